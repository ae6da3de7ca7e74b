"""``fuseaudit e2e --model hf-*`` on tiny transformers configs: the swap, agreement, fallbacks, the profile table.

Tiny Llama and GPT-2 (2 layers, hidden 64) with random weights, built by
transformers (the ``e2e`` extra; the module skips without it).  On the CPU
every swapped op runs under Triton's interpreter, so prompts are 8 tokens
and the greedy loops 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fuseaudit import e2e_hf
from fuseaudit.catalog import OPS
from fuseaudit.cli import main as cli_main

PROMPT, BATCH, GEN = 8, 2, 4
PLANTED_GQA = f"{Path(__file__).parent / 'planted' / 'attention_gqa.py'}:attention"


def _model(name: str, device: str):
    arch = e2e_hf.ARCHS[name]
    config = e2e_hf.hf_config(arch, "tiny")
    return arch, e2e_hf.build_model(arch, config, dtype=torch.bfloat16, device=device, seed=0)


@pytest.fixture(scope="module")
def llama(fuseaudit_device):
    return _model("hf-llama", fuseaudit_device)


@pytest.fixture(scope="module")
def gpt2(fuseaudit_device):
    return _model("hf-gpt2", fuseaudit_device)


def _reference(arch, model):
    return {op: OPS[op].load_reference() for op in e2e_hf.model_ops(arch, model.config)}


def _failures(result):
    agr = result["agreement"]
    return [f"{c['variant']} {c['output']}: {c.get('error') or c['comparison']['reason']}"
            for c in agr["checks"] if not c["passed"]] + [f"swap {v}: {s}" for v, s in result["swap"].items()
                                                           if not s["passed"]]


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_reference_kernels_agree_and_replace_every_module(name, llama, gpt2):
    """Agreement under the policy, and one call into our implementation per replaced module, no fallback."""
    arch, model = llama if name == "hf-llama" else gpt2
    layers = model.config.num_hidden_layers
    result = e2e_hf.check_agreement(model, arch, {"eager": {}, "fused": _reference(arch, model)}, batch=BATCH,
                                    prompt_len=PROMPT, gen_tokens=GEN, seed=0)
    assert result["agreement"]["verdict"] == "agree", _failures(result)
    assert result["agreement"]["kv_cache"]["passed"]
    swap = result["swap"]["fused"]
    norm, act, _ = e2e_hf.model_ops(arch, model.config)
    expected = {norm: 2 * layers + 1, act: layers, "attention": layers}
    assert swap["replaced"] == expected
    assert swap["calls_per_forward"] == expected  # nothing fell back to HF's modules in a forward
    assert swap["fallbacks"] == {} and swap["passed"]
    assert {c["output"] for c in result["agreement"]["checks"]} == set(e2e_hf.OUTPUTS)
    assert [g["reference"] for g in result["agreement"]["greedy"]] == ["oracle", "eager"]
    # restored on exit: HF's own modules and attention again
    assert model.config._attn_implementation == "sdpa"
    assert not any(isinstance(m, (e2e_hf.CatalogRMSNorm, e2e_hf.CatalogLayerNorm)) for m in model.modules())


def test_padding_mask_falls_back_and_is_counted(llama):
    """A padding mask is not expressible by the catalog's attention: HF's SDPA runs it, and it is counted."""
    arch, model = llama
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), device=model.device)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    with torch.no_grad(), e2e_hf.swapped(model, arch, _reference(arch, model)) as state:
        model(input_ids=tokens, attention_mask=mask)
        assert state.fallbacks["attention"] == model.config.num_hidden_layers
        assert "mask" in state.fallback_reasons["attention"]
        assert state.calls["attention"] == 0


def test_a_fallback_fails_the_agreement(llama, monkeypatch):
    """The static cache's mask judged not causal: its decode step falls back, and the verdict says so."""
    arch, model = llama
    monkeypatch.setattr(e2e_hf, "_mask_is_causal_prefix", lambda *a: False)
    result = e2e_hf.check_agreement(model, arch, {"eager": {}, "fused": _reference(arch, model)}, batch=BATCH,
                                    prompt_len=PROMPT, gen_tokens=1, seed=0)
    assert result["agreement"]["verdict"] == "disagree"
    swap = result["swap"]["fused"]
    assert not swap["passed"] and swap["fallbacks"]["attention"] >= model.config.num_hidden_layers


def test_unknown_module_is_refused(llama):
    """A norm module of a kind we do not know is named in a SwapError, and nothing is changed."""
    arch, model = llama

    class OddRMSNorm(torch.nn.Module):  # no eps attribute
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

    layer = model.model.layers[0]
    real = layer.input_layernorm
    layer.input_layernorm = OddRMSNorm(real.weight)
    try:
        with pytest.raises(e2e_hf.SwapError, match=r"layers\.0\.input_layernorm"):
            with e2e_hf.swapped(model, arch, _reference(arch, model)):
                pass
        assert model.config._attn_implementation == "sdpa"
        assert type(model.model.layers[1].input_layernorm).__name__ == "LlamaRMSNorm"
    finally:
        layer.input_layernorm = real


def test_cli_json_and_trace(tmp_path, fuseaudit_device):
    """``fuseaudit e2e --model hf-llama``: exit 0, the documented JSON, a trace beside it per variant."""
    path = tmp_path / "e2e-hf.json"
    device = "cuda" if fuseaudit_device.startswith("cuda") else "cpu"
    argv = ["e2e", "--model", "hf-llama", "--device", device, "--config", "tiny", "--variants", "fused",
            "--batches", str(BATCH), "--prompt-len", str(PROMPT), "--gen-tokens", str(GEN), "--repeats", "2",
            "--warmup", "1", "--cuda-graphs", "--json", str(path)]
    assert cli_main(argv) == 0
    data = json.loads(path.read_text())
    assert data["schema"] == e2e_hf.SCHEMA and data["model"] == "hf-llama"
    assert data["variants"] == ["eager", "fused"]
    assert data["ops"]["fused"]["rms_norm"] == OPS["rms_norm"].reference
    assert data["agreement"]["verdict"] == "agree" and data["swap"]["fused"]["passed"]
    profiles = {p["variant"]: p for p in data["profiles"]}
    assert set(profiles) == {"eager", "fused"}
    for v, p in profiles.items():
        assert "error" not in p, p
        assert (tmp_path / p["trace"]).is_file()
        cats = {r["category"]: r for r in p["rows"]}
        assert list(cats) == ["rms_norm", "swiglu", "attention", "matmul", "other"]
        assert cats["rms_norm"]["host_us"] > 0 and cats["matmul"]["host_us"] > 0, (v, cats)
    if device == "cpu":
        assert data["timing"] is False and data["results"] == []
        assert data["launches_cpu"]["fused"]["triton"] == 9  # 5 norms, 2 swiglu, 2 attention
    else:
        cell = next(r for r in data["results"] if r["variant"] == "fused")
        assert not cell["errors"] and cell["tpot_ms"] > 0 and cell["tokens_per_s"] > 0
        assert cell["graph_max_abs_diff"] == 0.0


def test_cli_planted_target_disagrees(tmp_path, fuseaudit_device):
    """A wrong grouped-query mapping given as ``--target attention=...`` is reported as disagreeing: exit 1."""
    path = tmp_path / "e2e-hf.json"
    device = "cuda" if fuseaudit_device.startswith("cuda") else "cpu"
    argv = ["e2e", "--model", "hf-llama", "--device", device, "--config", "tiny", "--variants", "eager",
            "--target", f"attention={PLANTED_GQA}", "--batches", str(BATCH), "--prompt-len", str(PROMPT),
            "--gen-tokens", "1", "--repeats", "1", "--warmup", "0", "--no-profile", "--json", str(path)]
    assert cli_main(argv) == 1
    data = json.loads(path.read_text())
    assert data["ops"]["target"] == {"attention": PLANTED_GQA}
    verdicts = {c["output"]: c["passed"] for c in data["agreement"]["checks"] if c["variant"] == "target"}
    assert verdicts and not any(verdicts.values()), verdicts
    assert data["swap"]["target"]["replaced"] == {"attention": 2} and data["swap"]["target"]["passed"]


def test_cli_rejects_bad_options(capsys):
    assert cli_main(["e2e", "--model", "hf-llama", "--device", "cpu", "--target", "softmax=x:y"]) == 2
    assert cli_main(["e2e", "--model", "hf-llama", "--device", "cpu", "--variants", "target"]) == 2
    assert cli_main(["e2e", "--model", "hf-gpt2", "--device", "cpu", "--target", "attention=builtin:sdpa-flash"]) == 2
    assert cli_main(["e2e", "--device", "cpu", "--target", "rms_norm=x:y"]) == 2  # the own stack takes no --target
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith("fuseaudit e2e: error: ") for line in err), err  # one prefix rule


def test_step_breakdown_attributes_kernels():
    """GPU time by the launch's enclosing ranges: GEMMs to matmul, labelled launches to their op, the rest other."""
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = [
        x(e2e_hf.STEP_LABEL, "user_annotation", 0, 100),
        x(e2e_hf.LABEL + "rms_norm", "user_annotation", 5, 10),
        x("cuLaunchKernelEx", "cuda_driver", 8, 2, correlation=1),
        x("aten::linear", "cpu_op", 20, 20),
        x("aten::mm", "cpu_op", 22, 15),
        x("cudaLaunchKernel", "cuda_runtime", 25, 3, correlation=2),
        x(e2e_hf.LABEL + "swiglu", "user_annotation", 50, 20),
        x("aten::mm", "cpu_op", 52, 5),  # a matmul inside an op's range is still a matmul
        x("cudaLaunchKernel", "cuda_runtime", 53, 1, correlation=3),
        x("cudaLaunchKernel", "cuda_runtime", 60, 1, correlation=4),
        x("cudaLaunchKernel", "cuda_runtime", 80, 1, correlation=5),
        x("rms_kernel", "kernel", 30, 4, tid=7, correlation=1),
        x("sm90_xmma_gemm_bf16", "kernel", 40, 20, tid=7, correlation=2),
        x("some_kernel", "kernel", 60, 6, tid=7, correlation=3),
        x("silu_mul_kernel", "kernel", 66, 3, tid=7, correlation=4),
        x("argmax_kernel", "kernel", 90, 2, tid=7, correlation=5),
        x("unrelated", "kernel", 500, 2, tid=7, correlation=99),
    ]
    out = e2e_hf.step_breakdown({"traceEvents": events}, ops=("rms_norm", "swiglu", "attention"))
    rows = {r["category"]: r for r in out["rows"]}
    assert rows["rms_norm"]["gpu_us"] == 4 and rows["swiglu"]["gpu_us"] == 3
    assert rows["matmul"]["gpu_us"] == 26 and rows["matmul"]["kernels"] == 2
    assert rows["other"]["gpu_us"] == 2 and rows["attention"]["gpu_us"] == 0
    assert out["kernels"] == 5 and out["gpu_span_us"] == 62 and out["gpu_busy_us"] == 35
    assert rows["matmul"]["host_us"] == 25  # linear [20, 40] and mm [52, 57]
    assert rows["rms_norm"]["host_us"] == 10 and rows["swiglu"]["host_us"] == 15
    assert rows["other"]["host_us"] == 50 and out["host_step_us"] == 100


def test_oracle_norms_compute_in_float64(llama):
    """HF's RMSNorm rounds through float32 whatever the model's dtype; the oracle's norms must not."""
    import copy

    arch, model = llama
    oracle = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    name, norm = next((n, m) for n, m, role in e2e_hf.swappable_modules(oracle) if role == "norm")
    x = torch.randn(3, oracle.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    hf = norm(x)
    assert (hf - exact).abs().max() > 1e-12, "HF's norm no longer rounds through float32: this guard is moot"
    with e2e_hf._oracle_norms(oracle, arch):
        swapped = oracle.get_submodule(name)
        assert swapped is not norm
        torch.testing.assert_close(swapped(x), exact, rtol=1e-15, atol=0)


def test_kv_cache_bound_is_rounding_not_a_lost_key():
    """The oracle's cache check: a 1B model's float64 re-prefill (H200: 7.1e-14 off at logits of 4.4) passes,
    an error at float32's level (what a cache that drops or misplaces a key gives, at the least) fails."""
    arch = e2e_hf.ARCHS["hf-llama"]
    config = e2e_hf.hf_config(arch, "default")
    bound = e2e_hf.kv_cache_bound(config, 513, 4.44, torch.float64)
    assert 7.1e-14 < bound < torch.finfo(torch.float32).eps * 4.44
