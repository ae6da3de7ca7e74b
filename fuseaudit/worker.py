"""The processes that hold the target: a zygote, and the workers it forks.

The **zygote** (:func:`zygote_main`) is started once per judge and device
kind with isolated interpreter flags (``python -I``), a scratch working
directory and an environment without the caller's secrets; it imports torch
and Triton (no CUDA context: it never touches a device) and forks a
**worker** for each audit, so a fresh process for the target costs a fork,
not an interpreter start.  It is the subreaper of its workers: whatever a
worker starts, also in a session of its own, is its child once the worker is
gone, and is killed before the worker's ``exit`` line reaches the judge.

A **worker** (:class:`Worker`) only loads the target, calls it on tensors
built over the judge's buffers (:class:`fuseaudit.channel.Mapper`), and
describes what came back, copying each output into the slot the judge gave
it.  Nothing it says is a verdict; the judge validates every message
(:func:`fuseaudit.channel.validated`) and judges the memory it reads itself.

Requests (JSON objects with ``req`` and ``id``): ``load`` (target, op,
device, path), ``call`` (inputs, slots, params, keep, supports), ``count``
(inputs, params: kernels per call), ``resend`` (copies the outputs a kept
call returned into new slots), ``forget``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
_CUDA_FATAL = ("illegal memory access", "illegal address", "device-side assert", "unspecified launch failure",
               "an illegal instruction", "misaligned address", "CUDA error")
KEPT_CALLS = 4  # outputs of this many ``keep`` calls are held for ``resend``


def prctl(option: int, value: int) -> bool:
    """Linux ``prctl``; False where it is not available."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_cuda_fatal(text: str) -> bool:
    """Whether an error message means the CUDA context is lost."""
    return any(marker in text for marker in _CUDA_FATAL)


def safe_str(value: Any, limit: int = 2000) -> str:
    """``str(value)``, also for an object whose ``__str__`` raises or is huge."""
    try:
        text = str(value)
    except BaseException as exc:
        text = f"<its str() raised {type(exc).__name__}>"
    if not isinstance(text, str):
        text = f"<its str() returned a {type(text).__name__}>"
    return text[:limit]


def raised(exc: BaseException) -> str:
    """``raised ValueError: ... (at file:line)`` for an exception of the target's."""
    try:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    except Exception:
        where = ""
    return f"raised {type(exc).__name__}: {safe_str(exc)}{where}"


def signature_problem(spec: Any, impl: Any, target: str) -> str | None:
    """Why ``impl`` cannot be called as ``spec.signature`` says (inputs positional, params by keyword)."""
    import inspect

    try:
        sig = inspect.signature(impl)
    except (TypeError, ValueError):  # a builtin or extension function: nothing to inspect
        return None
    try:
        sig.bind(*spec.input_names, **spec.defaults())
    except TypeError as exc:
        return (f"{target} has signature {sig}, which does not fit {spec.signature} "
                f"(inputs by position, parameters by keyword): {exc}")
    return None


# ---------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------

class Worker:
    """Serves the judge's requests on ``sock`` until it closes."""

    def __init__(self, sock: socket.socket):
        from .channel import Mapper

        self.sock = sock
        self.mapper = Mapper()
        self.impl: Any = None
        self.spec: Any = None
        self.device = "cpu"
        self.torch_device: Any = None
        self.kept: dict[int, list[Any]] = {}

    def serve(self) -> None:
        from .channel import ChannelClosed, receive, send

        while True:
            try:
                request = receive(self.sock)
            except ChannelClosed:
                return
            reply = getattr(self, f"_{request['req']}")(request)
            reply["id"] = request["id"]
            if reply.get("fatal"):  # the CUDA context is lost: nothing more can run here, not even a release
                send(self.sock, reply)  # of the judge's buffers (it synchronises, and would abort the process)
                os._exit(3)
            if request["req"] != "load" and not request.get("hold"):
                self.mapper.forget()
            send(self.sock, reply)

    # -- requests ---------------------------------------------------------------
    def _load(self, request: dict[str, Any]) -> dict[str, Any]:
        import torch

        from .catalog import get_op
        from .targets import load_target

        self.device = request["device"]
        if self.device.startswith("cuda:"):
            torch.cuda.set_device(int(self.device.split(":")[1]))  # Triton launches on the current device
        self.torch_device = torch.device(self.device)
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        sys.path[:0] = [p for p in request.get("path", []) if p not in sys.path]
        try:
            self.spec = get_op(request["op"])
            self.impl = load_target(request["target"], op=request["op"])
        except BaseException as exc:
            name = type(exc).__name__
            message = safe_str(exc) if name == "TargetError" else f"could not load {request['target']}: {name}: " \
                                                                    f"{safe_str(exc)}"
            return {"status": "raised", "message": message}
        return {"status": "ok", "supports": getattr(self.impl, "fuseaudit_supports", None) is not None,
                "problem": signature_problem(self.spec, self.impl, request["target"])}

    def _args(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        inputs = {s["name"]: self.mapper.tensor(s) for s in request["inputs"]}
        return inputs, [inputs[n] for n in self.spec.input_names]

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        from .check import poisoned_allocations

        inputs, args = self._args(request)
        params = request["params"]
        if request.get("supports"):
            probe = getattr(self.impl, "fuseaudit_supports", None)
            if probe is not None:
                try:
                    reason = probe(*args, **params)
                except BaseException as exc:
                    return {"status": "raised", "message": f"its fuseaudit_supports declaration {raised(exc)}"}
                if reason:
                    return {"status": "unsupported", "message": safe_str(reason)}
        start = time.perf_counter()
        try:
            with poisoned_allocations():
                got = self.impl(*args, **params)
            self._sync()
        except BaseException as exc:
            message = raised(exc)
            return {"status": "raised", "message": message, "fatal": is_cuda_fatal(message)}
        seconds = time.perf_counter() - start
        outputs = list(got) if isinstance(got, (tuple, list)) else [got]
        if request.get("keep"):
            self.kept[request["id"]] = outputs
            for old in sorted(self.kept)[:-KEPT_CALLS]:
                del self.kept[old]
        return self._describe(outputs, request, inputs, seconds)

    def _resend(self, request: dict[str, Any]) -> dict[str, Any]:
        outputs = self.kept.get(request["call"])
        if outputs is None:
            return {"status": "raised", "message": f"no kept outputs of call {request['call']}"}
        return self._describe(outputs, request, {}, 0.0)

    def _forget(self, request: dict[str, Any]) -> dict[str, Any]:
        self.kept.clear()
        return {"status": "ok", "outputs": []}

    def _count(self, request: dict[str, Any]) -> dict[str, Any]:
        from .launches import LaunchCountError, count_launches

        _, args = self._args(request)
        params = request["params"]
        try:
            count = count_launches(lambda: self.impl(*args, **params), device=self.device)
        except LaunchCountError as exc:
            return {"status": "untrusted", "message": safe_str(exc)}
        except BaseException as exc:
            message = raised(exc)
            return {"status": "raised", "message": message, "fatal": is_cuda_fatal(message)}
        return {"status": "ok", "count": count.to_dict()}

    # -- outputs ----------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def _describe(self, outputs: list[Any], request: dict[str, Any], inputs: dict[str, Any],
                  seconds: float) -> dict[str, Any]:
        slots = [self.mapper.tensor(s) for s in request["slots"]]
        metas = [describe_output(out, slots[i] if i < len(slots) else None, inputs, device=self.torch_device)
                 for i, out in enumerate(outputs[:64])]
        try:
            self._sync()
        except BaseException as exc:
            message = raised(exc)
            return {"status": "raised", "message": message, "fatal": is_cuda_fatal(message)}
        return {"status": "ok", "outputs": metas, "seconds": seconds}


def _overlaps(a: Any, b: Any) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    lo_a, lo_b = sa.data_ptr(), sb.data_ptr()
    return lo_a < lo_b + sb.nbytes() and lo_b < lo_a + sa.nbytes()


def describe_output(out: Any, slot: Any, inputs: dict[str, Any], *, device: Any = None) -> dict[str, Any]:
    """What one output is, and its values copied into ``slot`` where it is a plain dense tensor that fits.

    ``device``: where the output must be (default: the slot's device).
    """
    import torch

    kind = type(out)
    meta: dict[str, Any] = {"type": f"{kind.__module__}.{kind.__qualname__}", "tensor": isinstance(out, torch.Tensor),
                            "exact": kind is torch.Tensor, "layout": "", "device": "", "dtype": "", "shape": [],
                            "alias": None, "copied": False, "note": ""}
    if kind is not torch.Tensor:
        return meta  # a subclass's metadata is its own code: nothing of it is read
    meta.update(layout=str(out.layout), device=str(out.device), dtype=str(out.dtype).removeprefix("torch."),
                shape=list(out.shape))
    if out.layout != torch.strided or out.device.type == "meta":
        return meta
    meta["alias"] = next((name for name, t in inputs.items() if out.numel() and _overlaps(out, t)), None)
    if slot is not None and out.device == (device or slot.device) and out.dtype == slot.dtype \
            and out.shape == slot.shape:
        try:
            slot.copy_(out.detach())
            meta["copied"] = True
        except BaseException as exc:
            meta["note"] = f"copying it raised {type(exc).__name__}: {safe_str(exc, 300)}"
    return meta


# ---------------------------------------------------------------------------
# The zygote
# ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``)."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
        return found
    except OSError:
        pass
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def kill_strays(is_stray: Callable[[int], bool]) -> None:
    """Kill and reap this process's children for which ``is_stray`` holds, until none is left.

    Their children come to us when they die (we are a subreaper), so each round finds the next generation.
    """
    for _ in range(1000):
        strays = [pid for pid in _children(os.getpid()) if is_stray(pid)]
        if not strays:
            return
        for pid in strays:
            _kill_group(pid)
        for pid in strays:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Zygote:
    """Forks workers on request and reaps them, and everything they leave, before saying they are gone."""

    def __init__(self, ctrl: socket.socket):
        self.ctrl = ctrl
        self.workers: set[int] = set()

    def run(self) -> None:
        while True:
            self._reap()
            ready, _, _ = select.select([self.ctrl], [], [], 0.05)
            if not ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(self.ctrl, 1 << 16, 4)
            except OSError:
                data, fds = b"", []
            if not data:  # the judge is gone: so is everything forked for it
                for pid in list(self.workers):
                    _kill_group(pid)
                self._reap(block=True)
                os._exit(0)  # nothing to tidy: an orderly interpreter exit with torch loaded costs half a second
            request = json.loads(data)
            if request.get("req") == "fork":
                self._fork(request, fds)
            elif request.get("req") == "kill":
                _kill_group(int(request["pid"]))
            for fd in fds:
                os.close(fd)

    def _fork(self, request: dict[str, Any], fds: list[int]) -> None:
        sock_fd, log_fd = fds[0], fds[1]
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                os.setsid()
                self.ctrl.close()
                prctl(PR_SET_DUMPABLE, 1)
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                import faulthandler

                faulthandler.enable()  # a segfault says where it happened, in the worker's log
                faulthandler.register(signal.SIGUSR1, all_threads=True)  # the judge asks before killing a hang
                Worker(socket.socket(fileno=sock_fd)).serve()
            except BaseException:
                traceback.print_exc()
                code = 4
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.workers.add(pid)
        self.ctrl.send(json.dumps({"event": "forked", "pid": pid}).encode())

    def _reap(self, block: bool = False) -> None:
        """Reap exited children; once a worker is gone, kill what it left (orphans are ours) and say so."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid not in self.workers:
                continue  # an orphan we killed
            self.workers.discard(pid)
            self._sweep()
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                self.ctrl.send(json.dumps({"event": "exit", "pid": pid, "status": code}).encode())
            except OSError:
                return

    def _sweep(self) -> None:
        """Kill and reap every child that is not a live worker, until none is left."""
        kill_strays(lambda pid: pid not in self.workers)


def zygote_main(ctrl_fd: int) -> None:
    """The zygote's entry: preload, say ready, fork workers until the judge closes the channel."""
    prctl(PR_SET_DUMPABLE, 0)  # no worker may attach to it or read its memory
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctrl = socket.socket(fileno=ctrl_fd)
    import torch  # what every worker needs, imported once

    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    import torch.profiler

    if os.environ.get("TRITON_INTERPRET") != "1":
        # the CUDA profiler's first use imports torch._dynamo (seconds): once here rather than in every worker
        import torch._dynamo  # noqa: F401
    from . import catalog, check, launches, targets  # noqa: F401

    ctrl.send(json.dumps({"event": "ready", "pid": os.getpid()}).encode())
    Zygote(ctrl).run()
