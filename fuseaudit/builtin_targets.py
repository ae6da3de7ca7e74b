"""Built-in third-party targets: ``fuseaudit audit OP builtin:NAME``.

=====================  ==============================================  ==================  ==========================
target                 what is audited                                 devices             declared support
=====================  ==============================================  ==================  ==========================
``builtin:compile``    ``torch.compile`` (Inductor) of the op's eager  cuda; cpu with a    every dtype, layout and
                       composition (attention: plain SDPA after        C++ compiler        head dim; launches are
                       ``repeat_interleave`` for grouped-query)                            counted on CUDA only
``builtin:sdpa-flash`` ``F.scaled_dot_product_attention`` pinned to    cuda                float16/bfloat16, head dim
                       FlashAttention                                                      <= 256, contiguous inputs
``builtin:sdpa-cudnn`` ... pinned to cuDNN attention                   cuda                float16/bfloat16, head dim
                                                                                           <= 128, contiguous inputs
``builtin:sdpa-        ... pinned to memory-efficient attention        cuda                every dtype and head dim,
efficient``                                                                                contiguous inputs
``builtin:sdpa-math``  ... pinned to the math backend                  cpu, cuda           everything; launches are
                                                                                           counted, not judged (it is
                                                                                           the unfused baseline)
=====================  ==============================================  ==================  ==========================

Grouped-query attention (``k``/``v`` with fewer heads) goes through SDPA's
``enable_gqa`` where the backend has it (flash and math, torch >= 2.5) and
through ``repeat_interleave`` otherwise; those copies are launches, and the
audit counts them.  The fused backends' layout support is declared
conservatively (contiguous inputs only) until a GPU run shows more.  Per
input, the fused backends also declare what they take with SDPA's own check
(``torch.backends.cuda.can_use_*``, attached as ``fuseaudit_supports``): an
input the backend's dispatcher refuses ("No available kernel") is an
unsupported case, skipped and counted, not a failure of ``runs``.

A target that cannot run on this device (an SDPA backend on the CPU) is a
usage error: the audit exits 2 and names the targets that are available here
(:func:`available_targets`).  Inductor's CPU code is C++ loops, not
launches, so ``builtin:compile`` gets a launch count on CUDA only.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from .catalog import OPS, get_op
from .shapes import ATTENTION
from .targets import BUILTIN_PREFIX, TargetError

ALL_DTYPES = ("float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16", "float16")
_HEAD_DIMS = ATTENTION.head_dims


@dataclass(frozen=True)
class BuiltinTarget:
    """A built-in target and what it declares it supports."""

    name: str  # without the "builtin:" prefix
    description: str
    ops: tuple[str, ...]  # the ops it implements
    devices: tuple[str, ...]
    dtypes: tuple[str, ...] = ALL_DTYPES
    head_dims: tuple[int, ...] | None = None
    contiguous_only: bool = False
    judge_launches: bool = True  # False: count, report, do not judge (an unfused baseline)
    count_launches_on: tuple[str, ...] = ("cpu", "cuda")
    min_timeout_s: float = 0.0  # the first call compiles: no-progress timeout at least this

    @property
    def target(self) -> str:
        return BUILTIN_PREFIX + self.name

    def unavailable(self, op: str, device: str) -> str | None:
        """Why this target cannot audit ``op`` on ``device``, or None where it can."""
        if op not in self.ops:
            return f"{self.target} implements {', '.join(self.ops)}, not {op}"
        if device.split(":")[0] not in self.devices:  # cuda:1 is a cuda device
            return f"{self.target} needs {' or '.join(self.devices)}, not {device}"
        if self.name == "compile" and device == "cpu" and not _cxx_compiler():
            return f"{self.target} on the CPU needs a C++ compiler for Inductor, and none was found"
        if self.name.startswith("sdpa-"):
            missing = _missing_backend(self.name)
            if missing:
                return missing
        return None


_BACKENDS = {  # builtin name -> SDPBackend member
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}

BUILTINS: dict[str, BuiltinTarget] = {
    t.name: t
    for t in [
        BuiltinTarget("compile", "torch.compile of the op's eager composition", tuple(OPS), ("cpu", "cuda"),
                      count_launches_on=("cuda",), min_timeout_s=300.0),
        BuiltinTarget("sdpa-flash", "SDPA pinned to FlashAttention", ("attention",), ("cuda",),
                      dtypes=HALF_DTYPES, head_dims=tuple(d for d in _HEAD_DIMS if d <= 256), contiguous_only=True),
        BuiltinTarget("sdpa-cudnn", "SDPA pinned to cuDNN attention", ("attention",), ("cuda",),
                      dtypes=HALF_DTYPES, head_dims=tuple(d for d in _HEAD_DIMS if d <= 128), contiguous_only=True),
        BuiltinTarget("sdpa-efficient", "SDPA pinned to memory-efficient attention", ("attention",), ("cuda",),
                      contiguous_only=True),
        BuiltinTarget("sdpa-math", "SDPA pinned to the math backend (unfused)", ("attention",), ("cpu", "cuda"),
                      judge_launches=False),
    ]
}


def builtin_target(spec: str) -> BuiltinTarget:
    """The built-in target ``builtin:NAME``; :class:`TargetError` naming the known ones otherwise."""
    name = spec[len(BUILTIN_PREFIX):] if spec.startswith(BUILTIN_PREFIX) else spec
    try:
        return BUILTINS[name]
    except KeyError:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
        raise TargetError(f"unknown built-in target {spec!r}; known: {known}") from None


def available_targets(op: str, device: str) -> list[str]:
    """The built-in targets that can audit ``op`` on ``device`` (``cpu`` or ``cuda``) here."""
    get_op(op)
    return [t.target for t in BUILTINS.values() if t.unavailable(op, device) is None]


def load_builtin(spec: str, *, op: str | None) -> Callable[..., Any]:
    """The callable behind ``builtin:NAME`` for ``op`` (the canonical signature of the op)."""
    target = builtin_target(spec)
    if op is None:
        raise TargetError(f"{spec} is made for one op: pass op=")
    if op not in target.ops:
        raise TargetError(f"{spec} implements {', '.join(target.ops)}, not {op}")
    if target.name == "compile":
        return _compiled(op)
    return _sdpa(_BACKENDS[target.name])


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------

def _cxx_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _plain_attention(q, k, v, causal=False, scale=None):
    """The attention composition Inductor sees: no backend pinned, so it may pick a fused one."""
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


@functools.cache
def _compiled(op: str) -> Callable[..., Any]:
    import torch

    cfg = torch._dynamo.config
    # Every new shape, stride or dtype may recompile; past the limit Dynamo
    # silently runs eager, and we would audit eager.  Keep the limit out of reach.
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(int(getattr(cfg, knob)), 4096))
    fn = _plain_attention if op == "attention" else get_op(op).eager
    compiled = torch.compile(fn)
    if getattr(compiled, "__wrapped__", None) is None:  # keep the op's signature visible to the audit
        try:
            functools.update_wrapper(compiled, fn)
        except (AttributeError, TypeError):
            pass
    return compiled


# ---------------------------------------------------------------------------
# SDPA backends
# ---------------------------------------------------------------------------

def _torch_version() -> tuple[int, int]:
    import torch

    from .profiles import version_tuple

    return version_tuple(torch.__version__)


def _missing_backend(name: str) -> str | None:
    from torch.nn.attention import SDPBackend

    if not hasattr(SDPBackend, _BACKENDS[name]):
        return f"{BUILTIN_PREFIX}{name}: this torch has no SDPBackend.{_BACKENDS[name]}"
    return None


def _sdpa(backend_name: str) -> Callable[..., Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    native_gqa = backend_name in ("FLASH_ATTENTION", "MATH") and _torch_version() >= (2, 5)

    def prepare(q, k, v):  # what the backend is handed: k/v repeated where it has no native GQA
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and not native_gqa:
            return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
        return q, k, v, groups > 1

    def attention(q, k, v, causal=False, scale=None):
        q, k, v, gqa = prepare(q, k, v)
        extra = {"enable_gqa": True} if gqa else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)

    def supports(q, k, v, causal=False, scale=None) -> str | None:
        """The backend's own check (torch.backends.cuda.can_use_*), asked before the call, in its context."""
        with sdpa_kernel(backend):  # the enable flags as the call will see them
            return _backend_refuses(backend_name, *prepare(q, k, v), causal=causal)

    attention.__name__ = f"sdpa_{backend_name.lower()}"
    if backend_name != "MATH":  # the math backend takes everything
        attention.fuseaudit_supports = supports  # type: ignore[attr-defined]
    return attention


_CAN_USE = {"FLASH_ATTENTION": "can_use_flash_attention", "CUDNN_ATTENTION": "can_use_cudnn_attention",
            "EFFICIENT_ATTENTION": "can_use_efficient_attention"}


def _backend_refuses(backend_name: str, q: Any, k: Any, v: Any, gqa: bool, *, causal: bool) -> str | None:
    """Why SDPA's ``backend_name`` would refuse these inputs (its own warning text), or None.

    ``torch.backends.cuda.can_use_*`` run the checks SDPA's dispatcher runs;
    with ``debug=True`` they warn the reason.  Where this torch lacks them the
    backend is asked nothing: every drawn input counts as supported.
    """
    import warnings

    import torch

    check = getattr(torch.backends.cuda, _CAN_USE[backend_name], None)
    params_type = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or params_type is None:
        return None
    try:  # enable_gqa joined SDPAParams in torch 2.5
        params = params_type(q, k, v, None, 0.0, causal, gqa)
    except TypeError:
        params = params_type(q, k, v, None, 0.0, causal)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = check(params, True)
    if ok:
        return None
    said = "; ".join(" ".join(str(w.message).split()) for w in caught)
    return f"{backend_name.lower()} refuses it: {said}" if said else f"{backend_name.lower()} refuses it"
