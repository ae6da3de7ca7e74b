"""The looped ("wide") path of the row-wise kernels, reached with small rows.

Rows wider than ``_rows.MAX_FUSED_BYTES`` are normalised by looping over
column blocks instead of holding the row in registers.  CI's sizes stay below
the real cap (32K half-precision elements), so this lowers the cap to 256
bytes: every row wider than 128 half or 64 float32 elements takes the loop.
"""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.strategies import cases

WIDE_OPS = [OPS[name] for name in ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")]


@pytest.mark.parametrize("spec", WIDE_OPS, ids=[op.name for op in WIDE_OPS])
@settings(max_examples=6)  # the interpreter runs the column loop slowly
@given(data=st.data())
def test_wide_path(spec, data, fuseaudit_device):
    from fuseaudit.kernels import _rows

    case = data.draw(cases(spec), label="case")
    with mock.patch.object(_rows, "MAX_FUSED_BYTES", 256):
        wide = _rows.row_block_config(1, 1000, 2, _rows.RowTuning(32, 8, 8))[3]
        assert wide, "the lowered cap should select the looped path"
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("spec", [OPS["rms_norm"], OPS["softmax"]], ids=["rms_norm", "softmax"])
@pytest.mark.parametrize("n", [11008, 14336])
def test_uneven_rows_loop(spec, n, fuseaudit_device):
    """Half-precision rows wider than 8192 and not a power of two take the looped kernel (RowTuning.uneven_block)."""
    from fuseaudit.kernels import _rows, rms_norm, softmax

    from fuseaudit.case import Case

    tuning = {"rms_norm": rms_norm.TUNING, "softmax": softmax.TUNING}[spec.name]
    assert _rows.row_block_config(3, n, 2, tuning)[1:] == (tuning.uneven_block, tuning.uneven_warps, True)
    for dtype in ("bfloat16", "float16"):
        case = Case(op=spec.name, dtype=dtype, dims={"lead": (3,), "N": n},
                    layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=n)
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()
