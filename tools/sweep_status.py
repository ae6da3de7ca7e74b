"""Where the row ops stand against the speed targets in a stored results file.

    python tools/sweep_status.py [RESULTS]     (default: reports/results-h200.json.gz)

The sweep: rows {1, 8, 64, 1024, 16384} x hidden {1024 .. 65536} in bfloat16,
rows {8, 1024, 16384} x hidden {2048, 8192, 32768} in float16 and float32
(``fuseaudit.sweep``), each op's reference point against torch.compile
(``speedup_vs_compile``, target 1.0x), and the points moving 256 MB or more
against 92% of the copy bandwidth; then the same counts over every reference
row-op point in the file.  A point stored twice counts once, as the report
shows it (the first).  ``fuseaudit report --target-copy 92 --target-compile 1``
lists the same misses in the report.
"""

from __future__ import annotations

import sys
from typing import Any

from fuseaudit.jsonio import read_json
from fuseaudit.sweep import ROW_HIDDEN, ROW_ROWS, ROW_SUBSET_HIDDEN, ROW_SUBSET_ROWS

OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "softmax")
Key = tuple[str, str, int, int]


def reference_points(results: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """``(op, dtype, rows, N) -> extra_info`` of every reference row-op point on 2-D inputs."""
    points: dict[Key, dict[str, Any]] = {}
    for b in results["bench"]["document"]["benchmarks"]:
        info, params = b["extra_info"], b.get("params") or {}
        lead = params.get("lead")
        if info.get("impl") == "reference" and info.get("op") in OPS and lead is not None and len(lead) == 1:
            points.setdefault((info["op"], info["dtype"], lead[0], params["N"]), info)
    return points


def summary(name: str, keys: list[Key], points: dict[Key, dict[str, Any]], *, worst: int = 0) -> None:
    ratio = {k: points[k].get("speedup_vs_compile") or 0.0 for k in keys}
    large = [k for k in keys if points[k]["bytes_moved"] >= 256e6]
    r = list(ratio.values())
    print(f"{name}: {len(keys)} points; at 1.0x torch.compile or more {sum(x >= 1 for x in r)}, "
          f"0.95-0.99x {sum(0.95 <= x < 1 for x in r)}, below 0.95x {sum(x < 0.95 for x in r)}; "
          f"moving 256 MB or more {len(large)}, at 92% of copy {sum(points[k]['pct_copy'] >= 92 for k in large)}")
    for k in sorted(keys, key=ratio.__getitem__)[:worst]:
        if ratio[k] < 1:
            info = points[k]
            print(f"  {ratio[k]:.3f}x  {k[0]} {k[1]} {k[2]} x {k[3]}: {info['timing']['median_us']:.1f} µs, "
                  f"{info['pct_copy']:.1f}% of copy")


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "reports/results-h200.json.gz"
    points = reference_points(read_json(path, SystemExit))
    sweep = [(op, "bfloat16", r, n) for op in OPS for r in ROW_ROWS for n in ROW_HIDDEN]
    sweep += [(op, dt, r, n) for op in OPS for dt in ("float16", "float32") for r in ROW_SUBSET_ROWS
              for n in ROW_SUBSET_HIDDEN]
    missing = [k for k in sweep if k not in points]
    if missing:
        print(f"the sweep's points not in {path}: {missing}")
    summary("the sweep", [k for k in sweep if k in points], points, worst=len(sweep))
    summary("every reference row-op point", list(points), points)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
