"""Bug: the sum of squares is accumulated in the input dtype: float16 squares overflow past |x| = 256."""

import torch


def rms_norm(x, weight, eps=1e-6):
    mean_sq = (x * x).sum(dim=-1, keepdim=True) / x.shape[-1]  # BUG: x * x in float16 is inf for |x| > 256
    y = x.double() * torch.rsqrt(mean_sq.double() + eps) * weight.double()
    return y.to(x.dtype)
