"""The ``fuseaudit`` command.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``main(args) -> int``; this module only wires them together.  Exit codes
(DESIGN.md): 0 every property holds, 1 a target failed a property, 2 the
command could not run (bad target, unknown op, wrong signature, bad option).
"""

from __future__ import annotations

import argparse
import importlib
import sys

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# subcommand -> (module, one-line help)
COMMANDS = {
    "ops": ("fuseaudit.cli_ops", "list the ops with their signatures"),
    "launches": ("fuseaudit.cli_launches", "count kernels per call: reference, eager, torch.compile"),
    "audit": ("fuseaudit.audit", "check a kernel against an op on generated inputs"),
    "run": ("fuseaudit.runner", "audit every reference kernel (and built-in targets), then write the report"),
    "report": ("fuseaudit.report", "render the HTML report from stored results"),
    "bench": ("fuseaudit.bench", "time ops over a sweep of shapes (GPU)"),
    "compare": ("fuseaudit.compare", "compare two benchmark JSON files; non-zero on slow-downs"),
    "e2e": ("fuseaudit.e2e", "what fusion buys in a decode step: TTFT/TPOT per variant beside the microbenchmark"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        self.exit(EXIT_USAGE, f"fuseaudit: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuseaudit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue  # a subcommand whose module is not in this build
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mod = getattr(args, "_module", None)
    if mod is None:
        print(f"fuseaudit: error: '{args.command}' is not available in this build", file=sys.stderr)
        return EXIT_USAGE
    return int(mod.main(args))


if __name__ == "__main__":
    sys.exit(main())
