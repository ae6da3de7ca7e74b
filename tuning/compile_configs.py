"""What torch.compile builds at row-op points: its generated code and the launch config its autotuner kept (GPU).

    python tuning/compile_configs.py OUT_DIR op,dtype,rows,N ...

For each point the eager composition is compiled as ``fuseaudit bench``
compiles it (``dynamic=False``, dynamo reset first) and run once; the
generated module goes to ``OUT_DIR/compile-<op>-<dtype>-<rows>x<N>.py`` and
each Triton kernel it launched is printed with the config kept, e.g.
``triton_red_fused__fused_rms_norm_0 [({'XBLOCK': 1, 'R0_BLOCK': 2048}, 16, 1)]``
(kwargs, warps, stages).  A tuning aid: what the contender the row ops
are measured against does at a point where it wins.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch._dynamo
from torch._inductor.utils import run_and_get_code

from fuseaudit.catalog import OPS
from fuseaudit.contenders import Contender, build
from fuseaudit.sweep import _rows_point, bench_inputs


def autotuners() -> dict[int, object]:
    """Inductor's live kernel launchers (``CachingAutotuner``), by id."""
    return {id(o): o for o in gc.get_objects() if type(o).__name__ == "CachingAutotuner"}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not torch.cuda.is_available():
        print(__doc__.strip().splitlines()[2].strip() + "   (needs a CUDA GPU)", file=sys.stderr)
        return 2
    out, points = argv[0], argv[1:]
    os.makedirs(out, exist_ok=True)
    for text in points:
        op, dtype, rows, n = text.split(",")
        spec = OPS[op]
        point = _rows_point(spec, int(rows), int(n), dtype)
        inputs = bench_inputs(point.case, "cuda")
        torch._dynamo.reset()
        before = autotuners()
        compiled = build(Contender("compile", "compile"), spec, point, inputs)
        _, codes = run_and_get_code(compiled.call)
        tag = f"{op}-{dtype}-{rows}x{n}"
        with open(os.path.join(out, f"compile-{tag}.py"), "w") as f:
            f.write("\n\n# ----\n".join(codes))
        for key, tuner in autotuners().items():
            if key in before:
                continue
            name = getattr(getattr(tuner, "fn", None), "__name__", "?")
            kept = [(c.config.kwargs, c.config.num_warps, c.config.num_stages) for c in getattr(tuner, "launchers", [])]
            print(f"{tag} {name} {kept}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
