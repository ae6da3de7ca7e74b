"""The row ops' launch tables (``fuseaudit/kernels/tuning_h200.json``): total, disjoint, and every config correct.

Each table row maps a dtype, a range of row counts and a range of widths to
a :class:`~fuseaudit.kernels._tuning.RowConfig`.  The look-up must find
exactly one row for any call, and every config must give the right answer:
each is forced through the op's wrapper (``with_config``) and
:func:`fuseaudit.check.run_case` on a small shape it can run, its column
blocks scaled down (a looped config's blocks to 64 columns, the widths it
holds alike) and, for the cooperative split, the ``_coop`` constants lowered
so that a few small rows split (16 SMs counted, chunks of 16 bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuseaudit.case import Case
from fuseaudit.catalog import OPS
from fuseaudit.check import run_case
from fuseaudit.kernels import _coop, _launch, _tuning
from fuseaudit.kernels._tuning import RowConfig, Split, TableRow

_TUNE_ROWS = Path(__file__).resolve().parent.parent / "tuning" / "tune_rows.py"
ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
HALF_BLOCK = 64  # a looped config's block, scaled down
LAYOUTS = ("contiguous", "padded", "transposed")


def _distinct(op: str) -> list[tuple[str, RowConfig, TableRow]]:
    """Each ``(dtype class, config)`` of the op's table once (and each split's fallback), with a row holding it."""
    seen: dict[tuple[frozenset[str], RowConfig], TableRow] = {}
    for row in _tuning.TABLES[op]:
        for config in (row.config, dataclasses.replace(row.config, split=None)):
            seen.setdefault((row.dtypes, config), row)
    return [("float32" if "fp32" in dtypes else "bfloat16", config, row) for (dtypes, config), row in seen.items()]


def _small(config: RowConfig, row: TableRow) -> tuple[RowConfig, int, int]:
    """``(config, rows, N)``: the config with its blocks scaled down, and a shape it runs as it would at full size."""
    rows = 3
    if config.kernel == "looped":
        scale = max(config.block_n // HALF_BLOCK, 1)
        small = dataclasses.replace(config, block_n=config.block_n // scale, block_s=config.block_s // scale)
        if row.min_n == row.max_n:  # a width the config holds exactly (e.g. two blocks)
            n = max(row.min_n // scale, 1)
        else:
            n = 4 * small.stats_block if config.keep else 3 * small.block_n + 37
    else:
        small = config
        n = 600 if config.kernel == "tail" else (min(row.min_n, 512) if row.min_n == row.max_n else 300)
    if config.split is not None and config.split.chunk:  # many rows: 4 chunks of 32, groups looping over 12 rows
        small = dataclasses.replace(small, split=Split(chunk=32, warps=4, per_sm=1))
        rows, n = 12, 100
    elif config.split is not None:  # a few rows: 4 chunks of 64 (16 SMs, chunks of at least 16 bytes)
        n = max(n, 229)
    return small, rows, n


def _cases(op: str) -> list[tuple[str, RowConfig, int, int, int]]:
    """``(dtype, small config, rows, N, configs it stands for)``: configs that differ in ``num_warps`` alone run
    the same code under the interpreter, so one case covers them (``test_compile_hopper`` compiles each)."""
    groups: dict[tuple[str, RowConfig, int, int], int] = {}
    for dtype, config, row in _distinct(op):
        small, rows, n = _small(config, row)
        key = (dtype, dataclasses.replace(small, warps=4), rows, n)
        groups[key] = groups.get(key, 0) + 1
    return [(dtype, small, rows, n, count) for (dtype, small, rows, n), count in groups.items()]


CASES = [(op, i, *entry) for op in ROW_OPS for i, entry in enumerate(_cases(op))]


@contextlib.contextmanager
def _small_splits() -> Iterator[None]:
    """A few rows of a few elements split (16 SMs counted under the interpreter); one row a program as configured."""
    from fuseaudit.kernels import _tuning as tuning

    with _launch.retuned(_coop, MIN_CHUNK_BYTES=16, INTERPRETER_SMS=16), _launch.retuned(tuning, INTERPRETER_TILE=1):
        yield


@pytest.mark.parametrize(("op", "index", "dtype", "small", "rows", "n", "count"), CASES,
                         ids=[f"{op}-{i}" for op, i, *_ in CASES])
def test_every_config_is_correct(op, index, dtype, small, rows, n, count, fuseaudit_device):
    """The config, forced through the op's wrapper on a small strided shape, meets every property of the harness."""
    spec = OPS[op]
    module = importlib.import_module(spec.reference.split(":")[0])
    if dtype != "float32" and index % 2:
        dtype = "float16"
    layout = LAYOUTS[index % len(LAYOUTS)]
    case = Case(op=op, dtype=dtype, dims={"lead": (rows,), "N": n}, layouts={name: layout for name in spec.input_names},
                params=spec.defaults(), seed=index)
    with _small_splits():
        if small.split is not None:
            from torch import device

            size = 4 if dtype == "float32" else 2
            assert _coop.coop_config(rows, n, size, device(fuseaudit_device), small.split) is not None
        run_case(spec, module.with_config(op, small), case, device=fuseaudit_device,
                 target=spec.reference).raise_for_failures()


def _edges(op: str) -> list[int]:
    ends = {e for row in _tuning.TABLES[op] for e in (row.min_n, row.max_n) if e}
    return sorted({1, 2, 10**7} | {e + d for e in ends for d in (-1, 0, 1) if e + d >= 1})


@pytest.mark.parametrize("op", ROW_OPS)
def test_lookup_is_total_and_rows_do_not_overlap(op):
    """Every dtype x rows x N finds exactly one table row, and no two rows share a call."""
    table = _tuning.TABLES[op]
    rows_grid = sorted({1, 2, 10**7} | {e + d for row in table for e in (row.min_rows, row.max_rows) if e
                                        for d in (-1, 0, 1) if e + d >= 1})
    for dtype, rows, n in itertools.product(("fp16", "bf16", "fp32"), rows_grid, _edges(op)):
        holding = [row for row in table if row.holds(dtype, rows, n)]
        assert len(holding) == 1, f"{op} {dtype} {rows} rows x {n}: {len(holding)} rows hold it"
    for a, b in itertools.combinations(table, 2):
        if not a.dtypes & b.dtypes:
            continue
        rows_meet = a.min_rows <= (b.max_rows or 10**18) and b.min_rows <= (a.max_rows or 10**18)
        n_meet = a.min_n <= (b.max_n or 10**18) and b.min_n <= (a.max_n or 10**18)
        assert not (rows_meet and n_meet), f"{op}: {a} overlaps {b}"


def test_table_file_round_trips():
    """The table says where it was measured, and each config reads back as written."""
    assert {"device", "torch", "triton", "date"} <= set(_tuning.MEASURED)
    for table in _tuning.TABLES.values():
        for row in table:
            assert RowConfig.from_json(row.config.to_json()) == row.config


def _tune_rows():
    spec = importlib.util.spec_from_file_location("tune_rows", _TUNE_ROWS)
    tune_rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_rows)
    return tune_rows


def test_a_partial_tuning_run_stamps_the_rows_it_measured(tmp_path):
    """tune_rows.py's table after a run: the header says where every row was measured only where the
    run measured them all; a partial run's rows carry their own stamp, and the table still loads."""
    tune_rows = _tune_rows()
    old, new = {"device": "before", "torch": "-", "triton": "-", "date": "-"}, {**_tuning.MEASURED, "date": "now"}
    config = RowConfig(kernel="whole", warps=4).to_json()
    tables = {"softmax": [{"dtypes": "bf16", "rows": [1, None], "n": [1, None], "config": config, "measured": new},
                          {"dtypes": "fp32", "rows": [1, None], "n": [1, None], "config": config}]}
    header, rows = tune_rows.provenance(old, tables, new)
    assert header == old and rows["softmax"][0]["measured"] == new and "measured" not in rows["softmax"][1]
    tune_rows.write_table(tmp_path / "t.json", header, rows)
    measured, loaded = _tuning.load_tables(tmp_path / "t.json")
    assert measured == old and [r.config for r in loaded["softmax"]] == [RowConfig.from_json(config)] * 2
    tables["softmax"][1]["measured"] = new  # every row measured by this run: the header says so, the rows not
    header, rows = tune_rows.provenance(old, tables, new)
    assert header == new and not [r for r in rows["softmax"] if "measured" in r]


def test_a_tuning_run_confirms_the_fastest_screened_and_keeps_a_config_unless_beaten_everywhere():
    """tune_rows.py's two choices: which candidates the screen sends on (the least geometric mean over
    the row's shapes, never one that failed at a shape), and which one replaces the row's config."""
    tune_rows = _tune_rows()
    inf = float("inf")
    screened = [[10.0, 5.0, 9.0, 1.0, 8.0], [10.0, 5.0, 9.0, inf, 12.0]]  # per shape: the row's own config first
    assert tune_rows.finalists(screened, 2) == [0, 1, 2]
    assert tune_rows.finalists(screened, 9) == [0, 1, 2, 4]
    assert tune_rows.pick([[10.0, 9.0, 8.0], [10.0, 9.0, 10.0]], 0.02) == 1  # 2 ties the row's config at one shape
    assert tune_rows.pick([[10.0, 9.9], [10.0, 9.0]], 0.02) == 0  # within the gain at one shape: kept
    assert tune_rows.pick([[10.0, 9.0, 8.0], [10.0, 9.0, 8.5]], 0.02) == 2


def test_the_screen_drops_a_candidate_at_the_first_shape_it_loses(monkeypatch):
    """A candidate screened no faster than the row's config at a shape is not screened at the smaller
    ones (it cannot win at every shape); the largest shape is screened first."""
    tune_rows = _tune_rows()
    at = {(64, 4096): [10.0, 9.0, 11.0, 8.0], (64, 1024): [5.0, 4.0, 1.0, 6.0], (8, 1024): [2.0, 1.0, 1.0, 1.0]}
    asked: list[tuple[tuple[int, int], list[str]]] = []

    def screen(op, dtype, rows, n, configs, device):
        asked.append(((rows, n), configs))
        return [at[rows, n][int(c)] for c in configs]

    monkeypatch.setattr(tune_rows, "screen", screen)
    inf = float("inf")
    times = tune_rows.screen_row("softmax", "bf16", [(8, 1024), (64, 1024), (64, 4096)], list("0123"), "cpu")
    assert asked == [((64, 4096), list("0123")), ((64, 1024), list("013")), ((8, 1024), list("01"))]
    assert times == [[2.0, 1.0, inf, inf], [5.0, 4.0, inf, 6.0], [10.0, 9.0, 11.0, 8.0]]
    assert tune_rows.finalists(times, 3) == [0, 1]


def _stand_in_gpu(monkeypatch, tune_rows) -> None:
    """tune_rows.py on a stand-in device whose every candidate times 1 µs, with nothing compiled."""
    import torch

    monkeypatch.setattr(tune_rows, "screen", lambda op, dtype, rows, n, configs, device: [1.0] * len(configs))
    monkeypatch.setattr(tune_rows, "measure", lambda op, dtype, rows, n, configs, *a, **k: [1.0] * len(configs))
    monkeypatch.setattr(tune_rows, "precompile", lambda jobs, processes: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a stand-in")


def test_a_tuning_run_stopped_part_way_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The table is rewritten after each row: a run stopped in its third row has stamped two, and a
    second run, on any day, goes on from the third (``--again``: from the first)."""
    import json
    import shutil

    tune_rows = _tune_rows()
    table = tmp_path / "t.json"
    shutil.copy(_tuning.TABLE_FILE, table)
    ranked: list[int] = []
    finalists = tune_rows.finalists

    def stop_in_the_third_row(times, top):
        ranked.append(1)
        if len(ranked) == 3:
            raise KeyboardInterrupt
        return finalists(times, top)

    monkeypatch.setattr(tune_rows, "finalists", stop_in_the_third_row)
    _stand_in_gpu(monkeypatch, tune_rows)
    with pytest.raises(KeyboardInterrupt):
        tune_rows.main(["--ops", "softmax", "--table", str(table)])
    rows = json.loads(table.read_text())["ops"]["softmax"]
    assert [(row.get("measured") or {}).get("device") == "a stand-in" for row in rows[:3]] == [True, True, False]
    assert rows[0]["measured"]["device"] == "a stand-in" and _tuning.load_tables(table)
    doc = json.loads(table.read_text())  # run again on a later day: the stamped rows are neither compiled
    earlier = {**rows[0]["measured"], "date": "2000-01-01"}  # nor measured, the rest are
    doc["ops"]["softmax"][:2] = [{**row, "measured": earlier} for row in rows[:2]]
    table.write_text(json.dumps(doc))
    jobs: list[list] = []
    monkeypatch.setattr(tune_rows, "finalists", finalists)
    monkeypatch.setattr(tune_rows, "precompile", lambda todo, processes: jobs.append(todo))
    assert tune_rows.main(["--ops", "softmax", "--table", str(table)]) == 0
    assert len(jobs[0]) == len(rows) - 2 and len(ranked) == 3
    stamps = [row.get("measured") for row in json.loads(table.read_text())["ops"]["softmax"]]
    assert stamps == [earlier] * 2 + [rows[0]["measured"]] * (len(rows) - 2)
    assert tune_rows.main(["--ops", "softmax", "--table", str(table), "--again"]) == 0
    assert len(jobs[1]) == len(rows)


def test_a_tuning_run_at_points_measures_only_the_rows_that_hold_them(tmp_path, monkeypatch):
    """``--at FILE`` measures the table rows that hold its shapes, stamped before or not, and no other."""
    import json
    import shutil

    tune_rows = _tune_rows()
    table = tmp_path / "t.json"
    shutil.copy(_tuning.TABLE_FILE, table)
    rows = json.loads(table.read_text())["ops"]["softmax"]
    wide = next(i for i, row in enumerate(rows) if "fp32" in row["dtypes"] and (row["n"][1] or 1 << 40) > 16384)
    r, n = rows[wide]["rows"][0], rows[wide]["n"][0]
    (tmp_path / "at.txt").write_text(f"# a flagged point\nsoftmax fp32 {r} {n}\n")
    _stand_in_gpu(monkeypatch, tune_rows)
    jobs: list[list] = []
    monkeypatch.setattr(tune_rows, "precompile", lambda todo, processes: jobs.append(todo))
    for _ in range(2):  # the second time its row is stamped alike: measured all the same
        assert tune_rows.main(["--at", str(tmp_path / "at.txt"), "--table", str(table)]) == 0
        stamped = [i for i, row in enumerate(json.loads(table.read_text())["ops"]["softmax"])
                   if (row.get("measured") or {}).get("device") == "a stand-in"]
        assert stamped == [wide] and [job[:2] for job in jobs[-1]] == [("softmax", "fp32")]
    (tmp_path / "bad.txt").write_text("softmax fp8 1 1024\n")
    with pytest.raises(SystemExit, match=r"bad\.txt:1"):
        tune_rows.main(["--at", str(tmp_path / "bad.txt"), "--table", str(table)])


def test_a_row_is_measured_at_its_ends_and_middles_within_the_element_cap():
    """A table row's shapes: its ranges' ends and middles, inside the row, no shape past MAX_ELEMENTS, the
    large end reached where rows times the width fit, and an aligned width where the row has one."""
    tune_rows = _tune_rows()
    for op, table in _tuning.TABLES.items():
        for row in table:
            doc = {"rows": [row.min_rows, row.max_rows], "n": [row.min_n, row.max_n]}
            points = tune_rows.shapes(doc)
            assert 1 <= len(points) <= 9 and len(set(points)) == len(points), (op, doc)
            for rows, n in points:
                assert row.holds(next(iter(row.dtypes)), rows, n), (op, doc, rows, n)
                assert rows * n <= tune_rows.MAX_ELEMENTS or rows == row.min_rows, (op, doc, rows, n)
            widest = max(n for _, n in points)
            top = min(row.max_rows or tune_rows.MAX_ROWS, tune_rows.MAX_ROWS, tune_rows.MAX_ELEMENTS // widest)
            assert (max(top, row.min_rows), widest) in points, (op, doc)
            hi = min(row.max_n or tune_rows.MAX_N, max(row.min_n, tune_rows.MAX_N))
            if hi // tune_rows.ALIGNED * tune_rows.ALIGNED >= row.min_n:
                assert any(n % tune_rows.ALIGNED == 0 for _, n in points), (op, doc, points)


def test_split_grids_fit_the_sms():
    """Every split a table asks for is resident at once on an H200 (132 SMs): a cooperative grid must be."""
    splits = {row.config.split for table in _tuning.TABLES.values() for row in table if row.config.split}
    for split, rows, n, size in itertools.product(splits, (1, 3, 8, 33, 66, 67, 1024, 16384),
                                                  (16384, 20000, 32768, 65536, 100000, 262144), (2, 4)):
        if not split.chunk and rows > 66:
            continue
        blocks = _coop._coop_config(rows, n, size, 132, _coop.knobs(), split)
        if blocks is not None:
            programs = (blocks.groups or rows) * blocks.splits
            assert programs <= 132 * max(split.per_sm, 1), f"{split} {rows} x {n}: {programs} programs"
            assert blocks.chunk * (blocks.splits - 1) < n <= blocks.chunk * blocks.splits
