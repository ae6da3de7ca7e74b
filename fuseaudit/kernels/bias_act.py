"""Bias + activation, optionally with a residual, fused into one pass.

    bias_gelu(x, b)              = gelu(x + b)
    bias_silu(x, b)              = silu(x + b)
    residual_bias_gelu(x, r, b)  = gelu(x + r + b)

Unfused, eager PyTorch writes ``x + b`` (and ``x + r``) to memory in the
input dtype and reads it back for the activation: two or three launches and
one or two full-size temporaries.  Here every element is loaded once, the sum
and the activation are computed in float32 (no intermediate rounding), and
the result is stored once in the input dtype.

Each program owns a ``BLOCK_M x BLOCK_N`` tile of the ``rows x N`` view of the
inputs; rows are addressed through :func:`row_offsets`, so any leading dims
and any strides work without a copy.  The bias is broadcast along rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._activations import GELU, SILU, apply_activation, gelu_code
from ._launch import Plan, output_like, planned
from ._rows import check_tensors, next_pow2, row_layout, row_offsets

# About 4K elements a program: enough bytes in flight per SM on a GPU, and
# few programs under the interpreter.
TILE_ELEMENTS = 4096
MAX_BLOCK_N = 1024


@triton.jit
def bias_act_kernel(
    x_ptr, r_ptr, b_ptr, y_ptr,
    M, N, D1, D2,
    sx0, sx1, sx2, sxn,
    sr0, sr1, sr2, srn,
    sbn,
    ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]

    # h = x + r + b, in float32
    x_offs = row_offsets(rows, D1, D2, sx0, sx1, sx2, 1)[:, None] + cols[None, :] * sxn
    h = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_offs = row_offsets(rows, D1, D2, sr0, sr1, sr2, 1)[:, None] + cols[None, :] * srn
        h += tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols * sbn, mask=cols < N, other=0.0).to(tl.float32)
    h += b[None, :]

    # y = act(h), rounded once to the output dtype; the output is contiguous
    y = apply_activation(h, ACTIVATION)
    y_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _bias_act(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor, activation: int
) -> torch.Tensor:
    """Plan (once per input layout, see ``_launch.py``), allocate and launch."""
    plan = planned((op, activation), (x, residual, bias), _plan, op, x, residual, bias, activation)
    y = output_like(x, plan)
    if plan is not None:
        plan.launch(x, x if residual is None else residual, bias, y)  # R is never read without a residual
    return y


def _plan(op: str, x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor,
          activation: int) -> Plan | None:
    """Check the inputs and choose the grid and tile; None when there is nothing to launch."""
    tensors = {"x": x, "bias": bias} if residual is None else {"x": x, "residual": residual, "bias": bias}
    check_tensors(op, **tensors)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have a hidden (last) dim, got a 0-d tensor")
    n = x.shape[-1]
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"{op}: bias must be 1-D of the hidden size {n}, got {tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    if x.numel() == 0:
        return None
    layout = row_layout(x.shape, *((x,) if residual is None else (x, residual)))
    sx = layout.strides[0]
    sr = layout.strides[1] if residual is not None else sx
    block_n = min(next_pow2(n), MAX_BLOCK_N)
    block_m = min(next_pow2(layout.rows), max(1, TILE_ELEMENTS // block_n))
    grid = (triton.cdiv(layout.rows, block_m), triton.cdiv(n, block_n))
    return Plan(
        bias_act_kernel, grid, layout.rows, n, layout.dims[1], layout.dims[2], *sx, *sr, bias.stride(0),
        ACTIVATION=activation, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=8 if block_m * block_n >= 4096 else 4,
    )


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` in one launch."""
    return _bias_act("bias_gelu", x, None, bias, gelu_code(approximate))


def bias_silu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.silu(x + bias)`` in one launch."""
    return _bias_act("bias_silu", x, None, bias, SILU)


def residual_bias_gelu(x: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x + residual + bias)`` in one launch."""
    if residual.shape != x.shape:
        raise ValueError(
            f"residual_bias_gelu: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )
    return _bias_act("residual_bias_gelu", x, residual, bias, GELU)
