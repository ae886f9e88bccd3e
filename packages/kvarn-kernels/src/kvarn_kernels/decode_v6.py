# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon JIT kernels are untyped by nature.)
"""Decode attention v6: v5's loop transposed, tokens in the MMA's M dimension.

v5 (:mod:`kvarn_kernels.decode_v5`) puts the query rows in the ``mma.m16n8k16`` M dimension:
at Qwen3-8B's 4 query heads per KV head, 12 of its 16 rows are padding, in every score and
``P V`` MMA, in the score registers and in the softmax. Here both products are transposed,

* scores ``S^T = K Q^T``: the K codes of a chunk's 32 token pairs (one parity) are the A
  operand ``[32 pairs, D]``, the query the B operand ``[D, 8]`` (8 columns: up to 8 query
  heads per KV head);
* outputs ``O^T = V^T P^T``: the V codes of one field are the A operand ``[NC channels, 32
  pairs]``, the probabilities the B operand ``[32 pairs, 8]``;

so the MMAs per 64-token step halve (64 instead of 128 at k4v2_g128) and so do the score values
per lane (16 instead of 32). The code words unpack into operand registers as in v5: an A
fragment holds, for rows ``g`` and ``g + 8``, what the B fragments of columns ``g`` and ``g +
8`` hold, so v5's relabellings (:func:`kvarn_kernels.decode_v5._perm16`) and its shared-memory
copies carry over unchanged (:func:`_operand_a` is :func:`kvarn_kernels.decode_v5._operand`
with the other permutation). New is the probabilities' way from the score accumulator (C
layout: a lane holds pairs ``g, g + 8, ...`` at query columns ``2t, 2t + 1``) to the B operand
(pairs ``2t, 2t + 1, ...`` at column ``g``), a layout conversion the compiler does with lane
shuffles, and the softmax, which reduces over the tokens, now along M (three shuffle rounds
per column pair and step).

Numerics as v5 (the same halved operands, fp32 scores and accumulators); ``FOLD``
(``variant="v6f"``) as v5f. ``TMA`` (``variant="v6t"``, thirty-ninth session): v6f with a
step's 8 fields copied by the tensor memory accelerator onto one mbarrier instead of 20
``cp.async`` a lane and three block-table walks: the same words in the same shared-memory
order (K's token-pair relabelling by the descriptor's dimensions, its token scales' by a
linear shared layout), so the partials are bit-identical, with 10% fewer loop
instructions. Where each SM has bandwidth to spare (an H200) the loop's time follows its
instructions (docs/kernel-notes.md). ``BLOCK_SCALES`` (fortieth session; v6t takes it on
128-token tiles with 2-bit values, :func:`kvarn_kernels.attention.v6t_block_scales`): a
tile's channel-scale work once for its two chunks, 7% fewer instructions a chunk. GPU only
(Gluon has no interpreter); 4-bit keys with 2- or 4-bit values, head dim 128, the in-cache
code order, up to 8 query heads per KV head. v6f is
``variant="auto"``'s kernel there since the seventeenth session (docs/kernel-notes.md).
"""

from __future__ import annotations

from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
    mma_v2,
)
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    mbarrier,
    tma,
)

from kvarn_kernels._launch import gdc_wait
from kvarn_kernels.decode_v5 import (
    _HALVES,
    _UNPACK4,
    _axis,
    _chunk,
    _copy_meta,
    _halves,
    _issue,
    _k_scale_pairs,
    _k_vector,
    _parities_of_quads,
    _perm16,
    _split_chunks,
    _stage_buffers,
    _store_split,
    _token_scale_pairs,
    _v_channel_scales,
    _v_field_codes,
)

__all__ = [
    "PROBE_COMPUTE_ONLY",
    "PROBE_COPIES_ONLY",
    "V6_MAX_QPK",
    "V6_TMA_ROW_BYTES",
    "decode_v6_kernel",
]

#: Query heads per KV head v6 takes: the 8 columns of one ``m16n8k16`` N tile.
V6_MAX_QPK = 8

#: ``decode_v6_kernel(PROBE=...)``: timing probes (docs/kernel-notes.md, twenty-second
#: session), whose outputs are not attention. Copies only: every copy and wait of the loop,
#: none of the math (the staged words feed only an XOR of their low bits, so the compiler
#: keeps few of their shared-memory reads). Compute only: the whole step on the first step's
#: stage, no copy after the prologue's.
PROBE_COPIES_ONLY = gl.constexpr(1)
PROBE_COMPUTE_ONLY = gl.constexpr(2)
#: The unit of the ``TMA`` build's record coordinates: a record and each of its fields start
#: on a multiple of it (so a coordinate is an int32 up to 256 GB of cache).
V6_TMA_ROW_BYTES = 128


#: The ``TMA`` build's row coordinate for chunks it must not read (pool blocks, chunks past
#: the split): out of every descriptor's bounds, so the copies land zeros (as the masked
#: ``cp.async`` of the scales do), and the barrier still counts the whole box.
_TMA_NOWHERE = gl.constexpr(-(1 << 20))


@gluon.jit
def _tma_chunk(it, walk, geo: gl.constexpr):
    """Step ``it``'s chunk of a one-warp program for the ``TMA`` build: its record's first
    128-byte row (:data:`V6_TMA_ROW_BYTES`; :data:`_TMA_NOWHERE` unless it is a packed record
    of this split), the chunk within the block, the block's index in the request and whether
    it is packed (:func:`kvarn_kernels.decode_v5._chunk`'s walk, once a step for the copies
    and the math)."""
    _kv, bt_row, BLOCK_TO_SLOT, h, ch_lo, ch_hi = walk
    HK: gl.constexpr = geo[1]
    NCH: gl.constexpr = geo[2]
    STRIDE: gl.constexpr = geo[3]
    ci = ch_lo + it
    valid = ci < ch_hi
    bi = ci // NCH
    blk = gl.load(bt_row + bi, mask=valid, other=0)
    packed = valid & (gl.load(BLOCK_TO_SLOT + blk, mask=valid, other=0) < 0)
    row = gl.where(packed, (blk * HK + h) * (STRIDE // 128), _TMA_NOWHERE)
    return row, ci % NCH, bi, packed


@gluon.jit
def _tma_issue(
    stage,
    chunk,
    descs,
    raw,
    bars,
    D: gl.constexpr,
    NC: gl.constexpr,
    offs: gl.constexpr,
    BLOCK_FIELDS: gl.constexpr = True,
):
    """The ``TMA`` build's copies of a step's chunk into ``stage``, all on the stage's barrier:
    K's 32 token-pair rows in the ``_perm16`` order (the descriptor's dimensions do the
    relabelling), V's two parities' byte columns, the block's K channel scales and zeros and
    V channel scales (256 bytes each; not with ``BLOCK_FIELDS`` off: a tile's second chunk
    under ``BLOCK_SCALES``, which keeps its first chunk's), the chunk's K token scales and V
    token scales and zeros (128 bytes each). ``chunk``: :func:`_tma_chunk`'s; ``raw``: the
    stage buffers in that order (:func:`_tma_buffers`)."""
    row, c, _bi, _packed = chunk
    bar = bars.index(stage)
    mbarrier.expect(bar, 32 * D + 64 * NC + 3 * 128 + (3 * 256 if BLOCK_FIELDS else 0))
    OFF_KC: gl.constexpr = offs[0] // 128
    OFF_KS: gl.constexpr = offs[1] // 128
    OFF_KZ: gl.constexpr = offs[2] // 128
    OFF_KT: gl.constexpr = offs[3] // 128
    OFF_VC: gl.constexpr = offs[4] // 128
    OFF_VCS: gl.constexpr = offs[5] // 128
    OFF_VS: gl.constexpr = offs[6] // 128
    OFF_VZ: gl.constexpr = offs[7] // 128
    tma.async_copy_global_to_shared(
        descs[0], [0, row + OFF_KC + c * 32, 0, 0, 0], bar, raw[0].index(stage)
    )
    tma.async_copy_global_to_shared(descs[1], [row + OFF_VC, c, 0, 0, 0], bar, raw[1].index(stage))
    if BLOCK_FIELDS:
        tma.async_copy_global_to_shared(descs[2], [row + OFF_KS, 0], bar, raw[2].index(stage))
        tma.async_copy_global_to_shared(descs[2], [row + OFF_KZ, 0], bar, raw[3].index(stage))
    tma.async_copy_global_to_shared(descs[3], [row + OFF_KT + c, 0], bar, raw[4].index(stage))
    tma.async_copy_global_to_shared(descs[3], [row + OFF_VS + c, 0], bar, raw[5].index(stage))
    tma.async_copy_global_to_shared(descs[3], [row + OFF_VZ + c, 0], bar, raw[6].index(stage))
    if BLOCK_FIELDS:
        tma.async_copy_global_to_shared(descs[2], [row + OFF_VCS, 0], bar, raw[7].index(stage))


@gluon.jit
def _tma_token_scale_pairs(
    stage, raw, quads: gl.constexpr, along: gl.constexpr, AXIS: gl.constexpr
):
    """:func:`kvarn_kernels.decode_v5._token_scale_pairs` on the ``TMA`` build's stage: the
    chunk's K token scales in the natural pair order, read through a linear shared layout
    that puts score column ``n`` at pair ``_perm16(n)`` (offset bits b, h, t0, t1, kt are
    ``n``'s 8, 1, 2, 4, 16), and V's token scales and zeros, whose 64-bit words of pairs ``(4q,
    4q + 1)`` and ``(4q + 2, 4q + 3)`` alternate, split in registers."""
    kt_view: gl.constexpr = gl.SharedLinearLayout(
        offset_bases=[[0, 8], [0, 1], [0, 2], [0, 4], [0, 16]]
    )
    kt = raw[4].index(stage)._reinterpret(gl.int32, [1, 32], kt_view).load(along)
    kt_e, kt_o = gl.inline_asm_elementwise(
        _HALVES,
        "=h,=h,r",
        [gl.expand_dims(kt, AXIS)],
        dtype=(gl.float16,) * 2,
        is_pure=True,
        pack=1,
    )
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    # q on lane bits 0-1 and the pair in registers, the other lanes copies: after the split,
    # quads' layout (words of lane t), so the conversions below move nothing
    halves: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 4, 8], [1, 1, 1], [1, 2, 0])
    vs_a, vs_b = gl.split(raw[5].index(stage)._reinterpret(gl.int64, [1, 8, 2], flat).load(halves))
    vz_a, vz_b = gl.split(raw[6].index(stage)._reinterpret(gl.int64, [1, 8, 2], flat).load(halves))
    vs = _parities_of_quads(gl.convert_layout(vs_a, quads), gl.convert_layout(vs_b, quads))
    vz = _parities_of_quads(gl.convert_layout(vz_a, quads), gl.convert_layout(vz_b, quads))
    return kt_e, kt_o, vs, vz


@gluon.jit
def _tma_buffers(descs, STAGES: gl.constexpr, D: gl.constexpr, NC: gl.constexpr, VG: gl.constexpr):
    """The ``TMA`` build's stage buffers as the copies write them (``raw``, in
    :func:`_tma_issue`'s order), and the code words and channel scales as the views the
    step's helpers read, in :func:`kvarn_kernels.decode_v5._stage_buffers`' places and shapes
    (in the token scales' places their raw buffers: :func:`_tma_token_scale_pairs` reads
    them)."""
    gl.static_assert(STAGES == 2, "the TMA build's layouts are written for two stages")
    s256: gl.constexpr = descs[2].layout
    s128: gl.constexpr = descs[3].layout
    k_box: gl.constexpr = descs[0].block_type.shape
    v_box: gl.constexpr = descs[1].block_type.shape
    raw = (
        # K and V codes ([STAGES] + box: Gluon takes no starred list)
        gl.allocate_shared_memory(gl.int32, [STAGES] + k_box, descs[0].layout),  # noqa: RUF005
        gl.allocate_shared_memory(gl.int32, [STAGES] + v_box, descs[1].layout),  # noqa: RUF005
        gl.allocate_shared_memory(gl.int64, [STAGES, 2, 16], s256),  # K channel scales
        gl.allocate_shared_memory(gl.int64, [STAGES, 2, 16], s256),  # K channel zeros
        gl.allocate_shared_memory(gl.int64, [STAGES, 1, 16], s128),  # K token scales
        gl.allocate_shared_memory(gl.int64, [STAGES, 1, 16], s128),  # V token scales
        gl.allocate_shared_memory(gl.int64, [STAGES, 1, 16], s128),  # V token zeros
        gl.allocate_shared_memory(gl.int64, [STAGES, 2, 16], s256),  # V channel scales
    )
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    vc_dtype: gl.constexpr = gl.int64 if VG == 4 else gl.int32
    views = (
        raw[0],
        raw[1],
        raw[2]._reinterpret(gl.int64, [STAGES, 1, D // 4], flat),
        raw[3]._reinterpret(gl.int64, [STAGES, 1, D // 4], flat),
        raw[4],  # the token scales' places: _tma_token_scale_pairs reads them
        raw[5],
        raw[5],
        raw[6],
        raw[6],
        raw[7]._reinterpret(vc_dtype, [STAGES, 1, NC], flat),
    )
    return raw, views


@gluon.jit
def _operand_a(r0, r1, W: gl.constexpr, M: gl.constexpr, K: gl.constexpr, layout: gl.constexpr):
    """fp16x2 registers ``[W, M, K / 4]`` of bytes (0, 2) and (1, 3) of each word as the ``[W,
    M, K]`` A operand (``k = 16 kt + 8 b + 2 t + h`` for word ``4 kt + t``, half ``h`` of
    ``r_b``), as :func:`kvarn_kernels.decode_v5._operand` builds the B operand."""
    x = gl.join(_halves(r0), _halves(r1))  # [W, m, word, h, b]
    x = gl.reshape(x, [W, M, K // 16, 4, 2, 2])
    x = gl.reshape(gl.permute(x, [0, 1, 2, 5, 3, 4]), [W, M, K])
    return gl.convert_layout(x, layout)


@gluon.jit
def _pv_t(x, magic: gl.constexpr, vs, vz, pb, acc, FOLD: gl.constexpr, NC: gl.constexpr, W, aop):
    """``acc + V^T P^T`` of one field and parity: fp16x2 code registers ``x = (f, g)``
    dequantized as ``(x - magic) * vs + vz`` (per token, along k), or with ``FOLD`` the raw
    codes (the scale is in ``pb``, the rest in the chain's start), against the probabilities
    ``pb`` (B operand)."""
    f, g = x
    a = _operand_a(f, g, W, NC, 32, aop)
    if not FOLD:
        a = (a - magic) * vs + vz
    return mma_v2(a, pb, acc)


@gluon.jit
def _field_t(
    acc, a3, pb, codes, magic: gl.constexpr, vc, terms, zero, FOLD: gl.constexpr, NC, W, aop
):
    """A V field's ``[W, NC, 8]`` accumulator after a step: rescaled by ``a3`` (per query
    column), plus both parities' ``V^T P^T`` (one MMA chain) in the field's channel scales
    ``vc`` (per row). ``codes``: the field's registers of bytes (0, 2) and (1, 3), even then
    odd; ``terms``: the operands' scales and zeros (``vs_e, vz_e, vs_o, vz_o``) and, with
    ``FOLD``, the columns' sums ``pz, ps`` whose ``pz - magic * ps`` starts the chain."""
    pb_e, pb_o = pb
    fe, ge, fo, go = codes
    vs_e, vz_e, vs_o, vz_o, pz, ps = terms
    start = zero
    if FOLD:
        start = gl.broadcast(gl.expand_dims(pz - magic * ps, 1), zero)[0]
    pv = _pv_t((fe, ge), magic, vs_e, vz_e, pb_e, start, FOLD, NC, W, aop)
    pv = _pv_t((fo, go), magic, vs_o, vz_o, pb_o, pv, FOLD, NC, W, aop)
    return acc * a3 + pv * vc.to(gl.float32)


@gluon.jit
def _mma_column_sum(a, b, zero):
    """``sum_k a[k] b[k, n]`` of a B operand ``b`` (``[W, K, 8]``), ``a`` the A operand ``[W,
    16, K]`` whose 16 rows all hold the weights (ones for a plain sum): one MMA chain, fp32
    sums of exact products, every row of the ``[W, 16, 8]`` result the same, so the max over
    rows is a layout change to ``[W, 8]`` (two shuffle rounds fewer than a sum over ``k``
    across the lanes, and none of its conversions to fp32)."""
    return gl.max(mma_v2(a, b, zero), axis=1)


@gluon.jit
def _mma_column_sum2(a, b, zero):
    """:func:`_mma_column_sum` of two operand pairs ``a = (a0, a1)``, ``b = (b0, b1)`` summed:
    one chain."""
    return gl.max(mma_v2(a[1], b[1], mma_v2(a[0], b[0], zero)), axis=1)


@gluon.jit
def _k_channel_operands(pairs, W: gl.constexpr, D: gl.constexpr, avec, bvec, FOLD: gl.constexpr):
    """A block's K channel scales and zeros (``pairs``: their ``ks0, ks1, kz0, kz1`` pair
    registers) as the score step's operands: with ``FOLD`` the scales on the query's k ``[W,
    D, 1]`` and the zeros along A's k ``[W, 1, D]``, else both on the codes' k ``[W, 1, D]``,
    the zeros halved (the codes' halving)."""
    ks0, ks1, kz0, kz1 = pairs
    if FOLD:
        ks = gl.expand_dims(_k_vector(ks0, ks1, W, D, bvec), 2)
        kz = gl.expand_dims(_k_vector(kz0, kz1, W, D, avec), 1)
    else:
        ks = gl.expand_dims(_k_vector(ks0, ks1, W, D, avec), 1)
        kz = gl.expand_dims(_k_vector(kz0, kz1, W, D, avec), 1) * 0.5
    return ks, kz


@gluon.jit
def _online_softmax(s_e, s_o, m, l_acc, col_scale, col_scale2, bop: gl.constexpr):
    """One step of the online softmax over the tokens (M), per query column, on the even and
    odd tokens' scores ``s_e, s_o`` (``[W, 32, 8]``, before the columns' factor
    ``col_scale``): the new running max ``m`` and row sum ``l_acc`` (``[W, 8]``), the
    probabilities as fp16 B operands (layout ``bop``) and the accumulators' rescale ``[W, 1,
    8]``."""
    s_max = gl.maximum(gl.max(s_e, axis=1), gl.max(s_o, axis=1))  # [W, 8]
    m_new = gl.maximum(m, s_max * col_scale2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_use)
    m3 = gl.expand_dims(m_use, 1)
    p_e = gl.exp2(gl.fma(s_e, col_scale, -m3))
    p_o = gl.exp2(gl.fma(s_o, col_scale, -m3))
    l_acc = l_acc * alpha + gl.sum(p_e + p_o, axis=1)
    # the probabilities from the accumulator layout to the B operand's (lane shuffles; a
    # movmatrix.trans per 8 x 8 block with relabelled registers counted 21 fewer
    # instructions, not worth a layout claim no interpreter can check)
    pb_e = gl.convert_layout(p_e.to(gl.float16), bop)
    pb_o = gl.convert_layout(p_o.to(gl.float16), bop)
    return m_new, l_acc, pb_e, pb_o, gl.expand_dims(alpha, 1)


@gluon.jit
def decode_v6_kernel(
    Q,
    KV,
    BLOCK_TABLE,
    SEQ_LENS,
    BLOCK_TO_SLOT,
    O_PART,
    LSE_PART,
    qk_scale,
    stride_bt,
    n_rows_total,
    q_rows,
    K_DESC,
    V_DESC,
    S256_DESC,
    S128_DESC,
    HQ: gl.constexpr,
    HK: gl.constexpr,
    QPK: gl.constexpr,
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
    STAGES: gl.constexpr,
    FOLD: gl.constexpr = False,
    PROBE: gl.constexpr = 0,
    TMA: gl.constexpr = False,
    BLOCK_SCALES: gl.constexpr = False,
    PDL: gl.constexpr = False,
):
    """One program per (request, KV head, split), ``W`` warps, 64 tokens per warp and step,
    as :func:`kvarn_kernels.decode_v5.decode_v5_kernel` (same grid, copies, partial outputs
    and LSE; the pool tiles are :mod:`kvarn_kernels.decode_pool`'s launch), with both MMAs transposed. ``FOLD``
    (``variant="v6f"``): v5f's folding, the raw codes as A operands, K's channel scales on
    the query and V's token scales on the probabilities (both B operands, a quarter of the
    values they would scale on the A side), the zeros and magics as per-column sums that
    start the MMA chains. ``TMA``: every field of a step copied by the tensor memory
    accelerator onto one barrier (``K_DESC``, ``V_DESC``, ``S256_DESC``, ``S128_DESC``:
    :func:`kvarn_kernels.attention.v6_tma_descriptors`; None otherwise), one block-table walk
    a step; one warp per program, two stages. ``BLOCK_SCALES`` (one warp, 128-token tiles): a
    tile's K channel-scale work (the scaled query, the folds' column sums) and V channel
    scales done on its first chunk and kept for its second (a one-warp program's steps walk a
    split's chunks in order, two to a tile). ``PDL``: launched as a programmatic dependent of
    the queries' rotation (:func:`kvarn_kernels._launch.gdc_wait` before the query)."""
    gl.static_assert(W == 1 or W == 2 or W == 4, "v6 runs 1, 2 or 4 warps per program")
    gl.static_assert(
        not TMA or (W == 1 and STAGES == 2 and PROBE == 0), "v6's TMA build: one warp, two stages"
    )
    gl.static_assert(STAGES == 2 or STAGES == 3, "v6 pipelines 2 or 3 stages")
    gl.static_assert(
        not BLOCK_SCALES or (W == 1 and G == 128 and PROBE == 0),
        "BLOCK_SCALES: one warp, 128-token tiles",
    )
    STEPS: gl.constexpr = 2 if BLOCK_SCALES else 1  # chunks a loop iteration
    gl.static_assert(D == 128, "v6 is written for head dim 128")
    gl.static_assert(VB == 2 or VB == 4, "v6 takes 2- or 4-bit values")
    gl.static_assert(QPK <= 8, "v6 takes up to 8 query heads per KV head")
    VG: gl.constexpr = 8 // VB  # V fields per byte
    NC: gl.constexpr = D // VG  # byte columns of a V row (channels per field)
    NCH: gl.constexpr = G // 64  # chunks per block
    NQ: gl.constexpr = 8  # query columns

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
    )
    aop: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    bop: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    words: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 1],
        threads_per_warp=[1, 8, 4],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    k_copy: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 4],
        threads_per_warp=[1, 4, 8],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    v_copy: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 4],
        threads_per_warp=[1, 16, 2],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    s_copy: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[W, 1], order=[1, 0]
    )
    avec: gl.constexpr = gl.SliceLayout(1, aop)  # [W, K] along the A operand's k
    bvec: gl.constexpr = gl.SliceLayout(2, bop)  # [W, K] along the B operand's k
    quads: gl.constexpr = gl.SliceLayout(1, words)  # [W, words] as lane t holds them
    rows_l: gl.constexpr = gl.SliceLayout(2, mma)  # [W, M] along the accumulators' rows
    cols_l: gl.constexpr = gl.SliceLayout(1, mma)  # [W, 8] along the query columns

    b = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ_LENS + b)

    # the query, column-normalized, as the B operand [W, D, 8] in the _perm16 channel order
    if PDL:
        gdc_wait()
    qc = _axis(NQ, 2, bop)
    q_ok = qc < q_rows
    q_ptr = Q + (b.to(gl.int64) * HQ + h * QPK + qc) * D + _perm16(_axis(D, 1, bop))
    q = gl.load(q_ptr + 0 * _axis(W, 0, bop), mask=q_ok, other=0.0) * qk_scale
    qmax = gl.max(gl.abs(q), axis=1)  # [W, 8]
    qmax = gl.where(qmax > 0, qmax, 1.0)
    q16 = (q / gl.expand_dims(qmax, 1)).to(gl.float16)
    col_scale2 = gl.convert_layout(qmax, cols_l) * 2.0  # the scores' column factor, K's halving
    col_scale = gl.expand_dims(col_scale2, 1)  # [W, 1, 8]

    ch_lo, ch_hi = _split_chunks(seq_len, split, G, NCH, NUM_SPLITS)
    n_it = gl.cdiv(ch_hi - ch_lo, W)
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

    walk = (KV, bt_row, BLOCK_TO_SLOT, h, ch_lo, ch_hi)
    geo: gl.constexpr = (W, HK, NCH, STRIDE)
    offs: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    copies: gl.constexpr = (k_copy, v_copy, s_copy)
    warp_s = _axis(W, 0, mma)
    if TMA:
        descs = (K_DESC, V_DESC, S256_DESC, S128_DESC)
        raw, bufs = _tma_buffers(descs, STAGES, D, NC, VG)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(bars.index(st), count=1)
        nxt = _tma_chunk(0, walk, geo)
        _tma_issue(0, nxt, descs, raw, bars, D, NC, offs)
        _row, c, bi, packed = nxt
        nxt = _tma_chunk(1, walk, geo)
    else:
        bufs = _stage_buffers(STAGES, W, D, NC, VG)
        for st in gl.static_range(STAGES - 1):
            _issue(st, _copy_meta(st, walk, geo, copies), bufs, D, G, NC, VG, offs, copies)
        meta = _copy_meta(STAGES - 1, walk, geo, copies)
        _r, bi, c, packed = _chunk(0, warp_s, walk, geo)

    pair_m = _perm16(_axis(32, 1, mma))  # score row m: token pair _perm16(m) of the chunk
    out_row = _axis(NC, 1, mma)  # [1, NC, 1]: byte column of V, the outputs' m

    m = gl.full([W, NQ], float("-inf"), gl.float32, cols_l)
    l_acc = gl.zeros([W, NQ], gl.float32, cols_l)
    zero = gl.zeros([W, NC, NQ], gl.float32, mma)
    zero_s = gl.zeros([W, 32, NQ], gl.float32, mma)
    # the folds' column sums as MMAs against rows of ones (or of the zeros): 16 rows, one tile
    zero_c = gl.zeros([W, 16, NQ], gl.float32, mma)
    ones_d = gl.full([W, 16, D], 1.0, gl.float16, aop)
    ones_p = gl.full([W, 16, 32], 1.0, gl.float16, aop)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    if PROBE == PROBE_COMPUTE_ONLY:  # every step reads the prologue's stage
        async_copy.wait_group(0)
    if PROBE == PROBE_COPIES_ONLY:
        k_sink = gl.zeros([W, 32, D // 4], gl.int32, words)
        v_sink = gl.zeros([W, 2 * NC, 8], gl.int32, words)
    for it_tile in range(n_it // STEPS):
        for sub in gl.static_range(STEPS):  # unrolled: a tile's two chunks with BLOCK_SCALES
            it = it_tile * STEPS + sub
            if TMA:
                # the stage last read a step ago: its reads before the async proxy's writes
                fence_async_shared()
                # chunk it + 1: under BLOCK_SCALES a tile's second when sub is 0
                _tma_issue((it + 1) % 2, nxt, descs, raw, bars, D, NC, offs, STEPS == 1 or sub == 1)
                _row, c_next, bi_next, packed_next = nxt
                nxt = _tma_chunk(it + 2, walk, geo)
            else:
                if PROBE != PROBE_COMPUTE_ONLY:
                    _issue((it + STAGES - 1) % STAGES, meta, bufs, D, G, NC, VG, offs, copies)
                    meta = _copy_meta(it + STAGES, walk, geo, copies)
                _r, bi_next, c_next, packed_next = _chunk(it + 1, warp_s, walk, geo)

            if PROBE == PROBE_COMPUTE_ONLY:
                stage = 0
            elif TMA:
                stage = it % 2
                mbarrier.wait(bars.index(stage), (it // 2) & 1)
            else:
                async_copy.wait_group(STAGES - 1)
                stage = it % STAGES
            if TMA:
                kw = bufs[0].index(stage).reshape([W, 32, D // 4]).load(words)
                vw = bufs[1].index(stage).reshape([W, 2 * NC, 8]).load(words)
            else:
                kw = bufs[0].index(stage).load(words)  # [W, 32, D / 4]
                vw = bufs[1].index(stage).load(words)  # [W, 2 NC, 8]
            if PROBE == PROBE_COPIES_ONLY:  # the code words read from shared memory, no math
                k_sink = k_sink ^ kw
                v_sink = v_sink ^ vw
            else:
                if sub == 0:  # with BLOCK_SCALES, the tile's second chunk keeps these
                    ks, kz = _k_channel_operands(
                        _k_scale_pairs(stage, bufs, quads), W, D, avec, bvec, FOLD
                    )
                if TMA:
                    kt_e, kt_o, vs, vz = _tma_token_scale_pairs(stage, raw, quads, rows_l, 2)
                else:
                    kt_e, kt_o, vs, vz = _token_scale_pairs(
                        stage, bufs, quads, rows_l, 2
                    )  # [W, 32, 1]
                se0, so0, se1, so1 = vs
                ze0, zo0, ze1, zo1 = vz
                if FOLD:  # the scales on the probabilities' k: [W, 32, 1]; the zeros along A's k
                    vs_e = gl.expand_dims(_k_vector(se0, se1, W, 32, bvec), 2)
                    vs_o = gl.expand_dims(_k_vector(so0, so1, W, 32, bvec), 2)
                    vz_e = gl.broadcast(
                        gl.expand_dims(_k_vector(ze0, ze1, W, 32, avec), 1), ones_p
                    )[0]
                    vz_o = gl.broadcast(
                        gl.expand_dims(_k_vector(zo0, zo1, W, 32, avec), 1), ones_p
                    )[0]
                else:  # on the codes' k: [W, 1, 32]
                    vs_e = gl.expand_dims(_k_vector(se0, se1, W, 32, avec), 1)
                    vs_o = gl.expand_dims(_k_vector(so0, so1, W, 32, avec), 1)
                    vz_e = gl.expand_dims(_k_vector(ze0, ze1, W, 32, avec), 1) * 0.5
                    vz_o = gl.expand_dims(_k_vector(zo0, zo1, W, 32, avec), 1) * 0.5
                if sub == 0:
                    vc = _v_channel_scales(stage, bufs, rows_l, 2, VG)  # [W, NC, 1] each

                # --- scores [W, 32 pairs, 8 columns] of the even and odd tokens of the chunk ---
                lo0, lo1, hi0, hi1 = gl.inline_asm_elementwise(
                    _UNPACK4, "=r,=r,=r,=r,r", [kw], dtype=(gl.int32,) * 4, is_pure=True, pack=1
                )
                if FOLD:
                    if sub == 0:
                        # q . ((x - magic) ks + kz / 2) = x . (q ks) + (q . kz / 2 - magic
                        # sum(q ks)): the channel scale on the query, the rest one number per
                        # query column (qs sums the rounded q ks the score MMA multiplies, so
                        # the magic cancels; the zero term, the zeros' rows against q16, sums
                        # exact products)
                        q_s = q16 * ks
                        qs = _mma_column_sum(ones_d, q_s, zero_c)
                        qz = _mma_column_sum(gl.broadcast(kz, ones_d)[0], q16, zero_c) * 0.5
                        start_e = gl.broadcast(gl.expand_dims(qz - 512.0 * qs, 1), zero_s)[0]
                        start_o = gl.broadcast(gl.expand_dims(qz - 32.0 * qs, 1), zero_s)[0]
                    s_e = mma_v2(_operand_a(lo0, lo1, W, 32, D, aop), q_s, start_e)
                    s_o = mma_v2(_operand_a(hi0, hi1, W, 32, D, aop), q_s, start_o)
                else:
                    k_e = (_operand_a(lo0, lo1, W, 32, D, aop) - 512.0) * ks + kz
                    s_e = mma_v2(k_e, q16, zero_s)
                    k_o = (_operand_a(hi0, hi1, W, 32, D, aop) - 32.0) * ks + kz
                    s_o = mma_v2(k_o, q16, zero_s)
                pos = (bi * G + c * 64 + 2 * pair_m).to(gl.int32)  # [W, 32, 1], the even token
                s_e = gl.where(packed & (pos < seq_len), s_e * kt_e.to(gl.float32), float("-inf"))
                s_o = gl.where(
                    packed & (pos + 1 < seq_len), s_o * kt_o.to(gl.float32), float("-inf")
                )

                m, l_acc, pb_e, pb_o, a3 = _online_softmax(
                    s_e, s_o, m, l_acc, col_scale, col_scale2, bop
                )
                if FOLD:
                    # (x - magic) vs + vz / 2 against P: x against P vs, plus per column and field
                    # P . vz / 2 - magic sum(P vs), from two column sums for all fields
                    pz = _mma_column_sum2((vz_e, vz_o), (pb_e, pb_o), zero_c) * 0.5
                    pb_e = pb_e * vs_e
                    pb_o = pb_o * vs_o
                    ps = _mma_column_sum2((ones_p, ones_p), (pb_e, pb_o), zero_c)
                else:
                    pz = 0.0
                    ps = 0.0
                pb = (pb_e, pb_o)

                # --- V^T P^T [W, NC, 8] per V field, both parities into one MMA chain ---
                terms = (vs_e, vz_e, vs_o, vz_o, pz, ps)
                v_e, v_o = gl.split(gl.permute(gl.reshape(vw, [W, 2, NC, 8]), [0, 2, 3, 1]))
                f = _v_field_codes(v_e, v_o, VG)
                if VG == 4:
                    acc0 = _field_t(acc0, a3, pb, f[0], 512.0, vc[0], terms, zero, FOLD, NC, W, aop)
                    acc1 = _field_t(acc1, a3, pb, f[1], 128.0, vc[1], terms, zero, FOLD, NC, W, aop)
                    acc2 = _field_t(acc2, a3, pb, f[2], 32.0, vc[2], terms, zero, FOLD, NC, W, aop)
                    acc3 = _field_t(acc3, a3, pb, f[3], 8.0, vc[3], terms, zero, FOLD, NC, W, aop)
                else:
                    acc0 = _field_t(acc0, a3, pb, f[0], 512.0, vc[0], terms, zero, FOLD, NC, W, aop)
                    acc1 = _field_t(acc1, a3, pb, f[1], 32.0, vc[1], terms, zero, FOLD, NC, W, aop)
            bi = bi_next
            c = c_next
            packed = packed_next
    if TMA:  # the last step's copies (past the split: zeros) land before the program ends
        mbarrier.wait(bars.index(n_it % 2), (n_it // 2) & 1)
    else:
        async_copy.wait_group(0)
    if PROBE == PROBE_COPIES_ONLY:  # the words' low bits into the sums: the copies stay used
        sink = gl.sum(gl.sum(k_sink & 1, axis=2), axis=1) + gl.sum(
            gl.sum(v_sink & 1, axis=2), axis=1
        )
        sink = gl.convert_layout(sink.to(gl.float32), gl.SliceLayout(1, cols_l))
        l_acc = l_acc + gl.expand_dims(sink, 1)

    cols = _axis(NQ, 2, mma)  # [1, 1, 8]
    lcol = gl.arange(0, NQ, layout=gl.SliceLayout(0, cols_l))
    accs = (acc0, acc1, acc2, acc3)
    where = (O_PART, LSE_PART, split, b, h, n_rows_total)
    _store_split(accs, m, l_acc, cols, out_row, lcol, 2, where, HQ, QPK, D, VG)
