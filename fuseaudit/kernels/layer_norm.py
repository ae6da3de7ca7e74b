"""Fused LayerNorm, and residual add + LayerNorm, in one kernel launch.

The maths, per row ``x`` of ``N`` elements (the last dim)::

    d    = x - x0                      # about the row's first element x0, so a
    mean = x0 + sum(d) / N             # constant row has mean == its value
    var  = sum((x - mean)^2) / N       # two-pass: never E[x^2] - E[x]^2, which
                                       # cancels on near-constant rows
    rstd = 1 / sqrt(var + eps)         # eps keeps constant rows finite
    y    = (x - mean) * rstd * w + b   # rounded to the input dtype once, at the store

and the fused residual variant, as an eager ``h = x + residual`` would do it::

    h = round_to_dtype(x + residual)   # the rounded h is returned ...
    y = layer_norm(h)                  # ... and it is what gets normalised

Every element is loaded in its own dtype, upcast to float32, and only the
stores round.

Three kernels; which one a call takes, and how it is launched, is a
:class:`~._tuning.RowConfig` looked up in the op's table (``_tuning.py``):

* :func:`layer_norm_kernel` keeps whole rows in registers, so the second pass
  over ``x - mean`` costs no memory traffic: one read of each input, one
  write of each output.  ``BLOCK_M`` rows a program; a row may be a block
  plus a tail block.  Each reduction is a round trip through shared memory
  and a barrier, so half-precision rows (one a program) first try one pass::

      var1 = sum(d^2) / N - (sum(d) / N)^2        # both sums in one reduction

  Its rounding error grows with ``(mean - x0)^2 / var``: once that passes
  ``ONE_PASS_RATIO`` (x0 more than 4 standard deviations from the mean)
  the row takes the exact second reduction after all.  Below it the
  relative error of ``var1`` stays under ``3 * 17 * log2(N)`` float32
  epsilons (9e-5 at N = 16384), under a tenth of a float16 ulp in ``y``;
  float32 rows, whose outputs would see it, always take two passes.
  (``properties/test_layer_norm_one_pass.py`` builds rows on both sides of
  the switch; without it, a far-out x0 fails the tolerance policy.)
* :func:`layer_norm_wide_kernel` loops over a row in blocks of ``BLOCK_N``.
  Rows without a residual compiled for their width (``RowConfig.fixed``,
  the kernel's ``N_FIXED``) keep Welford's running
  mean and ``M2`` in each lane (lane ``j`` sees elements ``j, j + BLOCK_N,
  ...``)::

      d = x - mean;  mean += d / n;  M2 += d * (x - mean)

  which does not cancel, and end the pass with one reduction of two sums
  about the row's first element x0, ``count * (mean - x0)`` and ``M2 +
  count * (mean - x0)^2``, into the one-pass variance above; past
  ``ONE_PASS_RATIO`` the lanes merge by Chan's formula (below) instead,
  from the registers (float32 rows: the mean, then the lanes' ``M2`` about
  it, two reductions).  Other half-precision rows without a residual take
  the one pass lane by lane: each lane sums ``d = x - k`` and ``d^2`` over the blocks and one
  reduction ends the pass, with ``k`` the first block's mean, which lies
  within ``sqrt(N / BLOCK_N - 1)`` standard deviations of the row's (so the
  exact fallback, a third read of the row, only runs past ``N = 17 *
  BLOCK_N``; each lane adds ``N / BLOCK_N`` terms before a tree of
  ``log2(BLOCK_N)``: 29 deep at N = 131072 where the whole-row tree is 17;
  pass 1 in blocks wider than pass 2's, ``BLOCK_S``, first sums each
  lane's 8-element vectors).  Otherwise (float32 rows not compiled for
  their width, and rows with a residual) each block's mean and sum of squared deviations ``M2`` are
  two-pass values (the block is in registers), and blocks merge with Chan et
  al.'s parallel formula, which has no cancellation::

      n = n_a + n_b,  delta = mean_b - mean_a
      mean = mean_a + delta * n_b / n
      M2   = M2_a + M2_b + delta^2 * n_a * n_b / n

  (both running sums carry Kahan compensations).  Pass 2 normalises, so the
  row is read twice (the second read usually hits L2); after Welford's
  pass, with ``RowConfig.keep``, pass 2 starts from the block pass 1 ended
  on, still in registers (``KEEP``).
* :func:`layer_norm_coop_kernel` is for a few wide rows (decode): each row
  is split over ``SPLITS`` programs of one cooperative launch (see
  ``_coop.py``).  Each holds a chunk in registers and publishes its sum of
  deviations from the row's first element and its own ``M2``; the row's
  mean and variance follow from the same merge, done for all chunks at once::

      mean = x0 + sum(s_c) / N,                       s_c = sum over chunk c of (x - x0)
      var  = (sum(M2_c) + sum(n_c * (s_c / n_c - (mean - x0))^2)) / N

Rows are addressed in place whatever the strides (see ``_rows.py``); the
outputs are new contiguous tensors, so an output row starts at ``row * N``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import _rows
from ._coop import (
    arrive_and_wait,
    chunk_width,
    coop_config,
    gather,
    launch_options,
    load_raw_chunk,
    publish,
    row_chunk,
    row_slots,
    workspace,
)
from ._launch import Plan, output_like, planned
from ._rows import (
    add_residual,
    aligned_width,
    check_row_shapes,
    check_tensors,
    even_blocks,
    load_back_block,
    load_chunk,
    load_pair,
    load_pair_block,
    load_vector,
    next_pair_block,
    out_row_offsets,
    row_alignment,
    row_layout,
    row_offsets,
    to_dtype,
    vector_sums,
)
from ._tuning import RowConfig, row_config, whole_blocks

# The cooperative kernel loads weight and bias before it waits for the row's
# other programs when its chunk is at most this many elements; larger chunks
# load them after (kept in registers through the merge, they would spill).
COOP_EARLY_MAX = 8192

# One pass while (mean - x0)^2 <= ONE_PASS_RATIO * var, i.e. x0 within 4 std of the mean.
ONE_PASS_RATIO = tl.constexpr(16.0)


@triton.jit
def _add_pair(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@triton.jit
def _centred(x, xt, mask, t_mask, mean, TAIL: tl.constexpr):
    """``x - mean`` for the block and the tail (the block's again without a tail), 0 on masked lanes.

    With a tail the block is inside the row: no lane to zero (rows past the
    end have ``x = mean = 0``).
    """
    xc = x - mean[:, None] if TAIL else tl.where(mask, x - mean[:, None], 0.0)
    xct = tl.where(t_mask, xt - mean[:, None], 0.0) if TAIL else xc
    return xc, xct


@triton.jit
def _sum_squares(xc, xct, TAIL: tl.constexpr):
    s2 = tl.sum(xc * xc, axis=1)
    if TAIL:
        s2 += tl.sum(xct * xct, axis=1)
    return s2


@triton.jit
def _load_wb(W, B, cols, N, swn, sbn, EVEN: tl.constexpr = False):
    """Weight and bias for ``cols``, in their own dtype (``EVEN``: every column is below ``N``, no mask)."""
    return load_vector(W, cols, N, swn, EVEN), load_vector(B, cols, N, sbn, EVEN)


@triton.jit
def _store_y(Y, out_rows, cols, mask, xc, rstd, w, b):
    """``y = (x - mean) * rstd * w + b`` for a tile of rows x cols, rounded once, at the store."""
    y = xc * rstd[:, None] * w.to(tl.float32)[None, :] + b.to(tl.float32)[None, :]
    tl.store(Y + out_rows[:, None] + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=mask)


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
    BLOCK_T: tl.constexpr,
    ALIGN: tl.constexpr,  # divides every row offset (see _rows.row_alignment)
    EARLY: tl.constexpr,  # load weight and bias with the row, not after the reductions
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N, or BLOCK_N columns and a
    # tail block of BLOCK_T.  The tail, when there is
    # one, follows every step the block takes; each sum adds both.
    ONE_PASS: tl.constexpr = BLOCK_M == 1 and X.dtype.element_ty != tl.float32
    TAIL: tl.constexpr = BLOCK_T > 0
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    x_rows = row_offsets(rows, D1, D2, sx0, sx1, sx2, ALIGN)
    r_rows = x_rows
    if HAS_RESIDUAL:
        r_rows = row_offsets(rows, D1, D2, sr0, sr1, sr2, ALIGN)
    out_rows = out_row_offsets(rows, N, ALIGN)

    # Every load of the row (block, tail, first element) is issued before h
    # is stored: one wait for memory, not two (see _rows.load_pair).
    cols = tl.arange(0, BLOCK_N)
    # With a tail, N > BLOCK_N: only the tail has columns past the end.
    mask = row_mask[:, None] if TAIL else row_mask[:, None] & (cols < N)[None, :]
    x_ptrs, r_ptrs, h_offs = X + x_rows[:, None], R + r_rows[:, None], out_rows[:, None]
    x, r = load_pair(x_ptrs, r_ptrs, cols[None, :], mask, sxn, srn, HAS_RESIDUAL)
    xt, rt, t_cols, t_mask = x, r, cols, mask  # (stand in where there is no tail)
    if TAIL:
        t_cols = BLOCK_N + tl.arange(0, BLOCK_T)
        t_mask = row_mask[:, None] & (t_cols < N)[None, :]
        xt, rt = load_pair(x_ptrs, r_ptrs, t_cols[None, :], t_mask, sxn, srn, HAS_RESIDUAL)
    x0 = tl.load(X + x_rows, mask=row_mask, other=0.0).to(tl.float32)  # each row's first element
    if HAS_RESIDUAL:
        r0 = tl.load(R + r_rows, mask=row_mask, other=0.0).to(tl.float32)
        x0 = to_dtype(x0 + r0, H.dtype.element_ty).to(tl.float32)  # h's first element, rounded alike
    x = add_residual(x, r, H, h_offs, cols[None, :], mask, HAS_RESIDUAL)
    if TAIL:
        xt = add_residual(xt, rt, H, h_offs, t_cols[None, :], t_mask, HAS_RESIDUAL)
    if EARLY:  # weight and bias with the row: one wait for memory (few rows)
        w, b = _load_wb(W, B, cols, N, swn, sbn)
        wt, bt = w, b
        if TAIL:
            wt, bt = _load_wb(W, B, t_cols, N, swn, sbn)

    # Statistics on the row in registers.  The mean is taken about the row's
    # first element x0 (mean = x0 + sum(d) / N, d = x - x0): the shifted
    # terms are small on near-constant rows, and a constant row gets exactly
    # its value as mean, zero deviations, y = b.  Masked lanes must not
    # count, so their deviations are zeroed (a full block has none; rows past
    # the end load x = x0 = 0).
    # (Each tail term is formed after the block's reduction, not beside it: fewer live registers.)
    d = x - x0[:, None] if TAIL else tl.where(mask, x - x0[:, None], 0.0)
    if ONE_PASS:  # sum(d) and sum(d^2) in one reduction (see the module docstring)
        s1, s2 = tl.reduce((d, d * d), 1, _add_pair)
        if TAIL:
            dt = tl.where(t_mask, xt - x0[:, None], 0.0)
            t1, t2 = tl.reduce((dt, dt * dt), 1, _add_pair)
            s1, s2 = s1 + t1, s2 + t2
        shift = tl.math.div_rn(s1, N * 1.0)  # mean - x0
        var = tl.maximum(tl.math.div_rn(s2, N * 1.0) - shift * shift, 0.0)
        mean = x0 + shift
        xc, xct = _centred(x, xt, mask, t_mask, mean, TAIL)
        # One row a program (BLOCK_M == 1): this max is over one value, no exchange.
        if tl.max((shift * shift > ONE_PASS_RATIO * var).to(tl.int32), axis=0) > 0:
            var = tl.math.div_rn(_sum_squares(xc, xct, TAIL), N * 1.0)
    else:
        s1 = tl.sum(d, axis=1)
        if TAIL:
            s1 += tl.sum(tl.where(t_mask, xt - x0[:, None], 0.0), axis=1)
        mean = x0 + tl.math.div_rn(s1, N * 1.0)
        xc, xct = _centred(x, xt, mask, t_mask, mean, TAIL)
        var = tl.math.div_rn(_sum_squares(xc, xct, TAIL), N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    # Many rows (not EARLY): the vectors are loaded here, the tail's after the
    # block is stored, so that at most one pair is live at a time; registers
    # are worth more than the wait then.
    if not EARLY:
        w, b = _load_wb(W, B, cols, N, swn, sbn)
    _store_y(Y, out_rows, cols, mask, xc, rstd, w, b)
    if TAIL:
        if not EARLY:
            wt, bt = _load_wb(W, B, t_cols, N, swn, sbn)
        _store_y(Y, out_rows, t_cols, t_mask, xct, rstd, wt, bt)


@triton.jit
def _chan_merge(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Two partial ``(mean, M2, count)`` merged by Chan et al.'s formula (no cancellation): a reduction's combine."""
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / n
    return mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac, n


@triton.jit
def _wide_stats_welford(x_row, N, sxn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, EVEN: tl.constexpr,
                        KEEP: tl.constexpr):
    """Pass 1 of the looped kernel for rows compiled for their width without a residual (``N_FIXED``): Welford.

    Lane ``j`` sees elements ``j, j + BLOCK_N, ...`` of the row and keeps
    their running mean and ``M2`` (Welford: ``d = x - mean; mean += d / n;
    M2 += d * (x - mean)``, no cancellation whatever the row's offset); in
    half precision one reduction of two sums about x0 merges the lanes, or
    where x0 is far from the mean a reduction by Chan's formula (see the
    module docstring); in float32 two reductions, the mean and then M2.  No
    block waits on a reduction before the loop (the shifted sums' ``k``), and
    no row is read a third time.
    """
    offs = tl.arange(0, BLOCK_N)
    x, _ = load_pair_block(x_row, x_row, offs, N, sxn, sxn, False)  # block 0 (the row is wider than BLOCK_N)
    # block 1 ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, _ = load_pair_block(x_row, x_row, offs + BLOCK_N, N, sxn, sxn, False)
    mean = x.to(tl.float32)
    m2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    # KEEP: the last block is taken after the loop, and returned for pass 2.
    last = (N - 1) // BLOCK_N * BLOCK_N
    for start in range(BLOCK_N, last if KEEP else N, BLOCK_N):
        cols = start + offs
        x, _, x_next, _ = next_pair_block(x_row, x_row, x_next, x_next, cols, N, sxn, sxn, False, BLOCK_N, PREFETCH)
        mean, m2 = _welford_step(mean, m2, x, cols, start, N, BLOCK_N, EVEN)
    if KEEP:  # the last block: loaded ahead by the loop's last step (or before the loop), else now
        x = x_next
        if PREFETCH == 0:
            x, _ = load_pair_block(x_row, x_row, last + offs, N, sxn, sxn, False)
        mean, m2 = _welford_step(mean, m2, x, last + offs, last, N, BLOCK_N, EVEN)
    count = ((N - offs + BLOCK_N - 1) // BLOCK_N).to(tl.float32)  # elements each lane saw
    x0 = tl.load(x_row).to(tl.float32)
    dk = mean - x0
    if x_row.dtype.element_ty == tl.float32:
        # float32 outputs would see the one pass's rounding (see the module
        # docstring): the row's mean first, then the lanes' M2 about it, a sum
        # of terms >= 0 (M2 + count * (mean - row mean)^2) that cannot cancel.
        row_mean = x0 + tl.math.div_rn(tl.sum(count * dk, axis=0), N * 1.0)
        dm = mean - row_mean
        var = tl.math.div_rn(tl.sum(m2 + count * dm * dm, axis=0), N * 1.0)
    else:
        # The lanes merged as sums about the row's first element x0: each
        # lane's count * (mean - x0) and M2 + count * (mean - x0)^2, one
        # reduction of two sums, var = S2 / N - (S1 / N)^2 as in the whole-row
        # kernel's one pass; where x0 is far from the mean (ONE_PASS_RATIO)
        # that cancels and the lanes merge by Chan's formula instead, from the
        # registers.
        s1, s2 = tl.reduce((count * dk, m2 + count * dk * dk), 0, _add_pair)
        shift = tl.math.div_rn(s1, N * 1.0)  # the row's mean - x0
        row_mean = x0 + shift
        var = tl.maximum(tl.math.div_rn(s2, N * 1.0) - shift * shift, 0.0)
        if shift * shift > ONE_PASS_RATIO * var:
            row_mean, row_m2, _n = tl.reduce((mean, m2, count), 0, _chan_merge)
            var = tl.math.div_rn(row_m2, N * 1.0)
    return row_mean, var, x  # x: the last block (KEEP)


@triton.jit
def _welford_step(mean, m2, x, cols, start, N, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """Block ``x`` (columns ``cols`` from ``start`` on) into each lane's running mean and ``M2``, Welford's way."""
    xf = x.to(tl.float32)
    d = xf - mean
    if not EVEN:  # the lanes past N (loaded as 0) keep what they had
        d = tl.where(cols < N, d, 0.0)
    mean += d * (1.0 / (start // BLOCK_N + 1))  # this lane's element start // BLOCK_N + 1
    m2 += d * (xf - mean)
    return mean, m2


@triton.jit
def _wide_stats_shifted(x_row, N, sxn, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, VECTORS: tl.constexpr,
                        EVEN: tl.constexpr):
    """Pass 1 of the looped kernel, half-precision rows without a residual not compiled for their width: shifted sums.

    Each lane keeps running sums of ``d = x - k`` and ``d^2`` over the
    blocks, reduced once at the end, as the whole-row kernel's one pass does
    (see the module docstring); ``k`` is the first block's mean, within
    ``sqrt(N / BLOCK_N - 1)`` standard deviations of the row's, so up to
    ``N = 17 * BLOCK_N`` the exact fallback below never runs.  With
    ``VECTORS`` (blocks wider than pass 2's) a
    running sum covers one vector of 8 elements, not one element.
    """
    # Block 0 first, whole (the row is wider than BLOCK_N): its mean is k
    # (outside the loop: a reduction under `if start == 0` slows every step).
    offs = tl.arange(0, BLOCK_N)
    x, _ = load_pair_block(x_row, x_row, offs, N, sxn, sxn, False)
    # block 1 ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, _ = load_pair_block(x_row, x_row, offs + BLOCK_N, N, sxn, sxn, False)
    k = tl.math.div_rn(tl.sum(x.to(tl.float32), axis=0), BLOCK_N * 1.0)
    d = x.to(tl.float32) - k
    s1 = vector_sums(d, VECTORS, 8)
    s2 = vector_sums(d * d, VECTORS, 8)
    for start in range(BLOCK_N, N, BLOCK_N):
        cols = start + offs
        x, _, x_next, _ = next_pair_block(x_row, x_row, x_next, x_next, cols, N, sxn, sxn, False, BLOCK_N, PREFETCH)
        d = x.to(tl.float32) - k
        if not EVEN:  # the lanes past N (loaded as 0)
            d = tl.where(cols < N, d, 0.0)
        s1 += vector_sums(d, VECTORS, 8)
        s2 += vector_sums(d * d, VECTORS, 8)
    s1, s2 = tl.reduce((s1, s2), 0, _add_pair)
    shift = tl.math.div_rn(s1, N * 1.0)  # mean - k
    mean = k + shift
    var = tl.maximum(tl.math.div_rn(s2, N * 1.0) - shift * shift, 0.0)
    if shift * shift > ONE_PASS_RATIO * var:  # k far from the mean: the exact sum of squares, one more read
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            xb = load_back_block(x_row, x_row, cols, N, sxn, False).to(tl.float32)
            xc = tl.where(cols < N, xb - mean, 0.0)
            acc += xc * xc
        var = tl.math.div_rn(tl.sum(acc, axis=0), N * 1.0)
    return mean, var


@triton.jit
def _wide_stats_chan(x_row, r_row, H, out, N, sxn, srn, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """Pass 1 of the looped kernel in float32 or with a residual: ``(mean, var)``, blocks merged with Chan's formula.

    Each block's mean and ``M2`` are two-pass values (the block is in
    registers).  ``mean`` and ``M2`` are running sums over the blocks: each
    keeps a Kahan compensation (what its roundings added), or on a
    near-constant row (mean >> std) the rounding of the mean at every block
    would pile up.
    """
    mean = tl.zeros([], dtype=tl.float32)
    mean_c = tl.zeros([], dtype=tl.float32)
    m2 = tl.zeros([], dtype=tl.float32)
    m2_c = tl.zeros([], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_N)
    # the first block ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, r_next = load_pair_block(x_row, r_row, offs, N, sxn, srn, HAS_RESIDUAL)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        x, r, x_next, r_next = next_pair_block(x_row, r_row, x_next, r_next, cols, N, sxn, srn, HAS_RESIDUAL,
                                               BLOCK_N, PREFETCH)
        x = add_residual(x.to(tl.float32), r.to(tl.float32), H, out, cols, mask, HAS_RESIDUAL)
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
    return mean - mean_c, tl.math.div_rn(m2 - m2_c, N * 1.0)


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
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used
    ALIGN: tl.constexpr,  # divides every row offset and N (see _rows.row_alignment)
    BLOCK_S: tl.constexpr,  # pass 1's block in half precision without a residual: BLOCK_N, or wider
    EVEN: tl.constexpr,  # BLOCK_N and BLOCK_S divide N: no column masks (see _rows.even_blocks)
    N_FIXED: tl.constexpr,  # N itself, compiled in (constant trip counts, Welford's pass 1), or 0
    KEEP: tl.constexpr = False,  # pass 2 starts from the block pass 1 ended on, in registers
):
    # One row per program, BLOCK_N < N columns at a time.
    if KEEP:  # only Welford's pass 1 (below) ends on a block pass 2 can take
        tl.static_assert(BLOCK_S == BLOCK_N and N_FIXED > BLOCK_N)
    if N_FIXED > 0:
        N = N_FIXED
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    row = tl.program_id(0)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN)
    r_row = R + row_offsets(row, D1, D2, sr0, sr1, sr2, ALIGN)
    out = out_row_offsets(row, N, ALIGN)

    # Pass 1: the row's mean and variance; with a residual, h = x + residual
    # is formed, rounded and stored here.  Welford's lanes (rows compiled for
    # their width) or, in half precision, shifted sums; with a residual,
    # Chan's merge of blocks.
    if N_FIXED > 0 and not HAS_RESIDUAL:
        mean, var, x_keep = _wide_stats_welford(x_row, N, sxn, BLOCK_S, PREFETCH, EVEN, KEEP)
    elif X.dtype.element_ty != tl.float32 and not HAS_RESIDUAL:
        mean, var = _wide_stats_shifted(x_row, N, sxn, BLOCK_S, PREFETCH, BLOCK_S > BLOCK_N, EVEN)
    else:
        mean, var = _wide_stats_chan(x_row, r_row, H, out, N, sxn, srn, HAS_RESIDUAL, BLOCK_N, PREFETCH)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))

    if HAS_RESIDUAL:
        # Pass 2 reads h back; make this program's stores visible to all its threads.
        tl.debug_barrier()
    # Pass 2: normalise and store, walking the row backwards (the blocks that
    # pass 1 read last are the likeliest to be in cache still); with PREFETCH
    # the block before this one is loaded ahead as in pass 1.
    # Every row reads w and b again, from L2.
    offs = tl.arange(0, BLOCK_N)
    last = (N - 1) // BLOCK_N * BLOCK_N
    FIRST: tl.constexpr = BLOCK_N if KEEP else 0  # blocks already done, from the registers
    if KEEP:
        w, b = _load_wb(W, B, last + offs, N, swn, sbn, EVEN)
        _norm_block(Y, out, last + offs, x_keep, w, b, mean, rstd, N, EVEN)
    # the first block ahead (dead code without PREFETCH >= 2: see _rows.load_pair_block)
    x_next = load_back_block(x_row, H + out, last - FIRST + offs, N, sxn, HAS_RESIDUAL)
    w_next, b_next = _load_wb(W, B, last - FIRST + offs, N, swn, sbn)  # (KEEP: N > BLOCK_N, so last - FIRST >= 0)
    for offset in range(FIRST, N, BLOCK_N):
        cols = (last - offset) + offs
        if PREFETCH >= 2:
            x, w, b = x_next, w_next, b_next
            prev = cols - BLOCK_N
            x_next = load_back_block(x_row, H + out, prev, N, sxn, HAS_RESIDUAL)
            w_next = tl.load(W + prev * swn, mask=prev >= 0, other=0.0)
            b_next = tl.load(B + prev * sbn, mask=prev >= 0, other=0.0)
        else:
            x = load_back_block(x_row, H + out, cols, N, sxn, HAS_RESIDUAL, EVEN)
            w, b = _load_wb(W, B, cols, N, swn, sbn, EVEN)
        _norm_block(Y, out, cols, x, w, b, mean, rstd, N, EVEN)


@triton.jit
def _norm_block(Y, out, cols, x, w, b, mean, rstd, N, EVEN: tl.constexpr):
    """Pass 2 of the looped kernel, one block: ``y = (x - mean) * rstd * w + b``, stored (``EVEN``: no column mask)."""
    y = (x.to(tl.float32) - mean) * rstd * w.to(tl.float32) + b.to(tl.float32)
    tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=None if EVEN else cols < N)


@triton.jit
def _chunk_partial(x, mask, x0, split, N, CHUNK: tl.constexpr):
    """A chunk's ``(s_c, M2_c)``: its sum of deviations from ``x0``, and of squared deviations from its own mean."""
    d = tl.where(mask, x - x0, 0.0)
    s_c = tl.sum(d, axis=0)
    dc = tl.where(mask, d - tl.math.div_rn(s_c, chunk_width(split, N, CHUNK) * 1.0), 0.0)
    return s_c, tl.sum(dc * dc, axis=0)


@triton.jit
def layer_norm_coop_kernel(
    X, R, W, B, Y, H, Part, Count,  # as layer_norm_kernel, then the workspace (see _coop.workspace)
    n_rows, N, D1, D2,
    sx0, sx1, sx2, sxn,
    sr0, sr1, sr2, srn,
    swn, sbn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,  # programs a row
    SLOTS: tl.constexpr,  # SPLITS rounded up to a power of two
    ALIGN: tl.constexpr,
    EARLY: tl.constexpr,  # load weight and bias before the wait (see COOP_EARLY_MAX)
    LOOP_ROWS: tl.constexpr,  # many rows: loop over the group's rows (see _coop.py); else one row a program
    COOPERATIVE: tl.constexpr,  # False under the interpreter (see _coop.py)
):
    # Program (group, split) holds columns [split * CHUNK, (split + 1) * CHUNK)
    # of rows group, group + groups, ... (a few rows: one row a group).
    N = aligned_width(N, ALIGN)
    group = tl.program_id(0)
    split = tl.program_id(1)
    groups = tl.num_programs(0)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    # the first row ahead (dead code without LOOP_ROWS: see _rows.load_pair_block)
    x_next, r_next = load_raw_chunk(X, R, group, n_rows, cols, N, D1, D2, sx0, sx1, sx2, sxn,
                                    sr0, sr1, sr2, srn, ALIGN, HAS_RESIDUAL)
    rows_here = 1  # a constant trip count of 1: the compiler drops the loop
    if LOOP_ROWS:
        rows_here = tl.cdiv(n_rows - group, groups)
        if EARLY:  # once, for every row of the group
            w, b = _load_wb(W, B, cols, N, swn, sbn)
    for k in range(0, rows_here):  # this group's k-th row
        x, x_next, r_next, x_row, r_row, out = row_chunk(
            X, R, H, group + k * groups, n_rows, groups, x_next, r_next, cols, N, D1, D2,
            sx0, sx1, sx2, sxn, sr0, sr1, sr2, srn, ALIGN, HAS_RESIDUAL, LOOP_ROWS)
        if EARLY and not LOOP_ROWS:  # after the row, which the partials wait for; the wait below hides them
            w, b = _load_wb(W, B, cols, N, swn, sbn)
        # Deviations are taken from the row's first element x0, as in
        # layer_norm_kernel: a constant row gets exactly its value as mean, y = b.
        x0 = tl.load(x_row).to(tl.float32)
        if HAS_RESIDUAL:
            x0 = to_dtype(x0 + tl.load(r_row).to(tl.float32), H.dtype.element_ty).to(tl.float32)

        slots = row_slots(group, k)
        if COOPERATIVE:
            s_c, m2_c = _chunk_partial(x, mask, x0, split, N, CHUNK)
            publish(Part, slots, split, s_c, m2_c, SPLITS)
            arrive_and_wait(Count, group, split, SPLITS)
        else:  # the interpreter: this program computes every chunk's partial itself
            for c in range(SPLITS):
                c_cols = c * CHUNK + tl.arange(0, CHUNK)
                c_mask = c_cols < N
                xc = load_chunk(X, R, H, x_row, r_row, out, c_cols, c_mask, sxn, srn, HAS_RESIDUAL)
                s_c, m2_c = _chunk_partial(xc, c_mask, x0, c, N, CHUNK)
                publish(Part, slots, c, s_c, m2_c, SPLITS)
        # Merge (Chan et al., all chunks at once): the spread of the chunk means
        # about the row's mean adds to the chunks' own M2.
        sums, m2s, valid = gather(Part, slots, SPLITS, SLOTS, 0.0, 0.0)
        n_c = chunk_width(tl.arange(0, SLOTS), N, CHUNK) * 1.0
        shift = tl.math.div_rn(tl.sum(sums, axis=0), N * 1.0)  # mean - x0
        spread = tl.where(valid, tl.math.div_rn(sums, tl.where(valid, n_c, 1.0)) - shift, 0.0)
        var = tl.math.div_rn(tl.sum(m2s, axis=0) + tl.sum(n_c * spread * spread, axis=0), N * 1.0)
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
        if not EARLY:  # large chunks: registers are worth more than the wait
            w, b = _load_wb(W, B, cols, N, swn, sbn)
        xc = tl.where(mask, x - (x0 + shift), 0.0)
        y = xc * rstd * w.to(tl.float32) + b.to(tl.float32)
        tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=mask)


def _layer_norm(
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    config: RowConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch; returns ``(y, h)``."""
    plan = planned((op, eps, config), (x, residual, weight, bias), _plan, op, x, residual, weight, bias, eps, config)
    y = output_like(x, plan)
    h = None if residual is None else torch.empty_like(y)
    if plan is not None:
        # Without a residual, R is never read and H never written: x and y stand in.
        plan.launch(x, x if residual is None else residual, weight, bias, y, y if h is None else h)
    return y, h


def _plan(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
          eps: float, config: RowConfig | None = None) -> Plan | None:
    """Check the inputs and build the launch of ``config`` (default: the table's); None when there is nothing to do."""
    if residual is None:
        check_tensors(op, x=x, weight=weight, bias=bias)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight, bias=bias)
    n = check_row_shapes(op, x, residual, weight=weight, bias=bias)
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, *((x,) if residual is None else (x, residual)))
    rows, (_, d1, d2) = layout.rows, layout.dims
    args = (*layout.strides[0], *(layout.strides[1] if residual is not None else (0, 0, 0, 0)),
            weight.stride(0), bias.stride(0), float(eps))
    cfg = config or row_config(op, x.dtype, rows, n)
    align = row_alignment(n, layout)
    if cfg.kernel == "looped":
        even = not cfg.masked and even_blocks(n, cfg.block_n, cfg.stats_block)
        plan = Plan(layer_norm_wide_kernel, (rows,), n, d1, d2, *args, HAS_RESIDUAL=residual is not None,
                    BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch, ALIGN=align, BLOCK_S=cfg.stats_block, EVEN=even,
                    N_FIXED=n if cfg.fixed else 0, KEEP=cfg.keep and even and cfg.block_n < n,
                    num_warps=cfg.warps)
    else:
        block_m, block_n, block_t, warps = whole_blocks(cfg, rows, n)
        plan = Plan(layer_norm_kernel, (triton.cdiv(rows, block_m),), rows, n, d1, d2, *args,
                    HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t,
                    ALIGN=align, EARLY=cfg.early, num_warps=warps)
    coop = coop_config(rows, n, x.element_size(), x.device, cfg.split)
    if coop is None:
        return plan
    return Plan(layer_norm_coop_kernel, (coop.groups or rows, coop.splits), rows, n, d1, d2, *args,
                scratch=workspace, fallback=plan, HAS_RESIDUAL=residual is not None, CHUNK=coop.chunk,
                SPLITS=coop.splits, SLOTS=coop.slots, ALIGN=align, EARLY=coop.chunk <= COOP_EARLY_MAX,
                LOOP_ROWS=coop.groups is not None, COOPERATIVE=not _rows.interpreting(),
                num_warps=coop.num_warps, **launch_options())


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


def with_config(op: str, config: RowConfig) -> Callable[..., object]:
    """``op`` (``layer_norm`` or ``add_layer_norm``) with the canonical signature, launched with ``config``."""
    if op == "layer_norm":
        return lambda x, weight, bias, eps=1e-5: _layer_norm(op, x, None, weight, bias, eps, config)[0]
    return lambda x, residual, weight, bias, eps=1e-5: _layer_norm(op, x, residual, weight, bias, eps, config)


__all__ = ["add_layer_norm", "layer_norm", "layer_norm_coop_kernel", "layer_norm_kernel", "layer_norm_wide_kernel",
           "with_config"]
