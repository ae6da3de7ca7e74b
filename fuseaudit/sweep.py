"""The shape points a benchmark sweeps, and their inputs.

A point is a :class:`~fuseaudit.case.Case` (contiguous layouts, normal
values, the op's default parameters unless the point says otherwise) with a
short label.  The default sweeps are the shapes of LLM inference:

* row ops: rows {1, 8, 64, 1024, 16384} (decode batch to long prefill) x
  hidden {1024 ... 65536} (model widths, MLP widths, vocabulary-sized
  softmax) in bfloat16, plus float16 and float32 on a subset;
* attention: prefill at S = 512 ... 16k with D in {64, 128}, causal and not,
  the batch scaled down as S grows (16k tokens per point, B=4 at 4k) so each
  point is a large amount of work that still takes well under a second; and
  decode (Sq=1, Sk up to 32k, grouped-query H=32, Hkv=8).

``quick`` sweeps keep a few points of each shape for a smoke run.  Which sweep an op
gets is its catalog shape's (:mod:`fuseaudit.shapes`).

Inputs come from :func:`~fuseaudit.case.materialize`, which draws float64
values on the host: for a 16384 x 65536 point that alone would take longer
than timing it.  :func:`bench_inputs` therefore materializes a smaller case
(fewer rows, batch or sequence) from the same seed and tiles it on the
device to the full shape; the kernel sees the same shapes, strides and value
distribution, and the inputs stay deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .case import DTYPES, Case, materialize
from .catalog import OPS, OpSpec

__all__ = [
    "ATTENTION_DECODE_SK",
    "ATTENTION_PREFILL_S",
    "ROW_HIDDEN",
    "ROW_ROWS",
    "Point",
    "attention_points",
    "bench_inputs",
    "default_points",
    "rows_points",
]

ROW_ROWS: tuple[int, ...] = (1, 8, 64, 1024, 16384)
ROW_HIDDEN: tuple[int, ...] = (1024, 2048, 4096, 5120, 8192, 11008, 14336, 16384, 32768, 65536)
# float16 and float32 run on this subset of the grid
ROW_SUBSET_ROWS: tuple[int, ...] = (8, 1024, 16384)
ROW_SUBSET_HIDDEN: tuple[int, ...] = (2048, 8192, 32768)
ROW_QUICK: tuple[tuple[int, int, str], ...] = (
    (1, 4096, "bfloat16"), (1024, 4096, "bfloat16"), (16384, 8192, "bfloat16"),
    (1024, 4096, "float16"), (1024, 4096, "float32"),
)

ATTENTION_PREFILL_S: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TOKENS = 16384  # B * S per prefill point: B=4 at S=4096
ATTENTION_HEADS = 32
ATTENTION_DECODE_SK: tuple[int, ...] = (1024, 4096, 16384, 32768)
ATTENTION_DECODE_BATCH = 8
ATTENTION_DECODE_KV_HEADS = 8

# The pytest-benchmark suite (benchmarks/test_bench_ops.py): each row op at a decode batch and a long
# prefill, attention at a prefill and a grouped-query decode point of its quick sweep.
SUITE_ROW_POINTS: tuple[tuple[int, int], ...] = ((8, 8192), (16384, 8192))
SUITE_ATTENTION_LABELS: tuple[str, ...] = ("B=4 H=32 S=4096 D=128", "decode B=8 H=32/8 Sk=4096 D=128")

# Elements materialized on the host per input before tiling on the device.
MATERIALIZE_LIMIT = 1 << 22


@dataclass(frozen=True)
class Point:
    """One shape point of one op: a case and a label such as ``rows=1024 N=4096``."""

    case: Case
    label: str
    kind: str  # "rows", "prefill" or "decode"

    @property
    def op(self) -> str:
        return self.case.op

    @property
    def dtype(self) -> str:
        return self.case.dtype

    @property
    def params(self) -> dict[str, Any]:
        """The op's keyword parameters at this point (defaults filled in)."""
        return {**self.case.spec.defaults(), **self.case.params}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.case.shapes()

    def bench_params(self) -> dict[str, Any]:
        """Flat, JSON-friendly identity of the point (pytest-benchmark ``params``)."""
        dims = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.case.dims.items()}
        return {"op": self.op, "dtype": self.dtype, **dims, **{k: v for k, v in self.params.items()}}


def _rows_point(spec: OpSpec, rows: int, hidden: int, dtype: str) -> Point:
    layouts = {i.name: "contiguous" for i in spec.inputs}
    case = Case(op=spec.name, dtype=dtype, dims={"lead": (rows,), "N": hidden}, layouts=layouts,
                params=spec.defaults(), seed=0)
    return Point(case=case, label=f"rows={rows} N={hidden}", kind="rows")


def _attention_point(spec: OpSpec, *, b: int, h: int, hkv: int, sq: int, sk: int, d: int, causal: bool,
                     dtype: str) -> Point:
    layouts = {i.name: "contiguous" for i in spec.inputs}
    params = {**spec.defaults(), "causal": causal}
    case = Case(op=spec.name, dtype=dtype, dims={"B": b, "H": h, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": d},
                layouts=layouts, params=params, seed=0)
    if sq == 1:
        label = f"decode B={b} H={h}/{hkv} Sk={sk} D={d}"
        kind = "decode"
    else:
        label = f"B={b} H={h} S={sq} D={d}" + (" causal" if causal else "")
        kind = "prefill"
    return Point(case=case, label=label, kind=kind)


def rows_points(spec: OpSpec, *, quick: bool) -> list[Point]:
    """A row op's default (or ``quick``) sweep."""
    if quick:
        return [_rows_point(spec, r, n, dt) for r, n, dt in ROW_QUICK]
    points = [_rows_point(spec, r, n, "bfloat16") for r in ROW_ROWS for n in ROW_HIDDEN]
    for dt in ("float16", "float32"):
        points += [_rows_point(spec, r, n, dt) for r in ROW_SUBSET_ROWS for n in ROW_SUBSET_HIDDEN]
    return points


def attention_points(spec: OpSpec, *, quick: bool) -> list[Point]:
    """Attention's default (or ``quick``) sweep: prefill, causal and not, and grouped-query decode."""
    dtypes = ("bfloat16",) if quick else ("bfloat16", "float16")
    heads_dims = (128,) if quick else (64, 128)
    seqs = (1024, 4096) if quick else ATTENTION_PREFILL_S
    decode_sk = (4096, 32768) if quick else ATTENTION_DECODE_SK
    points = []
    for dt in dtypes:
        for d in heads_dims:
            for s in seqs:
                b = max(1, ATTENTION_TOKENS // s)
                for causal in (False, True):
                    points.append(_attention_point(spec, b=b, h=ATTENTION_HEADS, hkv=ATTENTION_HEADS, sq=s, sk=s,
                                                   d=d, causal=causal, dtype=dt))
        for sk in decode_sk:  # Sq=1: top-left causal would see one key, so decode is non-causal
            points.append(_attention_point(spec, b=ATTENTION_DECODE_BATCH, h=ATTENTION_HEADS,
                                           hkv=ATTENTION_DECODE_KV_HEADS, sq=1, sk=sk, d=128, causal=False,
                                           dtype=dt))
    return points


def default_points(spec: OpSpec, *, quick: bool = False, dtypes: Iterable[str] | None = None,
                   rows: Sequence[int] | None = None, hidden: Sequence[int] | None = None) -> list[Point]:
    """The sweep of ``spec``: its shape's default (or ``quick``) points, filtered by ``dtypes``.

    ``rows`` and ``hidden`` replace the row-op grid (every dtype asked for on
    the whole replaced grid); they are ignored for attention.
    """
    if spec.name not in OPS:
        raise ValueError(f"unknown op {spec.name!r}")
    wanted = None if dtypes is None else tuple(dtypes)
    if wanted is not None:
        unknown = [d for d in wanted if d not in DTYPES]
        if unknown:
            raise ValueError(f"unknown dtype(s) {unknown}; known: {', '.join(DTYPES)}")
    for name, values in (("rows", rows), ("hidden", hidden)):
        if values is not None and (not values or any(not isinstance(v, int) or v < 1 for v in values)):
            raise ValueError(f"{name} must be positive ints, got {values!r}")
    points = spec.shape.sweep(spec, quick=quick, rows=None if rows is None else tuple(rows),
                              hidden=None if hidden is None else tuple(hidden), dtypes=wanted)
    if wanted is not None:
        points = [p for p in points if p.dtype in wanted]
    return points


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def _shrunk_dims(case: Case, limit: int) -> dict[str, Any]:
    """Dims of a case whose inputs have at most ``limit`` elements each (leading dims shrunk)."""
    dims = dict(case.dims)
    biggest = lambda d: max(math.prod(s) for s in replace(case, dims=d).shapes().values())
    if "lead" in dims:
        lead = list(dims["lead"])
        while biggest({**dims, "lead": tuple(lead)}) > limit and any(x > 1 for x in lead):
            i = max(range(len(lead)), key=lambda j: lead[j])
            lead[i] = max(1, lead[i] // 2)
        dims["lead"] = tuple(lead)
        return dims
    for key in ("B", "Sq", "Sk"):  # attention: batch first, then the sequences
        while biggest(dims) > limit and dims[key] > 1:
            dims[key] = max(1, dims[key] // 2)
    return dims


def _tile(small: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    reps = [math.ceil(full / part) for full, part in zip(shape, small.shape)]
    out = small.repeat(*reps) if any(r > 1 for r in reps) else small
    return out[tuple(slice(0, n) for n in shape)].contiguous()


def bench_inputs(case: Case, device: str | torch.device, *, limit: int = MATERIALIZE_LIMIT) -> dict[str, torch.Tensor]:
    """Contiguous inputs of ``case`` on ``device``: materialized, tiled from a smaller case when large."""
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit!r}")
    if any(v != "contiguous" for v in case.layouts.values()):
        raise ValueError("bench_inputs makes contiguous inputs only; use materialize for other layouts")
    full = case.shapes()
    if max(math.prod(s) for s in full.values()) <= limit:
        return materialize(case, str(device))
    small_case = replace(case, dims=_shrunk_dims(case, limit))
    small = materialize(small_case, str(device))
    return {name: _tile(t, full[name]) for name, t in small.items()}
