"""Memory errors numerics cannot see: cases run under NVIDIA's compute-sanitizer.

An out-of-bounds read that lands on memory whose values do not matter, a read
of uninitialised memory that happens to hold harmless bits, a shared-memory
race that loses only under other timing: each can leave every output right.
``fuseaudit audit --sanitize`` runs the edge cases and every minimal failing
case again under compute-sanitizer, one process per tool:

``memcheck``   out-of-bounds and misaligned global/shared accesses
``initcheck``  reads of device memory nothing wrote
``racecheck``  shared-memory hazards between threads of a block

The process (:func:`child_main`) is a worker like any other: ``python -I``,
a scratch directory, the worker's environment, and
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own
allocation and memcheck knows its bounds.  It materialises each case,
synchronises, prints a marker, calls the target, synchronises, prints
another; the judge reads the tool's report line by line and gives each
finding the case whose markers frame it.  A finding outside the target's
calls (torch's own kernels making the inputs) is reported as such.

Trust: the report reaches the judge through the process's own output, so a
hostile target can forge or hide it.  ``--sanitize`` finds honest memory
errors; it is no defence against a target that games the audit (the
numerics, launches and state checks stay with the judge).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

TOOLS = ("memcheck", "initcheck", "racecheck")
MARK = "@@fuseaudit-sanitize"
_PREFIX = "========= "
# the tool's own bookkeeping lines: not findings
_NOT_FINDINGS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                           r"Target application returned|Saved host backtrace|No hazards|Internal Sanitizer)")
_KERNEL = re.compile(r"\bat\s+(.+?)\+0x[0-9a-f]+(?:\s+in\s+(\S+:\d+))?")
_SPACE = re.compile(r"0x[0-9a-f]+|\(\d+,\d+,\d+\)")

_CHILD = ("import sys; sys.path[:] = __import__('json').loads(sys.argv[1]); "
          "from fuseaudit.sanitize import child_main; child_main(sys.argv[2])")


def find_tool() -> str | None:
    """compute-sanitizer's path: on PATH, under $CUDA_HOME/bin, or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


def parse_tools(text: str | None) -> list[str]:
    """``--sanitize memcheck,racecheck`` as a list; every tool when empty; ValueError naming the known ones."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()] or list(TOOLS)
    unknown = [t for t in names if t not in TOOLS]
    if unknown:
        raise ValueError(f"unknown sanitizer tool {unknown[0]!r}; known: {', '.join(TOOLS)}")
    return list(dict.fromkeys(names))


@dataclass
class Finding:
    """One kind of error of one tool in one kernel on one case, with how often it was reported."""

    tool: str
    what: str  # the tool's headline, addresses and thread indices left out
    kernel: str
    where: str  # file:line of the access, where the tool names it
    case: int | None  # index into the cases run; None: outside the target's calls
    count: int = 1
    first: str = ""  # the first report's lines, as the tool printed them

    def line(self) -> str:
        kernel = f" in {self.kernel}" if self.kernel else ""
        where = f" ({self.where})" if self.where else ""
        times = f", {self.count} times" if self.count > 1 else ""
        return f"{self.tool}: {self.what}{kernel}{where}{times}"


class _Reader:
    """Folds the tool's report into findings, attributing each to the case whose markers frame it."""

    def __init__(self, tool: str):
        self.tool = tool
        self.case: int | None = None
        self.in_call = False
        self.ended: list[int] = []
        self.raised: dict[int, str] = {}
        self.findings: dict[tuple[Any, ...], Finding] = {}
        self.block: list[str] = []

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        if line.startswith(MARK):
            self._flush()
            word, _, rest = line[len(MARK):].strip().partition(" ")
            index, _, message = rest.partition(" ")
            if word == "begin":
                self.case, self.in_call = int(index), True
            elif word == "end":
                self._flush()
                self.in_call = False
                self.ended.append(int(index))
            elif word == "raised":
                self.raised[int(index)] = message
            return
        if not line.startswith(_PREFIX.rstrip()):
            return  # the target's own output
        body = line[len(_PREFIX):] if line.startswith(_PREFIX) else ""
        if body.startswith(" ") or not body:  # a continuation of the report being read
            if self.block:
                self.block.append(body)
            return
        self._flush()
        if not _NOT_FINDINGS.match(body):
            self.block = [body]

    def _flush(self) -> None:
        if not self.block:
            return
        head, rest = self.block[0], self.block[1:]
        self.block = []
        kernel = where = ""
        for line in [head, *rest]:
            m = _KERNEL.search(line)
            if m:
                kernel, where = m.group(1), (m.group(2) or "")
                break
        what = _SPACE.sub("…", head.removeprefix("Error: ")).strip()
        case = self.case if self.in_call else None
        key = (what, kernel, where, case)
        if key in self.findings:
            self.findings[key].count += 1
        else:
            first = "\n".join([head, *rest[:6]])
            self.findings[key] = Finding(self.tool, what, _short(kernel), _short_path(where), case, first=first)

    def close(self) -> list[Finding]:
        self._flush()
        return list(self.findings.values())


def _short(kernel: str, limit: int = 80) -> str:
    """A kernel's name without its template arguments, cut to ``limit`` characters."""
    depth, out = 0, []
    for ch in kernel:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    name = "".join(out)
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _short_path(where: str) -> str:
    path, _, line = where.rpartition(":")
    return f"{Path(path).name}:{line}" if path else where


@dataclass
class ToolRun:
    """What one tool reported over the cases: findings, cases that ran, and why it stopped short."""

    tool: str
    findings: list[Finding]
    ended: list[int]
    raised: dict[int, str]
    problem: str = ""  # the process did not finish every case: why

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["raised"] = {str(k): v for k, v in self.raised.items()}
        return d


def run_tool(tool: str, *, executable: str, op: str, target: str, device: str, cases: list[str],
             timeout: float, env: dict[str, str], on_line: Callable[[str], None] | None = None) -> ToolRun:
    """Run ``target`` on ``cases`` (Case JSON) under ``tool``; at most ``timeout`` seconds in all."""
    from .sandbox import _worker_path

    scratch = tempfile.mkdtemp(prefix="fuseaudit-sanitize-")
    job = Path(scratch) / "job.json"
    job.write_text(json.dumps({"op": op, "target": target, "device": device, "cases": cases}))
    command = [executable, "--tool", tool, "--show-backtrace", "no", "--print-limit", "0",
               sys.executable, "-I", "-c", _CHILD, json.dumps(_worker_path()), str(job)]
    reader = _Reader(tool)
    problem = ""
    proc = subprocess.Popen(command, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in _lines_until(proc, deadline):
            reader.feed(line)
            if on_line is not None:
                on_line(line)
        if proc.poll() is None:
            problem = f"stopped after {timeout:.0f} s"
        elif proc.returncode and not reader.ended:
            problem = f"the process exited with status {proc.returncode} before any case ended"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    findings = reader.close()
    if not problem and len(reader.ended) < len(cases):
        problem = f"{len(cases) - len(reader.ended)} of {len(cases)} case(s) did not finish (exit status " \
                  f"{proc.returncode})"
    return ToolRun(tool, findings, reader.ended, reader.raised, problem)


def _lines_until(proc: subprocess.Popen, deadline: float):  # type: ignore[type-arg]
    """The process's output lines until it closes them or ``deadline`` passes."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(timeout=left):
            return
        line = proc.stdout.readline()
        if not line:
            return
        yield line


# ---------------------------------------------------------------------------
# The process the tool wraps
# ---------------------------------------------------------------------------

def child_main(job_path: str) -> None:
    """Materialise each case, call the target on it between markers; exceptions are reported, not raised."""
    import torch

    from .case import Case, materialize
    from .catalog import get_op
    from .check import call_target
    from .targets import load_target
    from .worker import raised

    job = json.loads(Path(job_path).read_text())
    device = job["device"]
    if device.startswith("cuda:"):
        torch.cuda.set_device(int(device.split(":")[1]))
    spec = get_op(job["op"])
    impl = load_target(job["target"], op=job["op"])
    for i, text in enumerate(job["cases"]):
        case = Case.from_json(text)
        inputs = materialize(case, device)
        torch.cuda.synchronize()
        print(f"{MARK} begin {i}", flush=True)
        try:
            call_target(spec, impl, inputs, dict(case.params))
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"{MARK} raised {i} {' '.join(raised(exc).split())[:300]}", flush=True)
        print(f"{MARK} end {i}", flush=True)
        del inputs
