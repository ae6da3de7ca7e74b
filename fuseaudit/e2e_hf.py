"""``fuseaudit e2e --model hf-llama|hf-gpt2``: a Hugging Face transformers model with any kernels swapped in.

The own stack of ``fuseaudit e2e`` (:mod:`fuseaudit.model`) answers what
fusion buys in a decode step written for it; users serve models built by
``transformers``.  This module builds such a model from a config written
here (random weights, nothing downloaded: :data:`ARCHS`), replaces its norm,
activation / gated-MLP and attention modules by an implementation of the
catalog op with the canonical signature, and measures it as serving does,
beside HF's own modules (``eager``, the baseline).

Architectures (``--config default`` has real model sizes, ``tiny`` is for
CPU tests under Triton's interpreter; ``--layers`` scales either):

``hf-llama``  ``LlamaForCausalLM``, Llama-3.2-1B-like (hidden 2048, 16 layers, 32/8
              heads, intermediate 8192, vocab 128256, tied embeddings): ops
              ``rms_norm``, ``swiglu`` (``geglu`` for a GELU ``hidden_act``), ``attention``
``hf-gpt2``   ``GPT2LMHeadModel``, GPT-2-medium-like (hidden 1024, 24 layers, 16 heads,
              vocab 50257): ops ``layer_norm``, ``bias_gelu`` (tanh), ``attention``

Variants: ``eager`` (HF's modules, ``attn_implementation="sdpa"`` as HF
defaults to), ``fused`` (the reference kernels), ``compile``
(``builtin:compile``: ``torch.compile`` of each op's eager composition), and
``target`` (the ops given as ``--target OP=SPEC``, any target string
``fuseaudit audit`` takes; the model's other modules stay HF's).

How a module is swapped.  The module classes are looked up on the built
model at run time by their role (a ``*RMSNorm`` with ``weight`` and an eps,
``nn.LayerNorm``, a ``*MLP`` with ``gate_proj/up_proj/down_proj/act_fn`` or
``c_fc/c_proj/act``); each is replaced by a small module of ours that calls
the op's implementation (the MLP's matmuls stay HF's ``nn.Linear`` /
``Conv1D`` weights, multiplied by torch).  Attention is a function
registered with ``transformers.AttentionInterface`` (and the matching SDPA
mask function with ``AttentionMaskInterface``) under the name
``"fuseaudit"``, selected by ``model.set_attn_implementation``.  A model
whose norm or MLP modules are of a kind this module does not know, or whose
activation has no catalog op, is refused with the modules named (exit 2).
Every call into a swapped implementation is counted; the agreement check
runs one decode step and requires, per op, as many calls as modules were
replaced, and no fallback anywhere.

Attention and masks.  The catalog's ``attention(q, k, v, causal, scale)``
takes grouped-query ``k``/``v`` as they are (no repeat) and top-left causal
masking; it has no mask argument.  So the function takes what a mask says
without the mask: with no mask, a prefill (``Sq > 1``) is causal over the
first ``Sq`` keys (HF's SDPA path does the same for an empty static cache)
and a decode step (``Sq == 1``) sees every key.  A static cache (needed for
CUDA graphs) always hands over a mask and all ``max_cache_len`` keys; the
harness, which knows the position, tells the function how many keys are
valid (:meth:`SwapState.valid_keys`), the function slices them and, during
the agreement check, verifies on the device that the mask is exactly causal
over that prefix.  Anything else -- a mask with padding, a chunked prefill
(``1 < Sq < Sk`` with causal masking, which needs bottom-right alignment),
dropout, softcapping, a sliding window -- is handed to HF's SDPA function
and counted as a fallback, with the reason; the agreement check fails on any.
A mask taken for the causal prefix makes the call causal whatever
``is_causal`` says (some models pass ``is_causal=False`` whenever they pass
a mask).

Versions: the class, keyword and cache names are looked up at run time
(``cache`` or ``past_key_values``, ``logits_to_keep``, ``cache_position``
where the forward takes it, ``DynamicCache``/``StaticCache`` constructors of
either generation); run on the CPU with transformers 4.57, 5.17 and 5.24.

Measurements (GPU), per variant and batch (``--batches``, default 1,8,64):

* **TTFT** -- a prefill of ``--prompt-len`` tokens into a new ``DynamicCache``
  and the greedy first token (warm: compilation excluded);
* **TPOT** -- a greedy generate loop of ``--gen-tokens`` decode steps over that
  cache (argmax on the device, fed back; no host sync inside), per token;
  ``tokens_per_s = batch / TPOT``;
* **peak memory** -- ``torch.cuda.max_memory_allocated`` over a prefill and
  the generate loop, and what it adds to what was allocated before;
* with ``--cuda-graphs`` -- a ``StaticCache`` holding the prompt; one decode
  step (argmax included) at position P captured in a CUDA graph and replayed:
  the step rewinds the cache's length counters to P first, so every replay
  is the same step (the rewind's small fills are in every variant's graph);
* **profile** -- one decode step at ``--profile-batch`` (default: the smallest
  batch) under ``torch.profiler``: a Chrome trace beside the JSON, and a
  table of where the step's GPU and host time go: each catalog op (for HF's
  own modules the norm modules, the MLP minus its matmuls and the SDPA call,
  labelled only while profiling), ``matmul`` (GEMM kernels and aten matmul
  ops wherever they are) and ``other`` (embeddings, rotary, residual adds,
  KV-cache writes, masks, argmax).  GPU time is kernel time attributed
  through the launch that queued it; host time is the step's wall time on
  the launching thread.  ``gpu_busy_us`` against ``host_step_us`` says
  whether the step waits for the GPU or the host.

Timing: CUDA events, median of ``--repeats`` after ``--warmup`` calls.  On
the CPU nothing is timed (the interpreter would time Python): the command
runs the agreement check and the swap counts, counts one decode step's
launches (interpreter launches + aten ops) and still writes the profile.

Agreement, before any timing, at one batch (the smallest of ``--batches``
that is >= 8, else the largest): a prompt, then one decode step with a fixed
next token, through a ``DynamicCache`` and again through a ``StaticCache``;
outputs ``prefill_logits`` (B, V) at the last prompt position,
``decode_logits`` and ``decode_logits_static`` (B, V), each judged by
:func:`fuseaudit.tolerance.compare` with HF eager (same cache kind) as the
yardstick and, as the oracle, a copy of the model in float64 running HF's
own modules.  The oracle's cache is checked too (its decode step equals a
re-prefill of prompt + token).  Then each model generates ``--gen-tokens``
greedy tokens from the prompt: identical to eager's, or the first divergence
(step, row, both tokens, and the gap between them in the reference's logits:
random weights make near-ties, so a divergence within rounding is reported,
not failed).  Eager is compared with the oracle the same way.

Exit status: 0 every variant agrees and every swap held; 1 a variant
disagrees, fell back or failed to run; 2 bad options or a model that cannot
be swapped.

JSON (``--json``, default ``reports/e2e-<model>.json``; rewritten after
every measurement)::

    schema             "fuseaudit-e2e-hf/1"
    created            ISO time (UTC)
    env                {device, device_name, torch, triton, cuda, transformers}
    model              "hf-llama" | "hf-gpt2";  model_class: the transformers class
    config             {name, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab,
                        max_positions, params, hf: {the transformers config fields set here}}
    dtype, prompt_len, gen_tokens, batches, variants, cuda_graphs
    ops                {variant: {op: implementation}}  (eager: {}; fused: the reference's
                        "module:function"; compile: "builtin:compile"; target: the --target specs)
    timing             bool: false on the CPU;  timing_note: why not, where false
    weight_bytes       bytes of the model's parameters
    swap               {variant: {replaced: {op: modules}, calls_per_forward: {op: calls in one
                        decode step}, fallbacks: {op: n}, fallback_reasons: {op: first reason},
                        passed}}
    agreement          {verdict: "agree" | "disagree", batch, prompt_len, oracle_dtype,
                        kv_cache: {max_abs_diff, scale, passed},
                        checks: [{variant, output, passed, error?, comparison: Comparison.to_dict()}],
                        greedy: [{variant, reference ("eager" | "oracle"), steps, identical,
                                  first_divergence?: {step, row, reference_token, token, reference_gap}}]}
    results            [{variant, batch, ttft, ttft_ms, tpot, tpot_ms, tokens_per_s, tpot_graph,
                         tpot_graph_ms, tokens_per_s_graph, graph_max_abs_diff, peak_bytes,
                         transient_bytes, kv_cache_bytes_static, errors: {what: message}, skipped?}]
                       ttft / tpot / tpot_graph: fuseaudit.timing.Timing.to_dict() (microseconds;
                       tpot's samples are per token)
    gains              [{variant, batch, ttft_gain, tpot_gain, tpot_graph_gain}]  (eager / variant)
    profiles           [{variant, batch, trace: file name beside the JSON, host_step_us, gpu_span_us,
                         gpu_busy_us, kernels, rows: [{category, gpu_us, gpu_share, host_us, host_share,
                         kernels}], error?}]   categories: the model's ops, "matmul", "other";
                       gpu_* are null on the CPU
    launches_cpu       CPU only: {variant: {count, triton, by_kernel} or {error}}
    budget_s, elapsed_s, skipped, notes
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import inspect
import math
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .catalog import get_op
from .cli import usage_error
from .jsonio import write_json

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SCHEMA = "fuseaudit-e2e-hf/1"
MODELS = ("hf-llama", "hf-gpt2")
VARIANTS = ("eager", "fused", "compile", "target")
ATTN_NAME = "fuseaudit"
LABEL = "fuseaudit.op:"
STEP_LABEL = "fuseaudit.step"
SWAP_ATTR = "_fuseaudit_swap"
OUTPUTS = ("prefill_logits", "decode_logits", "decode_logits_static")
NOTES = [
    "eager = the transformers modules as built (attn_implementation 'sdpa'); the other variants replace the "
    "norm, MLP activation and attention modules only: embeddings, rotary, residual adds, matmuls and the KV "
    "cache are transformers' own in every variant",
    "compile = builtin:compile (torch.compile of each op's eager composition) swapped in per op, not a "
    "torch.compile of the whole model",
    "TPOT: a greedy loop over a DynamicCache; the CUDA-graph figure replays one step at a fixed position "
    "over a StaticCache (rewound inside the graph)",
    "random weights (HF's initialisation, 1-D parameters perturbed so norms and biases are not trivial): "
    "greedy tokens meet near-ties, so a divergence is reported with its logit gap, not failed",
]


# ---------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """A transformers model family: its classes and config fields, and the sizes written here."""

    name: str
    model_class: str
    config_class: str
    layers_field: str
    positions_field: str
    norm_op: str  # "rms_norm" or "layer_norm"
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)


ARCHS: dict[str, Arch] = {
    "hf-llama": Arch(
        "hf-llama", "LlamaForCausalLM", "LlamaConfig", "num_hidden_layers", "max_position_embeddings", "rms_norm",
        sizes={
            # Llama-3.2-1B's shapes (default rope: rotary is plain torch in every variant either way)
            "default": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192,
                            rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=True,
                            bos_token_id=128000, eos_token_id=128001),
            "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=1, initializer_range=0.125),
        }),
    "hf-gpt2": Arch(
        "hf-gpt2", "GPT2LMHeadModel", "GPT2Config", "n_layer", "n_positions", "layer_norm",
        sizes={
            # GPT-2 medium
            "default": dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257,
                            activation_function="gelu_new", layer_norm_epsilon=1e-5),
            "tiny": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256,
                         activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=1,
                         initializer_range=0.125),
        }),
}

# activation name in a transformers config -> (catalog op, its parameters)
GATED_ACTS = {"silu": ("swiglu", {}), "swish": ("swiglu", {}), "gelu": ("geglu", {"approximate": "none"}),
              "gelu_pytorch_tanh": ("geglu", {"approximate": "tanh"}), "gelu_new": ("geglu", {"approximate": "tanh"})}
BIAS_ACTS = {"gelu_new": ("bias_gelu", {"approximate": "tanh"}),
             "gelu_pytorch_tanh": ("bias_gelu", {"approximate": "tanh"}),
             "gelu": ("bias_gelu", {"approximate": "none"})}


class SwapError(Exception):
    """A model (or a transformers version) whose modules this module cannot swap: one clear line."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise SwapError("--model hf-* needs transformers: pip install 'fuseaudit[e2e]'") from None
    return transformers


def _hf_class(name: str) -> Any:
    tf = _transformers()
    cls = getattr(tf, name, None)
    if cls is None:
        raise SwapError(f"transformers {tf.__version__} has no {name}")
    return cls


def hf_config(arch: Arch, size: str, *, layers: int | None = None) -> Any:
    """The transformers config of ``arch`` at ``size`` (``default`` or ``tiny``), ``layers`` overriding."""
    try:
        kw = dict(arch.sizes[size])
    except KeyError:
        raise ValueError(f"unknown config {size!r}; known: {', '.join(arch.sizes)}") from None
    if layers is not None:
        kw[arch.layers_field] = layers
    return _hf_class(arch.config_class)(**kw)


def mlp_op(arch: Arch, config: Any) -> tuple[str, dict[str, Any]]:
    """The catalog op (and its parameters) that stands for the MLP's activation of this config."""
    if arch.name == "hf-llama":
        act = getattr(config, "hidden_act", None)
        table = GATED_ACTS
    else:
        act = getattr(config, "activation_function", None)
        table = BIAS_ACTS
    if act not in table:
        raise SwapError(f"{arch.name}: activation {act!r} has no catalog op (known: {', '.join(table)})")
    return table[act]


def model_ops(arch: Arch, config: Any) -> tuple[str, ...]:
    """The catalog ops swapped into this model: norm, MLP activation, attention."""
    return (arch.norm_op, mlp_op(arch, config)[0], "attention")


def describe_config(arch: Arch, size: str, config: Any, model: Any) -> dict[str, Any]:
    c = config
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    return {
        "name": size, "layers": getattr(c, arch.layers_field), "hidden": hidden, "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or hidden // heads, "intermediate": inter, "vocab": c.vocab_size,
        "max_positions": getattr(c, arch.positions_field), "params": model.num_parameters(),
        "hf": {**arch.sizes[size], arch.layers_field: getattr(c, arch.layers_field)},
    }


def build_model(arch: Arch, config: Any, *, dtype: Any, device: str, seed: int) -> Any:
    """The model with random weights, in eval mode: HF's initialisation, 1-D parameters perturbed.

    Norm weights start at one and biases at zero in HF's initialisation; a
    kernel that ignored them would pass.  So every 1-D parameter gets
    ``0.1 * N(0, 1)`` added (from the same seed).
    """
    cls = _hf_class(arch.model_class)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    model = model.to(dtype).eval()
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(device=p.device, dtype=p.dtype))
    return model


# ---------------------------------------------------------------------------
# Swapping modules
# ---------------------------------------------------------------------------

@dataclass
class SwapState:
    """What one swapped model counts, and the hints the harness gives its attention."""

    impls: dict[str, Callable[..., Any]]
    replaced: collections.Counter = field(default_factory=collections.Counter)
    calls: collections.Counter = field(default_factory=collections.Counter)
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    kv_len: int | None = None  # keys of a static cache that hold data (set by the harness)
    verify_masks: bool = False  # check each mask against the causal prefix it is taken for (syncs)
    labels: bool = False  # record_function ranges around each op (while profiling only)

    def fallback(self, op: str, reason: str) -> None:
        self.fallbacks[op] += 1
        self.fallback_reasons.setdefault(op, reason)

    @contextlib.contextmanager
    def valid_keys(self, n: int | None) -> Iterator[None]:
        """Within the block, a static cache's first ``n`` keys are the valid ones."""
        old, self.kv_len = self.kv_len, n
        try:
            yield
        finally:
            self.kv_len = old

    def summary(self) -> dict[str, Any]:
        return {"replaced": dict(self.replaced), "fallbacks": dict(self.fallbacks),
                "fallback_reasons": dict(self.fallback_reasons)}


def _op_call(state: SwapState, op: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    state.calls[op] += 1
    if state.labels:
        with torch.profiler.record_function(LABEL + op):
            return fn(*args, **kw)
    return fn(*args, **kw)


class CatalogRMSNorm(nn.Module):
    """``rms_norm(x, weight, eps)`` in place of a transformers ``*RMSNorm``."""

    def __init__(self, weight: Any, eps: float, state: SwapState):
        super().__init__()
        self.weight, self.eps, self.state = weight, float(eps), state

    def forward(self, x: Any) -> Any:
        return _op_call(self.state, "rms_norm", self.state.impls["rms_norm"], x, self.weight, eps=self.eps)


class CatalogLayerNorm(nn.Module):
    """``layer_norm(x, weight, bias, eps)`` in place of an ``nn.LayerNorm``."""

    def __init__(self, weight: Any, bias: Any, eps: float, state: SwapState):
        super().__init__()
        self.weight, self.bias, self.eps, self.state = weight, bias, float(eps), state

    def forward(self, x: Any) -> Any:
        return _op_call(self.state, "layer_norm", self.state.impls["layer_norm"], x, self.weight, self.bias,
                        eps=self.eps)


class CatalogGatedMLP(nn.Module):
    """``down(op(gate(x), up(x)))`` with the gated op (``swiglu``/``geglu``) in place of ``act(gate) * up``."""

    def __init__(self, mlp: Any, op: str, params: dict[str, Any], state: SwapState):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.op, self.params, self.state = op, params, state

    def forward(self, x: Any) -> Any:
        h = _op_call(self.state, self.op, self.state.impls[self.op], self.gate_proj(x), self.up_proj(x),
                     **self.params)
        return self.down_proj(h)


class CatalogBiasActMLP(nn.Module):
    """GPT-2's MLP: ``c_proj(op(x @ W_fc, b_fc))`` with the bias-activation op in place of ``act(addmm)``."""

    def __init__(self, mlp: Any, op: str, params: dict[str, Any], state: SwapState):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = mlp.c_fc, mlp.c_proj, mlp.dropout
        self.op, self.params, self.state = op, params, state

    def forward(self, x: Any) -> Any:
        h = torch.mm(x.reshape(-1, x.shape[-1]), self.c_fc.weight).view(*x.shape[:-1], -1)
        h = _op_call(self.state, self.op, self.state.impls[self.op], h, self.c_fc.bias, **self.params)
        return self.dropout(self.c_proj(h))


def _rms_eps(m: Any) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _role(m: Any) -> str | None:
    """What kind of swappable module ``m`` is ("norm", "mlp", "attention"), by its class and attributes."""
    name = type(m).__name__
    if isinstance(m, (CatalogRMSNorm, CatalogLayerNorm, CatalogGatedMLP, CatalogBiasActMLP)):
        return None
    if isinstance(m, nn.LayerNorm) or name.endswith(("RMSNorm", "LayerNorm")):
        return "norm"
    if name.endswith("MLP"):
        return "mlp"
    if name.endswith("Attention") and hasattr(m, "config"):
        return "attention"
    return None


def _swap_module(arch: Arch, config: Any, m: Any, role: str, state: SwapState) -> Any:
    """Our module for ``m``; :class:`SwapError` where ``m`` is not of a shape we know."""
    what = f"{type(m).__module__}.{type(m).__name__}"
    if role == "norm":
        if arch.norm_op == "rms_norm":
            eps = _rms_eps(m)
            w = getattr(m, "weight", None)
            if eps is None or not isinstance(w, nn.Parameter) or w.dim() != 1 or getattr(m, "bias", None) is not None:
                raise SwapError(f"{what}: not an RMSNorm with a 1-D weight and an eps")
            if type(m).__name__.startswith("Gemma"):  # (1 + weight) scaling
                raise SwapError(f"{what}: scales by 1 + weight, which rms_norm does not")
            return CatalogRMSNorm(w, eps, state)
        if not isinstance(m, nn.LayerNorm) or m.weight is None or m.bias is None or len(m.normalized_shape) != 1:
            raise SwapError(f"{what}: not an nn.LayerNorm over the last dim with weight and bias")
        return CatalogLayerNorm(m.weight, m.bias, m.eps, state)
    op, params = mlp_op(arch, config)
    if op in ("swiglu", "geglu"):
        if not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise SwapError(f"{what}: not a gated MLP with gate_proj/up_proj/down_proj/act_fn")
        return CatalogGatedMLP(m, op, params, state)
    if not all(hasattr(m, a) for a in ("c_fc", "c_proj", "act", "dropout")) or m.c_fc.bias is None:
        raise SwapError(f"{what}: not a GPT-2 MLP with c_fc/c_proj/act")
    if type(m.c_fc).__name__ != "Conv1D":
        raise SwapError(f"{what}: c_fc is {type(m.c_fc).__name__}, expected transformers' Conv1D")
    return CatalogBiasActMLP(m, op, params, state)


def swappable_modules(model: Any) -> list[tuple[str, Any, str]]:
    """``(qualified name, module, role)`` of every module this module would swap."""
    out = []
    for name, m in model.named_modules():
        role = _role(m)
        if role is not None:
            out.append((name, m, role))
    return out


def _set_child(model: Any, qualname: str, new: Any) -> Any:
    parent_name, _, child = qualname.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def _register_attention() -> None:
    """Register :func:`catalog_attention` (and SDPA's mask function) under ``"fuseaudit"``."""
    tf = _transformers()
    iface = getattr(tf, "AttentionInterface", None)
    if iface is None:
        raise SwapError(f"transformers {tf.__version__} has no AttentionInterface: attention cannot be swapped")
    iface.register(ATTN_NAME, catalog_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return  # transformers before the mask interface builds masks by its own rules
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _set_attn(model: Any, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise SwapError(f"could not set attn_implementation {name!r} (got {model.config._attn_implementation!r})")


@contextlib.contextmanager
def swapped(model: Any, arch: Arch, impls: dict[str, Callable[..., Any]]) -> Iterator[SwapState]:
    """The model with the ops in ``impls`` swapped in (the others stay HF's), restored on exit.

    Raises :class:`SwapError` (before changing anything) where a module of a
    role to be swapped is of a kind this module does not know.
    """
    state = SwapState(impls=dict(impls))
    config = model.config
    norm_op, act_op, _ = model_ops(arch, config)
    wanted = {"norm": norm_op in impls, "mlp": act_op in impls, "attention": "attention" in impls}
    plan, problems = [], []
    for name, m, role in swappable_modules(model):
        if not wanted[role]:
            continue
        if role == "attention":
            plan.append((name, m, role, None))
            continue
        try:
            plan.append((name, m, role, _swap_module(arch, config, m, role, state)))
        except SwapError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise SwapError(f"{arch.name}: modules that cannot be swapped: {'; '.join(problems)}")
    for role, want in wanted.items():
        if want and not any(p[2] == role for p in plan):
            raise SwapError(f"{arch.name}: found no {role} module to swap in {type(model).__name__}")
    old_attn = config._attn_implementation
    undo: list[tuple[str, Any]] = []
    try:
        if wanted["attention"]:
            _register_attention()
            _set_attn(model, ATTN_NAME)
        for name, m, role, new in plan:
            if role == "attention":
                setattr(m, SWAP_ATTR, state)
                state.replaced["attention"] += 1
            else:
                undo.append((name, _set_child(model, name, new)))
                state.replaced[norm_op if role == "norm" else act_op] += 1
        yield state
    finally:
        for name, old in reversed(undo):
            _set_child(model, name, old)
        for _, m, role, _ in plan:
            if role == "attention" and hasattr(m, SWAP_ATTR):
                delattr(m, SWAP_ATTR)
        if config._attn_implementation != old_attn:
            _set_attn(model, old_attn)


def _visible(mask: Any) -> Any:
    return mask if mask.dtype == torch.bool else mask == 0


def _mask_is_causal_prefix(mask: Any, sq: int, kv_len: int) -> bool:
    """``mask`` (B|1, H|1, Sq, Sk) shows query i the keys ``0 .. kv_len - sq + i`` and nothing else."""
    sk = mask.shape[-1]
    q = torch.arange(sq, device=mask.device)[:, None] + (kv_len - sq)
    k = torch.arange(sk, device=mask.device)[None, :]
    want = k <= q
    return bool((_visible(mask) == want).all())


def _hf_sdpa() -> Callable[..., Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def catalog_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature over the catalog's ``attention(q, k, v, causal, scale)``.

    See the module docstring for what is expressed and what falls back (to
    HF's SDPA function, counted).  Returns ``(B, Sq, H, D)`` and no weights.
    """
    state: SwapState | None = getattr(module, SWAP_ATTR, None)
    if state is None:
        raise RuntimeError(f"attn_implementation {ATTN_NAME!r} on a module fuseaudit did not swap "
                           f"({type(module).__name__})")
    sq, sk = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    reason = None
    if dropout:
        reason = "attention dropout (training)"
    elif any(kwargs.get(k) is not None for k in ("softcap", "sliding_window", "position_bias", "s_aux")):
        reason = "softcap / sliding window / position bias / sinks: not in the catalog's attention"
    elif kwargs.get("output_attentions"):
        reason = "output_attentions needs the attention weights"
    valid = sk
    if reason is None:
        if state.kv_len is not None:
            valid = state.kv_len
            if valid > sk or valid < sq:
                reason = f"{valid} valid keys hinted, {sk} given for {sq} queries"
            elif attention_mask is not None:
                if state.verify_masks and not _mask_is_causal_prefix(attention_mask, sq, valid):
                    reason = f"the mask is not causal over the first {valid} keys (padding?)"
                causal = True  # what the mask says (some models pass is_causal=False whenever there is a mask)
        elif attention_mask is not None:
            reason = "a mask (padding, or a static cache without a hint of its valid keys)"
        elif causal and sq > 1:
            valid = sq  # an empty cache's prefill, as HF's SDPA path takes it
    if reason is None and causal and 1 < sq != valid:
        reason = f"chunked prefill ({sq} queries over {valid} keys) needs bottom-right causal masking"
    if reason is not None:
        state.fallback("attention", reason)
        return _hf_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                          is_causal=is_causal, **kwargs)
    if valid < sk:
        key, value = key[:, :, :valid], value[:, :, :valid]
    out = _op_call(state, "attention", state.impls["attention"], query, key, value,
                   causal=causal and sq > 1, scale=scaling)
    return out.transpose(1, 2), None


# ---------------------------------------------------------------------------
# Running the model
# ---------------------------------------------------------------------------

class Runner:
    """Calls a transformers causal LM the same way across versions (cache keyword, logits kept)."""

    def __init__(self, model: Any):
        self.model = model
        params = inspect.signature(type(model).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.takes_cache_position = "cache_position" in params

    def forward(self, ids: Any, cache: Any, *, start: int | None = None, position_ids: Any = None,
                cache_position: Any = None) -> Any:
        """Logits (B, V) of the last position of ``ids`` (B, S), the cache advanced.

        ``start`` (a static cache's host-known position) adds explicit
        positions; ``position_ids`` / ``cache_position`` are static buffers for a
        captured step.
        """
        kw: dict[str, Any] = {self.cache_kw: cache, "use_cache": True}
        if self.keep_kw:
            kw[self.keep_kw] = 1
        if start is not None and position_ids is None:
            pos = torch.arange(start, start + ids.shape[1], device=ids.device)
            position_ids = pos[None].expand(ids.shape[0], -1)
            cache_position = pos
        if position_ids is not None:
            kw["position_ids"] = position_ids
        if cache_position is not None and self.takes_cache_position:
            kw["cache_position"] = cache_position
        out = self.model(input_ids=ids, **kw)
        return out.logits[:, -1]

    def dynamic_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    def static_cache(self, batch: int, max_len: int) -> Any:
        from transformers import StaticCache

        try:
            return StaticCache(config=self.model.config, max_cache_len=max_len)
        except TypeError:
            p = next(self.model.parameters())
            return StaticCache(config=self.model.config, max_batch_size=batch, max_cache_len=max_len,
                               device=p.device, dtype=p.dtype)

    def rewind(self, cache: Any, pos: int) -> None:
        """Set a static cache's length counters to ``pos`` (on the device: capturable)."""
        done = 0
        for layer in getattr(cache, "layers", ()) or ():
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(pos)
                done += 1
        if not done and not self.takes_cache_position:
            raise SwapError(f"cannot rewind {type(cache).__name__} of this transformers version "
                            "(no per-layer cumulative_length, no cache_position argument)")


def _hint(state: SwapState | None, n: int | None) -> Any:
    return state.valid_keys(n) if state is not None else contextlib.nullcontext()


def greedy(runner: Runner, prompt: Any, steps: int) -> tuple[Any, list[Any]]:
    """``steps`` greedy tokens (B, steps) after ``prompt`` over a DynamicCache, and each step's logits."""
    cache = runner.dynamic_cache()
    logits = runner.forward(prompt, cache)
    toks, seen = [], []
    for i in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        toks.append(tok)
        seen.append(logits)
        if i + 1 < steps:
            logits = runner.forward(tok, cache)
    return torch.cat(toks, dim=1), seen


def run_outputs(runner: Runner, tokens: Any, state: SwapState | None, *, spare: int = 3) -> dict[str, Any]:
    """The three checked outputs for prompt ``tokens[:, :-1]`` and next token ``tokens[:, -1:]``.

    The static cache has ``spare`` positions more than the step needs, as a
    generate loop's has: its mask and the keys sliced for it are then not trivial.
    """
    b, n = tokens.shape
    p = n - 1
    prompt, nxt = tokens[:, :p], tokens[:, p:]
    cache = runner.dynamic_cache()
    out = {"prefill_logits": runner.forward(prompt, cache).clone()}
    before = collections.Counter(state.calls) if state is not None else None
    out["decode_logits"] = runner.forward(nxt, cache).clone()
    if state is not None:
        out["_calls_per_forward"] = dict(collections.Counter(state.calls) - before)
    static = runner.static_cache(b, n + spare)
    with _hint(state, p):
        runner.forward(prompt, static, start=0)
    with _hint(state, n):
        out["decode_logits_static"] = runner.forward(nxt, static, start=p).clone()
    return out


def _first_divergence(ref: Any, got: Any, ref_logits: list[Any]) -> dict[str, Any] | None:
    diff = (ref != got).any(dim=0).nonzero()
    if diff.numel() == 0:
        return None
    step = int(diff[0])
    row = int((ref[:, step] != got[:, step]).nonzero()[0])
    rt, gt = int(ref[row, step]), int(got[row, step])
    lg = ref_logits[step][row].float()
    return {"step": step, "row": row, "reference_token": rt, "token": gt, "reference_gap": float(lg[rt] - lg[gt])}


def kv_cache_bound(config: Any, seq: int, scale: float, dtype: Any) -> float:
    """How far a decode step through the oracle's cache may be from a re-prefill: rounding alone.

    The two orders of summation differ; each layer's longest sum (the hidden
    size, the MLP width or the keys) bounds its relative rounding by ``length x
    eps``, and the layers add.  A cache that loses or misplaces a key is off
    at the model's own scale, many orders of magnitude above this.
    """
    dims = [getattr(config, k, 0) or 0 for k in ("hidden_size", "n_embd", "intermediate_size", "n_inner")]
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 1)
    longest = max([seq, *dims])
    return float(torch.finfo(dtype).eps * layers * longest * max(scale, 1.0))


def _oracle_norms(oracle: Any, arch: Arch) -> Any:
    """The oracle's RMSNorms as the float64 formula: HF's own computes in float32 whatever the model's dtype."""
    if arch.norm_op != "rms_norm":
        return contextlib.nullcontext()  # nn.LayerNorm computes in its input's dtype
    maths = get_op("rms_norm").oracle_fn
    return swapped(oracle, arch, {"rms_norm": lambda x, weight, eps=1e-6: maths(x, weight, eps)})


def check_agreement(model: Any, arch: Arch, variants: dict[str, dict[str, Callable[..., Any]]], *, batch: int,
                    prompt_len: int, gen_tokens: int, seed: int, oracle_dtype: Any = None) -> dict[str, Any]:
    """Every variant against HF eager and a float64 oracle (see the module docstring); also the swap counts.

    ``variants`` maps a variant name to its ``{op: implementation}`` (``{}`` for eager).
    Returns ``{"agreement": ..., "swap": ...}``.
    """
    from .e2e import MODEL_FALLBACK_ULPS
    from .tolerance import compare

    oracle_dtype = oracle_dtype or torch.float64
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    tokens = torch.randint(0, model.config.vocab_size, (batch, prompt_len + 1), generator=gen).to(device)
    prompt = tokens[:, :prompt_len]
    runner = Runner(model)
    with torch.no_grad():
        oracle = copy.deepcopy(model).to(oracle_dtype)
        orunner = Runner(oracle)
        with _oracle_norms(oracle, arch):
            want = run_outputs(orunner, tokens, None)
            full = orunner.forward(tokens, orunner.dynamic_cache())
            diff = float((want["decode_logits"] - full).abs().max())
            scale = float(full.abs().max())
            bound = kv_cache_bound(model.config, tokens.shape[1], scale, oracle_dtype)
            kv = {"max_abs_diff": diff, "scale": scale, "bound": bound, "passed": bool(diff <= bound)}
            oracle_tokens, oracle_logits = greedy(orunner, prompt, gen_tokens)
        del oracle, orunner, full

        outs: dict[str, dict[str, Any]] = {}
        toks: dict[str, tuple[Any, list[Any]]] = {}
        errors: dict[str, str] = {}
        swap: dict[str, dict[str, Any]] = {}
        for v, impls in variants.items():
            try:
                ctx = swapped(model, arch, impls) if impls else contextlib.nullcontext()
                with ctx as state:
                    if state is not None:
                        state.verify_masks = True
                    outs[v] = run_outputs(runner, tokens, state)
                    toks[v] = greedy(runner, prompt, gen_tokens)
                    if state is not None:
                        calls = outs[v].pop("_calls_per_forward")
                        s = state.summary()
                        s["calls_per_forward"] = calls
                        s["passed"] = not state.fallbacks and all(
                            calls.get(op, 0) == n for op, n in state.replaced.items())
                        swap[v] = s
            except SwapError:
                raise
            except Exception as exc:  # a variant that cannot run fails the check, with the reason
                errors[v] = f"{type(exc).__name__}: {exc}"

    dtype = next(model.parameters()).dtype
    checks = []
    for v in variants:
        for name in OUTPUTS:
            entry: dict[str, Any] = {"variant": v, "output": name}
            if v in errors or "eager" in errors:
                entry.update(passed=False, error=errors.get(v) or f"eager failed: {errors['eager']}")
            else:
                got, ref = outs[v][name], want["decode_logits" if name == "decode_logits_static" else name]
                if got.shape != ref.shape or got.dtype != dtype:
                    entry.update(passed=False, error=f"shape/dtype {tuple(got.shape)} {got.dtype}, expected "
                                                     f"{tuple(ref.shape)} {dtype}")
                else:
                    cmp = compare(name, got, outs["eager"][name], ref, dtype=dtype, fallback_ulps=MODEL_FALLBACK_ULPS)
                    entry.update(passed=cmp.passed, comparison=cmp.to_dict())
            checks.append(entry)
    greedy_rows = []
    for v in variants:
        if v not in toks:
            continue
        if v == "eager":
            ref_name, (ref_t, ref_l) = "oracle", (oracle_tokens, oracle_logits)
        elif "eager" in toks:
            ref_name, (ref_t, ref_l) = "eager", toks["eager"]
        else:
            continue
        div = _first_divergence(ref_t, toks[v][0], ref_l)
        row: dict[str, Any] = {"variant": v, "reference": ref_name, "steps": gen_tokens, "identical": div is None}
        if div:
            row["first_divergence"] = div
        greedy_rows.append(row)
    passed = all(c["passed"] for c in checks) and kv["passed"] and all(s["passed"] for s in swap.values())
    return {
        "agreement": {"verdict": "agree" if passed else "disagree", "batch": batch, "prompt_len": prompt_len,
                      "oracle_dtype": str(oracle_dtype).replace("torch.", ""), "kv_cache": kv, "checks": checks,
                      "greedy": greedy_rows},
        "swap": swap,
    }


# ---------------------------------------------------------------------------
# Profile of one decode step
# ---------------------------------------------------------------------------

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                        "aten::_scaled_mm", "aten::addmv", "aten::mv"})
_GEMM_WORDS = ("gemm", "cutlass", "nvjet", "cublas", "xmma")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_breakdown(trace: dict[str, Any], *, ops: Sequence[str]) -> dict[str, Any]:
    """Where one profiled step's GPU and host time go, from a Chrome trace (``torch.profiler``'s export).

    The step is the ``fuseaudit.step`` range; host intervals are those of its
    thread.  A kernel belongs to the launch (``cuda_runtime``/``cuda_driver``
    event of the same ``correlation``) that queued it inside the step, and to
    the category of the ranges around that launch: ``matmul`` for an aten
    matmul op or a GEMM kernel name, else the innermost ``fuseaudit.op:OP``
    label, else ``other``.  Host time: matmul ops' wall time, each label's
    wall time outside matmul ops, the rest of the step as ``other``.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == STEP_LABEL and e.get("cat") in ("user_annotation", "cpu_op")]
    if not steps:
        raise ValueError(f"no {STEP_LABEL} range in the trace")
    step = steps[0]
    t0, t1 = float(step["ts"]), float(step["ts"]) + float(step.get("dur", 0))
    tid, pid = step.get("tid"), step.get("pid")
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e.get("tid") == tid
            and e.get("pid") == pid and t0 <= float(e["ts"]) <= t1 and e is not step]
    cats = [*ops, "matmul", "other"]
    spans = {e_id: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e_id, e in enumerate(host)}

    def label_of(e: dict[str, Any]) -> str | None:
        name = str(e.get("name", ""))
        if name in MATMUL_OPS:
            return "matmul"
        if name.startswith(LABEL) and name[len(LABEL):] in ops:
            return name[len(LABEL):]
        return None

    labelled = [(spans[i], label_of(e)) for i, e in enumerate(host) if label_of(e)]
    mm = [s for s, c in labelled if c == "matmul"]
    host_us = {c: 0.0 for c in cats}
    host_us["matmul"] = _union(mm)
    for c in ops:
        own = [s for s, lab in labelled if lab == c]
        if own:
            host_us[c] = _union(own + mm) - host_us["matmul"]
    host_us["other"] = max(0.0, (t1 - t0) - sum(host_us[c] for c in cats if c != "other"))

    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= float(e["ts"]) <= t1:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    gpu_us = {c: 0.0 for c in cats}
    kernels = {c: 0 for c in cats}
    ivals = []
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launch = launches.get((k.get("args") or {}).get("correlation"))
        if launch is None:
            continue
        ts = float(launch["ts"])
        around = [(spans[i], label_of(e)) for i, e in enumerate(host)
                  if e.get("tid") == launch.get("tid") and spans[i][0] <= ts <= spans[i][1] and label_of(e)]
        name = str(k.get("name", "")).lower()
        if any(c == "matmul" for _, c in around) or (k.get("cat") == "kernel" and any(w in name for w in _GEMM_WORDS)):
            c = "matmul"
        elif around:
            c = min(around, key=lambda sc: sc[0][1] - sc[0][0])[1]  # the innermost label
        else:
            c = "other"
        d = float(k.get("dur", 0))
        gpu_us[c] += d
        kernels[c] += 1
        ivals.append((float(k["ts"]), float(k["ts"]) + d))
    have_gpu = bool(ivals)
    host_total = t1 - t0
    gpu_total = sum(gpu_us.values())
    rows = [{"category": c,
             "gpu_us": gpu_us[c] if have_gpu else None,
             "gpu_share": (gpu_us[c] / gpu_total if gpu_total else 0.0) if have_gpu else None,
             "host_us": host_us[c], "host_share": host_us[c] / host_total if host_total else 0.0,
             "kernels": kernels[c] if have_gpu else None} for c in cats]
    return {"host_step_us": host_total,
            "gpu_span_us": (max(b for _, b in ivals) - min(a for a, _ in ivals)) if have_gpu else None,
            "gpu_busy_us": _union(ivals) if have_gpu else None,
            "kernels": len(ivals) if have_gpu else None, "rows": rows}


@contextlib.contextmanager
def labelled(model: Any, arch: Arch, state: SwapState | None) -> Iterator[None]:
    """Profiler ranges around each op of the model: ours through ``state.labels``, HF's through hooks."""
    norm_op, act_op, _ = model_ops(arch, model.config)
    handles, stack = [], []

    def pre(label: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(*_: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for _, m, role in swappable_modules(model):
        if role in ("norm", "mlp"):
            label = LABEL + (norm_op if role == "norm" else act_op)
            handles += [m.register_forward_pre_hook(pre(label)), m.register_forward_hook(post)]
    restore = None
    impl = model.config._attn_implementation
    if impl != ATTN_NAME:
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as funcs
        except ImportError:
            funcs = None
        if funcs is not None and impl in funcs:
            orig, had_local = funcs[impl], impl in getattr(funcs, "_local_mapping", {})

            def attention(*args: Any, **kw: Any) -> Any:
                with torch.profiler.record_function(LABEL + "attention"):
                    return orig(*args, **kw)

            funcs[impl] = attention
            restore = (funcs, impl, orig, had_local)
    if state is not None:
        state.labels = True
    try:
        yield
    finally:
        if state is not None:
            state.labels = False
        for h in handles:
            h.remove()
        if restore is not None:
            funcs, impl, orig, had_local = restore
            if had_local:
                funcs[impl] = orig
            else:
                del funcs[impl]


def profile_step(model: Any, arch: Arch, state: SwapState | None, *, batch: int, prompt_len: int, seed: int,
                 path: pathlib.Path, gpu: bool) -> dict[str, Any]:
    """Profile one decode step after a prefill and two warm-up steps; the trace is written to ``path``."""
    import json

    from torch.profiler import ProfilerActivity, profile, record_function

    runner = Runner(model)
    prompt = _tokens(model, batch, prompt_len, seed=seed + 4)
    cache = runner.dynamic_cache()
    with torch.no_grad():
        tok = runner.forward(prompt, cache).argmax(-1, keepdim=True)
        for _ in range(2):
            tok = runner.forward(tok, cache).argmax(-1, keepdim=True)
        if gpu:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with labelled(model, arch, state), profile(activities=acts) as prof:
            with record_function(STEP_LABEL):
                tok = runner.forward(tok, cache).argmax(-1, keepdim=True)
            if gpu:
                torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    return step_breakdown(trace, ops=model_ops(arch, model.config))


# ---------------------------------------------------------------------------
# Timing (GPU)
# ---------------------------------------------------------------------------

def _tokens(model: Any, batch: int, n: int, *, seed: int) -> Any:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = next(model.parameters()).device
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=gen).to(device)


def measure_cell(model: Any, state: SwapState | None, variant: str, *, batch: int, prompt_len: int,
                 gen_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT, generate-loop TPOT, peak memory and (``--cuda-graphs``) graphed TPOT of one variant at one batch."""
    from .e2e import capture_step, time_step
    from .timing import summarize

    runner = Runner(model)
    g = gen_tokens
    cell: dict[str, Any] = {"variant": variant, "batch": batch, "errors": {}}
    tokens = _tokens(model, batch, prompt_len + 1, seed=args.seed + 3)
    prompt, nxt = tokens[:, :prompt_len].contiguous(), tokens[:, prompt_len:].contiguous()

    def first() -> tuple[Any, Any]:
        cache = runner.dynamic_cache()
        return cache, runner.forward(prompt, cache).argmax(-1, keepdim=True)

    def loop(cache: Any, tok: Any) -> Any:
        for _ in range(g):
            tok = runner.forward(tok, cache).argmax(-1, keepdim=True)
        return tok

    def attempt(what: str, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as exc:  # one figure failing must not lose the others
            cell["errors"][what] = f"{type(exc).__name__}: {exc}"
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:
                raise RuntimeError(f"{variant} at batch {batch}: {what} failed and left CUDA unusable: "
                                   f"{cell['errors'][what]}") from sync_exc

    def ttft() -> None:
        t = time_step(first, warmup=args.warmup, repeats=args.repeats)
        cell["ttft"], cell["ttft_ms"] = t.to_dict(), t.median_us / 1e3

    def tpot() -> None:
        samples = []
        for i in range(args.warmup + args.repeats):
            cache, tok = first()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            loop(cache, tok)
            end.record()
            end.synchronize()
            if i >= args.warmup:
                samples.append(1e3 * start.elapsed_time(end) / g)
            del cache
        t = summarize(samples, mode="events")
        cell["tpot"], cell["tpot_ms"] = t.to_dict(), t.median_us / 1e3
        cell["tokens_per_s"] = batch * 1e3 / cell["tpot_ms"]

    def memory() -> None:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        cache, tok = first()
        loop(cache, tok)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        cell["peak_bytes"], cell["transient_bytes"] = int(peak), int(peak - base)

    def graphed() -> None:
        n = prompt_len + 1
        static = runner.static_cache(batch, n + g)  # room for a generate loop, as serving allocates it
        with _hint(state, prompt_len):
            runner.forward(prompt, static, start=0)
        pos = torch.arange(prompt_len, n, device=tokens.device)
        pos_ids = pos[None].expand(batch, -1).contiguous()

        def step() -> tuple[Any, Any]:
            runner.rewind(static, prompt_len)
            with _hint(state, n):
                logits = runner.forward(nxt, static, position_ids=pos_ids, cache_position=pos)
            return logits, logits.argmax(-1)

        direct = step()[0].clone()
        graph, out = capture_step(step, warmup=args.warmup)
        cell["graph_max_abs_diff"] = float((out[0].float() - direct.float()).abs().max())
        cell["kv_cache_bytes_static"] = sum(t.numel() * t.element_size() for layer in getattr(static, "layers", [])
                                            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                                            if isinstance(t, torch.Tensor))
        t = time_step(graph.replay, warmup=args.warmup, repeats=max(args.repeats, 20))
        cell["tpot_graph"], cell["tpot_graph_ms"] = t.to_dict(), t.median_us / 1e3
        cell["tokens_per_s_graph"] = batch * 1e3 / cell["tpot_graph_ms"]
        del graph, out

    with torch.no_grad():
        attempt("ttft", ttft)
        attempt("tpot", tpot)
        attempt("memory", memory)
        if args.cuda_graphs:
            attempt("cuda_graph", graphed)
    return cell


def join_gains(report: dict[str, Any]) -> None:
    from .e2e import step_gains

    report["gains"] = step_gains(report["results"])


# ---------------------------------------------------------------------------
# Options and main
# ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only ``--model hf-*`` takes (the rest are ``fuseaudit e2e``'s own)."""
    parser.add_argument("--target", action="append", default=[], metavar="OP=SPEC",
                        help="hf models: the 'target' variant swaps OP for SPEC (any target 'fuseaudit audit' "
                             "takes); repeatable")
    parser.add_argument("--gen-tokens", type=int, default=None,
                        help="hf models: greedy tokens per generate loop (GPU default 32, CPU 4)")
    parser.add_argument("--profile-batch", type=int, default=None,
                        help="hf models: batch of the profiled decode step (default: the smallest of --batches)")
    parser.add_argument("--no-profile", action="store_true", help="hf models: no profiled step, no trace")


def parse_targets(items: Sequence[str], ops: Sequence[str]) -> dict[str, str]:
    targets: dict[str, str] = {}
    for item in items:
        op, sep, spec = item.partition("=")
        op, spec = op.strip(), spec.strip()
        if not sep or not op or not spec:
            raise ValueError(f"--target takes OP=SPEC, got {item!r}")
        if op not in ops:
            raise ValueError(f"--target {item}: this model's swappable ops are {', '.join(ops)}")
        if op in targets:
            raise ValueError(f"--target {op} given twice")
        targets[op] = spec
    return targets


def load_impls(variant: str, ops: Sequence[str], targets: dict[str, str], device: str
               ) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """``({op: implementation}, {op: its spec})`` of one variant; ValueError for a target that cannot load."""
    from .catalog import OPS
    from .targets import TargetError, is_builtin, load_target

    if variant == "eager":
        return {}, {}
    if variant == "fused":
        specs = {op: OPS[op].reference for op in ops}
    elif variant == "compile":
        specs = {op: "builtin:compile" for op in ops}
    else:
        specs = dict(targets)
    impls = {}
    for op, spec in specs.items():
        if spec is None:
            raise ValueError(f"op {op} has no reference kernel")
        if is_builtin(spec):
            from .builtin_targets import builtin_target

            try:
                why = builtin_target(spec).unavailable(op, device)
            except TargetError as exc:
                raise ValueError(str(exc)) from None
            if why:
                raise ValueError(why)
        try:
            impls[op] = load_target(spec, op=op)
        except TargetError as exc:
            raise ValueError(f"{op}={spec}: {exc}") from None
    return impls, specs


def print_report(report: dict[str, Any], out: Any = None) -> None:
    from .e2e import _fmt, print_checks

    out = out or sys.stdout
    cfg = report["config"]
    print(f"model: {report['model']} ({report['model_class']}), {cfg['layers']} layers, hidden {cfg['hidden']}, "
          f"{cfg['heads']}/{cfg['kv_heads']} heads, vocab {cfg['vocab']} ({cfg['params'] / 1e6:.1f}M params), "
          f"{report['dtype']}, prompt {report['prompt_len']}, {report['gen_tokens']} generated, "
          f"device {report['env']['device_name']}, transformers {report['env']['transformers']}", file=out)
    for v, s in report.get("swap", {}).items():
        print(f"  swap {v:<8} replaced {s['replaced']}, calls in one decode step {s['calls_per_forward']}, "
              f"fallbacks {s['fallbacks'] or 0}{'' if s['passed'] else '  <- INCOMPLETE'}"
              + (f" ({s['fallback_reasons']})" if s["fallback_reasons"] else ""), file=out)
    agr = report.get("agreement")
    if agr:
        print(f"\nagreement at batch {agr['batch']} (oracle: same weights, HF modules, {agr['oracle_dtype']}; "
              f"yardstick: HF eager): {agr['verdict'].upper()}", file=out)
        kv = agr["kv_cache"]
        print(f"  kv cache (oracle): decode vs re-prefill, max |diff| {kv['max_abs_diff']:.3g} "
              f"(rounding bound {kv.get('bound', float('nan')):.3g}) -> {'ok' if kv['passed'] else 'FAILED'}", file=out)
        print_checks(agr["checks"], out, width=21)
        for g in agr.get("greedy", []):
            if g["identical"]:
                print(f"  greedy {g['variant']:<8} {g['steps']} tokens identical to {g['reference']}", file=out)
            else:
                d = g["first_divergence"]
                print(f"  greedy {g['variant']:<8} diverges from {g['reference']} at step {d['step']} (row {d['row']}: "
                      f"{d['reference_token']} vs {d['token']}, gap {d['reference_gap']:.3g} in "
                      f"{g['reference']}'s logits)", file=out)
    if not report["timing"]:
        print(f"\n{report['timing_note']}", file=out)
    if report["results"]:
        print(f"\n{'variant':<8} {'batch':>5} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'graph ms':>9} "
              f"{'graph tok/s':>11} {'peak MiB':>9} {'TPOT gain':>9} {'graph gain':>10}", file=out)
        gains = {(g["variant"], g["batch"]): g for g in report.get("gains", [])}
        for r in report["results"]:
            g = gains.get((r["variant"], r["batch"]), {})
            peak = r.get("peak_bytes", 0) / 2**20 or None
            skipped = f"  (skipped: {r['skipped']})" if r.get("skipped") else ""
            errs = f"  errors: {'; '.join(f'{k}: {v[:80]}' for k, v in r['errors'].items())}" if r.get("errors") else ""
            print(f"{r['variant']:<8} {r['batch']:>5} {_fmt(r.get('ttft_ms')):>9} {_fmt(r.get('tpot_ms')):>9} "
                  f"{_fmt(r.get('tokens_per_s'), '.0f'):>9} {_fmt(r.get('tpot_graph_ms')):>9} "
                  f"{_fmt(r.get('tokens_per_s_graph'), '.0f'):>11} {_fmt(peak, '.0f'):>9} "
                  f"{_fmt(g.get('tpot_gain'), '.2f'):>9} {_fmt(g.get('tpot_graph_gain'), '.2f'):>10}{skipped}{errs}",
                  file=out)
    for p in report.get("profiles", []):
        if p.get("error"):
            print(f"\nprofile {p['variant']} batch {p['batch']}: {p['error']}", file=out)
            continue
        print(f"\none decode step of {p['variant']} at batch {p['batch']}: host {p['host_step_us']:.0f} us, GPU busy "
              f"{_fmt(p.get('gpu_busy_us'), '.0f')} us of a {_fmt(p.get('gpu_span_us'), '.0f')} us span, "
              f"{_fmt(p.get('kernels'), 'd')} kernels; trace {p['trace']}", file=out)
        print(f"  {'category':<12} {'GPU us':>9} {'GPU %':>6} {'host us':>9} {'host %':>6} {'kernels':>7}", file=out)
        for r in p["rows"]:
            print(f"  {r['category']:<12} {_fmt(r['gpu_us'], '.1f'):>9} {_fmt(r['gpu_share'], '.0%'):>6} "
                  f"{r['host_us']:>9.1f} {r['host_share']:>6.0%} {_fmt(r['kernels'], 'd'):>7}", file=out)
    if report.get("launches_cpu"):
        print("\nlaunches per decode step (CPU: interpreter launches + aten ops):", file=out)
        for v, d in report["launches_cpu"].items():
            print(f"  {v:<8} {d.get('count', d.get('error'))}", file=out)
    print(f"\nwritten: {report.get('_path', '')}", file=out)


def _write(report: dict[str, Any], path: pathlib.Path) -> None:
    write_json(path, {k: v for k, v in report.items() if not k.startswith("_")})


def _trace_name(path: pathlib.Path, variant: str, batch: int) -> pathlib.Path:
    return path.with_name(f"{path.stem}.trace-{variant}-b{batch}.json")


def main(args: argparse.Namespace) -> int:
    """``fuseaudit e2e --model hf-*`` (the options of :func:`fuseaudit.e2e.add_arguments` and ours)."""
    from .e2e import TIMING_NOTE, _int_list
    from .profiles import resolve_device

    try:
        device = resolve_device(args.device)
        if device.startswith("cuda:"):
            device = "cuda"
        gpu = device == "cuda"
        arch = ARCHS[args.model]
        size = args.config or ("default" if gpu else "tiny")
        if args.layers is not None and args.layers < 1:
            raise ValueError("--layers must be at least 1")
        config = hf_config(arch, size, layers=args.layers)
        ops = model_ops(arch, config)
        targets = parse_targets(args.target, ops)
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        if targets and "target" not in variants:
            variants.append("target")
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            raise ValueError(f"unknown variant(s) {', '.join(unknown) or '(none)'}; known: {', '.join(VARIANTS)}")
        if "target" in variants and not targets:
            raise ValueError("the 'target' variant needs --target OP=SPEC")
        variants = list(dict.fromkeys(["eager", *variants]))
        batches = _int_list(args.batches, "batches") if args.batches else ([1, 8, 64] if gpu else [2])
        prompt_len = args.prompt_len if args.prompt_len is not None else (512 if gpu else 8)
        gen_tokens = args.gen_tokens if args.gen_tokens is not None else (32 if gpu else 4)
        if prompt_len < 2 or gen_tokens < 1:
            raise ValueError("--prompt-len must be at least 2 and --gen-tokens at least 1")
        if args.repeats < 1 or args.warmup < 0:
            raise ValueError("--repeats must be >= 1 and --warmup >= 0")
        max_pos = getattr(config, arch.positions_field)
        if prompt_len + gen_tokens + 1 > max_pos:
            raise ValueError(f"--prompt-len {prompt_len} + --gen-tokens {gen_tokens} + 1 exceeds the config's "
                             f"{max_pos} positions")
        if args.oracle == "float32" and args.dtype == "float32":
            raise ValueError("--oracle float32 is no oracle for a float32 model: use --oracle float64")
        impls, specs = {}, {}
        for v in variants:
            impls[v], specs[v] = load_impls(v, ops, targets, device)
        profile_batch = args.profile_batch or min(batches)
    except (ValueError, SwapError) as exc:
        return usage_error("e2e", str(exc))

    import triton

    tf = _transformers()
    t0 = time.monotonic()
    over_budget = lambda: args.budget_s is not None and time.monotonic() - t0 > args.budget_s
    dtype = getattr(torch, args.dtype)
    path = pathlib.Path(args.json or f"reports/e2e-{args.model}.json")
    print(f"building {arch.model_class} ({size}, {getattr(config, arch.layers_field)} layers, {args.dtype}) "
          f"on {device} ...", flush=True)
    model = build_model(arch, config, dtype=dtype, device=device, seed=args.seed)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {"device": device, "device_name": torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)",
                "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                "transformers": tf.__version__},
        "model": arch.name, "model_class": arch.model_class, "config": describe_config(arch, size, config, model),
        "dtype": args.dtype, "prompt_len": prompt_len, "gen_tokens": gen_tokens, "batches": batches,
        "variants": variants, "ops": specs, "cuda_graphs": bool(args.cuda_graphs and gpu), "timing": gpu,
        "timing_note": None if gpu else TIMING_NOTE, "budget_s": args.budget_s, "notes": list(NOTES),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "swap": {}, "results": [], "gains": [], "profiles": [], "skipped": [], "_path": str(path),
    }
    if args.cuda_graphs and not gpu:
        report["notes"].append("--cuda-graphs ignored: CUDA graphs need a GPU")

    check_batch = min((b for b in batches if b >= 8), default=max(batches))
    print(f"agreement check at batch {check_batch}, prompt {prompt_len}, {gen_tokens} greedy tokens ...", flush=True)
    try:
        checked = check_agreement(model, arch, impls, batch=check_batch, prompt_len=prompt_len, gen_tokens=gen_tokens,
                                  seed=args.seed, oracle_dtype=getattr(torch, args.oracle))
    except SwapError as exc:
        return usage_error("e2e", str(exc))
    report.update(checked)
    _write(report, path)
    if gpu:
        torch.cuda.empty_cache()

    def profile(v: str, state: SwapState | None) -> None:
        trace = _trace_name(path, v, profile_batch)
        entry: dict[str, Any] = {"variant": v, "batch": profile_batch, "trace": trace.name}
        try:
            entry.update(profile_step(model, arch, state, batch=profile_batch, prompt_len=prompt_len,
                                      seed=args.seed, path=trace, gpu=gpu))
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        report["profiles"].append(entry)

    order = [v for v in variants if v != "compile"] + (["compile"] if "compile" in variants else [])
    for v in order:
        ctx = swapped(model, arch, impls[v]) if impls[v] else contextlib.nullcontext()
        with ctx as state:
            if not gpu:
                from .launches import recording, short_name

                runner = Runner(model)
                prompt = _tokens(model, check_batch, prompt_len, seed=args.seed + 2)
                try:
                    with torch.no_grad():
                        cache = runner.dynamic_cache()
                        tok = runner.forward(prompt, cache).argmax(-1, keepdim=True)
                        tok = runner.forward(tok, cache).argmax(-1, keepdim=True)
                        with recording("cpu") as count:
                            runner.forward(tok, cache)
                    by_kernel = collections.Counter(short_name(k) for k in count.kernels)
                    report.setdefault("launches_cpu", {})[v] = {
                        "count": count.count, "triton": len(count.triton), "by_kernel": dict(by_kernel.most_common())}
                except Exception as exc:
                    report.setdefault("launches_cpu", {})[v] = {"error": f"{type(exc).__name__}: {exc}"}
                if not args.no_profile:
                    profile(v, state)
                _write(report, path)
                continue
            for b in batches:
                if over_budget():
                    report["skipped"].append({"what": v, "batch": b})
                    report["results"].append({"variant": v, "batch": b, "errors": {},
                                              "skipped": f"over the {args.budget_s:g} s budget"})
                    continue
                print(f"{v} at batch {b} ...", flush=True)
                report["results"].append(measure_cell(model, state, v, batch=b, prompt_len=prompt_len,
                                                      gen_tokens=gen_tokens, args=args))
                torch.cuda.empty_cache()
                join_gains(report)
                report["elapsed_s"] = time.monotonic() - t0
                _write(report, path)
            if not args.no_profile:  # after the timed cells, whatever the budget left: it is one step
                print(f"{v}: profiling one decode step at batch {profile_batch} ...", flush=True)
                profile(v, state)
                _write(report, path)
    join_gains(report)
    report["elapsed_s"] = time.monotonic() - t0
    _write(report, path)
    print_report(report)
    ok = report["agreement"]["verdict"] == "agree"
    return EXIT_OK if ok else EXIT_FAILED


__all__ = [
    "ARCHS", "MODELS", "SCHEMA", "VARIANTS", "Arch", "CatalogBiasActMLP", "CatalogGatedMLP", "CatalogLayerNorm",
    "CatalogRMSNorm", "Runner", "SwapError", "SwapState", "add_arguments", "build_model", "catalog_attention",
    "check_agreement", "hf_config", "load_impls", "main", "model_ops", "parse_targets", "print_report",
    "profile_step", "step_breakdown", "swappable_modules", "swapped",
]
