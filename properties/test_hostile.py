"""Hostile targets: whatever a target does in its own process, the verdict is the judge's.

Each target of ``properties/planted/hostile.py`` attacks one way (the module
also patches torch's functionals and fuseaudit's judging at import); each must
fail the audit (exit 1) or leave it inconclusive (exit 3), never pass it.
The judge never imports that module: every audit here runs the target in a
worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuseaudit.audit import audit
from fuseaudit.audit_result import FAIL, INCONCLUSIVE

HOSTILE = Path(__file__).parent / "planted" / "hostile.py"
EAGER_LAUNCHES = 9  # hostile.rms_norm_eager's aten ops


DEVICE = ["cpu"]


@pytest.fixture(autouse=True)
def _session_device(fuseaudit_device: str) -> None:
    DEVICE[0] = fuseaudit_device  # the worker runs the target where the session runs kernels


def run(fn: str, op: str = "rms_norm", **kw):
    options = {"examples": 6, "seed": 0, "device": DEVICE[0], "profile": "ci", "shrink_time": 3.0, **kw}
    return audit(op, f"{HOSTILE}:{fn}", **options)


@pytest.mark.parametrize(("fn", "op"), [("rms_norm_clone", "rms_norm"), ("softmax_clone", "softmax")])
def test_patched_functionals_and_fuseaudit_do_not_reach_the_judge(fn, op):
    result = run(fn, op)
    assert result.exit_code == 1 and result.verdicts["numerics"].status == FAIL, result.render()


@pytest.mark.parametrize(("fn", "prop", "words"), [
    ("forged_reply", "numerics", "output y: "),  # NaN (the slot as the judge filled it) or the garbage
    ("garbage_on_channel", "runs", "broke the worker's protocol"),
    ("exits_cleanly", "runs", "crashed the process (exit status 0)"),
])
def test_forged_messages_are_failures(fn, prop, words):
    result = run(fn)
    assert result.exit_code == 1 and result.verdicts[prop].status == FAIL, result.render()
    assert any(words in f.message for f in result.verdicts[prop].failures), result.render()
    assert "result: PASS" not in result.render().splitlines()[-1]


def test_heartbeat_does_not_hide_a_hang():
    start = time.monotonic()
    result = run("heartbeat_hang", timeout=2)
    assert result.verdicts["runs"].status == FAIL and "made no progress for 2 s" in result.verdicts["runs"].summary
    assert time.monotonic() - start < 30, "one timeout, not one per phase"


@pytest.mark.parametrize(("fn", "words"), [
    ("returns_list", "is a builtins.list, not a torch.Tensor"),
    ("returns_subclass", "a subclass of torch.Tensor"),
    ("returns_meta", "is on meta, expected"),
    ("returns_sparse", "layout torch.sparse_coo"),
])
def test_outputs_are_checked_as_what_they_are(fn, words):
    result = run(fn)
    assert result.exit_code == 1 and result.verdicts["contract"].status == FAIL, result.render()
    assert words in result.verdicts["contract"].summary, result.render()


def test_an_exception_whose_str_raises_is_a_runs_failure():
    result = run("raises_unprintable")
    assert result.verdicts["runs"].status == FAIL, result.render()
    assert "raised _Unprintable: <its str() raised RuntimeError>" in result.verdicts["runs"].summary


def test_declaring_everything_unsupported_is_inconclusive():
    result = run("unsupported_everything")
    assert result.exit_code == 3, result.render()
    assert {result.verdicts[p].status for p in ("runs", "contract", "numerics", "launches")} == {INCONCLUSIVE}
    assert "declared unsupported" in result.verdicts["numerics"].summary
    assert result.render().splitlines()[-1].startswith("result: INCONCLUSIVE")


def test_a_predicate_that_rewrites_inputs_fails():
    result = run("predicate_rewrites", launches=EAGER_LAUNCHES)
    assert result.exit_code == 1, result.render()
    assert result.verdicts["inputs_unchanged"].status == FAIL and result.verdicts["numerics"].status == FAIL


def test_a_pointer_keyed_cache_fails_when_buffers_are_reused():
    result = run("pointer_cache", launches=EAGER_LAUNCHES)
    assert result.verdicts["numerics"].status == FAIL, result.render()
    # the state phase says so; the search's reused buffers may find it first, as a failure a fresh worker
    # does not repeat (flaky: it depends on earlier calls)
    assert any("same buffers" in f.message or f.source == "flaky" for f in result.verdicts["numerics"].failures), \
        result.render()


def test_outputs_that_are_views_of_a_reused_workspace_fail():
    result = run("workspace_view", launches=EAGER_LAUNCHES)
    assert result.verdicts["contract"].status == FAIL, result.render()
    assert "changed after a later call" in result.verdicts["contract"].summary


def test_raising_inside_the_launch_counter_fails_launches():
    result = run("raises_when_counted", launches=EAGER_LAUNCHES)
    assert result.verdicts["launches"].status == FAIL, result.render()
    assert "failed inside the launch counter" in result.verdicts["launches"].summary
    assert "not while you are looking" in result.verdicts["launches"].summary


def test_a_failure_that_needs_earlier_calls_is_reported_flaky_with_its_seed():
    result = run("wrong_once_warm", launches=EAGER_LAUNCHES)
    verdict = result.verdicts["numerics"]
    assert verdict.status == FAIL, result.render()
    first = verdict.failures[0]
    assert first.source == "flaky" and "--seed 0" in first.message, result.render()


def _cli(tmp_path: Path, fn: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuseaudit.cli", "audit", "rms_norm", f"{HOSTILE}:{fn}", "--device", DEVICE[0],
         "--examples", "4", "--seed", "0", "--launches", str(EAGER_LAUNCHES), *extra],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("fn", ["grandchild_rewrites_json", "kills_the_zygote"])
def test_a_grandchild_in_its_own_session_cannot_rewrite_the_json(tmp_path, fn):
    out = tmp_path / "result.json"
    proc = _cli(tmp_path, fn, "--json", str(out))
    written = out.read_text()
    time.sleep(1.0)  # a survivor would rewrite the file within 50 ms
    assert out.read_text() == written and "forged" not in written, written
    data = json.loads(written)
    assert data["exit_code"] == proc.returncode == 0, proc.stdout + proc.stderr
    said = set(tmp_path.glob("fuseaudit-hostile-*.pid"))  # the grandchild's, beside the --json file
    assert said, "the grandchild never started: the test tests nothing"
    for pid_file in said:
        pid = int(pid_file.read_text())
        pid_file.unlink()
        assert not _running(pid), f"the target's grandchild {pid} outlived the audit"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_worker_sees_no_secrets_and_not_the_callers_folder(tmp_path):
    (tmp_path / "fuseaudit-caller-marker").write_text("")
    proc = _cli(tmp_path, "sees_the_callers_world", env={"MY_SECRET_TOKEN": "hunter2", "HF_TOKEN": "x"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numerics          PASS" in proc.stdout
