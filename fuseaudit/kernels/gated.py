"""Gated linear units: the activation of one half times the other, in one pass.

    swiglu(gate, up)  = silu(gate) * up
    geglu(gate, up)   = gelu(gate) * up        (erf or tanh GELU)

The MLP of Llama-style models computes ``gate`` and ``up`` with two
projections (or one fused projection, sliced); eager PyTorch then writes
``act(gate)`` to memory and reads it back for the product.  Here both inputs
are read once, the product is formed in float32 and stored once.

``gate`` and ``up`` may be any strided views of the same shape, e.g. the two
halves of one ``(..., 2N)`` projection output (row stride ``2N``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._activations import SILU, apply_activation, gelu_code
from ._launch import Plan, output_like, planned
from ._rows import check_tensors, next_pow2, row_layout, row_offsets

TILE_ELEMENTS = 4096
MAX_BLOCK_N = 1024


@triton.jit
def gated_kernel(
    g_ptr, u_ptr, y_ptr,
    M, N, D1, D2,
    sg0, sg1, sg2, sgn,
    su0, su1, su2, sun,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]

    g_offs = row_offsets(rows, D1, D2, sg0, sg1, sg2, 1)[:, None] + cols[None, :] * sgn
    u_offs = row_offsets(rows, D1, D2, su0, su1, su2, 1)[:, None] + cols[None, :] * sun
    g = tl.load(g_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_offs, mask=mask, other=0.0).to(tl.float32)

    # y = act(g) * u, rounded once
    y = apply_activation(g, ACTIVATION) * u
    y_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _gated(op: str, gate: torch.Tensor, up: torch.Tensor, activation: int) -> torch.Tensor:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch."""
    plan = planned((op, activation), (gate, up), _plan, op, gate, up, activation)
    y = output_like(gate, plan)
    if plan is not None:
        plan.launch(gate, up, y)
    return y


def _plan(op: str, gate: torch.Tensor, up: torch.Tensor, activation: int) -> Plan | None:
    """Check the inputs and choose the grid and tile; None when there is nothing to launch."""
    check_tensors(op, gate=gate, up=up)
    if gate.dim() == 0 or gate.shape != up.shape:
        raise ValueError(
            f"{op}: gate and up must have one shape (..., N); got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    n = gate.shape[-1]
    if gate.numel() == 0:
        return None
    layout = row_layout(gate.shape, gate, up)
    block_n = min(next_pow2(n), MAX_BLOCK_N)
    block_m = min(next_pow2(layout.rows), max(1, TILE_ELEMENTS // block_n))
    grid = (triton.cdiv(layout.rows, block_m), triton.cdiv(n, block_n))
    return Plan(
        gated_kernel, grid, layout.rows, n, layout.dims[1], layout.dims[2], *layout.strides[0], *layout.strides[1],
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if block_m * block_n >= 4096 else 4,
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one launch."""
    return _gated("swiglu", gate, up, SILU)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one launch."""
    return _gated("geglu", gate, up, gelu_code(approximate))
