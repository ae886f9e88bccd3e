# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels and their @triton.jit helpers are untyped by nature; the launcher
# helpers in this module are fully annotated.)
"""Decode attention v2: codes dequantized into the MMA operand, tokens as the MMA rows.

v1 (``attention._attn_kernel``) folds the scales into the *other* operand (``k_scale`` into
the query, ``v_scale`` into the probabilities), runs ``[16 query rows] x [chunk]`` MMAs on raw
codes and removes the zero points with row sums. Every chunk then rebuilds the query operand,
takes max normalizations of the folded operands and two zero-point sums, each a cross-warp
reduction through shared memory; the 4 real query rows of a Qwen3-8B KV head are padded to 16;
238 registers, 31 barriers and ~1,400 SASS instructions per warp and 64-token step make it
latency- and issue-bound (docs/kernel-notes.md). v2 changes three things:

* **Transposed MMAs.** Scores are computed as ``S^T = K^T q^T`` (``[chunk tokens, q rows]``)
  and the output as ``O^T = V^T P^T`` (``[D, q rows]``): the large code tiles are the MMA's M
  side (rows shared out over the warps, never replicated) and the query heads the N side,
  padded only to 8. Half the MMAs of v1 at 4 query heads per KV head, and no warp holds a copy
  of a ``[16, D]`` query operand.
* **Scales on the code side.** The K operand is ``fp16((code * k_scale[d] + k_zero[d]) / 2)``
  (the record's value before its per-token scale) and the V operand ``fp16((code *
  v_scale[t] + v_zero[t]) / 2)``, built in registers with one exact ``fp16(1024 + code) -
  1024`` and one fp16 FMA per code pair. ``2 * k_token_scale[t]`` multiplies the scores and
  ``2 * v_channel_scale[d]`` the chunk's output, both elementwise. The query operand (row
  normalized, fp16) is loop-invariant and the probabilities go in unscaled (in [0, 1], as in
  FlashAttention). No max normalization and no zero-point reduction remain; the only
  cross-warp reduction in the loop is the online-softmax maximum, and the probability row
  sums are accumulated elementwise and reduced once at the end.
* **Loads.** The code bytes are plain loads that Triton's pipeliner turns into ``cp.async``
  copies ``num_stages - 1`` chunks ahead; the per-record scale vectors (too small per thread
  for ``cp.async``) are prefetched one chunk ahead in registers.

Numerics: one fp16 rounding of ``(code * scale + zero) / 2`` (relative 2^-11, ~100x below the
4-bit quantization step). The halving keeps every record the codec can write inside the fp16
range: ``code * scale + zero`` is the tile value divided by its other-axis Sinkhorn scale,
which the codec clamps to at least ``exp(-0.3)``, so it is at most ``65504 / 0.7407 =
88,435`` in magnitude, 44,218 after halving (records that were not written by the codec can
overflow to +-inf). The query operand is the row-normalized query in fp16, as in v1.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels.attention import _codes_f16, _load_codes

__all__ = ["decode_v2_config", "decode_v2_kernel"]


@triton.jit
def _dequant(codes1024, half_scale, half_zero):
    """``fp16((code * scale + zero) / 2)`` from fp16 ``1024 + code`` and the halved fields.

    ``1024 + code - 1024`` is exact in fp16; the FMA rounds once.
    """
    return (codes1024 - 1024.0) * half_scale + half_zero


@triton.jit
def _centred(codes1024, half_scale, BITS: tl.constexpr):
    """``fp16((code - 2**(BITS-1)) * scale / 2)``: the code term alone, centred.

    The subtraction is exact; the product rounds once, to 2^-11 of at most half the row's
    range (the zero point, often much larger than the range, is added exactly elsewhere).
    """
    mid: tl.constexpr = 1024.0 + (1 << (BITS - 1))
    return (codes1024 - mid) * half_scale


@triton.jit
def _scales(rec, tok, dd, ok, OFF_KS, OFF_KZ, OFF_KT, OFF_VCS, OFF_VS, OFF_VZ):
    """One chunk's scale vectors (masked by ``ok``).

    Halved ``k_scale``, ``k_zero`` ``[D]`` and ``v_scale``, ``v_zero`` ``[BN]`` in fp16 (the
    operand side); ``2 * k_token_scale`` ``[BN]`` and ``2 * v_channel_scale`` ``[D]`` in fp32
    (the result side, undoing the halving). Halving an fp16 value is exact.
    """
    f16 = tl.pointer_type(tl.float16)
    ks = tl.load((rec + OFF_KS).to(f16) + dd, mask=ok, other=0.0) * 0.5
    kz = tl.load((rec + OFF_KZ).to(f16) + dd, mask=ok, other=0.0) * 0.5
    kt = tl.load((rec + OFF_KT).to(f16) + tok, mask=ok, other=0.0).to(tl.float32) * 2.0
    vs = tl.load((rec + OFF_VS).to(f16) + tok, mask=ok, other=0.0) * 0.5
    vz = tl.load((rec + OFF_VZ).to(f16) + tok, mask=ok, other=0.0) * 0.5
    vcs = tl.load((rec + OFF_VCS).to(f16) + dd, mask=ok, other=0.0).to(tl.float32) * 2.0
    return ks, kz, kt, vs, vz, vcs


@triton.jit
def decode_v2_kernel(
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
    """One program per (request, KV head, split); MMA columns are the KV head's query heads.

    Writes the split's normalized partial output (``O_PART``, fp32, rotated frame) and its
    base-2 log-sum-exp (``LSE_PART``); ``attention._merge_unrotate_kernel`` finishes.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    qi = tl.arange(0, BLOCK_Q)
    q_ok = qi < QPK
    seq_len = tl.load(SEQ_LENS + b)
    dd = tl.arange(0, D)
    rows = b.to(tl.int64) * HQ + h * QPK + qi
    # q^T [D, BLOCK_Q], scaled, normalized per query head (column) into [-1, 1].
    qT = tl.load(Q + rows[None, :] * D + dd[:, None], mask=q_ok[None, :], other=0.0)
    qT = qT * qk_scale
    qmax = tl.max(tl.abs(qT), axis=0)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    qn = qT / qmax[None, :]
    qT16 = qn.to(tl.float16)

    n_blocks = tl.cdiv(seq_len, G)
    if NUM_SPLITS > 1:
        per = tl.cdiv(n_blocks, NUM_SPLITS)
        blk_lo = split * per
        blk_hi = tl.minimum(blk_lo + per, n_blocks)
    else:
        blk_lo = 0
        blk_hi = n_blocks
    NCH: tl.constexpr = G // BN
    n_it = tl.maximum(blk_hi - blk_lo, 0) * NCH

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([BN, BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([D, BLOCK_Q], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    tn = tl.arange(0, BN)
    K_ROW: tl.constexpr = G * KB // 8
    V_ROW: tl.constexpr = D * VB // 8

    # Scale vectors of chunk 0; from then on they are loaded one chunk ahead.
    blk = tl.load(bt_row + blk_lo, mask=n_it > 0, other=0).to(tl.int64)
    ks, kz, kt, vs, vz, vcs = _scales(
        KV + (blk * HK + h) * STRIDE,
        tn,
        dd,
        n_it > 0,
        OFF_KS,
        OFF_KZ,
        OFF_KT,
        OFF_VCS,
        OFF_VS,
        OFF_VZ,
    )
    for it in range(0, n_it):
        bi = blk_lo + it // NCH
        c = it % NCH
        blk = tl.load(bt_row + bi).to(tl.int64)
        slot = tl.load(BLOCK_TO_SLOT + blk)
        rec = KV + (blk * HK + h) * STRIDE
        tok = c * BN + tn
        live = bi * G + tok < seq_len
        c_ks = ks
        c_kz = kz
        c_kt = kt
        c_vs = vs
        c_vz = vz
        c_vcs = vcs
        nit = it + 1
        n_ok = nit < n_it
        n_blk = tl.load(bt_row + blk_lo + nit // NCH, mask=n_ok, other=0).to(tl.int64)
        ks, kz, kt, vs, vz, vcs = _scales(
            KV + (n_blk * HK + h) * STRIDE,
            (nit % NCH) * BN + tn,
            dd,
            n_ok,
            OFF_KS,
            OFF_KZ,
            OFF_KT,
            OFF_VCS,
            OFF_VS,
            OFF_VZ,
        )

        # --- scores^T [BN, BLOCK_Q] from K [D, BN] = fp16((code * k_scale + k_zero) / 2) ---
        k0, k1, k2, k3, k4 = _load_codes(rec + OFF_KC, D, K_ROW, c * (BN * KB // 8), BN, KB, True)
        kc = _codes_f16(k0, k1, k2, k3, k4, BN, KB, FAST_UNPACK)
        # Zero point (plus the centring offset) once per query head, in fp32:
        # sum_d q[d] * (k_zero[d] + mid * k_scale[d]) / 2.
        mid: tl.constexpr = 1 << (KB - 1)
        zq = tl.sum(qn * (c_kz.to(tl.float32) + mid * c_ks.to(tl.float32))[:, None], axis=0)
        sT = tl.dot(tl.trans(_centred(kc, c_ks[:, None], KB)), qT16)
        sT = (sT + zq[None, :]) * c_kt[:, None]
        if slot >= 0:
            # fp16 pool block (sink, in-progress tile): its record bytes are unused.
            prow = (slot.to(tl.int64) * G + tok) * HK + h
            kpT = tl.load(POOL_K + prow[:, None] * D + dd[None, :], mask=live[:, None], other=0.0)
            sT = tl.dot(kpT, qT16)
        sT = sT * qmax[None, :]
        sT = tl.where(live[:, None], sT, float("-inf"))

        # --- online softmax (base 2) over the chunk's tokens (rows) ---
        m_new = tl.maximum(m_i, tl.max(sT, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pT = tl.exp2(sT - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + pT
        m_i = m_new
        pT16 = pT.to(tl.float16)

        # --- out^T [D, BLOCK_Q] from V [BN, D] = fp16((code * v_scale + v_zero) / 2) ---
        v0, v1, v2, v3, v4 = _load_codes(rec + OFF_VC + c * BN * V_ROW, BN, V_ROW, 0, D, VB, True)
        vdq = _dequant(
            _codes_f16(v0, v1, v2, v3, v4, D, VB, FAST_UNPACK), c_vs[:, None], c_vz[:, None]
        )
        pvT = tl.dot(tl.trans(vdq), pT16) * c_vcs[:, None]
        if slot >= 0:
            prow = (slot.to(tl.int64) * G + tok) * HK + h
            vpT = tl.load(POOL_V + prow[None, :] * D + dd[:, None], mask=live[None, :], other=0.0)
            pvT = tl.dot(vpT, pT16)
        acc = acc * alpha[None, :] + pvT

    l_i = tl.sum(l_acc, axis=0)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    oT = acc / l_safe[None, :]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    prow_out = split.to(tl.int64) * n_rows_total + rows
    tl.store(O_PART + prow_out[None, :] * D + dd[:, None], oT, mask=q_ok[None, :])
    tl.store(LSE_PART + prow_out, lse, mask=q_ok)


def decode_v2_config(head_dim: int, group: int) -> dict[str, int | None]:
    """Default launch shape of :func:`decode_v2_kernel`: tokens per step, warps, stages, and
    the register cap.

    ``BN * D = 16384`` codes per operand tile (128 tokens at D = 128) on 8 warps, capped at
    128 registers at D <= 128 (ptxas spills at most a few bytes there), fits two programs (16
    warps) per SM with two chunks of code bytes in flight each (static analysis in
    docs/kernel-notes.md).
    """
    bn = max(16, min(group, 16384 // head_dim))
    warps = 8 if bn * head_dim >= 16384 else 4
    return {
        "block_n": bn,
        "num_warps": warps,
        "num_stages": 3,
        # At D = 128 the cap costs a few spilled bytes; beyond, hundreds (no cap there).
        "maxnreg": 128 if warps == 8 and head_dim <= 128 else None,
    }
