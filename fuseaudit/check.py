"""Run one case against one implementation and check every property.

This is the one code path behind the property tests of the reference kernels
and the audit of third-party kernels.  Properties, in the order checked:

``runs``              the call returns (an exception on a supported input fails)
``contract``          number, type, shape, dtype and device of the outputs; outputs
                      are new tensors, not views of an input
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
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

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
        }


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Fill memory from ``torch.empty`` and friends with NaN while a target runs.

    Uses ``torch.utils.deterministic.fill_uninitialized_memory`` (it acts only
    under ``use_deterministic_algorithms``, which we turn on in warn-only mode
    so that no target is refused for a non-deterministic op).
    """
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage, padding and offsets included."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage())
    return raw.clone()


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


def _contract(spec: OpSpec, case: Case, got: tuple[Any, ...], inputs: dict[str, torch.Tensor]) -> str | None:
    if len(got) != len(spec.outputs):
        return f"returned {len(got)} output(s), expected {len(spec.outputs)} ({', '.join(spec.outputs)})"
    first = inputs[spec.inputs[0].name]
    input_storages = {t.untyped_storage().data_ptr() for t in inputs.values()}
    for name, out in zip(spec.outputs, got):
        if not isinstance(out, torch.Tensor):
            return f"output {name} is a {type(out).__name__}, not a torch.Tensor"
        if tuple(out.shape) != tuple(first.shape):
            return f"output {name} has shape {tuple(out.shape)}, expected {tuple(first.shape)}"
        if out.dtype != first.dtype:
            return f"output {name} has dtype {out.dtype}, expected {first.dtype}"
        if out.device != first.device:
            return f"output {name} is on {out.device}, expected {first.device}"
        if out.numel() and out.untyped_storage().data_ptr() in input_storages:
            return f"output {name} shares memory with an input; outputs must be new tensors"
    return None


def run_case(
    spec: OpSpec,
    impl: Callable[..., Any],
    case: Case,
    *,
    device: str,
    target: str,
) -> CaseReport:
    """Check every property of :data:`PROPERTIES` for ``impl`` on ``case``.

    Never raises for a misbehaving target: what went wrong is in the report.
    """
    report = CaseReport(case=case, target=target, device=device)
    inputs = materialize(case, device)
    try:
        report.unsupported = declared_unsupported(spec, impl, inputs, case.params)
    except Exception as exc:
        report.failures.append(Failure("runs", f"its {SUPPORTS_ATTRIBUTE} declaration raised "
                                               f"{type(exc).__name__}: {exc}"))
        return report
    if report.unsupported:
        return report
    before = {n: storage_bytes(t) for n, t in inputs.items()}
    start = time.perf_counter()
    try:
        with poisoned_allocations():
            got = as_tuple(call_target(spec, impl, inputs, case.params))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        report.failures.append(Failure(
            "runs", f"raised {type(exc).__name__}: {exc} (at {tb.filename}:{tb.lineno})"))
        report.seconds = time.perf_counter() - start
        return report
    report.seconds = time.perf_counter() - start

    problem = _contract(spec, case, got, inputs)
    if problem:
        report.failures.append(Failure("contract", problem))
    changed = [n for n, t in inputs.items() if not torch.equal(storage_bytes(t), before[n])]
    if changed:
        report.failures.append(Failure(
            "inputs_unchanged", f"the call modified input(s) {', '.join(changed)} (their storage changed)"))
    if problem:
        return report
    if changed:  # judge the outputs against the inputs the caller passed, not what the target left there
        inputs = materialize(case, device)

    eager = spec.run_eager(inputs, case.params)
    oracle = spec.run_oracle(inputs, case.params)
    for name, g, e, o in zip(spec.outputs, got, eager, oracle):
        # the op's own error analysis applies to its main output; h = x + residual is pointwise
        f32 = spec.float32_scale(inputs, case.params, o) if name == spec.outputs[0] else None
        cmp = compare(name, g, e, o, dtype=case.torch_dtype, fallback_ulps=spec.fallback_ulps, float32_scale=f32)
        report.comparisons.append(cmp)
        if not cmp.passed:
            report.failures.append(Failure("numerics", f"output {name}: {cmp.reason}"))
    return report
