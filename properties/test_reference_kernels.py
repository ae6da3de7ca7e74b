"""Every reference kernel against every property, on Hypothesis-drawn cases.

The same :func:`fuseaudit.check.run_case` audits third-party kernels, so a
property that holds here holds under ``fuseaudit audit`` too.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.strategies import cases

REFERENCE_OPS = [op for op in OPS.values() if op.reference]


@pytest.mark.parametrize("spec", REFERENCE_OPS, ids=[op.name for op in REFERENCE_OPS])
@given(data=st.data())
def test_reference_kernel(spec, data, fuseaudit_device):
    case = data.draw(cases(spec), label="case")
    run_case(spec, spec.load_reference(), case, device=fuseaudit_device, target=spec.reference).raise_for_failures()
