"""Resolving audit targets: ``package.module:function`` or ``path/file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from typing import Any, Callable


def load_target(spec: str) -> Callable[..., Any]:
    """Import ``package.module:function`` or ``path/to/file.py:function``.

    Raises :class:`TargetError` with one clear line for anything that does
    not resolve to a callable.
    """
    if ":" not in spec:
        raise TargetError(f"target {spec!r} must be 'package.module:function' or 'path/file.py:function'")
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
