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

Three kernels share the work:

* :func:`layer_norm_kernel` keeps whole rows in registers, so the second pass
  over ``x - mean`` costs no memory traffic: one read of each input, one
  write of each output.  Short rows go ``BLOCK_M`` to a program; a row
  that is not a power of two may be a block plus a tail block
  (``_rows.RowBlocks``).  Each reduction is a round trip through shared memory and a barrier, and on the
  H200 the second one was what stood between layer_norm and rms_norm's
  bandwidth, so half-precision rows (one a program) first try one pass::

      var1 = sum(d^2) / N - (sum(d) / N)^2        # both sums in one reduction

  Its rounding error grows with ``(mean - x0)^2 / var``: once that passes
  ``ONE_PASS_RATIO`` (x0 more than 4 standard deviations from the mean)
  the row takes the exact second reduction after all.  Below it the
  relative error of ``var1`` stays under ``3 * 17 * log2(N)`` float32
  epsilons (9e-5 at N = 16384), under a tenth of a float16 ulp in ``y``;
  float32 rows, whose outputs would see it, always take two passes.
  (``properties/test_layer_norm_one_pass.py`` builds rows on both sides of
  the switch; without it, a far-out x0 fails the tolerance policy.)
* :func:`layer_norm_wide_kernel` is for rows wider than ``_rows.MAX_FUSED_BYTES``
  (twice that with a residual: see ``TUNING``), and for many half-precision
  rows of 2048 to 16384 that blocks divide (``_rows.NarrowLooped``).  Pass 1
  loops over column blocks.  Rows without a residual compiled for their
  width (:func:`fixed_width`: half precision up to ``FIXED_WIDTH_MAX`` wide,
  float32 whenever they loop) keep Welford's running
  mean and ``M2`` in each lane (lane ``j`` sees elements ``j, j + BLOCK_N,
  ...``)::

      d = x - mean;  mean += d / n;  M2 += d * (x - mean)

  which does not cancel, and end the pass with one reduction of two sums
  about the row's first element x0, ``count * (mean - x0)`` and ``M2 +
  count * (mean - x0)^2``, into the one-pass variance above; past
  ``ONE_PASS_RATIO`` the lanes merge by Chan's formula (below) instead,
  from the registers (float32 rows: the mean, then the lanes' ``M2`` about
  it, two reductions).  Wider half-precision rows take the one pass lane by
  lane: each lane sums ``d = x - k`` and ``d^2`` over the blocks and one
  reduction ends the pass, with ``k`` the first block's mean, which lies
  within ``sqrt(N / BLOCK_N - 1)`` standard deviations of the row's (so the
  exact fallback, a third read of the row, only runs past ``N = 17 *
  BLOCK_N``; each lane adds ``N / BLOCK_N`` terms before a tree of
  ``log2(BLOCK_N)``: 29 deep at N = 131072 where the whole-row tree is 17;
  a tuning's ``_rows.StatsBlock``, none by default since rows of 65536 went
  to Welford's pass, takes pass 1 in wider blocks whose lanes first sum
  their 8-element vectors: 8 + 2 + 12 deep at N = 65536 in blocks of 32768).
  Otherwise each block's mean and sum of squared deviations ``M2`` are
  two-pass values (the block is in registers), and blocks merge with Chan et
  al.'s parallel formula, which has no cancellation::

      n = n_a + n_b,  delta = mean_b - mean_a
      mean = mean_a + delta * n_b / n
      M2   = M2_a + M2_b + delta^2 * n_a * n_b / n

  (both running sums carry Kahan compensations).  Pass 2 normalises, so the
  row is read twice (the second read usually hits L2); after Welford's
  pass, in rows past the cap, pass 2 starts from the block pass 1 ended
  on, still in registers (:func:`keep_last`).
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
    FLOAT32_WHOLE_MAX,
    HalfLong,
    HalfShort,
    NarrowLooped,
    RowTuning,
    TailSplit,
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

# Two reductions per row (one for most half-precision rows and in the looped kernel):
# at most 8 warps (H200, bf16, 16384 rows: N=14336 in 265 µs with 8 warps, 434 with 16).
# float32 rows of 16384 and 32768 are held whole (see RowTuning.float32_whole_from);
# wider ones loop (float32_long, below; add_layer_norm's in blocks of 8192 in 16 warps,
# RowTuning.float32_wide, as plain layer_norm's did before).  H200,
# float32, event time after an L2 flush (reports/h200/norms-fp32-wide-session9.txt),
# (4096, 8) -> (8192, 16) at N = 65536: 16384 rows layer_norm 3026 -> 3036 µs,
# add_layer_norm 5588 -> 5494; 8 rows 34.0 -> 24.4 and 42.8 -> 30.0.
# Half-precision rows past 16384 elements loop in blocks of 8192 in 32 warps, prefetching
# in pass 1, since that pass keeps running statistics in each lane (_wide_stats_shifted, and
# _wide_stats_welford up to FIXED_WIDTH_MAX) instead of merging blocks with Chan's formula
# (three reductions a block).  H200, event time after an L2
# flush (reports/h200/lnw-final-session18.txt), the seventeenth session's rules (Chan in 8192
# x 8 warps; rows of 32768 whole in 32 warps) -> these: bf16 16384 x 65536 1447.6 -> 1305.8 µs,
# 1024 x 65536 105.5 -> 90.6, 128 x 65536 28.0 -> 15.8, 16384 x 32768 637.9 -> 640.4, 1024 x
# 32768 48.8 -> 48.4, 256 x 32768 15.8 -> 14.2, 16384 x 20000 474.7 -> 483.5; fp16 16384 x
# 65536 1390.6 -> 1348.1, 16384 x 32768 617.4 -> 601.7.  Rows of 16384 and 14336 stay whole
# (bf16, 16384 rows: 269.9 and 249.5 whole, 293.0 and 271.9 at best looped; lnw-ab-session18.txt).
# From 256 rows, those narrower than 32768 loop in blocks of 4096 in 8 warps instead
# (RowTuning.half_short): blocks of 8192 in 32 warps left one program on each SM (two of 4096 x 8
# fit), and padded up to 48% of a row (N = 17000 in three blocks).  H200, event time after an L2
# flush, 8192 x 32 warps -> 4096 x 8, µs (uneven-blocks-session19.txt,
# uneven-rules-session19.txt): bf16 16384 x 17000 1282.3 -> 812.7, 16384 x 20000 483.3 -> 367.9,
# 16384 x 24000 496.9 -> 449.6, 16384 x 30000 624.3 -> 610.1, 1024 x 20000 37.6 -> 30.2, 1024 x
# 24000 38.6 -> 35.3, 256 x 20000 11.5 -> 10.2, fp16 16384 x 20000 447.8 -> 366.8, 16384 x 24000
# 467.6 -> 447.4; wider rows lost (16384 x 40000 785.3 -> 836.1, 50000 1098.1 -> 1103.9; 32768 a
# tie, ln-ablate2-session19.txt), as did 128 rows and fewer (1 x 24000 7.5 -> 9.1, 128 x 20000 8.1
# -> 9.1; uneven-decode-session19.txt).
# From 1024 rows, rows of 32768 to 49151 loop in those blocks of 8192 in 16 warps rather
# than 32 (RowTuning.half_mid_warps).  H200, event µs after an L2 flush, 32 -> 16 warps
# (reports/h200/ln32768-configs-session23.txt, warps16-session23.txt): bf16 16384 x 32768
# 625.4 -> 586.4, 4096 x 32768 165.4 -> 154.9, 1024 x 32768 47.5 -> 45.0, fp16 16384 x 32768
# 587.9 -> 568.8, bf16 16384 x 40000 780.7 -> 768.3, 1024 x 40000 57.2 -> 56.2; ties at 256 x
# 32768 (14.56 -> 14.50) and 16384 x 49152 (922.6 -> 920.6), and rows of 65536 lost (1024 rows
# 90.2 -> 91.4); rms_norm lost (16384 x 32768 510.0 -> 549.0).
TUNING = RowTuning(elements_per_thread=32, max_warps=8, wide_warps=32, wide_prefetch=1, split_tail=TailSplit(),
                   float32_whole_from=16384, float32_wide=(8192, 16),
                   float32_long=(HalfLong(FLOAT32_WHOLE_MAX + 1, 16384, 32, prefetch=1),),
                   half_short=HalfShort(32768, 4096, 8, min_rows=256), half_mid_warps=(49152, 16, 1024),
                   half_long=(HalfLong(49152, 16384, 32, max_n=98304),), float32_elements_per_thread=8,
                   half_looped=(NarrowLooped(12289, 16384, 256, (4096, 2048), 16),
                                NarrowLooped(5121, 8192, 1024, (4096, 2048), 8),
                                NarrowLooped(4097, 5120, 1024, (1024,), 8),
                                NarrowLooped(2048, 4096, 1024, (2048,), 4)))
# Many half-precision rows of 12289 to 16384 elements that a block of 4096 or 2048 divides loop in those blocks in 16
# warps rather than whole (NarrowLooped), compiled for their width (FIXED_WIDTH_MAX).  H200, bf16, event µs after an L2
# flush, whole -> looped (twenty-fifth session's probes, their files lost: reports/h200/README.md; fuseaudit bench of
# the final code, bench-ln-fixed-width-session26.txt: 16384 x 14336 229.6, 1.04x torch.compile, 16384 x 16384 254.3):
# 16384 x 14336 250.0 -> 229.5 (torch.compile 238.6), 16384 x 16384 271.9 -> 254.7 (260.2), fp16 16384 x 14336 250.0
# -> 224.7 (227.1), 4096 x 14336 69.9 -> 65.0, 256 x 16384 10.6 -> 10.5; 512 x 14336 14.3 -> 12.2 and 256 x 14336 9.3
# -> 9.0 (with pass 1's lanes merged by Chan's formula).  Widths that no block divides lost (masked blocks of 2048):
# 16384 x 15000 263.0 -> 294.5, 13000 241.0 -> 262.6, 12800 235.4 -> 259.9.
# So do many narrower rows, from 1024 rows: of 2048 to 4096 in blocks of 2048 in 4 warps (a row of 2048 in one block),
# 5120 in blocks of 1024 in 8 warps, 5121 to 8192 in blocks of 4096 or 2048 in 8 warps.  H200, event µs after an L2
# flush, whole -> looped, compiled for their width (row-configs-ln-narrow-session27.txt, row-configs-under-copy-
# session27.txt): bf16 16384 x 4096 70.46 -> 68.03 and 70.27 -> 67.95 (blocks of 4096 in 4 warps 68.10; N at runtime
# 78.16), fp16 70.24 -> 68.06, 4096 x 4096 22.98 -> 21.78, 1024 x 4096 8.96 -> 8.64, 16384 x 2048 40.13 -> 36.78,
# 16384 x 5120 86.21 -> 83.63, 16384 x 8192 136.00 -> 131.58 (2048 x 8 warps 131.47).  Rows of 1024 tied (16384
# rows 22.02 -> 21.89 at best), rows of 11008 (no block divides them) and float32 rows lost (16384 x 11008 184.94 ->
# 194.02, float32 16384 x 4096 136.54 -> 145.49).
# Half-precision rows of 49152 to 98304 loop in blocks of 16384 in 32 warps (HalfLong), compiled for their width with
# Welford's pass 1 (FIXED_WIDTH_MAX).  They had taken blocks of 8192 in 32 warps, N at runtime, and from 2048 rows
# of 57344 to 65536 pass 1 (the shifted sums) in blocks of 32768 (StatsBlock; the twenty-third session's rule: 16384
# x 65536 1314.8 -> 1182.1 µs, stats-range-session23.txt, which no op's tuning now takes by default).  H200, event µs
# after an L2 flush, those rules -> these (row-configs-probe2-session28.txt, row-configs-probe3-session28.txt): bf16
# 16384 x 49152 923.1 -> 832.3, 16384 x 57344 1079.6 -> 1003.8, 16384 x 65536 1163.3 -> 1122.9 (fp16 1145.2 ->
# 1118.3), 16384 x 73728 1518.8 -> 1341.3 (N at runtime 1670.3), 16384 x 98304 2090.6 -> 2071.3, 4096 x 65536 304.1 ->
# 293.9, 2048 x 65536 164.2 -> 156.3, 1024 x 65536 90.2 -> 84.9 (fp16 89.8 -> 80.1), 512 x 65536 48.7 -> 47.2, 256 x
# 65536 27.9 -> 27.2, 128 x 65536 16.2 -> 14.6, 1024 x 98304 140.1 -> 134.2, 1024 x 49152 66.5 -> 63.0.  Blocks of
# 32768 lost (1024 x 65536 92.4), as did 16 warps (97.5) and rows of 131072 (16384 rows 2758.2 -> 2942.8, 1024 rows
# 189.3 -> 186.9): they keep blocks of 8192 and N at runtime.
# float32 rows that loop (wider than FLOAT32_WHOLE_MAX) loop in blocks of 16384 in 32 warps, prefetching in pass 1
# (float32_long), compiled for their width with Welford's pass 1 as half-precision rows are (fixed_width; and KEEP
# where keep_last says).  They had taken blocks of 8192 in 16 warps, N at runtime and Chan's pass 1, whose three
# reductions a block waited on one another.  H200, event µs after an L2 flush, three interleaved rounds, those ->
# these (reports/h200/probe6-, probe7-session31.txt): 16384 x 33000 1508.9 -> 1140.7, 16384 x 40000 1751.6 ->
# 1290.1, 16384 x 49152 2103.4 -> 1630.2, 16384 x 65536 2852.7 -> 2438.4, 16384 x 98304 4445.7 -> 4037.7, 16384 x
# 131072 5970.6 -> 5568.5, 4096 x 40000 447.3 -> 332.8, 4096 x 65536 742.4 -> 619.6, 1024 x 40000 118.9 -> 93.2,
# 1024 x 65536 199.1 -> 164.4, 256 x 65536 58.1 -> 46.8, 128 x 65536 37.9 -> 26.2 (torch.compile 34.9), 128 x
# 131072 74.4 -> 52.9 (60.2).  The same blocks without Welford's pass 1 gained less (16384 x 65536 2709.4), 16
# warps (2488.5), blocks of 8192 in 32 warps (2614.6) and of 32768 (3709.8) less or lost; prefetching in both
# passes won at 16384 x 33000 (1087.0) and lost from 40000 (1558.8).  Those probes merged the lanes as half precision
# does; as shipped, exactly (see _wide_stats_welford; probe9-session31.txt): 16384 x 65536 2448.1, 16384 x 40000
# 1317.7, 16384 x 36000 1560.6 -> 1180.5, 16384 x 80000 3552.0 -> 3182.2, 128 x 40000 24.5 -> 17.7.  (The residual
# variant keeps its blocks: 16384 x 65536 4919.6, 5849.0 in these blocks prefetching in both passes, probe6-session31.)
# float32 rows held whole within the cap run a thread to 8 elements, not 32 (float32_elements_per_thread; rows of
# 2048 in 8 warps rather than 4, rows of 4096 in 8 (max_warps) rather than 4).  H200, event µs after an L2 flush,
# (row-configs-probe2-session28.txt, row-configs-probe3-session28.txt): 16384 x 2048 69.6 -> 68.7 and 69.9 -> 68.7,
# 4096 x 2048 21.9 -> 21.2, 1024 x 2048 8.69 -> 8.19, 64 x 2048 4.91 -> 4.83, 8 x 2048 4.77 -> 4.64, 16384 x 4096
# 136.2 -> 134.5 (16 warps 131.9), 16384 x 1024 (two rows a program) 38.35 -> 38.14.
# The residual variant keeps every half-precision row up to 64 KiB whole, padded or
# not: at N = 24000 (16384 rows) 758.2 µs whole vs 865.0 looped (but 8 rows: 15.9 vs
# 11.1).  Its looped kernel prefetches, in pass 1 for half precision and both passes
# for float32 (RowBlocks.prefetch; H200, 16384 rows, event time after an L2 flush,
# 0 -> 1 -> 2 passes, reports/h200/wide-prefetch-session13.txt, row-tuning3-session13.txt):
# N = 65536 bf16 2768.9 -> 2542.5 -> 2542.7 µs, float32 5400.6 -> 4928.7 -> 4930.3.
# So float32 rows past the cap loop here: N = 16384 1162.7 µs whole -> 1130.9 looped ->
# 1115.8 -> 1108.7 prefetching, N = 32768 2287.8 whole -> 2286.9 -> 2253.9.
# Its half-precision rows of 65536 and more loop in blocks of 16384 in 16 warps (H200,
# event time after an L2 flush, 8192 x 8 warps -> 16384 x 16, prefetching in pass 1: bf16
# 16384 x 65536 2494.6 -> 2305.7 µs, float16 2505.1 -> 2293.3, bf16 1024 x 65536 167.5 ->
# 160.1; reports/h200/split-warps-session17.txt).  Its pass 1 keeps Chan's formula: with
# shifted sums it did not gain (16384 x 65536: 2295.1 Chan, 2295.2 shifted in 8192 x 32
# warps, 2339.8 in 16384 x 16; 1024 rows 159.7, 156.7, 156.9; lnw-ab-session18.txt), nor with Welford's
# lanes (a variant of _wide_stats_welford forming h, not kept; H200, bf16, event µs after an L2 flush, Chan ->
# Welford, N at runtime / compiled in, reports/h200/probe2-session29.txt: 16384 x 65536 2282.9 -> 2407.8 / 2564.2,
# 1024 x 65536 159.3 -> 165.3 / 174.2, 16384 x 131072 4983.7 -> 5187.2; fp16 16384 x 65536 2266.6 -> 2235.5 alone
# won).  Those rows are
# compiled for their width (fixed_width): H200, bf16, event µs after an L2 flush, N at runtime -> compiled in
# (row-configs-probe5-session28.txt, row-configs-probe1-session29.txt, probe2-, probe3-session29.txt): 16384 x
# 65536 2300.1 -> 2267.6, 2283.0 -> 2264.8, 2282.9 -> 2268.6; 4096 x 65536 588.6 -> 579.5; 1024 x 65536 159.0 ->
# 154.8, 159.0 -> 155.9, 159.3 -> 155.7; 256 x 65536 45.8 -> 44.7; 16384 x 98304 3544.1 -> 3528.6; 16384 x 131072
# 4970.9 -> 4940.6; fp16 16384 x 65536 2265.4 -> 2262.1 (a tie).
# Its float32 rows of 8192 (the cap), held whole, run in 16 warps from 256 rows (RowTuning.float32_cap_warps; H200,
# event time after an L2 flush, 8 -> 16 warps, µs, reports/h200/row-configs-small-session22.txt,
# row-configs-fp32-add-session22.txt): 16384 rows 539.5 -> 524.7 and 540.5 -> 522.6 (32 warps 523.1, 522.9), 4096
# rows 140.9 -> 136.5, 1024 rows 40.5 -> 39.6, 256 rows 13.70 -> 13.41.  (Plain layer_norm tied, 265.3 -> 265.0, and
# add_rms_norm too, 526.3 -> 527.4.)
ADD_TUNING = TUNING._replace(fused_scale=2, wide_warps=8, float32_whole_from=0, float32_wide_prefetch=2,
                             float32_long=(), half_short=None, half_long=(HalfLong(65536, 16384, 16),),
                             float32_cap_warps=(256, 16),
                             half_mid_warps=None, stats_block=None, half_looped=(), float32_elements_per_thread=0)

# The cooperative kernel loads weight and bias before it waits for the row's
# other programs when its chunk is at most this many elements.  Larger
# chunks load them after: with them in registers through the merge, ptxas
# spilled (CPU compile for sm_90, float32, 16384 columns in 16 warps: 100
# bytes a thread; 32768 in 32 warps, 1076 -> 152).
COOP_EARLY_MAX = 8192

# Half-precision rows without a residual up to this wide, where they loop, are compiled for their width (the kernel's
# N_FIXED: one compile per hidden size, as torch.compile's kernels are) and take pass 1 by Welford in each lane
# (_wide_stats_welford); wider rows keep N a runtime argument and their pass 1 (float32 rows that loop: see TUNING;
# the residual variant keeps its pass 1, and N at runtime below ADD_TUNING.half_long).
# Neither change paid alone.  H200, bf16, event µs after an L2 flush, runtime N and shifted sums (the twenty-fourth
# session's kernel) / Welford with N at runtime / Welford with N compiled in (the twenty-fifth session's probes; their
# files were lost with its machine, reports/h200/README.md): 16384 x 20000 374.6 / 407.2 / 334.6, 1024 x 20000 31.3 /
# 33.6 / 30.1, 16384 x 24000 456.1 / 482.8 / 414.4, 16384 x 32768 584.7 / 866.8 / 539.6, 1024 x 32768 44.8 / 61.0 /
# 43.0.  Rows of 65536 lost with it: 1024 rows 90.5 / 105.8 / 98.4, and with pass 1 in blocks of 32768 (StatsBlock)
# 16384 rows 1153.8 against 1490.7-1632.2 (ptxas spills) or 1169.6 for shifted sums about x0 with N compiled in (fp16
# 1141.1 and 1226.8).  N compiled in with the shifted sums as they were (k the first block's mean) lost too: 16384 x
# 65536 1174.3 -> 1487.6.  Re-measured with fuseaudit bench (bench-ln-fixed-width-session26.txt): 16384 x 32768 541.6
# µs, 93% of copy, 1.20x torch.compile (fp16 518.7, 98%).  Rows of 49152 to 98304 in blocks of 16384 in 32 warps won
# with it in the twenty-eighth session (see TUNING): 16384 x 65536 1163.3 -> 1122.9 µs, 1024 x 65536 90.2 -> 84.9.
# Those blocks won only compiled for the width, so the range ends where TUNING.half_long's does (98304).
# The residual variant's half-precision rows in ADD_TUNING.half_long's blocks are compiled for their width too (see
# ADD_TUNING), keeping Chan's pass 1.
FIXED_WIDTH_MAX = TUNING.half_long[0].max_n

# Pass 2 of the looped kernel starts from the block Welford's pass 1 ended on, still in registers, rather than reading
# it again (KEEP, see keep_last), in rows past the cap (16384) that its blocks divide.  H200, event µs after an L2
# flush, three interleaved rounds, read again -> kept (reports/h200/probe2-, probe3-, probe6-session30.txt):
# bf16 16384 x 65536 1130.7 -> 1114.8 (fp16 1129.2 -> 1108.3), 4096 x 65536 296.4 -> 288.6, 1024 x 65536 85.1 ->
# 80.8, 256 x 65536 27.0 -> 26.5, 128 x 65536 14.7 -> 14.6, 16384 x 98304 2034.8 -> 1994.2, 1024 x 98304 134.9 ->
# 131.5, 16384 x 49152 838.8 -> 825.7, 16384 x 32768 544.8 -> 526.4, 1024 x 32768 43.4 -> 42.3.  The narrow rows that
# loop (NarrowLooped) gained in blocks of 2048 (16384 x 14336 231.0 -> 225.5, fp16 226.3 -> 224.5, 2048 x 14336 37.7
# -> 36.2; 1024 x 14336 a tie) but not in blocks of 4096 (1024 x 16384 23.5 -> 23.7, 512 x 16384 15.5 -> 15.8, 4096 x
# 16384 69.5 -> 69.9, 16384 x 16384 a tie; 16384 x 8192 131.5 -> 143.6, 1024 x 8192 14.4 -> 15.6), so they keep
# reading; and rows the blocks do not divide lost (16384 x 40000 679.2 -> 772.2, 1024 x 20000 29.9 -> 30.6; 16384 x
# 24000 won, 415.8 -> 403.0).  The same change lost or tied in rms_norm's and softmax's looped kernels (bf16 16384 x
# 65536: 999.6 -> 1011.1 and 1073.1 -> 1070.6; 16384 x 32768 softmax 518.6 -> 625.6, probe2-session30.txt), and,
# kept through the loop rather than taken after it, in the residual variants (add_rms_norm 16384 x 65536 2199.5 ->
# 2252.8, probe1-session30.txt).
KEEP_MIN_N = 16385

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
    EARLY: tl.constexpr,  # load weight and bias with the row (see _rows.RowBlocks.early)
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N, or BLOCK_N columns and a
    # tail block of BLOCK_T (see _rows.RowBlocks).  The tail, when there is
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
    if EARLY:  # weight and bias with the row: one wait for memory (see _rows.RowBlocks.early)
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
    # (Each tail term is formed after the block's reduction, not beside it:
    # at N = 5120 that ordering kept layer_norm at 90 µs instead of 104.)
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
    """Pass 1 of the looped kernel for rows compiled for their width without a residual (:func:`fixed_width`): Welford.

    Lane ``j`` sees elements ``j, j + BLOCK_N, ...`` of the row and keeps
    their running mean and ``M2`` (Welford: ``d = x - mean; mean += d / n;
    M2 += d * (x - mean)``, no cancellation whatever the row's offset); in
    half precision one reduction of two sums about x0 merges the lanes, or
    where x0 is far from the mean a reduction by Chan's formula (see the
    module docstring); in float32 two reductions, the mean and then M2.  No
    block waits on a reduction before the loop (the shifted sums' ``k``), and
    no row is read a third time; with the row width compiled in it was the
    faster pass (see ``FIXED_WIDTH_MAX``).
    """
    offs = tl.arange(0, BLOCK_N)
    x, _ = load_pair_block(x_row, x_row, offs, N, sxn, sxn, False)  # block 0 (the row is wider than BLOCK_N)
    # block 1 ahead (dead code without PREFETCH >= 1: see _rows.load_pair_block)
    x_next, _ = load_pair_block(x_row, x_row, offs + BLOCK_N, N, sxn, sxn, False)
    mean = x.to(tl.float32)
    m2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    # KEEP: the last block is taken after the loop, and returned for pass 2 (see keep_last).
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
    """Pass 1 of the looped kernel, half-precision rows past ``FIXED_WIDTH_MAX`` without a residual: shifted sums.

    Each lane keeps running sums of ``d = x - k`` and ``d^2`` over the
    blocks, reduced once at the end, as the whole-row kernel's one pass does
    (see the module docstring); ``k`` is the first block's mean, within
    ``sqrt(N / BLOCK_N - 1)`` standard deviations of the row's, so up to
    ``N = 17 * BLOCK_N`` the exact fallback below never runs.  With
    ``VECTORS`` (blocks wider than pass 2's, see ``_rows.StatsBlock``) a
    running sum covers one vector of 8 elements, not one element.
    """
    # Block 0 first, whole (the row is wider than BLOCK_N): its mean is k.
    # (Taken inside the loop under `if start == 0`, the reduction cost 12-40%
    # of the kernel's time on the H200: lnw-final-session18.txt.)
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
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used (see _rows.RowBlocks)
    ALIGN: tl.constexpr,  # divides every row offset and N (see _rows.row_alignment)
    BLOCK_S: tl.constexpr,  # pass 1's block in half precision without a residual: BLOCK_N, or wider (_rows.StatsBlock)
    EVEN: tl.constexpr,  # BLOCK_N and BLOCK_S divide N: no column masks (see _rows.even_blocks)
    N_FIXED: tl.constexpr,  # N itself, compiled in, or 0 (see FIXED_WIDTH_MAX)
    KEEP: tl.constexpr = False,  # pass 2 starts from the block pass 1 ended on, in registers (see keep_last)
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
    # their width) or, in half precision, shifted sums where they were
    # measured faster (see FIXED_WIDTH_MAX and TUNING); with a residual pass
    # 1 moves three times the bytes and they measured no faster (see ADD_TUNING).
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
    # Every row reads w and b again, from L2: on the H200 (bf16, 16384 x
    # 32768) this kernel ran in 534 µs without them against 590.  Reading them
    # once for two or four rows a program was slower (640-906 µs), as were
    # cache hints to keep them in L1 (reports/h200/ln-rows-wb-, ln-rows-,
    # ln-pair-, hints-wb-session24.txt).  What did pay was N compiled in with
    # Welford's pass 1 (N_FIXED: 16384 x 32768 in 539.6 µs, see FIXED_WIDTH_MAX).
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch; returns ``(y, h)``."""
    plan = planned((op, eps), (x, residual, weight, bias), _plan, op, x, residual, weight, bias, eps)
    y = output_like(x, plan)
    h = None if residual is None else torch.empty_like(y)
    if plan is not None:
        # Without a residual, R is never read and H never written: x and y stand in.
        plan.launch(x, x if residual is None else residual, weight, bias, y, y if h is None else h)
    return y, h


def fixed_width(n: int, element_size: int, has_residual: bool) -> int:
    """The looped kernel's ``N_FIXED`` for rows of ``n``: ``n`` where it is compiled for their width, else 0.

    Rows without a residual: half precision up to ``FIXED_WIDTH_MAX``, and
    float32 (rows that loop, in ``TUNING.float32_long``'s blocks); with one,
    the half-precision rows ``ADD_TUNING.half_long`` takes (all read at plan
    time, as every tuning constant): see their notes.  Without a residual,
    such rows take Welford's pass 1.
    """
    if has_residual:
        return n if element_size == 2 and any(rule.applies(n) for rule in ADD_TUNING.half_long) else 0
    return n if element_size == 4 or n <= FIXED_WIDTH_MAX else 0


def keep_last(n: int, element_size: int, has_residual: bool, blocks: _rows.RowBlocks) -> bool:
    """The looped kernel's ``KEEP`` for rows of ``n`` in ``blocks``: whether pass 2 starts from pass 1's last block.

    Only Welford's pass 1 (no residual, compiled for the width:
    :func:`fixed_width`) ends on a block pass 2 can take, where the
    row is more than one of them; from ``KEEP_MIN_N`` columns, in blocks that
    divide the row (where it was measured faster; read at plan time).
    """
    welford = not has_residual and fixed_width(n, element_size, has_residual) > 0
    return (welford and blocks.wide and blocks.stats_block_n == blocks.block_n < n and n >= KEEP_MIN_N
            and even_blocks(n, blocks.block_n))


def _plan(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
          eps: float) -> Plan | None:
    """Check the inputs and choose the kernel, grid and tile; None when there is nothing to launch."""
    tuning = TUNING if residual is None else ADD_TUNING
    if residual is None:
        check_tensors(op, x=x, weight=weight, bias=bias)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight, bias=bias)
    n = check_row_shapes(op, x, residual, weight=weight, bias=bias)
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, *((x,) if residual is None else (x, residual)))
    sx = layout.strides[0]
    sr = layout.strides[1] if residual is not None else (0, 0, 0, 0)
    _, d1, d2 = layout.dims
    vectors = (weight.stride(0), bias.stride(0), float(eps))
    blocks = row_block_config(layout.rows, n, x.element_size(), tuning)
    if blocks.wide:
        plan = Plan(layer_norm_wide_kernel, (layout.rows,), n, d1, d2, *sx, *sr, *vectors,
                    HAS_RESIDUAL=residual is not None, BLOCK_N=blocks.block_n, PREFETCH=blocks.prefetch,
                    ALIGN=row_alignment(n, layout), BLOCK_S=blocks.stats_block_n,
                    EVEN=even_blocks(n, blocks.block_n, blocks.stats_block_n),
                    N_FIXED=fixed_width(n, x.element_size(), residual is not None),
                    KEEP=keep_last(n, x.element_size(), residual is not None, blocks), num_warps=blocks.num_warps)
    else:
        plan = Plan(layer_norm_kernel, (triton.cdiv(layout.rows, blocks.block_m),), layout.rows, n, d1, d2, *sx,
                    *sr, *vectors, HAS_RESIDUAL=residual is not None, BLOCK_M=blocks.block_m,
                    BLOCK_N=blocks.block_n, BLOCK_T=blocks.block_t, ALIGN=row_alignment(n, layout),
                    EARLY=blocks.early, num_warps=blocks.num_warps)
    many = tuning.float32_many_rows if x.element_size() == 4 else None
    coop = coop_config(layout.rows, n, x.element_size(), x.device, many)
    if coop is None:
        return plan
    return Plan(layer_norm_coop_kernel, (coop.groups or layout.rows, coop.splits), layout.rows, n, d1, d2, *sx,
                *sr, *vectors, scratch=workspace, fallback=plan, HAS_RESIDUAL=residual is not None,
                CHUNK=coop.chunk, SPLITS=coop.splits, SLOTS=coop.slots, ALIGN=row_alignment(n, layout),
                EARLY=coop.chunk <= COOP_EARLY_MAX, LOOP_ROWS=coop.groups is not None,
                COOPERATIVE=not _rows.interpreting(),
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


__all__ = ["add_layer_norm", "layer_norm", "layer_norm_coop_kernel", "layer_norm_kernel", "layer_norm_wide_kernel"]
