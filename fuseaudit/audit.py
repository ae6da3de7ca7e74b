"""``fuseaudit audit OP TARGET``: check any implementation of an op, and survive it.

Python API: :func:`audit` returns an :class:`~fuseaudit.audit_result.AuditResult`
(``.exit_code``, ``.render()``, ``.to_dict()``) or raises :class:`AuditUsageError`
when the audit cannot run.  Command line::

    fuseaudit audit OP TARGET [--examples N] [--seed S] [--device cpu|cuda|auto]
                    [--launches N] [--json PATH] [--case JSON] [--timeout SECONDS]
                    [--dtypes D ...] [--contiguous-only] [--head-dims D ...]
                    [--profile ci|dev|gpu] [--shrink-time SECONDS] [--in-process]

Process model: this process is the **judge** (:mod:`fuseaudit.judge`): it
draws the cases, makes and keeps the inputs, computes eager and the float64
oracle and every comparison, and writes the verdict; it never imports the
target.  The target runs in a **worker** forked for the audit from a zygote
that has torch and Triton imported (:mod:`fuseaudit.sandbox`), which only loads
it, calls it on the judge's buffers and hands the outputs back as data
(:mod:`fuseaudit.remote`).  A call that raises, hangs (``--timeout`` seconds,
on the judge's clock), crashes the worker or breaks its protocol is a
``runs`` failure naming the case; the next call gets a fresh worker.  Before
the result is printed or written, the worker and everything it started are
gone.  ``--in-process`` calls the target in this process instead (for a
debugger; no protection).

Properties (one verdict line each): ``runs``, ``contract``, ``inputs_unchanged``
and ``numerics`` on Hypothesis-drawn cases, each failing property shrunk to its
own minimal case; ``launches`` and ``determinism`` on cases of the search; the
state checks (buffers reused with new values, outputs unchanged by later calls)
count towards ``numerics`` and ``contract``.  Every failure prints its message,
the smallest failing case and one command that replays exactly that case
(``--case``).

Exit codes: 0 every property holds; 1 the target failed a property; 2 the
audit could not run -- unknown op, a target that does not load or whose
signature does not fit the op, a built-in target not available on this
device, bad option values, a ``--case`` of another op -- with one line on
stderr; 3 INCONCLUSIVE: a property was checked on fewer cases than asked
(the target declared them unsupported, or the count could not be trusted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable

from .audit_result import AuditResult, assemble
from .case import DTYPES, LAYOUTS, Case
from .catalog import OpSpec, get_op
from .cli import usage_error
from .jsonio import write_json
from .judge import AuditJob, Judge, environment
from .run_progress import PHASE_WORDS
from .strategies import SIZE_PROFILES

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
DEFAULT_EXAMPLES = 50
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SHRINK_S = 120.0
SETUP_TIMEOUT_S = 180.0  # loading the target in a fresh worker (imports, a first compile)


class AuditUsageError(Exception):
    """The audit could not run (exit 2); the message is one line."""


def audit(
    op: str,
    target: str,
    *,
    examples: int = DEFAULT_EXAMPLES,
    seed: int | None = None,
    device: str = "auto",
    launches: int | None = None,
    case: str | Case | None = None,
    timeout: float | None = None,
    dtypes: Sequence[str] | None = None,
    contiguous_only: bool = False,
    head_dims: Sequence[int] | None = None,
    profile: str | None = None,
    shrink_time: float = DEFAULT_SHRINK_S,
    isolate: bool = True,
    progress: bool = False,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
    sanitize: bool | str | Sequence[str] = False,
) -> AuditResult:
    """Audit ``target`` (``module:function``, ``file.py:function`` or ``builtin:NAME``) as op ``op``.

    ``examples`` Hypothesis examples (shrinking comes on top), derandomized
    with ``seed`` (a random one, recorded in the result, when None, so every
    search can be replayed); ``launches`` the expected kernels per call
    (default: the catalog's); ``case`` replays one case (a :class:`Case` or
    its JSON); ``timeout`` seconds a call may take before it counts as hung;
    ``profile`` the size bounds (default ``gpu`` on CUDA, ``ci`` on the CPU);
    ``shrink_time`` seconds of shrinking after the first failure (the edge
    phase and the search on one clock), after which the smallest failing case
    found so far is reported; ``isolate=False``
    calls the target in this process; ``progress`` shows progress on stderr;
    ``on_event`` receives every event of the judge as it comes (``fuseaudit
    run`` draws its progress and its per-case figures from them); ``env``
    extra environment variables of the worker (a GPU's ``CUDA_VISIBLE_DEVICES``);
    ``sanitize`` runs the edge cases and the minimal failing cases again under
    compute-sanitizer (True: every tool; or tool names, :mod:`fuseaudit.sanitize`).
    """
    start = time.perf_counter()
    spec = _get_op(op)
    if isolate:
        from .sandbox import start as start_zygote

        start_zygote("cuda" if str(device).startswith("cuda") else device if device == "cpu" else _auto(), env=env)
    device = _device(device)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    job, declared, min_timeout = _job(spec, target, device=device, examples=examples, seed=seed, launches=launches,
                                      case=case, dtypes=dtypes, contiguous_only=contiguous_only,
                                      head_dims=head_dims, profile=profile)
    if sanitize:
        job.sanitize = _sanitize_tools(sanitize)
        job.phases.append("sanitize")
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if not timeout > 0:
        raise AuditUsageError(f"--timeout must be positive, got {timeout}")
    timeout = max(timeout, min_timeout)
    if not shrink_time >= 0:
        raise AuditUsageError(f"--shrink-time must be zero or positive, got {shrink_time}")
    job.shrink_seconds = float(shrink_time)
    events: list[dict[str, Any]] = []
    with _progress(progress, job) as shown:
        listener = _chain(shown, on_event)

        def emit(event: dict[str, Any]) -> None:
            events.append(event)
            if listener is not None:
                listener(event)

        caller = _caller(spec, target, device=device, timeout=timeout, isolate=isolate, env=env)
        try:
            emit({"event": "setup", "ok": True, "env": environment(device)})
            Judge(job, caller, emit).run()
        except Exception as exc:  # a bug of fuseaudit's own: exit 2, never a verdict
            raise AuditUsageError(f"internal error: {type(exc).__name__}: {exc}") from exc
        finally:
            caller.close()  # the worker and everything it started are gone before the result exists
    restarts = getattr(caller, "restarts", 0)
    return assemble(events, job=job, declared=declared, elapsed_s=time.perf_counter() - start, restarts=restarts)


def _auto() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _target_for_worker(target: str) -> str:
    """``path/file.py:fn`` made absolute: the worker runs in a scratch directory."""
    module, _, attr = target.rpartition(":")
    if module.endswith(".py"):
        return f"{Path(module).resolve()}:{attr}"
    return target


def _caller(spec: OpSpec, target: str, *, device: str, timeout: float, isolate: bool,
            env: dict[str, str] | None) -> Any:
    """The way to the target: a worker (loaded, or exit 2 where it cannot be), or this process."""
    if not isolate:
        from .check import InProcess
        from .targets import load_target
        from .worker import signature_problem

        try:
            impl = load_target(target, op=spec.name)
        except Exception as exc:
            message = str(exc) if type(exc).__name__ == "TargetError" else \
                f"could not load {target}: {type(exc).__name__}: {exc}"
            raise AuditUsageError(message) from None
        problem = signature_problem(spec, impl, target)
        if problem:
            raise AuditUsageError(problem)
        return InProcess(impl, device=device)
    from .remote import Remote, TargetLoadError
    from .sandbox import sandbox

    try:
        box = sandbox(device, env=env)
        remote = Remote(box, target=_target_for_worker(target), op=spec.name, device=device, timeout=timeout,
                        load_timeout=max(SETUP_TIMEOUT_S, timeout), path=[os.getcwd()], env=env)
        remote.start()
    except TargetLoadError as exc:
        raise AuditUsageError(str(exc)) from None
    except RuntimeError as exc:  # the zygote did not start
        raise AuditUsageError(f"could not start a worker: {exc}") from None
    return remote


# ---------------------------------------------------------------------------
# Validation: everything that makes exit 2
# ---------------------------------------------------------------------------

def _get_op(op: str) -> OpSpec:
    try:
        return get_op(op)
    except KeyError as exc:
        raise AuditUsageError(exc.args[0]) from None


def _device(device: str) -> str:
    from .profiles import resolve_device

    try:
        return resolve_device(device)
    except ValueError as exc:
        raise AuditUsageError(str(exc)) from None


def _sanitize_tools(sanitize: bool | str | Sequence[str]) -> list[str]:
    from .sanitize import parse_tools

    text = "" if sanitize is True else sanitize if isinstance(sanitize, str) else ",".join(sanitize)
    try:
        return parse_tools(text)
    except ValueError as exc:
        raise AuditUsageError(f"--sanitize: {exc}") from None


def _split(values: Sequence[Any] | None) -> list[str]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]``: both spellings work on the command line."""
    out: list[str] = []
    for v in values or ():
        out.extend(s for s in str(v).replace(",", " ").split() if s)
    return out


def _job(spec: OpSpec, target: str, *, device: str, examples: int, seed: int | None, launches: int | None,
         case: str | Case | None, dtypes: Sequence[str] | None, contiguous_only: bool,
         head_dims: Sequence[int] | None, profile: str | None) -> tuple[AuditJob, dict[str, Any], float]:
    """The worker's job from validated options, the declared support, and the least timeout."""
    if not isinstance(examples, int) or examples < 1:
        raise AuditUsageError(f"--examples must be a positive integer, got {examples!r}")
    if launches is not None and (not isinstance(launches, int) or launches < 1):
        raise AuditUsageError(f"--launches must be a positive integer, got {launches!r}")
    profile = profile or ("gpu" if device.startswith("cuda") else "ci")
    if profile not in SIZE_PROFILES:
        raise AuditUsageError(f"unknown profile {profile!r}; known: {', '.join(SIZE_PROFILES)}")
    dtype_list = _split(dtypes) or None
    for d in dtype_list or ():
        if d not in DTYPES:
            raise AuditUsageError(f"unknown dtype {d!r} in --dtypes; known: {', '.join(DTYPES)}")
    head_list: list[int] | None = None
    if head_dims:
        if not spec.shape.head_dims:
            raise AuditUsageError(f"--head-dims applies to ops with a head dim (attention), not {spec.name}")
        try:
            head_list = sorted({int(h) for h in _split(head_dims)})
        except ValueError:
            raise AuditUsageError(f"--head-dims must be positive integers, got {' '.join(map(str, head_dims))}") \
                from None
        if not head_list or head_list[0] < 1:
            raise AuditUsageError(f"--head-dims must be positive integers, got {head_list}")
    layouts = ["contiguous"] if contiguous_only else None

    expected = launches if launches is not None else spec.launches
    count, note, min_timeout = True, "", 0.0
    if ":" not in target:
        raise AuditUsageError(
            f"target {target!r} must be 'package.module:function', 'path/file.py:function' or 'builtin:NAME'")
    from .targets import is_builtin

    if is_builtin(target):
        dtype_list, layouts, head_list, expected, count, note, min_timeout = _builtin(
            spec, target, device, dtype_list, layouts, head_list, launches)

    case_json = None
    if case is not None:
        try:
            replay = case if isinstance(case, Case) else Case.from_json(case)
        except ValueError as exc:
            raise AuditUsageError(f"--case: {exc}") from None
        if replay.op != spec.name:
            raise AuditUsageError(f"--case is a case of op {replay.op!r}, not {spec.name!r}")
        case_json = replay.to_json()
    phases = ["replay"] if case_json else ["edge", "search"]
    phases += ["launches", "determinism", "state"]
    job = AuditJob(op=spec.name, target=target, device=device, phases=phases, examples=examples, seed=seed,
                   profile=profile, dtypes=dtype_list, layouts=layouts, head_dims=head_list,
                   expected_launches=expected, count_launches=count, launches_note=note, case=case_json)
    declared = {"dtypes": dtype_list, "layouts": layouts, "head_dims": head_list}
    return job, declared, min_timeout


def _builtin(spec: OpSpec, target: str, device: str, dtypes: list[str] | None, layouts: list[str] | None,
             head_dims: list[int] | None, launches: int | None) -> tuple[Any, ...]:
    """Intersect the user's declared support with the built-in target's own; exit 2 where it cannot run here."""
    from .builtin_targets import available_targets, builtin_target
    from .targets import TargetError

    try:
        info = builtin_target(target)
    except TargetError as exc:
        raise AuditUsageError(str(exc)) from None
    why = info.unavailable(spec.name, device)
    if why:
        here = ", ".join(available_targets(spec.name, device)) or "none"
        raise AuditUsageError(f"{why}; built-in targets for {spec.name} on {device}: {here}")
    dtypes = [d for d in (dtypes or info.dtypes) if d in info.dtypes]
    if not dtypes:
        raise AuditUsageError(f"--dtypes leaves nothing {target} supports ({', '.join(info.dtypes)})")
    if info.contiguous_only:
        layouts = ["contiguous"]
    if info.head_dims is not None:
        head_dims = [h for h in (head_dims or info.head_dims) if h in info.head_dims]
        if not head_dims:
            raise AuditUsageError(f"--head-dims leaves nothing {target} supports ({info.head_dims})")
    expected = launches if launches is not None else (spec.launches if info.judge_launches else None)
    note = "" if info.judge_launches else f"{target} is an unfused baseline"
    count = device.split(":")[0] in info.count_launches_on  # cuda:1 counts as cuda
    if not count:
        note = f"{target}: kernels are counted on {', '.join(info.count_launches_on)} only"
    return dtypes, layouts, head_dims, expected, count, note, info.min_timeout_s


# ---------------------------------------------------------------------------
# Progress (stderr, only on a terminal)
# ---------------------------------------------------------------------------

def _chain(*callbacks: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """One callback that calls each of ``callbacks`` that is not None (None if there are none)."""
    live = [c for c in callbacks if c is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def both(event: dict[str, Any]) -> None:
        for c in live:
            c(event)

    return both


# Off a terminal (a log, CI), a plain line at each phase and every this many examples.
LOG_EVERY_EXAMPLES = 10


@contextlib.contextmanager
def _progress(enabled: bool, job: AuditJob) -> Iterator[Callable[[dict[str, Any]], None] | None]:
    """Progress on stderr: a live status line on a terminal, plain timestamped lines in a log."""
    if not enabled:
        yield None
        return
    state: dict[str, Any] = {"done": 0, "failing": 0, "phase": "loading the target", "said": ""}
    start = time.monotonic()
    status = None
    if sys.stderr.isatty():
        from rich.console import Console

        status = Console(stderr=True).status(f"audit {job.op}: loading the target")

    def on_event(event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "phase":
            state["phase"] = event["phase"]
        elif kind == "done" and event["phase"] == "search":
            state["done"] += 1
            state["failing"] += not event["report"]["passed"]
        elif kind == "lost":
            state["phase"] = f"a fresh worker after: {event['kind']}"
        if state["phase"] == "search":
            extra = " (shrinking)" if state["done"] > job.examples else ""
            text = f"search: {state['done']}/{job.examples} examples, {state['failing']} failing{extra}"
            milestone = f"search {state['done'] // LOG_EVERY_EXAMPLES}"
        else:
            text = milestone = PHASE_WORDS.get(state["phase"], str(state["phase"]))
        if status is not None:
            status.update(f"audit {job.op}: {text}")
        elif (state["phase"] == "search" or state["said"]) and milestone != state["said"]:
            # silent until the search starts, so that a usage error stays one line
            state["said"] = milestone
            print(f"{time.monotonic() - start:6.0f}s audit {job.op}: {text}", file=sys.stderr, flush=True)

    if status is not None:
        status.start()
    try:
        yield on_event
    finally:
        if status is not None:
            status.stop()


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help="the op, as `fuseaudit ops` lists it")
    parser.add_argument("target", help="package.module:function, path/to/file.py:function or builtin:NAME "
                                       "(builtin:compile; for attention builtin:sdpa-flash|cudnn|efficient|math)")
    parser.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, metavar="N",
                        help=f"Hypothesis examples before shrinking (default {DEFAULT_EXAMPLES})")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="derandomize the search with this seed")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the target runs; cpu runs Triton's interpreter (default: cuda if available)")
    parser.add_argument("--launches", type=int, default=None, metavar="N",
                        help="kernels one call should launch (default: the catalog's, 1 for every op)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON")
    parser.add_argument("--case", default=None, metavar="JSON", help="replay exactly this case (from a replay line)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"a call that makes no progress this long has hung (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--dtypes", nargs="+", default=None, metavar="DTYPE",
                        help=f"declared support: only these dtypes ({', '.join(DTYPES)})")
    parser.add_argument("--contiguous-only", action="store_true",
                        help=f"declared support: contiguous inputs only (else {', '.join(LAYOUTS)})")
    parser.add_argument("--head-dims", nargs="+", default=None, metavar="D",
                        help="declared support (attention): only these head dims")
    parser.add_argument("--profile", choices=tuple(SIZE_PROFILES), default=None,
                        help="size bounds of drawn cases (default: gpu on CUDA, ci on the CPU)")
    parser.add_argument("--shrink-time", type=float, default=DEFAULT_SHRINK_S, metavar="SECONDS",
                        help=f"stop shrinking this long after the first failure, edge phase and search alike "
                             f"(default {DEFAULT_SHRINK_S:g})")
    parser.add_argument("--sanitize", nargs="?", const="", default=None, metavar="TOOLS",
                        help="also run the edge cases and the minimal failing cases under compute-sanitizer "
                             "(CUDA): memcheck,initcheck,racecheck (default: all three)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the target in this process (debugging; no protection from hangs or crashes)")


def main(args: argparse.Namespace) -> int:
    """Run the audit; print the verdicts (stdout) or one error line (stderr); return the exit code."""
    try:
        result = audit(
            args.op, args.target, examples=args.examples, seed=args.seed, device=args.device,
            launches=args.launches, case=args.case, timeout=args.timeout, dtypes=args.dtypes,
            contiguous_only=args.contiguous_only, head_dims=args.head_dims, profile=args.profile,
            shrink_time=args.shrink_time, isolate=not args.in_process, progress=True,
            sanitize=False if args.sanitize is None else (args.sanitize or True),
        )
    except AuditUsageError as exc:
        message = " ".join(str(exc).split())  # one line
        usage_error("audit", message)
        if args.json:
            _write_json(args.json, {"op": args.op, "target": args.target, "exit_code": EXIT_USAGE,
                                    "error": message})
        return EXIT_USAGE
    print(result.render())
    if args.json and not _write_json(args.json, result.to_dict()):
        return EXIT_USAGE
    return result.exit_code


def _write_json(path: str, data: dict[str, Any]) -> bool:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(path, data)
    except OSError as exc:
        usage_error("audit", f"cannot write --json {path}: {exc.strerror or exc}")
        return False
    return True
