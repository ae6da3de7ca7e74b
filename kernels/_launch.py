"""Launching a Triton kernel with less host time per call.

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run`` on every
call: it binds the arguments, computes the specialisation key (each integer
checked for ``== 1`` and divisibility by 16, each pointer for 16-byte
alignment), finds the compiled kernel and builds its launch metadata.  On the
H200 host that measured about 33 µs per call of our ~20-argument norm
kernels, against about 14 µs through the compiled kernel's own launcher and
11 µs for one eager PyTorch op.  At decode shapes (a few rows) the kernel
itself runs in about 2 µs, so the host is what a decode step waits for.

Our wrappers spend as long again before the launch: argument checks, folding
the leading dims, choosing the tile.  All of that depends only on the inputs'
*metadata*, so a wrapper describes its launch as a :class:`Plan` (kernel,
grid, scalar arguments, constexprs and launch options: everything but the
tensors) and :func:`planned` keeps plans by a key of

* the wrapper's own parameters (op, eps, its tuning, knobs tests change),
* each input tensor's shape, strides, dtype, device and whether its data
  pointer is 16-byte aligned (what Triton specialises pointers on),
* the current CUDA device.

Equal keys imply equal checks, equal scalar arguments and equal Triton
specialisations (outputs are fresh contiguous allocations, always aligned),
so a plan that has launched once calls its compiled kernel directly (its
``kernel[grid]`` runner, which still calls Triton's launch hooks, so launch
counting is unchanged).  A new key takes the wrapper's full path (checks
included) and Triton's normal launch, and keeps what they return.

Plans are never kept under Triton's interpreter or with
``FUSEAUDIT_FAST_LAUNCH=0`` (to rule this cache out when a result looks
wrong): every call then checks, plans and launches through ``kernel[grid]``.
On a Triton without ``CompiledKernel.__getitem__`` plans are kept but each
launch goes through ``kernel[grid]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ._rows import interpreting

__all__ = ["Plan", "clear_cache", "planned"]

# A few thousand shapes per process is plenty for serving; a long randomised
# audit would otherwise grow it without bound, so it is emptied when full.
MAX_ENTRIES = 4096
_PLANS: dict[Hashable, Plan | None] = {}


def _enabled() -> bool:
    return os.environ.get("FUSEAUDIT_FAST_LAUNCH", "1") not in ("", "0") and not interpreting()


def clear_cache() -> None:
    """Forget every kept plan (e.g. after changing Triton options)."""
    _PLANS.clear()


class Plan:
    """One kernel launch with everything but its tensors fixed.

    ``Plan(kernel, grid, *scalars, **meta)(*tensors)`` is
    ``kernel[grid](*tensors, *scalars, **meta)``: the kernel takes its tensor
    arguments first, then ``scalars`` (ints, floats); ``meta`` names its
    constexprs and Triton's launch options (``num_warps``, ``num_stages``).
    ``scratch``, if given, maps the first tensor's device to tensors the
    kernel takes after the caller's: a workspace that cannot be kept in the
    plan, e.g. one per stream (see ``_coop.workspace``).
    """

    __slots__ = ("_fast", "grid", "kernel", "meta", "scalars", "scratch")

    def __init__(self, kernel: Any, grid: tuple[int, ...], *scalars: Any,
                 scratch: Callable[[torch.device], tuple[torch.Tensor, ...]] | None = None, **meta: Any) -> None:
        self.kernel = kernel
        self.grid = grid
        self.scalars = scalars
        self.scratch = scratch
        self.meta = meta
        # The compiled kernel's runner and its trailing arguments once launched;
        # False where none can be built (then every launch takes kernel[grid]).
        self._fast: tuple[Any, tuple[Any, ...]] | bool | None = None

    def __call__(self, *tensors: torch.Tensor) -> None:
        if self.scratch is not None:
            tensors = (*tensors, *self.scratch(tensors[0].device))
        fast = self._fast
        if fast:
            fast[0](*tensors, *fast[1])
            return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.meta)
        if fast is None and _enabled():
            self._fast = _runner(self, compiled, len(tensors)) or False

    def __repr__(self) -> str:
        name = getattr(self.kernel, "__name__", type(self.kernel).__name__)
        return f"Plan({name}, grid={self.grid}, scalars={self.scalars}, meta={self.meta})"


def planned(params: tuple[Hashable, ...], inputs: tuple[torch.Tensor | None, ...],
            build: Callable[[], Plan | None]) -> Plan | None:
    """The plan ``build()`` returns for these ``params`` and ``inputs``, kept by their metadata.

    ``build`` is the wrapper's full path: it checks the inputs (raising its
    clear errors), and returns the plan, or None where there is nothing to
    launch (an empty tensor).  ``inputs`` are every tensor argument the
    wrapper reads (None for an absent optional one); ``params`` every other
    value the plan depends on.  Anything that is not a tensor among
    ``inputs`` skips the cache, so ``build`` raises its error.
    """
    if not _enabled():
        return build()
    try:
        key = (params, torch.cuda.current_device(), tuple(
            None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
            for t in inputs))
    except (AttributeError, TypeError):  # not a tensor: let build() say what is wrong
        return build()
    try:
        return _PLANS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable parameter: build() says whether it is acceptable
        return build()
    plan = build()
    if len(_PLANS) >= MAX_ENTRIES:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _runner(plan: Plan, compiled: Any, n_tensors: int) -> tuple[Any, tuple[Any, ...]] | None:
    """``(compiled[grid3], scalars + constexpr values in signature order)``, or None where that cannot be built."""
    names = getattr(plan.kernel, "arg_names", None)
    if compiled is None or names is None or not hasattr(compiled, "__getitem__"):
        return None
    rest = names[n_tensors + len(plan.scalars):]
    if any(name not in plan.meta for name in rest):  # a defaulted argument: leave it to Triton's binder
        return None
    grid3 = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
    try:
        return compiled[grid3], (*plan.scalars, *(plan.meta[name] for name in rest))
    except Exception:  # an older CompiledKernel: keep the normal path
        return None
