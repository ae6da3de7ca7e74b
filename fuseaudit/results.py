"""The results file of ``fuseaudit run``: one JSON document the report is rendered from.

Schema ``fuseaudit-results/1`` (every float finite or one of the strings
``"inf"``, ``"-inf"``, ``"nan"``; every key below is always present)::

    schema        "fuseaudit-results/1"
    created       ISO time (UTC) the run started; updated: last write; finished: bool
    device        "cpu" | "cuda"
    argv          the command line
    options       {ops, examples: {op: N}, target_examples, seed, builtins, shrink_time,
                   bench, bench_seconds, e2e, e2e_seconds, time_limit, workers,
                   gpus (0 on the CPU), reference_env: {VAR: value} the reference audits'
                   children ran with -- these two absent in files written before them}
    environment   {device, device_name, torch, triton, cuda, cudnn, python, hypothesis, fuseaudit,
                   platform, cpu: {model, logical_cores}, git_commit,
                   gpu: benchjson.gpu_info() (name, capability, sm_count, memory_bytes, driver,
                        cuda_driver, nvml) or null on the CPU}
    audits        [{op, target, kind: "reference" | "builtin",
                    status: "done" | "error" | "unavailable",
                    exit_code: 0 | 1 | 2, passed: bool | null (null unless done),
                    verdicts: {property: "PASS" | "FAIL" | "SKIP"}, message (why, where not done),
                    elapsed_s, examples,
                    worker: the ``--workers`` slot that ran it (0 without), device: "cpu" | "cuda:K"
                    (the GPU it ran on) -- both absent in files written before ``--workers``,
                    cases: [case_record(...)],             one per checked case (search / replay)
                    ulp_histograms: {dtype: {output: [counts per tolerance.ULP_BINS bin]}},
                    result: AuditResult.to_dict() or null}]
    launches      {status: "done" | "error" | "skipped", message?,
                   rows: [cli_launches.launch_table row: {op, expected, reference, eager, compile?}]}
    bench         {status: "done" | "error" | "skipped", message?, seconds?,
                   document: pytest-benchmark JSON (benchjson) or null}
    e2e           {status: "done" | "error" | "skipped", message?, document: e2e JSON or null}
    summary       {exit_code, passed, failed: [{op, target, properties | message}], elapsed_s}

A case record (:func:`case_record`)::

    {phase, dtype, shapes: {input: shape}, hidden (last dim of the first input),
     keys (attention: Sk), layouts: {input: layout}, regime, params, passed, failed: [property],
     describe, case (Case JSON),
     outputs: [{output, passed, max_abs_err, max_rel_err, max_ulp_err, eager_max_ulp_err,
                ratio_to_eager, yardstick, rows, rows_failed,
                margin: the worst row's error / its bound (<= 1 passes; inf: NaN/Inf parity)}]}
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import platform
import subprocess
from typing import Any

from .jsonio import read_json, write_json

SCHEMA = "fuseaudit-results/1"
PROPERTY_ORDER = ("runs", "contract", "inputs_unchanged", "numerics", "launches", "determinism")
_CMP_KEYS = ("output", "passed", "max_abs_err", "max_rel_err", "max_ulp_err", "eager_max_ulp_err",
             "ratio_to_eager", "yardstick", "rows", "rows_failed")


class ResultsError(ValueError):
    """A file that is not a fuseaudit results document; the message is one line."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def number(value: Any) -> float | None:
    """A float from a results value (``"inf"`` strings included); None where there is none."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def new_document(device: str, *, argv: list[str], options: dict[str, Any],
                 environment: dict[str, Any]) -> dict[str, Any]:
    """An empty results document for a run on ``device``."""
    skipped = {"status": "skipped", "message": "not run yet"}
    return {"schema": SCHEMA, "created": now(), "updated": now(), "finished": False, "device": device,
            "argv": argv, "options": options, "environment": environment, "audits": [],
            "launches": {**skipped, "rows": []}, "bench": {**skipped, "document": None},
            "e2e": {**skipped, "document": None},
            "summary": {"exit_code": None, "passed": None, "failed": [], "elapsed_s": 0.0}}


def write(path: str | os.PathLike[str], doc: dict[str, Any]) -> pathlib.Path:
    """Write ``doc`` atomically (a run killed mid-write keeps the previous version)."""
    doc["updated"] = now()
    return write_json(path, doc, indent=1)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a results document; :class:`ResultsError` (one line) when it is not one."""
    p = pathlib.Path(path)
    doc = read_json(p, ResultsError)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ResultsError(f"{p}: not a fuseaudit results file (schema is not {SCHEMA!r})")
    if not isinstance(doc.get("audits"), list) or doc.get("device") not in ("cpu", "cuda"):
        raise ResultsError(f"{p}: malformed results file (no 'audits' list or no device)")
    return doc


# ---------------------------------------------------------------------------
# What one audit contributes
# ---------------------------------------------------------------------------

def case_record(report: dict[str, Any], phase: str) -> dict[str, Any]:
    """The figures of one checked case (a worker ``done`` event's report), compact."""
    from .case import Case

    case = Case.from_json(report["case"])
    shapes = {k: list(v) for k, v in case.shapes().items()}
    first = next(iter(shapes.values()))
    return {
        "phase": phase,
        "dtype": case.dtype,
        "shapes": shapes,
        "hidden": first[-1] if first else 1,
        "keys": case.dims.get("Sk"),
        "layouts": dict(case.layouts),
        "regime": case.regime,
        "params": case.params,
        "passed": bool(report.get("passed")),
        "failed": sorted({f["prop"] for f in report.get("failures", [])}),
        "describe": report.get("describe", ""),
        "case": report["case"],
        "outputs": [{**{k: c.get(k) for k in _CMP_KEYS}, "margin": margin(c)} for c in report.get("comparisons", [])],
    }


def margin(comparison: dict[str, Any]) -> float | None:
    """How much of its bound the worst row used: row error / bound (at most 1 passes); inf for NaN/Inf parity."""
    got, oracle, bound = (number(comparison.get(k)) for k in ("worst_got", "worst_oracle", "worst_bound"))
    if not comparison.get("passed", True) and number(comparison.get("max_abs_err")) == math.inf:
        return math.inf
    if got is None or oracle is None or not bound or not math.isfinite(bound):
        return None
    if not (math.isfinite(got) and math.isfinite(oracle)):  # matching Inf/NaN (a mismatch fails above)
        return 0.0 if got == oracle or (math.isnan(got) and math.isnan(oracle)) else None
    return abs(got - oracle) / bound


class CaseCollector:
    """An ``on_event`` callback for :func:`fuseaudit.audit.audit` that keeps every checked case's figures."""

    def __init__(self) -> None:
        self.cases: list[dict[str, Any]] = []
        self.histograms: dict[str, dict[str, list[int]]] = {}

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") != "done" or event.get("phase") not in ("edge", "search", "replay"):
            return
        report = event["report"]
        try:
            record = case_record(report, event["phase"])
        except (ValueError, KeyError, TypeError):
            return  # a malformed case is the audit's business, not the report's
        self.cases.append(record)
        for c in report.get("comparisons", []):
            hist = c.get("ulp_histogram")
            if not hist:
                continue
            slot = self.histograms.setdefault(record["dtype"], {})
            old = slot.get(c["output"])
            slot[c["output"]] = list(hist) if old is None else [a + b for a, b in zip(old, hist)]


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def environment(device: str) -> dict[str, Any]:
    """Versions, the GPU (driver, CUDA, NVML) and the CPU: what makes two runs comparable."""
    import torch

    from .judge import environment as worker_environment

    env = worker_environment(device)
    env["cuda"] = torch.version.cuda
    env["cudnn"] = None
    try:
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        pass
    env["cpu"] = {"model": _cpu_model(), "logical_cores": os.cpu_count()}
    env["git_commit"] = _git_commit()
    env["gpu"] = None
    if device.startswith("cuda"):
        from .benchjson import gpu_info

        try:
            env["gpu"] = gpu_info()
        except Exception as exc:  # the record is worth more than a perfect GPU section
            env["gpu"] = {"error": f"{type(exc).__name__}: {exc}"}
    return env


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------

def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Exit code 0 when every reference audit ran and passed every property, else 1."""
    failed = []
    for a in doc["audits"]:
        if a["kind"] != "reference":
            continue
        if a["status"] != "done":
            failed.append({"op": a["op"], "target": a["target"], "message": a.get("message", a["status"])})
        elif not a["passed"]:
            failed.append({"op": a["op"], "target": a["target"],
                           "properties": [p for p, v in a["verdicts"].items() if v == "FAIL"]})
    return {"exit_code": 1 if failed else 0, "passed": not failed, "failed": failed}
