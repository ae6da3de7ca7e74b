"""``fuseaudit e2e``: what fusion buys in a whole decode step, beside what the microbenchmark predicts.

A fused op that is 3x faster in isolation does not make a decode step 3x
faster: the matmuls, the launches that are left and the host around them
do not change.  This command runs a Llama-style decoder stack
(:mod:`fuseaudit.model`, random weights, ~1B-parameter shapes by default) in
three variants (``eager``: the catalog's eager compositions; ``fused``: the
catalog's reference kernels; ``compile``: ``torch.compile`` of the whole
forward) and reports, per variant and batch size:

* **TTFT** -- device time of the prefill of a ``--prompt-len`` prompt (logits
  of the last position, as sampling needs);
* **TPOT** -- device time of one decode step with a KV cache of the prompt;
  with ``--cuda-graphs`` also the step captured in a CUDA graph and replayed;
* **launches per decode step** (:func:`fuseaudit.launches.recording`);
* **peak memory** of a prefill and of a decode step;

and, per batch, the microbenchmark's prediction: every catalog op call of
one eager decode step is recorded with its real arguments (shapes, strides,
dtype), the distinct calls are timed alone with
:func:`fuseaudit.timing.time_events` (the project's microbenchmark: CUDA
events, L2 flushed), eager and fused, and ``sum(eager) / sum(fused)`` (each
weighted by its calls per step) is set beside the measured ``TPOT eager /
TPOT fused``.  Amdahl's law joins the two: with ``s`` the share of the eager
step spent in these ops, the step can gain at most ``1 / (1 - s + s / g)``.

Timing: CUDA events; warm-up calls (compilation, autotuning) excluded; each
repeat starts from an idle GPU (synchronised first), as a decode loop that
samples on the host does, so host launch overhead is inside the figure;
median of the repeats (quartiles kept).  On the CPU there is nothing to time
(the Triton interpreter times Python): the command runs the tiny
configuration as an agreement check only and says "timing needs a GPU".

Agreement: before any timing, every variant runs the same prompt and one
decode step at one batch size (the smallest of ``--batches`` that is >= 8,
else the largest); its outputs (prefill logits of the last position, final
hidden states of every prompt position, decode-step logits and hidden state)
are judged by :func:`fuseaudit.tolerance.compare` -- the project's one policy
-- with the ``eager`` variant as the yardstick and, as the oracle, the same
model (the same rounded weights) run with the eager ops in float64
(``--oracle float32`` for a cheaper one).  The KV cache is checked too: the
oracle's decode step must equal a re-prefill of prompt + token.

Exit status: 0 every variant agrees; 1 a variant disagrees or failed to run;
2 bad options.

``--model hf-llama`` / ``hf-gpt2`` measures a Hugging Face transformers model
with the ops swapped in instead of this stack: :mod:`fuseaudit.e2e_hf`.

JSON (``--json``, default ``reports/e2e.json``; rewritten after every
measurement, so a run cut short keeps what it measured)::

    schema             "fuseaudit-e2e/1"
    created            ISO time (UTC)
    env                {device, device_name, torch, triton, cuda}
    config             ModelConfig fields + head_dim, params
    dtype              model dtype ("bfloat16", ...)
    prompt_len         prompt length P (the decode step attends to P + 1 keys)
    batches, variants  as run
    cuda_graphs        bool
    timing             bool: false on the CPU
    timing_note        why not, where false
    weight_bytes       bytes of the model's weights
    agreement          {verdict: "agree" | "disagree", batch, prompt_len, oracle_dtype,
                        kv_cache: {max_abs_diff, scale, passed},
                        checks: [{variant, output, passed, error?, comparison: Comparison.to_dict()}]}
                       outputs: prefill_logits (B, V), prefill_hidden (B, P, hidden),
                       decode_logits (B, V), decode_hidden (B, 1, hidden)
    results            [{variant, batch, ttft, tpot, tpot_graph, ttft_ms, tpot_ms, tpot_graph_ms,
                         launches: {count, memcpy, memset, method, triton, by_kernel: {name: n}},
                         peak_prefill_bytes, peak_decode_bytes, transient_prefill_bytes,
                         transient_decode_bytes, kv_cache_bytes, graph_max_abs_diff,
                         errors: {what: message}, skipped?}]
                       ttft / tpot / tpot_graph: fuseaudit.timing.Timing.to_dict() (microseconds);
                       peak_*: torch.cuda.max_memory_allocated() over one call after a reset (weights,
                       cache and all included); transient_*: that peak minus what was allocated before
    microbench         [{batch, calls: [{op, shapes, strides, dtype, params, calls_per_step,
                                         eager_us, fused_us, gain, eager_graph_us?, fused_graph_us?}],
                         eager_ops_us, fused_ops_us, predicted_gain, (per step, weighted by calls)
                         eager_share_of_step, amdahl_gain, measured_gain,
                         predicted_gain_graph?, eager_share_of_step_graph?, amdahl_gain_graph?,
                         measured_gain_graph?, errors}]
                       *_graph: the ops timed inside a CUDA graph (fuseaudit.timing.time_graph)
                       beside the graphed decode step
    gains              [{variant, batch, ttft_gain, tpot_gain, tpot_graph_gain}]  (eager / variant)
    launches_cpu       CPU only: {variant: launches of one decode step (interpreter + aten ops) or {error}}
    budget_s, elapsed_s, skipped  (step measurements skipped once --budget-s was spent; the
                                   microbenchmark, a few seconds, always runs)
    notes              list of strings (design choices a reader should know)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import math
import pathlib
import sys
import time
from typing import Any, Callable

from .cli import usage_error
from .jsonio import write_json

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SCHEMA = "fuseaudit-e2e/1"
TIMING_NOTE = "timing needs a GPU (on the CPU the Triton interpreter would time Python, not kernels)"
# Budget of the tolerance policy's dtype fallback, in ulps of a row's largest
# oracle magnitude.  A bf16 model's eager error is ~1-2 ulps of that
# magnitude (float32: ~10), so a sane eager is always the yardstick; the
# fallback only bounds the case where eager itself is non-finite or far off.
MODEL_FALLBACK_ULPS = 64.0
OUTPUTS = ("prefill_logits", "prefill_hidden", "decode_logits", "decode_hidden")
NOTES = [
    "rotary embeddings are plain torch (HF rotate-half), identical in every variant; compiled with the rest "
    "under torch.compile",
    "compile = torch.compile(dynamic=False) of the whole forward (prefill, or one decode step) with the eager "
    "ops, attention written as plain SDPA without a pinned backend (as a user's model is): what a user would do",
    "eager attention is the catalog's eager composition: repeat_interleave for grouped-query + SDPA pinned to "
    "the math backend (the unfused yardstick)",
    "--cuda-graphs captures one decode step (static tokens and KV cache, fixed position) of every variant the "
    "same way, by hand; prefill is not graphed",
    "matmuls are torch (cuBLAS) in every variant",
]


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("own", "hf-llama", "hf-gpt2"), default="own",
                        help="own: this project's Llama-style stack; hf-*: a transformers model with the ops "
                             "swapped in (fuseaudit.e2e_hf; needs the 'e2e' extra)")
    parser.add_argument("--config", choices=("default", "tiny"), default=None,
                        help="model shape (default: 'default' on a GPU, 'tiny' on the CPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the config's number of layers")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (GPU default 1,8,64)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt length (GPU default 512, CPU 8)")
    parser.add_argument("--variants", default="eager,fused,compile",
                        help="comma-separated: eager,fused,compile (hf models: also target, implied by --target)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time the decode step replayed from a CUDA graph")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--oracle", choices=("float64", "float32"), default="float64",
                        help="dtype of the oracle forward (same weights, eager ops)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per figure (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation, autotuning)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip the measurements left once this many seconds have passed (results so far kept)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="where to write the results (default reports/e2e.json, reports/e2e-MODEL.json for hf-*)")
    from .e2e_hf import add_arguments as add_hf_arguments

    add_hf_arguments(parser)


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{what} must list positive integers, got {text!r}")
    return values


# ---------------------------------------------------------------------------
# Running the model
# ---------------------------------------------------------------------------

def prefill_and_step(fw: Callable[..., Any], model: Any, tokens: Any) -> dict[str, Any]:
    """Prefill ``tokens[:, :-1]`` into a fresh cache, then decode ``tokens[:, -1:]``: the four outputs."""
    b, n = tokens.shape
    p = n - 1
    cache = model.new_cache(b, n)
    pl, ph = fw(tokens[:, :p], cache, 0)
    pl, ph = pl.clone(), ph.clone()  # a compiled or graphed fn may reuse its output buffers
    dl, dh = fw(tokens[:, p:], cache, p)
    return {"prefill_logits": pl, "prefill_hidden": ph, "decode_logits": dl.clone(), "decode_hidden": dh.clone()}


def check_agreement(model: Any, variants: list[str], *, batch: int, prompt_len: int, seed: int,
                    oracle_dtype: Any = None) -> dict[str, Any]:
    """Every variant's outputs judged by the tolerance policy against eager and the oracle (see module doc)."""
    import torch

    from .model import make_ops, random_tokens, variant_forward
    from .tolerance import compare

    oracle_dtype = oracle_dtype or torch.float64
    tokens = random_tokens(model.cfg, batch, prompt_len + 1, seed=seed + 1, device=model.device)
    eager_ops = make_ops("eager")
    with torch.no_grad():
        oracle = model.cast(oracle_dtype)
        ofw = lambda t, c, p: oracle.forward(eager_ops, t, c, p)
        want = prefill_and_step(ofw, oracle, tokens)
        # The KV cache's own property, on the oracle: decode with the cache == re-prefill of prompt + token.
        full, _ = ofw(tokens, oracle.new_cache(batch, prompt_len + 1), 0)
        diff = float((want["decode_logits"] - full).abs().max())
        scale = float(full.abs().max())
        kv = {"max_abs_diff": diff, "scale": scale,
              "passed": bool(diff <= 64 * torch.finfo(oracle_dtype).eps * max(scale, 1.0))}
        oracle = full = None  # free the oracle's weights before the variants run

        outs: dict[str, dict[str, Any]] = {}
        errors: dict[str, str] = {}
        for v in dict.fromkeys(["eager", *variants]):
            try:
                outs[v] = prefill_and_step(variant_forward(model, v), model, tokens)
            except Exception as exc:  # a variant that cannot run fails the check, with the reason
                errors[v] = f"{type(exc).__name__}: {exc}"

    checks = []
    for v in variants:
        for name in OUTPUTS:
            entry: dict[str, Any] = {"variant": v, "output": name}
            if v in errors or "eager" in errors:
                entry.update(passed=False, error=errors.get(v) or f"eager failed: {errors['eager']}")
            else:
                got = outs[v][name]
                if got.shape != want[name].shape or got.dtype != model.dtype:
                    entry.update(passed=False, error=f"shape/dtype {tuple(got.shape)} {got.dtype}, expected "
                                                     f"{tuple(want[name].shape)} {model.dtype}")
                else:
                    cmp = compare(name, got, outs["eager"][name], want[name], dtype=model.dtype,
                                  fallback_ulps=MODEL_FALLBACK_ULPS)
                    entry.update(passed=cmp.passed, comparison=cmp.to_dict())
            checks.append(entry)
    passed = all(c["passed"] for c in checks) and kv["passed"]
    return {"verdict": "agree" if passed else "disagree", "batch": batch, "prompt_len": prompt_len,
            "oracle_dtype": str(oracle_dtype).replace("torch.", ""), "kv_cache": kv, "checks": checks}


def decode_launches(model: Any, variant: str, *, batch: int, prompt_len: int, seed: int, device: str,
                    fw: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Kernels launched by one decode step (after a prefill and a warm-up step)."""
    import torch

    from .launches import recording, short_name
    from .model import random_tokens, variant_forward

    fw = fw or variant_forward(model, variant)
    tokens = random_tokens(model.cfg, batch, prompt_len + 1, seed=seed + 2, device=model.device)
    cache = model.new_cache(batch, prompt_len + 1)
    with torch.no_grad():
        fw(tokens[:, :prompt_len], cache, 0)
        fw(tokens[:, prompt_len:], cache, prompt_len)  # warm-up: compilation, autotuning
        with recording(device) as count:
            fw(tokens[:, prompt_len:], cache, prompt_len)
    d = count.to_dict()
    by_kernel = collections.Counter(short_name(k) for k in count.kernels)
    return {"count": d["count"], "memcpy": d["memcpy"], "memset": d["memset"], "method": d["method"],
            "triton": len(d["triton"]), "by_kernel": dict(by_kernel.most_common())}


# ---------------------------------------------------------------------------
# Timing (GPU)
# ---------------------------------------------------------------------------

def time_step(fn: Callable[[], Any], *, warmup: int, repeats: int) -> Any:
    """CUDA-event time of ``fn()``, each repeat from an idle GPU (host overhead included); a Timing."""
    import torch

    from .timing import summarize

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end))
    return summarize(samples, mode="events")


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, int]:
    """``(peak allocated during fn(), peak minus what was allocated before)``."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return int(peak), int(peak - base)


def capture_step(fn: Callable[[], Any], *, warmup: int) -> tuple[Any, Any]:
    """``(graph, outputs)``: ``fn()`` captured in a CUDA graph after warm-up on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def measure_cell(model: Any, variant: str, fw: Callable[..., Any], *, batch: int, prompt_len: int,
                 args: argparse.Namespace, device: str) -> dict[str, Any]:
    """TTFT, TPOT (and graphed TPOT), launches and peak memory of one variant at one batch size."""
    import torch

    from .model import random_tokens

    cell: dict[str, Any] = {"variant": variant, "batch": batch, "errors": {}}
    tokens = random_tokens(model.cfg, batch, prompt_len + 1, seed=args.seed + 3, device=model.device)
    prompt, nxt = tokens[:, :prompt_len].contiguous(), tokens[:, prompt_len:].contiguous()
    cache = model.new_cache(batch, prompt_len + 1)
    cell["kv_cache_bytes"] = cache.nbytes()
    prefill = lambda: fw(prompt, cache, 0)
    step = lambda: fw(nxt, cache, prompt_len)

    def attempt(what: str, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as exc:  # one figure failing must not lose the others
            cell["errors"][what] = f"{type(exc).__name__}: {exc}"
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # the context is gone (a fault): say so, stop here
                raise RuntimeError(f"{variant} at batch {batch}: {what} failed and left CUDA unusable: "
                                   f"{cell['errors'][what]}") from sync_exc

    with torch.no_grad():
        def ttft() -> None:
            t = time_step(prefill, warmup=args.warmup, repeats=args.repeats)
            cell["ttft"], cell["ttft_ms"] = t.to_dict(), t.median_us / 1e3

        def tpot() -> None:
            prefill()  # the cache holds the prompt
            t = time_step(step, warmup=args.warmup, repeats=max(args.repeats, 20))
            cell["tpot"], cell["tpot_ms"] = t.to_dict(), t.median_us / 1e3

        def memory() -> None:
            cell["peak_prefill_bytes"], cell["transient_prefill_bytes"] = peak_bytes(prefill)
            cell["peak_decode_bytes"], cell["transient_decode_bytes"] = peak_bytes(step)

        def launches() -> None:
            cell["launches"] = decode_launches(model, variant, batch=batch, prompt_len=prompt_len,
                                               seed=args.seed, device=device, fw=fw)

        def graphed() -> None:
            prefill()
            direct = step()[0].clone()
            graph, out = capture_step(step, warmup=args.warmup)
            cell["graph_max_abs_diff"] = float((out[0].float() - direct.float()).abs().max())
            t = time_step(graph.replay, warmup=args.warmup, repeats=max(args.repeats, 20))
            cell["tpot_graph"], cell["tpot_graph_ms"] = t.to_dict(), t.median_us / 1e3
            del graph, out

        attempt("ttft", ttft)
        attempt("tpot", tpot)
        attempt("memory", memory)
        attempt("launches", launches)
        if args.cuda_graphs:
            attempt("cuda_graph", graphed)
    return cell


def microbench(model: Any, *, batch: int, prompt_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """Time the catalog op calls of one eager decode step alone, eager vs fused (see module doc)."""
    import functools

    import torch

    from .catalog import OPS
    from .model import OpCall, make_ops, random_tokens, recording_ops
    from .timing import time_events, time_graph

    calls: list[OpCall] = []
    tokens = random_tokens(model.cfg, batch, prompt_len + 1, seed=args.seed + 3, device=model.device)
    cache = model.new_cache(batch, prompt_len + 1)
    eager = make_ops("eager")
    with torch.no_grad():
        model.forward(eager, tokens[:, :prompt_len], cache, 0)
        model.forward(recording_ops(eager, calls), tokens[:, prompt_len:], cache, prompt_len)
    groups: dict[Any, list[OpCall]] = {}
    for c in calls:
        groups.setdefault(c.key(), []).append(c)

    rows, errors = [], {}
    for same in groups.values():
        call = same[0]
        spec = OPS[call.op]
        row = call.describe()
        row["calls_per_step"] = len(same)
        impls = {"eager": spec.eager, "fused": spec.load_reference()}
        for label, impl in impls.items():
            fn = functools.partial(impl, **call.params)
            try:
                with torch.no_grad():
                    row[f"{label}_us"] = time_events(fn, rotate=(call.args,), warmup=args.warmup).median_us
                    if args.cuda_graphs:
                        row[f"{label}_graph_us"] = time_graph(fn, args=call.args, warmup=args.warmup).median_us
            except Exception as exc:
                errors[f"{call.op}/{label}"] = f"{type(exc).__name__}: {exc}"
        if "eager_us" in row and "fused_us" in row:
            row["gain"] = row["eager_us"] / row["fused_us"]
        rows.append(row)
    out: dict[str, Any] = {"batch": batch, "calls": rows, "errors": errors}
    for suffix in ("", "_graph"):
        if all(f"eager{suffix}_us" in r and f"fused{suffix}_us" in r for r in rows) and rows:
            e = sum(r[f"eager{suffix}_us"] * r["calls_per_step"] for r in rows)
            f = sum(r[f"fused{suffix}_us"] * r["calls_per_step"] for r in rows)
            out[f"eager_ops{suffix}_us"], out[f"fused_ops{suffix}_us"] = e, f
            out[f"predicted_gain{suffix}"] = e / f if f > 0 else math.nan
    del cache, calls, groups
    return out


def step_gains(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """eager / variant of TTFT, TPOT and graphed TPOT, per variant and batch, where both were measured."""
    cells = {(r["variant"], r["batch"]): r for r in results}
    gains = []
    for (variant, batch), r in cells.items():
        base = cells.get(("eager", batch))
        if base is None:
            continue
        g: dict[str, Any] = {"variant": variant, "batch": batch}
        for key in ("ttft", "tpot", "tpot_graph"):
            if f"{key}_ms" in base and f"{key}_ms" in r and r[f"{key}_ms"] > 0:
                g[f"{key}_gain"] = base[f"{key}_ms"] / r[f"{key}_ms"]
        gains.append(g)
    return gains


def join_gains(report: dict[str, Any]) -> None:
    """Fill ``gains`` (eager / variant) and the microbenchmark rows' step figures from ``results``."""
    cells = {(r["variant"], r["batch"]): r for r in report["results"]}
    report["gains"] = step_gains(report["results"])
    for m in report["microbench"]:
        base, fused = cells.get(("eager", m["batch"])), cells.get(("fused", m["batch"]))
        for suffix, step_key in (("", "tpot_ms"), ("_graph", "tpot_graph_ms")):
            if base is None or step_key not in base or f"eager_ops{suffix}_us" not in m:
                continue
            step_us = 1e3 * base[step_key]
            share = m[f"eager_ops{suffix}_us"] / step_us
            m[f"eager_share_of_step{suffix}"] = share
            rest = step_us - m[f"eager_ops{suffix}_us"] + m[f"fused_ops{suffix}_us"]
            m[f"amdahl_gain{suffix}"] = step_us / rest if rest > 0 else math.nan
            if fused is not None and step_key in fused and fused[step_key] > 0:
                m[f"measured_gain{suffix}"] = base[step_key] / fused[step_key]


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def print_report(report: dict[str, Any], out: Any = None) -> None:
    from .model import describe_params

    out = out or sys.stdout
    cfg = report["config"]
    print(f"model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']}/{cfg['kv_heads']} heads, "
          f"intermediate {cfg['intermediate']}, vocab {cfg['vocab']} ({describe_params(cfg['params'])} params), "
          f"{report['dtype']}, prompt {report['prompt_len']}, device {report['env']['device_name']}", file=out)
    agr = report.get("agreement")
    if agr:
        print(f"\nagreement at batch {agr['batch']} (oracle: same weights, eager ops, {agr['oracle_dtype']}; "
              f"yardstick: eager): {agr['verdict'].upper()}", file=out)
        kv = agr["kv_cache"]
        print(f"  kv cache (oracle): decode step vs re-prefill of prompt+token, max |diff| {kv['max_abs_diff']:.3g} "
              f"-> {'ok' if kv['passed'] else 'FAILED'}", file=out)
        print_checks(agr["checks"], out, width=15)
    if not report["timing"]:
        print(f"\n{report['timing_note']}", file=out)
    if report["results"]:
        print(f"\n{'variant':<8} {'batch':>5} {'TTFT ms':>9} {'TPOT ms':>9} {'graph ms':>9} {'launch/step':>11} "
              f"{'peak MiB':>9} {'TPOT gain':>9} {'graph gain':>10}", file=out)
        gains = {(g["variant"], g["batch"]): g for g in report.get("gains", [])}
        for r in report["results"]:
            g = gains.get((r["variant"], r["batch"]), {})
            peak = max(r.get("peak_prefill_bytes", 0), r.get("peak_decode_bytes", 0)) / 2**20 or None
            launches = r.get("launches", {}).get("count")
            skipped = f"  (skipped: {r['skipped']})" if r.get("skipped") else ""
            errs = f"  errors: {'; '.join(f'{k}: {v[:80]}' for k, v in r['errors'].items())}" if r.get("errors") else ""
            print(f"{r['variant']:<8} {r['batch']:>5} {_fmt(r.get('ttft_ms')):>9} {_fmt(r.get('tpot_ms')):>9} "
                  f"{_fmt(r.get('tpot_graph_ms')):>9} {_fmt(launches, 'd'):>11} {_fmt(peak, '.0f'):>9} "
                  f"{_fmt(g.get('tpot_gain'), '.2f'):>9} {_fmt(g.get('tpot_graph_gain'), '.2f'):>10}{skipped}{errs}",
                  file=out)
    elif report.get("launches_cpu"):
        print("\nlaunches per decode step (CPU: interpreter launches + aten ops):", file=out)
        for v, d in report["launches_cpu"].items():
            print(f"  {v:<8} {d.get('count', d.get('error'))}", file=out)
    if report["microbench"]:
        print("\nwhat the microbenchmark predicts vs what the decode step gets (fused vs eager):", file=out)
        print(f"{'batch':>5} {'ops eager us':>12} {'ops fused us':>12} {'micro gain':>10} {'share of step':>13} "
              f"{'Amdahl':>7} {'measured':>8} {'graph: micro':>12} {'Amdahl':>7} {'measured':>8}", file=out)
        for m in report["microbench"]:
            if m.get("skipped"):
                print(f"{m['batch']:>5}  skipped: {m['skipped']}", file=out)
                continue
            print(f"{m['batch']:>5} {_fmt(m.get('eager_ops_us'), '.1f'):>12} {_fmt(m.get('fused_ops_us'), '.1f'):>12} "
                  f"{_fmt(m.get('predicted_gain'), '.2f'):>10} {_fmt(m.get('eager_share_of_step'), '.1%'):>13} "
                  f"{_fmt(m.get('amdahl_gain'), '.2f'):>7} {_fmt(m.get('measured_gain'), '.2f'):>8} "
                  f"{_fmt(m.get('predicted_gain_graph'), '.2f'):>12} {_fmt(m.get('amdahl_gain_graph'), '.2f'):>7} "
                  f"{_fmt(m.get('measured_gain_graph'), '.2f'):>8}", file=out)
            for c in m["calls"]:
                print(f"        {c['op']:<13} x{c['calls_per_step']:<3} {c['shapes']!s:<44} eager "
                      f"{_fmt(c.get('eager_us'), '.1f')} us, fused {_fmt(c.get('fused_us'), '.1f')} us, "
                      f"gain {_fmt(c.get('gain'), '.2f')}", file=out)
            if m.get("errors"):
                print(f"        errors: {m['errors']}", file=out)
    print(f"\nwritten: {report.get('_path', '')}", file=out)


def _write(report: dict[str, Any], path: pathlib.Path) -> None:
    write_json(path, {k: v for k, v in report.items() if not k.startswith("_")})


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    from .profiles import resolve_device

    if args.model != "own":
        from .e2e_hf import main as hf_main

        return hf_main(args)
    try:
        hf_only = [o for o, given in (("--target", args.target), ("--gen-tokens", args.gen_tokens is not None),
                                      ("--profile-batch", args.profile_batch is not None),
                                      ("--no-profile", args.no_profile)) if given]
        if hf_only:
            raise ValueError(f"{', '.join(hf_only)}: only with --model hf-llama or hf-gpt2")
        device = resolve_device(args.device)  # before any kernel module is imported
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        from .model import VARIANTS, describe_params, get_config

        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            raise ValueError(f"unknown variant(s) {', '.join(unknown) or '(none)'}; known: {', '.join(VARIANTS)}")
        gpu = device == "cuda"
        batches = _int_list(args.batches, "batches") if args.batches else ([1, 8, 64] if gpu else [2])
        prompt_len = args.prompt_len if args.prompt_len is not None else (512 if gpu else 8)
        if prompt_len < 2:
            raise ValueError("--prompt-len must be at least 2")
        if args.repeats < 1 or args.warmup < 0:
            raise ValueError("--repeats must be >= 1 and --warmup >= 0")
        if args.layers is not None and args.layers < 1:
            raise ValueError("--layers must be at least 1")
        cfg = get_config(args.config or ("default" if gpu else "tiny"), args.layers)
        if args.oracle == "float32" and args.dtype == "float32":
            raise ValueError("--oracle float32 is no oracle for a float32 model: use --oracle float64")
        if prompt_len + 1 > cfg.max_seq:
            raise ValueError(f"--prompt-len {prompt_len} + 1 exceeds the config's max_seq {cfg.max_seq}")
    except ValueError as exc:
        return usage_error("e2e", str(exc))

    import torch
    import triton

    from .model import Model

    t0 = time.monotonic()
    over_budget = lambda: args.budget_s is not None and time.monotonic() - t0 > args.budget_s
    dtype = getattr(torch, args.dtype)
    path = pathlib.Path(args.json or "reports/e2e.json")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {"device": device, "device_name": torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)",
                "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "config": cfg.to_dict(), "dtype": args.dtype, "prompt_len": prompt_len, "batches": batches,
        "variants": variants, "cuda_graphs": bool(args.cuda_graphs and gpu), "timing": gpu,
        "timing_note": None if gpu else TIMING_NOTE, "budget_s": args.budget_s, "notes": NOTES,
        "results": [], "microbench": [], "gains": [], "skipped": [], "_path": str(path),
    }
    if args.cuda_graphs and not gpu:
        report["notes"] = [*NOTES, "--cuda-graphs ignored: CUDA graphs need a GPU"]
    if not gpu and cfg.hidden > 512:
        print("note: a full-size config under the Triton interpreter takes very long; --config tiny is the CPU check",
              flush=True)
    print(f"building the model ({describe_params(cfg.num_params())} params, {args.dtype}) on {device} ...", flush=True)
    model = Model(cfg, dtype=dtype, device=device, seed=args.seed)
    report["weight_bytes"] = model.weight_bytes()

    check_batch = min((b for b in batches if b >= 8), default=max(batches))
    print(f"agreement check at batch {check_batch}, prompt {prompt_len} ...", flush=True)
    report["agreement"] = check_agreement(model, variants, batch=check_batch, prompt_len=prompt_len, seed=args.seed,
                                          oracle_dtype=getattr(torch, args.oracle))
    _write(report, path)
    if gpu:
        torch.cuda.empty_cache()  # the oracle's weights

    if not gpu:
        report["launches_cpu"] = {}
        for v in variants:
            if v == "compile":
                report["launches_cpu"][v] = {"error": "n/a on the CPU (Inductor emits C++ loops, not launches)"}
                continue
            try:
                report["launches_cpu"][v] = decode_launches(model, v, batch=check_batch, prompt_len=prompt_len,
                                                            seed=args.seed, device=device)
            except Exception as exc:
                report["launches_cpu"][v] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{TIMING_NOTE}; agreement only.", flush=True)
    else:
        from .model import variant_forward

        # compile last (its compilations are the slow part); the microbenchmark after every step was measured,
        # so its L2-flush buffer is in no variant's peak memory.  --budget-s skips step measurements only: the
        # microbenchmark takes seconds and is half of what this command is for.
        order = [v for v in variants if v != "compile"] + (["compile"] if "compile" in variants else [])
        with_micro = "eager" in variants and "fused" in variants
        for phase in [*order, *(["microbench"] if with_micro else [])]:
            fw = variant_forward(model, phase) if phase != "microbench" else None
            for b in batches:
                if phase != "microbench" and over_budget():
                    report["skipped"].append({"what": phase, "batch": b})
                    report["results"].append({"variant": phase, "batch": b, "errors": {},
                                              "skipped": f"over the {args.budget_s:g} s budget"})
                    continue
                print(f"{phase} at batch {b} ...", flush=True)
                if phase == "microbench":
                    report["microbench"].append(microbench(model, batch=b, prompt_len=prompt_len, args=args))
                else:
                    report["results"].append(measure_cell(model, phase, fw, batch=b, prompt_len=prompt_len,
                                                          args=args, device=device))
                torch.cuda.empty_cache()
                join_gains(report)
                report["elapsed_s"] = time.monotonic() - t0
                _write(report, path)
    join_gains(report)
    report["elapsed_s"] = time.monotonic() - t0
    _write(report, path)
    print_report(report)
    return EXIT_OK if report["agreement"]["verdict"] == "agree" else EXIT_FAILED


def print_checks(checks: list[dict[str, Any]], out: Any, *, width: int) -> None:
    """One line per agreement check: the yardstick's own error, or a variant's against it."""
    for c in checks:
        cmp = c.get("comparison") or {}
        if c.get("error"):
            detail = c["error"]
        elif c["variant"] == "eager":
            detail = f"the yardstick: max err {cmp.get('max_abs_err', 0):.3g} vs the oracle"
        else:
            detail = (f"max err {cmp.get('max_abs_err', 0):.3g} (eager {cmp.get('eager_max_abs_err', 0):.3g}), "
                      f"worst row {cmp.get('ratio_to_eager', 0):.2f}x eager's error; {cmp.get('reason', '')}")
        print(f"  {c['variant']:<8} {c['output']:<{width}} {'pass' if c['passed'] else 'FAIL'}  {detail}", file=out)
