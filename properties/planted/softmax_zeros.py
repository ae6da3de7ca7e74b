"""Bug: probabilities below 1e-3 are flushed to zero (a "sparse" shortcut a fixed atol=1e-3 would pass)."""

import torch


def softmax(x, scale=1.0):
    y = torch.softmax(x.double() * scale, dim=-1)
    y = torch.where(y < 1e-3, torch.zeros_like(y), y)  # BUG: tiny outputs returned as zeros
    return y.to(x.dtype)
