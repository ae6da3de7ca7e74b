"""Hypothesis strategies shared by the properties, the audit and the benchmarks.

``cases(op)`` draws a :class:`~fuseaudit.case.Case`: shapes (one row to many;
hidden sizes that are and are not powers of two, below and above one block;
2-D to 4-D), a dtype, a layout per input drawn independently, a value regime,
the op's keyword parameters and a seed for the values.  Sizes are bounded by a
size profile: ``"ci"`` keeps Triton's CPU interpreter quick, ``"gpu"`` is
larger.  Every choice is drawn so that it shrinks towards the simple case:
few rows, small N, float32, contiguous, normal values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from .case import DTYPES, LAYOUTS, Case, can_transpose
from .catalog import OpSpec, get_op
from .shapes import ATTENTION


@dataclass(frozen=True)
class SizeProfile:
    """Bounds on the drawn sizes."""

    name: str
    max_rows: int  # product of the leading dims
    max_n: int  # hidden size
    max_seq: int  # attention Sq and Sk
    max_batch_heads: int  # attention B * H
    max_elements: int  # rows * N


SIZE_PROFILES = {
    "ci": SizeProfile("ci", max_rows=64, max_n=5000, max_seq=48, max_batch_heads=4,
                      max_elements=1 << 17),
    "dev": SizeProfile("dev", max_rows=256, max_n=12289, max_seq=96, max_batch_heads=8,
                       max_elements=1 << 20),
    "gpu": SizeProfile("gpu", max_rows=4096, max_n=70000, max_seq=1100, max_batch_heads=32,
                       max_elements=1 << 24),
}


def size_profile(name: str | None = None) -> SizeProfile:
    """The named size profile, else ``$FUSEAUDIT_PROFILE``, else ``ci``."""
    name = name or os.environ.get("FUSEAUDIT_PROFILE") or "ci"
    try:
        return SIZE_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown size profile {name!r}; known: {', '.join(SIZE_PROFILES)}") from None


# Hidden sizes worth hitting on purpose: around powers of two and the block
# caps of typical kernels (1024, 4096, 8192), plus Llama-ish widths.
_INTERESTING_N = (1, 2, 3, 7, 16, 31, 64, 100, 127, 128, 129, 255, 257, 1000, 1023, 1024, 1025,
                  2047, 2049, 4095, 4096, 4097, 5120, 8191, 8193, 11008, 14336, 16385, 32769, 65537)
_HEAD_DIMS = ATTENTION.head_dims


def dtypes(allowed: tuple[str, ...] | None = None) -> st.SearchStrategy[str]:
    """float32 first so that shrinking ends on the most precise dtype."""
    order = [d for d in ("float32", "bfloat16", "float16") if allowed is None or d in allowed]
    return st.sampled_from(order)


def layouts(allowed: tuple[str, ...] | None = None) -> st.SearchStrategy[str]:
    return st.sampled_from([lay for lay in LAYOUTS if allowed is None or lay in allowed])


@st.composite
def hidden_sizes(draw: st.DrawFn, max_n: int) -> int:
    picks = [n for n in _INTERESTING_N if n <= max_n]
    return draw(st.one_of(st.integers(1, min(max_n, 300)), st.sampled_from(picks), st.integers(1, max_n)))


@st.composite
def row_dims(draw: st.DrawFn, profile: SizeProfile) -> dict[str, Any]:
    """``lead`` (0 to 3 leading dims, 1-D to 4-D tensors) and ``N``."""
    n = draw(hidden_sizes(profile.max_n))
    ndim = draw(st.integers(1, 3))  # leading dims; 0 is covered by N-only (1-D) below
    lead: list[int] = []
    budget = max(1, min(profile.max_rows, profile.max_elements // n))
    for _ in range(ndim):
        size = draw(st.integers(1, max(1, min(budget, 40))))
        lead.append(size)
        budget = max(1, budget // size)
    if draw(st.booleans()) and len(lead) == 1 and lead[0] == 1:
        lead = []  # a plain 1-D tensor of N elements
    return {"lead": tuple(lead), "N": n}


@st.composite
def attention_dims(draw: st.DrawFn, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> dict[str, Any]:
    """Batch, heads, kv-heads dividing heads, independent Sq and Sk, head dim (one of ``head_dims`` if given)."""
    hkv = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([1, 2, 4]))
    h = hkv * groups
    b = draw(st.integers(1, max(1, profile.max_batch_heads // h)))
    seq = st.one_of(st.integers(1, min(profile.max_seq, 40)), st.integers(1, profile.max_seq))
    dims = {"B": b, "H": h, "Hkv": hkv, "Sq": draw(seq), "Sk": draw(seq), "D": draw(st.sampled_from(_HEAD_DIMS))}
    if head_dims is not None:
        dims["D"] = draw(st.sampled_from(sorted(head_dims)))
    return dims


@st.composite
def cases(
    draw: st.DrawFn,
    op: str | OpSpec,
    *,
    profile: str | None = None,
    dtypes_allowed: tuple[str, ...] | None = None,
    layouts_allowed: tuple[str, ...] | None = None,
    head_dims: tuple[int, ...] | None = None,
) -> Case:
    """A :class:`Case` of ``op``: the one strategy behind tests, audits and benchmarks.

    ``dtypes_allowed`` / ``layouts_allowed`` / ``head_dims`` restrict the draw
    to what a target declares it supports.
    """
    spec = get_op(op) if isinstance(op, str) else op
    size = size_profile(profile)
    dims = draw(spec.shape.draw(size, head_dims))
    partial = Case(op=spec.name, dtype="float32", dims=dims, layouts={})
    chosen = {}
    for name, shape in partial.shapes().items():
        # a vector or a single row has no second dim to swap: its non-unit stride is "strided"
        allowed = tuple(lay for lay in LAYOUTS if lay != "transposed" or can_transpose(shape))
        if layouts_allowed is not None:
            allowed = tuple(lay for lay in allowed if lay in layouts_allowed) or ("contiguous",)
        chosen[name] = draw(layouts(allowed))
    params = {p.name: draw(st.sampled_from(p.choices)) for p in spec.params}
    return Case(
        op=spec.name,
        dtype=draw(dtypes(dtypes_allowed)),
        dims=dims,
        layouts=chosen,
        regime=draw(st.sampled_from(spec.regimes)),
        params=params,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


__all__ = ["DTYPES", "SIZE_PROFILES", "SizeProfile", "attention_dims", "cases", "dtypes",
           "hidden_sizes", "layouts", "row_dims", "size_profile"]
