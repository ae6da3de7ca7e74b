"""Launching a Triton kernel with less host time per call.

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run`` on every
call: it binds the arguments, computes the specialisation key (each integer
checked for ``== 1`` and divisibility by 16, each pointer for 16-byte
alignment), finds the compiled kernel and builds its launch metadata: about
twice the host time of the compiled kernel's own launcher.  At decode shapes
(a few rows) the kernel itself runs in a few µs, so the host is what a
decode step waits for.

Our wrappers spend as long again before the launch: argument checks, folding
the leading dims, choosing the tile.  All of that depends only on the inputs'
*metadata*, so a wrapper describes its launch as a :class:`Plan` (kernel,
grid, scalar arguments, constexprs and launch options: everything but the
tensors) and :func:`planned` keeps plans by a key of

* the call's own parameters (op, eps, scale, activation),
* each input tensor's shape, strides, dtype, device and whether its data
  pointer is 16-byte aligned (what Triton specialises pointers on),
* the current CUDA device.

Equal keys imply equal checks, equal scalar arguments and equal Triton
specialisations (outputs are fresh contiguous allocations, always aligned),
so a plan that has launched once calls its compiled kernel's launcher
directly.  A new key takes the wrapper's full path (checks included) and
Triton's normal launch, and keeps what they return.

What a wrapper chooses its launch by (the tables of ``_tuning.py``, the
``_rows`` and ``_coop`` constants) is read when a plan is built, as Triton
reads its options when it compiles: it is not part of the key (a longer key
costs host time on every call).  Change it through :func:`retuned`, which
forgets the kept plans, or call :func:`clear_cache` after changing it.

The direct launch is the compiled kernel's ``kernel[grid]`` runner without
its per-call Python: the runner looks up the current device and stream
through ``torch.cuda``, builds a launch-metadata dict for the launch hooks
and (from Triton 3.5, whose hooks are chains that are never None) calls two
empty hook chains; the launcher then asks the driver about every tensor
argument (``cuPointerGetAttribute``, to reject host memory).  A plan reads
the raw stream handle as torch.compile's generated code does, passes data
pointers as integers (the plan's key already says every tensor is on the
plan's CUDA device) and passes no hooks while none is registered; with
Triton 3.5 and 3.6 it calls the launcher's C function itself (see
``_c_launch``).  A kept plan's launch is one Python call (``plan.launch``,
a closure over everything but the tensors), which reads the pointers with
``map`` and checks the hooks inline.  When a launch hook is registered
(``fuseaudit.launches`` counts launches with one; so do Triton's
profilers), each launch takes Triton's runner, hooks and all.

Plans are never kept under Triton's interpreter or with
``FUSEAUDIT_FAST_LAUNCH=0`` in the environment as the kernels are imported
(to rule this cache out when a result looks wrong; or set ``ENABLED``):
every call then checks, plans and launches through ``kernel[grid]``.
On a Triton without ``CompiledKernel.__getitem__`` plans are kept but each
launch goes through ``kernel[grid]``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner

from . import _coop, _tuning
from ._rows import interpreting

__all__ = ["Plan", "clear_cache", "output_like", "planned", "retuned"]

# A few thousand shapes per process is plenty for serving; a long randomised
# audit would otherwise grow it without bound, so it is emptied when full.
MAX_ENTRIES = 4096
_PLANS: dict[Hashable, Plan | None] = {}


# Read once, when the kernels are imported: an os.environ look-up per call would cost host time.
ENABLED = os.environ.get("FUSEAUDIT_FAST_LAUNCH", "1") not in ("", "0") and not interpreting()


# torch.cuda.current_device() checks CUDA's lazy initialisation in Python
# first; the plan's key reads the index directly (a launch initialises CUDA).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def clear_cache() -> None:
    """Forget every kept plan and remembered tile choice (after changing Triton options or a module constant).

    The table look-ups (``_tuning._lookup``) and splits (``_coop._coop_config``)
    are cached by their arguments, not by the tables and constants they read:
    without this a table changed after a first call would not be seen.
    """
    _PLANS.clear()
    _tuning._lookup.cache_clear()
    _coop._coop_config.cache_clear()


@contextlib.contextmanager
def retuned(target: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``target`` (``_tuning.TABLES``, ``_tuning``, ``_rows`` or ``_coop`` constants) for the block.

    Plans (and the cached tile choices) are built from such constants but not
    keyed by them, so they are forgotten on entry and again on exit (see
    :func:`clear_cache`): the calls inside build their plans from the new
    values, the calls after from the old.  An
    attribute ``target`` lacks is an AttributeError (a misspelt name would
    otherwise change nothing).
    """
    old = {name: getattr(target, name) for name in values}
    clear_cache()
    try:
        for name, value in values.items():
            setattr(target, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(target, name, value)
        clear_cache()


class Plan:
    """One kernel launch with everything but its tensors fixed.

    ``Plan(kernel, grid, *scalars, **meta).launch(*tensors)`` (or calling
    the plan) is ``kernel[grid](*tensors, *scalars, **meta)``: the kernel
    takes its tensor arguments first, then ``scalars`` (ints, floats);
    ``meta`` names its constexprs and Triton's launch options
    (``num_warps``, ``num_stages``).
    ``scratch``, if given, maps the first tensor's device to tensors the
    kernel takes after the caller's: a workspace that cannot be kept in the
    plan, e.g. one per stream (see ``_coop.workspace``).
    ``fallback``, if given, is a plan taking the same tensors that this one
    gives way to for good when CUDA refuses its first launch as a
    cooperative grid that does not fit (see ``_coop.py``), with a warning.
    ``late``: the number of scalars each launch passes after the tensors
    (``plan.launch(*tensors, *late_values)``); the kernel takes them after
    the tensors and the scratch, before ``scalars``.  They are values that
    change from call to call without changing the launch (a growing cache's
    length), so the plan's key holds what Triton specialises them on.
    A ``kernel`` that is a ``triton.autotune`` is launched through it once;
    the plan then fixes the config it chose and launches the kernel itself.
    """

    __slots__ = ("fallback", "grid", "kernel", "late", "launch", "meta", "row_major", "scalars", "scratch")

    def __init__(self, kernel: Any, grid: tuple[int, ...], *scalars: Any,
                 scratch: Callable[[torch.device], tuple[torch.Tensor, ...]] | None = None,
                 fallback: Plan | None = None, late: int = 0, **meta: Any) -> None:
        self.kernel = kernel
        self.grid = grid
        self.scalars = scalars
        self.scratch = scratch
        self.fallback = fallback
        self.late = late
        self.meta = meta
        # Whether the first input is contiguous (set by planned, which keys
        # plans by its strides): then ``torch.empty_like`` of it is a
        # row-major output (see output_like).
        self.row_major = False
        # ``plan.launch(*tensors)`` launches: through kernel[grid] until the
        # kernel is compiled, then through the compiled kernel's launcher
        # (see _launcher) where one can be built.  One attribute, so a kept
        # plan's launch is one Python call.
        self.launch: Callable[..., None] = self._first_launch

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.launch(*tensors)

    def _first_launch(self, *args: Any) -> None:
        try:
            compiled = self._launch_by_kernel(*args)
        except RuntimeError as e:
            if self.fallback is None or "cooperative" not in str(e):
                raise
            warnings.warn(f"{self!r}: CUDA refused the cooperative launch ({e}); using {self.fallback!r}",
                          RuntimeWarning, stacklevel=_outside_stacklevel())
            self.fallback.launch(*args)
            self.launch = self.fallback.launch  # its own launcher from now on
            return
        if ENABLED:  # from now on the compiled kernel's launcher, or kernel[grid] where none can be built
            self._fix_tuned_config()
            scratch = () if self.scratch is None else self.scratch(args[0].device)
            self.launch = _launcher(self, compiled, len(args) - self.late + len(scratch)) or self._launch_by_kernel

    def _fix_tuned_config(self) -> None:
        """After an autotuned first launch: the kernel itself, with the config the autotuner chose."""
        tuned = getattr(self.kernel, "best_config", None) if isinstance(self.kernel, Autotuner) else None
        if tuned is not None and tuned.pre_hook is None and hasattr(tuned, "all_kwargs"):
            self.kernel, self.meta = self.kernel.fn, {**self.meta, **tuned.all_kwargs()}

    def _launch_by_kernel(self, *args: Any) -> Any:
        """``kernel[grid](...)``, Triton's own launch; returns its compiled kernel."""
        if self.scratch is not None:
            n = len(args) - self.late
            args = (*args[:n], *self.scratch(args[0].device), *args[n:])
        return self.kernel[self.grid](*args, *self.scalars, **self.meta)

    def __repr__(self) -> str:
        name = getattr(self.kernel, "__name__", type(self.kernel).__name__)
        return f"Plan({name}, grid={self.grid}, scalars={self.scalars}, meta={self.meta})"


def _outside_stacklevel() -> int:
    """``stacklevel`` for a warning from the caller's frame: the first frame outside the kernels package."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = inspect.currentframe(), 0
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def planned(params: tuple[Hashable, ...], inputs: tuple[torch.Tensor | None, ...],
            build: Callable[..., Plan | None], *args: Any) -> Plan | None:
    """The plan ``build(*args)`` returns for these ``params`` and ``inputs``, kept by their metadata.

    ``build`` is the wrapper's full path: it checks the inputs (raising its
    clear errors), and returns the plan, or None where there is nothing to
    launch (an empty tensor).  ``inputs`` are every tensor argument the
    wrapper reads (None for an absent optional one); ``params`` the call's
    other arguments (module constants are read by ``build``, not keyed: see
    :func:`retuned`).  Anything that is not a tensor among ``inputs`` skips
    the cache, so ``build`` raises its error.  (``build`` takes ``args``
    rather than closing over them: no lambda per call.)
    """
    if not ENABLED:
        return build(*args)
    try:
        # One flat tuple: cheaper than a tuple per tensor.
        key = [params, _current_device()]
        for t in inputs:
            key += (None,) if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)
        key = tuple(key)
    except (AttributeError, TypeError):  # not a tensor: let build() say what is wrong
        return build(*args)
    try:
        return _PLANS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable parameter: build() says whether it is acceptable
        return build(*args)
    plan = build(*args)
    if plan is not None:
        plan.row_major = inputs[0].is_contiguous()
    if len(_PLANS) >= MAX_ENTRIES:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def output_like(x: torch.Tensor, plan: Plan | None) -> torch.Tensor:
    """A new row-major tensor of ``x``'s shape, dtype and device: a wrapper's output (``x`` its plan's first input).

    ``torch.empty_like(x)`` keeps a dense ``x``'s strides (a transposed
    ``x`` would give a transposed output); its ``memory_format`` keyword
    costs host time on every call, so a kept plan whose first
    input is contiguous goes without it.
    """
    if plan is not None and plan.row_major:
        return torch.empty_like(x)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _launcher(plan: Plan, compiled: Any, n_tensors: int) -> Callable[..., None] | None:
    """A function launching ``compiled`` on the plan's grid with given tensors, or None where none can be built.

    ``n_tensors`` counts the kernel's tensor arguments, the plan's scratch
    included (the function appends those); after them come the launch's late
    values, the plan's scalars and constexpr values in signature order
    (Triton's binder is what this skips).
    """
    names = getattr(plan.kernel, "arg_names", None)
    if compiled is None or names is None or not hasattr(compiled, "__getitem__"):
        return None
    scratch, late = plan.scratch, plan.late
    rest = names[n_tensors + late + len(plan.scalars):]
    if any(name not in plan.meta for name in rest):  # a defaulted argument: leave it to Triton's binder
        return None
    trailing = (*plan.scalars, *(plan.meta[name] for name in rest))
    grid3 = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
    try:
        runner = compiled[grid3]  # Triton's own: loads the kernel on this device
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except Exception:  # an older CompiledKernel: keep the normal path
        return None
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if get_device is None or stream is None or runtime is None:
        def launch_by_runner(*args: Any) -> None:
            tensors, values = (args[:-late], args[-late:]) if late else (args, ())
            if scratch is not None:
                tensors = (*tensors, *scratch(tensors[0].device))
            runner(*tensors, *values, *trailing)
        return launch_by_runner
    # A plan is kept per current device (see planned): it launches on this
    # device's current stream.
    device = get_device()
    gx, gy, gz = grid3
    # run(grid, stream, function, metadata, no launch metadata, no hooks, ...),
    # or the C launch it calls, given what run() would add (see _c_launch)
    call, extra = run, (packed, None, None, None)
    c_launch = _c_launch(run)
    if c_launch is not None:
        call, coop, pdl = c_launch
        extra = (coop, pdl, None, None, *extra)

    def launch(*args: Any) -> None:
        tensors, values = (args[:-late], args[-late:]) if late else (args, ())
        if scratch is not None:
            tensors = (*tensors, *scratch(tensors[0].device))
        # Any registered hook (launch counting, profilers): Triton's runner.
        # A Triton 3.4 hook is a callable or None, a 3.5+ one a chain with a
        # list of calls; spelled out here, not in a helper, as this runs on
        # every launch.
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if ((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True))):
            runner(*tensors, *values, *trailing)
            return
        call(gx, gy, gz, stream(device), function, *extra, *map(_data_ptr, tensors), *values, *trailing)
    return launch


_data_ptr = torch.Tensor.data_ptr


# The launcher's __call__ arguments in the Triton versions whose C launch
# function takes (grid, stream, function, cooperative, pdl, global scratch,
# profile scratch, *the rest of __call__'s arguments): 3.5 and 3.6.
_C_LAUNCH_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def _c_launch(run: Any) -> tuple[Callable[..., None], Any, Any] | None:
    """``(launch, cooperative, pdl)`` of Triton's launcher where calling its C function directly is known to match.

    Triton 3.5 and 3.6's ``CudaLauncher.__call__`` only allocates the
    global and profile scratch (none for kernels that need none) and passes
    everything on to its C ``launch``; calling that directly saves a Python
    frame and two closures per launch.
    Recognised by the ``profile_scratch_size`` attribute and ``__call__``'s
    parameters; any other launcher (Triton 3.4, 3.7 on) keeps ``run(...)``.
    """
    c_call = getattr(run, "launch", None)
    if c_call is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    try:
        params = tuple(inspect.signature(type(run).__call__).parameters)
    except (TypeError, ValueError):
        return None
    if params != _C_LAUNCH_CALL or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    return c_call, run.launch_cooperative_grid, run.launch_pdl
