"""The pytest plugin (entry point ``pytest11: fuseaudit``).

Options (one prefix, ``--fuseaudit-``):

``--fuseaudit-profile {ci,dev,gpu}``  Hypothesis profile and size bounds
                                      (default: ``$FUSEAUDIT_PROFILE``, else
                                      the user's own Hypothesis settings)
``--fuseaudit-device {auto,cpu,cuda}`` where kernels run; ``cpu`` turns on
                                      Triton's interpreter
``--fuseaudit-shard K/N``             run only tests ``K, K+N, K+2N, ...`` of
                                      the collected order (0-based): one pytest
                                      process per GPU where xdist cannot go

Fixtures: ``fuseaudit_device`` (session scope, so it works under ``@given``)
and ``fuseaudit_launches``, which counts the kernels launched inside a
``with`` block.  The marker ``@pytest.mark.fused(launches=1)`` makes the test
fail, listing the kernels, when any block it counted launched another number::

    @pytest.mark.fused(launches=1)
    def test_my_kernel(fuseaudit_launches):
        x = torch.randn(8, 4096, device="cuda")
        my_fused_op(x)                 # warm-up: compilation is not counted
        with fuseaudit_launches:
            my_fused_op(x)

Under pytest-xdist (``-n N``) worker ``gwK`` is pinned to GPU ``K % device_count``
(``torch.cuda.set_device``) and ``fuseaudit_device`` is that GPU, ``"cuda:<index>"``; on the CPU
there is nothing to pin.  Every test's report carries the device in its
``user_properties`` (``("fuseaudit_device", device)``, in junit XML too).

pytest-benchmark turns itself off under xdist, so the benchmarks spread over
GPUs by shards instead, one process per GPU, and ``fuseaudit merge`` joins
their JSON files (each benchmark keeps the device it ran on)::

    for k in 0 1; do CUDA_VISIBLE_DEVICES=$k pytest benchmarks --fuseaudit-shard $k/2 \
        --benchmark-json part-$k.json & done; wait
    fuseaudit merge part-0.json part-1.json --out bench.json
"""

from __future__ import annotations

import argparse
import os

import pytest

from . import profiles
from .launches import LaunchCount, recording


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuseaudit", "fused-kernel audits")
    group.addoption("--fuseaudit-profile", choices=profiles.PROFILES, default=None,
                    help="Hypothesis profile and size bounds for fuseaudit strategies")
    group.addoption("--fuseaudit-device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="device for kernels; cpu runs Triton's interpreter (default: cuda if available)")
    group.addoption("--fuseaudit-shard", default=None, metavar="K/N", type=_shard,
                    help="run only every N-th collected test from the K-th (0-based), e.g. one process per GPU")


def _shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``; otherwise a usage error naming the expected form."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return int(k), int(n)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = config.getoption("--fuseaudit-shard")
    if shard is None:
        return
    k, n = shard
    kept = [item for i, item in enumerate(items) if i % n == k]
    dropped = [item for i, item in enumerate(items) if i % n != k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuseaudit_gpu: needs a CUDA device; skipped with a reason otherwise")
    config.addinivalue_line(
        "markers", "fused(launches=1): every block counted by the fuseaudit_launches fixture must launch exactly "
        "this many kernels")
    profiles.register()
    profile = config.getoption("--fuseaudit-profile") or os.environ.get("FUSEAUDIT_PROFILE")
    if profile:
        profiles.activate(profile)
    else:
        profiles.activate_default()
    device = profiles.resolve_device(config.getoption("--fuseaudit-device"))
    worker = xdist_worker_index()
    if device == "cuda" and worker is not None:  # one GPU per xdist worker, round-robin
        import torch

        index = worker % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    config._fuseaudit_device = device  # type: ignore[attr-defined]


def xdist_worker_index() -> int | None:
    """``K`` of pytest-xdist's worker ``gwK`` (``$PYTEST_XDIST_WORKER``); None outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


def pytest_report_header(config: pytest.Config) -> str:
    import torch
    import triton

    device = getattr(config, "_fuseaudit_device", "?")
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU, Triton interpreter"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    on = f"worker {worker} -> " if worker else ""
    return (f"fuseaudit: {on}device={device} ({where}), profile={os.environ.get('FUSEAUDIT_PROFILE', 'user')}, "
            f"torch {torch.__version__}, triton {triton.__version__}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    device = getattr(item.config, "_fuseaudit_device", "cpu")
    if ("fuseaudit_device", device) not in item.user_properties:  # every phase's report carries it
        item.user_properties.append(("fuseaudit_device", device))
    if item.get_closest_marker("fuseaudit_gpu") and not device.startswith("cuda"):
        pytest.skip("needs a CUDA device (timing, profiler and NVML figures are only real on a GPU)")


@pytest.fixture(scope="session")
def fuseaudit_device(pytestconfig: pytest.Config) -> str:
    """``"cuda"``, ``"cuda:K"`` (xdist worker ``gwK``'s GPU) or ``"cpu"`` (with Triton's interpreter on)."""
    return pytestconfig._fuseaudit_device  # type: ignore[attr-defined]


class LaunchRecorder:
    """Counts kernels launched inside ``with recorder:`` blocks (warm up first)."""

    def __init__(self, device: str):
        self.device = device
        self.counts: list[LaunchCount] = []
        self._active: list = []

    def __enter__(self) -> LaunchCount:
        cm = recording(self.device)
        count = cm.__enter__()
        self._active.append((cm, count))
        return count

    def __exit__(self, *exc: object) -> None:
        cm, count = self._active.pop()
        cm.__exit__(*exc)
        self.counts.append(count)


@pytest.fixture
def fuseaudit_launches(fuseaudit_device: str) -> LaunchRecorder:
    """A :class:`LaunchRecorder` on the session's device."""
    return LaunchRecorder(fuseaudit_device)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    marker = item.get_closest_marker("fused")
    if marker is None:
        return result
    expected = marker.kwargs.get("launches", marker.args[0] if marker.args else 1)
    recorder = getattr(item, "funcargs", {}).get("fuseaudit_launches")
    if recorder is None or not recorder.counts:
        pytest.fail("marked @pytest.mark.fused but no launches were counted: "
                    "use the fuseaudit_launches fixture as `with fuseaudit_launches: ...`", pytrace=False)
    for i, count in enumerate(recorder.counts):
        if count.count != expected:
            pytest.fail(f"expected {expected} launch(es) per fused call, block {i + 1} launched {count.describe()}",
                        pytrace=False)
    return result
