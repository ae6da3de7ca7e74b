"""Time candidate launch configs of a row op at one point against torch.compile (GPU; a tuning aid).

    python benchmarks/row_configs.py POINTS.txt

Each line of ``POINTS.txt`` is ``op dtype rows N cand ...`` (``#`` starts a
comment); ``N/S`` for N gives the inputs of shape ``(rows, N)`` a row stride of
``S`` elements (sliced from ``(rows, S)``), e.g. to tell a row alignment's
effect from the width's.  A candidate is one of:

* ``w:M:BN:W`` -- whole rows, ``BLOCK_M = M`` rows of ``BLOCK_N = BN`` in ``W`` warps;
* ``t:BN:BT:W`` -- whole rows as a block of ``BN`` plus a tail block of ``BT`` (see ``_rows.RowBlocks``);
* ``l:BN:W:P`` -- the looped kernel in blocks of ``BN``, ``W`` warps, prefetching in ``P`` passes
  (``l:BN:W:P:BS``: pass 1 in blocks of ``BS``, see ``_rows.StatsBlock``; a trailing ``L``, e.g.
  ``l:16384:16:1L``: softmax's pass 1 in lanes, see ``_rows.RowBlocks.lanes``);
* ``aK`` -- the library's own blocks with ``ALIGN`` forced to ``K`` (``a1``: rows read as unaligned).

A ``+f`` or ``-f`` after a looped candidate compiles it for the row's width or not (the
norms' ``N_FIXED``, see ``fixed_width`` in their modules) whatever the module's rule says.

Every candidate is the plan the op's wrapper builds with those blocks (the
cooperative split left out), launched on tensors kept from one call, so
only the kernel differs; its output must match the library's before it is
timed.  The library as it stands ("default") and ``torch.compile`` as
``fuseaudit bench`` builds it run beside them: event time after an L2 flush,
three interleaved rounds (:func:`fuseaudit.timing.time_events_rounds`).
One line a point: µs, ``compile µs / µs`` and the op's bytes at the bandwidth of a
device copy of its first input timed alike ("% of copy").  What a rule in ``_rows``
is built from; ``fuseaudit bench`` then measures the rule.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from fuseaudit.kernels import _rows
from fuseaudit.kernels import layer_norm as _layer_norm
from fuseaudit.kernels import rms_norm as _rms_norm
from fuseaudit.kernels import softmax as _softmax

from fuseaudit.catalog import OPS, OpSpec
from fuseaudit.contenders import Contender, build
from fuseaudit.sweep import _rows_point, bench_inputs
from fuseaudit.timing import time_events_rounds

MODULES = {"rms_norm": _rms_norm, "add_rms_norm": _rms_norm, "layer_norm": _layer_norm,
           "add_layer_norm": _layer_norm, "softmax": _softmax}
# Where y sits among the tensors each wrapper launches with (see their plan.launch calls).
Y_INDEX = {"rms_norm": 3, "add_rms_norm": 3, "layer_norm": 4, "add_layer_norm": 4, "softmax": 1}


def parse_candidate(text: str, rows: int) -> _rows.RowBlocks | int:
    """The blocks ``text`` names (module docstring), or for ``aK`` the ALIGN ``K``."""
    if text[0] == "a" and text[1:].isdigit():
        return int(text[1:])
    lanes = text.endswith("L")
    kind, *values = text.removesuffix("L").split(":")
    v = [int(i) for i in values]
    early = rows <= _rows.EARLY_VECTOR_ROWS
    if kind == "w" and len(v) == 3:
        return _rows.RowBlocks(v[0], v[1], v[2], False, early=early)
    if kind == "t" and len(v) == 3:
        return _rows.RowBlocks(1, v[0], v[2], False, v[1], early=early)
    if kind == "l" and len(v) in (3, 4):
        return _rows.RowBlocks(1, v[0], v[1], True, prefetch=v[2], block_s=v[3] if len(v) == 4 else 0, lanes=lanes)
    raise ValueError(f"not a candidate: {text!r} (w:M:BN:W, t:BN:BT:W, l:BN:W:P[:BS][L] or aK)")


def candidate_call(spec: OpSpec, module: ModuleType, args: list[torch.Tensor], params: dict[str, Any],
                   blocks: _rows.RowBlocks | int, fixed: bool | None = None
                   ) -> tuple[Callable[[], None], torch.Tensor]:
    """A call launching the plan ``spec``'s wrapper builds with ``blocks`` (an int: its blocks, that ALIGN).

    ``fixed`` forces the looped kernel's ``N_FIXED`` on (True) or off (False); None keeps the module's rule.
    """
    fn = spec.load_reference()
    names = ["row_block_config", "coop_config", "planned", "row_alignment"]
    if fixed is not None:
        if not hasattr(module, "fixed_width"):
            raise ValueError(f"{spec.name} has no N_FIXED to force (+f/-f)")
        names.append("fixed_width")
    saved = {name: getattr(module, name) for name in names}
    plans: list[Any] = []

    def keep(_params: Any, _inputs: Any, build_plan: Callable[..., Any], *build_args: Any) -> Any:
        plans.append(build_plan(*build_args))
        return plans[-1]

    try:
        if fixed is not None:
            module.fixed_width = (lambda n, *a: n) if fixed else (lambda *a: 0)
        if isinstance(blocks, int):
            module.row_alignment = lambda *a, **k: blocks
        else:
            module.row_block_config = lambda *a, **k: blocks
            module.coop_config = lambda *a, **k: None
        module.planned = keep
        fn(*args, **params)  # builds the plan and makes its first launch
        (plan,) = plans
        launched: list[tuple[torch.Tensor, ...]] = []
        launch = plan.launch
        plan.launch = lambda *t: (launched.append(t), launch(*t))
        module.planned = lambda *a: plan
        fn(*args, **params)  # the tensors it launches with, kept
        plan.launch = launch
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    tensors = launched[0]
    return (lambda: launch(*tensors)), tensors[Y_INDEX[spec.name]]


def restride(t: torch.Tensor, stride: int) -> torch.Tensor:
    """``t`` if it is a vector, else a copy of its ``(rows, N)`` values whose rows are ``stride`` apart."""
    if t.dim() != 2:
        return t
    if stride < t.shape[1]:
        raise ValueError(f"a row stride of {stride} is narrower than the rows ({t.shape[1]})")
    buf = torch.empty(t.shape[0], stride, dtype=t.dtype, device=t.device)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def probe(line: list[str]) -> str:
    """One point: every candidate that computes the library's output, timed beside the library and compile."""
    op, dtype, rows, width, *names = line
    n, _, stride = width.partition("/")
    spec, module = OPS[op], MODULES[op]
    point = _rows_point(spec, int(rows), int(n), dtype)
    inputs = bench_inputs(point.case, "cuda")
    if stride:
        inputs = {k: restride(t, int(stride)) for k, t in inputs.items()}
    params = dict(point.params)
    reference = build(Contender("reference", "fused"), spec, point, inputs)
    compiled = build(Contender("compile", "compile"), spec, point, inputs)
    want = reference.call()
    want = (want[0] if isinstance(want, tuple) else want).float()
    labels, calls = ["default", "compile"], [reference.call, compiled.call]
    for name in names:
        try:
            base, fixed = (name[:-2], name[-2] == "+") if name[-2:] in ("+f", "-f") else (name, None)
            call, y = candidate_call(spec, module, [inputs[k] for k in spec.input_names], params,
                                     parse_candidate(base, int(rows)), fixed)
            y.zero_()
            call()
            torch.cuda.synchronize()
        except Exception as exc:  # a config the compiler or the launch refuses: say so, go on
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            continue
        if not torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2):
            print(f"  {name}: wrong output, max |diff| {(y.float() - want).abs().max().item():.3g}", file=sys.stderr)
            continue
        labels.append(name)
        calls.append(call)
    x = inputs[spec.input_names[0]]
    x_copy = torch.empty_like(x)
    labels.append("copy")
    calls.append(lambda: x_copy.copy_(x))
    timings = time_events_rounds(calls, rounds=3, target_seconds=0.15, min_repeats=30, max_repeats=300)
    us = {label: (float("nan") if isinstance(t, Exception) else t.median_us) for label, t in zip(labels, timings)}
    ref_us = us.pop("compile")
    # The op's bytes at the copy's bandwidth (read + write of x), as the sweep's "% of copy".
    copy_gbs = 2 * x.numel() * x.element_size() / us.pop("copy") / 1e3
    moved = spec.bytes_moved(point.shapes(), x.dtype)
    cells = "  ".join(f"{label} {t:.2f} ({ref_us / t:.3f}x, {moved / t / 1e3 / copy_gbs:.1%})"
                      for label, t in us.items())
    return f"{op} {dtype} {rows}x{width}: compile {ref_us:.2f} | {cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("points", help="file of 'op dtype rows N cand ...' lines")
    path = parser.parse_args(argv).points
    if not torch.cuda.is_available():
        print("row_configs: needs a CUDA GPU", file=sys.stderr)
        return 2
    with open(path) as f:
        lines = [ln.split() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    for line in lines:
        t0 = time.perf_counter()
        print(f"{probe(line)}   [{time.perf_counter() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
