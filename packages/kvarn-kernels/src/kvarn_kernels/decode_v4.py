# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels are untyped by nature; the config helper is annotated.)
"""Decode attention v4: one chunk per warp, no shared-memory staging of dequantized operands.

Round 3 (docs/kernel-notes.md) found the decode loop latency-bound: the record loads alone run
at 4.4 TB/s, but every chunk walked a dependent chain of layout conversions (dequantized fp16
operands stored to shared memory and read back for the MMA: 108 barriers per 256 tokens in the
fastest round-3 kernel, 124 in v1) and cross-warp softmax reductions. v4 removes both, from
the static analysis of small Triton kernels (``scripts/static_kernels.py``):

* **Codes as MMA B operands, unpacked in the operand layout.** Scores are ``S = q K`` with the
  K codes (channel-major in the record, i.e. ``[D, tokens]``) as the B operand, and the
  output ``O = P V`` with the V codes (token-major, ``[tokens, channels]``) as the B operand:
  no transposes. The low and high nibbles of a K byte (even and odd tokens) and the
  ``VG = 8 / VB`` fields of a V byte (channels ``VG * n + j``) are separate operands, so the
  unpack and the fp16 dequantization are elementwise on the loaded bytes; Triton then keeps
  the raw bytes in shared memory (``cp.async``, pipelined) and reads them straight into the
  MMA operand layout (``local_load`` of ``i8`` into ``dot_op``), with no fp16 round trip.
  Token order inside a chunk does not matter (softmax and ``P V`` are sums over tokens) as
  long as scores, probabilities and V rows agree, so the fields are never re-interleaved:
  each V field accumulates its own ``[q rows, D / VG]`` output block, stored to its channels
  at the end.
* **One chunk per warp.** A program runs ``W = num_warps`` chunks at a time as a batched
  ``[W, 16, D] x [W, D, BN/2]`` MMA; the batch dimension lies along the warps, so each warp
  keeps its own online softmax (maximum, sum, output) and no reduction crosses warps inside
  the loop. The ``W`` partial states are merged once, at the end.
* **Pool blocks** (the sink and the in-progress tile, fp16) are masked out of the main loop
  (their record bytes are unused: scales zeroed, scores ``-inf``) and attended in a second,
  short phase over the split's pool-resident blocks, found with a vectorized scan of the
  block table: one 64-token chunk at a time across the warps, or (``POOL_BATCHED``, round
  7) one block at a time, each warp on its own ``G / W`` rows. A pool block's record area
  holds random bytes, or with shadow rows the tile's first ``SHADOW`` fp16 rows
  (``_common.pool_row_ptrs``) then random bytes, so every value the main loop reads from it
  as a float is dropped with ``tl.where`` (never multiplied by zero: ``NaN * 0`` is NaN); the
  codes are always finite (``1024 + code``).

Numerics. Codes become fp16 as ``1024 + code`` (exact: OR-ed into the mantissa of 1024.0).
The K operand is ``fp16((code * k_scale[d] + k_zero[d]) / 2)`` and the V operand
``fp16((code * v_scale[t] + v_zero[t]) / 2)``: a dequantized cache value at the precision of
an fp16 cache entry. ``2 * k_token_scale`` multiplies the fp32 scores and ``2 *
v_channel_scale`` the fp32 outputs. The halving keeps every record the codec can write inside
fp16: ``code * scale + zero`` is a tile value divided by its other-axis Sinkhorn scale, which
the codec clamps to at least ``exp(-0.3)``, so it is at most ``65504 / exp(-0.3) = 88,421``
in magnitude, 44,211 after halving (halving an fp16 value is exact). The query operand is the
row-normalized query in fp16 (its row maximum multiplies the scores in fp32); probabilities go
in unscaled, as in FlashAttention.

4-bit keys with 2- or 4-bit values only: 5-bit codes straddle bytes (v1 serves them).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._common import code_offsets, code_offsets_of_pair, pool_row_ptrs
from kvarn_kernels.attention import _UNPACK2_ASM, _UNPACK4_ASM, _split_blocks

__all__ = ["decode_v4_config", "decode_v4_kernel"]


@triton.jit
def _nibbles(b, FAST: tl.constexpr):
    """Low and high nibbles as fp16 ``1024 + code`` (exact), elementwise.

    ``FAST`` (GPU only): the inline-PTX unpack of :mod:`kvarn_kernels.attention`, four bytes
    per block, about one instruction per code.
    """
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
def _fields(b, VB: tl.constexpr, FAST: tl.constexpr):
    """The ``8 / VB`` fields of each byte (low bits first) as fp16 ``1024 + code``; for 4-bit
    values the last two repeat the first two (unused)."""
    if VB == 4:
        f0, f1 = _nibbles(b, FAST)
        f2 = f0
        f3 = f1
    elif FAST:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            _UNPACK2_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [b],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        x = b.to(tl.int16)
        f0 = ((x & 3) | 0x6400).to(tl.float16, bitcast=True)
        f1 = (((x >> 2) & 3) | 0x6400).to(tl.float16, bitcast=True)
        f2 = (((x >> 4) & 3) | 0x6400).to(tl.float16, bitcast=True)
        f3 = ((x >> 6) | 0x6400).to(tl.float16, bitcast=True)
    return f0, f1, f2, f3


@triton.jit
def _f16_halves(words, SHIFT: tl.constexpr):
    """The fp16 in bits ``SHIFT .. SHIFT + 15`` of integer ``words`` (little-endian fp16
    fields read with one wider load)."""
    return (words >> SHIFT).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _paired_v_scale(packed, vcw, F: tl.constexpr, MASKED: tl.constexpr):
    """(``WIDE_SCALES``) ``2 * s_col_V`` of field ``F`` of each V byte from the one wide load
    ``vcw`` of the byte's channel scales; fp32, zero for pool blocks (``MASKED``: ``vcw`` was
    loaded as zeros there)."""
    v = _f16_halves(vcw, 16 * F).to(tl.float32)
    if not MASKED:
        v = tl.where(packed[:, None], v, 0.0)
    return v * 2.0


@triton.jit
def _pool_window(bt_row, BLOCK_TO_SLOT, idx, blk_hi):
    """A window ``idx`` of a request's block-table row (entries ``>= blk_hi`` masked): the
    block ids, their pool slots, which are pool-resident, and each one's rank among those."""
    ok = idx < blk_hi
    blks = tl.load(bt_row + idx, mask=ok, other=0)
    slots = tl.load(BLOCK_TO_SLOT + blks, mask=ok, other=-1)
    is_pool = ok & (slots >= 0)
    rank = tl.cumsum(is_pool.to(tl.int32), axis=0) - 1
    return idx, blks, slots, is_pool, rank


@triton.jit
def _online(m, l_acc, s_e, s_o, AXIS: tl.constexpr):
    """Online-softmax step over axis ``AXIS`` (the tokens) of the even and odd score halves.

    Returns the new maximum, the rescale factor of the old state, the new row sums and the
    probabilities as fp16 MMA operands.
    """
    m_new = tl.maximum(m, tl.maximum(tl.max(s_e, axis=AXIS), tl.max(s_o, axis=AXIS)))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p_e = tl.exp2(s_e - tl.expand_dims(m_use, AXIS))
    p_o = tl.exp2(s_o - tl.expand_dims(m_use, AXIS))
    l_acc = l_acc * alpha + tl.sum(p_e, axis=AXIS) + tl.sum(p_o, axis=AXIS)
    return m_new, alpha, l_acc, p_e.to(tl.float16), p_o.to(tl.float16)


@triton.jit
def decode_v4_kernel(
    Q,
    KV,
    POOL_K,
    POOL_V,
    BLOCK_TABLE,
    SEQ_LENS,
    BLOCK_TO_SLOT,
    O_PART,
    LSE_PART,
    QSL,
    qk_scale,
    stride_bt,
    n_rows_total,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
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
    W: tl.constexpr,
    SCAN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
    POOL_BATCHED: tl.constexpr = False,
    WIDE_SCALES: tl.constexpr = False,
    MASKED_SCALES: tl.constexpr = False,
    MULTI: tl.constexpr = False,
    TPP: tl.constexpr = 1,
    NTG: tl.constexpr = 1,
    PHASES: tl.constexpr = 0,
):
    """One program per (request, KV head, split); ``W`` chunks of ``BN`` tokens per step.

    Writes the split's normalized partial output (``O_PART``, fp32, rotated frame, natural
    channel order) and base-2 LSE (``LSE_PART``), like v1's kernel. ``SHADOW``: the pool holds
    ``G - SHADOW`` rows per slot; a pool tile's first rows are in its block's record area.
    Round 7 (``variant="v4b"`` sets both): ``POOL_BATCHED``, the pool phase takes one pool
    block per step, ``G / W`` rows per warp with per-warp softmax states (merged at the end,
    like the main loop's), instead of 64-token chunks one at a time across the warps;
    ``WIDE_SCALES``, the main loop reads each token pair's scale fields, and each V byte's
    channel scales, with one wide load instead of 2-byte loads. ``MASKED_SCALES``
    (``variant="v4c"``, with both): every scale of a pool block (K's and V's per channel and
    per token) comes from a masked load as zero instead of being zeroed by selects after the
    load, and the per-token scales of a packed block's tokens past the request's length are
    no longer zeroed (their scores are masked to ``-inf`` anyway, and the record values are
    finite: a packed block is a whole tile the store wrote). Static SASS of the main loop:
    2,512 instructions instead of 2,951 (k4v2_g128), 2,680 instead of 3,144 (k4v4_g128).

    ``MULTI`` (speculative verify, :func:`kvarn_kernels.verify_attention`): request ``b`` has
    the query tokens ``QSL[b] .. QSL[b + 1] - 1`` (at most ``NTG * TPP``), the last at
    position ``seq_len - 1``; a program takes ``TPP`` of them (``TPP * QPK <= BLOCK_Q`` rows
    of the MMA that decode pads with zeros), program axis 0 is ``b * NTG + token group``, and
    each row sees the positions up to its own token. Without it (decode) none of that code
    is compiled.

    ``PHASES`` (decode only): 0 runs both phases (the main loop over the split's records,
    then the pool phase over its pool blocks); 1 compiles the main loop alone (no pool-phase
    code: the kernel keeps fewer registers live). ``variant="v4d"`` launches 1, then
    :mod:`kvarn_kernels.decode_pool` over each request's pool blocks into partial
    ``NUM_SPLITS``, and merges ``NUM_SPLITS + 1`` partials, so the fp16 sink and in-progress
    tiles no longer lengthen one main program each (docs/kernel-notes.md, tenth session; v4's
    own pool phase ran that launch until the twenty-third).
    """
    tl.static_assert(KB == 4, "v4 takes 4-bit keys")
    tl.static_assert(PHASES == 0 or PHASES == 1, "PHASES is 0 (both phases) or 1 (main loop)")
    tl.static_assert(PHASES == 0 or not MULTI, "PHASES 1 is for decode")
    tl.static_assert(VB == 2 or VB == 4, "v4 takes 2- or 4-bit values")
    if MULTI:
        b = tl.program_id(0) // NTG
        tg = tl.program_id(0) % NTG
    else:
        b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    f16 = tl.pointer_type(tl.float16)
    i32p = tl.pointer_type(tl.int32)

    H2: tl.constexpr = BN // 2  # tokens per parity in a chunk
    VG: tl.constexpr = 8 // VB  # V fields per byte
    DV: tl.constexpr = D // VG  # channels per V field
    K_ROW: tl.constexpr = G * KB // 8
    V_ROW: tl.constexpr = D * VB // 8
    NCH: tl.constexpr = G // BN

    qi = tl.arange(0, BLOCK_Q)
    seq_len = tl.load(SEQ_LENS + b)
    dd = tl.arange(0, D)
    if MULTI:
        q_first = tl.load(QSL + b)
        q_len = tl.load(QSL + b + 1) - q_first
        tq = tg * TPP + qi // QPK  # the row's query token within its request
        q_ok = (qi < TPP * QPK) & (tq < q_len)
        rows = (q_first + tq).to(tl.int64) * HQ + h * QPK + qi % QPK
        # token tq sits at position seq_len - q_len + tq and sees the positions up to its own
        row_end = seq_len - q_len + 1 + tq  # [BLOCK_Q]
    else:
        q_ok = qi < QPK
        rows = b.to(tl.int64) * HQ + h * QPK + qi
    q = tl.load(Q + rows[:, None] * D + dd[None, :], mask=q_ok[:, None], other=0.0) * qk_scale
    qmax = tl.max(tl.abs(q), axis=1)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    qn = q / qmax[:, None]  # [BLOCK_Q, D] in [-1, 1]
    q16 = qn.to(tl.float16)
    q3 = tl.broadcast_to(q16[None, :, :], (W, BLOCK_Q, D))

    n_blocks = tl.cdiv(seq_len, G)
    blk_lo, blk_hi = _split_blocks(n_blocks, split, NUM_SPLITS)
    if MULTI:
        # a token group past the request's query tokens has no rows: nothing to read
        blk_hi = tl.where(tg * TPP < q_len, blk_hi, blk_lo)
    # the pool phase's blocks: the split's own
    pool_lo = blk_lo
    pool_hi = blk_hi
    ch_lo = blk_lo * NCH
    ch_hi = tl.maximum(blk_hi, blk_lo) * NCH
    n_it = tl.cdiv(ch_hi - ch_lo, W)

    ww = tl.arange(0, W)
    nb = tl.arange(0, H2)  # K bytes of a chunk row (two tokens each)
    nv = tl.arange(0, DV)  # V bytes of a token row (VG channels each)
    tp = nb * 2  # even token offsets within a chunk
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt

    m = tl.full([W, BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([W, BLOCK_Q], dtype=tl.float32)
    acc0 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
    acc1 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
    acc2 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
    acc3 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)

    for it in range(0, n_it):
        ci = ch_lo + it * W + ww  # [W] chunk of each warp
        valid = ci < ch_hi
        bi = ci // NCH
        c = ci % NCH
        blk = tl.load(bt_row + bi, mask=valid, other=0).to(tl.int64)
        slot = tl.load(BLOCK_TO_SLOT + blk, mask=valid, other=0)
        # Pool blocks are the second phase's: every float read from their record area below
        # (scales, zero points, token scales) goes through tl.where on packed/live.
        packed = valid & (slot < 0)
        rec = KV + (blk * HK + h) * STRIDE  # [W] record pointers
        tok_e = c[:, None] * BN + tp[None, :]  # [W, H2]
        tok_o = tok_e + 1
        live_e = packed[:, None] & (bi[:, None] * G + tok_e < seq_len)
        live_o = packed[:, None] & (bi[:, None] * G + tok_o < seq_len)

        # --- scores [W, BLOCK_Q, H2] of the even and odd tokens ---
        kbytes = tl.load(
            rec[:, None, None]
            + OFF_KC
            + code_offsets(
                dd[None, :, None], c[:, None, None] * H2 + nb[None, None, :], D, K_ROW, K_ORDER
            )
        )
        k_lo, k_hi = _nibbles(kbytes, FAST_UNPACK)
        ksp = (rec[:, None] + OFF_KS).to(f16) + dd[None, :]
        kzp = (rec[:, None] + OFF_KZ).to(f16) + dd[None, :]
        if MASKED_SCALES:
            # (v4c) zero-filled by the load itself (a predicated cp.async): no per-element
            # selects in the operand layout, where every thread holds many copies
            ks = (tl.load(ksp, mask=packed[:, None], other=0.0) * 0.5)[:, :, None]
            kz = (tl.load(kzp, mask=packed[:, None], other=0.0) * 0.5)[:, :, None]
        else:
            ks = (tl.where(packed[:, None], tl.load(ksp), 0.0) * 0.5)[:, :, None]  # [W, D, 1]
            kz = (tl.where(packed[:, None], tl.load(kzp), 0.0) * 0.5)[:, :, None]
        if WIDE_SCALES:
            # (v4b) The per-token fields of an even/odd token pair share one 32-bit word: one
            # load for both. v4's 2-byte loads at stride 2 are neither vectorized nor
            # pipelined (cp.async moves 4 bytes or more): ten per step, each a global-memory
            # wait in the middle of the step, plus a shared-memory layout change each.
            pair = c[:, None] * H2 + nb[None, :]  # [W, H2] token-pair index in the tile
            if MASKED_SCALES:
                # (v4c) Pool blocks' words load as zeros. A dead token of a packed block (past
                # the request's length) keeps its finite record value: its score is -inf below
                # whatever it is, and its V operand meets a zero probability.
                ktw = tl.load(
                    (rec[:, None] + OFF_KT).to(i32p) + pair, mask=packed[:, None], other=0
                )
                kt_e = _f16_halves(ktw, 0).to(tl.float32) * 2.0
                kt_o = _f16_halves(ktw, 16).to(tl.float32) * 2.0
            else:
                ktw = tl.load((rec[:, None] + OFF_KT).to(i32p) + pair)
                kt_e = tl.where(live_e, _f16_halves(ktw, 0).to(tl.float32), 0.0) * 2.0
                kt_o = tl.where(live_o, _f16_halves(ktw, 16).to(tl.float32), 0.0) * 2.0
        else:
            ktp = (rec[:, None] + OFF_KT).to(f16)
            kt_e = tl.where(live_e, tl.load(ktp + tok_e).to(tl.float32), 0.0) * 2.0
            kt_o = tl.where(live_o, tl.load(ktp + tok_o).to(tl.float32), 0.0) * 2.0
        s_e = tl.dot(q3, (k_lo - 1024.0) * ks + kz)
        s_o = tl.dot(q3, (k_hi - 1024.0) * ks + kz)
        s_e = s_e * kt_e[:, None, :] * qmax[None, :, None]
        s_o = s_o * kt_o[:, None, :] * qmax[None, :, None]
        if MULTI:
            pos_e = (bi[:, None] * G + tok_e)[:, None, :]  # [W, 1, H2]
            re3 = row_end[None, :, None]
            s_e = tl.where(live_e[:, None, :] & (pos_e < re3), s_e, float("-inf"))
            s_o = tl.where(live_o[:, None, :] & (pos_e + 1 < re3), s_o, float("-inf"))
        else:
            s_e = tl.where(live_e[:, None, :], s_e, float("-inf"))
            s_o = tl.where(live_o[:, None, :], s_o, float("-inf"))
        m, alpha, l_acc, p_e16, p_o16 = _online(m, l_acc, s_e, s_o, 2)

        # --- P V [W, BLOCK_Q, DV] per V field ---
        vsec = rec[:, None, None] + OFF_VC
        vpair = (c[:, None] * H2 + nb[None, :])[:, :, None]  # [W, H2, 1] token pair in the tile
        vb_e = tl.load(vsec + code_offsets_of_pair(vpair, 0, nv[None, None, :], G, V_ROW, V_ORDER))
        vb_o = tl.load(vsec + code_offsets_of_pair(vpair, 1, nv[None, None, :], G, V_ROW, V_ORDER))
        if WIDE_SCALES:
            if MASKED_SCALES:  # (v4c) as the token scales above
                vsw = tl.load(
                    (rec[:, None] + OFF_VS).to(i32p) + pair, mask=packed[:, None], other=0
                )
                vzw = tl.load(
                    (rec[:, None] + OFF_VZ).to(i32p) + pair, mask=packed[:, None], other=0
                )
                vs_e = _f16_halves(vsw, 0)[:, :, None] * 0.5
                vs_o = _f16_halves(vsw, 16)[:, :, None] * 0.5
                vz_e = _f16_halves(vzw, 0)[:, :, None] * 0.5
                vz_o = _f16_halves(vzw, 16)[:, :, None] * 0.5
            else:
                vsw = tl.load((rec[:, None] + OFF_VS).to(i32p) + pair)
                vzw = tl.load((rec[:, None] + OFF_VZ).to(i32p) + pair)
                vs_e = tl.where(live_e, _f16_halves(vsw, 0), 0.0)[:, :, None] * 0.5
                vs_o = tl.where(live_o, _f16_halves(vsw, 16), 0.0)[:, :, None] * 0.5
                vz_e = tl.where(live_e, _f16_halves(vzw, 0), 0.0)[:, :, None] * 0.5
                vz_o = tl.where(live_o, _f16_halves(vzw, 16), 0.0)[:, :, None] * 0.5
            # the VG channel scales of V byte n (channels VG * n ..): one load (v4c: zeros
            # for pool blocks, from the load itself)
            if VG == 4:
                vcsp = (rec[:, None] + OFF_VCS).to(tl.pointer_type(tl.int64)) + nv[None, :]
            else:
                vcsp = (rec[:, None] + OFF_VCS).to(i32p) + nv[None, :]
            if MASKED_SCALES:  # noqa: SIM108 (a constexpr branch, as everywhere here)
                vcw = tl.load(vcsp, mask=packed[:, None], other=0)
            else:
                vcw = tl.load(vcsp)
        else:
            vsp = (rec[:, None] + OFF_VS).to(f16)
            vzp = (rec[:, None] + OFF_VZ).to(f16)
            vs_e = tl.where(live_e, tl.load(vsp + tok_e), 0.0)[:, :, None] * 0.5
            vs_o = tl.where(live_o, tl.load(vsp + tok_o), 0.0)[:, :, None] * 0.5
            vz_e = tl.where(live_e, tl.load(vzp + tok_e), 0.0)[:, :, None] * 0.5
            vz_o = tl.where(live_o, tl.load(vzp + tok_o), 0.0)[:, :, None] * 0.5
            vcp = (rec[:, None] + OFF_VCS).to(f16) + nv[None, :] * VG
        a3 = alpha[:, :, None]
        e0, e1, e2, e3 = _fields(vb_e, VB, FAST_UNPACK)
        o0_, o1_, o2_, o3_ = _fields(vb_o, VB, FAST_UNPACK)
        pv = tl.dot(p_e16, (e0 - 1024.0) * vs_e + vz_e)
        pv = tl.dot(p_o16, (o0_ - 1024.0) * vs_o + vz_o, pv)
        vcs = (
            _paired_v_scale(packed, vcw, 0, MASKED_SCALES)
            if WIDE_SCALES
            else tl.where(packed[:, None], tl.load(vcp).to(tl.float32), 0.0) * 2.0
        )
        acc0 = acc0 * a3 + pv * vcs[:, None, :]
        pv = tl.dot(p_e16, (e1 - 1024.0) * vs_e + vz_e)
        pv = tl.dot(p_o16, (o1_ - 1024.0) * vs_o + vz_o, pv)
        vcs = (
            _paired_v_scale(packed, vcw, 1, MASKED_SCALES)
            if WIDE_SCALES
            else tl.where(packed[:, None], tl.load(vcp + 1).to(tl.float32), 0.0) * 2.0
        )
        acc1 = acc1 * a3 + pv * vcs[:, None, :]
        if VG == 4:
            pv = tl.dot(p_e16, (e2 - 1024.0) * vs_e + vz_e)
            pv = tl.dot(p_o16, (o2_ - 1024.0) * vs_o + vz_o, pv)
            vcs = (
                _paired_v_scale(packed, vcw, 2, MASKED_SCALES)
                if WIDE_SCALES
                else tl.where(packed[:, None], tl.load(vcp + 2).to(tl.float32), 0.0) * 2.0
            )
            acc2 = acc2 * a3 + pv * vcs[:, None, :]
            pv = tl.dot(p_e16, (e3 - 1024.0) * vs_e + vz_e)
            pv = tl.dot(p_o16, (o3_ - 1024.0) * vs_o + vz_o, pv)
            vcs = (
                _paired_v_scale(packed, vcw, 3, MASKED_SCALES)
                if WIDE_SCALES
                else tl.where(packed[:, None], tl.load(vcp + 3).to(tl.float32), 0.0) * 2.0
            )
            acc3 = acc3 * a3 + pv * vcs[:, None, :]

    # --- merge the W warps' states ---
    m_all = tl.max(m, axis=0)  # [BLOCK_Q]
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    wscale = tl.exp2(m - m_safe[None, :])  # [W, BLOCK_Q]; 0 for empty warps
    l_tot = tl.sum(l_acc * wscale, axis=0)
    o0 = tl.sum(acc0 * wscale[:, :, None], axis=0)  # [BLOCK_Q, DV]
    o1 = tl.sum(acc1 * wscale[:, :, None], axis=0)
    o2 = tl.sum(acc2 * wscale[:, :, None], axis=0)
    o3 = tl.sum(acc3 * wscale[:, :, None], axis=0)
    m_run = m_all

    if POOL_BATCHED and PHASES != 1:
        # --- phase 2, one pool block per step: warp w attends to its G / W rows of the block
        # (fp16, no parity split), with its own online softmax; merged into the totals after.
        # The main loop's states are merged above, which frees their registers.
        TB: tl.constexpr = G // W
        m = tl.full([W, BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_acc = tl.zeros([W, BLOCK_Q], dtype=tl.float32)
        acc0 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
        acc1 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
        acc2 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
        acc3 = tl.zeros([W, BLOCK_Q, DV], dtype=tl.float32)
        sc = tl.arange(0, SCAN)
        trow = (ww[:, None] * TB + tl.arange(0, TB)[None, :]).to(tl.int64)  # [W, TB]
        for g0 in range(pool_lo, pool_hi, SCAN):
            idx, blks, slots, is_pool, rank = _pool_window(bt_row, BLOCK_TO_SLOT, g0 + sc, pool_hi)
            for k in tl.range(0, tl.sum(is_pool.to(tl.int32), axis=0), num_stages=1):
                sel = is_pool & (rank == k)
                pbi = tl.sum(tl.where(sel, idx, 0), axis=0)
                pslot = tl.sum(tl.where(sel, slots, 0), axis=0).to(tl.int64)
                pblk = tl.sum(tl.where(sel, blks, 0), axis=0).to(tl.int64)
                # Rows past seq_len are masked (other=0): NaN pool poison, stale rows, and
                # random bytes in a shadowed block's record area.
                live = pbi * G + trow < seq_len  # [W, TB]
                kr = pool_row_ptrs(POOL_K, KV, pslot, pblk, trow, h, 0, HK, D, G, SHADOW, STRIDE)
                vr = pool_row_ptrs(POOL_V, KV, pslot, pblk, trow, h, 1, HK, D, G, SHADOW, STRIDE)
                kt = tl.load(kr[:, :, None] + dd[None, None, :], mask=live[:, :, None], other=0.0)
                sp = tl.dot(q3, tl.permute(kt, (0, 2, 1))) * qmax[None, :, None]  # [W, Q, TB]
                if MULTI:
                    pos = (pbi * G + trow)[:, None, :]  # [W, 1, TB]
                    seen = live[:, None, :] & (pos < row_end[None, :, None])
                    sp = tl.where(seen, sp, float("-inf"))
                else:
                    sp = tl.where(live[:, None, :], sp, float("-inf"))
                m_new = tl.maximum(m, tl.max(sp, axis=2))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(sp - m_use[:, :, None])
                l_acc = l_acc * alpha + tl.sum(p, axis=2)
                m = m_new
                p16 = p.to(tl.float16)
                a3 = alpha[:, :, None]
                vt = tl.load(vr[:, :, None] + dd[None, None, :], mask=live[:, :, None], other=0.0)
                # the VG channel fields of the rows (channel VG * n + f), in registers
                if VG == 4:
                    va, vb = tl.split(tl.reshape(vt, (W, TB, DV, 2, 2)))
                    f0, f2 = tl.split(va)
                    f1, f3 = tl.split(vb)
                else:
                    f0, f1 = tl.split(tl.reshape(vt, (W, TB, DV, 2)))
                acc0 = acc0 * a3 + tl.dot(p16, f0)
                acc1 = acc1 * a3 + tl.dot(p16, f1)
                if VG == 4:
                    acc2 = acc2 * a3 + tl.dot(p16, f2)
                    acc3 = acc3 * a3 + tl.dot(p16, f3)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # [BLOCK_Q]
        m_safe2 = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_main = tl.exp2(m_run - m_safe2)
        ws2 = tl.exp2(m - m_safe2[None, :])  # [W, BLOCK_Q]; 0 for warps without pool rows
        l_tot = l_tot * s_main + tl.sum(l_acc * ws2, axis=0)
        o0 = o0 * s_main[:, None] + tl.sum(acc0 * ws2[:, :, None], axis=0)
        o1 = o1 * s_main[:, None] + tl.sum(acc1 * ws2[:, :, None], axis=0)
        o2 = o2 * s_main[:, None] + tl.sum(acc2 * ws2[:, :, None], axis=0)
        o3 = o3 * s_main[:, None] + tl.sum(acc3 * ws2[:, :, None], axis=0)
        m_run = m_new

    # --- phase 2: the split's pool-resident blocks (fp16 sink / in-progress tiles), one
    # chunk at a time across the warps ---
    if not POOL_BATCHED and PHASES != 1:
        sc = tl.arange(0, SCAN)
        tn = tl.arange(0, H2)
        for g0 in range(pool_lo, pool_hi, SCAN):
            idx, blks, slots, is_pool, rank = _pool_window(bt_row, BLOCK_TO_SLOT, g0 + sc, pool_hi)
            for k in range(0, tl.sum(is_pool.to(tl.int32), axis=0)):
                sel = is_pool & (rank == k)
                pbi = tl.sum(tl.where(sel, idx, 0), axis=0)
                pslot = tl.sum(tl.where(sel, slots, 0), axis=0).to(tl.int64)
                if SHADOW > 0:
                    pblk = tl.sum(tl.where(sel, blks, 0), axis=0).to(tl.int64)
                for cc in range(0, NCH):
                    te = cc * BN + tn * 2
                    # Rows past seq_len are masked (other=0): NaN pool poison, stale rows, and
                    # random bytes in a shadowed block's record area.
                    le = pbi * G + te < seq_len
                    lo_ = pbi * G + te + 1 < seq_len
                    if SHADOW == 0:
                        # Every row in the pool slot: pool_row_ptrs' SHADOW == 0 addresses, kept
                        # as the integer offsets v4 was timed with. Built from pool_row_ptrs'
                        # pointers they compiled to other sm_90a SASS (other register assignment;
                        # more spills at D = 64 with the odd rows' addresses recomputed).
                        prow_e = (pslot * G + te) * HK + h
                        prow_o = prow_e + HK
                        kpe_p = POOL_K + prow_e[None, :] * D + dd[:, None]
                        kpo_p = POOL_K + prow_o[None, :] * D + dd[:, None]
                    else:
                        # rows < SHADOW from the block's record area; an odd row may be a pool
                        # row while its even row is not, so each parity is addressed on its own
                        kre = pool_row_ptrs(
                            POOL_K, KV, pslot, pblk, te, h, 0, HK, D, G, SHADOW, STRIDE
                        )
                        kro = pool_row_ptrs(
                            POOL_K, KV, pslot, pblk, te + 1, h, 0, HK, D, G, SHADOW, STRIDE
                        )
                        kpe_p = kre[None, :] + dd[:, None]
                        kpo_p = kro[None, :] + dd[:, None]
                    kpe = tl.load(kpe_p, mask=le[None, :], other=0.0)
                    kpo = tl.load(kpo_p, mask=lo_[None, :], other=0.0)
                    pe = tl.dot(q16, kpe) * qmax[:, None]
                    po = tl.dot(q16, kpo) * qmax[:, None]
                    if MULTI:
                        pos_e = (pbi * G + te)[None, :]  # [1, H2]
                        pe = tl.where(le[None, :] & (pos_e < row_end[:, None]), pe, float("-inf"))
                        po = tl.where(
                            lo_[None, :] & (pos_e + 1 < row_end[:, None]), po, float("-inf")
                        )
                    else:
                        pe = tl.where(le[None, :], pe, float("-inf"))
                        po = tl.where(lo_[None, :], po, float("-inf"))
                    m_run, alpha2, l_tot, pe16, po16 = _online(m_run, l_tot, pe, po, 1)
                    a2 = alpha2[:, None]
                    if SHADOW == 0:
                        vpe = POOL_V + prow_e[:, None] * D + nv[None, :] * VG
                        vpo = POOL_V + prow_o[:, None] * D + nv[None, :] * VG
                    else:
                        vre = pool_row_ptrs(
                            POOL_V, KV, pslot, pblk, te, h, 1, HK, D, G, SHADOW, STRIDE
                        )
                        vro = pool_row_ptrs(
                            POOL_V, KV, pslot, pblk, te + 1, h, 1, HK, D, G, SHADOW, STRIDE
                        )
                        vpe = vre[:, None] + nv[None, :] * VG
                        vpo = vro[:, None] + nv[None, :] * VG
                    o0 = o0 * a2 + tl.dot(pe16, tl.load(vpe, mask=le[:, None], other=0.0))
                    o0 = o0 + tl.dot(po16, tl.load(vpo, mask=lo_[:, None], other=0.0))
                    o1 = o1 * a2 + tl.dot(pe16, tl.load(vpe + 1, mask=le[:, None], other=0.0))
                    o1 = o1 + tl.dot(po16, tl.load(vpo + 1, mask=lo_[:, None], other=0.0))
                    if VG == 4:
                        o2 = o2 * a2 + tl.dot(pe16, tl.load(vpe + 2, mask=le[:, None], other=0.0))
                        o2 = o2 + tl.dot(po16, tl.load(vpo + 2, mask=lo_[:, None], other=0.0))
                        o3 = o3 * a2 + tl.dot(pe16, tl.load(vpe + 3, mask=le[:, None], other=0.0))
                        o3 = o3 + tl.dot(po16, tl.load(vpo + 3, mask=lo_[:, None], other=0.0))

    l_safe = tl.where(l_tot > 0, l_tot, 1.0)
    lse = tl.where(l_tot > 0, m_run + tl.log2(l_safe), float("-inf"))
    prow_out = split.to(tl.int64) * n_rows_total + rows
    obase = O_PART + prow_out[:, None] * D + nv[None, :] * VG
    tl.store(obase, o0 / l_safe[:, None], mask=q_ok[:, None])
    tl.store(obase + 1, o1 / l_safe[:, None], mask=q_ok[:, None])
    if VG == 4:
        tl.store(obase + 2, o2 / l_safe[:, None], mask=q_ok[:, None])
        tl.store(obase + 3, o3 / l_safe[:, None], mask=q_ok[:, None])
    tl.store(LSE_PART + prow_out, lse, mask=q_ok)


def decode_v4_config(head_dim: int, group: int, *, verify: bool = False) -> dict[str, int]:
    """Default launch shape, as timed on the H200 (docs/kernel-notes.md, round 4).

    ``BN`` tokens per warp and step such that one warp's K chunk is ``D x BN/2 = 4 KB`` of
    bytes, 4 warps (4 chunks in flight per program), 2 pipeline stages, block-table scans of
    64 entries in the pool phase. At k4v2_g128, B = 64, 16K, D = 128 this shape takes 903 µs
    (v1: 1,559); 3 stages 1,021 µs, BN 32 2,503 µs, BN 32 on 8 warps 3,996 µs.

    Decode at head dims of 256 and more pipelines one stage: a second stage's buffers cost
    the registers and shared memory that the wider tiles need (H200, eleventh session's
    kernel check, k4v2_g128, B = 64, 16K, v4c with 8 query rows: 3,238 µs with one stage,
    4,020 µs with two). Speculative verify (16 query rows) keeps two stages there, untimed
    with one. Other head dims and 64-token tiles run the same rules untimed.
    """
    bn = max(32, min(group, 8192 // head_dim))
    stages = 1 if head_dim >= 256 and not verify else 2
    return {"block_n": bn, "num_warps": 4, "num_stages": stages, "scan": 64}
