"""Row addressing shared by every row-wise kernel: any leading dims, any strides.

Every op of the catalog works on the last dim ("a row") of tensors shaped
``(..., N)``.  The inputs may be strided views: rows padded then sliced, a
transposed tensor whose last dim is not unit-stride, an expanded (stride-0)
dim, a storage offset.  Copying them to contiguous memory would cost a launch
and a round trip through memory, so the kernels address them in place.

The host side (:func:`row_layout`) folds the leading dims into at most three
(``D0, D1, D2``), merging neighbours only where *every* tensor allows it, and
hands each tensor's strides for those three dims plus its column stride to the
kernel.  Inside a kernel :func:`row_offsets` turns flat row indices back into
element offsets::

    row r  ->  (i0, i1, i2) = (r // (D1*D2), (r // D2) % D1, r % D2)
    offset =  i0*S0 + i1*S1 + i2*S2

Triton specialises integer arguments equal to 1, so a contiguous last dim
(column stride 1) still gets vectorised loads, and on divisibility by 16;
rows whose strides are multiples of 8 or 4 only (a width of 3000) are told
so through ``ALIGN`` (:func:`row_alignment`).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_LEADING_DIMS = 3


class RowLayout(NamedTuple):
    """Leading dims folded to three, and per tensor ``(S0, S1, S2, SN)`` strides."""

    rows: int
    dims: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensors(op: str, **tensors: torch.Tensor) -> None:
    """Raise a clear error for inputs no reference kernel can take.

    All tensors must be floating point of one supported dtype, on one device,
    and on a CUDA device unless Triton's interpreter is on.
    """
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but {first_name} is {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"{op}: {name} is on {t.device}; the Triton kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 to run them on the CPU)"
            )


def check_row_shapes(op: str, x: torch.Tensor, residual: torch.Tensor | None = None,
                     **vectors: torch.Tensor) -> int:
    """Check ``x`` is ``(..., N)``, ``residual`` (if any) has x's shape and each vector is ``(N,)``; return N."""
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dim (the hidden dim), got a scalar")
    n = x.shape[-1]
    for name, v in vectors.items():
        if v.dim() != 1 or v.shape[0] != n:
            raise ValueError(f"{op}: {name} must have shape ({n},), got {tuple(v.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}"
        )
    return n


def row_layout(shape: torch.Size | tuple[int, ...], *tensors: torch.Tensor) -> RowLayout:
    """Fold the leading dims of ``shape`` (shared by ``tensors``) into three.

    Each tensor must have exactly ``shape`` (a 1-D tensor of the hidden size is
    a "vector" and is not passed here).  Two neighbouring leading dims merge
    when, for every tensor, the outer stride equals inner stride times inner
    size, which is exactly when one flat index can walk both.  Layouts are
    cached by shape and strides: a decode loop asks for the same few.
    """
    for t in tensors:
        if t.shape != shape:
            raise ValueError(f"expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return _fold(tuple(shape), tuple(t.stride() for t in tensors))


@functools.lru_cache(maxsize=4096)
def _fold(shape: tuple[int, ...], tensor_strides: tuple[tuple[int, ...], ...]) -> RowLayout:
    sizes = list(shape[:-1])
    strides = [list(st[:-1]) for st in tensor_strides]
    i = len(sizes) - 2
    while i >= 0:
        if sizes[i] == 1 or sizes[i + 1] == 1 or all(
            s[i] == s[i + 1] * sizes[i + 1] for s in strides
        ):
            # size-1 dims merge with anything; keep the stride of the non-trivial one
            for s in strides:
                s[i] = s[i + 1] if sizes[i] == 1 else s[i] if sizes[i + 1] == 1 else s[i + 1]
            sizes[i] *= sizes[i + 1]
            del sizes[i + 1]
            for s in strides:
                del s[i + 1]
        i -= 1
    if len(sizes) > MAX_LEADING_DIMS:
        raise NotImplementedError(
            f"leading dims {tuple(shape[:-1])} with these strides fold to {len(sizes)} "
            f"independent dims; the kernels address at most {MAX_LEADING_DIMS}"
        )
    # Pad at the end: the usual single leading dim becomes (rows, 1, 1), and
    # Triton's specialisation of arguments equal to 1 then removes both
    # divisions of row_offsets (they sat in front of every program's first load).
    pad = MAX_LEADING_DIMS - len(sizes)
    sizes = sizes + [1] * pad
    rows = 1
    for n in sizes:
        rows *= n
    per_tensor = tuple(
        (*tuple(s + [0] * pad), st[-1]) for s, st in zip(strides, tensor_strides)
    )
    return RowLayout(rows, (sizes[0], sizes[1], sizes[2]), per_tensor)  # type: ignore[arg-type]


@triton.jit
def row_offsets(rows, D1, D2, S0, S1, S2, ALIGN: tl.constexpr):
    """Element offset of the first element of each row in ``rows`` (int64), a multiple of ``ALIGN``.

    ``ALIGN`` is what the host knows divides every offset (see
    :func:`row_alignment`); told to the compiler, it keeps 16-byte vector
    loads that Triton's own specialisation would miss.  The bias/gated
    kernels pass 1 (no claim).
    """
    rows = rows.to(tl.int64)
    i2 = rows % D2
    rest = rows // D2
    t0 = (rest // D1) * S0
    t1 = (rest % D1) * S1
    t2 = i2 * S2
    if ALIGN > 1:
        # Each term, not the sum: with D1 = D2 = 1 (Triton specialises them)
        # t1 and t2 fold to 0 and the sum into t0, dropping a hint on the sum.
        t0 = tl.multiple_of(t0, ALIGN)
        t1 = tl.multiple_of(t1, ALIGN)
        t2 = tl.multiple_of(t2, ALIGN)
    return t0 + t1 + t2


@triton.jit
def aligned_width(N, ALIGN: tl.constexpr):
    """``N`` itself, written so that the compiler knows ``ALIGN`` divides it.

    Column masks ``cols < N`` then hold ALIGN lanes alike, which vector
    loads and stores need (see :func:`row_alignment`).
    """
    if ALIGN > 1:
        N = N // ALIGN * ALIGN
    return N


@triton.jit
def out_row_offsets(rows, N, ALIGN: tl.constexpr):
    """Offset of each row in a contiguous ``(rows, N)`` output (int64), a multiple of ``ALIGN``."""
    offsets = rows.to(tl.int64) * N
    if ALIGN > 1:
        offsets = tl.multiple_of(offsets, ALIGN)
    return offsets


def row_alignment(n: int, layout: RowLayout) -> int:
    """The largest power of two up to 16 dividing ``n`` and every row stride of every tensor.

    Triton specialises an integer argument on divisibility by 16 only, so a
    row stride of 3000 elements (6000 bytes in float16, a multiple of 16
    bytes) reads as unaligned and every load of the row would be a scalar
    load.  The row kernels take this divisor as ``ALIGN`` and tell the
    compiler: ``tl.multiple_of`` on the row offsets, and
    :func:`aligned_width` so that the column masks hold ALIGN lanes alike.
    ``properties/test_compile_hopper.py`` checks the 16-byte loads in the
    PTX.  Strides of size-1 dims only make the divisor smaller; stride-0
    dims do not change it.
    """
    g = n
    for s0, s1, s2, _ in layout.strides:
        g = math.gcd(g, s0, s1, s2)
    return min(g & -g, 16) if g else 16


@triton.jit
def load_pair(x_row, r_row, cols, mask, sxn, srn, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of a row of ``x`` and of the residual in float32, 0 where masked (``x`` twice without one).

    ``x_row`` and ``r_row`` point to the rows; they may be ``[BLOCK_M, 1]``
    and ``cols`` ``[1, BLOCK_N]``: a tile.  Apart from :func:`add_residual`
    so that a kernel can issue every load of a row (its block and its tail)
    before the first store of ``h``: warps issue in order, so a load after
    the store would wait for memory a second time.
    """
    x = tl.load(x_row + cols.to(tl.int64) * sxn, mask=mask, other=0.0).to(tl.float32)
    r = x
    if HAS_RESIDUAL:
        r = tl.load(r_row + cols.to(tl.int64) * srn, mask=mask, other=0.0).to(tl.float32)
    return x, r


@triton.jit
def add_residual(x, r, H, out, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """``h = x + residual`` rounded to ``H``'s dtype as eager's sum is, stored to ``H``; ``x`` without one.

    ``H`` is a contiguous output whose row starts at offset ``out``; what is
    returned (and normalised) is the rounded ``h`` in float32.
    """
    if HAS_RESIDUAL:
        h = to_dtype(x + r, H.dtype.element_ty)
        tl.store(H + out + cols, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def load_chunk(X, R, H, x_row, r_row, out, cols, mask, sxn, srn, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of a row of ``x`` in float32, 0 where masked (``x_row``: a pointer to the row).

    With a residual it returns ``h = x + residual`` instead, after storing it
    to ``H`` (see :func:`add_residual`).
    """
    x, r = load_pair(x_row, r_row, cols, mask, sxn, srn, HAS_RESIDUAL)
    return add_residual(x, r, H, out, cols, mask, HAS_RESIDUAL)


@triton.jit
def load_pair_block(x_row, r_row, cols, N, sxn, srn, HAS_RESIDUAL: tl.constexpr):
    """Pass 1 of a looped kernel: columns ``cols`` of a row of ``x`` and of the residual, 0 from ``N`` on.

    The values come back in their own dtype, not converted: the looped
    kernels load block i + 1 before they use block i, and a conversion here
    would wait for the load.  Without a residual ``x`` is read again in pass
    2, so L2 is asked to keep it; with one, ``h`` is read again instead and
    ``x`` and the residual go first.

    Each pass loads its first block ahead before the loop whether or not it
    prefetches: without prefetching nothing uses that load and the compiler
    drops it (sm_90 PTX: the same loads as a kernel without it), while a name
    defined only under a constexpr ``if`` is not carried into the loop by
    Triton 3.9.
    """
    mask = cols < N
    if HAS_RESIDUAL:
        x = tl.load(x_row + cols.to(tl.int64) * sxn, mask=mask, other=0.0, eviction_policy="evict_first")
        r = tl.load(r_row + cols.to(tl.int64) * srn, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_row + cols.to(tl.int64) * sxn, mask=mask, other=0.0, eviction_policy="evict_last")
        r = x
    return x, r


@triton.jit
def next_pair_block(x_row, r_row, x_next, r_next, cols, N, sxn, srn, HAS_RESIDUAL: tl.constexpr,
                    BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """A pass-1 loop's step: its block at ``cols`` (as ``load_pair_block``) and the blocks for the next step.

    With ``PREFETCH >= 1`` the block at ``cols`` is the one the step before
    loaded (``x_next``, ``r_next``), and the block ``BLOCK`` columns on is
    loaded now, in flight while this one is used; without, the block at
    ``cols`` is loaded here and ``x_next``, ``r_next`` pass through.  Returns
    ``x, r, x_next, r_next``.
    """
    if PREFETCH >= 1:
        x, r = x_next, r_next
        x_next, r_next = load_pair_block(x_row, r_row, cols + BLOCK, N, sxn, srn, HAS_RESIDUAL)
    else:
        x, r = load_pair_block(x_row, r_row, cols, N, sxn, srn, HAS_RESIDUAL)
    return x, r, x_next, r_next


@triton.jit
def vector_sums(v, VECTORS: tl.constexpr, VEC: tl.constexpr):
    """``v`` (a 1-D block) summed over each run of ``VEC`` neighbours if ``VECTORS``, else ``v`` itself.

    A thread holds runs of 16 bytes of a loaded row (8 half-precision or 4
    float32 elements, its vector loads), so with ``VEC`` that wide the sums
    stay within threads: a running sum per vector rather than per element,
    an eighth of the registers in half precision (a pass 1 in wide blocks).
    """
    if VECTORS:
        v = tl.sum(tl.reshape(v, [v.shape[0] // VEC, VEC]), axis=1)
    return v


@triton.jit
def load_back_block(x_row, h_row, cols, N, sxn, HAS_RESIDUAL: tl.constexpr, EVEN: tl.constexpr = False):
    """Pass 2 of a looped kernel: columns ``cols`` of the row it normalises, 0 outside ``[0, N)``.

    That row is ``h`` (contiguous, at ``h_row``) with a residual, ``x``
    without one; this is its last read, so it goes first from L2.  Pass 2
    walks the row backwards and loads the block before this one ahead of
    time, hence the mask below 0.  ``EVEN``: ``cols`` lie within the row (see
    :func:`even_blocks`; not for a block loaded ahead), no mask.
    """
    mask = None if EVEN else (cols >= 0) & (cols < N)
    other = None if EVEN else 0.0
    if HAS_RESIDUAL:
        x = tl.load(h_row + cols, mask=mask, other=other, eviction_policy="evict_first")
    else:
        x = tl.load(x_row + cols.to(tl.int64) * sxn, mask=mask, other=other, eviction_policy="evict_first")
    return x


@triton.jit
def load_vector(V, cols, N, svn, EVEN: tl.constexpr = False):
    """Columns ``cols`` of a hidden-size vector (a weight, a bias) in its own dtype, 0 from ``N`` on.

    ``EVEN``: every column of ``cols`` is below ``N`` (see :func:`even_blocks`), so no mask.
    """
    return tl.load(V + cols * svn, mask=None if EVEN else cols < N, other=None if EVEN else 0.0)


def even_blocks(n: int, *blocks: int) -> bool:
    """Whether each of ``blocks`` divides the row width ``n``: a looped kernel's ``EVEN``.

    Its blocks then end at the row's end, and the loads and stores of the
    blocks it uses at once (not those it loads ahead) need no column mask,
    nor the reductions a ``where`` for the lanes past ``N``.
    """
    return all(n % b == 0 for b in blocks)


# Triton's CPU interpreter truncates float32 -> bfloat16 (and mangles
# subnormals) where the GPU's cvt.rn rounds to nearest even.  Under the
# interpreter only, round the bits by hand.
_ROUND_BF16_BY_HAND = tl.constexpr(interpreting())


@triton.jit
def to_dtype(v, dtype: tl.constexpr):
    """Round float32 ``v`` to ``dtype`` to nearest even, also under the interpreter."""
    out = v.to(dtype)
    if _ROUND_BF16_BY_HAND:
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            out = tl.where(v == v, rounded, out)  # NaN stays NaN
    return out


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1
