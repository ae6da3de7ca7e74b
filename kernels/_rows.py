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
        # t1 and t2 fold to 0 and the sum folds into t0, which would drop a
        # hint set on the sum: the row's loads were 2 bytes wide at every
        # odd row stride (see row_alignment).
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

    Triton specialises an integer argument on being divisible by 16, so a
    row stride of 3000 elements (6000 bytes in float16, itself a multiple of
    16 bytes) reads as "not aligned" and every load of the row becomes a
    scalar 2-byte load.  The whole-row kernels take this divisor as
    ``ALIGN`` and pass it on to the compiler: ``tl.multiple_of`` on the row
    offsets, and :func:`aligned_width` (``N // ALIGN * ALIGN``, the same
    value) so that the column masks are known to hold ALIGN lanes alike.  Checked in the PTX by
    ``properties/test_compile_hopper.py`` (16-byte loads at N = 3000).
    H200, fp16, 16384 rows, µs before -> after
    (``reports/h200/bench-rows-split-final-fp16.txt`` -> ``bench-rows-align-fp16.txt``):
    layer_norm N = 3000 110.2 -> 56.3, softmax 147.6 -> 61.4, rms_norm
    N = 2500 78.9 -> 55.1; N = 7000 layer_norm 478 -> 127 (do_bench before,
    ``row-split-widths.txt``).  The looped kernels take it too since the
    twentieth session (``ALIGN = 1`` -> the divisor, bf16, event time after
    an L2 flush, µs, ``reports/h200/align-wide-session20.txt``): rms_norm
    16384 x 9000 394.3 -> 253.8, 1024 x 13000 39.8 -> 27.9, softmax 16384 x
    9000 355.5 -> 233.6, 16384 x 20008 829.7 -> 550.2, layer_norm 16384 x
    20008 892.0 -> 527.3, float32 16384 x 40004 2667.6 -> 1939.6,
    add_layer_norm 16384 x 40008 3505.5 -> 2326.8.  Those figures still
    read ``x`` 2 bytes at a time: the hint sat on the sum in
    :func:`row_offsets`, which folds away for a ``(rows, N)`` input (D1 =
    D2 = 1), so only the stores and the weight were 16 bytes wide (ncu on
    the H200: 78% of rms_norm 16384 x 9000's load sectors excessive).  With
    the hint on each term (twenty-first session, event µs after an L2
    flush, ``reports/h200/align-fold-session21.txt``): rms_norm 16384 x
    9000 253.6 -> 165.6, 16384 x 20008 471.1 -> 325.6, layer_norm 16384 x
    20008 527.7 -> 380.4, softmax 16384 x 20008 549.0 -> 374.8,
    add_layer_norm 16384 x 40008 2311.3 -> 1488.3, add_rms_norm 16384 x
    9000 442.3 -> 290.1.  The bias/gated kernels pass 1: not measured.
    Strides of size-1 dims (any value, never multiplied by more than 0)
    only make the divisor smaller; stride-0 dims do not change it.
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
    before the first store of ``h``: a store waits for the loads it
    depends on, and warps issue in order, so a load after it would wait for
    memory a second time (H200, 16384 rows, add_layer_norm bf16 N = 11008
    as 8192 + 4096: 377.7 -> 368.8 µs, ``reports/h200/h-store-order-session12.txt``).
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
    an eighth of the registers in half precision (see StatsBlock).
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
    nor the reductions a ``where`` for the lanes past ``N``: 10-16% of the
    instructions of layer_norm's two loops (sm_90 SASS, bf16, blocks of
    8192 in 32 warps).  H200, event µs after an L2 flush, masked -> not
    (``reports/h200/even-session23.txt``): layer_norm bf16 16384 x 32768
    637.3 -> 625.6, softmax bf16 16384 x 32768 555.9 -> 537.5, 1024 x 32768
    45.1 -> 41.5, rms_norm bf16 1024 x 32768 40.3 -> 39.7 (16384 x 32768,
    at the copy's speed either way, 503.7 -> 508.7).  Float32 softmax lost
    (see its wrapper) and keeps the masks.
    """
    return all(n % b == 0 for b in blocks)


# Widest row a program keeps whole in registers, in bytes of the input dtype:
# 16384 elements of float16/bfloat16, 8192 of float32.  Wider rows take the
# looped kernel, in blocks of half this unless a RowTuning field says other
# blocks (float32_wide, half_short, half_long).  On the H200 (bf16, 16384 rows) the
# looped kernel beat whole rows in registers at N = 32768 for every op
# (rms_norm 525 vs 587 µs, softmax 599 vs 1026 µs).  Tests lower it to reach
# that path with small rows (through _launch.retuned, as for every constant
# here a plan is built from: kept plans are not keyed by them).
MAX_FUSED_BYTES = 32768
# For short rows, one program takes about this many elements (several rows) ...
ROW_TILE = 2048
# ... but only while the grid keeps at least this many programs.
MIN_PROGRAMS = 1024
MIN_WARPS = 4
WIDE_WHOLE_ROW_WARPS = 32  # whole rows past MAX_FUSED_BYTES (RowTuning.fused_scale, float32_whole_from)
FLOAT32_WHOLE_MAX = 32768  # see RowTuning.float32_whole_from: 32 float32 registers a thread in 32 warps
# Triton's CPU interpreter pays per program, not per element: there, one
# program takes as many rows as fit in this many elements.
INTERPRETER_TILE = 1 << 20
# See RowTuning.uneven_block.
UNEVEN_MIN = 8192
# See TailSplit and _split_tail: rows whose power-of-two block is at most
# TAIL_MAX_BLOCK elements may be split, when there are at least TAIL_MIN_ROWS
# of them.  At decode sizes a split row's 4 warps
# are too few (H200, bf16, rows=8, N=5120: rms_norm 7.7 µs split against 6.7
# padded with 8 warps, softmax 7.5 against 6.7; bench-rows-bf16-session5.txt
# and bench-rows-bf16.txt).
TAIL_MAX_BLOCK = 8192
TAIL_MIN_ROWS = 1024
# A row held whole as a block plus a tail gets 2 x element size warps, more
# where that would leave a thread over this many elements (see split_warps).
SPLIT_MAX_PER_THREAD = 72
# See RowBlocks.early: launches of at most this many rows (no more programs
# than an H100/H200 has SMs) load the weight and bias with the row.
EARLY_VECTOR_ROWS = 128


class TailSplit(NamedTuple):
    """Which rows a kernel holds as a power-of-two block plus a tail block (see :func:`_split_tail`).

    Rows of at least ``min_n`` elements, when the tail is at most
    ``max_tail`` of the block in half precision, ``float32_max_tail`` in
    float32 (0.5: whenever the split saves registers, e.g. 3000 = 2048 +
    1024; 0.25: only when it saves at least 3/8 of them, e.g. 5120 = 4096 +
    1024; 0: never).
    """

    max_tail: float = 0.5
    float32_max_tail: float = 0.5
    min_n: int = 2048


class TwoBlocks(NamedTuple):
    """Rows of exactly ``2 * block`` elements, at least ``min_rows`` of them: the looped kernel in two blocks.

    With many rows in flight a row in two blocks beat the row held whole.
    H200, rows of 8192, event µs after an L2 flush, whole -> looped
    (``reports/h200/loop-ab*-session15.txt``, ``two-blocks-threshold-session15.txt``):
    at 16384 rows rms_norm bf16 135.0 -> 130.7 (4096, 8 warps, prefetch 1),
    fp16 135.5 -> 130.6, float32 264.5 -> 256.7 (4096, 16, 2), softmax
    float32 270.7 -> 256.8 (4096, 8, 1); at 8192 rows rms_norm bf16 69.7 ->
    69.2, float32 135.5 -> 132.5, softmax float32 140.1 -> 131.6.  Fewer rows
    lost for rms_norm (4096 rows: bf16 38.0 -> 38.6, float32 69.8 -> 70.7;
    1024: 13.8 -> 15.0), not for softmax in float32 (4096 rows 73.9 -> 70.6,
    2048 41.4 -> 39.5; at 1024 a tie, 24.3 -> 24.0, and 24.3 µs either way
    in ``fuseaudit bench``).  The residual variants, softmax in half
    precision, and rows of 4096 or 16384 elements lost or tied; once the
    looped softmax stored y evict-first, its half-precision rows of 16384
    won in two blocks of 8192 (see its TUNING).
    """

    min_rows: int
    block: int
    warps: int
    prefetch: int


class ManyRows(NamedTuple):
    """Many float32 rows (``min_rows``, at least ``min_n`` elements): each split over programs of a persistent launch.

    Program ``(g, s)`` holds chunk ``s`` (``chunk`` elements, ``warps``
    warps) of rows ``g, g + G, g + 2G, ...``, ``per_sm`` programs an SM,
    in one cooperative launch (see ``_coop.py``): every element is read
    once and kept in registers while the row's statistics are merged, where
    the looped kernel reads the row twice and rows of 256 KiB no longer
    stay in L2 for the second read.  Each program loads its next row before
    it waits for this one's partials.  H200, float32, event µs after an L2
    flush, looped -> split (``reports/h200/many-rows-*-session16.txt``):
    rms_norm in chunks of 8192, 8 warps, 2 programs an SM: 16384 x 65536
    2712.2 -> 2252.2 (copy 2009.8), 1024 x 65536 182.6 -> 149.0, 128 x
    65536 28.0 -> 25.5, 16384 x 40000 1521.2 -> 1436.2; add_rms_norm
    (4096, 8 warps, 2 an SM; 8192 in 8 warps did not fit two an SM)
    16384 x 65536 5166.6 -> 4598.2, 1024 x 40000 196.9 -> 188.0, but 128
    rows lost (44.2 -> 47.6).  The layer_norms lost or tied at every
    config tried (add_layer_norm 16384 x 65536: 4858.3 looped, 5012.5 at
    best split), and in bfloat16 the chunks that fit two programs an SM
    were too small to win (rms_norm 1024 x 65536: 97.1 against 86.5
    looped; ``pcoop-*-session16.txt``), softmax in float32 tied.
    """

    min_n: int
    chunk: int
    warps: int
    per_sm: int
    min_rows: int = 0


class HalfShort(NamedTuple):
    """Half-precision rows past the cap narrower than ``max_n``, ``min_rows`` or more: blocks of ``block`` in ``warps``.

    The plain norms' rows from 16385 columns (each op's tuning says how far,
    and what it measured): blocks of 8192 in 32 warps leave one program on
    each SM, where blocks of 4096 in fewer warps fit two and pad less.  With
    at most one row an SM (128 rows on an H200) the 32 warps a row won
    (H200, bf16, layer_norm 1 x 20000 7.5 µs in 8192 x 32 warps, 8.4 in
    4096 x 8; 128 rows 8.1 and 9.1; 256 rows 11.8 and 10.1;
    ``reports/h200/uneven-decode-session19.txt``).  Rows no wider than
    ``block`` keep the other rules.
    """

    max_n: int
    block: int
    warps: int
    min_rows: int


class HalfLong(NamedTuple):
    """Half-precision rows past the cap, ``min_n`` to ``max_n`` columns (0: any): blocks of ``block`` in ``warps``.

    (A tuning's ``float32_long`` rules give float32 rows that loop their blocks alike.)

    Wide rows move the most bytes per program: larger blocks in more warps
    keep more of a row in flight, and a row of 65536 in blocks of 32768 is
    two loads of 64 KiB.  ``prefetch`` is the looped kernel's
    ``RowBlocks.prefetch`` for these rows (None: the tuning's
    ``wide_prefetch``); ``few``, ``(max_rows, block, warps)``, replaces the
    blocks where there are at most ``max_rows`` rows (one program a row,
    each alone on an SM); ``lanes`` is ``RowBlocks.lanes``; with ``pads_as``
    the rule holds only rows that its blocks pad to no more columns than
    blocks of ``pads_as`` would.  A tuning lists such rules for ranges of
    widths that do not overlap (``RowTuning.half_long``); each op's tuning
    says what it measured and where a rule stops paying.
    """

    min_n: int
    block: int
    warps: int
    max_n: int = 0
    prefetch: int | None = None
    few: tuple[int, int, int] | None = None
    lanes: bool = False
    pads_as: int = 0

    def applies(self, n: int) -> bool:
        """Whether rows of ``n`` columns (past the cap, in the precision of the list holding it) take these blocks."""
        if self.pads_as and triton.cdiv(n, self.block) * self.block > triton.cdiv(n, self.pads_as) * self.pads_as:
            return False
        return self.min_n <= n and (not self.max_n or n <= self.max_n)


class NarrowLooped(NamedTuple):
    """``min_rows`` or more half-precision rows of ``min_n`` to ``max_n`` elements, which fit whole, looped over.

    ``BLOCK_N`` is the first of ``blocks`` that divides the row (no column
    masks, see :func:`even_blocks`); where none does, the row stays whole
    (masked blocks lost).  ``warps`` warps.  Held whole, such a row pads to
    a power of two and each reduction spans it all; a looped kernel compiled
    for the row's width keeps running statistics in each lane instead, as
    torch.compile's kernels do.  Each op's tuning says what it measured.
    """

    min_n: int
    max_n: int
    min_rows: int
    blocks: tuple[int, ...]
    warps: int


class PairedRows(NamedTuple):
    """Half-precision rows of exactly ``n`` elements, ``min_rows`` or more: two a program, ``warps`` warps.

    The tile rule (``ROW_TILE``, ``MIN_PROGRAMS``) gives such rows one
    program each, and every program loads the whole weight: as many bytes
    again as its row.  Two rows a program load it once for both.  Each op's
    tuning says what it measured; elsewhere two rows a program tied or lost.
    """

    n: int
    warps: int
    min_rows: int


class StatsBlock(NamedTuple):
    """Many half-precision rows of ``min_n`` to ``max_n`` elements that loop: pass 1 in blocks of ``block``.

    The looped kernel reads a row twice, its statistics first (pass 1),
    then again to normalise (pass 2), and counts on L2 to still hold the row
    for the second read.  With rows of 128 KiB (65536 elements) and two
    programs an SM, 264 rows in flight on an H200 outgrow what L2 keeps for
    them: ncu read 2.62 GB from DRAM for rms_norm bf16 16384 x 65536, whose
    x is 2.15 GB (layer_norm 2.84 GB; ``reports/h200/ncu-wide-session23.txt``).
    Pass 1 in wider blocks, summed a vector of each thread at a time (see
    :func:`vector_sums`), takes more registers, so one program an SM: half
    the rows in flight, each loaded in two 64 KiB halves at once.  H200,
    event µs after an L2 flush, blocks of 8192 in 32 warps -> pass 1 in
    blocks of 32768 (``reports/h200/lanes-session23.txt``, ``even-session23.txt``,
    ``wide-rule-session23.txt``): rms_norm bf16 16384 x 65536 1223.5 -> 1048.3,
    4096 x 65536 309.5 -> 274.0, 1024 x 65536 81.7 -> 79.9, but 256 x 65536
    25.7 -> 27.3 (too few rows to fill the SMs), 16384 x 40000 642.9 -> 836.0
    (those rows stayed in L2 anyway: 95% of copy before) and 8192 x 131072
    1339.0 -> 1470.7 (one such row an SM is already too many); layer_norm
    16384 x 65536 1314.8 -> 1182.1, fp16 1342.6 -> 1150.1.  Each op's tuning
    says where it applies.
    """

    min_n: int
    max_n: int
    block: int
    min_rows: int


class RowTuning(NamedTuple):
    """How one row kernel spreads a row over threads (each kernel file declares its own).

    ``elements_per_thread`` and ``max_warps`` size the whole-row kernel's
    programs; ``wide_warps`` is the looped kernel's.  Measured on the H200,
    bf16, 16384 rows: the norms prefer fewer warps than softmax (its max and
    exp-sum reductions want more threads per row), e.g. layer_norm at
    N = 14336 ran in 265 µs with 8 warps and 434 µs with 16.
    """

    elements_per_thread: int
    max_warps: int
    wide_warps: int
    # Half-precision rows are held whole up to fused_scale x MAX_FUSED_BYTES
    # (float32 rows past the cap: see float32_whole_from); those past
    # MAX_FUSED_BYTES get up to WIDE_WHOLE_ROW_WARPS warps.  2 for the
    # residual variants: their looped kernel re-reads two inputs, and on the H200 (bf16, 16384 x 32768)
    # whole rows in 32 warps beat it: add_rms_norm 1034 vs 1099 µs,
    # add_layer_norm 1122 vs 1208 µs (plain rms_norm: 590 vs 526, so it loops).
    fused_scale: int = 1
    # Half-precision rows wider than UNEVEN_MIN elements and not a power of two
    # would pad to the next power of two in registers; with uneven_block > 0
    # they take the looped kernel in blocks of uneven_block, uneven_warps warps.
    # H200, bf16, 16384 rows (reports/h200/row-configs-loop.txt): rms_norm
    # N=11008 184 µs looped (4096, 8 warps) vs 219 whole, N=14336 237 vs 247;
    # softmax (4096, 4 warps) 204 vs 286 and 272 vs 305.  The layer_norms and
    # add_rms_norm were fastest whole at every width measured, so they keep 0.
    uneven_block: int = 0
    uneven_warps: int = 0
    # (BLOCK_N, warps) for those uneven rows that this larger block pads to
    # no more columns than uneven_block does (softmax: 8192 in 8 warps for
    # rows of 12289 to 16383, e.g. 14336, two blocks rather than four);
    # None: uneven_block for all of them.  Each op's tuning says what it measured.
    uneven_large: tuple[int, int] | None = None
    # (max_n, BLOCK_N, warps), narrowest first: those uneven rows of at most
    # max_n columns that loop take these blocks instead of uneven_block and
    # uneven_warps (the first that applies); (): none.  Each op's tuning says
    # what it measured.
    uneven_narrow: tuple[tuple[int, int, int], ...] = ()
    # max_rows: those uneven rows, at most max_rows of them, held whole
    # instead, as a block of half their padded width plus a tail block (see
    # RowBlocks; 11008 = 8192 + 4096, 14336 = 8192 + 8192) in split_warps
    # warps (9000 = 8192 + 1024 in 4, those two in 8); None: they loop.  Each
    # op's tuning says what it measured.
    uneven_split: int | None = None
    # Rows that are not a power of two may be held whole as a power-of-two
    # block plus a smaller tail block (see RowBlocks, TailSplit); None: never.
    split_tail: TailSplit | None = None
    # float32 rows whose power-of-two block is at least this many elements, up
    # to FLOAT32_WHOLE_MAX, are held whole in WIDE_WHOLE_ROW_WARPS warps past
    # the cap; any other float32 row past the cap loops (0: all of them).
    # The looped kernel reads such a row twice, and rows of 128 KiB no
    # longer stay in L2 for the second read.  H200, float32, 16384 rows,
    # looped -> whole (reports/h200/row-fp32-whole-session8.txt): N = 32768
    # rms_norm 1192 -> 1022 µs (torch.compile 1002), add_rms_norm 2380 ->
    # 2067 (2144), layer_norm 1441 -> 1117 (1122), add_layer_norm 2663 ->
    # 2243 (2219); N = 16384 layer_norm 652 -> 596, but rms_norm 505 -> 541
    # and softmax lost at both widths (1372 -> 1592 at 32768).  Once the
    # looped kernel prefetched (RowBlocks.prefetch) add_layer_norm looped
    # faster (see its ADD_TUNING).
    float32_whole_from: int = 0
    # False: only float32 rows exactly as wide as their block are held whole
    # by float32_whole_from; rows that the block pads loop.
    float32_whole_padded: bool = True
    # float32_whole_from holds rows whole from this many rows on; fewer loop.
    float32_whole_min_rows: int = 0
    # (BLOCK_N, warps) of the looped kernel for float32 rows at least two
    # such blocks wide; None: half the cap in wide_warps warps, as for half
    # precision.  H200, softmax, float32, 16384 rows, do_bench
    # (reports/h200/softmax-wide-session9.txt): (8192, 16) against (4096, 8)
    # 1206 vs 1373 µs at N = 32768, 536 vs 597 at 16384, 2759 vs 2945 at
    # 65536; bfloat16 rows lost with it (657 vs 599 at 32768).
    float32_wide: tuple[int, int] | None = None
    # Half-precision rows past the cap that loop in smaller blocks (see
    # HalfShort); None: half the cap in wide_warps warps.
    half_short: HalfShort | None = None
    # The looped kernel's blocks for half-precision rows past the cap, by
    # width (see HalfLong; the first rule whose range holds the row); rows no
    # rule holds: half the cap in wide_warps warps.  Each op's tuning says
    # what it measured (the residual norms: blocks of 16384 in 16 warps from
    # 65536 columns).
    half_long: tuple[HalfLong, ...] = ()
    # The same for float32 rows that loop (HalfLong's rules, ``few`` and all;
    # rows no rule holds: float32_wide).  Each op's tuning says what it measured.
    float32_long: tuple[HalfLong, ...] = ()
    # (max_n, warps, min_rows): half-precision rows narrower than max_n, at
    # least min_rows of them, that loop in the default blocks (half the cap:
    # none of half_short, half_long, the uneven rules applies) take ``warps``
    # warps instead of wide_warps; None: wide_warps.  Each op's tuning says
    # what it measured.
    half_mid_warps: tuple[int, int, int] | None = None
    # The looped kernel's RowBlocks.prefetch in half precision, in float32.
    wide_prefetch: int = 0
    float32_wide_prefetch: int = 0
    # elements_per_thread for float32 rows held whole within the cap (MAX_FUSED_BYTES); 0: elements_per_thread.
    # Each op's tuning says what it measured.
    float32_elements_per_thread: int = 0
    # Rows of exactly two blocks that loop over them once there are enough of
    # them (see TwoBlocks), in half precision and in float32; None: those
    # rows follow the other rules.
    two_blocks: TwoBlocks | None = None
    float32_two_blocks: TwoBlocks | None = None
    # Many float32 rows this wide or wider are split over programs (see ManyRows); None: never.
    float32_many_rows: ManyRows | None = None
    # (min_rows, warps): float32 rows exactly as wide as the cap (8192), held
    # whole, get ``warps`` warps from min_rows rows on (before two_blocks takes
    # them, if it does); None: the elements_per_thread rule.
    float32_cap_warps: tuple[int, int] | None = None
    # Half-precision rows exactly this wide, held whole two a program (see PairedRows); None: the tile rule.
    paired_rows: PairedRows | None = None
    # Half-precision rows whose looped kernel takes pass 1 in wider blocks (see StatsBlock); None: BLOCK_N.
    stats_block: StatsBlock | None = None
    # Half-precision rows narrow enough to hold whole that loop instead, ranges of widths that do not overlap (see
    # NarrowLooped); (): none.
    half_looped: tuple[NarrowLooped, ...] = ()


class RowBlocks(NamedTuple):
    """How a row kernel is launched: ``BLOCK_M`` rows a program, ``BLOCK_N`` columns at a time.

    ``wide``: the looped kernel (one row a program, ``BLOCK_N < N``).
    Otherwise whole rows: ``BLOCK_N >= N``, or, with ``BLOCK_T > 0``, a
    full block of ``BLOCK_N`` columns plus a tail block of ``BLOCK_T``
    (``BLOCK_N < N <= BLOCK_N + BLOCK_T``).  A row of 5120 is then held as
    4096 + 1024 registers' worth instead of padding to 8192: fewer registers
    a row, more rows in flight on each SM.
    """

    block_m: int
    block_n: int
    num_warps: int
    wide: bool
    block_t: int = 0
    # Whole-row kernels: load the weight (and bias) together with the row
    # instead of after the reductions.  A program then waits for memory once,
    # not twice, which is what a decode-sized call costs; but the vectors
    # stay in registers across the reductions, and with many rows the lost
    # occupancy costs more.  H200, bf16, event time after an L2 flush
    # (reports/h200/row-experiments-session7.txt), late -> early: rms_norm
    # rows=1 N=4096 6.85 -> 5.63 µs (torch.compile 6.02), layer_norm rows=8
    # N=16384 8.16 -> 7.14 (10.59), add_layer_norm rows=64 N=4096 7.26 ->
    # 6.66 (7.31); at 16384 rows early lost up to 2x (layer_norm N=11008
    # 266 -> 473 µs, rms_norm N=16384 262 -> 356).  So: only up to
    # EARLY_VECTOR_ROWS rows.
    early: bool = False
    # The looped kernel: in how many of its two passes (0, 1 or 2) it loads
    # column block i + 1 before it uses block i.  Those loads are then in
    # flight while block i is reduced (a reduction is a barrier the loads do
    # not cross, and a store waits for its operands), where otherwise every
    # block waits for memory.  But two blocks are live at once, and where the
    # registers cost a program per SM it loses: H200, 16384 rows, event time
    # after an L2 flush, 0 -> 1 -> 2 passes, µs (reports/h200/wide-prefetch-
    # session13.txt): add_layer_norm bf16 N = 65536 2769 -> 2543 -> 2543,
    # layer_norm bf16 65536 1460 -> 1461 -> 1615 (128 -> 172 registers a
    # thread in 8 warps: 2 programs an SM -> 1).  Each op's tuning says what
    # it measured.
    prefetch: int = 0
    # The looped kernel's pass 1 (the row's statistics) in blocks of this
    # many columns, wider than block_n (see StatsBlock); 0: block_n.
    block_s: int = 0
    # softmax's looped kernel: pass 1 keeps a max and a sum for each run of
    # a thread's neighbouring elements and merges them once, after the loop,
    # rather than reducing each block across the program (see its
    # _lane_stats; the norms' pass 1 already reduces once).
    lanes: bool = False

    @property
    def stats_block_n(self) -> int:
        """The looped kernel's pass-1 block: ``block_s``, or ``block_n`` where that is 0 (its ``BLOCK_S``)."""
        return self.block_s or self.block_n


def row_block_config(rows: int, n: int, element_size: int, tuning: RowTuning) -> RowBlocks:
    """How to launch a row-wise kernel over ``rows`` rows of ``n`` elements (see :class:`RowBlocks`).

    Shared by the norm and softmax kernels: whole rows in registers up to
    ``MAX_FUSED_BYTES`` (several short rows a program), else ``wide``: loop
    over column blocks (also for uneven rows, see ``RowTuning.uneven_block``).
    Module constants are read at call time, so a test can lower
    ``MAX_FUSED_BYTES`` to reach the looped path with small rows.
    """
    blocks = _row_block_config(rows, n, element_size, tuning, MAX_FUSED_BYTES, interpreting())
    stats = tuning.stats_block
    if (stats is not None and blocks.wide and element_size == 2 and stats.min_n <= n <= stats.max_n
            and rows >= stats.min_rows and stats.block > blocks.block_n):
        blocks = blocks._replace(block_s=stats.block)
    return blocks._replace(early=not blocks.wide and rows <= EARLY_VECTOR_ROWS)


@functools.lru_cache(maxsize=4096)
def _row_block_config(rows: int, n: int, element_size: int, tuning: RowTuning, max_fused_bytes: int,
                      interpreter: bool) -> RowBlocks:
    cap = max(max_fused_bytes // element_size, 1)
    block_n = next_pow2(n)
    wide = block_n > cap * tuning.fused_scale
    if element_size == 4 and block_n > cap:  # float32 past the cap: float32_whole_from alone decides
        wide = not (0 < tuning.float32_whole_from <= block_n <= FLOAT32_WHOLE_MAX
                    and (tuning.float32_whole_padded or n == block_n) and rows >= tuning.float32_whole_min_rows)
    prefetch = tuning.float32_wide_prefetch if element_size == 4 else tuning.wide_prefetch
    two = tuning.float32_two_blocks if element_size == 4 else tuning.two_blocks
    if two is not None and rows >= two.min_rows and n == 2 * two.block:
        return RowBlocks(1, two.block, two.warps, True, prefetch=two.prefetch)
    for looped in tuning.half_looped if not wide and element_size == 2 else ():
        if looped.min_n <= n <= looped.max_n and rows >= looped.min_rows:
            block = next((b for b in looped.blocks if n % b == 0), 0)
            if block:
                return RowBlocks(1, block, looped.warps, True, prefetch=prefetch)
    if not wide and tuning.uneven_block and element_size == 2 and n > UNEVEN_MIN and n != block_n:
        if tuning.uneven_split and rows <= tuning.uneven_split:
            full = block_n // 2
            tail = next_pow2(n - full)
            return RowBlocks(1, full, split_warps(full + tail, element_size), False, tail)
        for max_n, block, warps in tuning.uneven_narrow:
            if n <= max_n:
                return RowBlocks(1, block, warps, True, prefetch=prefetch)
        block, warps = tuning.uneven_block, tuning.uneven_warps
        large = tuning.uneven_large
        if large and triton.cdiv(n, large[0]) * large[0] <= triton.cdiv(n, block) * block:  # pads no more
            block, warps = large
        return RowBlocks(1, block, warps, True, prefetch=prefetch)
    # A split may keep whole a row that "wide" would loop over.  It pays when
    # many rows are in flight; a few rows want many threads each instead.
    # (The interpreter splits whatever the rows, so CPU tests run the tails.)
    split = _split_tail(n, element_size, tuning, cap) if rows >= TAIL_MIN_ROWS or interpreter else None
    if split is not None:
        if interpreter:  # several rows a program there too (the kernels take BLOCK_M rows)
            per_program = max(INTERPRETER_TILE // (split.block_n + split.block_t), 1)
            split = split._replace(block_m=min(next_pow2(rows), per_program))
        return split
    if wide:  # loop over the row in blocks of half the (unscaled) cap
        long_rules = tuning.float32_long if element_size == 4 else tuning.half_long
        long = next((rule for rule in long_rules if rule.applies(n)), None)
        if element_size == 4 and long is None and tuning.float32_wide and n >= 2 * tuning.float32_wide[0]:
            block, warps = tuning.float32_wide
            return RowBlocks(1, block, warps, True, prefetch=prefetch)
        short = tuning.half_short
        if element_size == 2 and short and rows >= short.min_rows and short.block < n < short.max_n:
            return RowBlocks(1, short.block, short.warps, True, prefetch=prefetch)
        if long is not None:
            block, warps = long.block, long.warps
            if long.few and rows <= long.few[0]:
                _, block, warps = long.few
            return RowBlocks(1, block, warps, True, prefetch=prefetch if long.prefetch is None else long.prefetch,
                             lanes=long.lanes)
        warps = tuning.wide_warps
        mid = tuning.half_mid_warps
        if element_size == 2 and mid and n < mid[0] and rows >= mid[2]:
            warps = mid[1]
        return RowBlocks(1, max(next_pow2(cap) // 2, 1), warps, True, prefetch=prefetch)
    pair = tuning.paired_rows
    if pair and element_size == 2 and n == pair.n and rows >= pair.min_rows and not interpreter:
        return RowBlocks(2, n, pair.warps, False)
    by_tile = max(ROW_TILE // block_n, 1)
    by_grid = max(rows // MIN_PROGRAMS, 1)
    block_m = min(by_tile, 1 << (by_grid.bit_length() - 1))  # powers of two
    if interpreter:
        block_m = min(next_pow2(rows), max(INTERPRETER_TILE // block_n, 1))
    within_cap = block_n * element_size <= max_fused_bytes
    per_thread = tuning.elements_per_thread
    if element_size == 4 and within_cap and tuning.float32_elements_per_thread:
        per_thread = tuning.float32_elements_per_thread
    threads = block_m * block_n // per_thread
    max_warps = tuning.max_warps if within_cap else WIDE_WHOLE_ROW_WARPS
    num_warps = min(max(next_pow2(threads) // 32, MIN_WARPS), max_warps)
    cap_warps = tuning.float32_cap_warps
    if cap_warps and element_size == 4 and n == cap and rows >= cap_warps[0]:
        num_warps = cap_warps[1]
    return RowBlocks(block_m, block_n, num_warps, False)


def _split_tail(n: int, element_size: int, tuning: RowTuning, cap: int) -> RowBlocks | None:
    """A whole row as a power-of-two block plus a tail block, or None where that does not apply.

    ``N = 5120`` becomes 4096 + 1024 instead of 8192 (37% of the registers
    idle), ``11008`` becomes 8192 + 4096.  Measured on the H200 (16384 rows,
    µs, ``reports/h200/row-experiments-session5.txt``), padded whole row ->
    split, 4 warps in half precision:
    N = 5120 rms_norm 95.5 -> 89.5, layer_norm 120.0 -> 90.0, softmax
    118.8 -> 105.6; N = 11008 layer_norm 238.0 -> 223.0; N = 2500 (fp16)
    rms_norm 89.0 -> 80.0, layer_norm 141.6 -> 101.0; 8 warps in float32:
    layer_norm 5120 214.0 -> 167.8, 11008 411 (looped) -> 348.  More warps
    were slower in half precision (8 warps: layer_norm 5120 146.5, 11008
    278.4), fewer in float32 (4 warps: 187.3, 425.9): ``2 * element_size``
    warps.  Where a split did not pay, the ops' TailSplit rules leave it out:
    rms_norm at N = 6000 (108.4 vs 103.3), add_rms_norm in half precision
    (N = 3000 144.1 vs 127.3), softmax in float32 and below 4096
    (N = 2500 137.8 vs 119.6) or with a tail over a quarter (N = 6000 132.9
    vs 127.9).  (The N = 2500 and 3000 comparisons predate ``ALIGN``: both
    sides read those rows 2 bytes at a time then; see row_alignment.)  The
    rms_norms split float32 rows since the twelfth session (event time after
    an L2 flush, 16384 rows, ``reports/h200/rms-split-fp32-session12.txt``):
    N = 11008 rms_norm 411.1 -> 371.0 µs, add_rms_norm 771.5 -> 723.3, and
    within 1% either way at N = 3000, 5120 and 6000; with the tail loaded
    together with the block (``tail-load-order-session12.txt``) 349.7 and
    716.9 (softmax bf16 N = 5120: 103.4 -> 91.0).  Rows
    whose block exceeds TAIL_MAX_BLOCK elements or the cap keep the other
    rules: nothing wider was measured.
    A thread holds at most ``SPLIT_MAX_PER_THREAD`` elements: more warps
    where ``2 * element_size`` would leave it more (:func:`split_warps`).
    That is the layer_norms' half-precision rows of 8192 + 4096 (N = 11008:
    96 elements a thread in 4 warps), once their full block was unmasked;
    H200, event time after an L2 flush, 4 -> 8 warps, µs
    (``reports/h200/split-warps-session17.txt``): layer_norm bf16 16384 x
    11008 224.2 -> 183.8, 1024 x 11008 21.5 -> 19.5, float16 221.0 -> 204.9,
    add_layer_norm 1024 x 11008 31.4 -> 28.5 (16384 rows: 351.6 -> 348.7);
    at 48 a thread (6000 in 4 warps) 8 warps tied, at 40 (5120) they lost
    (layer_norm 85.3 -> 140.1), and so did they, by far, at 72 a thread
    (8192 + 1024; 8 -> 4 warps, ``reports/h200/split-warps-session21.txt``):
    layer_norm bf16 16384 x 9000 300.6 -> 179.0, 16384 x 8400 281.9 ->
    164.1, 4096 x 9000 80.0 -> 50.1, fp16 16384 x 9000 288.9 -> 203.7,
    add_layer_norm 16384 x 9000 331.7 -> 290.4, 1024 x 9000 30.1 -> 25.8.
    At 80 (8192 + 2048) 8 warps won (layer_norm 16384 x 10000 170.9 against
    187.4 in 4): up to 72 elements a thread.
    """
    rule = tuning.split_tail
    if rule is None or n <= max(rule.min_n, 1):
        return None
    max_tail = rule.float32_max_tail if element_size == 4 else rule.max_tail
    full = next_pow2(n) // 2  # the largest power of two below n
    tail = next_pow2(n - full)
    if full > min(TAIL_MAX_BLOCK, cap) or tail > max_tail * full:
        return None
    return RowBlocks(1, full, split_warps(full + tail, element_size), False, tail)


def split_warps(elements: int, element_size: int) -> int:
    """Warps for a row held whole as a block plus a tail of ``elements`` in all: ``2 x element_size``, or more.

    More where a thread would hold over ``SPLIT_MAX_PER_THREAD`` elements: rows of 8192 + 4096
    (96 a thread in 4 warps) get 8, rows of 8192 + 1024 (72) keep 4 (see :func:`_split_tail`).
    """
    return max(2 * element_size, next_pow2(triton.cdiv(elements, 32 * SPLIT_MAX_PER_THREAD)))


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
    return triton.next_power_of_2(max(int(n), 1))
