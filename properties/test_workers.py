"""Several workers: ``fuseaudit run --workers N`` and the plugin under pytest-xdist (CPU parts)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fuseaudit import results, runner
from fuseaudit.cli import main as cli_main
from fuseaudit.plugin import xdist_worker_index


def _options(argv: list[str], device: str) -> dict:
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    return runner._options(parser.parse_args(argv), device)


def test_run_with_two_workers_records_each_audits_worker_and_device(tmp_path: Path) -> None:
    code = cli_main(["run", "--device", "cpu", "--ops", "swiglu", "bias_silu", "--workers", "2", "--examples", "3",
                     "--no-bench", "--no-e2e", "--out", str(tmp_path)])
    assert code == 0
    doc = results.load(tmp_path / "results-cpu.json")
    assert doc["finished"] and doc["options"]["workers"] == 2
    assert [a["op"] for a in doc["audits"]] == ["swiglu", "bias_silu"]  # job order, whichever finished first
    for a in doc["audits"]:
        assert a["status"] == "done" and a["passed"], a.get("message")
        assert a["device"] == "cpu" and a["worker"] in (0, 1)
    assert (tmp_path / "report-cpu.html").exists()
    launches = doc["launches"]  # counted in a child process after the audits
    assert launches["status"] == "done", launches.get("message")
    assert sorted(r["op"] for r in launches["rows"]) == ["bias_silu", "swiglu"]
    assert not [r for r in launches["rows"] if "error" in r]


def test_longest_audits_are_scheduled_first() -> None:
    jobs = [("swiglu", "fuseaudit.kernels.gated:swiglu", "reference", 30),
            ("attention", "builtin:sdpa-flash", "builtin", 8),
            ("attention", "fuseaudit.kernels.attention:attention", "reference", 20),
            ("softmax", "builtin:compile", "builtin", 8),
            ("attention", "builtin:compile", "builtin", 8)]
    order = sorted(jobs, key=lambda j: -runner.expected_cost(j))
    assert [(j[0], j[1].split(":")[-1]) for j in order] == [
        ("attention", "compile"), ("attention", "attention"), ("softmax", "compile"), ("swiglu", "swiglu"),
        ("attention", "sdpa-flash")]


def test_time_limit_estimate_scales_each_audit_by_the_finished_ones() -> None:
    """After a long attention audit, a short row-op audit is still expected to be short."""
    attention = ("attention", "fuseaudit.kernels.attention:attention", "reference", 15)
    rms_norm = ("rms_norm", "fuseaudit.kernels.rms_norm:rms_norm", "reference", 15)
    assert runner.expected_seconds(rms_norm, []) == 0.0
    finished = [(runner.expected_cost(attention), 2 * runner.expected_cost(attention))]  # ran twice as long
    assert runner.expected_seconds(rms_norm, finished) == pytest.approx(2 * runner.expected_cost(rms_norm))
    assert runner.expected_seconds(rms_norm, finished) < runner.expected_seconds(attention, finished) / 3


def _cuda(monkeypatch: pytest.MonkeyPatch, *, gpus: int, cores: int) -> None:
    """Pretend this machine has ``gpus`` CUDA devices and ``cores`` CPU cores."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)


def test_workers_and_gpus_are_validated(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main(["run", "--device", "cpu", "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "--workers must be a positive integer" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["run", "--device", "cpu", "--gpus", "1"]) == 2  # no GPU to use on the CPU
    err = capsys.readouterr().err
    assert "--gpus 1: the run is on the CPU" in err and len(err.strip().splitlines()) == 1
    cpu = _options([], "cpu")
    assert (cpu["gpus"], cpu["workers"]) == (0, 1)
    assert _options(["--workers", "3"], "cpu")["workers"] == 3
    _cuda(monkeypatch, gpus=1, cores=16)
    with pytest.raises(ValueError, match="--gpus must be a positive integer"):
        _options(["--gpus", "0"], "cuda")
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    monkeypatch.setattr("fuseaudit.profiles.resolve_device", lambda device: "cuda")
    assert runner.main(parser.parse_args(["--gpus", "2"])) == 2  # more GPUs than there are: a usage error
    err = capsys.readouterr().err
    assert "--gpus 2: only 1 CUDA device(s) here" in err and len(err.strip().splitlines()) == 1


def test_default_workers_share_each_gpu_within_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    per_gpu, cores_each = runner.WORKERS_PER_GPU, runner.CORES_PER_WORKER
    _cuda(monkeypatch, gpus=2, cores=per_gpu * cores_each)
    one = _options([], "cuda")
    assert (one["gpus"], one["workers"]) == (1, per_gpu)  # the one GPU shared by its workers
    assert _options(["--gpus", "2"], "cuda")["workers"] == per_gpu  # the cores bound the workers of two GPUs
    assert _options(["--workers", "3"], "cuda")["workers"] == 3  # more workers than GPUs, as asked
    _cuda(monkeypatch, gpus=2, cores=4 * per_gpu * cores_each)
    assert _options(["--gpus", "2"], "cuda")["workers"] == 2 * per_gpu
    _cuda(monkeypatch, gpus=1, cores=3 * cores_each)
    assert _options([], "cuda")["workers"] == 3
    _cuda(monkeypatch, gpus=1, cores=1)
    assert _options([], "cuda")["workers"] == 1  # at least one


def test_worker_device() -> None:
    # the judge and the target's process see the same GPUs: worker i audits on the judge's cuda:(i % gpus)
    assert runner.worker_device("cpu", 1) == ("cpu", None)
    assert runner.worker_device("cuda", 1, gpus=2) == ("cuda:1", None)
    assert [runner.worker_device("cuda", w, gpus=2)[0] for w in range(5)] == \
        ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert {runner.worker_device("cuda", w, gpus=1)[0] for w in range(4)} == {"cuda:0"}


class _Result:
    """What the fake audit returns: the attributes :func:`runner.audit_entry` reads."""

    exit_code, passed = 0, True

    def to_dict(self) -> dict:
        return {"properties": {"numerics": {"status": "PASS"}}}


class _FakeRun:
    """A ``fuseaudit run`` on a pretended GPU: audits and steps record what they were given and when."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], *, gpus: int = 2) -> None:
        _cuda(monkeypatch, gpus=gpus, cores=16)
        self.events: list[tuple] = []
        self.calls: list[dict] = []
        self.active = 0
        self.lock = threading.Lock()
        monkeypatch.setattr("fuseaudit.audit.audit", self.audit)
        monkeypatch.setattr("fuseaudit.builtin_targets.available_targets", lambda op, device: ["builtin:compile"])
        monkeypatch.setattr(results, "environment", lambda device: {"device": device, "device_name": "a GPU"})
        for name in ("launches", "bench", "e2e"):
            monkeypatch.setattr(runner, f"{name}_step", self.step(name))
        parser = argparse.ArgumentParser()
        runner.add_arguments(parser)
        self.args = parser.parse_args(["--ops", "swiglu", "attention", "--bench", "--e2e", *argv])
        self.options = runner._options(self.args, "cuda")
        self.path = tmp_path / "results-cuda.json"

    def audit(self, op: str, target: str, *, device: str, env: dict | None, **_: object) -> _Result:
        with self.lock:
            self.active += 1
            self.calls.append({"op": op, "target": target, "device": device, "env": env})
            self.events.append(("audit", op, target))
        time.sleep(0.05)  # long enough for the workers to overlap
        with self.lock:
            self.active -= 1
        return _Result()

    def step(self, name: str):
        def job(*args: object) -> dict:
            self.events.append((name, self.active))  # how many audits were running when the step began
            return {"status": "done", "message": "", "rows": [], "document": None}
        return job

    def run(self) -> dict:
        return runner.run(self.args, "cuda", self.options, self.path)


def test_reference_audits_run_without_autotuning_and_builtins_as_they_are(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = _FakeRun(monkeypatch, tmp_path, [])
    doc = fake.run()
    envs = {(c["op"], c["target"].startswith("builtin:")): c["env"] for c in fake.calls}
    assert len(envs) == 4
    for (op, builtin), env in envs.items():
        if builtin:
            assert "FUSEAUDIT_AUTOTUNE" not in (env or {}), (op, env)
        else:
            assert env == {"FUSEAUDIT_AUTOTUNE": "0"}, (op, env)
    assert doc["options"]["reference_env"] == {"FUSEAUDIT_AUTOTUNE": "0"}
    assert results.load(fake.path)["options"]["reference_env"] == {"FUSEAUDIT_AUTOTUNE": "0"}


def test_more_workers_than_gpus_spread_over_every_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = _FakeRun(monkeypatch, tmp_path, ["--gpus", "2", "--workers", "4"])
    doc = fake.run()
    assert len(doc["audits"]) == 4 and {a["status"] for a in doc["audits"]} == {"done"}
    for a in doc["audits"]:
        assert a["device"] == f"cuda:{a['worker'] % 2}", a
    assert {c["device"] for c in fake.calls} == {"cuda:0", "cuda:1"}
    assert {a["worker"] for a in doc["audits"]} == {0, 1, 2, 3}  # four audits at once, each on a worker


def test_every_audit_runs_before_bench_and_e2e_and_launches_beside_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = _FakeRun(monkeypatch, tmp_path, ["--workers", "3"])
    doc = fake.run()
    timed = [e for e in fake.events if e[0] in ("bench", "e2e")]
    assert timed == [("bench", 0), ("e2e", 0)]  # in this order, with no audit running
    audits = [i for i, e in enumerate(fake.events) if e[0] == "audit"]
    assert len(audits) == 4 and {fake.events[i][2] for i in audits} >= {"builtin:compile"}
    assert fake.events.index(("bench", 0)) == len(audits) + 1  # the built-in targets too come first
    # launch counting times nothing: on a GPU it starts before the last audit has begun, not after them
    launches = [i for i, e in enumerate(fake.events) if e[0] == "launches"]
    assert len(launches) == 1 and launches[0] < audits[-1], fake.events
    assert doc["launches"]["status"] == "done"
    assert runner.launches_beside("cuda") and not runner.launches_beside("cpu")
    assert "launches" in runner.later_steps(fake.options, "cpu")  # on the CPU it follows the audits
    assert doc["finished"] and doc["bench"]["status"] == "done" and doc["e2e"]["status"] == "done"
    err = capsys.readouterr().err
    finished = [line for line in err.splitlines() if "PASS" in line]
    assert len(finished) == 4 and all(re.search(r"about \d+ (s|min) left", line) for line in finished), err


def test_an_interrupted_run_leaves_no_launch_counter_running(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    fake = _FakeRun(monkeypatch, tmp_path, ["--workers", "2"])
    ended = threading.Event()

    def slow_count(*args: object) -> dict:  # a launch counter that would run for a minute
        runner._child([sys.executable, "-c", "import time; time.sleep(60)"], timeout=120,
                      stdout=subprocess.DEVNULL)
        ended.set()
        return {"status": "error", "message": "", "rows": []}

    def interrupted(*args: object, **kw: object) -> _Result:
        time.sleep(0.5)  # the counter has started
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "launches_step", slow_count)
    monkeypatch.setattr("fuseaudit.audit.audit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fake.run()
    assert ended.wait(10), "the launch counter beside the audits kept running after the run stopped"
    assert not runner._CHILDREN


def test_builtin_audits_leave_the_speed_steps_their_budgets(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    # the bench and e2e budgets and a step's 30 s margin do not fit in 200 s: built-in
    # targets are not audited; the reference kernels still are, and so are the steps
    fake = _FakeRun(monkeypatch, tmp_path, ["--time-limit", "200", "--workers", "2"])
    doc = fake.run()
    by_kind = {(a["op"], a["kind"]): a for a in doc["audits"]}
    assert {by_kind[(op, "reference")]["status"] for op in ("swiglu", "attention")} == {"done"}
    for op in ("swiglu", "attention"):
        entry = by_kind[(op, "builtin")]
        assert entry["status"] == "skipped", entry
        assert "leaves no time before bench, e2e" in entry["message"]
    assert [e[0] for e in fake.events if e[0] in ("bench", "e2e")] == ["bench", "e2e"]
    roomy = _FakeRun(monkeypatch, tmp_path, ["--time-limit", "600", "--workers", "2"]).run()
    assert {a["status"] for a in roomy["audits"]} == {"done"}  # with room, the built-in targets run


def test_expected_duration_line() -> None:
    later = {"launches": 30.0, "bench": 60.0, "e2e": 120.0}
    four = runner.expected_line([50.0] * 4, workers=4, later=later, device="cuda", time_limit=None)
    assert four == "expected about 4 min (audits ~50 s on 4 workers, launches ~30 s, bench 60 s, e2e 120 s)"
    one = runner.expected_line([50.0] * 4, workers=1, later=later, device="cuda", time_limit=None)
    assert one == "expected about 7 min (audits ~3 min on 1 worker, launches ~30 s, bench 60 s, e2e 120 s)"
    beside = runner.expected_line([50.0] * 4, workers=4, later={"bench": 60.0, "e2e": 120.0}, device="cuda",
                                  time_limit=None)
    assert beside == "expected about 4 min (audits ~50 s on 4 workers with launches beside them, bench 60 s, " \
                     "e2e 120 s)"
    cut = runner.expected_line([50.0] * 4, workers=1, later=later, device="cuda", time_limit=300)
    assert cut.startswith("expected about 5 min") and cut.endswith("; --time-limit 300 s cuts it)")
    cpu = runner.expected_line([50.0], workers=1, later={"launches": 30.0}, device="cpu", time_limit=None)
    assert "expected about" not in cpu and cpu.endswith("then launches ~30 s")  # no GPU rates for the interpreter
    # an audit cannot be split over workers: the longest one bounds the audits
    assert runner.schedule_seconds([80.0, 10.0, 10.0], 4) == 80.0
    assert runner.schedule_seconds([30.0, 30.0, 30.0], 2) == 60.0
    assert runner.schedule_seconds([10.0], 2, busy=[40.0]) == 40.0


def test_default_run_expects_the_catalogs_audits_and_the_default_budgets(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    fake = _FakeRun(monkeypatch, tmp_path, ["--workers", "2"])
    assert runner.later_steps(fake.options, "cuda") == {"bench": runner.DEFAULT_BENCH_S, "e2e": runner.DEFAULT_E2E_S}
    jobs = runner._jobs(fake.options, "cuda")
    audits = runner.schedule_seconds([runner.expected_cost(j) for j in jobs], 2)
    fake.run()
    from fuseaudit.run_progress import duration

    err = capsys.readouterr().err
    budgets = f"bench {runner.DEFAULT_BENCH_S:g} s, e2e {runner.DEFAULT_E2E_S:g} s"
    assert f"(audits ~{duration(audits)} on 2 workers with launches beside them, {budgets})" in err, err
    assert err.index("expected about") < err.index("PASS")  # before the first audit finishes


def test_time_left_is_shown_after_each_audit() -> None:
    from rich.console import Console

    from fuseaudit.run_progress import RunProgress

    out = io.StringIO()
    progress = RunProgress(2, Console(file=out, force_terminal=False, width=200), workers=2)
    entry = {"op": "swiglu", "target": "t", "status": "done", "passed": True, "verdicts": {}, "cases": [],
             "elapsed_s": 3.0}
    progress.begin_audit("swiglu", "t", 5, worker=1)
    progress.end_audit(entry, left_s=150.0)
    progress.end_audit({**entry, "op": "softmax"}, left_s=None)
    lines = out.getvalue().splitlines()
    assert "swiglu t (5 examples, worker 1)" in lines[0]
    assert "PASS" in lines[1] and "3 s" in lines[1] and "about 2 min left" in lines[1]
    assert "left" not in lines[2]  # no estimate yet: nothing said


def test_progress_names_each_phase_in_words() -> None:
    """A quiet audit's progress line says what it is doing, not the judge's phase identifier."""
    from rich.console import Console

    from fuseaudit import run_progress
    from fuseaudit.judge import PHASES

    assert set(run_progress.PHASE_WORDS) == set(PHASES)
    out = io.StringIO()
    progress = run_progress.RunProgress(1, Console(file=out, force_terminal=False, width=200))
    progress.begin_audit("swiglu", "t", 5)
    progress.last_line -= run_progress.QUIET_S  # as after QUIET_S seconds without a line
    progress.on_event({"event": "phase", "phase": "state"})
    assert "swiglu t: a second call on the same buffers, 0/5 examples" in out.getvalue().splitlines()[-1]


def test_the_runner_imports_without_torch() -> None:
    """The command line reads REFERENCE_ENV to start the zygote while it imports torch."""
    code = "import sys, fuseaudit.runner; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_xdist_worker_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert xdist_worker_index() is None
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert xdist_worker_index() == 3
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "master")
    assert xdist_worker_index() is None


XDIST_TESTS = """
import os

def test_one(fuseaudit_device):
    assert fuseaudit_device == "cpu"
    assert os.environ["PYTEST_XDIST_WORKER"].startswith("gw")

def test_two(fuseaudit_device):
    assert fuseaudit_device == "cpu"
"""


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed (pip install "
                    "'fuseaudit[dev]')")
def test_plugin_under_xdist_records_the_device(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(XDIST_TESTS)
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "-p", "no:cacheprovider",
                                           "--fuseaudit-device=cpu", f"--junitxml={junit}")
    result.assert_outcomes(passed=2)
    props = [(p.get("name"), p.get("value")) for p in ET.parse(junit).getroot().iter("property")]
    assert props.count(("fuseaudit_device", "cpu")) == 2, props


SHARD_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(5))
def test_item(i):
    pass
"""


def test_shards_split_the_collected_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SHARD_TESTS)
    ran = []
    for k in range(2):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fuseaudit-device=cpu",
                                               f"--fuseaudit-shard={k}/2", "-v")
        result.assert_outcomes(passed=3 - k, deselected=2 + k)
        ran += [line.split("::")[1].split()[0] for line in result.outlines if "PASSED" in line]
    assert sorted(ran) == [f"test_item[{i}]" for i in range(5)]  # every test in exactly one shard
    bad = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fuseaudit-device=cpu", "--fuseaudit-shard=2/2")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    assert "K/N" in bad.stderr.str()


def test_the_e2e_step_measures_a_transformers_model_beside_the_results(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """Where transformers is installed the step runs ``e2e --model hf-llama --cuda-graphs``; its JSON (and with it
    the profiled steps' traces) lands in the results' folder, where the report links them."""
    import importlib.util
    import json

    seen: list[list[str]] = []

    def child(cmd: list[str], *, timeout: float, stdout) -> tuple[int, str]:
        seen.append(cmd)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"agreement": {"verdict": "agree"}, "_path": "x"}))
        return 0, ""

    monkeypatch.setattr(runner, "_child", child)
    out, tmp = tmp_path / "reports", tmp_path / "tmp"
    out.mkdir(), tmp.mkdir()
    step = runner.e2e_step("cuda", out, tmp, 100.0)
    cmd = seen.pop()
    model = "hf-llama" if importlib.util.find_spec("transformers") else "own"
    assert cmd[cmd.index("--model") + 1] == model and "--cuda-graphs" in cmd
    assert cmd[cmd.index("--json") + 1] == str(out / f"e2e-{model}.json") and cmd[-1] == "60"
    assert step["status"] == "done" and "_path" not in step["document"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "transformers" else object())
    assert runner.e2e_model() == "own"
