"""``fuseaudit run`` and the HTML report: one results file, one self-contained page, a real browser.

The report is rendered from a synthetic GPU-like results document (every
section: verdicts, a failure, tolerance, speed, memory, NVML, end to end,
hostile target names) and from a real, small CPU run.  Headless Chromium
opens it: no console error, a non-trivial screenshot, nothing fetched.
Where Chromium is not installed the browser test skips with a reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
from html import escape
from html import unescape as html_unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from fuseaudit import benchjson, nvml, report, report_provenance, report_text, report_view, results, runner
from fuseaudit.case import Case
from fuseaudit.catalog import OPS
from fuseaudit.cli import main as cli_main
from fuseaudit.tolerance import ULP_BINS

HOSTILE = "<script>alert(1)</script>"
HOSTILE_MSG = '<img src=x onerror="alert(2)"> broke'
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium")
                 if p and os.path.exists(p)), None)


# ---------------------------------------------------------------------------
# A synthetic results document with every section filled
# ---------------------------------------------------------------------------

def _case_json(op: str, dtype: str, n: int, rng: random.Random) -> str:
    spec = OPS[op]
    dims: dict[str, Any] = spec.shape.sample_dims("cpu")
    if "lead" in dims:  # row ops: as many rows as a model's batch
        dims.update(lead=(rng.randint(1, 64),), N=n)
    else:
        dims["Sk"] = n
    case = Case(op, dtype, dims, {i.name: "contiguous" for i in spec.inputs}, "normal", spec.defaults(),
                seed=rng.randint(0, 999))
    return case.to_json()


def _audit(op: str, target: str, kind: str, rng: random.Random, *, fail: str | None = None) -> dict[str, Any]:
    collector = results.CaseCollector()
    for i in range(12):
        dtype = ("float32", "bfloat16", "float16")[i % 3]
        n = rng.choice([7, 64, 129, 1000, 4096, 5120])
        ulp = rng.uniform(0, 2.5)
        bad = fail == "numerics" and i == 5
        cmp = {"output": "y", "passed": not bad, "max_abs_err": 1e-3, "max_rel_err": 1e-3,
               "max_ulp_err": 40.0 if bad else ulp, "eager_max_ulp_err": rng.uniform(0.5, 2.5),
               "ratio_to_eager": rng.uniform(0.5, 1.5), "yardstick": "eager", "rows": 8, "rows_failed": int(bad),
               "worst_index": [0, 1], "worst_got": 1.0 + (0.02 if bad else 0.001), "worst_oracle": 1.0,
               "worst_eager": 1.0, "worst_bound": 0.004,
               "ulp_histogram": [rng.randint(0, 500) for _ in ULP_BINS]}
        report_ = {"case": _case_json(op, dtype, n, rng), "describe": f"{op} {dtype} N={n}", "passed": not bad,
                   "failures": [{"prop": "numerics", "message": "rows exceed the bound"}] if bad else [],
                   "comparisons": [cmp]}
        collector({"event": "done", "phase": "search", "report": report_})
    props = {p: {"status": "PASS", "summary": "held on 12 case(s)", "failures": []} for p in results.PROPERTY_ORDER}
    if fail:
        case = collector.cases[5]["case"]
        props[fail] = {"status": "FAIL", "summary": f"{HOSTILE_MSG}: 1/8 rows exceed the bound", "failures": [{
            "message": HOSTILE_MSG, "source": "shrunk", "case": case, "describe": f"{op} minimal {HOSTILE}",
            "replay": Case.from_json(case).replay_command(target, "cuda"), "comparisons": []}]}
    verdicts = {p: v["status"] for p, v in props.items()}
    return {"op": op, "target": target, "kind": kind, "examples": 12, "status": "done",
            "exit_code": 1 if fail else 0, "passed": not fail, "verdicts": verdicts, "elapsed_s": 3.5,
            "result": {"properties": props}, "cases": collector.cases, "ulp_histograms": collector.histograms}


def _bench_document() -> dict[str, Any]:
    entries = []
    for op, spec in OPS.items():
        attention = spec.compute_bound
        impls = ["reference", "eager", "compile"] + [f"sdpa_{b}" for b in spec.sdpa_backends[:1]]
        for k, (label, nbytes) in enumerate([("rows=1 N=4096", 2e4), ("rows=1024 N=4096", 2.5e7),
                                             ("rows=16384 N=8192", 8e8)]):
            base_us = 3 + nbytes / 3e6
            for impl in impls:
                us = base_us * {"reference": 1.0, "eager": 2.4, "compile": 1.3, "sdpa_flash": 0.9}[impl]
                extra = {"op": op, "impl": impl, "point": label, "dtype": "bfloat16", "bytes_moved": nbytes,
                         "flops": nbytes * 50,
                         "gbps": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / 4000, "copy_gbps": 4000,
                         "tflops": 300.0 / (1 + (impl != "reference")) if attention else None,
                         "launches": {"count": 1 if impl == "reference" else 3},
                         "memory": {"peak_extra_bytes": int(nbytes * (1 if impl == "reference" else 2))},
                         "nvml": {"available": True, "avg_watts": 420.0 + k, "sm_clock_mhz": 1980,
                                  "mem_clock_mhz": 3201, "temperature_c": 51, "throttle_reasons": ["gpu_idle"]}}
                if impl == "reference":
                    extra.update(intermediate_bytes_avoided=int(nbytes / 2), speedup_vs_eager=2.4,
                                 speedup_vs_compile=1.3, peak_saved_vs_eager_bytes=int(nbytes))
                entries.append(benchjson.benchmark_entry(
                    op=op, impl=impl, point_label=label, dtype="bfloat16", params={"op": op},
                    samples_s=[us * 1e-6 * (1 + 0.01 * i) for i in range(5)], extra_info=extra))
    meta = {"copy_gbps": 4000.0, "seconds": 170.2, "interrupted": False,
            "skipped": [{"op": "attention", "point": "S=4096", "dtype": "bfloat16", "impl": "sdpa_cudnn",
                         "reason": f"no kernel {HOSTILE}"}]}
    return benchjson.document(entries, fuseaudit=meta, machine={"node": "synthetic"})


def _e2e_document() -> dict[str, Any]:
    rows, gains = [], []
    for variant, tpot in (("eager", 9.0), ("fused", 7.5), ("compile", 7.0)):
        for batch in (1, 8):
            rows.append({"variant": variant, "batch": batch, "ttft_ms": tpot * 20, "tpot_ms": tpot * (1 + batch / 16),
                         "tpot_graph_ms": tpot * 0.8, "launches": {"count": 300 if variant == "eager" else 180},
                         "peak_decode_bytes": 3 << 30, "errors": {}})
            gains.append({"variant": variant, "batch": batch, "ttft_gain": 9.0 / tpot, "tpot_gain": 9.0 / tpot})
    return {"schema": "fuseaudit-e2e/1", "dtype": "bfloat16", "prompt_len": 512, "config": {"hidden": 2048},
            "timing": True, "timing_note": None, "notes": ["matmuls are torch"], "results": rows, "gains": gains,
            "agreement": {"verdict": "agree", "checks": [{"variant": "fused", "output": "decode_logits",
                                                          "passed": True, "comparison": {"max_ulp_err": 1.5,
                                                                                         "ratio_to_eager": 1.1}}]},
            "microbench": [{"batch": 1, "predicted_gain": 2.1, "measured_gain": 1.2, "eager_share_of_step": 0.25,
                            "amdahl_gain": 1.15}]}


def synthetic_results() -> dict[str, Any]:
    """A GPU-like results document: every section of the report has something to show."""
    rng = random.Random(0)
    env = {"device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8",
           "python": "3.11", "fuseaudit": "0.1.0", "cpu": {"model": "synthetic", "logical_cores": 16},
           "gpu": {"name": "NVIDIA H200", "capability": "9.0", "sm_count": 132, "memory_bytes": 150_000_000_000,
                   "driver": "570.00", "cuda_driver": "12.8", "nvml": {"power_limit_w": 700.0}}}
    doc = results.new_document("cuda", argv=["fuseaudit", "run"], options={}, environment=env)
    for op, spec in OPS.items():
        doc["audits"].append(_audit(op, spec.reference, "reference", rng, fail="numerics" if op == "softmax" else None))
    doc["audits"].append(_audit("swiglu", f"evil.mod:{HOSTILE}", "builtin", rng))
    doc["audits"].append({"op": "geglu", "target": f"builtin:{HOSTILE}", "kind": "builtin", "status": "error",
                          "exit_code": 2, "passed": None, "verdicts": {}, "message": HOSTILE_MSG, "elapsed_s": 0.1,
                          "result": None, "cases": [], "ulp_histograms": {}})
    doc["launches"] = {"status": "done", "rows": [
        {"op": op, "expected": 1, "reference": {"count": 1, "kernels": [f"{op}_kernel"]},
         "eager": {"count": 3, "kernels": ["a", "b", HOSTILE]}, "compile": {"count": 1, "kernels": ["triton_"]}}
        for op in OPS]}
    doc["bench"] = {"status": "done", "seconds": 170.2, "document": _bench_document()}
    doc["e2e"] = {"status": "done", "document": _e2e_document()}
    doc["finished"] = True
    doc["summary"] = {**results.summarize(doc), "elapsed_s": 540.0}
    return doc


# ---------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------

def _assert_self_contained(html: str) -> None:
    assert not re.search(r"<script\b", html, re.I), "the report has a script element"
    assert not re.search(r"<link\b", html, re.I), "the report links an external resource"
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I), "remote src/href"
    assert not re.search(r"url\(\s*['\"]?\s*(?:https?:)?//", html, re.I), "remote url() in CSS"
    assert "@import" not in html
    assert "<!DOCTYPE svg" not in html and "<?xml" not in html


@pytest.fixture(scope="module")
def synthetic_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return report.render([synthetic_results()], tmp_path_factory.mktemp("page") / "synthetic.html")


def test_report_is_self_contained_and_escapes_untrusted_text(synthetic_page: Path) -> None:
    html = synthetic_page.read_text(encoding="utf-8")
    _assert_self_contained(html)
    assert HOSTILE not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    for section in ("headline", "summary", "failures", "launches", "tolerance", "speed", "e2e", "environment"):
        assert f'id="{section}"' in html
    assert html.count("<svg") >= 5  # ULP histograms, scatter, time, throughput, roofline
    assert "NVIDIA H200" in html and "softmax" in html and "2.40×" in html


def _hf_e2e_document() -> dict[str, Any]:
    """A ``fuseaudit e2e --model hf-llama`` document: tokens/s, graph gains, spread, one profiled step."""
    rows, gains = [], []
    for variant, tpot in (("eager", 20.0), ("fused", 15.0)):
        rows.append({"variant": variant, "batch": 1, "ttft_ms": 12.0, "tpot_ms": tpot, "tokens_per_s": 1e3 / tpot,
                     "tpot": {"median_us": tpot * 1e3, "iqr_us": 1100.0}, "tpot_graph_ms": tpot / 8,
                     "peak_bytes": 2 << 30, "errors": {}})
        gains.append({"variant": variant, "batch": 1, "ttft_gain": 1.0, "tpot_gain": 20.0 / tpot,
                      "tpot_graph_gain": 1.25 if variant == "fused" else 1.0})
    profile = {"variant": "fused", "batch": 1, "trace": "e2e-hf-llama.trace-fused-b1.json", "host_step_us": 30138.0,
               "gpu_busy_us": 1609.0, "gpu_span_us": 27922.0, "kernels": 433,
               "rows": [{"category": "attention", "gpu_us": 107.4, "gpu_share": 0.07, "host_us": 2009.9,
                         "host_share": 0.07, "kernels": 16}]}
    return {"schema": "fuseaudit-e2e-hf/1", "model": "hf-llama", "model_class": "LlamaForCausalLM",
            "config": {"layers": 16, "hidden": 2048, "params": 1235814400, "hf": {"hidden_size": 2048}},
            "dtype": "bfloat16", "prompt_len": 512, "timing": True, "results": rows, "gains": gains,
            "profiles": [profile], "notes": [],
            "agreement": {"verdict": "agree", "checks": [], "greedy": [
                {"variant": "fused", "reference": "eager", "steps": 32, "identical": False,
                 "first_divergence": {"step": 1, "row": 3, "reference_token": 6125, "token": 118217,
                                      "reference_gap": 0.0156}}]}}


def test_a_transformers_decode_step_in_the_report(tmp_path: Path) -> None:
    """A transformers model's e2e document: named with its size, every figure it holds shown (tokens/s, the
    TPOT spread, graph gains, peak memory), the profiled step's breakdown, its trace linked only where the
    file lies beside the page, the greedy divergence."""
    doc = synthetic_results()
    doc["e2e"]["document"] = _hf_e2e_document()
    view = report_view.e2e([doc])
    assert view is not None and view["hf"]
    assert view["model"].startswith("transformers' LlamaForCausalLM (1.24B parameters, 16 layers")
    fused = next(r for r in view["results"] if r["variant"] == "fused")
    assert (fused["tokens"], fused["tpot_iqr"], fused["graph_gain"], fused["peak"]) == ("67", "1.1", "1.25×",
                                                                                        "2 GiB")
    assert view["shown"] == {"tokens": True, "graph_gain": True, "launches": False}
    (tmp_path / "e2e-hf-llama.trace-fused-b1.json").write_text("{}")
    html = report.render_html([doc], out=tmp_path / "report.html")
    section = html[html.index('id="e2e"'):html.index('id="environment"')]
    assert "LlamaForCausalLM" in section and "tokens/s" in section and "graph gain" in section
    assert "launches / step" not in section, "a column no row has data for is left out, not filled with dashes"
    assert 'href="e2e-hf-llama.trace-fused-b1.json"' in section and "30.1" in section and "0.107" in section
    elsewhere = report.render_html([doc], out=tmp_path / "elsewhere" / "report.html")
    assert "trace-fused-b1.json</a>" not in elsewhere and "is not kept beside this page" in elsewhere
    assert "first divergence at step 1, row 3" in section
    assert "hidden_size" not in section, "the transformers config itself stays in the data file"


def test_results_roundtrip_and_report_rerenders_from_stored_json(tmp_path: Path, capsys) -> None:
    stored = results.write(tmp_path / "results-cuda.json", synthetic_results())
    loaded = results.load(stored)
    assert loaded["schema"] == results.SCHEMA and loaded["summary"]["exit_code"] == 1  # softmax fails
    assert cli_main(["report", "--results", str(stored), "--out", str(tmp_path / "index.html")]) == 0
    assert (tmp_path / "index.html").stat().st_size > 10_000
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmarks": []}')
    assert cli_main(["report", "--results", str(bad), "--out", str(tmp_path / "x.html")]) == 2
    assert "not a fuseaudit results file" in capsys.readouterr().err
    assert cli_main(["report", "--results", str(tmp_path / "missing.json")]) == 2


def test_tolerance_used_is_error_over_bound() -> None:
    base = {"passed": True, "max_abs_err": 0.5, "worst_got": 1.5, "worst_oracle": 1.0, "worst_bound": 2.0}
    assert results.margin(base) == 0.25
    inf = float("inf")
    assert results.margin({**base, "worst_got": inf, "worst_oracle": inf}) == 0.0  # matching Inf
    assert results.margin({**base, "passed": False, "max_abs_err": inf}) == inf  # NaN/Inf parity failure
    assert results.margin({**base, "worst_bound": 0.0}) is None
    assert results.number("inf") == inf and results.number("x") is None and results.number(True) is None


def test_run_options_are_validated(capsys) -> None:
    assert cli_main(["run", "--device", "cpu", "--ops", "nope"]) == 2
    assert "unknown op" in capsys.readouterr().err
    assert cli_main(["run", "--device", "cpu", "--examples", "0"]) == 2
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    opts = runner._options(parser.parse_args([]), "cpu")
    assert set(opts["ops"]) == set(OPS) and not opts["bench"] and not opts["builtins"]
    assert opts["examples"]["attention"] < opts["examples"]["swiglu"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """A real, small ``fuseaudit run`` on the CPU: one good reference kernel, one that does not load."""
    out = tmp_path_factory.mktemp("run")
    broken = dataclasses.replace(OPS["bias_silu"], reference="fuseaudit.kernels.no_such_module:bias_silu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(OPS, "bias_silu", broken)
        code = cli_main(["run", "--device", "cpu", "--ops", "swiglu", "bias_silu", "--examples", "2",
                         "--out", str(out)])
    return code, out


def test_run_on_the_cpu_records_everything_and_survives_a_broken_kernel(cpu_run: tuple[int, Path]) -> None:
    code, out = cpu_run
    assert code == 1  # bias_silu's reference kernel does not load: a failure, not a crash
    doc = results.load(out / "results-cpu.json")
    assert doc["finished"] and doc["device"] == "cpu"
    by_op = {a["op"]: a for a in doc["audits"]}
    assert by_op["swiglu"]["status"] == "done" and by_op["swiglu"]["passed"], by_op["swiglu"]
    assert by_op["swiglu"]["cases"] and by_op["swiglu"]["ulp_histograms"]
    assert by_op["bias_silu"]["status"] == "error" and "no_such_module" in by_op["bias_silu"]["message"]
    assert doc["summary"]["failed"] == [{"op": "bias_silu", "target": by_op["bias_silu"]["target"],
                                         "message": by_op["bias_silu"]["message"]}]
    assert {r["op"] for r in doc["launches"]["rows"]} == {"swiglu", "bias_silu"}
    assert doc["bench"]["status"] == "skipped" and doc["environment"]["torch"]
    html = (out / "report-cpu.html").read_text(encoding="utf-8")
    _assert_self_contained(html)
    assert "no_such_module" in html


def test_resume_keeps_finished_audits_and_reruns_the_rest(cpu_run: tuple[int, Path]) -> None:
    _, out = cpu_run
    before = results.load(out / "results-cpu.json")
    kept = next(a for a in before["audits"] if a["op"] == "swiglu")
    shutil.copy(out / "results-cpu.json", out / "resumed.json")
    # the real bias_silu kernel this time: the audit that could not run is run again, and passes
    assert cli_main(["run", "--device", "cpu", "--ops", "swiglu", "bias_silu", "--examples", "2",
                     "--out", str(out), "--results", str(out / "resumed.json"), "--resume"]) == 0
    after = results.load(out / "resumed.json")
    assert next(a for a in after["audits"] if a["op"] == "swiglu") == kept
    assert next(a for a in after["audits"] if a["op"] == "bias_silu")["passed"]
    assert after["launches"] == before["launches"]


# ---------------------------------------------------------------------------
# A real browser
# ---------------------------------------------------------------------------

def _chromium(page: Path, shot: Path, profile: Path) -> subprocess.CompletedProcess[str]:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-default-apps", "--hide-scrollbars", f"--user-data-dir={profile}", "--enable-logging=stderr",
           "--v=0", f"--screenshot={shot}", "--window-size=1400,3000", page.resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _console(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_browser_check_sees_console_errors(tmp_path: Path) -> None:
    """The check below is not vacuous: a page that throws shows up in Chromium's log."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><p>x</p><script>undefined_fn();</script></body></html>")
    proc = _chromium(page, tmp_path / "bad.png", tmp_path / "profile")
    assert any("Uncaught ReferenceError" in line for line in _console(proc.stdout + proc.stderr))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_opens_in_headless_chromium_without_errors(tmp_path: Path, synthetic_page: Path,
                                                         cpu_run: tuple[int, Path]) -> None:
    pages = {"synthetic": synthetic_page, "cpu": cpu_run[1] / "report-cpu.html"}
    for name, page in pages.items():
        shot = tmp_path / f"{name}.png"
        proc = _chromium(page, shot, tmp_path / f"profile-{name}")
        log = proc.stdout + proc.stderr
        assert not _console(log), _console(log)  # the page has no script: any console line is a fault
        assert not re.search(r"net::ERR_|Failed to load resource", log), log[-2000:]
        assert shot.exists() and shot.stat().st_size > 50_000, (proc.returncode, log[-2000:])
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_PROBE = """<!DOCTYPE html><html><body><pre id="out">pending</pre>
<iframe id="r" src="%s" width="1400" height="900"></iframe>
<script>
document.getElementById("r").onload = () => {
  const d = document.getElementById("r").contentDocument;
  const answers = [...d.querySelectorAll(".answer")].map(a => ({
    label: a.querySelector(".q").textContent,
    parts: [...a.querySelectorAll("span:not(.q)")].map(s => [s.textContent, getComputedStyle(s).color])}));
  const cells = [...d.querySelectorAll("td")].map(td => ({
    section: td.closest("section") ? td.closest("section").id : "",
    text: td.innerText.trim(), titled: !!(td.title || td.querySelector("[title]"))}));
  document.getElementById("out").textContent = JSON.stringify({answers, cells});
};
</script></body></html>"""
GREEN, RED = "rgb(19, 115, 51)", "rgb(179, 38, 30)"  # --pass and --fail of the page's CSS


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_in_a_browser_the_headline_answers_in_order_and_no_cell_with_data_shows_a_dash(tmp_path: Path,
                                                                                       issue_page) -> None:
    """What Chromium renders: the three answers in order, their colours, every table cell's text.

    A probe page (the report itself has no script) frames the report and
    reads the rendered text and computed colours; Chromium prints its DOM.
    """
    _, page = issue_page
    probe = tmp_path / "probe.html"
    probe.write_text(_PROBE % page.resolve().as_uri())
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--allow-file-access-from-files",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom",
           probe.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.S)
    assert found and found.group(1) != "pending", proc.stderr[-2000:]
    seen = json.loads(html_unescape(found.group(1)))
    assert [a["label"] for a in seen["answers"]] == ["Right?", "Fused?", "Worth it?"]
    colour = {text: rgb for a in seen["answers"] for text, rgb in a["parts"]}
    assert colour["fused 0.75× at batch 1"] == RED and colour["compile 1.29× at batch 1"] == GREEN
    assert colour["2.40× vs eager"] == GREEN and colour["11 of 11 reference kernels launch the expected number of "
                                                           "kernels per call"] == GREEN
    targets = [rgb for text, rgb in colour.items() if "points moving" in text or "points timed" in text]
    assert len(targets) == 2 and RED not in targets, "a target is a goal, not a failure"
    headline = [c for c in seen["cells"] if c["section"] == "headline"]
    assert len(headline) == 9 * len(OPS) and not [c for c in headline if c["text"] in ("–", "-", "")]
    blank = [c for c in seen["cells"] if "–" in c["text"].split() and not c["titled"]]
    assert not blank, blank[:5]


def test_merged_cpu_and_gpu_results(tmp_path: Path, cpu_run: tuple[int, Path]) -> None:
    gpu = results.write(tmp_path / "results-cuda.json", synthetic_results())
    out = tmp_path / "index.html"
    assert cli_main(["report", "--results", str(cpu_run[1] / "results-cpu.json"), str(gpu), "--out", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    assert "cpu · " in html and "cuda · NVIDIA H200" in html
    assert json.loads((cpu_run[1] / "results-cpu.json").read_text())["schema"] == results.SCHEMA


def test_audits_spread_over_gpus_show_their_device() -> None:
    """A ``--gpus N`` run records each audit's GPU; the verdict table gets a device column then only."""
    one = synthetic_results()
    assert not report_view.build([one])["multi_device"]
    spread = synthetic_results()
    for i, a in enumerate(spread["audits"]):
        a["device"] = f"cuda:{i % 2}"
    view = report_view.build([spread])
    assert view["multi_device"]
    assert [r["device"] for r in view["summary"]] == [f"cuda:{i % 2}" for i in range(len(spread["audits"]))]


def test_targets_count_every_reference_point_and_list_the_misses_worst_first() -> None:
    mib = 2**20

    def rec(op: str, mb: float, pct: float | None, vs_compile: float | None, impl: str = "reference") -> dict:
        return {"op": op, "point": f"rows={int(mb)}", "dtype": "bfloat16", "impl": impl, "us": 10.0,
                "bytes_moved": mb * mib, "pct_copy": pct, "speedup_vs_compile": vs_compile}

    records = [rec("a", 300, 95.0, 1.1), rec("b", 300, 80.0, 0.9), rec("c", 10, 50.0, 1.2), rec("d", 500, 91.9, None),
               rec("e", 900, 10.0, 0.1, impl="eager"), rec("f", 256, 92.0, 1.0), rec("attention", 512, 4.0, None)]
    view = report_view.targets(records, report_view.Goals(copy_pct=92, compile_ratio=1.0))
    assert view is not None
    copy, compile_ = view["copy"], view["compile"]
    assert (copy["met"], copy["total"]) == (2, 4), "a, b, d, f move 256 MiB or more (attention: TFLOP/s); a, f meet 92%"
    assert [m["op"] for m in copy["misses"]] == ["b", "d"], "worst first"
    assert (compile_["met"], compile_["total"]) == (3, 4) and [m["op"] for m in compile_["misses"]] == ["b"]
    assert report_view.targets(records, None) is None and report_view.targets(records, report_view.Goals()) is None
    small = report_view.targets(records, report_view.Goals(copy_pct=92, copy_min_mib=0))
    assert small is not None and small["copy"]["total"] == 5 and "compile" not in small
    for bad in ({"copy_pct": 0}, {"copy_pct": -5}, {"compile_ratio": 0}, {"copy_min_mib": -1}):
        with pytest.raises(ValueError):
            report_view.Goals(**bad)


def test_report_targets_from_the_command_line(tmp_path: Path, capsys) -> None:
    stored = results.write(tmp_path / "results-cuda.json", synthetic_results())
    out = tmp_path / "index.html"
    assert cli_main(["report", "--results", str(stored), "--out", str(out),
                     "--target-copy", "92", "--target-compile", "1"]) == 0
    html = out.read_text(encoding="utf-8")
    assert "<h3>Targets</h3>" in html and "92% of copy</b>" in html and "1× torch.compile</b>" in html
    assert "target 92% of copy: " in html and "target 1× torch.compile: " in html  # in the headline's "Worth it?"
    assert cli_main(["report", "--results", str(stored), "--out", str(out)]) == 0
    assert "<h3>Targets</h3>" not in out.read_text(encoding="utf-8"), "no targets given: no section"
    assert cli_main(["report", "--results", str(stored), "--out", str(out), "--target-compile", "0"]) == 2
    assert "torch.compile target" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Every figure right, or absent with a reason
# ---------------------------------------------------------------------------

POINTWISE = ("bias_gelu", "bias_silu", "residual_bias_gelu", "swiglu", "geglu")
BIG = "rows=16384 N=8192"  # the synthetic sweep's largest point
DEMANGLED = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
             "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
             "{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&)::{lambda(int)#1}>(int, at::native::"
             "gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>)")
JOURNAL_WORD = "SENTINEL-JOURNAL-WORD"


def _nvml(seconds: float, watts: float, **extra: Any) -> dict[str, Any]:
    return {"available": True, "seconds": seconds, "energy_j": watts * seconds, "avg_watts": watts,
            "sm_clock_mhz": 1980, "mem_clock_mhz": 3201, "temperature_c": 50, "throttle_reasons": [], **extra}


def issue_results() -> dict[str, Any]:
    """The committed H200 file's traps, small: figures the report must derive, doubt or explain.

    Suite-style points without speed-ups or peak savings (the five pointwise
    ops), an attention point whose reference peaks above eager, no sweep-wide
    copy bandwidth, NVML windows of 15 ms (0 W, 3075 W) beside 1 s loops (one
    within the 700 W limit, one at 1283 W), a launch failure listing a
    demangled C++ name, passing cases of 1.61e7 and 2e4 ulps, a command that
    turned bench and e2e off although both sections hold data, a long journal
    as the bench step's note, and a fused decode step slower than eager.
    """
    doc = synthetic_results()
    doc["argv"] = ["/opt/venv/bin/fuseaudit", "run", "--device", "cuda", "--no-bench", "--no-e2e"]
    doc["options"] = {"bench": False, "e2e": False}
    doc["environment"]["git_commit"] = "abc1234"
    doc["bench"]["message"] = "A run's journal. " * 400 + JOURNAL_WORD
    doc["e2e"]["message"] = "from `fuseaudit e2e --layers 8 --cuda-graphs` on another H200"
    bench = doc["bench"]["document"]
    bench["fuseaudit"].pop("copy_gbps")
    for b in bench["benchmarks"]:
        info, impl = b["extra_info"], b["params"]["impl"]
        if info["op"] in POINTWISE:
            for key in ("speedup_vs_eager", "speedup_vs_compile", "peak_saved_vs_eager_bytes"):
                info.pop(key, None)
        if info["point"] != BIG:
            continue
        if info["op"] == "attention":
            info.pop("peak_saved_vs_eager_bytes", None)
            info["memory"] = ({"peak_extra_bytes": 1_662_976, "temporaries_bytes": 1_597_440} if impl == "reference"
                              else {"peak_extra_bytes": 599_552, "temporaries_bytes": 534_016})
        info["nvml"] = _nvml(0.015, 3075.0 if impl == "reference" else 0.0)
        if impl == "reference":
            info["energy_loop"] = _nvml(1.2, 600.0, calls=4000, energy_per_call_uj=180_000.0)
        elif impl == "compile":
            info["energy_loop"] = _nvml(1.1, 1283.0, calls=4000, energy_per_call_uj=352_825.0)
    for g in doc["e2e"]["document"]["gains"]:
        if g["variant"] == "fused" and g["batch"] == 1:
            g["tpot_gain"] = 0.75
    builtin = next(a for a in doc["audits"] if a["kind"] == "builtin" and a["status"] == "done")
    summary = f"one call launched 3 kernel(s), expected 1: {DEMANGLED}, {DEMANGLED}, fmha_cutlassF_f32_sm80"
    builtin["result"]["properties"]["launches"] = {"status": "FAIL", "summary": summary, "failures": [
        {"message": summary, "source": "launches", "case": builtin["cases"][0]["case"], "describe": "a case",
         "replay": "fuseaudit audit ...", "comparisons": []}]}
    builtin["verdicts"]["launches"], builtin["passed"], builtin["exit_code"] = "FAIL", False, 1
    for op, ulp, eager_ulp in (("rms_norm", 1.61e7, 1.5e7), ("layer_norm", 2.0e4, 5.0)):
        audit = next(a for a in doc["audits"] if a["op"] == op and a["kind"] == "reference")
        case = next(c for c in audit["cases"] if c["dtype"] == "float32")
        case["outputs"][0].update(max_ulp_err=ulp, eager_max_ulp_err=eager_ulp, margin=0.4, passed=True)
    return doc


class _Cells(HTMLParser):
    """Every table cell of a page: its section id, its text, and whether it or a child carries a title."""

    def __init__(self) -> None:
        super().__init__()
        self.section, self.cells, self._cell = "", [], None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section":
            self.section = a.get("id") or ""
        if tag == "td":
            self._cell = {"section": self.section, "text": "", "title": bool(a.get("title"))}
        elif self._cell is not None and a.get("title"):
            self._cell["title"] = True

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self._cell["text"] = " ".join(self._cell["text"].split())
            self.cells.append(self._cell)
            self._cell = None


def cells_of(html: str) -> list[dict[str, Any]]:
    parser = _Cells()
    parser.feed(html)
    return parser.cells


@pytest.fixture(scope="module")
def issue_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The view and the page of :func:`issue_results`, laid out as the committed example: gzipped results,
    a README of provenance and the report side by side."""
    folder = tmp_path_factory.mktemp("issue") / "reports"
    stored = results.write(folder / "results-h200.json.gz", issue_results())
    (folder / "README.md").write_text("notes\n")
    doc = results.load(stored)
    out = folder / "report-h200.html"
    goals = report_view.Goals(copy_pct=92, compile_ratio=1.0)
    view = report_view.build([doc], goals, sources=[stored], out=out)
    return view, report.render([doc], out, goals, sources=[stored])


def test_every_cell_with_data_shows_its_figure_and_every_dash_says_why(issue_page) -> None:
    view, page = issue_page
    for row in view["headline"]:  # suite-style points get their speed-ups from the times beside them
        assert "–" not in (row["vs_eager"]["text"], row["vs_compile"]["text"], row["roofline"]["text"],
                           row["memory"]["text"]), row["op"]
        assert row["roofline"]["title"].startswith("best of "), row["roofline"]  # and at which point
    assert {r["op"] for r in view["speed"]["memory"]} == set(OPS)
    for m in view["speed"]["memory"]:
        assert "–" not in (m["peak_ref"]["text"], m["peak_eager"]["text"], m["saved"]["text"]), m["op"]
    attention = next(m for m in view["speed"]["memory"] if m["op"] == "attention")
    assert attention["saved"]["text"] == "−1.01 MiB" and "temporaries of its own" in attention["saved"]["title"]
    assert view["speed"]["copy_bw"] == "4000 GB/s"  # from the records, the sweep-wide figure being absent
    html = page.read_text(encoding="utf-8")
    assert "(– GB/s)" not in html and "bandwidth, 4000 GB/s" in html
    cells = cells_of(html)
    assert len(cells) > 500
    blank = [c for c in cells if "–" in c["text"].split() and not c["title"]]
    assert not blank, blank[:5]


def test_nvml_power_and_energy_only_where_the_reading_is_trustworthy(issue_page) -> None:
    view, _ = issue_page
    rows = [r for r in view["speed"]["power"] if r["op"] == "rms_norm"]
    by = {r["impl"]: r for r in rows}
    assert by["reference"]["watts"] == "600" and by["reference"]["energy"] == "1.8e+05"  # a 1.2 s loop, 600 W
    assert by["compile"]["watts"] == "–" and "above the card's 700 W power limit" in by["compile"]["why"]
    assert by["eager"]["watts"] == "–" and "under 1 s" in by["eager"]["why"]  # a 15 ms window
    assert "did not advance" in by["eager"]["why"]
    assert not any(r["watts"] in ("3075", "1283", "0") for r in view["speed"]["power"])
    summary = view["speed"]["power_summary"]
    assert summary.startswith("power 600 W over 11 back-to-back loop(s)"), summary
    assert "3075" not in summary and "1283" not in summary and "readings not shown" in summary
    assert nvml.energy_doubts(seconds=1.2, energy_j=720.0, watts=600.0, power_limit_w=700.0) == []


def test_kernel_names_are_shortened_with_the_full_name_on_hover(issue_page) -> None:
    _, page = issue_page
    html = page.read_text(encoding="utf-8")
    short = report_text.short_kernel(DEMANGLED)
    assert short == "elementwise_kernel[gpu_kernel_impl_nocast]"
    assert f'<code class="kernel" title="{escape(DEMANGLED)}">{short}</code>' in html
    assert '<code class="kernel" title="fmha_cutlassF_f32_sm80">fmha_cutlassF_f32_sm80</code>' in html
    visible = re.sub(r'title="[^"]*"', "", html)
    assert "at::native::" not in visible, "a demangled name is shown outside a title"
    assert report_text.split_names("a<1, 2>(x, y), b") == ["a<1, 2>(x, y)", "b"]
    assert report_text.split_names("operator< a, b") is None  # unbalanced: kept whole, never cut in two


def test_headline_answers_right_fused_worth_it_in_order_with_one_colour_rule(issue_page) -> None:
    view, page = issue_page
    questions = view["questions"]
    assert [q["label"] for q in questions] == ["Right?", "Fused?", "Worth it?"]
    right, fused, worth = questions
    assert right["parts"][0]["cls"] == "bad" and "softmax" in right["parts"][0]["text"]  # softmax's audit fails
    assert fused["cls"] == "good"
    parts = {p["text"]: p["cls"] for p in worth["parts"] if p["text"]}
    assert parts["fused 0.75× at batch 1"] == "bad", "slower than eager is red"
    assert parts["compile 1.29× at batch 1"] == "good" and parts["2.40× vs eager"] == "good"
    targets = {text: cls for text, cls in parts.items() if "points moving" in text or "points timed" in text}
    assert len(targets) == 2 and "bad" not in targets.values(), "a target is a goal, not a failure"
    assert [report_view.speed_cls(x) for x in (0.75, 0.96, 1.0, 1.04, 1.3, None)] == ["bad", "", "", "", "good", ""]
    html = page.read_text(encoding="utf-8")
    assert html.index(">Right?<") < html.index(">Fused?<") < html.index(">Worth it?<") < html.index('id="headline"')
    assert '<span class="bad">fused 0.75× at batch 1</span>' in html


def test_provenance_names_the_command_of_each_section_in_a_few_lines(issue_page) -> None:
    view, page = issue_page
    pv = view["provenance"][0]
    lines = dict(pv["lines"])
    assert lines["commit"].startswith("abc1234") and "NVIDIA H200" in lines["device"] and "UTC" in lines["date"]
    assert pv["data"]["href"] == "results-h200.json.gz" and pv["notes"]["href"] == "README.md"
    sections = {s["section"]: s for s in pv["sections"]}
    assert sections["audits"]["command"] == "fuseaudit run --device cuda --no-bench --no-e2e"
    assert sections["bench"]["command"] is None and "--no-bench" in sections["bench"]["why"]
    assert sections["e2e"]["command"] == "fuseaudit e2e --layers 8 --cuda-graphs"
    assert sections["bench"]["note"]["cut"] and sections["bench"]["note"]["words"] > 1000
    html = page.read_text(encoding="utf-8")
    assert JOURNAL_WORD not in html and "A run&#39;s journal" not in html, "a long note is pointed to, not inlined"
    assert report_provenance.command_line(["/x/bin/fuseaudit", "audit", "a b"]) == "fuseaudit audit 'a b'"


def test_a_large_passing_ulp_count_says_why_beside_it(issue_page) -> None:
    view, page = issue_page
    rows = {t["op"]: t for t in view["tolerance"]["table"] if t["kind"] == "reference"}
    assert rows["rms_norm"]["dtypes"]["float32"]["ulp"] == "1.61e+07"
    assert rows["rms_norm"]["dtypes"]["float32"]["note"]["text"] == "eager as far off"
    assert rows["layer_norm"]["dtypes"]["float32"]["note"]["text"] == "near-zero elements"
    assert rows["swiglu"]["dtypes"]["float32"]["note"] is None  # a few ulps need no word
    html = page.read_text(encoding="utf-8")
    assert re.search(r"1\.61e\+07 <span class=\"muted\">\(1\.5e\+07\)</span> <span class=\"why\" title=\"eager", html)


def test_run_and_report_name_their_outputs_alike(tmp_path: Path, capsys) -> None:
    """A folder stands for its results files; the report beside them is named as `fuseaudit run` names it."""
    folder = tmp_path / "out"
    for device in ("cuda", "cpu"):  # empty runs: the names are the point, not the figures
        doc = results.new_document(device, argv=["fuseaudit", "run"], options={}, environment={})
        results.write(folder / report.results_name(device), doc)
        (folder / "results-cuda-archive.json.gz").write_bytes(b"")  # archives are not picked up
        assert cli_main(["report", "--results", str(folder)]) == 0
    assert (folder / "report-cpu-cuda.html").is_file() and report.report_name(["cuda"]) == "report-cuda.html"
    assert cli_main(["report", "--results", str(folder / "results-cuda.json")]) == 0
    assert (folder / "report-cuda.html").is_file()
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", "--results", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith("fuseaudit report: error: no results files")


def test_every_command_prefixes_its_errors_alike(capsys) -> None:
    from fuseaudit.cli import build_parser

    assert "fused GPU kernels" in build_parser().description and "``" not in build_parser().description
    assert "current directory" in build_parser().epilog
    with pytest.raises(SystemExit) as exit_:
        cli_main(["audit"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("fuseaudit audit: error: ")
    assert cli_main(["launches", "--ops", "nope"]) == 2
    assert capsys.readouterr().err.startswith("fuseaudit launches: error: unknown op(s) nope")
    assert cli_main(["run", "--device", "cpu", "--examples", "0"]) == 2
    assert capsys.readouterr().err.startswith("fuseaudit run: error: --examples must be")


def test_the_committed_example_report_re_renders_from_its_one_results_file() -> None:
    """README and reports/README.md give one command; every file it names is there, and the results load."""
    root = Path(__file__).resolve().parents[1]
    commands = {line.strip().strip("`") for doc in ("README.md", "reports/README.md")
                for line in (root / doc).read_text(encoding="utf-8").splitlines()
                if "fuseaudit report --results reports/" in line}
    commands = {re.search(r"fuseaudit report --results \S+ --out \S+[^`]*", c).group(0) for c in commands}
    assert len(commands) == 1, commands
    argv = commands.pop().split()
    source, out = root / argv[argv.index("--results") + 1], root / argv[argv.index("--out") + 1]
    assert out.is_file() and source.is_file() and source.stat().st_size < 5 << 20
    doc = results.load(source)
    assert doc["device"] == "cuda" and doc["audits"] and doc["bench"]["document"]["benchmarks"]
    html = out.read_text(encoding="utf-8")
    assert f'href="{source.name}"' in html and 'href="README.md"' in html
