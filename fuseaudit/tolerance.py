"""The tolerance policy: one rule for every op, dtype and implementation.

A fixed atol/rtol either fails correct kernels (layer_norm on near-constant
rows, cancellation near zero) or passes wrong ones (a softmax over 100k
columns returned as zeros).  Instead, for every output and every row (the
last dim) we compare three things computed from the *same rounded inputs*:

* ``got``    -- the implementation under test;
* ``eager``  -- the unfused eager PyTorch composition in the inputs' dtype,
  built from torch's own functionals (the yardstick);
* ``oracle`` -- the same maths in float64.

Per row ``r``, with ``err(t) = max_i |t_i - oracle_i|`` over the row::

    out_r      = max_i |oracle_i|
    noise_r    = NOISE_ULPS * ulp(dtype, out_r) + ulp(float32, max_i s_i) + tiny(dtype)
    fallback_r = spec.fallback_ulps * ulp(dtype, out_r) + noise_r

    if eager's row is finite:                                     (eager is the yardstick)
        bound_r = FACTOR * err(eager) + noise_r
    else:                                                         (eager overflowed)
        bound_r = fallback_r

    the row passes  iff  err(got) <= bound_r

``FACTOR = 2`` follows FlashAttention's tests.  ``noise_r`` has two parts:

* the rounding noise of the output dtype at the row's magnitude, so a kernel
  that rounds once where eager rounded differently still passes;
* the error that float32 arithmetic cannot avoid, ``ulp(float32, s)``, where
  ``s`` comes from a first-order error analysis of the op in the catalog
  (:meth:`OpSpec.float32_scale`): ``sqrt(K) |y|`` for a reduction of length
  ``K``; ``|x| + |residual| + |bias|`` for the bias-activation ops, whose sum
  cancels; ``sqrt(N) |h| / std * |w|`` for layer_norm, whose ``h - mean``
  cancels on near-constant rows; ``(sqrt(N) + |z|) y`` for softmax, whose
  logits ``z = x * scale`` are rounded at their own magnitude; and
  ``(sqrt(Sk + D) + |q||k| scale) max|v|`` for attention, an average of
  ``v`` rows.  It matters for float32 outputs and for cancelling rows; for a
  softmax it is proportional to each row's outputs, so tiny outputs keep a
  tight bound: zeros returned for a row of 1e-5 values miss it by orders of
  magnitude.

A kernel exactly as good as eager always passes: where eager's row is finite
but further from the oracle than ``fallback_r`` (GELU's float32 left tail,
where ``1 + erf(x)`` cancels), its error still sets the bound, and the
comparison counts those rows (``rows_eager_far``, yardstick ``eager_far`` when
the worst row is one) so that the verdict can say where eager itself was off.
A non-finite yardstick never widens the bound past ``fallback_r``.

Before any of that, NaN and Inf must match: a non-finite value where the
oracle (rounded to the output dtype) is finite fails, and the reverse too.
In a row whose inputs hold NaN or Inf, eager's value at an element is as
good as the oracle's: PyTorch's own kernels disagree there (float32
``F.gelu(inf)`` is NaN on some CPU builds and inf in float64; CUDA's
``F.rms_norm`` turns a row holding ``inf`` into NaN where the maths gives
``x * 0``).  NaN is never a wildcard: it passes only where the oracle, or in
such a row eager, is NaN at that very element.  An element never written by the kernel reads as NaN
(see :mod:`fuseaudit.check`) and fails here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

FACTOR = 2.0
NOISE_ULPS = 2.0

# Explicit significand bits (ulp(1.0) = 2**-MANTISSA) and smallest normals.
MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}


def tiny(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


def ulp(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at ``magnitude`` (float64, elementwise)."""
    mag = magnitude.abs().clamp_min(tiny(dtype))
    exponent = torch.floor(torch.log2(mag))
    return torch.exp2(exponent - MANTISSA[dtype])


@dataclass
class Comparison:
    """The verdict on one output tensor, with the figures a report needs."""

    output: str
    passed: bool
    reason: str
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0  # max over rows of err / scale
    max_ulp_err: float = 0.0  # max over elements of |got - oracle| / ulp(oracle)
    eager_max_abs_err: float = 0.0
    eager_max_ulp_err: float = 0.0
    ratio_to_eager: float = 0.0  # err(got) / err(eager) over the worst row, inf if eager is exact
    yardstick: str = "eager"  # "eager_far" where eager was finite but past the dtype budget, "fallback" non-finite
    rows: int = 0
    rows_failed: int = 0
    rows_eager_far: int = 0  # rows where eager itself was further from the oracle than the dtype budget
    worst_index: tuple[int, ...] = ()
    worst_got: float = 0.0
    worst_oracle: float = 0.0
    worst_eager: float = 0.0
    worst_bound: float = 0.0
    ulp_histogram: list[int] | None = None  # counts of elements at 0, <=0.5, <=1, <=2, ... ulps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ULP_BINS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, math.inf)


def _histogram(ulps: torch.Tensor) -> list[int]:
    edges = torch.tensor(ULP_BINS, dtype=torch.float64, device=ulps.device)
    idx = torch.bucketize(ulps, edges)  # 0 for exactly 0, i for (edge[i-1], edge[i]]
    return torch.bincount(idx.clamp_max(len(ULP_BINS) - 1), minlength=len(ULP_BINS)).tolist()


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat //= s
    return tuple(reversed(out))


def compare(
    name: str,
    got: torch.Tensor,
    eager: torch.Tensor,
    oracle: torch.Tensor,
    *,
    dtype: torch.dtype,
    fallback_ulps: float,
    float32_scale: torch.Tensor | None = None,
    factor: float = FACTOR,
    noise_ulps: float = NOISE_ULPS,
    eager_defines: torch.Tensor | None = None,
) -> Comparison:
    """Apply the policy to one output; shape and dtype were checked already.

    ``float32_scale`` (broadcastable to the output) comes from the op's
    catalog entry (:meth:`OpSpec.float32_scale`); by default ``2 |oracle|``.
    ``eager_defines`` (one bool per row, the output's leading shape) marks the
    rows whose inputs hold NaN or Inf: there an element may also be eager's
    own value, finite or not.
    """
    shape = tuple(got.shape)
    n = shape[-1] if shape else 1
    g = got.detach().to(torch.float64).reshape(-1, n)
    e = eager.detach().to(torch.float64).reshape(-1, n)
    o = oracle.detach().to(torch.float64).reshape(-1, n)
    rows = g.shape[0]
    if g.numel() == 0:
        return Comparison(name, True, "empty output", rows=0)

    # 1. NaN / Inf parity against the oracle rounded to the output dtype
    ref = o.to(dtype).to(torch.float64)
    ref_finite = torch.isfinite(ref)

    def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a == b) | (torch.isnan(a) & torch.isnan(b))

    # rows with non-finite inputs: eager's value is as defined as the oracle's (PyTorch's kernels differ there)
    as_eager = torch.zeros_like(ref_finite)
    if eager_defines is not None:
        as_eager = eager_defines.reshape(-1, 1).to(g.device) & same(g, e) & ~(torch.isfinite(e) & ref_finite)
    got_finite = torch.isfinite(g) | as_eager  # an element equal to eager's non-finite value counts as right
    bad_nonfinite = ref_finite & ~got_finite
    if bool(bad_nonfinite.any()):
        idx = _unravel(int(bad_nonfinite.reshape(-1).nonzero()[0]), shape)
        count = int(bad_nonfinite.sum())
        return Comparison(
            name, False,
            f"{count} element(s) are NaN/Inf (or were never written) where the oracle is finite; first at {idx}",
            rows=rows, worst_index=idx, worst_got=float(g.reshape(-1)[_flat(idx, shape)]),
            worst_oracle=float(o.reshape(-1)[_flat(idx, shape)]), max_abs_err=math.inf, max_ulp_err=math.inf,
        )
    mismatch = ~ref_finite & ~(same(g, ref) | as_eager)
    if bool(mismatch.any()):
        idx = _unravel(int(mismatch.reshape(-1).nonzero()[0]), shape)
        return Comparison(
            name, False, f"oracle is non-finite at {idx} but the output differs there",
            rows=rows, worst_index=idx, worst_got=float(g.reshape(-1)[_flat(idx, shape)]),
            worst_oracle=float(ref.reshape(-1)[_flat(idx, shape)]),
        )

    # 2. errors on the finite part
    zero = torch.zeros((), dtype=torch.float64, device=g.device)
    judged = ref_finite & ~as_eager  # elements the bound applies to
    err_g = torch.where(judged, (g - o).abs(), zero)
    eager_finite_row = (torch.isfinite(e) | ~judged).all(dim=1)
    err_e = torch.where(judged, (e - o).abs(), zero)
    err_e = torch.where(torch.isnan(err_e), torch.full_like(err_e, math.inf), err_e)
    scale = torch.where(ref_finite, o.abs(), zero).amax(dim=1)
    if float32_scale is None:
        f32 = 2 * scale
    else:
        f32 = torch.nan_to_num(float32_scale.detach().to(torch.float64).abs().expand(shape).reshape(-1, n),
                               posinf=0.0).amax(dim=1)
    row_ulp = ulp(dtype, scale)
    noise = noise_ulps * row_ulp + ulp(torch.float32, f32) + tiny(dtype)
    fallback = fallback_ulps * row_ulp + noise

    row_err_g = err_g.amax(dim=1)
    row_err_e = err_e.amax(dim=1)
    far = eager_finite_row & (row_err_e > fallback)
    bound = torch.where(eager_finite_row, factor * row_err_e + noise, fallback)
    failed = row_err_g > bound

    elem_ulps = err_g / ulp(dtype, o)
    eager_ulps = torch.where(torch.isfinite(err_e), err_e / ulp(dtype, o), zero)
    # the worst row: failed rows first, then by how close to its bound
    margin = row_err_g / bound
    worst_row = int(margin.argmax())
    worst_col = int(err_g[worst_row].argmax())
    flat = worst_row * n + worst_col
    idx = _unravel(flat, shape)
    rel = (row_err_g / scale.clamp_min(tiny(dtype)))
    eager_worst = float(row_err_e[worst_row])
    cmp = Comparison(
        output=name,
        passed=not bool(failed.any()),
        reason="",
        max_abs_err=float(row_err_g.max()),
        max_rel_err=float(rel.max()),
        max_ulp_err=float(elem_ulps.max()),
        eager_max_abs_err=float(torch.where(torch.isfinite(row_err_e), row_err_e, zero).max()),
        eager_max_ulp_err=float(eager_ulps.max()),
        ratio_to_eager=float(row_err_g[worst_row]) / eager_worst if eager_worst > 0 else (
            0.0 if float(row_err_g[worst_row]) == 0 else math.inf),
        yardstick=("eager_far" if bool(far[worst_row]) else "eager") if bool(eager_finite_row[worst_row])
        else "fallback",
        rows=rows,
        rows_failed=int(failed.sum()),
        rows_eager_far=int(far.sum()),
        worst_index=idx,
        worst_got=float(g[worst_row, worst_col]),
        worst_oracle=float(o[worst_row, worst_col]),
        worst_eager=float(e[worst_row, worst_col]),
        worst_bound=float(bound[worst_row]),
        ulp_histogram=_histogram(elem_ulps.reshape(-1)),
    )
    if cmp.passed:
        cmp.reason = "within bound"
    else:
        how = (f"{factor:g} x eager's error {eager_worst:.3g} + noise {float(noise[worst_row]):.3g}"
               if cmp.yardstick != "fallback" else
               f"the dtype bound of {fallback_ulps:g} ulp (eager is non-finite here)")
        cmp.reason = (
            f"{cmp.rows_failed}/{rows} rows exceed the bound; worst at {idx}: got {cmp.worst_got:.6g}, "
            f"oracle {cmp.worst_oracle:.6g}, eager {cmp.worst_eager:.6g}; row error "
            f"{float(row_err_g[worst_row]):.3g} > bound {cmp.worst_bound:.3g} ({how})"
        )
    return cmp


def _flat(idx: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, s in zip(idx, shape):
        flat = flat * s + i
    return flat
