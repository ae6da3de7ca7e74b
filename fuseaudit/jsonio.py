"""Strict JSON for every file fuseaudit writes: results, audits, benchmarks, e2e.

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON; a
report or another tool would choke on them.  :func:`jsonable` turns
non-finite floats into the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (read
back with :func:`fuseaudit.results.number`), and :func:`write_json` writes
atomically, so a run killed mid-write keeps the previous version of the file.
:func:`read_json` reads one back, or raises the caller's error with one line.

A path ending in ``.gz`` is gzip-compressed JSON, written and read alike:
results and benchmark files shrink about eightfold that way (the committed
example, ``reports/results-h200.json.gz``, is one), and ``gunzip -k`` gives
pytest-benchmark's own tools the plain file.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pathlib
from typing import Any, Callable


def jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats as ``"inf"``/``"-inf"``/``"nan"``, tuples as lists, others as str."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int = 2,
               convert: Callable[[Any], Any] = jsonable) -> pathlib.Path:
    """Write ``convert(doc)`` to ``path`` atomically (parent folders made); returns the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    data = (json.dumps(convert(doc), indent=indent, allow_nan=False) + "\n").encode("utf-8")
    if is_gzip(out):
        data = gzip.compress(data, mtime=0)  # mtime 0: the same document gives the same bytes
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


def is_gzip(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` names gzip-compressed JSON (its name ends in ``.gz``)."""
    return pathlib.Path(path).suffix == ".gz"


def read_json(path: str | os.PathLike[str], error: type[BaseException]) -> Any:
    """The JSON value in ``path``; ``error`` with one line (missing, unreadable, not JSON) otherwise."""
    p = pathlib.Path(path)
    try:
        data = p.read_bytes()
        return json.loads((gzip.decompress(data) if is_gzip(p) else data).decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no such file") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # gzip.BadGzipFile is an OSError
        raise error(f"{p}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None
