"""Fused LayerNorm, and residual add + LayerNorm, in one kernel launch.

The maths, per row ``x`` of ``N`` elements (the last dim)::

    mean = x0 + sum(x - x0) / N        # about the row's first element x0, so a
                                       # constant row has mean == its value
    var  = sum((x - mean)^2) / N       # two-pass: never E[x^2] - E[x]^2, which
                                       # cancels on near-constant rows
    rstd = 1 / sqrt(var + eps)         # eps keeps constant rows finite
    y    = (x - mean) * rstd * w + b   # rounded to the input dtype once, at the store

and the fused residual variant, as an eager ``h = x + residual`` would do it::

    h = round_to_dtype(x + residual)   # the rounded h is returned ...
    y = layer_norm(h)                  # ... and it is what gets normalised

Every element is loaded in its own dtype, upcast to float32, and only the
stores round.

Two kernels share the work:

* :func:`layer_norm_kernel` keeps whole rows in registers, so the second pass
  over ``x - mean`` costs no memory traffic: one read of each input, one
  write of each output.  Short rows go ``BLOCK_M`` to a program.
* :func:`layer_norm_wide_kernel` is for rows wider than ``_rows.MAX_FUSED_BYTES``
  (twice that with a residual, see ``ADD_TUNING``).
  Pass 1 loops over column blocks; each block's mean and sum of squared
  deviations ``M2`` are two-pass values (the block is in registers), and
  blocks merge with Chan et al.'s parallel formula, which has no cancellation::

      n = n_a + n_b,  delta = mean_b - mean_a
      mean = mean_a + delta * n_b / n
      M2   = M2_a + M2_b + delta^2 * n_a * n_b / n

  (both running sums carry Kahan compensations).  Pass 2 normalises, so the
  row is read twice (the second read usually hits L2).

Rows are addressed in place whatever the strides (see ``_rows.py``); the
outputs are new contiguous tensors, so an output row starts at ``row * N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch
from ._rows import RowTuning, check_row_shapes, check_tensors, row_block_config, row_layout, row_offsets, to_dtype

# Two reductions per row (and Chan merges per block in the looped kernel):
# at most 8 warps (H200, bf16, 16384 rows: N=14336 in 265 µs with 8 warps, 434 with 16).
TUNING = RowTuning(elements_per_thread=32, max_warps=8, wide_warps=8)
# The residual variant keeps rows up to 64 KiB whole (see RowTuning.fused_scale).
ADD_TUNING = TUNING._replace(fused_scale=2)


@triton.jit
def layer_norm_kernel(
    X, R, W, B, Y, H,  # input, residual, weight, bias, output y, output h
    n_rows, N, D1, D2,  # rows, hidden size, folded leading dims (see _rows.py)
    sx0, sx1, sx2, sxn,  # strides of x
    sr0, sr1, sr2, srn,  # strides of residual
    swn, sbn,  # strides of weight and bias
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

    row_mask = rows < n_rows
    x_row = row_offsets(rows, D1, D2, sx0, sx1, sx2)
    x = tl.load(X + x_row[:, None] + cols[None, :].to(tl.int64) * sxn, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(X + x_row, mask=row_mask, other=0.0).to(tl.float32)  # each row's first element
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        r_row = row_offsets(rows, D1, D2, sr0, sr1, sr2)
        r = tl.load(R + r_row[:, None] + cols[None, :].to(tl.int64) * srn, mask=mask, other=0.0).to(tl.float32)
        h = to_dtype(x + r, H.dtype.element_ty)  # round as eager's x + residual does
        tl.store(H + out_off, h, mask=mask)
        x = h.to(tl.float32)  # normalise the rounded h
        r0 = tl.load(R + r_row, mask=row_mask, other=0.0).to(tl.float32)
        x0 = to_dtype(x0 + r0, H.dtype.element_ty).to(tl.float32)  # h's first element, rounded alike

    # Statistics on the row in registers, two reductions.  The mean is taken
    # about the row's first element x0 (mean = x0 + sum(x - x0) / N): the
    # shifted terms are small on near-constant rows, and a constant row gets
    # exactly its value as mean, zero deviations, y = b.  Masked lanes must
    # not count, so their deviations are zeroed.
    mean = x0 + tl.math.div_rn(tl.sum(tl.where(mask, x - x0[:, None], 0.0), axis=1), N * 1.0)
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.math.div_rn(tl.sum(xc * xc, axis=1), N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))

    w = tl.load(W + cols * swn, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols * sbn, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + out_off, to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_wide_kernel(
    X, R, W, B, Y, H,
    N, D1, D2,
    sx0, sx1, sx2, sxn,
    sr0, sr1, sr2, srn,
    swn, sbn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One row per program, BLOCK_N < N columns at a time.
    row = tl.program_id(0)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2)
    r_row = R + row_offsets(row, D1, D2, sr0, sr1, sr2)
    out = row.to(tl.int64) * N

    # Pass 1: mean and M2 block by block, merged with Chan's formula.
    # With a residual, h = x + residual is formed, rounded and stored here.
    # mean and M2 are running sums over the blocks: each keeps a Kahan
    # compensation (what its roundings added), or on a near-constant row
    # (mean >> std) the rounding of the mean at every block would pile up.
    mean = tl.zeros([], dtype=tl.float32)
    mean_c = tl.zeros([], dtype=tl.float32)
    m2 = tl.zeros([], dtype=tl.float32)
    m2_c = tl.zeros([], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < N
        x_ptrs = x_row + cols.to(tl.int64) * sxn
        if HAS_RESIDUAL:  # x and residual are not read again: h is
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            r_ptrs = r_row + cols.to(tl.int64) * srn
            r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            h = to_dtype(x.to(tl.float32) + r.to(tl.float32), H.dtype.element_ty)
            tl.store(H + out + cols, h, mask=mask)
            x = h.to(tl.float32)
        else:  # ask L2 to keep x for pass 2
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
            x = x.to(tl.float32)
        n_a = start * 1.0  # elements merged so far
        n_b = tl.sum(mask.to(tl.float32), axis=0)  # elements in this block
        mean_b = tl.math.div_rn(tl.sum(x, axis=0), n_b)
        mean_b += tl.math.div_rn(tl.sum(tl.where(mask, x - mean_b, 0.0), axis=0), n_b)
        xc = tl.where(mask, x - mean_b, 0.0)
        m2_b = tl.sum(xc * xc, axis=0)
        n = n_a + n_b
        delta = (mean_b - mean) + mean_c  # mean_b minus the running mean
        add = delta * tl.math.div_rn(n_b, n) - mean_c
        total = mean + add
        mean_c = (total - mean) - add
        mean = total
        add = m2_b + delta * delta * tl.math.div_rn(n_a * n_b, n) - m2_c
        total = m2 + add
        m2_c = (total - m2) - add
        m2 = total
    mean -= mean_c
    var = tl.math.div_rn(m2 - m2_c, N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))

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
        b = tl.load(B + cols * sbn, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=mask)


def _layer_norm(
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check, lay out and launch; returns ``(y, h)`` (``h`` is None without a residual)."""
    if residual is None:
        check_tensors(op, x=x, weight=weight, bias=bias)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight, bias=bias)
    n = check_row_shapes(op, x, residual, weight=weight, bias=bias)

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty_like(y)
    if y.numel() == 0:
        return y, h
    inputs = (x,) if residual is None else (x, residual)
    layout = row_layout(x.shape, *inputs)
    sx = layout.strides[0]
    sr = layout.strides[1] if residual is not None else (0, 0, 0, 0)
    _, d1, d2 = layout.dims
    block_m, block_n, num_warps, wide = row_block_config(layout.rows, n, x.element_size(),
                                                        TUNING if residual is None else ADD_TUNING)
    r_arg = x if residual is None else residual  # never read without a residual
    h_arg = y if h is None else h  # never written without a residual
    if wide:
        launch(
            layer_norm_wide_kernel, (layout.rows,),
            x, r_arg, weight, bias, y, h_arg, n, d1, d2, *sx, *sr,
            weight.stride(0), bias.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=num_warps,
        )
    else:
        launch(
            layer_norm_kernel, (triton.cdiv(layout.rows, block_m),),
            x, r_arg, weight, bias, y, h_arg, layout.rows, n, d1, d2, *sx, *sr,
            weight.stride(0), bias.stride(0), float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y, h


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """``F.layer_norm(x, (N,), weight, bias, eps)`` in one launch; ``x`` is ``(..., N)``."""
    return _layer_norm("layer_norm", x, None, weight, bias, eps)[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; (F.layer_norm(h, (N,), weight, bias, eps), h)`` in one launch.

    ``h`` is rounded to the input dtype before it is normalised, as in eager.
    """
    y, h = _layer_norm("add_layer_norm", x, residual, weight, bias, eps)
    assert h is not None
    return y, h


__all__ = ["add_layer_norm", "layer_norm", "layer_norm_kernel", "layer_norm_wide_kernel"]
