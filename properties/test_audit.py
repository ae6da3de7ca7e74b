"""``fuseaudit audit`` against planted bugs, correct kernels, misbehaving processes and bad usage.

Every planted bug (``properties/planted/``) must fail the property that
catches its bug class, with a minimal case and a replay command; every
correct kernel must pass.  Every audit runs its target in a worker forked
from the zygote, on the session's device.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fuseaudit import audit as audit_cli
from fuseaudit.audit import AuditUsageError, audit
from fuseaudit.audit_result import FAIL, INCONCLUSIVE, PASS, AuditResult, FailureRecord, Verdict
from fuseaudit.builtin_targets import available_targets, builtin_target
from fuseaudit.case import Case
from fuseaudit.catalog import get_op
from fuseaudit.edges import edge_cases

PLANTED = Path(__file__).parent / "planted"
EXAMPLES = 8


DEVICE = ["cpu"]


@pytest.fixture(autouse=True)
def _session_device(fuseaudit_device: str) -> None:
    """The planted kernels run in a worker on the session's device (the interpreter on the CPU)."""
    DEVICE[0] = fuseaudit_device


def planted(name: str) -> str:
    return f"{PLANTED / name.split(':')[0]}:{name.split(':')[1]}"


def run(op: str, target: str, **kw):
    options = {"examples": EXAMPLES, "seed": 0, "device": DEVICE[0], "profile": "ci",
               "shrink_time": 5.0, **kw}
    return audit(op, planted(target), **options)


def minimal(result, prop: str) -> Case:
    """The case shown for a failed property, with the checks every failure must pass."""
    verdict = result.verdicts[prop]
    assert verdict.status == FAIL, result.render()
    first = verdict.failures[0]
    assert first.message and first.describe
    assert first.replay and "--case" in first.replay and f"audit {result.op} " in first.replay
    return Case.from_json(first.case)


def test_per_input_support_declaration_skips_without_judging() -> None:
    declared = run("softmax", "narrow.py:softmax", examples=20, launches=2)  # torch.softmax(x * scale): 2
    assert declared.passed, declared.render()
    assert any("outside the target's declared support" in n for n in declared.notes), declared.notes
    undeclared = run("softmax", "narrow.py:softmax_undeclared", examples=20)
    assert undeclared.verdicts["runs"].status == FAIL
    assert "at most 8 are supported" in undeclared.verdicts["runs"].failures[0].message
    assert Case.from_json(undeclared.verdicts["runs"].failures[0].case).dims["N"] > 8


# ---------------------------------------------------------------------------
# Planted bugs: the right property fails, with a minimal case and a replay
# ---------------------------------------------------------------------------

BUGS = [
    # (op, target, property that must fail, check on the case shown)
    ("swiglu", "row_stride.py:swiglu", "numerics",
     lambda c: any(lay != "contiguous" for lay in c.layouts.values())),
    ("swiglu", "col_stride.py:swiglu", "numerics", lambda c: {"transposed", "strided"} & set(c.layouts.values())),
    ("swiglu", "tail_mask.py:swiglu", "numerics", lambda c: c.dims["N"] % 256 != 0),
    ("rms_norm", "half_accum.py:rms_norm", "numerics", lambda c: c.dtype == "float16"),
    ("rms_norm", "eps_misplaced.py:rms_norm", "numerics", None),
    ("bias_gelu", "inplace.py:bias_gelu", "inputs_unchanged", None),
    ("softmax", "wrong_dtype.py:softmax", "contract", lambda c: c.dtype != "float32"),
    ("softmax", "softmax_zeros.py:softmax", "numerics", None),
    ("attention", "attention_causal.py:attention", "numerics",
     lambda c: c.params["causal"] and c.dims["Sq"] != c.dims["Sk"]),
    ("attention", "attention_gqa.py:attention", "numerics",
     lambda c: c.dims["Hkv"] > 1 and c.dims["H"] > c.dims["Hkv"]),
    ("attention", "attention_online.py:no_rescale", "numerics", lambda c: c.dims["Sk"] > 16),
]


@pytest.mark.parametrize(("op", "target", "prop", "check"), BUGS, ids=[b[1].split(":")[0] for b in BUGS])
def test_planted_bug_fails_its_property(op, target, prop, check):
    result = run(op, target)
    assert result.exit_code == 1
    case = minimal(result, prop)
    assert case.op == op
    if check is not None:
        assert check(case), f"{prop} failed on a case that does not show the bug: {case.describe()}"
    # none of them raises; the search stops at its first failure and shrinks for a bounded time, so how many
    # cases "runs" held on (all asked: PASS, fewer: INCONCLUSIVE) depends on the machine's speed
    runs = result.verdicts["runs"]
    stopped = runs.summary.partition("the search stops at a failing case (")[2]
    assert runs.status == PASS or (runs.status == INCONCLUSIVE and prop in stopped), result.render()
    text = result.render()
    assert f"{prop:<17} FAIL" in text and "replay:" in text and case.describe() in text


BLIND_SPOTS = [
    ("nan_on_zero_rows", "numerics", lambda c: c.regime == "zeros"),
    ("wrong_past_64_rows", "numerics", lambda c: math.prod(c.dims["lead"]) > 64),
    ("wrong_past_5000", "numerics", lambda c: c.dims["N"] > 5000),
    ("raises_past_65536", "runs", lambda c: c.dims["N"] > 65536),
    ("wrong_in_the_last_row", "numerics", lambda c: math.prod(c.dims["lead"]) > 1),
    ("wrong_with_storage_offsets", "numerics", lambda c: "offset" in c.layouts.values()),
]


@pytest.mark.parametrize(("fn", "prop", "check"), BLIND_SPOTS, ids=[b[0] for b in BLIND_SPOTS])
def test_a_default_audit_finds_bugs_where_the_search_seldom_looks(fn, prop, check):
    """The edge phase: each planted kernel is wrong only past a limit the search's bounds never reach."""
    result = audit("rms_norm", planted(f"blind_spots.py:{fn}"), device=DEVICE[0], seed=0)
    assert result.verdicts[prop].status == FAIL, result.render()
    case = minimal(result, prop)
    assert check(case), f"{prop} failed on a case that does not show the bug: {case.describe()}"


def test_the_shrink_time_bounds_the_edge_phase_and_the_search():
    """``shrink_time=0``: no shrinking call in either phase; the failing cases found are shown, the note says why."""
    starts: dict[str, int] = {"edge": 0, "search": 0}

    def count(event: dict) -> None:
        if event["event"] == "start" and event["phase"] in starts:
            starts[event["phase"]] += 1

    result = run("rms_norm", "eps_misplaced.py:rms_norm", examples=4, shrink_time=0.0, on_event=count)
    minimal(result, "numerics")
    assert starts["edge"] == len(edge_cases(get_op("rms_norm"), profile="ci")), starts
    assert starts["search"] <= 2 * 4, starts  # the examples, and Hypothesis's replay of each failing one
    assert any("stopped at the shrink time (0 s)" in note for note in result.notes), result.notes


NON_FINITE_BUGS = [
    ("softmax", "softmax_zero_on_masked_rows", lambda c: c.regime == "masked"),
    ("softmax", "softmax_online_unsafe_max", lambda c: c.regime == "masked" and c.dims["N"] > 1024),
    ("rms_norm", "rms_norm_hides_nan", lambda c: c.regime == "nonfinite"),
]


@pytest.mark.parametrize(("op", "fn", "check"), NON_FINITE_BUGS, ids=[b[1] for b in NON_FINITE_BUGS])
def test_a_default_audit_judges_non_finite_inputs_as_eager_does(op, fn, check):
    """-inf masks (fully masked rows, whole masked tiles) and NaN inputs: wrong only there, caught by default."""
    result = audit(op, planted(f"non_finite.py:{fn}"), device=DEVICE[0], seed=0)
    assert result.verdicts["numerics"].status == FAIL, result.render()
    case = minimal(result, "numerics")
    assert check(case), f"numerics failed on a case that does not show the bug: {case.describe()}"


def test_fake_fusion_fails_launches_only():
    result = run("swiglu", "fake_fusion.py:swiglu", examples=4)
    assert result.failed == ["launches"], result.render()
    assert result.verdicts["launches"].detail["count"]["kernels"] == ["silu_kernel", "mul_kernel", "cast_kernel"]
    assert "silu_kernel, mul_kernel, cast_kernel" in result.verdicts["launches"].summary
    minimal(result, "launches")


# ---------------------------------------------------------------------------
# Correct kernels pass
# ---------------------------------------------------------------------------

def test_eager_composition_passes():
    result = run("bias_gelu", "correct.py:bias_gelu", launches=2)
    assert result.exit_code == 0, result.render()
    assert all(v.status == PASS for v in result.verdicts.values()), result.render()


def test_plain_pytorch_composition_is_told_how_to_be_judged_unfused():
    result = run("bias_gelu", "correct.py:bias_gelu", examples=3)
    assert result.failed == ["launches"], result.render()
    assert "a plain PyTorch composition launches one kernel per op" in result.verdicts["launches"].summary
    assert "pass --launches 2" in result.verdicts["launches"].summary


def test_audit_from_a_folder_that_holds_a_fuseaudit_directory(tmp_path):
    """The folder one cloned into, or the repository's parent: the worker never imports that directory."""
    (tmp_path / "fuseaudit").mkdir()
    (tmp_path / "fuseaudit" / "README.md").write_text("a checkout, not a package\n")
    script = Path(sys.executable).with_name("fuseaudit")  # the console script, as a user types it
    proc = subprocess.run(
        [str(script), "audit", "bias_gelu", planted("correct.py:bias_gelu"),
         "--device", "cpu", "--examples", "3", "--seed", "0", "--launches", "2"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: PASS" in proc.stdout


def test_correct_triton_kernel_passes():
    result = run("swiglu", "correct_triton.py:swiglu", examples=6)
    assert result.exit_code == 0, result.render()
    assert result.verdicts["launches"].summary == "1 kernel(s): swiglu_kernel (on 3 case(s))"


def test_correct_tiled_attention_is_right_but_not_fused():
    result = run("attention", "attention_online.py:rescaled", examples=6)
    assert result.failed == ["launches"], result.render()


def test_replay_runs_exactly_one_case_with_figures():
    case = Case(op="swiglu", dtype="float32", dims={"lead": (2,), "N": 1},
                layouts={"gate": "contiguous", "up": "padded"}, regime="normal", params={}, seed=0)
    result = run("swiglu", "row_stride.py:swiglu", case=case.to_json())
    assert result.mode == "replay" and result.examples_run == 0 and result.failed == ["numerics"]
    assert {f.case for f in result.verdicts["numerics"].failures} == {case.to_json()}
    assert Case.from_json(result.verdicts["numerics"].failures[0].case) == case
    assert "comparison figures:" in result.render()
    assert result.replay_report["comparisons"][0]["output"] == "y"


# ---------------------------------------------------------------------------
# Isolation: raises, hangs, segfaults are failures, and the audit goes on
# ---------------------------------------------------------------------------

def test_segfault_is_a_runs_failure_and_the_audit_goes_on():
    result = run("bias_gelu", "misbehaving.py:segfaults_on_narrow_rows", isolate=True, launches=2)
    case = minimal(result, "runs")
    message = result.verdicts["runs"].summary
    assert "SIGSEGV" in message and "misbehaving.py" in message, message
    assert case.dims["N"] < 8
    # every crash was a case Hypothesis could shrink, each next call in a fresh worker; the later
    # phases ran on cases that do not crash
    assert result.verdicts["launches"].status == PASS
    assert result.verdicts["determinism"].status == PASS
    assert result.restarts >= 1 and result.verdicts["runs"].failures[0].source == "shrunk"


def test_hang_is_a_runs_failure_after_the_timeout():
    events: list[dict] = []
    result = run("bias_gelu", "misbehaving.py:hangs_on_narrow_rows", isolate=True, launches=2, timeout=3,
                 on_event=events.append)
    case = minimal(result, "runs")
    message = result.verdicts["runs"].summary
    assert "no progress for 3 s" in message and "hangs_on_narrow_rows" in message, message
    assert case.dims["N"] < 8
    # one timeout: the search stops at the hang, and the later phases call only cases that ran
    hung = [e for e in events if e["event"] == "done" and e["report"].get("process") == "timeout"]
    assert len(hung) == 1, [e["phase"] for e in hung]
    assert result.restarts == 0 and "at the first hang" in result.render()


def test_lost_cuda_context_is_a_runs_failure():
    # CPU stand-in for an illegal CUDA access: the worker treats the error as fatal on any device
    result = run("bias_gelu", "misbehaving.py:illegal_access_on_half", launches=2)
    case = minimal(result, "runs")
    assert case.dtype in ("float16", "bfloat16")
    assert result.verdicts["runs"].summary.startswith("the target made the CUDA context unusable in a call")
    assert "illegal memory access" in result.verdicts["runs"].summary


def test_a_lost_cuda_context_is_reported_by_its_error_not_as_a_crash():
    """A worker whose context is lost replies before it lets go of the judge's buffers: on a GPU that
    release synchronises and aborts the process, which would hide the error behind a SIGABRT."""
    result = run("bias_gelu", "misbehaving.py:misaligned_on_half", launches=2)
    summary = result.verdicts["runs"].summary
    assert "misaligned address" in summary and "SIGABRT" not in summary, summary


def test_cli_raising_target_is_shrunk_and_reported(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fuseaudit.cli", "audit", "bias_gelu", planted("misbehaving.py:raises_above_64"),
         "--device", "cpu", "--examples", "10", "--seed", "0", "--launches", "2", "--shrink-time", "10",
         "--json", str(out)],
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "runs              FAIL  raised ValueError: hidden size 65 is not supported" in proc.stdout
    assert "case (minimal):" in proc.stdout and "replay:" in proc.stdout
    data = json.loads(out.read_text())
    assert data["exit_code"] == 1 and data["failed"] == ["runs"]
    failure = data["properties"]["runs"]["failures"][0]
    assert failure["source"] == "shrunk"
    assert Case.from_json(failure["case"]).dims["N"] == 65  # Hypothesis shrank to the smallest width that raises
    assert failure["replay"].count("--case") == 1
    # the later phases run on drawn cases that ran (none wider than 64)
    assert data["properties"]["launches"]["status"] == "PASS"
    assert data["environment"]["torch"] and data["environment"]["triton"] and data["elapsed_s"] > 0


# ---------------------------------------------------------------------------
# Bad usage: exit 2, one line on stderr
# ---------------------------------------------------------------------------

def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    audit_cli.add_arguments(parser)
    return audit_cli.main(parser.parse_args(list(argv)))


@pytest.mark.parametrize("argv", [
    ("no_such_op", planted("correct.py:bias_gelu")),
    ("bias_gelu", str(PLANTED / "missing.py") + ":f"),
    ("bias_gelu", planted("correct.py:no_such_function"), "--in-process"),
    ("bias_gelu", planted("misbehaving.py:wrong_signature"), "--in-process"),
    ("bias_gelu", planted("correct.py:bias_gelu"), "--examples", "0"),
    ("bias_gelu", planted("correct.py:bias_gelu"), "--dtypes", "float8"),
    ("bias_gelu", planted("correct.py:bias_gelu"), "--head-dims", "64"),
    ("bias_gelu", planted("correct.py:bias_gelu"), "--case", '{"op": "softmax"'),
    ("softmax", planted("correct.py:bias_gelu"), "--case", Case(
        op="bias_gelu", dtype="float32", dims={"lead": (1,), "N": 1}, layouts={}, params={}).to_json()),
    ("attention", "builtin:sdpa-flash", "--device", "cpu"),
], ids=["unknown-op", "missing-file", "missing-function", "wrong-signature", "examples-0", "bad-dtype",
        "head-dims-not-attention", "bad-case-json", "case-of-another-op", "builtin-not-here"])
def test_bad_usage_exits_2_with_one_line(argv, capsys):
    assert cli(*argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuseaudit audit: error: "), captured.err
    assert "Traceback" not in captured.err


def test_wrong_signature_names_the_expected_one(capsys):
    with pytest.raises(AuditUsageError, match=r"bias_gelu\(x, bias, approximate='none'\)"):
        run("bias_gelu", "misbehaving.py:wrong_signature")


def test_cli_subprocess_bad_option_exits_2():
    proc = subprocess.run([sys.executable, "-m", "fuseaudit.cli", "audit", "no_such_op", "x.py:f"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "unknown op" in proc.stderr


# ---------------------------------------------------------------------------
# Built-in targets
# ---------------------------------------------------------------------------

def test_builtin_targets_available_on_cpu():
    here = available_targets("attention", "cpu")
    assert "builtin:sdpa-math" in here and "builtin:sdpa-flash" not in here
    assert "builtin:sdpa-math" not in available_targets("rms_norm", "cpu")
    assert builtin_target("builtin:sdpa-flash").dtypes == ("bfloat16", "float16")
    assert "needs cuda" in builtin_target("builtin:sdpa-cudnn").unavailable("attention", "cpu")
    # a numbered GPU (what `fuseaudit run` gives each worker) is a cuda device
    compile_ = builtin_target("builtin:compile")
    assert compile_.unavailable("rms_norm", "cuda:1") is None and "needs" in compile_.unavailable("rms_norm", "xpu:0")


def test_builtin_sdpa_math_matches_on_one_case():
    case = Case(op="attention", dtype="float32", dims={"B": 1, "H": 4, "Hkv": 2, "Sq": 5, "Sk": 9, "D": 16},
                layouts={"q": "contiguous", "k": "padded", "v": "contiguous"}, params={"causal": True, "scale": None})
    result = audit("attention", "builtin:sdpa-math", case=case, device="cpu", isolate=False)
    assert result.exit_code == 0, result.render()
    assert result.verdicts["launches"].status == "SKIP"  # the unfused baseline: counted, not judged
    assert result.verdicts["launches"].detail["count"]["count"] > 1


def test_every_listed_failure_keeps_a_space_after_its_label():
    """``also (launches):`` is as wide as the label column: its case must not run into it."""
    failures = [FailureRecord("3 kernel(s)", source, describe=f"case {i}", replay="fuseaudit audit ... --case '{}'")
                for i, source in enumerate(("launches", "launches", "determinism"))]
    verdict = Verdict("launches", FAIL, "3 launches, expected 1", cases=3, failing_cases=3, failures=failures)
    result = AuditResult(op="swiglu", target="m:f", device="cpu", mode="search", verdicts={"launches": verdict},
                         examples_requested=3, examples_run=3, seed=0, profile="ci", declared={}, environment={})
    lines = result.render().splitlines()
    also = [line.strip() for line in lines if line.strip().startswith("also")]
    assert also == ["also (launches): case 1", "also (determinism): case 2"], lines
