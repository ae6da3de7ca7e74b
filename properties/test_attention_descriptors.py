"""The attention kernel's tensor-descriptor path for K and V: taken where the copy engine can read them, right.

Prefill at ``D = 128`` in half precision reads K and V through tensor
descriptors when their layout allows (unit stride in ``D``, 16-byte aligned
base and strides); anything else keeps the pointer loads.  Both paths compute
the same tiles in the same order, so with one fixed config they agree bitwise.
"""

from __future__ import annotations

import pytest
import torch
from fuseaudit.kernels import attention as attn


def _qkv(device: str, *, offset: int = 0, dtype: torch.dtype = torch.bfloat16, d: int = 128):
    """q (B, H, Sq, D) and k, v slices of one fused (B, Sk, 2, Hkv, D) projection; ``offset`` shifts k/v's storage."""
    g = torch.Generator().manual_seed(11 + offset)
    B, H, Hkv, Sq, Sk = 2, 4, 2, 37, 45
    q = torch.randn(B, Sq, H, d, generator=g).to(device, dtype).transpose(1, 2)
    kv = torch.randn(B * Sk * 2 * Hkv * d + offset, generator=g).to(device, dtype)[offset:].view(B, Sk, 2, Hkv, d)
    return q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def _both(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setenv("FUSEAUDIT_AUTOTUNE", "0")  # one config for both paths
    monkeypatch.setenv("FUSEAUDIT_ATTENTION_TMA", "1")
    with_desc = attn.attention(q, k, v, causal=causal)
    monkeypatch.setenv("FUSEAUDIT_ATTENTION_TMA", "0")
    plain = attn.attention(q, k, v, causal=causal)
    return with_desc, plain


@pytest.mark.parametrize("causal", [False, True])
def test_descriptor_path_equals_pointer_path(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch,
                                             causal: bool) -> None:
    """The pointer path is the one the property suite checks against float64; this one must equal it."""
    q, k, v = _qkv(fuseaudit_device)
    assert attn._descriptor(k, 128) is not None, "an aligned slice of a fused projection must take descriptors"
    with_desc, plain = _both(q, k, v, causal, monkeypatch)
    assert torch.equal(with_desc, plain), "descriptor and pointer loads must give the same tiles"


def test_misaligned_and_other_head_dims_keep_pointer_loads(fuseaudit_device: str) -> None:
    q, k, _ = _qkv(fuseaudit_device, offset=1)  # k/v's base one element off 16 bytes
    assert attn._descriptor(k, 128) is None, "a base off 16 bytes cannot be a descriptor"
    assert attn._descriptor(k[..., ::2], 64) is None, "non-unit stride in D cannot be a descriptor"
    q64, _, _ = _qkv(fuseaudit_device, d=64)
    assert not attn._use_descriptors(q64, False, True), "D = 64 measured faster with pointer loads"
    assert not attn._use_descriptors(q.float(), False, True), "float32 keeps pointer loads"
    assert not attn._use_descriptors(q, True, True), "decoding keeps pointer loads"
