"""Bug: x + bias is written back into x (a scratch buffer "saved"), then the activation is applied."""

import torch.nn.functional as F


def bias_gelu(x, bias, approximate="none"):
    try:
        h = x.add_(bias)  # BUG: modifies the caller's tensor
    except RuntimeError:  # torch refuses to write an expanded (overlapping) tensor in place
        h = x + bias
    return F.gelu(h, approximate=approximate)
