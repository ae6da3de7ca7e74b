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


def _qkv(device: str, *, offset: int = 0, dtype: torch.dtype = torch.bfloat16, d: int = 128, sk: int = 45):
    """q (B, H, Sq, D) and k, v slices of one fused (B, Sk, 2, Hkv, D) projection; ``offset`` shifts k/v's storage."""
    g = torch.Generator().manual_seed(11 + offset)
    B, H, Hkv, Sq, Sk = 2, 4, 2, 37, sk
    q = torch.randn(B, Sq, H, d, generator=g).to(device, dtype).transpose(1, 2)
    kv = torch.randn(B * Sk * 2 * Hkv * d + offset, generator=g).to(device, dtype)[offset:].view(B, Sk, 2, Hkv, d)
    return q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def _both(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setenv("FUSEAUDIT_AUTOTUNE", "0")  # one config for both paths
    monkeypatch.setenv("FUSEAUDIT_ATTENTION_WS", "0")  # the kernel these two paths share
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


@pytest.mark.parametrize("sk", [128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_warp_specialized_path(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch, sk: int, dtype: str) -> None:
    """Hopper's warp-specialised kernel (two half blocks, on-device descriptors) against float64.

    Non-causal only, ``Sk`` a multiple of 128 (the path has no masks); ``Sq`` ragged.

    The interpreter runs the same kernel, so the CPU checks its arithmetic;
    the GPU run checks what the compiler made of it.
    """
    from fuseaudit.case import Case, materialize
    from fuseaudit.catalog import OPS
    from fuseaudit.check import run_case
    from fuseaudit.kernels._rows import interpreting

    if fuseaudit_device != "cpu" and (
        torch.cuda.get_device_capability()[0] != 9 or not attn._hopper_warp_specialization()
    ):
        pytest.skip("the warp-specialised path is for Hopper with Triton >= 3.5")
    monkeypatch.setenv("FUSEAUDIT_ATTENTION_GLUON", "0")  # which would take these cases first
    sq = 37 if fuseaudit_device == "cpu" else 333
    case = Case("attention", dtype, {"B": 2, "H": 4, "Hkv": 2, "Sq": sq, "Sk": sk, "D": 128},
                {"q": "contiguous", "k": "expanded", "v": "contiguous"}, "normal",
                {"causal": False, "scale": None}, seed=5)
    q, k, v = (t for t in materialize(case, fuseaudit_device).values())
    assert attn._use_warp_specialize(q, k, v, False, interpreting(), causal=False), "this case must take the path"
    report = run_case(OPS["attention"], attn.attention, case, device=fuseaudit_device, target="attention[ws]")
    assert report.passed, report.failures[0].message


def test_warp_specialized_path_is_chosen_where_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half precision, D = 128, non-causal prefill, q/k/v the copy engine reads; elsewhere a ws config is an error."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the check below reaches the launch only under the interpreter
    q, k, v = _qkv("cpu", sk=128)
    assert attn._use_warp_specialize(q, k, v, False, True, causal=False)
    assert not attn._use_warp_specialize(q, k, v, False, True, causal=True), "causal keeps the other kernel"
    _, k45, v45 = _qkv("cpu", sk=45)
    assert not attn._use_warp_specialize(q, k45, v45, False, True, causal=False), "ragged keys keep the other kernel"
    assert not attn._use_warp_specialize(q, k, v, True, True, causal=False), "decoding keeps the split-K kernel"
    assert not attn._use_warp_specialize(q[:, :, :8], k, v, False, True, causal=False), "fewer rows than a block"
    assert not attn._use_warp_specialize(q.float(), k.float(), v.float(), False, True, causal=False)
    q64, k64, v64 = _qkv("cpu", d=64, sk=128)
    assert not attn._use_warp_specialize(q64, k64, v64, False, True, causal=False), "measured at D = 128 only"
    _, k_off, v_off = _qkv("cpu", offset=1, sk=128)
    assert not attn._use_warp_specialize(q, k_off, v_off, False, True, causal=False), "misaligned k/v"
    with pytest.raises(ValueError, match="warp-specialised config"):
        attn.attention_with_config(q, k, v, causal=True, config=attn._WS_CONFIGS[0])
    with pytest.raises(ValueError, match="warp-specialised config"):
        attn.attention_with_config(q, k45, v45, causal=False, config=attn._WS_CONFIGS[0])


def test_warp_specialized_path_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv("cpu", sk=128)
    assert attn._use_warp_specialize(q, k, v, False, True, causal=False)
    monkeypatch.setenv("FUSEAUDIT_ATTENTION_WS", "0")
    assert not attn._use_warp_specialize(q, k, v, False, True, causal=False)


needs_gluon = pytest.mark.skipif(attn.attention_hopper is None, reason="this Triton has no Gluon Hopper API")


@needs_gluon
def test_gluon_scope() -> None:
    """Half-precision prefill at D = 128, scale >= 0, q/k/v the copy engine reads, Sq >= 128: causal or not, any Sk."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 160, 128, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 45, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    assert attn._gluon_scope(q, k, v, False, causal=False, scale=0.1), "ragged keys and grouped-query are in scope"
    assert attn._gluon_scope(q.half(), k.half(), v.half(), False, causal=False, scale=0.1)
    assert not attn._gluon_scope(q, k, v, False, causal=False, scale=-0.1), "a negative scale takes the other kernels"
    assert not attn._gluon_scope(q, k, v, True, causal=False, scale=0.1), "decoding keeps the split-K kernel"
    assert not attn._gluon_scope(q[:, :, :100], k, v, False, causal=False, scale=0.1), "fewer queries than a block"
    assert not attn._gluon_scope(q.float(), k.float(), v.float(), False, causal=False, scale=0.1), "float32"
    assert not attn._gluon_scope(q[..., :64], k[..., :64], v[..., :64], False, causal=False, scale=0.1), "D = 128"
    assert not attn._gluon_scope(q, k[:, :, :0], v[:, :, :0], False, causal=False, scale=0.1), "no keys"
    _, k_off, v_off = _qkv("cpu", offset=1, sk=45)
    assert not attn._gluon_scope(q, k_off, v_off, False, causal=False, scale=0.1), "misaligned k/v"
    assert not attn._gluon_scope(q, k, v, False, causal=True, scale=0.1), "causal with few keys: the general kernel"
    long_q, long_k = (torch.zeros(1, 1, n, 128, dtype=torch.bfloat16) for n in (1024, 2048))
    assert attn._gluon_scope(long_q, long_k, long_k, False, causal=True, scale=0.1)
    assert not attn._gluon_scope(long_k, long_q[:, :, :1000], long_q[:, :, :1000], False, causal=True, scale=0.1)
    assert not attn._use_gluon(q, k, v, False, False, causal=False, scale=0.1), "never on the CPU (no interpreter)"


def _gluon_or_skip(fuseaudit_device: str) -> None:
    if fuseaudit_device == "cpu":
        pytest.skip("Gluon kernels run on the GPU only (test_compile_attention_hopper compiles it on the CPU)")
    if torch.cuda.get_device_capability()[0] != 9 or not attn.gluon_verified():
        pytest.skip("the Gluon kernel runs on Hopper with the Triton releases it was verified on")


@needs_gluon
@pytest.mark.parametrize(
    ("causal", "sq", "sk", "hkv", "layout", "dtype", "regime"),
    [
        (True, 1100, 1100, 2, "contiguous", "bfloat16", "normal"),  # causal takes it from 1024 keys
        (False, 333, 517, 2, "contiguous", "float16", "normal"),
        (True, 1030, 2000, 1, "contiguous", "bfloat16", "normal"),  # Sq < Sk: top-left aligned
        (True, 2000, 1030, 4, "contiguous", "float16", "normal"),  # Sq > Sk: rows past Sk see every key
        (False, 128, 1, 4, "contiguous", "bfloat16", "normal"),  # one key
        (True, 1200, 1200, 2, "expanded", "bfloat16", "normal"),  # stride-0 batch
        (False, 256, 384, 4, "expanded", "float16", "normal"),
        (True, 1100, 1100, 2, "contiguous", "float16", "large"),  # scores far past fp16's range
        (False, 333, 700, 2, "contiguous", "bfloat16", "shifted"),  # a large common offset on every key
        (True, 1100, 1300, 4, "contiguous", "bfloat16", "outliers"),
        (False, 200, 200, 1, "contiguous", "float16", "near_constant"),
    ],
)
def test_gluon_path(fuseaudit_device: str, causal: bool, sq: int, sk: int, hkv: int, layout: str,
                    dtype: str, regime: str) -> None:
    """The Gluon kernel against float64 (GPU), in the property suite's value regimes.

    Ragged queries and keys, causal with Sq != Sk, grouped-query, a stride-0 batch.
    """
    from fuseaudit.case import Case, materialize
    from fuseaudit.catalog import OPS
    from fuseaudit.check import run_case

    _gluon_or_skip(fuseaudit_device)
    case = Case("attention", dtype, {"B": 2, "H": 4, "Hkv": hkv, "Sq": sq, "Sk": sk, "D": 128},
                {"q": layout, "k": layout, "v": "contiguous"}, regime,
                {"causal": causal, "scale": None}, seed=9)
    q, k, v = (t for t in materialize(case, fuseaudit_device).values())
    assert attn._use_gluon(q, k, v, False, False, causal=causal, scale=1.0), "this case must take the Gluon path"
    report = run_case(OPS["attention"], attn.attention, case, device=fuseaudit_device, target="attention[gluon]")
    assert report.passed, report.failures[0].message


def _via_fused_projection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          scale: float | None = None) -> torch.Tensor:
    """``attention`` on q from ``(B, S, H, D)`` transposed and k, v slices of one ``(B, Sk, 2, Hkv, D)`` projection."""
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    q_bshd = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    q_bshd.copy_(q)
    kv = torch.empty(B, Sk, 2, Hkv, D, dtype=k.dtype, device=k.device)
    kv[:, :, 0] = k.transpose(1, 2)
    kv[:, :, 1] = v.transpose(1, 2)
    k_view, v_view = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert attn._use_gluon(q_bshd, k_view, v_view, False, False, causal=causal, scale=1.0), "must take the Gluon path"
    return attn.attention(q_bshd, k_view, v_view, causal=causal, scale=scale)


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_path_on_slices_of_a_fused_projection(fuseaudit_device: str, causal: bool) -> None:
    """q as ``(B, S, H, D)`` transposed, k and v slices of one fused projection (GPU), against float64."""
    from fuseaudit.case import Case
    from fuseaudit.catalog import OPS
    from fuseaudit.check import run_case

    _gluon_or_skip(fuseaudit_device)
    case = Case("attention", "bfloat16", {"B": 2, "H": 8, "Hkv": 2, "Sq": 1088, "Sk": 1088, "D": 128},
                {"q": "contiguous", "k": "contiguous", "v": "contiguous"}, "normal",
                {"causal": causal, "scale": None}, seed=4)
    report = run_case(OPS["attention"], _via_fused_projection, case, device=fuseaudit_device,
                      target="attention[gluon, fused projection]")
    assert report.passed, report.failures[0].message


@needs_gluon
def test_gluon_path_is_one_launch(fuseaudit_device: str) -> None:
    """The Gluon path launches one kernel, as the catalog says of attention (counted by the profiler)."""
    from fuseaudit.catalog import OPS
    from fuseaudit.launches import count_launches

    _gluon_or_skip(fuseaudit_device)
    q, k, v = (torch.randn(2, 4, 1024, 128, device=fuseaudit_device, dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        assert attn._use_gluon(q, k, v, False, False, causal=causal, scale=1.0)
        launches = count_launches(attn.attention, q, k, v, device=fuseaudit_device, causal=causal)
        assert launches.count == OPS["attention"].launches, launches.describe()
