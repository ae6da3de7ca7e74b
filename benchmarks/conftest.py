"""The pytest-benchmark suite's fixtures and hooks (GPU only; every benchmark skips with a reason elsewhere).

Run it explicitly (it is outside the default ``testpaths``)::

    pytest benchmarks/ --benchmark-json reports/pytest-bench.json

Timing goes through :class:`fuseaudit.timing.CudaEventClock` in
``benchmark.pedantic`` with an L2 flush as ``setup``, so pytest-benchmark's
statistics are device time; our other figures land in ``extra_info`` and the
GPU, driver and versions in ``machine_info["gpu"]``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fuseaudit import benchjson
from fuseaudit.timing import TimingUnavailable, measure_copy_bandwidth, require_cuda


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add the GPU, driver, CUDA, torch and Triton versions to pytest-benchmark's machine info."""
    machine_info["gpu"] = benchjson.clean(benchjson.gpu_info())


@pytest.fixture(scope="session")
def bench_device(fuseaudit_device: str) -> torch.device:
    """The CUDA device benchmarks time on; a skip with the reason where there is none."""
    if fuseaudit_device != "cuda":
        pytest.skip("benchmarks need a CUDA device (fuseaudit device is "
                    f"{fuseaudit_device}: the Triton interpreter times Python, not a kernel)")
    try:
        return require_cuda()
    except TimingUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def copy_gbps(bench_device: torch.device) -> float:
    """Device-to-device copy bandwidth (GB/s), measured once per session."""
    return measure_copy_bandwidth(bench_device)
