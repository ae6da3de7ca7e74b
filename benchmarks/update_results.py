"""Put newer benchmark figures into a stored results file (the report's input).

    python benchmarks/update_results.py RESULTS BENCH... -m TEXT

``RESULTS`` is what ``fuseaudit run`` writes and ``fuseaudit report``
reads (``reports/h200/results-cuda.json``); each ``BENCH`` a
``fuseaudit bench`` JSON.  Their benchmarks go first, the newest file
first, and replace the stored ones of the same name (op, contender,
dtype, point), so a point measured again shows its newest figures; ``TEXT``
heads the bench section's message (what was measured, where).  The bench
document's machine and commit info stay the stored ones.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fuseaudit import benchjson, results
from fuseaudit.jsonio import write_json


def update(results: dict[str, Any], benches: list[dict[str, Any]], message: str) -> tuple[int, int]:
    """Put ``benches``' benchmarks (newest first) in ``results``; returns ``(added, replaced)``."""
    document = results["bench"]["document"]
    new: list[dict[str, Any]] = []
    names: set[str] = set()
    for bench in benches:
        for b in bench["benchmarks"]:
            if b["name"] not in names:
                names.add(b["name"])
                new.append(b)
    kept = [b for b in document["benchmarks"] if b["name"] not in names]
    replaced = len(document["benchmarks"]) - len(kept)
    document["benchmarks"] = new + kept
    results["bench"]["message"] = f"{message} {results['bench'].get('message') or ''}".strip()
    return len(new) - replaced, replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("results")
    parser.add_argument("benches", nargs="+", help="fuseaudit bench JSON files, newest first")
    parser.add_argument("-m", "--message", required=True, help="what these files measured, and where")
    args = parser.parse_args(argv)
    try:  # the project's checked readers: a wrong file is one line, not a traceback
        doc = results.load(args.results)
        benches = [benchjson.load(path) for path in args.benches]
    except (results.ResultsError, benchjson.BenchJsonError) as exc:
        print(f"update_results: {exc}", file=sys.stderr)
        return 2
    added, replaced = update(doc, benches, args.message)
    write_json(args.results, doc, indent=2)  # atomically, in the stored file's indentation
    print(f"{args.results}: {added} benchmark(s) added, {replaced} replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
