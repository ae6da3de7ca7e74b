"""The row kernels compile for Hopper (sm_90) with every tile the launch rules pick, without a GPU.

(The cooperative kernels too, whose waiting code the interpreter never runs.)

Triton's interpreter runs a kernel's Python; it never runs Triton's compiler,
so code the compiler rejects passes every CPU test and first fails on a GPU.
(A plain ``flag = True`` assigned in a kernel becomes a runtime value, and a
variable then defined under ``if flag:`` does not exist after it: that came
up once, on the H200.)  This compiles each row kernel to PTX and cubin for
sm_90 with the bundled ``ptxas``, for the ``(BLOCK_*, num_warps)`` that
``_rows.row_block_config`` chooses over a spread of widths, dtypes and row
counts.  It runs in a subprocess: the kernels must be imported without
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

    from fuseaudit.kernels import _rows, layer_norm, rms_norm, softmax

    TARGET = GPUTarget("cuda", 90, 32)
    TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    FAMILIES = [  # (module, tuning, kernels, constexprs besides the blocks)
        (rms_norm, rms_norm.TUNING, dict(HAS_RESIDUAL=False)),
        (rms_norm, rms_norm.ADD_TUNING, dict(HAS_RESIDUAL=True)),
        (layer_norm, layer_norm.TUNING, dict(HAS_RESIDUAL=False)),
        (layer_norm, layer_norm.ADD_TUNING, dict(HAS_RESIDUAL=True)),
        (softmax, softmax.TUNING, dict()),
    ]
    POINTERS = ("X", "R", "W", "B", "Y", "H")
    WORKSPACE = {"Part": "*fp32", "Count": "*i32"}  # the cooperative kernels' (kernels/_coop.py)
    WIDTHS = (100, 1000, 2500, 3000, 5120, 7000, 8192, 9000, 11008, 14336, 16384, 20000, 20008, 40000, 65536)
    # not multiples of 16 elements, rows 16-byte aligned in half precision: whole rows (3000) and looped (9000, 20008)
    UNALIGNED = (3000, 9000, 20008)
    ROWS = (8, 16384)
    # and rules that only some row counts take (softmax float32 rows of 8192 in 32 warps and rms_norm's uneven
    # split from 256 to 4096 rows; rms_norm's rows of 4096 two a program from 1024)
    POINTS = [(n, rows) for n in WIDTHS for rows in ROWS] + [(8192, 1024), (11008, 1024), (4096, 16384)]
    # and widths only some rules take (softmax's half-precision rows of 49152 to 65535 and from 98304)
    POINTS += [(49152, 16384), (131072, 16384)]

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
    for module, tuning, extra in FAMILIES:
        name = module.__name__.rsplit(".", 1)[-1]
        whole, wide = getattr(module, name + "_kernel"), getattr(module, name + "_wide_kernel")
        for dtype in TYPES:
            for n, rows in POINTS:
                b = _rows.row_block_config(rows, n, dtype.itemsize, tuning)
                consts = dict(extra)
                if module is softmax:
                    consts["PRECISE"] = dtype == torch.float32
                if b.wide:
                    fn, consts = wide, dict(consts, BLOCK_N=b.block_n, PREFETCH=b.prefetch, ALIGN=min(n & -n, 16))
                    if module is rms_norm:  # y stored evict-first in the widest rows
                        consts["STREAM_Y"] = rms_norm.stream_y(n, dtype.itemsize, extra["HAS_RESIDUAL"])
                    if module is softmax:  # pass 1 in lanes (RowBlocks.lanes)
                        consts["VEC"] = softmax.LANE_BYTES // dtype.itemsize if b.lanes else 0
                    if module is not softmax:  # pass 1's blocks (wider for many rows of 65536: StatsBlock)
                        consts["BLOCK_S"] = b.stats_block_n
                    if module is layer_norm:  # compiled for the row's width, or not (FIXED_WIDTH_MAX)
                        consts["N_FIXED"] = layer_norm.fixed_width(n, dtype.itemsize, extra["HAS_RESIDUAL"])
                        # pass 2 from pass 1's last block (Welford's pass, more than one block)
                        consts["KEEP"] = layer_norm.keep_last(n, dtype.itemsize, extra["HAS_RESIDUAL"], b)
                    if module is rms_norm:
                        consts["N_FIXED"] = rms_norm.fixed_width(n, dtype.itemsize, extra["HAS_RESIDUAL"], b.block_n)
                    consts["EVEN"] = _rows.even_blocks(n, b.block_n, b.stats_block_n)
                    consts.update({k: 1 for k in ("D1", "D2", "sxn", "srn", "swn", "sbn") if k in fn.arg_names})
                else:
                    fn, consts = whole, dict(consts, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_T=b.block_t,
                                             ALIGN=min(n & -n, 16))  # contiguous (rows, n) inputs
                    if "EARLY" in fn.arg_names:  # the norms: vectors early at 8 rows, late at 16384
                        consts["EARLY"] = b.early
                    # column strides of 1, as Triton specialises them
                    consts.update({k: 1 for k in ("D1", "D2", "sxn", "srn", "swn", "sbn") if k in fn.arg_names})
                key = (fn.__name__, dtype, tuple(sorted(consts.items())), b.num_warps)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    ptx = compile_ptx(fn, dtype, consts, b.num_warps)
                except Exception as e:
                    failures.append(f"{fn.__name__} {dtype} N={n} rows={rows} {consts} "
                                    f"num_warps={b.num_warps}: {type(e).__name__}: {e}")
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
                    allowed = (1 + extra["HAS_RESIDUAL"]) if module is layer_norm and fn is whole else 0
                    if module is layer_norm and fn is wide and consts["N_FIXED"]:
                        allowed = 1
                    if not vector_loads or "st.global.b16" in ptx or scalar_loads > allowed:
                        failures.append(f"{fn.__name__} {dtype} N={n} ALIGN={consts['ALIGN']}: "
                                        f"not 16-byte vectorised ({scalar_loads} 2-byte loads)")
    # The cooperative kernels, at the splits an H200 (132 SMs) takes for a few wide rows (and for many,
    # by each op's ManyRows rule): they must compile for a cooperative grid, publish with a release
    # and wait with acquire loads in a loop.
    from fuseaudit.kernels import _coop

    for module, tuning, extra in FAMILIES:
        name = module.__name__.rsplit(".", 1)[-1]
        coop = getattr(module, name + "_coop_kernel")
        for dtype in TYPES:
            for n in (16384, 40000, 65536):
                for rows in (1, 8, 64, 16384):
                    many = getattr(tuning, "float32_many_rows", None) if dtype == torch.float32 else None
                    c = _coop._coop_config(rows, n, dtype.itemsize, 132, _coop.knobs(), many)
                    if c is None:
                        continue
                    consts = dict(extra, CHUNK=c.chunk, SPLITS=c.splits, SLOTS=c.slots, ALIGN=min(n & -n, 16),
                                  COOPERATIVE=True)
                    if "LOOP_ROWS" in coop.arg_names:
                        consts["LOOP_ROWS"] = c.groups is not None
                    consts.update({k: 1 for k in ("D1", "D2", "sxn", "srn", "swn", "sbn") if k in coop.arg_names})
                    if module is softmax:
                        consts["PRECISE"] = dtype == torch.float32
                    if "EARLY" in coop.arg_names:
                        consts["EARLY"] = c.chunk <= layer_norm.COOP_EARLY_MAX
                    key = (coop.__name__, dtype, tuple(sorted(consts.items())), c.num_warps)
                    if key in seen:
                        continue
                    seen.add(key)
                    try:
                        ptx = compile_ptx(coop, dtype, consts, c.num_warps, launch_cooperative_grid=True)
                    except Exception as e:
                        failures.append(f"{coop.__name__} {dtype} N={n} rows={rows} {consts} "
                                        f"num_warps={c.num_warps}: {type(e).__name__}: {e}")
                        continue
                    if "atom.global.gpu.acq_rel.add" not in ptx or "ld.global.gpu.acquire" not in ptx:
                        failures.append(f"{coop.__name__} {dtype} N={n} rows={rows}: no release/acquire pair")
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
    assert cooperative >= 3 * 3, f"expected the three cooperative kernels in every dtype: {proc.stdout}"
