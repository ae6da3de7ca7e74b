"""Few wide rows: each row split over several programs of one cooperative launch.

At decode sizes a row-wise op has a handful of rows (1 to 64) and a 132-SM
GPU runs one program a row: a few SMs each stream a whole row, one block
after another, while the others idle, where the bandwidth of the whole chip
would move it in a fraction of the time.

Splitting the row over ``SPLITS`` programs, each holding a ``CHUNK`` of
columns in registers, needs the row's statistics (a sum of squares, a mean
and a variance, a max and a sum of exps) before any program can write its
output.  So each program

1. loads its chunk (and its weight) and reduces it to a *partial*: two
   float32 numbers;
2. publishes it in a workspace slot and arrives at its row's counter;
3. waits until every program of its row has arrived, loads all the row's
   partials and merges them (each op says how, beside its kernel);
4. writes its chunk of the output from the registers: one read, one write.

Step 3 is only safe when every program of the launch is resident at once, so
the launch is *cooperative* (``launch_cooperative_grid=True``: CUDA refuses
it rather than queue a program behind a spinning one), and the grid is kept
to at most one program per SM.

Many wide rows (a config's ``Split`` with a chunk, see ``_tuning.py``) split the same way,
but over a fixed grid: ``groups`` groups of ``SPLITS`` programs, a few
programs an SM, each group taking every ``groups``-th row and each program
loading its chunk of the next row before it waits for this one.  Where a
cooperative grid does not fit after all (more registers than the rule
expected), CUDA refuses the launch and the plan falls back to the op's
one-program-a-row kernel (``_launch.Plan``'s ``fallback``).

The counter is never reset.  Every launch adds exactly ``EPOCH`` to each row's
counter (program ``s`` adds its share, :func:`arrive_step`), so at the start
of a launch it is a multiple of ``EPOCH``; a program has seen its whole row
arrive once the counter has left the epoch it arrived in.  That holds across
int32 wrap-around, needs no memset per call, and survives CUDA graph
capture and replay (the graph replays the same additions).  Launches that
share a workspace must not overlap, so there is one workspace per device and
stream (:func:`workspace`).

Triton's interpreter runs programs one after another, so a program there
could wait for ever.  Under it (``COOPERATIVE=False``) each program computes
every chunk's partial itself, stores them all, and then goes on exactly as
on the GPU: the chunking, the partials, their merge and the output are the
same code, only the publishing and the waiting are not run on the CPU.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from ._rows import add_residual, interpreting, load_pair, next_pow2, out_row_offsets, row_offsets

if TYPE_CHECKING:
    from ._tuning import Split

# A program's chunk is at least this many bytes ...
MIN_CHUNK_BYTES = 2048
# ... and at most this many elements, else the row keeps one program.
MAX_CHUNK = 32768
# Threads: 16 elements each, 4 to 16 warps; chunks past 16384 elements take 32 warps.
ELEMENTS_PER_THREAD = 16
MIN_WARPS = 4
MAX_WARPS = 16
WIDE_CHUNK = 16384
WIDE_CHUNK_WARPS = 32
# Every launch adds EPOCH to each row's counter: at most EPOCH programs a row.
EPOCH_BITS = tl.constexpr(10)
EPOCH = 1 << EPOCH_BITS.value
# The interpreter has no SMs; route as on an H100/H200 so the CPU tests take the GPU's paths.
INTERPRETER_SMS = 132
# There each program computes every chunk's partial (see above): a row costs splits squared chunk loads.
INTERPRETER_MAX_SPLITS = 8
# Workspace: a counter a row (a group of programs) and two float32 partials a program, twice (a
# group's consecutive rows alternate between two sets of slots).
MAX_ROWS = 1024
MAX_PROGRAMS = 4096
# Each row's counter on its own 128-byte line: the programs of one row poll
# it while those of the next row add to theirs.
COUNTER_STRIDE = tl.constexpr(32)


class CoopBlocks(NamedTuple):
    """A row split over ``splits`` programs of ``chunk`` columns (the last may be partly masked).

    ``groups``: None for one row a group of ``splits`` programs (a few
    rows), else that many groups, each taking every ``groups``-th row (many
    rows), each program loading its next row before it waits for this one's
    partials.
    """

    chunk: int
    splits: int
    num_warps: int
    groups: int | None = None

    @property
    def slots(self) -> int:
        """``splits`` rounded up to a power of two: the length of the vectors the partials merge in."""
        return next_pow2(self.splits)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``INTERPRETER_SMS`` under the interpreter)."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def coop_config(rows: int, n: int, element_size: int, device: torch.device, split: Split | None) -> CoopBlocks | None:
    """How to split ``rows`` rows of ``n`` elements over programs as ``split`` says, or None for one program a row.

    A few rows (``split.chunk == 0``, at most half as many rows as SMs) split
    as finely as the SMs allow down to chunks of ``MIN_CHUNK_BYTES``, and not
    at all where a chunk would exceed ``MAX_CHUNK`` elements; many rows in
    ``split``'s chunks, in groups of programs that loop over the rows.  Never
    with ``FUSEAUDIT_COOP=0``.  Module constants are read at call time.
    """
    if split is None or not ENABLED:
        return None
    most = INTERPRETER_MAX_SPLITS if interpreting() else EPOCH
    return _coop_config(rows, n, element_size, sm_count(device), knobs(), split, most)


@functools.lru_cache(maxsize=4096)
def _coop_config(rows: int, n: int, element_size: int, sms: int, knobs: tuple[int, ...],
                 split: Split, max_splits: int = EPOCH) -> CoopBlocks | None:
    min_chunk_bytes, max_chunk = knobs
    if split.chunk:
        splits = triton.cdiv(n, split.chunk)
        groups = min(sms * split.per_sm // splits, rows, MAX_ROWS, MAX_PROGRAMS // splits)
        if splits < 2 or groups < 1:
            return None
        return CoopBlocks(split.chunk, splits, split.warps, groups)
    if rows > min(sms // 2, MAX_ROWS):
        return None
    most = min(sms // rows, max_splits, MAX_PROGRAMS // rows)  # programs a row
    chunk = max(next_pow2(triton.cdiv(n, most)), next_pow2(max(min_chunk_bytes // element_size, 1)))
    splits = triton.cdiv(n, chunk)
    if splits < 2 or chunk > max_chunk:
        return None
    warps = min(max(chunk // ELEMENTS_PER_THREAD // 32, MIN_WARPS), MAX_WARPS)
    if chunk > WIDE_CHUNK:
        warps = WIDE_CHUNK_WARPS
    return CoopBlocks(chunk, splits, warps)


def launch_options() -> dict[str, bool]:
    """Triton's launch option for a cooperative grid (none under the interpreter, which runs no grid at once)."""
    return {} if interpreting() else {"launch_cooperative_grid": True}


_WORKSPACES: dict[tuple[str, int | None, int], tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, counters)`` for cooperative launches on ``device``'s current stream.

    Allocated (and zeroed, once) on first use; a later launch on the same
    stream follows the previous one, so they share it safely.  A CUDA graph
    keeps the workspace of the stream it was captured on; replaying it while
    that stream runs the same kind of launch is not supported.
    """
    key = (device.type, device.index, _current_stream(device) if device.type == "cuda" else 0)
    try:
        return _WORKSPACES[key]
    except KeyError:
        pass
    buffers = (torch.zeros(4 * MAX_PROGRAMS, dtype=torch.float32, device=device),
               torch.zeros(MAX_ROWS * COUNTER_STRIDE.value, dtype=torch.int32, device=device))
    _WORKSPACES[key] = buffers
    return buffers


def _current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (cheaper than a Stream object; torch.compile reads it too)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


@triton.jit
def arrive_step(split, SPLITS: tl.constexpr):
    """What program ``split`` of a row adds to its counter: the shares add up to exactly ``EPOCH``."""
    share = (1 << EPOCH_BITS) // SPLITS
    return tl.where(split == 0, (1 << EPOCH_BITS) - share * (SPLITS - 1), share)


@triton.jit
def publish(Part, row, split, a, b, SPLITS: tl.constexpr):
    """Store one program's partial ``(a, b)`` in its slot of the row's ``2 * SPLITS`` floats.

    ``row`` numbers the row's slots: the row itself with one row a group,
    else :func:`row_slots` (gather takes the same number).
    """
    slot = Part + (row * SPLITS + split) * 2
    tl.store(slot, a)
    tl.store(slot + 1, b)


@triton.jit
def arrive_and_wait(Count, row, split, SPLITS: tl.constexpr):
    """Arrive at the row's counter, then wait until every program of the row has.

    The barrier puts every thread's partial before the counter's release;
    the acquire makes the other programs' partials visible in return.
    """
    tl.debug_barrier()
    counter = Count + row * COUNTER_STRIDE
    old = tl.atomic_add(counter, arrive_step(split, SPLITS), sem="acq_rel")
    now = old + arrive_step(split, SPLITS)
    while ((now ^ old) >> EPOCH_BITS) == 0:  # still in the epoch we arrived in
        now = tl.atomic_add(counter, 0, sem="acquire")


@triton.jit
def gather(Part, row, SPLITS: tl.constexpr, SLOTS: tl.constexpr, A_PAD: tl.constexpr, B_PAD: tl.constexpr):
    """The row's partials as two ``[SLOTS]`` vectors (padded with ``A_PAD``, ``B_PAD``), and their mask.

    ``SLOTS`` is ``SPLITS`` rounded up to a power of two (see :class:`CoopBlocks`).
    ``.cg`` reads at L2, where the other programs' stores are, never a stale L1 line.
    """
    s = tl.arange(0, SLOTS)
    valid = s < SPLITS
    slot = Part + (row * SPLITS + s) * 2
    a = tl.load(slot, mask=valid, other=A_PAD, cache_modifier=".cg")
    b = tl.load(slot + 1, mask=valid, other=B_PAD, cache_modifier=".cg")
    return a, b, valid


@triton.jit
def load_raw_chunk(X, R, row, n_rows, cols, N, D1, D2, sx0, sx1, sx2, sxn, sr0, sr1, sr2, srn,
                   ALIGN: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Columns ``cols`` of row ``row`` of ``x`` and of the residual in their own dtype, 0 past ``N`` or ``n_rows``.

    ``x`` twice without a residual.  A program loads its next row with this
    before it waits for this row's partials: converted here, the values
    would be waited for here.
    """
    # (a column bound of 0 past the last row: Triton 3.9's interpreter rejects a block mask & a scalar)
    mask = cols < tl.where(row < n_rows, N, 0)
    offs = cols.to(tl.int64)
    x = tl.load(X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN) + offs * sxn, mask=mask, other=0.0)
    r = x
    if HAS_RESIDUAL:
        r = tl.load(R + row_offsets(row, D1, D2, sr0, sr1, sr2, ALIGN) + offs * srn, mask=mask, other=0.0)
    return x, r


@triton.jit
def row_chunk(X, R, H, row, n_rows, groups, x_next, r_next, cols, N, D1, D2, sx0, sx1, sx2, sxn, sr0, sr1, sr2, srn,
              ALIGN: tl.constexpr, HAS_RESIDUAL: tl.constexpr, AHEAD: tl.constexpr):
    """Row ``row``'s chunk ``cols`` in float32 (``h = x + residual``, stored to ``H``, with one) and the look-ahead.

    Returns ``(x, x_next, r_next, x_row, r_row, out)``: with ``AHEAD`` the
    chunk is the one loaded ahead (``x_next``, ``r_next``), and the group's
    next row (``row + groups``) is loaded ahead in its place; without, it is
    loaded here.  ``x_row``, ``r_row`` point to the row's
    inputs, ``out`` is its offset in the contiguous outputs.
    """
    x_row = X + row_offsets(row, D1, D2, sx0, sx1, sx2, ALIGN)
    r_row = R + row_offsets(row, D1, D2, sr0, sr1, sr2, ALIGN)
    out = out_row_offsets(row, N, ALIGN)
    mask = cols < N
    if AHEAD:
        x, r = x_next, r_next
        x_next, r_next = load_raw_chunk(X, R, row + groups, n_rows, cols, N, D1, D2, sx0, sx1, sx2, sxn,
                                        sr0, sr1, sr2, srn, ALIGN, HAS_RESIDUAL)
    else:
        x, r = load_pair(x_row, r_row, cols, mask, sxn, srn, HAS_RESIDUAL)
    x = add_residual(x.to(tl.float32), r.to(tl.float32), H, out, cols, mask, HAS_RESIDUAL)
    return x, x_next, r_next, x_row, r_row, out


@triton.jit
def row_slots(group, k):
    """The slots of a group's ``k``-th row: consecutive rows alternate between two sets.

    A program can be at most one row ahead of the slowest of its group (it
    waits for all of them at every row), so row k + 2 never overwrites
    partials that row k's programs may still be reading.
    """
    return group * 2 + (k & 1)


@triton.jit
def chunk_width(split, N, CHUNK: tl.constexpr):
    """Columns of the row that chunk ``split`` holds (``CHUNK``, fewer for the last)."""
    return tl.minimum(N - split * CHUNK, CHUNK)


# False with FUSEAUDIT_COOP=0 in the environment as the kernels are imported
# (read once: see _launch.ENABLED): every row then keeps one program (e.g.
# where cooperative launches are refused).  A test may set it (through
# _launch.retuned: kept plans are not keyed by it).
ENABLED = os.environ.get("FUSEAUDIT_COOP", "1") not in ("", "0")


def knobs() -> tuple[int, int]:
    """The module constants the split depends on (part of ``_coop_config``'s cache key)."""
    return MIN_CHUNK_BYTES, MAX_CHUNK


__all__ = ["CoopBlocks", "arrive_and_wait", "chunk_width", "coop_config", "gather", "knobs",
           "launch_options", "load_raw_chunk", "publish", "row_chunk", "row_slots", "sm_count", "workspace"]
