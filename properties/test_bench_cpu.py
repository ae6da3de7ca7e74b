"""The speed-and-memory harness where there is no GPU: what must hold without one.

Timing itself needs a GPU; here we check that it refuses clearly without one,
that NVML degrades instead of crashing, that the byte and FLOP models and the
figures derived from them are right, that the sweep and its inputs are what
they say, that our JSON is pytest-benchmark JSON its own tools load, and
that ``fuseaudit compare`` exits 0 / 1 / 2 as documented.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuseaudit import benchjson, nvml
from fuseaudit.bench import format_table, parse_targets, plan
from fuseaudit.case import materialize
from fuseaudit.catalog import OPS
from fuseaudit.cli import main as cli_main
from fuseaudit.compare import compare
from fuseaudit.measure import figures
from fuseaudit.sweep import bench_inputs, default_points
from fuseaudit.timing import (
    CudaEventClock,
    TimingUnavailable,
    measure_copy_bandwidth,
    require_cuda,
    summarize,
    time_events,
    time_graph,
    time_host,
)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Synthetic pytest-benchmark documents
# ---------------------------------------------------------------------------

def _entry(impl: str, median_us: float, *, spread: float = 0.0, n: int = 21, label: str = "rows=8 N=64") -> dict:
    """A benchmark whose samples have the given median and a relative IQR of about ``spread``."""
    half = median_us * spread  # samples evenly over median +- half: the IQR is half, spread x median
    samples = [(median_us + half * (2 * i / (n - 1) - 1)) * 1e-6 for i in range(n)]
    return benchjson.benchmark_entry(op="rms_norm", impl=impl, point_label=label, dtype="bfloat16",
                                     params={"op": "rms_norm", "dtype": "bfloat16", "lead": [8], "N": 64},
                                     samples_s=samples, extra_info={"gbps": 1.0, "nan": float("nan")})


def _write(path: Path, entries: list[dict]) -> Path:
    return benchjson.write(path, benchjson.document(entries, machine={"node": "test"}, fuseaudit={"skipped": []}))


def test_merge_joins_shards_and_keeps_the_device(tmp_path: Path, capsys) -> None:
    from fuseaudit.cli import main as cli_main

    parts = []
    for k, impls in enumerate((("reference", "eager"), ("compile",))):
        doc = benchjson.document([_entry(i, 10.0 + k) for i in impls],
                                 machine={"node": "test", "gpu": {"name": f"GPU{k}", "nvml": {"index": k}}})
        parts.append(benchjson.write(tmp_path / f"part-{k}.json", doc))
    out = tmp_path / "all.json"
    assert cli_main(["merge", *map(str, parts), "--out", str(out)]) == 0
    merged = benchjson.load(out)
    assert [b["params"]["impl"] for b in merged["benchmarks"]] == ["reference", "eager", "compile"]
    assert [b["extra_info"]["merged_from"]["nvml_index"] for b in merged["benchmarks"]] == [0, 0, 1]
    assert [p["file"] for p in merged["machine_info"]["parts"]] == ["part-0.json", "part-1.json"]
    changes = compare(merged, merged)  # still pytest-benchmark JSON our tools read
    assert len(changes) == 3 and not any(c.verdict == "SLOWER" for c in changes)
    capsys.readouterr()
    assert cli_main(["merge", str(parts[0]), str(parts[0]), "--out", str(out)]) == 2  # a benchmark twice
    err = capsys.readouterr().err
    assert "is in both" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------
# Timing refuses clearly without a GPU
# ---------------------------------------------------------------------------

def test_timing_on_cpu_raises_a_clear_error():
    with pytest.raises(TimingUnavailable, match="CUDA device"):
        require_cuda("cpu")
    with pytest.raises(TimingUnavailable, match="CUDA device"):
        time_events(lambda: None, device="cpu")
    with pytest.raises(TimingUnavailable, match="CUDA device"):
        time_graph(lambda: None, device="cpu")
    with pytest.raises(TimingUnavailable, match="CUDA device"):
        time_host(lambda: None, device="cpu")
    with pytest.raises(TimingUnavailable, match="CUDA device"):
        measure_copy_bandwidth("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_timing_without_any_gpu_raises():
    with pytest.raises(TimingUnavailable, match="none is available"):
        require_cuda()
    with pytest.raises(TimingUnavailable):
        CudaEventClock()()


def test_timing_arguments_are_validated():
    with pytest.raises(ValueError):
        summarize([], mode="events")
    with pytest.raises((ValueError, TimingUnavailable)):
        time_events(lambda: None, repeats=-1)


def test_interleaved_rounds_rotate_the_order_and_pool_the_samples(monkeypatch):
    """Each round times every contender, starting one later each round; a failing contender drops out alone."""
    from fuseaudit import timing

    calls: list[tuple[str, int, float, object]] = []

    def stand_in(fn, *, warmup, target_seconds, min_repeats, max_repeats, around, device):
        name = fn()
        calls.append((name, warmup, target_seconds, around))
        return summarize([float(len(calls))] * min_repeats, mode="events")

    def broken():
        if sum(1 for c in calls if c[0] == "b") >= 1:
            raise RuntimeError("second round fails")
        return "b"

    monkeypatch.setattr(timing, "time_events", stand_in)
    probes = [object(), object(), object()]
    out = timing.time_events_rounds([lambda: "a", broken, lambda: "c"], rounds=3, warmup=5, target_seconds=0.3,
                                    min_repeats=6, arounds=probes)
    assert [c[0] for c in calls] == ["a", "b", "c", "c", "a", "c", "a"], "rotated order; b gone after it raised"
    assert [c[1] for c in calls] == [5, 5, 5, 1, 1, 1, 1], "full warmup in the first round only"
    assert all(c[2] == pytest.approx(0.1) for c in calls), "the target time is shared between the rounds"
    assert [c[3] for c in calls[:3]] == probes and all(c[3] is None for c in calls[3:]), "probes: first round"
    a, b, c = out
    assert isinstance(b, RuntimeError) and "second round" in str(b)
    assert a.repeats == c.repeats == 3 * 2, "min_repeats split over the rounds, samples pooled"
    assert sorted(set(a.samples_us)) == [1.0, 5.0, 7.0] and sorted(set(c.samples_us)) == [3.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="rounds"):
        timing.time_events_rounds([lambda: None], rounds=0)
    with pytest.raises(ValueError, match="arounds"):
        timing.time_events_rounds([lambda: None], arounds=[])


def test_summarize_median_and_quartiles():
    t = summarize([5.0, 1.0, 2.0, 3.0, 4.0], mode="events")
    assert (t.median_us, t.min_us, t.max_us, t.repeats) == (3.0, 1.0, 5.0, 5)
    assert t.q1_us == 2.0 and t.q3_us == 4.0 and t.iqr_us == 2.0
    assert t.to_dict()["spread"] == pytest.approx(2 / 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_benchmarks_skip_with_a_reason_without_a_gpu():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/test_bench_ops.py", "-q", "-rs", "-k", "rms_norm and reference",
         "-p", "no:randomly"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped" in out.stdout and "benchmarks need a CUDA device" in out.stdout, out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_command_without_a_gpu_exits_2(capsys):
    assert cli_main(["bench", "--quick", "--ops", "softmax"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA device" in err


# ---------------------------------------------------------------------------
# NVML degrades, never crashes
# ---------------------------------------------------------------------------

@pytest.fixture
def no_nvml(monkeypatch):
    monkeypatch.setitem(nvml._STATE, "module", None)
    monkeypatch.setitem(nvml._STATE, "error", "NVML could not be initialised: test")


def test_nvml_unavailable_is_recorded_not_raised(no_nvml):
    assert nvml.status() == {"available": False, "reason": "NVML could not be initialised: test"}
    info = nvml.device_info(0)
    assert info["available"] is False and "test" in info["reason"]
    ran = []
    with nvml.sample(0) as s:
        ran.append(True)
    assert ran and s == {"available": False, "reason": "NVML could not be initialised: test"}


def test_nvml_on_this_machine_never_raises():
    with nvml.sample(0) as s:
        pass
    assert isinstance(s["available"], bool)
    if not s["available"]:
        assert s["reason"]
    assert isinstance(nvml.device_info(0)["available"], bool)


def test_nvml_failing_queries_become_reasons(monkeypatch):
    class FakeNvml:
        NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

        def __init__(self):
            self.energy = 1000

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetTotalEnergyConsumption(self, h):
            self.energy += 2500  # 2.5 J per read
            return self.energy

        def nvmlDeviceGetPowerUsage(self, h):
            return 350_000

        def nvmlDeviceGetClockInfo(self, h, kind):
            return 1980 if kind == 1 else 2619

        def nvmlDeviceGetTemperature(self, h, kind):
            raise RuntimeError("not supported")

        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            return 0x4 | 0x40

        def nvmlDeviceGetMemoryInfo(self, h):
            raise RuntimeError("no memory info")

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return []

    monkeypatch.setitem(nvml._STATE, "module", FakeNvml())
    with nvml.sample(0) as s:
        pass
    assert s["available"] is True and s["energy_j"] == pytest.approx(2.5)
    assert s["power_w"] == pytest.approx(350.0) and s["sm_clock_mhz"] == 1980
    assert s["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert s["temperature_c"] is None and "not supported" in s["temperature_c_reason"]
    assert s["memory_used_bytes"] is None and s["process_memory_bytes"] is None
    assert "window" in s["energy_suspect"]  # a block of microseconds: the counter cannot resolve it


def test_energy_readings_are_doubted_when_short_backwards_or_above_the_power_limit():
    def doubts(seconds=2.0, energy_j=1300.0, limit=700.0):
        return " ".join(nvml.energy_doubts(seconds=seconds, energy_j=energy_j, watts=energy_j / seconds,
                                           power_limit_w=limit))

    assert doubts() == ""
    assert "window of 0.200 s" in doubts(seconds=0.2, energy_j=130.0)
    assert "above the card's 700 W power limit" in doubts(energy_j=2566.0)
    assert "backwards" in doubts(energy_j=-5.0) and "did not advance" in doubts(energy_j=0.0)
    assert "no power limit" in doubts(limit=None)


def test_throttle_reasons_decoded():
    assert nvml.decode_throttle_reasons(0) == []
    assert nvml.decode_throttle_reasons(0x1 | 0x8) == ["gpu_idle", "hw_slowdown"]
    assert nvml.decode_throttle_reasons(0x10000) == ["0x10000"]
    with pytest.raises(ValueError):
        nvml.decode_throttle_reasons(-1)


# ---------------------------------------------------------------------------
# Models and derived figures
# ---------------------------------------------------------------------------

def test_bytes_and_flops_models():
    rms = OPS["rms_norm"]
    shapes = {"x": (1024, 4096), "weight": (4096,)}
    assert rms.bytes_moved(shapes, torch.bfloat16) == 2 * (1024 * 4096 + 4096 + 1024 * 4096)
    assert rms.intermediate_bytes(shapes, torch.bfloat16) == 0
    add = OPS["add_rms_norm"]  # reads x, residual, weight; writes y and h
    shapes = {"x": (8, 64), "residual": (8, 64), "weight": (64,)}
    assert add.bytes_moved(shapes, torch.float32) == 4 * (2 * 512 + 64 + 2 * 512)
    attn = OPS["attention"]
    shapes = {"q": (2, 4, 16, 8), "k": (2, 4, 16, 8), "v": (2, 4, 16, 8)}
    assert attn.flops(shapes, {"causal": False}) == 4 * 2 * 4 * 16 * 16 * 8
    assert attn.flops(shapes, {"causal": True}) == 4 * 2 * 4 * (16 * 17 // 2) * 8
    # softmax's eager writes x * scale and reads it back: one full-size temporary
    assert OPS["softmax"].intermediate_bytes({"x": (4, 8)}, torch.float16) == 2 * 2 * 32


def test_figures_from_a_median():
    point = next(p for p in default_points(OPS["rms_norm"], rows=[1024], hidden=[4096], dtypes=["bfloat16"]))
    f = figures(OPS["rms_norm"], point, median_us=10.0, copy_gbps=4000.0, role="fused")
    assert f["bytes_moved"] == 2 * (2 * 1024 * 4096 + 4096)
    assert f["gbps"] == pytest.approx(f["bytes_moved"] / 10e-6 / 1e9)
    assert f["pct_copy"] == pytest.approx(100 * f["gbps"] / 4000.0)
    assert "intermediate_bytes_avoided" in f
    attn = next(p for p in default_points(OPS["attention"], quick=True) if p.kind == "prefill")
    f = figures(OPS["attention"], attn, median_us=1000.0, copy_gbps=None, role="eager")
    assert f["tflops"] == pytest.approx(f["flops"] / 1e-3 / 1e12) and f["pct_copy"] is None
    assert f["intermediate_bytes"] > 0


# ---------------------------------------------------------------------------
# Sweeps and inputs
# ---------------------------------------------------------------------------

def test_default_sweeps():
    rows = default_points(OPS["rms_norm"])
    bf16 = [p for p in rows if p.dtype == "bfloat16"]
    assert len(bf16) == 50 and {p.dtype for p in rows} == {"bfloat16", "float16", "float32"}
    assert len(default_points(OPS["rms_norm"], dtypes=["float32"])) == 9
    attn = default_points(OPS["attention"])
    decode = [p for p in attn if p.kind == "decode"]
    assert decode and all(p.case.dims["Sq"] == 1 and p.case.dims["Hkv"] == 8 and not p.params["causal"]
                          for p in decode)
    assert max(p.case.dims["Sk"] for p in decode) == 32768
    s4k = [p for p in attn if p.kind == "prefill" and p.case.dims["Sq"] == 4096]
    assert all(p.case.dims["B"] == 4 and p.case.dims["H"] == 32 for p in s4k)
    assert {p.params["causal"] for p in s4k} == {False, True}
    assert len(default_points(OPS["softmax"], quick=True)) < 10
    with pytest.raises(ValueError):
        default_points(OPS["softmax"], dtypes=["float8"])


def test_bench_inputs_small_equals_materialize_and_large_is_tiled():
    small = next(iter(default_points(OPS["add_rms_norm"], rows=[8], hidden=[64], dtypes=["float32"])))
    got, want = bench_inputs(small.case, "cpu"), materialize(small.case, "cpu")
    assert all(torch.equal(got[k], want[k]) for k in want)
    big = next(iter(default_points(OPS["add_rms_norm"], rows=[300], hidden=[64], dtypes=["bfloat16"])))
    tiled = bench_inputs(big.case, "cpu", limit=1000)
    assert tiled["x"].shape == (300, 64) and tiled["x"].is_contiguous() and tiled["weight"].shape == (64,)
    assert torch.equal(tiled["x"], bench_inputs(big.case, "cpu", limit=1000)["x"])  # deterministic
    attn = next(p for p in default_points(OPS["attention"], quick=True) if p.kind == "decode")
    q = bench_inputs(attn.case, "cpu", limit=4096)
    assert q["k"].shape == attn.shapes()["k"] and q["q"].shape == attn.shapes()["q"]


def test_plan_and_targets():
    p = plan(ops=["rms_norm"], quick=True, targets=["liger=some.module:rms_norm"])
    assert p.targets == {"rms_norm": {"liger": "some.module:rms_norm"}}
    assert parse_targets(["softmax:mine=file.py:softmax"], ["rms_norm", "softmax"]) == {
        "softmax": {"mine": "file.py:softmax"}}
    for bad in (["x=y"], ["rms_norm:eager=a:b"], ["nosuchop:x=a:b"]):
        with pytest.raises(ValueError):
            parse_targets(bad, ["rms_norm"])
    with pytest.raises(ValueError, match="which op"):
        parse_targets(["x=a:b"], ["rms_norm", "softmax"])


def test_bench_dry_run_and_bad_options(capsys):
    assert cli_main(["bench", "--dry-run", "--quick", "--ops", "attention"]) == 0
    out = capsys.readouterr().out
    assert "sdpa_flash" in out and "decode" in out
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--ops", "nosuchop"])
    assert exc.value.code == 2


# ---------------------------------------------------------------------------
# JSON: pytest-benchmark's format, loaded by its own tools
# ---------------------------------------------------------------------------

def test_json_writer_is_pytest_benchmark_json(tmp_path):
    entries = [_entry("reference", 10.0), _entry("eager", 25.0), _entry("compile", 12.0)]
    doc = benchjson.document(entries, fuseaudit={"copy_gbps": 4000.0})  # real machine_info, gpu section included
    assert {"machine_info", "commit_info", "benchmarks", "datetime", "version"} <= set(doc)
    assert "gpu" in doc["machine_info"] and "torch" in doc["machine_info"]["gpu"]
    stats = doc["benchmarks"][0]["stats"]
    assert stats["median"] == pytest.approx(10e-6) and stats["rounds"] == 21 and stats["iterations"] == 1
    assert doc["benchmarks"][0]["extra_info"]["nan"] is None  # strict JSON: no NaN
    base = benchjson.write(tmp_path / "0001_base.json", doc)
    json.loads(base.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))

    from pytest_benchmark.logger import Logger
    from pytest_benchmark.storage.file import FileStorage

    storage = FileStorage(tmp_path, logger=Logger(Logger.QUIET))
    loaded = list(storage.load_benchmarks(str(base)))
    assert [b["name"] for b in loaded] == [e["name"] for e in entries]
    assert all(b["median"] > 0 and b["ops"] > 0 for b in loaded)

    new = _write(tmp_path / "0002_new.json", [_entry("reference", 11.0), _entry("eager", 25.0)])
    script = Path(sys.executable).with_name("pytest-benchmark")
    cli = [str(script)] if script.exists() else [shutil.which("pytest-benchmark") or "pytest-benchmark"]
    out = subprocess.run([*cli, "compare", str(base), str(new), "--columns", "min,median,iqr"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rms_norm[reference-bfloat16-rows=8 N=64]" in out.stdout, out.stdout
    assert "Failed to load" not in out.stdout + out.stderr


def test_format_table():
    entries = [_entry("reference", 10.0), _entry("eager", 25.0), _entry("compile", 12.0)]
    for e in entries:
        e["extra_info"].update(op="rms_norm", point="rows=8 N=64", dtype="bfloat16", gbps=100.0, pct_copy=2.5)
    lines = format_table(entries).splitlines()
    assert len(lines) == 3 and "fused µs" in lines[0]
    assert "2.50" in lines[2] and "1.20" in lines[2]  # x eager, x compile


# ---------------------------------------------------------------------------
# fuseaudit compare: 0 same, 1 slower beyond max(threshold, spread), 2 unreadable
# ---------------------------------------------------------------------------

def _compare(tmp_path: Path, base: list[dict], new: list[dict], *extra: str) -> int:
    a, b = _write(tmp_path / "base.json", base), _write(tmp_path / "new.json", new)
    return cli_main(["compare", str(a), str(b), *extra])


def test_compare_exit_codes(tmp_path, capsys):
    assert _compare(tmp_path, [_entry("reference", 10.0)], [_entry("reference", 10.2)]) == 0
    assert _compare(tmp_path, [_entry("reference", 10.0)], [_entry("reference", 12.0)]) == 1
    assert "SLOWER" in capsys.readouterr().out
    assert _compare(tmp_path, [_entry("reference", 10.0)], [_entry("reference", 12.0)], "--threshold", "25") == 0
    assert _compare(tmp_path, [_entry("reference", 10.0)], [_entry("reference", 5.0)]) == 0  # faster
    # benchmarks in one run only are listed, never a failure
    assert _compare(tmp_path, [_entry("reference", 10.0)], [_entry("eager", 99.0)]) == 0


def test_compare_tolerates_the_measured_spread(tmp_path):
    noisy = dict(spread=0.1)  # IQR 10 % of the median in each run: 20 % together
    assert _compare(tmp_path, [_entry("reference", 10.0, **noisy)], [_entry("reference", 11.5, **noisy)]) == 0
    assert _compare(tmp_path, [_entry("reference", 10.0, **noisy)], [_entry("reference", 13.0, **noisy)]) == 1
    changes = compare(json.loads((tmp_path / "base.json").read_text()), json.loads((tmp_path / "new.json").read_text()),
                      threshold=0.05)
    assert changes[0].allowed == pytest.approx(changes[0].spread) and changes[0].spread > 0.15


def test_compare_unreadable_input_exits_2(tmp_path, capsys):
    good = _write(tmp_path / "good.json", [_entry("reference", 10.0)])
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    for bad in ("bad.json", "other.json", "missing.json"):
        capsys.readouterr()
        assert cli_main(["compare", str(good), str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and bad in err, err
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(good), str(good), "--threshold", "-3"])
    assert exc.value.code == 2


def test_gzipped_json_reads_and_compares_as_the_plain_file(tmp_path, capsys):
    """``NAME.json.gz`` (as the committed example results are stored) is the same document, byte for byte."""
    import gzip

    plain = _write(tmp_path / "base.json", [_entry("reference", 10.0)])
    packed = benchjson.write(tmp_path / "base.json.gz", benchjson.load(plain))
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert benchjson.load(packed) == benchjson.load(plain)
    slower = _write(tmp_path / "new.json.gz", [_entry("reference", 12.0)])
    assert cli_main(["compare", str(packed), str(plain)]) == 0
    assert cli_main(["compare", str(packed), str(slower)]) == 1
    (tmp_path / "torn.json.gz").write_bytes(packed.read_bytes()[:-9])  # cut short, as by a killed copy
    capsys.readouterr()
    assert cli_main(["compare", str(packed), str(tmp_path / "torn.json.gz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torn.json.gz" in err, err


def test_compare_reads_pytest_benchmark_own_output(tmp_path):
    """A file written by ``pytest --benchmark-json`` (no fuseaudit fields) compares too."""
    entry = _entry("reference", 10.0)
    entry.pop("params")
    entry["fullname"] = "benchmarks/test_x.py::test_y"
    doc = {"machine_info": {}, "commit_info": {}, "benchmarks": [entry], "datetime": "x", "version": "5.0"}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    assert cli_main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert not math.isnan(entry["stats"]["median"])


# ---------------------------------------------------------------------------
# The whole bench pipeline on the CPU, with a host clock standing in for the GPU timer
# ---------------------------------------------------------------------------

def test_bench_pipeline_with_a_stand_in_timer(tmp_path, monkeypatch, capsys, fuseaudit_device):
    """Plan, inputs, contenders (reference under the interpreter, eager, a --target), entries, ratios,
    skipped contenders, the JSON and the table: everything but the GPU timer itself."""
    if fuseaudit_device != "cpu":
        pytest.skip("runs the reference kernels under the interpreter in this process: a CPU session's job")
    import time

    from fuseaudit import measure, timing
    from fuseaudit.measure import Measurement

    def host_clock_events(fn, *, warmup=3, target_seconds=0.05, min_repeats=10, max_repeats=200, around=None,
                          device=None, **_):
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            samples.append(1e6 * (time.perf_counter() - t0))
        return summarize(samples, mode="events")

    def fake_measure(built, spec, point, inputs, *, timed, device, copy_gbps, options=None):
        t = timed.timing  # bench times every contender first, in rounds
        extra = {"op": spec.name, "impl": built.contender.name, "point": point.label, "dtype": point.dtype,
                 "memory": {"peak_extra_bytes": 100 if built.contender.role == "eager" else 40},
                 **figures(spec, point, median_us=t.median_us, copy_gbps=copy_gbps, role=built.contender.role)}
        return Measurement(contender=built.contender.name, role=built.contender.role, timing=t, extra=extra)

    monkeypatch.setattr(timing, "require_cuda", lambda device=None: torch.device("cpu"))
    monkeypatch.setattr(measure, "require_cuda", lambda device=None: torch.device("cpu"))
    monkeypatch.setattr(nvml, "nvml_index", lambda index=None: 0)  # no CUDA device to ask
    monkeypatch.setattr(timing, "measure_copy_bandwidth", lambda device=None: 1000.0)
    monkeypatch.setattr(measure, "measure", fake_measure)
    monkeypatch.setattr(timing, "time_events", host_clock_events)  # time_events_rounds itself runs for real
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "--ops", "rms_norm,softmax", "--rows", "4", "--hidden", "64", "--dtypes", "float32",
                   "--contenders", "reference,eager,targets", "--target", "rms_norm:mine=fuseaudit.catalog:_rms_norm",
                   "--target", "softmax:broken=fuseaudit.catalog:no_such_function", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    doc = benchjson.load(out)
    impls = sorted((b["extra_info"]["op"], b["params"]["impl"]) for b in doc["benchmarks"])
    assert impls == [("rms_norm", "eager"), ("rms_norm", "mine"), ("rms_norm", "reference"),
                     ("softmax", "eager"), ("softmax", "reference")]
    ref = next(b for b in doc["benchmarks"] if b["params"]["impl"] == "reference" and b["params"]["op"] == "rms_norm")
    assert ref["extra_info"]["speedup_vs_eager"] > 0 and ref["extra_info"]["peak_saved_vs_eager_bytes"] == 60
    assert ref["stats"]["rounds"] == 3 * 5 and ref["group"] == "rms_norm rows=4 N=64 float32", \
        "three interleaved rounds of five stand-in samples each, pooled"
    assert ref["options"]["rounds"] == 3
    skipped = doc["fuseaudit"]["skipped"]
    assert [(s["op"], s["impl"]) for s in skipped] == [("softmax", "broken")] and "no_such_function" in skipped[0][
        "reason"]
    assert "fused µs" in captured.out and "skipped softmax" in captured.err
