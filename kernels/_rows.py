"""Row addressing shared by every row-wise kernel: any leading dims, any strides.

Every op of the catalog works on the last dim ("a row") of tensors shaped
``(..., N)``.  The inputs may be strided views: rows padded then sliced, a
transposed tensor whose last dim is not unit-stride, an expanded (stride-0)
dim, a storage offset.  Copying them to contiguous memory would cost a launch
and a round trip through memory, so the kernels address them in place.

The host side (:func:`row_layout`) folds the leading dims into at most three
(``D0, D1, D2``), merging neighbours only where *every* tensor allows it, and
hands each tensor's strides for those three dims plus its column stride to the
kernel.  Inside a kernel :func:`row_offsets` turns flat row indices back into
element offsets::

    row r  ->  (i0, i1, i2) = (r // (D1*D2), (r // D2) % D1, r % D2)
    offset =  i0*S0 + i1*S1 + i2*S2

Triton specialises integer arguments equal to 1, so a contiguous last dim
(column stride 1) still gets vectorised loads.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_LEADING_DIMS = 3


class RowLayout(NamedTuple):
    """Leading dims folded to three, and per tensor ``(S0, S1, S2, SN)`` strides."""

    rows: int
    dims: tuple[int, int, int]
    strides: tuple[tuple[int, int, int, int], ...]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensors(op: str, **tensors: torch.Tensor) -> None:
    """Raise a clear error for inputs no reference kernel can take.

    All tensors must be floating point of one supported dtype, on one device,
    and on a CUDA device unless Triton's interpreter is on.
    """
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but {first_name} is {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}")
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"{op}: {name} is on {t.device}; the Triton kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 to run them on the CPU)"
            )


def row_layout(shape: torch.Size | tuple[int, ...], *tensors: torch.Tensor) -> RowLayout:
    """Fold the leading dims of ``shape`` (shared by ``tensors``) into three.

    Each tensor must have exactly ``shape`` (a 1-D tensor of the hidden size is
    a "vector" and is not passed here).  Two neighbouring leading dims merge
    when, for every tensor, the outer stride equals inner stride times inner
    size, which is exactly when one flat index can walk both.
    """
    for t in tensors:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"expected shape {tuple(shape)}, got {tuple(t.shape)}")
    sizes = list(shape[:-1])
    strides = [list(t.stride()[:-1]) for t in tensors]
    i = len(sizes) - 2
    while i >= 0:
        if sizes[i] == 1 or sizes[i + 1] == 1 or all(
            s[i] == s[i + 1] * sizes[i + 1] for s in strides
        ):
            # size-1 dims merge with anything; keep the stride of the non-trivial one
            for s in strides:
                s[i] = s[i + 1] if sizes[i] == 1 else s[i] if sizes[i + 1] == 1 else s[i + 1]
            sizes[i] *= sizes[i + 1]
            del sizes[i + 1]
            for s in strides:
                del s[i + 1]
        i -= 1
    if len(sizes) > MAX_LEADING_DIMS:
        raise NotImplementedError(
            f"leading dims {tuple(shape[:-1])} with these strides fold to {len(sizes)} "
            f"independent dims; the kernels address at most {MAX_LEADING_DIMS}"
        )
    pad = MAX_LEADING_DIMS - len(sizes)
    sizes = [1] * pad + sizes
    rows = 1
    for n in sizes:
        rows *= n
    per_tensor = tuple(
        (*tuple([0] * pad + s), t.stride(-1)) for s, t in zip(strides, tensors)
    )
    return RowLayout(rows, (sizes[0], sizes[1], sizes[2]), per_tensor)  # type: ignore[arg-type]


@triton.jit
def row_offsets(rows, D1, D2, S0, S1, S2):
    """Element offset of the first element of each row in ``rows`` (int64)."""
    rows = rows.to(tl.int64)
    i2 = rows % D2
    rest = rows // D2
    return (rest // D1) * S0 + (rest % D1) * S1 + i2 * S2


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
