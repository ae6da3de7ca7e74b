"""A test case: everything needed to rebuild one op call bit for bit.

Hypothesis draws :class:`Case` objects (shapes, dtype, one layout per input,
a value regime, keyword parameters and a seed); the tensors are made from the
case deterministically by :func:`materialize`.  Shrinking therefore acts on
the things a kernel engineer reasons about (fewer rows, a smaller hidden size,
contiguous inputs, normal values), and a case printed as JSON replays the
exact same inputs anywhere: ``fuseaudit audit OP TARGET --case '<json>'``.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .catalog import KV, ROWS, VECTOR, OpSpec, Q, get_op

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
LAYOUTS = ("contiguous", "padded", "transposed", "strided", "expanded", "offset")
STRIDE = 2  # the "strided" layout: every STRIDE-th element of a longer buffer


def can_transpose(shape: tuple[int, ...]) -> bool:
    """Whether swapping the last two dims makes the last dim non-unit-stride (else "strided" is the layout)."""
    return len(shape) >= 2 and shape[-2] > 1

# Regimes whose inputs hold -inf, +inf or NaN (the first input only; case._non_finite).
NON_FINITE_REGIMES = ("masked", "nonfinite")

# Values beyond the inputs' own range: a kernel that reads padding or memory
# before a storage offset turns them into NaN in its output.
SENTINEL = float("nan")


@dataclass
class Case:
    """One op call.  ``dims`` holds ``lead`` and ``N`` (row ops) or
    ``B, H, Hkv, Sq, Sk, D`` (attention)."""

    op: str
    dtype: str
    dims: dict[str, Any]
    layouts: dict[str, str]
    regime: str = "normal"
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def spec(self) -> OpSpec:
        return get_op(self.op)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The logical shape of every input."""
        d = self.dims
        out: dict[str, tuple[int, ...]] = {}
        for inp in self.spec.inputs:
            if inp.role == ROWS:
                out[inp.name] = (*d["lead"], d["N"])
            elif inp.role == VECTOR:
                out[inp.name] = (d["N"],)
            elif inp.role == Q:
                out[inp.name] = (d["B"], d["H"], d["Sq"], d["D"])
            elif inp.role == KV:
                out[inp.name] = (d["B"], d["Hkv"], d["Sk"], d["D"])
        return out

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())

    # -- (de)serialisation ---------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        if "lead" in d["dims"]:
            d["dims"]["lead"] = list(d["dims"]["lead"])
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        try:
            d = json.loads(text)
            if "lead" in d["dims"]:
                d["dims"]["lead"] = tuple(d["dims"]["lead"])
            case = cls(**d)
            case.spec  # noqa: B018 -- validates the op name
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a fuseaudit case: {exc}") from exc
        return case

    def describe(self) -> str:
        """One line: op, dtype, each input's shape and layout, regime, params, seed."""
        shapes = self.shapes()
        parts = [f"{n}{tuple(s)}[{_layout_words(self.layouts.get(n, 'contiguous'), tuple(s))}]"
                 for n, s in shapes.items()]
        params = " ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.op} {self.dtype} {' '.join(parts)} regime={self.regime} {params} seed={self.seed}".replace(
            "  ", " "
        )

    def replay_command(self, target: str, device: str) -> str:
        """One shell command that re-runs exactly this case against ``target``."""
        env = "TRITON_INTERPRET=1 " if device == "cpu" else ""
        return (
            f"{env}fuseaudit audit {self.op} {shlex.quote(target)} --device {device} "
            f"--case {shlex.quote(self.to_json())}"
        )


def _layout_words(layout: str, shape: tuple[int, ...]) -> str:
    """A layout as a failure should name it: a stride said with its step."""
    if layout == "strided" or (layout == "transposed" and not can_transpose(shape)):
        return f"strided: every {STRIDE}nd element, stride {STRIDE}"
    if layout == "padded" and len(shape) >= 2:
        return f"padded: row stride {shape[-1] + 3 + shape[-1] % 5}"
    return layout


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

def _values(role: str, shape: tuple[int, ...], regime: str, dtype: torch.dtype, gen: torch.Generator,
            zero_rows: torch.Tensor | None) -> torch.Tensor:
    """Float64 values of one input for a value regime (before rounding to dtype)."""
    f64 = {"generator": gen, "dtype": torch.float64, "device": gen.device}
    if role == VECTOR:
        # parameters stay ordinary: weight near 1, bias near 0
        return torch.randn(shape, **f64) * 0.5
    x = torch.randn(shape, **f64)
    attention = role in (Q, KV)
    if regime == "large":
        # |x| in [256, 2048]: squares and sums of squares overflow a float16
        # accumulator (max 65504), the values themselves are far from it.
        mag = 4.0 if attention else 2.0 ** (8 + 3 * torch.rand(shape, **f64))
        x = torch.sign(x) * mag * (x.abs() if attention else 1.0)
    elif regime == "outliers":
        # a few channels a hundred times larger, as in LLM activations
        spikes = torch.rand(shape, **f64) < 0.02
        x = torch.where(spikes, x * (10.0 if attention else 100.0), x)
    elif regime == "near_constant":
        # c + tiny noise per row: the variance cancels unless computed carefully
        c = torch.randn((*shape[:-1], 1), **f64) * 10
        x = c + 1e-3 * x
    elif regime == "shifted":
        # a large common offset per row: tests max subtraction in softmax
        offset = 1000.0 if dtype == torch.float16 else 10000.0
        x = x * 3 + (0.0 if role == Q else offset)
    if zero_rows is not None:
        x = x * (~zero_rows).to(x.dtype).unsqueeze(-1)
    return x


def _non_finite(x: torch.Tensor, regime: str, gen: torch.Generator) -> torch.Tensor:
    """``x`` with the non-finite entries of its regime, a pattern per row (row index mod 4 or 3).

    ``masked``: ``-inf`` logits as an attention or padding mask leaves them -- a
    fully masked row (eager gives NaN), a masked prefix of three quarters of the
    row (whole tiles of ``-inf`` before any finite value: an online max must not
    turn ``-inf - -inf`` into NaN), half the entries at random, none.
    ``nonfinite``: one NaN, one ``+inf``, or nothing in a row; every op's eager
    result is defined there (NaN propagates, ``+inf`` saturates).
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n).clone()
    dev = rows.device
    kind = torch.arange(rows.shape[0], device=dev) % (4 if regime == "masked" else 3)
    if regime == "masked":
        prefix = torch.arange(n, device=dev) < (3 * n) // 4
        scatter = torch.rand(rows.shape, generator=gen, device=dev) < 0.5
        mask = (kind == 0)[:, None] | ((kind == 1)[:, None] & prefix) | ((kind == 2)[:, None] & scatter)
        rows = rows.masked_fill(mask, -math.inf)
    else:
        col = torch.randint(n, (rows.shape[0],), generator=gen, device=dev)
        hit = torch.arange(n, device=dev)[None, :] == col[:, None]
        rows = torch.where(hit & (kind == 0)[:, None], math.nan, rows)
        rows = torch.where(hit & (kind == 1)[:, None], math.inf, rows)
    return rows.reshape(x.shape)


def _place(values: torch.Tensor, layout: str) -> torch.Tensor:
    """Put ``values`` (already in the target dtype, contiguous, on their device) in memory with ``layout``."""
    shape = tuple(values.shape)
    full = {"dtype": values.dtype, "device": values.device}
    if layout == "contiguous":
        return values.clone()
    if layout == "padded":
        # rows padded then sliced: row stride > N, padding holds NaN
        pad = 3 + shape[-1] % 5
        buf = torch.full((*shape[:-1], shape[-1] + pad), SENTINEL, **full)
        buf[..., : shape[-1]] = values
        return buf[..., : shape[-1]]
    if layout == "transposed" and can_transpose(shape):
        # stored with the last two dims swapped: the last dim is not unit-stride
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout in ("strided", "transposed"):
        # every STRIDE-th element of a longer buffer (what "transposed" is for a vector or a single row)
        buf = torch.full((*shape[:-1], STRIDE * shape[-1]), SENTINEL, **full)
        buf[..., ::STRIDE] = values
        return buf[..., ::STRIDE]
    if layout == "expanded":
        # a stride-0 dim: one slice broadcast along dim 0 (values are made to match)
        return values.narrow(0, 0, 1).clone().expand(shape)
    if layout == "offset":
        off = 7
        flat = torch.full((values.numel() + off,), SENTINEL, **full)
        flat[off:] = values.reshape(-1)
        return flat.as_strided(shape, values.contiguous().stride(), off)
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def materialize(case: Case, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The inputs of ``case`` on ``device``, made deterministically from its seed.

    Drawn on ``device`` itself (a large case costs a kernel, not a host loop
    and a copy): the same seed gives the same values on every device of one
    kind, so a replay on the device the audit ran on sees the failing inputs.
    """
    gen = torch.Generator(device=device).manual_seed(case.seed)
    shapes = case.shapes()
    dtype = case.torch_dtype
    zero_rows = None
    if case.regime == "zeros":
        first = shapes[case.spec.inputs[0].name]
        zero_rows = torch.rand(first[:-1], generator=gen, device=gen.device) < 0.5
    out = {}
    for inp in case.spec.inputs:
        shape = shapes[inp.name]
        zr = zero_rows if (zero_rows is not None and inp.role == ROWS) else None
        if zero_rows is not None and inp.role == Q:
            zr = zero_rows
        vals = _values(inp.role, shape, case.regime, dtype, gen, zr)
        if case.regime in NON_FINITE_REGIMES and inp is case.spec.inputs[0]:
            vals = _non_finite(vals, case.regime, gen)
        if inp.role == VECTOR and inp.name == "weight":
            vals = vals + 1.0
        out[inp.name] = _place(vals.to(dtype), case.layouts.get(inp.name, "contiguous"))
    return out
