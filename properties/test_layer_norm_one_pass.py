"""layer_norm's one-pass statistics, on rows built to make one pass cancel.

Half-precision rows that a program takes alone get ``var = E[d^2] - E[d]^2``
with ``d = x - x0`` (one reduction), unless ``x0`` sits more than 4 standard
deviations from the mean, where that cancels and the kernel takes the exact
second reduction (see ``fuseaudit/kernels/layer_norm.py``).  These rows sit on both
sides of that switch and far past it; each must meet the tolerance policy,
and a constant row must give exactly the bias.  On a GPU, rows this wide are
one a program anyway; under the interpreter the tile is lowered to one row.
"""

from __future__ import annotations

import pytest
import torch

from fuseaudit.catalog import OPS
from fuseaudit.tolerance import compare

WIDTHS = (2048, 5000)


def _test_rows(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Float64 rows of ``n`` elements, by what they do to one-pass statistics."""
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    z = (z - z.mean()) / z.std(unbiased=False)  # mean 0, std 1 exactly (before rounding)

    def x0_at(k: float) -> torch.Tensor:  # x0 k standard deviations of the *other* elements from their mean
        row = z.clone()
        row[0] = k
        return row

    return {
        "normal": z,
        "x0 3.5 std out (one pass)": x0_at(3.5),
        "x0 4.5 std out (two passes)": x0_at(4.5),
        "x0 far out": x0_at(1000.0),
        "offset 100": 100.0 + z,
        "near constant": 1000.0 + 0.25 * torch.randint(0, 4, (n,), generator=gen).to(torch.float64),
        "constant": torch.full((n,), 3.0, dtype=torch.float64),
    }


def _inputs(op: str, rows: dict[str, torch.Tensor], gen: torch.Generator, device: str,
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The op's inputs: ``rows`` as x (and a small residual, so that h keeps each row's character), random vectors."""
    x = torch.stack(list(rows.values())).to(device, dtype)
    n = x.shape[-1]
    inputs = {"x": x}
    if op == "add_layer_norm":
        residual = 0.01 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
        inputs["residual"] = residual.to(device, dtype)
    inputs["weight"] = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(device, dtype)
    inputs["bias"] = (0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(device, dtype)
    return inputs


def _assert_meets_policy(op: str, got: object, inputs: dict[str, torch.Tensor], params: dict, rows: list[str],
                         label: str) -> None:
    """``got`` against the eager op and float64 under the tolerance policy; a constant row gives exactly the bias."""
    spec = OPS[op]
    y = got if op == "layer_norm" else got[0]
    eager = spec.run_eager(inputs, params)[0]
    oracle = spec.run_oracle(inputs, params)[0]
    cmp = compare("y", y, eager, oracle, dtype=inputs["x"].dtype, fallback_ulps=spec.fallback_ulps,
                  float32_scale=spec.float32_scale(inputs, params, oracle))
    assert cmp.passed, f"{op} {label}: {cmp.reason} (rows: {rows})"
    if op == "layer_norm":
        assert torch.equal(y[rows.index("constant")], inputs["bias"]), "a constant row must give exactly the bias"


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_one_pass_rows_meet_the_policy(op: str, dtype: torch.dtype, n: int, fuseaudit_device: str) -> None:
    from fuseaudit.kernels import _launch, _tuning, layer_norm
    from fuseaudit.kernels._tuning import RowConfig

    gen = torch.Generator().manual_seed(n)
    rows = _test_rows(n, gen)
    inputs = _inputs(op, rows, gen, fuseaudit_device, dtype)
    params = {"eps": 1e-5}
    with _launch.retuned(_tuning, INTERPRETER_TILE=1):  # one row a program
        got = layer_norm.with_config(op, RowConfig("whole", warps=8))(**inputs, **params)
    _assert_meets_policy(op, got, inputs, params, list(rows), f"{dtype} N={n}")


def _wide_rows(n: int, block: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The rows above, and rows whose first block is far from the rest (what a shift taken from it would cancel)."""
    rows = _test_rows(n, gen)
    z = rows["normal"]
    far = z.clone()
    far[:block] = 50.0
    rows["first block far out"] = far
    rows["first block far, rest constant"] = torch.cat([torch.full((block,), 7.0, dtype=torch.float64),
                                                        torch.full((n - block,), -1.0, dtype=torch.float64)])
    rows["offset 1e4, spread one ulp"] = 1e4 + 64.0 * torch.randint(0, 2, (n,), generator=gen).to(torch.float64)
    return rows


@pytest.mark.parametrize("ratio", ["shipped", "always exact", "never exact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(("op", "pass1"), [("layer_norm", "welford"), ("layer_norm", "shifted"),
                                           ("add_layer_norm", "chan")])
def test_looped_rows_meet_the_policy(op: str, pass1: str, dtype: torch.dtype, ratio: str,
                                     fuseaudit_device: str) -> None:
    """The looped pass 1 on rows of 40 blocks, near-constant and far-offset ones among them, meets the policy.
    layer_norm's ``welford`` (rows compiled for their width, ``RowConfig.fixed``): Welford in each lane, the lanes
    merged as sums about x0 or, x0 far out, by Chan's formula (float32: the row's mean, then M2 about it, whatever
    the ratio); its ``shifted`` (half-precision rows not compiled for their width): lane sums of ``x - k``, ``k``
    the first block's mean, or the exact fallback.  Under the interpreter, whose
    kernels read ``ONE_PASS_RATIO`` at each launch, either branch is forced.  add_layer_norm's pass 1 (Chan's merge
    of blocks) takes the same rows."""
    from fuseaudit.kernels import _launch, layer_norm
    from fuseaudit.kernels._tuning import RowConfig

    if ratio != "shipped" and (fuseaudit_device != "cpu" or op == "add_layer_norm"):
        pytest.skip("a compiled kernel keeps the ONE_PASS_RATIO it was compiled with; add_layer_norm has no switch")
    if pass1 == "shifted" and dtype == torch.float32:
        pytest.skip("float32 rows not compiled for their width take Chan's pass 1 (add_layer_norm's here)")
    forced = {"shipped": {}, "always exact": {"ONE_PASS_RATIO": -1.0}, "never exact": {"ONE_PASS_RATIO": 1e30}}[ratio]
    block = 128 // dtype.itemsize  # 64 half-precision elements, 32 float32
    n = 40 * block
    config = RowConfig("looped", warps=8, block_n=block, prefetch=1, fixed=pass1 == "welford")
    gen = torch.Generator().manual_seed(40)
    rows = _wide_rows(n, block, gen)
    inputs = _inputs(op, rows, gen, fuseaudit_device, dtype)
    params = {"eps": 1e-5}
    with _launch.retuned(layer_norm, **forced):
        got = layer_norm.with_config(op, config)(**inputs, **params)
    _assert_meets_policy(op, got, inputs, params, list(rows), f"{dtype} N={n}, {pass1}, {ratio}")
