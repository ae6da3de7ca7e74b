"""The side of an audit that calls the target: load it, run the phases, log every step.

Run in a child process by :mod:`fuseaudit.supervise` as
``python -m fuseaudit._audit_worker JOB.json RESULTS.jsonl`` (or in-process by
:func:`run_job` for debugging).  It never trusts the target: every call is
preceded by a ``start`` line naming the case and followed by a ``done``
line, each flushed before going on, so whoever reads the log knows the last
case started even if the process dies in the middle of the call.

Phases, in the order a job lists them:

``search``       Hypothesis draws cases within the declared support and runs
                 :func:`fuseaudit.check.run_case` on each; a failure raises its
                 property's exception, so Hypothesis shrinks every failing
                 property to its own minimal case (``minimal`` lines).  Once
                 ``shrink_seconds`` have passed since the first failure, new
                 cases are no longer run (they count as passing), so
                 shrinking ends with the smallest failing case found so far.
``replay``       :func:`run_case` on the one case of ``--case``.
``launches``     :func:`fuseaudit.launches.count_launches` on one case.
``determinism``  two calls on fresh copies of the same inputs must give
                 bitwise-equal outputs, on a few cases.

Events (one JSON object a line, key ``event``): ``setup`` (ok, env or
message), ``phase`` / ``phase_end``, ``start`` (phase, case), ``done``
(phase, report: :meth:`CaseReport.to_dict`), ``minimal`` (prop, report),
``launches`` (case, count, expected, error), ``determinism`` (case, status,
message), ``note`` (message), ``fatal`` (the CUDA context is lost; the process exits 3),
``error`` (an internal error of fuseaudit; exit 4), ``finished``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

EXIT_OK, EXIT_SETUP, EXIT_FATAL, EXIT_INTERNAL = 0, 5, 3, 4
PHASES = ("search", "replay", "launches", "determinism")

Emit = Callable[[dict[str, Any]], None]


@dataclass
class AuditJob:
    """Everything the worker needs; JSON-serialisable so it crosses the process boundary."""

    op: str
    target: str
    device: str  # "cpu" or "cuda", already resolved
    phases: list[str]
    examples: int = 50
    seed: int | None = None
    profile: str = "ci"
    dtypes: list[str] | None = None
    layouts: list[str] | None = None
    head_dims: list[int] | None = None
    expected_launches: int | None = None  # None: count and report, do not judge
    count_launches: bool = True  # False: launches cannot be counted for this target here
    launches_note: str = ""  # why launches are not judged or counted
    case: str | None = None  # a Case as JSON, for ``replay``
    shrink_seconds: float = 300.0  # shrinking budget, from the first failure on
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AuditJob:
        return cls(**json.loads(text))


class ContextLost(BaseException):
    """The CUDA context is unusable (an illegal access): nothing more can run in this process.

    A ``BaseException`` so that Hypothesis does not take it for a failure to shrink.
    """


_CUDA_FATAL = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
               "an illegal instruction", "misaligned address", "CUDA error")


def is_cuda_fatal(text: str) -> bool:
    """Whether an error message means the CUDA context is lost."""
    return any(marker in text for marker in _CUDA_FATAL)


def _raised(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(exc).__name__}: {exc}{where}"


def signature_problem(spec: Any, impl: Callable[..., Any], target: str) -> str | None:
    """Why ``impl`` cannot be called as ``spec.signature`` says (inputs positional, params by keyword)."""
    import inspect

    try:
        sig = inspect.signature(impl)
    except (TypeError, ValueError):  # a builtin or extension function: nothing to inspect
        return None
    try:
        sig.bind(*spec.input_names, **spec.defaults())
    except TypeError as exc:
        return (f"{target} has signature {sig}, which does not fit {spec.signature} "
                f"(inputs by position, parameters by keyword): {exc}")
    return None


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, for the record."""
    import hypothesis
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        triton_version = None
    from . import __version__

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU {platform.processor() or platform.machine()} (Triton interpreter)"
    return {"device": device, "device_name": name, "torch": torch.__version__, "triton": triton_version,
            "hypothesis": hypothesis.__version__, "python": platform.python_version(), "fuseaudit": __version__,
            "platform": platform.platform()}


# ---------------------------------------------------------------------------
# Cases for launches and determinism
# ---------------------------------------------------------------------------

def representative_cases(spec: Any, *, dtypes: list[str] | None = None, layouts: list[str] | None = None,
                         head_dims: list[int] | None = None) -> list[Any]:
    """Three small, fixed cases inside the declared support: the first is the launch-count case.

    They differ in shape (non-power-of-two widths, one just past a power of
    two), dtype, layout and keyword parameters.
    """
    from .case import Case

    order = [d for d in ("float32", "bfloat16", "float16") if not dtypes or d in dtypes]
    lays = [lay for lay in ("contiguous", "padded", "transposed") if not layouts or lay in layouts] or ["contiguous"]
    out = []
    for i in range(3):
        if spec.family == "attention":
            b, h, hkv, sq, sk = [(1, 4, 2, 20, 33), (2, 2, 2, 33, 17), (1, 2, 1, 16, 16)][i]
            dims_d = list(head_dims) if head_dims else [64, 80, 32]
            dims: dict[str, Any] = {"B": b, "H": h, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": dims_d[i % len(dims_d)]}
        else:
            lead, n = [((3, 5), 300), ((4,), 1000), ((2, 3), 129)][i]
            dims = {"lead": lead, "N": n}
        out.append(Case(
            op=spec.name,
            dtype=order[i % len(order)],
            dims=dims,
            layouts={inp.name: lays[i % len(lays)] for inp in spec.inputs},
            regime="normal",
            params={p.name: p.choices[i % len(p.choices)] for p in spec.params},
            seed=1234 + i,
        ))
    return out


# ---------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------

class Worker:
    """Runs one :class:`AuditJob`, reporting every step through ``emit``."""

    def __init__(self, job: AuditJob, emit: Emit):
        self.job = job
        self.emit = emit
        self.spec: Any = None
        self.impl: Any = None
        self.device = job.device

    # -- entry ----------------------------------------------------------------
    def run(self) -> int:
        if not self._setup():
            return EXIT_SETUP
        try:
            for phase in self.job.phases:
                self.emit({"event": "phase", "phase": phase})
                getattr(self, f"_phase_{phase}")()
                self.emit({"event": "phase_end", "phase": phase})
        except ContextLost as lost:
            self.emit({"event": "fatal", "message": str(lost)})
            return EXIT_FATAL
        except Exception as exc:  # a bug in fuseaudit itself, not in the target
            self.emit({"event": "error", "message": f"internal error: {_raised(exc)}",
                       "traceback": traceback.format_exc()})
            return EXIT_INTERNAL
        self.emit({"event": "finished"})
        return EXIT_OK

    def _setup(self) -> bool:
        from .catalog import get_op
        from .profiles import resolve_device
        from .targets import load_target

        try:
            # sets TRITON_INTERPRET=1 for the CPU before the target imports a kernel
            self.device = resolve_device(self.job.device)
            self.spec = get_op(self.job.op)
            self.impl = load_target(self.job.target, op=self.job.op)
            problem = signature_problem(self.spec, self.impl, self.job.target)
        except Exception as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            if not isinstance(exc, (ValueError, KeyError)) and type(exc).__name__ != "TargetError":
                message = f"could not load {self.job.target}: {type(exc).__name__}: {exc}"
            self.emit({"event": "setup", "ok": False, "message": message})
            return False
        if problem:
            self.emit({"event": "setup", "ok": False, "message": problem})
            return False
        self.emit({"event": "setup", "ok": True, "env": environment(self.device)})
        return True

    # -- one checked call -------------------------------------------------------
    def _observe(self, case: Any, phase: str) -> Any:
        """:func:`run_case` on ``case``, logged before and after."""
        from .check import run_case

        self.emit({"event": "start", "phase": phase, "case": case.to_json()})
        try:
            report = run_case(self.spec, self.impl, case, device=self.device, target=self.job.target)
        except Exception as exc:
            self._check_context(str(exc))
            raise
        for failure in report.failures:
            if failure.prop == "runs":
                self._check_context(failure.message)
        if report.unsupported:
            self.emit({"event": "unsupported", "phase": phase, "case": case.to_json(),
                       "describe": case.describe(), "reason": report.unsupported})
        else:
            self.emit({"event": "done", "phase": phase, "report": report.to_dict()})
        return report

    def _check_context(self, message: str) -> None:
        if self.device.startswith("cuda") and is_cuda_fatal(message):
            raise ContextLost(message)

    def _raised_report(self, case: Any, exc: BaseException, phase: str) -> None:
        from .check import CaseReport, Failure

        message = _raised(exc)
        self._check_context(message)
        report = CaseReport(case=case, target=self.job.target, device=self.device,
                            failures=[Failure("runs", message)])
        self.emit({"event": "done", "phase": phase, "report": report.to_dict()})

    def _cases(self) -> list[Any]:
        from .case import Case

        if self.job.case is not None:
            return [Case.from_json(self.job.case)]
        return representative_cases(self.spec, dtypes=self.job.dtypes, layouts=self.job.layouts,
                                    head_dims=self.job.head_dims)

    # -- phases -----------------------------------------------------------------
    def _phase_search(self) -> None:
        from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
        from hypothesis import seed as hypothesis_seed

        from .strategies import cases

        strategy = cases(self.spec, profile=self.job.profile, dtypes_allowed=_tuple(self.job.dtypes),
                         layouts_allowed=_tuple(self.job.layouts), head_dims=_tuple(self.job.head_dims))

        failed: set[str] = set()  # cases (as JSON) that failed
        clock: dict[str, float] = {}

        def check(case: Any) -> None:
            key = case.to_json()
            if failed and key not in failed and time.monotonic() - clock["first_failure"] > self.job.shrink_seconds:
                return  # shrink budget spent: report the smallest failing case found so far
            report = self._observe(case, "search")
            if report.unsupported:
                reject()  # outside the target's declared support: not an example
            if not report.passed:
                failed.add(key)
                clock.setdefault("first_failure", time.monotonic())
            report.raise_for_failures()

        test = settings(
            parent=settings.get_profile("default"),  # not the caller's loaded profile
            max_examples=self.job.examples,
            deadline=None,
            database=None,
            report_multiple_bugs=True,
            derandomize=False,
            print_blob=False,
            verbosity=Verbosity.quiet,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.generate, Phase.target, Phase.shrink),  # no explain phase
        )(given(strategy)(check))
        if self.job.seed is not None:
            test = hypothesis_seed(self.job.seed)(test)
        try:
            test()
        except Exception as exc:
            from hypothesis.errors import HypothesisException

            failures = property_failures(exc)
            if not failures:
                if not isinstance(exc, HypothesisException):
                    raise
                # e.g. a failure that did not reproduce: the observed cases still carry the verdicts
                self.emit({"event": "note", "message": f"Hypothesis: {type(exc).__name__}: {exc}"})
            for failure in failures:
                self.emit({"event": "minimal", "prop": failure.prop, "report": failure.report.to_dict()})

    def _phase_replay(self) -> None:
        self._observe(self._cases()[0], "replay")

    def _phase_launches(self) -> None:
        from .case import materialize
        from .check import call_target
        from .launches import LaunchCountError, count_launches

        case = self._cases()[0]
        base = {"event": "launches", "case": case.to_json(), "expected": self.job.expected_launches}
        if not self.job.count_launches:
            self.emit({**base, "error": self.job.launches_note or "launches are not counted for this target here"})
            return
        self.emit({"event": "start", "phase": "launches", "case": case.to_json()})
        inputs = materialize(case, self.device)
        reason = self._unsupported(case, inputs)
        if reason:
            self.emit({**base, "error": f"not counted: the target declares this case unsupported ({reason})"})
            return
        try:
            count = count_launches(lambda: call_target(self.spec, self.impl, inputs, case.params),
                                   device=self.device)
        except LaunchCountError as exc:
            self.emit({**base, "error": f"the count cannot be trusted: {exc}"})
            return
        except Exception as exc:
            self._raised_report(case, exc, "launches")
            self.emit({**base, "error": f"not counted: the target {_raised(exc)}"})
            return
        self.emit({**base, "count": count.to_dict(), "describe": count.describe()})

    def _phase_determinism(self) -> None:
        for case in self._cases():
            self.emit({"event": "start", "phase": "determinism", "case": case.to_json()})
            reason = self._unsupported(case)
            if reason:
                self.emit({"event": "determinism", "case": case.to_json(), "status": "skip",
                           "message": f"not compared: the target declares this case unsupported ({reason})"})
                continue
            try:
                first = self._fresh_call(case)
                second = self._fresh_call(case)
            except Exception as exc:
                self._raised_report(case, exc, "determinism")
                self.emit({"event": "determinism", "case": case.to_json(), "status": "skip",
                           "message": f"not compared: the target {_raised(exc)}"})
                continue
            status, message = bitwise_difference(self.spec.outputs, first, second)
            self.emit({"event": "determinism", "case": case.to_json(), "status": status, "message": message})

    def _unsupported(self, case: Any, inputs: dict[str, Any] | None = None) -> str | None:
        """The target's own reason not to take ``case`` (inputs made only when it declares per-input support)."""
        from .case import materialize
        from .check import SUPPORTS_ATTRIBUTE, declared_unsupported

        if getattr(self.impl, SUPPORTS_ATTRIBUTE, None) is None:
            return None
        try:
            inputs = materialize(case, self.device) if inputs is None else inputs
            return declared_unsupported(self.spec, self.impl, inputs, case.params)
        except Exception as exc:  # judged in the search phase (runs); here it only stops the call
            return f"its support declaration raised {type(exc).__name__}: {exc}"

    def _fresh_call(self, case: Any) -> tuple[Any, ...]:
        import torch

        from .case import materialize
        from .catalog import as_tuple
        from .check import call_target, poisoned_allocations

        inputs = materialize(case, self.device)
        with poisoned_allocations():
            out = as_tuple(call_target(self.spec, self.impl, inputs, case.params))
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out


def bitwise_difference(names: tuple[str, ...], first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[str, str]:
    """``("equal" | "differ" | "skip", message)`` for two calls' outputs."""
    import torch

    if len(first) != len(second):
        return "differ", f"the two calls returned {len(first)} and {len(second)} outputs"
    for name, a, b in zip(names, first, second):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return "skip", f"output {name} is not a tensor (see contract)"
        if a.shape != b.shape or a.dtype != b.dtype:
            return "differ", f"output {name}: {tuple(a.shape)} {a.dtype} then {tuple(b.shape)} {b.dtype}"
        if a.numel() == 0:
            continue
        ab = a.detach().contiguous().flatten().view(torch.uint8).reshape(a.numel(), -1)
        bb = b.detach().contiguous().flatten().view(torch.uint8).reshape(b.numel(), -1)
        differs = (ab != bb).any(dim=1)
        if bool(differs.any()):
            flat = int(differs.nonzero()[0])
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
            av, bv = a.reshape(-1)[flat].item(), b.reshape(-1)[flat].item()
            return "differ", (f"two calls on identical inputs differ in {int(differs.sum())} element(s) of output "
                              f"{name}; first at {idx}: {av!r} then {bv!r}")
    return "equal", "bitwise equal"


def property_failures(exc: BaseException) -> list[Any]:
    """The :class:`PropertyFailure` exceptions inside what Hypothesis raised (one, or a group)."""
    from .check import PropertyFailure

    found, stack, seen = [], [exc], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, PropertyFailure):
            found.append(e)
            continue
        stack.extend(getattr(e, "exceptions", None) or ())
        if e.__cause__ is not None:
            stack.append(e.__cause__)
    return found


def _tuple(values: list[Any] | None) -> tuple[Any, ...] | None:
    return tuple(values) if values else None


def run_job(job: AuditJob, emit: Emit) -> int:
    """Run ``job`` here, reporting through ``emit``; returns the worker's exit status."""
    return Worker(job, emit).run()


def _exit_with_parent() -> None:
    """End this process if the auditing parent dies (the child runs in its own session, so no signal reaches it)."""
    import os
    import threading

    parent = os.environ.get("FUSEAUDIT_PARENT_PID")
    if not parent or not hasattr(os, "getppid"):
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os._exit(EXIT_INTERNAL)

    threading.Thread(target=watch, name="fuseaudit-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """``python -m fuseaudit._audit_worker JOB.json RESULTS.jsonl``."""
    import faulthandler
    import os
    import signal

    faulthandler.enable()  # a segfault prints where it happened (to the log the parent reads)
    if hasattr(signal, "SIGUSR1"):  # the parent asks for a stack dump before killing a hung child
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    _exit_with_parent()
    job_path, results_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(job_path) as f:
        job = AuditJob.from_json(f.read())
    with open(results_path, "a", encoding="utf-8") as out:

        def emit(event: dict[str, Any]) -> None:
            out.write(json.dumps(event) + "\n")
            out.flush()  # on disk before the next step: the process may die in the target's call

        code = run_job(job, emit)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == EXIT_FATAL:
        os._exit(code)  # a lost CUDA context can hang or crash an orderly exit
    return code


if __name__ == "__main__":
    sys.exit(main())
