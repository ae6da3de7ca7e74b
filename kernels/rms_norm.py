"""Fused RMSNorm, and residual add + RMSNorm, in one kernel launch.

The maths, per row ``x`` of ``N`` elements (the last dim)::

    ms   = sum(x * x) / N              # mean square, accumulated in float32
    rstd = 1 / sqrt(ms + eps)          # eps keeps all-zero rows finite (y = 0)
    y    = x * rstd * w                # rounded to the input dtype once, at the store

and the fused residual variant, as an eager ``h = x + residual`` would do it::

    h = round_to_dtype(x + residual)   # the rounded h is returned ...
    y = rms_norm(h)                    # ... and it is what gets normalised

Every element is loaded in its own dtype, upcast to float32, and only the
stores round: ``|x| ~ 2000`` in float16 squares to 4e6, far beyond a half's
65504, so nothing is ever summed in half precision.

Two kernels share the work:

* :func:`rms_norm_kernel` keeps whole rows in registers: one read of each
  input, one write of each output.  When rows are short it takes a tile of
  ``BLOCK_M`` rows per program, so that every program moves a useful amount.
* :func:`rms_norm_wide_kernel` is for rows wider than ``_MAX_FUSED_BYTES``:
  it loops over column blocks twice (sum of squares, then normalise), so the
  row is read twice; the second read usually hits L2.

Rows are addressed in place whatever the strides (see ``_rows.py``); the
outputs are new contiguous tensors, so an output row starts at ``row * N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rows import check_tensors, interpreting, next_pow2, row_layout, row_offsets

# Widest row a program keeps whole in registers, in bytes of the input dtype:
# 32768 elements of float16/bfloat16, 16384 of float32.  Upcast to float32
# that is up to 64 registers per thread at 16 warps.  Wider rows take the
# looped two-pass kernel.  Tests lower it to reach that path with small rows.
_MAX_FUSED_BYTES = 65536
# For short rows, one program takes about this many elements (several rows) ...
_ROW_TILE = 2048
# ... but only while the grid keeps at least this many programs.
_MIN_PROGRAMS = 1024
_MAX_WARPS = 16
# Triton's CPU interpreter pays per program, not per element: there, one
# program takes as many rows as fit in this many elements.  (Like triton.jit
# itself, which picks the interpreter when the kernel is defined, this is
# decided at import.)
_INTERPRETING = interpreting()
_INTERPRETER_TILE = 1 << 20


def _launch_config(rows: int, n: int, element_size: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, wide)`` for ``rows`` rows of ``n`` elements."""
    cap = max(_MAX_FUSED_BYTES // element_size, 1)
    block_n = next_pow2(n)
    wide = block_n > cap
    if wide:  # loop over the row in blocks of half the cap
        block_m, block_n = 1, max(next_pow2(cap) // 2, 1)
    else:
        by_tile = max(_ROW_TILE // block_n, 1)
        by_grid = max(rows // _MIN_PROGRAMS, 1)
        block_m = min(by_tile, 1 << (by_grid.bit_length() - 1))  # powers of two
        if _INTERPRETING:
            block_m = min(next_pow2(rows), max(_INTERPRETER_TILE // block_n, 1))
    # about 8 elements per thread (one 16-byte vector of a 2-byte dtype)
    num_warps = min(max(block_m * block_n // 256, 1), _MAX_WARPS)
    return block_m, block_n, num_warps, wide


# Triton's CPU interpreter truncates float32 -> bfloat16 (and mangles
# subnormals) where the GPU's cvt.rn rounds to nearest even.  Under the
# interpreter only, round the bits by hand.
_ROUND_BF16_BY_HAND = tl.constexpr(_INTERPRETING)


@triton.jit
def _to_dtype(v, dtype: tl.constexpr):
    """Round float32 ``v`` to ``dtype`` to nearest even, also under the interpreter."""
    out = v.to(dtype)
    if _ROUND_BF16_BY_HAND:
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            out = tl.where(v == v, rounded, out)  # NaN stays NaN
    return out


@triton.jit
def rms_norm_kernel(
    X, R, W, Y, H,  # input, residual, weight, output y, output h
    n_rows, N, D1, D2,  # rows, hidden size, folded leading dims (see _rows.py)
    sx0, sx1, sx2, sxn,  # strides of x
    sr0, sr1, sr2, srn,  # strides of residual
    swn,  # stride of weight
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < n_rows)[:, None] & col_mask[None, :]

    x_off = row_offsets(rows, D1, D2, sx0, sx1, sx2)[:, None] + cols[None, :].to(tl.int64) * sxn
    x = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        r_off = row_offsets(rows, D1, D2, sr0, sr1, sr2)[:, None] + cols[None, :].to(tl.int64) * srn
        r = tl.load(R + r_off, mask=mask, other=0.0).to(tl.float32)
        h = _to_dtype(x + r, H.dtype.element_ty)  # round as eager's x + residual does
        tl.store(H + out_off, h, mask=mask)
        x = h.to(tl.float32)  # normalise the rounded h

    # Statistics in float32; masked lanes hold 0 and add nothing.
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))

    w = tl.load(W + cols * swn, mask=col_mask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + out_off, _to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_wide_kernel(
    X, R, W, Y, H,
    N, D1, D2,
    sx0, sx1, sx2, sxn,
    sr0, sr1, sr2, srn,
    swn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One row per program, BLOCK_N < N columns at a time.
    row = tl.program_id(0)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2)
    r_row = R + row_offsets(row, D1, D2, sr0, sr1, sr2)
    out = row.to(tl.int64) * N

    # Pass 1: sum of squares, lane by lane (reduced once after the loop).
    # With a residual, h = x + residual is formed, rounded and stored here.
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x_ptrs = x_row + cols.to(tl.int64) * sxn
        if HAS_RESIDUAL:  # x and residual are not read again: h is
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            r_ptrs = r_row + cols.to(tl.int64) * srn
            r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            h = _to_dtype(x.to(tl.float32) + r.to(tl.float32), H.dtype.element_ty)
            tl.store(H + out + cols, h, mask=mask)
            x = h.to(tl.float32)
        else:  # ask L2 to keep x for pass 2
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
            x = x.to(tl.float32)
        acc += x * x
    ms = tl.math.div_rn(tl.sum(acc, axis=0), N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))

    if HAS_RESIDUAL:
        # Pass 2 reads h back; make this program's stores visible to all its threads.
        tl.debug_barrier()
    # Pass 2: normalise and store, walking the row backwards: the blocks that
    # pass 1 read last are the likeliest to be in cache still.
    last = (N - 1) // BLOCK_N * BLOCK_N
    for offset in range(0, N, BLOCK_N):
        cols = (last - offset) + tl.arange(0, BLOCK_N)
        mask = cols < N
        if HAS_RESIDUAL:
            x_ptrs = H + out + cols
        else:
            x_ptrs = x_row + cols.to(tl.int64) * sxn
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + cols * swn, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * w
        tl.store(Y + out + cols, _to_dtype(y, Y.dtype.element_ty), mask=mask)


def _rms_norm(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check, lay out and launch; returns ``(y, h)`` (``h`` is None without a residual)."""
    if residual is None:
        check_tensors(op, x=x, weight=weight)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dim (the hidden dim), got a scalar")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"{op}: weight must have shape ({n},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}"
        )

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(y)
    if y.numel() == 0:
        return y, h
    inputs = (x,) if residual is None else (x, residual)
    layout = row_layout(x.shape, *inputs)
    sx = layout.strides[0]
    sr = layout.strides[1] if residual is not None else (0, 0, 0, 0)
    _, d1, d2 = layout.dims
    block_m, block_n, num_warps, wide = _launch_config(layout.rows, n, x.element_size())
    r_arg = x if residual is None else residual  # never read without a residual
    h_arg = y if h is None else h  # never written without a residual
    if wide:
        rms_norm_wide_kernel[(layout.rows,)](
            x, r_arg, weight, y, h_arg, n, d1, d2, *sx, *sr, weight.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=num_warps,
        )
    else:
        rms_norm_kernel[(triton.cdiv(layout.rows, block_m),)](
            x, r_arg, weight, y, h_arg, layout.rows, n, d1, d2, *sx, *sr, weight.stride(0),
            float(eps), HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``F.rms_norm(x, (N,), weight, eps)`` in one launch; ``x`` is ``(..., N)``, any strides."""
    return _rms_norm("rms_norm", x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; (F.rms_norm(h, (N,), weight, eps), h)`` in one launch.

    ``h`` is rounded to the input dtype before it is normalised, as in eager.
    """
    y, h = _rms_norm("add_rms_norm", x, residual, weight, eps)
    assert h is not None
    return y, h


__all__ = ["add_rms_norm", "rms_norm", "rms_norm_kernel", "rms_norm_wide_kernel"]
