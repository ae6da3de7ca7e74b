"""Plain attention pieces shared by the planted attention kernels (torch code).

They compute in float64 and round once, so that the only thing wrong with a
planted kernel is its planted bug.
"""

import math

import torch


def scores(q, k, scale):
    """``(B, H, Sq, Sk)`` scores in float64; k already has q's heads."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale


def top_left_causal(sq, sk, device):
    """Query i sees keys 0..i, as SDPA's is_causal does (also when Sq != Sk)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def attend(s, v, mask=None):
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double())
