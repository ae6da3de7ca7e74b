"""How an op's inputs are sized: one :class:`Shape` for all the ops whose dims are laid out alike.

Each catalog entry names its shape (:attr:`fuseaudit.catalog.OpSpec.shape`), and
whatever depends on how an op is sized asks the shape, never the op's name:
the dims Hypothesis draws (:func:`fuseaudit.strategies.cases`), the edge
phase's dims (:mod:`fuseaudit.edges`), one representative case per device
(``fuseaudit launches``), the benchmark sweeps (:mod:`fuseaudit.sweep`) and
the pytest-benchmark suite's points, the head dims a target may restrict
itself to (``--head-dims``), and the size the report plots errors against.

Two shapes exist: :data:`ROWS` (dims ``lead`` and ``N``: activations
``(*lead, N)``, vectors of ``N``) and :data:`ATTENTION` (dims ``B, H, Hkv,
Sq, Sk, D``).  An op of either is one catalog entry; a new layout of dims is
one more :class:`Shape` here.  The methods import the machinery they hand
over to when called, so the catalog can name a shape without importing
Hypothesis or the sweep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from .catalog import OpSpec
    from .strategies import SizeProfile
    from .sweep import Point

Dims = dict[str, Any]


@dataclass(frozen=True, eq=False)
class Shape:
    """The dims of a family of ops, and how each part of fuseaudit chooses them."""

    name: str
    # per device kind, the dims of one representative case (``fuseaudit launches``)
    sample: Mapping[str, Mapping[str, Any]]
    # the head dims drawn; () where the op has no head dim (``--head-dims`` does not apply)
    head_dims: tuple[int, ...] = ()
    # the case record's size that errors are plotted against in the report: "hidden" (N) or "keys" (Sk)
    width: str = "hidden"

    def sample_dims(self, device: str) -> Dims:
        """A copy of the representative dims for ``device`` (``cpu``, ``cuda`` or ``cuda:K``)."""
        return dict(self.sample["cuda" if device.startswith("cuda") else "cpu"])

    def draw(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> SearchStrategy[Dims]:
        """The Hypothesis strategy of this shape's dims within ``profile`` (and the declared head dims)."""
        raise NotImplementedError

    def edge_dims(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> list[Dims]:
        """The edge phase's dims: the sizes a kernel's limits are made of, whatever the profile's bounds."""
        raise NotImplementedError

    def sweep(self, spec: OpSpec, *, quick: bool, rows: Sequence[int] | None,
              hidden: Sequence[int] | None, dtypes: tuple[str, ...] | None) -> list[Point]:
        """The benchmark sweep of ``spec`` (``fuseaudit bench``); ``rows``/``hidden`` replace a row grid."""
        raise NotImplementedError

    def suite_points(self, spec: OpSpec) -> list[Point]:
        """The pytest-benchmark suite's points of ``spec``: one at decode size and one large."""
        raise NotImplementedError


class _Rows(Shape):
    def draw(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> SearchStrategy[Dims]:
        from .strategies import row_dims

        return row_dims(profile)

    def edge_dims(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> list[Dims]:
        from .edges import row_edge_dims

        return row_edge_dims(profile.max_n, profile.max_rows)

    def sweep(self, spec: OpSpec, *, quick: bool, rows: Sequence[int] | None,
              hidden: Sequence[int] | None, dtypes: tuple[str, ...] | None) -> list[Point]:
        from . import sweep

        if rows is None and hidden is None:
            return sweep.rows_points(spec, quick=quick)
        return [sweep._rows_point(spec, r, n, dt) for dt in (dtypes or ("bfloat16",))
                for r in (rows or sweep.ROW_ROWS) for n in (hidden or sweep.ROW_HIDDEN)]

    def suite_points(self, spec: OpSpec) -> list[Point]:
        from .sweep import SUITE_ROW_POINTS, _rows_point

        return [_rows_point(spec, r, n, "bfloat16") for r, n in SUITE_ROW_POINTS]


class _Attention(Shape):
    def draw(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> SearchStrategy[Dims]:
        from .strategies import attention_dims

        return attention_dims(profile, head_dims)

    def edge_dims(self, profile: SizeProfile, head_dims: Sequence[int] | None = None) -> list[Dims]:
        from .edges import attention_edge_dims

        return attention_edge_dims(self.head_dims, head_dims)

    def sweep(self, spec: OpSpec, *, quick: bool, rows: Sequence[int] | None,
              hidden: Sequence[int] | None, dtypes: tuple[str, ...] | None) -> list[Point]:
        from .sweep import attention_points

        return attention_points(spec, quick=quick)

    def suite_points(self, spec: OpSpec) -> list[Point]:
        from .sweep import SUITE_ATTENTION_LABELS, attention_points

        return [p for p in attention_points(spec, quick=True) if p.label in SUITE_ATTENTION_LABELS]


ROWS: Shape = _Rows(
    name="rows",
    sample={"cpu": {"lead": (4, 8), "N": 1000}, "cuda": {"lead": (64,), "N": 4096}},
)
ATTENTION: Shape = _Attention(
    name="attention",
    sample={"cpu": {"B": 1, "H": 4, "Hkv": 2, "Sq": 16, "Sk": 24, "D": 64},
            "cuda": {"B": 2, "H": 8, "Hkv": 2, "Sq": 512, "Sk": 512, "D": 128}},
    head_dims=(16, 32, 64, 80, 96, 128, 256),
    width="keys",
)
