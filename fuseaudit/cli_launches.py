"""``fuseaudit launches``: kernels per call for each op: reference, eager, torch.compile.

Counts on one representative case per op (contiguous float16 inputs).
``torch.compile`` is counted on a GPU only: on the CPU Inductor emits C++
loops that are not kernel launches, so the column reads ``n/a`` there.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .case import Case, materialize
from .catalog import OPS, OpSpec
from .launches import count_launches, short_name
from .profiles import resolve_device


def representative_case(spec: OpSpec, device: str) -> Case:
    """Contiguous float16 inputs of the op's representative dims for ``device`` (its shape's sample)."""
    return Case(spec.name, "float16", spec.shape.sample_dims(device), {}, "normal", spec.defaults(), seed=0)


def launch_table(ops: list[str], device: str) -> list[dict[str, Any]]:
    """One row per op: the launches of the reference kernel, eager and torch.compile."""
    import torch

    rows = []
    for name in ops:
        spec = OPS[name]
        case = representative_case(spec, device)
        inputs = materialize(case, device)
        args = [inputs[n] for n in spec.input_names]
        row: dict[str, Any] = {"op": name, "expected": spec.launches}
        impls = {"reference": spec.load_reference(), "eager": spec.eager}
        if device.startswith("cuda"):
            impls["compile"] = torch.compile(spec.eager, dynamic=False)
        for label, fn in impls.items():
            try:
                row[label] = count_launches(fn, *args, device=device, **case.params).to_dict()
            except Exception as exc:  # report, do not stop the table
                row[label] = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", nargs="*", default=list(OPS), help="ops to count (default: all)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "n/a"
    if "error" in entry:
        return "error"
    return str(entry["count"]) + (f"+{entry['memcpy'] + entry['memset']}m" if entry["memcpy"] + entry["memset"] else "")


def main(args: argparse.Namespace) -> int:
    from .cli import usage_error

    unknown = [o for o in args.ops if o not in OPS]
    if unknown:
        return usage_error("launches", f"unknown op(s) {', '.join(unknown)}; known: {', '.join(OPS)}")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:  # --device cuda without one: one line, not a traceback
        return usage_error("launches", str(exc))
    rows = launch_table(args.ops, device)
    print(f"{'op':<20} {'reference':>9} {'eager':>6} {'compile':>8}   kernels (reference | eager | compile)")
    for r in rows:
        names = " | ".join(", ".join(short_name(n) for n in r[k].get("kernels", [r[k].get("error", "")]))
                           if k in r else "n/a"
                           for k in ("reference", "eager", "compile"))
        print(f"{r['op']:<20} {_cell(r.get('reference')):>9} {_cell(r.get('eager')):>6} "
              f"{_cell(r.get('compile')):>8}   {names}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=2)
    bad = [r["op"] for r in rows if r["reference"].get("count") != r["expected"]]
    return 1 if bad else 0
