"""How the row ops' speed depends on where rows start in memory (GPU): ``python benchmarks/row_alignment.py``.

bfloat16, 16384 rows of ``n`` columns, ``x = big[:, :n]`` of a tensor with
row stride ``n + pad``: the same kernel, tile and ``ALIGN`` (the divisor of
``n`` and the stride) at ``n = 9000`` with stride 9000 (rows 16 bytes past a
32-byte boundary every other row) and stride 9024 (every row 128-byte
aligned).  Ours (the library) against ``torch.compile``, event time after an
L2 flush, three interleaved rounds.  (It found ours 1.4-1.5x slower at the
odd stride; ncu then showed why: the hint behind ``ALIGN`` had folded away,
see ``_rows.row_offsets`` and ``reports/h200/align-fold-session21.txt``.)
"""

from __future__ import annotations

import functools

import torch

from fuseaudit.catalog import OPS
from fuseaudit.timing import time_events_rounds

ROWS = 16384
SHAPES = ((9000, 0), (9000, 24), (9024, 0), (9008, 0), (9016, 0), (9088, 0), (9040, 0), (20008, 0), (20008, 56),
          (20032, 0))


def main() -> None:
    torch.manual_seed(0)
    for op in ("rms_norm", "layer_norm", "softmax"):
        spec = OPS[op]
        ours = spec.load_reference()
        compiled = torch.compile(spec.eager, dynamic=False)
        for n, pad in SHAPES:
            x = torch.randn(ROWS, n + pad, device="cuda", dtype=torch.bfloat16)[:, :n]
            w, b = torch.randn(2, n, device="cuda", dtype=torch.bfloat16)
            args = {"rms_norm": (x, w), "layer_norm": (x, w, b), "softmax": (x,)}[op]
            torch._dynamo.reset()
            calls = [functools.partial(ours, *args), functools.partial(compiled, *args)]
            for call in calls:
                call()
            t_ours, t_compile = time_events_rounds(calls, rounds=3, target_seconds=0.1)
            print(f"{op} {ROWS}x{n} row stride {n + pad} ({(n + pad) * 2 % 128} B past 128): "
                  f"ours {t_ours.median_us:.1f} compile {t_compile.median_us:.1f}", flush=True)


if __name__ == "__main__":
    main()
