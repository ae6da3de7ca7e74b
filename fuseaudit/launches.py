"""Count the kernels one call launches, with their names.

A "fused" op that still launches three kernels saves nothing.  We count in
the way each environment allows, and never trust a source that lost events:

**GPU** -- ``torch.profiler`` CUDA events.  Kernels are counted; memcpy and
memset are counted apart.  The call is bracketed by two marker kernels
(``torch.cuda._sleep``'s spin kernel, which nothing else launches): if the
trace lacks either marker, events were dropped and :class:`LaunchCountError`
is raised.  Triton's launch hook
(``knobs.runtime.launch_enter_hook``: an assignable hook in Triton 3.4, a
hook chain with ``add``/``remove`` from 3.5) cross-checks it: every Triton
launch must appear among the profiler's kernels.

**CPU, Triton interpreter** -- launch hooks do not fire there, and a kernel
object's own pre-run hook only sees that one kernel, so the interpreter's
grid executor is wrapped for the duration of the count.  Aten compute ops
are counted too (through a ``TorchDispatchMode``), each as one launch, so an
eager composition gets a count on the CPU as well; aten ops that only make
views or allocate are not launches, and the interpreter's own host copies
inside a Triton launch are not counted.

In both, a warm-up call runs first, so compilation, autotuning and lazy
initialisation launch nothing that is counted.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class LaunchCountError(RuntimeError):
    """The count could not be trusted (dropped profiler events, hooks that disagree)."""


@dataclass
class LaunchCount:
    """Kernels launched by one call."""

    kernels: list[str] = field(default_factory=list)  # compute kernels, in launch order
    memcpy: int = 0
    memset: int = 0
    method: str = ""  # "profiler", "interpreter"
    triton: list[str] = field(default_factory=list)  # Triton launches seen by hooks

    @property
    def count(self) -> int:
        return len(self.kernels)

    def describe(self) -> str:
        names = ", ".join(short_name(k) for k in self.kernels) or "none"
        extra = f" (+{self.memcpy} memcpy, {self.memset} memset)" if self.memcpy or self.memset else ""
        return f"{self.count} kernel(s){extra}: {names}"

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "kernels": self.kernels, "memcpy": self.memcpy, "memset": self.memset,
                "method": self.method, "triton": self.triton}


_FUNCTOR = re.compile(r"(CUDAFunctor_\w+|\w*Functor\w*|\w+_kernel\w*|\w+Kernel\w*)")


def short_name(kernel: str) -> str:
    """A readable kernel name: a C++ template's base name plus its telling functor.

    ``void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(...)...>``
    becomes ``vectorized_elementwise_kernel[GeluCUDAKernelImpl]``; ``...BinaryFunctor<..., MulFunctor<float>>``
    becomes ``...[MulFunctor]``.  A plain function whose parameter list holds
    templates keeps its own name: ``fmha_cutlassF_bf16_aligned_64x128_rf_sm80(
    PyTorchMemEffAttention::AttentionKernel<...>::Params)`` (SDPA's
    memory-efficient kernel) is ``fmha_cutlassF_bf16_aligned_64x128_rf_sm80``,
    not its parameter's ``AttentionKernel``.
    """
    name = kernel.removeprefix("void ").strip().replace("(anonymous namespace)::", "")
    if name.startswith("aten::"):  # the interpreter's count of eager ops: already short
        return name
    paren, angle = name.find("("), name.find("<")
    if paren > 0 and (angle < 0 or paren < angle):  # a function, not a template: its parameters say nothing
        return name[:paren].split("::")[-1]
    if "<" not in name:
        return name.split("(")[0].split("::")[-1]
    base, _, rest = name.partition("<")
    base = base.split("::")[-1]
    found = [m for m in _FUNCTOR.findall(rest) if m != base]
    functors = [m for m in found if "Functor" in m]
    pick = functors[-1] if functors else found[0] if found else None  # the innermost functor says most
    return f"{base}[{pick}]" if pick else base


# ---------------------------------------------------------------------------
# Triton launch hooks (GPU)
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def triton_launch_hook(callback: Callable[[str], None]) -> Iterator[None]:
    """Call ``callback(kernel_name)`` at every compiled Triton launch."""
    from triton import knobs

    def hook(metadata: Any) -> None:
        data = metadata.get() if hasattr(metadata, "get") and callable(metadata.get) else metadata
        try:
            callback(str(data["name"]))
        except Exception:
            callback("<triton kernel>")

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton >= 3.5: a hook chain
        chain.add(hook)
        try:
            yield
        finally:
            chain.remove(hook)
    else:  # Triton 3.4: one assignable hook; chain to whatever was there
        previous = chain

        def both(metadata: Any) -> None:
            hook(metadata)
            if previous is not None:
                previous(metadata)

        knobs.runtime.launch_enter_hook = both
        try:
            yield
        finally:
            knobs.runtime.launch_enter_hook = previous


# ---------------------------------------------------------------------------
# Interpreter and aten counting (CPU)
# ---------------------------------------------------------------------------

# Aten ops that make views, allocate or query metadata: no kernel on a GPU.
_NOT_LAUNCHES = {
    "view", "_unsafe_view", "reshape", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
    "squeeze", "select", "slice", "detach", "alias", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "_to_copy_meta", "resize_", "set_", "unbind", "split", "chunk",
    "narrow", "diagonal", "expand_as", "view_as", "flatten", "unflatten", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_reshape_alias", "split_with_sizes",
}


@contextlib.contextmanager
def _interpreter_and_aten(record: Callable[[str], None]) -> Iterator[None]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    state = {"inside_triton": 0}

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if not state["inside_triton"] and name not in _NOT_LAUNCHES:
            record(f"aten::{name}")
        return func(*args, **(kwargs or {}))

    if "torch._dynamo" not in sys.modules:
        # torch wraps a mode's handler in dynamo.disable on its first call, importing torch._dynamo
        # (about 2 s); nothing compiles here (a compiled target has imported it in its warm-up call)
        setattr(dispatch, "__dynamo_disable", dispatch)

    class AtenCounter(TorchDispatchMode):
        __torch_dispatch__ = dispatch

    executor = interpreter.GridExecutor
    original = executor.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self, "fn", None)
        record(getattr(fn, "__name__", "<triton kernel>"))
        state["inside_triton"] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            state["inside_triton"] -= 1

    executor.__call__ = counted
    try:
        with AtenCounter():
            yield
    finally:
        executor.__call__ = original


# ---------------------------------------------------------------------------
# Profiler (GPU)
# ---------------------------------------------------------------------------

def _marker() -> None:
    torch.cuda._sleep(64)  # a few hundred nanoseconds of "spin_kernel"


@contextlib.contextmanager
def _profiled(count: LaunchCount) -> Iterator[None]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with warnings.catch_warnings(), triton_launch_hook(count.triton.append), \
            profile(activities=[ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("ignore")  # "Profiler clears events at the end of each cycle"
        _marker()
        yield
        _marker()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if _is_device_event(e)]
    events.sort(key=lambda e: e.time_range.start)
    names = [e.name for e in events]
    marks = [i for i, n in enumerate(names) if "spin_kernel" in n]
    if len(marks) != 2:
        raise LaunchCountError(
            f"the profiler lost events: expected 2 marker kernels around the call, saw {len(marks)} "
            f"(all device events: {names})")
    for n in names[marks[0] + 1: marks[1]]:
        low = n.lower()
        if "memcpy" in low:
            count.memcpy += 1
        elif "memset" in low:
            count.memset += 1
        else:
            count.kernels.append(n)
    missing = [t for t in count.triton if not any(t in k for k in count.kernels)]
    if missing:
        raise LaunchCountError(f"Triton launched {missing} but the profiler did not record them: {count.kernels}")


def _is_device_event(e: Any) -> bool:
    kind = getattr(e, "device_type", None)
    return kind is not None and "CUDA" in str(kind)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def recording(device: str) -> Iterator[LaunchCount]:
    """Count the launches made inside the ``with`` block; the count is filled at exit.

    ``device`` is ``"cuda"`` (profiler, cross-checked with Triton's hooks) or
    ``"cpu"`` (Triton's interpreter plus aten ops).  Warm up before entering.
    """
    if device.startswith("cuda"):
        count = LaunchCount(method="profiler")
        with _profiled(count):
            yield count
        return
    count = LaunchCount(method="interpreter")
    with _interpreter_and_aten(count.kernels.append):
        yield count
    count.triton = [k for k in count.kernels if not k.startswith("aten::")]


def count_launches(fn: Callable[..., Any], *args: Any, device: str, warmup: int = 1, **kwargs: Any) -> LaunchCount:
    """Kernels launched by ``fn(*args, **kwargs)`` after ``warmup`` uncounted calls."""
    for _ in range(warmup):
        fn(*args, **kwargs)
    with recording(device) as count:
        fn(*args, **kwargs)
    return count
