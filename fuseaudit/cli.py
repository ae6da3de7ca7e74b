"""Audit fused GPU kernels: right against eager PyTorch and a float64 oracle, really fused, and worth it.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``main(args) -> int``; this module only wires them together.  Exit codes
(DESIGN.md): 0 every property holds, 1 a target failed a property, 2 the
command could not run (bad target, unknown op, wrong signature, bad option),
3 inconclusive (a property checked on fewer cases than asked).  Every
command reports an error as one line on stderr, ``fuseaudit COMMAND: error:
...`` (:func:`usage_error`).
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
    "merge": ("fuseaudit.merge", "join pytest-benchmark JSON files (one per GPU shard) into one"),
    "e2e": ("fuseaudit.e2e", "what fusion buys in a decode step: TTFT/TPOT per variant beside the microbenchmark"),
}


EPILOG = ("Outputs, relative to the current directory: `fuseaudit run` writes reports/results-<device>.json and "
          "reports/report-<device>.html (--out DIR for another folder); `fuseaudit report` reads "
          "reports/results-*.json and writes the report beside them under the same name (--results, --out); "
          "`fuseaudit bench` writes reports/bench-<time>.json (--json). "
          "Exit codes: 0 every property holds, 1 a property failed, 2 the command could not run, "
          "3 inconclusive. `fuseaudit COMMAND --help` gives each command's options.")


def usage_error(command: str | None, message: str) -> int:
    """Print ``fuseaudit COMMAND: error: MESSAGE`` (one line, stderr) and return the usage exit code, 2."""
    prog = f"fuseaudit {command}" if command else "fuseaudit"
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2, prefixed like every other error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (the others stay unloaded)."""
    parser = _Parser(prog="fuseaudit", description=__doc__.splitlines()[0], epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    return parser


def _start_worker_early(command: str | None, argv: list[str]) -> None:
    """An audit's zygote imports torch and Triton while this process does the same."""
    if command not in ("audit", "run") or "--in-process" in argv:
        return
    device = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--device"), "auto")
    if device == "auto":
        import os

        device = "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
    from .sandbox import adopt_orphans, start

    adopt_orphans()  # what a target's processes leave, even past a killed zygote, is ours to kill
    if command == "run":  # the reference audits' environment, which the run starts with
        from .runner import REFERENCE_ENV

        start(device, env=REFERENCE_ENV)
    else:
        start(device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    _start_worker_early(command, argv)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    args.argv = ["fuseaudit", *argv]  # the command as typed, for the results file's provenance
    return int(args._module.main(args))


if __name__ == "__main__":
    sys.exit(main())
