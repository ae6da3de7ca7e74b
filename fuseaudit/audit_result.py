"""From the worker's log to verdicts: what ``fuseaudit audit`` prints and writes as JSON.

:func:`assemble` reads the events of :mod:`fuseaudit._audit_worker` (and the
parent's ``crash`` events of :mod:`fuseaudit.supervise`) and gives each
property a verdict:

``runs``, ``contract``, ``inputs_unchanged``, ``numerics``
    FAIL when any case checked failed it (a crash or hang is a ``runs``
    failure); PASS when it was checked on at least one case and held on
    all; SKIP when no case got far enough to check it (``numerics`` needs a
    call that returned outputs of the right kind).  The case shown is the
    minimal one Hypothesis shrank to for that property; a property that was
    never the first to fail on a case (so Hypothesis did not shrink it)
    shows the smallest case it failed on; a crash shows the case that was
    running.
``launches``
    FAIL when the count differs from the expected one, PASS when equal,
    SKIP when it could not be counted or is not judged for this target.
``determinism``
    FAIL when two calls on the same inputs differ in any bit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ._audit_worker import AuditJob
from .case import Case
from .check import PROPERTIES
from .jsonio import jsonable

ALL_PROPERTIES = (*PROPERTIES, "launches", "determinism")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class FailureRecord:
    """One failing case of a property, ready to print and replay."""

    message: str
    source: str  # shrunk, observed, crash, timeout, fatal, launches, determinism
    case: str | None = None  # the Case as JSON
    describe: str = ""
    replay: str | None = None
    comparisons: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Verdict:
    prop: str
    status: str  # PASS, FAIL or SKIP
    summary: str
    cases: int = 0  # cases on which the property was evaluated
    failing_cases: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class AuditResult:
    """The outcome of one audit; :attr:`exit_code` is 1 when any property failed, else 0."""

    op: str
    target: str
    device: str
    mode: str  # "search" or "replay"
    verdicts: dict[str, Verdict]
    examples_requested: int
    examples_run: int
    seed: int | None
    profile: str
    declared: dict[str, Any]
    environment: dict[str, Any]
    elapsed_s: float = 0.0
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    replay_report: dict[str, Any] | None = None

    @property
    def failed(self) -> list[str]:
        return [p for p, v in self.verdicts.items() if v.status == FAIL]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["properties"] = d.pop("verdicts")
        d.update(exit_code=self.exit_code, passed=self.passed, failed=self.failed)
        return jsonable(d)

    def render(self) -> str:
        return render_text(self)




# ---------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------

def _failed_props(report: dict[str, Any]) -> set[str]:
    return {f["prop"] for f in report["failures"]}


def _evaluated(prop: str, failed: set[str]) -> bool:
    if prop == "runs":
        return True
    if prop in ("contract", "inputs_unchanged"):
        return "runs" not in failed
    return not failed & {"runs", "contract"}  # numerics


def _replay(job: AuditJob, case_json: str | None) -> str | None:
    if not case_json:
        return None
    return Case.from_json(case_json).replay_command(job.target, job.device)


def _record(job: AuditJob, prop: str, report: dict[str, Any], source: str) -> FailureRecord:
    message = next(f["message"] for f in report["failures"] if f["prop"] == prop)
    return FailureRecord(message=message, source=source, case=report["case"], describe=report["describe"],
                         replay=report.get("replay") or _replay(job, report["case"]),
                         comparisons=report.get("comparisons", []))


def _size(report: dict[str, Any]) -> tuple[int, str]:
    return Case.from_json(report["case"]).numel(), report["describe"]


def _check_verdict(prop: str, job: AuditJob, observed: list[dict[str, Any]], minimal: list[dict[str, Any]],
                   crashes: list[dict[str, Any]]) -> Verdict:
    evaluated = [r for r in observed if _evaluated(prop, _failed_props(r))]
    failing = [r for r in evaluated if prop in _failed_props(r)]
    records: list[FailureRecord] = []
    if prop == "runs":
        for c in crashes:
            case = c.get("case") or c.get("last_case")
            records.append(FailureRecord(message=c["message"], source=c["kind"], case=case,
                                         describe=Case.from_json(case).describe() if case else "",
                                         replay=_replay(job, case)))
    seen = set()
    for m in minimal:
        if m["prop"] == prop and m["report"]["case"] not in seen:
            seen.add(m["report"]["case"])
            records.append(_record(job, prop, m["report"], "shrunk"))
    if failing and not seen:
        records.append(_record(job, prop, min(failing, key=_size), "observed"))
    n_cases = len(evaluated) + (len(crashes) if prop == "runs" else 0)
    n_failing = len(failing) + (len(crashes) if prop == "runs" else 0)
    detail = {"worst": _worst_figures(evaluated)} if prop == "numerics" else {}
    if records:
        return Verdict(prop, FAIL, records[0].message, n_cases, n_failing, records, detail)
    if evaluated:
        return Verdict(prop, PASS, f"held on {len(evaluated)} case(s)", n_cases, detail=detail)
    if not observed:
        why = "no case completed" + (" (the process crashed)" if crashes else "")
    else:
        why = "no case got past " + ("runs" if prop != "numerics" else "runs and contract")
    return Verdict(prop, SKIP, f"not evaluated: {why}")


def _worst_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per output, the comparison furthest from the oracle in ulps over all cases checked, with its case."""
    worst: dict[str, Any] = {}
    for r in reports:
        for c in r.get("comparisons", []):
            if c["output"] not in worst or c["max_ulp_err"] > worst[c["output"]]["max_ulp_err"]:
                worst[c["output"]] = {**c, "case": r["case"], "describe": r["describe"]}
    return worst


def _launches_verdict(job: AuditJob, events: list[dict[str, Any]], crashes: list[dict[str, Any]]) -> Verdict:
    if "launches" not in job.phases:
        return Verdict("launches", SKIP, "not run")
    found = [e for e in events if e["event"] == "launches"]
    if not found:
        if any(c["phase"] == "launches" for c in crashes):
            return Verdict("launches", SKIP, "not counted: the process died while counting (see runs)")
        return Verdict("launches", SKIP, "not counted: the audit ended before this phase")
    e = found[-1]
    if "count" not in e:
        return Verdict("launches", SKIP, e.get("error", "not counted"))
    count = e["count"]
    detail = {"count": count, "expected": e["expected"], "case": e["case"]}
    if e["expected"] is None:
        note = f" ({job.launches_note})" if job.launches_note else ""
        return Verdict("launches", SKIP, f"not judged{note}: {count['count']} kernel(s): {_names(count['kernels'])}",
                       1, detail=detail)
    if count["count"] == e["expected"]:
        return Verdict("launches", PASS, f"{count['count']} kernel(s): {_names(count['kernels'])}", 1, detail=detail)
    message = f"one call launched {count['count']} kernel(s), expected {e['expected']}: {_names(count['kernels'])}"
    case = Case.from_json(e["case"])
    record = FailureRecord(message=message, source="launches", case=e["case"], describe=case.describe(),
                           replay=_replay(job, e["case"]))
    return Verdict("launches", FAIL, message, 1, 1, [record], detail)


def _names(kernels: list[str], shown: int = 8) -> str:
    more = f", ... ({len(kernels) - shown} more)" if len(kernels) > shown else ""
    return (", ".join(kernels[:shown]) or "none") + more


def _determinism_verdict(job: AuditJob, events: list[dict[str, Any]], crashes: list[dict[str, Any]]) -> Verdict:
    if "determinism" not in job.phases:
        return Verdict("determinism", SKIP, "not run")
    found = [e for e in events if e["event"] == "determinism"]
    compared = [e for e in found if e["status"] != "skip"]
    differ = [e for e in compared if e["status"] == "differ"]
    if differ:
        records = [FailureRecord(message=e["message"], source="determinism", case=e["case"],
                                 describe=Case.from_json(e["case"]).describe(), replay=_replay(job, e["case"]))
                   for e in differ]
        return Verdict("determinism", FAIL, differ[0]["message"], len(compared), len(differ), records)
    if compared:
        return Verdict("determinism", PASS, f"bitwise equal on {len(compared)} case(s)", len(compared))
    if found:
        return Verdict("determinism", SKIP, found[0]["message"])
    if any(c["phase"] == "determinism" for c in crashes):
        return Verdict("determinism", SKIP, "not compared: the process died (see runs)")
    return Verdict("determinism", SKIP, "not compared: the audit ended before this phase")


def assemble(events: list[dict[str, Any]], *, job: AuditJob, declared: dict[str, Any], elapsed_s: float,
             notes: list[str] | None = None) -> AuditResult:
    """The :class:`AuditResult` of a finished audit (the setup succeeded)."""
    observed = [e["report"] for e in events if e["event"] == "done"]
    minimal = [e for e in events if e["event"] == "minimal"]
    crashes = [e for e in events if e["event"] == "crash"]
    verdicts = {p: _check_verdict(p, job, observed, minimal, crashes) for p in PROPERTIES}
    verdicts["launches"] = _launches_verdict(job, events, crashes)
    verdicts["determinism"] = _determinism_verdict(job, events, crashes)
    env = next((e["env"] for e in events if e["event"] == "setup" and e.get("ok")), {})
    replayed = [e["report"] for e in events if e["event"] == "done" and e["phase"] == "replay"]
    notes = list(notes or []) + [e["message"] for e in events if e["event"] == "note"]
    unsupported = [e for e in events if e["event"] == "unsupported"]
    if unsupported:
        first = unsupported[0]
        notes.append(f"{len(unsupported)} drawn case(s) outside the target's declared support were skipped, "
                     f"e.g. {first['describe']}: {first['reason']}")
    if crashes and any(e["event"] == "phase" for e in events[events.index(crashes[0]):]):
        notes.append("after the crash a fresh process ran the remaining phases")
    return AuditResult(
        op=job.op, target=job.target, device=job.device, mode="replay" if job.case else "search",
        verdicts=verdicts, examples_requested=job.examples,
        examples_run=sum(1 for e in events if e["event"] == "done" and e["phase"] == "search"),
        seed=job.seed, profile=job.profile, declared=declared, environment=env, elapsed_s=elapsed_s,
        restarts=len(crashes), notes=notes, replay_report=replayed[-1] if replayed else None,
    )


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------

def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def figures(comparison: dict[str, Any]) -> list[str]:
    """Two lines of comparison figures for one output."""
    c = comparison
    if c["max_abs_err"] == math.inf and c["rows_failed"] == 0:  # a NaN/Inf parity failure: no bound applies
        return [f"output {c['output']}: non-finite where the oracle is finite (or the reverse); worst element "
                f"{tuple(c['worst_index'])}: got {_fmt(c['worst_got'])}, oracle {_fmt(c['worst_oracle'])}"]
    return [
        f"output {c['output']}: max abs err {_fmt(c['max_abs_err'])} ({_fmt(c['max_ulp_err'])} ulp), "
        f"eager {_fmt(c['eager_max_abs_err'])} ({_fmt(c['eager_max_ulp_err'])} ulp), "
        f"ratio to eager {_fmt(c['ratio_to_eager'])}, yardstick {c['yardstick']}, "
        f"rows failed {c['rows_failed']}/{c['rows']}",
        f"  worst element {tuple(c['worst_index'])}: got {_fmt(c['worst_got'])}, oracle {_fmt(c['worst_oracle'])}, "
        f"eager {_fmt(c['worst_eager'])}, bound {_fmt(c['worst_bound'])}",
    ]


def render_text(result: AuditResult) -> str:
    """The verdict lines, each failure with its case and one replay command, and a closing line."""
    pad = " " * 24
    env = result.environment
    where = env.get("device_name", result.device)
    lines = [f"fuseaudit audit {result.op} {result.target}"]
    if result.mode == "replay":
        lines.append(f"  replaying one case on {where}")
    else:
        seed = f", seed {result.seed}" if result.seed is not None else ""
        lines.append(f"  {where}, profile {result.profile}, {result.examples_requested} examples "
                     f"({result.examples_run} run, shrinking included){seed}")
    declared = ", ".join(f"{k}={v}" for k, v in result.declared.items() if v)
    if declared:
        lines.append(f"  declared support: {declared}")
    for prop in ALL_PROPERTIES:
        v = result.verdicts[prop]
        lines.append(f"  {prop:<17} {v.status}  {v.summary}")
        if v.status != FAIL:
            continue
        first = v.failures[0]
        if first.describe:
            label = "case (minimal)" if first.source == "shrunk" else "case"
            lines.append(f"{pad}{label + ':':<16}{first.describe}")
        if prop == "numerics" and result.mode != "replay":
            for cmp in first.comparisons:
                if not cmp.get("passed", True):
                    lines.extend(f"{pad}{'figures:' if i == 0 else '':<16}{s}" for i, s in enumerate(figures(cmp)))
                    break
        if first.replay:
            lines.append(f"{pad}{'replay:':<16}{first.replay}")
        for other in v.failures[1:3]:
            lines.append(f"{pad}{'also (' + other.source + '):':<16}{other.describe}")
        if len(v.failures) > 3:
            lines.append(f"{pad}{'':<16}... and {len(v.failures) - 3} more (see --json)")
    if result.replay_report and result.replay_report.get("comparisons"):
        lines.append("  comparison figures:")
        for cmp in result.replay_report["comparisons"]:
            lines.extend(f"    {s}" for s in figures(cmp))
    for note in result.notes:
        lines.append(f"  note: {note}")
    verdict = "PASS" if result.passed else f"FAIL ({', '.join(result.failed)})"
    lines.append(f"result: {verdict} in {result.elapsed_s:.1f} s")
    return "\n".join(lines)
