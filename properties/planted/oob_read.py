"""An rms_norm right in every output that reads past the end of its input (properties/test_sanitize.py).

The row load has no mask: each program reads a whole power-of-two block, and
``tl.where`` drops the extra values, so numerics hold while the last row reads
``BLOCK_N - N`` elements past the allocation.  Only a memory checker sees it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_oob_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)  # the bug: no mask=inside
    x = tl.where(inside, x, 0.0)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(y_ptr + row * N + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=inside)


def rms_norm(x, weight, eps=1e-6):
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()  # its own allocation of exactly rows * N elements
    y = torch.empty_like(rows)
    rms_norm_oob_kernel[(rows.shape[0],)](rows, weight.contiguous(), y, n, eps, BLOCK_N=triton.next_power_of_2(n))
    return y.reshape(x.shape)
