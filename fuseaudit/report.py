"""``fuseaudit report``: render the HTML report from stored results.

``fuseaudit report [--results PATH ...] [--out PATH] [--target-copy PCT]
[--target-copy-min-mib MIB] [--target-compile X]`` reads one or more
results files of ``fuseaudit run`` (:mod:`fuseaudit.results`; default: every
``reports/results-*.json``, e.g. a CPU run and a GPU run together) and writes
one self-contained HTML file (default ``reports/index.html``): inline CSS,
charts as inline SVG, no script and nothing fetched when it is viewed.  The
template (``fuseaudit/templates/report.html.j2``) is rendered by Jinja2 with
autoescaping on: every string from a target is untrusted.  With ``--target-*``
it also checks every reference point against speed targets (a share of the
copy bandwidth from a size on, a speed-up over torch.compile) and lists the
points that miss them, worst first.

Exit codes: 0 the report was written; 2 it could not be (no results, a file
that is not a results file, an unwritable output).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from .cli import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from .report_view import Goals

TEMPLATES = pathlib.Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"


def render_html(runs: list[dict[str, Any]], goals: Goals | None = None) -> str:
    """The report of ``runs`` (results documents) as one HTML string, checked against ``goals`` if given."""
    import jinja2

    from . import __version__
    from .report_view import build

    if not runs:
        raise ValueError("no results to report")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    view = build(runs, goals)
    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return env.get_template(TEMPLATE).render(v=view, generated=generated, version=__version__)


def render(runs: list[dict[str, Any]], out: str | os.PathLike[str], goals: Goals | None = None) -> pathlib.Path:
    """Write the report of ``runs`` to ``out`` (parent folders made); returns the path."""
    path = pathlib.Path(out)
    html = render_html(runs, goals)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", nargs="+", default=None, metavar="PATH",
                        help="results files of `fuseaudit run` (default: reports/results-*.json)")
    parser.add_argument("--out", default="reports/index.html", metavar="PATH",
                        help="the HTML file to write (default reports/index.html)")
    parser.add_argument("--target-copy", type=float, default=None, metavar="PCT",
                        help="check every reference point moving --target-copy-min-mib or more against PCT%% of "
                             "the measured copy bandwidth, and list the misses")
    parser.add_argument("--target-copy-min-mib", type=float, default=256.0, metavar="MIB",
                        help="the size from which --target-copy applies (default 256 MiB)")
    parser.add_argument("--target-compile", type=float, default=None, metavar="X",
                        help="check every reference point timed against torch.compile for a speed-up of X or more")


def main(args: argparse.Namespace) -> int:
    from .report_view import Goals
    from .results import ResultsError, load

    try:
        goals = Goals(copy_pct=args.target_copy, copy_min_mib=args.target_copy_min_mib,
                      compile_ratio=args.target_compile)
    except ValueError as exc:
        print(f"fuseaudit report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    paths = [pathlib.Path(p) for p in args.results] if args.results else sorted(
        pathlib.Path("reports").glob("results-*.json"))
    if not paths:
        print("fuseaudit report: error: no results given and no reports/results-*.json found "
              "(run `fuseaudit run` first)", file=sys.stderr)
        return EXIT_USAGE
    try:
        runs = [load(p) for p in paths]
    except ResultsError as exc:
        print(f"fuseaudit report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = render(runs, args.out, goals)
    except OSError as exc:
        print(f"fuseaudit report: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {path} from {', '.join(map(str, paths))}")
    return EXIT_OK
