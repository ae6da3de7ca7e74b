"""From the judge's events to verdicts: what ``fuseaudit audit`` prints and writes as JSON.

:func:`assemble` reads the events of :mod:`fuseaudit.judge` and gives each
property a verdict:

``runs``, ``contract``, ``inputs_unchanged``, ``numerics``
    FAIL when any case checked failed it (a crash, hang or broken protocol
    of the worker is a ``runs`` failure); PASS when it held on at least as
    many cases as the audit asked for; INCONCLUSIVE when it held on fewer
    (the target declared cases unsupported) or on none.  The case shown is
    the minimal one Hypothesis shrank to for that property (marked flaky
    where it passed when replayed in a fresh worker); a property that was
    never the first to fail on a case (so Hypothesis did not shrink it)
    shows the smallest case it failed on.
``launches``
    FAIL when a count differs from the expected one or the target failed
    inside the counter, PASS when every count equals it, INCONCLUSIVE when no
    count could be trusted, SKIP when not judged for this target.
``determinism``
    FAIL when two calls on the same inputs differ in any bit; INCONCLUSIVE
    when no case could be compared.
``memory`` (only with ``--sanitize``)
    FAIL when compute-sanitizer reports an error inside a call of the
    target; PASS when every tool ran every case without one; INCONCLUSIVE
    when a tool stopped short; SKIP (with the reason) on the CPU or where
    the tool is absent.

A property checked on no case is never held.  Exit code: 1 on any FAIL,
else 3 on any INCONCLUSIVE, else 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .case import Case
from .check import PROPERTIES
from .jsonio import jsonable
from .judge import AuditJob

ALL_PROPERTIES = (*PROPERTIES, "launches", "determinism", "memory")  # memory: only with --sanitize
PASS, FAIL, SKIP, INCONCLUSIVE = "PASS", "FAIL", "SKIP", "INCONCLUSIVE"


@dataclass
class FailureRecord:
    """One failing case of a property, ready to print and replay."""

    message: str
    source: str  # shrunk, observed, flaky, crash, timeout, protocol, fatal, launches, determinism
    case: str | None = None  # the Case as JSON
    describe: str = ""
    replay: str | None = None
    comparisons: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Verdict:
    prop: str
    status: str  # PASS, FAIL, INCONCLUSIVE or SKIP
    summary: str
    cases: int = 0  # cases on which the property was evaluated
    failing_cases: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class AuditResult:
    """The outcome of one audit; :attr:`exit_code` is 1 on a failure, 3 when inconclusive, else 0."""

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
    def inconclusive(self) -> list[str]:
        return [p for p, v in self.verdicts.items() if v.status == INCONCLUSIVE]

    @property
    def passed(self) -> bool:
        return not self.failed and not self.inconclusive

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 3 if self.inconclusive else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["properties"] = d.pop("verdicts")
        d.update(exit_code=self.exit_code, passed=self.passed, failed=self.failed, inconclusive=self.inconclusive)
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
    if prop == "inputs_unchanged":
        return True  # the judge reads the inputs back after every call, even one that raised
    if prop == "contract":
        return "runs" not in failed
    return not failed & {"runs", "contract"}  # numerics


def _replay(job: AuditJob, case_json: str | None) -> str | None:
    if not case_json:
        return None
    return Case.from_json(case_json).replay_command(job.target, job.device)


def _record(job: AuditJob, prop: str, report: dict[str, Any], source: str) -> FailureRecord:
    message = next(f["message"] for f in report["failures"] if f["prop"] == prop)
    if report.get("process") and source != "shrunk":
        source = report["process"]
    return FailureRecord(message=message, source=source, case=report["case"], describe=report["describe"],
                         replay=report.get("replay") or _replay(job, report["case"]),
                         comparisons=report.get("comparisons", []))


def _size(report: dict[str, Any]) -> tuple[int, str]:
    return Case.from_json(report["case"]).numel(), report["describe"]


def _asked(job: AuditJob) -> int:
    return 1 if job.case else job.examples


def _check_verdict(prop: str, job: AuditJob, observed: list[dict[str, Any]], minimal: list[dict[str, Any]],
                   flaky: set[tuple[str, str]], unsupported: int, stopped_by: Sequence[str] = ()) -> Verdict:
    evaluated = [r for r in observed if _evaluated(prop, _failed_props(r))]
    failing = [r for r in evaluated if prop in _failed_props(r)]
    records: list[FailureRecord] = []
    seen = set()
    for m in minimal:
        if m["prop"] == prop and m["report"]["case"] not in seen:
            seen.add(m["report"]["case"])
            record = _record(job, prop, m["report"], "shrunk")
            if (prop, m["report"]["case"]) in flaky:
                record.source = "flaky"
                record.message += (" [flaky: it passed when replayed alone in a fresh worker, so it depends on "
                                   f"earlier calls; the whole search replays with --seed {job.seed} --examples "
                                   f"{job.examples}]")
            records.append(record)
    if failing and not seen:
        records.append(_record(job, prop, min(failing, key=_size), "observed"))
    detail = {"worst": _worst_figures(evaluated)} if prop == "numerics" else {}
    if records:
        return Verdict(prop, FAIL, records[0].message, len(evaluated), len(failing), records, detail)
    searched = sum(1 for r in evaluated if r["_phase"] in ("search", "replay"))
    if searched and searched >= _asked(job):
        return Verdict(prop, PASS, f"held on {len(evaluated)} case(s)", len(evaluated), detail=detail)
    skipped = f"; {unsupported} drawn case(s) were declared unsupported" if unsupported else ""
    if not searched:
        return Verdict(prop, INCONCLUSIVE, f"not checked on any case{skipped}", detail=detail)
    stopped = (f"; the search stops at a failing case ({', '.join(stopped_by)}) and then shrinks it"
               if stopped_by else "")
    return Verdict(prop, INCONCLUSIVE, f"held on {searched} of the {_asked(job)} case(s) asked{skipped}{stopped}",
                   len(evaluated), detail=detail)


def _worst_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per output, the comparison furthest from the oracle in ulps over all cases checked, with its case."""
    worst: dict[str, Any] = {}
    for r in reports:
        for c in r.get("comparisons", []):
            if c["output"] not in worst or c["max_ulp_err"] > worst[c["output"]]["max_ulp_err"]:
                worst[c["output"]] = {**c, "case": r["case"], "describe": r["describe"]}
    return worst


def _launches_verdict(job: AuditJob, events: list[dict[str, Any]]) -> Verdict:
    if "launches" not in job.phases:
        return Verdict("launches", SKIP, "not run")
    found = [e for e in events if e["event"] == "launches"]
    if not found:
        return Verdict("launches", INCONCLUSIVE, "not counted: the audit ended before this phase")
    counted = [e for e in found if "count" in e]
    raised = [e for e in found if e.get("raised")]
    if not job.count_launches:
        return Verdict("launches", SKIP, found[0].get("error", "not counted"))
    expected = found[0]["expected"]
    if expected is None:
        if not counted:
            return Verdict("launches", SKIP, f"not judged ({job.launches_note}): {found[0].get('error', '')}")
        e = counted[0]
        note = f" ({job.launches_note})" if job.launches_note else ""
        return Verdict("launches", SKIP, f"not judged{note}: {e['describe']}", len(counted),
                       detail={"count": e["count"], "expected": None, "case": e["case"]})
    wrong = [e for e in counted if len(e["count"]["kernels"]) != expected]
    records = []
    for e in wrong + raised:
        if "count" in e:
            message = f"one call launched {e['describe']}, expected {expected}"
            if e["count"]["kernels"] and all(k.startswith("aten::") for k in e["count"]["kernels"]):
                message += (f" (a plain PyTorch composition launches one kernel per op: to audit it as the "
                            f"unfused code it is, pass --launches {len(e['count']['kernels'])})")
        else:
            message = e["error"]
        records.append(FailureRecord(message=message, source="launches", case=e["case"],
                                     describe=Case.from_json(e["case"]).describe() if e["case"] else "",
                                     replay=_replay(job, e["case"])))
    first = (wrong or counted or [found[0]])[0]
    detail = {"count": first.get("count"), "expected": expected, "case": first["case"],
              "counts": [{"case": e["case"], "count": e["count"]} for e in counted]}
    if records:
        return Verdict("launches", FAIL, records[0].message, len(counted) + len(raised), len(records), records,
                       detail)
    if counted and len(counted) == len(found):
        return Verdict("launches", PASS, f"{counted[0]['describe']} (on {len(counted)} case(s))", len(counted),
                       detail=detail)
    errors = [e for e in found if "count" not in e]
    return Verdict("launches", INCONCLUSIVE, errors[0].get("error", "not counted"), len(counted), detail=detail)


def _determinism_verdict(job: AuditJob, events: list[dict[str, Any]]) -> Verdict:
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
        return Verdict("determinism", INCONCLUSIVE, found[0]["message"])
    return Verdict("determinism", INCONCLUSIVE, "not compared: no drawn case ran")


def _memory_verdict(job: AuditJob, events: list[dict[str, Any]]) -> Verdict:
    """compute-sanitizer's findings inside the target's calls, one record per finding and case."""
    found = [e for e in events if e["event"] == "sanitize"]
    skipped = [e for e in found if e["status"] == "skip"]
    if skipped or not found:
        return Verdict("memory", SKIP, skipped[0]["reason"] if skipped else "not run")
    runs = [e["run"] for e in found]
    cases = found[0]["cases"]
    records, outside = [], []
    for run in runs:
        by_case: dict[int, list[str]] = {}
        for f in run["findings"]:
            if f["case"] is None:
                outside.append(f)
            else:
                by_case.setdefault(f["case"], []).append(_finding_line(f))
        for index, lines in sorted(by_case.items()):  # one record per case and tool
            case = cases[index]
            more = f" (and {len(lines) - 1} more finding(s), see --json)" if len(lines) > 1 else ""
            records.append(FailureRecord(message=lines[0] + more, source=run["tool"], case=case,
                                         describe=Case.from_json(case).describe(),
                                         replay=f"{_replay(job, case)} --sanitize {run['tool']}"))
    tools = ", ".join(r["tool"] for r in runs)
    detail = {"runs": runs, "outside_target": [_finding_line(f) for f in outside]}
    if records:
        failing = len({r.case for r in records})
        return Verdict("memory", FAIL, records[0].message, len(cases), failing, records, detail=detail)
    short = [r for r in runs if r["problem"]]
    if short:
        return Verdict("memory", INCONCLUSIVE, f"{short[0]['tool']}: {short[0]['problem']}", len(cases),
                       detail=detail)
    note = f"; {len(outside)} outside the target's calls (see --json)" if outside else ""
    return Verdict("memory", PASS, f"no error from {tools} on {len(cases)} case(s){note}", len(cases), detail=detail)


def _finding_line(f: dict[str, Any]) -> str:
    from .sanitize import Finding

    return Finding(**f).line()


def assemble(events: list[dict[str, Any]], *, job: AuditJob, declared: dict[str, Any], elapsed_s: float,
             notes: list[str] | None = None, restarts: int = 0) -> AuditResult:
    """The :class:`AuditResult` of a finished audit."""
    observed = [{**e["report"], "_phase": e["phase"]} for e in events if e["event"] == "done"]
    minimal = [e for e in events if e["event"] == "minimal"]
    flaky = {(e["prop"], e["case"]) for e in events if e["event"] == "flaky"}
    unsupported = [e for e in events if e["event"] == "unsupported"]
    stopped_by = sorted({f for r in observed if r["_phase"] == "search" for f in _failed_props(r)})
    verdicts = {p: _check_verdict(p, job, observed, minimal, flaky, len(unsupported), stopped_by)
                for p in PROPERTIES}
    verdicts["launches"] = _launches_verdict(job, events)
    verdicts["determinism"] = _determinism_verdict(job, events)
    if "sanitize" in job.phases:
        verdicts["memory"] = _memory_verdict(job, events)
    env = next((e["env"] for e in events if e["event"] == "setup" and e.get("ok")), {})
    replayed = [e["report"] for e in events if e["event"] == "done" and e["phase"] == "replay"]
    notes = list(notes or []) + [e["message"] for e in events if e["event"] == "note"]
    if unsupported:
        first = unsupported[0]
        notes.append(f"{len(unsupported)} drawn case(s) outside the target's declared support were skipped, "
                     f"e.g. {first['describe']}: {first['reason']}")
    far = [(r, c) for r in observed for c in r.get("comparisons", []) if c.get("rows_eager_far")]
    if far:
        r, c = max(far, key=lambda rc: rc[1]["eager_max_ulp_err"])
        notes.append(f"eager itself was further from the float64 oracle than the dtype budget on {len(far)} "
                     f"output(s) checked, up to {c['eager_max_ulp_err']:.3g} ulp (the target: {c['max_ulp_err']:.3g}) "
                     f"on {r['describe']}; there eager's own error sets the bound, as good as PyTorch is no failure")
    lost = [e for e in events if e["event"] == "lost"]
    if lost:
        kinds = ", ".join(sorted({e["kind"] for e in lost}))
        notes.append(f"{len(lost)} worker(s) lost ({kinds}); each following call ran in a fresh worker")
    return AuditResult(
        op=job.op, target=job.target, device=job.device, mode="replay" if job.case else "search",
        verdicts=verdicts, examples_requested=job.examples,
        examples_run=sum(1 for e in events if e["event"] == "done" and e["phase"] == "search"),
        seed=job.seed, profile=job.profile, declared=declared, environment=env, elapsed_s=elapsed_s,
        restarts=restarts, notes=notes, replay_report=replayed[-1] if replayed else None,
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
    for prop in (p for p in ALL_PROPERTIES if p in result.verdicts):
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
        for other in v.failures[1:3]:  # a label of 16 characters or more ("also (determinism):") keeps a space
            lines.append(f"{pad}{'also (' + other.source + '):':<15} {other.describe}")
        if len(v.failures) > 3:
            lines.append(f"{pad}{'':<16}... and {len(v.failures) - 3} more (see --json)")
    if result.replay_report and result.replay_report.get("comparisons"):
        lines.append("  comparison figures:")
        for cmp in result.replay_report["comparisons"]:
            lines.extend(f"    {s}" for s in figures(cmp))
    for note in result.notes:
        lines.append(f"  note: {note}")
    if result.failed:
        verdict = f"FAIL ({', '.join(result.failed)})"
    elif result.inconclusive:
        verdict = f"INCONCLUSIVE ({', '.join(result.inconclusive)})"
    else:
        verdict = "PASS"
    lines.append(f"result: {verdict} in {result.elapsed_s:.1f} s")
    return "\n".join(lines)
