"""A small Llama-style decoder stack for end-to-end measurements (``fuseaudit e2e``).

Random weights made locally from a seed (nothing is downloaded); the shapes
of a ~1B-parameter Llama (:data:`CONFIGS` ``"default"``: hidden 2048, 16
layers, 32 query heads, 8 kv heads, intermediate 8192, vocab 32000) or a
``"tiny"`` one for CPU tests under Triton's interpreter.

One layer, as vLLM runs it (pre-norm, the residual add fused into the next
norm)::

    x, residual = add_rms_norm(h, residual, ln_attn)     # rms_norm(h) in layer 0
    q, k, v     = split(x @ W_qkv)                       # one fused QKV projection
    q, k        = rotary(q), rotary(k)                   # plain torch, every variant
    cache[pos : pos + S] = k, v
    a           = attention(q, cache_k[:pos + S], cache_v[:pos + S], causal=S > 1)
    h           = a @ W_o
    x, residual = add_rms_norm(h, residual, ln_mlp)
    gate, up    = split(x @ W_gate_up)                   # strided halves of one GEMM
    h           = swiglu(gate, up) @ W_down

and at the end ``x = add_rms_norm(h, residual, ln_final)``, ``logits =
x[:, -1] @ W_lm``.  All non-matmul work except rotary goes through an
:class:`Ops` provider holding the catalog ops ``rms_norm``, ``add_rms_norm``,
``swiglu`` and ``attention``:

``eager``    each op is the catalog's unfused eager composition (``spec.eager``)
``fused``    each op is the catalog's reference Triton kernel (``spec.load_reference()``)
``compile``  eager ops, except attention is plain SDPA with no backend pinned (as a
             user's model is written), meant to run under ``torch.compile`` of the
             whole forward (:func:`compiled_forward`): what a user would do

Rotary embeddings are done in plain torch (HF's rotate-half form, cos/sin
tables precomputed in float64 and cast to the model dtype), identically in
every variant; under ``torch.compile`` they are compiled with the rest.  The
oracle (:meth:`Model.cast`) takes the rounded tables, as it takes the
rounded weights, so only the arithmetic differs between it and a variant.

KV cache: :class:`KVCache` holds ``(B, Hkv, max_len, D)`` buffers per layer.
Prefill starts at position 0 and uses causal attention with ``Sq == Sk``
(top-left causal is then the usual causal mask).  A decode step has
``Sq = 1`` and attends to the whole cache up to and including its own
position with ``causal=False``: top-left causal with ``Sq = 1 < Sk`` would
see key 0 only.  Chunked prefill (``S > 1`` at ``pos > 0``) would need
bottom-right causal, which the catalog's attention does not have, so it is
refused.  A step writes its k/v at ``pos`` and reads ``[0, pos]`` only, so
running the same step twice is idempotent: what lets a CUDA graph of one
step be replayed for timing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from .catalog import OPS

VARIANTS = ("eager", "fused", "compile")
MODEL_OPS = ("rms_norm", "add_rms_norm", "swiglu", "attention")


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    vocab: int = 32000
    max_seq: int = 4096
    eps: float = 1e-5
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads {self.kv_heads} must divide heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary")
        if self.layers < 1:
            raise ValueError("layers must be at least 1")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        d, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = d * (d + 2 * kv) + d * d + 3 * d * self.intermediate + 2 * d
        return self.layers * per_layer + 2 * self.vocab * d + d

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["head_dim"] = self.head_dim
        d["params"] = self.num_params()
        return d


CONFIGS: dict[str, ModelConfig] = {
    "default": ModelConfig(),
    # small enough for Triton's interpreter on two CPU cores; still grouped-query
    "tiny": ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, max_seq=64),
}


def get_config(name: str, layers: int | None = None) -> ModelConfig:
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}") from None
    return replace(cfg, layers=layers) if layers is not None else cfg


# ---------------------------------------------------------------------------
# The ops provider
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Ops:
    """The catalog ops a forward uses, by name; ``kind`` is the variant they come from."""

    kind: str
    rms_norm: Callable[..., Any]
    add_rms_norm: Callable[..., Any]
    swiglu: Callable[..., Any]
    attention: Callable[..., Any]


def plain_attention(q, k, v, causal=False, scale=None):
    """Attention as a user's model writes it: SDPA, no backend pinned (Inductor / SDPA pick one)."""
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    extra: dict[str, Any] = {}
    if groups > 1:
        if _SDPA_GQA:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)


def _torch_at_least(major: int, minor: int) -> bool:
    got = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return got >= (major, minor)


_SDPA_GQA = _torch_at_least(2, 5)  # SDPA's enable_gqa (decided once: nothing to trace under torch.compile)


def make_ops(kind: str) -> Ops:
    """The ops of one variant: ``eager``, ``fused`` or ``compile`` (see the module docstring)."""
    if kind == "eager":
        return Ops(kind, *(OPS[n].eager for n in MODEL_OPS))
    if kind == "fused":
        impls = []
        for n in MODEL_OPS:
            fn = OPS[n].load_reference()
            if fn is None:
                raise ValueError(f"op {n} has no reference kernel")
            impls.append(fn)
        return Ops(kind, *impls)
    if kind == "compile":
        return Ops(kind, OPS["rms_norm"].eager, OPS["add_rms_norm"].eager, OPS["swiglu"].eager, plain_attention)
    raise ValueError(f"unknown variant {kind!r}; known: {', '.join(VARIANTS)}")


@dataclass
class OpCall:
    """One op call seen in a forward: what the microbenchmark replays."""

    op: str
    args: tuple[torch.Tensor, ...]
    params: dict[str, Any]

    def key(self) -> tuple[Any, ...]:
        return (self.op, tuple((tuple(a.shape), a.stride(), str(a.dtype)) for a in self.args),
                tuple(sorted(self.params.items())))

    def describe(self) -> dict[str, Any]:
        return {"op": self.op, "shapes": [list(a.shape) for a in self.args],
                "strides": [list(a.stride()) for a in self.args],
                "dtype": str(self.args[0].dtype).replace("torch.", ""), "params": dict(self.params)}


def recording_ops(ops: Ops, calls: list[OpCall]) -> Ops:
    """``ops`` that append every call (the argument tensors themselves, not copies) to ``calls``."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: torch.Tensor, **params: Any) -> Any:
            calls.append(OpCall(name, tuple(args), dict(params)))
            return fn(*args, **params)

        return recorded

    return Ops(ops.kind, *(wrap(n, getattr(ops, n)) for n in MODEL_OPS))


# ---------------------------------------------------------------------------
# Weights, cache and the forward
# ---------------------------------------------------------------------------

@dataclass
class Layer:
    ln_attn: torch.Tensor
    w_qkv: torch.Tensor  # (hidden, (heads + 2 kv_heads) * head_dim)
    w_o: torch.Tensor  # (heads * head_dim, hidden)
    ln_mlp: torch.Tensor
    w_gate_up: torch.Tensor  # (hidden, 2 * intermediate)
    w_down: torch.Tensor  # (intermediate, hidden)


class KVCache:
    """Per-layer ``(B, Hkv, max_len, D)`` key and value buffers (static: CUDA graphs may capture them)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, *, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.layers)]
        self.batch, self.max_len = batch, max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Model:
    """The decoder stack: weights plus a forward parameterised by an :class:`Ops` provider."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 seed: int = 0, _weights: dict[str, Any] | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        if _weights is not None:
            self.__dict__.update(_weights)
            return
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rand(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32) * std
            return w.to(dtype)

        def norm_weight() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(cfg.hidden, generator=gen, device=self.device, dtype=torch.float32)
            return w.to(dtype)

        d, hd = cfg.hidden, cfg.head_dim
        qkv = (cfg.heads + 2 * cfg.kv_heads) * hd
        self.embed = rand(cfg.vocab, d, std=1.0)
        self.layers = [
            Layer(ln_attn=norm_weight(), w_qkv=rand(d, qkv, std=d ** -0.5), w_o=rand(cfg.heads * hd, d, std=d ** -0.5),
                  ln_mlp=norm_weight(), w_gate_up=rand(d, 2 * cfg.intermediate, std=d ** -0.5),
                  w_down=rand(cfg.intermediate, d, std=cfg.intermediate ** -0.5))
            for _ in range(cfg.layers)
        ]
        self.ln_final = norm_weight()
        self.lm_head = rand(d, cfg.vocab, std=d ** -0.5)
        self.cos, self.sin = rotary_tables(cfg, dtype=dtype, device=self.device)

    def cast(self, dtype: torch.dtype) -> Model:
        """The same (already rounded) weights in another dtype: the oracle is ``model.cast(torch.float64)``."""
        def c(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype)

        weights = {
            "embed": c(self.embed), "ln_final": c(self.ln_final), "lm_head": c(self.lm_head),
            "layers": [Layer(*(c(getattr(layer, f)) for f in Layer.__dataclass_fields__)) for layer in self.layers],
        }
        # the rotary tables are constants of the model like its weights: the rounded ones, upcast
        weights["cos"], weights["sin"] = c(self.cos), c(self.sin)
        return Model(self.cfg, dtype=dtype, device=self.device, _weights=weights)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if max_len > self.cfg.max_seq:
            raise ValueError(f"cache of {max_len} positions exceeds max_seq {self.cfg.max_seq}")
        return KVCache(self.cfg, batch, max_len, dtype=self.dtype, device=self.device)

    def weight_bytes(self) -> int:
        ts = [self.embed, self.ln_final, self.lm_head]
        for layer in self.layers:
            ts += [getattr(layer, f) for f in Layer.__dataclass_fields__]
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(self, ops: Ops, tokens: torch.Tensor, cache: KVCache, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (B, S) at positions ``pos .. pos + S - 1``; returns ``(logits, hidden)``.

        ``logits`` (B, vocab) are those of the last position (what sampling
        needs); ``hidden`` (B, S, hidden) is the final normed hidden state of
        every position (what the agreement check compares besides the logits).
        ``S > 1`` is a prefill from ``pos == 0``; ``S == 1`` a decode step.
        """
        cfg = self.cfg
        b, s = tokens.shape
        if s > 1 and pos != 0:
            raise ValueError("a prefill (S > 1) must start at position 0: chunked prefill needs bottom-right "
                             "causal attention, which the catalog's attention does not have")
        end = pos + s
        if end > cache.max_len:
            raise ValueError(f"positions up to {end} do not fit a cache of {cache.max_len}")
        h_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        cos, sin = self.cos[pos:end], self.sin[pos:end]
        causal = s > 1

        h = torch.nn.functional.embedding(tokens, self.embed)  # (B, S, hidden); capture-safe under CUDA graphs
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, layer.ln_attn, eps=cfg.eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, layer.ln_attn, eps=cfg.eps)
            qkv = x @ layer.w_qkv
            q = qkv[..., :h_dim].view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = qkv[..., h_dim:h_dim + kv_dim].view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = qkv[..., h_dim + kv_dim:].view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.k[i][:, :, pos:end] = k
            cache.v[i][:, :, pos:end] = v
            a = ops.attention(q, cache.k[i][:, :, :end], cache.v[i][:, :, :end], causal=causal)
            h = a.transpose(1, 2).reshape(b, s, h_dim) @ layer.w_o
            x, residual = ops.add_rms_norm(h, residual, layer.ln_mlp, eps=cfg.eps)
            gu = x @ layer.w_gate_up
            h = ops.swiglu(gu[..., :cfg.intermediate], gu[..., cfg.intermediate:]) @ layer.w_down
        x, _ = ops.add_rms_norm(h, residual, self.ln_final, eps=cfg.eps)
        logits = x[:, -1] @ self.lm_head
        return logits, x


def rotary_tables(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape (max_seq, head_dim), computed in float64, cast to ``dtype``."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64, device=device) / half))
    angles = torch.arange(cfg.max_seq, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary on ``x`` (B, H, S, D) with tables (S, D), in the model dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------
# Variants as callables
# ---------------------------------------------------------------------------

# fn(tokens, cache, pos) -> (logits, hidden)
Forward = Callable[[torch.Tensor, KVCache, int], tuple[torch.Tensor, torch.Tensor]]


def _raise_recompile_limits() -> None:
    # Each (batch, prefill/decode) shape is its own graph (dynamic=False); past
    # the limit Dynamo silently falls back to eager and we would time eager.
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(int(getattr(cfg, knob)), 256))


def compiled_forward(model: Model) -> Forward:
    """``torch.compile`` of the whole forward (prefill or decode step) with the ``compile`` ops.

    ``dynamic=False``: one static graph per batch size and phase, as a
    serving stack that buckets batch sizes would have.  The default mode
    (no Inductor CUDA graphs): ``--cuda-graphs`` captures every variant the
    same way, by hand.
    """
    cached = getattr(model, "_compiled_forward", None)
    if cached is not None:  # one compiled function per model, so its graphs are reused
        return cached
    _raise_recompile_limits()
    ops = make_ops("compile")

    def forward(tokens: torch.Tensor, cache: KVCache, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return model.forward(ops, tokens, cache, pos)

    model._compiled_forward = torch.compile(forward, dynamic=False)
    return model._compiled_forward


def variant_forward(model: Model, variant: str) -> Forward:
    """``fn(tokens, cache, pos) -> (logits, hidden)`` for one variant."""
    if variant == "compile":
        return compiled_forward(model)
    ops = make_ops(variant)
    return lambda tokens, cache, pos: model.forward(ops, tokens, cache, pos)


def random_tokens(cfg: ModelConfig, batch: int, length: int, *, seed: int, device: torch.device | str
                  ) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch, length), generator=gen).to(device)


def describe_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


__all__ = [
    "CONFIGS", "MODEL_OPS", "VARIANTS", "KVCache", "Model", "ModelConfig", "OpCall", "Ops", "apply_rotary",
    "compiled_forward", "describe_params", "get_config", "make_ops", "plain_attention", "random_tokens",
    "recording_ops", "rotary_tables", "variant_forward",
]
