"""From results documents to what the report template shows: rows of strings, classes and charts.

:func:`build` takes one or more results documents (:mod:`fuseaudit.results`;
a CPU run and a GPU run may be merged) and returns a plain dict.  Every
string that came from a target (names, messages, kernel names) stays a
plain string here; the template escapes it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from . import report_charts as charts
from .catalog import OPS
from .results import PROPERTY_ORDER, number

STATUS_CLASS = {"PASS": "pass", "FAIL": "fail", "SKIP": "skip", "ERROR": "fail", "UNAVAILABLE": "fail"}


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


def budget(value: Any) -> dict[str, str]:
    """A margin (worst row error / bound) as the share of the tolerance used: text and CSS class."""
    v = number(value)
    if v is None:
        return {"text": "–", "cls": ""}
    if math.isinf(v) or math.isnan(v):
        return {"text": "NaN/Inf", "cls": "bad"}
    if v <= 1:
        return {"text": f"{100 * v:.0f}%", "cls": "good"}
    return {"text": f"{v:.3g}× bound", "cls": "bad"}


def fmt_x(value: Any) -> str:
    v = number(value)
    return "–" if v is None else f"{v:.2f}×"


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
    if a["status"] != "done":
        return a["status"].upper()
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
        return out, doc.get("fuseaudit") or {}
    return [], None


def _is_attention(op: str) -> bool:
    """Attention is bound by arithmetic: its rate is TFLOP/s, not a share of the copy bandwidth."""
    spec = OPS.get(op)
    return spec is not None and spec.family == "attention"


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
                right.append({"run": run["device"], "status": status, "cls": STATUS_CLASS.get(status, "skip"),
                              "title": f"{label}: " + (", ".join(failed) if failed else a.get("message", status))})
                for _, o in _outputs(a.get("cases", [])):
                    ulp.append(number(o.get("max_ulp_err")))
                    eager_ulp.append(number(o.get("eager_max_ulp_err")))
                    ratios.append(number(o.get("ratio_to_eager")))
                    margins.append(number(o.get("margin")))
        finite = [r for r in ratios if r is not None and math.isfinite(r)]
        row: dict[str, Any] = {
            "op": op, "right": right,
            "budget": budget(max((m for m in margins if m is not None), default=None)),
            "ulp": fmt(max((u for u in ulp if u is not None), default=None), ".3g"),
            "eager_ulp": fmt(max((u for u in eager_ulp if u is not None), default=None), ".3g"),
            "ratio_median": fmt(statistics.median(finite), ".2g") + "×" if finite else "–",
        }
        lr = launch_rows.get(op)
        row["launches"] = lr
        mine = [r for r in bench if r["op"] == op and r["impl"] == "reference"]
        for ref in ("eager", "compile"):
            vals = [number(r.get(f"speedup_vs_{ref}")) for r in mine]
            vals = [v for v in vals if v is not None]
            g = geomean(vals)
            row[f"vs_{ref}"] = {"text": fmt_x(g), "range": f"{min(vals):.2f}–{max(vals):.2f}×" if vals else "",
                                "cls": "" if g is None else ("good" if g >= 1.05 else "bad" if g < 0.95 else "")}
        if _is_attention(op):
            best = max((number(r.get("tflops")) or 0 for r in mine), default=0)
            row["roofline"] = f"{best:.0f} TFLOP/s" if best else "–"
        else:
            best = max((number(r.get("pct_copy")) or 0 for r in mine), default=0)
            row["roofline"] = f"{best:.0f}% of copy" if best else "–"
        avoided = max((number(r.get("intermediate_bytes_avoided")) or 0 for r in mine), default=0)
        row["memory"] = fmt_bytes(avoided) if avoided else ("0" if mine else "–")
        rows.append(row)
    return rows


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
                    cell[impl] = {"text": str(e.get("count")), "title": ", ".join(map(str, e.get("kernels", [])))}
            if "error" in r:
                cell["reference"] = {"text": "error", "title": str(r["error"])}
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
                              "title": str((props.get(p) or {}).get("summary", ""))})
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
                out.append({**base, "prop": a["status"], "message": a.get("message", ""), "cases": [], "more": 0})
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
                    cases.append({"source": f.get("source", ""), "describe": f.get("describe", ""),
                                  "message": f.get("message", ""), "replay": f.get("replay") or "",
                                  "figures": lines})
                out.append({**base, "prop": p, "message": v.get("summary", ""), "cases": cases,
                            "more": max(0, len(v.get("failures", [])) - 3)})
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
                              "ratio": fmt(o.get("ratio_to_eager"), ".2g"), "passed": o.get("passed", True),
                              "describe": c["describe"], "replay": replay})
    hists, scatters = [], []
    for n, (run, label) in enumerate(zip(runs, labels)):
        refs = [a for a in run["audits"] if a["kind"] == "reference"]
        h_panels = [{"title": a["op"], "histograms": _merge_outputs(a.get("ulp_histograms") or {})} for a in refs]
        s_panels = [{"title": a["op"], "xlabel": "keys (Sk)" if c0 else "hidden size N",
                     "points": [{"x": (c["keys"] if c0 else c["hidden"]) or 1, "dtype": c["dtype"],
                                 "ulp": number(o.get("max_ulp_err")), "eager_ulp": number(o.get("eager_max_ulp_err")),
                                 "passed": o.get("passed", True)} for c, o in _outputs(a.get("cases", []))]}
                    for a in refs for c0 in [_is_attention(a["op"])]]
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
        per_dtype[dtype] = {
            "budget": budget(max(margins, default=None)),
            "ulp": fmt(max((number(o.get("max_ulp_err")) or 0 for o in mine), default=None), ".3g"),
            "eager_ulp": fmt(max((number(o.get("eager_max_ulp_err")) or 0 for o in mine), default=None), ".3g"),
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


def speed(records: list[dict[str, Any]], meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """Tables and charts of the benchmark sweep; None where there is none."""
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
        ref = by.get("reference", {})
        attention = _is_attention(op)
        table.append({
            "op": op, "point": point, "dtype": dt,
            "us": [fmt(by.get(i, {}).get("us"), ".1f") for i in impls],
            "rate": (fmt(ref.get("tflops"), ".0f") + " TFLOP/s") if attention else (fmt(ref.get("gbps"), ".0f")
                                                                                     + " GB/s"),
            "pct_copy": fmt(ref.get("pct_copy"), ".0f") + "%" if ref.get("pct_copy") is not None else "–",
            "vs_eager": fmt_x(ref.get("speedup_vs_eager")), "vs_compile": fmt_x(ref.get("speedup_vs_compile")),
            "launches": " / ".join(str(((by.get(i) or {}).get("launches") or {}).get("count", "–"))
                                   for i in ("reference", "eager", "compile")),
        })
    time_panels, rate_panels, bars, memory, power = [], [], [], [], []
    for op in ops:
        mine = [r for r in records if r["op"] == op and r["dtype"] == dtype]
        attention = _is_attention(op)
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        rates: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in mine:  # attention: FLOPs tell causal from full and prefill from decode; bytes do not
            x = number(r.get("flops" if attention else "bytes_moved"))
            series[r["impl"]].append((x, r["us"]))
            rates[r["impl"]].append((x, number(r.get("tflops" if attention else "gbps"))))
        xlabel = "FLOPs" if attention else "bytes moved"
        time_panels.append({"title": f"{op} ({dtype})", "series": dict(series), "xlabel": xlabel})
        rate_panels.append({"title": f"{op} ({dtype})", "series": dict(rates), "xlabel": xlabel,
                            "ylabel": "TFLOP/s" if attention else "GB/s"})
        big = _largest_point(records, op, dtype)
        at = {r["impl"]: r for r in mine if r["point"] == big}
        if not attention:
            bars.append({"op": op, "values": {i: number(r.get("pct_copy")) for i, r in at.items()
                                              if number(r.get("pct_copy")) is not None}})
        if at:
            memory.append(_memory_row(op, big, dtype, at))
            power += _power_rows(op, big, at)
    return {
        "dtype": dtype, "impls": impls, "table": table, "copy_gbps": fmt((meta or {}).get("copy_gbps"), ".0f"),
        "time_svg": charts.speed_panels(time_panels, ylabel="µs (median)", salt="time"),
        "rate_svg": charts.speed_panels(rate_panels, ylabel="GB/s or TFLOP/s", salt="rate"),
        "roofline_svg": charts.roofline_bars(bars, "roofline"),
        "memory": memory, "power": power, "power_summary": _power_summary(power),
        "skipped": (meta or {}).get("skipped") or [],
        "seconds": (meta or {}).get("seconds"), "interrupted": (meta or {}).get("interrupted"),
    }


def _memory_row(op: str, point: str | None, dtype: str | None, at: dict[str, dict[str, Any]]) -> dict[str, Any]:
    peak = {i: number((r.get("memory") or {}).get("peak_extra_bytes")) for i, r in at.items()}
    ref = at.get("reference", {})
    return {"op": op, "point": point, "dtype": dtype,
            "peak_ref": fmt_bytes(peak.get("reference")), "peak_eager": fmt_bytes(peak.get("eager")),
            "peak_compile": fmt_bytes(peak.get("compile")),
            "saved": fmt_bytes(ref.get("peak_saved_vs_eager_bytes")),
            "avoided": fmt_bytes(ref.get("intermediate_bytes_avoided"))}


def _power_rows(op: str, point: str | None, at: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for impl, r in at.items():
        nv = r.get("nvml") or {}
        energy = r.get("energy_loop") or {}  # the back-to-back loop of bench --energy-seconds
        rows.append({"op": op, "point": point, "impl": impl, "available": bool(nv.get("available")),
                     "watts": fmt(nv.get("avg_watts"), ".0f"), "sm_mhz": fmt(nv.get("sm_clock_mhz"), ".0f"),
                     "mem_mhz": fmt(nv.get("mem_clock_mhz"), ".0f"), "temp": fmt(nv.get("temperature_c"), ".0f"),
                     "energy": fmt(energy.get("energy_per_call_uj"), ".3g")
                     + (" (suspect: " + energy["energy_suspect"] + ")" if energy.get("energy_suspect") else ""),
                     "throttle": ", ".join(x for x in (nv.get("throttle_reasons") or []) if x != "gpu_idle") or "none",
                     "reason": nv.get("reason") or ""})
    return rows


def _power_summary(rows: list[dict[str, Any]]) -> str:
    """One line over the NVML rows: power and SM clock ranges, throttle reasons seen."""
    ok = [r for r in rows if r["available"]]
    if not ok:
        return "NVML unavailable" + (f": {rows[0]['reason']}" if rows else "")
    def span(key: str) -> str:
        vals = sorted(number(r[key]) for r in ok if number(r[key]) is not None)
        return "–" if not vals else (f"{vals[0]:.0f}" if vals[0] == vals[-1] else f"{vals[0]:.0f}–{vals[-1]:.0f}")
    reasons = sorted({x for r in ok for x in r["throttle"].split(", ") if x != "none"})
    return (f"{span('watts')} W, SM clock {span('sm_mhz')} MHz, {span('temp')} °C; throttling: "
            f"{', '.join(reasons) or 'none'}")


def e2e(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The end-to-end decode-step tables of the first run that has them."""
    for run in sorted(runs, key=lambda r: r["device"] != "cuda"):
        doc = (run.get("e2e") or {}).get("document")
        if not doc:
            continue
        agreement = doc.get("agreement") or {}
        results_rows = [{
            "variant": r.get("variant"), "batch": r.get("batch"), "ttft": fmt(r.get("ttft_ms"), ".3g"),
            "tpot": fmt(r.get("tpot_ms"), ".3g"), "tpot_graph": fmt(r.get("tpot_graph_ms"), ".3g"),
            "launches": ((r.get("launches") or {}).get("count", "–")),
            "peak": fmt_bytes(r.get("peak_decode_bytes")), "skipped": r.get("skipped") or "",
            "errors": "; ".join(f"{k}: {v}" for k, v in (r.get("errors") or {}).items()),
        } for r in doc.get("results", [])]
        gains = {(g.get("variant"), g.get("batch")): g for g in doc.get("gains", [])}
        for row in results_rows:
            g = gains.get((row["variant"], row["batch"]), {})
            row["tpot_gain"] = fmt_x(g.get("tpot_gain"))
            row["ttft_gain"] = fmt_x(g.get("ttft_gain"))
        micro = [{"batch": m.get("batch"), "predicted": fmt_x(m.get("predicted_gain")),
                  "measured": fmt_x(m.get("measured_gain")), "share": _percent(m.get("eager_share_of_step")),
                  "amdahl": fmt_x(m.get("amdahl_gain")), "skipped": m.get("skipped") or ""}
                 for m in doc.get("microbench", [])]
        checks = [{"variant": c.get("variant"), "output": c.get("output"), "passed": c.get("passed"),
                   "error": c.get("error") or "",
                   "ulp": fmt((c.get("comparison") or {}).get("max_ulp_err"), ".3g"),
                   "ratio": fmt((c.get("comparison") or {}).get("ratio_to_eager"), ".2g")}
                  for c in agreement.get("checks", [])]
        cfg = doc.get("config") or {}
        cpu_launches = [{"variant": k, "text": str(v.get("count")) if "count" in v else str(v.get("error", "–"))}
                        for k, v in (doc.get("launches_cpu") or {}).items() if isinstance(v, dict)]
        return {"device": run["device"], "verdict": agreement.get("verdict", "–"), "checks": checks,
                "results": results_rows, "micro": micro, "timing": doc.get("timing"),
                "timing_note": doc.get("timing_note") or "", "notes": doc.get("notes") or [],
                "config": ", ".join(f"{k}={v}" for k, v in cfg.items()), "dtype": doc.get("dtype"),
                "prompt_len": doc.get("prompt_len"), "skipped": doc.get("skipped") or [],
                "cpu_launches": cpu_launches}
    return None


def environment(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    out = []
    for run, label in zip(runs, labels):
        env = run.get("environment") or {}
        gpu = env.get("gpu") or {}
        nv = gpu.get("nvml") or {}
        cpu = env.get("cpu") or {}
        copy = (((run.get("bench") or {}).get("document") or {}).get("fuseaudit") or {}).get("copy_gbps")
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
            ("measured copy bandwidth", f"{fmt(copy, '.0f')} GB/s" if copy else None),
            ("torch", env.get("torch")), ("Triton", env.get("triton")), ("Python", env.get("python")),
            ("Hypothesis", env.get("hypothesis")), ("fuseaudit", env.get("fuseaudit")),
            ("commit", env.get("git_commit")), ("CPU", f"{cpu.get('model')} ({cpu.get('logical_cores')} logical cores)"
                                                if cpu else None),
            ("platform", env.get("platform")), ("started", run.get("created")),
            ("elapsed", f"{fmt((run.get('summary') or {}).get('elapsed_s'), '.0f')} s"),
            ("finished", "yes" if run.get("finished") else "no (interrupted or still running)"),
            ("command", " ".join(run.get("argv") or [])),
        ]
        out.append({"run": label, "rows": [(k, str(v)) for k, v in items if v not in (None, "", "None")]})
    return out


def steps(runs: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    """What each run did beyond the audits (launches, bench, e2e) and why a step was skipped."""
    out = []
    for run, label in zip(runs, labels):
        for name in ("launches", "bench", "e2e"):
            s = run.get(name) or {}
            out.append({"run": label, "step": name, "status": s.get("status", "–"), "message": s.get("message") or ""})
    return out


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
        big = [r for r in refs if number(r.get("pct_copy")) is not None and not _is_attention(r["op"])
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
                        "vs_compile": fmt(r.get("speedup_vs_compile"), ".3f")} for r in misses]}


def takeaways(head: list[dict[str, Any]], records: list[dict[str, Any]], e2e_view: dict[str, Any] | None,
              goals_view: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """The answers in one line each: fused? faster, over all points? by how much end to end?"""
    out = []
    counted = [r["launches"] for r in head if r["launches"]]
    if counted:
        ok = sum(1 for c in counted if c["ok"])
        out.append({"label": "Fused", "cls": "good" if ok == len(counted) else "bad",
                    "text": f"{ok} of {len(counted)} reference kernels launch the expected number of kernels per "
                            f"call ({counted[0]['device']})."})
    refs = [r for r in records if r["impl"] == "reference"]
    if refs:
        parts = []
        for ref in ("eager", "compile"):
            vals = [number(r.get(f"speedup_vs_{ref}")) for r in refs]
            vals = [v for v in vals if v is not None]
            if vals:
                wins = sum(v > 1 for v in vals)
                parts.append(f"{fmt_x(geomean(vals))} {ref} (geometric mean; faster at {wins} of {len(vals)} points)")
        if parts:
            out.append({"label": "Faster", "cls": "", "text": "Reference kernels vs " + "; vs ".join(parts) + "."})
    for g in (goals_view or {}).values():
        out.append({"label": "Target", "cls": "good" if g["met"] == g["total"] else "bad",
                    "text": f"{g['met']} of {g['total']} {g['scope']} at {g['goal']} or more."})
    if e2e_view and e2e_view["results"]:
        gains = [f"{r['variant']} {r['tpot_gain']} at batch {r['batch']}" for r in e2e_view["results"]
                 if r["variant"] != "eager" and r["tpot_gain"] != "–"]
        if gains:
            out.append({"label": "End to end", "cls": "",
                        "text": "Decode step (TPOT) vs eager: " + ", ".join(gains) + "."})
    return out


def build(runs: list[dict[str, Any]], goals: Goals | None = None) -> dict[str, Any]:
    """Everything the template shows (``goals``: speed targets to check, see :class:`Goals`)."""
    labels = run_labels(runs)
    records, meta = bench_records(runs)
    refs = [a for r in runs for a in r["audits"] if a["kind"] == "reference"]
    bad = [a for a in refs if audit_status(a) != "PASS"]
    verdict = {"ok": bool(refs) and not bad, "refs": len(refs), "bad": len(bad),
               "ops": len({a["op"] for a in refs}), "failed_ops": sorted({a["op"] for a in bad})}
    head, e2e_view = headline(runs, labels, records), e2e(runs)
    summary_rows = summary(runs, labels)
    goals_view = targets(records, goals)
    return {
        "labels": labels, "verdict": verdict, "properties": PROPERTY_ORDER,
        "headline": head, "takeaways": takeaways(head, records, e2e_view, goals_view), "summary": summary_rows,
        "targets": goals_view,
        # a run spread over several GPUs (fuseaudit run --gpus N): each audit's device gets a column
        "multi_device": len({r["device"] for r in summary_rows}) > 1,
        "failures": failures(runs, labels), "tolerance": tolerance(runs, labels),
        "launch_table": _launch_rows(runs), "speed": speed(records, meta), "e2e": e2e_view,
        "environment": environment(runs, labels), "steps": steps(runs, labels),
        "has_bench": bool(records), "ulp_bins": charts.bin_labels(), "dtypes": list(charts.DTYPE_COLORS),
    }
