"""Run the audit's worker in a child process and survive whatever the target does.

The target runs in a child (``python -m fuseaudit._audit_worker``, a fresh
interpreter: nothing of the parent's state, CUDA context or imports leaks in,
and ``TRITON_INTERPRET=1`` is in its environment for the CPU before anything
is imported).  The child appends one JSON line per step to a results file
and flushes it, ``start`` before each call of the target and ``done`` after
(:mod:`fuseaudit._audit_worker`).  The parent only reads that file:

* **raises**: caught in the child by :func:`fuseaudit.check.run_case`, a
  ``runs`` failure Hypothesis shrinks like any other;
* **hangs**: no new line for ``timeout`` seconds (per example, so a long
  audit is never cut short, a stuck call always is; loading the target gets
  ``setup_timeout``).  The parent asks the child for a stack dump
  (``SIGUSR1`` to :mod:`faulthandler`), kills its process group and records
  a ``crash`` event (kind ``timeout``) naming the case that was running and
  where it was stuck;
* **crashes** (segfault, abort, ``os._exit``): the child is gone without a
  ``finished`` line; the parent records a ``crash`` event with the signal,
  the case that was running and the innermost frames of faulthandler's dump;
* **illegal CUDA access**: the child notices the lost context, writes a
  ``fatal`` line and exits; recorded like a crash.

Nothing is lost: every line the child wrote stays in the results file and
the report is assembled from all of them.  **Restart policy**: after a crash
or a hang the parent starts a fresh child for the *remaining phases* only
(``launches``, ``determinism``); the interrupted phase is not resumed
(Hypothesis's search state died with the child), so the crash itself is the
``runs`` failure and the case is the one that was running, unshrunk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ._audit_worker import EXIT_FATAL, AuditJob, run_job

OnEvent = Callable[[dict[str, Any]], None]
POLL_S = 0.1


class _Lines:
    """Complete lines appended to a file since the last read (a torn last line waits)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.pending = b""

    def skip_to_end(self) -> None:
        self.offset = self.path.stat().st_size
        self.pending = b""

    def read(self) -> list[dict[str, Any]]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        data = self.pending + chunk
        *complete, self.pending = data.split(b"\n")
        events = []
        for line in complete:
            try:
                events.append(json.loads(line))
            except ValueError:  # a line torn by a killed child
                continue
        return events


def _append(path: Path, event: dict[str, Any]) -> None:
    with open(path, "ab") as f:
        if f.tell() and _last_byte(path) != b"\n":
            f.write(b"\n")  # end a line the dead child left torn
        f.write(json.dumps(event).encode() + b"\n")


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (its own process group)."""
    if proc.poll() is not None:
        return
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _dump_stacks(proc: subprocess.Popen) -> None:
    """Ask a hung child for faulthandler's stack dump, and give it a moment to write."""
    if os.name == "posix" and hasattr(signal, "SIGUSR1") and proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return
        time.sleep(0.5)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where_it_was(log: str, frames: int = 2) -> str:
    """``Fatal Python error: ...; at file:line in fn <- ...`` from the last faulthandler dump in ``log``."""
    fatal = [ln.strip() for ln in log.splitlines() if ln.startswith("Fatal Python error")]
    dump = log.rsplit("most recent call first", 1)
    found = []
    if len(dump) == 2:
        for line in dump[1].splitlines()[1:]:
            m = _FRAME.match(line)
            if not m:
                if found:
                    break
                continue
            found.append(f"{_short(m['file'])}:{m['line']} in {m['func']}")
            if len(found) == frames:
                break
    parts = fatal[-1:] + ([f"at {' <- '.join(found)}"] if found else [])
    return "; ".join(parts)


def _short(path: str) -> str:
    """A path relative to the working directory, else its last two parts."""
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(Path(*p.parts[-2:]))


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def run_in_process(job: AuditJob, *, on_event: OnEvent | None = None) -> list[dict[str, Any]]:
    """Run the worker here: no protection against hangs or crashes (for debugging and fast tests)."""
    events: list[dict[str, Any]] = []

    def emit(event: dict[str, Any]) -> None:
        event = json.loads(json.dumps(event))  # exactly what a child's line would hold
        events.append(event)
        if on_event:
            on_event(event)

    code = run_job(job, emit)
    if code == EXIT_FATAL:  # recorded as a crash, as the parent of a child would
        events.append(_crash_event(events, code, False, 0.0, "", 1))
    return events


def run_isolated(job: AuditJob, *, timeout: float, setup_timeout: float, workdir: Path,
                 on_event: OnEvent | None = None, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``job`` in child processes, restarting after a crash for the remaining phases.

    ``env``: variables set in the children's environment on top of ours (``CUDA_VISIBLE_DEVICES``
    of one GPU, for ``fuseaudit run --workers``).

    Returns every event, the parent's ``crash`` events included, in order.
    """
    results = workdir / "results.jsonl"
    results.touch()
    reader = _Lines(results)
    events: list[dict[str, Any]] = []
    remaining = list(job.phases)
    attempt = 0
    child_env = {**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",
                 "FUSEAUDIT_PARENT_PID": str(os.getpid())}
    if job.device == "cpu":
        child_env["TRITON_INTERPRET"] = "1"
    while remaining:
        attempt += 1
        job_path = workdir / f"job-{attempt}.json"
        job_path.write_text(replace(job, phases=remaining).to_json())
        log_path = workdir / f"child-{attempt}.log"
        first = len(events)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fuseaudit._audit_worker", str(job_path), str(results)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                start_new_session=os.name == "posix",
            )
            try:
                timed_out = _watch(proc, reader, events, timeout=timeout, setup_timeout=setup_timeout,
                                   on_event=on_event)
            finally:
                _kill(proc)
        mine = events[first:]
        kinds = {e["event"] for e in mine}
        setup = next((e for e in mine if e["event"] == "setup"), None)
        if "finished" in kinds or "error" in kinds or (setup is not None and not setup.get("ok")):
            break
        crash = _crash_event(mine, proc.returncode, timed_out, timeout if setup else setup_timeout,
                             log_path.read_text(errors="replace"), attempt)
        _append(results, crash)
        reader.skip_to_end()  # the crash line is ours, and a torn line of the dead child is garbage
        events.append(crash)
        if on_event:
            on_event(crash)
        if setup is None:
            break  # died while loading the target: the audit cannot run
        # restart for the phases neither finished nor interrupted
        ended = {e["phase"] for e in mine if e["event"] == "phase_end"}
        remaining = [p for p in remaining if p not in ended and p != crash["phase"]]
    return events


def _watch(proc: subprocess.Popen, reader: _Lines, events: list[dict[str, Any]], *, timeout: float,
           setup_timeout: float, on_event: OnEvent | None) -> bool:
    """Collect the child's lines until it exits (False) or makes no progress in time (True)."""
    last = time.monotonic()
    in_setup = True
    while True:
        exited = proc.poll() is not None
        new = reader.read()
        for event in new:
            events.append(event)
            if on_event:
                on_event(event)
            if event["event"] == "setup":
                in_setup = False
        now = time.monotonic()
        if new:
            last = now
        if exited:
            return False
        if now - last > (setup_timeout if in_setup else timeout):
            _dump_stacks(proc)
            _kill(proc)
            for event in reader.read():
                events.append(event)
                if on_event:
                    on_event(event)
            return True
        time.sleep(POLL_S)


def _crash_event(mine: list[dict[str, Any]], code: int | None, timed_out: bool, limit: float, log: str,
                 attempt: int) -> dict[str, Any]:
    """The parent's record of a child that hung or died: which phase, which case, how."""
    phase = None
    for e in mine:
        if e["event"] == "phase":
            phase = e["phase"]
        elif e["event"] == "phase_end":
            phase = None
    starts = [e for e in mine if e["event"] == "start"]
    last_start = starts[-1] if starts else None
    in_call = last_start is not None and not any(
        e["event"] in ("done", "launches", "determinism") for e in mine[mine.index(last_start) + 1:])
    case = last_start["case"] if last_start else None
    fatal = next((e for e in mine if e["event"] == "fatal"), None)
    setup_done = any(e["event"] == "setup" for e in mine)
    where = where_it_was(log)
    detail = where
    if fatal is not None:
        kind, how, detail = "fatal", "made the CUDA context unusable", fatal["message"]
    elif timed_out:
        kind, how = "timeout", f"made no progress for {limit:g} s (killed)"
    else:
        kind, how = "crash", f"crashed the process ({_signal_name(code if code is not None else 0)})"
    if not setup_done:
        doing = "while loading the target"
    elif in_call:
        doing = f"in a call ({phase} phase)"
    else:
        doing = f"between calls ({phase or 'no'} phase; the case is the last one that ran)"
    message = f"the target {how} {doing}" + (f"; {detail}" if detail else "")
    return {"event": "crash", "kind": kind, "phase": phase, "case": case if in_call else None,
            "last_case": case, "in_call": in_call, "message": message, "returncode": code, "attempt": attempt,
            "setup_done": setup_done, "log_tail": log[-4000:]}
