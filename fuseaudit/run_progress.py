"""Progress of ``fuseaudit run`` on stderr.

On a terminal: a rich bar for the audits and, with one worker, one for the
examples of the audit running, above one line per finished audit with its
verdict, its time and the time the run expects is left.  Elsewhere (CI logs,
a remote command): a line per started audit and the same finished-audit
lines, plus, with one worker, a line every :data:`QUIET_S` seconds saying
which op and target are running and how many examples are done.  With
several workers audits overlap, so no example count is shown: the bar says
how many are running.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

# what progress lines call each of the judge's phases (fuseaudit.judge.PHASES)
PHASE_WORDS = {"edge": "edge cases", "search": "search", "replay": "replaying the minimal cases",
               "launches": "counting launches", "determinism": "determinism (a second call)",
               "state": "a second call on the same buffers", "sanitize": "compute-sanitizer"}
QUIET_S = 20.0
_STYLE = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow", "ERROR": "bold red", "UNAVAILABLE": "bold red"}


class RunProgress:
    """What ``fuseaudit run`` shows while it works."""

    def __init__(self, total_audits: int, console: Console | None = None, *, workers: int = 1) -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.start = time.monotonic()
        self.total = total_audits
        self.workers = workers
        self.running: set[str] = set()  # the audits begun and not ended
        self.index = 0
        self.label = ""
        self.examples = 0
        self.done = 0
        self.failing = 0
        self.phase = ""
        self.last_line = time.monotonic()
        self.bar: Progress | None = None
        if self.console.is_terminal:
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=True)
            self.overall = self.bar.add_task("audits", total=max(total_audits, 1))
            self.current = self.bar.add_task("", total=1, visible=False)

    # -- lifecycle ------------------------------------------------------------
    def __enter__(self) -> RunProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop drawing while a child process writes to stderr itself (the benchmark's own progress)."""
        if self.bar is not None:
            self.bar.stop()
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.start()

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.start:5.0f}s"

    def line(self, text: str) -> None:
        """A line of markup (callers escape untrusted text)."""
        self.console.print(f"[dim]{self.elapsed()}[/dim] {text}")

    # -- audits -----------------------------------------------------------------
    def begin_audit(self, op: str, target: str, examples: int, *, worker: int = 0) -> None:
        self.index += 1
        self.label = f"{op} {target}"
        self.running.add(self.label)
        self.examples, self.done, self.failing, self.phase = examples, 0, 0, "loading"
        self.last_line = time.monotonic()
        if self.workers > 1:  # overlapping audits: which ones started, never one audit's examples
            if self.bar is not None:
                self.bar.update(self.overall, description=f"audits, {len(self.running)} running")
            else:
                self.line(f"audit {self.index}/{self.total}: {escape(self.label)} ({examples} examples, "
                          f"worker {worker})")
        elif self.bar is not None:
            self.bar.update(self.overall, description=f"audit {self.index}/{self.total}")
            self.bar.reset(self.current, total=examples, visible=True, description=escape(self.label))
        else:
            self.line(f"audit {self.index}/{self.total}: {escape(self.label)} ({examples} examples)")

    def on_event(self, event: dict[str, Any]) -> None:
        """Callback for :func:`fuseaudit.audit.audit`'s ``on_event``."""
        kind = event.get("event")
        if kind == "phase":
            phase = str(event.get("phase"))
            self.phase = PHASE_WORDS.get(phase, phase)
        elif kind == "done" and event.get("phase") == "search":
            self.done += 1
            self.failing += not event["report"].get("passed", True)
        elif kind == "crash":
            self.phase = f"restarted after a {event.get('kind', 'crash')}"
        if self.bar is not None:
            shrink = " shrinking" if self.done > self.examples else ""
            fails = f" [red]{self.failing} failing[/red]" if self.failing else ""
            self.bar.update(self.current, completed=min(self.done, self.examples),
                            description=f"{escape(self.label)} [dim]{self.phase}{shrink}[/dim]{fails}")
        elif time.monotonic() - self.last_line >= QUIET_S:
            self.last_line = time.monotonic()
            self.line(f"  {escape(self.label)}: {self.phase}, {self.done}/{self.examples} examples, "
                      f"{self.failing} failing")

    def end_audit(self, entry: dict[str, Any], *, left_s: float | None = None) -> None:
        """The finished audit's line; ``left_s``: the seconds the run expects to have left (None: no estimate)."""
        self.running.discard(f"{entry['op']} {entry['target']}")
        if entry["status"] != "done":
            word = entry["status"].upper()
            detail = escape(str(entry.get("message", ""))[:200])
        else:
            word = "PASS" if entry["passed"] else "FAIL"
            failed = [p for p, v in entry["verdicts"].items() if v == "FAIL"]
            skipped = [p for p, v in entry["verdicts"].items() if v == "SKIP"]
            detail = (f"({', '.join(failed)}) " if failed else "") + (f"[dim]skip: {', '.join(skipped)}[/dim] "
                                                                      if skipped else "")
            detail += f"[dim]{len(entry['cases'])} cases, {entry['elapsed_s']:.0f} s[/dim]"
        if left_s is not None:
            detail += f" [dim]· about {duration(left_s)} left[/dim]"
        if self.bar is not None:
            self.bar.update(self.overall, advance=1)
            self.bar.update(self.current, visible=False)
            if self.workers > 1:
                self.bar.update(self.overall, description=f"audits, {len(self.running)} running")
        style = _STYLE.get(word, "yellow")
        self.line(f"[{style}]{word:<5}[/{style}] {escape(entry['op'])} {escape(entry['target'])} {detail}")


def duration(seconds: float) -> str:
    """``seconds`` for a person: "45 s" below a minute and a half, else whole minutes ("4 min")."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
