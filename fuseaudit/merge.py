"""``fuseaudit merge PART.json ... --out ALL.json``: one pytest-benchmark document from several.

pytest-benchmark turns itself off under pytest-xdist, so a suite spread over
GPUs runs as one pytest process per GPU (``--fuseaudit-shard K/N``), each
writing its own JSON.  This joins them: the benchmarks of every part in order,
each stamped in ``extra_info["merged_from"]`` with its file and the GPU its
part ran on (from that part's ``machine_info["gpu"]``); the first part's
machine and commit info head the document, and ``machine_info["parts"]``
lists every part's.  The result stays pytest-benchmark JSON (its ``compare``
reads it).  Exit codes: 0 written; 2 a part is unreadable, or two parts hold
the same benchmark.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from .benchjson import BenchJsonError, load, write

__all__ = ["add_arguments", "main", "merge"]

EXIT_OK, EXIT_USAGE = 0, 2


def _gpu(machine_info: dict[str, Any]) -> dict[str, Any]:
    gpu = machine_info.get("gpu") or {}
    nvml = gpu.get("nvml") or {}
    return {"name": gpu.get("name"), "nvml_index": nvml.get("index"), "cuda_visible_devices":
            gpu.get("cuda_visible_devices")}


def merge(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The merged document of ``(name, document)`` parts; ValueError on a benchmark in two parts."""
    if not parts:
        raise ValueError("nothing to merge")
    seen: dict[str, str] = {}
    benchmarks = []
    for name, doc in parts:
        source = {"file": name, **_gpu(doc.get("machine_info") or {})}
        for b in doc.get("benchmarks", []):
            key = b.get("fullname") or b.get("name")
            if key in seen:
                raise ValueError(f"benchmark {key!r} is in both {seen[key]} and {name}")
            seen[key] = name
            b = dict(b)
            b["extra_info"] = {**(b.get("extra_info") or {}), "merged_from": source}
            benchmarks.append(b)
    first = parts[0][1]
    machine = dict(first.get("machine_info") or {})
    machine["parts"] = [{"file": n, **_gpu(d.get("machine_info") or {})} for n, d in parts]
    return {**first, "machine_info": machine, "benchmarks": benchmarks}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("parts", nargs="+", metavar="PART.json", help="pytest-benchmark JSON files to join")
    parser.add_argument("--out", required=True, metavar="ALL.json", help="where the merged document goes")


def main(args: argparse.Namespace) -> int:
    try:
        parts = [(pathlib.Path(p).name, load(p)) for p in args.parts]
        doc = merge(parts)
    except (BenchJsonError, ValueError) as exc:
        print(f"fuseaudit merge: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = write(args.out, doc)
    print(f"wrote {path}: {len(doc['benchmarks'])} benchmark(s) from {len(parts)} part(s)")
    return EXIT_OK
