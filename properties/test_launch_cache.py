"""The cached launcher of ``kernels/_launch.py``: same results as Triton's own path, never under the interpreter."""

from __future__ import annotations

import pytest
import torch
from fuseaudit.kernels import _launch
from fuseaudit.kernels.rms_norm import add_rms_norm, rms_norm


def _inputs(device: str, n: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + offset)
    x = torch.randn(8 * n + offset, generator=g).to(device, torch.bfloat16)[offset:].view(8, n)  # offset: misaligned
    r = torch.randn(8, n, generator=g).to(device, torch.bfloat16)
    w = torch.randn(n, generator=g).to(device, torch.bfloat16)
    return x, r, w


def test_interpreter_takes_tritons_path(fuseaudit_device: str) -> None:
    if fuseaudit_device != "cpu":
        pytest.skip("the interpreter runs on the CPU")
    _launch.clear_cache()
    x, _, w = _inputs("cpu", 40)
    rms_norm(x, w)
    assert not _launch._CACHE, "no compiled kernel exists under the interpreter: nothing may be cached"


@pytest.mark.fuseaudit_gpu
def test_cached_launches_equal_tritons_own(fuseaudit_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same compiled kernel either way, so bitwise equal, on new data and on misaligned views."""
    if not fuseaudit_device.startswith("cuda"):
        pytest.skip("the cached path exists on a GPU only")
    _launch.clear_cache()
    for offset in (0, 0, 1, 1, 0):  # repeats hit the cache; an odd offset misaligns x (another specialisation)
        x, r, w = _inputs(fuseaudit_device, 1000, offset=offset)
        cached = (rms_norm(x, w), *add_rms_norm(x, r, w))
        monkeypatch.setenv("FUSEAUDIT_FAST_LAUNCH", "0")
        plain = (rms_norm(x, w), *add_rms_norm(x, r, w))
        monkeypatch.delenv("FUSEAUDIT_FAST_LAUNCH")
        for a, b in zip(cached, plain):
            assert torch.equal(a, b), f"offset={offset}: the cached launch differs from Triton's own"
    assert len(_launch._CACHE) >= 4, "aligned and misaligned x must be cached apart, per kernel"
