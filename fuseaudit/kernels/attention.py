"""Fused scaled-dot-product attention: a FlashAttention-2 style forward kernel.

``attention(q, k, v, causal, scale)`` equals
``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` on
``(B, H, S, D)`` tensors, in one kernel launch, without ever writing the
``(Sq, Sk)`` score matrix to memory.

Tiling
------
Each program owns ``BLOCK_M`` query rows of one batch entry and one *kv head*
and walks the keys in tiles of ``BLOCK_N``::

    for each key tile j:                       # K_j, V_j: (BLOCK_N, D)
        S   = Q @ K_j^T * scale                # (BLOCK_M, BLOCK_N), fp32, on chip
        acc, m, l  <-  online softmax update with S and V_j
    O = acc / l

Grouped-query attention: query head ``h`` reads kv head ``h // G`` with
``G = H // Hkv``.  The ``G`` query heads that share a kv head are packed into
the rows of one program (row ``r`` is query position ``r // G`` of head
``r % G`` of the group), so K and V are read once per group instead of once per
query head.  That is what makes decoding (``Sq = 1``) with grouped-query cheap.

Online softmax (all in fp32, base 2)
------------------------------------
With ``c = scale * log2(e)`` we have ``exp(q.k * scale) = 2 ** (q.k * c)``, so
the kernel uses the cheap ``exp2`` and folds ``log2(e)`` into the scale once on
the host.  Per row it keeps the running max ``m`` of the scaled scores seen so
far, the running sum ``l = sum 2 ** (s - m)`` and the unnormalised output
``acc = sum 2 ** (s - m) * v``.  A new tile with raw scores ``x_j = q.k_j``
updates them::

    m_new = max(m, max_j x_j * c)              # c >= 0: scale the max, not each x_j
    p_j   = 2 ** fma(x_j, c, -m_new)           # <= 1; one rounding, relative to x_j*c - m
    alpha = 2 ** (m - m_new)                   # rescales what was summed so far
    l     = l * alpha + sum_j p_j
    acc   = acc * alpha + p @ V_j              # p cast to the input dtype, fp32 acc

and at the end ``O = acc / l``.  Masked keys get ``-inf`` scores before the max,
so they contribute ``2 ** -inf = 0``.  A negative ``scale`` negates q instead
(exact), which keeps ``c >= 0``.

Masking work is only done where it is needed: the key tiles that every row of
the block sees completely (all of them but the last without causal; those left
of the diagonal with causal) run a loop without any mask; only the diagonal and
the ragged last tile run the masked loop.  Causal is *top-left* aligned, like
SDPA's ``is_causal``: query ``i`` sees keys ``j <= i``, also when ``Sq != Sk``,
and tiles right of the last row's diagonal are never visited.

Split-K for decoding
--------------------
With few query rows (decoding) there are only ``B * Hkv`` programs, too few to
fill the GPU.  Then the keys are split into ``num_splits`` chunks, each program
does one chunk and writes its partial ``(acc, m, l)`` to a scratch buffer, and
the last program of a row block to finish (counted with an atomic) merges the
partials with the same rescaling as above.  That stays one launch.

Layout: q, k and v are addressed through all four of their strides, so any
strided view (a slice of a fused QKV projection, ``(B, S, H, D)`` transposed,
non-unit stride in ``D``, a storage offset) is read in place.  The head dim is
padded to a power of two ``BLOCK_D`` with masks (``D = 80, 96``).

Tensor descriptors (Hopper)
---------------------------
Where the copy engine can read K and V (unit stride in ``D``, 16-byte aligned
base and strides, half precision, ``D = 128``), prefill passes them as 4-D
tensor descriptors and each key tile arrives by one bulk tensor copy (TMA)
instead of ``BLOCK_N * D`` computed addresses; keys past ``Sk`` arrive as
zeros and are masked as before.  Anything else takes the pointer loads.

Warp specialisation (Hopper)
----------------------------
Half-precision prefill at ``D = 128`` with q, k and v readable by the copy
engine runs, on the Triton releases it was verified on, the Gluon kernel of
``attention_hopper.py``: a loader warp and two consumer warpgroups, written
out by hand, masks only on the tiles that need them, causal or not (see
``_use_gluon``).  Where Gluon is not there, non-causal prefill with ``Sk`` a
multiple of 128 runs ``_attention_ws_kernel``
instead: the same online softmax with the row block split in two halves, each
with its own ``(acc, l, m)``, and the key loop marked ``warp_specialize``, so
that the compiler gives the halves' rows to consumer warpgroups and the bulk
copies to a producer warp, and one half's softmax runs while the other's
matrix products do.  That kernel is written around what Triton 3.6's
specialisation accepts (see its docstring).  It has no masks at all: with
Triton 3.6 only one loop can be specialised, so a mask would run on every
tile, and on the H200 that made ragged keys and causal attention slower than
the kernel above (see ``_use_warp_specialize``), which keeps them.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from . import _launch
from ._launch import Plan, planned
from ._rows import check_tensors, interpreting, next_pow2

try:  # host-side tensor descriptors (the bulk tensor copy engine on Hopper)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: pointer loads only
    TensorDescriptor = None

try:  # the hand-specialised Hopper kernel, written in Gluon
    from . import attention_hopper
except (ImportError, AttributeError):  # a Triton without Gluon's Hopper API
    attention_hopper = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# Query rows (G * Sq) up to which a call counts as decoding: one small row block
# per kv head, autotuned over the key tile only, split over the keys if the GPU
# would otherwise sit idle.
DECODE_MAX_ROWS = 64
# Head dim at which prefill reads K and V through tensor descriptors (see _use_descriptors).
DESCRIPTOR_HEAD_DIM = 128


# ----------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``a @ b (+ acc)`` in fp32 on the tensor cores."""
    if INTERP_BF16:
        # Triton's interpreter multiplies bfloat16 bit patterns as integers; go
        # through fp32, which is exact, as are the GPU's products of bf16 inputs
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _round_to(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest even, as the GPU does)."""
    if INTERP_BF16:
        # Triton's interpreter truncates fp32 -> bf16: round on the bits first,
        # after which the truncation is exact (NaN is left alone)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16 << 16
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def _negated(q):
    """``-q`` in q's dtype, exactly (through fp32, as the interpreter cannot negate bfloat16).

    A negative scale is applied as ``q.k * scale = (-q).k * |scale|``.
    """
    return (-q.to(tl.float32)).to(q.dtype)


@triton.jit
def _row_offsets(b64, head, q_pos, stride_b, stride_h, stride_m):
    """Element offsets of packed rows (query position ``q_pos`` of head ``head``) in int64."""
    return b64 * stride_b + head.to(tl.int64) * stride_h + q_pos.to(tl.int64) * stride_m


@triton.jit
def _load_q(
    Q, b64, hkv, rows, Sq, stride_qb, stride_qh, stride_qm, stride_qd, offs_d, d_mask,
    GROUP: tl.constexpr, NEGATE_Q: tl.constexpr,
):
    """The Q block of packed ``rows``: ``(q, q_pos, head, row_ok)``.

    Row ``r`` is query position ``r // GROUP`` of query head
    ``hkv * GROUP + r % GROUP``; rows past ``Sq`` load zeros.
    """
    q_pos = rows // GROUP
    head = hkv * GROUP + rows % GROUP
    row_ok = q_pos < Sq
    q_rows = _row_offsets(b64, head, q_pos, stride_qb, stride_qh, stride_qm)
    q = tl.load(
        Q + q_rows[:, None] + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )
    if NEGATE_Q:
        q = _negated(q)
    return q, q_pos, head, row_ok


@triton.jit
def _key_range(pid_m, Sq, Sk, CAUSAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys ``[0, hi)`` that row block ``pid_m`` sees, of which ``[0, full_end)`` need no mask.

    ``full_end`` is a multiple of ``BLOCK_N``: the whole tiles every row sees
    (causal: those left of the block's first row).
    """
    if CAUSAL:
        first_pos = (pid_m * BLOCK_M) // GROUP
        last_pos = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, Sq - 1)
        hi = tl.minimum(last_pos + 1, Sk)  # keys j <= last_pos
        full_end = (tl.minimum(first_pos + 1, Sk) // BLOCK_N) * BLOCK_N
    else:
        hi = Sk
        full_end = (Sk // BLOCK_N) * BLOCK_N
    return hi, full_end


@triton.jit
def _normalised(acc, l_i, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc / l`` rounded to ``dtype``; a row that saw no key (``l = 0``) gives 0."""
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    return _round_to(acc / l_i[:, None], dtype, INTERP_BF16)


@triton.jit
def _softmax_tile(qk, m_i, l_i, keys, q_pos, Sk, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """The online-softmax step of one key tile: raw scores ``qk`` -> ``(p, alpha, l, m)``.

    ``p = 2 ** (qk * qk_scale - m_new)`` (fp32, masked keys 0), ``alpha``
    rescales what was summed so far, ``l`` already includes this tile.
    With ``MASKED`` false every key of the tile is valid for every row.
    """
    if MASKED:
        keep = (keys < Sk)[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= q_pos[:, None])
        s = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet (only possible in a split-K chunk right of
        # its diagonal) keeps m = -inf; subtract 0 there, not -inf - -inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # qk_scale >= 0, so the max can be scaled instead of every score
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = m_new
    # qk * scale - m rounded once (an fma, as the GPU compiler would fuse it
    # anyway): its error is relative to the small difference, not to |s|
    s = tl.fma(qk, qk_scale, -m_ref[:, None])
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    p = tl.math.exp2(s)
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def _attend_key_tiles(
    acc, l_i, m_i, q, q_pos,
    k_base, v_base, k_offs, v_offs, d_mask, b, hkv,
    lo, hi, Sk, stride_kn, stride_vn, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, USE_DESC: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Fold the key tiles ``[lo, hi)`` into the running ``(acc, l, m)``.

    ``k_base + k_offs`` (``v_base + v_offs``) address the ``(BLOCK_N, BLOCK_D)``
    tile of keys ``0 .. BLOCK_N-1``; ``lo`` is a multiple of ``BLOCK_N``.  With
    ``USE_DESC``, ``k_base`` and ``v_base`` are instead tensor descriptors of the
    whole ``(B, Hkv, Sk, D)`` k and v, read a tile at a time by the copy engine
    (keys past ``Sk`` come back as zeros).  With ``MASKED`` false every key of
    every tile is valid for every row (no masks at all).
    ``qk_scale = |scale| * log2(e)``, never negative.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if not USE_DESC:
        # only the tile's first address is carried through the loop (a scalar):
        # a carried tensor of pointers would cost two registers per element
        k_tile = k_base + lo.to(tl.int64) * stride_kn
        v_tile = v_base + lo.to(tl.int64) * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        if not USE_DESC:
            k_ptrs = k_tile + k_offs
            v_ptrs = v_tile + v_offs
        # -- S = Q K^T, scaled into the log2 domain ---------------------------
        if USE_DESC:
            # one bulk tensor copy per tile; the leading unit dims are (b, hkv)
            k = k_base.load([b, hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED:
            key_ok = keys < Sk
            k = tl.load(k_ptrs, mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        qk = _mma(q, tl.trans(k), None, DOT_PRECISION, INTERP_BF16)
        p, alpha, l_i, m_new = _softmax_tile(qk, m_i, l_i, keys, q_pos, Sk, qk_scale, MASKED, CAUSAL)
        # -- acc = acc * alpha + P V ------------------------------------------
        if USE_DESC:
            v = v_base.load([b, hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED:
            v = tl.load(v_ptrs, mask=key_ok[:, None] & d_mask[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = _mma(_round_to(p, v.dtype, INTERP_BF16), v, acc, DOT_PRECISION, INTERP_BF16)
        m_i = m_new
        if not USE_DESC:
            k_tile += BLOCK_N * stride_kn
            v_tile += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _merge_splits(
    Opart, Mpart, Lpart, part0, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the ``num_splits`` partial ``(acc, m, l)`` of one row block."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        part = part0 + split
        # .cg: read from L2, where the other programs' writes are
        m_s = tl.load(Mpart + part * BLOCK_M + offs_m, cache_modifier=".cg")
        l_s = tl.load(Lpart + part * BLOCK_M + offs_m, cache_modifier=".cg")
        acc_s = tl.load(
            Opart + part * (BLOCK_M * BLOCK_D) + offs_m[:, None] * BLOCK_D + offs_d[None, :],
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_i, m_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # chunks with no key
        alpha = tl.math.exp2(m_i - m_ref)
        beta = tl.math.exp2(m_s - m_ref)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    return acc, l_i


@triton.jit
def _attention_fwd_kernel(
    Q, K, V, Out,
    Opart, Mpart, Lpart, Locks,  # split-K scratch; unused unless SPLIT
    Sk, split_len,  # first of the scalars: what changes from one decode step to the next
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    Sq, qk_scale, num_splits,
    ROWS_BUCKET, KEYS_BUCKET,  # autotune keys only (rounded sizes)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, NEGATE_Q: tl.constexpr,
    USE_DESC: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: ``BLOCK_M`` packed query rows x one key chunk of one kv head.

    ``K`` and ``V`` are pointers, or with ``USE_DESC`` tensor descriptors of
    block ``(1, 1, BLOCK_N, BLOCK_D)`` (the host sets the block to the config's).

    Grid: ``(cdiv(Sq * GROUP, BLOCK_M) * num_splits, Hkv, B)``.
    """
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    # -- which rows, which kv head, which key chunk ----------------------------
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    split = pid % num_splits
    pid_m = pid // num_splits
    if CAUSAL:
        # the blocks at the bottom see the most keys: start them first
        pid_m = tl.cdiv(Sq * GROUP, BLOCK_M) - 1 - pid_m

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = pid_m * BLOCK_M + offs_m
    b64 = b.to(tl.int64)
    q, q_pos, head, row_ok = _load_q(
        Q, b64, hkv, rows, Sq, stride_qb, stride_qh, stride_qm, stride_qd, offs_d, d_mask,
        GROUP, NEGATE_Q,
    )
    if USE_DESC:
        # K and V are tensor descriptors: the copy engine computes the addresses
        k_base = K
        v_base = V
        k_offs = 0
        v_offs = 0
    else:
        k_base = K + (b64 * stride_kb + hkv.to(tl.int64) * stride_kh)
        v_base = V + (b64 * stride_vb + hkv.to(tl.int64) * stride_vh)
        k_offs = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_offs = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    # -- the key range: [0, hi), of which [0, full_end) needs no mask ---------
    hi, full_end = _key_range(pid_m, Sq, Sk, CAUSAL, GROUP, BLOCK_M, BLOCK_N)
    # this program's chunk of it (split_len is a multiple of BLOCK_N)
    lo = split * split_len
    hi = tl.minimum(hi, lo + split_len)
    mid = tl.maximum(tl.minimum(full_end, hi), lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # tiles every row sees in full: no masking work
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, k_offs, v_offs, d_mask, b, hkv,
        lo, mid, Sk, stride_kn, stride_vn, qk_scale,
        False, CAUSAL, EVEN_D, USE_DESC, DOT_PRECISION, INTERP_BF16, BLOCK_N, BLOCK_D,
    )
    # the diagonal tiles (causal) and the ragged last tile
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, k_offs, v_offs, d_mask, b, hkv,
        mid, hi, Sk, stride_kn, stride_vn, qk_scale,
        True, CAUSAL, EVEN_D, USE_DESC, DOT_PRECISION, INTERP_BF16, BLOCK_N, BLOCK_D,
    )

    o_rows = _row_offsets(b64, head, q_pos, stride_ob, stride_oh, stride_om)
    o_ptrs = Out + o_rows[:, None] + offs_d[None, :] * stride_od
    o_mask = row_ok[:, None] & d_mask[None, :]
    if SPLIT:
        # -- publish this chunk's partial result ------------------------------
        block = (b * tl.num_programs(1) + hkv) * tl.cdiv(Sq * GROUP, BLOCK_M) + pid_m
        part0 = block.to(tl.int64) * num_splits
        part = part0 + split
        tl.store(Mpart + part * BLOCK_M + offs_m, m_i)
        tl.store(Lpart + part * BLOCK_M + offs_m, l_i)
        tl.store(
            Opart + part * (BLOCK_M * BLOCK_D) + offs_m[:, None] * BLOCK_D + offs_d[None, :],
            acc,
        )
        tl.debug_barrier()  # every thread's stores happen before the release below
        done = tl.atomic_add(Locks + block, 1, sem="acq_rel")
        if done == num_splits - 1:
            # the last chunk to finish merges all of them, then re-arms the lock
            acc, l_i = _merge_splits(Opart, Mpart, Lpart, part0, num_splits, BLOCK_M, BLOCK_D)
            tl.store(o_ptrs, _normalised(acc, l_i, Out.dtype.element_ty, INTERP_BF16), mask=o_mask)
            tl.atomic_xchg(Locks + block, 0)
    else:
        tl.store(o_ptrs, _normalised(acc, l_i, Out.dtype.element_ty, INTERP_BF16), mask=o_mask)


@triton.jit
def _fold_tile(acc, l_i, m_i, q, k, v, qk_scale, INTERP_BF16: tl.constexpr):
    """``(acc, l, m)`` after one ``(BLOCK_N, D)`` tile of keys ``k`` and values ``v``, every key valid."""
    qk = _mma(q, tl.trans(k), None, "tf32", INTERP_BF16)
    p, alpha, l_i, m_new = _softmax_tile(qk, m_i, l_i, 0, 0, 0, qk_scale, False, False)
    acc = acc * alpha[:, None]
    acc = _mma(_round_to(p, v.dtype, INTERP_BF16), v, acc, "tf32", INTERP_BF16)
    return acc, l_i, m_new


@triton.jit
def _attention_ws_kernel(
    Q, K, V, Out,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Sq, Sk, qk_scale,
    ROWS_BUCKET, KEYS_BUCKET,  # autotune keys only (rounded sizes)
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NEGATE_Q: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Non-causal prefill on Hopper: ``BLOCK_M`` query rows of one head as two halves, warp-specialised.

    The same online softmax as ``_attention_fwd_kernel``, written the way
    Triton's automatic warp specialisation on Hopper (3.5 and later) takes
    it: each half of the row block keeps its own ``(acc, l, m)`` (the
    compiler gives each half to one consumer warpgroup while a producer warp
    issues the bulk tensor copies); Q, K, V and the output are tensor
    descriptors made here, on the device, for this program's ``(b, head)``
    and ``(b, head // GROUP)`` (rows past ``Sq`` read as zeros, output rows
    past ``Sq`` are not written); and there is a single key
    loop, without masks: ``Sk`` is a multiple of ``BLOCK_N`` (the host
    checks).  With Triton 3.6 a second loop, a branch inside the loop or Q
    read through pointers made the compiler fail or drop the specialisation,
    and pointer stores of the output came out wrong.  The compiler splits
    each half's rows further between its consumer warpgroups (64 rows each);
    a row position written as ``row0 + tl.arange`` with ``row0`` the offset
    of Q's load came out shifted by that split twice (rows 64.. of a half
    saw keys 64 too far), so a causal or per-row mask here must keep the
    scalar off the row side.
    Grouped-query heads are not packed into rows here: each query head has
    its own programs and K/V tiles are read once per query head, from L2
    mostly.  Half precision, ``D`` a power of two, q, k and v with unit
    stride in ``D`` and 16-byte aligned (the host checks).
    Grid: ``(cdiv(Sq, BLOCK_M), H, B)``.
    """
    HALF: tl.constexpr = BLOCK_M // 2
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    hkv64 = (h // GROUP).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(
        Q + (b64 * stride_qb + h.to(tl.int64) * stride_qh), shape=[Sq, HEAD_DIM], strides=[stride_qm, 1],
        block_shape=[HALF, HEAD_DIM],
    )
    k_desc = tl.make_tensor_descriptor(
        K + (b64 * stride_kb + hkv64 * stride_kh), shape=[Sk, HEAD_DIM], strides=[stride_kn, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
    )
    v_desc = tl.make_tensor_descriptor(
        V + (b64 * stride_vb + hkv64 * stride_vh), shape=[Sk, HEAD_DIM], strides=[stride_vn, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
    )
    q0 = q_desc.load([pid_m * BLOCK_M, 0])
    q1 = q_desc.load([pid_m * BLOCK_M + HALF, 0])
    if NEGATE_Q:
        q0 = _negated(q0)
        q1 = _negated(q1)
    m0 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([HALF], dtype=tl.float32)
    acc0 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)
    m1 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l1 = tl.zeros([HALF], dtype=tl.float32)
    acc1 = tl.zeros([HALF, HEAD_DIM], dtype=tl.float32)

    for start_n in tl.range(0, Sk, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        acc0, l0, m0 = _fold_tile(acc0, l0, m0, q0, k, v, qk_scale, INTERP_BF16)
        acc1, l1, m1 = _fold_tile(acc1, l1, m1, q1, k, v, qk_scale, INTERP_BF16)

    # the output through a descriptor as well: pointer stores after the
    # specialised loop came out wrong on the H200 (Triton 3.6); rows past Sq
    # are not written
    out_ty = Out.dtype.element_ty
    o_desc = tl.make_tensor_descriptor(
        Out + (b64 * stride_ob + h.to(tl.int64) * stride_oh), shape=[Sq, HEAD_DIM], strides=[stride_om, 1],
        block_shape=[HALF, HEAD_DIM],
    )
    o_desc.store([pid_m * BLOCK_M, 0], _normalised(acc0, l0, out_ty, INTERP_BF16))
    o_desc.store([pid_m * BLOCK_M + HALF, 0], _normalised(acc1, l1, out_ty, INTERP_BF16))


# ----------------------------------------------------------------------------
# Autotuning (GPU only; the interpreter runs one small fixed config)
# ----------------------------------------------------------------------------

_TUNE_KEY = ["HEAD_DIM", "GROUP", "CAUSAL", "SPLIT", "ROWS_BUCKET", "KEYS_BUCKET"]

# Two blocks on each SM, so that one block's softmax runs while the other's
# tensor-core work does (Triton cannot overlap them inside one block without
# warp specialisation, which Triton 3.6 fails to compile for this kernel; the
# non-causal case has _attention_ws_kernel for that): 128 x 64
# tiles in 2 stages (96 KiB of shared memory) with one warpgroup per block, or
# with two warpgroups capped at 128 registers a thread (146 uncapped: one block
# per SM).  (BLOCK_M, BLOCK_N, warps, stages, maxnreg); offered from
# _TWO_BLOCKS_MIN_KEYS keys on (see _prune).
_TWO_BLOCKS = ((128, 64, 4, 2, None), (128, 64, 8, 2, 128))
_TWO_BLOCKS_MIN_KEYS = 2048
# Hopper: 128-row blocks feed wgmma well; 64-row and 32-key tiles are the
# fallback for D = 256 and float32, whose tiles do not fit shared memory else.
_PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, maxnreg=r)
    for bm, bn, w, s, r in [
        (128, 64, 4, 3, None),
        (128, 64, 8, 3, None),
        (128, 128, 8, 2, None),
        (128, 128, 8, 3, None),
        (128, 64, 8, 2, None),
        (64, 64, 4, 3, None),
        (64, 32, 4, 2, None),
        *_TWO_BLOCKS,
    ]
]
# Decoding: BLOCK_M is set by the caller (the packed rows, 16..64).
_DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn, w, s in [
        (64, 4, 2),
        (64, 4, 3),
        (128, 4, 2),
        (128, 4, 3),
        (128, 8, 3),
        (32, 4, 2),
    ]
]
# Key tiles of every decode config divide this, so split chunks align to tiles.
_SPLIT_ALIGN = 128
_SPLIT_MIN_KEYS = 256  # fewer keys per chunk are not worth a partial result
DECODE_PROGRAMS_PER_SM = 1  # see _num_splits
_SMEM_BUDGET = 227 * 1024  # shared memory per block on Hopper


def _smem_bytes(bm: int, bn: int, stages: int, block_d: int, elt: int) -> int:
    """Shared memory of a config on sm_90 (half dtypes): Q plus ``stages`` K and V tiles.

    Configs that fit by this count but still fail to compile are dropped by the
    autotuner itself (``OutOfResources``); this only saves their compile time.
    """
    return (bm + 2 * stages * bn) * block_d * elt


def _tile(c: triton.Config) -> tuple:
    """``(BLOCK_M, BLOCK_N, warps, stages, maxnreg)`` of a config, as ``_TWO_BLOCKS`` lists them."""
    return (c.kwargs.get("BLOCK_M"), c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg)


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop configs whose tiles cannot fit in shared memory for this head dim.

    A register cap is only for half-precision tiles up to ``D = 128``: wider or
    float32 accumulators do not fit under it (ptxas fails or spills).  The
    two-blocks-per-SM configs are offered from ``_TWO_BLOCKS_MIN_KEYS`` keys
    on: with fewer keys the autotuner's pick among them was slower than
    without them, so they are not offered there.
    """
    args = {**named_args, **kwargs}
    block_d = args["BLOCK_D"]
    elt = args["Q"].element_size()
    fits = []
    for c in configs:
        bm = c.kwargs.get("BLOCK_M", args.get("BLOCK_M"))
        if c.maxnreg and (block_d > 128 or elt > 2):
            continue
        if _tile(c) in _TWO_BLOCKS and args.get("KEYS_BUCKET", 0) < _TWO_BLOCKS_MIN_KEYS:
            continue
        if _smem_bytes(bm, c.kwargs["BLOCK_N"], c.num_stages, block_d, elt) <= _SMEM_BUDGET:
            fits.append(c)
    if fits:
        return fits
    return [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.num_stages)]


# Autotune timings kept in Triton's cache, so that a second run of an audit or a bench is warm
# (configs with a pre-hook are never cached by Triton; before Triton has the option, nothing is).
_CACHED = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}

_attention_prefill = triton.autotune(
    configs=_PREFILL_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}, **_CACHED
)(_attention_fwd_kernel)


def _set_desc_blocks(nargs: dict) -> None:
    """Autotune pre-hook: K and V descriptors read tiles of the config's ``BLOCK_N`` keys."""
    block = [1, 1, nargs["BLOCK_N"], nargs["BLOCK_D"]]
    nargs["K"].block_shape = block
    nargs["V"].block_shape = block


_attention_prefill_desc = triton.autotune(
    configs=[
        triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, maxnreg=c.maxnreg,
                      pre_hook=_set_desc_blocks)
        for c in _PREFILL_CONFIGS
    ],
    key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune},
)(_attention_fwd_kernel)
_attention_decode = triton.autotune(
    configs=_DECODE_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}, **_CACHED
)(_attention_fwd_kernel)

# Hopper non-causal prefill with warp specialisation (``_attention_ws_kernel``):
# BLOCK_M rows as two halves of BLOCK_M // 2, one warpgroup each.  Two stages is what
# fits shared memory with 128-key tiles; three stages gave wrong results (NaN)
# in two 64-key configs with Triton 3.6 and are not offered.
_WS_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)
    for bm, bn in ((256, 128), (256, 64), (128, 128))
]
_attention_ws = triton.autotune(
    configs=_WS_CONFIGS, key=["HEAD_DIM", "GROUP", "ROWS_BUCKET", "KEYS_BUCKET"], **_CACHED
)(_attention_ws_kernel)
# Head dim of the warp-specialised path (the one it is tuned for; see _use_warp_specialize).
WS_HEAD_DIM = 128
# Fewer query rows than this leave a consumer warpgroup idle: the other kernel.
WS_MIN_QUERIES = 128
_INTERP_WS_BLOCK_M = 32  # two halves of 16 rows, the smallest tl.dot takes
_WS_EVEN_KEYS = 128  # key tiles of every ws config divide this: the ws path takes Sk a multiple of it

# Interpreter: one small config, so that CPU runs stay quick.
_INTERP_BLOCK_M = 16
_INTERP_BLOCK_N = 16
_INTERP_NUM_SMS = 8  # pretend SM count, so that small tests (B * Hkv < 8) exercise split-K


# ----------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints, in plain Python (``triton.cdiv`` costs a call through Triton)."""
    return -(-a // b)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERP_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# Split-K scratch per device: (partials, counters).  Calls on concurrent streams must not share it.
_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# Outgrown workspaces are kept, not freed: a captured CUDA graph may still address them.
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []


def _workspace(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 buffer of at least ``floats`` and an int32 one of at least ``counters`` on ``device``.

    The counters are all zero between calls: each call's last program re-arms
    its own.  So they are zeroed only when allocated, by a host-to-device copy
    rather than a fill kernel (a launch count sees one kernel per call).
    """
    ws = _WORKSPACE.get(device)
    if ws is not None and ws[0].numel() >= floats and ws[1].numel() >= counters:
        return ws
    if ws is not None:
        _OUTGROWN.append(ws)
    old_floats, old_counters = (ws[0].numel(), ws[1].numel()) if ws is not None else (0, 0)
    ws = (torch.empty(max(next_pow2(max(floats, 1)), old_floats), dtype=torch.float32, device=device),
          torch.zeros(max(next_pow2(max(counters, 1024)), old_counters), dtype=torch.int32).to(device))
    _WORKSPACE[device] = ws
    return ws


def _split_scratch(parts: int, block_m: int, block_d: int,
                   counters: int) -> Callable[[torch.device], tuple[torch.Tensor, ...]]:
    """A plan's scratch for split-K: ``(Opart, Mpart, Lpart, Locks)`` of ``parts`` partial row blocks.

    Views of the device's workspace, made again only when it grows (a plan
    launch then costs a dictionary look-up).  Offsets are multiples of 16
    floats, so every pointer stays 16-byte aligned, as Triton specialised it.
    """
    o_size, m_size = parts * block_m * block_d, parts * block_m
    held: list[Any] = [None, ()]

    def scratch(device: torch.device) -> tuple[torch.Tensor, ...]:
        ws = _workspace(device, o_size + 2 * m_size, counters)
        if held[0] is not ws:
            part, locks = ws
            held[:] = ws, (part, part[o_size:], part[o_size + m_size:], locks)
        return held[1]
    return scratch


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"attention: k and v must have one shape (B, Hkv, Sk, D), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    (B, H, _, D), (Bk, Hkv, _, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"attention: batch of k/v ({Bk}) differs from that of q ({B})")
    if Dk != D:
        raise ValueError(f"attention: head dim of k/v ({Dk}) differs from that of q ({D})")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"attention: kv heads ({Hkv}) must divide query heads ({H}) for grouped-query"
        )
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim {D} is outside 1..{MAX_HEAD_DIM}")


@functools.lru_cache(maxsize=4096)
def _num_splits(programs: int, keys: int, device: torch.device) -> tuple[int, int]:
    """Chunks to split ``keys`` into so that about one program runs per SM: ``(n, chunk)``.

    Chunks are multiples of ``_SPLIT_ALIGN`` keys and at least
    ``_SPLIT_MIN_KEYS`` long (under the interpreter, of ``_INTERP_BLOCK_N``).
    One program per SM (``DECODE_PROGRAMS_PER_SM``): more programs an SM
    only add chunks to merge where the kernel, not the host, sets the time.
    ``n = 1`` is one chunk of all the keys.  Cached: a decode step asks it
    once a layer.
    """
    align, min_chunk = (_INTERP_BLOCK_N, _INTERP_BLOCK_N) if interpreting() else (_SPLIT_ALIGN, _SPLIT_MIN_KEYS)
    n = min(cdiv(DECODE_PROGRAMS_PER_SM * _num_sms(device), programs), cdiv(keys, min_chunk))
    if n <= 1:
        return 1, max(keys, 1)
    chunk = cdiv(cdiv(keys, n), align) * align
    return cdiv(keys, chunk), chunk


def _tma_compatible(t: torch.Tensor, block_d: int) -> bool:
    """Whether the copy engine can read ``(B, Hkv, Sk, D)`` k or v in ``(keys, D)`` tiles.

    The bulk tensor copy needs a 16-byte aligned base, 16-byte multiples for
    every stride but the last, unit stride in ``D`` and ``D`` a whole tile.
    """
    elt = t.element_size()
    return not (
        t.shape[-1] != block_d
        or t.stride(-1) != 1
        or t.data_ptr() % 16
        or any(s * elt % 16 for s in t.stride()[:-1])
        or 0 in t.shape
    )


def _descriptor(t: torch.Tensor, block_d: int) -> TensorDescriptor | None:
    """A host tensor descriptor of ``(B, Hkv, Sk, D)`` k or v, or ``None`` where the copy engine cannot read it."""
    if TensorDescriptor is None or not _tma_compatible(t, block_d):
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, block_d])


def _use_descriptors(q: torch.Tensor, decode: bool, interp: bool) -> bool:
    """K/V through tensor descriptors: half-precision prefill at ``D = 128`` on Hopper or newer.

    Descriptors help at ``D = 128`` and not at ``D = 64``, which keeps pointer
    loads.  Under the interpreter too, so CPU tests cover the path.
    ``FUSEAUDIT_ATTENTION_TMA=0`` turns it off (pointer loads everywhere).
    """
    if decode or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != DESCRIPTOR_HEAD_DIM:
        return False
    if os.environ.get("FUSEAUDIT_ATTENTION_TMA", "1") == "0":
        return False
    return interp or torch.cuda.get_device_capability(q.device)[0] >= 9


@functools.cache
def _triton_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed Triton."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return major, minor


@functools.cache
def _hopper_warp_specialization() -> bool:
    """Whether this Triton warp-specialises attention loops on Hopper (3.5 and later).

    Triton 3.4 has the ``warp_specialize`` loop option for Blackwell only.
    """
    return _triton_release() >= (3, 5) and hasattr(tl, "make_tensor_descriptor")


def gluon_verified() -> bool:
    """Whether this Triton is one the Gluon kernel ran on (``attention_hopper.VERIFIED_TRITON``)."""
    return attention_hopper is not None and _triton_release() in attention_hopper.VERIFIED_TRITON


def _use_warp_specialize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decode: bool, interp: bool, *, causal: bool
) -> bool:
    """Non-causal prefill through ``_attention_ws_kernel``: half precision, ``D = 128``, Hopper.

    q, k and v must be readable by the copy engine, there must be at least
    ``WS_MIN_QUERIES`` queries, and ``Sk`` a multiple of ``_WS_EVEN_KEYS``.
    There it is faster than the general kernel, its softmax overlapping the
    matrix products.  Only on Hopper (compute capability 9.x), the
    architecture it is written for; under the interpreter too, so that CPU
    tests cover the kernel.  ``FUSEAUDIT_ATTENTION_WS=0`` turns it off.

    Ragged keys and causal attention keep the other kernel, which masks only
    the tiles that need it; here every tile would take the mask, which costs
    more than the specialisation gains.
    """
    if decode or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != WS_HEAD_DIM:
        return False
    if causal or k.shape[2] % _WS_EVEN_KEYS != 0:
        return False
    if q.shape[2] < (_INTERP_WS_BLOCK_M if interp else WS_MIN_QUERIES):
        return False
    if os.environ.get("FUSEAUDIT_ATTENTION_WS", "1") == "0":
        return False
    if not all(_tma_compatible(t, WS_HEAD_DIM) for t in (q, k, v)):
        return False
    if interp:
        return hasattr(tl, "make_tensor_descriptor")
    return torch.cuda.get_device_capability(q.device)[0] == 9 and _hopper_warp_specialization()


# Causal attention with min(Sq, Sk) below this keeps the general kernel (see _gluon_scope).
GLUON_CAUSAL_MIN_KEYS = 1024


def _gluon_scope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decode: bool, *, causal: bool,
                 scale: float) -> bool:
    """Whether a call is in the Gluon kernel's scope (``fuseaudit/kernels/attention_hopper.py``), device aside.

    Half-precision prefill at ``D = 128`` with at least ``WS_MIN_QUERIES``
    queries and a key, ``scale >= 0``, and q, k and v readable by the copy
    engine; any ``Sk``, grouped-query.  Causal from ``GLUON_CAUSAL_MIN_KEYS``
    keys (``min(Sq, Sk)``) on: below that its programs are a few tiles long
    and the general kernel, two blocks an SM, is faster; non-causal calls
    are faster on Gluon at every length in scope.
    """
    if attention_hopper is None or decode or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] != attention_hopper.HEAD_DIM or scale < 0:
        return False
    if q.shape[2] < WS_MIN_QUERIES or k.shape[2] == 0:
        return False
    if causal and min(q.shape[2], k.shape[2]) < GLUON_CAUSAL_MIN_KEYS:
        return False
    return all(_tma_compatible(t, attention_hopper.HEAD_DIM) for t in (q, k, v))


def _use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decode: bool, interp: bool, *,
               causal: bool, scale: float) -> bool:
    """Prefill through the Gluon kernel: in its scope, on Hopper, with a Triton it ran on.

    There it is the fastest of the attention kernels, causal and non-causal.
    Gluon has no interpreter, so CPU runs never take it
    (``test_compile_attention_hopper`` compiles it for sm_90 there).  Only
    with the Triton releases it ran on (``gluon_verified``: Gluon's API
    moves between releases).  ``FUSEAUDIT_ATTENTION_GLUON=0`` turns it off.
    """
    if interp or not q.is_cuda or not gluon_verified() or os.environ.get("FUSEAUDIT_ATTENTION_GLUON", "1") == "0":
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9 and _gluon_scope(
        q, k, v, decode, causal=causal, scale=scale)


def _scratch_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for on-device tensor descriptors (Triton asks for it at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for on-device tensor descriptors unless the caller set one.

    Triton keeps the allocator in a context variable, so a thread that never
    set one (a worker thread, say) sees none: checked at every call.
    """
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
    except ImportError:  # a Triton without the context variable: set ours
        triton.set_allocator(_scratch_allocator)
        return
    if isinstance(_allocator.get(), NullAllocator):
        triton.set_allocator(_scratch_allocator)


def _launch_ws(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
    scale: float, config: triton.Config | None, interp: bool,
) -> None:
    """Run ``_attention_ws_kernel`` (non-causal) into ``out``: autotuned, or one given config."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    keys = Sk
    args = (
        q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        Sq, Sk, abs(scale) * LOG2E, next_pow2(max(Sq, 16)), next_pow2(max(keys, 16)),
    )
    meta = dict(
        HEAD_DIM=D, GROUP=H // Hkv, NEGATE_Q=scale < 0, WARP_SPECIALIZE=True,
        INTERP_BF16=interp and q.dtype == torch.bfloat16,
    )

    def grid(meta: dict) -> tuple[int, int, int]:
        return (triton.cdiv(Sq, meta["BLOCK_M"]), H, B)

    if interp:
        _attention_ws_kernel[grid](*args, **meta, BLOCK_M=_INTERP_WS_BLOCK_M, BLOCK_N=_INTERP_BLOCK_N)
        return
    _ensure_allocator()
    if config is not None or os.environ.get("FUSEAUDIT_AUTOTUNE", "1") == "0":
        cfg = config or _WS_CONFIGS[0]
        _attention_ws_kernel[grid](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _attention_ws[grid](*args, **meta)


_WS_CONFIG_ERROR = (
    "attention: a warp-specialised config needs non-causal half-precision prefill at D = 128 "
    f"with Sk a multiple of {_WS_EVEN_KEYS} and q, k, v the copy engine can read, on Hopper"
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    ``q`` is ``(B, H, Sq, D)``; ``k`` and ``v`` are ``(B, Hkv, Sk, D)`` with
    ``Hkv`` dividing ``H`` (query head ``h`` reads kv head ``h // (H // Hkv)``).
    ``causal`` is top-left aligned (query ``i`` sees keys ``j <= i``).  ``scale``
    defaults to ``1 / sqrt(D)``.  Any strided views; one kernel launch; returns a
    new contiguous ``(B, H, Sq, D)`` tensor of q's dtype.

    On a GPU the tiles are autotuned; ``FUSEAUDIT_AUTOTUNE=0`` takes the first
    config that fits instead (property tests compile one config per shape class).
    """
    return attention_with_config(q, k, v, causal, scale, config=None)


def attention_with_config(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    config: triton.Config | None,
) -> torch.Tensor:
    """:func:`attention` with one given tile config (GPU; ``None``: autotuned)."""
    found = _kept_decode(q, k, v, bool(causal), scale, config)
    if found is None:
        return _attention(q, k, v, bool(causal), scale, config)
    plan, sk, split_len = found
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan.launch(q, k, v, out, sk, split_len)
    return out


def _kept_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                 config: triton.Config | None) -> tuple[Plan, int, int] | None:
    """A decode call's kept plan (``_launch.py``) with its ``Sk`` and ``split_len``; None for any other call.

    A decode step differs from the one before only in ``Sk``, the keys of a
    growing cache: the plan is kept by everything else (q's layout, k's and
    v's but for ``Sk``), by what ``Sk`` decides (the splits, the autotune
    bucket) and by what Triton specialises ``Sk`` and ``split_len`` on (one,
    a multiple of 16).  ``Sk`` and ``split_len`` are passed at each launch.
    Anything that is not a well-formed decode call takes the full path,
    which says what is wrong with it.
    """
    if not _launch.ENABLED:
        return None
    try:
        B, H, Sq, _ = q.shape
        Bk, Hkv, sk, Dk = k.shape
        rows = Sq * (H // Hkv)
        if not 0 < rows <= DECODE_MAX_ROWS or v.shape != k.shape:
            return None
        device = q.device
        keys = min(sk, Sq) if causal else sk
        n, split_len = _num_splits(B * Hkv, keys, device)
        layout = (causal, scale, config, n, next_pow2(max(min(keys, split_len), 16)),
                  sk % 16 == 0, sk == 1, split_len % 16 == 0, split_len == 1,
                  Bk, Hkv, Dk, k.stride(), v.stride(), k.dtype, v.dtype, k.get_device(), v.get_device(),
                  k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    plan = planned(layout, (q,), _decode_plan, q, k, v, causal, scale, config, n, split_len)
    return None if plan is None else (plan, sk, split_len)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
               config: triton.Config | None) -> torch.Tensor:
    """Every call's full path: check, choose the kernel, allocate, launch."""
    check_tensors("attention", q=q, k=k, v=v)
    _check_shapes(q, k, v)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out

    group = H // Hkv
    rows = Sq * group  # query rows of one program's kv head
    block_d = max(16, next_pow2(D))  # tl.dot needs >= 16
    keys = min(Sk, Sq) if causal else Sk  # keys the last row can see
    interp = interpreting()
    decode = rows <= DECODE_MAX_ROWS
    if decode:
        n, split_len = _num_splits(B * Hkv, keys, q.device)
        _decode_plan(q, k, v, causal, scale, config, n, split_len).launch(q, k, v, out, Sk, split_len)
        return out

    if config is None and _use_gluon(q, k, v, decode, interp, causal=causal, scale=scale):
        attention_hopper.attention_into(q, k, v, out, causal=causal, qk_scale=scale * LOG2E)
        return out
    ws_config = config is not None and any(config is c for c in _WS_CONFIGS)
    use_ws = (ws_config or config is None) and _use_warp_specialize(q, k, v, decode, interp, causal=causal)
    if ws_config and not use_ws:
        raise ValueError(_WS_CONFIG_ERROR)
    if ws_config or (config is None and use_ws):
        _launch_ws(q, k, v, out, scale=scale, config=config, interp=interp)
        return out

    def grid(meta: dict) -> tuple[int, int, int]:
        return (cdiv(rows, meta["BLOCK_M"]), Hkv, B)

    k_arg, v_arg = k, v
    if _use_descriptors(q, decode, interp):
        k_desc, v_desc = _descriptor(k, block_d), _descriptor(v, block_d)
        if k_desc is not None and v_desc is not None:
            k_arg, v_arg = k_desc, v_desc
    use_desc = k_arg is not k

    args = (
        q, k_arg, v_arg, out, out, out, out, out, Sk, max(Sk, 1),  # no split-K: the scratch is not read
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Sq, abs(scale) * LOG2E, 1, next_pow2(max(rows, 16)), next_pow2(max(keys, 16)),
    )
    meta = _constexprs(q, group=group, causal=causal, split=False, scale=scale, use_desc=use_desc, interp=interp)
    if interp:
        if use_desc:
            _set_desc_blocks({"K": k_arg, "V": v_arg, "BLOCK_N": _INTERP_BLOCK_N, "BLOCK_D": block_d})
        _attention_fwd_kernel[grid](*args, **meta, BLOCK_M=_INTERP_BLOCK_M, BLOCK_N=_INTERP_BLOCK_N)
    elif config is not None or os.environ.get("FUSEAUDIT_AUTOTUNE", "1") == "0":
        # one fixed config, no autotuning: the first that fits, or the one asked for
        cfg = config or _prune(_PREFILL_CONFIGS, {"BLOCK_D": block_d, "Q": q})[0]
        if use_desc:
            _set_desc_blocks({"K": k_arg, "V": v_arg, "BLOCK_N": cfg.kwargs["BLOCK_N"], "BLOCK_D": block_d})
        _attention_fwd_kernel[grid](*args, **meta, **cfg.kwargs, **_options(cfg))
    elif use_desc:
        _attention_prefill_desc[grid](*args, **meta)
    else:
        _attention_prefill[grid](*args, **meta)
    return out


def _constexprs(q: torch.Tensor, *, group: int, causal: bool, split: bool, scale: float, use_desc: bool,
                interp: bool) -> dict[str, Any]:
    """``_attention_fwd_kernel``'s constexprs but the tile's."""
    D = q.shape[-1]
    return dict(
        HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), GROUP=group, CAUSAL=causal, SPLIT=split,
        NEGATE_Q=scale < 0, USE_DESC=use_desc,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERP_BF16=interp and q.dtype == torch.bfloat16,
    )


def _options(cfg: triton.Config) -> dict[str, int]:
    """A config's launch options: warps, stages and, if it has one, a register cap (two blocks per SM)."""
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return options


def _decode_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                 config: triton.Config | None, num_splits: int, split_len: int) -> Plan:
    """Check a decode call and build its launch: ``plan.launch(q, k, v, out, Sk, split_len)``.

    One row block per kv head (``BLOCK_M``: the packed rows, 16 to 64), its
    keys in ``num_splits`` chunks of ``split_len``.  The key tile is
    autotuned (the plan keeps the autotuner's choice), or ``config``'s, or
    with ``FUSEAUDIT_AUTOTUNE=0`` the first that fits.
    """
    check_tensors("attention", q=q, k=k, v=v)
    _check_shapes(q, k, v)
    if config is not None and any(config is c for c in _WS_CONFIGS):
        raise ValueError(_WS_CONFIG_ERROR)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = Sq * (H // Hkv)
    block_m, block_d = max(16, next_pow2(rows)), max(16, next_pow2(D))
    keys = min(Sk, Sq) if causal else Sk
    split = num_splits > 1
    interp = interpreting()
    out_strides = (H * Sq * D, Sq * D, D, 1)  # the contiguous output's
    scalars = (*q.stride(), *k.stride(), *v.stride(), *out_strides, Sq, abs(scale) * LOG2E, num_splits,
               next_pow2(max(rows, 16)), next_pow2(max(min(keys, split_len), 16)))
    meta = dict(_constexprs(q, group=H // Hkv, causal=causal, split=split, scale=scale, use_desc=False,
                            interp=interp), BLOCK_M=block_m)
    scratch = _split_scratch(B * Hkv * num_splits if split else 0, block_m, block_d, B * Hkv)
    grid = (num_splits, Hkv, B)  # one row block per kv head
    if interp:
        kernel, meta["BLOCK_N"] = _attention_fwd_kernel, _INTERP_BLOCK_N
    elif config is not None or os.environ.get("FUSEAUDIT_AUTOTUNE", "1") == "0":
        cfg = config or _prune(_DECODE_CONFIGS, {"BLOCK_D": block_d, "Q": q, "BLOCK_M": block_m})[0]
        kernel = _attention_fwd_kernel
        meta.update({**cfg.kwargs, "BLOCK_M": block_m}, **_options(cfg))
    else:
        kernel = _attention_decode
    return Plan(kernel, grid, *scalars, late=2, scratch=scratch, **meta)
