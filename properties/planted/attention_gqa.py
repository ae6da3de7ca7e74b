"""Bug: query head h reads kv head h % Hkv instead of h // (H / Hkv) (grouped-query mapping wrong)."""

import torch
from _planted_attention import attend, scores, top_left_causal


def attention(q, k, v, causal=False, scale=None):
    h, hkv = q.shape[1], k.shape[1]
    index = torch.arange(h, device=q.device) % hkv  # BUG: should be arange(h) // (h // hkv)
    k, v = k[:, index], v[:, index]
    mask = top_left_causal(q.shape[2], k.shape[2], q.device) if causal else None
    return attend(scores(q, k, scale), v, mask).to(q.dtype)
