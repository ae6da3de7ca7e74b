"""Benchmark results as pytest-benchmark JSON, so its tools read ours.

``fuseaudit bench`` and ``pytest benchmarks/ --benchmark-json`` write the
same format, which ``pytest-benchmark compare`` and ``fuseaudit compare``
both load::

    {
      "machine_info": {...pytest-benchmark's..., "gpu": {name, capability, L2, driver, cuda, torch, triton, nvml}},
      "commit_info": {...},
      "benchmarks": [
        {"group": "rms_norm rows=1024 N=4096 bfloat16",
         "name": "rms_norm[reference-bfloat16-rows=1024 N=4096]",
         "fullname": "fuseaudit.bench::rms_norm[reference-bfloat16-rows=1024 N=4096]",
         "params": {"impl": "reference", "op": ..., "dtype": ..., dims..., op params...},
         "param": "reference-bfloat16-rows=1024 N=4096",
         "extra_info": {gbps, pct_copy, tflops, launches, memory, nvml, timing, ...},
         "options": {"timer": "cuda_event", "mode": "events", ...},
         "stats": {min, max, mean, stddev, rounds, median, iqr, q1, q3, iqr_outliers, stddev_outliers,
                   outliers, ld15iqr, hd15iqr, ops, total, data, iterations}}   # seconds
      ],
      "datetime": "...", "version": "<pytest-benchmark version>",
      "fuseaudit": {"copy_gbps": ..., "skipped": [...], "argv": [...], ...}
    }

``stats`` are computed by pytest-benchmark's own :class:`~pytest_benchmark.stats.Stats`
from the per-repeat samples, in seconds per call.
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from .jsonio import read_json, write_json

__all__ = ["BenchJsonError", "benchmark_entry", "clean", "document", "gpu_info", "load", "machine_info", "write"]


class BenchJsonError(ValueError):
    """A file that is not readable pytest-benchmark JSON; the message is one line."""


def clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, tuples lists, other objects strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def gpu_info(device_index: int | None = None) -> dict[str, Any]:
    """GPU, driver and software versions: what makes two runs comparable."""
    import torch
    import triton

    from . import nvml

    info: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                            "cuda": torch.version.cuda, "cudnn": None,
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    if not torch.cuda.is_available():
        info["name"] = None
        info["reason"] = "no CUDA device"
        info["nvml"] = nvml.status()
        return info
    idx = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(idx)
    info.update(name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                memory_bytes=int(props.total_memory), l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0))
    dev = nvml.device_info(nvml.nvml_index(idx))
    info["driver"] = dev.get("driver")
    info["cuda_driver"] = dev.get("cuda_driver")
    info["nvml"] = dev
    return info


def machine_info(*, gpu: bool = True) -> dict[str, Any]:
    """pytest-benchmark's machine info plus a ``gpu`` section."""
    from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info

    info = pytest_benchmark_generate_machine_info()
    if gpu:
        info["gpu"] = gpu_info()
    return info


def _commit_info() -> dict[str, Any]:
    try:
        from pytest_benchmark.utils import get_commit_info

        return get_commit_info()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _stats(samples_s: Sequence[float], iterations: int) -> dict[str, Any]:
    from pytest_benchmark.stats import Stats

    stats = Stats()
    for s in samples_s:
        stats.update(float(s))
    out = {field: getattr(stats, field) for field in Stats.fields}
    out["data"] = [float(s) for s in samples_s]
    out["iterations"] = iterations
    return out


def benchmark_entry(*, op: str, impl: str, point_label: str, dtype: str, params: dict[str, Any],
                    samples_s: Sequence[float], iterations: int = 1, extra_info: dict[str, Any] | None = None,
                    options: dict[str, Any] | None = None, source: str = "fuseaudit.bench") -> dict[str, Any]:
    """One benchmark in pytest-benchmark's layout (``samples_s``: seconds per call, one per round)."""
    if not samples_s:
        raise ValueError("a benchmark needs at least one sample")
    if any(not isinstance(s, (int, float)) or s < 0 or not math.isfinite(s) for s in samples_s):
        raise ValueError("samples must be finite non-negative seconds")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    param = f"{impl}-{dtype}-{point_label}"
    name = f"{op}[{param}]"
    return clean({
        "group": f"{op} {point_label} {dtype}",
        "name": name,
        "fullname": f"{source}::{name}",
        "params": {"impl": impl, **params},
        "param": param,
        "extra_info": extra_info or {},
        "options": options or {},
        "stats": _stats(samples_s, iterations),
    })


def document(benchmarks: list[dict[str, Any]], *, fuseaudit: dict[str, Any] | None = None,
             machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole file: machine and commit info, benchmarks, time, pytest-benchmark version."""
    from pytest_benchmark import __version__

    return clean({
        "machine_info": machine if machine is not None else machine_info(),
        "commit_info": _commit_info(),
        "benchmarks": benchmarks,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": __version__,
        "fuseaudit": fuseaudit or {},
    })


def write(path: str | os.PathLike[str], doc: dict[str, Any]) -> pathlib.Path:
    """Write ``doc`` as indented JSON (parent folders made, atomically); returns the path."""
    return write_json(path, doc, indent=2, convert=clean)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a pytest-benchmark JSON file; :class:`BenchJsonError` (one line) otherwise."""
    p = pathlib.Path(path)
    doc = read_json(p, BenchJsonError)
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise BenchJsonError(f"{p}: not pytest-benchmark JSON (no 'benchmarks' list)")
    for i, bench in enumerate(doc["benchmarks"]):
        stats = bench.get("stats") if isinstance(bench, dict) else None
        if not isinstance(stats, dict) or not isinstance(stats.get("median"), (int, float)):
            raise BenchJsonError(f"{p}: benchmark #{i} has no stats.median")
        if not isinstance(bench.get("name") or bench.get("fullname"), str):
            raise BenchJsonError(f"{p}: benchmark #{i} has no name")
    return doc
