"""The op catalog: the single source of truth for every part of fuseaudit.

Each :class:`OpSpec` carries an op's canonical signature, its inputs and
keyword parameters, the unfused eager composition (the yardstick, built from
torch's own functionals), the float64 oracle, the launches a fused
implementation should make, models of the minimum bytes moved and of the
FLOPs, the reference kernel that implements it, its shape
(:mod:`fuseaudit.shapes`: how its cases are drawn, its edge cases, its
benchmark points), what a benchmark times it against and how its speed is
rated, and how many cases an audit draws by default.  Tests, the audit, the
benchmarks, the reports and the CLI all read the ops from :data:`OPS` and
never test an op's name or kind: adding an op is one entry here plus its
kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .shapes import ATTENTION, Shape
from .shapes import ROWS as ROW_SHAPE

# Input roles.  "rows": an activation shaped (..., N); "vector": a 1-D
# parameter of the hidden size N; "q" / "kv": attention operands
# (B, H, Sq, D) and (B, Hkv, Sk, D).
ROWS, VECTOR, Q, KV = "rows", "vector", "q", "kv"


@dataclass(frozen=True)
class Input:
    name: str
    role: str


@dataclass(frozen=True)
class Param:
    """A keyword parameter of the op and the values the strategies draw from."""

    name: str
    default: Any
    choices: tuple[Any, ...]


@dataclass(frozen=True)
class OpSpec:
    """One op of the catalog.  See DESIGN.md for the canonical signatures."""

    name: str
    shape: Shape  # how its inputs are sized, drawn, swept (fuseaudit.shapes: ROWS or ATTENTION)
    inputs: tuple[Input, ...]
    params: tuple[Param, ...]
    outputs: tuple[str, ...]
    eager: Callable[..., Any]
    meaning: str
    reference: str | None
    # Budget of the dtype-based fallback bound, in ulps of the row's largest
    # oracle magnitude (tolerance.py): used only where eager is no yardstick.
    fallback_ulps: float
    # Full-size temporaries the eager composition writes and reads back, in
    # units of the primary input's size (attention: of the Sq x Sk score
    # matrix per head).  The bytes fusion avoids.
    eager_temporaries: float
    oracle_fn: Callable[..., Any] | None = None
    # Where the op's arithmetic is conditioned (tolerance.py): "output" (the
    # output's own magnitude), "inputs" (sum of the inputs' magnitudes: the
    # sums of bias-activation ops cancel), "centred" (layer_norm: x - mean
    # cancels on near-constant rows, then is amplified by 1/std), "logits"
    # (softmax: x * scale is rounded at its own magnitude), "v" (attention:
    # an average of v).  See float32_scale.
    error_scale_of: str = "output"
    # Length of the op's float32 reductions: "none" (pointwise) or "row" (N).
    reduction: str = "none"
    launches: int = 1
    regimes: tuple[str, ...] = ("normal", "large", "outliers", "zeros", "near_constant", "shifted")
    flops_per_element: float = 1.0
    # FLOPs of one call from the input shapes and params, where not flops_per_element x the first input's size
    flops_model: Callable[[dict[str, tuple[int, ...]], dict[str, Any]], float] | None = None
    # elements of the unit eager_temporaries counts in, where not the first input's size
    temporary_elements: Callable[[dict[str, tuple[int, ...]]], int] | None = None
    # bound by arithmetic, not memory traffic: its speed is rated in TFLOP/s, not as a share of the copy bandwidth
    compute_bound: bool = False
    # what a benchmark times as "eager", where not ``eager`` (attention: SDPA's default dispatch; the MATH
    # composition is a correctness yardstick, not a speed one), and how a benchmark file names it
    speed_eager: Callable[..., Any] | None = None
    speed_eager_note: str | None = None
    # SDPA backends that are benchmark contenders of their own, each pinned (contenders.py)
    sdpa_backends: tuple[str, ...] = ()
    # cases an audit of `fuseaudit run` draws by default, on the CPU (Triton's interpreter) and on a GPU
    examples_cpu: int = 40
    examples_cuda: int = 30
    tags: tuple[str, ...] = field(default_factory=tuple)

    # -- signature ----------------------------------------------------------
    @property
    def signature(self) -> str:
        args = [i.name for i in self.inputs]
        args += [f"{p.name}={p.default!r}" for p in self.params]
        ret = " -> (" + ", ".join(self.outputs) + ")" if len(self.outputs) > 1 else ""
        return f"{self.name}({', '.join(args)}){ret}"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def default_examples(self, device: str) -> int:
        """Cases an audit of ``fuseaudit run`` draws on ``device`` unless told otherwise."""
        return self.examples_cuda if device.startswith("cuda") else self.examples_cpu

    @property
    def speed_baseline(self) -> Callable[..., Any]:
        """The function a benchmark times as "eager"."""
        return self.speed_eager or self.eager

    # -- semantics ----------------------------------------------------------
    def run_eager(self, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The unfused eager composition, in the inputs' dtype."""
        return as_tuple(self.eager(*(inputs[n] for n in self.input_names), **params))

    def run_oracle(self, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The float64 oracle, computed from the same (rounded) inputs."""
        dtype = inputs[self.inputs[0].name].dtype
        wide = {n: t.to(torch.float64) for n, t in inputs.items()}
        fn = self.oracle_fn or (lambda *a, dtype, **kw: self.eager(*a, **kw))
        return as_tuple(fn(*(wide[n] for n in self.input_names), dtype=dtype, **params))

    def rows_with_non_finite_inputs(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Per output row, whether an activation input of that row holds NaN or Inf (None: no row does)."""
        rows = [inputs[i.name] for i in self.inputs if i.role == ROWS]
        if not rows:
            return None
        mask = functools.reduce(torch.logical_or, [(~torch.isfinite(t)).any(dim=-1) for t in rows])
        return mask if bool(mask.any()) else None

    def float32_scale(self, inputs: dict[str, torch.Tensor], params: dict[str, Any],
                      oracle: torch.Tensor) -> torch.Tensor:
        """Magnitude ``s`` whose float32 ulp bounds the error no float32 kernel can avoid.

        A first-order error analysis per op (tolerance.py explains the policy);
        ``oracle`` is the float64 main output ``y``.
        """
        # non-finite entries round nothing: NaN/Inf parity judges them (tolerance.py)
        y = oracle.detach().abs().nan_to_num(nan=0.0, posinf=0.0)
        wide = {n: t.detach().double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) for n, t in inputs.items()}
        kind = self.error_scale_of
        if kind == "inputs":  # x (+ residual) + bias rounds at the inputs' magnitude, then the slope (<= 1.13)
            return 2 * sum(t.abs() for t in wide.values())
        if kind == "centred":  # layer_norm: the mean's rounding error, amplified by 1 / std
            h = wide["x"] + wide["residual"] if "residual" in wide else wide["x"]
            std = torch.sqrt(h.var(dim=-1, unbiased=False, keepdim=True) + params.get("eps", 1e-5))
            amplified = h.abs().amax(dim=-1, keepdim=True) / std * wide["weight"].abs()
            return math.sqrt(h.shape[-1]) * amplified + 2 * y
        if kind == "logits":  # softmax: dy_i ~ y_i * (|dz| + the sum's error), |dz| ~ ulp(|z|)
            z = (wide["x"] * params.get("scale", 1.0)).abs().amax(dim=-1, keepdim=True)
            return (2 * math.sqrt(wide["x"].shape[-1]) + 2 * z) * y
        if kind == "v":  # attention: an average of v rows; logits rounded at |q||k| * scale
            q, k, v = wide["q"], wide["k"], wide["v"]
            groups = q.shape[1] // k.shape[1]
            scale = params.get("scale") or 1 / math.sqrt(q.shape[-1])
            k_norm = k.norm(dim=-1).amax(dim=-1).repeat_interleave(groups, dim=1)  # (B, H)
            z = (q.norm(dim=-1) * k_norm[..., None] * scale).unsqueeze(-1)  # (B, H, Sq, 1)
            v_max = v.abs().amax(dim=(-2, -1), keepdim=True).repeat_interleave(groups, dim=1)
            return (2 * math.sqrt(k.shape[2] + k.shape[3]) + 2 * z) * v_max
        n = oracle.shape[-1] if self.reduction == "row" and oracle.dim() else 1
        return 2 * math.sqrt(n) * y

    def load_reference(self) -> Callable[..., Any] | None:
        from .targets import load_target

        return load_target(self.reference) if self.reference else None

    # -- models ---------------------------------------------------------------
    def bytes_moved(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Fewest bytes a fused kernel must move: each input read once, each output written once."""
        size = torch.empty((), dtype=dtype).element_size()
        read = sum(math.prod(s) for s in shapes.values())
        out_shape = shapes[self.inputs[0].name]
        return size * (read + len(self.outputs) * math.prod(out_shape))

    def flops(self, shapes: dict[str, tuple[int, ...]], params: dict[str, Any]) -> float:
        """Floating-point operations of one call (matrix FLOPs for attention)."""
        if self.flops_model is not None:
            return self.flops_model(shapes, params)
        return self.flops_per_element * math.prod(shapes[self.inputs[0].name])

    def intermediate_bytes(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Bytes of the temporaries eager writes and reads back (written once, read once)."""
        size = torch.empty((), dtype=dtype).element_size()
        if self.temporary_elements is not None:
            unit = self.temporary_elements(shapes)
        else:
            unit = math.prod(shapes[self.inputs[0].name])
        return int(2 * size * self.eager_temporaries * unit)


def attention_pairs(shapes: dict[str, tuple[int, ...]], params: dict[str, Any]) -> int:
    """Query-key pairs attended, summed over batch and heads (top-left causal)."""
    b, h, sq, _ = shapes["q"]
    sk = shapes["k"][2]
    if not params.get("causal", False):
        return b * h * sq * sk
    full = max(0, sq - sk)  # rows that see every key
    tri = min(sq, sk)
    return b * h * (tri * (tri + 1) // 2 + full * sk)


def _attention_flops(shapes: dict[str, tuple[int, ...]], params: dict[str, Any]) -> float:
    """Matrix FLOPs: ``q k^T`` and ``p v``, two multiply-adds per attended pair and head dim."""
    return 4.0 * attention_pairs(shapes, params) * shapes["q"][-1]


def _score_elements(shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements of the ``Sq x Sk`` score matrix, over batch and heads."""
    b, h, sq, _ = shapes["q"]
    return b * h * sq * shapes["k"][2]


def as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ---------------------------------------------------------------------------
# Eager compositions (in the inputs' dtype) and oracles (float64)
# ---------------------------------------------------------------------------

def _bias_gelu(x, bias, approximate="none"):
    return F.gelu(x + bias, approximate=approximate)


def _bias_silu(x, bias):
    return F.silu(x + bias)


def _residual_bias_gelu(x, residual, bias):
    return F.gelu(x + residual + bias)


def _swiglu(gate, up):
    return F.silu(gate) * up


def _geglu(gate, up, approximate="none"):
    return F.gelu(gate, approximate=approximate) * up


def _rms_norm(x, weight, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_rms_norm(x, residual, weight, eps=1e-6):
    h = x + residual
    return _rms_norm(h, weight, eps), h


def _layer_norm(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _add_layer_norm(x, residual, weight, bias, eps=1e-5):
    h = x + residual
    return _layer_norm(h, weight, bias, eps), h


def _softmax(x, scale=1.0):
    return torch.softmax(x * scale, dim=-1)


def _attention(q, k, v, causal=False, scale=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query: each kv head serves `groups` query heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# torch >= 2.5 takes grouped-query k/v natively; older torch repeats the heads
_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa_default(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 scale: float | None = None) -> torch.Tensor:
    """SDPA with torch's own backend choice; grouped-query heads natively where torch can (>= 2.5)."""
    if k.shape[1] != q.shape[1]:
        if _ENABLE_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _rms_norm_maths(x, weight, eps=1e-6, *, dtype=None):
    # the oracle spelled out: F.rms_norm's CUDA kernel turns a row holding inf into NaN, the maths gives x * 0
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _add_norm_oracle(norm):
    # The contract rounds h = x + residual to the input dtype and normalises
    # that h (as eager does), so the oracle normalises the rounded h too.
    def oracle(x, residual, *rest, dtype, **kw):
        h = (x + residual).to(dtype).to(torch.float64)
        return norm(h, *rest, **kw), x + residual

    return oracle


# "nonfinite": NaN and +inf entries, where every op's eager result is defined;
# "masked": -inf logits, some rows fully masked (case._non_finite).  Attention's
# signature has no mask: its masking is `causal`, which never masks a whole row,
# and -inf in q, k or v is no masked logit, so it keeps finite regimes.
_POINTWISE_REGIMES = ("normal", "large", "outliers", "zeros", "shifted", "nonfinite")
_NORM_REGIMES = ("normal", "large", "outliers", "zeros", "near_constant", "shifted", "nonfinite")
_SOFTMAX_REGIMES = ("normal", "large", "outliers", "zeros", "near_constant", "shifted", "masked")
_ATTN_REGIMES = ("normal", "large", "outliers", "zeros", "shifted")


def _op(name, shape, inputs, outputs, eager, meaning, kernel_file, **kw) -> OpSpec:
    params = kw.pop("params", ())
    return OpSpec(
        name=name,
        shape=shape,
        inputs=tuple(Input(n, r) for n, r in inputs),
        params=tuple(params),
        outputs=outputs,
        eager=eager,
        meaning=meaning,
        reference=f"fuseaudit.kernels.{kernel_file}:{name}" if kernel_file else None,
        **kw,
    )


_APPROX = Param("approximate", "none", ("none", "tanh"))

OPS: dict[str, OpSpec] = {
    op.name: op
    for op in [
        _op("bias_gelu", ROW_SHAPE, [("x", ROWS), ("bias", VECTOR)], ("y",), _bias_gelu,
            'F.gelu(x + bias, approximate=...)', "bias_act", params=[_APPROX],
            fallback_ulps=8, eager_temporaries=1, regimes=_POINTWISE_REGIMES, flops_per_element=20,
            error_scale_of="inputs"),
        _op("bias_silu", ROW_SHAPE, [("x", ROWS), ("bias", VECTOR)], ("y",), _bias_silu,
            "F.silu(x + bias)", "bias_act",
            fallback_ulps=8, eager_temporaries=1, regimes=_POINTWISE_REGIMES, flops_per_element=6,
            error_scale_of="inputs"),
        _op("residual_bias_gelu", ROW_SHAPE, [("x", ROWS), ("residual", ROWS), ("bias", VECTOR)], ("y",),
            _residual_bias_gelu, "F.gelu(x + residual + bias)", "bias_act",
            fallback_ulps=8, eager_temporaries=2, regimes=_POINTWISE_REGIMES, flops_per_element=21,
            error_scale_of="inputs"),
        _op("swiglu", ROW_SHAPE, [("gate", ROWS), ("up", ROWS)], ("y",), _swiglu,
            "F.silu(gate) * up", "gated",
            fallback_ulps=8, eager_temporaries=1, regimes=_POINTWISE_REGIMES, flops_per_element=6),
        _op("geglu", ROW_SHAPE, [("gate", ROWS), ("up", ROWS)], ("y",), _geglu,
            "F.gelu(gate, approximate=...) * up", "gated", params=[_APPROX],
            fallback_ulps=8, eager_temporaries=1, regimes=_POINTWISE_REGIMES, flops_per_element=20),
        _op("rms_norm", ROW_SHAPE, [("x", ROWS), ("weight", VECTOR)], ("y",), _rms_norm,
            "F.rms_norm(x, (N,), weight, eps)", "rms_norm",
            params=[Param("eps", 1e-6, (1e-6, 1e-5))], fallback_ulps=16, eager_temporaries=0,
            oracle_fn=_rms_norm_maths, flops_per_element=4, reduction="row", regimes=_NORM_REGIMES),
        _op("add_rms_norm", ROW_SHAPE, [("x", ROWS), ("residual", ROWS), ("weight", VECTOR)], ("y", "h"),
            _add_rms_norm, "h = x + residual; (F.rms_norm(h, (N,), weight, eps), h)", "rms_norm",
            params=[Param("eps", 1e-6, (1e-6, 1e-5))], fallback_ulps=16, eager_temporaries=0,
            oracle_fn=_add_norm_oracle(_rms_norm_maths), flops_per_element=5, reduction="row", regimes=_NORM_REGIMES),
        _op("layer_norm", ROW_SHAPE, [("x", ROWS), ("weight", VECTOR), ("bias", VECTOR)], ("y",),
            _layer_norm, "F.layer_norm(x, (N,), weight, bias, eps)", "layer_norm",
            params=[Param("eps", 1e-5, (1e-5, 1e-6))], fallback_ulps=16, eager_temporaries=0,
            flops_per_element=8, reduction="row", error_scale_of="centred", regimes=_NORM_REGIMES),
        _op("add_layer_norm", ROW_SHAPE, [("x", ROWS), ("residual", ROWS), ("weight", VECTOR), ("bias", VECTOR)],
            ("y", "h"), _add_layer_norm, "h = x + residual; (F.layer_norm(h, (N,), weight, bias, eps), h)",
            "layer_norm", params=[Param("eps", 1e-5, (1e-5, 1e-6))], fallback_ulps=16,
            eager_temporaries=0, oracle_fn=_add_norm_oracle(_layer_norm), flops_per_element=9, reduction="row",
            error_scale_of="centred", regimes=_NORM_REGIMES),
        _op("softmax", ROW_SHAPE, [("x", ROWS)], ("y",), _softmax,
            "torch.softmax(x * scale, dim=-1)", "softmax",
            params=[Param("scale", 1.0, (1.0, 0.125, 2.0, 0.08838834764831845))],
            fallback_ulps=16, eager_temporaries=1, flops_per_element=5, reduction="row",
            error_scale_of="logits", regimes=_SOFTMAX_REGIMES),
        _op("attention", ATTENTION, [("q", Q), ("k", KV), ("v", KV)], ("y",), _attention,
            "F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale); "
            "k, v may have fewer heads (grouped-query); causal top-left aligned", "attention",
            params=[Param("causal", False, (False, True)), Param("scale", None, (None, 0.1))],
            fallback_ulps=64, eager_temporaries=2, regimes=_ATTN_REGIMES,
            error_scale_of="v", flops_model=_attention_flops, temporary_elements=_score_elements,
            compute_bound=True, speed_eager=sdpa_default, speed_eager_note="SDPA default dispatch",
            sdpa_backends=("flash", "cudnn", "efficient"), examples_cpu=12, examples_cuda=20),
    ]
}


def get_op(name: str) -> OpSpec:
    """The op called ``name``; a clear error naming the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None
