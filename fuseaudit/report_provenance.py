"""Where a report's figures come from: per run its device, date, commit and, per section, the command.

A results file of ``fuseaudit run`` records the command line that made it;
every section (audits, launches, bench, e2e) came from that command unless
the file says otherwise: a section can be added afterwards (a sweep merged
in, launch counts from another run), and then the run's own command,
which may even have turned that step off, is not the one to show.  So each
section names its own command, or says why none is known.  Long notes stay
in the results file (and in a README beside it, linked): the report shows
their first sentence.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shlex
from typing import Any

from .report_text import quoted_commands, short_note

STEPS = ("launches", "bench", "e2e")
_PROGRAMS = ("fuseaudit", "cli.py", "__main__.py")  # argv[0] of `fuseaudit`, `python -m fuseaudit.cli`


def command_line(argv: list[str] | None) -> str | None:
    """A recorded argv as the command a person would type (``fuseaudit run ...``), quoted for the shell."""
    if not argv:
        return None
    program = pathlib.PurePath(str(argv[0])).name
    head = "fuseaudit" if program in _PROGRAMS else str(argv[0])
    return shlex.join([head, *map(str, argv[1:])])


def when(stamp: str | None) -> str | None:
    """An ISO time as ``YYYY-MM-DD HH:MM UTC``; the text as it is where it does not parse."""
    if not stamp:
        return None
    try:
        t = datetime.datetime.fromisoformat(str(stamp))
    except ValueError:
        return str(stamp)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def link(target: pathlib.Path, out: pathlib.Path | None) -> dict[str, str]:
    """A link to ``target`` from a page written at ``out`` (relative, so the folder can move)."""
    href = os.path.relpath(target, out.parent) if out is not None else str(target)
    return {"text": href, "href": pathlib.PurePath(href).as_posix()}


def step_command(run: dict[str, Any], name: str) -> dict[str, Any]:
    """The command that produced step ``name``'s data, where it is known; else why it is not.

    In order: a command recorded with the step (``argv``), one its note
    names in backticks (a section put in from another run), the bench
    document's own command line, this run's command where this run ran the
    step.  Skipped steps have none: their note says why.
    """
    step = run.get(name) or {}
    message = step.get("message") or ""
    if step.get("status") == "skipped":
        return {"command": None, "origin": "", "why": message or "skipped"}
    if step.get("argv"):
        return {"command": command_line(step["argv"]), "origin": "recorded with the step", "why": ""}
    quoted = quoted_commands(message)
    if quoted:
        return {"command": quoted[0], "origin": "named in the step's note", "why": ""}
    document = step.get("document") or {}
    meta = document.get("fuseaudit") if isinstance(document, dict) else None
    if isinstance(meta, dict) and meta.get("argv") and not _ran_here(run, name):
        return {"command": command_line(meta["argv"]), "origin": "recorded in the bench document", "why": ""}
    if _ran_here(run, name):
        return {"command": command_line(run.get("argv")), "origin": "this run", "why": ""}
    return {"command": None, "origin": "",
            "why": f"not recorded: this run's own command did not run it (--no-{name}); the data was put into "
                   f"the results file afterwards"}


def _ran_here(run: dict[str, Any], name: str) -> bool:
    """Whether this run's own command ran step ``name`` (launches always; bench and e2e where turned on)."""
    options = run.get("options") or {}
    return name == "launches" or bool(options.get(name))


def _device_line(run: dict[str, Any]) -> str:
    env = run.get("environment") or {}
    gpu = env.get("gpu") or {}
    parts = [str(env.get("device_name") or run["device"])]
    used = sorted({str(a["device"]) for a in run.get("audits", []) if a.get("device")})
    if len(used) > 1:
        parts.append(f"audits on {', '.join(used)}")
    if gpu.get("driver"):
        parts.append(f"driver {gpu['driver']}")
    versions = [f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k)]
    return ", ".join(parts + versions)


def provenance(run: dict[str, Any], label: str, *, source: pathlib.Path | None = None,
               out: pathlib.Path | None = None) -> dict[str, Any]:
    """Device, date, commit and data file of one run, then every section with its command and a short note."""
    env = run.get("environment") or {}
    summary = run.get("summary") or {}
    elapsed = summary.get("elapsed_s")
    date = when(run.get("created")) or "not recorded"
    if elapsed is not None:
        date += f", {float(elapsed):.0f} s"
    if not run.get("finished"):
        date += " (not finished: interrupted or still running)"
    lines = [("device", _device_line(run)), ("date", date),
             ("commit", f"{env.get('git_commit') or 'not recorded'} (fuseaudit {env.get('fuseaudit') or '?'})")]
    sections = [{"section": "audits", "status": "done" if run.get("audits") else "none",
                 "command": command_line(run.get("argv")), "origin": "this run",
                 "why": "" if run.get("argv") else "not recorded", "note": short_note("")}]
    for name in STEPS:
        step = run.get(name) or {}
        note = short_note(step.get("message") or "") if step.get("status") != "skipped" else short_note("")
        sections.append({"section": name, "status": step.get("status", "none"), **step_command(run, name),
                         "note": note})
    readme = source.parent / "README.md" if source is not None else None
    return {"run": label, "lines": lines, "sections": sections,
            "data": link(source, out) if source is not None else None,
            "notes": link(readme, out) if readme is not None and readme.is_file() else None}
