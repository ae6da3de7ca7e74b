"""Resolving audit targets.

A target is ``package.module:function``, ``path/to/file.py:function`` or a
built-in third-party target ``builtin:NAME`` (``torch.compile`` of the op's
eager composition, SDPA pinned to one backend: see
:mod:`fuseaudit.builtin_targets`).  Built-in targets are made for one op, so
:func:`load_target` needs ``op`` for them.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from typing import Any, Callable

BUILTIN_PREFIX = "builtin:"


def is_builtin(spec: str) -> bool:
    """True for a ``builtin:NAME`` target."""
    return spec.startswith(BUILTIN_PREFIX)


def load_target(spec: str, *, op: str | None = None) -> Callable[..., Any]:
    """Import ``package.module:function`` or ``path/to/file.py:function``, or make ``builtin:NAME`` for ``op``.

    Raises :class:`TargetError` with one clear line for anything that does
    not resolve to a callable.
    """
    if is_builtin(spec):
        from .builtin_targets import load_builtin

        return load_builtin(spec, op=op)
    if ":" not in spec:
        raise TargetError(
            f"target {spec!r} must be 'package.module:function', 'path/file.py:function' or 'builtin:NAME'")
    mod_name, _, attr = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            path = pathlib.Path(mod_name).resolve()
            if not path.is_file():
                raise TargetError(f"target file {mod_name} does not exist")
            name = f"_fuseaudit_target_{abs(hash(str(path)))}"
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            sys.path.insert(0, str(path.parent))
            try:
                file_spec.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.parent))
        else:
            module = importlib.import_module(mod_name)
    except TargetError:
        raise
    except Exception as exc:  # the target's own import failed
        raise TargetError(f"could not import {mod_name}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(f"{spec} is not callable")
    return obj


class TargetError(Exception):
    """A target that cannot be loaded or called as the op's signature says."""
