# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon JIT kernels are untyped by nature.)
"""Fused prefill with cached context on Hopper's asynchronous warpgroup MMA (Gluon).

:mod:`kvarn_kernels.prefill_v2` (Triton) dequantizes a chunk, then waits for each MMA before
its next instruction: one program of 8 warps per SM, its warps stalled on the MMAs, the loads
and the barriers in turn (docs/kernel-notes.md, twenty-fourth session: 2 warps a scheduler,
1.05 instructions per cycle, ~7.5K cycles per 64-token step of 128 rows). Here a program (8
warps, two warpgroups, 128 query rows = tokens x GQA heads of one KV head; 4 warps and 64
rows with ``block_m=64``) overlaps the parts of its loop:

* the scores of chunk ``j`` (``Q K_j^T``) run as an asynchronous wgmma while the warps
  dequantize chunk ``j + 1`` into the other of two shared-memory stages;
* the raw bytes and scales of chunk ``j + 2`` are loaded into registers while chunk ``j + 1``
  is dequantized (two chunks of global-load latency hidden);
* ``P V_j`` runs from the registers' probabilities against stage ``j``;
* the loop takes two chunks a trip, each stage its own allocation and written by one store:
  one barrier a step (the compiler cannot tell slices of one allocation apart and put one
  between every two stores).

On an H200 it takes 0.56-0.71x v2's time, 2.02x FA3 fp16's at 64 tokens after 16K (B = 1):
ALU-latency-bound (~1,000 instructions a warp a step at ~1.3-1.5 a cycle over the SM).
Leaving ``P V`` running into the next step (three stages) was no faster; dequantizing in fp16
pairs (``DEQ16``, the default) took 16% of the instructions off and 7-14% of the time.

:func:`prefill_v3ws_kernel` (the default for 128-row tiles, :data:`V3_WARP_SPECIALIZED`) splits
the loop over warps of their own: producer warps copy raw chunks ahead into a shared-memory
ring with ``cp.async`` and dequantize them into three stages, the two consumer warpgroups
only wait for a stage to be ready. 0.80-0.84x this kernel's time; with the stage stores spread
over the shared-memory banks (:data:`WS_SPREAD_STORES`) and the codes unpacked without
shifts 1.53x FA3 fp16's at 64 tokens after 16K (B = 1).

Layout choices that keep the dequantization free of shuffles:

* tokens of a chunk are kept parity-major (row ``i`` of a stage is token ``2 (i % 32) + i //
  32`` of the chunk): K's 4-bit bytes hold a token pair (low nibble even), V's in-cache
  order stores the even tokens' rows, then the odd ones' (:class:`kvarn_format.CodeOrder`
  ``PARITY``), so both unpack into the two halves of a stage. Attention does not depend on
  the order of the keys, as long as K's rows, V's rows, the token scales and the causal mask
  agree;
* K's in-cache order is transposed (channels contiguous for a token pair): a chunk's K bytes
  are one contiguous ``[32 pairs, D]`` block.

Numerics: ``k / 2`` and ``v / 2`` in fp16, saturated to +-65504 (NaN kept), rounded twice with
:data:`V3_DEQ16` (``code * scale + zero``, then the other axis' scale, in fp16 pairs; 6e-4
from the dequantize path's output at the bench's shape) or once as the dequantize path and v2
do (fp32, ``V3_DEQ16 = False``); the query row-normalized to fp16, fp32 scores and accumulators.
GPU only (Gluon has no interpreter); 4-bit keys with 2- or 4-bit values, head dim 128 (pool
slots with or without shadow rows); the launcher uses v2 elsewhere.
"""

from __future__ import annotations

from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
)
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kvarn_kernels._common import PREFILL_UNSPECIALIZED
from kvarn_kernels._launch import gdc_wait

__all__ = ["V3_HEAD_DIMS", "V3_WARPS", "prefill_v3_kernel", "prefill_v3ws_kernel"]

#: Warps per program (``16 * V3_WARPS`` query rows: one or two warpgroups).
V3_WARPS = 8
#: Dequantize a chunk (:func:`_stage_record`) in fp16 pairs (two roundings a value; codes
#: unpacked without shifts, saturated by one ``min.xorsign.abs``), else in fp32 (one
#: rounding, the dequantize path's values).
V3_DEQ16 = True
#: Run 128-row tiles on the warp-specialized form (:func:`prefill_v3ws_kernel`): 0.83-0.91x
#: the one-partition kernel's time on an H200 (docs/kernel-notes.md, twenty-sixth session).
V3_WARP_SPECIALIZED = True
#: Head dims the kernel is written for.
V3_HEAD_DIMS = (128,)

_FP16_MAX: gl.constexpr = gl.constexpr(65504.0)


@gluon.constexpr_function
def _rows_layout(W):
    """``[rows, D]`` fp32 or fp16 over ``W`` warps: the outputs' store, the query load and
    the pool rows' copy."""
    return gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])


@gluon.constexpr_function
def _acc_layout(W, N):
    """The wgmma accumulator ``[rows, N]`` of ``W`` warps (a warpgroup per 64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, N, 16])


@gluon.constexpr_function
def _p_operand(W, D):
    """``P V``'s register A operand: the probabilities against the ``[rows, D]`` output."""
    return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(W, D), k_width=2)


@gluon.constexpr_function
def _record_loads(D, G, VB, offsets, W, SPREAD=False):
    """:func:`_load_raw`'s constants for ``W`` loading warps: head dim, group, value bits, the
    record's eight field offsets, then the layouts of K's ``[32 pairs, D]`` bytes and of V's
    ``[32 pairs, D * VB / 8]`` bytes.

    ``SPREAD`` (:data:`WS_SPREAD_STORES`): layouts whose stage stores touch every bank of
    shared memory once a wavefront. A stage row is 128-byte swizzled: its 16-byte chunk ``c``
    lies at ``c ^ (row % 8)``. Eight lanes of a row, 16 channels each, put their first
    chunks at only four places (chunks 0, 2, 4, 6 of both 64-channel halves), so K's
    ``STS.128`` took 2 wavefronts where 1 does; V's lanes held rows 4 apart, two swizzle
    phases among 8 rows, and its ``STS.64`` took 4 (Nsight Compute, docs/kernel-notes.md,
    thirtieth session). Spread: K's lanes 4 to a row (two rows of a wavefront, adjacent
    phases), V's rows 2 apart a lane (four even phases)."""
    if SPREAD:
        k_bytes = gl.BlockedLayout([1, 16], [8, 4], [W, 1], [1, 0])
        v_bytes = gl.BlockedLayout([2, 1], [8, 4], [1, W], [1, 0])
    else:
        k_bytes = gl.BlockedLayout([1, 16], [4, 8], [W, 1], [1, 0])
        v_bytes = gl.BlockedLayout([4, 1], [8, 4], [1, W], [0, 1])
    return (D, G, VB, *offsets, k_bytes, v_bytes)


@gluon.jit
def _sat16(x):
    """fp32 to fp16, finite values beyond fp16's range clamped to +-65504 (one
    ``cvt.rn.satfinite`` per pair)."""
    return gl.inline_asm_elementwise(
        "cvt.rn.satfinite.f16x2.f32 $0, $2, $1;",
        "=r,f,f",
        [x],
        dtype=gl.float16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _load_raw(rec, c, ok, LOADS: gl.constexpr):
    """Chunk ``c`` (64 tokens) of record ``rec`` (``LOADS``: head dim, group, value bits, the
    record's field offsets, K's and V's byte layouts): K bytes ``[32 pairs, D]``, V bytes of the even
    and the odd tokens ``[32 pairs, D * VB / 8]``, and the fp16 scales (channel vectors in K's
    and V's column layouts, token vectors as even / odd halves)."""
    D: gl.constexpr = LOADS[0]
    G: gl.constexpr = LOADS[1]
    VB: gl.constexpr = LOADS[2]
    OFF_KC: gl.constexpr = LOADS[3]
    OFF_KS: gl.constexpr = LOADS[4]
    OFF_KZ: gl.constexpr = LOADS[5]
    OFF_KT: gl.constexpr = LOADS[6]
    OFF_VC: gl.constexpr = LOADS[7]
    OFF_VCS: gl.constexpr = LOADS[8]
    OFF_VS: gl.constexpr = LOADS[9]
    OFF_VZ: gl.constexpr = LOADS[10]
    KL: gl.constexpr = LOADS[11]
    VL: gl.constexpr = LOADS[12]
    VCOLS: gl.constexpr = D * VB // 8
    pr = gl.arange(0, 32, layout=gl.SliceLayout(1, KL))
    dk = gl.arange(0, D, layout=gl.SliceLayout(0, KL))
    # K, transposed in-cache order: byte (channel d, pair j) at j * D + d
    kb = gl.load(rec + OFF_KC + (c * 32 + pr)[:, None] * D + dk[None, :], mask=ok, other=0)
    # V, parity order: byte (parity p, column b, pair j) at p * (VCOLS * G / 2) + b * G / 2 + j
    pv = gl.arange(0, 32, layout=gl.SliceLayout(1, VL))
    bv = gl.arange(0, VCOLS, layout=gl.SliceLayout(0, VL))
    voff = bv[None, :] * (G // 2) + (c * 32 + pv)[:, None]
    ve = gl.load(rec + OFF_VC + voff, mask=ok, other=0)
    vo = gl.load(rec + OFF_VC + VCOLS * (G // 2) + voff, mask=ok, other=0)
    f16 = gl.pointer_type(gl.float16)
    ks = gl.load((rec + OFF_KS).to(f16) + dk, mask=ok, other=0.0)
    kz = gl.load((rec + OFF_KZ).to(f16) + dk, mask=ok, other=0.0)
    tk = c * 64 + 2 * pr
    kte = gl.load((rec + OFF_KT).to(f16) + tk, mask=ok, other=0.0)
    kto = gl.load((rec + OFF_KT).to(f16) + tk + 1, mask=ok, other=0.0)
    tv = c * 64 + 2 * pv
    vse = gl.load((rec + OFF_VS).to(f16) + tv, mask=ok, other=0.0)
    vso = gl.load((rec + OFF_VS).to(f16) + tv + 1, mask=ok, other=0.0)
    vze = gl.load((rec + OFF_VZ).to(f16) + tv, mask=ok, other=0.0)
    vzo = gl.load((rec + OFF_VZ).to(f16) + tv + 1, mask=ok, other=0.0)
    # V's channel scales by bit field: channel PER * b + f of byte column b
    PER: gl.constexpr = 8 // VB
    vcol = (rec + OFF_VCS).to(f16) + bv * PER
    vc0 = gl.load(vcol, mask=ok, other=0.0)
    vc1 = gl.load(vcol + 1, mask=ok, other=0.0)
    vc2 = gl.load(vcol + 2 % PER, mask=ok, other=0.0)  # unused at 4 bits
    vc3 = gl.load(vcol + 3 % PER, mask=ok, other=0.0)
    return kb, ve, vo, ks, kz, kte, kto, vse, vso, vze, vzo, vc0, vc1, vc2, vc3


@gluon.jit
def _unpack_nibbles(b):
    """Two fp16 tensors for the low and the high nibbles of bytes ``b``: ``base + code``, the
    bases :func:`_field_base`'s (about one instruction per code)."""
    return gl.inline_asm_elementwise(
        _unpack_asm(4),
        "=r,=r,=r,=r,r",
        [b],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.constexpr_function
def _fp16_pow2_bits(x):
    """The fp16 bits of the power of two ``x``, for PTX immediates."""
    return (int(x).bit_length() - 1 + 15) << 10


@gluon.constexpr_function
def _unpack_asm(BITS):
    """PTX unpacking the ``8 / BITS`` fields of 4 bytes without shifts: a field at bit ``k``
    of a 16-bit half, masked in place and OR-ed into the fp16 whose mantissa bit ``k`` weighs
    1 (:func:`_field_base`), reads ``base + code``. Two instructions a byte pair fewer than
    attention.py's shifting unpack for 4-bit codes, six for 2-bit ones (docs/kernel-notes.md,
    thirty-first and thirty-second sessions)."""
    fields = 8 // BITS
    lines = [
        "{",
        ".reg .b32 t0, t1;",
        f"prmt.b32 t0, ${2 * fields}, 0, 0x4140;",
        f"prmt.b32 t1, ${2 * fields}, 0, 0x4342;",
    ]
    for f in range(fields):
        mask = ((1 << BITS) - 1) << (BITS * f)
        base = _fp16_pow2_bits(_field_base(f, BITS))
        for half in range(2):
            lines.append(
                f"lop3.b32 ${2 * f + half}, t{half}, 0x{mask:04X}{mask:04X}, "
                f"0x{base:04X}{base:04X}, 0xEA;"
            )
    return "\n".join([*lines, "}"])


@gluon.constexpr_function
def _field_base(f, BITS):
    """The fp16 that field ``f`` (``BITS`` wide) of a byte is read against: the power of two
    whose mantissa bit ``BITS * f`` weighs 1."""
    return 1024.0 / (1 << (BITS * f))


@gluon.constexpr_function
def _affine16x2_asm(base):
    """PTX for ``((c - base) * scale + zero) * mult`` on fp16 pairs (``base`` a power of two),
    saturated to +-65504 with NaN kept by one ``min.xorsign.abs`` (sm_86+: ``|t|`` capped at
    65504 keeps ``t``'s sign, the XOR of its own and 65504's; the same value as a ``min`` and a
    ``max`` for every input). ~2.5 instructions a value where the fp32 form takes ~7."""
    half = _fp16_pow2_bits(base)
    return (
        "{\n.reg .b32 t, k;\n"
        f"mov.b32 k, 0x{half:04X}{half:04X};\n"
        "sub.rn.f16x2 t, $1, k;\nfma.rn.f16x2 t, t, $2, $3;\nmul.rn.f16x2 t, t, $4;\n"
        "mov.b32 k, 0x7BFF7BFF;\nmin.NaN.xorsign.abs.f16x2 $0, t, k;\n}\n"
    )


@gluon.jit
def _affine(c, base: gl.constexpr, scale, zero, mult, DEQ16: gl.constexpr):
    """fp16 ``((c - base) * scale + zero) * mult``, saturated; ``c`` a code read against
    ``base`` (:func:`_field_base`), ``scale``, ``zero`` and ``mult`` fp16, broadcast.
    ``DEQ16`` (:data:`V3_DEQ16`): in fp16 pairs (two roundings); else in fp32 (one rounding,
    the dequantize path's values)."""
    if DEQ16:
        return gl.inline_asm_elementwise(
            _affine16x2_asm(base),
            "=r,r,r,r,r",
            [c, scale, zero, mult],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )
    else:
        sf = scale.to(gl.float32)
        return _sat16(
            (c.to(gl.float32) * sf + (zero.to(gl.float32) - base * sf)) * mult.to(gl.float32)
        )


@gluon.jit
def _v_rows(vb, vs, vz, vc0, vc1, vc2, vc3, VB: gl.constexpr, D: gl.constexpr, DEQ16: gl.constexpr):
    """``v / 2`` of 32 tokens ``[32, D]`` fp16 from their bytes ``[32, D * VB / 8]`` (channel
    ``c`` in bits ``VB * (c % (8 / VB))`` of byte ``c // (8 / VB)``); ``vs`` and ``vz`` the
    tokens' scale and zero, halved; ``vc0 .. vc3`` the channel scales of each bit field. Each
    field is scaled in the bytes' layout and only the fp16 result is interleaved."""
    s = vs[:, None]
    z = vz[:, None]
    if VB == 2:
        c0, c1, c2, c3 = gl.inline_asm_elementwise(
            _unpack_asm(2),
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [vb],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True,
            pack=4,
        )
        f0 = _affine(c0, _field_base(0, 2), s, z, vc0[None, :], DEQ16)
        f1 = _affine(c1, _field_base(1, 2), s, z, vc1[None, :], DEQ16)
        f2 = _affine(c2, _field_base(2, 2), s, z, vc2[None, :], DEQ16)
        f3 = _affine(c3, _field_base(3, 2), s, z, vc3[None, :], DEQ16)
        v = gl.reshape(gl.join(gl.join(f0, f2), gl.join(f1, f3)), [32, D])
    else:
        c0, c1 = _unpack_nibbles(vb)
        f0 = _affine(c0, _field_base(0, 4), s, z, vc0[None, :], DEQ16)
        f1 = _affine(c1, _field_base(1, 4), s, z, vc1[None, :], DEQ16)
        v = gl.reshape(gl.join(f0, f1), [32, D])
    return v


@gluon.jit
def _stack_rows(top, bottom, D: gl.constexpr):
    """``[32, D]`` on ``[32, D]``: ``[64, D]`` (the even tokens' rows, then the odd ones')."""
    return gl.reshape(gl.permute(gl.join(top, bottom), (2, 0, 1)), [64, D])


@gluon.jit
def _stage_record(k_stage, v_stage, raw, VB: gl.constexpr, D: gl.constexpr, DEQ16: gl.constexpr):
    """Dequantize one chunk's raw bytes (:func:`_load_raw`) into a shared-memory stage (rows
    parity-major)."""
    kb, ve, vo, ks, kz, kte, kto, vse, vso, vze, vzo, vc0, vc1, vc2, vc3 = raw
    lo, hi = _unpack_nibbles(kb)
    # k = (code * k_scale + k_zero) * k_token_scale, halved; even tokens in the low nibbles
    k_even = _affine(lo, _field_base(0, 4), ks[None, :], kz[None, :], (kte * 0.5)[:, None], DEQ16)
    k_odd = _affine(hi, _field_base(1, 4), ks[None, :], kz[None, :], (kto * 0.5)[:, None], DEQ16)
    v_even = _v_rows(ve, vse * 0.5, vze * 0.5, vc0, vc1, vc2, vc3, VB, D, DEQ16)
    v_odd = _v_rows(vo, vso * 0.5, vzo * 0.5, vc0, vc1, vc2, vc3, VB, D, DEQ16)
    # each stage in one store: two stores to one allocation get a barrier between them
    k_stage.store(_stack_rows(k_even, k_odd, D))
    v_stage.store(_stack_rows(v_even, v_odd, D))


@gluon.jit
def _stage_pool(
    k_stage,
    v_stage,
    pool,
    slot,
    c,
    live_from,
    kv_len,
    h,
    HK: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
    SHADOW: gl.constexpr,
    STRIDE: gl.constexpr,
    PL: gl.constexpr,
):
    """A pool block's chunk ``c`` (fp16, halved) into a stage, rows parity-major; rows past
    ``kv_len`` are zero (stale rows, NaN poison). ``pool``: the pool's K and V, the paged
    cache and the block: with ``SHADOW`` rows, a tile's first ``SHADOW`` rows are in the
    block's record area (K's rows, then V's; ``_common.pool_row_ptrs``), the others in pool
    slots of ``G - SHADOW`` rows."""
    i = gl.arange(0, 64, layout=gl.SliceLayout(1, PL))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, PL))
    t = c * 64 + 2 * (i % 32) + i // 32  # token of stage row i within the tile
    live = live_from + t < kv_len
    k_src, v_src = _pool_rows(pool, slot, t, h, HK, D, G, SHADOW, STRIDE)
    kp = gl.load(k_src[:, None] + dd[None, :], mask=live[:, None], other=0.0)
    vp = gl.load(v_src[:, None] + dd[None, :], mask=live[:, None], other=0.0)
    k_stage.store(kp * 0.5)
    v_stage.store(vp * 0.5)


@gluon.jit
def _pool_rows(
    pool,
    slot,
    t,
    h,
    HK: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
    SHADOW: gl.constexpr,
    STRIDE: gl.constexpr,
):
    """The fp16 K and V rows of tokens ``t`` (within the tile) of a pool block in slot
    ``slot`` (``pool``: the pool's K and V, the paged cache and the block; ``SHADOW``:
    :func:`_stage_pool`'s)."""
    POOL_K, POOL_V, KV, blk = pool
    if SHADOW == 0:
        rows = ((slot.to(gl.int64) * G + t) * HK + h) * D
        k_src = POOL_K + rows
        v_src = POOL_V + rows
    else:
        pooled = t >= SHADOW
        rows = ((slot.to(gl.int64) * (G - SHADOW) + gl.where(pooled, t - SHADOW, 0)) * HK + h) * D
        record = (KV + (blk * HK + h) * STRIDE).to(gl.pointer_type(gl.float16))
        in_record = gl.where(pooled, 0, t) * D
        k_src = gl.where(pooled, POOL_K + rows, record + in_record)
        v_src = gl.where(pooled, POOL_V + rows, record + SHADOW * D + in_record)
    return k_src, v_src


@gluon.jit
def _stage_chunk(
    stage,
    slot,
    raw,
    it,
    tile,
    HK: gl.constexpr,
    LOADS: gl.constexpr,
    DEQ16: gl.constexpr,
    SHADOW: gl.constexpr,
    STRIDE: gl.constexpr,
    PL: gl.constexpr,
):
    """Chunk ``it`` into a stage (``stage``: its K and V buffers, then the pool's K and V and
    the paged cache): its pool block's rows when ``slot >= 0``, else its record's raw bytes
    ``raw`` dequantized. ``tile``: the block table's row, the split's first block and
    chunks, the keys the tile sees and the KV head."""
    k_stage, v_stage, POOL_K, POOL_V, KV = stage
    bt_row, blk_lo, n_it, kv_len, h = tile
    D: gl.constexpr = LOADS[0]
    G: gl.constexpr = LOADS[1]
    VB: gl.constexpr = LOADS[2]
    NCH: gl.constexpr = G // 64
    if slot >= 0:
        start = (blk_lo + it // NCH) * G
        pool = (POOL_K, POOL_V, KV, _chunk_block(bt_row, blk_lo, it, n_it, NCH))
        _stage_pool(
            k_stage,
            v_stage,
            pool,
            slot,
            it % NCH,
            start,
            kv_len,
            h,
            HK,
            D,
            G,
            SHADOW,
            STRIDE,
            PL,
        )
    else:
        _stage_record(k_stage, v_stage, raw, VB, D, DEQ16)


@gluon.jit
def _next_raw(
    bt_row,
    BLOCK_TO_SLOT,
    KV,
    blk_lo,
    it,
    n_it,
    h,
    HK: gl.constexpr,
    STRIDE: gl.constexpr,
    NCH: gl.constexpr,
    LOADS: gl.constexpr,
):
    """Chunk ``it``'s pool slot and raw record bytes (:func:`_load_raw`; ``LOADS`` its
    constant arguments; nothing loaded past ``n_it``)."""
    ok = it < n_it
    blk = _chunk_block(bt_row, blk_lo, it, n_it, NCH)
    slot = gl.load(BLOCK_TO_SLOT + blk, mask=ok, other=0)
    raw = _load_raw(KV + (blk * HK + h) * STRIDE, it % NCH, ok, LOADS)
    return slot, raw


@gluon.jit
def _chunk_block(bt_row, blk_lo, it, n_it, NCH: gl.constexpr):
    """Chunk ``it``'s cache block (0 past ``n_it``)."""
    return gl.load(bt_row + blk_lo + it // NCH, mask=it < n_it, other=0).to(gl.int64)


@gluon.jit
def _step(
    ctx,
    ST: gl.constexpr,
    it,
    state,
    nxt,
    HK: gl.constexpr,
    STRIDE: gl.constexpr,
    NCH: gl.constexpr,
    LOADS: gl.constexpr,
    OL: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    P_OP: gl.constexpr,
    M: gl.constexpr,
    DEQ16: gl.constexpr,
    SHADOW: gl.constexpr,
):
    """Chunk ``it`` from stage ``ST``: its scores as an asynchronous wgmma, meanwhile chunk
    ``it + 1`` (``nxt``: its slot and raw bytes) dequantized into stage ``1 - ST`` and chunk
    ``it + 2``'s bytes loaded; then the softmax and ``P V``. Returns the new softmax state and
    chunk ``it + 2``'s slot and bytes."""
    BN: gl.constexpr = 64
    G: gl.constexpr = LOADS[1]
    (
        q_smem,
        k0,
        v0,
        k1,
        v1,
        row_scale,
        q_pos,
        pos_lo,
        kv_len,
        blk_lo,
        bt_row,
        BLOCK_TO_SLOT,
        KV,
        POOL_K,
        POOL_V,
        h,
        n_it,
    ) = ctx
    if ST == 0:
        k_cur, v_cur, k_nxt, v_nxt = k0, v0, k1, v1
    else:
        k_cur, v_cur, k_nxt, v_nxt = k1, v1, k0, v0
    s_tok = warpgroup_mma(
        q_smem,
        k_cur.permute((1, 0)),
        gl.zeros([M, BN], gl.float32, layout=S_MMA),
        use_acc=False,
        is_async=True,
    )
    slot, raw = nxt
    if it + 1 < n_it:
        stage = (k_nxt, v_nxt, POOL_K, POOL_V, KV)
        tile = (bt_row, blk_lo, n_it, kv_len, h)
        _stage_chunk(stage, slot, raw, it + 1, tile, HK, LOADS, DEQ16, SHADOW, STRIDE, OL)
    nxt = _next_raw(bt_row, BLOCK_TO_SLOT, KV, blk_lo, it + 2, n_it, h, HK, STRIDE, NCH, LOADS)

    s = warpgroup_mma_wait(0, deps=[s_tok])
    t0 = (blk_lo + it // NCH) * G + (it % NCH) * BN
    state = _softmax_pv(s, v_cur, state, t0, row_scale, q_pos, pos_lo, kv_len, O_MMA, P_OP)
    fence_async_shared()
    gl.thread_barrier()
    return state, nxt


@gluon.jit
def _softmax_pv(
    s, v_cur, state, t0, row_scale, q_pos, pos_lo, kv_len, O_MMA: gl.constexpr, P_OP: gl.constexpr
):
    """The online softmax of one chunk's scores ``s`` (``[M, 64]``, stage rows parity-major
    from token ``t0``; keys after a row's own position or past ``kv_len`` masked), then ``P V``
    against the stage ``v_cur``; returns the new ``(m, l, acc)``."""
    BN: gl.constexpr = 64
    m_i, l_i, acc = state
    if t0 + BN - 1 > pos_lo:  # some row must not see some key of the chunk
        tn = gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        tpos = t0 + 2 * (tn % 32) + tn // 32  # stage row tn's token
        keep = (tpos[None, :] <= q_pos[:, None]) & (tpos < kv_len)[None, :]
        s = gl.where(keep, s, float("-inf"))
    # row_scale > 0: the scores' row maximum is row_scale times the raw one
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * row_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * row_scale[:, None] - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA))[:, None]
    p16 = gl.convert_layout(p.to(gl.float16), P_OP)
    o_tok = warpgroup_mma(p16, v_cur, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[o_tok])
    return m_new, l_i, acc


@gluon.jit(**PREFILL_UNSPECIALIZED)
def prefill_v3_kernel(
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
    HQ: gl.constexpr,
    HK: gl.constexpr,
    QPK: gl.constexpr,
    QPK_P: gl.constexpr,
    BQ: gl.constexpr,
    B_P: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
    VB: gl.constexpr,
    STRIDE: gl.constexpr,
    OFF_KC: gl.constexpr,
    OFF_KS: gl.constexpr,
    OFF_KZ: gl.constexpr,
    OFF_KT: gl.constexpr,
    OFF_VC: gl.constexpr,
    OFF_VCS: gl.constexpr,
    OFF_VS: gl.constexpr,
    OFF_VZ: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    W: gl.constexpr,
    DEQ16: gl.constexpr,
    SHADOW: gl.constexpr,
    PDL: gl.constexpr,
):
    """As :func:`kvarn_kernels.prefill_v2.prefill_v2_kernel` (the same grid, partials and
    arguments, 64-token chunks), on the asynchronous wgmma: ``W`` warps (4 or 8, launched
    with ``num_warps=W``) and ``16 W`` query rows. ``PDL``: launched as a programmatic
    dependent (:func:`gdc_wait` before the queries)."""
    M: gl.constexpr = 16 * W
    BN: gl.constexpr = 64
    NCH: gl.constexpr = G // BN
    gl.static_assert(D == 128, "head dim 128")
    gl.static_assert(G % BN == 0, "a tile must be whole chunks")
    OL: gl.constexpr = _rows_layout(W)
    S_MMA: gl.constexpr = _acc_layout(W, BN)
    O_MMA: gl.constexpr = _acc_layout(W, D)
    P_OP: gl.constexpr = _p_operand(W, D)
    SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)

    pid = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    first, q_end, pos_lo, kv_len, m, rows, row_ok, b = _tile_rows(
        pid, h, QSL, SEQ_LENS, num_reqs, HQ, QPK, QPK_P, BQ, B_P, M, W, OL
    )
    if first >= q_end:
        return
    q_smem, row_scale, q_pos = _query_tile(
        Q, rows, row_ok, m, qk_scale, pos_lo, QPK_P, M, D, OL, S_MMA, PDL
    )

    # two stages, each its own allocation (the barrier placement tells allocations apart,
    # not the stages of one)
    k0 = gl.allocate_shared_memory(gl.float16, [BN, D], SMEM)
    v0 = gl.allocate_shared_memory(gl.float16, [BN, D], SMEM)
    k1 = gl.allocate_shared_memory(gl.float16, [BN, D], SMEM)
    v1 = gl.allocate_shared_memory(gl.float16, [BN, D], SMEM)

    blk_lo, n_it = _context_range(kv_len, split, G, NUM_SPLITS)
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

    # chunk 0 staged, chunk 1's bytes in registers
    OFFSETS: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    LOADS: gl.constexpr = _record_loads(D, G, VB, OFFSETS, W)
    slot, raw = _next_raw(bt_row, BLOCK_TO_SLOT, KV, blk_lo, 0, n_it, h, HK, STRIDE, NCH, LOADS)
    tile = (bt_row, blk_lo, n_it, kv_len, h)
    _stage_chunk(
        (k0, v0, POOL_K, POOL_V, KV), slot, raw, 0, tile, HK, LOADS, DEQ16, SHADOW, STRIDE, OL
    )
    nxt = _next_raw(bt_row, BLOCK_TO_SLOT, KV, blk_lo, 1, n_it, h, HK, STRIDE, NCH, LOADS)
    fence_async_shared()
    gl.thread_barrier()

    state = (
        gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA)),
        gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, S_MMA)),
        gl.zeros([M, D], gl.float32, layout=O_MMA),
    )
    ctx = (
        q_smem,
        k0,
        v0,
        k1,
        v1,
        row_scale,
        q_pos,
        pos_lo,
        kv_len,
        blk_lo,
        bt_row,
        BLOCK_TO_SLOT,
        KV,
        POOL_K,
        POOL_V,
        h,
        n_it,
    )
    # two chunks a trip, each with its stage a constant: with the stage a loop value, the
    # compiler cannot tell the stages apart and put a barrier between every two shared-memory
    # stores of a step
    for it in range(0, n_it, 2):
        state, nxt = _step(
            ctx, 0, it, state, nxt, HK, STRIDE, NCH, LOADS, OL, S_MMA, O_MMA, P_OP, M, DEQ16, SHADOW
        )
        if it + 1 < n_it:
            state, nxt = _step(
                ctx,
                1,
                it + 1,
                state,
                nxt,
                HK,
                STRIDE,
                NCH,
                LOADS,
                OL,
                S_MMA,
                O_MMA,
                P_OP,
                M,
                DEQ16,
                SHADOW,
            )
    _store_partials(state, rows, row_ok, split, n_rows_total, O_PART, LSE_PART, D, OL)


@gluon.jit
def _tile_rows(
    pid,
    h,
    QSL,
    SEQ_LENS,
    num_reqs,
    HQ: gl.constexpr,
    QPK: gl.constexpr,
    QPK_P: gl.constexpr,
    BQ: gl.constexpr,
    B_P: gl.constexpr,
    M: gl.constexpr,
    W: gl.constexpr,
    OL: gl.constexpr,
):
    """Query tile ``pid``'s request ``b`` (attention._prefill_tile in Gluon), its first query
    token and the request's query end, the first row's position and the keys the tile sees
    (``kv_len``), and its rows (tokens x heads: ``m``, the query rows, which are real)."""
    ridx = gl.arange(0, B_P, layout=gl.BlockedLayout([1], [32], [W], [0]))
    qsl_v = gl.load(QSL + ridx, mask=ridx < num_reqs, other=0)
    starts = qsl_v // BQ + ridx
    b = gl.sum(((starts <= pid) & (ridx < num_reqs)).to(gl.int32), axis=0) - 1
    q_begin = gl.load(QSL + b)
    q_end = gl.load(QSL + b + 1)
    first = q_begin + (pid - (q_begin // BQ + b)) * BQ
    seq_len = gl.load(SEQ_LENS + b)
    ctx0 = seq_len - (q_end - q_begin)
    pos_lo = ctx0 + first - q_begin
    kv_len = ctx0 + gl.minimum(first + BQ, q_end) - q_begin
    m = gl.arange(0, M, layout=gl.SliceLayout(1, OL))
    rows, row_ok = _row_ids(m, first, q_end, h, HQ, QPK, QPK_P)
    return first, q_end, pos_lo, kv_len, m, rows, row_ok, b


@gluon.jit
def _row_ids(m, first, q_end, h, HQ: gl.constexpr, QPK: gl.constexpr, QPK_P: gl.constexpr):
    """Tile rows ``m``' query rows (token x head) and whether each is a real one."""
    tok = first + m // QPK_P
    mj = m % QPK_P
    row_ok = (mj < QPK) & (tok < q_end)
    rows = tok.to(gl.int64) * HQ + h * QPK + mj
    return rows, row_ok


@gluon.jit
def _query_tile(
    Q,
    rows,
    row_ok,
    m,
    qk_scale,
    pos_lo,
    QPK_P: gl.constexpr,
    M: gl.constexpr,
    D: gl.constexpr,
    OL: gl.constexpr,
    S_MMA: gl.constexpr,
    PDL: gl.constexpr,
):
    """The tile's queries, row-normalized fp16, in shared memory; the rows' scale (the
    scores' factor back) and positions in the scores' layout. ``PDL``: :func:`_query_smem`'s."""
    q_smem, row_scale = _query_smem(Q, rows, row_ok, qk_scale, M, D, OL, PDL=PDL)
    row_scale = gl.convert_layout(row_scale, gl.SliceLayout(1, S_MMA))
    q_pos = gl.convert_layout(pos_lo + m // QPK_P, gl.SliceLayout(1, S_MMA))
    return q_smem, row_scale, q_pos


@gluon.jit
def _query_smem(
    Q,
    rows,
    row_ok,
    qk_scale,
    M: gl.constexpr,
    D: gl.constexpr,
    OL: gl.constexpr,
    cols=None,
    PDL: gl.constexpr = False,
):
    """The tile's queries, each row divided by its largest magnitude, fp16 in shared memory,
    and the rows' scale back (``2 x`` that magnitude; the stages hold ``k / 2``). ``cols``:
    the channel each shared-memory column holds (``[D]`` along ``OL``'s columns; default
    channel order). ``PDL``: launched as a programmatic dependent of the queries' rotation,
    so wait for it first (the work before, on the cache and the lengths, overlaps its end)."""
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], gl.float16)
    if PDL:
        gdc_wait()
    if cols is None:
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
    q = gl.load(Q + rows[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
    q = q * qk_scale
    qmax = gl.max(gl.abs(q), axis=1)
    qmax = gl.where(qmax > 0, qmax, 1.0)
    q_smem = gl.allocate_shared_memory(
        gl.float16, [M, D], Q_SMEM, (q / qmax[:, None]).to(gl.float16)
    )
    return q_smem, 2.0 * qmax


@gluon.jit
def _context_range(kv_len, split, G: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Split ``split``'s first context block and its number of 64-token chunks."""
    n_blocks = gl.cdiv(kv_len, G)
    per = gl.cdiv(n_blocks, NUM_SPLITS)
    blk_lo = split * per
    blk_hi = gl.minimum(blk_lo + per, n_blocks)
    return blk_lo, gl.maximum(blk_hi - blk_lo, 0) * (G // 64)


@gluon.jit
def _store_partials(
    state, rows, row_ok, split, n_rows_total, O_PART, LSE_PART, D: gl.constexpr, OL: gl.constexpr
):
    """The split's partial output and base-2 LSE of the real rows (the merge's inputs)."""
    m_i, l_i, acc = state
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    o = acc * gl.convert_layout(2.0 / l_safe, gl.SliceLayout(1, acc.type.layout))[:, None]
    o = gl.convert_layout(o, OL)
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, OL))
    out_row = split.to(gl.int64) * n_rows_total + rows
    gl.store(O_PART + out_row[:, None] * D + dd[None, :], o, mask=row_ok[:, None])
    gl.store(LSE_PART + out_row, gl.convert_layout(lse, gl.SliceLayout(1, OL)), mask=row_ok)


#: Warp-specialized form (:func:`prefill_v3ws_kernel`): its stages, its producer warps and
#: their registers, and the register cap of the launch (8 consumer warps and the producer's 4
#: share an SM's 64K registers: 12 x 32 x 168 = 64,512; the consumers get what the producer
#: leaves, 152).
WS_STAGES = 3
WS_PRODUCER_WARPS = 4
WS_PRODUCER_REGS = 192
WS_MAXNREG = 168
#: Timing probes (docs/kernel-notes.md, twenty-seventh session), wrong results by design:
#: 0 off; 1 the consumers alone (the producer hands over stages without loading or
#: dequantizing); 2 the producer alone (the consumers hand stages back untouched); 3 only the
#: hand-over of the stages.
WS_PROBE = 0
#: Consumer partitions: 1, both warpgroups in one partition (each stage hand-over
#: synchronizes the two), or 2, a partition each (64 query rows, their own hand-overs, so
#: one's softmax can run under the other's wgmma), the second with :data:`WS_CONSUMER_REGS`.
WS_CONSUMER_PARTITIONS = 2
WS_CONSUMER_REGS = 152
#: The producer's ring of raw chunks in shared memory, filled by ``cp.async``: ``R - 1``
#: chunks' loads in flight while one is dequantized (0.92-0.96x the time of one chunk ahead
#: in registers, which is as deep as registers go without spilling; rings of 3 and 6 within
#: 1.5% of 4: docs/kernel-notes.md, twenty-eighth session).
WS_RING = 4
#: The producer's register layouts spread each stage store over all shared-memory banks
#: (:func:`_record_loads`'s ``SPREAD``).
WS_SPREAD_STORES = True


@gluon.constexpr_function
def _ring_copies(PW):
    """The ring's ``cp.async`` layouts for ``PW`` producer warps, 16 bytes a copy: ``[rows,
    32]`` words (K's 32 pair rows of ``D`` bytes, the scale rows), V's ``[2 D VB / 8, 8]``
    words (parity x byte column: the chunk's 32 pairs), and the chunk's pool slot id."""
    return (
        gl.BlockedLayout([1, 4], [4, 8], [PW, 1], [1, 0]),
        gl.BlockedLayout([1, 4], [16, 2], [PW, 1], [1, 0]),
        gl.BlockedLayout([1], [32], [PW], [0]),
    )


@gluon.jit
def _ring_issue(
    ring,
    r,
    KV,
    BLOCK_TO_SLOT,
    blk,
    it,
    n_it,
    h,
    HK: gl.constexpr,
    STRIDE: gl.constexpr,
    NCH: gl.constexpr,
    LOADS: gl.constexpr,
    COPIES: gl.constexpr,
):
    """Start the copies of chunk ``it`` (cache block ``blk``) into ring slot ``r`` (``ring``:
    K's, V's and the scales' words and the pool slot ids, ``[RING, ...]``): K's and V's bytes,
    the record's channel scales (D fp16 each: two rows of 32 words), the chunk's token scales
    (one row each) and the block's pool slot. Past ``n_it`` zeros land."""
    D: gl.constexpr = LOADS[0]
    G: gl.constexpr = LOADS[1]
    VB: gl.constexpr = LOADS[2]
    OFF_KC: gl.constexpr = LOADS[3]
    OFF_KS: gl.constexpr = LOADS[4]
    OFF_KZ: gl.constexpr = LOADS[5]
    OFF_KT: gl.constexpr = LOADS[6]
    OFF_VC: gl.constexpr = LOADS[7]
    OFF_VCS: gl.constexpr = LOADS[8]
    OFF_VS: gl.constexpr = LOADS[9]
    OFF_VZ: gl.constexpr = LOADS[10]
    WORDS: gl.constexpr = COPIES[0]
    V_WORDS: gl.constexpr = COPIES[1]
    ONE: gl.constexpr = COPIES[2]
    VCOLS: gl.constexpr = D * VB // 8
    gl.static_assert(D == 128, "a channel vector is two scale rows of 32 words")
    k_raw, v_raw, s_raw, slot_raw = ring
    ok = it < n_it
    c = it % NCH
    rec = KV + (blk * HK + h) * STRIDE
    i32 = gl.pointer_type(gl.int32)
    # K, transposed in-cache order: the chunk's 32 pair rows of D bytes, contiguous
    kj = gl.arange(0, 32, layout=gl.SliceLayout(1, WORDS))
    w32 = gl.arange(0, 32, layout=gl.SliceLayout(0, WORDS))
    k_src = (rec + OFF_KC + (c * 32 + kj)[:, None] * D).to(i32) + w32[None, :]
    async_copy.async_copy_global_to_shared(k_raw.index(r), k_src, mask=ok)
    # V, parity order: 32 bytes (the chunk's pairs) of each parity's byte column
    vr = gl.arange(0, 2 * VCOLS, layout=gl.SliceLayout(1, V_WORDS))
    v_row = (vr // VCOLS) * (VCOLS * (G // 2)) + (vr % VCOLS) * (G // 2) + c * 32
    v_w = gl.arange(0, 8, layout=gl.SliceLayout(0, V_WORDS))
    v_src = (rec + OFF_VC + v_row[:, None]).to(i32) + v_w[None, :]
    async_copy.async_copy_global_to_shared(v_raw.index(r), v_src, mask=ok)
    # scale rows: 0-1 K's channel scales, 2-3 K's channel zeros, 4-5 V's channel scales,
    # 6-8 the chunk's K token scales, V token scales and V token zeros; 9-15 unused
    sr = gl.arange(0, 16, layout=gl.SliceLayout(1, WORDS))
    token_row = gl.where(sr == 6, OFF_KT, gl.where(sr == 7, OFF_VS, OFF_VZ)) + c * 128
    channel_row = gl.where(sr < 2, OFF_KS, gl.where(sr < 4, OFF_KZ, OFF_VCS)) + (sr % 2) * 128
    s_at = gl.where(sr < 6, channel_row, token_row)
    s_src = (rec + s_at[:, None]).to(i32) + w32[None, :]
    async_copy.async_copy_global_to_shared(s_raw.index(r), s_src, mask=ok & (sr < 9)[:, None])
    one = gl.arange(0, 1, layout=ONE)
    async_copy.async_copy_global_to_shared(slot_raw.index(r), BLOCK_TO_SLOT + blk + one, mask=ok)


@gluon.jit
def _fp16_field(words, f: gl.constexpr):
    """The fp16 in bits ``16 f .. 16 f + 15`` of integer ``words``."""
    return ((words >> (16 * f)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _ring_read(ring, r, LOADS: gl.constexpr, COPIES: gl.constexpr):
    """Ring slot ``r``'s chunk as :func:`_load_raw` returns it (same layouts), and its pool
    slot."""
    ONE: gl.constexpr = COPIES[2]
    D: gl.constexpr = LOADS[0]
    VB: gl.constexpr = LOADS[2]
    KL: gl.constexpr = LOADS[11]
    VL: gl.constexpr = LOADS[12]
    VCOLS: gl.constexpr = D * VB // 8
    k_raw, v_raw, s_raw, slot_raw = ring
    R: gl.constexpr = k_raw.type.shape[0]
    # (a ring's layout orders the dims after the slot's)
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kb = k_raw._reinterpret(gl.uint8, [R, 32, D], FLAT3).index(r).load(KL)
    v8 = v_raw._reinterpret(gl.uint8, [R, 2 * VCOLS, 32], FLAT3).index(r)
    ve = v8.slice(0, VCOLS).permute((1, 0)).load(VL)
    vo = v8.slice(VCOLS, VCOLS).permute((1, 0)).load(VL)
    # the scale rows (:func:`_ring_issue`), 32 words each, flat
    ROW: gl.constexpr = 32
    s16 = s_raw._reinterpret(gl.float16, [R, 32 * ROW], FLAT2).index(r)
    ks = s16.slice(0, D).load(gl.SliceLayout(0, KL))  # rows 0-1
    kz = s16.slice(D, D).load(gl.SliceLayout(0, KL))  # rows 2-3
    s32 = s_raw._reinterpret(gl.int32, [R, 16 * ROW], FLAT2).index(r)
    kt = s32.slice(6 * ROW, 32).load(gl.SliceLayout(1, KL))  # token pair words (even low)
    vs = s32.slice(7 * ROW, 32).load(gl.SliceLayout(1, VL))
    vz = s32.slice(8 * ROW, 32).load(gl.SliceLayout(1, VL))
    # V's channel scales (rows 4-5) by bit field: channel PER * b + f of byte column b, one
    # word a column
    if VB == 2:
        s64 = s_raw._reinterpret(gl.int64, [R, 8 * ROW], FLAT2).index(r)
        vcw = s64.slice(2 * ROW, VCOLS).load(gl.SliceLayout(0, VL))
        vc0, vc1, vc2, vc3 = (
            _fp16_field(vcw, 0),
            _fp16_field(vcw, 1),
            _fp16_field(vcw, 2),
            _fp16_field(vcw, 3),
        )
    else:
        vcw = s32.slice(4 * ROW, VCOLS).load(gl.SliceLayout(0, VL))
        vc0, vc1 = _fp16_field(vcw, 0), _fp16_field(vcw, 1)
        vc2, vc3 = vc0, vc1  # unused at 4 bits
    raw = (
        kb,
        ve,
        vo,
        ks,
        kz,
        _fp16_field(kt, 0),
        _fp16_field(kt, 1),
        _fp16_field(vs, 0),
        _fp16_field(vs, 1),
        _fp16_field(vz, 0),
        _fp16_field(vz, 1),
        vc0,
        vc1,
        vc2,
        vc3,
    )
    slot = gl.max(slot_raw.index(r).load(ONE), axis=0)
    return raw, slot


@gluon.jit
def _ws_produce(
    chunks,
    HK: gl.constexpr,
    STRIDE: gl.constexpr,
    LOADS: gl.constexpr,
    DEQ16: gl.constexpr,
    SHADOW: gl.constexpr,
    PW: gl.constexpr,
    PROBE: gl.constexpr,
):
    """The producer warps (``PW``): each chunk's raw bytes taken from the ring (``RING``
    slots: :data:`WS_RING`), then dequantized, or its pool rows copied, into the next free
    stage, which is then marked ready. ``chunks``: the stages and their barriers, the cache's
    tensors, the split's chunks, the KV head and the ring's buffers. ``LOADS``:
    :func:`_record_loads` at ``PW`` warps; ``SHADOW``: the pool's shadow rows
    (:func:`_stage_pool`); ``PROBE``: :data:`WS_PROBE`. The block of the chunk after the
    one a step starts is looked up a step ahead (its copies' addresses wait on nothing)."""
    k_bufs, v_bufs, ready, empty = chunks[0], chunks[1], chunks[2], chunks[3]
    KV, POOL_K, POOL_V, BLOCK_TO_SLOT = chunks[4], chunks[5], chunks[6], chunks[7]
    bt_row, blk_lo, n_it, kv_len, h = chunks[8], chunks[9], chunks[10], chunks[11], chunks[12]
    NCH: gl.constexpr = LOADS[1] // 64
    PL: gl.constexpr = _rows_layout(PW)  # pool rows [64, D]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    WORK: gl.constexpr = PROBE == 0 or PROBE == 2
    RING: gl.constexpr = chunks[13].type.shape[0]
    ring = (chunks[13], chunks[14], chunks[15], chunks[16])
    COPIES: gl.constexpr = _ring_copies(PW)
    # chunks 0 .. RING - 2 in flight; each step then reads one and starts one
    for i in gl.static_range(RING - 1):
        if WORK:
            blk = _chunk_block(bt_row, blk_lo, i, n_it, NCH)
            _ring_issue(ring, i, KV, BLOCK_TO_SLOT, blk, i, n_it, h, HK, STRIDE, NCH, LOADS, COPIES)
        async_copy.commit_group()
    blk_next = _chunk_block(bt_row, blk_lo, RING - 1, n_it, NCH)
    for it in range(n_it):
        st = it % STAGES
        async_copy.wait_group(RING - 2)  # this thread's copies of chunk it landed
        gl.thread_barrier()  # and every producer thread's; slot it - 1 read by all
        if WORK:
            raw, slot = _ring_read(ring, it % RING, LOADS, COPIES)
            j = it + RING - 1
            _ring_issue(
                ring,
                j % RING,
                KV,
                BLOCK_TO_SLOT,
                blk_next,
                j,
                n_it,
                h,
                HK,
                STRIDE,
                NCH,
                LOADS,
                COPIES,
            )
            blk_next = _chunk_block(bt_row, blk_lo, j + 1, n_it, NCH)
        async_copy.commit_group()
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # its last reader done
        if WORK:
            stage = (k_bufs.index(st), v_bufs.index(st), POOL_K, POOL_V, KV)
            tile = (bt_row, blk_lo, n_it, kv_len, h)
            _stage_chunk(stage, slot, raw, it, tile, HK, LOADS, DEQ16, SHADOW, STRIDE, PL)
        fence_async_shared()  # the stores before the consumers' wgmma reads them
        mbarrier.arrive(ready.index(st), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _ws_consume(
    stages,
    tile,
    HQ: gl.constexpr,
    QPK: gl.constexpr,
    QPK_P: gl.constexpr,
    ROW0: gl.constexpr,
    M: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
    W: gl.constexpr,
    PROBE: gl.constexpr,
):
    """A consumer partition of ``W`` warps on the tile's rows ``ROW0 .. ROW0 + M``: each
    ready stage's scores (wgmma), online softmax and ``P V``; the stage is handed back to the
    producer as soon as ``P V`` has read it. Then the split's partials of those rows. The
    rows' scales come from ``scale_smem`` (a worker partition takes no tensors).
    ``PROBE``: :data:`WS_PROBE`."""
    q_smem, scale_smem, k_bufs, v_bufs, ready, empty = stages
    first, q_end, pos_lo, kv_len, blk_lo, n_it, h, split, n_rows_total, O_PART, LSE_PART = tile
    BN: gl.constexpr = 64
    NCH: gl.constexpr = G // BN
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    OL: gl.constexpr = _rows_layout(W)
    S_MMA: gl.constexpr = _acc_layout(W, BN)
    O_MMA: gl.constexpr = _acc_layout(W, D)
    P_OP: gl.constexpr = _p_operand(W, D)
    q_rows = q_smem.slice(ROW0, M)
    row_scale = scale_smem.slice(ROW0, M).load(gl.SliceLayout(1, S_MMA))
    q_pos = pos_lo + (ROW0 + gl.arange(0, M, layout=gl.SliceLayout(1, S_MMA))) // QPK_P
    state = (
        gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA)),
        gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, S_MMA)),
        gl.zeros([M, D], gl.float32, layout=O_MMA),
    )
    zero_s = gl.zeros([M, BN], gl.float32, layout=S_MMA)
    if PROBE >= 2:  # no math: each stage handed back as soon as it is ready
        for it in range(n_it):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(st), count=1)
    else:
        for it in range(n_it):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            v_cur = v_bufs.index(st)
            s_tok = warpgroup_mma(
                q_rows, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            s = warpgroup_mma_wait(0, deps=[s_tok])
            t0 = (blk_lo + it // NCH) * G + (it % NCH) * BN
            state = _softmax_pv(s, v_cur, state, t0, row_scale, q_pos, pos_lo, kv_len, O_MMA, P_OP)
            mbarrier.arrive(empty.index(st), count=1)
    m = ROW0 + gl.arange(0, M, layout=gl.SliceLayout(1, OL))
    rows, row_ok = _row_ids(m, first, q_end, h, HQ, QPK, QPK_P)
    _store_partials(state, rows, row_ok, split, n_rows_total, O_PART, LSE_PART, D, OL)


@gluon.jit(**PREFILL_UNSPECIALIZED)
def prefill_v3ws_kernel(
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
    HQ: gl.constexpr,
    HK: gl.constexpr,
    QPK: gl.constexpr,
    QPK_P: gl.constexpr,
    BQ: gl.constexpr,
    B_P: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
    VB: gl.constexpr,
    STRIDE: gl.constexpr,
    OFF_KC: gl.constexpr,
    OFF_KS: gl.constexpr,
    OFF_KZ: gl.constexpr,
    OFF_KT: gl.constexpr,
    OFF_VC: gl.constexpr,
    OFF_VCS: gl.constexpr,
    OFF_VS: gl.constexpr,
    OFF_VZ: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    W: gl.constexpr,
    DEQ16: gl.constexpr,
    SHADOW: gl.constexpr,
    STAGES: gl.constexpr,
    PW: gl.constexpr,
    PREGS: gl.constexpr,
    CP: gl.constexpr,
    CREGS: gl.constexpr,
    RING: gl.constexpr,
    PROBE: gl.constexpr,
    SPREAD: gl.constexpr,
    PDL: gl.constexpr,
):
    """:func:`prefill_v3_kernel` (same grid, arguments and partials) with its parts in
    separate warps. ``CP`` consumer partitions of ``W`` warps each (launched with
    ``num_warps=W`` and a ``maxnreg`` cap; ``16 W CP = 128`` query rows; the second partition
    with ``CREGS`` registers) run the scores, the softmax and ``P V``, while ``PW`` producer
    warps (``PREGS`` registers each) dequantize the next chunks into ``STAGES`` shared-memory
    stages, their raw bytes copied ahead into a ring of ``RING`` slots; handed over through
    mbarriers. ``RING``, ``PROBE``, ``SPREAD``: :data:`WS_RING`, :data:`WS_PROBE`,
    :data:`WS_SPREAD_STORES` (defaults: the ``WS_`` constants); ``PDL``: as
    :func:`prefill_v3_kernel`'s.
    The consumers never wait on the dequantization's instruction chain, only on a stage being
    ready."""
    M: gl.constexpr = 16 * W * CP
    MP: gl.constexpr = 16 * W  # a consumer partition's rows
    BN: gl.constexpr = 64
    gl.static_assert(D == 128, "head dim 128")
    gl.static_assert(G % BN == 0, "a tile must be whole chunks")
    gl.static_assert(CP == 1 or CP == 2, "one or two consumer partitions")
    OL: gl.constexpr = _rows_layout(W)
    SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.float16)

    pid = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    first, q_end, pos_lo, kv_len, _, rows, row_ok, b = _tile_rows(
        pid, h, QSL, SEQ_LENS, num_reqs, HQ, QPK, QPK_P, BQ, B_P, M, W, OL
    )
    q_smem, row_scale = _query_smem(Q, rows, row_ok, qk_scale, M, D, OL, PDL=PDL)
    scale_smem = gl.allocate_shared_memory(
        gl.float32, [M], gl.SwizzledSharedLayout(1, 1, 1, [0]), row_scale
    )
    blk_lo, n_it = _context_range(kv_len, split, G, NUM_SPLITS)
    n_it = gl.where(first < q_end, n_it, 0)  # a tile past its request's queries: no work
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

    k_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], SMEM)
    v_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BN, D], SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CP)  # each consumer partition hands it back
    # the producer's ring of raw chunks
    gl.static_assert(RING >= 2, "a ring of two or more chunks")
    R: gl.constexpr = RING
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # the dims after the slot's
    k_raw = gl.allocate_shared_memory(gl.int32, [R, 32, D // 4], FLAT3)
    v_raw = gl.allocate_shared_memory(gl.int32, [R, D * VB // 4, 8], FLAT3)
    s_raw = gl.allocate_shared_memory(gl.int32, [R, 16, 32], FLAT3)
    slot_raw = gl.allocate_shared_memory(
        BLOCK_TO_SLOT.dtype.element_ty, [R, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    OFFSETS: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    LOADS: gl.constexpr = _record_loads(D, G, VB, OFFSETS, PW, SPREAD)  # the producer's
    stages = (q_smem, scale_smem, k_bufs, v_bufs, ready, empty)
    tile = (first, q_end, pos_lo, kv_len, blk_lo, n_it, h, split, n_rows_total, O_PART, LSE_PART)
    producer = (
        k_bufs,
        v_bufs,
        ready,
        empty,
        KV,
        POOL_K,
        POOL_V,
        BLOCK_TO_SLOT,
        bt_row,
        blk_lo,
        n_it,
        kv_len,
        h,
        k_raw,
        v_raw,
        s_raw,
        slot_raw,
    )  # then the constexprs, in the calls (a variable's tuple cannot hold LOADS' layouts)
    if CP == 2:
        gl.warp_specialize(
            [
                (_ws_consume, (stages, tile, HQ, QPK, QPK_P, 0, MP, D, G, W, PROBE)),
                (_ws_consume, (stages, tile, HQ, QPK, QPK_P, MP, MP, D, G, W, PROBE)),
                (
                    _ws_produce,
                    (producer, HK, STRIDE, LOADS, DEQ16, SHADOW, PW, PROBE),
                ),
            ],
            [W, PW],
            [CREGS, PREGS],
        )
    else:
        gl.warp_specialize(
            [
                (_ws_consume, (stages, tile, HQ, QPK, QPK_P, 0, MP, D, G, W, PROBE)),
                (
                    _ws_produce,
                    (producer, HK, STRIDE, LOADS, DEQ16, SHADOW, PW, PROBE),
                ),
            ],
            [PW],
            [PREGS],
        )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
