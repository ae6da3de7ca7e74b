"""From results documents to what the report template shows: rows of strings, classes and charts.

:func:`build` takes one or more results documents (:mod:`fuseaudit.results`;
a CPU run and a GPU run may be merged) and returns a plain dict.  Every
string that came from a target (names, messages, kernel names) stays a
plain string here; the template escapes it.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from . import nvml
from . import report_charts as charts
from .catalog import OPS
from .report_provenance import provenance
from .report_text import kernel_list, kernel_parts, shorten_kernels, ulp_note
from .results import PROPERTY_ORDER, number

STATUS_CLASS = {"PASS": "pass", "FAIL": "fail", "SKIP": "skip", "ERROR": "fail", "UNAVAILABLE": "fail",
                "INCONCLUSIVE": "skip"}


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

def fmt(value: Any, spec: str = ".3g", none: str = "–") -> str:
    v = number(value)
    if v is None:
        return none
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if math.isnan(v):
        return "NaN"
    return format(v, spec)


def fmt_bytes(value: Any) -> str:
    v = number(value)
    if v is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def budget(value: Any, why: str = "no bound recorded for this comparison") -> dict[str, str]:
    """A margin (worst row error / bound) as the share of the tolerance used: text, CSS class, and ``why`` none."""
    v = number(value)
    if v is None:
        return {"text": "–", "cls": "", "title": why}
    if math.isinf(v) or math.isnan(v):
        return {"text": "NaN/Inf", "cls": "bad", "title": "NaN or Inf where the oracle is finite, or the reverse"}
    if v <= 1:
        return {"text": f"{100 * v:.0f}%", "cls": "good", "title": ""}
    return {"text": f"{v:.3g}× bound", "cls": "bad", "title": ""}


def fmt_x(value: Any) -> str:
    v = number(value)
    return "–" if v is None else f"{v:.2f}×"


SAME_SPEED = 1.05  # a speed-up between 1/1.05 and 1.05 is drawn neither faster nor slower


def speed_cls(ratio: Any) -> str:
    """The CSS class of a speed-up, one rule everywhere: "good" faster, "bad" slower, "" about even or unknown."""
    v = number(ratio)
    if v is None or not math.isfinite(v) or v <= 0:
        return ""
    return "good" if v >= SAME_SPEED else "bad" if v <= 1 / SAME_SPEED else ""


def _percent(share: Any) -> str:
    v = number(share)
    return "–" if v is None else f"{100 * v:.0f}%"


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def run_labels(runs: list[dict[str, Any]]) -> list[str]:
    labels = []
    for run in runs:
        env = run.get("environment") or {}
        name = env.get("device_name") or run["device"]
        label = f"{run['device']} · {name}"
        labels.append(label if label not in labels else f"{label} ({len(labels) + 1})")
    return labels


def _ops(runs: list[dict[str, Any]]) -> list[str]:
    seen = {a["op"] for r in runs for a in r["audits"]}
    return [o for o in OPS if o in seen] + sorted(seen - set(OPS))


def audit_status(a: dict[str, Any]) -> str:
    """PASS, FAIL, INCONCLUSIVE (exit 3: checked on fewer cases than asked), or the status of an audit not done."""
    if a["status"] != "done":
        return a["status"].upper()
    if a.get("exit_code") == 3:
        return "INCONCLUSIVE"
    return "PASS" if a["passed"] else "FAIL"


def _outputs(cases: list[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
    for c in cases:
        for o in c.get("outputs", []):
            yield c, o


# ---------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------

def bench_records(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Flat benchmark records of the first run with benchmark data, and that document's ``fuseaudit`` meta."""
    for run in runs:
        doc = (run.get("bench") or {}).get("document")
        if not doc or not doc.get("benchmarks"):
            continue
        out = []
        for b in doc["benchmarks"]:
            info = b.get("extra_info") or {}
            median = number((b.get("stats") or {}).get("median"))
            out.append({**info, "op": info.get("op") or b.get("group", "?").split(" ")[0],
                        "impl": (b.get("params") or {}).get("impl") or info.get("impl", "?"),
                        "point": info.get("point", b.get("group", "?")), "dtype": info.get("dtype", "?"),
                        "us": median * 1e6 if median is not None else None})
        _fill_ratios(out)
        return out, doc.get("fuseaudit") or {}
    return [], None


def _peak(record: dict[str, Any]) -> float | None:
    return number((record.get("memory") or {}).get("peak_extra_bytes"))


def _fill_ratios(records: list[dict[str, Any]]) -> None:
    """Speed-ups and peak savings a record lacks, from its point's other contenders (in place).

    ``fuseaudit bench`` stores them with each point; the pytest-benchmark
    suite, and bench files merged in from it, store only times and peaks.
    The same definitions fill them (a median time over a median time, a peak
    less a peak), so every op the charts show has its figures in the
    tables.  A stored figure stays: it was taken beside its baseline.
    """
    points: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        points[(r["op"], r["point"], r["dtype"])][r["impl"]] = r
    for by in points.values():
        for impl, r in by.items():
            for base in ("eager", "compile"):
                other, key = by.get(base), f"speedup_vs_{base}"
                if impl == base or other is None or number(r.get(key)) is not None:
                    continue
                them, us = number(other.get("us")), number(r.get("us"))
                if them and us:
                    r[key] = them / us
            eager = by.get("eager")
            if impl != "eager" and eager is not None and number(r.get("peak_saved_vs_eager_bytes")) is None:
                theirs, mine = _peak(eager), _peak(r)
                if theirs is not None and mine is not None:
                    r["peak_saved_vs_eager_bytes"] = theirs - mine


def _compute_bound(op: str) -> bool:
    """An op bound by arithmetic (the catalog's ``compute_bound``): its rate is TFLOP/s, not a share of copy."""
    spec = OPS.get(op)
    return spec is not None and spec.compute_bound


_WIDTH_LABELS = {"hidden": "hidden size N", "keys": "keys (Sk)"}


def _width(op: str) -> str:
    """The case record's size an op's errors are plotted against (its shape's ``width``: hidden or keys)."""
    spec = OPS.get(op)
    return spec.shape.width if spec is not None else "hidden"


def _main_dtype(records: list[dict[str, Any]]) -> str | None:
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        counts[r["dtype"]] += 1
    return max(counts, key=lambda d: (counts[d], d == "bfloat16")) if counts else None


def _largest_point(records: list[dict[str, Any]], op: str, dtype: str | None) -> str | None:
    pts = [(number(r.get("bytes_moved")) or 0, r["point"]) for r in records if r["op"] == op and r["dtype"] == dtype
           and r["impl"] == "reference"]
    return max(pts)[1] if pts else None


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------

def headline(runs: list[dict[str, Any]], labels: list[str], bench: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op: right? fused? faster? by how much?"""
    rows = []
    launch_rows = _launch_rows(runs)
    for op in _ops(runs):
        right = []
        ulp, eager_ulp, ratios, margins = [], [], [], []
        for run, label in zip(runs, labels):
            for a in run["audits"]:
                if a["op"] != op or a["kind"] != "reference":
                    continue
                status = audit_status(a)
                failed = [p for p, v in a.get("verdicts", {}).items() if v == "FAIL"]
                why = ", ".join(failed) if failed else shorten_kernels(str(a.get("message", status)))
                right.append({"run": run["device"], "status": status, "cls": STATUS_CLASS.get(status, "skip"),
                              "title": f"{label}: {why}"})
                for _, o in _outputs(a.get("cases", [])):
                    ulp.append(number(o.get("max_ulp_err")))
                    eager_ulp.append(number(o.get("eager_max_ulp_err")))
                    ratios.append(number(o.get("ratio_to_eager")))
                    margins.append(number(o.get("margin")))
        finite = [r for r in ratios if r is not None and math.isfinite(r)]
        row: dict[str, Any] = {
            "op": op, "right": right,
            "budget": budget(max((m for m in margins if m is not None), default=None),
                             why="no checked case in these results"),
            "ulp": fmt(max((u for u in ulp if u is not None), default=None), ".3g"),
            "eager_ulp": fmt(max((u for u in eager_ulp if u is not None), default=None), ".3g"),
            "ratio_median": fmt(statistics.median(finite), ".2g") + "×" if finite else "–",
        }
        lr = launch_rows.get(op)
        row["launches"] = lr
        mine = [r for r in bench if r["op"] == op and r["impl"] == "reference"]
        for ref in ("eager", "compile"):
            row[f"vs_{ref}"] = _speedup_cell(mine, ref, timed=bool(bench))
        untimed = "no timing in these results" if not bench else "no reference point of this op in the benchmarks"
        key, unit = ("tflops", " TFLOP/s") if _compute_bound(op) else ("pct_copy", "% of copy")
        rated = [(v, r) for r in mine if (v := number(r.get(key)))]
        if rated:
            best, at = max(rated, key=lambda x: x[0])
            row["roofline"] = _cell(f"{best:.2g}{unit}" if best < 10 else f"{best:.0f}{unit}",
                                    f"best of {len(rated)} point(s): {at['point']} {at['dtype']}")
        else:
            row["roofline"] = _cell("–", untimed if not mine else "no copy bandwidth was recorded"
                                    if key == "pct_copy" else "no FLOP rate")
        avoided = max((number(r.get("intermediate_bytes_avoided")) or 0 for r in mine), default=0)
        row["memory"] = _cell(fmt_bytes(avoided) if avoided else "0") if mine else _cell("–", untimed)
        rows.append(row)
    return rows


def _speedup_cell(mine: list[dict[str, Any]], ref: str, *, timed: bool) -> dict[str, str]:
    """The geometric mean of an op's speed-ups over ``ref``, its range and points; where none, why not."""
    vals = [v for v in (number(r.get(f"speedup_vs_{ref}")) for r in mine) if v is not None]
    g = geomean(vals)
    if g is None:
        why = ("no timing in these results" if not timed else "no reference point of this op in the benchmarks"
               if not mine else f"{'torch.compile' if ref == 'compile' else ref} was not timed at this op's points")
        return {"text": "–", "range": "", "cls": "", "title": why}
    return {"text": fmt_x(g), "range": f"{min(vals):.2f}–{max(vals):.2f}×", "cls": speed_cls(g),
            "title": f"geometric mean over {len(vals)} point(s)"}


def _launch_rows(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per op, the launch counts of the GPU run where there is one (else the first): ref/eager/compile."""
    out: dict[str, dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: r["device"] != "cuda"):
        for r in (run.get("launches") or {}).get("rows", []):
            if r.get("op") in out:
                continue
            cell = {"device": run["device"], "expected": r.get("expected")}
            for impl in ("reference", "eager", "compile"):
                e = r.get(impl)
                if e is None:
                    cell[impl] = {"text": "n/a", "title": "not counted on this device"}
                elif "error" in e:
                    cell[impl] = {"text": "error", "title": str(e["error"])}
                else:
                    cell[impl] = {"text": str(e.get("count")), "title": kernel_list(e.get("kernels", []))}
            if "error" in r:
                cell["reference"] = {"text": "error", "title": shorten_kernels(str(r["error"]))}
            ref = (r.get("reference") or {}).get("count")
            cell["ok"] = ref is not None and ref == r.get("expected")
            out[r["op"]] = cell
    return out


def summary(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Per run, per op and target: each property's verdict."""
    rows = []
    for run, label in zip(runs, labels):
        for a in run["audits"]:
            props = (a.get("result") or {}).get("properties", {})
            cells = []
            for p in PROPERTY_ORDER:
                v = a.get("verdicts", {}).get(p)
                text = v or "–"
                cells.append({"text": text, "cls": STATUS_CLASS.get(v or "", "none"),
                              "title": shorten_kernels(str((props.get(p) or {}).get("summary", "")))})
            status = audit_status(a)
            rows.append({"run": label, "op": a["op"], "target": a["target"], "kind": a["kind"], "cells": cells,
                         "device": a.get("device") or run["device"],
                         "status": status, "cls": STATUS_CLASS.get(status, "skip"), "cases": len(a.get("cases", [])),
                         "seconds": fmt(a.get("elapsed_s"), ".0f"), "message": a.get("message", "")})
    return rows


def failures(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """Every failing property (first three cases each) and every audit that could not run.

    Audits skipped on purpose (a time limit, an option) are listed in the verdicts table, not here.
    """
    from .audit_result import figures

    out = []
    for run, label in zip(runs, labels):
        for a in run["audits"]:
            base = {"run": label, "op": a["op"], "target": a["target"], "kind": a["kind"]}
            if a["status"] == "skipped":
                continue
            if a["status"] != "done":
                message = a.get("message", "")
                out.append({**base, "prop": a["status"], "message": message, "parts": kernel_parts(message),
                            "cases": [], "more": 0})
                continue
            for p, v in ((a.get("result") or {}).get("properties") or {}).items():
                if v.get("status") != "FAIL":
                    continue
                cases = []
                for f in v.get("failures", [])[:3]:
                    lines = []
                    for c in f.get("comparisons", []):
                        if not c.get("passed", True):
                            try:
                                lines = figures(c)
                            except (KeyError, TypeError):
                                lines = []
                            break
                    message = f.get("message", "")
                    cases.append({"source": f.get("source", ""), "describe": f.get("describe", ""),
                                  "message": message, "parts": kernel_parts(message),
                                  "replay": f.get("replay") or "", "figures": lines})
                summary_text = v.get("summary", "")
                out.append({**base, "prop": p, "message": summary_text, "parts": kernel_parts(summary_text),
                            "cases": cases, "more": max(0, len(v.get("failures", [])) - 3)})
    return out


def tolerance(runs: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per op, target and dtype: error figures; the worst case of each audit with its replay; the charts."""
    from .case import Case

    table, worst = [], []
    for run, label in zip(runs, labels):
        for a in run["audits"]:
            pairs = list(_outputs(a.get("cases", [])))
            if pairs:
                table.append(_tolerance_row(label, a, pairs))
            pairs = list(_outputs(a.get("cases", [])))
            if pairs:  # the case that came closest to (or went furthest past) its bound
                c, o = max(pairs, key=lambda p: (o_passed(p[1]), number(p[1].get("margin")) or 0,
                                                 number(p[1].get("max_ulp_err")) or 0))
                try:
                    replay = Case.from_json(c["case"]).replay_command(a["target"], run["device"])
                except ValueError:
                    replay = ""
                worst.append({"run": label, "op": a["op"], "target": a["target"], "kind": a["kind"],
                              "output": o.get("output"), "ulp": fmt(o.get("max_ulp_err"), ".3g"),
                              "budget": budget(o.get("margin")),
                              "eager_ulp": fmt(o.get("eager_max_ulp_err"), ".3g"),
                              "note": ulp_note(number(o.get("max_ulp_err")), number(o.get("eager_max_ulp_err")),
                                               budget_ulps=_ulp_budget(a["op"]), passed=o.get("passed", True)),
                              "ratio": fmt(o.get("ratio_to_eager"), ".2g"), "passed": o.get("passed", True),
                              "describe": c["describe"], "replay": replay})
    hists, scatters = [], []
    for n, (run, label) in enumerate(zip(runs, labels)):
        refs = [a for a in run["audits"] if a["kind"] == "reference"]
        h_panels = [{"title": a["op"], "histograms": _merge_outputs(a.get("ulp_histograms") or {})} for a in refs]
        s_panels = [{"title": a["op"], "xlabel": _WIDTH_LABELS[width],
                     "points": [{"x": c[width] or 1, "dtype": c["dtype"],
                                 "ulp": number(o.get("max_ulp_err")), "eager_ulp": number(o.get("eager_max_ulp_err")),
                                 "passed": o.get("passed", True)} for c, o in _outputs(a.get("cases", []))]}
                    for a in refs for width in [_width(a["op"])]]
        hists.append({"run": label, "svg": charts.ulp_histograms(h_panels, f"hist{n}")})
        scatters.append({"run": label, "svg": charts.error_scatter(s_panels, f"scatter{n}")})
    return {"table": table, "worst": worst, "histograms": [h for h in hists if h["svg"]],
            "scatters": [s for s in scatters if s["svg"]]}


def _tolerance_row(label: str, a: dict[str, Any], pairs: list[tuple[dict[str, Any], dict[str, Any]]]
                   ) -> dict[str, Any]:
    """One audit's error figures: per dtype the tolerance used and max ulps (eager's beside), then overall."""
    per_dtype = {}
    for dtype in charts.DTYPE_COLORS:
        mine = [o for c, o in pairs if c["dtype"] == dtype]
        if not mine:
            continue
        margins = [m for m in (number(o.get("margin")) for o in mine) if m is not None]
        ulp = max((number(o.get("max_ulp_err")) or 0 for o in mine), default=None)
        eager_ulp = max((number(o.get("eager_max_ulp_err")) or 0 for o in mine), default=None)
        per_dtype[dtype] = {
            "budget": budget(max(margins, default=None)), "ulp": fmt(ulp, ".3g"), "eager_ulp": fmt(eager_ulp, ".3g"),
            "note": ulp_note(ulp, eager_ulp, budget_ulps=_ulp_budget(a["op"]),
                             passed=all(o.get("passed", True) for o in mine)),
        }
    ratios = [r for r in (number(o.get("ratio_to_eager")) for _, o in pairs) if r is not None and math.isfinite(r)]
    hidden = [c["hidden"] for c, _ in pairs]
    return {"run": label, "op": a["op"], "target": a["target"], "kind": a["kind"], "dtypes": per_dtype,
            "cases": len({c["case"] for c, _ in pairs}),
            "failed": len({c["case"] for c, o in pairs if o.get("passed") is False}),
            "ratio_max": fmt(max(ratios), ".2g") + "×" if ratios else "–",
            "ratio_median": fmt(statistics.median(ratios), ".2g") + "×" if ratios else "–",
            "fallback": sum(o.get("yardstick") == "fallback" for _, o in pairs),
            "hidden": f"{min(hidden)}–{max(hidden)}"}


def _ulp_budget(op: str) -> float:
    """The op's own dtype budget in ulps (the catalog's ``fallback_ulps``): past it a passing figure is explained."""
    spec = OPS.get(op)
    return float(spec.fallback_ulps) if spec is not None else 8.0


def o_passed(output: dict[str, Any]) -> int:
    """1 for a failing comparison (it sorts last, so ``max`` picks it), else 0."""
    return 0 if output.get("passed", True) else 1


def _merge_outputs(hists: dict[str, dict[str, list[int]]]) -> dict[str, list[int]]:
    """{dtype: {output: counts}} -> {dtype: counts summed over outputs}."""
    out = {}
    for dtype, per_output in hists.items():
        total: list[int] = []
        for counts in per_output.values():
            total = [a + b for a, b in zip(total, counts)] if total else list(counts)
        out[dtype] = total
    return out


def speed(records: list[dict[str, Any]], meta: dict[str, Any] | None, power_limit_w: float | None = None
          ) -> dict[str, Any] | None:
    """Tables and charts of the benchmark sweep; None where there is none.

    ``power_limit_w``: the card's enforced power limit from the run's
    environment, for NVML readings that do not carry their own.
    """
    if not records:
        return None
    dtype = _main_dtype(records)
    ops = [o for o in OPS if any(r["op"] == o for r in records)]
    impls: list[str] = []
    for r in records:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    impls.sort(key=lambda i: (i != "reference", i != "eager", i != "compile", i))
    points: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in records:
        points.setdefault((r["op"], r["point"], r["dtype"]), {})[r["impl"]] = r
    table = []
    for (op, point, dt), by in points.items():
        table.append(_point_row(op, point, dt, by, impls))
    time_panels, rate_panels, bars, memory, power = [], [], [], [], []
    for op in ops:
        mine = [r for r in records if r["op"] == op and r["dtype"] == dtype]
        compute = _compute_bound(op)
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        rates: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in mine:  # attention: FLOPs tell causal from full and prefill from decode; bytes do not
            x = number(r.get("flops" if compute else "bytes_moved"))
            series[r["impl"]].append((x, r["us"]))
            rates[r["impl"]].append((x, number(r.get("tflops" if compute else "gbps"))))
        xlabel = "FLOPs" if compute else "bytes moved"
        time_panels.append({"title": f"{op} ({dtype})", "series": dict(series), "xlabel": xlabel})
        rate_panels.append({"title": f"{op} ({dtype})", "series": dict(rates), "xlabel": xlabel,
                            "ylabel": "TFLOP/s" if compute else "GB/s"})
        big = _largest_point(records, op, dtype)
        at = {r["impl"]: r for r in mine if r["point"] == big}
        if not compute:
            bars.append({"op": op, "values": {i: number(r.get("pct_copy")) for i, r in at.items()
                                              if number(r.get("pct_copy")) is not None}})
        if at:
            memory.append(_memory_row(op, big, dtype, at))
            power += _power_rows(op, big, at, power_limit_w)
    return {
        "dtype": dtype, "impls": impls, "table": table, "copy_bw": copy_bandwidth(records, meta),
        "time_svg": charts.speed_panels(time_panels, ylabel="µs (median)", salt="time"),
        "rate_svg": charts.speed_panels(rate_panels, ylabel="GB/s or TFLOP/s", salt="rate"),
        "roofline_svg": charts.roofline_bars(bars, "roofline"),
        "memory": memory, "power": power, "power_summary": _power_summary(power),
        "skipped": (meta or {}).get("skipped") or [],
        "seconds": (meta or {}).get("seconds"), "interrupted": (meta or {}).get("interrupted"),
    }


def _cell(text: str, why: str = "", cls: str = "") -> dict[str, str]:
    """A table cell: its text and, where it shows no figure, why (the cell's title)."""
    return {"text": text, "title": why, "cls": cls}


def _point_row(op: str, point: str, dtype: str, by: dict[str, dict[str, Any]], impls: list[str]) -> dict[str, Any]:
    """One benchmark point of the "every point" table; a cell without a figure says why."""
    ref = by.get("reference", {})
    compute = _compute_bound(op)
    us = [_cell(fmt(by[i].get("us"), ".1f")) if i in by else _cell("–", f"{i} was not timed at this point")
          for i in impls]
    if not ref:
        rate = pct = _cell("–", "the reference was not timed at this point")
    else:
        rate = _cell(f"{fmt(ref.get('tflops'), '.0f')} TFLOP/s" if compute else f"{fmt(ref.get('gbps'), '.0f')} GB/s")
        pct = (_cell("–", f"{op} is bound by arithmetic: its rate is TFLOP/s, not a share of the copy bandwidth")
               if compute else _cell(f"{fmt(ref.get('pct_copy'), '.0f')}%") if ref.get("pct_copy") is not None
               else _cell("–", "no copy bandwidth was recorded"))
    ratios = []
    for base in ("eager", "compile"):
        value = number(ref.get(f"speedup_vs_{base}"))
        ratios.append(_cell(fmt_x(value), cls=speed_cls(value)) if value is not None else
                      _cell("–", f"{'torch.compile' if base == 'compile' else base} was not timed at this point"))
    counts = [str(((by.get(i) or {}).get("launches") or {}).get("count", "–"))
              for i in ("reference", "eager", "compile")]
    return {"op": op, "point": point, "dtype": dtype, "us": us, "rate": rate, "pct_copy": pct,
            "vs_eager": ratios[0], "vs_compile": ratios[1],
            "launches": _cell(" / ".join(counts), "–: not counted for that contender" if "–" in counts else "")}


def copy_bandwidth(records: list[dict[str, Any]], meta: dict[str, Any] | None) -> str | None:
    """The measured copy bandwidth that "% of copy" is against, as text; None where none was recorded.

    ``fuseaudit bench`` stores it once per sweep; every benchmark record also
    carries the figure its own benchmark run measured, which is all a file merged
    from several runs has.
    """
    value = number((meta or {}).get("copy_gbps"))
    if value:
        return f"{value:.0f} GB/s"
    values = sorted({round(v) for v in (number(r.get("copy_gbps")) for r in records) if v})
    if not values:
        return None
    if len(values) == 1:
        return f"{values[0]:.0f} GB/s"
    return f"{values[0]:.0f}–{values[-1]:.0f} GB/s (each benchmark run measures its own)"


def _memory_row(op: str, point: str | None, dtype: str | None, at: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Peaks of every contender at the op's largest point, the reference's saving over eager, and why one is absent."""
    cells = {}
    for impl in ("reference", "eager", "compile"):
        peak = _peak(at[impl]) if impl in at else None
        why = "" if peak is not None else (f"{impl} was not timed at this point" if impl not in at
                                           else "its peak was not measured")
        cells[impl] = {"text": fmt_bytes(peak), "title": why}
    ref = at.get("reference", {})
    saved = number(ref.get("peak_saved_vs_eager_bytes"))
    if saved is None:
        missing = [i for i in ("reference", "eager") if cells[i]["title"]]
        saved_cell = {"text": "–", "title": f"no peak of {' or '.join(missing) or 'eager'} here", "cls": ""}
    elif saved < 0:
        own = number((ref.get("memory") or {}).get("temporaries_bytes"))
        extra = f": {fmt_bytes(own)} of temporaries of its own" if own else ""
        saved_cell = {"text": "−" + fmt_bytes(-saved), "cls": "",
                      "title": f"the reference peaks {fmt_bytes(-saved)} above eager here{extra}"}
    else:
        saved_cell = {"text": fmt_bytes(saved), "title": "", "cls": ""}
    return {"op": op, "point": point, "dtype": dtype, "peak_ref": cells["reference"], "peak_eager": cells["eager"],
            "peak_compile": cells["compile"], "saved": saved_cell,
            "avoided": fmt_bytes(ref.get("intermediate_bytes_avoided")), "compute_bound": _compute_bound(op)}


def _reading(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The NVML reading of a record worth judging: the back-to-back energy loop where one ran, else the timed window."""
    loop = record.get("energy_loop") or {}
    if loop.get("available"):
        return loop, "loop"
    return record.get("nvml") or {}, "timed"


def _power_rows(op: str, point: str | None, at: dict[str, dict[str, Any]], limit_w: float | None
                ) -> list[dict[str, Any]]:
    """NVML per contender at the op's largest point.

    Power and energy only where :func:`nvml.energy_doubts` finds nothing to
    doubt (else its reasons, shown instead); energy per call only from a
    back-to-back loop, the one reading whose call count is known.  Clocks,
    temperature and throttling are instantaneous reads, shown as read.
    """
    rows = []
    for impl, r in at.items():
        reading, source = _reading(r)
        seconds = number(reading.get("seconds"))
        doubts = nvml.energy_doubts(seconds=seconds, energy_j=number(reading.get("energy_j")),
                                    watts=number(reading.get("avg_watts")),
                                    power_limit_w=number(reading.get("power_limit_w")) or limit_w)
        trusted = bool(reading.get("available")) and not doubts
        if not trusted:
            why = "; ".join(doubts)
        elif source != "loop":
            why = "energy per call needs a back-to-back loop (fuseaudit bench --energy-seconds S)"
        else:
            why = ""
        throttle = [x for x in (reading.get("throttle_reasons") or []) if x != "gpu_idle"]
        rows.append({"op": op, "point": point, "impl": impl, "available": bool(reading.get("available")),
                     "trusted": trusted, "doubts": [] if trusted else doubts, "why": why,
                     "source": "1 s loop" if source == "loop" else "timed repeats",
                     "window": fmt(seconds, ".3g") + " s" if seconds is not None else "–",
                     "watts": fmt(reading.get("avg_watts"), ".0f") if trusted else "–",
                     "energy": fmt(reading.get("energy_per_call_uj"), ".3g") if trusted and source == "loop" else "–",
                     "sm_mhz": fmt(reading.get("sm_clock_mhz"), ".0f"),
                     "mem_mhz": fmt(reading.get("mem_clock_mhz"), ".0f"),
                     "temp": fmt(reading.get("temperature_c"), ".0f"), "throttle": ", ".join(throttle) or "none",
                     "reason": reading.get("reason") or ""})
    return rows


# (a phrase of an nvml.energy_doubts reason, how the summary counts it); the first phrase found names it
_DOUBT_KINDS = (("backwards", "the counter going backwards"), ("did not advance", "the counter not advancing"),
                ("above the card", "averages above the card's power limit"),
                ("no power limit", "no power limit to check against"), ("no energy", "no energy reading"),
                ("under 1 s", "windows under 1 s, too short for the energy counter"))


def _power_summary(rows: list[dict[str, Any]]) -> str:
    """One line over the NVML rows: the trusted power range, clocks, throttling, and what was left out and why."""
    ok = [r for r in rows if r["available"]]
    if not ok:
        return "NVML unavailable" + (f": {rows[0]['reason']}" if rows else "")

    def span(key: str, among: list[dict[str, Any]]) -> str:
        vals = sorted(v for v in (number(r[key]) for r in among) if v is not None)
        return "–" if not vals else (f"{vals[0]:.0f}" if vals[0] == vals[-1] else f"{vals[0]:.0f}–{vals[-1]:.0f}")

    trusted = [r for r in ok if r["trusted"]]
    power = (f"power {span('watts', trusted)} W over {len(trusted)} back-to-back loop(s)" if trusted
             else "no power figure shown")
    left = [r for r in ok if not r["trusted"]]
    if left:
        kinds: dict[str, int] = defaultdict(int)
        for r in left:
            for d in r["doubts"]:
                kinds[next((text for key, text in _DOUBT_KINDS if key in d), d)] += 1
        power += (f" ({len(left)} of {len(ok)} readings not shown: "
                  + ", ".join(f"{k} ({n})" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])) + ")")
    reasons = sorted({x for r in ok for x in r["throttle"].split(", ") if x != "none"})
    return (f"{power}; SM clock {span('sm_mhz', ok)} MHz, {span('temp', ok)} °C; throttling: "
            f"{', '.join(reasons) or 'none'}")


def e2e(runs: list[dict[str, Any]], *, out: Any = None) -> dict[str, Any] | None:
    """The end-to-end decode-step tables of the first run that has them (this project's stack or a transformers
    model).  ``out``: the page's path; a profiled step's trace is linked where it lies beside it."""
    for run in sorted(runs, key=lambda r: r["device"] != "cuda"):
        doc = (run.get("e2e") or {}).get("document")
        if not doc:
            continue
        agreement = doc.get("agreement") or {}
        gains = {(g.get("variant"), g.get("batch")): g for g in doc.get("gains", [])}
        results_rows = [_e2e_row(r, gains.get((r.get("variant"), r.get("batch")), {})) for r in doc.get("results", [])]
        micro = [{"batch": m.get("batch"), "predicted": fmt_x(m.get("predicted_gain")),
                  "measured": fmt_x(m.get("measured_gain")), "measured_cls": speed_cls(m.get("measured_gain")),
                  "share": _percent(m.get("eager_share_of_step")),
                  "amdahl": fmt_x(m.get("amdahl_gain")), "skipped": m.get("skipped") or ""}
                 for m in doc.get("microbench", [])]
        checks = [_agreement_row(c) for c in agreement.get("checks", [])]
        cfg = doc.get("config") or {}
        cpu_launches = [{"variant": k, "text": str(v.get("count")) if "count" in v else str(v.get("error", "–"))}
                        for k, v in (doc.get("launches_cpu") or {}).items() if isinstance(v, dict)]
        shown = {col: any(r[col] != "–" for r in results_rows) for col in ("tokens", "graph_gain", "launches")}
        return {"device": run["device"], "verdict": agreement.get("verdict", "–"), "checks": checks,
                "results": results_rows, "micro": micro, "timing": doc.get("timing"),
                "timing_note": doc.get("timing_note") or "", "notes": doc.get("notes") or [],
                "model": _e2e_model(doc), "hf": bool(doc.get("model_class")), "shown": shown,
                "config": ", ".join(f"{k}={v}" for k, v in cfg.items() if not isinstance(v, dict)),
                "dtype": doc.get("dtype"), "prompt_len": doc.get("prompt_len"), "skipped": doc.get("skipped") or [],
                "cpu_launches": cpu_launches,
                "profiles": [_e2e_profile(p, out=out) for p in doc.get("profiles") or []],
                "greedy": [_greedy_line(g) for g in agreement.get("greedy") or []]}
    return None


def _e2e_model(doc: dict[str, Any]) -> str:
    """What was measured: a transformers class of a size, or the project's own stack."""
    if not doc.get("model_class"):
        return "A Llama-style decoder of this project's own"
    cfg = doc.get("config") or {}
    params = number(cfg.get("params"))
    size = f"{params / 1e9:.2f}B parameters, " if params else ""
    return (f"transformers' {doc['model_class']} ({size}{cfg.get('layers', '?')} layers, hidden "
            f"{cfg.get('hidden', '?')}; random weights)")


def _e2e_row(r: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
    """One variant at one batch: times, their spread, tokens/s, gains over eager (eager/variant)."""
    spread = number((r.get("tpot") or {}).get("iqr_us"))
    eager = r.get("variant") == "eager"
    return {
        "variant": r.get("variant"), "batch": r.get("batch"), "ttft": fmt(r.get("ttft_ms"), ".3g"),
        "tpot": fmt(r.get("tpot_ms"), ".3g"), "tpot_iqr": fmt(spread / 1e3 if spread is not None else None, ".2g"),
        "tokens": fmt(r.get("tokens_per_s"), ".0f"), "tpot_graph": fmt(r.get("tpot_graph_ms"), ".3g"),
        "launches": (r.get("launches") or {}).get("count", "–"),
        "peak": fmt_bytes(r.get("peak_decode_bytes", r.get("peak_bytes"))), "skipped": r.get("skipped") or "",
        "errors": "; ".join(f"{k}: {v}" for k, v in (r.get("errors") or {}).items()),
        "tpot_gain": fmt_x(g.get("tpot_gain")), "ttft_gain": fmt_x(g.get("ttft_gain")),
        "graph_gain": fmt_x(g.get("tpot_graph_gain")), "tpot_value": number(g.get("tpot_gain")),
        "tpot_cls": "" if eager else speed_cls(g.get("tpot_gain")),
        "ttft_cls": "" if eager else speed_cls(g.get("ttft_gain")),
        "graph_cls": "" if eager else speed_cls(g.get("tpot_graph_gain")),
    }


def _e2e_profile(p: dict[str, Any], *, out: Any = None) -> dict[str, Any]:
    """Where one profiled decode step's GPU and host time went, by category (the model's ops, matmuls, the rest).

    ``trace`` is the Chrome trace's file name where it lies beside the page ``out`` (else empty, and
    ``trace_note`` says so): a link that leads nowhere is worse than none.
    """
    def ms(value: Any) -> str:  # the document's µs, shown in ms
        v = number(value)
        return fmt(v / 1e3 if v is not None else None, ".3g")

    name = pathlib.Path(str(p.get("trace") or "")).name
    beside = bool(name) and out is not None and (pathlib.Path(out).parent / name).is_file()
    return {"variant": p.get("variant"), "batch": p.get("batch"), "trace": name if beside else "",
            "trace_note": "" if beside or not name else f"its trace ({name}) is not kept beside this page",
            "host": ms(p.get("host_step_us")), "busy": ms(p.get("gpu_busy_us")), "span": ms(p.get("gpu_span_us")),
            "kernels": p.get("kernels", "–"), "error": p.get("error") or "",
            "rows": [{"category": r.get("category"), "gpu": ms(r.get("gpu_us")),
                      "gpu_share": _percent(r.get("gpu_share")),
                      "host": ms(r.get("host_us")), "host_share": _percent(r.get("host_share")),
                      "kernels": r.get("kernels", "–")} for r in p.get("rows") or []]}


def _greedy_line(g: dict[str, Any]) -> str:
    """Greedy tokens of a variant against its reference: identical, or where they first part."""
    head = f"{g.get('variant')} vs {g.get('reference')} over {g.get('steps')} steps: "
    if g.get("identical"):
        return head + "identical tokens"
    d = g.get("first_divergence") or {}
    return head + (f"first divergence at step {d.get('step')}, row {d.get('row')} ({d.get('reference_token')} vs "
                   f"{d.get('token')}; gap {fmt(d.get('reference_gap'), '.3g')} in the reference's logits)")


E2E_ULP_BUDGET = 64.0  # the catalog's widest dtype budget (attention's): past it a passing figure is explained


def _agreement_row(check: dict[str, Any]) -> dict[str, Any]:
    """One end-to-end agreement check: verdict, tolerance used, max ulp and why a large count still passes."""
    from .results import margin

    cmp = check.get("comparison") or {}
    ulp, eager_ulp = number(cmp.get("max_ulp_err")), number(cmp.get("eager_max_ulp_err"))
    passed = bool(check.get("passed"))
    note = ulp_note(ulp, eager_ulp, budget_ulps=E2E_ULP_BUDGET, passed=passed)
    if note and check.get("variant") == "eager":
        note = {"text": "the yardstick", "title": "eager is the yardstick: against the float64 oracle its bound is "
                "twice its own error, at the row's magnitude; the count is at each element's own magnitude, where "
                "near zero one ulp is tiny"}
    return {"variant": check.get("variant"), "output": check.get("output"), "passed": passed,
            "error": check.get("error") or "", "budget": budget(margin(cmp)) if cmp else budget(None),
            "ulp": fmt(ulp, ".3g"), "note": note, "ratio": fmt(cmp.get("ratio_to_eager"), ".2g")}


def environment(runs: list[dict[str, Any]], labels: list[str], records: list[dict[str, Any]] | None = None,
                meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per run the versions and hardware behind its figures (shown folded, below each run's provenance)."""
    out = []
    copy = copy_bandwidth(records or [], meta)
    for run, label in zip(runs, labels):
        env = run.get("environment") or {}
        gpu = env.get("gpu") or {}
        nv = gpu.get("nvml") or {}
        cpu = env.get("cpu") or {}
        items = [
            ("device", env.get("device_name") or run["device"]),
            ("GPU", gpu.get("name")), ("compute capability", gpu.get("capability")),
            ("SMs", gpu.get("sm_count")), ("GPU memory", fmt_bytes(gpu.get("memory_bytes")) if gpu else None),
            ("L2", fmt_bytes(gpu.get("l2_bytes")) if gpu.get("l2_bytes") else None),
            ("driver", gpu.get("driver")), ("CUDA (driver)", gpu.get("cuda_driver")),
            ("CUDA (torch)", env.get("cuda")), ("cuDNN", env.get("cudnn")),
            ("power limit", f"{fmt(nv.get('power_limit_w'), '.0f')} W" if nv.get("power_limit_w") else None),
            ("max SM / memory clock", f"{nv.get('max_sm_clock_mhz')} / {nv.get('max_mem_clock_mhz')} MHz"
             if nv.get("max_sm_clock_mhz") else None),
            ("measured copy bandwidth", copy if run.get("bench", {}).get("document") else None),
            ("torch", env.get("torch")), ("Triton", env.get("triton")), ("Python", env.get("python")),
            ("Hypothesis", env.get("hypothesis")), ("fuseaudit", env.get("fuseaudit")),
            ("CPU", f"{cpu.get('model')} ({cpu.get('logical_cores')} logical cores)" if cpu else None),
            ("platform", env.get("platform")),
        ]
        out.append({"run": label, "rows": [(k, str(v)) for k, v in items if v not in (None, "", "None")]})
    return out


def power_limit(runs: list[dict[str, Any]]) -> float | None:
    """The enforced power limit NVML gave for the (first) GPU run's card, if any."""
    for run in runs:
        nv = (((run.get("environment") or {}).get("gpu") or {}).get("nvml") or {})
        value = number(nv.get("power_limit_w"))
        if value:
            return value
    return None


@dataclasses.dataclass(frozen=True)
class Goals:
    """Speed targets the report checks every reference point against (``fuseaudit report --target-*``).

    ``copy_pct``: at least this % of the measured copy bandwidth at every
    point moving at least ``copy_min_mib`` MiB (small points are bound by
    latency, not bandwidth; attention, bound by arithmetic, is left out);
    ``compile_ratio``: at least this speed-up over
    torch.compile at every point timed against it.  None: not checked.
    """

    copy_pct: float | None = None
    copy_min_mib: float = 256.0
    compile_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.copy_pct is not None and not 0 < self.copy_pct <= 1000:
            raise ValueError(f"the copy target is a percentage in (0, 1000], got {self.copy_pct}")
        if not self.copy_min_mib >= 0:
            raise ValueError(f"the copy target's minimum size must be >= 0 MiB, got {self.copy_min_mib}")
        if self.compile_ratio is not None and not self.compile_ratio > 0:
            raise ValueError(f"the torch.compile target is a ratio > 0, got {self.compile_ratio}")


def targets(records: list[dict[str, Any]], goals: Goals | None) -> dict[str, Any] | None:
    """Which reference points meet ``goals``, with the misses worst first; None where no goal is set."""
    if goals is None or (goals.copy_pct is None and goals.compile_ratio is None):
        return None
    refs = [r for r in records if r["impl"] == "reference"]
    out: dict[str, Any] = {}
    if goals.copy_pct is not None:
        big = [r for r in refs if number(r.get("pct_copy")) is not None and not _compute_bound(r["op"])
               and (number(r.get("bytes_moved")) or 0) >= goals.copy_min_mib * 2**20]
        out["copy"] = _goal_view(big, "pct_copy", goals.copy_pct, goal=f"{goals.copy_pct:g}% of copy",
                                 scope=f"points moving {goals.copy_min_mib:g} MiB or more")
    if goals.compile_ratio is not None:
        timed = [r for r in refs if number(r.get("speedup_vs_compile")) is not None]
        out["compile"] = _goal_view(timed, "speedup_vs_compile", goals.compile_ratio,
                                    goal=f"{goals.compile_ratio:g}× torch.compile", scope="points timed against it")
    return out


def _goal_view(points: list[dict[str, Any]], key: str, least: float, *, goal: str, scope: str) -> dict[str, Any]:
    misses = sorted((r for r in points if number(r[key]) < least), key=lambda r: number(r[key]))
    return {"goal": goal, "scope": scope, "met": len(points) - len(misses), "total": len(points),
            "misses": [{"op": r["op"], "point": r["point"], "dtype": r["dtype"], "us": fmt(r.get("us"), ".1f"),
                        "mib": fmt((number(r.get("bytes_moved")) or 0) / 2**20, ".0f"),
                        "pct_copy": fmt(r.get("pct_copy"), ".1f") + "%" if r.get("pct_copy") is not None else "–",
                        "vs_compile": fmt(r.get("speedup_vs_compile"), ".3f"),
                        "vs_compile_cls": speed_cls(r.get("speedup_vs_compile"))} for r in misses]}


def _part(text: str, cls: str = "", pre: str = "") -> dict[str, str]:
    """One coloured figure of the headline; ``pre``: plain text before it (a separator, a lead-in)."""
    return {"text": text, "cls": cls, "pre": pre}


def _right(verdict: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Right? The reference kernels' verdict, then the third-party targets' (failed is red, passed green)."""
    if verdict["refs"] == 0:
        parts = [_part("no reference kernel was audited", "bad")]
    elif verdict["ok"]:
        parts = [_part(f"all {verdict['refs']} reference kernel audits pass every property ({verdict['ops']} ops)",
                       "good")]
    else:
        parts = [_part(f"{verdict['bad']} of {verdict['refs']} reference kernel audits failed or could not run: "
                       f"{', '.join(verdict['failed_ops'])}", "bad")]
    others = [a for r in runs for a in r["audits"] if a["kind"] != "reference" and a["status"] != "skipped"]
    if others:
        failed = [a for a in others if audit_status(a) in ("FAIL", "ERROR", "UNAVAILABLE")]
        text = (f"{len(failed)} of {len(others)} failed a property or could not run (see Verdicts)" if failed
                else f"all {len(others)} pass")
        parts.append(_part(text, "bad" if failed else "good", pre="; third-party target audits: "))
    return {"label": "Right?", "cls": parts[0]["cls"], "parts": parts}


def _fused(head: list[dict[str, Any]]) -> dict[str, Any]:
    """Fused? How many reference kernels launch the expected number of kernels per call."""
    counted = [r["launches"] for r in head if r["launches"]]
    if not counted:
        return {"label": "Fused?", "cls": "", "parts": [_part("no launch counts in these results")]}
    ok = sum(1 for c in counted if c["ok"])
    cls = "good" if ok == len(counted) else "bad"
    return {"label": "Fused?", "cls": cls, "parts": [_part(
        f"{ok} of {len(counted)} reference kernels launch the expected number of kernels per call", cls),
        _part(counted[0]["device"], pre=", counted on ")]}


def _worth_it(records: list[dict[str, Any]], e2e_view: dict[str, Any] | None,
              goals_view: dict[str, Any] | None) -> dict[str, Any]:
    """Worth it? Speed-ups over eager and torch.compile, the decode step end to end, then the speed targets.

    Each figure is coloured by :func:`speed_cls` (green faster, red slower);
    a target is a goal rather than a verdict: green where every point meets
    it, plain otherwise.
    """
    parts = []
    refs = [r for r in records if r["impl"] == "reference"]
    for ref, name in (("eager", "eager"), ("compile", "torch.compile")):
        vals = [v for v in (number(r.get(f"speedup_vs_{ref}")) for r in refs) if v is not None]
        if vals:
            g = geomean(vals)
            parts.append(_part(f"{fmt_x(g)} vs {name}", speed_cls(g), pre="; " if parts else ""))
            parts.append(_part("", pre=f" (geometric mean over {len(vals)} points, faster at "
                                       f"{sum(v > 1 for v in vals)})"))
    gains = [r for r in (e2e_view or {}).get("results", []) if r["variant"] != "eager" and r["tpot_value"] is not None]
    for k, r in enumerate(gains):
        lead = ("; " if parts else "") + "decode step (TPOT) vs eager: " if k == 0 else ", "
        parts.append(_part(f"{r['variant']} {r['tpot_gain']} at batch {r['batch']}", r["tpot_cls"], pre=lead))
    for g in (goals_view or {}).values():
        parts.append(_part(f"{g['met']} of {g['total']} {g['scope']}", "good" if g["met"] == g["total"] else "",
                           pre=("; " if parts else "") + f"target {g['goal']}: "))
    if not parts:
        parts = [_part("no timing in these results: speed needs a GPU run")]
    return {"label": "Worth it?", "cls": "", "parts": parts}


def questions(verdict: dict[str, Any], runs: list[dict[str, Any]], head: list[dict[str, Any]],
              records: list[dict[str, Any]], e2e_view: dict[str, Any] | None,
              goals_view: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The headline: right? fused? worth it?, in that order, each a list of coloured parts."""
    return [_right(verdict, runs), _fused(head), _worth_it(records, e2e_view, goals_view)]


def build(runs: list[dict[str, Any]], goals: Goals | None = None, *, sources: list[Any] | None = None,
          out: Any = None) -> dict[str, Any]:
    """Everything the template shows (``goals``: speed targets to check, see :class:`Goals`).

    ``sources``: the results file of each run (for links to the data and to
    a README beside it), ``out``: where the page is written (links are
    relative to it).
    """
    labels = run_labels(runs)
    records, meta = bench_records(runs)
    refs = [a for r in runs for a in r["audits"] if a["kind"] == "reference"]
    bad = [a for a in refs if audit_status(a) != "PASS"]
    verdict = {"ok": bool(refs) and not bad, "refs": len(refs), "bad": len(bad),
               "ops": len({a["op"] for a in refs}), "failed_ops": sorted({a["op"] for a in bad})}
    head, e2e_view = headline(runs, labels, records), e2e(runs, out=out)
    summary_rows = summary(runs, labels)
    goals_view = targets(records, goals)
    paths = list(sources or []) + [None] * (len(runs) - len(sources or []))
    return {
        "labels": labels, "verdict": verdict, "properties": PROPERTY_ORDER,
        "headline": head, "questions": questions(verdict, runs, head, records, e2e_view, goals_view),
        "summary": summary_rows, "targets": goals_view,
        # a run spread over several GPUs (fuseaudit run --gpus N): each audit's device gets a column
        "multi_device": len({r["device"] for r in summary_rows}) > 1,
        "failures": failures(runs, labels), "tolerance": tolerance(runs, labels),
        "launch_table": _launch_rows(runs), "speed": speed(records, meta, power_limit(runs)), "e2e": e2e_view,
        "environment": environment(runs, labels, records, meta),
        "provenance": [provenance(run, label, source=path, out=out) for run, label, path in zip(runs, labels, paths)],
        "has_bench": bool(records), "ulp_bins": charts.bin_labels(), "dtypes": list(charts.DTYPE_COLORS),
    }
