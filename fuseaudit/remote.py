"""The target in a worker process, called as :class:`fuseaudit.check.InProcess` calls it in this one.

:class:`Remote` copies the judge's inputs (every byte of their storage, so
padding and offsets are what the judge made) into shared buffers, gives the
worker NaN-filled slots for the outputs, and after the reply reads both
itself: the outputs from the slots, and the inputs' bytes, which must equal
what the judge wrote.  A worker that crashes, hangs or breaks the protocol
is killed with everything it started; the call is a ``runs`` failure, and the
next call forks a fresh worker.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .catalog import OpSpec
from .channel import Buffer, HostArena, arena_for
from .check import Called, output_slots, storage_view
from .sandbox import Sandbox, WorkerGone, WorkerProcess, sandbox


class TargetLoadError(Exception):
    """The worker could not load the target, or its signature does not fit the op (exit 2)."""


class Remote:
    """One audit's target, held by a worker forked from ``box``."""

    def __init__(self, box: Sandbox, *, target: str, op: str, device: str, timeout: float,
                 load_timeout: float, path: list[str], env: dict[str, str] | None = None):
        self.box = box
        self.env = env
        self.target = target
        self.op = op
        self.device = device
        self.timeout = timeout
        self.load_timeout = load_timeout
        self.path = path
        self.arena = arena_for(device)
        # outputs come back through host memory on every device: a slot the worker wrote into over
        # CUDA IPC is not released by it in time (torch warns at exit), and an output is read once
        self.slot_arena = self.arena if isinstance(self.arena, HostArena) else HostArena(initial=16 << 20)
        self.worker: WorkerProcess | None = None
        self.supports = False
        self.restarts = 0
        self.lost: list[str] = []  # how each lost worker went
        self._last: list[tuple[str, Buffer, dict[str, Any]]] | None = None

    # -- the worker -----------------------------------------------------------------
    def start(self) -> None:
        """Fork a worker and load the target; :class:`TargetLoadError` where that cannot be done."""
        if not self.box.alive:  # a target killed it: a new zygote for the next worker
            self.box = sandbox(self.device, env=self.env)
        worker = self.box.worker(cwd_path=self.path, device=self.device)
        try:
            reply = worker.request({"req": "load", "target": self.target, "op": self.op, "device": self.device,
                                    "path": self.path}, timeout=self.load_timeout)
        except WorkerGone as gone:
            raise TargetLoadError(f"the target {gone.message} while loading the target") from None
        if reply["status"] != "ok":
            worker.close()
            raise TargetLoadError(reply["message"])
        if reply["problem"]:
            worker.close()
            raise TargetLoadError(reply["problem"])
        self.supports = reply["supports"]
        self.worker = worker

    def _ready(self) -> WorkerProcess:
        if self.worker is None or self.worker.gone is not None:
            self.restarts += self.worker is not None
            self.worker = None
            try:
                self.start()
            except TargetLoadError as exc:  # it loaded before: now it is the target's failure
                raise WorkerGone("crash", f"could not be loaded again in a fresh process: {exc}") from None
        assert self.worker is not None
        return self.worker

    def fresh(self) -> None:
        """The next call runs in a fresh worker."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.arena.close()
        if self.slot_arena is not self.arena:
            self.slot_arena.close()

    def _request(self, message: dict[str, Any], *, timeout: float | None = None) -> dict[str, Any]:
        try:
            reply = self._ready().request(message, timeout=timeout or self.timeout)
        except WorkerGone as gone:
            self.lost.append(gone.kind)
            raise
        if reply.get("fatal"):
            assert self.worker is not None
            self.worker.kill()
            self.lost.append("fatal")
        return reply

    # -- buffers ----------------------------------------------------------------------
    def _inputs(self, inputs: dict[str, torch.Tensor], same_buffers: bool) -> list[tuple[str, Buffer, dict[str, Any]]]:
        if same_buffers and self._last is not None:
            placed = self._last
            for name, buf, _ in placed:
                buf.raw.copy_(storage_view(inputs[name]))
            return placed
        placed = []
        for name, t in inputs.items():
            source = storage_view(t)
            buf = self.arena.buffer(source.numel())
            buf.raw.copy_(source)
            placed.append((name, buf, {"name": name, "buf": buf.describe, "dtype": str(t.dtype).removeprefix("torch."),
                                       "shape": list(t.shape), "stride": list(t.stride()),
                                       "offset": t.storage_offset()}))
        return placed

    def _slots(self, spec: OpSpec, inputs: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        views, described = [], []
        for dtype, shape in output_slots(spec, inputs):
            numel = math.prod(shape)
            buf = self.slot_arena.buffer(numel * torch.empty((), dtype=dtype).element_size())
            stride = torch.empty(shape, device="meta").stride()
            view = buf.view(dtype, shape, stride, 0)
            view.fill_(math.nan)  # a slot the worker never fills fails numerics
            views.append(view)
            described.append({"buf": buf.describe, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                              "stride": list(stride), "offset": 0})
        return views, described

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _reset(self, same_buffers: bool) -> None:
        if not same_buffers:
            self.arena.reset()
        if self.slot_arena is not self.arena:
            self.slot_arena.reset()

    # -- calls ------------------------------------------------------------------------
    def call(self, spec: OpSpec, inputs: dict[str, torch.Tensor], params: dict[str, Any], *,
             keep: bool = False, same_buffers: bool = False) -> Called:
        self._reset(same_buffers and self._last is not None)
        placed = self._inputs(inputs, same_buffers)
        views, slots = self._slots(spec, inputs)
        self._sync()
        message = {"req": "call", "inputs": [p[2] for p in placed], "slots": slots, "params": params,
                   "keep": keep, "supports": self.supports, "hold": keep}
        try:
            reply = self._request(message)
        except WorkerGone as gone:
            self._last = None
            return Called(gone.kind, f"the target {gone.message}", changed=self._changed(placed, inputs))
        self._last = placed
        changed = self._changed(placed, inputs)
        if reply["status"] != "ok":
            status = "fatal" if reply.get("fatal") else reply["status"]
            message_text = reply["message"]
            if status == "fatal":
                message_text = f"the target made the CUDA context unusable in a call: {message_text}"
            return Called(status if status != "untrusted" else "raised", message_text, changed=changed)
        return self._called(reply, views, changed)

    def resend(self, spec: OpSpec, inputs: dict[str, torch.Tensor], call_id: int) -> Called:
        """The outputs the kept call ``call_id`` returned, as they are now."""
        if self.slot_arena is not self.arena:
            self.slot_arena.reset()
        views, slots = self._slots(spec, inputs)
        self._sync()
        try:
            reply = self._request({"req": "resend", "call": call_id, "slots": slots})
        except WorkerGone as gone:
            return Called(gone.kind, f"the target {gone.message}")
        if reply["status"] != "ok":
            return Called("raised", reply["message"])
        return self._called(reply, views, [])

    def count(self, spec: OpSpec, inputs: dict[str, torch.Tensor], params: dict[str, Any]) -> tuple[str, Any]:
        """``("ok", count)``, ``("untrusted" | "raised" | KIND, message)``: kernels one call launches."""
        self.arena.reset()
        placed = self._inputs(inputs, False)
        self._sync()
        try:
            reply = self._request({"req": "count", "inputs": [p[2] for p in placed], "params": params})
        except WorkerGone as gone:
            return gone.kind, f"the target {gone.message}"
        if reply["status"] == "ok":
            return "ok", reply["count"]
        return reply["status"], reply["message"]

    def _called(self, reply: dict[str, Any], views: list[torch.Tensor], changed: list[str]) -> Called:
        outputs = reply["outputs"]
        values = [views[i].to(self.device, copy=True) if i < len(views) and m["copied"] else None
                  for i, m in enumerate(outputs)]
        return Called("ok", outputs=outputs, values=values, changed=changed, seconds=reply.get("seconds", 0.0),
                      call_id=reply["id"])

    def _changed(self, placed: list[tuple[str, Buffer, dict[str, Any]]], inputs: dict[str, torch.Tensor]) -> list[str]:
        self._sync()
        return [name for name, buf, _ in placed if not torch.equal(buf.raw, storage_view(inputs[name]))]
