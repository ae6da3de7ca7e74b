"""The implementations a benchmark sets against each other at one point.

For every op: ``reference`` (our fused Triton kernel), ``eager`` (the unfused
composition of torch functionals, one kernel per step) and ``compile``
(``torch.compile`` of that same composition, ``dynamic=False``, compiled once
per op, shape and dtype: what a user gets for free).  Where the catalog
names another speed baseline (``OpSpec.speed_eager``: for attention SDPA's
default dispatch, as the math-backend composition is a correctness yardstick,
not a speed one), that is "eager" and what ``compile`` compiles; each SDPA
backend the catalog lists for an op (``OpSpec.sdpa_backends``: flash, cuDNN,
memory-efficient) is a contender of its own, pinned with
``torch.nn.attention.sdpa_kernel``.  Third-party targets
(``module:function``, ``file.py:function`` or ``builtin:NAME``) join under
a name.

:func:`build` binds a contender to a point's inputs and makes the first call
(compilation, autotuning); a contender that cannot run there raises
:class:`ContenderUnavailable` with the reason, which the sweep records.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .catalog import OpSpec, sdpa_default
from .sweep import Point
from .targets import TargetError, load_target

__all__ = ["KINDS", "SDPA_BACKENDS", "Built", "Contender", "ContenderUnavailable", "build", "contenders_for",
           "sdpa_default"]

# --contenders choices: "sdpa" stands for every SDPA backend of the op (OpSpec.sdpa_backends)
KINDS = ("reference", "eager", "compile", "sdpa", "targets")
SDPA_BACKENDS = ("flash", "cudnn", "efficient")  # every backend _pinned_sdpa can pin
_BACKEND_ENUM = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


class ContenderUnavailable(RuntimeError):
    """This contender cannot run at this point; the message says why."""


@dataclass(frozen=True)
class Contender:
    """One implementation: ``role`` is fused, eager, compile, backend or target."""

    name: str
    role: str
    target: str | None = None  # module:function for third-party targets


@dataclass
class Built:
    """A contender bound to one point's inputs: ``call()`` runs it once."""

    contender: Contender
    call: Callable[[], Any]
    first_call_s: float
    note: str | None = None


def _pinned_sdpa(backend: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enum = getattr(SDPBackend, _BACKEND_ENUM[backend], None)
    if enum is None:
        raise ContenderUnavailable(f"this torch has no SDPA backend {_BACKEND_ENUM[backend]}")

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
             scale: float | None = None) -> torch.Tensor:
        with sdpa_kernel(enum):
            return sdpa_default(q, k, v, causal=causal, scale=scale)

    call.__name__ = f"sdpa_{backend}"
    return call


def contenders_for(spec: OpSpec, *, include: Sequence[str] = KINDS,
                   targets: Mapping[str, str] | None = None) -> list[Contender]:
    """The contenders of ``spec``: the kinds in ``include`` plus named third-party ``targets``."""
    unknown = [k for k in include if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown contender kind(s) {unknown}; known: {', '.join(KINDS)}")
    out: list[Contender] = []
    if "reference" in include and spec.reference:
        out.append(Contender("reference", "fused"))
    if "eager" in include:
        out.append(Contender("eager", "eager"))
    if "compile" in include:
        out.append(Contender("compile", "compile"))
    if "sdpa" in include:
        out += [Contender(f"sdpa_{b}", "backend") for b in spec.sdpa_backends]
    if "targets" in include:
        for name, target in (targets or {}).items():
            out.append(Contender(name, "target", target))
    return out


def _function(contender: Contender, spec: OpSpec) -> tuple[Callable[..., Any], str | None]:
    if contender.role == "fused":
        try:
            fn = spec.load_reference()
        except TargetError as exc:
            raise ContenderUnavailable(f"reference kernel not loadable: {exc}") from exc
        if fn is None:
            raise ContenderUnavailable(f"{spec.name} has no reference kernel")
        return fn, None
    if contender.role == "eager":
        return spec.speed_baseline, spec.speed_eager_note
    if contender.role == "compile":
        import torch._dynamo

        torch._dynamo.reset()  # one compilation per op/shape/dtype; no recompile limit reached
        compiled = torch.compile(spec.speed_baseline, dynamic=False)
        return compiled, "torch.compile(dynamic=False) of the eager composition"
    if contender.role == "backend":
        return _pinned_sdpa(contender.name.removeprefix("sdpa_")), None
    if contender.role == "target":
        target = contender.target or ""
        try:  # built-in targets (builtin:NAME) are made for one op
            fn = load_target(target, op=spec.name) if target.startswith("builtin:") else load_target(target)
            return fn, target
        except TargetError as exc:
            raise ContenderUnavailable(str(exc)) from exc
    raise ValueError(f"unknown contender role {contender.role!r}")


def build(contender: Contender, spec: OpSpec, point: Point, inputs: Mapping[str, torch.Tensor]) -> Built:
    """Bind ``contender`` to ``inputs`` and make the first call (timed as ``first_call_s``)."""
    fn, note = _function(contender, spec)
    args = tuple(inputs[n] for n in spec.input_names)
    params = dict(point.params)

    def call() -> Any:
        return fn(*args, **params)

    t0 = time.perf_counter()
    try:
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as exc:
        raise ContenderUnavailable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                                   if str(exc).strip() else type(exc).__name__) from exc
    return Built(contender=contender, call=call, first_call_s=time.perf_counter() - t0, note=note)
