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

Three kernels; which one a call takes, and how it is launched, is a
:class:`~._tuning.RowConfig` looked up in the op's table (``_tuning.py``):

* :func:`rms_norm_kernel` keeps whole rows in registers (one read, one
  write): ``BLOCK_M`` rows a program, each as one block of ``BLOCK_N``
  columns, or a block and a tail block of ``BLOCK_T`` (5120 = 4096 + 1024
  rather than padded to 8192).
* :func:`rms_norm_wide_kernel` loops over a row in blocks of ``BLOCK_N``:
  the sum of squares, then the normalisation, so the row is read twice (the
  second read usually hits L2).
* :func:`rms_norm_coop_kernel` splits each row over ``SPLITS`` programs of
  one cooperative launch (see ``_coop.py``); each holds a chunk in
  registers and publishes its sum of squares, and the row's is their sum.

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
    EARLY: tl.constexpr,  # load the weight with the row, not after the reduction
):
    # A tile of BLOCK_M whole rows: BLOCK_N >= N, or BLOCK_N columns and a tail block of BLOCK_T.
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
    if EARLY:  # the weight with the row: one wait for memory (few rows)
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
    PREFETCH: tl.constexpr,  # passes (0-2) that load block i + 1 before block i is used
    ALIGN: tl.constexpr,  # divides every row offset and N (see _rows.row_alignment)
    STREAM_Y: tl.constexpr,  # store y evict-first (L2 keeps the rows pass 2 has yet to read)
    BLOCK_S: tl.constexpr,  # pass 1's block: BLOCK_N, or wider
    EVEN: tl.constexpr,  # BLOCK_N divides N: no column masks in pass 2 (see _rows.even_blocks)
    N_FIXED: tl.constexpr,  # N itself, compiled in (constant trip counts), or 0
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
    # A few rows: one straight row a program, its chunk loaded before the weight.
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
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    config: RowConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch; returns ``(y, h)``."""
    plan = planned((op, eps, config), (x, residual, weight), _plan, op, x, residual, weight, eps, config)
    y = output_like(x, plan)
    h = None if residual is None else torch.empty_like(y)
    if plan is not None:
        # Without a residual, R is never read and H never written: x and y stand in.
        plan.launch(x, x if residual is None else residual, weight, y, y if h is None else h)
    return y, h


def _plan(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          config: RowConfig | None = None) -> Plan | None:
    """Check the inputs and build the launch of ``config`` (default: the table's); None when there is nothing to do."""
    if residual is None:
        check_tensors(op, x=x, weight=weight)
    else:
        check_tensors(op, x=x, residual=residual, weight=weight)
    n = check_row_shapes(op, x, residual, weight=weight)
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, *((x,) if residual is None else (x, residual)))
    rows, (_, d1, d2) = layout.rows, layout.dims
    args = (*layout.strides[0], *(layout.strides[1] if residual is not None else (0, 0, 0, 0)),
            weight.stride(0), float(eps))
    cfg = config or row_config(op, x.dtype, rows, n)
    align = row_alignment(n, layout)
    if cfg.kernel == "looped":
        plan = Plan(rms_norm_wide_kernel, (rows,), n, d1, d2, *args, HAS_RESIDUAL=residual is not None,
                    BLOCK_N=cfg.block_n, BLOCK_S=cfg.stats_block, EVEN=not cfg.masked and even_blocks(n, cfg.block_n),
                    PREFETCH=cfg.prefetch, ALIGN=align, STREAM_Y=cfg.stream, N_FIXED=n if cfg.fixed else 0,
                    num_warps=cfg.warps)
    else:
        block_m, block_n, block_t, warps = whole_blocks(cfg, rows, n)
        plan = Plan(rms_norm_kernel, (triton.cdiv(rows, block_m),), rows, n, d1, d2, *args,
                    HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t,
                    ALIGN=align, EARLY=cfg.early, num_warps=warps)
    coop = coop_config(rows, n, x.element_size(), x.device, cfg.split)
    if coop is None:
        return plan
    return Plan(rms_norm_coop_kernel, (coop.groups or rows, coop.splits), rows, n, d1, d2, *args,
                scratch=workspace, fallback=plan, HAS_RESIDUAL=residual is not None, CHUNK=coop.chunk,
                SPLITS=coop.splits, SLOTS=coop.slots, ALIGN=align, LOOP_ROWS=coop.groups is not None,
                COOPERATIVE=not _rows.interpreting(), num_warps=coop.num_warps, **launch_options())


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


def with_config(op: str, config: RowConfig) -> Callable[..., object]:
    """``op`` (``rms_norm`` or ``add_rms_norm``) with the canonical signature, launched with ``config``."""
    if op == "rms_norm":
        return lambda x, weight, eps=1e-6: _rms_norm(op, x, None, weight, eps, config)[0]
    return lambda x, residual, weight, eps=1e-6: _rms_norm(op, x, residual, weight, eps, config)


__all__ = ["add_rms_norm", "rms_norm", "rms_norm_coop_kernel", "rms_norm_kernel", "rms_norm_wide_kernel",
           "with_config"]
