"""The cooperative path of the row-wise kernels: a few wide rows, each split over several programs.

At decode sizes a wide row is split over ``SPLITS`` programs of one
cooperative launch (``fuseaudit/kernels/_coop.py``); each publishes a partial of its
chunk and merges the row's.  CI's rows are far narrower than those the
tables split, so these tests give every table row a split, lower the chunk
to 16 bytes, and (under the interpreter) count 16 SMs: every row of a few
elements and at most 8 rows splits into up to 16 chunks.  Under the
interpreter each program computes all the partials itself (programs run one
after another there); on the GPU the programs publish and wait for real.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fuseaudit.case import Case, materialize
from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.strategies import cases

ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
SPLIT_SMS = 16


@contextlib.contextmanager
def split_tables(split_for: Callable[[frozenset[str]], object]) -> Iterator[None]:
    """Every row of every table given the split ``split_for(its dtypes)`` (None: none)."""
    import dataclasses

    from fuseaudit.kernels import _launch, _tuning

    tables = {op: tuple(row._replace(config=dataclasses.replace(row.config, split=split_for(row.dtypes)))
                        for row in table) for op, table in _tuning.TABLES.items()}
    with _launch.retuned(_tuning, TABLES=tables):
        yield


@contextlib.contextmanager
def split_small_rows() -> Iterator[None]:
    """Every table splits a few rows, in chunks of 16 bytes on 16 SMs: CI-sized rows take the cooperative path."""
    from fuseaudit.kernels import _coop, _launch
    from fuseaudit.kernels._tuning import Split

    with _launch.retuned(_coop, MIN_CHUNK_BYTES=16, INTERPRETER_SMS=SPLIT_SMS), split_tables(lambda _: Split()):
        yield


def _coop_blocks(case: Case, element_size: int, device: str):
    import torch

    from fuseaudit.kernels import _coop
    from fuseaudit.kernels._tuning import Split

    rows = math.prod(case.dims["lead"])
    return _coop.coop_config(rows, case.dims["N"], element_size, torch.device(device), Split())


def _assert_within_policy(op: str, inputs: dict, params: dict, got) -> None:
    """``got`` (the op's first output) against eager and float64 under the tolerance policy."""
    from fuseaudit.tolerance import compare

    spec = OPS[op]
    oracle = spec.run_oracle(inputs, params)[0]
    cmp = compare("y", got, spec.run_eager(inputs, params)[0], oracle, dtype=got.dtype,
                  fallback_ulps=spec.fallback_ulps, float32_scale=spec.float32_scale(inputs, params, oracle))
    assert cmp.passed, f"{op} {got.dtype}: {cmp.reason}"


def _plan_kernel(op: str, inputs: dict, params: dict) -> str:
    """Name of the kernel the op's wrapper plans for these inputs."""
    from fuseaudit.kernels import layer_norm, rms_norm, softmax

    x = inputs["x"]
    if op == "softmax":
        plan = softmax._plan(x, params.get("scale", 1.0))
    elif op.endswith("rms_norm"):
        plan = rms_norm._plan(op, x, inputs.get("residual"), inputs["weight"], params["eps"])
    else:
        plan = layer_norm._plan(op, x, inputs.get("residual"), inputs["weight"], inputs["bias"], params["eps"])
    assert plan is not None
    return plan.kernel.__name__


@pytest.mark.parametrize("op", ROW_OPS)
@settings(max_examples=8)
@given(data=st.data())
def test_coop_path(op, data, fuseaudit_device):
    """Shapes, dtypes, strides and values of the shared strategies, split over programs."""
    spec = OPS[op]
    case = data.draw(cases(spec), label="case")
    with split_small_rows():
        blocks = _coop_blocks(case, {"float32": 4}.get(case.dtype, 2), fuseaudit_device)
        assume(blocks is not None)
        assert 2 <= blocks.splits <= blocks.slots < 2 * blocks.splits
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("regime", ["near_constant", "large", "outliers"])
def test_coop_statistics(op, regime, fuseaudit_device):
    """The chunk partials and their merge on the hard value regimes, in every dtype and a strided layout each.

    A constant offset ten times the row's spread (the variance a sliver of
    the mean square: layer_norm's merge must not cancel), magnitudes up to
    2048, outlier channels.  Under the interpreter (16 SMs counted): one
    float32 row of 1000 in 16 chunks of 64, three bfloat16 rows of 777
    (transposed) in 4 chunks of 256, eight float16 rows of 130 (padded) in
    2 of 128; on an H200 the same rows split finer (132 SMs).
    """
    spec = OPS[op]
    if regime not in spec.regimes:
        pytest.skip(f"{op} does not draw the {regime} regime")
    with split_small_rows():
        for dtype, layout, n, lead in (("float32", "contiguous", 1000, (1,)), ("bfloat16", "transposed", 777, (3,)),
                                       ("float16", "padded", 130, (2, 4))):
            case = Case(op=op, dtype=dtype, dims={"lead": lead, "N": n}, regime=regime,
                        layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=n)
            blocks = _coop_blocks(case, 4 if dtype == "float32" else 2, fuseaudit_device)
            assert blocks is not None and blocks.splits >= 2
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


def test_coop_softmax_special_values(fuseaudit_device, special_logit_rows):
    """NaN, +inf, -inf and all -inf rows, and a row whose chunks are all -inf but one: as float64 has them."""
    import torch

    from fuseaudit.kernels import softmax

    spec = OPS["softmax"]
    n = 300
    rows = [*special_logit_rows(n),
            [-float("inf")] * (n - 3) + [-100.0, -101.0, -99.5]]  # one live chunk, far below 0
    params = spec.defaults()
    with split_small_rows():
        for dtype in (torch.float32, torch.bfloat16):
            inputs = {"x": torch.tensor(rows, dtype=dtype, device=fuseaudit_device)}
            assert _plan_kernel("softmax", inputs, params) == "softmax_coop_kernel"
            _assert_within_policy("softmax", inputs, params, softmax.softmax(**inputs, **params))


def test_coop_constant_rows_are_exact(fuseaudit_device):
    """A constant row normalises to exactly ``b`` (layer_norm) and exactly ``x * rsqrt(x^2 + eps) * w`` (rms_norm)."""
    import torch

    from fuseaudit.kernels import layer_norm

    with split_small_rows():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.full((3, 500), 0.1, dtype=dtype, device=fuseaudit_device)
            w = torch.linspace(-2, 2, 500, dtype=dtype, device=fuseaudit_device)
            b = torch.linspace(-1, 3, 500, dtype=dtype, device=fuseaudit_device)
            assert _plan_kernel("layer_norm", {"x": x, "weight": w, "bias": b}, {"eps": 1e-5}) == \
                "layer_norm_coop_kernel"
            assert torch.equal(layer_norm.layer_norm(x, w, b), b.expand(3, 500))


def test_coop_can_be_turned_off():
    """With ``FUSEAUDIT_COOP=0`` (``_coop.ENABLED``) every row keeps one program, whatever the table says."""
    import torch

    from fuseaudit.kernels import _coop, _launch
    from fuseaudit.kernels._tuning import Split

    assert _coop.coop_config(8, 65536, 4, torch.device("cpu"), Split()) is not None
    with _launch.retuned(_coop, ENABLED=False):
        assert _coop.coop_config(8, 65536, 4, torch.device("cpu"), Split()) is None


@pytest.mark.parametrize("op", ROW_OPS)
def test_coop_is_one_launch(op, fuseaudit_device):
    """The split row is still one kernel launch (the workspace is allocated once, before the counted call)."""
    from fuseaudit.launches import count_launches

    spec = OPS[op]
    case = Case(op=op, dtype="float32", dims={"lead": (2,), "N": 200},
                layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=1)
    inputs = materialize(case, fuseaudit_device)
    with split_small_rows():
        assert _plan_kernel(op, inputs, case.params).endswith("_coop_kernel")
        count = count_launches(spec.load_reference(), *(inputs[n] for n in spec.input_names),
                               device=fuseaudit_device, **case.params)
    assert count.count == 1, count.describe()


@pytest.mark.fuseaudit_gpu
def test_coop_counters_wrap_and_replay(fuseaudit_device):
    """The row counters cross int32's wrap-around, and a captured CUDA graph replays the split launch.

    Every launch adds ``EPOCH`` to each row's counter and never resets it;
    set just below 2^31 it wraps to negative within a few calls, and each
    call must still wait for all its row's programs (outputs equal to a
    fresh launch's, no hang).
    """
    import torch

    from fuseaudit.kernels import _coop, layer_norm

    x = torch.randn(8, 65536, device="cuda")
    inputs = {"x": x, "weight": torch.randn(65536, device="cuda"), "bias": torch.randn(65536, device="cuda")}
    params = {"eps": 1e-5}
    assert _plan_kernel("layer_norm", inputs, params) == "layer_norm_coop_kernel"
    _, counters = _coop.workspace(x.device)
    counters.fill_(2**31 - 2 * _coop.EPOCH)
    for _ in range(5):
        _assert_within_policy("layer_norm", inputs, params, layer_norm.layer_norm(**inputs, **params))
    torch.cuda.synchronize()
    assert int(counters[0]) == -(2**31) + 3 * _coop.EPOCH, "each launch adds EPOCH to each row's counter"

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer_norm.layer_norm(**inputs, **params)  # the capture stream's workspace, before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = layer_norm.layer_norm(**inputs, **params)
    torch.cuda.current_stream().wait_stream(stream)
    for scale in (1.0, -2.0, 0.5):
        x.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        _assert_within_policy("layer_norm", inputs, params, y)


MANY_ROWS_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")


@contextlib.contextmanager
def split_many_rows(chunk: int, per_sm: int) -> Iterator[None]:
    """Every table's float32 rows split over groups of programs in chunks of ``chunk`` (half precision: no split)."""
    from fuseaudit.kernels._tuning import Split

    many = Split(chunk=chunk, warps=4, per_sm=per_sm)
    with split_tables(lambda dtypes: many if "fp32" in dtypes else None):
        yield


@pytest.mark.parametrize("op", MANY_ROWS_OPS)
def test_many_rows_split(op, fuseaudit_device):
    """Many float32 rows split over groups of programs, each group looping over every ``groups``-th row.

    Every float32 row split in chunks of 32 (16 SMs counted under the
    interpreter, one program an SM: 4 groups of 4 programs; on an H200 33
    groups): 2 x 40 padded rows of 100 (a residual transposed), so a
    group takes 20 (2 or 3 on the GPU) rows one after another: consecutive rows
    alternate between two sets of partial slots, each program loads its
    next row before it waits, and a group's last look-ahead is masked.
    Against eager and float64 under the policy, ``h`` exactly.
    """
    import torch

    spec = OPS[op]
    layouts = {name: ("transposed" if name == "residual" else "padded") for name in spec.input_names}
    case = Case(op=op, dtype="float32", dims={"lead": (2, 40), "N": 100}, layouts=layouts,
                params=spec.defaults(), seed=7)
    from fuseaudit.kernels import _coop, _launch
    from fuseaudit.kernels._tuning import Split

    with _launch.retuned(_coop, INTERPRETER_SMS=SPLIT_SMS), split_many_rows(chunk=32, per_sm=1):
        blocks = _coop.coop_config(80, 100, 4, torch.device(fuseaudit_device), Split(32, 4, 1))
        assert blocks is not None and blocks.splits == 4
        assert blocks.groups is not None and 80 // blocks.groups >= 2, "each group must take several rows"
        inputs = materialize(case, fuseaudit_device)
        assert _plan_kernel(op, inputs, case.params).endswith("_coop_kernel")
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()
        # bfloat16 rows keep one program a row: only the float32 rows split here
        half = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
        assert not _plan_kernel(op, half, case.params).endswith("_coop_kernel")


def test_interpreter_splits_a_row_into_few_chunks():
    """Under the interpreter each program computes every chunk's partial, so a row there takes few chunks."""
    import torch

    from fuseaudit.kernels import _coop
    from fuseaudit.kernels._tuning import Split

    if not _coop.interpreting():
        pytest.skip("the cap applies under Triton's interpreter")
    gpu = _coop._coop_config(1, 65536, 2, _coop.INTERPRETER_SMS, _coop.knobs(), Split())
    here = _coop.coop_config(1, 65536, 2, torch.device("cpu"), Split())
    assert gpu is not None and gpu.splits > _coop.INTERPRETER_MAX_SPLITS, "the GPU's route splits finer"
    assert here is not None and 2 <= here.splits <= _coop.INTERPRETER_MAX_SPLITS
