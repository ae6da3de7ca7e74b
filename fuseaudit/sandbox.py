"""The judge's side of the process model: one zygote per device kind, a fresh worker per audit.

:func:`sandbox` returns the process's :class:`Sandbox` for a device kind,
starting its zygote (:func:`fuseaudit.worker.zygote_main`) on first use; every
audit of the process (``fuseaudit audit``, each audit of ``fuseaudit run``, the
pytest plugin's) forks its workers from it.  :meth:`Sandbox.worker` forks one
(:class:`WorkerProcess`); :meth:`WorkerProcess.request` sends a request and
waits for its reply on the judge's own clock, per call, whatever the worker
sends in between, and turns a crash, a hang or a malformed message into
:class:`WorkerGone` with a reason a user can act on.

The zygote runs ``python -I`` (no ``PYTHON*`` variables, no user site, no
current directory on ``sys.path``: a ``fuseaudit/`` folder where the user
stands is never imported), in a scratch directory, with an environment of
the variables kernels need and none that look like secrets
(:func:`worker_environment`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .channel import ChannelClosed, ChannelTimeout, ProtocolError, receive, send, validated

ZYGOTE_START_S = 180.0  # importing torch and Triton in a fresh interpreter, on a loaded machine
DUMP_WAIT_S = 0.5  # for faulthandler's stack dump of a hung worker
EXIT_WAIT_S = 5.0  # for the zygote's word that a closed worker is gone

# What a worker's environment keeps of the judge's: what kernels, compilers and drivers read.
_KEEP = re.compile(r"^(PATH|HOME|USER|LOGNAME|LANG|LC_\w+|TZ|TMPDIR|TERM|LD_LIBRARY_PATH|"
                   r"CUDA_\w+|NVIDIA_\w+|TRITON_\w+|TORCH\w*|PYTORCH_\w+|OMP_\w+|MKL_\w+|OPENBLAS_\w+|KMP_\w+|"
                   r"XDG_CACHE_HOME|FUSEAUDIT_\w+|NCCL_\w+)$")
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE|AUTH", re.IGNORECASE)
_BOOT = "import sys; sys.path[:] = __import__('json').loads(sys.argv[2]); " \
        "from fuseaudit.worker import zygote_main; zygote_main(int(sys.argv[1]))"


class WorkerGone(Exception):
    """The worker can serve no more: ``kind`` is crash, timeout, protocol or fatal; ``message`` says how."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def worker_environment(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The judge's environment, less what a target has no need of (secrets among it)."""
    env = {k: v for k, v in os.environ.items() if _KEEP.match(k) and not _SECRET.search(k)}
    env.update(extra or {})
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _worker_path() -> list[str]:
    """The judge's ``sys.path`` without the current directory: the worker imports fuseaudit as the judge did."""
    here = {"", ".", os.getcwd()}
    return [p for p in sys.path if p not in here]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _signal_name(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def where_it_was(log: str, frames: int = 2) -> str:
    """``Fatal Python error: ...; at file:line in fn <- ...`` from the last faulthandler dump in ``log``."""
    fatal = [ln.strip() for ln in log.splitlines() if ln.startswith("Fatal Python error")]
    dump = log.rsplit("most recent call first", 1)
    found: list[str] = []
    if len(dump) == 2:
        for line in dump[1].splitlines()[1:]:
            m = _FRAME.match(line)
            if not m:
                if found:
                    break
                continue
            if "fuseaudit/worker.py" in m["file"] or "fuseaudit/check.py" in m["file"]:
                break  # our frames: the target's end where the worker's begin
            found.append(f"{_short(m['file'])}:{m['line']} in {m['func']}")
            if len(found) == frames:
                break
    return "; ".join(fatal[-1:] + ([f"at {' <- '.join(found)}"] if found else []))


def _short(path: str) -> str:
    p = Path(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(Path(*p.parts[-2:]))


class Sandbox:
    """A zygote for one device kind and the workers it forks."""

    def __init__(self, device_kind: str, *, env: dict[str, str] | None = None):
        self.kind = device_kind
        self.dir = tempfile.mkdtemp(prefix="fuseaudit-sandbox-")
        self.env = worker_environment(device_kind, env)
        self.ctrl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = open(os.path.join(self.dir, "zygote.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, str(child.fileno()), json.dumps(_worker_path())],
            pass_fds=(child.fileno(),), env=self.env, cwd=self.dir, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        child.close()
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()  # one request at a time on the control channel
        self._ready = False
        self._serial = 0

    # -- the control channel ------------------------------------------------------
    def _pump(self, timeout: float) -> dict[str, Any] | None:
        """One message of the zygote's (exits are recorded); None on timeout."""
        ready, _, _ = select.select([self.ctrl], [], [], max(timeout, 0.0))
        if not ready:
            return None
        data = self.ctrl.recv(1 << 16)
        if not data:
            raise ChannelClosed()
        message = json.loads(data)
        if message.get("event") == "exit":
            self.exits[int(message["pid"])] = int(message["status"])
        return message

    def _wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout()
            try:
                message = self._pump(left)
            except ChannelClosed:
                raise RuntimeError(f"the zygote died ({_signal_name(self.proc.poll())}): "
                                   f"{self._log_tail()}") from None
            if message is not None and message.get("event") == event:
                return message

    def _log_tail(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace").strip()
        return text.splitlines()[-1] if text else "it wrote nothing"

    def ready(self, timeout: float = ZYGOTE_START_S) -> None:
        """Wait until the zygote has imported torch and Triton."""
        with self.lock:
            if not self._ready:
                try:
                    self._wait_for("ready", timeout)
                except ChannelTimeout:
                    raise RuntimeError(f"the worker process did not start within {timeout:g} s") from None
                self._ready = True

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def worker(self, *, cwd_path: list[str], device: str) -> WorkerProcess:
        """Fork a fresh worker (its own session, scratch directory and log)."""
        self.ready()
        with self.lock:
            self._serial += 1
            workdir = tempfile.mkdtemp(prefix=f"worker-{self._serial}-", dir=self.dir)
            judge_end, worker_end = socket.socketpair()
            log_path = os.path.join(workdir, "worker.log")
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                socket.send_fds(self.ctrl, [json.dumps({"req": "fork", "env": self.env, "cwd": workdir}).encode()],
                                [worker_end.fileno(), log_fd])
            finally:
                worker_end.close()
                os.close(log_fd)
            pid = int(self._wait_for("forked", 30.0)["pid"])
        return WorkerProcess(self, pid, judge_end, Path(log_path), device=device, path=cwd_path)

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """The worker's exit status once the zygote has reaped it and everything it left; None if not in time."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return None
                try:
                    self._pump(min(left, 0.05))
                except ChannelClosed:
                    return None
            return self.exits.pop(pid)

    def poll_exit(self, pid: int) -> int | None:
        with self.lock:
            try:
                while self._pump(0.0) is not None:
                    pass
            except ChannelClosed:
                pass
            return self.exits.get(pid)

    def close(self) -> None:
        try:
            self.ctrl.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


class WorkerProcess:
    """One worker: requests with the judge's deadlines, and a kill that leaves nothing behind."""

    def __init__(self, sandbox: Sandbox, pid: int, sock: socket.socket, log: Path, *, device: str,
                 path: list[str]):
        self.sandbox = sandbox
        self.pid = pid
        self.sock = sock
        self.log = log
        self.device = device
        self.path = path
        self.serial = 0
        self.gone: WorkerGone | None = None

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def request(self, message: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Send ``message``; its validated reply, or :class:`WorkerGone` (and the worker is killed)."""
        if self.gone is not None:
            raise self.gone
        self.serial += 1
        message = {**message, "id": self.serial}
        try:
            send(self.sock, message)
        except OSError:
            self._lost("crash", "closed its channel")
        deadline = time.monotonic() + timeout
        while True:
            # the zygote's word arrives apart from the worker's channel: look at both
            ready, _, _ = select.select([self.sock], [], [], max(min(deadline - time.monotonic(), 0.05), 0))
            if ready:
                try:
                    reply = receive(self.sock, deadline=deadline)
                except ChannelClosed:
                    self._lost("crash", "closed its channel")
                except ChannelTimeout:
                    self._hung(timeout)
                except ProtocolError as exc:
                    self._lost("protocol", f"sent {exc}")
                try:
                    return validated(reply, request=message)
                except ProtocolError as exc:
                    self._lost("protocol", f"sent {exc}")
            if self.sandbox.poll_exit(self.pid) is not None or not _alive(self.pid):
                self._lost("crash", "")
            if time.monotonic() >= deadline:
                self._hung(timeout)

    def _hung(self, timeout: float) -> None:
        if _alive(self.pid):
            try:
                os.kill(self.pid, signal.SIGUSR1)  # faulthandler's dump: where it was stuck
            except ProcessLookupError:
                pass
            time.sleep(DUMP_WAIT_S)
        self._lost("timeout", f"made no progress for {timeout:g} s (killed)")

    def _lost(self, kind: str, how: str) -> None:
        status = self.kill()
        if kind == "crash":
            how = f"crashed the process ({_signal_name(status)})" + (f": it {how}" if how else "")
        elif kind == "protocol":
            how = f"broke the worker's protocol: it {how} (killed)"
        where = where_it_was(self.log_text())
        self.gone = WorkerGone(kind, how + (f"; {where}" if where else ""))
        raise self.gone

    def kill(self) -> int | None:
        """Kill the worker and, through the zygote, everything it started; its exit status."""
        status = self.sandbox.poll_exit(self.pid)
        if status is None:
            for kill in (os.killpg, os.kill):
                try:
                    kill(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            status = self.sandbox.wait_exit(self.pid, EXIT_WAIT_S)
        else:
            self.sandbox.exits.pop(self.pid, None)
        if not self.sandbox.alive:  # the target killed the zygote: its orphans came to us, if we adopt them
            sweep_orphans()
        try:
            self.sock.close()
        except OSError:
            pass
        if self.gone is None:
            self.gone = WorkerGone("closed", "the worker was closed")
        return status

    def close(self) -> None:
        if self.gone is None:
            self.kill()


_ADOPTING = [False]


def adopt_orphans() -> bool:
    """Make this process the reaper of orphaned descendants (Linux), so that :func:`sweep_orphans` finds them.

    The command line does this; a library caller's process is left as it is.
    """
    from .worker import PR_SET_CHILD_SUBREAPER, prctl

    _ADOPTING[0] = prctl(PR_SET_CHILD_SUBREAPER, 1)
    return _ADOPTING[0]


def sweep_orphans() -> None:
    """Kill our children in sessions of their own that are no zygote: what a dead zygote's workers left."""
    if not _ADOPTING[0]:
        return
    from .worker import kill_strays

    ours = os.getsid(0)
    zygotes = {box.proc.pid for box in _SANDBOXES.values() if box.alive}

    def stray(pid: int) -> bool:
        try:
            return pid not in zygotes and os.getsid(pid) != ours
        except OSError:
            return True  # a zombie: reap it

    kill_strays(stray)


_SANDBOXES: dict[tuple[str, tuple[tuple[str, str], ...]], Sandbox] = {}
_LOCK = threading.Lock()


def sandbox(device: str, *, env: dict[str, str] | None = None) -> Sandbox:
    """The process's sandbox for ``device``'s kind (cpu or cuda) and ``env``, started on first use."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    key = (kind, tuple(sorted((env or {}).items())))
    with _LOCK:
        box = _SANDBOXES.get(key)
        if box is None or not box.alive:
            box = _SANDBOXES[key] = Sandbox(kind, env=env)
        return box


def start(device: str, *, env: dict[str, str] | None = None) -> None:
    """Start the zygote of ``device`` and ``env`` now (it imports while the judge does)."""
    sandbox(device, env=env)


@atexit.register
def _close_all() -> None:
    for box in _SANDBOXES.values():
        try:
            box.close()
        except Exception:
            pass
    _SANDBOXES.clear()
