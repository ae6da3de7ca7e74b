"""The Gluon attention kernel for Hopper compiles for sm_90 without a GPU.

``fuseaudit/kernels/attention_hopper.py`` never runs under the interpreter (Gluon has
none), so CPU runs would not notice a kernel the compiler rejects, or a Gluon
API that moved in the installed Triton (the bulk-copy names did between 3.6
and 3.9).  This compiles it to PTX and cubin for sm_90, causal and not, and
checks that what makes it fast is there: ``wgmma`` tensor-core products,
``setmaxnreg`` register hand-over between the warp roles, bulk tensor copies,
and no local-memory spills.  In a subprocess: the kernels must be imported
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from fuseaudit.kernels import attention_hopper as AH

    fn = AH.attention_hopper_kernel
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.empty(2, 4, 256, AH.HEAD_DIM, dtype=dtype)
        kv = torch.empty(2, 256, 2, 2, AH.HEAD_DIM, dtype=dtype)[:, :, 0].transpose(1, 2)  # strided, as a slice
        descs = dict(q_desc=AH.descriptor(q, AH.M_WG), k_desc=AH.descriptor(kv, AH.BLOCK_N),
                     v_desc=AH.descriptor(kv, AH.BLOCK_N), o_desc=AH.descriptor(q, AH.M_WG))
        for causal in (False, True):
            consts = dict(GROUP=2, CAUSAL=causal, M_WG=AH.M_WG, BLOCK_N=AH.BLOCK_N, STAGES=AH.STAGES,
                          CONSUMERS=AH.CONSUMERS)
            sig = {}
            for name in fn.arg_names:
                if name in consts:
                    sig[name] = "constexpr"
                elif name in descs:
                    sig[name] = mangle_type(descs[name])
                else:
                    sig[name] = "fp32" if name == "qk_scale" else "i32"
            src = GluonASTSource(fn=fn, signature=sig,
                                 constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4, "maxnreg": AH.MAX_REGISTERS})
            ptx = kernel.asm["ptx"]
            print(dtype, "causal" if causal else "full", "smem", kernel.metadata.shared,
                  "wgmma", ptx.count("wgmma.mma_async"), "setmaxnreg", ptx.count("setmaxnreg"),
                  "tma", ptx.count("cp.async.bulk.tensor"), "local", ptx.count(".local"), flush=True)
    """
)


def test_gluon_attention_compiles_for_hopper() -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert len(lines) == 4, proc.stdout
    for fields in lines:
        stats = dict(zip(fields[2::2], map(int, fields[3::2]), strict=True))
        assert stats["smem"] <= 227 * 1024, f"more shared memory than an SM has: {fields}"
        assert stats["wgmma"] > 0, f"no warpgroup MMA (wgmma) in the PTX: {fields}"
        assert stats["setmaxnreg"] > 0, f"no register hand-over between the warp roles: {fields}"
        assert stats["tma"] > 0, f"no bulk tensor copies: {fields}"
        assert stats["local"] == 0, f"local memory (spills) in the PTX: {fields}"
