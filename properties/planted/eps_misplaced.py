"""Bug: eps added after the reciprocal square root, rsqrt(mean) + eps, instead of rsqrt(mean + eps)."""

import torch


def rms_norm(x, weight, eps=1e-6):
    xf = x.double()
    mean_sq = xf.pow(2).mean(dim=-1, keepdim=True)
    y = xf * (torch.rsqrt(mean_sq) + eps) * weight.double()  # BUG: eps belongs inside the rsqrt
    return y.to(x.dtype)
