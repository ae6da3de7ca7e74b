"""Child process of ``fuseaudit run`` that counts launches: ``python -m fuseaudit._launch_worker DEVICE OUT OP...``.

Runs :func:`fuseaudit.cli_launches.launch_table` one op at a time, so that a
reference kernel that does not load or raises costs its own row only, and
rewrites ``OUT`` (JSON: ``{"device", "rows": [...]}``) after every op, so
that a process killed by the parent's timeout keeps the rows it counted.
"""

from __future__ import annotations

import pathlib
import sys


def main(argv: list[str]) -> int:
    device, out, *ops = argv
    from .profiles import resolve_device

    device = resolve_device(device)  # TRITON_INTERPRET before any kernel module is imported
    from .cli_launches import launch_table
    from .jsonio import write_json

    rows = []
    path = pathlib.Path(out)
    for op in ops:
        try:
            rows.extend(launch_table([op], device))
        except Exception as exc:  # e.g. the reference kernel does not import
            rows.append({"op": op, "error": f"{type(exc).__name__}: {exc}"})
        write_json(path, {"device": device, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
