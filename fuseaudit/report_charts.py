"""The report's charts: matplotlib (Agg) figures as inline SVG strings, nothing to fetch.

Every function takes plain data (lists of dicts from :mod:`fuseaudit.report`)
and returns the SVG markup of one figure, or None where there is nothing to
draw.  Text stays text (``svg.fonttype='none'``); matplotlib escapes it, so
names from a target cannot inject markup.  The XML prolog and the metadata
block (with its licence URLs) are dropped, so the figure embeds in HTML as is.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator, NullLocator

from .tolerance import ULP_BINS

DTYPE_COLORS = {"float32": "#4c72b0", "bfloat16": "#dd8452", "float16": "#55a868"}
IMPL_COLORS = {"reference": "#d62728", "eager": "#7f7f7f", "compile": "#1f77b4", "sdpa_flash": "#2ca02c",
               "sdpa_cudnn": "#9467bd", "sdpa_efficient": "#8c564b"}
MIN_WIDTH_IN = 6.0  # room for a legend of four entries
_EXTRA_COLORS = ("#e377c2", "#bcbd22", "#17becf", "#ff7f0e")
_RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8,
       "xtick.labelsize": 7, "ytick.labelsize": 7, "legend.fontsize": 7, "axes.spines.top": False,
       "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3, "grid.linewidth": 0.5}


def bin_labels() -> list[str]:
    """``0``, ``≤0.5``, ``≤1``, ... ``>256``: one label per tolerance.ULP_BINS bucket."""
    out = ["0"]
    for edge in ULP_BINS[1:]:
        out.append(f"≤{edge:g}" if math.isfinite(edge) else f">{ULP_BINS[-2]:g}")
    return out


def impl_color(name: str, others: list[str]) -> str:
    if name in IMPL_COLORS:
        return IMPL_COLORS[name]
    if name not in others:
        others.append(name)
    return _EXTRA_COLORS[others.index(name) % len(_EXTRA_COLORS)]


def to_svg(fig: Any, salt: str) -> str:
    """The figure as an inline ``<svg>`` element (the figure is closed)."""
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    return text.replace("<svg ", '<svg class="chart" role="img" ', 1)


def _grid(n: int, cols: int, width: float = 2.6, height: float = 2.0, *, bottom: float = 0.5,
          footer: float = 0.0) -> tuple[Any, list[Any]]:
    """A figure of ``n`` panels in ``cols`` columns, each ``width`` x ``height`` inches, laid out by hand.

    Fixed margins instead of ``tight_layout``: measuring every tick label of
    dozens of log axes costs seconds.  A band on top holds the legend;
    ``bottom`` is each panel's room for tick labels and the x label,
    ``footer`` a band for a figure-wide x label.
    """
    cols = max(1, min(cols, n))
    rows = max(1, math.ceil(n / cols))
    band, left, right, top, edge = 0.35, 0.55, 0.1, 0.28, 0.15  # edge: room for the first column's y label
    fig_w, fig_h = max(cols * width + edge, MIN_WIDTH_IN), rows * height + band + footer
    edge = (fig_w - cols * width) / 2 + edge / 2  # centre the panels; the legend gets the whole width
    fig = plt.figure(figsize=(fig_w, fig_h))
    axes = []
    for i in range(n):
        r, c = divmod(i, cols)
        x0 = (edge + c * width + left) / fig_w
        y0 = (footer + (rows - 1 - r) * height + bottom) / fig_h
        axes.append(fig.add_axes((x0, y0, (width - left - right) / fig_w, (height - bottom - top) / fig_h)))
    return fig, axes


def _legend(fig: Any, handles: list[Any], labels: list[str]) -> None:
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), frameon=False,
               bbox_to_anchor=(0.5, 1.0))


def _decades(ax: Any, values: list[float]) -> None:
    """A log y axis spanning whole decades around ``values``, labelled at decades only."""
    ax.set_yscale("log")
    vals = [v for v in values if v > 0]
    if vals:
        lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
        ax.set_ylim(10.0 ** lo, 10.0 ** max(hi, lo + 1))
    _sparse(ax.yaxis)


def _sparse(axis: Any) -> None:
    """Decade ticks only on a log axis: minor ticks cost a tick object each, and clutter small panels."""
    axis.set_major_locator(LogLocator(base=10, numticks=5))
    axis.set_minor_locator(NullLocator())


def ulp_histograms(panels: Sequence[dict[str, Any]], salt: str) -> str | None:
    """Small multiples, one per op: share of output elements per ULP-error bucket, one bar per dtype.

    ``panels``: ``[{"title", "histograms": {dtype: [counts]}}]``.
    """
    panels = [p for p in panels if any(sum(c) for c in p["histograms"].values())]
    if not panels:
        return None
    labels = bin_labels()
    with plt.rc_context(_RC):
        fig, axes = _grid(len(panels), 4, width=2.6, height=1.9, bottom=0.55, footer=0.25)
        for ax, p in zip(axes, panels):
            dtypes = [d for d in DTYPE_COLORS if d in p["histograms"]]
            width = 0.8 / max(len(dtypes), 1)
            for i, d in enumerate(dtypes):
                counts = p["histograms"][d]
                total = sum(counts) or 1
                xs = [k + (i - (len(dtypes) - 1) / 2) * width for k in range(len(counts))]
                ax.bar(xs, [c / total for c in counts], width=width, color=DTYPE_COLORS[d], label=d)
            ax.set_yscale("log")
            ax.set_ylim(1e-6, 1.5)
            _sparse(ax.yaxis)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=60)
            ax.set_title(p["title"])
        axes[0].set_ylabel("share of elements")
        _legend(fig, [plt.Rectangle((0, 0), 1, 1, color=c) for c in DTYPE_COLORS.values()], list(DTYPE_COLORS))
        fig.text(0.5, 0.02, "|got - oracle| in ulps of the output dtype", ha="center", fontsize=8)
        return to_svg(fig, salt)


def error_scatter(panels: Sequence[dict[str, Any]], salt: str) -> str | None:
    """Small multiples, one per op: max ULP error of each case against its hidden size, fused and eager.

    ``panels``: ``[{"title", "xlabel", "points": [{"x", "dtype", "ulp", "eager_ulp", "passed"}]}]``.
    """
    panels = [p for p in panels if p["points"]]
    if not panels:
        return None
    floor = 0.05  # exact (0 ulp) drawn at the floor, so log axes keep them
    with plt.rc_context(_RC):
        fig, axes = _grid(len(panels), 4)
        for ax, p in zip(axes, panels):
            for d, color in DTYPE_COLORS.items():
                pts = [q for q in p["points"] if q["dtype"] == d and q["ulp"] is not None]
                if not pts:
                    continue
                xs = [q["x"] for q in pts]
                ax.scatter(xs, [max(q["eager_ulp"] or 0, floor) for q in pts], marker="_", s=30, color=color,
                           alpha=0.6, linewidths=1)
                ax.scatter(xs, [max(min(q["ulp"], 1e6), floor) for q in pts], s=9, color=color,
                           edgecolors=["#000" if not q["passed"] else color for q in pts], linewidths=0.6)
            ax.set_xscale("log")
            _sparse(ax.xaxis)
            _decades(ax, [max(v or 0, floor) for q in p["points"] for v in (q["ulp"], q["eager_ulp"])
                          if v is None or math.isfinite(v)])
            ax.set_title(p["title"])
            ax.set_xlabel(p["xlabel"])
        axes[0].set_ylabel("max error (ulps)")
        handles = [plt.Line2D([], [], marker="o", ls="", color=c, markersize=4) for c in DTYPE_COLORS.values()]
        handles.append(plt.Line2D([], [], marker="_", ls="", color="#555", markersize=8))
        _legend(fig, handles, [*DTYPE_COLORS, "eager (same case)"])
        return to_svg(fig, salt)


def speed_panels(panels: Sequence[dict[str, Any]], *, ylabel: str, salt: str) -> str | None:
    """Small multiples, one per op: a figure of every implementation against the bytes a point moves.

    ``panels``: ``[{"title", "series": {impl: [(x, value)]}, "xlabel"?, "ylabel"?}]`` (x: bytes moved unless
    ``xlabel`` says otherwise, e.g. FLOPs for attention; ``ylabel`` per
    panel where the panels differ, e.g. GB/s for row ops and TFLOP/s for attention).
    """
    panels = [p for p in panels if any(p["series"].values())]
    if not panels:
        return None
    others: list[str] = []
    seen: dict[str, str] = {}
    with plt.rc_context(_RC):
        fig, axes = _grid(len(panels), 4)
        for ax, p in zip(axes, panels):
            ys: list[float] = []
            for impl, pts in p["series"].items():
                pts = sorted((x, y) for x, y in pts if x and y)
                if not pts:
                    continue
                ys += [y for _, y in pts]
                color = impl_color(impl, others)
                seen[impl] = color
                lw = 1.8 if impl == "reference" else 1.0
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=2.5, lw=lw, color=color)
            ax.set_xscale("log")
            _sparse(ax.xaxis)
            _decades(ax, ys)  # at least one labelled decade, also for a panel of one point
            ax.set_title(p["title"])
            ax.set_xlabel(p.get("xlabel", "bytes moved"))
            if "ylabel" in p:
                ax.set_ylabel(p["ylabel"])
        if "ylabel" not in panels[0]:
            axes[0].set_ylabel(ylabel)
        handles = [plt.Line2D([], [], color=c, marker="o", markersize=3) for c in seen.values()]
        label = {"reference": "reference (fused)"}
        _legend(fig, handles, [label.get(i, i) for i in seen])
        return to_svg(fig, salt)


def roofline_bars(rows: Sequence[dict[str, Any]], salt: str) -> str | None:
    """Grouped bars: % of the measured copy bandwidth per op, per implementation.

    ``rows``: ``[{"op", "values": {impl: pct}}]``.
    """
    rows = [r for r in rows if r["values"]]
    if not rows:
        return None
    impls: list[str] = []
    for r in rows:
        impls += [i for i in r["values"] if i not in impls]
    impls.sort(key=lambda i: (i != "reference", i != "eager", i != "compile", i))
    others: list[str] = []
    width = 0.8 / len(impls)
    with plt.rc_context(_RC):
        width_in = max(6.0, 0.75 * len(rows) + 1.5)
        fig, ax = plt.subplots(figsize=(width_in, 2.9))
        fig.subplots_adjust(left=0.7 / width_in, right=1 - 0.2 / width_in, bottom=0.8 / 2.9, top=1 - 0.4 / 2.9)
        for k, impl in enumerate(impls):
            xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [r["values"].get(impl) or 0 for r in rows], width=width, color=impl_color(impl, others),
                   label="reference (fused)" if impl == "reference" else impl)
        ax.axhline(100, color="#333", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["op"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel("% of copy bandwidth")
        handles, labels = ax.get_legend_handles_labels()
        _legend(fig, handles, labels)
        return to_svg(fig, salt)
