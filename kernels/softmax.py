"""Fused scaled softmax over the last dim, in one kernel launch.

The maths, per row ``x`` of ``N`` elements::

    s = x * scale                      # in float32: no half-precision overflow
    m = max(s)                         # subtracting it keeps exp() <= 1, so
    e = exp(s - m)                     # logits ~ 10000 cannot overflow
    y = e / sum(e)                     # rounded to the input dtype at the store

Masked lanes (past the end of the row) hold ``-inf`` after the scaling, so
they neither raise the max nor add to the sum (``exp(-inf) = 0``).

Three kernels share the work:

* :func:`softmax_kernel` keeps whole rows in registers: one read, one write.
  Short rows go ``BLOCK_M`` to a program; a row that is not a power of two
  may be a block plus a tail block (``_rows.RowBlocks``).
* :func:`softmax_wide_kernel` is for rows wider than ``_rows.MAX_FUSED_BYTES``.
  Pass 1 is the "online" softmax over column blocks: it keeps a reference
  ``m`` (the running max) and a running sum ``d`` of ``exp(s - m)``,
  rescaling the sum when the max grows::

      m' = max(s_block)  if it exceeds m by more than RESCALE_SLACK,  else m
      d' = d * exp(m - m') + sum(exp(s_block - m'))

  Each rescale costs an ulp or two of ``d``, so ``m`` moves only for a real
  jump (the exps of logits it lags behind stay below ``e^8``: no overflow),
  and ``d`` is summed with Kahan's compensation.  Pass 2 writes
  ``exp(s - m) / d``, so the row is read twice (the second read usually hits
  L2).  Half-precision rows (``RowBlocks.lanes``, see ``TUNING``) take
  pass 1 in lanes instead: each run of a thread's neighbouring elements
  keeps its own ``m`` and ``d`` by the same update, and the runs merge once,
  after the loop, as the cooperative kernel's chunks do (below), where the
  block-wise pass reduces each block across the program twice; with
  prefetching that measured faster on the H200 (see ``TUNING``).
* :func:`softmax_coop_kernel` is for a few wide rows (decode): each row is
  split over ``SPLITS`` programs of one cooperative launch (see
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

import torch
import triton
import triton.language as tl

from . import _rows
from ._coop import arrive_and_wait, coop_config, gather, launch_options, publish, workspace
from ._launch import Plan, output_like, planned
from ._rows import (
    HalfLong,
    RowTuning,
    TailSplit,
    TwoBlocks,
    aligned_width,
    check_tensors,
    even_blocks,
    load_back_block,
    load_pair_block,
    next_pair_block,
    out_row_offsets,
    row_alignment,
    row_block_config,
    row_layout,
    row_offsets,
    to_dtype,
)

# Two reductions and an exp per element: more threads per row than the norms
# (H200, bf16, 16384 rows: N=14336 in 304 µs with 32 warps, 329 with 16, 433 with 8).
# Split tails in half precision only: float32 N=5120 took 208 µs split, 198 padded.
# Wide float32 rows loop in blocks of 8192 in 16 warps (see RowTuning.float32_wide; rows of 49152 and more:
# float32_long, below), prefetching in both passes (RowBlocks.prefetch; H200, 16384 rows, 0 -> 1 -> 2
# passes: N = 11008 379.4 -> 351.2 -> 353.0 µs, 16384 511.0 -> 540.1 -> 521.0,
# 32768 1201.7 -> 1085.6 -> 1071.1, 65536 2737.7 -> 2595.9 -> 2562.1); half-precision
# rows do not (bf16 11008 206.3 -> 207.1 -> 210.9, 65536 1313.8 -> 1317.7 -> 1313.4).
# From 2048 rows, float32 rows of exactly 8192 loop over two blocks of 4096 (see _rows.TwoBlocks).
# Half-precision rows of 65536 and more (a vocabulary's logits) loop in blocks of 16384 in
# 16 warps (H200, event time after an L2 flush, 8192 x 8 warps -> 16384 x 16, µs: bf16
# 16384 x 65536 1371.6 -> 1218.2, float16 1374.2 -> 1193.2, bf16 1024 x 65536 98.7 -> 88.2,
# 4096 x 131072 753.5 -> 689.1, 1024 x 128256 199.0 -> 185.0; narrower rows lost, 16384 x
# 32768 590.0 -> 622.2, 16384 x 40000 766.4 -> 871.7; reports/h200/softmax-wide2-session17.txt).
# Up to 128 such rows (one program a row, each alone on an SM of an H100/H200: a vocabulary
# at decode, past the cooperative split) they loop in blocks of 32768 in 32 warps (16384 x
# 16 -> 32768 x 32, µs: bf16 64 x 128256 27.0 -> 23.1, 48 x 128256 25.0 -> 21.5, 128 x
# 128256 32.5 -> 29.9, 64 x 151936 33.4 -> 28.3, 128 x 65536 17.5 -> 16.4, float16 64 x
# 128256 25.9 -> 22.2; at 256 rows a tie or a loss, 256 x 65536 25.9 -> 29.7;
# softmax-vocab-session17.txt).
# Those rows prefetch in pass 1 (HalfLong.prefetch; the others do not, see above).  H200, event µs after an L2 flush,
# 0 -> 1 pass (reports/h200/row-configs-probe2-session28.txt, row-configs-probe3-session28.txt): bf16 16384 x 65536
# 1161.0 -> 1128.4 and 1162.5 -> 1132.7 (2 passes 1553.4), fp16 1142.6 -> 1123.2, 4096 x 65536 299.2 -> 294.1,
# 16384 x 131072 2578.4 -> 2558.9, 1024 x 65536 82.5 -> 82.2, 128 x 65536 (32768 x 32) 16.7 -> 16.5.  Narrower rows
# in their blocks lost (16384 x 14336 244.3 -> 274.9, 20000 363.7 -> 391.9, 24000 393.5 -> 421.2; 40000 725.2 ->
# 711.9 a win, 32768 534.9 -> 534.5 a tie), and so did blocks of 16384 prefetching below 65536 (16384 x 57344
# 1078.3 -> 1108.9, 16384 x 40000 725.2 -> 832.8; 1024 x 49152 66.0 -> 62.1 won).
# Every half-precision row past the cap now loops prefetching in pass 1, and that pass works in lanes
# (HalfLong.lanes, _lane_stats: no reduction across the program inside the loop), in blocks that grow with the row:
# 4096 x 8 warps up to 20480 columns, 8192 x 16 up to 49151, 16384 x 16 up to 98303 (up to 128 rows of 65536 and
# more, 32768 x 32), 32768 x 32 beyond.  H200, event µs after an L2 flush, the rules before -> these
# (reports/h200/softmax-lanes-session29.txt, probe2-session29.txt, probe3-session29.txt): bf16 16384 x 65536 1141.0 ->
# 1079.2 and 1140.7 -> 1078.7, fp16 1133.9 -> 1073.9, 4096 x 65536 298.0 -> 282.1, 1024 x 65536 81.8 -> 76.7, 256 x
# 65536 25.1 -> 23.6, 128 x 65536 16.5 -> 15.4; 16384 x 57344 1076.9 -> 1024.6, 16384 x 49152 894.3 -> 785.3 (fp16
# 897.1 -> 790.5), 1024 x 49152 66.1 -> 58.8, 128 x 49152 16.1 -> 12.2 (in 32768 x 32 14.2), 16384 x 45000 868.7 ->
# 805.1 (16384 x 16 814.4), 16384 x 40000 724.7 -> 685.4, 16384 x 36000 656.9 -> 616.5 (16384 x 16 766.1), 16384 x
# 32768 536.2 -> 518.3 (fp16 531.6 -> 511.4), 4096 x 32768 142.5 -> 138.6, 1024 x 32768 41.8 -> 40.7 (fp16 41.6 ->
# 40.5), 256 x 32768 15.9 -> 13.9, 128 x 32768 11.2 -> 9.3, 16384 x 28000 501.5 -> 488.4, 16384 x 24000 394.7 ->
# 389.1, 1024 x 24000 34.0 -> 32.4, 16384 x 20000 365.1 -> 334.6 (8192 x 16 368.2), 1024 x 20000 31.9 -> 30.5, 64 x
# 20000 9.2 -> 7.7; 16384 x 98304 1848.5 -> 1770.9 (16384 x 16 1783.3), 16384 x 131072 2558.4 -> 2354.0, 4096 x
# 131072 660.9 -> 599.3.  Lanes without prefetching lost (16384 x 65536 in 16384 x 16 1285.5, 16384 x 32768 in 8192
# x 8 657.7), and with it they did not gain in the rules of narrower rows (16384 x 14336 in 8192 x 8 243.6 -> 256.3,
# in 4096 x 8 242.8; 16384 x 11008 184.2 -> 183.3; 16384 x 16384 in two blocks of 8192 x 8 260.8 -> 257.6, a lead
# not taken) or in float32 (16384 x 65536 2464.2 -> 2449.8 at best, 16384 x 32768 1056.5 -> 1073.8): those keep
# their rules.
# Uneven rows that blocks of 8192 pad no more than blocks of 4096 (12289 to 16383 columns) loop in
# two blocks of 8192 in 8 warps (RowTuning.uneven_large; H200, event time after an L2 flush, 4096 x
# 4 warps -> 8192 x 8, µs, uneven-blocks-session19.txt, uneven-rules-session19.txt): bf16 16384 x
# 14336 261.3 -> 244.4, 4096 x 14336 71.5 -> 66.3, 256 x 14336 9.6 -> 8.8, 16384 x 16000 293.9
# -> 258.1, fp16 16384 x 14336 255.6 -> 243.3; 12800 tied (16384 rows 235.6 -> 236.8, 1024
# 21.6 -> 21.7), 1024 x 14336 lost 2-3% (bf16 22.4 -> 22.9, fp16 22.0 -> 22.6), and decode rows
# won (1 x 14336 7.5 -> 6.4, 64 x 14336 7.8 -> 6.7; uneven-decode-session19.txt); at 11008
# (12288 columns in blocks of 4096, 16384 in 8192) 8192 lost, 188.4 -> 229.3.
# From 2048 rows, half-precision rows of exactly 16384 loop over two blocks of 8192 in 8 warps, without prefetching
# (see _rows.TwoBlocks; they lost so while the looped kernel stored y plainly): H200, event time after an L2 flush,
# whole in 32 warps -> two blocks, µs (reports/h200/row-configs-softmax-two-session22.txt): bf16 16384 x 16384 276.1
# -> 258.2 (prefetching 287.3; in 16 warps 302.8), 8192 rows 142.3 -> 133.3, 4096 73.7 -> 70.6, 2048 40.3 -> 39.5;
# fp16 16384 x 16384 276.7 -> 264.2, 4096 73.7 -> 71.9; 1024 rows lost (bf16 23.4 -> 23.9, fp16 23.3 -> 23.5), as
# did 256 (8.8 -> 9.8) and 64 (6.9 -> 7.7).
# float32 rows of 8192 held whole run in 32 warps from 256 rows (RowTuning.float32_cap_warps; below the 2048
# rows that loop in two blocks): H200, event time after an L2 flush, 16 -> 32 warps, µs
# (reports/h200/uneven-split-session20.txt): 1024 rows 23.0 -> 22.2, 23.6 -> 22.2, 23.6 -> 22.1 (three runs),
# 1536 rows 32.1 -> 31.0, 256 rows 8.7 -> 8.5; 64 rows lost (6.2 -> 6.6), 1 and 8 rows tied.
# float32 rows of 49152 and more that blocks of 16384 pad no more than blocks of 8192 loop in blocks of 16384 in 32
# warps, prefetching in pass 1 (float32_long), not in float32_wide's 8192 x 16 prefetching in both.  H200, event µs
# after an L2 flush, three interleaved rounds, those -> these (reports/h200/probe6-, probe8-, probe9-session31.txt):
# 16384 x 49152 1750.5 -> 1641.4, 16384 x 65536 2464.1 -> 2215.9 (2464.2 -> 2218.5), 16384 x 80000 3140.9 -> 2803.4,
# 16384 x 98304 4029.7 -> 3608.9, 16384 x 131072 5518.0 -> 5109.3, 4096 x 65536 628.9 -> 568.9, 4096 x 131072 1395.9
# -> 1300.5, 1024 x 80000 211.3 -> 198.5, 1024 x 65536 166.8 -> 155.0, 256 x 65536 49.9 -> 44.5, 128 x 65536 26.2 ->
# 25.3.  Rows these blocks pad more lost or tied (16384 x 50000 1819.7 -> 2046.2, 16384 x 57344 2102.5 -> 2110.9), as
# did narrower rows (16384 x 40000 1356.7 -> 1508.4, 16384 x 32768 1058.1 -> 1130.5, 1024 x 40000 97.4 -> 113.4);
# prefetching in both passes or 16 warps tied at 49152 and more (16384 x 65536 2245.2, 2217.5), blocks of 32768 lost
# (3450.7).
# float32 rows of exactly 16384 and 32768 are held whole in 32 warps from 1024 rows (float32_whole_from,
# float32_whole_padded, float32_whole_min_rows), not looped in float32_wide's blocks.  Whole rows lost while
# softmax_kernel masked its one row a program (1372 -> 1592 µs at 16384 x 32768, row-fp32-whole-session8.txt; 64
# registers a thread with the mask) and won once it did not (47 registers).  H200, event µs after an L2 flush, three
# interleaved rounds, looped -> whole without the row mask (reports/h200/softmax-whole-variants-session32.txt):
# 16384 x 32768 1055.4 -> 1016.6 (torch.compile 1034.8), 1024 x 32768 76.7 -> 73.7, 16384 x 16384 539.4 -> 516.2
# (500.5), 1024 x 16384 42.4 -> 37.9 (38.6); fuseaudit bench of the final rule (bench-softmax-f32-final-session32.txt):
# 16384 x 32768 1033.0 (1.01x torch.compile), 4096 x 32768 265.2 (1.03x).  Padded rows in those blocks lost (16384 x
# 24000 764.6 -> 817.8, softmax-f32-whole-session32.txt), so they keep looping, and so did fewer rows (256 x 32768
# 23.6 looped there, 27.3 whole in bench-softmax-f32-whole-session32.txt; 512 x 32768 41.9 -> 44.0,
# row-configs-softmax-f32-session32.txt, where rows of 16384 won from 256 rows: a lead for a minimum by width).
TUNING = RowTuning(elements_per_thread=16, max_warps=32, wide_warps=8, uneven_block=4096, uneven_warps=4,
                   uneven_large=(8192, 8), float32_cap_warps=(256, 32), float32_whole_from=16384,
                   float32_whole_padded=False, float32_whole_min_rows=1024,
                   split_tail=TailSplit(max_tail=0.25, float32_max_tail=0, min_n=4096), float32_wide=(8192, 16),
                   float32_long=(HalfLong(49152, 16384, 32, prefetch=1, pads_as=8192),),
                   float32_wide_prefetch=2, float32_two_blocks=TwoBlocks(2048, 4096, 8, 1),
                   two_blocks=TwoBlocks(2048, 8192, 8, 0),
                   half_long=(HalfLong(16385, 4096, 8, max_n=20480, prefetch=1, lanes=True),
                              HalfLong(20481, 8192, 16, max_n=49151, prefetch=1, lanes=True),
                              HalfLong(49152, 16384, 16, max_n=65535, prefetch=1, lanes=True),
                              HalfLong(65536, 16384, 16, max_n=98303, prefetch=1, lanes=True, few=(128, 32768, 32)),
                              HalfLong(98304, 32768, 32, prefetch=1, lanes=True)))

# The looped kernel's lanes (RowBlocks.lanes): a run of this many bytes, one thread's vector load.
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
    outputs have 2^-11 ulps and do not need it.  (H200, float32, 16384 x
    8192: 276 µs with the earlier five-operation correction, 267 with this
    one, 262 with none; same ulps, ``reports/h200/softmax-exp-modes-session11.txt``.)
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
    H200, event time after an L2 flush, 16384 rows, µs, :func:`_exp` ->
    this (``reports/h200/softmax-exp-session17.txt``): bf16 N = 5120
    90.6 -> 83.6, 11008 205.8 -> 188.6, 14336 272.9 -> 261.1; float16
    5120 90.8 -> 83.7, 11008 195.1 -> 187.0; 1024 x 11008 19.1 -> 17.6.
    The looped kernel in blocks of 8192 lost instead (bf16 16384 x 65536
    1316.6 -> 1379.0, float16 16384 x 32768 583.9 -> 599.1, 1024 x 32768
    44.5 -> 46.1), though with this in either pass alone it did not
    (``softmax-wide-expk-session17.txt``; 128 registers a thread either way,
    sm_90 with Triton 3.9).
    Rows of 65536 and more now loop in larger blocks (see ``TUNING``); at
    32768 the loss of 1-3% is kept for one exp for every term.
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
    # tail block of BLOCK_T (see _rows.RowBlocks), which follows every step.
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M > 1:
        row_mask = rows < n_rows
    else:
        # One row a program: the grid is the rows, so the row exists.  Said as a
        # constant, the masks are the columns' alone: float32 rows of 32768 in 32
        # warps then take 47 registers a thread rather than the 64 that 32 warps
        # allow, which measured 1.47x slower (see TUNING.float32_whole_from).
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
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used (see _rows.RowBlocks)
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
        # y evict-first: L2 keeps the rows whose second read is still to come
        # (H200, event time after an L2 flush, plain store -> evict_first, µs,
        # reports/h200/store-hints2-session22.txt: bf16 16384 x 32768 594.8 -> 555.3,
        # 16384 x 65536 1226.7 -> 1187.3, 1024 x 65536 86.5 -> 82.6, 16384 x 14336
        # 247.8 -> 245.2; fp16 16384 x 32768 571.8 -> 543.1; float32 16384 x 65536
        # 2575.1 -> 2465.7, 16384 x 11008 353.5 -> 348.7; none lost by more than 0.6%).
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
    Only half-precision rows take this pass (``_rows.HalfLong.lanes``): a
    run adds ``VEC * N / BLOCK_N`` terms (48 at most in the shipped rules up
    to 98303 columns, 32 at 131072), whose float32 rounding stays far below
    a half-precision ulp without Kahan's compensation.
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
    plan = planned(("softmax", scale), (x,), _plan, x, scale)
    y = output_like(x, plan)
    if plan is not None:
        plan.launch(x, y)
    return y


def _plan(x: torch.Tensor, scale: float) -> Plan | None:
    """Check ``x`` and choose the kernel, grid and tile; None when there is nothing to launch."""
    check_tensors("softmax", x=x)
    if x.dim() == 0:
        raise ValueError("softmax: x must have at least one dim (the hidden dim), got a scalar")
    n = x.shape[-1]
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, x)
    _, d1, d2 = layout.dims
    precise = x.dtype == torch.float32
    blocks = row_block_config(layout.rows, n, x.element_size(), TUNING)
    if blocks.wide:
        # EVEN only in half precision: float32 rows lost without the masks (H200, event µs after
        # an L2 flush, reports/h200/even-fp32-session23.txt, masked -> not: 16384 x 32768 1054.5
        # -> 1117.1, 4096 x 32768 272.4 -> 289.3, 16384 x 16384 539.1 -> 561.0; bf16 16384 x
        # 32768 552.6 -> 533.7).
        plan = Plan(softmax_wide_kernel, (layout.rows,), n, d1, d2, *layout.strides[0], float(scale),
                    PRECISE=precise, BLOCK_N=blocks.block_n, PREFETCH=blocks.prefetch,
                    ALIGN=row_alignment(n, layout), EVEN=not precise and even_blocks(n, blocks.block_n),
                    VEC=LANE_BYTES // x.element_size() if blocks.lanes else 0,
                    num_warps=blocks.num_warps)
    else:
        plan = Plan(softmax_kernel, (triton.cdiv(layout.rows, blocks.block_m),), layout.rows, n, d1, d2,
                    *layout.strides[0], float(scale), PRECISE=precise, BLOCK_M=blocks.block_m,
                    BLOCK_N=blocks.block_n, BLOCK_T=blocks.block_t, ALIGN=row_alignment(n, layout),
                    num_warps=blocks.num_warps)
    coop = coop_config(layout.rows, n, x.element_size(), x.device)
    if coop is None:
        return plan
    return Plan(softmax_coop_kernel, (layout.rows, coop.splits), n, d1, d2, *layout.strides[0], float(scale),
                scratch=workspace, fallback=plan, PRECISE=precise, CHUNK=coop.chunk, SPLITS=coop.splits,
                SLOTS=coop.slots, ALIGN=row_alignment(n, layout), COOPERATIVE=not _rows.interpreting(),
                num_warps=coop.num_warps, **launch_options())


__all__ = ["softmax", "softmax_coop_kernel", "softmax_kernel", "softmax_wide_kernel"]
