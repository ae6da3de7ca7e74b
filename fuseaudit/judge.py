"""The judge: draws the cases, runs the phases of an audit, and logs every step as an event.

It runs in the auditing process and never imports the target: the target is
reached through a caller (:class:`fuseaudit.remote.Remote`, a worker process;
or :class:`fuseaudit.check.InProcess` for ``--in-process``), and every case is
judged by :func:`fuseaudit.check.judge_case` from inputs the judge keeps.

Phases, in the order a job lists them:

``edge``         the catalog's edge cases (:mod:`fuseaudit.edges`): every dtype,
                 regime and layout, the widths models use and kernels switch
                 at, more rows than a tile; each failing property is shrunk
                 among the cases near its first failing edge case, within
                 :data:`EDGE_SHRINK_CALLS` calls.
``search``       Hypothesis draws cases within the declared support; each
                 failing property is shrunk to its own minimal case
                 (``minimal`` events), then replayed in a fresh worker: one
                 that passes there is marked ``flaky`` (it depends on earlier
                 calls).  ``shrink_seconds`` after the audit's first failure
                 (edge or search) shrinking stops in both phases: the
                 smallest failing case found by then is reported.  A hang,
                 here or in the edge phase, ends the calls of new cases (each
                 attempt to shrink it would cost the timeout).
``replay``       the one case of ``--case``.
``launches``     kernels per call, on up to :data:`LATER_CASES` cases that ran
                 in the search (the smallest, the largest, another dtype).
``determinism``  two calls on identical inputs give the same bits, on those cases.
``state``        on those cases: a second call on the *same buffers* holding
                 new values must be judged right (a cache keyed by pointer or
                 shape fails), and the first call's outputs must be unchanged
                 after it (a view of a reused workspace fails ``contract``).
``sanitize``     (``--sanitize``, CUDA) the edge cases and every minimal
                 failing case again under compute-sanitizer, a process per
                 tool (:mod:`fuseaudit.sanitize`).

Events (dicts with key ``event``): ``setup``, ``phase`` / ``phase_end``,
``start`` (phase, case), ``done`` (phase, report), ``unsupported``,
``minimal`` (prop, report), ``flaky`` (prop, case), ``lost`` (kind, phase,
message: a worker was killed and a fresh one forked), ``launches`` (case,
count or error), ``determinism`` (case, status, message), ``sanitize``
(tool, status, reason or run), ``note``, ``finished``.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from .case import Case, materialize
from .catalog import OpSpec, get_op
from .check import Called, CaseReport, Failure, judge_case

PHASES = ("edge", "search", "replay", "launches", "determinism", "state", "sanitize")
EDGE_SHRINK_CALLS = 60  # calls to shrink one failing edge case
LATER_CASES = 3  # cases of the search that launches and determinism run on
STATE_CASES = 2  # cases of the search that the state phase runs on
STATE_SEED_STEP = 1_000_003  # the second call's values: another seed of the same case
SANITIZE_CASE_S = 60.0  # a case under compute-sanitizer (a compile, then a call many times slower)

Emit = Callable[[dict[str, Any]], None]


@dataclass
class AuditJob:
    """What one audit checks; JSON-serialisable, so it is recorded with the result."""

    op: str
    target: str
    device: str  # "cpu", "cuda" or "cuda:K", already resolved
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
    shrink_seconds: float = 300.0  # shrinking budget of the edge phase and the search, from the first failure on
    sanitize: list[str] | None = None  # compute-sanitizer tools of the sanitize phase
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AuditJob:
        return cls(**json.loads(text))


class SearchStopped(BaseException):
    """Ends the search at once (a hang); a ``BaseException`` so that Hypothesis does not shrink it."""


def environment(device: str) -> dict[str, Any]:
    """Versions and the device, for the record (the judge's: the worker forks from the same install)."""
    import hypothesis
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        triton_version = None
    from . import __version__

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"CPU {platform.processor() or platform.machine()} (Triton interpreter)"
    return {"device": device, "device_name": name, "torch": torch.__version__, "triton": triton_version,
            "hypothesis": hypothesis.__version__, "python": platform.python_version(), "fuseaudit": __version__,
            "platform": platform.platform()}


def bitwise_difference(names: tuple[str, ...], first: list[Any], second: list[Any]) -> tuple[str, str]:
    """``("equal" | "differ", message)`` for two calls' outputs (the judge's copies)."""
    import torch

    if len(first) != len(second):
        return "differ", f"the two calls returned {len(first)} and {len(second)} outputs"
    for name, a, b in zip(names, first, second):
        if a is None or b is None:
            return "differ", f"output {name} could be read from one call and not the other"
        if a.numel() == 0:
            continue
        ab = a.contiguous().view(torch.uint8).reshape(a.numel(), -1)
        bb = b.contiguous().view(torch.uint8).reshape(b.numel(), -1)
        differs = (ab != bb).any(dim=1)
        if bool(differs.any()):
            flat = int(differs.nonzero()[0])
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
            av, bv = a.reshape(-1)[flat].item(), b.reshape(-1)[flat].item()
            return "differ", (f"{int(differs.sum())} element(s) of output {name} differ; first at {idx}: "
                              f"{av!r} then {bv!r}")
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


class Judge:
    """Runs one :class:`AuditJob` against ``caller``, reporting every step through ``emit``."""

    def __init__(self, job: AuditJob, caller: Any, emit: Emit):
        self.job = job
        self.caller = caller
        self._emit = emit
        self.edge_set: list[Case] = []  # the edge phase's cases, for the sanitize phase
        self.minimal_cases: list[str] = []  # every minimal failing case (JSON), for the sanitize phase
        self.spec: OpSpec = get_op(job.op)
        self.device = job.device
        self.ran: list[Case] = []  # supported cases that returned outputs, for the later phases
        self.ran_edge: list[Case] = []  # edge cases that ran: for the later phases only if the search ran none
        self.hung = False  # a call hung: no new cases are called after it
        self.first_failure: float | None = None  # when the audit's first failure was judged: shrinking's clock
        self._lost_seen = 0

    def run(self) -> None:
        for phase in self.job.phases:
            self.emit({"event": "phase", "phase": phase})
            getattr(self, f"_phase_{phase}")()
            self.emit({"event": "phase_end", "phase": phase})
        self.emit({"event": "finished"})

    def emit(self, event: dict[str, Any]) -> None:
        if event["event"] == "minimal":
            self.minimal_cases.append(event["report"]["case"])
        self._emit(event)

    # -- one judged call --------------------------------------------------------
    def _judge(self, case: Case, phase: str, **kw: Any) -> tuple[CaseReport, Called]:
        self.emit({"event": "start", "phase": phase, "case": case.to_json()})
        report, called = judge_case(self.spec, self.caller, case, device=self.device, target=self.job.target, **kw)
        self._note_lost(phase, report)
        if report.unsupported:
            self.emit({"event": "unsupported", "phase": phase, "case": case.to_json(),
                       "describe": case.describe(), "reason": report.unsupported})
        else:
            self.emit({"event": "done", "phase": phase, "report": report.to_dict()})
        if called.status == "ok" and not report.unsupported and phase in ("edge", "search", "replay"):
            (self.ran_edge if phase == "edge" else self.ran).append(case)
        if report.failures and self.first_failure is None and phase in ("edge", "search"):
            self.first_failure = time.monotonic()
        return report, called

    def _note_lost(self, phase: str, report: CaseReport | None = None, message: str = "") -> None:
        lost = getattr(self.caller, "lost", [])
        for kind in lost[self._lost_seen:]:
            self.emit({"event": "lost", "kind": kind, "phase": phase,
                       "message": report.failures[0].message if report and report.failures else message})
        self._lost_seen = len(lost)

    def _later_cases(self, n: int) -> list[Case]:
        """Up to ``n`` distinct cases that ran: the smallest, the largest, then other dtypes."""
        if self.job.case is not None:
            return [Case.from_json(self.job.case)]
        # the search's cases (the edge set's widest rows cost seconds a call under the interpreter)
        unique = list({c.to_json(): c for c in self.ran or self.ran_edge}.values())
        if not unique:
            return []
        by_size = sorted(unique, key=Case.numel)
        picked = [by_size[0], by_size[-1]]
        dtypes = {c.dtype for c in picked}
        picked += [c for c in by_size if c.dtype not in dtypes][:1]
        picked += by_size[1:-1]
        return list({c.to_json(): c for c in picked}.values())[:n]

    # -- phases -----------------------------------------------------------------
    def _phase_edge(self) -> None:
        """The catalog's edge cases; each failing property then shrunk from its first failing edge case."""
        from .edges import edge_cases, shrink

        first: dict[str, CaseReport] = {}
        self.edge_set = edge_cases(self.spec, profile=self.job.profile, dtypes=self.job.dtypes,
                                   layouts=self.job.layouts, head_dims=self.job.head_dims)
        for case in self.edge_set:
            report, _ = self._judge(case, "edge")
            if report.process == "timeout":
                self._stop_at_hang()
                return
            for f in report.failures:
                first.setdefault(f.prop, report)
        for prop, report in first.items():
            if report.process is not None or self.hung:
                continue  # a crash is replayed by the command it prints; a hang is never called again
            smallest: dict[str, Any] = {"report": report, "cut": False}

            def fails(case: Case, prop: str = prop, smallest: dict[str, Any] = smallest) -> bool:
                if self.hung:
                    return False
                if time.monotonic() >= self._shrink_deadline():  # a compiling target pays seconds a call
                    smallest["cut"] = True
                    return False
                again, _ = self._judge(case, "edge")
                if again.process == "timeout":
                    self.hung = True
                if prop in {f.prop for f in again.failures}:
                    smallest["report"] = again
                    return True
                return False

            shrink(report.case, fails, budget=EDGE_SHRINK_CALLS)
            if smallest["cut"]:
                self.emit({"event": "note", "message": f"shrinking the edge phase's {prop} failure stopped at the "
                                                       f"shrink time ({self.job.shrink_seconds:g} s): the case shown "
                                                       "is the smallest found by then"})
            self.emit({"event": "minimal", "prop": prop, "report": smallest["report"].to_dict()})
            self._replay_minimal([(prop, smallest["report"])])

    def _shrink_deadline(self) -> float:
        """When shrinking stops: ``shrink_seconds`` after the audit's first failure, in the edge phase or the search."""
        return (self.first_failure or time.monotonic()) + self.job.shrink_seconds

    def _phase_search(self) -> None:
        from .strategies import cases

        if self.hung:
            self.emit({"event": "note", "message": "no search: the target hung in the edge phase"})
            return
        strategy = cases(self.spec, profile=self.job.profile, dtypes_allowed=_tuple(self.job.dtypes),
                         layouts_allowed=_tuple(self.job.layouts), head_dims=_tuple(self.job.head_dims))
        self._hypothesis(strategy, "search", self.job.examples)

    def _stop_at_hang(self) -> None:
        self.hung = True
        self.emit({"event": "note", "message": "the audit stopped calling new cases at the first hang: a hang is "
                                               "not shrunk (every attempt would cost the timeout)"})

    def _hypothesis(self, strategy: Any, phase: str, examples: int) -> None:
        """``strategy`` through Hypothesis, each failing property shrunk to its own minimal case."""
        from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
        from hypothesis import seed as hypothesis_seed

        failed: set[str] = set()

        def check(case: Case) -> None:
            key = case.to_json()
            if failed and key not in failed and time.monotonic() > self._shrink_deadline():
                return  # shrink budget spent: report the smallest failing case found so far
            report, _ = self._judge(case, phase)
            if report.unsupported:
                reject()  # outside the target's declared support: not an example
            if report.process == "timeout":
                raise SearchStopped()
            if not report.passed:
                failed.add(key)
            report.raise_for_failures()

        test = settings(
            parent=settings.get_profile("default"),  # not the caller's loaded profile
            max_examples=examples,
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
        except SearchStopped:
            self._stop_at_hang()
        except Exception as exc:
            from hypothesis.errors import HypothesisException

            failures = property_failures(exc)
            if not failures:
                if not isinstance(exc, HypothesisException):
                    raise
                self.emit({"event": "note", "message": f"Hypothesis: {type(exc).__name__}: {exc}"})
            for failure in failures:
                self.emit({"event": "minimal", "prop": failure.prop, "report": failure.report.to_dict()})
            self._replay_minimal([(f.prop, f.report) for f in failures])

    def _replay_minimal(self, failures: list[tuple[str, CaseReport]]) -> None:
        """Each minimal case again, in a fresh worker: a failure that does not come back is flaky."""
        fresh = getattr(self.caller, "fresh", None)
        if fresh is None:
            return
        for prop, report in failures:
            if report.process is not None:
                continue  # a crash is replayed by the command it prints
            fresh()
            again, _ = judge_case(self.spec, self.caller, report.case, device=self.device, target=self.job.target)
            self._note_lost("search", again)
            if prop not in {f.prop for f in again.failures}:
                self.emit({"event": "flaky", "prop": prop, "case": report.case.to_json()})

    def _phase_replay(self) -> None:
        self._judge(Case.from_json(self.job.case), "replay")

    def _phase_launches(self) -> None:
        chosen = self._later_cases(LATER_CASES)
        base = {"event": "launches", "expected": self.job.expected_launches}
        if not self.job.count_launches:
            self.emit({**base, "case": None, "error": self.job.launches_note or "launches are not counted here"})
            return
        if not chosen:
            self.emit({**base, "case": None, "error": "not counted: no drawn case ran"})
            return
        for case in chosen:
            self.emit({"event": "start", "phase": "launches", "case": case.to_json()})
            status, data = self.caller.count(self.spec, materialize(case, self.device), case.params)
            self._note_lost("launches", message=str(data))
            entry = {**base, "case": case.to_json()}
            if status == "ok":
                self.emit({**entry, "count": data, "describe": _describe_count(data)})
            elif status == "untrusted":
                self.emit({**entry, "error": f"the count cannot be trusted: {data}"})
            else:
                self.emit({**entry, "raised": True, "error": f"the target failed inside the launch counter: {data}"})

    def _phase_determinism(self) -> None:
        for case in self._later_cases(LATER_CASES):
            self.emit({"event": "start", "phase": "determinism", "case": case.to_json()})
            inputs = materialize(case, self.device)
            first = self.caller.call(self.spec, inputs, case.params)
            second = self.caller.call(self.spec, inputs, case.params) if first.status == "ok" else first
            self._note_lost("determinism", message=second.message)
            if first.status != "ok" or second.status != "ok":
                bad = first if first.status != "ok" else second
                self._failed_call(case, bad, "determinism")
                self.emit({"event": "determinism", "case": case.to_json(), "status": "skip",
                           "message": f"not compared: {bad.message}"})
                continue
            status, message = bitwise_difference(self.spec.outputs, first.values, second.values)
            if status == "differ":
                message = f"two calls on identical inputs: {message}"
            self.emit({"event": "determinism", "case": case.to_json(), "status": status, "message": message})

    def _failed_call(self, case: Case, called: Called, phase: str) -> None:
        """A call that failed outside the search: a ``runs`` failure on that case."""
        if called.status == "unsupported":
            return
        report = CaseReport(case=case, target=self.job.target, device=self.device,
                            failures=[Failure("runs", called.message)],
                            process=None if called.status == "raised" else called.status)
        self.emit({"event": "done", "phase": phase, "report": report.to_dict()})

    def _phase_state(self) -> None:
        for case in self._later_cases(STATE_CASES):
            first, called = self._judge(case, "state", keep=True)
            if not first.passed or called.status != "ok":
                continue
            other = replace(case, seed=case.seed + STATE_SEED_STEP)
            second, _ = judge_case(self.spec, self.caller, other, device=self.device, target=self.job.target,
                                   same_buffers=True)
            self._note_lost("state", second)
            if not second.passed:
                for f in second.failures:
                    f.message = (f"a second call on the same buffers (same pointers, shapes and strides) holding "
                                 f"new values (seed {other.seed}): {f.message}")
                second.case = case
            self.emit({"event": "done", "phase": "state", "report": second.to_dict()})
            again = self.caller.resend(self.spec, materialize(case, self.device), called.call_id)
            self._note_lost("state", message=again.message)
            report = CaseReport(case=case, target=self.job.target, device=self.device)
            if again.status != "ok":
                report.failures.append(Failure("runs", again.message))
            else:
                status, message = bitwise_difference(self.spec.outputs, called.values, again.values)
                if status == "differ":
                    report.failures.append(Failure(
                        "contract", f"an output changed after a later call (it is a view of memory the target "
                                    f"reuses, not a new tensor): {message}"))
            self.emit({"event": "done", "phase": "state", "report": report.to_dict()})

    def _phase_sanitize(self) -> None:
        """The edge cases and every minimal failing case again, under each compute-sanitizer tool."""
        from .sandbox import worker_environment
        from .sanitize import run_tool

        skip, executable = _sanitize_skip(self.device, self.hung)
        tools = self.job.sanitize or []
        if skip:
            self.emit({"event": "sanitize", "status": "skip", "tools": tools, "reason": skip})
            return
        cases = [self.job.case] if self.job.case else [c.to_json() for c in self.edge_set]
        cases = list(dict.fromkeys([*self.minimal_cases, *cases]))  # the failing ones first
        env = worker_environment(self.device, getattr(self.caller, "env", None))
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # each tensor its own allocation: memcheck knows its bounds
        for tool in tools:
            self.emit({"event": "start", "phase": "sanitize", "tool": tool})
            run = run_tool(tool, executable=executable, op=self.spec.name,
                           target=getattr(self.caller, "target", self.job.target), device=self.device,
                           cases=cases, timeout=SANITIZE_CASE_S * (len(cases) + 1), env=env)
            self.emit({"event": "sanitize", "status": "ran", "tool": tool, "cases": cases, "run": run.to_dict()})


def _sanitize_skip(device: str, hung: bool) -> tuple[str | None, str]:
    """Why the sanitize phase cannot run here (None where it can), and the tool's path."""
    from .sanitize import find_tool

    if not device.startswith("cuda"):
        return "compute-sanitizer checks CUDA kernels; this audit ran on the CPU", ""
    if hung:
        return "the target hung: it is not called again", ""
    tool = find_tool()
    if tool is None:
        return "compute-sanitizer not found (looked on PATH, in $CUDA_HOME/bin and /usr/local/cuda/bin)", ""
    return None, tool


def _describe_count(count: dict[str, Any]) -> str:
    from .launches import short_name

    names = ", ".join(short_name(k) for k in count["kernels"][:8]) or "none"
    more = f", ... ({len(count['kernels']) - 8} more)" if len(count["kernels"]) > 8 else ""
    extra = f" (+{count['memcpy']} memcpy, {count['memset']} memset)" if count["memcpy"] or count["memset"] else ""
    return f"{len(count['kernels'])} kernel(s){extra}: {names}{more}"
