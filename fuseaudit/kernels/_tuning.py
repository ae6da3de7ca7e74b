"""How each row op is launched: one :class:`RowConfig` per shape, looked up in a table that is data.

The tables live in ``tuning_h200.json`` beside the kernels (written by
``tuning/tune_rows.py``, which says where and when it measured them).  A
table row is ``(dtypes, rows range, width range) -> config``; the look-up
takes the first row that holds the call, and the rows of a table do not
overlap.  A config says which kernel runs and every launch parameter; where
a parameter follows the width (a whole row's block is ``next_pow2(N)``), it
says so by a mode rather than listing every width.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from ._rows import interpreting, next_pow2

TABLE_FILE = pathlib.Path(__file__).with_name("tuning_h200.json")
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
KERNELS = ("whole", "tail", "looped")

# Whole rows with block_m = 0 take as many rows a program as fit in ROW_TILE elements ...
ROW_TILE = 2048
# ... while the grid keeps at least MIN_PROGRAMS programs, in at least MIN_WARPS warps.
MIN_PROGRAMS = 1024
MIN_WARPS = 4
# The interpreter pays per program, not per element: whole rows take this many elements a program there.
INTERPRETER_TILE = 1 << 20


@dataclass(frozen=True)
class Split:
    """Each row over several programs of one cooperative launch (see ``_coop.py``).

    ``chunk = 0``: a few rows, each over as many programs as the SMs allow;
    else many rows, in chunks of ``chunk`` columns, ``warps`` warps,
    ``per_sm`` programs an SM, each group of programs looping over rows.
    """

    chunk: int = 0
    warps: int = 0
    per_sm: int = 0


def _changed(split: Split) -> dict[str, int]:
    """A split's fields that differ from their defaults (``{}``: the split with every default)."""
    return {f.name: getattr(split, f.name) for f in fields(split) if getattr(split, f.name) != f.default}


@dataclass(frozen=True)
class RowConfig:
    """One launch of a row kernel; the fields a kernel does not take keep their defaults.

    ``kernel``: ``whole`` (rows in registers, a block of ``next_pow2(N)``),
    ``tail`` (rows in registers as a block of ``next_pow2(N) / 2`` and a
    tail block of ``next_pow2`` of the rest), ``looped`` (one row a program,
    ``block_n`` columns a step, the row read twice).
    """

    kernel: str
    warps: int  # num_warps; whole rows with block_m = 0: for a full tile of ROW_TILE elements
    block_m: int = 1  # whole rows a program; 0: the tile rule (ROW_TILE, MIN_PROGRAMS)
    early: bool = False  # whole norms: load weight and bias with the row, not after the reductions
    block_n: int = 0  # looped: columns a step
    block_s: int = 0  # looped: pass 1's block where wider than block_n
    prefetch: int = 0  # looped: passes (0-2) that load block i + 1 before block i is used
    fixed: bool = False  # looped norms: compiled for the row's width (N_FIXED)
    keep: bool = False  # looped layer_norm: pass 2 starts from pass 1's last block, where the blocks divide N
    stream: bool = False  # looped rms_norm: store y evict-first
    lanes: bool = False  # looped softmax: pass 1 per run of 16 bytes, merged once after the loop
    masked: bool = False  # looped: keep the column masks even where the blocks divide N
    split: Split | None = None  # try the cooperative split first (this config is its fallback)

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if (self.kernel == "looped") != (self.block_n > 0):
            raise ValueError(f"block_n is for looped configs only: {self}")

    @property
    def stats_block(self) -> int:
        """The looped kernel's pass-1 block (its ``BLOCK_S``)."""
        return self.block_s or self.block_n

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what the table file holds)."""
        out: dict[str, Any] = {"kernel": self.kernel, "warps": self.warps}
        for f in fields(self)[2:]:
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = _changed(value) if isinstance(value, Split) else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RowConfig:
        split = data.get("split")
        return cls(**{**data, "split": None if split is None else Split(**split)})


class TableRow(NamedTuple):
    """``config`` for calls of one of ``dtypes`` with ``min_rows..max_rows`` rows of ``min_n..max_n`` (None: no end)."""

    dtypes: frozenset[str]
    min_rows: int
    max_rows: int | None
    min_n: int
    max_n: int | None
    config: RowConfig

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> TableRow:
        """A row as the table file writes it: ``{"dtypes": "fp16,bf16", "rows": [lo, hi], "n": [lo, hi], ...}``."""
        return cls(frozenset(row["dtypes"].split(",")), *row["rows"], *row["n"], RowConfig.from_json(row["config"]))

    def holds(self, dtype: str, rows: int, n: int) -> bool:
        return (dtype in self.dtypes and self.min_rows <= rows and (self.max_rows is None or rows <= self.max_rows)
                and self.min_n <= n and (self.max_n is None or n <= self.max_n))


def load_tables(path: pathlib.Path = TABLE_FILE) -> tuple[dict[str, Any], dict[str, tuple[TableRow, ...]]]:
    """``(where it was measured, {op: table})`` from a table file."""
    data = json.loads(path.read_text())
    tables = {op: tuple(TableRow.from_json(r) for r in rows) for op, rows in data["ops"].items()}
    return data["measured"], tables


MEASURED, TABLES = load_tables()


def row_config(op: str, dtype: torch.dtype, rows: int, n: int) -> RowConfig:
    """The config of the first row of ``op``'s table that holds the call (``TABLES`` is read at call time)."""
    return _lookup(op, DTYPE_NAMES[dtype], rows, n)


@functools.lru_cache(maxsize=4096)
def _lookup(op: str, dtype: str, rows: int, n: int) -> RowConfig:
    for row in TABLES[op]:
        if row.holds(dtype, rows, n):
            return row.config
    raise LookupError(f"no table row holds {dtype} x {rows} rows x {n}")


def whole_blocks(config: RowConfig, rows: int, n: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_T, num_warps)`` of a whole-row config for ``rows`` rows of ``n``."""
    block_n, block_t = next_pow2(n), 0
    if config.kernel == "tail":
        block_n //= 2
        block_t = next_pow2(n - block_n)
    block_m, warps = config.block_m, config.warps
    if block_m == 0:  # the tile rule: powers of two, fewer warps for a smaller tile
        by_grid = max(rows // MIN_PROGRAMS, 1)
        block_m = min(max(ROW_TILE // block_n, 1), 1 << (by_grid.bit_length() - 1))
        warps = max(MIN_WARPS, warps * block_m * block_n // ROW_TILE)
    if interpreting():  # several rows a program on the CPU
        block_m = max(block_m, min(next_pow2(rows), max(INTERPRETER_TILE // (block_n + block_t), 1)))
    return block_m, block_n, block_t, warps


__all__ = ["MEASURED", "TABLES", "RowConfig", "Split", "TableRow", "load_tables", "row_config", "whole_blocks"]
