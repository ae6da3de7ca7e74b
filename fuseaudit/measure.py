"""Every figure of one contender at one point: time, bandwidth, FLOP/s, launches, memory, energy.

The figures answer "is the fused kernel worth it" from several sides:

* device time (CUDA events, L2 flushed; :mod:`.timing`) and what it means
  against the hardware: GB/s from the op's minimum-bytes model and that as a
  percentage of the measured copy bandwidth; TFLOP/s for attention;
* for small points (device time under ``graph_below_us``), the per-call time
  replayed from a CUDA graph and the host time of the Python call, because
  there launch overhead, not the kernel, bounds a decode step;
* launches per call (:func:`~fuseaudit.launches.count_launches`);
* the allocator's peak over one call, above everything already allocated
  (outputs plus temporaries), and the temporaries the eager composition
  writes by the catalog's model (what fusion avoids);
* NVML energy, power, clocks and throttling over the timed loop, and, when
  asked, energy per call from a loop of back-to-back calls.

One failing figure (a profiler that lost events, a graph that cannot be
captured) is recorded with its reason; the others stand.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import nvml
from .catalog import OpSpec, as_tuple
from .contenders import Built
from .launches import count_launches
from .sweep import Point
from .timing import Timing, gbps, require_cuda, time_events_rounds, time_graph, time_host

__all__ = ["MeasureOptions", "Measurement", "Timed", "energy_loop", "figures", "measure", "peak_memory",
           "time_contenders"]


@dataclass(frozen=True)
class MeasureOptions:
    """How hard to measure.  Times in seconds unless named ``_us``."""

    target_seconds: float = 0.05  # device time the timed repeats fill
    warmup: int = 3
    min_repeats: int = 10
    max_repeats: int = 200
    graph_below_us: float = 50.0  # CUDA-graph and host timing below this device time
    calls_per_graph: int = 20
    host_calls: int = 50
    launches: bool = True
    memory: bool = True
    energy_seconds: float = 0.0  # > 0: an extra back-to-back loop this long for energy per call
    rounds: int = 3  # time_contenders: interleaved rounds (see timing.time_events_rounds)

    def __post_init__(self) -> None:
        for name in ("target_seconds", "graph_below_us", "energy_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if self.target_seconds <= 0:
            raise ValueError("target_seconds must be positive")
        for name in ("warmup", "min_repeats", "max_repeats", "calls_per_graph", "host_calls", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_repeats > self.max_repeats:
            raise ValueError("min_repeats must not exceed max_repeats")


@dataclass
class Measurement:
    """One contender at one point: the device timing and every other figure (``extra``)."""

    contender: str
    role: str
    timing: Timing
    extra: dict[str, Any]


def figures(spec: OpSpec, point: Point, *, median_us: float, copy_gbps: float | None, role: str) -> dict[str, Any]:
    """What a median time means against the op's models: bytes moved, GB/s, % of copy, FLOPs, TFLOP/s,
    and the temporaries of the eager composition (``intermediate_bytes_avoided`` for a fused role)."""
    shapes = point.shapes()
    dtype = point.case.torch_dtype
    moved = spec.bytes_moved(shapes, dtype)
    rate = gbps(moved, median_us)
    flops = spec.flops(shapes, point.params)
    key = "intermediate_bytes_avoided" if role in ("fused", "backend", "target") else "intermediate_bytes"
    return {
        "bytes_moved": moved,
        "gbps": rate,
        "copy_gbps": copy_gbps,
        "pct_copy": 100.0 * rate / copy_gbps if copy_gbps and math.isfinite(rate) else None,
        "flops": flops,
        "tflops": flops / (median_us * 1e-6) / 1e12 if median_us > 0 else None,
        key: spec.intermediate_bytes(shapes, dtype),
    }


def _nbytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in as_tuple(tensors) if isinstance(t, torch.Tensor))


def peak_memory(call: Any, *, device: torch.device) -> dict[str, int]:
    """Allocator peak of one ``call()`` above what was allocated before it, and its outputs' bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    outputs = _nbytes(out)
    del out
    return {"peak_extra_bytes": int(peak), "output_bytes": int(outputs),
            "temporaries_bytes": int(max(0, peak - outputs))}


def energy_loop(call: Any, *, median_us: float, seconds: float, device: torch.device) -> dict[str, Any]:
    """NVML energy over back-to-back calls for about ``seconds`` of wall clock, per call.

    The loop is bounded by the wall clock, not by ``seconds / median_us``
    calls: at decode shapes the host, not the kernel, paces the loop.  The
    device is synchronised every chunk so the queue never runs far ahead of
    the clock; the energy includes whatever the GPU draws while it waits.
    """
    chunk = max(1, min(10_000, int(0.05e6 / max(median_us, 1e-3))))  # about 50 ms of device time
    calls = 0
    torch.cuda.synchronize(device)
    with nvml.sample(nvml.nvml_index(device.index)) as probe:
        t0 = time.perf_counter()
        while True:
            for _ in range(chunk):
                call()
            calls += chunk
            torch.cuda.synchronize(device)
            if time.perf_counter() - t0 >= seconds:
                break
    out = dict(probe)
    out["calls"] = calls
    if out.get("energy_j") is not None:
        out["energy_per_call_uj"] = out["energy_j"] * 1e6 / calls
    return out


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}


@dataclass(frozen=True)
class Timed:
    """A contender's event timing taken beside others (:func:`time_contenders`), with its NVML sample."""

    timing: Timing
    nvml: dict[str, Any]


def time_contenders(calls: list[Any], *, device: torch.device | str,
                    options: MeasureOptions | None = None) -> list[Timed | Exception]:
    """Event timing of every contender at one point in interleaved rounds (``options.rounds``).

    Per contender a :class:`Timed` (NVML conditions over its first round) or
    the exception its call raised; :func:`measure` takes the former as
    ``timed`` and gathers the other figures.
    """
    opts = options or MeasureOptions()
    dev = require_cuda(device)
    probes = [nvml.sample(nvml.nvml_index(dev.index)) for _ in calls]
    timings = time_events_rounds(calls, rounds=opts.rounds, warmup=opts.warmup, target_seconds=opts.target_seconds,
                                 min_repeats=opts.min_repeats, max_repeats=opts.max_repeats, arounds=probes,
                                 device=dev)
    out: list[Timed | Exception] = []
    for timing, probe in zip(timings, probes):
        if isinstance(timing, Exception):
            out.append(timing)
            continue
        loop = dict(probe.result)
        if loop.get("energy_j") is not None:
            loop["note"] = "over the first round of timed repeats, each preceded by an L2 flush"
        out.append(Timed(timing, loop))
    return out


def measure(built: Built, spec: OpSpec, point: Point, inputs: dict[str, torch.Tensor], *, timed: Timed,
            device: torch.device | str, copy_gbps: float | None, options: MeasureOptions | None = None
            ) -> Measurement:
    """Every figure of ``built`` at ``point`` (module docstring), its device time from :func:`time_contenders`."""
    opts = options or MeasureOptions()
    dev = require_cuda(device)
    shapes = point.shapes()
    extra: dict[str, Any] = {"op": spec.name, "impl": built.contender.name, "role": built.contender.role,
                             "point": point.label, "kind": point.kind, "dtype": point.dtype,
                             "shapes": {k: list(v) for k, v in shapes.items()}, "params": point.params,
                             "first_call_s": round(built.first_call_s, 4)}
    if built.note:
        extra["note"] = built.note
    if opts.memory:
        extra["memory"] = _safe(lambda: peak_memory(built.call, device=dev))
        extra["input_bytes"] = _nbytes(tuple(inputs.values()))
    if opts.launches:
        extra["launches"] = _safe(lambda: count_launches(built.call, device="cuda", warmup=1).to_dict())

    timing = timed.timing
    extra["timing"] = timing.to_dict()
    extra["nvml"] = timed.nvml

    extra.update(figures(spec, point, median_us=timing.median_us, copy_gbps=copy_gbps, role=built.contender.role))

    if timing.median_us < opts.graph_below_us:
        extra["graph"] = _safe(lambda: time_graph(built.call, calls_per_graph=opts.calls_per_graph,
                                                  target_seconds=opts.target_seconds, device=dev).to_dict())
        extra["host"] = _safe(lambda: time_host(built.call, calls=opts.host_calls, device=dev).to_dict())
    if opts.energy_seconds > 0:
        extra["energy_loop"] = _safe(lambda: energy_loop(built.call, median_us=timing.median_us,
                                                          seconds=opts.energy_seconds, device=dev))
    return Measurement(contender=built.contender.name, role=built.contender.role, timing=timing, extra=extra)
