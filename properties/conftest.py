import os

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _interpreter_switch_stays_put():
    """Undo a test's change of ``TRITON_INTERPRET`` (an in-process ``--device cpu`` run sets it).

    In a GPU session a leaked switch would send every later test of the same
    worker through the interpreter's host paths (huge row tiles, no launcher cache).
    """
    before = os.environ.get("TRITON_INTERPRET")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before
