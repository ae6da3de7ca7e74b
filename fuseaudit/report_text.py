"""Text the report shows beside its figures: short kernel names, why a large ulp count passes, short notes.

Every function returns plain strings or lists of ``{"text", "title"}``
parts; the template escapes them (names and messages come from targets).
"""

from __future__ import annotations

import re
from typing import Any

from .launches import short_name

KERNEL_NAME_MAX = 60  # characters of a shortened kernel name; the full name goes in its title
NOTE_MAX = 300  # characters of a note shown inline; a longer one is pointed to, not shown

# "3 kernel(s): a, b, c", "3 kernel(s) (+1 memcpy, 0 memset): a, b" (launches.describe, the judge) and,
# in older files, "3 kernel(s), expected 1: a, b, c"
_KERNEL_LIST = re.compile(r"\d+ kernel\(s\)(?: \(\+[^)]*\))?(?:, expected \d+)?: ")
# what may follow the names: a count of those left out, the expected count, the plain-PyTorch hint
_AFTER_NAMES = re.compile(r"(?:, \.\.\. \(\d+ more\))?(?:, expected \d+)?(?: \(a plain PyTorch composition.*)?$", re.S)
_OPEN, _CLOSE = "<([{", ">)]}"


def short_kernel(name: str) -> str:
    """A kernel name short enough for a table: :func:`launches.short_name`, cut to :data:`KERNEL_NAME_MAX`."""
    short = short_name(name)
    if len(short) > KERNEL_NAME_MAX:
        short = short[:KERNEL_NAME_MAX - 1] + "…"
    return short


def split_names(text: str) -> list[str] | None:
    """``text`` split at the commas between kernel names, not those inside ``<>``, ``()``, ``{}``, ``[]``.

    Demangled C++ names hold commas in template and parameter lists.  None
    where the brackets do not balance (a name with ``operator<``): the
    caller then keeps the text whole rather than cut a name in two.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                return None
        elif ch == "," and depth == 0 and text[i + 1:i + 2] == " ":
            names.append(text[start:i])
            start = i + 2
    if depth != 0:
        return None
    names.append(text[start:])
    return [n.strip() for n in names if n.strip()]


def kernel_parts(message: str) -> list[dict[str, str]]:
    """A message as parts: plain text, and each kernel name it lists shortened with the full name as title.

    Messages of a launch count end with the kernels' names (``... 3
    kernel(s), expected 1: NAME, NAME, NAME``); older results files hold
    whole demangled C++ names there, 15 lines each.
    """
    match = _KERNEL_LIST.search(message)
    if not match:
        return [_plain(message)]
    head, listed = message[:match.end()], message[match.end():]
    tail = ""
    cut = _AFTER_NAMES.search(listed)
    if cut and cut.group(0):
        listed, tail = listed[:cut.start()], cut.group(0)
    names = split_names(listed) if listed else []
    if names is None:
        names = [listed]
    parts = [_plain(head)]
    for k, name in enumerate(names):
        if k:
            parts.append(_plain(", "))
        parts.append({"text": short_kernel(name), "title": name, "kernel": True})
    if tail:
        parts.append(_plain(tail))
    return parts


def _plain(text: str) -> dict[str, Any]:
    return {"text": text, "title": "", "kernel": False}


def shorten_kernels(message: str) -> str:
    """``message`` with the kernel names it lists shortened (for a ``title``, where no markup can go)."""
    return "".join(p["text"] for p in kernel_parts(message))


def kernel_list(names: list[Any]) -> str:
    """Kernel names for a hover text: one short name a line."""
    return "\n".join(short_kernel(str(n)) for n in names)


def ulp_note(ulp: float | None, eager_ulp: float | None, *, budget_ulps: float, passed: bool
             ) -> dict[str, str] | None:
    """Why a passing figure of many ulps passes: a short phrase and its explanation; None where none is due.

    Ulps are counted at each element's own magnitude, but the bound is set
    per row: at the row's magnitude, and at twice eager's error.  A count
    past the op's own dtype budget (``budget_ulps``, the catalog's
    ``fallback_ulps``) on a passing case comes from one of the two.
    """
    if not passed or ulp is None or not ulp > budget_ulps:
        return None
    if eager_ulp is not None and eager_ulp >= ulp / 2:
        return {"text": "eager as far off",
                "title": f"eager's own error reaches {eager_ulp:.3g} ulp here (counted, like this figure, at each "
                         f"element's own magnitude, where near zero one ulp is tiny): the bound is twice eager's "
                         f"error plus rounding noise at the row's magnitude, so a kernel as close to the oracle "
                         f"as eager passes"}
    return {"text": "near-zero elements",
            "title": "ulps are counted at each element's own magnitude: an element near zero in a row of "
                     "larger values (where the op cancels: x + bias near zero, layer_norm's centring, "
                     "attention's average of v) has a tiny ulp, so a small error is many of them; the bound "
                     "is set per row at the row's magnitude, and the row stayed within it"}


def short_note(text: str) -> dict[str, Any]:
    """A note for a table cell: a short one whole; a long one (a log, a journal) only as its length.

    A long note stays in the results file, where the report points to it:
    an excerpt of it would be a figure without its context.
    """
    text = " ".join((text or "").split())
    if len(text) <= NOTE_MAX:
        return {"text": text, "cut": False, "words": len(text.split())}
    return {"text": "", "cut": True, "words": len(text.split())}


def quoted_commands(text: str) -> list[str]:
    """The ``fuseaudit ...`` commands a note quotes in backticks (where a step's data came from)."""
    return re.findall(r"`((?:fuseaudit|python) [^`]+)`", text or "")
