"""A softmax that only takes rows of at most 8 elements and raises on wider ones.

``softmax`` declares that limit per input (``fuseaudit_supports``): the audit
skips wider cases and passes.  ``softmax_undeclared`` raises the same way
without saying so: raising on an input it claims to take fails ``runs``.
"""

import torch


def _softmax(x, scale=1.0):
    if x.shape[-1] > 8:
        raise ValueError(f"rows of {x.shape[-1]} elements: at most 8 are supported")
    return torch.softmax(x * scale, dim=-1)


def softmax(x, scale=1.0):
    return _softmax(x, scale)


def _supports(x, scale=1.0):
    return None if x.shape[-1] <= 8 else f"rows wider than 8 elements ({x.shape[-1]})"


softmax.fuseaudit_supports = _supports


def softmax_undeclared(x, scale=1.0):
    return _softmax(x, scale)
