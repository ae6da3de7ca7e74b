"""Run one case against one implementation and check every property.

This is the one code path behind the property tests of the reference kernels
and the audit of third-party kernels: :func:`judge_case` materializes the
inputs, keeps them, has a :class:`Caller` call the target on copies, and
judges what came back against eager and the float64 oracle computed here from
the kept inputs.  The caller is :class:`InProcess` (the target in this
process: :func:`run_case`, your own tests) or the audit's
:class:`fuseaudit.remote.Remote` (the target in a worker process: nothing it
does to torch or fuseaudit there reaches the judging).  Properties, in the
order checked:

``runs``              the call returns (an exception on a supported input fails)
``contract``          number, type (exactly ``torch.Tensor``, dense, strided), shape,
                      dtype and device of the outputs; outputs are new tensors,
                      not views of an input
``inputs_unchanged``  every byte of every input's storage (padding included) is
                      as it was before the call
``numerics``          NaN/Inf parity and the tolerance policy (:mod:`.tolerance`)
                      for every output; an element the kernel never wrote reads
                      as NaN, because the call runs with torch's
                      ``fill_uninitialized_memory`` on

Each failed property raises its own :class:`PropertyFailure` subclass, so that
Hypothesis shrinks and reports distinct bugs separately.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from .case import Case, materialize
from .catalog import OpSpec, as_tuple
from .tolerance import Comparison, compare

PROPERTIES = ("runs", "contract", "inputs_unchanged", "numerics")


class PropertyFailure(AssertionError):
    """A property that does not hold on a case; the message says how to replay it."""

    prop = "property"

    def __init__(self, message: str, report: CaseReport | None = None):
        super().__init__(message)
        self.report = report


class TargetRaised(PropertyFailure):
    prop = "runs"


class ContractViolation(PropertyFailure):
    prop = "contract"


class InputModified(PropertyFailure):
    prop = "inputs_unchanged"


class NumericsMismatch(PropertyFailure):
    prop = "numerics"


FAILURE_TYPES: dict[str, type[PropertyFailure]] = {
    cls.prop: cls for cls in (TargetRaised, ContractViolation, InputModified, NumericsMismatch)
}


@dataclass
class Failure:
    prop: str
    message: str


@dataclass
class CaseReport:
    """What happened on one case: failures, comparisons and the replay command."""

    case: Case
    target: str
    device: str
    failures: list[Failure] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    seconds: float = 0.0
    unsupported: str | None = None  # the target declared this input outside its support: not called
    process: str | None = None  # crash, timeout, protocol or fatal: the worker was lost on this case

    @property
    def passed(self) -> bool:
        return not self.failures

    def replay(self) -> str:
        return self.case.replay_command(self.target, self.device)

    def message(self, failure: Failure) -> str:
        return (
            f"[{failure.prop}] {failure.message}\n"
            f"  case:   {self.case.describe()}\n"
            f"  replay: {self.replay()}"
        )

    def raise_for_failures(self) -> None:
        """Raise the first failed property (in :data:`PROPERTIES` order) as its own type."""
        if self.failures:
            first = self.failures[0]
            raise FAILURE_TYPES.get(first.prop, PropertyFailure)(self.message(first), self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.to_json(),
            "describe": self.case.describe(),
            "target": self.target,
            "device": self.device,
            "passed": self.passed,
            "failures": [{"prop": f.prop, "message": f.message} for f in self.failures],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "seconds": self.seconds,
            "replay": self.replay(),
            "unsupported": self.unsupported,
            "process": self.process,
        }


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Fill memory from ``torch.empty`` and friends with NaN while a target runs.

    Uses ``torch.utils.deterministic.fill_uninitialized_memory`` (it acts only
    under ``use_deterministic_algorithms``, which we turn on in warn-only mode
    so that no target is refused for a non-deterministic op).  The flag is
    set through ``torch._C`` where it exists: the public setter also imports
    ``torch._inductor`` for its own flag, 1.4 s on the first call.
    """
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    set_flag = getattr(torch._C, "_set_deterministic_algorithms", torch.use_deterministic_algorithms)
    set_flag(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        set_flag(det, warn_only=warn_only)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage, padding and offsets included."""
    return storage_view(t).clone()


SUPPORTS_ATTRIBUTE = "fuseaudit_supports"


def declared_unsupported(spec: OpSpec, impl: Callable[..., Any], inputs: dict[str, torch.Tensor],
                         params: dict[str, Any]) -> str | None:
    """Why the target declares these inputs outside its support, or None where it takes them.

    A target may carry a predicate ``impl.fuseaudit_supports(*inputs, **params)``
    returning a reason (a string) for inputs it does not take, asked *before*
    each call: such a case is skipped and counted, not judged.  It complements
    the audit's static options (``--dtypes``, ``--contiguous-only``,
    ``--head-dims``) for limits those cannot express (the SDPA backends' own
    checks, for instance).  A target that accepts an input and then raises on
    it still fails ``runs``.
    """
    probe = getattr(impl, SUPPORTS_ATTRIBUTE, None)
    if probe is None:
        return None
    reason = probe(*(inputs[n] for n in spec.input_names), **params)
    return str(reason) if reason else None


def call_target(spec: OpSpec, impl: Callable[..., Any], inputs: dict[str, torch.Tensor],
                params: dict[str, Any]) -> Any:
    """Call ``impl`` with the canonical signature: inputs positional, params by keyword."""
    return impl(*(inputs[n] for n in spec.input_names), **params)


# ---------------------------------------------------------------------------
# Calling the target
# ---------------------------------------------------------------------------

@dataclass
class Called:
    """What one call of the target gave the judge.

    ``status``: ok, unsupported, raised, or how the worker was lost (crash,
    timeout, protocol, fatal); ``outputs``: each output's description (the
    keys of :data:`fuseaudit.channel.OUTPUT_KEYS`); ``values``: the judge's
    copy of each output the worker could copy, else None; ``changed``: the
    inputs whose storage differs, byte for byte, from what the judge made.
    """

    status: str
    message: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    call_id: int = 0


class Caller(Protocol):
    """Calls the target on the judge's inputs; never raises for what the target does."""

    def call(self, spec: OpSpec, inputs: dict[str, torch.Tensor], params: dict[str, Any], *,
             keep: bool = False, same_buffers: bool = False) -> Called: ...


def output_slots(spec: OpSpec, inputs: dict[str, torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape every output must have: those of the first input."""
    first = inputs[spec.inputs[0].name]
    return [(first.dtype, tuple(first.shape))] * len(spec.outputs)


class InProcess:
    """The target called in this process (no isolation: for your own tests and the reference suite)."""

    def __init__(self, impl: Callable[..., Any], *, device: str):
        self.impl = impl
        self.device = device
        self._last: dict[str, torch.Tensor] | None = None
        self._kept: dict[int, list[Any]] = {}
        self._calls = 0

    def call(self, spec: OpSpec, inputs: dict[str, torch.Tensor], params: dict[str, Any], *,
             keep: bool = False, same_buffers: bool = False) -> Called:
        from .worker import raised

        self._calls += 1
        if same_buffers and self._last is not None:
            work = self._last
            for name, t in inputs.items():
                storage_view(work[name]).copy_(storage_view(t))
        else:
            work = {n: _copy_layout(t) for n, t in inputs.items()}
        self._last = work
        try:
            reason = declared_unsupported(spec, self.impl, work, params)
        except Exception as exc:
            return Called("raised", f"its {SUPPORTS_ATTRIBUTE} declaration {raised(exc)}")
        if reason:
            return Called("unsupported", reason)
        start = time.perf_counter()
        try:
            with poisoned_allocations():
                got = as_tuple(call_target(spec, self.impl, work, params))
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
        except Exception as exc:
            return Called("raised", raised(exc), seconds=time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if keep:
            self._kept[self._calls] = list(got)
        called = self._collect(spec, list(got), work, inputs)
        called.seconds, called.call_id = seconds, self._calls
        return called

    def close(self) -> None:
        self._last = None
        self._kept.clear()

    def count(self, spec: OpSpec, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> tuple[str, Any]:
        """``("ok", count)`` or ``("untrusted" | "raised", message)``: kernels one call launches."""
        from .launches import LaunchCountError, count_launches
        from .worker import raised

        work = {n: _copy_layout(t) for n, t in inputs.items()}
        try:
            count = count_launches(lambda: call_target(spec, self.impl, work, params), device=self.device)
        except LaunchCountError as exc:
            return "untrusted", str(exc)
        except Exception as exc:
            return "raised", raised(exc)
        return "ok", count.to_dict()

    def resend(self, spec: OpSpec, inputs: dict[str, torch.Tensor], call_id: int) -> Called:
        return self._collect(spec, self._kept.get(call_id, []), {}, inputs, check_inputs=False)

    def _collect(self, spec: OpSpec, got: list[Any], work: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                 check_inputs: bool = True) -> Called:
        from .worker import describe_output

        slots = [torch.full(shape, math.nan, dtype=dtype, device=self.device) for dtype, shape in
                 output_slots(spec, inputs)]
        metas = [describe_output(out, slots[i] if i < len(slots) else None, work) for i, out in enumerate(got)]
        values = [slots[i] if i < len(slots) and m["copied"] else None for i, m in enumerate(metas)]
        changed = [n for n in work if check_inputs and not torch.equal(storage_view(work[n]), storage_view(inputs[n]))]
        return Called("ok", outputs=metas, values=values, changed=changed)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a uint8 tensor over the same memory."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    return raw.set_(t.untyped_storage())


def _copy_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its own storage of the same bytes, offset and strides."""
    raw = storage_view(t).clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(raw.untyped_storage(), t.storage_offset(),
                                                                 t.shape, t.stride())


# ---------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------

def _contract(spec: OpSpec, called: Called, inputs: dict[str, torch.Tensor]) -> str | None:
    """The first way the outputs are not what the signature says, from their descriptions."""
    got = called.outputs
    if len(got) != len(spec.outputs):
        return f"returned {len(got)} output(s), expected {len(spec.outputs)} ({', '.join(spec.outputs)})"
    first = inputs[spec.inputs[0].name]
    for name, m in zip(spec.outputs, got):
        if not m["tensor"]:
            return f"output {name} is a {m['type']}, not a torch.Tensor"
        if not m["exact"]:
            return f"output {name} is a {m['type']}, a subclass of torch.Tensor; outputs must be plain tensors"
        if m["layout"] != "torch.strided":
            return f"output {name} has layout {m['layout']}, expected a dense strided tensor"
        if tuple(m["shape"]) != tuple(first.shape):
            return f"output {name} has shape {tuple(m['shape'])}, expected {tuple(first.shape)}"
        if m["dtype"] != str(first.dtype).removeprefix("torch."):
            return f"output {name} has dtype {m['dtype']}, expected {str(first.dtype).removeprefix('torch.')}"
        if not _device_matches(m["device"], first.device):
            return f"output {name} is on {m['device'] or 'no device'}, expected {first.device}"
        if m["alias"] is not None:
            return f"output {name} shares memory with input {m['alias']}; outputs must be new tensors"
        if not m["copied"]:
            return f"output {name} could not be read" + (f": {m['note']}" if m["note"] else "")
    return None


def _device_matches(text: str, device: torch.device) -> bool:
    try:
        return torch.device(text) == device
    except (RuntimeError, ValueError):
        return False


def judge_case(spec: OpSpec, caller: Caller, case: Case, *, device: str, target: str,
               inputs: dict[str, torch.Tensor] | None = None, keep: bool = False,
               same_buffers: bool = False) -> tuple[CaseReport, Called]:
    """Check every property of :data:`PROPERTIES` on ``case``, the target called through ``caller``.

    Eager and the oracle come from the judge's own inputs (made here from
    the case, or ``inputs``), never from memory the target could reach.
    """
    report = CaseReport(case=case, target=target, device=device)
    inputs = materialize(case, device) if inputs is None else inputs
    called = caller.call(spec, inputs, case.params, keep=keep, same_buffers=same_buffers)
    report.seconds = called.seconds
    if called.status == "unsupported":
        report.unsupported = called.message or "declared unsupported"
        _inputs_unchanged(report, called)
        return report, called
    if called.status != "ok":
        if called.status != "raised":
            report.process = called.status
        report.failures.append(Failure("runs", called.message))
        _inputs_unchanged(report, called)
        return report, called
    problem = _contract(spec, called, inputs)
    if problem:
        report.failures.append(Failure("contract", problem))
    _inputs_unchanged(report, called)
    if problem:
        return report, called
    eager = spec.run_eager(inputs, case.params)
    oracle = spec.run_oracle(inputs, case.params)
    eager_defines = spec.rows_with_non_finite_inputs(inputs)
    for name, g, e, o in zip(spec.outputs, called.values, eager, oracle):
        # the op's own error analysis applies to its main output; h = x + residual is pointwise
        f32 = spec.float32_scale(inputs, case.params, o) if name == spec.outputs[0] else None
        cmp = compare(name, g, e, o, dtype=case.torch_dtype, fallback_ulps=spec.fallback_ulps, float32_scale=f32,
                      eager_defines=eager_defines)
        report.comparisons.append(cmp)
        if not cmp.passed:
            report.failures.append(Failure("numerics", f"output {name}: {cmp.reason}"))
    return report, called


def _inputs_unchanged(report: CaseReport, called: Called) -> None:
    if called.changed:
        report.failures.append(Failure(
            "inputs_unchanged", f"the call modified input(s) {', '.join(called.changed)} (their storage changed)"))


def run_case(
    spec: OpSpec,
    impl: Callable[..., Any],
    case: Case,
    *,
    device: str,
    target: str,
) -> CaseReport:
    """Check every property of :data:`PROPERTIES` for ``impl`` on ``case``, in this process.

    Never raises for a misbehaving target: what went wrong is in the report.
    """
    return judge_case(spec, InProcess(impl, device=device), case, device=device, target=target)[0]
