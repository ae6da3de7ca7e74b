"""Bug: rows assumed to lie N elements apart (padded, transposed or expanded inputs read the wrong memory)."""

import torch
import triton
import triton.language as tl


@triton.jit
def swiglu_rows_kernel(g_ptr, u_ptr, y_ptr, N, gSN, uSN, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * N + cols * gSN, mask=mask).to(tl.float32)  # BUG: row stride taken as N
    u = tl.load(u_ptr + row * N + cols * uSN, mask=mask).to(tl.float32)  # BUG: row stride taken as N
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu(gate, up):
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1]
    if y.numel() == 0:
        return y
    block = min(1024, triton.next_power_of_2(n))
    grid = (y.numel() // n, triton.cdiv(n, block))
    swiglu_rows_kernel[grid](gate, up, y, n, gate.stride(-1), up.stride(-1), BLOCK=block)
    return y
