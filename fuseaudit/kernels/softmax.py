"""Fused scaled softmax over the last dim, in one kernel launch.

The maths, per row ``x`` of ``N`` elements::

    s = x * scale                      # in float32: no half-precision overflow
    m = max(s)                         # subtracting it keeps exp() <= 1, so
    e = exp(s - m)                     # logits ~ 10000 cannot overflow
    y = e / sum(e)                     # rounded to the input dtype at the store

Masked lanes (past the end of the row) hold ``-inf`` after the scaling, so
they neither raise the max nor add to the sum (``exp(-inf) = 0``).

Three kernels; which one a call takes, and how it is launched, is a
:class:`~._tuning.RowConfig` looked up in the op's table (``_tuning.py``):

* :func:`softmax_kernel` keeps whole rows in registers: one read, one write.
  ``BLOCK_M`` rows a program; a row may be a block plus a tail block.
* :func:`softmax_wide_kernel` loops over a row in blocks of ``BLOCK_N``.
  Pass 1 is the "online" softmax over column blocks: it keeps a reference
  ``m`` (the running max) and a running sum ``d`` of ``exp(s - m)``,
  rescaling the sum when the max grows::

      m' = max(s_block)  if it exceeds m by more than RESCALE_SLACK,  else m
      d' = d * exp(m - m') + sum(exp(s_block - m'))

  Each rescale costs an ulp or two of ``d``, so ``m`` moves only for a real
  jump (the exps of logits it lags behind stay below ``e^8``: no overflow),
  and ``d`` is summed with Kahan's compensation.  Pass 2 writes
  ``exp(s - m) / d``, so the row is read twice (the second read usually hits
  L2).  With ``RowConfig.lanes`` (half precision) pass 1 works in lanes
  instead: each run of a thread's neighbouring elements keeps its own ``m``
  and ``d`` by the same update, and the runs merge once, after the loop, as
  the cooperative kernel's chunks do (below), where the block-wise pass
  reduces each block across the program twice.
* :func:`softmax_coop_kernel` splits each row (a few wide rows: decode)
  over ``SPLITS`` programs of one cooperative launch (see
  ``_coop.py``).  Each holds a chunk in registers and publishes its max
  ``m_c`` and ``d_c = sum(exp(s - m_c))``; the row's are::

      m = max(m_c),   d = sum(d_c * exp(m_c - m))

Precision of ``exp``: see :func:`_exp`.  In half precision every term of a
row's sum and every output carry a factor ``K = 2^64`` that cancels in the
division (:func:`_exp_k`: three operations an element, subnormals kept).
Every output, however tiny (a row of
100k columns gives outputs near 1e-5; logits 100 below the max give 1e-44),
keeps its relative precision rather than turning into zero.

Rows are addressed in place whatever the strides (see ``_rows.py``); the
output is a new contiguous tensor, so an output row starts at ``row * N``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import _rows
from ._coop import arrive_and_wait, coop_config, gather, launch_options, publish, workspace
from ._launch import Plan, output_like, planned
from ._rows import (
    aligned_width,
    check_tensors,
    even_blocks,
    load_back_block,
    load_pair_block,
    next_pair_block,
    out_row_offsets,
    row_alignment,
    row_layout,
    row_offsets,
    to_dtype,
)
from ._tuning import RowConfig, row_config, whole_blocks

# The looped kernel's lanes (RowConfig.lanes): a run of this many bytes, one thread's vector load.
LANE_BYTES = 16

# exp(u) = 2^(u * log2 e).  LOG2E rounds to float32 in the kernel; LN2 and
# LN2_LO are ln 2 rounded to float32 and what that rounding drops.
LOG2E = tl.constexpr(1.4426950216293335)  # float32(log2 e), exact in float32
LN2 = tl.constexpr(0.6931471824645996)  # float32(ln 2), exact in float32
LN2_LO = tl.constexpr(-1.904654323148236e-09)  # ln 2 - float32(ln 2)
TWO_POW_M64 = tl.constexpr(5.421010862427522e-20)  # 2^-64, exact
# Logits further than this below the max give exp(u) = 0 in float32 either way.
U_FLOOR = tl.constexpr(-10000.0)
# The wide kernel moves its reference max only for jumps beyond this (in logits).
RESCALE_SLACK = tl.constexpr(8.0)
# log2 of _exp_k's K in half precision.
EXP_K_LOG2 = tl.constexpr(64.0)


@triton.jit
def _exp(u, PRECISE: tl.constexpr):
    """``exp(u)`` in float32 for a logit ``u`` minus the row max (``u <= 8``; ``-inf`` gives 0).

    On NVIDIA GPUs ``exp2`` is ``ex2.approx.ftz``: about 2 ulp, but results
    below 2^-126 (float32 and bfloat16 subnormals) are flushed to zero.  So
    for ``t = u * log2 e < -126`` take ``2^(t + 64)`` (normal; ``t + 64`` is
    exact there) and scale it by ``2^-64`` with an exact, subnormal-aware
    multiply.

    ``PRECISE`` (float32 outputs): rounding ``t`` itself costs ``|t| * 2^-24``
    relative, ~50 ulp at ``u = -100``.  What it dropped, in natural-log units,
    is ``c = u - t ln 2`` (two fmas: ``t ln 2`` nearly cancels ``u``), and
    ``exp(u) = 2^t e^c ~ 2^t (1 + c)``.  ``u`` is floored first (NaN kept) so
    that ``-inf`` gives ``2^t = 0`` and a finite ``c``.  Half-precision
    outputs have 2^-11 ulps and do not need it.
    """
    if PRECISE:
        u = tl.maximum(u, U_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    t = u * LOG2E
    tiny = t < -126.0
    e = tl.exp2(tl.where(tiny, t + 64.0, t))
    if PRECISE:
        c = tl.fma(-t, LN2, u)
        c = tl.fma(-t, LN2_LO, c)
        e = tl.fma(e, c, e)
    return tl.where(tiny, e * TWO_POW_M64, e)


@triton.jit
def _exp_k(u, PRECISE: tl.constexpr):
    """``K exp(u)`` for a logit ``u`` minus the row max: ``K = 2^64`` for half-precision outputs, 1 for float32.

    Every term of a row's sum and every output go through here, so ``K``
    cancels in ``y = e / sum(e)``.  In half precision it replaces
    :func:`_exp`'s care for tiny results: ``2^(t + 64)`` is normal wherever
    ``exp(u)`` is a float32 at all (``t = u log2 e >= -150``; below that
    ``ex2``'s flush to zero is the right answer), and the one multiply that
    scales it back, ``e * (1 / d)``, rounds subnormal outputs as it should.
    ``t + 64`` is one fma (``u log2 e + 64``) whose rounding costs at most
    ``2^-18`` in ``t``, about 3e-6 relative: a thousandth of a bfloat16 ulp
    and a hundredth of a float16 one.  No overflow: ``u <= RESCALE_SLACK``
    gives ``K exp(u) < 2^76``, and a row's sum stays below ``2^107`` up to
    ``2^31`` columns.  Three operations an element instead of eight.
    Ratios between a row's maxima (rescaling a sum) take :func:`_exp`.
    """
    if PRECISE:
        return _exp(u, True)
    return tl.exp2(u * LOG2E + EXP_K_LOG2)


@triton.jit
def _load_logits(X, x_rows, rows_mask, cols, N, sxn, scale, FULL: tl.constexpr):
    """``x * scale`` for a tile of rows x cols in float32, ``-inf`` past the end of the row, and its mask.

    ``FULL``: every column of ``cols`` is inside the row (the full block of a
    row with a tail), so only the rows are masked and no lane is ``-inf``.
    """
    col_mask = (cols < N)[None, :]
    mask = rows_mask[:, None] if FULL else rows_mask[:, None] & col_mask
    x = tl.load(X + x_rows[:, None] + cols[None, :].to(tl.int64) * sxn, mask=mask, other=0.0).to(tl.float32)
    # Scale first, then mask: -inf * scale would be +inf or NaN for scale <= 0.
    # (Rows past the end keep their zeros: no -inf - -inf = NaN in their lanes.)
    return (x * scale if FULL else tl.where(col_mask, x * scale, float("-inf"))), mask


@triton.jit
def softmax_kernel(
    X, Y,  # input, output
    n_rows, N, D1, D2,  # rows, hidden size, folded leading dims (see _rows.py)
    sx0, sx1, sx2, sxn,  # strides of x
    scale,
    PRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ALIGN: tl.constexpr,  # divides every row offset (see _rows.row_alignment)
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N, or BLOCK_N columns and a
    # tail block of BLOCK_T, which follows every step.
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M > 1:
        row_mask = rows < n_rows
    else:
        # One row a program: the grid is the rows, so the row exists.  Said as a
        # constant, the masks are the columns' alone: fewer registers a thread.
        row_mask = tl.full([BLOCK_M], 1, tl.int1)
    x_rows = row_offsets(rows, D1, D2, sx0, sx1, sx2, ALIGN)
    out_rows = out_row_offsets(rows, N, ALIGN)[:, None]

    # The tail is loaded with the block, before either is reduced: one wait
    # for memory, not two (a reduction is a barrier the loads do not cross).
    cols = tl.arange(0, BLOCK_N)
    s, mask = _load_logits(X, x_rows, row_mask, cols, N, sxn, scale, BLOCK_T > 0)  # with a tail: N > BLOCK_N
    if BLOCK_T > 0:
        t_cols = BLOCK_N + tl.arange(0, BLOCK_T)
        st, t_mask = _load_logits(X, x_rows, row_mask, t_cols, N, sxn, scale, False)
    m = tl.max(s, axis=1)
    if BLOCK_T > 0:
        m = tl.maximum(m, tl.max(st, axis=1))
    e = _exp_k(s - m[:, None], PRECISE)
    d = tl.sum(e, axis=1)  # >= K: the max contributes K exp(0)
    if BLOCK_T > 0:
        et = _exp_k(st - m[:, None], PRECISE)
        d += tl.sum(et, axis=1)
    inv_d = tl.math.div_rn(1.0, d)[:, None]

    tl.store(Y + out_rows + cols[None, :], to_dtype(e * inv_d, Y.dtype.element_ty), mask=mask)
    if BLOCK_T > 0:
        tl.store(Y + out_rows + t_cols[None, :], to_dtype(et * inv_d, Y.dtype.element_ty), mask=t_mask)


@triton.jit
def softmax_wide_kernel(
    X, Y,
    N, D1, D2,
    sx0, sx1, sx2, sxn,
    scale,
    PRECISE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used
    ALIGN: tl.constexpr,  # divides every row offset and N (see _rows.row_alignment)
    EVEN: tl.constexpr,  # BLOCK_N divides N: no column masks (see _rows.even_blocks)
    VEC: tl.constexpr = 0,  # pass 1 per run of VEC elements (_lane_stats), or 0: per block
):
    # One row per program, BLOCK_N < N columns at a time.
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    row = tl.program_id(0)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN)
    out = out_row_offsets(row, N, ALIGN)
    offs = tl.arange(0, BLOCK_N)

    if VEC > 0:
        m, d = _lane_stats(x_row, N, sxn, scale, PRECISE, BLOCK_N, PREFETCH, EVEN, VEC)
    else:
        m, d = _block_stats(x_row, N, sxn, scale, PRECISE, BLOCK_N, PREFETCH, EVEN)
    inv_d = tl.math.div_rn(1.0, d)

    # Pass 2: normalise and store, walking the row backwards (the blocks that
    # pass 1 read last are the likeliest to be in cache still); with PREFETCH
    # the block before this one is loaded ahead as in pass 1.
    last = (N - 1) // BLOCK_N * BLOCK_N
    # the first block ahead (dead code without PREFETCH >= 2: see _rows.load_pair_block)
    x_next = load_back_block(x_row, x_row, last + offs, N, sxn, False)
    for offset in range(0, N, BLOCK_N):
        cols = (last - offset) + offs
        if PREFETCH >= 2:
            x = x_next
            x_next = load_back_block(x_row, x_row, cols - BLOCK_N, N, sxn, False)
        else:
            x = load_back_block(x_row, x_row, cols, N, sxn, False, EVEN)
        y = _exp_k(x.to(tl.float32) * scale - m, PRECISE) * inv_d
        # y evict-first: L2 keeps the rows whose second read is still to come.
        tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=None if EVEN else cols < N,
                 eviction_policy="evict_first")


@triton.jit
def _next_logits(x_row, x_next, cols, N, sxn, scale, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                 EVEN: tl.constexpr):
    """A pass-1 step: the logits ``x * scale`` at ``cols`` in float32 (``-inf`` past N), and the block loaded ahead.

    (See ``_rows.next_pair_block``: with ``PREFETCH`` the block at ``cols``
    is ``x_next``, loaded the step before.)
    """
    x, _, x_next, _ = next_pair_block(x_row, x_row, x_next, x_next, cols, N, sxn, sxn, False, BLOCK_N, PREFETCH)
    s = x.to(tl.float32) * scale
    if not EVEN:  # the lanes past N
        s = tl.where(cols < N, s, float("-inf"))
    return s, x_next


@triton.jit
def _lane_stats(x_row, N, sxn, scale, PRECISE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                EVEN: tl.constexpr, VEC: tl.constexpr):
    """Pass 1 of the looped kernel with no reduction across threads inside the loop: ``(m, d)``.

    Each run of ``VEC`` neighbouring lanes (one thread's vector load) keeps
    its own reference ``m_v`` and sum ``d_v``, updated as the block-wise
    pass updates the row's (``RESCALE_SLACK``, ``K``); the runs merge once
    at the end, as the cooperative kernel merges its chunks::

        m = max(m_v),   d = sum(d_v * exp(m_v - m))

    Every row element ``s`` stays within ``RESCALE_SLACK`` of its run's
    ``m_v``, so of ``m`` too: pass 2's ``exp(s - m)`` does not overflow.
    Only half-precision rows take this pass (``RowConfig.lanes``): a run
    adds ``VEC * N / BLOCK_N`` terms (48 at most in the shipped table up to
    98303 columns, 32 at 131072), whose float32 rounding stays far below a
    half-precision ulp without Kahan's compensation.
    """
    offs = tl.arange(0, BLOCK_N)
    m_v = tl.full([BLOCK_N // VEC], float("-inf"), dtype=tl.float32)
    d_v = tl.zeros([BLOCK_N // VEC], dtype=tl.float32)
    # the first block ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, _ = load_pair_block(x_row, x_row, offs, N, sxn, sxn, False)
    for start in range(0, N, BLOCK_N):
        s, x_next = _next_logits(x_row, x_next, start + offs, N, sxn, scale, BLOCK_N, PREFETCH, EVEN)
        s = tl.reshape(s, [BLOCK_N // VEC, VEC])
        m_blk = tl.max(s, axis=1)
        m_new = tl.where(m_blk > m_v + RESCALE_SLACK, m_blk, m_v)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a run of -inf so far: measure from 0
        d_v = d_v * _exp(m_v - m_ref, PRECISE) + tl.sum(_exp_k(s - m_ref[:, None], PRECISE), axis=1)
        m_v = m_new
    m = tl.max(m_v, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    d = tl.sum(d_v * _exp(m_v - m_ref, PRECISE), axis=0)
    return m, d


@triton.jit
def _block_stats(x_row, N, sxn, scale, PRECISE: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                 EVEN: tl.constexpr):
    """Pass 1 of the looped kernel, a block at a time: ``(m, d)``, the reference max and the sum of exps."""
    # A reference m (the running max, give or take RESCALE_SLACK) and
    # the running sum d of exp(s - m).
    m = tl.full([], float("-inf"), dtype=tl.float32)
    d = tl.zeros([], dtype=tl.float32)
    d_lost = tl.zeros([], dtype=tl.float32)  # Kahan: what rounding d has dropped
    # PREFETCH: as in rms_norm_wide_kernel.
    offs = tl.arange(0, BLOCK_N)
    # the first block ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, _ = load_pair_block(x_row, x_row, offs, N, sxn, sxn, False)
    for start in range(0, N, BLOCK_N):
        s, x_next = _next_logits(x_row, x_next, start + offs, N, sxn, scale, BLOCK_N, PREFETCH, EVEN)
        m_blk = tl.max(s, axis=0)
        m_new = tl.where(m_blk > m + RESCALE_SLACK, m_blk, m)
        # While every logit so far is -inf, measure from 0 (exps are 0, not NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m - m_ref, PRECISE)  # 1 unless the reference moved
        # d = d * alpha + sum(K exp(s - m')), compensated: a plain running sum
        # over many blocks would lose about sqrt(blocks) ulps.  (alpha, a ratio
        # of two exps, carries no K; see _exp_k.)
        d = d * alpha
        add = tl.sum(_exp_k(s - m_ref, PRECISE), axis=0) - d_lost * alpha
        d_new = d + add
        d_lost = (d_new - d) - add
        d = d_new
        m = m_new
    return m, d


@triton.jit
def _chunk_logits(x_row, cols, N, sxn, scale):
    """``x * scale`` for one chunk of a row in float32, ``-inf`` past the end of the row."""
    mask = cols < N
    x = tl.load(x_row + cols.to(tl.int64) * sxn, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x * scale, float("-inf"))  # scale first (see _load_logits)


@triton.jit
def _chunk_partial(s, PRECISE: tl.constexpr):
    """A chunk's max ``m_c`` and ``d_c = sum(exp(s - m_c))`` (exps measured from 0 while the chunk is all ``-inf``)."""
    m_c = tl.max(s, axis=0)
    return m_c, tl.sum(_exp_k(s - tl.where(m_c == float("-inf"), 0.0, m_c), PRECISE), axis=0)


@triton.jit
def softmax_coop_kernel(
    X, Y, Part, Count,  # input, output, the workspace (see _coop.workspace)
    N, D1, D2,
    sx0, sx1, sx2, sxn,
    scale,
    PRECISE: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,  # programs a row
    SLOTS: tl.constexpr,  # SPLITS rounded up to a power of two
    ALIGN: tl.constexpr,
    COOPERATIVE: tl.constexpr,  # False under the interpreter (see _coop.py)
):
    # Program (row, split) holds columns [split * CHUNK, (split + 1) * CHUNK) of its row.
    N = aligned_width(N, ALIGN)
    row = tl.program_id(0)
    split = tl.program_id(1)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN)
    out = out_row_offsets(row, N, ALIGN)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    s = _chunk_logits(x_row, cols, N, sxn, scale)

    if COOPERATIVE:
        m_c, d_c = _chunk_partial(s, PRECISE)
        publish(Part, row, split, m_c, d_c, SPLITS)
        arrive_and_wait(Count, row, split, SPLITS)
    else:  # the interpreter: this program computes every chunk's partial itself
        for c in range(SPLITS):
            m_c, d_c = _chunk_partial(_chunk_logits(x_row, c * CHUNK + tl.arange(0, CHUNK), N, sxn, scale), PRECISE)
            publish(Part, row, c, m_c, d_c, SPLITS)
    # Merge: rescale every chunk's sum to the row's max (exp(m_c - m) <= 1).
    maxes, sums, _ = gather(Part, row, SPLITS, SLOTS, float("-inf"), 0.0)
    m = tl.max(maxes, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an all -inf row: 0 / 0 = NaN, as in eager
    d = tl.sum(sums * _exp(maxes - m, PRECISE), axis=0)
    y = _exp_k(s - m, PRECISE) * tl.math.div_rn(1.0, d)
    tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=cols < N)


def softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``torch.softmax(x * scale, dim=-1)`` in one launch; ``x`` is ``(..., N)``, any strides."""
    return _softmax(x, scale)


def _softmax(x: torch.Tensor, scale: float, config: RowConfig | None = None) -> torch.Tensor:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch."""
    plan = planned(("softmax", scale, config), (x,), _plan, x, scale, config)
    y = output_like(x, plan)
    if plan is not None:
        plan.launch(x, y)
    return y


def _plan(x: torch.Tensor, scale: float, config: RowConfig | None = None) -> Plan | None:
    """Check ``x`` and build the launch of ``config`` (default: the table's); None when there is nothing to do."""
    check_tensors("softmax", x=x)
    if x.dim() == 0:
        raise ValueError("softmax: x must have at least one dim (the hidden dim), got a scalar")
    n = x.shape[-1]
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, x)
    rows, (_, d1, d2) = layout.rows, layout.dims
    args = (*layout.strides[0], float(scale))
    precise = x.dtype == torch.float32
    cfg = config or row_config("softmax", x.dtype, rows, n)
    align = row_alignment(n, layout)
    if cfg.kernel == "looped":
        plan = Plan(softmax_wide_kernel, (rows,), n, d1, d2, *args, PRECISE=precise, BLOCK_N=cfg.block_n,
                    PREFETCH=cfg.prefetch, ALIGN=align, EVEN=not cfg.masked and even_blocks(n, cfg.block_n),
                    VEC=LANE_BYTES // x.element_size() if cfg.lanes else 0, num_warps=cfg.warps)
    else:
        block_m, block_n, block_t, warps = whole_blocks(cfg, rows, n)
        plan = Plan(softmax_kernel, (triton.cdiv(rows, block_m),), rows, n, d1, d2, *args, PRECISE=precise,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t, ALIGN=align, num_warps=warps)
    coop = coop_config(rows, n, x.element_size(), x.device, cfg.split)
    if coop is None:
        return plan
    return Plan(softmax_coop_kernel, (rows, coop.splits), n, d1, d2, *args, scratch=workspace, fallback=plan,
                PRECISE=precise, CHUNK=coop.chunk, SPLITS=coop.splits, SLOTS=coop.slots, ALIGN=align,
                COOPERATIVE=not _rows.interpreting(), num_warps=coop.num_warps, **launch_options())


def with_config(op: str, config: RowConfig) -> Callable[..., object]:
    """``softmax`` with its canonical signature, launched with ``config`` whatever the table says (tests, tuning)."""
    assert op == "softmax", op
    return lambda x, scale=1.0: _softmax(x, scale, config)


__all__ = ["softmax", "softmax_coop_kernel", "softmax_kernel", "softmax_wide_kernel", "with_config"]
