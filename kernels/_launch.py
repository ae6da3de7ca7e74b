"""Launching a Triton kernel with less host time per call.

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run`` on every
call: it binds the arguments, computes the specialisation key (each integer
checked for ``== 1`` and divisibility by 16, each pointer for 16-byte
alignment), finds the compiled kernel and builds its launch metadata.  On the
H200 host that measured about 33 µs per call of our ~20-argument norm
kernels, against about 14 µs through the compiled kernel's own launcher and
11 µs for one eager PyTorch op.  At decode shapes (a few rows) the kernel
itself runs in about 2 µs, so the host is what a decode step waits for.

:func:`launch` remembers, per call site, the compiled kernel behind a key
that is *finer* than Triton's own: every integer and float argument by
value, every tensor by dtype and by whether its data pointer is 16-byte
aligned, the constexprs and launch options by value, the grid and the
current CUDA device.  Equal keys imply equal Triton specialisations, so a hit
may launch the cached compiled kernel directly (its ``kernel[grid]`` runner,
which still calls Triton's launch hooks, so launch counting is unchanged).
A miss takes Triton's normal path and caches what it returns.  Measured on
the H200 host (``reports/h200/host-time.txt``, rows=8, N=4096): 5 to 19 µs
less per wrapper call (rms_norm 43 -> 38 µs, add_rms_norm 60 -> 41 µs); the
rest (output allocation, argument checks, the launcher itself) still puts a
wrapper at 2-5x one eager op, so decode steps want CUDA graphs.

The normal path is always taken under Triton's interpreter, on a Triton
without ``CompiledKernel.__getitem__``, and with ``FUSEAUDIT_FAST_LAUNCH=0``
(to rule this cache out when a result looks wrong).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._rows import interpreting

__all__ = ["clear_cache", "launch"]

# A few thousand shapes per process is plenty for serving; a long randomised
# audit would otherwise grow it without bound, so it is emptied when full.
MAX_ENTRIES = 4096
_CACHE: dict[tuple[Any, ...], Any] = {}


def _enabled() -> bool:
    return os.environ.get("FUSEAUDIT_FAST_LAUNCH", "1") not in ("", "0") and not interpreting()


def clear_cache() -> None:
    """Forget every cached launcher (e.g. after changing Triton options)."""
    _CACHE.clear()


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, through a cached launcher when this call was seen before.

    ``args`` are the kernel's leading positional arguments (tensors, ints,
    floats); ``meta`` are its remaining arguments (constexprs, by name) and
    Triton's launch options (``num_warps``, ``num_stages``).
    """
    if not _enabled():
        kernel[grid](*args, **meta)
        return
    key = (
        kernel, grid, torch.cuda.current_device(), tuple(meta.items()),
        tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a) for a in args),
    )
    runner = _CACHE.get(key)
    if runner is not None:
        runner[0](*args, *runner[1])
        return
    compiled = kernel[grid](*args, **meta)
    runner = _runner(kernel, grid, compiled, len(args), meta)
    if runner is not None:
        if len(_CACHE) >= MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = runner


def _runner(kernel: Any, grid: tuple[int, ...], compiled: Any, n_args: int,
            meta: dict[str, Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """``(compiled[grid3], constexpr values in signature order)``, or None where that cannot be built."""
    names = getattr(kernel, "arg_names", None)
    if compiled is None or names is None or not hasattr(compiled, "__getitem__"):
        return None
    rest = names[n_args:]
    if any(name not in meta for name in rest):  # a defaulted argument: leave it to Triton's binder
        return None
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    try:
        return compiled[grid3], tuple(meta[name] for name in rest)
    except Exception:  # an older CompiledKernel: keep the normal path
        return None
