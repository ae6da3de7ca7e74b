"""Targets that try to change their own verdict, one way each (properties/test_hostile.py).

Importing this module already attacks: it replaces torch's functionals and
fuseaudit's judging functions in the process that imports it.  In an audit
that is the worker, which judges nothing, so every attack below must end in
a failure (exit 1) or an inconclusive audit (exit 3).
"""

import json
import os
import socket
import threading
import time

import torch
import torch.nn.functional as F

import fuseaudit.check
import fuseaudit.tolerance

# -- at import: make eager agree with whatever the target returns ---------------------------------
_identity = lambda x, *a, **k: x.clone()
F.rms_norm = _identity
F.silu = _identity
torch.softmax = _identity


class _Always:
    passed = True
    reason = ""


fuseaudit.tolerance.compare = lambda *a, **k: _Always()
fuseaudit.check.compare = fuseaudit.tolerance.compare
fuseaudit.check.judge_case = lambda *a, **k: (_ for _ in ()).throw(SystemExit(0))


def rms_norm_clone(x, weight, eps=1e-6):
    """Returns its input: passes only where the yardstick was patched to do the same."""
    return x.clone()


def softmax_clone(x, scale=1.0):
    return torch.softmax(x, dim=-1)  # the patched softmax: a clone


# -- the channel ------------------------------------------------------------------------------------
def _worker_socket() -> socket.socket | None:
    for fd in range(3, 256):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if s.type == socket.SOCK_STREAM and s.family == socket.AF_UNIX:
            return s
        s.close()
    return None


def _frame(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return len(data).to_bytes(4, "big") + data


_calls = [1]  # requests this worker has had: the load, then the calls


def forged_reply(x, weight, eps=1e-6):
    """Writes the reply the judge waits for (success, outputs copied) before the worker does, then garbage."""
    _calls[0] += 1
    sock = _worker_socket()
    if sock is not None:
        meta = {"type": "torch.Tensor", "tensor": True, "exact": True, "layout": "torch.strided",
                "device": str(x.device), "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
                "alias": None, "copied": True, "note": ""}
        sock.sendall(_frame({"id": _calls[0], "status": "ok", "outputs": [meta], "seconds": 0.0}))
    return torch.full_like(x, 7.0)


def garbage_on_channel(x, weight, eps=1e-6):
    """Writes bytes that are no message, then returns the right answer."""
    sock = _worker_socket()
    if sock is not None:
        sock.sendall(b"\x00\x00\x00\x05PASS!")
    return F.layer_norm(x, x.shape[-1:])  # never reached by a verdict


def exits_cleanly(x, weight, eps=1e-6):
    """Prints a passing result line and leaves with status 0 in the middle of a call."""
    print("result: PASS in 0.1 s", flush=True)
    os._exit(0)


# -- time -------------------------------------------------------------------------------------------
def heartbeat_hang(x, weight, eps=1e-6):
    """Hangs, while a thread prints and pokes the channel as if it were making progress."""
    def beat():
        while True:
            print("search: 10/10 examples, 0 failing", flush=True)
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    while True:
        time.sleep(0.05)


# -- outputs ----------------------------------------------------------------------------------------
def _right(x, weight, eps):
    return torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype)  # any tensor of the right kind


def returns_list(x, weight, eps=1e-6):
    return x.float().tolist()


class Agreeable(torch.Tensor):
    """A tensor subclass whose comparisons always agree."""

    def __eq__(self, other):
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def returns_subclass(x, weight, eps=1e-6):
    return torch.zeros_like(x).as_subclass(Agreeable)


def returns_meta(x, weight, eps=1e-6):
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def returns_sparse(x, weight, eps=1e-6):
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device).to_sparse()


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


def raises_unprintable(x, weight, eps=1e-6):
    raise _Unprintable()


# -- declarations -----------------------------------------------------------------------------------
def unsupported_everything(x, weight, eps=1e-6):
    return x.clone()


unsupported_everything.fuseaudit_supports = lambda x, weight, eps=1e-6: "nothing is supported"


def rms_norm_eager(x, weight, eps=1e-6):
    """Right in every dtype; 9 aten ops in every dtype (float64 throughout)."""
    xf = x.to(torch.float64)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float64)).to(x.dtype)


def predicate_rewrites(x, weight, eps=1e-6):
    """Correct on the inputs it sees, after its predicate made them all ones."""
    return rms_norm_eager(x, weight, eps)


def _rewrite(x, weight, eps=1e-6):
    with torch.no_grad():
        x.fill_(1.0)
    return None


predicate_rewrites.fuseaudit_supports = _rewrite


# -- state between calls ----------------------------------------------------------------------------
_by_pointer: dict = {}


def pointer_cache(x, weight, eps=1e-6):
    """Keys its results by pointer and shape: stale when a buffer is reused with new values."""
    key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, weight.data_ptr())
    if key not in _by_pointer:
        _by_pointer[key] = rms_norm_eager(x, weight, eps)
    return _by_pointer[key].clone()


_workspace: dict = {}


def workspace_view(x, weight, eps=1e-6):
    """Writes every result into one reused buffer and returns a view of it."""
    ws = _workspace.get(x.dtype)
    if ws is None or ws.numel() < x.numel():
        ws = _workspace[x.dtype] = torch.empty(max(x.numel(), 1 << 16), dtype=x.dtype, device=x.device)
    out = ws[: x.numel()].view(x.shape)
    out.copy_(rms_norm_eager(x, weight, eps))
    return out


# -- processes and the environment ------------------------------------------------------------------
def _judge_pid() -> int:
    with open(f"/proc/{os.getppid()}/stat") as f:  # the worker's parent (the zygote); its parent judges
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _json_path(pid: int) -> str | None:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[argv.index("--json") + 1] if "--json" in argv else None


def _leave_grandchild(x, weight, eps=1e-6, judge=None):
    if not os.environ.get("_HOSTILE_FORKED"):
        os.environ["_HOSTILE_FORKED"] = "1"
        judge = judge or _judge_pid()
        path = _json_path(judge)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a grandchild, in its own session, whose parent is gone
                # beside the --json file: each test's own folder, so that tests run side by side stay apart
                where = os.path.dirname(path) if path else "/tmp"
                with open(os.path.join(where, f"fuseaudit-hostile-{judge}.pid"), "w") as f:
                    f.write(str(os.getpid()))
                end = time.time() + 60
                while time.time() < end:
                    if path and os.path.exists(path):
                        try:
                            with open(path, "w") as f:
                                json.dump({"exit_code": 0, "passed": True, "forged": True}, f)
                        except OSError:
                            pass
                    time.sleep(0.05)
            os._exit(0)
    return rms_norm_eager(x, weight, eps)


def grandchild_rewrites_json(x, weight, eps=1e-6):
    """Correct, but leaves a process in a session of its own that rewrites the audit's --json file."""
    return _leave_grandchild(x, weight, eps)


def kills_the_zygote(x, weight, eps=1e-6):
    """Correct, but first kills the process the worker was forked from, then leaves a grandchild."""
    if not os.environ.get("_HOSTILE_FORKED"):
        judge = _judge_pid()
        os.kill(os.getppid(), 9)
        time.sleep(0.2)
        return _leave_grandchild(x, weight, eps, judge)
    return rms_norm_eager(x, weight, eps)


def sees_the_callers_world(x, weight, eps=1e-6):
    """Wrong wherever it can see a secret of the caller's or runs in the caller's folder."""
    leaked = any("SECRET" in k or "TOKEN" in k for k in os.environ) or os.path.exists("fuseaudit-caller-marker")
    y = rms_norm_eager(x, weight, eps)
    return y + 1 if leaked else y


# -- the launch counter and replays -----------------------------------------------------------------
def _being_counted() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    profiling = torch.autograd.profiler._is_profiler_enabled
    return _get_current_dispatch_mode() is not None or bool(profiling)


def raises_when_counted(x, weight, eps=1e-6):
    """Correct, except under the launch counter (the interpreter's dispatch mode, the profiler)."""
    if _being_counted():
        raise RuntimeError("not while you are looking")
    return rms_norm_eager(x, weight, eps)


_served = [0]


def wrong_once_warm(x, weight, eps=1e-6):
    """Correct for its first calls in a process, wrong from the fourth on: a failure only the search sees."""
    _served[0] += 1
    y = rms_norm_eager(x, weight, eps)
    return y * 2 if _served[0] > 3 else y
