"""Attention forward on Hopper, warp-specialised by hand: a FlashAttention-3 style kernel in Gluon.

Same maths as ``attention.py`` (read that file first: online softmax in base
2, ``c = scale * log2(e)``, masked keys at ``-inf``), same result; this file
is only *how* the H200 gets to run it near the tensor cores' speed.

Why a second kernel
-------------------
On Hopper the matrix products (``wgmma``) are asynchronous: a warpgroup can
start ``S = Q K^T`` and do softmax arithmetic while the tensor cores work.
Triton's automatic warp specialisation (``_attention_ws_kernel``) gets there
for non-causal attention, but it takes a single loop with no branch, so a
causal mask would run on every tile, and causal attention stays on the
general kernel, far from the tensor cores' speed.  Gluon, Triton's
lower-level language, lets the kernel say who does what:

* a **loader** warp issues the bulk tensor copies (TMA): Q once, then K_i and
  V_i into a ring of ``STAGES`` shared-memory slots, each slot guarded by
  mbarriers (``k_ready`` / ``v_ready``: landed; ``kv_empty``: both consumers
  are done with it);
* two **consumer** warpgroups own 64 query rows each.  Per key tile::

      issue  S_i = Q K_i^T                      (async)
      issue  O  += P_{i-1} V_{i-1}              (async, the previous tile's)
      wait for S_i; softmax of S_i -> P_i, alpha_i, l, m   (tensor cores busy with P V)
      wait for P_{i-1} V_{i-1}; release slot i-1; O *= alpha_i

  so one tile's exponentials overlap the previous tile's product, and the
  other warpgroup's work fills the gaps.

Masks only where needed: each consumer runs the tiles every one of its rows
sees in full without a mask, and only the diagonal (causal) and the ragged
last tile (``Sk`` not a multiple of ``BLOCK_N``; the copy engine returns zeros
past ``Sk``) with one.  Tiles right of a consumer's last row (the other
consumer's diagonal) are released without work.

Layout: q, k, v and the output are 4-D ``(B, H, S, D)`` tensor descriptors
made on the host (any strides the copy engine takes: unit stride in ``D``,
16-byte aligned, e.g. slices of a fused QKV projection or ``(B, S, H, D)``
transposed).  Rows past ``Sq`` load as zeros and are not stored.

Scope: half precision, ``D = 128``, ``scale >= 0`` (a negative scale takes the
other kernels), grouped-query by reading kv head ``h // GROUP``.  Gluon's API
moves between Triton releases (``tma.async_copy_global_to_shared`` became
``tma.async_load``): the names are looked up once below, and the host uses
this kernel only on the Triton versions where it ran on an H200
(``attention._use_gluon``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6 spells the bulk copies async_copy_*; later releases async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

HEAD_DIM = 128
M_WG = 64  # query rows of one consumer warpgroup (wgmma's M is 64 per warpgroup)
CONSUMERS = 2  # BLOCK_M = CONSUMERS * M_WG = 128 rows per program
BLOCK_N = 128  # keys per tile
STAGES = 3  # K/V ring depth: 32 KiB Q + 3 x 64 KiB K/V of the 227 KiB
MAX_REGISTERS = 168  # 12 warps (3 warpgroups) x 32 x 168 <= 64 Ki registers of an SM
# Triton (major, minor) releases this kernel was checked on, on an H200 (Gluon's API moves between releases).
VERIFIED_TRITON = ((3, 6),)


@gluon.constexpr_function
def _acc_layout(n):
    """wgmma accumulator layout of a ``(M_WG, n)`` fp32 tile held by one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
            b, h, hkv, row0, n_tiles,
            M_WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """One warp: Q's row blocks once, then K_i, V_i into slot ``i % STAGES`` once both consumers freed it."""
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        _tma_load(q_desc, [b, h, row0 + c * M_WG, 0], q_bar, q_smem.index(c))
    for i in range(n_tiles):
        slot = i % STAGES
        # a fresh mbarrier counts as having completed the phase before 0: the
        # first STAGES waits pass at once
        mbarrier.wait(kv_empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hkv, i * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [b, hkv, i * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _scores(q, k_smem, k_ready, i, M_WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            STAGES: gl.constexpr):
    """Start ``S = Q K_i^T`` on the tensor cores once K_i has landed (returns a token)."""
    mbarrier.wait(k_ready.index(i % STAGES), (i // STAGES) & 1)
    k = k_smem.index(i % STAGES).reshape([BLOCK_N, HEAD_DIM])
    return warpgroup_mma(q, k.permute((1, 0)), gl.zeros([M_WG, BLOCK_N], gl.float32, _acc_layout(BLOCK_N)),
                         use_acc=False, is_async=True)


@gluon.jit
def _softmax(qk, m_i, l_i, i, rows, Sk, qk_scale, dtype: gl.constexpr, MASKED: gl.constexpr,
             CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The online-softmax step of tile ``i``: ``(P as the next wgmma's A operand, alpha, l, m)``."""
    if MASKED:
        keys = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, _acc_layout(BLOCK_N)))
        keep = (keys < Sk)[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= rows[:, None])
        qk = gl.where(keep, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)  # qk_scale >= 0
        m_ref = m_new
    p = gl.exp2(gl.fma(qk, qk_scale, -m_ref[:, None]))
    alpha = gl.exp2(m_i - m_ref)
    l_i = l_i * alpha + gl.sum(p, 1)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    p = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), l_i, m_new


@gluon.jit
def _pipelined_tile(acc, l_i, m_i, p, q, k_smem, v_smem, k_ready, v_ready, kv_empty, i, rows, Sk, qk_scale,
                    MASKED: gl.constexpr, CAUSAL: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Tile ``i``'s scores and softmax while the tensor cores add tile ``i - 1``'s ``P V``."""
    qk = _scores(q, k_smem, k_ready, i, M_WG, BLOCK_N, HEAD_DIM, STAGES)
    prev = i - 1
    mbarrier.wait(v_ready.index(prev % STAGES), (prev // STAGES) & 1)
    v = v_smem.index(prev % STAGES).reshape([BLOCK_N, HEAD_DIM])
    acc = warpgroup_mma(p, v, acc, is_async=True)
    qk = warpgroup_mma_wait(1, deps=[qk])  # S_i done, P_{i-1} V_{i-1} may still run
    p_next, alpha, l_i, m_i = _softmax(qk, m_i, l_i, i, rows, Sk, qk_scale, v_smem.dtype, MASKED, CAUSAL,
                                       BLOCK_N, HEAD_DIM)
    acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # P_{i-1} stays in its registers until then
    mbarrier.arrive(kv_empty.index(prev % STAGES), count=1)
    return acc * alpha[:, None], l_i, m_i, p_next


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              b, h, row0, n_tiles, Sq, Sk, qk_scale,
              WG: gl.constexpr, CAUSAL: gl.constexpr, M_WG: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: query rows ``row0 + WG * M_WG ...`` against the key tiles, then its output rows."""
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    first = row0 + WG * M_WG
    rows = first + gl.arange(0, M_WG, gl.SliceLayout(1, _acc_layout(BLOCK_N)))
    if CAUSAL:
        # keys j <= row: tiles up to this warpgroup's last row, whole below its first
        last = gl.minimum(first + M_WG, Sq) - 1
        n_mine = gl.minimum(gl.cdiv(gl.minimum(last + 1, Sk), BLOCK_N), n_tiles)
        n_full = gl.minimum(gl.minimum(first + 1, Sk) // BLOCK_N, n_mine)
    else:
        n_mine = n_tiles
        n_full = Sk // BLOCK_N
    m_i = gl.full([M_WG], float("-inf"), gl.float32, gl.SliceLayout(1, _acc_layout(BLOCK_N)))
    l_i = gl.zeros([M_WG], gl.float32, gl.SliceLayout(1, _acc_layout(BLOCK_N)))
    acc = gl.zeros([M_WG, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(WG).reshape([M_WG, HEAD_DIM])

    # tile 0 on its own, masked (right whether it needs the mask or not; one tile)
    qk = warpgroup_mma_wait(0, deps=[_scores(q, k_smem, k_ready, 0, M_WG, BLOCK_N, HEAD_DIM, STAGES)])
    p, _, l_i, m_i = _softmax(qk, m_i, l_i, 0, rows, Sk, qk_scale, v_smem.dtype, True, CAUSAL,
                              BLOCK_N, HEAD_DIM)  # alpha: nothing summed yet
    for i in range(1, n_full):  # every row sees every key: no mask
        acc, l_i, m_i, p = _pipelined_tile(acc, l_i, m_i, p, q, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                           i, rows, Sk, qk_scale, False, CAUSAL, M_WG, BLOCK_N, HEAD_DIM, STAGES)
    for i in range(gl.maximum(n_full, 1), n_mine):  # the diagonal, the ragged last tile
        acc, l_i, m_i, p = _pipelined_tile(acc, l_i, m_i, p, q, k_smem, v_smem, k_ready, v_ready, kv_empty,
                                           i, rows, Sk, qk_scale, True, CAUSAL, M_WG, BLOCK_N, HEAD_DIM, STAGES)
    last_tile = n_mine - 1
    mbarrier.wait(v_ready.index(last_tile % STAGES), (last_tile // STAGES) & 1)
    v = v_smem.index(last_tile % STAGES).reshape([BLOCK_N, HEAD_DIM])
    acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(p, v, acc, is_async=True)])
    mbarrier.arrive(kv_empty.index(last_tile % STAGES), count=1)
    for i in range(n_mine, n_tiles):
        # right of this warpgroup's last row: nothing to add.  Release each tile
        # once it has landed (an earlier arrival would count towards the slot's
        # previous use, which the other warpgroup may still be reading)
        mbarrier.wait(k_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.wait(v_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(i % STAGES), count=1)

    # O = acc / l through this warpgroup's Q buffer (read by its last wgmma,
    # which has completed) and one bulk store; rows past Sq are not written
    l_o = gl.convert_layout(gl.where(l_i == 0.0, 1.0, l_i), gl.SliceLayout(1, o_layout))
    o_smem = q_smem.index(WG)
    o_smem.reshape([M_WG, HEAD_DIM]).store((acc / l_o[:, None]).to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, first, 0], o_smem)
    tma.store_wait(0)


@gluon.jit
def attention_hopper_kernel(q_desc, k_desc, v_desc, o_desc, Sq, Sk, qk_scale,
                            GROUP: gl.constexpr, CAUSAL: gl.constexpr, M_WG: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``CONSUMERS * M_WG`` query rows of head ``h`` of batch entry ``b``.  Grid: ``(cdiv(Sq, BLOCK_M), H, B)``."""
    gl.static_assert(CONSUMERS == 2, "the partitions below are written for two consumer warpgroups")
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = CONSUMERS * M_WG
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    if CAUSAL:
        pid_m = gl.cdiv(Sq, BLOCK_M) - 1 - pid_m  # the row blocks that see the most keys first
    row0 = pid_m * BLOCK_M
    if CAUSAL:
        hi = gl.minimum(gl.minimum(row0 + BLOCK_M, Sq), Sk)  # keys j <= the block's last row
    else:
        hi = Sk
    n_tiles = gl.cdiv(hi, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, 1, 1, M_WG, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=CONSUMERS)  # both consumers release a slot

    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    gl.warp_specialize([
        (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                     b, h, row0, n_tiles, Sq, Sk, qk_scale, WG0, CAUSAL, M_WG, BLOCK_N, HEAD_DIM, STAGES)),
        (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                     b, h, row0, n_tiles, Sq, Sk, qk_scale, WG1, CAUSAL, M_WG, BLOCK_N, HEAD_DIM, STAGES)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                   b, h, h // GROUP, row0, n_tiles, M_WG, BLOCK_N, STAGES, CONSUMERS)),
    ], [4, 1], [240, 24])  # registers: the second consumer's, the loader's (the first gets the rest)


# ----------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@functools.cache
def _shared_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a ``(1, 1, rows, head_dim)`` tile (cached: made once per shape)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], _GL_DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 4-D ``(B, H, S, D)`` descriptor of ``t`` read or written ``rows`` rows of one head at a time."""
    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(rows, t.shape[-1], t.dtype))


def attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *,
                   causal: bool, qk_scale: float) -> None:
    """Run the kernel into ``out`` (``(B, H, Sq, D)``); ``qk_scale = scale * log2(e) >= 0``.

    The caller checks the scope (``attention._use_gluon``): half precision,
    ``D = 128``, q/k/v/out readable by the copy engine, ``Sq, Sk >= 1``.
    """
    B, H, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    grid = (triton.cdiv(Sq, CONSUMERS * M_WG), H, B)
    attention_hopper_kernel[grid](
        descriptor(q, M_WG), descriptor(k, BLOCK_N), descriptor(v, BLOCK_N), descriptor(out, M_WG),
        Sq, Sk, qk_scale,
        GROUP=H // Hkv, CAUSAL=bool(causal), M_WG=M_WG, BLOCK_N=BLOCK_N, STAGES=STAGES, CONSUMERS=CONSUMERS,
        num_warps=4, maxnreg=MAX_REGISTERS,
    )
