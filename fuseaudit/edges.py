"""The edge phase: a small deterministic set of cases every audit runs before the search.

A random search finds what is common and shrinks it; it rarely draws what a
kernel's limits are made of.  :func:`edge_cases` builds, from the catalog
entry alone, cases that cross those limits whatever the profile's bounds:

* every dtype, every value regime of the op, every layout of every input
  (a storage offset, a stride) at least once;
* each non-finite regime (``-inf`` masks, NaN and ``+inf``) again on four
  rows (every row pattern: a fully masked row, a masked prefix of whole
  tiles, ...) of a model width, past any single tile;
* for row ops the widths real models use and kernels switch at (8192,
  11008, 14336, one past 65536), each on one or two rows, and just past the
  search's own bound; more rows than one program's tile (65, and 300 where
  the profile allows), an odd count, a single row;
* for attention ``Sq != Sk`` both ways, ``Sq = 1`` (decode), grouped-query
  heads, every head dim, causal and not.

A failing edge case is shrunk by :func:`shrink` (fewer rows, a narrower row,
contiguous inputs, float32, normal values, while the property still fails),
and reported and replayed as the search's minimal cases are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Callable

from .case import LAYOUTS, NON_FINITE_REGIMES, Case, can_transpose
from .catalog import OpSpec
from .strategies import SIZE_PROFILES

# Row widths worth one case each: where models sit and kernels change strategy.
MODEL_WIDTHS = (8192, 11008, 14336, 65537)
ROW_COUNTS = (65, 300)  # past a 64-row tile, and well past it
SEED = 9001


def row_edge_dims(max_n: int, max_rows: int) -> list[dict[str, Any]]:
    """The row ops' edge dims (:data:`fuseaudit.shapes.ROWS`)."""
    dims = [{"lead": (1,), "N": 1}, {"lead": (3, 5), "N": 127}, {"lead": (), "N": 1000}]
    dims.append({"lead": (2,), "N": max_n + 1})  # just past what the search draws
    dims += [{"lead": (2 if n < 65536 else 1,), "N": n} for n in MODEL_WIDTHS]
    dims += [{"lead": (rows,), "N": 64 if rows > 64 else 33} for rows in ROW_COUNTS if rows <= max(max_rows, 65)]
    dims.append({"lead": (7, 3), "N": 4097})
    return dims


def attention_edge_dims(all_head_dims: Sequence[int], head_dims: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Attention's edge dims (:data:`fuseaudit.shapes.ATTENTION`): one case per head dim, cycling the sequences.

    ``head_dims``, the target's declared ones, replace the head dims in turn.
    """
    shapes = [(1, 4, 1, 1, 37), (2, 4, 2, 33, 17), (1, 2, 2, 17, 33), (1, 8, 2, 64, 64)]
    out = []
    for i, d in enumerate(all_head_dims):
        b, h, hkv, sq, sk = shapes[i % len(shapes)]
        out.append({"B": b, "H": h, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": head_dims[i % len(head_dims)] if head_dims
                    else d})
    return out


def edge_cases(spec: OpSpec, *, profile: str = "ci", dtypes: list[str] | None = None,
               layouts: list[str] | None = None, head_dims: list[int] | None = None) -> list[Case]:
    """The edge set of ``spec`` within the declared support (dtypes, layouts, head dims)."""
    size = SIZE_PROFILES[profile]
    dims_list = spec.shape.edge_dims(size, head_dims)
    dtype_order = [d for d in ("float32", "bfloat16", "float16") if not dtypes or d in dtypes]
    layout_order = [lay for lay in LAYOUTS if not layouts or lay in layouts] or ["contiguous"]
    cases = []
    for i, dims in enumerate(dims_list):
        probe = Case(op=spec.name, dtype="float32", dims=dims, layouts={})
        chosen = {}
        for j, (name, shape) in enumerate(probe.shapes().items()):
            fits = [lay for lay in layout_order if lay != "transposed" or can_transpose(shape)] or ["contiguous"]
            chosen[name] = fits[(i + j) % len(fits)]  # every layout of every input comes round
        cases.append(Case(
            op=spec.name,
            dtype=dtype_order[i % len(dtype_order)],
            dims=dims,
            layouts=chosen,
            regime=spec.regimes[i % len(spec.regimes)],
            params={p.name: p.choices[i % len(p.choices)] for p in spec.params},
            seed=SEED + i,
        ))
    wide = {"lead": (4,), "N": MODEL_WIDTHS[-2]}
    for j, regime in enumerate(r for r in spec.regimes if r in NON_FINITE_REGIMES):
        cases.append(Case(op=spec.name, dtype=dtype_order[j % len(dtype_order)], dims=wide,
                          layouts={n: "contiguous" for n in spec.input_names}, regime=regime,
                          params=spec.defaults(), seed=SEED + len(cases)))
    return cases


def _with_size(case: Case, key: str | int, value: int) -> Case:
    dims = dict(case.dims)
    if isinstance(key, int):
        lead = list(dims["lead"])
        lead[key] = value
        dims["lead"] = tuple(lead)
    else:
        dims[key] = value
    return replace(case, dims=dims)


def _simpler_kinds(case: Case) -> Iterator[Case]:
    """One step towards the plainest case in each respect but size."""
    d = case.dims
    if "Hkv" in d and d["Hkv"] > 1:
        yield replace(case, dims={**d, "Hkv": 1, "H": d["H"] // d["Hkv"]})
    for name, lay in case.layouts.items():
        if lay != "contiguous":
            yield replace(case, layouts={**case.layouts, name: "contiguous"})
    if case.dtype != "float32":
        yield replace(case, dtype="float32")
    if case.regime != "normal":
        yield replace(case, regime="normal")
    if case.seed:
        yield replace(case, seed=0)


def shrink(case: Case, fails: Callable[[Case], bool], *, budget: int = 60) -> Case:
    """A simpler case on which ``fails`` still holds: each size bisected down, then plainer layouts, dtype, values.

    Deterministic, at most ``budget`` calls of ``fails``; ``case`` must fail.
    """
    calls = [0]

    def still(candidate: Case) -> bool:
        if calls[0] >= budget:
            return False
        calls[0] += 1
        return fails(candidate)

    d = case.dims
    keys: list[str | int] = ["N", *range(len(d["lead"]))] if "lead" in d else ["B", "Sq", "Sk"]
    for key in keys:
        hi = d[key] if isinstance(key, str) else d["lead"][key]
        if hi <= 1:
            continue
        if still(_with_size(case, key, 1)):
            case = _with_size(case, key, 1)
            continue
        lo = 1  # passes; hi fails: the smallest failing size lies in (lo, hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if still(_with_size(case, key, mid)):
                hi = mid
            else:
                lo = mid
        case = _with_size(case, key, hi)
        d = case.dims
    tried: set[str] = set()
    progress = True
    while progress:
        progress = False
        for candidate in _simpler_kinds(case):
            key = candidate.to_json()
            if key in tried:
                continue
            tried.add(key)
            if still(candidate):
                case, progress = candidate, True
                break
    return case
