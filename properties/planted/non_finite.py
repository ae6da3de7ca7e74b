"""Kernels right on finite inputs and wrong on the non-finite ones real models feed them (properties/test_audit.py)."""

import torch

TILE = 1024  # the online softmax's block of columns


def softmax_zero_on_masked_rows(x, scale=1.0):
    """A fully masked row returned as zeros (a convention some attention kernels take); eager gives NaN."""
    y = torch.softmax(x.float() * scale, dim=-1)
    return torch.where(torch.isneginf(x).all(dim=-1, keepdim=True), 0.0, y).to(x.dtype)


def softmax_online_unsafe_max(x, scale=1.0):
    """The textbook online softmax without a guard: a whole tile of -inf before any finite logit gives NaN."""
    z = x.float() * scale
    m = torch.full((*z.shape[:-1], 1), -torch.inf, device=z.device)
    d = torch.zeros_like(m)
    for start in range(0, z.shape[-1], TILE):
        block = z[..., start:start + TILE]
        m_new = torch.maximum(m, block.amax(dim=-1, keepdim=True))
        d = d * torch.exp(m - m_new) + torch.exp(block - m_new).sum(dim=-1, keepdim=True)
        m = m_new
    return (torch.exp(z - m) / d).to(x.dtype)


def rms_norm_hides_nan(x, weight, eps=1e-6):
    """NaN inputs zeroed before the norm: a diverging model's NaN disappears (eager propagates it)."""
    xf = torch.nan_to_num(x.double(), nan=0.0)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y.to(x.dtype)
