import os

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(scope="session", autouse=True)
def _session_interpreter_switch() -> str | None:
    """``TRITON_INTERPRET`` as the session began (set for a CPU session, unset for a GPU one)."""
    return os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _interpreter_switch_stays_put(_session_interpreter_switch: str | None):
    """Put ``TRITON_INTERPRET`` back as the session had it after every test.

    An in-process ``--device cpu`` run (a test's or a module fixture's) sets it;
    in a GPU session a leaked switch would send every later test of the same
    worker through the interpreter's host paths (huge row tiles, no launcher cache).
    """
    yield
    if _session_interpreter_switch is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _session_interpreter_switch


@pytest.fixture
def special_logit_rows():
    """``rows(n)``: softmax rows of ``n`` logits with NaN, +inf, -inf first, all -inf, and a plain ramp.

    Each is defined in eager (NaN rows stay NaN, +inf takes the row); a test adds the rows its path needs.
    """
    inf, nan = float("inf"), float("nan")

    def rows(n: int) -> list[list[float]]:
        return [
            [1.0, nan] + [0.5] * (n - 2),
            [0.25] * (n - 1) + [inf],
            [-inf, 1.0] + [0.5] * (n - 2),
            [-inf] * n,
            [float(i - n // 2) / 8 for i in range(n)],
        ]

    return rows
