"""Correctness of the row kernels' code paths, each forced from the launch table on small shapes.

``test_row_configs.py`` runs every config of ``fuseaudit/kernels/tuning_h200.json``
once; this file runs the paths those configs select on the inputs each path
treats in its own code: softmax's tiny outputs and special values in whole
rows, rows with a tail block, looped rows and looped rows in lanes; weight
and bias loaded with the row or after the reductions (``early``); leading
dims folded to one, two or three (``_rows.row_layout``); row alignment
(``ALIGN``) for rows whose stride is no multiple of 16 elements; and
Hypothesis-drawn cases through every looped config.  A config is taken from
the op's table and forced with the module's ``with_config``; a looped
config's blocks are scaled down to ``BLOCK`` columns (its pass-1 block
alike), so a row of a few hundred columns takes several blocks.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuseaudit.case import Case, materialize
from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.kernels import _tuning
from fuseaudit.kernels._rows import row_alignment, row_layout
from fuseaudit.kernels._tuning import RowConfig
from fuseaudit.strategies import cases
from fuseaudit.tolerance import compare

ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
NORM_OPS = ROW_OPS[:4]
BLOCK = 64  # a looped config's block, scaled down
DTYPE_CLASS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _module(op: str):
    return importlib.import_module(OPS[op].reference.split(":")[0])


def _scaled(config: RowConfig, block: int = BLOCK) -> RowConfig:
    """``config`` without its cooperative split, a looped one's blocks scaled down to ``block`` columns."""
    config = dataclasses.replace(config, split=None)
    if config.kernel != "looped":
        return config
    scale = max(config.block_n // block, 1)
    return dataclasses.replace(config, block_n=config.block_n // scale, block_s=config.block_s // scale)


def _table_configs(op: str, dtype: str, kernel: str, **fields: object) -> list[RowConfig]:
    """The distinct configs (scaled, no split) of ``op``'s table for ``dtype`` that run ``kernel`` with ``fields``."""
    found: list[RowConfig] = []
    for row in _tuning.TABLES[op]:
        config = row.config
        if DTYPE_CLASS[dtype] in row.dtypes and config.kernel == kernel and all(
                getattr(config, k) == v for k, v in fields.items()):
            small = _scaled(config)
            if small not in found:
                found.append(small)
    return found


def _table_config(op: str, dtype: str, kernel: str, **fields: object) -> RowConfig:
    """The first such config; for ``tail`` of any dtype (a tail config runs any dtype: some tables split
    half-precision rows only, add_rms_norm's float32 rows only)."""
    found = _table_configs(op, dtype, kernel, **fields)
    if kernel == "tail":
        found += [c for other in DTYPE_CLASS for c in _table_configs(op, other, kernel, **fields)]
    assert found, f"{op}'s table has no {dtype} {kernel} config with {fields}"
    return found[0]


def _case(op: str, dtype: str, lead: tuple[int, ...], n: int, layout: str | dict[str, str], *, regime="normal",
          seed=0) -> Case:
    spec = OPS[op]
    layouts = layout if isinstance(layout, dict) else {name: layout for name in spec.input_names}
    return Case(op=op, dtype=dtype, dims={"lead": lead, "N": n}, regime=regime, layouts=layouts,
                params=spec.defaults(), seed=seed)


def _run(op: str, config: RowConfig, case: Case, device: str) -> None:
    """``case`` through ``op`` launched with ``config``, every property of the harness (``run_case``)."""
    spec = OPS[op]
    run_case(spec, _module(op).with_config(op, config), case, device=device,
             target=spec.reference).raise_for_failures()


def _judge(op: str, impl: Callable[..., object], inputs: dict[str, torch.Tensor]) -> None:
    """``impl``'s outputs on ``inputs`` against the tolerance policy, as ``run_case`` judges them."""
    spec = OPS[op]
    params = spec.defaults()
    got = impl(*(inputs[name] for name in spec.input_names), **params)
    got = got if isinstance(got, tuple) else (got,)
    eager, oracle = spec.run_eager(inputs, params), spec.run_oracle(inputs, params)
    defines = spec.rows_with_non_finite_inputs(inputs)
    for name, g, e, o in zip(spec.outputs, got, eager, oracle):
        f32 = spec.float32_scale(inputs, params, o) if name == spec.outputs[0] else None
        cmp = compare(name, g, e, o, dtype=inputs["x"].dtype, fallback_ulps=spec.fallback_ulps, float32_scale=f32,
                      eager_defines=defines)
        assert cmp.passed, f"{op} {name}: {cmp.reason}"


def _plan(op: str, x: torch.Tensor, config: RowConfig):
    """The plan ``op``'s wrapper builds for ``x`` with ``config`` (add_*: x as the residual too; vectors: ones)."""
    module = _module(op)
    if op == "softmax":
        return module._plan(x, 1.0, config)
    w = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    vectors = (w,) * (1 if "rms" in op else 2)
    return module._plan(op, x, x if op.startswith("add_") else None, *vectors, 1e-5, config)


# --- softmax: tiny outputs and special values on every path ---------------------------------------------------

def _softmax_path(path: str, dtype: str) -> RowConfig:
    """The table's softmax config for ``path``: whole rows, a block and a tail, looped, looped in lanes."""
    if path == "whole":
        return _table_config("softmax", dtype, "whole")
    if path == "tail":
        return _table_config("softmax", dtype, "tail")
    if path == "lanes":  # half precision only (``_lane_stats``)
        return _table_config("softmax", dtype, "looped", lanes=True)
    return _table_config("softmax", dtype, "looped", lanes=False)


@pytest.mark.parametrize("path", ["whole", "tail", "looped", "lanes"])
def test_softmax_tiny_outputs(path, fuseaudit_device):
    """Half-precision outputs far below the row's max keep their precision, subnormals included.

    Logits from 0 down to -110 (bfloat16 subnormals begin near -87, float16
    ones near -6): every output within one ulp of the float64 softmax rounded
    to the output dtype.  The float32 arithmetic errs by ~1e-6, far below a
    half-precision ulp, so only the last rounding may differ; the tolerance
    policy bounds a row by its largest outputs and would let tiny ones flush
    to zero.  A row of 1000 (512 + a tail of 512; looped: 16 blocks of 64).
    """
    from fuseaudit.kernels import softmax

    n = 1000
    logits = torch.linspace(0.0, -110.0, n, dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16):
        config = _softmax_path(path, str(dtype).removeprefix("torch."))
        x = logits.to(dtype)[None].to(fuseaudit_device)
        assert (_plan("softmax", x, config).meta.get("VEC", 0) > 0) == (path == "lanes")
        y = softmax.with_config("softmax", config)(x)[0].double().cpu()
        want = torch.softmax(x[0].double().cpu(), -1)
        rounded = want.to(dtype).double()
        info = torch.finfo(dtype)
        ulp = torch.clamp(rounded.abs(), min=info.tiny) * info.eps  # a subnormal's ulp is tiny * eps
        assert ((rounded != 0) & (rounded.abs() < info.tiny)).any(), "the row should reach subnormals"
        err = (y - rounded).abs() / ulp
        worst = int(err.argmax())
        assert err.max() <= 1.0, f"{dtype} {path}: output {worst} is {y[worst]:.3e}, float64 gives {want[worst]:.3e}"


@pytest.mark.parametrize("path", ["whole", "tail", "looped", "lanes"])
def test_softmax_special_values(path, fuseaudit_device, special_logit_rows):
    """Rows with NaN, +inf, -inf (first, last, a prefix of whole blocks, everywhere) and a huge logit after -inf:
    NaN exactly where eager has it, the rest within the policy, float32 and bfloat16 (lanes: bfloat16 only).

    The looped kernel's running max and rescaled sum meet each special value
    in other code than a whole row's max and sum, and its pass in lanes in
    other code again; the whole row with a tail (N = 300 = 256 + 64) has a
    block and a tail to combine.  Then the ``masked`` regime's rows through
    ``run_case``."""
    inf = float("inf")
    n = 300
    rows = [*special_logit_rows(n),
            [-inf] * (n // 2) + [1e4] * (n - n // 2),
            [-inf] * 200 + [float(i) / 8 for i in range(n - 200)]]
    from fuseaudit.kernels import softmax

    for dtype in ("bfloat16",) if path == "lanes" else ("float32", "bfloat16"):
        config = _softmax_path(path, dtype)
        x = torch.tensor(rows, dtype=getattr(torch, dtype), device=fuseaudit_device)
        plan = _plan("softmax", x, config)
        assert (plan.meta.get("BLOCK_T", 0) > 0) == (path == "tail"), plan.meta
        _judge("softmax", softmax.with_config("softmax", config), {"x": x})
        _run("softmax", config, _case("softmax", dtype, (8,), n, "padded", regime="masked", seed=n), fuseaudit_device)


# --- weight and bias early or late ------------------------------------------------------------------------

@pytest.mark.parametrize("op", NORM_OPS)
def test_vectors_early_and_late(op, fuseaudit_device):
    """Weight and bias loaded with the row (``early``) or after the reductions: both meet every property, with
    the same outputs, in whole rows and in a block plus a tail (the table's early configs and their late twins),
    on strided, padded and offset inputs; the plan says which the kernel was given."""
    for kernel in ("whole", "tail"):
        early = _table_configs(op, "bfloat16", kernel, early=True)
        early = early[0] if early else dataclasses.replace(_table_config(op, "bfloat16", kernel), early=True)
        for n, dtype, layout in ((600, "bfloat16", "transposed"), (1000, "float32", "padded"),
                                 (96, "float16", "offset")):
            outputs = []
            for config in (early, dataclasses.replace(early, early=False)):
                case = _case(op, dtype, (3,), n, layout, seed=n)
                inputs = materialize(case, fuseaudit_device)
                assert _plan(op, inputs["x"], config).meta["EARLY"] is config.early
                _run(op, config, case, fuseaudit_device)
                spec = OPS[op]
                got = _module(op).with_config(op, config)(*(inputs[k] for k in spec.input_names), **spec.defaults())
                outputs.append(got if isinstance(got, tuple) else (got,))
            for a, b in zip(*outputs):
                assert torch.equal(a, b), f"{op} {kernel} {dtype} N={n}: early and late outputs differ"


# --- leading dims folded to the front -----------------------------------------------------------------------

def test_one_leading_dim_folds_to_the_front():
    """A single (folded) leading dim is laid out as ``(rows, 1, 1)``; two dims keep their order, ``(a, b, 1)``."""
    x = torch.zeros(6, 4, 10)
    assert row_layout(x.shape, x).dims == (24, 1, 1)
    assert row_layout(x.shape, x).strides == ((10, 0, 0, 1),)
    y = x[:, :3]  # rows 0..2 of each group of 4: the two leading dims no longer merge
    assert row_layout(y.shape, y).dims == (6, 3, 1)
    assert row_layout(y.shape, y).strides == ((40, 10, 0, 1),)
    z = torch.zeros(3, 2, 5, 10).permute(1, 0, 2, 3)  # no two neighbours merge
    assert row_layout(z.shape, z).dims == (2, 3, 5)
    assert row_layout(z.shape, z).strides == ((50, 100, 10, 1),)
    assert row_layout(z.shape, z, z.contiguous()).dims == (2, 3, 5)
    assert row_layout((2, 3, 5, 10), torch.zeros(2, 3, 5, 10), torch.zeros(2, 3, 5, 10)).dims == (30, 1, 1)


# (lead, layouts, the folded dims): one dim, two, three (x and the residual fold differently)
FOLDS = [((2, 3, 2), "padded", (12, 1, 1)),
         ((2, 3, 2), "transposed", (6, 2, 1)),
         ((3, 2), "expanded", (3, 2, 1)),
         ((2, 3, 2), {"x": "transposed", "residual": "expanded", "weight": "contiguous", "bias": "strided"},
          (2, 3, 2))]


def _path_configs(op: str, dtype: str) -> dict[str, RowConfig]:
    return {"whole": _table_config(op, dtype, "whole"), "tail": _table_config(op, dtype, "tail"),
            "looped": _table_config(op, dtype, "looped")}


@pytest.mark.parametrize("op", ROW_OPS)
def test_leading_dims_fold_on_every_path(op, fuseaudit_device):
    """Rows of several leading dims, folded to one, two or three (``row_offsets``' divisions by D1 and D2),
    strided, through whole rows, a block and a tail, and looped blocks (at most 12 rows): every property holds.
    Single-input ops reach three dims through a permuted tensor, judged by the policy."""
    spec = OPS[op]
    for index, (lead, layouts, dims) in enumerate(FOLDS):
        if not isinstance(layouts, dict):
            layouts = {name: layouts for name in spec.input_names}
        elif not op.startswith("add_"):
            continue
        layouts = {name: layouts[name] for name in spec.input_names}
        dtype = ("bfloat16", "float16", "float32")[index % 3]
        case = _case(op, dtype, lead, 100, layouts, seed=index)
        inputs = materialize(case, fuseaudit_device)
        rows = [inputs[name] for name in ("x", "residual") if name in inputs]
        assert row_layout(rows[0].shape, *rows).dims == dims, layouts
        for path, config in _path_configs(op, dtype).items():
            if path == "looped" and index == 0:  # (12 rows of 2 blocks: the slowest case; one folded dim is common)
                continue
            _run(op, config, case, fuseaudit_device)
    if not op.startswith("add_"):
        x = torch.randn(3, 2, 5, 100, device=fuseaudit_device).to(torch.bfloat16).permute(1, 0, 2, 3)
        assert row_layout(x.shape, x).dims == (2, 3, 5)
        inputs = {"x": x}
        if op != "softmax":
            inputs["weight"] = torch.randn(100, device=fuseaudit_device).to(torch.bfloat16)
            if "layer" in op:
                inputs["bias"] = torch.randn(100, device=fuseaudit_device).to(torch.bfloat16)
        for config in _path_configs(op, "bfloat16").values():
            _judge(op, _module(op).with_config(op, config), inputs)


# --- row alignment -----------------------------------------------------------------------------------------

def test_row_alignment_reaches_the_kernels(fuseaudit_device):
    """The kernels are told the rows' common power-of-two divisor (``_rows.row_alignment``), as ``ALIGN``.

    Too large a claim would make misaligned vector loads (and a column mask
    cut at ``N // ALIGN * ALIGN``), so each layout's divisor is checked, and
    that every wrapper hands it to its whole, tail and looped kernels.
    """
    def t(*shape):
        return torch.zeros(*shape, dtype=torch.float16, device=fuseaudit_device)

    layouts = {
        "contiguous, N=600": (t(16, 600), 8),
        "contiguous, N=640": (t(16, 640), 16),
        "3-D, N=600": (t(2, 8, 600), 8),
        "rows padded to 612": (t(16, 612)[:, :600], 4),
        "transposed": (t(600, 16).t(), 1),
        "odd width 251": (t(16, 251), 1),
        "expanded rows, N=500": (t(1, 500).expand(16, 500), 4),
        "N=90": (t(16, 90), 2),
    }
    for name, (x, expected) in layouts.items():
        n = x.shape[-1]
        assert row_alignment(n, row_layout(x.shape, x)) == expected, name
        for op in ROW_OPS:
            for path, config in _path_configs(op, "float16").items():
                plan = _plan(op, x, config)
                assert plan.meta.get("ALIGN") == expected, f"{op} {path}, {name}: {plan.meta}"


@pytest.mark.parametrize("op", ROW_OPS)
def test_unaligned_rows_are_correct(op, fuseaudit_device):
    """Rows whose stride is no multiple of 16 elements (ALIGN 8, 4, 2 and 1: widths of 600, 300, 90, 97, padded
    rows; an offset start leaves ALIGN to the strides, the pointer's alignment is Triton's own) through whole
    rows, a block and a tail, and looped blocks: every property holds."""
    for index, (n, layout, align) in enumerate(((600, "contiguous", 8), (300, "contiguous", 4), (90, "contiguous", 2),
                                                (97, "contiguous", 1), (200, "padded", 1), (300, "offset", 4))):
        dtype = ("bfloat16", "float16", "float32")[index % 3]
        case = _case(op, dtype, (3,), n, layout, seed=n)
        x = materialize(case, fuseaudit_device)["x"]
        assert row_alignment(n, row_layout(x.shape, x)) == align, (n, layout)
        for path, config in _path_configs(op, dtype).items():
            if path == "looped" and n > 300:  # (10 blocks of 64 a row: slow under the interpreter)
                continue
            assert _plan(op, x, config).meta["ALIGN"] == align
            _run(op, config, case, fuseaudit_device)


# --- Hypothesis: drawn cases through every looped config ----------------------------------------------------

@st.composite
def _looped_cases(draw: st.DrawFn, op: str) -> tuple[RowConfig, Case]:
    """One of the op's looped table configs (scaled to blocks of 16 or 64) and a case drawn by the harness's
    strategy (dtype, layouts, regime, params, seed), its shape made small: 1 to 4 rows in 1 to 3 leading dims, a
    row of one to six blocks past the config's pass-1 block."""
    spec = OPS[op]
    case = draw(cases(spec), label="case")
    dtype = "float32" if case.dtype == "float32" else "bfloat16"
    config = draw(st.sampled_from(_table_configs(op, dtype, "looped")), label="config")
    config = _scaled(config, draw(st.sampled_from([16, BLOCK]), label="block"))
    lo = config.stats_block + 1
    n = draw(st.one_of(st.integers(lo, lo + 5 * config.block_n),
                       st.integers(lo // config.block_n + 1, lo // config.block_n + 6).map(
                           lambda k: k * config.block_n)), label="N")
    lead = draw(st.lists(st.integers(1, 2), min_size=1, max_size=3).filter(
        lambda dims: torch.Size(dims).numel() <= 4), label="lead")
    return config, dataclasses.replace(case, dims={"lead": tuple(lead), "N": n})


@pytest.mark.parametrize("op", ROW_OPS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_looped_kernels_on_drawn_cases(op, data, fuseaudit_device):
    """Drawn cases through the op's looped configs (prefetch 0-2, lanes, fixed widths, kept blocks, wider pass-1
    blocks, streamed stores, masks kept): every property holds."""
    config, case = data.draw(_looped_cases(op), label="looped")
    x = materialize(case, fuseaudit_device)["x"]
    plan = _plan(op, x, config)
    assert plan.meta["BLOCK_N"] == config.block_n < case.dims["N"], plan.meta
    _run(op, config, case, fuseaudit_device)
