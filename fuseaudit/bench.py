"""``fuseaudit bench``: time every op over a sweep of shapes against eager and torch.compile.

For each op of the catalog and each point of its sweep (:mod:`.sweep`), every
contender (:mod:`.contenders`: our reference kernel, the unfused eager
composition, ``torch.compile`` of it, the SDPA backends for attention, and
``--target`` third-party kernels) is measured (:mod:`.measure`): median and
spread of the device time, GB/s and % of the measured copy bandwidth,
TFLOP/s, launches, allocator peak, temporaries avoided, NVML energy.

Writes pytest-benchmark JSON (:mod:`.benchjson`; ``fuseaudit compare`` and
``pytest-benchmark compare`` read it) and prints one compact table.  Progress
goes to stderr.  ``--max-seconds`` bounds the whole run: a point that would
not fit is skipped and listed, and the file is always written.

Exit codes: 0 the sweep ran (contenders that could not run at a point are
recorded with the reason); 2 it could not run (no CUDA device, bad option).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .case import DTYPES
from .catalog import OPS, OpSpec
from .cli import EXIT_OK, EXIT_USAGE
from .sweep import Point, default_points

__all__ = ["Plan", "add_arguments", "format_table", "main", "parse_targets", "plan"]


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------

def _csv(kind: str, allowed: tuple[str, ...] | None = None):  # type: ignore[no-untyped-def]
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        if allowed is not None:
            bad = [t for t in items if t not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad)}; known: {', '.join(allowed)}")
        return items

    return parse


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def parse_targets(specs: list[str], ops: list[str]) -> dict[str, dict[str, str]]:
    """``[OP:]NAME=TARGET`` options as ``{op: {name: target}}``.

    Without ``OP:`` the target implements the one op of ``--ops``.  Raises
    ValueError with one line for anything malformed.
    """
    from .contenders import KINDS, SDPA_BACKENDS

    reserved = set(KINDS) | {f"sdpa_{b}" for b in SDPA_BACKENDS}
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        left, eq, target = spec.partition("=")
        if not eq or not left or ":" not in target:
            raise ValueError(f"--target {spec!r}: expected [OP:]NAME=package.module:function or path/file.py:function")
        op, colon, name = left.rpartition(":")
        if not colon:
            if len(ops) != 1:
                raise ValueError(f"--target {spec!r}: say which op it implements (OP:NAME=...) or give one --ops")
            op = ops[0]
        if op not in OPS:
            raise ValueError(f"--target {spec!r}: unknown op {op!r}; known: {', '.join(OPS)}")
        if op not in ops:
            raise ValueError(f"--target {spec!r}: op {op} is not among --ops")
        if not name.replace("_", "").replace("-", "").isalnum() or name in reserved:
            raise ValueError(f"--target {spec!r}: NAME must be a plain word and not one of {sorted(reserved)}")
        if name in out.get(op, {}):
            raise ValueError(f"--target {spec!r}: {op}:{name} given twice")
        out.setdefault(op, {})[name] = target
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .contenders import KINDS

    parser.add_argument("--ops", type=_csv("op", tuple(OPS)), default=None,
                        help="comma-separated ops (default: all)")
    parser.add_argument("--dtypes", type=_csv("dtype", tuple(DTYPES)), default=None,
                        help="comma-separated dtypes to keep (default: each op's sweep)")
    parser.add_argument("--quick", action="store_true", help="a few points per op (a smoke run)")
    parser.add_argument("--rows", type=_ints, default=None, help="replace the row-op grid's row counts")
    parser.add_argument("--hidden", type=_ints, default=None, help="replace the row-op grid's hidden sizes")
    parser.add_argument("--contenders", type=_csv("contender kind", KINDS), default=list(KINDS),
                        help=f"which implementations to time (default: {','.join(KINDS)})")
    parser.add_argument("--target", action="append", default=[], metavar="[OP:]NAME=TARGET",
                        help="also time a third-party kernel: TARGET = package.module:function, file.py:function or "
                        "builtin:NAME; OP: may be left out when --ops names one op")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="pytest-benchmark JSON output (default: reports/bench-<timestamp>.json)")
    parser.add_argument("--max-seconds", type=_positive, default=None,
                        help="budget for the whole run; points that would not fit are skipped and listed")
    parser.add_argument("--target-seconds", type=_positive, default=0.05,
                        help="device time the timed repeats of one measurement fill (default 0.05)")
    parser.add_argument("--rounds", type=_positive_int, default=3,
                        help="interleaved timing rounds per point: each round times every contender in turn, the "
                        "order rotated (default 3; 1: one contender after the other)")
    parser.add_argument("--energy-seconds", type=_non_negative, default=0.0,
                        help="extra back-to-back loop per measurement for NVML energy per call (default 0: off)")
    parser.add_argument("--no-launches", action="store_true", help="skip the profiler launch counts")
    parser.add_argument("--dry-run", action="store_true", help="list the points and contenders, time nothing")


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------

@dataclass
class Plan:
    """The points to run, per op, and the contenders' kinds and targets."""

    points: list[tuple[OpSpec, Point]]
    kinds: list[str]
    targets: dict[str, dict[str, str]] = field(default_factory=dict)


def plan(*, ops: list[str] | None = None, dtypes: list[str] | None = None, quick: bool = False,
         rows: list[int] | None = None, hidden: list[int] | None = None, kinds: list[str] | None = None,
         targets: list[str] | None = None) -> Plan:
    """The sweep the options ask for (ValueError with one line on a bad combination)."""
    from .contenders import KINDS

    names = ops or list(OPS)
    points = [(OPS[n], p) for n in names
              for p in default_points(OPS[n], quick=quick, dtypes=dtypes, rows=rows, hidden=hidden)]
    if not points:
        raise ValueError("the options select no points (check --ops and --dtypes)")
    return Plan(points=points, kinds=list(kinds or KINDS), targets=parse_targets(targets or [], names))


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def _progress(total: int) -> Iterator[Any]:
    """Progress on stderr, yielding ``advance(text)``: a rich bar on a terminal, else a line every 15 s."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        Console = None
    if Console is None or not sys.stderr.isatty():
        state = {"done": 0, "last": time.monotonic(), "start": time.monotonic()}

        def plain(text: str) -> None:
            state["done"] += 1
            now = time.monotonic()
            if now - state["last"] >= 15 or state["done"] == total:
                state["last"] = now
                print(f"[bench {now - state['start']:.0f}s] {state['done']}/{total} {text}", file=sys.stderr,
                      flush=True)

        yield plain
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=False)
    with progress:
        task = progress.add_task("bench", total=total)

        def advance(text: str) -> None:
            progress.update(task, advance=1, description=text[:60])

        yield advance


@dataclass
class _Session:
    """What one run carries from point to point."""

    device: Any
    copy_gbps: float
    options: Any
    entries: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    cost: dict[str, list[float]] = field(default_factory=dict)  # seconds per point, per op

    def estimate(self, op: str) -> float:
        """Expected seconds of the next point of ``op`` (its mean so far, else every op's)."""
        history = self.cost.get(op) or [c for cs in self.cost.values() for c in cs]
        return sum(history) / len(history) if history else 0.0


def _run_point(session: _Session, the_plan: Plan, spec: OpSpec, point: Point) -> None:
    """Measure every contender at one point; failures are recorded in ``session.skipped``."""
    import torch

    from . import benchjson
    from .contenders import ContenderUnavailable, build, contenders_for
    from .measure import measure, time_contenders
    from .sweep import bench_inputs
    from .timing import HOLD_US

    where = {"op": spec.name, "point": point.label, "dtype": point.dtype}
    try:
        inputs = bench_inputs(point.case, session.device)
    except torch.cuda.OutOfMemoryError as exc:
        session.skipped.append({**where, "impl": "*", "reason": f"inputs do not fit: {str(exc).splitlines()[0]}"})
        return
    built_all = []
    for contender in contenders_for(spec, include=the_plan.kinds, targets=the_plan.targets.get(spec.name)):
        try:
            built_all.append(build(contender, spec, point, inputs))
        except ContenderUnavailable as exc:
            session.skipped.append({**where, "impl": contender.name, "reason": str(exc)})
        except Exception as exc:  # a contender that fails never ends the sweep
            session.skipped.append({**where, "impl": contender.name,
                                    "reason": f"{type(exc).__name__}: {str(exc).strip()[:300]}"})
    # Every contender is timed in interleaved rounds (measure.time_contenders), then its other figures.
    timed_all = time_contenders([b.call for b in built_all], device=session.device, options=session.options)
    for built, timed in zip(built_all, timed_all):
        try:
            if isinstance(timed, Exception):
                raise timed
            m = measure(built, spec, point, inputs, device=session.device, copy_gbps=session.copy_gbps,
                        options=session.options, timed=timed)
        except Exception as exc:  # a contender that fails mid-measure never ends the sweep
            session.skipped.append({**where, "impl": built.contender.name,
                                    "reason": f"{type(exc).__name__}: {str(exc).strip()[:300]}"})
            continue
        session.entries.append(benchjson.benchmark_entry(
            op=spec.name, impl=m.contender, point_label=point.label, dtype=point.dtype,
            params=point.bench_params(), samples_s=[s * 1e-6 for s in m.timing.samples_us], extra_info=m.extra,
            options={"timer": "cuda_event", "mode": m.timing.mode, "l2_flush": True, "hold_us": HOLD_US,
                     "rounds": session.options.rounds, "target_seconds": session.options.target_seconds,
                     "min_rounds": session.options.min_repeats}))
    del built_all, timed_all  # drop compiled graphs before the next point
    _add_ratios(session.entries, spec.name, point)
    del inputs
    gc.collect()
    torch.cuda.empty_cache()


def _run(the_plan: Plan, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    from . import nvml
    from .measure import MeasureOptions
    from .timing import HOLD_US, measure_copy_bandwidth, require_cuda

    dev = require_cuda()
    session = _Session(device=dev, copy_gbps=measure_copy_bandwidth(dev),
                       options=MeasureOptions(target_seconds=args.target_seconds, launches=not args.no_launches,
                                              energy_seconds=args.energy_seconds, rounds=args.rounds))
    print(f"fuseaudit bench: {torch.cuda.get_device_name(dev)}, copy bandwidth {session.copy_gbps:.0f} GB/s, "
          f"{len(the_plan.points)} point(s)", file=sys.stderr)
    t_start = time.monotonic()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    groups = _by_op(the_plan.points)
    interrupted = False
    with _progress(len(the_plan.points)) as advance:
        try:
            for n_op, (op, points) in enumerate(groups):
                # each op gets an equal share of what is left, so a budget never drops whole ops
                share = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (
                    len(groups) - n_op)
                for spec, point in (_spread_order(points) if deadline is not None else points):
                    label = f"{op} {point.label} {point.dtype}"
                    if share is not None and time.monotonic() + session.estimate(op) > share:
                        session.skipped.append({"op": op, "point": point.label, "dtype": point.dtype, "impl": "*",
                                                "reason": f"--max-seconds {args.max_seconds:g} budget"})
                        advance(f"skip {label}")
                        continue
                    t_point = time.monotonic()
                    _run_point(session, the_plan, spec, point)
                    session.cost.setdefault(op, []).append(time.monotonic() - t_point)
                    advance(label)
        except KeyboardInterrupt:  # keep what was measured
            interrupted = True
    rank = {(s.name, p.label, p.dtype): i for i, (s, p) in enumerate(the_plan.points)}
    session.entries.sort(key=lambda e: rank.get((e["extra_info"].get("op"), e["extra_info"].get("point"),
                                                  e["extra_info"].get("dtype")), len(rank)))
    meta = {"copy_gbps": session.copy_gbps, "skipped": session.skipped, "interrupted": interrupted,
            "seconds": round(time.monotonic() - t_start, 1), "argv": sys.argv, "nvml": nvml.status(),
            "l2_flush": True, "hold_us": HOLD_US}
    return session.entries, meta


def _by_op(points: list[tuple[OpSpec, Point]]) -> list[tuple[str, list[tuple[OpSpec, Point]]]]:
    groups: dict[str, list[tuple[OpSpec, Point]]] = {}
    for spec, point in points:
        groups.setdefault(spec.name, []).append((spec, point))
    return list(groups.items())


def _spread_order(items: list[Any]) -> list[Any]:
    """``items`` in bit-reversed index order: every prefix samples the whole grid evenly.

    Under a time budget the points that fit are then spread over rows,
    widths and dtypes instead of being the first rows of the grid.
    """
    if len(items) <= 2:
        return list(items)
    bits = (len(items) - 1).bit_length()
    keys = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(len(items))]
    return [item for _, item in sorted(zip(keys, items), key=lambda kv: kv[0])]


def _add_ratios(entries: list[dict[str, Any]], op: str, point: Point) -> None:
    """Speed-ups of every contender against eager and compile at this point, in its extra_info."""
    here = [e for e in entries if e["extra_info"].get("op") == op and e["extra_info"].get("point") == point.label
            and e["extra_info"].get("dtype") == point.dtype]
    base = {e["params"]["impl"]: e["stats"]["median"] for e in here}
    mem = {e["params"]["impl"]: (e["extra_info"].get("memory") or {}).get("peak_extra_bytes") for e in here}
    for e in here:
        median = e["stats"]["median"]
        for ref in ("eager", "compile"):
            if ref in base and median > 0 and e["params"]["impl"] != ref:
                e["extra_info"][f"speedup_vs_{ref}"] = base[ref] / median
        peak = mem.get(e["params"]["impl"])
        if mem.get("eager") is not None and peak is not None and e["params"]["impl"] != "eager":
            e["extra_info"]["peak_saved_vs_eager_bytes"] = mem["eager"] - peak


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------

def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pair(impls: dict[str, dict[str, Any]], names: tuple[str, ...], section: str, key: str, factor: float,
          spec: str, *, flag: str | None = None) -> str:
    """``a/b[/c]``: one figure of several contenders (``-`` where missing, ``?`` after a doubtful one)."""
    parts = []
    for name in names:
        info = (impls.get(name) or {}).get("extra_info", {}).get(section) or {}
        value = info.get(key)
        parts.append(_fmt(None if value is None else value * factor, spec) + ("?" if flag and info.get(flag) else ""))
    return "/".join(parts)


def format_table(benchmarks: list[dict[str, Any]]) -> str:
    """One line per op, point and dtype: µs of each contender, the fused kernel's GB/s, % copy, speed-ups.

    Where the benchmarks have them, more columns follow: CUDA-graph replay time
    (small shapes, where event timing includes launch gaps), host time per call,
    allocator peak and NVML energy per call (``?`` marks a doubtful reading).
    """
    rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    extra_impls: list[str] = []
    for b in benchmarks:
        info = b.get("extra_info", {})
        key = (info.get("op", b.get("group", "?")), info.get("point", "?"), info.get("dtype", "?"))
        impl = b.get("params", {}).get("impl", b.get("name", "?"))
        rows.setdefault(key, {})[impl] = b
        if impl not in ("reference", "eager", "compile") and impl not in extra_impls:
            extra_impls.append(impl)
    header = ["op", "shape", "dtype", "fused µs", "eager µs", "compile µs", *[f"{i} µs" for i in extra_impls],
              "GB/s", "% copy", "TFLOP/s", "x eager", "x compile"]
    # optional columns, shown when some benchmark has the figure
    infos = [b.get("extra_info", {}) for b in benchmarks]
    has_host = any((i.get("host") or {}).get("median_us") is not None for i in infos)
    has_peak = any((i.get("memory") or {}).get("peak_extra_bytes") is not None for i in infos)
    has_energy = any((i.get("energy_loop") or {}).get("energy_per_call_uj") is not None for i in infos)
    has_graph = any((i.get("graph") or {}).get("median_us") is not None for i in infos)
    header += ["graph µs fused/eager/compile"] if has_graph else []
    header += (["host µs fused/eager"] if has_host else []) + (["peak MiB fused/eager"] if has_peak else [])
    header += ["µJ/call fused/eager/compile"] if has_energy else []
    lines = [header]
    for (op, label, dtype), impls in rows.items():
        us = {i: b["stats"]["median"] * 1e6 for i, b in impls.items()}
        fused = impls.get("reference")
        info = fused["extra_info"] if fused else {}
        f_us = us.get("reference")
        lines.append([
            op, label, dtype, _fmt(f_us, ".1f"), _fmt(us.get("eager"), ".1f"), _fmt(us.get("compile"), ".1f"),
            *[_fmt(us.get(i), ".1f") for i in extra_impls],
            _fmt(info.get("gbps"), ".0f"), _fmt(info.get("pct_copy"), ".0f"),
            _fmt(info.get("tflops"), ".0f") if OPS.get(op) and OPS[op].compute_bound else "-",
            _fmt(us["eager"] / f_us if f_us and "eager" in us else None, ".2f"),
            _fmt(us["compile"] / f_us if f_us and "compile" in us else None, ".2f"),
        ])
        if has_graph:  # device time per call replayed from a CUDA graph: no host gaps (small shapes)
            lines[-1].append(_pair(impls, ("reference", "eager", "compile"), "graph", "median_us", 1.0, ".1f"))
        if has_host:
            lines[-1].append(_pair(impls, ("reference", "eager"), "host", "median_us", 1.0, ".1f"))
        if has_peak:
            lines[-1].append(_pair(impls, ("reference", "eager"), "memory", "peak_extra_bytes", 2**-20, ".1f"))
        if has_energy:
            lines[-1].append(_pair(impls, ("reference", "eager", "compile"), "energy_loop", "energy_per_call_uj",
                                   1.0, ".3g", flag="energy_suspect"))
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(header))]
    out = []
    for n, r in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def _default_json() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"reports/bench-{stamp}.json"


def main(args: argparse.Namespace) -> int:
    try:
        the_plan = plan(ops=args.ops, dtypes=args.dtypes, quick=args.quick, rows=args.rows, hidden=args.hidden,
                        kinds=args.contenders, targets=args.target)
    except ValueError as exc:
        print(f"fuseaudit bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        for spec, point in the_plan.points:
            names = [c.name for c in _contenders(spec, the_plan)]
            print(f"{spec.name:<16} {point.dtype:<9} {point.label:<40} {','.join(names)}")
        print(f"{len(the_plan.points)} point(s)")
        return EXIT_OK
    from . import benchjson
    from .timing import TimingUnavailable, require_cuda

    try:
        require_cuda()
    except TimingUnavailable as exc:
        print(f"fuseaudit bench: error: cannot run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = pathlib.Path(args.json or _default_json())
    try:  # fail before the sweep, not after it
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(f"{out.parent} is not writable")
    except OSError as exc:
        print(f"fuseaudit bench: error: cannot write {out}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        entries, meta = _run(the_plan, args)
    except TimingUnavailable as exc:
        print(f"fuseaudit bench: error: cannot run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = benchjson.write(out, benchjson.document(entries, fuseaudit=meta))
    table = format_table(entries)
    path.with_suffix(".txt").write_text(table + "\n", encoding="utf-8")
    print(table)
    for s in meta["skipped"]:
        print(f"skipped {s['op']} {s['point']} {s['dtype']} {s['impl']}: {s['reason']}", file=sys.stderr)
    print(f"wrote {path} and its table {path.with_suffix('.txt').name} ({len(entries)} benchmark(s), "
          f"{len(meta['skipped'])} skipped, {meta['seconds']} s)", file=sys.stderr)
    return EXIT_OK


def _contenders(spec: OpSpec, the_plan: Plan) -> list[Any]:
    from .contenders import contenders_for

    return contenders_for(spec, include=the_plan.kinds, targets=the_plan.targets.get(spec.name))
