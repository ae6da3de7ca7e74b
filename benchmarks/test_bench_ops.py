"""Every op, a small sweep, our reference kernel against eager and torch.compile, through pytest-benchmark.

Each benchmark times one call with CUDA events (``CudaEventClock``) in
``benchmark.pedantic``, the L2 flushed before every round (``setup``), so the
statistics pytest-benchmark stores and compares are device time.  Our own
figures go into ``extra_info``: GB/s and % of the measured copy bandwidth,
TFLOP/s, launches, the allocator peak, the eager temporaries fusion avoids,
NVML energy per call over a 1 s back-to-back loop.  Compare runs with ``pytest-benchmark compare``
or ``fuseaudit compare``.  Without a GPU every benchmark skips with a reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fuseaudit import nvml
from fuseaudit.benchjson import clean
from fuseaudit.catalog import OPS
from fuseaudit.contenders import Contender, ContenderUnavailable, build
from fuseaudit.launches import count_launches
from fuseaudit.measure import energy_loop, figures, peak_memory
from fuseaudit.sweep import bench_inputs
from fuseaudit.timing import HOLD_US, CudaEventClock, flush_l2

ROUNDS = 50
WARMUP_ROUNDS = 5
ENERGY_SECONDS = 1.0  # back-to-back loop for energy per call (the counter is coarse over shorter windows)
CLOCK = CudaEventClock()

CONTENDERS = {"reference": Contender("reference", "fused"), "eager": Contender("eager", "eager"),
              "compile": Contender("compile", "compile")}

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, min_rounds=ROUNDS)


# every op at a decode-sized and a large point (its shape's suite points: fuseaudit/shapes.py), keyed by a
# plain string, so pytest-benchmark's params stay readable JSON
POINTS = {f"{p.op}-{p.dtype}-{p.label.replace(' ', '_')}": p
          for spec in OPS.values() for p in spec.shape.suite_points(spec)}


@pytest.mark.parametrize("impl", list(CONTENDERS))
@pytest.mark.parametrize("point_id", list(POINTS))
def test_op(bench_device: torch.device, copy_gbps: float, benchmark: Any, point_id: str, impl: str) -> None:
    point = POINTS[point_id]
    spec = OPS[point.op]
    inputs = bench_inputs(point.case, bench_device)
    try:
        built = build(CONTENDERS[impl], spec, point, inputs)
    except ContenderUnavailable as exc:
        pytest.skip(f"{impl} cannot run {point.op} at {point.label}: {exc}")
    benchmark.group = f"{spec.name} {point.label} {point.dtype}"
    memory = peak_memory(built.call, device=bench_device)
    try:  # a count the profiler cannot vouch for is recorded, not a failed benchmark
        launches: dict[str, Any] = count_launches(built.call, device="cuda", warmup=1).to_dict()
    except Exception as exc:
        launches = {"error": f"{type(exc).__name__}: {exc}"}

    CLOCK.reset()
    with nvml.sample(nvml.nvml_index(bench_device.index)) as energy:
        benchmark.pedantic(built.call, setup=lambda: flush_l2(bench_device, hold_us=HOLD_US), rounds=ROUNDS,
                           warmup_rounds=WARMUP_ROUNDS, iterations=1)
        torch.cuda.synchronize(bench_device)
    if benchmark.stats is None:  # --benchmark-disable: one plain call, nothing timed
        return
    median_us = benchmark.stats.stats.median * 1e6
    benchmark.extra_info.update(clean({
        "op": spec.name, "impl": impl, "point": point.label, "dtype": point.dtype, "params": point.params,
        "timer": "cuda_event", "l2_flush": True, "hold_us": HOLD_US, "first_call_s": built.first_call_s,
        "device": str(bench_device),
        **figures(spec, point, median_us=median_us, copy_gbps=copy_gbps, role=CONTENDERS[impl].role),
        "launches": launches, "memory": memory,
        "input_bytes": sum(t.untyped_storage().nbytes() for t in inputs.values()),
        "nvml": energy,
        "energy_loop": energy_loop(built.call, median_us=median_us, seconds=ENERGY_SECONDS, device=bench_device),
    }))
