# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels are untyped by nature; the launcher helper is annotated.)
"""Decode attention v3: transposed MMAs on fp16 code operands that are never re-interleaved.

Design (docs/kernel-notes.md, rounds 2-3):

* **Transposed MMAs.** Scores are ``S^T = K^T q^T`` (``[tokens, q rows]``) and the output
  ``O^T = V^T P^T`` (``[channels, q rows]``): the code tiles are the MMA's M side, shared out
  over the warps, and the query heads of one KV head the N side, padded only to 8.
* **Scales on the code side.** The K operand is ``fp16((code * k_scale[d] + k_zero[d]) / 2)``
  built as an exact ``fp16(1024 + code) - 1024`` (inline PTX unpack) and one fp16 FMA, with
  the zero point (plus the centring offset) added once per query head in fp32; the V operand
  is ``fp16((code * v_scale[t] + v_zero[t]) / 2)``. ``2 * k_token_scale`` multiplies the fp32
  scores and ``2 * v_channel_scale`` the chunk's fp32 output. The halving keeps every record
  the codec can write inside fp16: ``code * scale + zero`` is a tile value divided by its
  other-axis Sinkhorn scale, which the codec clamps to at least ``exp(-0.3)``, so it is at
  most ``65504 / exp(-0.3) = 88,421`` in magnitude, 44,211 after halving. The query operand is
  the row-normalized query in fp16; probabilities go in unscaled, as in FlashAttention.
* **No re-interleaving.** Softmax and ``P V`` are sums over tokens, so any token order works
  as long as scores, probabilities and V rows agree, and the output channels can come out in
  any order the final store knows. The low nibbles of a chunk's K bytes are its even tokens
  and the high nibbles its odd ones: scores are two MMAs, ``S_even`` and ``S_odd``, with their
  own token scales and liveness masks. Field ``j`` of a V byte (``VG = 8 / VB`` fields) is
  channel ``VG * n + j``: V rows are loaded as even and odd tokens to match the scores, and
  each field accumulates its own ``[D / VG, q rows]`` output block, stored to its channels
  at the end. (Round 2's v2 re-interleaved the fields with ``tl.interleave``; removing that
  was worth 5% on the H200, see the notes.)
* **Pool blocks** (sink, in-progress tile) override a chunk's scores and output through a
  branch; their record bytes are unused.

2- and 4-bit fields only: 5-bit codes straddle bytes (v1 serves them).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels.attention import _UNPACK2_ASM, _UNPACK4_ASM, _split_blocks

__all__ = ["decode_v3_config", "decode_v3_kernel"]


@triton.jit
def _fields4(b, FAST: tl.constexpr):
    """Low and high nibbles of ``b`` as fp16 ``1024 + code`` (exact)."""
    if FAST:
        lo, hi = tl.inline_asm_elementwise(
            _UNPACK4_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        x = b.to(tl.int16)
        lo = ((x & 15) | 0x6400).to(tl.float16, bitcast=True)
        hi = ((x >> 4) | 0x6400).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _fields2(b, FAST: tl.constexpr):
    """The four 2-bit fields of ``b`` (bits 0-1, 2-3, 4-5, 6-7) as fp16 ``1024 + code``."""
    if FAST:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _UNPACK2_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [b],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        x = b.to(tl.int16)
        c0 = ((x & 3) | 0x6400).to(tl.float16, bitcast=True)
        c1 = (((x >> 2) & 3) | 0x6400).to(tl.float16, bitcast=True)
        c2 = (((x >> 4) & 3) | 0x6400).to(tl.float16, bitcast=True)
        c3 = ((x >> 6) | 0x6400).to(tl.float16, bitcast=True)
    return c0, c1, c2, c3


@triton.jit
def _pv(vc, half_scale, half_zero, pT16):
    """``V_field^T P^T`` for one field: ``[D/VG, q rows]`` from ``[BN/2, D/VG]`` codes."""
    vdq = (vc - 1024.0) * half_scale[:, None] + half_zero[:, None]
    return tl.dot(tl.trans(vdq), pT16)


@triton.jit
def _pool_pv(POOL_V, prow, ch, live, pT16, D: tl.constexpr):
    """The same product from fp16 pool rows (exact values, no scales)."""
    vp = tl.load(POOL_V + prow[:, None] * D + ch[None, :], mask=live[:, None], other=0.0)
    return tl.dot(tl.trans(vp), pT16)


@triton.jit
def decode_v3_kernel(
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
    HQ: tl.constexpr,
    HK: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
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
    BN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
):
    """One program per (request, KV head, split); writes the split's normalized partial output
    (``O_PART``, fp32, rotated frame, natural channel order) and base-2 LSE (``LSE_PART``)."""
    tl.static_assert(KB == 4, "v3 takes 4-bit keys")
    tl.static_assert(VB == 2 or VB == 4, "v3 takes 2- or 4-bit values")
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    f16 = tl.pointer_type(tl.float16)

    qi = tl.arange(0, BLOCK_Q)
    q_ok = qi < QPK
    seq_len = tl.load(SEQ_LENS + b)
    dd = tl.arange(0, D)
    rows = b.to(tl.int64) * HQ + h * QPK + qi
    qT = tl.load(Q + rows[None, :] * D + dd[:, None], mask=q_ok[None, :], other=0.0) * qk_scale
    qmax = tl.max(tl.abs(qT), axis=0)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    qn = qT / qmax[None, :]
    qT16 = qn.to(tl.float16)

    n_blocks = tl.cdiv(seq_len, G)
    blk_lo, blk_hi = _split_blocks(n_blocks, split, NUM_SPLITS)
    NCH: tl.constexpr = G // BN
    n_it = tl.maximum(blk_hi - blk_lo, 0) * NCH

    H2: tl.constexpr = BN // 2  # tokens per parity
    VG: tl.constexpr = 8 // VB  # V fields per byte
    DV: tl.constexpr = D // VG  # channels per V field
    K_ROW: tl.constexpr = G * KB // 8
    V_ROW: tl.constexpr = D * VB // 8
    mid: tl.constexpr = 1 << (KB - 1)
    tp = tl.arange(0, H2) * 2  # even token offsets within a chunk
    nb = tl.arange(0, BN // 2)  # K bytes per row and chunk (two 4-bit tokens per byte)
    nv = tl.arange(0, DV)  # V bytes per row (VG channels per byte)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([H2, BLOCK_Q], dtype=tl.float32)
    acc0 = tl.zeros([DV, BLOCK_Q], dtype=tl.float32)
    acc1 = tl.zeros([DV, BLOCK_Q], dtype=tl.float32)
    acc2 = tl.zeros([DV, BLOCK_Q], dtype=tl.float32)
    acc3 = tl.zeros([DV, BLOCK_Q], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt

    for it in range(0, n_it):
        bi = blk_lo + it // NCH
        c = it % NCH
        blk = tl.load(bt_row + bi).to(tl.int64)
        slot = tl.load(BLOCK_TO_SLOT + blk)
        rec = KV + (blk * HK + h) * STRIDE
        tok_e = c * BN + tp
        tok_o = tok_e + 1
        live_e = bi * G + tok_e < seq_len
        live_o = bi * G + tok_o < seq_len

        # --- scores of the even and odd tokens, [H2, BLOCK_Q] each ---
        kbytes = tl.load(rec + OFF_KC + dd[:, None] * K_ROW + c * (BN // 2) + nb[None, :])
        k_lo, k_hi = _fields4(kbytes, FAST_UNPACK)
        ks = tl.load((rec + OFF_KS).to(f16) + dd) * 0.5
        kz = tl.load((rec + OFF_KZ).to(f16) + dd) * 0.5
        zq = tl.sum(qn * (kz.to(tl.float32) + mid * ks.to(tl.float32))[:, None], axis=0)
        kt_e = tl.load((rec + OFF_KT).to(f16) + tok_e).to(tl.float32) * 2.0
        kt_o = tl.load((rec + OFF_KT).to(f16) + tok_o).to(tl.float32) * 2.0
        s_e = tl.dot(tl.trans((k_lo - (1024.0 + mid)) * ks[:, None]), qT16)
        s_o = tl.dot(tl.trans((k_hi - (1024.0 + mid)) * ks[:, None]), qT16)
        s_e = (s_e + zq[None, :]) * kt_e[:, None]
        s_o = (s_o + zq[None, :]) * kt_o[:, None]
        if slot >= 0:
            # fp16 pool block (sink, in-progress tile): its record bytes are unused.
            prow_e = (slot.to(tl.int64) * G + tok_e) * HK + h
            prow_o = (slot.to(tl.int64) * G + tok_o) * HK + h
            kp_e = tl.load(
                POOL_K + prow_e[:, None] * D + dd[None, :], mask=live_e[:, None], other=0.0
            )
            kp_o = tl.load(
                POOL_K + prow_o[:, None] * D + dd[None, :], mask=live_o[:, None], other=0.0
            )
            s_e = tl.dot(kp_e, qT16)
            s_o = tl.dot(kp_o, qT16)
        s_e = tl.where(live_e[:, None], s_e * qmax[None, :], float("-inf"))
        s_o = tl.where(live_o[:, None], s_o * qmax[None, :], float("-inf"))

        # --- online softmax (base 2) ---
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=0), tl.max(s_o, axis=0)))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p_e = tl.exp2(s_e - m_use[None, :])
        p_o = tl.exp2(s_o - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p_e + p_o
        m_i = m_new
        p_e16 = p_e.to(tl.float16)
        p_o16 = p_o.to(tl.float16)

        # --- P V, one [DV, BLOCK_Q] block per V field ---
        vrow_e = rec + OFF_VC + tok_e[:, None] * V_ROW + nv[None, :]
        vb_e = tl.load(vrow_e)
        vb_o = tl.load(vrow_e + V_ROW)
        vs_e = tl.load((rec + OFF_VS).to(f16) + tok_e) * 0.5
        vs_o = tl.load((rec + OFF_VS).to(f16) + tok_o) * 0.5
        vz_e = tl.load((rec + OFF_VZ).to(f16) + tok_e) * 0.5
        vz_o = tl.load((rec + OFF_VZ).to(f16) + tok_o) * 0.5
        vcs_base = (rec + OFF_VCS).to(f16) + nv * VG
        if VB == 2:
            e0, e1, e2, e3 = _fields2(vb_e, FAST_UNPACK)
            o0, o1, o2, o3 = _fields2(vb_o, FAST_UNPACK)
        else:
            e0, e1 = _fields4(vb_e, FAST_UNPACK)
            o0, o1 = _fields4(vb_o, FAST_UNPACK)
            e2 = e0
            e3 = e0
            o2 = o0
            o3 = o0
        pv0 = _pv(e0, vs_e, vz_e, p_e16) + _pv(o0, vs_o, vz_o, p_o16)
        pv1 = _pv(e1, vs_e, vz_e, p_e16) + _pv(o1, vs_o, vz_o, p_o16)
        pv0 = pv0 * (tl.load(vcs_base).to(tl.float32) * 2.0)[:, None]
        pv1 = pv1 * (tl.load(vcs_base + 1).to(tl.float32) * 2.0)[:, None]
        if VG == 4:
            pv2 = _pv(e2, vs_e, vz_e, p_e16) + _pv(o2, vs_o, vz_o, p_o16)
            pv3 = _pv(e3, vs_e, vz_e, p_e16) + _pv(o3, vs_o, vz_o, p_o16)
            pv2 = pv2 * (tl.load(vcs_base + 2).to(tl.float32) * 2.0)[:, None]
            pv3 = pv3 * (tl.load(vcs_base + 3).to(tl.float32) * 2.0)[:, None]
        else:
            pv2 = pv0
            pv3 = pv0
        if slot >= 0:
            prow_e = (slot.to(tl.int64) * G + tok_e) * HK + h
            prow_o = prow_e + HK
            pv0 = _pool_pv(POOL_V, prow_e, nv * VG, live_e, p_e16, D) + _pool_pv(
                POOL_V, prow_o, nv * VG, live_o, p_o16, D
            )
            pv1 = _pool_pv(POOL_V, prow_e, nv * VG + 1, live_e, p_e16, D) + _pool_pv(
                POOL_V, prow_o, nv * VG + 1, live_o, p_o16, D
            )
            if VG == 4:
                pv2 = _pool_pv(POOL_V, prow_e, nv * VG + 2, live_e, p_e16, D) + _pool_pv(
                    POOL_V, prow_o, nv * VG + 2, live_o, p_o16, D
                )
                pv3 = _pool_pv(POOL_V, prow_e, nv * VG + 3, live_e, p_e16, D) + _pool_pv(
                    POOL_V, prow_o, nv * VG + 3, live_o, p_o16, D
                )
        acc0 = acc0 * alpha[None, :] + pv0
        acc1 = acc1 * alpha[None, :] + pv1
        if VG == 4:
            acc2 = acc2 * alpha[None, :] + pv2
            acc3 = acc3 * alpha[None, :] + pv3

    l_i = tl.sum(l_acc, axis=0)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    prow_out = split.to(tl.int64) * n_rows_total + rows
    obase = O_PART + prow_out[None, :] * D + nv[:, None] * VG
    tl.store(obase, acc0 / l_safe[None, :], mask=q_ok[None, :])
    tl.store(obase + 1, acc1 / l_safe[None, :], mask=q_ok[None, :])
    if VG == 4:
        tl.store(obase + 2, acc2 / l_safe[None, :], mask=q_ok[None, :])
        tl.store(obase + 3, acc3 / l_safe[None, :], mask=q_ok[None, :])
    tl.store(LSE_PART + prow_out, lse, mask=q_ok)


def decode_v3_config(head_dim: int, group: int) -> dict[str, int]:
    """Default launch shape: tokens per step, warps and pipeline stages.

    Chunks of ``BN * D = 16384`` codes per operand (128 tokens at D = 128) on 4 warps: on the
    H200 (k4v2_g128, B = 64, 16K) 1,470 µs, against 2,634 µs on 8 warps, 2,041 µs for 64-token
    chunks and 2,235 µs for 32-token chunks (docs/kernel-notes.md, round 3).
    """
    return {"block_n": max(32, min(group, 16384 // head_dim)), "num_warps": 4, "num_stages": 3}
