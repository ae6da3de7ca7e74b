"""Float32 softmax rows of 16384-32768 held whole: a minimal kernel against the library's (GPU probe).

    python benchmarks/softmax_whole_f32.py

The probe behind softmax's float32 whole-row rule (``TUNING.float32_whole_from``,
thirty-second session).  The library then looped these rows in 8192 x 16
warps (0.98x torch.compile at 16384 x 32768), and its whole-row kernel
(``softmax_kernel`` with ``BLOCK_N = N``, 32 warps) was far slower (64
registers a thread, the most 32 warps may have: its row mask, since
dropped at one row a program), while a minimal whole-row kernel with the
same precise exp (:func:`softmax._exp`) and ``div_rn`` ran at 99% of a copy.  ``MODE`` picks the variant: 1, the
library's exp; 3, that with int64 column offsets as ``_load_logits`` has
them; 4, that with its scale-then-mask.  Each is checked against float64 (its
max error relative to the row's max printed) and timed with the library,
torch.compile and a device copy of ``x``: event µs after an L2 flush, three
interleaved rounds; cells are ``µs (x compile, % of that copy)``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from fuseaudit.kernels.softmax import _exp, softmax_kernel

from fuseaudit.catalog import OPS
from fuseaudit.contenders import Contender, build
from fuseaudit.sweep import _rows_point, bench_inputs
from fuseaudit.timing import time_events_rounds

POINTS = ((1024, 32768), (16384, 32768), (16384, 16384), (16384, 24000))


@triton.jit
def softmax_whole_kernel(X, Y, N, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    # One contiguous row a program, held whole: y = exp(x - max) / sum(exp(x - max)).
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    m = cols < N
    if MODE == 3:  # int64 column offsets, as the library's _load_logits
        x = tl.load(X + row * N + cols.to(tl.int64) * 1, mask=m, other=-float("inf")).to(tl.float32)
    elif MODE == 4:  # the library's scale, then mask
        x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
        x = tl.where(m, x * 1.0, float("-inf"))
    else:
        x = tl.load(X + row * N + cols, mask=m, other=-float("inf")).to(tl.float32)
    e = _exp(x - tl.max(x, axis=1)[:, None], True)
    y = e * tl.math.div_rn(1.0, tl.sum(e, axis=1))[:, None]
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=m)


def probe(rows: int, n: int) -> str:
    """One point: every variant beside the library, its own whole-row kernel, torch.compile and a copy."""
    spec = OPS["softmax"]
    point = _rows_point(spec, rows, n, "float32")
    inputs = bench_inputs(point.case, "cuda")
    ref = build(Contender("reference", "fused"), spec, point, inputs)
    comp = build(Contender("compile", "compile"), spec, point, inputs)
    want = ref.call().double()
    x = inputs["x"]
    y, x_copy = torch.empty_like(x), torch.empty_like(x)
    bn = triton.next_power_of_2(n)

    def minimal(mode: int) -> Callable[[], Any]:
        return lambda: softmax_whole_kernel[(rows,)](x, y, n, BLOCK_N=bn, MODE=mode, num_warps=32)

    def library_whole(precise: bool) -> Callable[[], Any]:
        return lambda: softmax_kernel[(rows,)](x, y, rows, n, 1, 1, n, 0, 0, 1, 1.0, PRECISE=precise, BLOCK_M=1,
                                               BLOCK_N=bn, BLOCK_T=0, ALIGN=16 if n % 16 == 0 else 1, num_warps=32)

    variants = {f"m{mode}w32": minimal(mode) for mode in (1, 3, 4)}
    variants.update({f"lib-whole-p{int(p)}": library_whole(p) for p in (True, False)})
    info = {}
    for label, call in variants.items():
        y.zero_()
        kernel = call()
        torch.cuda.synchronize()
        rel = ((y.double() - want).abs().max() / want.abs().max()).item()
        info[label] = f"r{kernel.n_regs},s{kernel.n_spills},err{rel:.1e}"
    labels = ["default", "compile", *variants, "copy"]
    calls = [ref.call, comp.call, *variants.values(), lambda: x_copy.copy_(x)]
    timings = time_events_rounds(calls, rounds=3, target_seconds=0.15, min_repeats=30, max_repeats=300)
    us = {label: (float("nan") if isinstance(t, Exception) else t.median_us) for label, t in zip(labels, timings)}
    compiled, copy = us.pop("compile"), us.pop("copy")
    cells = "  ".join(f"{label}[{info.get(label, '')}] {t:.2f} ({compiled / t:.3f}x, {copy / t:.1%})"
                      for label, t in us.items())
    return f"softmax float32 {rows}x{n}: copy {copy:.2f} compile {compiled:.2f} | {cells}"


def main() -> int:
    if not torch.cuda.is_available():
        print("softmax_whole_f32: needs a CUDA GPU", file=sys.stderr)
        return 2
    for rows, n in POINTS:
        t0 = time.perf_counter()
        print(f"{probe(rows, n)}   [{time.perf_counter() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
