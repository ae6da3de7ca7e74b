"""Bug: the grid rounds N / BLOCK down, so the last partial block of every row is never written."""

import torch
import triton
import triton.language as tl
from _planted_rows import leading, row_start

BLOCK = 256


@triton.jit
def swiglu_tail_kernel(g_ptr, u_ptr, y_ptr, N,
                       gD1, gD2, gS0, gS1, gS2, gSN,
                       uD1, uD2, uS0, uS1, uS2, uSN,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row_start(row, gD1, gD2, gS0, gS1, gS2) + cols * gSN, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + row_start(row, uD1, uD2, uS0, uS1, uS2) + cols * uSN, mask=mask).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row.to(tl.int64) * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def swiglu(gate, up):
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1]
    if y.numel() == 0:
        return y
    grid = (y.numel() // n, n // BLOCK)  # BUG: should be triton.cdiv(n, BLOCK)
    if grid[1]:
        swiglu_tail_kernel[grid](gate, up, y, n, *leading(gate), gate.stride(-1), *leading(up), up.stride(-1),
                                 BLOCK=BLOCK)
    return y
