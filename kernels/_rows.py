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
(column stride 1) still gets vectorised loads.
"""

from __future__ import annotations

import functools
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
    pad = MAX_LEADING_DIMS - len(sizes)
    sizes = [1] * pad + sizes
    rows = 1
    for n in sizes:
        rows *= n
    per_tensor = tuple(
        (*tuple([0] * pad + s), st[-1]) for s, st in zip(strides, tensor_strides)
    )
    return RowLayout(rows, (sizes[0], sizes[1], sizes[2]), per_tensor)  # type: ignore[arg-type]


@triton.jit
def row_offsets(rows, D1, D2, S0, S1, S2):
    """Element offset of the first element of each row in ``rows`` (int64)."""
    rows = rows.to(tl.int64)
    i2 = rows % D2
    rest = rows // D2
    return (rest // D1) * S0 + (rest % D1) * S1 + i2 * S2


# Widest row a program keeps whole in registers, in bytes of the input dtype:
# 16384 elements of float16/bfloat16, 8192 of float32.  Wider rows take the
# looped kernel, in blocks of half this.  On the H200 (bf16, 16384 rows) the
# looped kernel beat whole rows in registers at N = 32768 for every op
# (rms_norm 525 vs 587 µs, softmax 599 vs 1026 µs).  Tests lower it to reach
# that path with small rows.
MAX_FUSED_BYTES = 32768
# For short rows, one program takes about this many elements (several rows) ...
ROW_TILE = 2048
# ... but only while the grid keeps at least this many programs.
MIN_PROGRAMS = 1024
MIN_WARPS = 4
WIDE_WHOLE_ROW_WARPS = 32  # whole rows past MAX_FUSED_BYTES (RowTuning.fused_scale > 1)
# Triton's CPU interpreter pays per program, not per element: there, one
# program takes as many rows as fit in this many elements.
INTERPRETER_TILE = 1 << 20
# See RowTuning.uneven_block.
UNEVEN_MIN = 8192


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
    # Whole rows up to fused_scale x MAX_FUSED_BYTES; those past MAX_FUSED_BYTES
    # get up to WIDE_WHOLE_ROW_WARPS warps.  2 for the residual variants: their
    # looped kernel re-reads two inputs, and on the H200 (bf16, 16384 x 32768)
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


def row_block_config(rows: int, n: int, element_size: int, tuning: RowTuning) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, wide)`` for a row-wise kernel over ``rows`` rows of ``n`` elements.

    Shared by the norm and softmax kernels: whole rows in registers up to
    ``MAX_FUSED_BYTES`` (several short rows a program), else ``wide``: loop
    over column blocks (also for uneven rows, see ``RowTuning.uneven_block``).
    Module constants are read at call time, so a test can lower
    ``MAX_FUSED_BYTES`` to reach the looped path with small rows.
    """
    return _row_block_config(rows, n, element_size, tuning, MAX_FUSED_BYTES, interpreting())


@functools.lru_cache(maxsize=4096)
def _row_block_config(rows: int, n: int, element_size: int, tuning: RowTuning, max_fused_bytes: int,
                      interpreter: bool) -> tuple[int, int, int, bool]:
    cap = max(max_fused_bytes // element_size, 1)
    block_n = next_pow2(n)
    wide = block_n > cap * tuning.fused_scale
    if wide:  # loop over the row in blocks of half the (unscaled) cap
        return 1, max(next_pow2(cap) // 2, 1), tuning.wide_warps, True
    if tuning.uneven_block and element_size == 2 and n > UNEVEN_MIN and n != block_n:
        return 1, tuning.uneven_block, tuning.uneven_warps, True
    by_tile = max(ROW_TILE // block_n, 1)
    by_grid = max(rows // MIN_PROGRAMS, 1)
    block_m = min(by_tile, 1 << (by_grid.bit_length() - 1))  # powers of two
    if interpreter:
        block_m = min(next_pow2(rows), max(INTERPRETER_TILE // block_n, 1))
    threads = block_m * block_n // tuning.elements_per_thread
    max_warps = tuning.max_warps if block_n * element_size <= max_fused_bytes else WIDE_WHOLE_ROW_WARPS
    num_warps = min(max(next_pow2(threads) // 32, MIN_WARPS), max_warps)
    return block_m, block_n, num_warps, False


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
