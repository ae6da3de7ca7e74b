"""Bug: the causal mask is aligned bottom-right (query i sees keys up to i + Sk - Sq), not top-left as in SDPA."""

import torch
from _planted_attention import attend, scores


def attention(q, k, v, causal=False, scale=None):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    s = scores(q, k, scale)
    sq, sk = q.shape[2], k.shape[2]
    mask = None
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)  # BUG: bottom-right
    return attend(s, v, mask).to(q.dtype)
