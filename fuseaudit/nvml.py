"""What the GPU itself says: name, driver, memory, clocks, power, energy, throttling.

A speed figure means little without the conditions it was taken under: a GPU
at a power cap or thermally throttled runs slower, and energy per call is a
figure of its own for inference.  Everything here goes through NVML
(``pynvml`` from nvidia-ml-py) and degrades instead of failing: where NVML is
missing (CPU machines, some containers) or a query is unsupported, the result
is ``{"available": False, "reason": ...}`` (or that field is ``None`` with a
``*_reason``), never an exception.

Indices are NVML's.  :func:`nvml_index` maps a torch CUDA index to it
(they differ under ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["Sample", "decode_throttle_reasons", "device_info", "nvml_index", "sample", "status"]

# NVML's clocks-event ("throttle") reason bits, stable across driver versions.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

_STATE: dict[str, Any] = {"module": None, "error": None}


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised; the message says why."""


def _nvml() -> Any:
    """The initialised ``pynvml`` module, or :class:`NvmlUnavailable` (cached either way)."""
    if _STATE["module"] is not None:
        return _STATE["module"]
    if _STATE["error"] is not None:
        raise NvmlUnavailable(_STATE["error"])
    try:
        import pynvml

        pynvml.nvmlInit()
    except ImportError as exc:
        _STATE["error"] = f"pynvml (nvidia-ml-py) is not installed: {exc}"
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        _STATE["error"] = f"NVML could not be initialised: {type(exc).__name__}: {exc}"
    else:
        _STATE["module"] = pynvml
        return pynvml
    raise NvmlUnavailable(_STATE["error"])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _query(result: dict[str, Any], key: str, fn: Any, *args: Any, scale: float | None = None) -> Any:
    """``result[key] = fn(*args)`` (scaled); on an NVML error ``None`` and ``key_reason``."""
    try:
        value = fn(*args)
    except Exception as exc:
        result[key] = None
        result[f"{key}_reason"] = f"{type(exc).__name__}: {exc}"
        return None
    if scale is not None and value is not None:
        value = value * scale
    result[key] = value
    return value


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the reasons set in an NVML clocks-event bitmask (unknown bits as hex)."""
    if not isinstance(mask, int) or mask < 0:
        raise ValueError(f"mask must be a non-negative int, got {mask!r}")
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASONS)
    if unknown:
        names.append(hex(unknown))
    return names


def nvml_index(torch_index: int | None = None) -> int:
    """The NVML index of a torch CUDA device (identity when nothing remaps devices)."""
    import torch

    idx = torch.cuda.current_device() if torch_index is None else torch_index
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return idx
    try:
        return int(torch.cuda._get_nvml_device_index(idx))  # type: ignore[attr-defined]
    except Exception:
        return idx


def status() -> dict[str, Any]:
    """``{"available": True}`` or ``{"available": False, "reason": ...}``."""
    try:
        _nvml()
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}
    return {"available": True}


def _handle(device_index: int) -> tuple[Any, Any]:
    if not isinstance(device_index, int) or isinstance(device_index, bool) or device_index < 0:
        raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
    nv = _nvml()
    return nv, nv.nvmlDeviceGetHandleByIndex(device_index)


def _process_memory(nv: Any, handle: Any) -> tuple[int | None, str | None]:
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    for p in procs:
        if p.pid == os.getpid():
            used = p.usedGpuMemory
            return (int(used) if used is not None else None), None
    return None, "this process is not listed by NVML (a container's PID namespace hides it)"


def _conditions(nv: Any, handle: Any) -> dict[str, Any]:
    """Clocks, power, temperature, throttling and memory: what changes while a loop runs."""
    out: dict[str, Any] = {}
    _query(out, "power_w", nv.nvmlDeviceGetPowerUsage, handle, scale=1e-3)
    _query(out, "sm_clock_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
    _query(out, "mem_clock_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
    _query(out, "temperature_c", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
    reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nv.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = _query(out, "throttle_mask", reasons_fn, handle)
    out["throttle_reasons"] = decode_throttle_reasons(int(mask)) if mask is not None else None
    mem = _query(out, "_memory", nv.nvmlDeviceGetMemoryInfo, handle)
    out.pop("_memory", None)
    if mem is not None:
        out["memory_used_bytes"] = int(mem.used)
        out["memory_total_bytes"] = int(mem.total)
    else:
        out["memory_used_bytes"] = out["memory_total_bytes"] = None
        out["memory_reason"] = out.pop("_memory_reason", "unknown")
    used, reason = _process_memory(nv, handle)
    out["process_memory_bytes"] = used
    if reason:
        out["process_memory_reason"] = reason
    return out


def device_info(device_index: int = 0) -> dict[str, Any]:
    """Static and current facts about one GPU; ``available: False`` with a reason when NVML is missing."""
    try:
        nv, handle = _handle(device_index)
    except NvmlUnavailable as exc:
        return {"available": False, "reason": str(exc)}
    except Exception as exc:
        return {"available": False, "reason": f"NVML has no device {device_index}: {type(exc).__name__}: {exc}"}
    info: dict[str, Any] = {"available": True, "index": device_index}
    _query(info, "name", lambda: _text(nv.nvmlDeviceGetName(handle)))
    _query(info, "driver", lambda: _text(nv.nvmlSystemGetDriverVersion()))
    _query(info, "cuda_driver", lambda: _cuda_version(nv.nvmlSystemGetCudaDriverVersion()))
    _query(info, "power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, handle, scale=1e-3)
    _query(info, "max_sm_clock_mhz", nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM)
    _query(info, "max_mem_clock_mhz", nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_MEM)
    info.update(_conditions(nv, handle))
    return info


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _energy_mj(nv: Any, handle: Any) -> tuple[int | None, str | None]:
    try:
        return int(nv.nvmlDeviceGetTotalEnergyConsumption(handle)), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


# The energy counter advances in coarse steps: on the H200, windows well under
# a second read 0 W or up to 3075 W against a 700 W limit, while 1 s loops read
# 114-738 W.  A reading is trusted only over a window of at least
# MIN_ENERGY_SECONDS, with the counter moving forward, and an average no more
# than POWER_LIMIT_MARGIN above the enforced power limit (the limit holds as an
# average, so a loop may pass it by a little, never by a multiple).
MIN_ENERGY_SECONDS = 1.0
POWER_LIMIT_MARGIN = 1.1


def energy_doubts(*, seconds: float | None, energy_j: float | None, watts: float | None,
                  power_limit_w: float | None) -> list[str]:
    """Why an energy reading should not be shown (empty: it is trustworthy).

    One rule for the measurement (:class:`Sample` flags ``energy_suspect``)
    and for the report, which applies it again to stored readings so that
    files written under an older, laxer rule are judged the same way.
    """
    if energy_j is None:
        return ["no energy counter reading"]
    reasons = []
    if seconds is None or seconds < MIN_ENERGY_SECONDS:
        window = "an unknown window" if seconds is None else f"a window of {seconds:.3f} s"
        reasons.append(f"{window}, under {MIN_ENERGY_SECONDS:g} s: the energy counter advances in steps "
                       f"too coarse for it")
    if energy_j < 0:
        reasons.append("the energy counter went backwards (reset or wrapped)")
    elif energy_j == 0:
        reasons.append("the energy counter did not advance over the window")
    if power_limit_w is None or not power_limit_w > 0:
        reasons.append("no power limit recorded to check the average against")
    elif watts is not None and watts > POWER_LIMIT_MARGIN * power_limit_w:
        reasons.append(f"an average of {watts:.0f} W, above the card's {power_limit_w:.0f} W power limit")
    return reasons


def _power_limit_w(nv: Any, handle: Any) -> float | None:
    try:
        return nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    except Exception:
        return None


class Sample:
    """Context manager returned by :func:`sample`; ``result`` is the dict it yields."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.result: dict[str, Any] = {}
        self._start: tuple[Any, Any, int | None, str | None, float] | None = None

    def __enter__(self) -> dict[str, Any]:
        self.result.clear()
        try:
            nv, handle = _handle(self.device_index)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, NvmlUnavailable) else f"{type(exc).__name__}: {exc}"
            self.result.update(available=False, reason=reason)
            self._start = None
            return self.result
        e0, reason = _energy_mj(nv, handle)
        self._start = (nv, handle, e0, reason, time.perf_counter())
        return self.result

    def __exit__(self, *exc_info: object) -> None:
        if self._start is None:
            return
        nv, handle, e0, reason, t0 = self._start
        self._start = None
        seconds = time.perf_counter() - t0
        e1, reason1 = _energy_mj(nv, handle)
        result = self.result
        result.update(available=True, index=self.device_index, seconds=seconds)
        limit = _power_limit_w(nv, handle)
        result["power_limit_w"] = limit
        if e0 is not None and e1 is not None:
            joules = (e1 - e0) / 1e3
            result["energy_j"] = joules
            result["avg_watts"] = joules / seconds if seconds > 0 else None
            doubts = energy_doubts(seconds=seconds, energy_j=joules, watts=result["avg_watts"], power_limit_w=limit)
            if doubts:
                result["energy_suspect"] = "; ".join(doubts)
        else:
            result["energy_j"] = result["avg_watts"] = None
            result["energy_reason"] = reason or reason1
        try:
            result.update(_conditions(nv, handle))
        except Exception as exc:  # never lose the energy figure to a failing query
            result["conditions_reason"] = f"{type(exc).__name__}: {exc}"


def sample(device_index: int = 0) -> Sample:
    """Energy and conditions over a ``with`` block; the yielded dict is filled when the block ends.

    ``energy_j`` and ``avg_watts`` come from the energy counter (millijoules
    since driver load) read before and after; the caller synchronises the
    device inside the block so the work is really over.  ``seconds`` is the
    wall clock of the block; ``power_limit_w`` the enforced limit;
    ``energy_suspect`` says why the reading should not be trusted
    (:func:`energy_doubts`).  Clocks, power and throttle reasons are read at
    the end, while the GPU is still warm.  NVML missing or failing:
    ``{"available": False, "reason": ...}``; the block runs either way.  The
    returned object keeps the dict as ``.result``, so it can also be handed
    to code that enters it (``timing.time_events(..., around=...)``).
    """
    return Sample(device_index)
