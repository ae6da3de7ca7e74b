"""``fuseaudit ops``: the op catalog with canonical signatures."""

from __future__ import annotations

import argparse
import json

from .catalog import OPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the catalog as JSON")


def main(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps([
            {"op": op.name, "signature": op.signature, "meaning": op.meaning, "reference": op.reference,
             "launches": op.launches, "outputs": list(op.outputs)} for op in OPS.values()
        ], indent=2))
        return 0
    width = max(len(op.signature) for op in OPS.values())
    for op in OPS.values():
        print(f"{op.signature:<{width}}  # {op.meaning}")
    return 0
