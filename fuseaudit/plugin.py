"""The pytest plugin (entry point ``pytest11: fuseaudit``).

Options (one prefix, ``--fuseaudit-``):

``--fuseaudit-profile {ci,dev,gpu}``  Hypothesis profile and size bounds
                                      (default: ``$FUSEAUDIT_PROFILE``, else
                                      the user's own Hypothesis settings)
``--fuseaudit-device {auto,cpu,cuda}`` where kernels run; ``cpu`` turns on
                                      Triton's interpreter

Fixtures: ``fuseaudit_device`` (session scope, so it works under ``@given``).
"""

from __future__ import annotations

import os

import pytest

from . import profiles


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuseaudit", "fused-kernel audits")
    group.addoption("--fuseaudit-profile", choices=profiles.PROFILES, default=None,
                    help="Hypothesis profile and size bounds for fuseaudit strategies")
    group.addoption("--fuseaudit-device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="device for kernels; cpu runs Triton's interpreter (default: cuda if available)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuseaudit_gpu: needs a CUDA device; skipped with a reason otherwise")
    profiles.register()
    profile = config.getoption("--fuseaudit-profile") or os.environ.get("FUSEAUDIT_PROFILE")
    if profile:
        profiles.activate(profile)
    config._fuseaudit_device = profiles.resolve_device(config.getoption("--fuseaudit-device"))  # type: ignore[attr-defined]


def pytest_report_header(config: pytest.Config) -> str:
    import torch
    import triton

    device = getattr(config, "_fuseaudit_device", "?")
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    return (f"fuseaudit: device={device} ({where}), profile={os.environ.get('FUSEAUDIT_PROFILE', 'user')}, "
            f"torch {torch.__version__}, triton {triton.__version__}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("fuseaudit_gpu") and getattr(item.config, "_fuseaudit_device", "cpu") != "cuda":
        pytest.skip("needs a CUDA device (timing, profiler and NVML figures are only real on a GPU)")


@pytest.fixture(scope="session")
def fuseaudit_device(pytestconfig: pytest.Config) -> str:
    """``"cuda"`` or ``"cpu"`` (with Triton's interpreter on)."""
    return pytestconfig._fuseaudit_device  # type: ignore[attr-defined]
