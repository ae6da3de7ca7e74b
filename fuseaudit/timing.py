"""GPU-correct timing of one op call.

A host clock around an asynchronous launch measures the launch, not the
kernel, and a kernel timed back to back with the same inputs reads them from
a warm L2 cache (50-60 MB on Hopper holds a whole decode-sized problem).  So:

* :func:`time_events` -- the device time of one call: CUDA events around the
  call only; warm-up calls (compilation, autotuning) excluded; a buffer twice
  the size of L2 (at least 256 MB) is written before every timed repeat so
  each repeat reads its inputs from HBM; inputs optionally rotated; the
  median, the IQR, min/max and the number of repeats.
* :func:`time_graph` -- for small shapes, where a kernel finishes before the
  host can launch the next one: ``N`` calls captured in one CUDA graph, the
  replays timed, divided by ``N``.  Host overhead is gone; what is left is the
  device time of back-to-back calls.
* :func:`time_host` -- the other half of the decode story: the wall clock of
  the Python call itself, without a synchronisation, i.e. the launch overhead
  a framework pays per call.
* :func:`measure_copy_bandwidth` -- device-to-device copy bandwidth (bytes
  read + written per second), measured once per process and device: the
  roofline every memory-bound op is judged against.
* :class:`CudaEventClock` -- a pytest-benchmark ``timer`` that reads CUDA
  events, so ``benchmark.pedantic`` records device time.

There is nothing to time on a CPU (the Triton interpreter times Python), so
every function here raises :class:`TimingUnavailable` with one clear line
there; benchmarks turn that into a skip with the same reason.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "CudaEventClock",
    "Timing",
    "TimingUnavailable",
    "flush_l2",
    "gbps",
    "l2_flush_bytes",
    "measure_copy_bandwidth",
    "require_cuda",
    "summarize",
    "time_events",
    "time_events_rounds",
    "time_graph",
    "time_host",
]

# The flush buffer: at least this many bytes, and at least twice the L2.
MIN_FLUSH_BYTES = 256 * 2**20


class TimingUnavailable(RuntimeError):
    """Timing was asked for where it means nothing (no CUDA device)."""


@dataclass(frozen=True)
class Timing:
    """Summary of repeated measurements of one call, in microseconds.

    ``mode`` is ``"events"`` (device time, L2 flushed between repeats),
    ``"graph"`` (device time of back-to-back calls replayed from a CUDA graph,
    per call) or ``"host"`` (wall clock of the Python call, no sync).
    ``samples_us`` holds one value per repeat, already divided by
    ``calls_per_sample``.
    """

    mode: str
    median_us: float
    q1_us: float
    q3_us: float
    min_us: float
    max_us: float
    repeats: int
    calls_per_sample: int = 1
    samples_us: tuple[float, ...] = field(default=(), repr=False)

    @property
    def iqr_us(self) -> float:
        return self.q3_us - self.q1_us

    @property
    def spread(self) -> float:
        """IQR relative to the median (0.02 = 2 %)."""
        return self.iqr_us / self.median_us if self.median_us > 0 else 0.0

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["iqr_us"] = self.iqr_us
        d["spread"] = self.spread
        if samples:
            d["samples_us"] = list(self.samples_us)
        else:
            d.pop("samples_us")
        return d


def summarize(samples_us: Sequence[float], *, mode: str, calls_per_sample: int = 1) -> Timing:
    """Median, quartiles and extremes of ``samples_us`` (at least one sample)."""
    if not samples_us:
        raise ValueError("summarize needs at least one sample")
    data = sorted(float(s) for s in samples_us)
    if len(data) >= 2:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
    else:
        q1 = q3 = data[0]
    return Timing(mode=mode, median_us=statistics.median(data), q1_us=q1, q3_us=q3, min_us=data[0],
                  max_us=data[-1], repeats=len(data), calls_per_sample=calls_per_sample,
                  samples_us=tuple(float(s) for s in samples_us))


# ---------------------------------------------------------------------------
# Device checks and the L2 flush
# ---------------------------------------------------------------------------

def require_cuda(device: torch.device | str | int | None = None) -> torch.device:
    """The CUDA device to time on; :class:`TimingUnavailable` with the reason otherwise."""
    if not torch.cuda.is_available():
        raise TimingUnavailable(
            "timing needs a CUDA device and none is available (on the CPU the Triton interpreter would time "
            "Python, not a kernel)")
    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        dev = torch.device("cuda", device)
    else:
        dev = torch.device(device)
    if dev.type != "cuda":
        raise TimingUnavailable(f"timing needs a CUDA device, got {dev} (the interpreter times Python, not a kernel)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def l2_flush_bytes(device: torch.device | str | int | None = None) -> int:
    """Bytes written before each timed repeat: ``max(2 * L2, 256 MB)``."""
    dev = require_cuda(device)
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 0)
    return max(2 * l2, MIN_FLUSH_BYTES)


_FLUSH_BUFFERS: dict[int, torch.Tensor] = {}


# GPU cycles per microsecond assumed by the hold after a flush (about 2 GHz; only a lower bound matters)
_CYCLES_PER_US = 2000


# GPU held busy after each L2 flush while the host enqueues start event, call and end event.  50 µs
# was too short on the H200 (2026-11-29): a wrapper's host time (our attention's autotuner
# dispatch and split-K buffers, pytest-benchmark's round) let the GPU idle inside the events
# (attention decode Sk=4096 timed 302 µs against 55 µs with this hold; rms_norm 16384 x 8192
# 184 µs against 136), so hold a millisecond, far above any call's host time.
HOLD_US = 1000.0


def flush_l2(device: torch.device | str | int | None = None, *, hold_us: float = 0.0) -> None:
    """Evict L2 by writing a buffer larger than it, then keep the GPU busy about ``hold_us`` more.

    Both are enqueued on the current stream.  While they run, the host
    enqueues the start event, the call and the end event, so the events
    bracket the call's device time even when launching it takes longer than
    running it (a compiled call's guards, an eager composition's launches).
    """
    dev = require_cuda(device)
    buf = _FLUSH_BUFFERS.get(dev.index)  # type: ignore[arg-type]
    if buf is None:
        buf = torch.empty(l2_flush_bytes(dev) // 4, dtype=torch.int32, device=dev)
        _FLUSH_BUFFERS[dev.index] = buf  # type: ignore[index]
    buf.zero_()
    if hold_us > 0:
        torch.cuda._sleep(int(hold_us * _CYCLES_PER_US))


def _check_counts(**counts: int | None) -> None:
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _args_at(rotate: Sequence[Sequence[Any]], i: int) -> Sequence[Any]:
    return rotate[i % len(rotate)]


def _estimate_us(fn: Callable[..., Any], rotate: Sequence[Sequence[Any]], *, flush: bool, hold_us: float,
                 dev: torch.device, calls: int = 3) -> float:
    """Rough device time of one repeat (flush included when asked), from a few event-timed calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        if flush:
            flush_l2(dev, hold_us=hold_us)
        fn(*_args_at(rotate, i))
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def _repeat_count(repeats: int | None, per_repeat_us: float, *, target_seconds: float, min_repeats: int,
                  max_repeats: int) -> int:
    if repeats is not None:
        return max(1, repeats)
    fit = int(target_seconds * 1e6 / max(per_repeat_us, 1e-3))
    return max(min_repeats, min(max_repeats, fit))


# ---------------------------------------------------------------------------
# Device time
# ---------------------------------------------------------------------------

def time_events(fn: Callable[..., Any], *, rotate: Sequence[Sequence[Any]] = ((),), warmup: int = 3,
                repeats: int | None = None, target_seconds: float = 0.05, min_repeats: int = 10,
                max_repeats: int = 200, flush: bool = True, hold_us: float = HOLD_US,
                around: AbstractContextManager[Any] | None = None,
                device: torch.device | str | int | None = None) -> Timing:
    """Device time of ``fn(*rotate[i % len(rotate)])``, one CUDA-event pair per repeat.

    ``warmup`` calls run first and are not timed (compilation, autotuning,
    lazy initialisation).  Before each timed repeat the L2 is flushed (unless
    ``flush=False``) and the GPU held busy ``hold_us`` more, so the host has
    enqueued the whole call before the start event runs; only the call
    itself sits between the events.  Without a flush, a call shorter than its
    launch is timed as its launch: use :func:`time_graph` for those.  With
    ``repeats=None`` the count fills about ``target_seconds`` of device time,
    clamped to ``[min_repeats, max_repeats]``.  ``rotate`` gives argument sets
    used in turn, so consecutive repeats may read different buffers.
    ``around`` (e.g. :func:`fuseaudit.nvml.sample`) is entered around the
    timed repeats only, the final synchronisation included.
    """
    _check_counts(warmup=warmup, repeats=repeats, min_repeats=min_repeats, max_repeats=max_repeats)
    if not rotate:
        raise ValueError("rotate must hold at least one argument set")
    if target_seconds <= 0:
        raise ValueError(f"target_seconds must be positive, got {target_seconds!r}")
    if not hold_us >= 0:
        raise ValueError(f"hold_us must be non-negative, got {hold_us!r}")
    dev = require_cuda(device)
    with torch.cuda.device(dev):
        for i in range(warmup):
            fn(*_args_at(rotate, i))
        torch.cuda.synchronize(dev)
        per_repeat = _estimate_us(fn, rotate, flush=flush, hold_us=hold_us, dev=dev)
        n = _repeat_count(repeats, per_repeat, target_seconds=target_seconds, min_repeats=min_repeats,
                          max_repeats=max_repeats)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        with around if around is not None else nullcontext():
            for i in range(n):
                args = _args_at(rotate, i)
                if flush:
                    flush_l2(dev, hold_us=hold_us)  # the GPU is busy while the host enqueues the call
                starts[i].record()
                fn(*args)
                ends[i].record()
            torch.cuda.synchronize(dev)
    return summarize([1e3 * s.elapsed_time(e) for s, e in zip(starts, ends)], mode="events")


def time_events_rounds(fns: Sequence[Callable[[], Any]], *, rounds: int = 3, warmup: int = 3,
                       target_seconds: float = 0.05, min_repeats: int = 10, max_repeats: int = 200,
                       arounds: Sequence[AbstractContextManager[Any] | None] | None = None,
                       device: torch.device | str | int | None = None) -> list[Timing | Exception]:
    """:func:`time_events` of several contenders at one point, interleaved: per contender, a Timing or its error.

    ``rounds`` rounds, each timing every contender in turn for
    ``target_seconds / rounds``, the order rotated by one each round; a
    contender's samples from all rounds are pooled.  Why: on the H200, at
    ~10 µs points the first contenders timed at a new point read 10-15%
    slower than in later rounds, whichever kernels they are, so timing one
    contender after the other leans against whoever goes first.  ``warmup`` applies to each
    contender's first round (one call before each later one); ``arounds[i]``
    (e.g. an NVML sample) is entered around contender ``i``'s first round
    only.  A contender that raises is dropped from the later rounds and its
    exception returned in its place.
    """
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    if arounds is not None and len(arounds) != len(fns):
        raise ValueError("arounds must give one context manager (or None) per contender")
    samples: list[list[float]] = [[] for _ in fns]
    errors: dict[int, Exception] = {}
    for r in range(rounds):
        order = [(r + k) % len(fns) for k in range(len(fns))]
        for i in order:
            if i in errors:
                continue
            try:
                t = time_events(fns[i], warmup=warmup if r == 0 else 1, target_seconds=target_seconds / rounds,
                                min_repeats=max(1, math.ceil(min_repeats / rounds)),
                                max_repeats=max(1, max_repeats // rounds),
                                around=arounds[i] if arounds is not None and r == 0 else None, device=device)
            except Exception as exc:  # one contender failing never ends the others' timing
                errors[i] = exc
                continue
            samples[i].extend(t.samples_us)
    return [errors[i] if i in errors else summarize(samples[i], mode="events") for i in range(len(fns))]


def time_graph(fn: Callable[..., Any], *, args: Sequence[Any] = (), calls_per_graph: int = 20, warmup: int = 3,
               replays: int | None = None, target_seconds: float = 0.05, min_replays: int = 10,
               max_replays: int = 100, flush: bool = True,
               device: torch.device | str | int | None = None) -> Timing:
    """Device time per call of ``calls_per_graph`` back-to-back calls replayed from one CUDA graph.

    For shapes where host launch overhead dominates: the graph removes it, so
    the figure is what the kernel costs inside a captured decode step.  The
    calls inside a replay share inputs (a warm L2 for inputs that fit, as in
    a real step); the L2 is flushed before each replay when ``flush``.  Raises
    whatever capture raises (an op that synchronises or allocates on the host
    cannot be captured); callers record that as the reason.
    """
    _check_counts(calls_per_graph=calls_per_graph, warmup=warmup, replays=replays, min_replays=min_replays,
                  max_replays=max_replays)
    if calls_per_graph < 1:
        raise ValueError("calls_per_graph must be at least 1")
    dev = require_cuda(device)
    with torch.cuda.device(dev):
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # capture needs warm-up on a side stream
            for _ in range(max(1, warmup)):
                fn(*args)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn(*args)
        graph.replay()  # the first replay uploads the graph
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        n = _repeat_count(replays, 1e3 * start.elapsed_time(end), target_seconds=target_seconds,
                          min_repeats=min_replays, max_repeats=max_replays)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flush:
                flush_l2(dev)
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize(dev)
        del graph
    samples = [1e3 * s.elapsed_time(e) / calls_per_graph for s, e in zip(starts, ends)]
    return summarize(samples, mode="graph", calls_per_sample=calls_per_graph)


def time_host(fn: Callable[..., Any], *, args: Sequence[Any] = (), calls: int = 50, warmup: int = 3,
              device: torch.device | str | int | None = None) -> Timing:
    """Wall clock of the Python call ``fn(*args)`` without synchronising: the launch overhead.

    Each call is timed on its own with ``time.perf_counter``; the device is
    synchronised only before the first and after the last call, so a kernel
    shorter than its launch never blocks the host.  Meaningful for decode
    shapes, where this, not the kernel, bounds a step.
    """
    _check_counts(calls=calls, warmup=warmup)
    if calls < 1:
        raise ValueError("calls must be at least 1")
    dev = require_cuda(device)
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn(*args)
        torch.cuda.synchronize(dev)
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn(*args)
            samples.append(1e6 * (time.perf_counter() - t0))
        torch.cuda.synchronize(dev)
    return summarize(samples, mode="host")


# ---------------------------------------------------------------------------
# The copy roofline
# ---------------------------------------------------------------------------

_COPY_BANDWIDTH: dict[int, float] = {}


def measure_copy_bandwidth(device: torch.device | str | int | None = None, *, nbytes: int = 2**30,
                           repeats: int = 20, refresh: bool = False) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s), read + write bytes over time.

    Measured once per process and device (cached; ``refresh=True`` measures
    again) with a ``nbytes`` copy, far larger than L2, timed with CUDA events;
    the median of ``repeats``.  The yardstick for "% of copy" figures.
    """
    _check_counts(nbytes=nbytes, repeats=repeats)
    if nbytes < 2**20 or repeats < 1:
        raise ValueError("nbytes must be at least 1 MiB and repeats at least 1")
    dev = require_cuda(device)
    if not refresh and dev.index in _COPY_BANDWIDTH:
        return _COPY_BANDWIDTH[dev.index]  # type: ignore[index]
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=dev).fill_(1)
    dst = torch.empty_like(src)
    timing = time_events(torch.Tensor.copy_, rotate=((dst, src),), warmup=3, repeats=repeats, flush=False, device=dev)
    del src, dst
    torch.cuda.empty_cache()
    gbps = 2 * (nbytes // 4) * 4 / (timing.median_us * 1e-6) / 1e9
    _COPY_BANDWIDTH[dev.index] = gbps  # type: ignore[index]
    return gbps


# ---------------------------------------------------------------------------
# pytest-benchmark timer
# ---------------------------------------------------------------------------

class CudaEventClock:
    """A pytest-benchmark ``timer`` that reports CUDA-event (device) time.

    ``benchmark.pedantic`` calls its timer exactly twice per round, before
    and after the target.  The first call records a start event and returns
    ``0.0``; the second records an end event, waits for it and returns the
    elapsed seconds, so ``end - start`` is the device time of the call.  A
    ``setup`` that flushes L2 keeps the GPU busy while the call is enqueued,
    as in :func:`time_events`: the host enqueues start event, call and end
    event while the flush runs, so the events bracket the call's device time
    and not its launch.  Only for ``pedantic`` (calibration in plain
    ``benchmark(...)`` mode calls the timer in other patterns).
    """

    __name__ = "cuda_event_clock"

    def __init__(self) -> None:
        self._start: Any = None

    def reset(self) -> None:
        self._start = None

    def __call__(self) -> float:
        if self._start is None:
            require_cuda()
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return 0.0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        start, self._start = self._start, None
        return start.elapsed_time(end) / 1e3

    def __repr__(self) -> str:
        return "CudaEventClock()"


def gbps(nbytes: float, median_us: float) -> float:
    """Bytes per microsecond as GB/s (1e9 bytes/s); NaN for a non-positive time."""
    return nbytes / (median_us * 1e3) if median_us > 0 else math.nan
