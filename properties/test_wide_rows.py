"""The looped ("wide") path of the row-wise kernels, reached with small rows.

Rows wider than ``_rows.MAX_FUSED_BYTES`` are normalised by looping over
column blocks instead of holding the row in registers.  CI's sizes stay below
the real cap (32K half-precision elements), so this lowers the cap to 256
bytes: every row wider than 128 half or 64 float32 elements takes the loop.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.strategies import cases
from fuseaudit.tolerance import compare


def _plan_for(op: str, rows: int, n: int, dtype: torch.dtype, device: str):
    """The plan ``op``'s wrapper builds for zero ``(rows, n)`` inputs (add_*: x as the residual too; weight and bias:
    x's first row), to read its kernel and constants."""
    import importlib

    module = importlib.import_module(OPS[op].reference.split(":")[0])
    x = torch.zeros(rows, n, dtype=dtype, device=device)
    if op == "softmax":
        return module._plan(x, 1.0)
    vectors = (x[0],) * (1 if "rms" in op else 2)
    return module._plan(op, x, x if op.startswith("add_") else None, *vectors, 1e-5)


WIDE_OPS = [OPS[name] for name in ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")]


@pytest.mark.parametrize("spec", WIDE_OPS, ids=[op.name for op in WIDE_OPS])
@settings(max_examples=6)  # the interpreter runs the column loop slowly
@given(data=st.data())
def test_wide_path(spec, data, fuseaudit_device):
    from fuseaudit.kernels import _launch, _rows

    case = data.draw(cases(spec), label="case")
    with _launch.retuned(_rows, MAX_FUSED_BYTES=256):
        wide = _rows.row_block_config(1, 1000, 2, _rows.RowTuning(32, 8, 8)).wide
        assert wide, "the lowered cap should select the looped path"
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("spec", WIDE_OPS, ids=[op.name for op in WIDE_OPS])
def test_wide_prefetch(spec, prefetch, fuseaudit_device):
    """Every prefetch level of the looped kernels (``RowBlocks.prefetch``: block i + 1 loaded before block i is
    used, in 0, 1 or 2 passes), whatever the op's tuning chose: rows of 1000 (the cap lowered to 256 bytes: 16
    blocks of 64 half or 32 blocks of 32 float32 elements, the last partial), strided, against float64."""
    import importlib

    from fuseaudit.kernels import _launch, _rows

    from fuseaudit.case import Case

    module = importlib.import_module(spec.reference.split(":")[0])
    tunings = {name: getattr(module, name) for name in ("TUNING", "ADD_TUNING") if hasattr(module, name)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_launch.retuned(_rows, MAX_FUSED_BYTES=256))
        for name, tuning in tunings.items():
            patched = tuning._replace(wide_prefetch=prefetch, float32_wide_prefetch=prefetch)
            stack.enter_context(_launch.retuned(module, **{name: patched}))
        for dtype, size, layout in (("bfloat16", 2, "transposed"), ("float32", 4, "padded")):
            blocks = [_rows.row_block_config(3, 1000, size, getattr(module, name)) for name in tunings]
            assert all(b.wide and b.prefetch == prefetch for b in blocks)
            case = Case(op=spec.name, dtype=dtype, dims={"lead": (3,), "N": 1000}, regime="normal",
                        layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=prefetch)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
@pytest.mark.parametrize("regime", ["near_constant", "large", "outliers"])
def test_wide_layer_norm_statistics(op, regime, fuseaudit_device):
    """The looped layer_norm's block statistics and their merge (Chan's formula), on the hard value regimes.

    A constant offset ten times the row's spread (``near_constant``: the
    variance is a 1e-7 sliver of the mean square), magnitudes up to 2048,
    and outlier channels, over rows of 1000 in blocks of 64 (the cap
    lowered to 256 bytes): float32 outputs show any lost digit.  Plain
    layer_norm's half-precision rows take both of its other pass-1 methods:
    Welford's lanes (up to ``FIXED_WIDTH_MAX``) and shifted sums (past it);
    its float32 rows take Welford's lanes.
    """
    from fuseaudit.kernels import _launch, _rows, layer_norm

    from fuseaudit.case import Case

    spec = OPS[op]
    runs = [("float32", "padded", 1000, None)]
    for fixed_max in (layer_norm.FIXED_WIDTH_MAX, 0) if op == "layer_norm" else (None,):
        runs += [("bfloat16", "transposed", 777, fixed_max), ("float16", "contiguous", 130, fixed_max)]
    for dtype, layout, n, fixed_max in runs:
        fixed = {} if fixed_max is None else {"FIXED_WIDTH_MAX": fixed_max}
        with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(layer_norm, **fixed):
            case = Case(op=op, dtype=dtype, dims={"lead": (4,), "N": n}, regime=regime,
                        layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=n)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("spec", [OPS["rms_norm"], OPS["softmax"]], ids=["rms_norm", "softmax"])
@pytest.mark.parametrize("n", [9000, 11008, 14336])
def test_uneven_rows_loop(spec, n, fuseaudit_device):
    """Half-precision rows wider than 8192 and not a power of two take the looped kernel (RowTuning.uneven_block),
    softmax's in blocks of 8192 where those pad the row no more than blocks of 4096 (RowTuning.uneven_large: 14336
    in two blocks, 11008 in three of 4096); rms_norm's in 4096 x 16 warps from 12289 columns, narrower ones in 4096 x
    8 or, up to 8192 + 1024, 2048 x 8 (RowTuning.uneven_narrow), and up to 4096 rows held whole as 8192 plus a tail
    in 8 warps instead (RowTuning.uneven_split; rows of 8192 + 1024 in 4, see test_split_warps).  Three rows go
    through each kernel the rules pick, against float64."""
    from fuseaudit.kernels import _launch, _rows, rms_norm, softmax

    from fuseaudit.case import Case

    module = {"rms_norm": rms_norm, "softmax": softmax}[spec.name]
    tuning = module.TUNING
    measured = {("rms_norm", 9000): (2048, 8), ("rms_norm", 11008): (4096, 8), ("rms_norm", 14336): (4096, 16),
                ("softmax", 9000): (4096, 4), ("softmax", 11008): (4096, 4), ("softmax", 14336): (8192, 8)}
    blocks = _rows.row_block_config(16384, n, 2, tuning)
    assert (blocks.block_n, blocks.num_warps, blocks.wide) == (*measured[spec.name, n], True)
    assert tuning.uneven_split == (4096 if spec.name == "rms_norm" else None), "as measured"
    few = _rows.row_block_config(3, n, 2, tuning)
    if spec.name == "rms_norm":
        assert _rows.row_block_config(4096, n, 2, tuning) == few._replace(early=False)
        assert _rows.row_block_config(4097, n, 2, tuning).wide
        tail = _rows.next_pow2(n - 8192)
        assert (few.block_n, few.block_t, few.num_warps, few.wide) == (8192, tail, 4 if tail <= 1024 else 8, False)
    else:
        assert few == blocks._replace(early=few.early)
    loop = tuning._replace(uneven_split=None)
    for dtype in ("bfloat16", "float16"):
        case = Case(op=spec.name, dtype=dtype, dims={"lead": (3,), "N": n},
                    layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=n)
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()
        if spec.name == "rms_norm":  # and through the loop, which more rows take
            with _launch.retuned(module, TUNING=loop):
                assert _rows.row_block_config(3, n, 2, loop).wide
                run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                         target=spec.reference).raise_for_failures()


def test_float32_cap_warps(fuseaudit_device):
    """Float32 rows of 8192 (the cap) held whole get more warps from 256 rows (RowTuning.float32_cap_warps):
    softmax's 32 until 2048, where they loop in two blocks, add_layer_norm's 16; fewer rows, other widths, half
    precision and the other ops keep the elements_per_thread rule (softmax 16 warps, the layer_norms 8).  The GPU's
    choice: the interpreter's programs take many rows each.  256 such rows then go through both ops against
    float64."""
    from fuseaudit.kernels import _rows, layer_norm, rms_norm, softmax

    from fuseaudit.case import Case

    def gpu(rows, n, size, tuning):
        return _rows._row_block_config(rows, n, size, tuning, _rows.MAX_FUSED_BYTES, False)

    for tuning, warps, loops_from, default in ((softmax.TUNING, 32, 2048, 16), (layer_norm.ADD_TUNING, 16, None, 8)):
        assert tuning.float32_cap_warps == (256, warps), "as measured"
        for rows in (256, 1024, 2047, 16384):
            if loops_from and rows >= loops_from:
                assert gpu(rows, 8192, 4, tuning).wide  # TwoBlocks
            else:
                assert gpu(rows, 8192, 4, tuning) == _rows.RowBlocks(1, 8192, warps, False), rows
        plain = tuning._replace(float32_cap_warps=None)
        for rows, n, size in ((255, 8192, 4), (1, 8192, 4), (1024, 4096, 4), (1024, 6000, 4), (1024, 8192, 2),
                              (1024, 16384, 2)):
            assert gpu(rows, n, size, tuning) == gpu(rows, n, size, plain), (rows, n, size)
        assert gpu(255, 8192, 4, tuning).num_warps == gpu(1024, 8192, 4, plain).num_warps == default
    for other in (rms_norm.TUNING, rms_norm.ADD_TUNING, layer_norm.TUNING):
        assert other.float32_cap_warps is None
    for op in ("softmax", "add_layer_norm"):
        spec = OPS[op]
        case = Case(op=op, dtype="float32", dims={"lead": (256,), "N": 8192},
                    layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=8192)
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


def test_float32_elements_per_thread(fuseaudit_device):
    """layer_norm's float32 rows held whole within the cap run 8 elements a thread (``float32_elements_per_thread``,
    measured on the H200): rows of 2048 in 8 warps, 4096 in 8 (its ``max_warps``), two rows of 1024 a program in 8;
    rows past the cap, half precision, add_layer_norm and the other ops keep 32 (softmax 16) a thread.  Rows of 2048
    and 4096 then go through layer_norm in float32 against float64."""
    from fuseaudit.kernels import _rows, layer_norm, rms_norm, softmax

    from fuseaudit.case import Case

    def gpu(rows, n, size, tuning=layer_norm.TUNING):
        return _rows._row_block_config(rows, n, size, tuning, _rows.MAX_FUSED_BYTES, False)

    assert layer_norm.TUNING.float32_elements_per_thread == 8, "as measured"
    for other in (layer_norm.ADD_TUNING, rms_norm.TUNING, rms_norm.ADD_TUNING, softmax.TUNING):
        assert other.float32_elements_per_thread == 0
    plain = layer_norm.TUNING._replace(float32_elements_per_thread=0)
    for rows, n, block_m, warps in ((8, 2048, 1, 8), (16384, 2048, 1, 8), (16384, 4096, 1, 8), (16384, 1024, 2, 8),
                                    (1, 1024, 1, 4)):
        assert gpu(rows, n, 4)[:4] == (block_m, n, warps, False), (rows, n)
        assert gpu(rows, n, 4, plain).num_warps == 4, (rows, n)
    for rows, n, size in ((16384, 16384, 4), (16384, 2048, 2), (16384, 4096, 2), (16384, 5120, 4)):
        assert gpu(rows, n, size) == gpu(rows, n, size, plain), (rows, n, size)
    spec = OPS["layer_norm"]
    for n in (2048, 4096):
        case = Case(op="layer_norm", dtype="float32", dims={"lead": (16,), "N": n},
                    layouts={name: "padded" for name in spec.input_names}, params=spec.defaults(), seed=n)
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_layer_norm_rows_past_the_cap(op, fuseaudit_device):
    """Half-precision rows past 16384 loop in layer_norm, prefetching (its looped pass 1 sums shifted values): in
    blocks of 4096 in 8 warps below 32768 (RowTuning.half_short), of 8192 in 16 warps from there up to 49151
    (RowTuning.half_mid_warps, from 1024 rows) and in 32 warps for fewer rows, of 16384 in 32 warps from 49152 to
    98304 (RowTuning.half_long), of 8192 in 32 warps beyond; add_layer_norm holds them
    whole up to 32768, padded or not.  Every such row goes through its kernel against float64."""
    from fuseaudit.kernels import _coop, _launch, _rows, layer_norm

    from fuseaudit.case import Case

    spec = OPS[op]
    tuning = layer_norm.TUNING if op == "layer_norm" else layer_norm.ADD_TUNING
    assert layer_norm.TUNING.half_mid_warps == (49152, 16, 1024) and layer_norm.ADD_TUNING.half_mid_warps is None
    for n in (20000, 32768):
        blocks = _rows.row_block_config(16384, n, 2, tuning)
        if op == "layer_norm":
            expected = (4096, 8) if n < 32768 else (8192, 16)
            assert (blocks.block_n, blocks.num_warps, blocks.wide, blocks.prefetch) == (*expected, True, 1), n
            for rows, n_wide, block, warps in ((1024, 49151, 8192, 16), (1023, 32768, 8192, 32),
                                               (16384, 49152, 16384, 32), (16384, 131072, 8192, 32)):
                assert _rows.row_block_config(rows, n_wide, 2, tuning)[1:4] == (block, warps, True), (rows, n_wide)
        else:
            assert (blocks.block_n, blocks.wide) == (32768, False) and blocks.num_warps == _rows.WIDE_WHOLE_ROW_WARPS
        case = Case(op=op, dtype="bfloat16", dims={"lead": (3,), "N": n}, regime="normal",
                    layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=n)
        with _launch.retuned(_coop, ENABLED=False):  # three rows of 64 KiB would be split over programs
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
SPLIT_CANDIDATES = (2049, 2500, 3000, 5120, 6000)


@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("lead", [(1,), (3,)], ids=["1row", "3rows"])
def test_split_tail(op, lead, fuseaudit_device):
    """Whole rows held as a power-of-two block plus a tail block (RowTuning.split_tail, _rows.RowBlocks).

    Each width of SPLIT_CANDIDATES that the op's TailSplit rule splits in
    half precision or in float32 is run in float32, bfloat16 and float16,
    with padded rows (NaN past each row's end), transposed and offset
    inputs.  On the GPU one row a program, and only with TAIL_MIN_ROWS rows
    or more; under the interpreter with any rows, three rows to one program,
    so the tail code runs with BLOCK_M > 1 too.  A precision the rule leaves
    out (no rule, or a zero tail) must split nothing.
    """
    from fuseaudit.kernels import _rows, layer_norm, rms_norm, softmax

    from fuseaudit.case import Case

    spec = OPS[op]
    tuning = {"rms_norm": rms_norm.TUNING, "add_rms_norm": rms_norm.ADD_TUNING, "layer_norm": layer_norm.TUNING,
              "add_layer_norm": layer_norm.ADD_TUNING, "softmax": softmax.TUNING}[op]
    if not _rows.interpreting():  # a GPU splits only with many rows
        lead = (_rows.TAIL_MIN_ROWS + lead[0],)
        assert not _rows.row_block_config(8, 5120, 2, tuning).block_t, "decode-sized row counts keep whole blocks"
    rule = tuning.split_tail
    widths = {}
    for element_size, allowed in ((2, rule and rule.max_tail), (4, rule and rule.float32_max_tail)):
        split = []
        for n in SPLIT_CANDIDATES:
            blocks = _rows.row_block_config(lead[0], n, element_size, tuning)
            if blocks.block_t:
                assert not blocks.wide
                assert blocks.block_n < n <= blocks.block_n + blocks.block_t < 2 * blocks.block_n
                split.append(n)
        if allowed:  # (layer_norm's many half-precision rows of 5120 loop instead: NarrowLooped)
            looped = _rows.row_block_config(lead[0], 5120, element_size, tuning).wide and tuning.half_looped
            assert 5120 in split or looped, f"{op}: N=5120 (4096 + 1024) should split ({element_size}-byte elements)"
            assert split, f"{op}: no width splits ({element_size}-byte elements)"
        else:
            assert not split, f"{op}: the rule leaves {element_size}-byte rows whole, yet {split} split"
        widths[element_size] = split
    for n in sorted({*widths[2], *widths[4]}):
        for dtype, layout in (("float32", "padded"), ("bfloat16", "transposed"), ("float16", "offset")):
            case = Case(op=op, dtype=dtype, dims={"lead": lead, "N": n},
                        layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=n)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("wide", [False, True], ids=["whole", "looped"])
def test_softmax_tiny_outputs(wide, fuseaudit_device):
    """Half-precision outputs far below the row's max keep their precision, subnormals included: every element
    within one ulp of the float64 softmax rounded to the output dtype (the float32 arithmetic errs by ~1e-6, far
    below a half-precision ulp, so only the last rounding can differ; the tolerance policy bounds a row by its
    largest outputs and would let tiny ones flush to zero).  Logits from 0 down to -110 (bfloat16 subnormals begin
    near -87, float16 ones near -6), a row of 5000 (4096 + 1024 whole) and its looped kernel."""
    import torch
    from fuseaudit.kernels import _launch, _rows, softmax

    n = 5000
    rows = 1 if _rows.interpreting() else _rows.TAIL_MIN_ROWS  # a GPU splits tails only with many rows
    logits = torch.linspace(0.0, -110.0, n, dtype=torch.float64)
    cap = 256 if wide else _rows.MAX_FUSED_BYTES
    for dtype in (torch.bfloat16, torch.float16):
        x = logits.to(dtype).expand(rows, n).contiguous().to(fuseaudit_device)
        with _launch.retuned(_rows, MAX_FUSED_BYTES=cap):
            assert _rows.row_block_config(rows, n, dtype.itemsize, softmax.TUNING).wide == wide
            y = softmax.softmax(x)[0].double().cpu()
        want = torch.softmax(x[0].double().cpu(), -1)
        rounded = want.to(dtype).double()
        info = torch.finfo(dtype)
        ulp = torch.clamp(rounded.abs(), min=info.tiny) * info.eps  # a subnormal's ulp is tiny * eps
        assert ((rounded != 0) & (rounded.abs() < info.tiny)).any(), "the row should reach subnormals"
        err = (y - rounded).abs() / ulp
        worst = int(err.argmax())
        assert err.max() <= 1.0, f"{dtype}: output {worst} is {y[worst]:.3e}, float64 gives {want[worst]:.3e}"


@pytest.mark.parametrize("path", ["whole", "looped", "lanes"])
def test_softmax_special_values(path, fuseaudit_device):
    """Rows with NaN, +inf, -inf, all -inf: NaN exactly where the float64 softmax has it, the rest within the policy.

    The looped kernel's running max and rescaled sum meet each special value
    in other code than a whole row's max and sum do, and its pass 1 in
    lanes (``RowBlocks.lanes``, half precision; a rule lowered to these
    rows) in other code again; all three are checked, the whole bfloat16 row
    with its tail block (N = 5000 = 4096 + 1024).
    """
    import torch
    from fuseaudit.kernels import _launch, _rows, softmax

    spec = OPS["softmax"]
    inf, nan = float("inf"), float("nan")
    n = 5000
    rows = [
        [1.0, nan] + [0.5] * (n - 2),
        [0.25] * (n - 1) + [inf],
        [-inf, 1.0] + [0.5] * (n - 2),
        [-inf] * n,
        [-inf] * (n // 2) + [1e4] * (n - n // 2),
        [float(i - n // 2) / 8 for i in range(n)],
    ]
    if not _rows.interpreting():  # a GPU splits tails only with many rows
        rows = rows * (_rows.TAIL_MIN_ROWS // len(rows) + 1)
    params = spec.defaults()
    wide = path != "whole"
    cap = 256 if wide else _rows.MAX_FUSED_BYTES
    tuning = softmax.TUNING
    if path == "lanes":
        tuning = tuning._replace(half_long=(_rows.HalfLong(1000, 1024, 4, prefetch=1, lanes=True),))
    for dtype in (torch.float32, torch.bfloat16):
        inputs = {"x": torch.tensor(rows, dtype=dtype, device=fuseaudit_device)}
        with _launch.retuned(_rows, MAX_FUSED_BYTES=cap), _launch.retuned(softmax, TUNING=tuning):
            blocks = _rows.row_block_config(len(rows), n, dtype.itemsize, tuning)
            assert blocks.wide == wide and blocks.lanes == (path == "lanes" and dtype == torch.bfloat16)
            assert wide or (blocks.block_t > 0) == (dtype == torch.bfloat16), "tails split in half precision only"
            y = softmax.softmax(**inputs, **params)
        oracle = spec.run_oracle(inputs, params)[0]
        cmp = compare("y", y, spec.run_eager(inputs, params)[0], oracle, dtype=dtype,
                      fallback_ulps=spec.fallback_ulps, float32_scale=spec.float32_scale(inputs, params, oracle))
        assert cmp.passed, f"{dtype}: {cmp.reason}"


def test_row_alignment_reaches_the_kernels(fuseaudit_device):
    """The whole-row kernels are told the rows' common power-of-two divisor (``_rows.row_alignment``).

    Triton alone sees a width of 3000 as unaligned and reads it 2 bytes at a
    time; ``ALIGN`` is what lets the compiler use 16-byte loads (checked in
    the PTX by ``test_compile_hopper.py``).  Too large a claim would make
    misaligned vector loads, so each layout's divisor is checked here, and
    that every wrapper hands it to its kernel.
    """
    import torch
    from fuseaudit.kernels import layer_norm, rms_norm, softmax
    from fuseaudit.kernels._rows import row_alignment, row_layout

    def t(*shape):
        return torch.zeros(*shape, dtype=torch.float16, device=fuseaudit_device)

    layouts = {
        "contiguous, N=3000": (t(16, 3000), 8),
        "contiguous, N=5120": (t(16, 5120), 16),
        "3-D, N=3000": (t(2, 8, 3000), 8),
        "rows padded to 3012": (t(16, 3012)[:, :3000], 4),
        "transposed": (t(3000, 16).t(), 1),
        "odd width 2501": (t(16, 2501), 1),
        "expanded rows, N=2500": (t(1, 2500).expand(16, 2500), 4),
    }
    for name, (x, expected) in layouts.items():
        n = x.shape[-1]
        assert row_alignment(n, row_layout(x.shape, x)) == expected, name
        w = t(n) + 1
        plans = {
            "rms_norm": rms_norm._plan("rms_norm", x, None, w, 1e-6),
            "add_rms_norm": rms_norm._plan("add_rms_norm", x, x, w, 1e-6),
            "layer_norm": layer_norm._plan("layer_norm", x, None, w, w, 1e-5),
            "add_layer_norm": layer_norm._plan("add_layer_norm", x, x, w, w, 1e-5),
            "softmax": softmax._plan(x, 1.0),
        }
        for op, plan in plans.items():
            assert plan is not None and plan.meta.get("ALIGN") == expected, f"{op}, {name}: {plan}"


@pytest.mark.parametrize("op", ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm"))
@pytest.mark.parametrize("early", [True, False], ids=["early", "late"])
def test_vectors_early_and_late(op, early, fuseaudit_device):
    """Weight and bias loaded with the row (few rows) or after the reductions (many): same results.

    ``_rows.RowBlocks.early`` picks by the row count; lowering
    ``EARLY_VECTOR_ROWS`` to 0 (or raising it) forces either placement at
    CI's sizes.  Each is run with a tail block (N = 5120 = 4096 + 1024, in
    half precision where the op splits) and on strided inputs.
    """
    from fuseaudit.kernels import _launch, _rows, layer_norm, rms_norm

    from fuseaudit.case import Case

    spec = OPS[op]
    tuning = {"rms_norm": rms_norm.TUNING, "add_rms_norm": rms_norm.ADD_TUNING, "layer_norm": layer_norm.TUNING,
              "add_layer_norm": layer_norm.ADD_TUNING}[op]
    with _launch.retuned(_rows, EARLY_VECTOR_ROWS=1 << 30 if early else 0):
        for n, dtype, layout in ((5120, "bfloat16", "transposed"), (1000, "float32", "padded"),
                                 (96, "float16", "offset")):
            assert _rows.row_block_config(3, n, 2, tuning).early == early
            case = Case(op=op, dtype=dtype, dims={"lead": (3,), "N": n},
                        layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=n)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


def test_one_leading_dim_folds_to_the_front():
    """A single (folded) leading dim is laid out as ``(rows, 1, 1)``.

    Triton specialises integer arguments equal to 1, so ``D1 = D2 = 1`` takes
    both divisions out of ``row_offsets``: on the H200, layer_norm at
    16384 x 16384 (bf16) ran in 270 µs instead of 293.  Two dims keep their
    order, C-contiguous-like: ``(a, b, 1)``.
    """
    import torch
    from fuseaudit.kernels._rows import row_layout

    x = torch.zeros(6, 4, 10)
    assert row_layout(x.shape, x).dims == (24, 1, 1)
    assert row_layout(x.shape, x).strides == ((10, 0, 0, 1),)
    y = x[:, :3]  # rows 0..2 of each group of 4: the two leading dims no longer merge
    assert row_layout(y.shape, y).dims == (6, 3, 1)
    assert row_layout(y.shape, y).strides == ((40, 10, 0, 1),)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax"])
def test_float32_rows_whole_past_the_cap(op, fuseaudit_device):
    """float32 rows whose block reaches ``float32_whole_from`` are held whole in 32 warps, up to 32768.

    Past that, and for add_layer_norm (whose looped kernel prefetches), they loop (add_layer_norm and softmax in
    their ``float32_wide`` blocks, layer_norm in its ``float32_long`` ones: test_float32_long_rows), whatever
    ``fused_scale`` says for half precision.  softmax holds whole only rows exactly as wide as their block
    (``float32_whole_padded=False``), 16384 and 32768 but not 20000, from 1024 rows
    (``float32_whole_min_rows``).  Padded, strided rows of 20000 (block 32768),
    32768 and 40000 go through whichever path the rules pick, against float64.
    (Three such rows would be split over programs, ``test_coop_rows.py``; ``_coop.ENABLED = False``, as
    ``FUSEAUDIT_COOP=0`` sets it, keeps them here.)
    """
    from fuseaudit.kernels import _coop, _launch, _rows, layer_norm, rms_norm, softmax

    from fuseaudit.case import Case

    spec = OPS[op]
    tuning = {"rms_norm": rms_norm.TUNING, "add_rms_norm": rms_norm.ADD_TUNING, "layer_norm": layer_norm.TUNING,
              "add_layer_norm": layer_norm.ADD_TUNING, "softmax": softmax.TUNING}[op]
    loops = op in ("softmax", "add_layer_norm")
    whole = _rows.row_block_config(16384, 20000, 4, tuning)
    assert whole.wide == loops, "the other norms hold float32 rows of 20000 whole"
    if not whole.wide:
        assert (whole.block_n, whole.num_warps) == (32768, _rows.WIDE_WHOLE_ROW_WARPS)
    else:  # float32 rows of two blocks or more (and narrower than float32_long's) loop in float32_wide blocks
        assert (whole.block_n, whole.num_warps) == tuning.float32_wide == (8192, 16)
        if op == "softmax":  # rows that fill their block are held whole
            for n in (16384, 32768):
                exact = _rows.row_block_config(16384, n, 4, tuning)
                assert (exact.wide, exact.block_n, exact.num_warps) == (False, n, _rows.WIDE_WHOLE_ROW_WARPS)
            assert _rows.row_block_config(16384, 20000, 4, tuning._replace(float32_whole_padded=True)).block_n == 32768
            assert _rows.row_block_config(1023, 32768, 4, tuning).wide, "fewer rows than float32_whole_min_rows loop"
            assert not _rows.row_block_config(1024, 32768, 4, tuning).wide
        else:
            fill = _rows.row_block_config(16384, 16384, 4, tuning)
            assert fill.wide and fill.block_n == 8192, "a row filling a block twice the cap loops too"
    if op == "softmax":  # narrower ones in half the cap
        narrow = _rows.row_block_config(16384, 11008, 4, tuning)
        assert (narrow.block_n, narrow.num_warps) == (_rows.MAX_FUSED_BYTES // 4 // 2, tuning.wide_warps)
        half = _rows.row_block_config(16384, 32768, 2, tuning._replace(half_long=()))  # (half_long: its own test)
        assert (half.block_n, half.num_warps) == (_rows.MAX_FUSED_BYTES // 2 // 2, tuning.wide_warps)
    elif op == "add_rms_norm":  # fused_scale = 2 would hold these whole anyway; float32_whole_from does
        assert not _rows.row_block_config(16384, 16384, 4, tuning).wide
        assert _rows.row_block_config(16384, 16384, 4, tuning._replace(float32_whole_from=0)).wide
    looped = _rows.row_block_config(16384, 40000, 4, tuning)
    assert looped.wide, "past FLOAT32_WHOLE_MAX the rows loop"
    if op == "layer_norm":  # in float32_long's blocks (test_float32_long_rows)
        assert (looped.block_n, looped.num_warps, looped.prefetch) == (16384, 32, 1)
    elif tuning.float32_wide:  # add_layer_norm and softmax: in their float32 blocks
        assert (looped.block_n, looped.num_warps) == tuning.float32_wide
    without = tuning._replace(float32_whole_from=0, float32_wide=None, float32_long=())
    assert _rows.row_block_config(16384, 20000, 2, tuning) == _rows.row_block_config(16384, 20000, 2, without), \
        "half precision keeps its own rules"
    for n in (20000, 32768, 40000):
        case = Case(op=op, dtype="float32", dims={"lead": (3,), "N": n}, regime="normal",
                    layouts={name: "padded" for name in spec.input_names}, params=spec.defaults(), seed=3)
        with _launch.retuned(_coop, ENABLED=False):  # what FUSEAUDIT_COOP=0 sets
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()
    if op == "softmax":  # three rows of 32768 held whole too: float32_whole_min_rows lowered
        case = Case(op=op, dtype="float32", dims={"lead": (3,), "N": 32768}, regime="shifted",
                    layouts={"x": "padded"}, params={"scale": 0.5}, seed=4)
        with _launch.retuned(_coop, ENABLED=False), \
                _launch.retuned(softmax, TUNING=tuning._replace(float32_whole_min_rows=0)):
            assert not _rows.row_block_config(3, 32768, 4, softmax.TUNING).wide
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax"])
def test_two_blocks_with_many_rows(op, fuseaudit_device):
    """Rows of exactly two ``RowTuning.two_blocks`` blocks loop over them from ``min_rows`` rows: rms_norm's rows of
    8192 in both precisions, softmax's of 8192 in float32 and of 16384 in half precision; the rest (and fewer rows,
    and other widths) keep their rules.  Three strided rows of that width (8192 where no rule applies) with
    ``min_rows`` lowered to 3, through whichever path that picks, against float64."""
    import importlib

    from fuseaudit.kernels import _coop, _launch, _rows

    from fuseaudit.case import Case

    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    attr = "ADD_TUNING" if op.startswith("add_") else "TUNING"
    tuning = getattr(module, attr)
    loops = {"rms_norm": {2: (8192, 4096, 8, 1), 4: (8192, 4096, 16, 2)},
             "softmax": {2: (2048, 8192, 8, 0), 4: (2048, 4096, 8, 1)}}
    loops = loops.get(op, {})
    plain = tuning._replace(two_blocks=None, float32_two_blocks=None)
    width = {}
    for size in (2, 4):
        two = tuning.float32_two_blocks if size == 4 else tuning.two_blocks
        assert (two and tuple(two)) == loops.get(size), "the measured rule (see TwoBlocks)"
        many = two.min_rows if two else 16384
        n = width[size] = 2 * two.block if two else 8192
        blocks = _rows.row_block_config(many, n, size, tuning)
        if two:
            assert blocks.wide and (blocks.block_n, blocks.num_warps, blocks.prefetch) == tuple(two)[1:]
        for rows, m in ((many - 1, n), (many, n // 2), (many, n - 192), (many, 2 * n)):  # fewer rows, other widths
            assert _rows.row_block_config(rows, m, size, tuning) == _rows.row_block_config(rows, m, size, plain)
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        case = Case(op=op, dtype=dtype, dims={"lead": (3,), "N": width[size]}, regime="normal",
                    layouts={name: "transposed" if size == 2 else "padded" for name in spec.input_names},
                    params=spec.defaults(), seed=5)
        lowered = tuning._replace(**{k: v and v._replace(min_rows=3) for k, v in
                                     (("two_blocks", tuning.two_blocks),
                                      ("float32_two_blocks", tuning.float32_two_blocks))})
        with _launch.retuned(module, **{attr: lowered}), _launch.retuned(_coop, ENABLED=False):
            assert _rows.row_block_config(3, width[size], size, lowered).wide == (size in loops)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ROW_OPS)
def test_long_half_rows(op, fuseaudit_device):
    """Half-precision rows past the cap loop in the blocks of ``half_long``'s rules by width (``_rows.HalfLong``,
    measured on the H200): softmax from 16385 columns, prefetching with pass 1 in lanes, in blocks of 4096 x 8 warps
    to 20480, 8192 x 16 to 49151, 16384 x 16 to 98303 (up to 128 rows of 65536 and more in 32768 x 32), 32768 x 32
    beyond; the residual norms from 65536 in 16384 x 16; rms_norm from 65536 in 32768 x 32 (up to 128 rows 16384 x
    32); layer_norm from 49152 to 98304 in 16384 x 32.  Narrower and wider rows and float32 keep the other rules.
    With each op's rules lowered to rows of 1000 and more (blocks of 256, the last partial; 512 for two rows where a
    rule has a ``few``), strided bfloat16 rows go through them against float64, and rows one column narrower (or
    past the last rule) through the default blocks."""
    import importlib

    from fuseaudit.kernels import _rows

    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    attr = "ADD_TUNING" if op.startswith("add_") else "TUNING"
    tuning = getattr(module, attr)
    lanes = {"prefetch": 1, "lanes": True}
    measured = {"softmax": (_rows.HalfLong(16385, 4096, 8, max_n=20480, **lanes),
                            _rows.HalfLong(20481, 8192, 16, max_n=49151, **lanes),
                            _rows.HalfLong(49152, 16384, 16, max_n=65535, **lanes),
                            _rows.HalfLong(65536, 16384, 16, max_n=98303, few=(128, 32768, 32), **lanes),
                            _rows.HalfLong(98304, 32768, 32, **lanes)),
                "rms_norm": (_rows.HalfLong(65536, 32768, 32, few=(128, 16384, 32)),),
                "layer_norm": (_rows.HalfLong(49152, 16384, 32, max_n=98304),)}
    rules = tuning.half_long
    assert rules == measured.get(op, (_rows.HalfLong(65536, 16384, 16),)), "as measured"
    assert all(a.max_n and a.max_n < b.min_n for a, b in zip(rules, rules[1:])), "ranges in order, apart"
    plain = tuning._replace(half_long=())
    for rule in rules:
        prefetch = tuning.wide_prefetch if rule.prefetch is None else rule.prefetch
        widths = (rule.min_n, rule.max_n) if rule.max_n else (rule.min_n, 131072, 128256)
        for n in widths:
            blocks = _rows.row_block_config(16384, n, 2, tuning)
            assert blocks.wide and (blocks.block_n, blocks.num_warps, blocks.prefetch, blocks.lanes) == (
                rule.block, rule.warps, prefetch, rule.lanes), n
            if rule.few:  # at most few[0] rows: its blocks (rows the cooperative split takes never get here)
                assert tuple(_rows.row_block_config(rule.few[0], n, 2, tuning))[1:3] == rule.few[1:]
                assert tuple(_rows.row_block_config(rule.few[0] + 1, n, 2, tuning))[1:3] == (rule.block, rule.warps)
            assert _rows.row_block_config(16384, n, 4, tuning) == _rows.row_block_config(16384, n, 4, plain), \
                "float32 keeps its rules"
    outside = (rules[0].min_n - 1,) + ((rules[-1].max_n + 1,) if rules[-1].max_n else ())
    for n in outside:
        assert _rows.row_block_config(16384, n, 2, tuning) == _rows.row_block_config(16384, n, 2, plain), n
        assert _rows.row_block_config(8, n, 2, tuning) == _rows.row_block_config(8, n, 2, plain), n
    lowered_rules = tuple(rule._replace(min_n=1000 + 200 * i, max_n=rule.max_n and 1199 + 200 * i, block=256,
                                        warps=4, few=rule.few and (2, 512, 4)) for i, rule in enumerate(rules))
    lowered = tuning._replace(half_long=lowered_rules)
    cases = [(3, 999, 64)] + [(3, rule.min_n, 256) for rule in lowered_rules]
    cases += [(2, rule.min_n, 512) for rule in lowered_rules if rule.few]
    cases += [(3, lowered_rules[-1].max_n + 1, 64)] * bool(lowered_rules[-1].max_n)
    _through_lowered_rule(op, lowered, tuple(cases), fuseaudit_device)


def _through_lowered_rule(op: str, lowered, cases, device: str, *, dtype: str = "bfloat16") -> None:
    """Strided ``dtype`` rows ``(rows, n)`` through ``op``'s tuning replaced by ``lowered`` with a 256-byte cap
    (default looped blocks of 64 half-precision elements), each in blocks of ``expected`` columns, against float64."""
    import importlib

    from fuseaudit.kernels import _coop, _launch, _rows

    from fuseaudit.case import Case

    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    attr = "ADD_TUNING" if op.startswith("add_") else "TUNING"
    with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(module, **{attr: lowered}), \
            _launch.retuned(_coop, ENABLED=False):
        for rows, n, expected in cases:
            assert _rows.row_block_config(rows, n, getattr(torch, dtype).itemsize, lowered).block_n == expected
            case = Case(op=op, dtype=dtype, dims={"lead": (rows,), "N": n}, regime="normal",
                        layouts={name: "transposed" for name in spec.input_names}, params=spec.defaults(), seed=7)
            run_case(spec, spec.load_reference(), case, device=device, target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("op", ROW_OPS)
def test_short_half_rows(op, fuseaudit_device):
    """Half-precision rows past the cap and narrower than ``half_short[0]`` loop in its smaller blocks (the plain
    norms' rows from 16385 in blocks of 4096: layer_norm's to 32767, rms_norm's to 20480, where blocks of 4096
    pad less than blocks of 8192), from ``min_rows`` rows (256); fewer rows, wider ones, float32 and rows no
    wider than its block keep
    their rules.  With the rule lowered to rows below 1000 (blocks of 256), strided bfloat16 rows of 999 go
    through it against float64, and rows of 1000 and of 200 through the default blocks."""
    import importlib

    from fuseaudit.kernels import _rows

    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    attr = "ADD_TUNING" if op.startswith("add_") else "TUNING"
    tuning = getattr(module, attr)
    measured = {"rms_norm": (20481, 4096, 16, 256), "layer_norm": (32768, 4096, 8, 256)}
    assert tuning.half_short == measured.get(op), "as measured"
    if tuning.half_short is None:
        return
    max_n, block, warps, min_rows = tuning.half_short
    for rows, n in ((16384, 16385), (min_rows, 20000), (1024, max_n - 1)):
        blocks = _rows.row_block_config(rows, n, 2, tuning)
        expected = (block, warps, tuning.wide_prefetch)
        assert blocks.wide and (blocks.block_n, blocks.num_warps, blocks.prefetch) == expected, n
    plain = tuning._replace(half_short=None)
    for rows, n, size in ((16384, max_n, 2), (1024, 40000, 2), (16384, 20000, 4), (16384, 16384, 2),
                          (min_rows - 1, 20000, 2), (1, 20000, 2)):
        assert _rows.row_block_config(rows, n, size, tuning) == _rows.row_block_config(rows, n, size, plain)
    lowered = tuning._replace(half_short=_rows.HalfShort(1000, 256, 4, min_rows=1))
    _through_lowered_rule(op, lowered, ((3, 999, 256), (3, 1000, 64), (3, 200, 64)), fuseaudit_device)


@pytest.mark.parametrize("op", ROW_OPS)
def test_narrow_rows_loop(op, fuseaudit_device):
    """Many half-precision rows that fit whole loop instead where a block divides them (``_rows.NarrowLooped``,
    layer_norm's, measured on the H200): from 256 rows, 12289 to 16384 in blocks of 4096 or 2048 in 16 warps; from
    1024 rows, 5121 to 8192 in 4096 or 2048 in 8 warps, 5120 in 1024 in 8, 2048 to 4096 in 2048 in 4.  They are
    compiled for their width with Welford's pass 1 up to ``FIXED_WIDTH_MAX``; fewer rows, widths no block divides
    or outside the ranges, float32 and the other ops keep their rules, and wider rows, float32 and the residual
    variant keep N a runtime argument (but its rows of 65536 and more, in ``ADD_TUNING.half_long``'s blocks, are
    compiled for their width too).  With the rule lowered to rows of 65 to 128 (blocks of 32 or 16) and of 40 to 64
    (blocks of 8), strided bfloat16 rows go through it against float64."""
    import importlib

    from fuseaudit.kernels import _coop, _launch, _rows, layer_norm

    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    tuning = getattr(module, "ADD_TUNING" if op.startswith("add_") else "TUNING")
    measured = (_rows.NarrowLooped(12289, 16384, 256, (4096, 2048), 16),
                _rows.NarrowLooped(5121, 8192, 1024, (4096, 2048), 8),
                _rows.NarrowLooped(4097, 5120, 1024, (1024,), 8),
                _rows.NarrowLooped(2048, 4096, 1024, (2048,), 4))
    assert tuning.half_looped == (measured if op == "layer_norm" else ()), "as measured"
    if op != "layer_norm":
        return
    for rows, n, block, warps in ((16384, 14336, 2048, 16), (256, 16384, 4096, 16), (1024, 14336, 2048, 16),
                                  (16384, 8192, 4096, 8), (1024, 6144, 2048, 8), (16384, 5120, 1024, 8),
                                  (1024, 4096, 2048, 4), (16384, 2048, 2048, 4)):
        blocks = _rows.row_block_config(rows, n, 2, tuning)
        assert blocks.wide and (blocks.block_n, blocks.num_warps, blocks.prefetch) == (block, warps, 1), (rows, n)
    plain = tuning._replace(half_looped=())
    for rows, n, size in ((255, 16384, 2), (16384, 15000, 2), (16384, 12288, 2), (16384, 14336, 4),
                          (1023, 8192, 2), (16384, 7000, 2), (16384, 3072, 2), (16384, 1024, 2), (16384, 4096, 4)):
        assert _rows.row_block_config(rows, n, size, tuning) == _rows.row_block_config(rows, n, size, plain)
    assert layer_norm.FIXED_WIDTH_MAX == 98304, "as measured"

    def fixed(rows, n, dtype=torch.bfloat16, residual=False):
        plan = _plan_for("add_layer_norm" if residual else "layer_norm", rows, n, dtype, fuseaudit_device)
        assert plan.kernel is layer_norm.layer_norm_wide_kernel, (rows, n)
        return plan.meta["N_FIXED"]

    with _launch.retuned(_coop, ENABLED=False):  # (a few wide rows would take the cooperative kernel)
        assert fixed(256, 14336) == 14336 and fixed(8, 49151) == 49151 and fixed(16384, 65536) == 65536
        assert fixed(8, 98304) == 98304
        assert fixed(8, 98305) == fixed(16384, 131072) == 0
        assert fixed(8, 40000, torch.float32) == 40000 and fixed(16384, 131072, torch.float32) == 131072
        assert fixed(8, 40000, residual=True) == fixed(8, 65536, torch.float32, residual=True) == 0
        # the residual variant's rows in ADD_TUNING.half_long's blocks (65536 and more)
        assert fixed(8, 65536, residual=True) == 65536 and fixed(8, 131072, torch.float16, residual=True) == 131072
    lowered = tuning._replace(half_looped=(_rows.NarrowLooped(65, 128, 1, (32, 16), 4),
                                           _rows.NarrowLooped(40, 64, 1, (8,), 2)))
    _through_lowered_rule(op, lowered, ((3, 96, 32), (3, 80, 16), (3, 100, 128), (3, 64, 8), (3, 40, 8),
                                        (3, 36, 64)), fuseaudit_device)


def test_float32_long_rows(fuseaudit_device):
    """float32 rows that loop take a tuning's ``float32_long`` blocks, as measured on the H200 (see the tunings):
    layer_norm's (past ``FLOAT32_WHOLE_MAX``) blocks of 16384 in 32 warps, prefetching in pass 1, compiled for the
    row's width with Welford's pass 1, and ``KEEP`` where the blocks divide the row; softmax's alike from 49152
    columns where they pad the row no more than blocks of 8192 (other rows: ``float32_wide``'s 8192 in 16 warps);
    add_layer_norm keeps ``float32_wide``'s blocks and
    Chan's pass 1.  With the rules lowered (rows of 65 columns and more in blocks of 16, a 256-byte cap), strided
    float32 rows of 96 (blocks that divide it: layer_norm keeps its last block) and 100 go through them against
    float64."""
    from fuseaudit.kernels import _coop, _launch, _rows, layer_norm, softmax

    def looped(n, tuning):
        blocks = _rows.row_block_config(16384, n, 4, tuning)
        assert blocks.wide, n
        return blocks.block_n, blocks.num_warps, blocks.prefetch

    for n in (33000, 40000, 49152, 50000, 57344, 65536, 80000, 131072):
        assert looped(n, layer_norm.TUNING) == (16384, 32, 1), n
        assert looped(n, layer_norm.ADD_TUNING) == (8192, 16, 2), n
        padded_more = n in (50000, 57344)  # (65536 columns in blocks of 16384, 57344 in blocks of 8192)
        assert looped(n, softmax.TUNING) == ((16384, 32, 1) if n >= 49152 and not padded_more else (8192, 16, 2)), n
    assert not _rows.row_block_config(16384, 32768, 4, layer_norm.TUNING).wide, "held whole up to 32768"
    with _launch.retuned(_coop, ENABLED=False):  # (a few wide rows would take the cooperative kernel)
        for op, n, fixed, keep in (("layer_norm", 65536, 65536, True), ("layer_norm", 131072, 131072, True),
                                   ("layer_norm", 40000, 40000, False), ("add_layer_norm", 65536, 0, False)):
            plan = _plan_for(op, 8, n, torch.float32, fuseaudit_device)
            assert (plan.meta["N_FIXED"], plan.meta["KEEP"]) == (fixed, keep), (op, n)
    lowered = (_rows.HalfLong(65, 16, 4, prefetch=1),)
    with _launch.retuned(layer_norm, KEEP_MIN_N=0):
        for op, module in (("layer_norm", layer_norm), ("softmax", softmax)):
            _through_lowered_rule(op, module.TUNING._replace(float32_long=lowered), ((3, 96, 16), (3, 100, 16)),
                                  fuseaudit_device, dtype="float32")
            if op == "layer_norm":
                with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(_coop, ENABLED=False), \
                        _launch.retuned(layer_norm, TUNING=layer_norm.TUNING._replace(float32_long=lowered)):
                    plan = _plan_for(op, 3, 96, torch.float32, fuseaudit_device)
                    assert (plan.meta["BLOCK_N"], plan.meta["N_FIXED"], plan.meta["KEEP"]) == (16, 96, True)


def test_layer_norm_keeps_last_block(fuseaudit_device):
    """Plain layer_norm's looped kernel, where pass 1 is Welford's (half precision, compiled for the width), takes
    the block that pass ends on from registers as pass 2's first (``keep_last``: the kernel's ``KEEP``), where the
    row is more than one block, from ``KEEP_MIN_N`` columns, in blocks that divide it (as measured on the H200).  It
    changes no result: through the lowered cap and rule (blocks of 64; rows of 1024, 192 and 256, with and without
    prefetching, strided), the outputs with and without it are bitwise equal, and match float64; the kernel keeps
    a partial last block as well (rows of 1000)."""
    from fuseaudit.kernels import _coop, _launch, _rows, layer_norm

    from fuseaudit.case import Case

    assert layer_norm.KEEP_MIN_N == 16385, "as measured"

    def keep(rows, n, dtype=torch.bfloat16, residual=False):
        plan = _plan_for("add_layer_norm" if residual else "layer_norm", rows, n, dtype, fuseaudit_device)
        return plan.kernel is layer_norm.layer_norm_wide_kernel and plan.meta["KEEP"]

    with _launch.retuned(_coop, ENABLED=False):
        assert keep(16384, 65536) and keep(1024, 65536, torch.float16) and keep(8, 98304) and keep(16384, 32768)
        assert keep(8, 49152) and keep(1024, 24576)
        assert not (keep(16384, 16384) or keep(16384, 14336) or keep(1024, 4096)), "narrower than KEEP_MIN_N"
        assert not (keep(16384, 40000) or keep(16384, 20000)), "blocks that do not divide the row"
        assert not (keep(8, 131072) or keep(8, 40000, torch.float32) or keep(16384, 65536, residual=True))
    spec = OPS["layer_norm"]
    torch.manual_seed(0)
    for prefetch in (0, 1):
        tuning = layer_norm.TUNING._replace(wide_prefetch=prefetch)
        with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(layer_norm, TUNING=tuning, KEEP_MIN_N=0), \
                _launch.retuned(_coop, ENABLED=False):
            for dtype, n in ((torch.bfloat16, 1024), (torch.float16, 192), (torch.bfloat16, 256),
                             (torch.bfloat16, 1000)):
                assert keep(3, n, dtype) == (n % 64 == 0), n
                x = torch.randn(n, 3, device=fuseaudit_device).to(dtype).t()  # strided rows
                w, b = torch.randn(2, n, device=fuseaudit_device).to(dtype)
                outputs = []
                for forced in (True, False):  # the kernel with KEEP and without, whatever the rule says
                    with _launch.retuned(layer_norm, keep_last=lambda *args, forced=forced: forced):
                        assert keep(3, n, dtype) == forced
                        outputs.append(layer_norm.layer_norm(x, w, b))
                assert torch.equal(*outputs), (dtype, n, prefetch)
                case = Case(op="layer_norm", dtype=str(dtype).removeprefix("torch."), dims={"lead": (3,), "N": n},
                            regime="normal", layouts={name: "transposed" for name in spec.input_names},
                            params=spec.defaults(), seed=n)
                run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                         target=spec.reference).raise_for_failures()


def test_split_warps():
    """A split row gets ``2 x element size`` warps, more where a thread would hold over ``SPLIT_MAX_PER_THREAD``
    elements: the layer_norms' half-precision rows of 8192 + 4096 (N = 11008) and 8192 + 2048 in 8 warps, 8192 +
    1024 (9000), 5120 and 6000 in 4 (plain layer_norm's many rows of 5120 loop instead: NarrowLooped); rms_norm's
    uneven rows held whole (RowTuning.uneven_split) alike."""
    from fuseaudit.kernels import _rows, layer_norm, rms_norm

    cases = ((11008, 2, 8), (12000, 2, 8), (10000, 2, 8), (9000, 2, 4), (8200, 2, 4), (5120, 2, 4), (6000, 2, 4),
             (3000, 2, 4), (11008, 4, 8), (5120, 4, 8))
    assert _rows.row_block_config(16384, 5120, 2, layer_norm.TUNING).wide
    plain = tuple(c for c in cases if c[:2] != (5120, 2))
    for tuning, rows, widths in ((layer_norm.TUNING, 16384, plain), (layer_norm.ADD_TUNING, 16384, cases),
                                 (rms_norm.TUNING, 1024, ((9000, 2, 4), (11008, 2, 8), (14336, 2, 8)))):
        for n, element_size, warps in widths:
            blocks = _rows.row_block_config(rows, n, element_size, tuning)
            assert blocks.block_t and not blocks.wide, (n, element_size)
            assert blocks.num_warps == warps, (n, element_size, blocks)
            per_thread = (blocks.block_n + blocks.block_t) / (32 * blocks.num_warps)
            assert per_thread <= _rows.SPLIT_MAX_PER_THREAD


def test_rms_norm_fixed_width(fuseaudit_device):
    """rms_norm's looped kernel is compiled for the row's width (``N_FIXED``) in half-precision rows of 20481 to
    65536 and in any that loop in blocks of 16384 or more (rows of 65536 and more: 32768, ``half_long``; up to 128
    rows 16384, its ``few``), without a residual (measured on the H200, see ``FIXED_WIDTH_MAX``); narrower rows,
    float32 and add_rms_norm keep N a runtime argument.  With the range lowered to every width and the cap to 256
    bytes, bfloat16 and float16 rows, contiguous and strided, in blocks that divide them or not and with pass 1 in
    wider blocks (StatsBlock), go through the kernel compiled for their width against float64."""
    from fuseaudit.kernels import _coop, _launch, _rows, rms_norm

    from fuseaudit.case import Case

    assert (rms_norm.FIXED_WIDTH_MIN, rms_norm.FIXED_WIDTH_MAX, rms_norm.FIXED_BLOCK) == (20481, 65536, 16384)
    assert rms_norm.TUNING.half_long[0].few == (128, rms_norm.FIXED_BLOCK, 32), "as measured"

    def fixed(rows, n, dtype=torch.bfloat16, residual=False):
        plan = _plan_for("add_rms_norm" if residual else "rms_norm", rows, n, dtype, fuseaudit_device)
        assert plan.kernel is rms_norm.rms_norm_wide_kernel, (rows, n)
        return plan.meta["N_FIXED"], plan.meta["BLOCK_N"]

    with _launch.retuned(_coop, ENABLED=False):  # (a few wide rows would take the cooperative kernel)
        assert fixed(256, 20481) == (20481, 8192) and fixed(1024, 32768, torch.float16) == (32768, 8192)
        assert fixed(2048, 57344) == (57344, 8192) and fixed(1024, 65536) == (65536, 32768)
        assert fixed(128, 65536) == (65536, 16384) and fixed(129, 98304) == (98304, 32768)
        assert fixed(16384, 131072) == (131072, 32768)
        assert fixed(256, 20000)[0] == fixed(16384, 14336)[0] == fixed(8, 65537, torch.float32)[0] == 0
        assert fixed(8, 40000, residual=True)[0] == fixed(8, 131072, residual=True)[0] == 0
    spec = OPS["rms_norm"]
    everywhere = {"FIXED_WIDTH_MIN": 0, "FIXED_WIDTH_MAX": 10**6}
    for stats in (None, _rows.StatsBlock(0, 10**6, 256, 1)):
        tuning = rms_norm.TUNING._replace(stats_block=stats)
        with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(rms_norm, TUNING=tuning, **everywhere):
            for dtype, n, layout in (("bfloat16", 1000, "transposed"), ("float16", 1024, "contiguous"),
                                     ("bfloat16", 777, "padded")):
                plan = _plan_for("rms_norm", 3, n, getattr(torch, dtype), fuseaudit_device)
                assert plan.kernel is rms_norm.rms_norm_wide_kernel and plan.meta["N_FIXED"] == n
                assert plan.meta["BLOCK_S"] == (256 if stats else plan.meta["BLOCK_N"])
                case = Case(op="rms_norm", dtype=dtype, dims={"lead": (3,), "N": n},
                            layouts={name: layout for name in spec.input_names}, params=spec.defaults(), seed=n)
                run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                         target=spec.reference).raise_for_failures()


def test_rms_norm_streams_wide_rows(fuseaudit_device):
    """rms_norm's looped kernel stores ``y`` evict-first in rows of ``STREAM_Y_MIN_BYTES`` (128 KiB: half-precision
    rows of 65536) and more, add_rms_norm's never (both measured on the H200, see rms_norm.py).  With the limit
    lowered to 512 bytes and the cap to 256, bfloat16 rows of 300 go through the looped kernel both ways (the plan
    says which) against float64; rows of 200 stay below the limit."""
    from fuseaudit.kernels import _launch, _rows, rms_norm

    from fuseaudit.case import Case

    assert rms_norm.STREAM_Y_MIN_BYTES == 128 * 1024, "as measured"
    assert rms_norm.stream_y(65536, 2, False) and rms_norm.stream_y(131072, 2, False)
    assert not rms_norm.stream_y(40000, 2, False) and not rms_norm.stream_y(65536, 2, True)
    with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(rms_norm, STREAM_Y_MIN_BYTES=512):
        for op, n, streams in (("rms_norm", 300, True), ("rms_norm", 200, False), ("add_rms_norm", 300, False)):
            spec = OPS[op]
            case = Case(op=op, dtype="bfloat16", dims={"lead": (3,), "N": n}, regime="normal",
                        layouts={name: "transposed" for name in spec.input_names}, params=spec.defaults(), seed=n)
            plan = _plan_for(op, 3, n, torch.bfloat16, fuseaudit_device)
            assert plan.kernel is rms_norm.rms_norm_wide_kernel and plan.meta["STREAM_Y"] is streams, (op, n)
            run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                     target=spec.reference).raise_for_failures()


def test_paired_rows(fuseaudit_device):
    """rms_norm's half-precision rows of exactly 4096, from 1024 rows, are held two a program in 8 warps
    (``RowTuning.paired_rows``, measured on the H200); rows of 2048 and 8192, fewer rows, float32 and add_rms_norm
    keep the tile rule (one row a program), and the interpreter its own tiles.  1024 rows of 4096 in bfloat16 and
    float16 then go through rms_norm against float64 (on a GPU two rows a program, on the CPU in the interpreter's
    tiles)."""
    from fuseaudit.kernels import _rows, rms_norm

    from fuseaudit.case import Case

    assert rms_norm.TUNING.paired_rows == (4096, 8, 1024) and rms_norm.ADD_TUNING.paired_rows is None, "as measured"

    def config(rows, n, size, tuning=rms_norm.TUNING, interpreter=False):
        return _rows._row_block_config(rows, n, size, tuning, _rows.MAX_FUSED_BYTES, interpreter)

    assert config(1024, 4096, 2)[:4] == (2, 4096, 8, False) and config(16384, 4096, 2).block_m == 2
    for rows, n, size in ((1023, 4096, 2), (1024, 2048, 2), (1024, 8192, 2), (1024, 4096, 4)):
        assert config(rows, n, size).block_m == 1, (rows, n, size)
    assert config(1024, 4096, 2, rms_norm.ADD_TUNING).block_m == 1
    assert config(1024, 4096, 2, interpreter=True) == config(1024, 4096, 2, rms_norm.TUNING._replace(paired_rows=None),
                                                             interpreter=True)
    spec = OPS["rms_norm"]
    for dtype in ("bfloat16", "float16"):
        case = Case(op="rms_norm", dtype=dtype, dims={"lead": (1024,), "N": 4096},
                    layouts={name: "contiguous" for name in spec.input_names}, params=spec.defaults(), seed=4096)
        run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()
    plan = _plan_for("rms_norm", 1024, 4096, torch.bfloat16, fuseaudit_device)
    assert plan.meta["BLOCK_M"] == config(1024, 4096, 2, interpreter=_rows.interpreting()).block_m


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_stats_block(op, fuseaudit_device):
    """rms_norm's many half-precision rows of 57344 to 65535 loop with pass 1 in blocks of 32768, summed a 16-byte
    vector at a time (``_rows.StatsBlock``, measured on the H200); fewer than 2048 rows, other widths (rows of 65536
    loop in blocks of 32768 throughout), float32 and the residual variants keep pass 1 in the looped kernel's own
    blocks, and layer_norm has no such rule now (its rows of 49152 to 98304 took Welford's pass).  With the cap
    lowered to 256 bytes and a StatsBlock for every width, rows of 1000 (pass 1 in blocks of 256 and 512 against
    pass 2's 64: masked last blocks) and of 1024 (whole blocks), bfloat16 and float16, contiguous and strided, and
    layer_norm's hard value regimes (its shift ``k`` is the first pass-1 block's mean; its kernel still takes a
    StatsBlock a tuning gives), go through the looped kernel against float64."""
    import importlib

    from fuseaudit.kernels import _launch, _rows

    from fuseaudit.case import Case

    module = importlib.import_module(f"fuseaudit.kernels.{op}")
    wide_kernel = getattr(module, f"{op}_wide_kernel")
    measured = _rows.StatsBlock(57344, 65535, 32768, 2048) if op == "rms_norm" else None
    assert module.TUNING.stats_block == measured, "as measured"
    assert module.ADD_TUNING.stats_block is None

    def block_s(rows, n, size, tuning=module.TUNING):
        return _rows.row_block_config(rows, n, size, tuning).block_s

    for tuning in (module.TUNING, module.ADD_TUNING):
        assert block_s(16384, 65536, 2, tuning) == block_s(16384, 65536, 4, tuning) == 0
        assert block_s(16384, 57344, 2, tuning) == (32768 if measured and tuning is module.TUNING else 0)
    if measured:
        assert block_s(2048, 57344, 2) == block_s(16384, 65535, 2) == 32768
        for rows, n in ((2047, 57344), (16384, 57343), (16384, 131072)):
            assert block_s(rows, n, 2) == 0, (rows, n)
    spec = OPS[op]
    regimes = ("normal", "near_constant", "large", "outliers") if op == "layer_norm" else ("normal",)
    for block in (256, 512):
        stats = _rows.StatsBlock(0, 10**6, block, 1)
        # (layer_norm's rows that take these blocks are past FIXED_WIDTH_MAX: pass 1 by shifted sums)
        past_fixed = {"FIXED_WIDTH_MAX": 0} if op == "layer_norm" else {}
        with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(
                module, TUNING=module.TUNING._replace(stats_block=stats), **past_fixed):
            for dtype, n, layout in (("bfloat16", 1000, "transposed"), ("float16", 1024, "contiguous"),
                                     ("bfloat16", 1024, "padded")):
                plan = _plan_for(op, 3, n, getattr(torch, dtype), fuseaudit_device)
                assert plan.kernel is wide_kernel and plan.meta["BLOCK_S"] == block > plan.meta["BLOCK_N"]
                assert plan.meta.get("N_FIXED", 0) == 0
                for regime in regimes:
                    case = Case(op=op, dtype=dtype, dims={"lead": (3,), "N": n}, regime=regime,
                                layouts={name: layout for name in spec.input_names}, params=spec.defaults(),
                                seed=block + n)
                    run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                             target=spec.reference).raise_for_failures()


@pytest.mark.parametrize("spec", WIDE_OPS, ids=[op.name for op in WIDE_OPS])
def test_even_blocks(spec, fuseaudit_device):
    """Where the looped kernel's blocks divide the row (``_rows.even_blocks``) it drops its column masks, except on
    the blocks it loads ahead.  With the cap lowered to 256 bytes, rows of 1024 (16 or 32 whole blocks) and of 1000
    (a partial last block) at every prefetch level, bfloat16 and float32, strided, against float64; the plan's
    ``EVEN`` says which path ran (softmax's float32 rows keep their masks: they measured faster so)."""
    import importlib

    from fuseaudit.kernels import _launch, _rows

    from fuseaudit.case import Case

    assert _rows.even_blocks(65536, 8192, 32768) and not _rows.even_blocks(40000, 8192)
    module = importlib.import_module(spec.reference.split(":")[0])
    name = "TUNING" if spec.name in ("rms_norm", "layer_norm", "softmax") else "ADD_TUNING"
    for prefetch in (0, 2):
        patched = getattr(module, name)._replace(wide_prefetch=prefetch, float32_wide_prefetch=prefetch)
        with _launch.retuned(_rows, MAX_FUSED_BYTES=256), _launch.retuned(module, **{name: patched}):
            for dtype, n in (("bfloat16", 1024), ("float32", 1024), ("bfloat16", 1000)):
                case = Case(op=spec.name, dtype=dtype, dims={"lead": (3,), "N": n}, regime="normal",
                            layouts={name: "transposed" for name in spec.input_names}, params=spec.defaults(),
                            seed=n + prefetch)
                blocks = _rows.row_block_config(3, n, getattr(torch, dtype).itemsize, patched)
                assert blocks.wide and blocks.prefetch == prefetch
                plan = _plan_for(spec.name, 3, n, getattr(torch, dtype), fuseaudit_device)
                even = n == 1024 and not (spec.name == "softmax" and dtype == "float32")
                assert plan.meta["EVEN"] is even, (dtype, n)
                run_case(spec, spec.load_reference(), case, device=fuseaudit_device,
                         target=spec.reference).raise_for_failures()
