"""The judge's channel to a worker: length-prefixed JSON messages and shared tensor buffers.

Nothing on it is code: the judge never unpickles what a worker sends, it
parses JSON of a bounded size and validates every field (:func:`validated`).
Tensors cross through memory both processes map, which the judge allocates
and reads itself:

* **CPU**: one file under ``/dev/shm`` (else the temp dir) a generation,
  mapped ``MAP_SHARED`` by both; a buffer is ``(generation, offset, nbytes)``.
* **CUDA**: a judge-owned device tensor per buffer, handed over by CUDA IPC
  (``UntypedStorage._share_cuda_``); the worker opens it once and keeps it.

So the judge reads an input's bytes after a call from its own memory (what
the target left there, whatever it reports) and a result from the slot it
gave the worker, which it filled with NaN first.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import select
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_MESSAGE = 1 << 20  # bytes of JSON a worker may send in one message
ALIGN = 512  # bytes; as torch's allocators align a storage


class ChannelClosed(Exception):
    """The other end closed the channel (the process died or closed it)."""


class ChannelTimeout(Exception):
    """No complete message within the deadline."""


class ProtocolError(Exception):
    """A message that is not what the protocol allows."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, allow_nan=True).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def _read_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout()
            ready, _, _ = select.select([sock], [], [], left)
            if not ready:
                raise ChannelTimeout()
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            raise ChannelClosed()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, *, deadline: float | None = None, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    """One message; :class:`ProtocolError` for anything but a JSON object within ``limit`` bytes."""
    size = int.from_bytes(_read_exact(sock, 4, deadline), "big")
    if size > limit:
        raise ProtocolError(f"a message of {size} bytes (at most {limit} are taken)")
    body = _read_exact(sock, size, deadline)
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"a message that is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message that is a JSON {type(message).__name__}, not an object")
    return message


# ---------------------------------------------------------------------------
# Validation of what a worker sends
# ---------------------------------------------------------------------------

def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError(what)


def _short(value: Any, what: str, limit: int = 4000) -> str:
    _check(isinstance(value, str), f"{what} is not a string")
    return value[:limit]


def _int(value: Any, what: str) -> int:
    _check(type(value) is int and value >= 0, f"{what} is not a non-negative integer")
    return value


OUTPUT_KEYS = {"type": str, "tensor": bool, "exact": bool, "layout": str, "device": str, "dtype": str,
               "shape": list, "alias": (str, type(None)), "copied": bool, "note": str}
STATUSES = ("ok", "unsupported", "raised", "untrusted")


def validated_output(meta: Any, i: int) -> dict[str, Any]:
    """One output's description, exactly the keys and types the protocol has."""
    _check(isinstance(meta, dict) and set(meta) == set(OUTPUT_KEYS), f"output {i}: not an output description")
    for key, kind in OUTPUT_KEYS.items():
        _check(isinstance(meta[key], kind) and not (kind is int and isinstance(meta[key], bool)),
               f"output {i}: field {key} has the wrong type")
    _check(len(meta["shape"]) <= 16 and all(type(s) is int and s >= 0 for s in meta["shape"]),
           f"output {i}: shape is not a list of sizes")
    return {k: (v[:200] if isinstance(v, str) else v) for k, v in meta.items()}


def validated(reply: dict[str, Any], *, request: dict[str, Any]) -> dict[str, Any]:
    """``reply`` if it answers ``request`` as the protocol allows, else :class:`ProtocolError`."""
    _check(reply.get("id") == request["id"], f"a reply to request {reply.get('id')!r}, not {request['id']}")
    status = reply.get("status")
    _check(status in STATUSES, f"a reply of status {status!r}")
    kind = request["req"]
    out: dict[str, Any] = {"id": request["id"], "status": status}
    if status in ("unsupported", "raised", "untrusted"):
        out["message"] = _short(reply.get("message"), "message")
        out["fatal"] = reply.get("fatal") is True
        return out
    if kind == "load":
        out["supports"] = reply.get("supports") is True
        problem = reply.get("problem")
        out["problem"] = None if problem is None else _short(problem, "problem")
    elif kind in ("call", "resend"):
        outputs = reply.get("outputs")
        _check(isinstance(outputs, list) and len(outputs) <= 64, "outputs is not a list")
        out["outputs"] = [validated_output(m, i) for i, m in enumerate(outputs)]
        seconds = reply.get("seconds", 0.0)
        _check(isinstance(seconds, (int, float)) and math.isfinite(seconds), "seconds is not a number")
        out["seconds"] = float(seconds)
    elif kind == "count":
        count = reply.get("count")
        _check(isinstance(count, dict), "count is not an object")
        kernels = count.get("kernels")
        triton = count.get("triton", [])
        _check(isinstance(kernels, list) and len(kernels) <= 100_000, "kernels is not a list")
        _check(isinstance(triton, list) and len(triton) <= 100_000, "triton is not a list")
        out["count"] = {"kernels": [_short(k, "a kernel name", 2000) for k in kernels],
                        "memcpy": _int(count.get("memcpy", 0), "memcpy"),
                        "memset": _int(count.get("memset", 0), "memset"),
                        "method": _short(count.get("method", ""), "method", 40),
                        "triton": [_short(k, "a kernel name", 2000) for k in triton]}
    return out


# ---------------------------------------------------------------------------
# Shared buffers
# ---------------------------------------------------------------------------

def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Buffer:
    """A judge-owned byte buffer the worker can map; ``raw`` is the judge's uint8 view of it."""

    raw: torch.Tensor
    describe: dict[str, Any]  # what the worker needs to map it

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
        import torch

        return torch.empty(0, dtype=dtype, device=self.raw.device).set_(self.raw.untyped_storage(), offset,
                                                                          shape, stride)


class HostArena:
    """Buffers in one shared file a generation, handed out from a bump pointer and reset per request."""

    def __init__(self, directory: str | None = None, initial: int = 64 << 20):
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="fuseaudit-arena-", dir=directory or base)
        self.generation = -1
        self.capacity = 0
        self.used = 0
        self.initial = initial
        self._maps: list[mmap.mmap] = []
        self._grow(initial)

    def _grow(self, need: int) -> None:
        size = max(self.initial, 1 << max(need - 1, 1).bit_length())
        self.generation += 1
        path = os.path.join(self.dir, f"arena-{self.generation}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._maps.append(mmap.mmap(fd, size))
        finally:
            os.close(fd)
        self.path, self.capacity, self.used = path, size, 0

    def reset(self) -> None:
        self.used = 0

    def buffer(self, nbytes: int) -> Buffer:
        import torch

        nbytes = max(int(nbytes), 1)
        if self.used + nbytes > self.capacity:
            self._grow(2 * _up(nbytes))  # a new generation: the buffers already handed out stay mapped
        offset = self.used
        self.used = _up(offset + nbytes)
        raw = torch.frombuffer(self._maps[-1], dtype=torch.uint8, count=nbytes, offset=offset)
        return Buffer(raw, {"file": self.path, "offset": offset, "nbytes": nbytes})

    def close(self) -> None:
        import shutil

        self._maps.clear()  # views keep their map alive until they are gone
        shutil.rmtree(self.dir, ignore_errors=True)


class DeviceArena:
    """Judge-owned CUDA buffers, each handed over by CUDA IPC; kept until :meth:`reset`."""

    def __init__(self, device: str):
        import torch

        self.device = torch.device(device)
        self._live: list[torch.Tensor] = []

    def reset(self) -> None:
        self._live.clear()

    def buffer(self, nbytes: int) -> Buffer:
        import torch

        raw = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=self.device)
        self._live.append(raw)
        (dev, handle, size, offset, ref_handle, ref_offset, event, event_sync) = raw.untyped_storage()._share_cuda_()
        return Buffer(raw, {"ipc": [int(dev), handle.hex(), int(size), int(offset), ref_handle.hex(),
                                    int(ref_offset), event.hex() if event else "", bool(event_sync)],
                            "nbytes": int(raw.numel())})

    def close(self) -> None:
        import torch

        self._live.clear()
        torch.cuda.ipc_collect()  # free the blocks the worker has let go of


def arena_for(device: str) -> HostArena | DeviceArena:
    return DeviceArena(device) if device.startswith("cuda") else HostArena()


# ---------------------------------------------------------------------------
# The worker's side of the buffers
# ---------------------------------------------------------------------------

class Mapper:
    """Opens the judge's buffers in the worker: each file once, each IPC handle once until :meth:`forget`."""

    def __init__(self) -> None:
        self._files: dict[str, mmap.mmap] = {}
        self._ipc: dict[tuple[str, int], Any] = {}

    def raw(self, d: dict[str, Any]) -> torch.Tensor:
        import torch

        if "file" in d:
            mm = self._files.get(d["file"])
            if mm is None:
                fd = os.open(d["file"], os.O_RDWR)
                try:
                    mm = self._files[d["file"]] = mmap.mmap(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
            return torch.frombuffer(mm, dtype=torch.uint8, count=d["nbytes"], offset=d["offset"])
        dev, handle, size, offset, ref_handle, ref_offset, event, event_sync = d["ipc"]
        key = (handle, offset)
        storage = self._ipc.get(key)
        if storage is None:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                dev, bytes.fromhex(handle), size, offset, bytes.fromhex(ref_handle), ref_offset,
                bytes.fromhex(event) if event else None, event_sync)
            self._ipc[key] = storage
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage, 0, (d["nbytes"],), (1,))

    def forget(self) -> None:
        """Drop the opened IPC buffers, so that the judge can free them."""
        self._ipc.clear()

    def tensor(self, spec: dict[str, Any]) -> torch.Tensor:
        import torch

        raw = self.raw(spec["buf"])
        dtype = getattr(torch, spec["dtype"])
        return torch.empty(0, dtype=dtype, device=raw.device).set_(
            raw.untyped_storage(), spec["offset"], tuple(spec["shape"]), tuple(spec["stride"]))
