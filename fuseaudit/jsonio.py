"""Strict JSON for every file fuseaudit writes: results, audits, benchmarks, e2e.

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON; a
report or another tool would choke on them.  :func:`jsonable` turns
non-finite floats into the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (read
back with :func:`fuseaudit.results.number`), and :func:`write_json` writes
atomically, so a run killed mid-write keeps the previous version of the file.
:func:`read_json` reads one back, or raises the caller's error with one line.
"""

from __future__ import annotations

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
    tmp.write_text(json.dumps(convert(doc), indent=indent, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out


def read_json(path: str | os.PathLike[str], error: type[Exception]) -> Any:
    """The JSON value in ``path``; ``error`` with one line (missing, unreadable, not JSON) otherwise."""
    p = pathlib.Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{p}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None
