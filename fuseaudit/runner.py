"""``fuseaudit run``: the main job -- audit every reference kernel, measure, write the report.

Steps, each recorded in one results file (:mod:`fuseaudit.results`,
default ``reports/results-<device>.json``, rewritten after every step so an
interrupted run keeps what it did), in this order:

1. **audits** -- every reference kernel of the catalog, and (GPU, or
   ``--builtins``) every third-party target the device has
   (:func:`~fuseaudit.builtin_targets.available_targets`: ``torch.compile``
   and the SDPA backends), through :func:`fuseaudit.audit.audit`, each in its
   own child process (one op's failure, crash or missing kernel never stops
   the others), in one pool of ``--workers``, longest first.  Every checked
   case's figures are kept for the tolerance section of the report.
   Reference audits' children run with :data:`REFERENCE_ENV`
   (``FUSEAUDIT_AUTOTUNE=0``: the attention kernel takes the first config
   that fits each shape class instead of compiling and timing every config;
   an audit checks correctness only, and ``properties/test_attention_configs.py``
   checks every config apart); built-in targets keep the normal environment.
   The results file records it as ``options.reference_env``.
2. **launches** -- kernels per call of reference, eager and ``torch.compile``
   (:func:`~fuseaudit.cli_launches.launch_table`, in a child process).  It
   times nothing, so on a GPU it runs beside the audits
   (:func:`launches_beside`); on the CPU the interpreter's audits have the
   cores, and it follows them.
3. **bench** (GPU) -- ``fuseaudit bench --quick`` within ``--bench-seconds``.
4. **e2e** (GPU, where :mod:`fuseaudit.e2e` exists) -- ``fuseaudit e2e``
   within ``--e2e-seconds``: a transformers Llama at Llama-3.2-1B's size
   where transformers is installed (``--model hf-llama``), else the
   project's own stack, with and without CUDA graphs; its JSON and Chrome
   traces beside the results file.
5. the HTML report (:mod:`fuseaudit.report`), ``reports/report-<device>.html``
   (``--out DIR``: both files in ``DIR``; relative to the current directory).

Timing (bench, e2e) never runs while audits do: the audits share the GPU.

Defaults fit a fresh 2-core CPU machine in one to four minutes (attention,
slowest under the interpreter, gets the fewest examples).  On one H200 they
aim at five minutes: :data:`WORKERS_PER_GPU` audits at once, bench and e2e
within :data:`DEFAULT_BENCH_S` and :data:`DEFAULT_E2E_S`.  Before the first audit
the run prints what it expects to take (:func:`expected_line`), and after
each audit the time it expects is left.

``--time-limit S`` bounds the whole run (``--resume`` continues one that was
cut short): an audit starts only if it is expected to fit in the time left,
and a built-in target's audit only if it also leaves the later steps their
time (:func:`later_steps`: the bench and e2e budgets, and launches where it
follows the audits), so that
third-party correctness never starves the speed steps.

``--gpus N`` (CUDA; default 1) audits on N GPUs and ``--workers N`` runs up
to N audits at once, each in its own child process as always; worker ``i``
audits on GPU ``i % gpus``.  Audits only check correctness, so several may
share a GPU: the default is :data:`WORKERS_PER_GPU` per GPU, at most one per
:data:`CORES_PER_WORKER` CPU cores (Triton's compiles are CPU-bound), on the
CPU one.  Each audit entry records its ``worker`` and ``device``; entries
stay in job order.

Exit codes: 0 every reference kernel passed every property; 1 a reference
kernel failed a property, or could not be audited (missing, does not load);
2 the run could not run (bad option, no such device, unwritable output, or
interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import importlib.util
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import Any

from . import results
from .cli import usage_error

# The catalog (and with it torch) is imported where it is used: the command line reads
# REFERENCE_ENV before torch is imported, to start the audits' zygote while both import it.

# examples per audit: (row ops, attention) per device; built-in targets recompile per shape, so fewer
DEFAULT_TARGET_EXAMPLES = {"cpu": 8, "cuda": 8}
DEFAULT_SHRINK_S = 30.0  # shrinking of an audit, from its first failure: a run surveys many targets (audit: 120 s)
DEFAULT_BENCH_S = 100.0  # budget of the bench step; with the e2e one, what makes a default H200 run fit five minutes
DEFAULT_E2E_S = 120.0  # budget of the e2e step
LAUNCHES_TIMEOUT_S = 600.0
EXPECTED_LAUNCHES_S = 25.0  # the launches step, for the expected duration and the --time-limit reserve
WORKERS_PER_GPU = 8  # audits only check correctness, so several share a GPU while others compile
CORES_PER_WORKER = 2  # Triton's and Inductor's compiles are CPU-bound: at most one worker per this many cores
# the environment of the reference audits' children: correctness needs no autotuning sweep per shape class
REFERENCE_ENV = {"FUSEAUDIT_AUTOTUNE": "0"}
MIN_STEP_S = 30.0  # a step with less time than this left is skipped
GRACE_S = 30.0  # after SIGINT, before SIGKILL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    onoff = argparse.BooleanOptionalAction
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu runs Triton's interpreter (default: cuda if available)")
    parser.add_argument("--ops", nargs="+", default=None, metavar="OP", help="ops to audit (default: all)")
    parser.add_argument("--examples", type=int, default=None, metavar="N",
                        help="Hypothesis examples per reference audit (default: CPU 40, attention 12; GPU 30, "
                             "attention 20)")
    parser.add_argument("--target-examples", type=int, default=None, metavar="N",
                        help="examples per built-in target audit (default 8: torch.compile recompiles per shape)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every search (default 0: reproducible)")
    parser.add_argument("--shrink-time", type=float, default=None, metavar="S",
                        help=f"seconds of shrinking after a first failure (default {DEFAULT_SHRINK_S:g})")
    parser.add_argument("--builtins", action=onoff, default=None,
                        help="also audit the built-in targets this device has (default: on a GPU only)")
    parser.add_argument("--bench", action=onoff, default=None, help="benchmark sweep (default: on a GPU only)")
    parser.add_argument("--bench-seconds", type=float, default=DEFAULT_BENCH_S, metavar="S",
                        help=f"budget of the benchmark sweep (default {DEFAULT_BENCH_S:g})")
    parser.add_argument("--e2e", action=onoff, default=None,
                        help="end-to-end decode-step measurement (default: on a GPU, where fuseaudit.e2e exists)")
    parser.add_argument("--e2e-seconds", type=float, default=DEFAULT_E2E_S, metavar="S",
                        help=f"budget of the end-to-end measurement (default {DEFAULT_E2E_S:g})")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="wall-clock budget of the whole run: bench and e2e shrink to fit, audits that would "
                             "not fit are recorded as not run, built-in targets' audits also when they would not "
                             "leave launches, bench and e2e their time (default: none)")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="CUDA GPUs to audit on; worker i audits on GPU i %% N (default 1)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help=f"audits at once, each in its own child; several may share a GPU (default on CUDA "
                             f"{WORKERS_PER_GPU} per GPU, at most one per {CORES_PER_WORKER} CPU cores; on the "
                             f"CPU 1)")
    parser.add_argument("--out", default="reports", metavar="DIR",
                        help="the folder of DIR/results-<device>.json and DIR/report-<device>.html (default: "
                             "reports/ under the current directory)")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="results JSON (default: DIR/results-<device>.json)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished steps of an existing results file of the same device; run the rest")


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------

def _options(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Validated options with the device's defaults filled in; ValueError (one line) otherwise."""
    from .catalog import OPS

    ops = args.ops or list(OPS)
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(OPS)}")
    for name in ("examples", "target_examples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("bench_seconds", "e2e_seconds"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.shrink_time is not None and not args.shrink_time >= 0:
        raise ValueError("--shrink-time must be zero or positive")
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError("--time-limit must be positive")
    gpus, workers = _gpus_and_workers(getattr(args, "gpus", None), getattr(args, "workers", None), device)
    gpu = device == "cuda"
    examples = {o: args.examples or OPS[o].default_examples(device) for o in ops}
    e2e_exists = importlib.util.find_spec("fuseaudit.e2e") is not None
    return {
        "ops": ops, "examples": examples,
        "target_examples": args.target_examples or DEFAULT_TARGET_EXAMPLES[device],
        "seed": args.seed,
        "shrink_time": DEFAULT_SHRINK_S if args.shrink_time is None else args.shrink_time,
        "builtins": gpu if args.builtins is None else args.builtins,
        "bench": gpu if args.bench is None else args.bench, "bench_seconds": args.bench_seconds,
        "e2e": (gpu and e2e_exists) if args.e2e is None else args.e2e, "e2e_seconds": args.e2e_seconds,
        "time_limit": args.time_limit, "gpus": gpus, "workers": workers, "reference_env": dict(REFERENCE_ENV),
    }


def default_workers(gpus: int, cores: int | None) -> int:
    """Audits at once on CUDA unless told: :data:`WORKERS_PER_GPU` per GPU, at most one per
    :data:`CORES_PER_WORKER` of ``cores``, at least one."""
    return max(1, min(WORKERS_PER_GPU * gpus, (cores or 1) // CORES_PER_WORKER))


def _gpus_and_workers(gpus: int | None, workers: int | None, device: str) -> tuple[int, int]:
    """(GPUs used, audits at once) from ``--gpus`` and ``--workers`` (None: the default); ValueError otherwise.

    On the CPU no GPU is used, and the interpreter's children run one at a time unless told.
    """
    for name, value in (("gpus", gpus), ("workers", workers)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value}")
    if device != "cuda":
        if gpus is not None:
            raise ValueError(f"--gpus {gpus}: the run is on the CPU (--workers N runs N audits at once there)")
        return 0, workers or 1
    import torch

    gpus = gpus or 1
    if gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA device(s) here")
    return gpus, workers or default_workers(gpus, os.cpu_count())


def _jobs(options: dict[str, Any], device: str) -> list[tuple[str, str, str, int]]:
    """(op, target, kind, examples) of every audit: the reference kernels first, then the built-in targets."""
    from .builtin_targets import available_targets
    from .catalog import OPS

    jobs = [(op, OPS[op].reference or f"(no reference kernel for {op})", "reference", options["examples"][op])
            for op in options["ops"]]
    if options["builtins"]:
        for op in options["ops"]:
            jobs += [(op, t, "builtin", options["target_examples"]) for t in available_targets(op, device)]
    return jobs


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------

def audit_entry(op: str, target: str, kind: str, examples: int, *, device: str, options: dict[str, Any],
                progress: Any = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Audit one target; every outcome (usage error, internal error) is an entry, never an exception.

    ``env``: extra environment of the audit's children (:func:`audit_env`: :data:`REFERENCE_ENV` for a
    reference kernel).
    """
    from .audit import AuditUsageError, _chain, audit
    from .catalog import OPS

    entry: dict[str, Any] = {"op": op, "target": target, "kind": kind, "examples": examples, "verdicts": {},
                             "passed": None, "result": None, "cases": [], "ulp_histograms": {}}
    collector = results.CaseCollector()
    start = time.monotonic()
    if kind == "reference" and not OPS[op].reference:
        entry.update(status="unavailable", exit_code=2, message=f"the catalog names no reference kernel for {op}")
    else:
        try:
            res = audit(op, target, examples=examples, seed=options["seed"], device=device,
                        shrink_time=options["shrink_time"], progress=False,
                        on_event=_chain(collector, progress.on_event if progress else None), env=env)
        except AuditUsageError as exc:
            entry.update(status="error", exit_code=2, message=" ".join(str(exc).split()))
        except Exception as exc:  # a bug of fuseaudit's own must not lose the other ops
            entry.update(status="error", exit_code=2, message=f"internal error: {type(exc).__name__}: {exc}")
        else:
            d = res.to_dict()
            entry.update(status="done", exit_code=res.exit_code, passed=res.passed,
                         verdicts={p: v["status"] for p, v in d["properties"].items()}, result=d)
    entry.update(elapsed_s=round(time.monotonic() - start, 2), cases=collector.cases,
                 ulp_histograms=collector.histograms)
    return entry


_CHILDREN: set[subprocess.Popen] = set()  # the steps' children running now: killed where the run stops early


def _kill_children() -> None:
    for proc in list(_CHILDREN):
        proc.kill()


def _child(cmd: list[str], *, timeout: float, stdout: Any, stderr: Any = None) -> tuple[int | None, str]:
    """Run ``cmd`` (stderr shared with ours unless given); past ``timeout`` SIGINT (it keeps what it
    measured), then kill."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    _CHILDREN.add(proc)
    try:
        return proc.wait(timeout=timeout), ""
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
            return proc.returncode, f"stopped after {timeout:.0f} s (interrupted; partial results kept)"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None, f"killed after {timeout + GRACE_S:.0f} s"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        _CHILDREN.discard(proc)


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def launches_step(ops: list[str], device: str, tmp: pathlib.Path, budget: float) -> dict[str, Any]:
    """Kernels per call of every op, counted in a child whose output goes to its log (it may run beside
    the audits' progress): the log's tail is the message where it fails."""
    out, log = tmp / "launches.json", tmp / "launches.log"
    with log.open("w") as f:
        rc, note = _child([sys.executable, "-m", "fuseaudit._launch_worker", device, str(out), *ops],
                          timeout=min(LAUNCHES_TIMEOUT_S, budget), stdout=f, stderr=subprocess.STDOUT)
    doc = _read_json(out) or {"rows": []}
    rows = doc.get("rows", [])
    counted = {r.get("op") for r in rows}
    for op in ops:  # the child died or was stopped before reaching these
        if op not in counted:
            rows.append({"op": op, "error": f"not counted: the launch counter ended first ({note or f'exit {rc}'})"})
    status = "done" if rc == 0 else "error"
    message = "" if rc == 0 else (note or f"exit status {rc}: {_tail(log)}")
    return {"status": status, "message": message, "rows": rows}


def bench_step(options: dict[str, Any], tmp: pathlib.Path, budget: float) -> dict[str, Any]:
    """``fuseaudit bench --quick`` in a child: its own budget is 80% of ours (compilations overrun it)."""
    out, log = tmp / "bench.json", tmp / "bench.log"
    cmd = [sys.executable, "-m", "fuseaudit.cli", "bench", "--quick", "--max-seconds", f"{0.8 * budget:.0f}",
           "--json", str(out), "--ops", ",".join(options["ops"])]
    start = time.monotonic()
    with log.open("w") as f:
        rc, note = _child(cmd, timeout=budget, stdout=f)
    doc = _read_json(out)
    seconds = round(time.monotonic() - start, 1)
    if isinstance(doc, dict) and isinstance(doc.get("benchmarks"), list):
        return {"status": "done", "message": note, "seconds": seconds, "document": doc}
    return {"status": "error", "seconds": seconds, "document": None,
            "message": note or f"fuseaudit bench exited {rc} without results: {_tail(log)}"}


E2E_REPEATS = 5  # timed repeats per e2e figure in a run (fuseaudit e2e's own default is 10)


def e2e_model() -> str:
    """The model of the run's e2e step: a transformers Llama where transformers is installed, else our own stack."""
    return "hf-llama" if importlib.util.find_spec("transformers") is not None else "own"


def e2e_step(device: str, out_dir: pathlib.Path, tmp: pathlib.Path, budget: float) -> dict[str, Any]:
    """``fuseaudit e2e --model`` :func:`e2e_model` ``--cuda-graphs`` in a child: its timed cells get 60% of
    our budget (model build, agreement check and the profiled steps come on top).  Its JSON and the
    profiled steps' Chrome traces go to ``out_dir``, beside the report that links them."""
    if importlib.util.find_spec("fuseaudit.e2e") is None:
        return {"status": "skipped", "message": "fuseaudit.e2e is not in this build", "document": None}
    model = e2e_model()
    out, log = out_dir / f"e2e-{model}.json", tmp / "e2e.log"
    cmd = [sys.executable, "-m", "fuseaudit.cli", "e2e", "--model", model, "--cuda-graphs", "--device", device,
           "--repeats", str(E2E_REPEATS), "--warmup", "2", "--json", str(out), "--budget-s", f"{0.6 * budget:.0f}"]
    with log.open("w") as f:
        rc, note = _child(cmd, timeout=budget, stdout=f)
    doc = _read_json(out)
    if isinstance(doc, dict):
        doc.pop("_path", None)
        verdict = (doc.get("agreement") or {}).get("verdict")
        message = note or ("" if rc == 0 else f"exit status {rc} (agreement: {verdict})")
        return {"status": "done", "message": message, "document": doc}
    return {"status": "error", "document": None,
            "message": note or f"fuseaudit e2e exited {rc} without results: {_tail(log)}"}


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

# Scheduling estimates, in seconds per example (audit start-up included), keyed by (op, target), (op, kind),
# target or kind, first found: they order the pool longest first, give the duration printed before a run,
# and, scaled by the finished audits' own times, say whether an audit still fits a --time-limit and how long
# the run has left.  From a default run on one H200 (reports/results-h200.json.gz: each audit's elapsed_s over its
# examples).
_SECONDS_PER_EXAMPLE = {
    ("attention", "builtin:compile"): 15.0,  # Inductor compiles every new shape: the run's longest audit
    ("attention", "reference"): 4.0,         # autotuning off; a compile per new specialisation
    "builtin:compile": 3.5,                  # the row ops under torch.compile
    "builtin": 0.5,                          # an SDPA backend: no compile of ours
    "reference": 0.4,                        # a row-op reference kernel
}


def expected_cost(job: tuple[str, str, str, int]) -> float:
    """A rough duration of an audit job ``(op, target, kind, examples)``, for longest-first scheduling."""
    op, target, kind, examples = job
    table = _SECONDS_PER_EXAMPLE
    rate = table.get((op, target)) or table.get((op, kind)) or table.get(target) or table.get(kind, 1.0)
    return rate * examples


def expected_seconds(job: tuple[str, str, str, int], finished: list[tuple[float, float]]) -> float:
    """``expected_cost(job)`` scaled by how long the ``finished`` audits, ``(expected_cost, seconds)``,
    took against their own (0 before any).

    A plain mean over finished audits would let one long attention audit keep
    every short row-op audit from starting near a time limit.
    """
    cost = sum(c for c, _ in finished)
    return expected_cost(job) * sum(s for _, s in finished) / cost if cost > 0 else 0.0


def schedule_seconds(costs: Iterable[float], workers: int, *, busy: Iterable[float] = ()) -> float:
    """How long jobs of ``costs`` seconds take on ``workers`` taken longest first, each by the worker
    free first; ``busy``: seconds the workers still busy need."""
    loads = [*busy]
    loads += [0.0] * max(0, workers - len(loads))
    heapq.heapify(loads)
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads, default=0.0)


def launches_beside(device: str) -> bool:
    """Whether the launches step runs beside the audits: on a GPU (it times nothing, and the audits leave
    the GPU and the cores room), not under the interpreter (whose audits take every core)."""
    return device == "cuda"


def later_steps(options: dict[str, Any], device: str) -> dict[str, float]:
    """Seconds the steps after the audits are expected to take: launches (a guess) where it follows
    them (:func:`launches_beside`), and the budgets of bench and e2e where they run."""
    steps = {} if launches_beside(device) else {"launches": EXPECTED_LAUNCHES_S}
    if options["bench"] and device == "cuda":
        steps["bench"] = options["bench_seconds"]
    if options["e2e"]:
        steps["e2e"] = options["e2e_seconds"]
    return steps


def expected_line(costs: list[float], *, workers: int, later: dict[str, float], device: str,
                  time_limit: float | None) -> str:
    """What a run expects to take, printed before it starts: the audits' ``costs``
    (:func:`expected_cost`) spread over the workers, then the ``later`` steps (:func:`later_steps`).

    The rates behind the costs are the H200's: on the CPU (Triton's interpreter) the audits get
    no figure until the first one has finished and the run knows their pace.
    """
    from .run_progress import duration

    # launches is a guess, bench and e2e are budgets: as given
    steps = ", ".join(f"launches ~{duration(s)}" if name == "launches" else f"{name} {s:g} s"
                      for name, s in later.items())
    if device != "cuda":
        return f"expected: audits unknown until the first has finished (the rates are the H200's), then {steps}"
    audits = schedule_seconds(costs, workers)
    total = audits + sum(later.values())
    cut = f"; --time-limit {time_limit:g} s cuts it" if time_limit is not None and time_limit < total else ""
    beside = " with launches beside them" if "launches" not in later else ""
    return (f"expected about {duration(min(total, time_limit or total))} (audits ~{duration(audits)} on "
            f"{workers} worker{'s' * (workers > 1)}{beside}, {steps}{cut})")


def worker_device(device: str, worker: int, *, gpus: int = 1) -> tuple[str, dict[str, str] | None]:
    """(device, extra worker environment) of worker ``worker`` of a run on ``device`` over ``gpus`` GPUs.

    On CUDA worker ``i`` audits on GPU ``cuda:{i % gpus}`` (of the GPUs this process
    sees): the judge keeps its inputs there and hands them to the target's process by
    CUDA IPC, so both must see the same GPUs under the same numbers.
    """
    if not device.startswith("cuda"):
        return device, None
    return f"cuda:{worker % max(1, gpus)}", None


def audit_env(kind: str, worker_env: dict[str, str] | None) -> dict[str, str] | None:
    """The extra environment of an audit's children: the worker's, and :data:`REFERENCE_ENV` for a
    reference kernel (a third-party target runs as it would anywhere else)."""
    if kind != "reference":
        return worker_env
    return {**(worker_env or {}), **REFERENCE_ENV}


def _resumed(path: pathlib.Path, device: str) -> dict[str, Any] | None:
    try:
        old = results.load(path)
    except results.ResultsError:
        return None
    return old if old["device"] == device else None


def _join(thread: threading.Thread) -> None:
    """Wait for ``thread`` in short joins, which let KeyboardInterrupt through to the main thread."""
    while thread.is_alive():
        thread.join(timeout=0.5)


class _Run:
    """One ``fuseaudit run``: the document, where it goes, what to keep from a resumed file, the clock."""

    def __init__(self, args: argparse.Namespace, device: str, options: dict[str, Any], path: pathlib.Path,
                 progress: Any, tmp: pathlib.Path) -> None:
        self.device, self.options, self.path, self.progress, self.tmp = device, options, path, progress, tmp
        self.start = time.monotonic()
        limit = options["time_limit"]
        self.deadline = None if limit is None else self.start + limit
        self.doc = results.new_document(device, argv=getattr(args, "argv", None) or sys.argv, options=options,
                                        environment=results.environment(device))
        self.old = _resumed(path, device) if args.resume else None
        self.kept = {(a["op"], a["target"]): a for a in (self.old or {}).get("audits", [])
                     if a.get("status") == "done"}
        self.later = later_steps(options, device)
        # what a built-in target's audit leaves the later steps; MIN_STEP_S more, as each step keeps that at its end
        self.reserve = sum(self.later.values()) + MIN_STEP_S
        self.workers = options.get("workers", 1)
        self.finished: list[tuple[float, float]] = []  # (expected_cost, seconds) of each audit run
        self.jobs: list[tuple[str, str, str, int]] = []
        self.slots: list[dict[str, Any] | None] = []  # the entries of the jobs, in job order, as they finish
        self.first = 0  # where they go in the document's audits
        self.pending: set[int] = set()  # jobs not started
        self.running: dict[int, float] = {}  # job -> when it started
        self.lock = threading.Lock()  # the document, the progress and the clock's figures, across workers

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def save(self) -> None:
        with self.lock:
            self.doc["summary"] = {**results.summarize(self.doc),
                                   "elapsed_s": round(time.monotonic() - self.start, 1)}
            results.write(self.path, self.doc)

    def expected(self, jobs: list[tuple[str, str, str, int]]) -> str:
        """The line saying what this run expects to take (audits kept from a resumed file cost nothing)."""
        costs = [expected_cost(j) for j in jobs if (j[0], j[1]) not in self.kept]
        return expected_line(costs, workers=self.workers, later=self.later, device=self.device,
                             time_limit=self.options["time_limit"])

    def time_left(self) -> float | None:
        """Seconds the rest of the run is expected to take, at the finished audits' pace (None before any)."""
        cost = sum(c for c, _ in self.finished)
        if cost <= 0:
            return None
        pace, now = sum(s for _, s in self.finished) / cost, time.monotonic()
        busy = [max(0.0, pace * expected_cost(self.jobs[i]) - (now - t)) for i, t in self.running.items()]
        todo = [pace * expected_cost(self.jobs[i]) for i in self.pending if self.jobs[i][:2] not in self.kept]
        return max(0.0, min(self.left(), schedule_seconds(todo, self.workers, busy=busy) + sum(self.later.values())))

    def late(self, job: tuple[str, str, str, int]) -> str:
        """Why ``job`` does not fit the --time-limit ('' where it does); a built-in target's audit must
        also leave the later steps :attr:`reserve`."""
        reserve = 0.0 if job[2] == "reference" else self.reserve
        if self.left() - reserve >= expected_seconds(job, self.finished):
            return ""
        why = "reached" if reserve == 0 else f"leaves no time before {', '.join(self.later)}"
        return f"not run: --time-limit {self.options['time_limit']:g} s {why}"

    def audits(self, jobs: list[tuple[str, str, str, int]]) -> None:
        """Every job, ``options["workers"]`` at a time; the document keeps job order and is saved after each.

        One worker takes the jobs in their order (the reference kernels first), several take the
        longest first, so that none idles while another finishes the slowest audit.
        """
        self.jobs, self.first = jobs, len(self.doc["audits"])
        self.slots = [None] * len(jobs)
        self.pending = set(range(len(jobs)))
        if self.workers == 1:
            for i in range(len(jobs)):
                self._one(i, 0)
            return
        todo: queue.Queue[int] = queue.Queue()
        for i in sorted(range(len(jobs)), key=lambda i: -expected_cost(jobs[i])):  # longest first
            todo.put(i)
        failures: list[BaseException] = []

        def worker_loop(worker: int) -> None:
            while not failures:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._one(i, worker)
                except BaseException as exc:  # a bug of ours: stop the others, raise it in the main thread
                    failures.append(exc)

        # daemon threads: on Ctrl-C the main thread raises and exits; the zygote sees the judge's
        # channel close and kills every worker (fuseaudit.worker)
        threads = [threading.Thread(target=worker_loop, args=(w,), name=f"fuseaudit-worker-{w}", daemon=True)
                   for w in range(min(self.workers, len(jobs)))]
        for t in threads:
            t.start()
        for t in threads:
            _join(t)
        if failures:
            raise failures[0]

    def _publish(self, i: int, entry: dict[str, Any]) -> None:
        with self.lock:
            self.slots[i] = entry
            self.doc["audits"][self.first:] = [e for e in self.slots if e is not None]
        self.save()

    def _one(self, i: int, worker: int) -> None:
        """Job ``i`` on worker ``worker``: kept from a resumed file, not run (out of time), or audited."""
        op, target, kind, examples = self.jobs[i]
        if (op, target) in self.kept:
            with self.lock:
                self.pending.discard(i)
                self.progress.line(f"kept  {op} {target} (from {self.path.name})")
            self._publish(i, self.kept[(op, target)])
            return
        device, worker_env = worker_device(self.device, worker, gpus=self.options.get("gpus") or 1)
        with self.lock:
            self.pending.discard(i)
            late = self.late(self.jobs[i])
            if not late:
                self.running[i] = time.monotonic()
                self.progress.begin_audit(op, target, examples, worker=worker)
        if late:
            entry = {"op": op, "target": target, "kind": kind, "examples": examples, "status": "skipped",
                     "exit_code": 2, "passed": None, "verdicts": {}, "result": None, "cases": [],
                     "ulp_histograms": {}, "elapsed_s": 0.0, "message": late}
        else:  # concurrent audits would garble one progress bar's example count: finished lines only
            entry = audit_entry(op, target, kind, examples, device=device, options=self.options,
                                progress=self.progress if self.workers == 1 else None,
                                env=audit_env(kind, worker_env))
        entry.update(worker=worker, device=device)
        with self.lock:
            if not late:
                self.running.pop(i, None)
                self.finished.append((expected_cost(self.jobs[i]), entry["elapsed_s"]))
            self.progress.end_audit(entry, left_s=self.time_left())
        self._publish(i, entry)

    def step(self, name: str, wanted: bool, job: Any, *, beside: bool = False) -> None:
        """Run ``job(budget_seconds)`` for step ``name`` unless kept, unwanted or out of time; ``beside``:
        while the audits run (the child's output goes to its log, the progress keeps drawing)."""
        if self.old and (self.old.get(name) or {}).get("status") == "done":
            with self.lock:  # the audits' threads may be writing the document
                self.doc[name] = self.old[name]
            self.progress.line(f"kept  {name} (from {self.path.name})")
            return
        skip = None
        if name == "bench" and self.device != "cuda":
            skip = "timing needs a GPU"
        elif not wanted:
            skip = ("timing needs a GPU" if self.device == "cpu" else "turned off") + f" (--{name} to run it)"
        elif self.left() < MIN_STEP_S:
            skip = f"not run: --time-limit {self.options['time_limit']:g} s reached"
        if skip:
            with self.lock:
                self.doc[name] = {"status": "skipped", "message": skip, "document": None, "rows": []}
            return
        self.progress.line(f"{name} ..." + " (beside the audits)" * beside)
        budget = max(MIN_STEP_S, min(self.options.get(f"{name}_seconds") or 1e9, self.left() - MIN_STEP_S))
        with contextlib.nullcontext() if beside else self.progress.paused():
            entry = job(budget)
        with self.lock:
            self.doc[name] = entry
        self.progress.line(f"{name}: {entry['status']} {entry.get('message') or ''}".rstrip())
        self.save()


class _Beside:
    """``step(*args, beside=True)`` in a thread from now until :meth:`join` where ``beside``, else all of
    it at :meth:`join`; an exception of ours is raised at :meth:`join`."""

    def __init__(self, step: Any, *args: Any, beside: bool) -> None:
        self.step, self.args, self.error = step, args, None
        self.thread = threading.Thread(target=self._go, name="fuseaudit-beside", daemon=True) if beside else None
        if self.thread is not None:
            self.thread.start()

    def _go(self) -> None:
        try:
            self.step(*self.args, beside=True)
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        if self.thread is None:
            self.step(*self.args)
            return
        _join(self.thread)
        if self.error is not None:
            raise self.error


def run(args: argparse.Namespace, device: str, options: dict[str, Any], path: pathlib.Path) -> dict[str, Any]:
    """Every step, the document written after each; KeyboardInterrupt propagates (the document is saved).

    Order: every audit (reference kernels and built-in targets, one pool) with launches beside them on
    a GPU (after them on the CPU), bench, e2e: timing never runs while audits share the GPU, and under
    a ``--time-limit`` a built-in target's audit starts only if it leaves the later steps their time
    (:meth:`_Run.late`).
    """
    from .run_progress import RunProgress

    jobs = _jobs(options, device)
    with RunProgress(len(jobs), workers=options.get("workers", 1)) as progress, \
            tempfile.TemporaryDirectory(prefix="fuseaudit-run-") as tmpdir:
        r = _Run(args, device, options, path, progress, pathlib.Path(tmpdir))
        limit = f", time limit {options['time_limit']:g} s" if options["time_limit"] else ""
        progress.line(f"fuseaudit run on {r.doc['environment'].get('device_name', device)}: {len(jobs)} audit(s)"
                      f"{limit}; results in {path}")
        progress.line(r.expected(jobs))
        launches = _Beside(r.step, "launches", True,
                           lambda budget: launches_step(options["ops"], device, r.tmp, budget),
                           beside=launches_beside(device))
        try:
            r.audits(jobs)
            launches.join()
        except BaseException:  # interrupted, or a bug of ours: no launch counter is left running
            _kill_children()
            raise
        r.step("bench", options["bench"], lambda budget: bench_step(options, r.tmp, budget))
        r.step("e2e", options["e2e"], lambda budget: e2e_step(device, path.parent, r.tmp, budget))
        r.doc["finished"] = True
        r.save()
    return r.doc


def main(args: argparse.Namespace) -> int:
    from .profiles import resolve_device

    try:
        device = resolve_device(args.device)
        options = _options(args, device)
    except ValueError as exc:
        return usage_error("run", str(exc))
    from .report import report_name, results_name

    out_dir = pathlib.Path(args.out)
    path = pathlib.Path(args.results) if args.results else out_dir / results_name(device)
    html = out_dir / report_name([device])
    try:
        for d in {path.parent, html.parent}:
            d.mkdir(parents=True, exist_ok=True)
            probe = d / ".fuseaudit-write-test"
            probe.write_text("")
            probe.unlink()
    except OSError as exc:
        return usage_error("run", f"cannot write to {exc.filename}: {exc.strerror}")
    try:
        doc = run(args, device, options, path)
    except KeyboardInterrupt:
        return usage_error("run", f"interrupted; what was done is in {path} (fuseaudit report --results {path})")
    from .report import render

    try:
        render([doc], html, sources=[path])
    except Exception as exc:
        return usage_error("run", f"the report could not be written: {type(exc).__name__}: {exc}")
    summary = doc["summary"]
    verdict = "every reference kernel passed every property" if summary["passed"] else (
        "FAILED: " + "; ".join(f"{f['op']} ({', '.join(f.get('properties') or [f.get('message', '')])})"
                               for f in summary["failed"]))
    print(f"fuseaudit run: {verdict}\nresults: {path}\nreport:  {html}\n"
          f"({summary['elapsed_s']:.0f} s)")
    return int(summary["exit_code"])
