"""The row kernels compile for Hopper (sm_90) with every tile the launch rules pick, without a GPU.

(The cooperative kernels too, whose waiting code the interpreter never runs.)

Triton's interpreter runs a kernel's Python; it never runs Triton's compiler,
so code the compiler rejects passes every CPU test and first fails on a GPU.
(A plain ``flag = True`` assigned in a kernel becomes a runtime value, and a
variable then defined under ``if flag:`` does not exist after it: that came
up once, on the H200.)  This compiles each row kernel to PTX and cubin for
sm_90 with the bundled ``ptxas``, for the launch of every row of every
table (``fuseaudit/kernels/tuning_h200.json``), as the wrappers plan it, and for
row widths that are not multiples of 16 elements.  It runs in a subprocess: the kernels must be imported without
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import re
    import sys

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fuseaudit.kernels import _tuning, layer_norm, rms_norm, softmax

    TARGET = GPUTarget("cuda", 90, 32)
    TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    BY_NAME = {v: k for k, v in TYPES.items()}
    MODULES = {"rms_norm": rms_norm, "add_rms_norm": rms_norm, "layer_norm": layer_norm,
               "add_layer_norm": layer_norm, "softmax": softmax}
    for module in set(MODULES.values()):  # meta tensors stand in for CUDA ones: the plans are built, not launched
        module.check_tensors = lambda *args, **kwargs: None
    POINTERS = ("X", "R", "W", "B", "Y", "H")
    WORKSPACE = {"Part": "*fp32", "Count": "*i32"}  # the cooperative kernels' (fuseaudit/kernels/_coop.py)
    LAUNCH_OPTIONS = ("num_warps", "launch_cooperative_grid")
    # not multiples of 16 elements, rows 16-byte aligned in half precision: whole rows (3000) and looped (9000, 20008)
    UNALIGNED = (3000, 9000, 20008)
    # every table row at its first shape, in its first dtype; and the unaligned widths in half precision
    POINTS = list(dict.fromkeys((op, BY_NAME[sorted(row.dtypes)[0]], row.min_rows, row.min_n)
                                for op, table in _tuning.TABLES.items() for row in table))
    POINTS += [(op, dtype, rows, n) for op in MODULES for dtype in (torch.float16, torch.bfloat16)
               for rows in (8, 16384) for n in UNALIGNED]

    def plans(op, dtype, rows, n):
        # The plan the op's wrapper builds for contiguous (rows, n) inputs, and its fallback if it has one.
        x = torch.empty(rows, n, dtype=dtype, device="meta")
        w = torch.empty(n, dtype=dtype, device="meta")
        r = x if op.startswith("add_") else None
        if op == "softmax":
            plan = softmax._plan(x, 1.0)
        elif "rms" in op:
            plan = rms_norm._plan(op, x, r, w, 1e-6)
        else:
            plan = layer_norm._plan(op, x, r, w, w, 1e-5)
        return [p for p in (plan, plan.fallback) if p is not None]

    def signature(fn, dtype, constexprs):
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in POINTERS:
                sig[name] = "*" + TYPES[dtype]
            elif name in WORKSPACE:
                sig[name] = WORKSPACE[name]
            elif name in ("eps", "scale"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        return sig

    def compile_ptx(fn, dtype, consts, num_warps, **options):
        # Tensors are 16-byte aligned, as Triton specialises fresh allocations; integers unknown
        # (the row strides of an unaligned width are not multiples of 16), but those equal to 1 are
        # constexprs as Triton specialises them: the column strides, and D1 = D2 = 1 of a (rows, N)
        # input, with which the row offset's terms fold (see _rows.row_offsets; with them passed
        # as plain integers this check once passed while the H200 loaded such rows 2 bytes at a time).
        attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
                 for k in POINTERS + tuple(WORKSPACE) if k in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature(fn, dtype, consts),
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        return triton.compile(src, target=TARGET, options={"num_warps": num_warps, **options}).asm["ptx"]

    seen, failures = set(), []
    for op, dtype, rows, n in POINTS:
        for plan in plans(op, dtype, rows, n):
            fn = plan.kernel
            consts = {k: v for k, v in plan.meta.items() if k not in LAUNCH_OPTIONS}
            # column strides and D1 = D2 = 1 of a (rows, n) input, as Triton specialises them
            consts.update({k: 1 for k in ("D1", "D2", "sxn", "srn", "swn", "sbn") if k in fn.arg_names})
            coop = fn.__name__.endswith("_coop_kernel")
            options = {"launch_cooperative_grid": True} if coop else {}
            key = (fn.__name__, dtype, tuple(sorted(consts.items())), plan.meta["num_warps"])
            if key in seen:
                continue
            seen.add(key)
            try:
                ptx = compile_ptx(fn, dtype, consts, plan.meta["num_warps"], **options)
            except Exception as e:
                failures.append(f"{fn.__name__} {dtype} N={n} rows={rows} {consts} "
                                f"num_warps={plan.meta['num_warps']}: {type(e).__name__}: {e}")
                continue
            if coop:  # they must publish with a release and wait with acquire loads in a loop
                if "atom.global.gpu.acq_rel.add" not in ptx or "ld.global.gpu.acquire" not in ptx:
                    failures.append(f"{fn.__name__} {dtype} N={n} rows={rows}: no release/acquire pair")
                continue
            # These widths are not multiples of 16 elements (Triton's own specialisation
            # misses them) but their rows are 16-byte aligned in half precision: ALIGN must
            # keep the row's loads and stores 16 bytes wide, whole or looped (only the whole
            # layer_norm's first elements, x0 and with a residual r0, are 2-byte loads, as is
            # the looped layer_norm's x0 where its lanes merge about it: N_FIXED, Welford).
            if n in UNALIGNED and dtype != torch.float32:
                # (eviction hints sit between ld.global and the width: ld.global.L1::evict_last...)
                # Counted by address: Triton 3.8 loads layer_norm's x0 twice from one address
                # in a row held as block + tail (N = 9000), where 3.9 loads it once.
                scalar_loads = len(set(re.findall(r"ld\.global[.\w:]*\.b16 \{[^}]*\}, \[ ([^\]]+) \]", ptx)))
                vector_loads = len(re.findall(r"ld\.global[.\w:]*\.v4\.b32 ", ptx))
                residual = consts.get("HAS_RESIDUAL", False)
                allowed = 0
                if fn is layer_norm.layer_norm_kernel:
                    allowed = 1 + residual
                if fn is layer_norm.layer_norm_wide_kernel and consts["N_FIXED"]:
                    allowed = 1
                if not vector_loads or "st.global.b16" in ptx or scalar_loads > allowed:
                    failures.append(f"{fn.__name__} {dtype} N={n} ALIGN={consts['ALIGN']}: "
                                    f"not 16-byte vectorised ({scalar_loads} 2-byte loads)")
    n_coop = sum(key[0].endswith("_coop_kernel") for key in seen)
    print(f"compiled {len(seen)} kernel variants for sm_90 ({n_coop} cooperative), {len(failures)} failed")
    for f in failures:
        print(f)
    sys.exit(1 if failures else 0)
    """
)


def test_row_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a warm cache
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "compiled" in proc.stdout and " 0 failed" in proc.stdout, proc.stdout
    cooperative = int(proc.stdout.split(" cooperative)")[0].rsplit("(", 1)[1])
    assert cooperative >= 3 * 2, f"expected the three cooperative kernels in both precisions: {proc.stdout}"
