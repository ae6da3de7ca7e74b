"""``fuseaudit report``: render the HTML report from stored results.

``fuseaudit report [--results PATH ...] [--out PATH] [--target-copy PCT]
[--target-copy-min-mib MIB] [--target-compile X]`` reads one or more
results files of ``fuseaudit run`` (:mod:`fuseaudit.results`; a folder
stands for its ``results-*.json``; default: the folder ``reports``, e.g. a
CPU run and a GPU run together) and writes one self-contained HTML file:
inline CSS, charts as inline SVG, no script and nothing fetched when it is
viewed.  The template (``fuseaudit/templates/report.html.j2``) is rendered
by Jinja2 with autoescaping on: every string from a target is untrusted.
With ``--target-*`` it also checks every reference point against speed
targets (a share of the copy bandwidth from a size on, a speed-up over
torch.compile) and lists the points that miss them, worst first.

Where outputs go, for ``run`` and ``report`` alike (:func:`report_name`):
``results-<device>.json`` and ``report-<device>.html`` side by side in one
folder, ``reports`` by default; relative paths are relative to the current
directory.  A report of several runs is named after all their devices
(``report-cpu-cuda.html``) and goes beside the first results file.

Exit codes: 0 the report was written; 2 it could not be (no results, a file
that is not a results file, an unwritable output).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .cli import EXIT_OK, usage_error

if TYPE_CHECKING:
    from .report_view import Goals

TEMPLATES = pathlib.Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"
DEFAULT_DIR = pathlib.Path("reports")
RESULTS_GLOB = "results-*.json"  # a folder's results files; a gzipped one (NAME.json.gz) is named on its own


def report_name(devices: Sequence[str]) -> str:
    """The report's file name for runs on ``devices``: ``report-cuda.html``, ``report-cpu-cuda.html``."""
    seen = list(dict.fromkeys(devices)) or ["empty"]
    return f"report-{'-'.join(seen)}.html"


def results_name(device: str) -> str:
    """The results file's name of a run on ``device``: ``results-cuda.json``."""
    return f"results-{device}.json"


def render_html(runs: list[dict[str, Any]], goals: Goals | None = None, *,
                sources: Sequence[pathlib.Path] | None = None, out: pathlib.Path | None = None) -> str:
    """The report of ``runs`` (results documents) as one HTML string, checked against ``goals`` if given.

    ``sources``: each run's results file and ``out`` the page's path, for the
    provenance's links (to the data, and to a README beside it).
    """
    import jinja2

    from . import __version__
    from .report_view import build

    if not runs:
        raise ValueError("no results to report")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    view = build(runs, goals, sources=list(sources or []), out=out)
    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return env.get_template(TEMPLATE).render(v=view, generated=generated, version=__version__)


def render(runs: list[dict[str, Any]], out: str | os.PathLike[str], goals: Goals | None = None, *,
           sources: Sequence[pathlib.Path] | None = None) -> pathlib.Path:
    """Write the report of ``runs`` to ``out`` (parent folders made); returns the path."""
    path = pathlib.Path(out)
    html = render_html(runs, goals, sources=sources, out=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Outputs: relative paths are relative to the current directory. Without --out the report "
                     "goes beside the first results file, named after the runs' devices (report-cuda.html, "
                     "report-cpu-cuda.html), as `fuseaudit run` names it.")
    parser.add_argument("--results", nargs="+", default=None, metavar="PATH",
                        help="results files of `fuseaudit run`, or folders holding them (their results-*.json; "
                             "default: reports/)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="the HTML file to write (default: FOLDER/report-<devices>.html beside the first "
                             "results file)")
    parser.add_argument("--target-copy", type=float, default=None, metavar="PCT",
                        help="check every reference point moving --target-copy-min-mib or more against PCT%% of "
                             "the measured copy bandwidth, and list the misses")
    parser.add_argument("--target-copy-min-mib", type=float, default=256.0, metavar="MIB",
                        help="the size from which --target-copy applies (default 256 MiB)")
    parser.add_argument("--target-compile", type=float, default=None, metavar="X",
                        help="check every reference point timed against torch.compile for a speed-up of X or more")


def results_paths(given: Sequence[str] | None) -> list[pathlib.Path]:
    """The results files named by ``given`` (files, or folders standing for their ``results-*.json``)."""
    out: list[pathlib.Path] = []
    for p in map(pathlib.Path, given or [str(DEFAULT_DIR)]):
        out += sorted(p.glob(RESULTS_GLOB)) if p.is_dir() else [p]
    return out


def main(args: argparse.Namespace) -> int:
    from .report_view import Goals
    from .results import ResultsError, load

    try:
        goals = Goals(copy_pct=args.target_copy, copy_min_mib=args.target_copy_min_mib,
                      compile_ratio=args.target_compile)
    except ValueError as exc:
        return usage_error("report", str(exc))
    if not args.results and not DEFAULT_DIR.is_dir():
        return usage_error("report", f"no results: there is no {DEFAULT_DIR}/ folder here (run `fuseaudit run` "
                                     f"first, or name results files or folders with --results)")
    paths = results_paths(args.results)
    if not paths:
        where = ", ".join(args.results or [str(DEFAULT_DIR)])
        return usage_error("report", f"no results files ({RESULTS_GLOB}) in {where} (run `fuseaudit run` first, "
                                     f"or name them with --results)")
    try:
        runs = [load(p) for p in paths]
    except ResultsError as exc:
        return usage_error("report", str(exc))
    out = pathlib.Path(args.out) if args.out else paths[0].parent / report_name([r["device"] for r in runs])
    try:
        path = render(runs, out, goals, sources=paths)
    except OSError as exc:
        return usage_error("report", f"cannot write {out}: {exc.strerror or exc}")
    print(f"wrote {path} from {', '.join(map(str, paths))}")
    return EXIT_OK
