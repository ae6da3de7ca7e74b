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

Three kernels share the work:

* :func:`rms_norm_kernel` keeps whole rows in registers: one read of each
  input, one write of each output.  When rows are short it takes a tile of
  ``BLOCK_M`` rows per program, so that every program moves a useful amount.
  A row that is not a power of two may be held as a power-of-two block and
  a smaller tail block (5120 = 4096 + 1024) rather than padded (to 8192),
  see ``_rows.RowBlocks``.
* :func:`rms_norm_wide_kernel` is for rows wider than ``_rows.MAX_FUSED_BYTES``
  (twice that with a residual, see ``ADD_TUNING``): it loops over column
  blocks twice (sum of squares, then normalise), so the row is read twice;
  the second read usually hits L2 (for many rows of 57344 to 65535 only
  once pass 1 takes wider blocks, see ``_rows.StatsBlock``; rows of 65536
  and more loop in blocks of 32768, see ``TUNING``).  Most half-precision rows
  it takes are compiled for their width (``N_FIXED``, see ``FIXED_WIDTH_MAX``).
* :func:`rms_norm_coop_kernel` is for a few wide rows (decode): each row is
  split over ``SPLITS`` programs of one cooperative launch (see ``_coop.py``).
  Each holds a chunk in registers and publishes its sum of squares; the
  row's sum is the sum of the partials, so every program can then write its
  chunk of ``y``.  Many float32 rows too wide to hold whole take it as well,
  a group of ``SPLITS`` programs looping over rows (see ``_rows.ManyRows``).

Rows are addressed in place whatever the strides (see ``_rows.py``); the
outputs are new contiguous tensors, so an output row starts at ``row * N``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _rows
from ._coop import (
    arrive_and_wait,
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
    FLOAT32_WHOLE_MAX,
    HalfLong,
    HalfShort,
    ManyRows,
    PairedRows,
    RowTuning,
    StatsBlock,
    TailSplit,
    TwoBlocks,
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
    row_block_config,
    row_layout,
    row_offsets,
    to_dtype,
    vector_sums,
)

# One reduction per row: 8 warps for an 8192-wide row, 32 for the looped kernel
# (H200, bf16, 16384 rows: 135 µs at N=8192, 525 µs at N=32768).  Uneven rows
# loop in blocks of 4096 with 16 warps: once row_offsets lost its divisions
# the looped kernel needed fewer registers, more programs shared each SM, and
# with 8 warps N=14336 slowed from 238 to 256 µs; 16 warps ran it in 226
# (torch.compile 226), N=11008 in 186 (8 warps 188, compile 177)
# (reports/h200/row-experiments-session7.txt).
# float32 rows of 32768 are held whole (see RowTuning.float32_whole_from), and
# float32 rows split as a block plus a tail up to half its size (N = 11008 as
# 8192 + 4096 instead of looping; see _rows._split_tail).
# The looped kernel prefetches in pass 1 for half precision, in both passes for
# float32 (RowBlocks.prefetch; H200, 16384 rows, event time after an L2 flush, 0 -> 1
# -> 2 passes, reports/h200/wide-prefetch-session13.txt): bf16 N = 11008 189.3 ->
# 177.9 -> 181.6 µs, 14336 224.8 -> 224.0 -> 249.7, 32768 525.3 -> 514.2 -> 517.1,
# 65536 1278.1 -> 1271.0 -> 1195.8, add_rms_norm 65536 2369.9 -> 2254.0 -> 2243.8;
# float32 65536 2738.9 -> 2728.9 -> 2704.2 (again: 2735.4 -> 2728.7 -> 2701.5),
# add_rms_norm 5186.2 -> 5185.9 -> 5199.2.
# From 8192 rows, rows of exactly 8192 loop over two blocks of 4096 (see _rows.TwoBlocks).
# Many float32 rows past 32768 are split over programs that keep them in registers
# (see _rows.ManyRows): chunks of 8192 in 8 warps, two programs an SM; with a
# residual chunks of 4096 (the wider ones did not fit two an SM), from 1024 rows.
# Half-precision rows of 16385 to 20480 (which blocks of 4096 pad less than blocks of 8192) loop
# in blocks of 4096 in 16 warps, as uneven rows below the cap do (RowTuning.half_short; H200,
# event time after an L2 flush, 8192 x 32 warps -> 4096 x 16, µs, uneven-blocks-session19.txt,
# uneven-rules-session19.txt): bf16 16384 x 20000 374.1 -> 320.3, fp16 363.8 -> 319.6, 16384 x
# 17000 786.7 -> 650.5, 1024 x 20000 30.4 -> 27.2 (256 x 20000 9.1 -> 9.2); where both pad
# alike they tied or lost (16384 x 24000 399.2 -> 395.7, fp16 393.5 -> 403.2; 30000 484.2 ->
# 551.2), and wider rows lost (40000: 647.4 -> 777.6, 50000: 876.2 -> 1043.9), as did 128 rows
# and fewer (1 x 20000 6.1 -> 6.7, 128 x 20000 6.9 -> 7.7; uneven-decode-session19.txt).
# Up to 4096 rows, uneven rows held whole as 8192 plus a tail beat the loop (RowTuning.uneven_split, in 8 warps here;
# H200, bf16, event time after an L2 flush, looped -> split, µs, reports/h200/uneven-split-session20.txt): 1024 x
# 11008 17.6 -> 16.5, 4096 x 11008 52.0 -> 47.7, 64 x 11008 5.9 -> 5.3, 1 x 11008 6.1 -> 5.0, fp16 1024 x 11008
# 17.3 -> 16.2, 1024 x 14336 21.0 -> 19.6, 4096 x 14336 63.2 -> 61.5, 1 x 14336 6.6 -> 5.4, 1024 x 12288 18.8 ->
# 17.3, 1024 x 9000 22.0 -> 17.5, 1024 x 13000 27.9 -> 21.5 (256 x 11008 tied, 7.4 -> 7.3).  At 16384 rows the
# loop stays: 14336 225.0 -> 227.9, 12288 193.5 -> 199.6, 11008 178.4 -> 175.9.  (The rows of 9000 and 13000 then
# lost a hint and loaded x 2 bytes at a time; see _rows.row_offsets.)  Rows of 8192 + 1024 take 4 warps (split_warps;
# reports/h200/split-warps-session21.txt, 8 -> 4 warps): 1024 x 9000 15.7 -> 14.4, 4096 x 9000 49.7 -> 45.3, 1 x 9000
# 5.6 -> 5.2, 64 x 9000 6.4 -> 5.8, 1024 x 8400 14.8 -> 13.6, fp16 1024 x 9000 15.3 -> 14.1.
# More rows loop, in blocks of 4096 and 16 warps from 12289 columns (RowTuning.uneven_narrow): narrower rows padded
# less by blocks of 2048 (up to 8192 + 1024) or fewer warps won (H200, event time after an L2 flush, 4096 x 16 ->
# the rule, µs, reports/h200/uneven-narrow-session21.txt): bf16 16384 x 9000 165.7 -> 148.9 (2048 x 8), 16384 x 8400
# 155.6 -> 137.9, 16384 x 11008 180.5 -> 174.8 (4096 x 8), 8192 x 11008 95.2 -> 92.5, fp16 16384 x 11008 177.1 ->
# 173.7; 8 warps lost from 13000 (212.5 -> 217.8) and 14336 (224.7 -> 231.8).
# Rows of exactly 4096 in half precision, from 1024 rows, are held two a program in 8 warps (RowTuning.paired_rows):
# each program then loads the weight once for two rows.  H200, event time after an L2 flush, one row a program in 4
# warps -> two in 8, µs (reports/h200/row-configs-small-session22.txt, row-configs-two-rows-session22.txt): bf16 1024
# x 4096 8.54 -> 7.94 and 8.38 -> 7.84 (torch.compile 8.29, 8.10), 4096 x 4096 22.05 -> 21.15, 16384 x 4096 70.21 ->
# 69.02.  Rows of 2048 tied (1024 x 2048 6.29 -> 6.27, 16384 x 2048 36.46 -> 36.48), rows of 8192 lost (1024 x 8192
# 12.90 -> 13.18, 16384 x 8192 130.0 -> 134.0), four rows a program did less well (1024 x 4096 in 16 warps 8.32),
# and add_rms_norm tied (1024 x 4096 12.90 -> 12.74, 16384 x 4096 135.49 -> 135.58; not taken).
TUNING = RowTuning(elements_per_thread=32, max_warps=16, wide_warps=32, uneven_block=4096, uneven_warps=16,
                   uneven_split=4096, uneven_narrow=((9216, 2048, 8), (12288, 4096, 8)),
                   half_short=HalfShort(20481, 4096, 16, min_rows=256),
                   split_tail=TailSplit(max_tail=0.25), float32_whole_from=32768, wide_prefetch=1,
                   float32_wide_prefetch=2,
                   two_blocks=TwoBlocks(8192, 4096, 8, 1), float32_two_blocks=TwoBlocks(8192, 4096, 16, 2),
                   float32_many_rows=ManyRows(FLOAT32_WHOLE_MAX + 1, 8192, 8, 2),
                   paired_rows=PairedRows(4096, 8, 1024), stats_block=StatsBlock(57344, 65535, 32768, 2048),
                   half_long=(HalfLong(65536, 32768, 32, few=(128, 16384, 32)),))
# Many half-precision rows of 57344 to 65535 take pass 1 of the looped kernel in blocks of
# 32768 (see StatsBlock).  H200, bf16, event µs after an L2 flush, blocks of 8192 -> pass 1
# in 32768 (reports/h200/stats-range-session23.txt, wide-rule-session23.txt): 16384 rows
# of 49152 829.5 -> 862.1, 57344 1046.1 -> 973.9, 65536 1223.5 -> 1048.3, 73728 1401.5 ->
# 1282.6, 8192 x 98304 955.2 -> 1046.2; rows of 65536: 2048 158.9 -> 145.4, 1024 81.7 ->
# 79.9, 512 44.5 -> 45.6.  (Rows of 65536 and more now loop in blocks of 32768, below.)
# Half-precision rows of 65536 and more loop in blocks of 32768 in 32 warps (half_long),
# compiled for their width (FIXED_BLOCK): both passes in the blocks that pass 1 alone took
# before.  Up to 128 rows, blocks of 16384 (HalfLong.few).  H200, bf16 unless marked,
# event µs after an L2 flush, the twenty-seventh session's rules (8192 x 32 warps, pass 1
# in 32768 from 2048 rows; 16384 x 32 up to 1024 rows; N compiled in to 65536 or in blocks
# of 16384) -> blocks of 32768 (row-configs-probe2-session28.txt, row-configs-probe3-
# session28.txt): rows of 65536: 16384 1030.6 -> 994.5, fp16 1118.0 -> 994.8, 4096 268.8
# -> 255.7, 2048 141.1 -> 132.6, 1024 75.9 -> 71.3 (fp16 75.7 -> 71.5), 512 41.5 -> 40.9,
# 256 24.5 -> 24.6 (a tie), 128 13.2 -> 13.4 (so 16384 there); 16384 x 131072 2657.6 ->
# 2328.5, 8192 x 131072 1341.6 -> 1173.5, 1024 x 131072 172.5 -> 161.2, 256 x 131072 47.7
# -> 46.6, 16384 x 80000 1543.8 -> 1279.8, 16384 x 73728 1277.7 -> 1253.7.  Rows of
# 98304 lost a little (16384 rows 1886.1 -> 1911.0, 8192 rows 952.6 -> 962.6; 16384 x 32
# warps 1840.2).  Below 65536 these blocks won little or lost (16384 x 49152 798.2 ->
# 785.3, in 16384 x 32 warps 779.6; 16384 x 57344 944.4 -> 955.2; 1024 x 32768 38.0 ->
# 41.5), so the rule starts at 65536.
# The residual variant keeps rows up to 64 KiB whole (see RowTuning.fused_scale),
# uneven ones too (they were fastest whole: N=11008 349 µs vs 362 looped), and
# in half precision padded rather than split (fp16 N=3000: 127.3 µs padded,
# 144.1 split); float32 rows split as for rms_norm (N=11008: 723.3 µs split,
# 771.5 padded to 16384); float32 rows of 16384 whole too (16384 rows: 1079.2 µs
# whole, 1097.7 looped, 1096.9 prefetching).
# Half-precision rows of 65536 and more loop in blocks of 16384 in 16 warps (H200, event
# time after an L2 flush, 8192 x 32 warps -> 16384 x 16, prefetching in pass 1: bf16 16384 x
# 65536 2241.6 -> 2153.2 µs, float16 2218.6 -> 2158.8, bf16 1024 x 65536 149.6 -> 142.1;
# reports/h200/split-warps-session17.txt); plain rms_norm's did not gain (1276.9 ->
# 1312.5, norm-configs-session17.txt).
ADD_TUNING = TUNING._replace(fused_scale=2, uneven_block=0, uneven_warps=0, uneven_split=None, uneven_narrow=(),
                             half_short=None,
                             split_tail=TailSplit(max_tail=0),
                             float32_whole_from=16384, two_blocks=None, float32_two_blocks=None,
                             float32_many_rows=ManyRows(FLOAT32_WHOLE_MAX + 1, 4096, 8, 2, min_rows=1024),
                             half_long=(HalfLong(65536, 16384, 16),), paired_rows=None,
                             stats_block=None)

# The looped kernel stores y evict-first (L2 lines it would otherwise hold go
# to the rows whose second read is still to come) in rows of this many bytes
# and more, without a residual.  H200, event time after an L2 flush, three
# interleaved rounds, plain store -> evict_first (reports/h200/store-hints*-session22.txt):
# bf16 16384 x 65536 1274.1 -> 1223.7 µs, 1024 x 65536 85.2 -> 81.9, 256 x 65536
# 26.8 -> 25.4, fp16 16384 x 65536 1266.6 -> 1218.8; narrower rows tied or lost
# (16384 x 32768 504.1 -> 501.2, 16384 x 40000 644.9 -> 630.1 but 1024 x 40000
# 49.4 -> 49.9, 16384 x 11008 174.9 -> 178.1), and so did add_rms_norm (bf16
# 16384 x 65536 2168.2 -> 2205.5).  (In layer_norm's looped kernel the same hint
# cost bf16 16384 x 65536 1305 -> 1634 and ".cs" stores split by dtype.)
STREAM_Y_MIN_BYTES = 128 * 1024

# Half-precision rows of FIXED_WIDTH_MIN to FIXED_WIDTH_MAX without a residual (those that loop in blocks of 8192),
# and any that loop in blocks of FIXED_BLOCK or wider (half_long, with its few rows), are compiled for their width: the
# looped kernel's N_FIXED, one compile per hidden size, as torch.compile's kernels are.  Its loops then have constant
# trip counts.
# H200, event µs after an L2 flush, N at runtime -> compiled in (row-configs-rms-fixed-session27.txt,
# row-configs-rms-fixed2-session27.txt): bf16 16384 x 24000 385.9 -> 367.7 (torch.compile 368.6), 16384 x 30000
# 481.4 -> 460.4, 16384 x 32768 507.7 -> 502.2 (fp16 502.2 -> 502.3), 4096 x 32768 133.7 -> 130.4, 1024 x 32768
# 39.6 -> 38.0 and 39.8 -> 38.1 (torch.compile 38.1, 38.4), 256 x 32768 13.25 -> 12.70, 16384 x 40000 643.4 ->
# 628.0, 16384 x 49152 906.0 -> 798.9, pass 1 in blocks of 32768 (StatsBlock): 16384 x 57344 959.3 -> 944.2,
# 16384 x 65536 1043.4 -> 1027.3 (but fp16 1123.5 -> 1137.2), 4096 x 65536 272.7 -> 268.4, 2048 x 65536 144.5 ->
# 141.5.  Wider rows in blocks of 8192 lost (8192 x 98304 954.6 -> 1011.8, 4096 x 131072 678.5 -> 693.3), and so
# did narrower ones in blocks of 4096 x 8 warps (16384 x 11008 174.5 -> 183.6, 12288 196.0 -> 198.8); 4096 x 16
# tied (16384 x 14336 224.2 -> 223.5, 20000 321.7 -> 320.4).  add_rms_norm tied (bf16 16384 x 65536 2189.3 ->
# 2169.0, 1024 x 65536 143.0 -> 142.5) and keeps N at runtime.
FIXED_WIDTH_MIN = 20481
FIXED_WIDTH_MAX = 65536
FIXED_BLOCK = 16384


def fixed_width(n: int, element_size: int, has_residual: bool, block_n: int) -> int:
    """The looped kernel's ``N_FIXED`` for rows of ``n`` in blocks of ``block_n``: ``n`` where it is compiled for
    their width, else 0 (see ``FIXED_WIDTH_MAX``; the constants are read at plan time)."""
    fixed = FIXED_WIDTH_MIN <= n <= FIXED_WIDTH_MAX or block_n >= FIXED_BLOCK
    return n if element_size == 2 and not has_residual and fixed else 0


def stream_y(n: int, element_size: int, residual: bool) -> bool:
    """Whether the looped kernel stores ``y`` evict-first (see ``STREAM_Y_MIN_BYTES``)."""
    return not residual and n * element_size >= STREAM_Y_MIN_BYTES


@triton.jit
def _store_y(Y, out_rows, cols, mask, x, rstd, w):
    """``y = x * rstd * w`` for a tile of rows x cols, rounded once, at the store."""
    y = x * rstd[:, None] * w.to(tl.float32)[None, :]
    tl.store(Y + out_rows[:, None] + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=mask)


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
    BLOCK_T: tl.constexpr,
    ALIGN: tl.constexpr,  # divides every row offset (see _rows.row_alignment)
    EARLY: tl.constexpr,  # load the weight with the row (see _rows.RowBlocks.early)
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N, or BLOCK_N columns and a
    # tail block of BLOCK_T (see _rows.RowBlocks).
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    x_rows = row_offsets(rows, D1, D2, sx0, sx1, sx2, ALIGN)
    r_rows = x_rows
    if HAS_RESIDUAL:
        r_rows = row_offsets(rows, D1, D2, sr0, sr1, sr2, ALIGN)
    out_rows = out_row_offsets(rows, N, ALIGN)

    # Statistics in float32; masked lanes hold 0 and add nothing.
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < N)[None, :]
    # The tail is loaded with the block, before either is reduced or h is
    # stored: one wait for memory, not two (see _rows.load_pair).
    x_ptrs, r_ptrs, h_offs = X + x_rows[:, None], R + r_rows[:, None], out_rows[:, None]
    x, r = load_pair(x_ptrs, r_ptrs, cols[None, :], mask, sxn, srn, HAS_RESIDUAL)
    if BLOCK_T > 0:
        t_cols = BLOCK_N + tl.arange(0, BLOCK_T)
        t_mask = row_mask[:, None] & (t_cols < N)[None, :]
        xt, rt = load_pair(x_ptrs, r_ptrs, t_cols[None, :], t_mask, sxn, srn, HAS_RESIDUAL)
    x = add_residual(x, r, H, h_offs, cols[None, :], mask, HAS_RESIDUAL)
    if BLOCK_T > 0:
        xt = add_residual(xt, rt, H, h_offs, t_cols[None, :], t_mask, HAS_RESIDUAL)
    if EARLY:  # the weight with the row: one wait for memory (see _rows.RowBlocks.early)
        w = load_vector(W, cols, N, swn)
        if BLOCK_T > 0:
            wt = load_vector(W, t_cols, N, swn)
    sum_sq = tl.sum(x * x, axis=1)
    if BLOCK_T > 0:
        sum_sq += tl.sum(xt * xt, axis=1)
    ms = tl.math.div_rn(sum_sq, N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    # Many rows (not EARLY): the weight is loaded here, the tail's after the
    # block is stored; registers are worth more than the wait then.
    if not EARLY:
        w = load_vector(W, cols, N, swn)
    _store_y(Y, out_rows, cols, mask, x, rstd, w)
    if BLOCK_T > 0:
        if not EARLY:
            wt = load_vector(W, t_cols, N, swn)
        _store_y(Y, out_rows, t_cols, t_mask, xt, rstd, wt)


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
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used (see _rows.RowBlocks)
    ALIGN: tl.constexpr,  # divides every row offset and N (see _rows.row_alignment)
    STREAM_Y: tl.constexpr,  # store y evict-first (rows of STREAM_Y_MIN_BYTES and more, see there)
    BLOCK_S: tl.constexpr,  # pass 1's block: BLOCK_N, or wider (see _rows.StatsBlock)
    EVEN: tl.constexpr,  # BLOCK_N divides N: no column masks in pass 2 (see _rows.even_blocks)
    N_FIXED: tl.constexpr,  # N itself, compiled in, or 0 (see FIXED_WIDTH_MAX)
):
    # One row per program, BLOCK_N < N columns at a time.
    if N_FIXED > 0:
        N = N_FIXED
    N = aligned_width(N, ALIGN)  # the same N; the compiler now knows ALIGN divides it
    row = tl.program_id(0)
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN)
    r_row = R + row_offsets(row, D1, D2, sr0, sr1, sr2, ALIGN)
    out = out_row_offsets(row, N, ALIGN)
    offs = tl.arange(0, BLOCK_N)

    # Pass 1: sum of squares, lane by lane (reduced once after the loop).
    # With a residual, h = x + residual is formed, rounded and stored here.
    # With PREFETCH each iteration loads the next block before it uses this
    # one: those loads are in flight while this block is squared and its h
    # stored, where otherwise every block waits for memory.  Blocks wider
    # than BLOCK_N keep a sum a vector, not an element (_rows.vector_sums).
    VECTORS: tl.constexpr = BLOCK_S > BLOCK_N
    VEC: tl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # elements in 16 bytes
    acc = tl.zeros([BLOCK_S // VEC if VECTORS else BLOCK_S], dtype=tl.float32)
    s_offs = tl.arange(0, BLOCK_S)
    # the first block ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, r_next = load_pair_block(x_row, r_row, s_offs, N, sxn, srn, HAS_RESIDUAL)
    for start in range(0, N, BLOCK_S):
        cols = start + s_offs
        x, r, x_next, r_next = next_pair_block(x_row, r_row, x_next, r_next, cols, N, sxn, srn, HAS_RESIDUAL,
                                               BLOCK_S, PREFETCH)
        x = add_residual(x.to(tl.float32), r.to(tl.float32), H, out, cols, cols < N, HAS_RESIDUAL)
        acc += vector_sums(x * x, VECTORS, VEC)
    ms = tl.math.div_rn(tl.sum(acc, axis=0), N * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))

    if HAS_RESIDUAL:
        # Pass 2 reads h back; make this program's stores visible to all its threads.
        tl.debug_barrier()
    # Pass 2: normalise and store, walking the row backwards (the blocks that
    # pass 1 read last are the likeliest to be in cache still); with PREFETCH
    # the block before this one is loaded ahead as in pass 1.
    last = (N - 1) // BLOCK_N * BLOCK_N
    # the first block ahead (dead code without PREFETCH >= 2: see _rows.load_pair_block)
    x_next = load_back_block(x_row, H + out, last + offs, N, sxn, HAS_RESIDUAL)
    w_next = load_vector(W, last + offs, N, swn)
    for offset in range(0, N, BLOCK_N):
        cols = (last - offset) + offs
        if PREFETCH >= 2:
            x, w = x_next, w_next
            prev = cols - BLOCK_N
            x_next = load_back_block(x_row, H + out, prev, N, sxn, HAS_RESIDUAL)
            w_next = tl.load(W + prev * swn, mask=prev >= 0, other=0.0)
        else:
            x = load_back_block(x_row, H + out, cols, N, sxn, HAS_RESIDUAL, EVEN)
            w = load_vector(W, cols, N, swn, EVEN)
        y = x.to(tl.float32) * rstd * w.to(tl.float32)
        # STREAM_Y: y is not read again here; L2 keeps the rows that pass 2 has yet to re-read.
        tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=None if EVEN else cols < N,
                 eviction_policy="evict_first" if STREAM_Y else "")


@triton.jit
def rms_norm_coop_kernel(
    X, R, W, Y, H, Part, Count,  # as rms_norm_kernel, then the workspace (see _coop.workspace)
    n_rows, N, D1, D2,
    sx0, sx1, sx2, sxn,
    sr0, sr1, sr2, srn,
    swn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,  # programs a row
    SLOTS: tl.constexpr,  # SPLITS rounded up to a power of two
    ALIGN: tl.constexpr,
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
    # A few rows: one straight row a program, its chunk loaded before the weight.  (The
    # change as first written ran the loop once and loaded the weight first: on the
    # H200 the decode points ran 1.06x slower, bf16 64 x 65536 14.2 against 11.2 µs;
    # reports/h200/bench-coop-decode-*session16.)
    rows_here = 1  # a constant trip count of 1: the compiler drops the loop
    if LOOP_ROWS:
        rows_here = tl.cdiv(n_rows - group, groups)
        w = load_vector(W, cols, N, swn)  # once, for every row of the group
    for k in range(0, rows_here):  # this group's k-th row
        x, x_next, r_next, x_row, r_row, out = row_chunk(
            X, R, H, group + k * groups, n_rows, groups, x_next, r_next, cols, N, D1, D2,
            sx0, sx1, sx2, sxn, sr0, sr1, sr2, srn, ALIGN, HAS_RESIDUAL, LOOP_ROWS)
        if not LOOP_ROWS:  # after the row, which the partial waits for; the wait below hides it
            w = load_vector(W, cols, N, swn)

        # The partial is the chunk's sum of squares.
        slots = row_slots(group, k)
        if COOPERATIVE:
            publish(Part, slots, split, tl.sum(x * x, axis=0), 0.0, SPLITS)
            arrive_and_wait(Count, group, split, SPLITS)
        else:  # the interpreter: this program computes every chunk's partial itself
            for c in range(SPLITS):
                c_cols = c * CHUNK + tl.arange(0, CHUNK)
                xc = load_chunk(X, R, H, x_row, r_row, out, c_cols, c_cols < N, sxn, srn, HAS_RESIDUAL)
                publish(Part, slots, c, tl.sum(xc * xc, axis=0), 0.0, SPLITS)
        sums, _, _ = gather(Part, slots, SPLITS, SLOTS, 0.0, 0.0)
        ms = tl.math.div_rn(tl.sum(sums, axis=0), N * 1.0)
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
        y = x * rstd * w.to(tl.float32)
        tl.store(Y + out + cols, to_dtype(y, Y.dtype.element_ty), mask=mask)


def _rms_norm(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch; returns ``(y, h)``."""
    plan = planned((op, eps), (x, residual, weight), _plan, op, x, residual, weight, eps)
    y = output_like(x, plan)
    h = None if residual is None else torch.empty_like(y)
    if plan is not None:
        # Without a residual, R is never read and H never written: x and y stand in.
        plan.launch(x, x if residual is None else residual, weight, y, y if h is None else h)
    return y, h


def _plan(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> Plan | None:
    """Check the inputs and choose the kernel, grid and tile; None when there is nothing to launch."""
    tuning = TUNING if residual is None else ADD_TUNING
    if residual is None:
        check_tensors(op, x=x, weight=weight)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight)
    n = check_row_shapes(op, x, residual, weight=weight)
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, *((x,) if residual is None else (x, residual)))
    sx = layout.strides[0]
    sr = layout.strides[1] if residual is not None else (0, 0, 0, 0)
    _, d1, d2 = layout.dims
    blocks = row_block_config(layout.rows, n, x.element_size(), tuning)
    if blocks.wide:
        plan = Plan(rms_norm_wide_kernel, (layout.rows,), n, d1, d2, *sx, *sr, weight.stride(0), float(eps),
                    HAS_RESIDUAL=residual is not None, BLOCK_N=blocks.block_n, BLOCK_S=blocks.stats_block_n,
                    EVEN=even_blocks(n, blocks.block_n), PREFETCH=blocks.prefetch,
                    ALIGN=row_alignment(n, layout), STREAM_Y=stream_y(n, x.element_size(), residual is not None),
                    N_FIXED=fixed_width(n, x.element_size(), residual is not None, blocks.block_n),
                    num_warps=blocks.num_warps)
    else:
        plan = Plan(rms_norm_kernel, (triton.cdiv(layout.rows, blocks.block_m),),
                    layout.rows, n, d1, d2, *sx, *sr, weight.stride(0), float(eps),
                    HAS_RESIDUAL=residual is not None, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                    BLOCK_T=blocks.block_t, ALIGN=row_alignment(n, layout), EARLY=blocks.early,
                    num_warps=blocks.num_warps)
    many = tuning.float32_many_rows if x.element_size() == 4 else None
    coop = coop_config(layout.rows, n, x.element_size(), x.device, many)
    if coop is None:
        return plan
    return Plan(rms_norm_coop_kernel, (coop.groups or layout.rows, coop.splits), layout.rows, n, d1, d2, *sx, *sr,
                weight.stride(0), float(eps), scratch=workspace, fallback=plan, HAS_RESIDUAL=residual is not None,
                CHUNK=coop.chunk, SPLITS=coop.splits, SLOTS=coop.slots, ALIGN=row_alignment(n, layout),
                LOOP_ROWS=coop.groups is not None, COOPERATIVE=not _rows.interpreting(), num_warps=coop.num_warps,
                **launch_options())


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


__all__ = ["add_rms_norm", "rms_norm", "rms_norm_coop_kernel", "rms_norm_kernel", "rms_norm_wide_kernel"]
