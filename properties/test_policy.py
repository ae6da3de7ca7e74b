"""The harness itself: tolerance policy, layouts, cases and row addressing.

These pin down behaviour the property suites rely on: a policy that passed
zeros or NaN, or layouts that were secretly contiguous, would make every other
test meaningless.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuseaudit.case import LAYOUTS, Case, materialize
from fuseaudit.catalog import OPS
from fuseaudit.check import storage_bytes
from fuseaudit.strategies import cases
from fuseaudit.tolerance import compare, ulp


def _softmax_rows(n: int, dtype: torch.dtype):
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    oracle = torch.softmax(x.double(), dim=-1)
    eager = torch.softmax(x, dim=-1)
    return oracle, eager


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_eager_itself_passes(dtype):
    oracle, eager = _softmax_rows(1000, dtype)
    assert compare("y", eager, eager, oracle, dtype=dtype, fallback_ulps=16).passed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tiny_outputs_returned_as_zeros_fail(dtype):
    oracle, eager = _softmax_rows(100_000, dtype)  # outputs around 1e-5
    cmp = compare("y", torch.zeros_like(eager), eager, oracle, dtype=dtype, fallback_ulps=16)
    assert not cmp.passed and cmp.rows_failed == 4


def test_one_ulp_off_in_float16_passes_but_a_few_percent_fails():
    oracle, eager = _softmax_rows(257, torch.float16)
    nudged = (eager.float() + ulp(torch.float16, eager.double()).float()).half()
    assert compare("y", nudged, eager, oracle, dtype=torch.float16, fallback_ulps=16).passed
    assert not compare("y", eager * 1.03, eager, oracle, dtype=torch.float16, fallback_ulps=16).passed


def test_nan_is_never_a_wildcard():
    oracle, eager = _softmax_rows(64, torch.float32)
    got = eager.clone()
    got[2, 5] = math.nan
    cmp = compare("y", got, eager, oracle, dtype=torch.float32, fallback_ulps=16)
    assert not cmp.passed and cmp.worst_index == (2, 5)
    # and the reverse: a finite value where the oracle is NaN (and eager too)
    oracle_nan, eager_nan = oracle.clone(), eager.clone()
    oracle_nan[1, 1] = eager_nan[1, 1] = math.nan
    assert not compare("y", eager, eager_nan, oracle_nan, dtype=torch.float32, fallback_ulps=16).passed


def test_broken_yardstick_falls_back_to_the_dtype_bound():
    oracle, eager = _softmax_rows(64, torch.float16)
    broken = torch.full_like(eager, math.inf)
    # a correct kernel passes against the fallback bound ...
    ok = compare("y", eager, broken, oracle, dtype=torch.float16, fallback_ulps=16)
    assert ok.passed and ok.yardstick == "fallback"
    # ... and a wrong one is not let through by the broken yardstick
    assert not compare("y", eager * 1.05, broken, oracle, dtype=torch.float16, fallback_ulps=16).passed


def test_a_kernel_equal_to_eager_in_geglus_float32_left_tail_passes_and_tanh_still_fails():
    spec = OPS["geglu"]
    gate = torch.linspace(-9.0, -4.0, 512).reshape(2, 256)  # GELU's left tail: 1 + erf cancels in float32
    up = torch.ones_like(gate)
    inputs, params = {"gate": gate, "up": up}, {"approximate": "none"}
    (eager,) = spec.run_eager(inputs, params)
    (oracle,) = spec.run_oracle(inputs, params)
    scale = spec.float32_scale(inputs, params, oracle)
    check = lambda got: compare("y", got, eager, oracle, dtype=torch.float32,
                                fallback_ulps=spec.fallback_ulps, float32_scale=scale)
    same = check(eager.clone())
    assert same.rows_eager_far > 0, "the test must be where eager is past the dtype budget"
    assert same.passed and same.yardstick == "eager_far", same.reason
    # tanh where erf is asked: wrong by far more than eager is, on ordinary and on tail rows
    normal = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 2
    for g in (normal, gate):
        ins = {"gate": g, "up": torch.ones_like(g)}
        (e,) = spec.run_eager(ins, params)
        (o,) = spec.run_oracle(ins, params)
        tanh = torch.nn.functional.gelu(g, approximate="tanh")
        cmp = compare("y", tanh, e, o, dtype=torch.float32, fallback_ulps=spec.fallback_ulps,
                      float32_scale=spec.float32_scale(ins, params, o))
        assert not cmp.passed, f"tanh passed for erf on {g.min():.1f}..{g.max():.1f}"


def test_near_constant_rows_are_judged_against_eager_not_a_fixed_atol():
    # layer_norm of a near-constant row: the output is O(1) noise that eager
    # computes with a real error; a kernel as good as eager passes.
    x = (5 + 1e-3 * torch.randn(8, 512, generator=torch.Generator().manual_seed(1))).half()
    w, b = torch.ones(512, dtype=torch.half), torch.zeros(512, dtype=torch.half)
    oracle = torch.nn.functional.layer_norm(x.double(), (512,), w.double(), b.double(), 1e-5)
    eager = torch.nn.functional.layer_norm(x, (512,), w, b, 1e-5)
    assert compare("y", eager, eager, oracle, dtype=torch.float16, fallback_ulps=16).passed


@given(cases(OPS["add_layer_norm"]))
def test_layouts_are_what_they_claim(case):
    inputs = materialize(case)
    for name, t in inputs.items():
        layout = case.layouts[name]
        if layout == "padded":
            assert t.dim() == 1 or t.stride(-2) > t.shape[-1] or t.shape[-2] == 1
        elif layout == "transposed":
            assert t.shape[-2] > 1 and (t.shape[-1] == 1 or t.stride(-1) != 1), "transposed needs two dims to swap"
        elif layout == "strided":
            assert t.stride(-1) == 2 and "stride 2" in case.describe()
        elif layout == "expanded":
            assert t.shape[0] == 1 or t.stride(0) == 0
        elif layout == "offset":
            assert t.storage_offset() > 0
        else:
            assert t.is_contiguous()
        assert t.shape == case.shapes()[name]


@given(cases(OPS["rms_norm"]))
def test_cases_replay_bit_for_bit(case):
    again = Case.from_json(case.to_json())
    assert again == case
    a, b = materialize(case), materialize(again)
    for name in a:
        assert torch.equal(storage_bytes(a[name]), storage_bytes(b[name]))
        assert a[name].stride() == b[name].stride()


@given(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS), st.lists(st.integers(1, 5), min_size=0, max_size=4))
def test_row_layout_addresses_every_row(lay_x, lay_r, lead):
    from fuseaudit.kernels._rows import row_layout

    case = Case("add_rms_norm", "float32", {"lead": tuple(lead), "N": 6}, {"x": lay_x, "residual": lay_r},
                "normal", {}, 0)
    inputs = materialize(case)
    x, r = inputs["x"], inputs["residual"]
    layout = row_layout(x.shape, x, r)
    d0, d1, d2 = layout.dims
    assert d0 * d1 * d2 == layout.rows == math.prod(lead)
    for t, (s0, s1, s2, sn) in zip((x, r), layout.strides):
        flat = t.reshape(-1, 6)
        for row in range(layout.rows):
            i0, i1, i2 = row // (d1 * d2), (row // d2) % d1, row % d2
            off = t.storage_offset() + i0 * s0 + i1 * s1 + i2 * s2
            got = torch.as_strided(t, (6,), (sn,), off)
            assert torch.equal(got.nan_to_num(), flat[row].nan_to_num())


def test_in_a_row_with_non_finite_inputs_eagers_value_is_as_good_as_the_oracles():
    """PyTorch's kernels disagree on non-finite inputs (float32 F.gelu(+inf) is NaN on some CPU builds; CUDA's
    F.rms_norm makes a row holding inf NaN where the maths gives x * 0): there eager's value also passes."""
    def passes(got: float, eager: float, oracle: float, *, non_finite_inputs: bool = True) -> bool:
        rows = torch.tensor([non_finite_inputs])
        return compare("y", torch.tensor([[got, 1.0]]), torch.tensor([[eager, 1.0]]),
                       torch.tensor([[oracle, 1.0]], dtype=torch.float64), dtype=torch.float32, fallback_ulps=8,
                       eager_defines=rows).passed

    assert passes(math.inf, math.nan, math.inf) and passes(math.nan, math.nan, math.inf)
    assert passes(-0.0, 0.0, math.nan) and passes(math.nan, 0.0, math.nan)
    assert passes(-0.0, math.nan, 0.0) and passes(math.nan, math.nan, 0.0)
    for got in (-math.inf, 0.0, 3.4e38):
        assert not passes(got, math.nan, math.inf)
    assert not passes(1e-30, 0.0, math.nan)  # neither's value
    # rows of finite inputs: an overflowed eager is no yardstick, the oracle alone decides
    assert not passes(math.nan, math.nan, 0.0, non_finite_inputs=False)
    assert not passes(-0.0, 0.0, math.nan, non_finite_inputs=False)
