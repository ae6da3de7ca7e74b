"""``fuseaudit compare BASE.json NEW.json``: did anything get slower?

Reads two pytest-benchmark JSON files (from ``fuseaudit bench`` or
``pytest benchmarks/ --benchmark-json``), matches benchmarks by full name
and params, and prints one line per benchmark: both medians, the change,
the change allowed, and a verdict.

A benchmark is *slower* when its new median exceeds the base median by more
than ``max(threshold, spread_base + spread_new)``, where a run's spread is
its IQR relative to its median: a change inside the noise both runs measured
is no regression, however small the threshold.

Exit codes: 0 nothing slower; 1 at least one benchmark slower; 2 an input
could not be read (one clear line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from .benchjson import BenchJsonError, load

__all__ = ["Change", "add_arguments", "compare", "format_changes", "main"]

EXIT_OK, EXIT_SLOWER, EXIT_UNREADABLE = 0, 1, 2


@dataclass(frozen=True)
class Change:
    """One benchmark in both runs (``None`` medians where it is in one only)."""

    key: str
    base_s: float | None
    new_s: float | None
    allowed: float  # relative slow-down tolerated, e.g. 0.05
    spread: float  # spread_base + spread_new

    @property
    def change(self) -> float | None:
        if self.base_s is None or self.new_s is None or self.base_s <= 0:
            return None
        return self.new_s / self.base_s - 1.0

    @property
    def verdict(self) -> str:
        if self.base_s is None:
            return "new"
        if self.new_s is None:
            return "gone"
        c = self.change
        if c is None:
            return "?"
        if c > self.allowed:
            return "SLOWER"
        if c < -self.allowed:
            return "faster"
        return "same"


def _key(bench: dict[str, Any]) -> str:
    name = bench.get("fullname") or bench.get("name")
    params = bench.get("params")
    return f"{name} {json.dumps(params, sort_keys=True)}" if params else str(name)


def _spread(stats: dict[str, Any]) -> float:
    median = stats.get("median") or 0.0
    iqr = stats.get("iqr")
    if iqr is None and "q1" in stats and "q3" in stats:
        iqr = stats["q3"] - stats["q1"]
    return float(iqr) / median if median and iqr else 0.0


def compare(base: dict[str, Any], new: dict[str, Any], *, threshold: float = 0.05) -> list[Change]:
    """Changes from ``base`` to ``new`` (loaded pytest-benchmark documents); ``threshold`` is relative."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be non-negative, got {threshold!r}")
    b = {_key(x): x for x in base["benchmarks"]}
    n = {_key(x): x for x in new["benchmarks"]}
    out = []
    for key in [*b, *(k for k in n if k not in b)]:
        bs, ns = (b[key]["stats"] if key in b else None), (n[key]["stats"] if key in n else None)
        spread = (_spread(bs) if bs else 0.0) + (_spread(ns) if ns else 0.0)
        out.append(Change(key=key, base_s=bs["median"] if bs else None, new_s=ns["median"] if ns else None,
                          allowed=max(threshold, spread), spread=spread))
    return out


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.2f}"


def format_changes(changes: list[Change]) -> str:
    """The table: name, base µs, new µs, change %, allowed %, verdict."""
    header = ("benchmark", "base µs", "new µs", "change", "allowed", "verdict")
    rows = [header] + [
        (c.key.split(" {")[0], _us(c.base_s), _us(c.new_s),
         "-" if c.change is None else f"{100 * c.change:+.1f}%", f"{100 * c.allowed:.1f}%", c.verdict)
        for c in changes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) if i in (0, 5) else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 <= value < 1000:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 1000), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE.json", help="the earlier run")
    parser.add_argument("new", metavar="NEW.json", help="the run to check")
    parser.add_argument("--threshold", type=_threshold, default=5.0, metavar="PCT",
                        help="slow-down tolerated in percent, raised to the runs' own spread (default 5)")


def main(args: argparse.Namespace) -> int:
    try:
        base, new = load(args.base), load(args.new)
    except BenchJsonError as exc:
        print(f"fuseaudit compare: error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    changes = compare(base, new, threshold=args.threshold / 100)
    print(format_changes(changes))
    slower = [c for c in changes if c.verdict == "SLOWER"]
    matched = sum(1 for c in changes if c.base_s is not None and c.new_s is not None)
    print(f"{matched} matched, {len(slower)} slower, "
          f"{sum(c.verdict == 'faster' for c in changes)} faster, "
          f"{sum(c.verdict in ('new', 'gone') for c in changes)} in one run only", file=sys.stderr)
    return EXIT_SLOWER if slower else EXIT_OK
