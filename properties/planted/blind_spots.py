"""rms_norm kernels wrong only where a random search seldom looks (properties/test_audit.py).

Each is right everywhere else; the edge phase of a default audit must catch
every one of them.
"""

import torch


def _rms(x, weight, eps):
    xf = x.to(torch.float64)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float64)).to(x.dtype)


def nan_on_zero_rows(x, weight, eps=1e-6):
    """NaN on an all-zero row, as a kernel that drops eps gives (0 * rsqrt(0)); right on every other row."""
    y = _rms(x, weight, eps)
    return torch.where((x == 0).all(dim=-1, keepdim=True), torch.nan, y)


def wrong_past_64_rows(x, weight, eps=1e-6):
    y = _rms(x, weight, eps)
    rows = y.reshape(-1, y.shape[-1])
    rows[64:] *= 2
    return rows.reshape(y.shape)


def wrong_past_5000(x, weight, eps=1e-6):
    y = _rms(x, weight, eps)
    return y * 2 if x.shape[-1] > 5000 else y


def raises_past_65536(x, weight, eps=1e-6):
    if x.shape[-1] > 65536:
        raise ValueError(f"rows of {x.shape[-1]} elements are not supported")
    return _rms(x, weight, eps)


def wrong_in_the_last_row(x, weight, eps=1e-6):
    y = _rms(x, weight, eps)
    rows = y.reshape(-1, y.shape[-1])
    if rows.shape[0] > 1:
        rows[-1] = -rows[-1]
    return rows.reshape(y.shape)


def wrong_with_storage_offsets(x, weight, eps=1e-6):
    y = _rms(x, weight, eps)
    return y * 2 if x.storage_offset() or weight.storage_offset() else y
