"""Every autotuning config of the attention kernel computes the right thing (GPU).

The property suite runs the attention kernel with ``FUSEAUDIT_AUTOTUNE=0`` to
keep compile time bounded; this test covers the configs the autotuner may pick
instead, each on a prefill or decode case with ragged sizes, causal and
grouped-query.  Which configs the autotuner is offered for a shape is checked
on the CPU too.
"""

from __future__ import annotations

import functools

import pytest

from fuseaudit.case import Case
from fuseaudit.catalog import OPS
from fuseaudit.check import run_case


def _configs():
    from fuseaudit.kernels import attention as attn

    return [("prefill", c) for c in attn._PREFILL_CONFIGS] + [("decode", c) for c in attn._DECODE_CONFIGS]


@pytest.mark.fuseaudit_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_every_config(fuseaudit_device, dtype, head_dim):
    from fuseaudit.kernels.attention import attention_with_config

    spec = OPS["attention"]
    failures = []
    for kind, config in _configs():
        sq = 1 if kind == "decode" else 333
        for causal in (False, True):
            case = Case("attention", dtype, {"B": 2, "H": 8, "Hkv": 2, "Sq": sq, "Sk": 517, "D": head_dim},
                        {"q": "contiguous", "k": "transposed", "v": "padded"}, "normal",
                        {"causal": causal and kind == "prefill", "scale": None}, seed=7)
            impl = functools.partial(attention_with_config, config=config)
            report = run_case(spec, impl, case, device=fuseaudit_device, target=f"attention[{config}]")
            if not report.passed and "OutOfResources" in report.failures[0].message:
                continue  # too large for this head dim: the autotuner drops it the same way
            if not report.passed:
                failures.append(f"{kind} {config}: {report.failures[0].message}")
    assert not failures, "\n".join(failures)


@pytest.mark.fuseaudit_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_warp_specialized_config(fuseaudit_device, dtype):
    """Each config of the Hopper warp-specialised kernel (non-causal), ragged queries and grouped-query (GPU)."""
    import torch

    from fuseaudit.kernels import attention as attn

    if torch.cuda.get_device_capability()[0] != 9 or not attn._hopper_warp_specialization():
        pytest.skip("the warp-specialised path is for Hopper with Triton >= 3.5")
    spec = OPS["attention"]
    failures = []
    for config in attn._WS_CONFIGS:
        for sq, sk in ((333, 512), (517, 384), (256, 128)):
            # q and k broadcast over the batch (stride 0), v contiguous: all readable by the copy engine
            case = Case("attention", dtype, {"B": 2, "H": 8, "Hkv": 2, "Sq": sq, "Sk": sk, "D": 128},
                        {"q": "expanded", "k": "expanded", "v": "contiguous"}, "normal",
                        {"causal": False, "scale": None}, seed=7)
            impl = functools.partial(attn.attention_with_config, config=config)
            report = run_case(spec, impl, case, device=fuseaudit_device, target=f"attention[{config}]")
            if not report.passed:
                failures.append(f"{config} Sq={sq} Sk={sk}: {report.failures[0].message}")
    assert not failures, "\n".join(failures)


def test_configs_offered_per_shape():
    import torch

    from fuseaudit.kernels import attention as attn

    def offered(block_d, dtype, keys):
        q = torch.empty(1, 1, 1, block_d, dtype=dtype)
        return attn._prune(attn._PREFILL_CONFIGS, {"BLOCK_D": block_d, "Q": q, "KEYS_BUCKET": keys})

    def two_blocks(configs):
        return [c for c in configs if attn._tile(c) in attn._TWO_BLOCKS]

    assert len(attn._TWO_BLOCKS) == 2 == len(two_blocks(attn._PREFILL_CONFIGS))
    # two blocks per SM from _TWO_BLOCKS_MIN_KEYS keys on, both half dtypes, D up to 128
    for dtype in (torch.bfloat16, torch.float16):
        for block_d in (64, 128):
            assert two_blocks(offered(block_d, dtype, attn._TWO_BLOCKS_MIN_KEYS)) == two_blocks(attn._PREFILL_CONFIGS)
            assert not two_blocks(offered(block_d, dtype, attn._TWO_BLOCKS_MIN_KEYS // 2))
    # a register cap never where the accumulator cannot fit under it
    for block_d, dtype in ((256, torch.bfloat16), (128, torch.float32), (64, torch.float32)):
        assert not [c for c in offered(block_d, dtype, 1 << 16) if c.maxnreg]
    # the fixed-config path (no keys given) keeps the first config, uncapped
    fixed = attn._prune(attn._PREFILL_CONFIGS, {"BLOCK_D": 128, "Q": torch.empty(1, dtype=torch.bfloat16)})
    assert fixed[0] is attn._PREFILL_CONFIGS[0] and not fixed[0].maxnreg
