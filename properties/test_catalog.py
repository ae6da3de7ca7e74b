"""The op catalog is the one place an op is described: a new entry is drawn, edged, swept and benchmarked.

Every part of fuseaudit asks the op's catalog entry (and its shape,
``fuseaudit/shapes.py``) what to do; none tests an op's name or kind.  So a
copy of an existing entry under a new name must get everything the original
gets, without a line elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fuseaudit.catalog import OPS
from fuseaudit.cli_launches import representative_case
from fuseaudit.contenders import contenders_for
from fuseaudit.edges import edge_cases
from fuseaudit.strategies import cases
from fuseaudit.sweep import default_points


@pytest.mark.parametrize("original", ["swiglu", "attention"])
def test_a_new_op_is_one_catalog_entry(original, monkeypatch):
    base = OPS[original]
    spec = dataclasses.replace(base, name=f"{original}_copy")
    monkeypatch.setitem(OPS, spec.name, spec)

    edges = edge_cases(spec)
    assert edges and {c.op for c in edges} == {spec.name}
    assert [c.dims for c in edges] == [c.dims for c in edge_cases(base)]
    assert [p.label for p in default_points(spec)] == [p.label for p in default_points(base)]
    assert [p.label for p in spec.shape.suite_points(spec)] == [p.label for p in base.shape.suite_points(base)]
    for device in ("cpu", "cuda"):
        case = representative_case(spec, device)
        assert set(case.shapes()) == set(spec.input_names)
        assert spec.default_examples(device) == base.default_examples(device)
    assert [c.name for c in contenders_for(spec)] == [c.name for c in contenders_for(base)]

    @settings(max_examples=5, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(spec))
    def drawn(case):
        assert case.op == spec.name and set(case.shapes()) == set(spec.input_names)

    drawn()


def test_what_the_catalog_says_of_attention_and_the_row_ops():
    attention, rows = OPS["attention"], [s for s in OPS.values() if s.name != "attention"]
    assert attention.compute_bound and not any(s.compute_bound for s in rows)
    assert attention.sdpa_backends and not any(s.sdpa_backends for s in rows)
    assert attention.speed_baseline is not attention.eager and all(s.speed_baseline is s.eager for s in rows)
    assert attention.shape.head_dims and not any(s.shape.head_dims for s in rows)
    assert all(attention.default_examples(d) < s.default_examples(d) for s in rows for d in ("cpu", "cuda"))
    shapes = {"q": (2, 8, 16, 64), "k": (2, 2, 24, 64), "v": (2, 2, 24, 64)}
    assert attention.flops(shapes, {"causal": False}) == 4.0 * 2 * 8 * 16 * 24 * 64
    assert attention.intermediate_bytes(shapes, dtype=torch.float16) == 2 * 2 * 2 * (2 * 8 * 16 * 24)
