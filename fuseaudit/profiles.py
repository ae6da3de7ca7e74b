"""Hypothesis profiles and the device a run uses.

Three Hypothesis profiles, all with ``deadline=None`` (a first call compiles
a kernel, and the interpreter is slow; a deadline would only measure that):

``fuseaudit-ci``   few, small, derandomized examples: stable CI on 2 CPU cores
``fuseaudit-dev``  more and larger examples, random each run
``fuseaudit-gpu``  many, large examples for a real GPU
``fuseaudit-user`` Hypothesis's defaults without the deadline: what the plugin
                   loads when neither an option nor the user chose a profile,
                   so that ``@given(cases(spec))`` in your own tests does not
                   fail a correct kernel for its first call's compile

The size bounds that go with each profile live in :mod:`.strategies`; the
profile name reaches them through ``$FUSEAUDIT_PROFILE``.  ``$FUSEAUDIT_EXAMPLES``
overrides the number of examples of every profile (a time budget on a lent GPU).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = ("ci", "dev", "gpu")
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

_EXAMPLES = {"ci": 12, "dev": 60, "gpu": 60}


def _examples(profile: str) -> int:
    override = os.environ.get("FUSEAUDIT_EXAMPLES")
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"FUSEAUDIT_EXAMPLES must be a positive integer, got {override!r}")
        return int(override)
    return _EXAMPLES[profile]


def register() -> None:
    """Register the ``fuseaudit-*`` profiles (idempotent)."""
    settings.register_profile("fuseaudit-ci", max_examples=_examples("ci"), deadline=None, derandomize=True,
                              suppress_health_check=_SLOW, print_blob=True)
    settings.register_profile("fuseaudit-dev", max_examples=_examples("dev"), deadline=None,
                              suppress_health_check=_SLOW, print_blob=True)
    settings.register_profile("fuseaudit-gpu", max_examples=_examples("gpu"), deadline=None,
                              suppress_health_check=_SLOW, print_blob=True)
    settings.register_profile("fuseaudit-user", deadline=None, suppress_health_check=_SLOW)


def activate_default() -> None:
    """Hypothesis's own defaults less the deadline, unless the user has loaded a profile of their own."""
    if getattr(settings, "_current_profile", "default") in (None, "default"):
        register()
        settings.load_profile("fuseaudit-user")


def activate(profile: str) -> None:
    """Load the Hypothesis profile and the matching size bounds."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    register()
    settings.load_profile(f"fuseaudit-{profile}")
    os.environ["FUSEAUDIT_PROFILE"] = profile


def resolve_device(device: str = "auto") -> str:
    """``cuda`` when asked for or available; else ``cpu`` with Triton's interpreter on.

    ``cuda:K`` (one GPU of several: a pytest-xdist worker's) is kept as it is
    and made the current device, since Triton launches on the current device.

    The interpreter switch must be set before any kernel module is imported,
    which is why every entry point calls this first.
    """
    import torch

    if device.startswith("cuda:"):
        index = device[len("cuda:"):]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: no such CUDA device ({torch.cuda.device_count()} available)")
        # Triton launches on the current device: make it this one (an audit child given cuda:1
        # would otherwise launch on GPU 0 with GPU 1's pointers)
        torch.cuda.set_device(int(index))
        return device
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:K, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        _warn_old_interpreter()
    return device


def version_tuple(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``2.11.0+cu130`` or ``3.4.0rc1``."""
    major, minor = [*text.split("+")[0].split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _warn_old_interpreter() -> None:
    """Triton < 3.5's interpreter calls ``int()`` on one-element arrays, which NumPy >= 2.4 refuses."""
    import warnings

    import numpy
    import triton

    if version_tuple(triton.__version__) < (3, 5) and version_tuple(numpy.__version__) >= (2, 4):
        warnings.warn(f"Triton {triton.__version__}'s interpreter fails on kernels that loop over scalar "
                      f"arguments with NumPy {numpy.__version__} ('only 0-dimensional arrays can be converted "
                      "to Python scalars'): install numpy<2.4", RuntimeWarning, stacklevel=3)
