# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels are untyped by nature.)
"""Decode attention over a request's fp16 pool tiles (the sink and the in-progress tile), in
a launch of its own beside the main loop's (``variant="v4d"`` and the Gluon variants).

The main loops read packed records only; the tokens a request still keeps in fp16 (the side
pool's blocks) are this kernel's: one program per (request, KV head) finds the request's
pool-resident blocks with a vectorized scan of its block-table row, attends to them with a
plain flash-decoding loop (``[rows, D] x [D, BN]`` scores, an online softmax, ``[rows, BN] x
[BN, D]`` outputs, across the program's warps) and writes one more partial (output and base-2
LSE) for the split merge.

Why not v4's pool phase (``decode_v4_kernel(PHASES=2)``, which the launches used until the
twenty-third session): its warps each hold their own ``G / W`` rows, online softmax state
and four V-field accumulators, 255 registers a thread (52 bytes spilled) at 4 warps, so two
of its programs fill an SM's registers and the main loop's programs wait for them
(docs/kernel-notes.md, twenty-second session). Here one state per program, the accumulator in
the natural channel order and a ``BN``-token chunk of K and V in flight: 166 registers at BN
64 and 4 warps, no spill (static count), and the served decode plan 0.95x at B = 64 / 16K,
0.89x at B = 256 / 4K (H200, twenty-third session).

Numerics as v4's pool phase: the query row-normalized to fp16 (its row maximum multiplies the
fp32 scores), probabilities in fp16 unscaled, fp32 accumulators; pool rows past the request's
length are masked at the load (a pool slot's stale rows and a shadowed block's record bytes
may be anything, NaN included).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._common import pool_row_ptrs
from kvarn_kernels.decode_v4 import _pool_window

__all__ = [
    "POOL_CHUNK_TOKENS",
    "POOL_MAX_REGISTERS",
    "POOL_STAGES",
    "POOL_WARPS",
    "decode_pool_kernel",
]

#: Tokens of a pool tile per step (their K and V in flight together: 32 KB at head dim 128).
POOL_CHUNK_TOKENS = 64
#: Warps per program.
POOL_WARPS = 4
#: Software-pipeline stages of a tile's chunk loop: 2 copies a tile's next chunk into shared
#: memory while this one is attended to (static count, k4v2_g128: 148 registers, 38 KB of
#: shared memory, against 166 and 22 KB at 1). The default since the thirty-fourth session
#: (H100, ``scripts/decode_pool_ab.py``): the served decode plan 0.986-0.989x the 1-stage
#: kernel's time at B = 256 / 4K-6K, 0.995x at B = 64 / 16K, 0.986x at B = 8 / 16K, outputs
#: bit-identical.
POOL_STAGES = 2
#: Registers per thread the launch may take (Triton's ``maxnreg``), or None for the compiler's
#: choice.
POOL_MAX_REGISTERS: int | None = None


# part is 1 for a one-split launch, which Triton would make a constant (an int, no .to)
@triton.jit(do_not_specialize=["part"])
def decode_pool_kernel(
    Q,
    KV,
    POOL_K,
    POOL_V,
    BLOCK_TABLE,
    SEQ_LENS,
    BLOCK_TO_SLOT,
    O_PART,
    LSE_PART,
    qk_scale,
    stride_bt,
    n_rows_total,
    part,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    SHADOW: tl.constexpr,
    STRIDE: tl.constexpr,
    BN: tl.constexpr,
    SCAN: tl.constexpr,
    STAGES: tl.constexpr = 1,
):
    """One program per (request, KV head): attention of the ``QPK`` query rows of ``Q``
    (rotated, fp32, ``[B * HQ, D]``) over the request's pool-resident blocks, written as
    partial ``part`` of ``O_PART`` (``[parts, n_rows_total, D]``, normalized) and ``LSE_PART``
    (``[parts, n_rows_total]``, base 2; ``-inf`` when the request has no pool rows).
    ``qk_scale`` is the softmax scale times ``log2(e)``."""
    tl.static_assert(G % BN == 0, "a pool tile must be whole chunks")
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + b)
    qi = tl.arange(0, BLOCK_Q)
    dd = tl.arange(0, D)
    q_ok = qi < QPK
    rows = b.to(tl.int64) * HQ + h * QPK + qi
    q = tl.load(Q + rows[:, None] * D + dd[None, :], mask=q_ok[:, None], other=0.0) * qk_scale
    qmax = tl.max(tl.abs(q), axis=1)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    q16 = (q / qmax[:, None]).to(tl.float16)

    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    n_blocks = tl.cdiv(seq_len, G)
    sc = tl.arange(0, SCAN)
    tn = tl.arange(0, BN)
    for g0 in range(0, n_blocks, SCAN):
        idx, blks, slots, is_pool, rank = _pool_window(bt_row, BLOCK_TO_SLOT, g0 + sc, n_blocks)
        for k in range(0, tl.sum(is_pool.to(tl.int32), axis=0)):
            sel = is_pool & (rank == k)
            pbi = tl.sum(tl.where(sel, idx, 0), axis=0)
            pslot = tl.sum(tl.where(sel, slots, 0), axis=0).to(tl.int64)
            pblk = tl.sum(tl.where(sel, blks, 0), axis=0).to(tl.int64)
            # the tile's live rows only: an in-progress tile skips its empty chunks
            n_live = tl.minimum(seq_len - pbi * G, G)
            for t0 in tl.range(0, n_live, BN, num_stages=STAGES):
                trow = (t0 + tn).to(tl.int64)
                live = pbi * G + trow < seq_len  # [BN]
                kr = pool_row_ptrs(POOL_K, KV, pslot, pblk, trow, h, 0, HK, D, G, SHADOW, STRIDE)
                vr = pool_row_ptrs(POOL_V, KV, pslot, pblk, trow, h, 1, HK, D, G, SHADOW, STRIDE)
                # both loads first: one chunk's K and V in flight together
                kt = tl.load(kr[:, None] + dd[None, :], mask=live[:, None], other=0.0)
                vt = tl.load(vr[:, None] + dd[None, :], mask=live[:, None], other=0.0)
                s = tl.dot(q16, tl.trans(kt)) * qmax[:, None]  # [BLOCK_Q, BN]
                s = tl.where(live[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_acc = l_acc * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vt)
                m = m_new
    l_safe = tl.where(l_acc > 0, l_acc, 1.0)
    lse = tl.where(l_acc > 0, m + tl.log2(l_safe), float("-inf"))
    out_row = part.to(tl.int64) * n_rows_total + rows
    tl.store(O_PART + out_row[:, None] * D + dd[None, :], acc / l_safe[:, None], mask=q_ok[:, None])
    tl.store(LSE_PART + out_row, lse, mask=q_ok)
