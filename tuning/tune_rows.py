"""Measure the row ops' launch configs on a GPU and rewrite their table (``fuseaudit/kernels/tuning_h200.json``).

    python tuning/tune_rows.py                      # every op, every table row; rewrites the table
    python tuning/tune_rows.py --ops softmax --dry-run
    python tuning/tune_rows.py --points points.txt  # time candidates at given shapes, print, change nothing
    python tuning/tune_rows.py --at points.txt      # measure again the table rows that hold these shapes

For each row of an op's table (a dtype, a range of row counts and a range of
widths) it takes up to nine shapes inside the row's ranges (:func:`shapes`) and builds the
candidate configs (the row's own, and a generated space around it, pruned by
:func:`keep`).  Three steps, so that a whole table fits in minutes of GPU time:

1. **compile**: every candidate runs once at every shape in ``--processes``
   spawned processes, filling Triton's cache (the compiles, not the GPU, are
   most of a cold run's time);
2. **screen**: every candidate is timed once, briefly, at the row's largest
   shape, then at each smaller one those still faster than the row's config
   (:func:`screen_row`: one slower at a shape cannot win at every shape), and
   the ``--top`` fastest by geometric mean over the row's shapes go on;
3. **confirm**: those (if any is left) and the row's own config are checked against the
   row's output and timed at every shape in interleaved rounds (event time
   after an L2 flush, ``fuseaudit.timing.time_events_rounds``, or
   ``triton.testing.do_bench`` with ``--do-bench``).

A candidate replaces the row's config only where it is faster at every shape
of the row by more than ``--min-gain`` (:func:`pick`).  The table is written
after each row with where and when it was measured: in its header where the
run measured every row, else as a stamp on each row it measured
(``--ops``/``--dtypes`` split a run into parts; each part's rows say where
they were measured).  A row already stamped by a run on the same device, with
the same versions and method, is not measured again (``--again`` measures it),
so a run that was cut short goes on where it stopped, on any later day.

A ``--points`` file has one ``op dtype rows N[/stride]`` a line (``#`` starts
a comment; ``/stride``: rows sliced from ``(rows, stride)``, to tell a row
alignment's effect from the width's), and prints the candidates' times at each
point beside ``torch.compile``'s and a device copy's.  ``--at`` takes the same
file and measures the table rows that hold its shapes (and only those, stamped
or not): where a compare flagged a point, its row is measured again.

The table format is :func:`write_table`'s; ``fuseaudit/kernels/_tuning.py`` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE = ROOT / "fuseaudit" / "kernels" / "tuning_h200.json"
OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# Shapes a table row is measured at are capped so that a run stays within minutes.
MAX_ROWS = 16384
MAX_N = 131072
MAX_ELEMENTS = 1 << 30
ALIGNED = 128  # a row's middle width is a multiple of this many elements
BLOCKS = (1024, 2048, 4096, 8192, 16384, 32768)
WARPS = (4, 8, 16, 32)


def write_table(path: pathlib.Path, measured: dict[str, Any], tables: dict[str, list[dict[str, Any]]]) -> None:
    """The table file: where it was measured, then per op its rows, one a line (what ``_tuning.load_tables`` reads)."""
    lines = ["{", f'  "measured": {json.dumps(measured)},', '  "ops": {']
    for i, (op, rows) in enumerate(tables.items()):
        lines.append(f'    "{op}": [')
        lines += [f"      {json.dumps(row)}{',' if j < len(rows) - 1 else ''}" for j, row in enumerate(rows)]
        lines.append("    ]" + ("," if i < len(tables) - 1 else ""))
    lines += ["  }", "}"]
    path.write_text("\n".join(lines) + "\n")


def keep(config: Any, n_max: int, element_size: int) -> bool:
    """Whether a candidate config is worth timing for rows up to ``n_max`` wide (the search space's pruning)."""
    if config.kernel == "looped":
        return config.block_n < n_max and config.block_n * element_size <= 65536 and config.warps * 32 * 4 <= \
            config.block_n
    width = 1 << (max(n_max, 1) - 1).bit_length()
    return width * element_size <= 131072 and config.warps * 32 <= width


def candidates(config: Any, n_max: int, element_size: int) -> list[Any]:
    """The row's own config first, then a generated space around it (blocks x warps x prefetch, or warps)."""
    replace = dataclasses.replace
    out = [config]
    if config.kernel == "looped":
        out += [replace(config, block_n=b, block_s=0, warps=w, prefetch=p, keep=config.keep and b == config.block_n)
                for b in BLOCKS for w in WARPS for p in (0, 1, 2)]
    else:
        out += [replace(config, warps=w) for w in WARPS]
        if config.block_m == 0:
            return [c for c in dict.fromkeys(out) if c.warps >= 4]
        if config.kernel == "whole" and n_max > 2048:
            out.append(replace(config, kernel="tail"))
    return [c for c in dict.fromkeys(out) if c == config or keep(c, n_max, element_size)]


def shapes(row: dict[str, Any]) -> list[tuple[int, int]]:
    """Up to 9 ``(rows, N)`` inside a table row's ranges: each range's ends and middle, capped.

    The rows' middle is geometric.  The middle width is a multiple of :data:`ALIGNED` (as models' widths
    are) while the ends are often odd (2**k - 1, 2**k + 1: rows not 16-byte aligned), and which config
    wins can differ between the two.  A rows count past ``MAX_ELEMENTS`` at a width is lowered to fit,
    so that a row's large end is measured where it fits rather than left out.
    """
    r0, r1 = row["rows"]
    n0, n1 = row["n"]
    r1 = min(r1 or MAX_ROWS, MAX_ROWS)
    n1 = min(n1 or max(n0, MAX_N), max(n0, MAX_N))
    middle = min(max(n0, (n0 + n1 + ALIGNED) // (2 * ALIGNED) * ALIGNED), n1)  # the nearest multiple
    out = {(min(rows, max(r0, MAX_ELEMENTS // n)), n)
           for n in (n0, middle, n1) for rows in (r0, math.isqrt(r0 * r1), r1)}
    return sorted(out)


def _inputs(op: str, dtype: str, rows: int, n: int, stride: int | None, device: str) -> dict[str, Any]:
    import torch

    from fuseaudit.catalog import OPS as SPECS

    spec = SPECS[op]
    dt = getattr(torch, DTYPES[dtype])
    gen = torch.Generator(device=device).manual_seed(rows * 7 + n)
    out: dict[str, Any] = {}
    for name in spec.input_names:
        if name in ("weight", "bias"):
            out[name] = torch.randn(n, generator=gen, device=device, dtype=dt)
        else:
            full = torch.randn(rows, stride or n, generator=gen, device=device, dtype=dt)
            out[name] = full[:, :n]
    return out


def _module(op: str) -> Any:
    import importlib

    family = "softmax" if op == "softmax" else op.removeprefix("add_")
    return importlib.import_module(f"fuseaudit.kernels.{family}")


def _time(fns: list[Callable[[], Any]], do_bench: bool, **rounds: Any) -> list[float]:
    """Microseconds per call of each of ``fns`` (inf for one that raised); ``rounds``: options of
    ``time_events_rounds`` (default: 3 rounds)."""
    if do_bench:
        import triton.testing

        out = []
        for fn in fns:
            try:
                out.append(1000 * triton.testing.do_bench(fn, warmup=25, rep=100))
            except Exception:  # a candidate that does not compile or launch loses
                out.append(float("inf"))
        return out
    from fuseaudit.timing import time_events_rounds

    return [t.median_us if not isinstance(t, Exception) else float("inf")  # type: ignore[union-attr]
            for t in time_events_rounds(fns, **{"rounds": 3, **rounds})]


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _calls(op: str, dtype: str, rows: int, n: int, configs: list[Any], device: str,
           stride: int | None = None) -> list[Callable[[], Any]]:
    """One call of the op a config, on inputs drawn for the shape (the same for every config)."""
    from fuseaudit.catalog import OPS as SPECS

    spec = SPECS[op]
    inputs = _inputs(op, dtype, rows, n, stride, device)
    args = [inputs[name] for name in spec.input_names]
    module = _module(op)
    return [functools.partial(module.with_config(op, c), *args, **spec.defaults()) for c in configs]


def measure(op: str, dtype: str, rows: int, n: int, configs: list[Any], device: str, do_bench: bool,
            stride: int | None = None) -> list[float]:
    """µs of each config at one shape; a config whose output differs from the first's by more than noise is inf."""
    import torch

    calls = _calls(op, dtype, rows, n, configs, device, stride)
    want = _first(calls[0]()).float()
    ok = []
    for call in calls:
        try:
            got = _first(call()).float()
            ok.append(torch.allclose(got, want, rtol=2e-2, atol=2e-2, equal_nan=True))
        except Exception:
            ok.append(False)
    times = _time(calls, do_bench)
    return [t if good else float("inf") for t, good in zip(times, ok)]


def screen(op: str, dtype: str, rows: int, n: int, configs: list[Any], device: str) -> list[float]:
    """µs of each config at one shape, from a few repeats each (inf for one that raised): a ranking, not a verdict."""
    return _time(_calls(op, dtype, rows, n, configs, device), False, rounds=1, warmup=1, target_seconds=0.003,
                 min_repeats=3, max_repeats=20)


def screen_row(op: str, dtype: str, points: list[tuple[int, int]], configs: list[Any], device: str
               ) -> list[list[float]]:
    """:func:`screen` at each of ``points``, the largest first; a candidate screened no faster than the row's
    own config (index 0) at a shape is not screened at the rest (it cannot win at every shape): inf there."""
    alive, by_point = list(range(len(configs))), {}
    for point in sorted(points, key=lambda p: -p[0] * p[1]):
        times = [math.inf] * len(configs)
        if len(alive) > 1:
            for i, t in zip(alive, screen(op, dtype, *point, [configs[i] for i in alive], device)):
                times[i] = t
            alive = [0, *(i for i in alive[1:] if times[i] < times[0])]
        by_point[point] = times
    return [by_point[p] for p in points]


def finalists(times: list[list[float]], top: int) -> list[int]:
    """Index 0 (the row's own config) and the ``top`` other candidates with the least geometric mean of
    their time over the current config's, across the shapes ``times`` holds (one list per shape)."""
    def score(i: int) -> float:
        ratios = [t[i] / t[0] for t in times]
        return math.prod(ratios) ** (1 / len(ratios)) if all(math.isfinite(r) for r in ratios) else math.inf

    ranked = sorted((i for i in range(1, len(times[0])) if math.isfinite(score(i))), key=score)
    return [0, *ranked[:top]]


def pick(times: list[list[float]], min_gain: float) -> int:
    """The candidate to keep: the fastest at every shape among those faster than index 0 by ``min_gain``
    at every shape; else 0."""
    best = 0
    for i in range(1, len(times[0])):
        if all(t[i] * (1 + min_gain) < t[0] for t in times) and (best == 0 or all(t[i] < t[best] for t in times)):
            best = i
    return best


def _compile_init(fraction: float) -> None:
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction)  # a shape too large for its share skips the step


def _compile_job(job: tuple[str, str, list[tuple[int, int]], list[dict[str, Any]]]) -> int:
    """Run each config of ``job`` once at each of its shapes (Triton compiles it into its cache); how many raised.

    One job is one table row, so that no two processes compile the same kernel at once."""
    from fuseaudit.kernels._tuning import RowConfig

    op, dtype, points, configs = job
    failed = 0
    for rows, n in points:
        try:
            calls = _calls(op, dtype, rows, n, [RowConfig.from_json(c) for c in configs], "cuda")
        except Exception:  # out of this process's share of memory: the timing process compiles these
            failed += len(configs)
            continue
        for call in calls:
            try:
                call()
            except Exception:
                failed += 1
        del calls
    return failed


def precompile(jobs: list[tuple[str, str, list[tuple[int, int]], list[dict[str, Any]]]], processes: int) -> None:
    """Compile every ``(op, dtype, shapes, configs)`` job in ``processes`` spawned processes before any timing."""
    import multiprocessing

    if processes < 1 or not jobs:
        return
    start, done, failed = time.monotonic(), 0, 0
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes, initializer=_compile_init, initargs=(0.9 / processes,)) as pool:
        for failed_here in pool.imap_unordered(_compile_job, jobs):
            done, failed = done + 1, failed + failed_here
            if done % 20 == 0 or done == len(jobs):
                print(f"compiled {done}/{len(jobs)} table rows in {time.monotonic() - start:.0f} s "
                      f"({failed} candidate runs raised or did not fit)", file=sys.stderr, flush=True)


def provenance(old: dict[str, Any], tables: dict[str, list[dict[str, Any]]], measured: dict[str, Any]
               ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The header and rows to write after a run that stamped the rows it measured with ``measured``.

    Where the run measured every row, ``measured`` becomes the header and the rows carry no stamp;
    otherwise the header keeps ``old`` (what the unstamped rows came from) and each row measured by
    this run or an earlier partial run keeps its own stamp, so a table tuned op by op over several
    runs says where each row was measured.
    """
    if all(row.get("measured") == measured for rows in tables.values() for row in rows):
        return measured, {op: [{k: v for k, v in row.items() if k != "measured"} for row in rows]
                          for op, rows in tables.items()}
    return old, tables


Plan = tuple[str, list[tuple[int, int]], list[Any]]  # a row's measured dtype, shapes and candidates


def _plan(row: dict[str, Any]) -> Plan:
    """A table row's measured dtype, shapes and candidates (the row's own config first)."""
    from fuseaudit.kernels._tuning import RowConfig

    dtype = row["dtypes"].split(",")[0]
    points = shapes(row)
    return dtype, points, candidates(RowConfig.from_json(row["config"]), max(n for _, n in points),
                                     4 if dtype == "fp32" else 2)


def measured_alike(stamp: dict[str, Any] | None, measured: dict[str, Any]) -> bool:
    """Whether a row's ``stamp`` says it was measured as this run measures (its date aside)."""
    return stamp is not None and {**stamp, "date": None} == {**measured, "date": None}


def tune(op: str, rows_of_table: list[dict[str, Any]], device: str, plans: dict[int, Plan],
         min_gain: float, do_bench: bool, measured: dict[str, Any], top: int) -> Iterator[dict[str, Any]]:
    """The table's rows with each config replaced by the fastest candidate where it wins at every shape;
    each row measured (those with a plan in ``plans``, keyed by ``id(row)``) is stamped ``measured``."""
    for row in rows_of_table:
        if id(row) not in plans:
            yield row
            continue
        start = time.monotonic()
        dtype, points, cands = plans[id(row)]
        kept = finalists(screen_row(op, dtype, points, cands, device), top)
        best = cands[0]
        if len(kept) > 1:  # some candidate screened faster than the row's config at every shape: confirm
            times = [measure(op, dtype, r, n, [cands[i] for i in kept], device, do_bench) for r, n in points]
            best = cands[kept[pick(times, min_gain)]]
        print(f"{op} {row['dtypes']} rows {row['rows']} N {row['n']}: {len(cands)} candidates, {len(kept) - 1} "
              f"confirmed, {time.monotonic() - start:.1f} s, "
              + ("kept" if best is cands[0] else f"-> {best.to_json()}"), file=sys.stderr, flush=True)
        yield {**row, "config": best.to_json(), "measured": measured}


def read_points(path: pathlib.Path) -> list[tuple[str, str, int, int, int | None]]:
    """A points file's ``(op, dtype, rows, N, stride or None)``, one per ``op dtype rows N[/stride]`` line."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            op, dtype, rows_text, n_text = fields
            n, _, stride = n_text.partition("/")
            if op not in OPS or dtype not in DTYPES:
                raise ValueError
            out.append((op, dtype, int(rows_text), int(n), int(stride) if stride else None))
        except ValueError:
            raise SystemExit(f"{path}:{number}: not 'op dtype rows N[/stride]' (op from {','.join(OPS)}, "
                             f"dtype from {','.join(DTYPES)}): {line.strip()}") from None
    return out


def print_points(path: pathlib.Path, device: str, do_bench: bool) -> None:
    """For each ``op dtype rows N[/stride]`` line, the table's config and its candidates, µs, and torch.compile's."""
    import torch

    from fuseaudit.catalog import OPS as SPECS
    from fuseaudit.kernels._tuning import row_config

    for op, dtype, rows, n, stride in read_points(path):
        dt = getattr(torch, DTYPES[dtype])
        current = row_config(op, dt, rows, n)
        cands = candidates(current, n, dt.itemsize)
        times = measure(op, dtype, rows, n, cands, device, do_bench, stride)
        spec = SPECS[op]
        inputs = _inputs(op, dtype, rows, n, stride, device)
        args = [inputs[name] for name in spec.input_names]
        compiled = torch.compile(spec.eager)
        base = _time([functools.partial(compiled, *args, **spec.defaults()), args[0].clone], do_bench)
        width = f"{n}" + (f"/{stride}" if stride else "")
        print(f"{op} {dtype} {rows} x {width}: torch.compile {base[0]:.1f} µs, copy {base[1]:.1f} µs")
        for cand, t in sorted(zip(cands, times), key=lambda ct: ct[1])[:8]:
            mark = "*" if cand == current else " "
            print(f"  {mark} {t:9.1f} µs  {json.dumps(cand.to_json())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all five)")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32", help="table rows of these dtypes are measured")
    parser.add_argument("--table", type=pathlib.Path, default=TABLE, help="the table file to read and rewrite")
    parser.add_argument("--min-gain", type=float, default=0.02, help="a candidate must be this much faster (0.02: 2%%)")
    parser.add_argument("--do-bench", action="store_true", help="time with triton.testing.do_bench")
    parser.add_argument("--again", action="store_true",
                        help="measure rows a run like this one (device, versions, method) has measured before")
    parser.add_argument("--dry-run", action="store_true", help="measure and print; leave the table as it is")
    parser.add_argument("--points", type=pathlib.Path, help="time the candidates at these shapes only (see above)")
    parser.add_argument("--at", type=pathlib.Path, metavar="POINTS",
                        help="measure only the table rows that hold a shape of this points file, "
                             "measured before or not (e.g. the points a compare flagged)")
    parser.add_argument("--top", type=int, default=3, help="candidates a row confirms after the screen (default 3)")
    parser.add_argument("--processes", type=int, default=min(os.cpu_count() or 1, 16),
                        help="processes that compile the candidates first (0: compile while timing)")
    args = parser.parse_args(argv)
    ops, dtypes = args.ops.split(","), set(args.dtypes.split(","))
    if set(ops) - set(OPS) or dtypes - set(DTYPES) or args.top < 1 or args.processes < 0:
        parser.error(f"--ops from {','.join(OPS)}, --dtypes from {','.join(DTYPES)}, --top >= 1, --processes >= 0")

    at = read_points(args.at) if args.at else None

    import torch
    import triton

    from fuseaudit.kernels._tuning import TableRow

    if not torch.cuda.is_available():
        print("tune_rows: a CUDA device is needed to measure", file=sys.stderr)
        return 2
    device = "cuda"
    if args.points:
        print_points(args.points, device, args.do_bench)
        return 0
    data = json.loads(args.table.read_text())
    tables = dict(data["ops"])
    timing = "triton.testing.do_bench" if args.do_bench else "event time after an L2 flush, 3 interleaved rounds"
    measured = {"device": torch.cuda.get_device_name(), "torch": torch.__version__.split("+")[0],
                "triton": triton.__version__, "date": datetime.date.today().isoformat(),
                "method": f"every candidate screened at up to 9 shapes of the row (its ranges' ends and middles, "
                          f"the middle width a multiple of {ALIGNED}), "
                          f"the {args.top} fastest confirmed by {timing}",
                "by": "tuning/tune_rows.py"}
    named = None if at is None else {id(row) for op, dtype, r, n, _ in at
                                     for row in tables[op] if TableRow.from_json(row).holds(dtype, r, n)}

    def todo(row: dict[str, Any]) -> bool:
        if not set(row["dtypes"].split(",")) & dtypes:
            return False
        if named is not None:
            return id(row) in named
        return args.again or not measured_alike(row.get("measured"), measured)

    plans = {id(row): _plan(row) for op in ops for row in tables[op] if todo(row)}
    jobs = [(op, dtype, points, [c.to_json() for c in cands]) for op in ops for row in tables[op]
            if id(row) in plans for dtype, points, cands in [plans[id(row)]]]
    jobs.sort(key=lambda job: -len(job[2]) * len(job[3]))  # the longest first, so that none is left to run alone
    precompile(jobs, args.processes)
    for op in ops:
        before, done = tables[op], []
        for row in tune(op, before, device, plans, args.min_gain, args.do_bench, measured, args.top):
            done.append(row)
            tables[op] = done + before[len(done):]
            if not args.dry_run and id(before[len(done) - 1]) in plans:  # after each row measured: a cut run keeps it
                write_table(args.table, *provenance(data["measured"], tables, measured))
        print(f"{op}: done" + ("" if args.dry_run else f", {args.table} rewritten"), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
