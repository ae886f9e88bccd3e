# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels are untyped by nature.)
"""Fused prefill with cached context for short chunks: packed records read in the attention
loop, every tile dequantized once per program (``prefill_attention(method="fused")``).

A short chunk after a long context (an agent's turn: 64 tokens after 16K) is where the
dequantize-then-FlashAttention path costs the most: it writes and reads the whole context in
fp16 for a few query rows. This kernel reads the packed bytes instead:

* one program per (query tile of ``BLOCK_M`` rows = ``BQ`` tokens x ``QPK_P`` heads of one KV
  head, KV head, split of the context): the GQA heads share the tile, so each context chunk
  is unpacked once for all of a KV head's query heads and ``BQ`` tokens;
* each ``BN``-token chunk of a record is dequantized in registers to the same fp16 values the
  dequantize path writes (``k / 2`` and ``v / 2``: every value the codec can write stays
  inside fp16), then a plain flash-attention step runs on it: ``[BLOCK_M, D] x [D, BN]``
  scores, a base-2 online softmax, ``[BLOCK_M, BN] x [BN, D]`` into an fp32 accumulator;
* pool-resident blocks (the sink, the in-progress tile, the chunk's own tiles) are read in
  fp16 from the side pool, halved the same way;
* the next chunk's record bytes and scales are loaded before the current chunk is computed;
* split-K over the context: each split writes a normalized partial and its base-2 LSE, which
  ``attention._merge_unrotate_kernel`` merges and un-rotates (as for the v1 kernel).

Where v1's prefill (``attention._attn_kernel``) folds the record's scales into the queries and
probabilities (``BLOCK_M x D`` and ``BLOCK_M x BN`` work per chunk, per query tile), this one
scales the codes (``D x BN`` per chunk): cheaper whenever a tile holds at least as many rows
as a chunk has tokens, which is the short-chunk case with 128-row tiles.

On an H200 (twenty-fourth session) it takes 0.38-0.45x v1's time at the same split count and
3.2x FA3 fp16's at 64 tokens after 16K (B = 1), waiting on each wgmma in turn (1.05
instructions a cycle); :mod:`kvarn_kernels.prefill_v3` (Gluon) overlaps the MMA with the
dequantization and takes its place where it applies.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._common import PREFILL_UNSPECIALIZED, pool_row_ptrs
from kvarn_kernels.attention import _codes_f16, _load_chunk, _prefill_tile

__all__ = ["PREFILL_V2_WARPS", "default_block_m", "prefill_v2_kernel"]

#: Warps per program.
PREFILL_V2_WARPS = 8

_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)


def default_block_m(head_dim: int) -> int:
    """Query rows (tokens x padded GQA heads) per program: 128, or 64 above head dim 128
    (the ``[rows, D]`` fp32 accumulator; static count at head dim 256 and 8 warps: 1,988
    bytes of spill at 128 rows, 320 at 64)."""
    return 128 if head_dim <= 128 else 64


@triton.jit
def _f16_saturated(x, FAST: tl.constexpr):
    """fp32 to fp16 with finite values beyond fp16's range clamped to +-65504 (one
    ``cvt.rn.satfinite`` per pair on the GPU: the two-sided clamp cost two instructions per
    value, 10% of the loop)."""
    if FAST:
        y = tl.inline_asm_elementwise(
            "cvt.rn.satfinite.f16x2.f32 $0, $2, $1;",
            "=r,f,f",
            [x],
            dtype=tl.float16,
            is_pure=True,
            pack=2,
        )
    else:
        y = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX).to(tl.float16)
    return y


@triton.jit
def _record_kv(
    k0,
    k1,
    v0,
    v1,
    ks,
    kz,
    kt,
    vcs,
    vs,
    vz,
    BN: tl.constexpr,
    D: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
):
    """A record chunk's ``k / 2`` as ``[D, BN]`` and ``v / 2`` as ``[BN, D]`` fp16 (the
    reference decoder's fp32 operations; ``_codes_f16`` gives ``1024 + code``)."""
    kc = _codes_f16(k0, k1, BN, KB, FAST_UNPACK).to(tl.float32)
    # k = (code * k_scale + k_zero) * k_token_scale, with code = kc - 1024
    k = kc * ks[:, None] + (kz - 1024.0 * ks)[:, None]
    k = k * (0.5 * kt)[None, :]
    k16 = _f16_saturated(k, FAST_UNPACK)
    vc = _codes_f16(v0, v1, D, VB, FAST_UNPACK).to(tl.float32)
    # v = (code * v_scale + v_zero) * v_channel_scale
    v = vc * vs[:, None] + (vz - 1024.0 * vs)[:, None]
    v = v * (0.5 * vcs)[None, :]
    v16 = _f16_saturated(v, FAST_UNPACK)
    return k16, v16


@triton.jit
def _attend_chunk(
    q16, k16, v16, row_scale, q_pos, m_i, l_i, acc, t0, pos_lo, kv_len, BN: tl.constexpr
):
    """One flash-attention step over keys ``t0 .. t0 + BN - 1`` (``k16`` ``[D, BN]``, ``v16``
    ``[BN, D]``, both halved): the new softmax state and accumulator."""
    tn = tl.arange(0, BN)
    raw = tl.dot(q16, k16)  # [BLOCK_M, BN]; the score is raw * row_scale
    if t0 + BN - 1 > pos_lo:  # some row of the tile must not see some key of the chunk
        keep = ((t0 + tn)[None, :] <= q_pos[:, None]) & ((t0 + tn) < kv_len)[None, :]
        raw = tl.where(keep, raw, float("-inf"))
    # row_scale > 0, so the row maximum of the scores is row_scale times raw's
    m_new = tl.maximum(m_i, tl.max(raw, axis=1) * row_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(raw * row_scale[:, None] - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v16)
    return m_new, l_i, acc


@triton.jit(**PREFILL_UNSPECIALIZED)
def prefill_v2_kernel(
    Q,
    KV,
    POOL_K,
    POOL_V,
    BLOCK_TABLE,
    SEQ_LENS,
    BLOCK_TO_SLOT,
    QSL,
    O_PART,
    LSE_PART,
    qk_scale,
    stride_bt,
    n_rows_total,
    num_reqs,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    QPK: tl.constexpr,
    QPK_P: tl.constexpr,
    BQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    B_P: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    SHADOW: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    STRIDE: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    K_ORDER: tl.constexpr,
    V_ORDER: tl.constexpr,
    BN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
):
    """Program (tile ``pid``, KV head ``h``, split): rows of ``Q`` (rotated, fp32 ``[T * HQ,
    D]``) attend causally to their request's context, written as partial ``split`` of
    ``O_PART`` (``[NUM_SPLITS, n_rows_total, D]``, normalized) and ``LSE_PART`` (base 2;
    ``-inf`` for a split with no context). ``qk_scale`` is the softmax scale times
    ``log2(e)``. The grid's first axis is ``cdiv(T, BQ) + num_reqs`` (request ``r``'s tiles
    start at ``qsl[r] // BQ + r``, an upper bound of the tiles before it)."""
    tl.static_assert(G % BN == 0, "a tile must be whole chunks")
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    b, q_begin, q_end, first = _prefill_tile(QSL, num_reqs, pid, BQ, B_P)
    if first >= q_end:
        return
    seq_len = tl.load(SEQ_LENS + b)
    ctx0 = seq_len - (q_end - q_begin)  # position of the request's first query token
    pos_lo = ctx0 + first - q_begin  # the tile's first (lowest) query position
    kv_len = ctx0 + tl.minimum(first + BQ, q_end) - q_begin

    m = tl.arange(0, BLOCK_M)
    mi = m // QPK_P
    mj = m % QPK_P
    tok = first + mi
    row_ok = (mj < QPK) & (tok < q_end)
    q_pos = pos_lo + mi
    dd = tl.arange(0, D)
    rows = tok.to(tl.int64) * HQ + h * QPK + mj
    q = tl.load(Q + rows[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0) * qk_scale
    # Rows normalized to [-1, 1] for the fp16 operand; the scores get the row maximum back
    # (times 2: K is halved).
    qmax = tl.max(tl.abs(q), axis=1)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    q16 = (q / qmax[:, None]).to(tl.float16)
    row_scale = 2.0 * qmax

    n_blocks = tl.cdiv(kv_len, G)
    per = tl.cdiv(n_blocks, NUM_SPLITS)
    blk_lo = split * per
    blk_hi = tl.minimum(blk_lo + per, n_blocks)
    NCH: tl.constexpr = G // BN
    n_it = tl.maximum(blk_hi - blk_lo, 0) * NCH

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    tn = tl.arange(0, BN)

    # chunk 0's record bytes and scales (a pool block's are loaded and not used)
    ok = n_it > 0
    blk = tl.load(bt_row + blk_lo, mask=ok, other=0).to(tl.int64)
    slot = tl.load(BLOCK_TO_SLOT + blk, mask=ok, other=0)
    (k0, k1, v0, v1, ks, kz, kt, vcs, vs, vz) = _load_chunk(
        KV + (blk * HK + h) * STRIDE,
        0,
        ok,
        D,
        G,
        BN,
        KB,
        VB,
        OFF_KC,
        OFF_KS,
        OFF_KZ,
        OFF_KT,
        OFF_VC,
        OFF_VCS,
        OFF_VS,
        OFF_VZ,
        K_ORDER,
        V_ORDER,
    )
    for it in range(0, n_it):
        bi = blk_lo + it // NCH
        c = it % NCH
        c_k0, c_k1, c_v0, c_v1 = k0, k1, v0, v1
        c_ks, c_kz, c_kt, c_vcs, c_vs, c_vz = ks, kz, kt, vcs, vs, vz
        c_slot = slot
        c_blk = blk

        # the next chunk's loads, issued before this chunk's math
        n_ok = it + 1 < n_it
        n_bi = blk_lo + (it + 1) // NCH
        blk = tl.load(bt_row + n_bi, mask=n_ok, other=0).to(tl.int64)
        slot = tl.load(BLOCK_TO_SLOT + blk, mask=n_ok, other=0)
        (k0, k1, v0, v1, ks, kz, kt, vcs, vs, vz) = _load_chunk(
            KV + (blk * HK + h) * STRIDE,
            (it + 1) % NCH,
            n_ok,
            D,
            G,
            BN,
            KB,
            VB,
            OFF_KC,
            OFF_KS,
            OFF_KZ,
            OFF_KT,
            OFF_VC,
            OFF_VCS,
            OFF_VS,
            OFF_VZ,
            K_ORDER,
            V_ORDER,
        )

        t0 = bi * G + c * BN
        # The whole step in each branch: a tensor leaving an `if` must have one layout in
        # both, and the pool's loads forced theirs on the unpacked codes (a shared-memory
        # layout conversion of every K chunk).
        if c_slot >= 0:
            # fp16 pool rows; rows past kv_len are masked at the load (stale rows, NaN
            # poison, or a shadowed block's record bytes)
            trow = (c * BN + tn).to(tl.int64)
            live = t0 + tn < kv_len
            s64 = c_slot.to(tl.int64)
            kr = pool_row_ptrs(POOL_K, KV, s64, c_blk, trow, h, 0, HK, D, G, SHADOW, STRIDE)
            vr = pool_row_ptrs(POOL_V, KV, s64, c_blk, trow, h, 1, HK, D, G, SHADOW, STRIDE)
            kp = tl.load(kr[None, :] + dd[:, None], mask=live[None, :], other=0.0)
            vp = tl.load(vr[:, None] + dd[None, :], mask=live[:, None], other=0.0)
            m_i, l_i, acc = _attend_chunk(
                q16, kp * 0.5, vp * 0.5, row_scale, q_pos, m_i, l_i, acc, t0, pos_lo, kv_len, BN
            )
        else:
            k16, v16 = _record_kv(
                c_k0,
                c_k1,
                c_v0,
                c_v1,
                c_ks,
                c_kz,
                c_kt,
                c_vcs,
                c_vs,
                c_vz,
                BN,
                D,
                KB,
                VB,
                FAST_UNPACK,
            )
            m_i, l_i, acc = _attend_chunk(
                q16, k16, v16, row_scale, q_pos, m_i, l_i, acc, t0, pos_lo, kv_len, BN
            )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc * (2.0 / l_safe)[:, None]  # V was halved
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    out_row = split.to(tl.int64) * n_rows_total + rows
    tl.store(O_PART + out_row[:, None] * D + dd[None, :], o, mask=row_ok[:, None])
    tl.store(LSE_PART + out_row, lse, mask=row_ok)
