"""Tiled attention with an online softmax over blocks of keys (FlashAttention's loop, in torch).

Computed in float64 and rounded once.  ``rescaled`` is correct.  ``no_rescale`` has the classic bug: when a later
block raises the running max, the running sum is rescaled but the output
accumulator is not, so every key block after the first is weighted wrongly.
"""

import math

import torch

BLOCK_K = 16


def _online(q, k, v, causal, scale, rescale_acc):
    dtype = q.dtype
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    q = q.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    sq, sk = q.shape[2], k.shape[2]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    total = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    acc = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    rows = torch.arange(sq, device=q.device)[:, None]
    for start in range(0, sk, BLOCK_K):
        kb, vb = k[:, :, start:start + BLOCK_K], v[:, :, start:start + BLOCK_K]
        s = torch.matmul(q, kb.transpose(-1, -2)) * scale
        if causal:  # top-left: query i sees keys 0..i
            cols = torch.arange(start, start + kb.shape[2], device=q.device)[None, :]
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a fully masked row so far
        p = torch.exp(s - safe[..., None])
        alpha = torch.exp(m - safe)
        total = total * alpha + p.sum(dim=-1)
        if rescale_acc:
            acc = acc * alpha[..., None]
        acc = acc + torch.matmul(p, vb)  # no_rescale: BUG, acc still weighted by the old max
        m = m_new
    return (acc / total[..., None]).to(dtype)


def rescaled(q, k, v, causal=False, scale=None):
    return _online(q, k, v, causal, scale, rescale_acc=True)


def no_rescale(q, k, v, causal=False, scale=None):
    return _online(q, k, v, causal, scale, rescale_acc=False)
