"""Several workers: ``fuseaudit run --workers N`` and the plugin under pytest-xdist (CPU parts)."""

from __future__ import annotations

import argparse
import importlib.util
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
            ("softmax", "builtin:compile", "builtin", 8)]
    order = sorted(jobs, key=lambda j: -runner.expected_cost(j))
    assert [j[1].split(":")[-1] for j in order] == ["attention", "compile", "swiglu", "sdpa-flash"]


def test_time_limit_estimate_scales_each_audit_by_the_finished_ones() -> None:
    """After a long attention audit, a short row-op audit is still expected to be short."""
    attention = ("attention", "fuseaudit.kernels.attention:attention", "reference", 15)
    rms_norm = ("rms_norm", "fuseaudit.kernels.rms_norm:rms_norm", "reference", 15)
    assert runner.expected_seconds(rms_norm, []) == 0.0
    finished = [(runner.expected_cost(attention), 2 * runner.expected_cost(attention))]  # ran twice as long
    assert runner.expected_seconds(rms_norm, finished) == pytest.approx(2 * runner.expected_cost(rms_norm))
    assert runner.expected_seconds(rms_norm, finished) < runner.expected_seconds(attention, finished) / 10


def test_workers_are_validated(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main(["run", "--device", "cpu", "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "--workers must be a positive integer" in err and len(err.strip().splitlines()) == 1
    assert _options(["--gpus", "3"], "cpu")["workers"] == 3  # the alias; any number of CPU children
    assert _options([], "cpu")["workers"] == 1
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _options(["--gpus", "2"], "cuda")["workers"] == 2
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        _options(["--workers", "3"], "cuda")


def test_worker_device() -> None:
    # the judge and the target's process see the same GPUs: worker i audits on the judge's cuda:i
    assert runner.worker_device("cpu", 1) == ("cpu", None)
    assert runner.worker_device("cuda", 1) == ("cuda:1", None)


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
