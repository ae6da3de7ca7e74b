"""Row addressing for the planted Triton kernels: a row of a strided ``(..., N)`` tensor.

Up to three leading dims (``D0, D1, D2``) with strides ``S0, S1, S2``; row
``r`` starts at ``(r // (D1*D2))*S0 + ((r // D2) % D1)*S1 + (r % D2)*S2``.
"""

import triton
import triton.language as tl


def leading(t):
    """``(D1, D2, S0, S1, S2)`` of ``t``'s leading dims, padded to three."""
    if t.dim() > 4:
        raise NotImplementedError("at most three leading dims")
    sizes = [1] * (4 - t.dim()) + list(t.shape)
    strides = [0] * (4 - t.dim()) + list(t.stride())
    return sizes[1], sizes[2], strides[0], strides[1], strides[2]


@triton.jit
def row_start(row, D1, D2, S0, S1, S2):
    row = row.to(tl.int64)
    return (row // (D1 * D2)) * S0 + ((row // D2) % D1) * S1 + (row % D2) * S2
