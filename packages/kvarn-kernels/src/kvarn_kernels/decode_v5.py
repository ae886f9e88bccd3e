# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon JIT kernels are untyped by nature.)
"""Decode attention v5: v4's main loop in Gluon, with every register layout stated.

v4 (:mod:`kvarn_kernels.decode_v4`) lets Triton choose which tensor elements share a register,
and its loop pays for that in register moves and a shared-memory relayout around the inline
PTX unpack (docs/kernel-notes.md, eleventh to thirteenth sessions). Here the layouts are
written down (Triton's Gluon dialect), so a 32-bit word of codes unpacks straight into MMA
operand registers. What makes that possible on today's cache (docs/format.md §7.1, no format
change) are three free relabellings, all address arithmetic:

* **Channels.** The score MMA reduces over channels, so their order is ours to choose as
  long as the query and the per-channel scales follow it. Operand index ``k = 16 kt + 8 b +
  2 t + h`` is channel ``16 kt + 4 t + 2 h + b`` (:func:`_perm16`): the ``mma.m16n8k16`` B
  registers of lane ``t`` (``k = 2t, 2t+1`` and ``2t+8, 2t+9``) are then bytes (0, 2) and
  (1, 3) of the in-cache word ``4 kt + t`` of a token pair's row, one ``lop3`` each.
* **Token pairs.** Softmax and ``P V`` sum over tokens, so the same map on a chunk's token
  pairs (score column ``n`` is pair ``_perm16(n)``) makes the V words (a byte column's four
  consecutive pairs) the ``P V`` B registers in the same way; the K rows are copied into
  shared memory in that order.
* **Field magic.** Each field of a byte (a nibble, a 2-bit field) is OR-ed into the mantissa
  of its own power of two, chosen so that ``x - magic`` is half the code, exactly: every field
  shares one scale, and the halving that keeps operands inside fp16 (below) costs nothing.

Structure as v4: one 64-token chunk per warp and step (a rank-3 MMA whose batch dimension lies
along the warps, each warp with its own online softmax, merged once at the end), the chunks'
code words and scales copied into shared memory with ``cp.async`` ``STAGES - 1`` steps ahead
(2 or 3 stages). Pool blocks (the fp16 sink and in-progress tiles) are masked out here and
attended by :mod:`kvarn_kernels.decode_pool`'s launch, whose partial the merge takes, as
``variant="v4d"`` does. Numerics as v4:
operands are dequantized cache values halved into fp16 (``(x - magic) * scale + zero / 2``,
the same single rounding as v4's ``code * (scale / 2) + zero / 2``), the query
row-normalized, fp32 scores and accumulators; the halvings come back as a factor 2 on the
scores' row scale and on the output.

GPU only (Gluon has no interpreter mode); 4-bit keys with 2- or 4-bit values, head dim 128,
the in-cache code order, up to 16 query heads per KV head.
"""

from __future__ import annotations

from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
    mma_v2,
)

__all__ = [
    "V5_HEAD_DIMS",
    "V5_MAX_QPK",
    "V5_ONE_WARP_SPLITS",
    "V5_SPLIT_WARPS",
    "V5_STAGES",
    "V5_WARPS",
    "V5_WARP_COUNTS",
    "decode_v5_kernel",
]

#: Head dims the v5 kernel is written for.
V5_HEAD_DIMS = (128,)
#: Query heads per KV head v5 takes: the 16 rows of its MMA tile.
V5_MAX_QPK = 16
#: Warps per program by default: one, so that no warp waits for another at the pipeline's
#: barriers (fifteenth session, H200: 0.83-0.85x the time of four warps at B >= 64).
V5_WARPS = 1
#: The warps per program :func:`kvarn_kernels.attention.choose_decode_splits` sizes its split
#: count for: a v5 program of ``W`` warps takes ``V5_SPLIT_WARPS / W`` times as many splits, so
#: that as many warps are in flight.
V5_SPLIT_WARPS = 4
#: The factor for one-warp programs (the default): 3, not 4. On the H200 (twenty-second
#: session, v6f, k4v2_g128) 3x the split rule's count took 0.90-0.99x the time of 4x at every
#: batch timed, B = 8 to 256 at 4K-64K: fewer programs (1.9 waves of 12 per SM instead of 2.6
#: at B = 64 / 16K) and fewer partials to merge.
V5_ONE_WARP_SPLITS = 3
#: The warp counts a program may have (``decode_attention(num_warps=...)``). With fewer warps
#: per program the barriers the shared-memory pipeline needs wait on fewer warps, and more
#: programs (splits) share an SM.
V5_WARP_COUNTS = (1, 2, 4)
#: Pipeline stages (``decode_attention(num_stages=...)``): 2 by default, or 3 (copies two steps
#: ahead, 1.5x the shared memory).
V5_STAGES = (2, 3)

# 4-bit codes of a word: $0 / $1 the low nibbles of bytes (0, 2) / (1, 3) as fp16x2 ``512 +
# c / 2``, $2 / $3 the high nibbles as ``32 + c / 2``: the OR into the mantissa of a power of
# two whose step at the field's bits is 1/2, so ``x - magic`` is the halved code (exact)
_UNPACK4 = gl.constexpr("""
{
.reg .b32 s;
lop3.b32 $0, $4, 0x000F000F, 0x60006000, 0xEA;
lop3.b32 $2, $4, 0x00F000F0, 0x50005000, 0xEA;
shr.b32 s, $4, 8;
lop3.b32 $1, s, 0x000F000F, 0x60006000, 0xEA;
lop3.b32 $3, s, 0x00F000F0, 0x50005000, 0xEA;
}
""")
# 2-bit codes of a word: field f of bytes (0, 2) -> $f, of bytes (1, 3) -> $(4 + f), as
# ``magic_f + c / 2`` with magic 512, 128, 32, 8
_UNPACK2 = gl.constexpr("""
{
.reg .b32 s;
lop3.b32 $0, $8, 0x00030003, 0x60006000, 0xEA;
lop3.b32 $1, $8, 0x000C000C, 0x58005800, 0xEA;
lop3.b32 $2, $8, 0x00300030, 0x50005000, 0xEA;
lop3.b32 $3, $8, 0x00C000C0, 0x48004800, 0xEA;
shr.b32 s, $8, 8;
lop3.b32 $4, s, 0x00030003, 0x60006000, 0xEA;
lop3.b32 $5, s, 0x000C000C, 0x58005800, 0xEA;
lop3.b32 $6, s, 0x00300030, 0x50005000, 0xEA;
lop3.b32 $7, s, 0x00C000C0, 0x48004800, 0xEA;
}
""")
# four fp16 of a 64-bit word w (items 0..3) as the fp16x2 pairs (0, 2) and (1, 3)
_PAIRS_OF_QUAD = gl.constexpr("""
{
.reg .b32 lo, hi;
mov.b64 {lo, hi}, $2;
prmt.b32 $0, lo, hi, 0x5410;
prmt.b32 $1, lo, hi, 0x7632;
}
""")
# two 64-bit words of token-pair scale words (pairs 0, 1 | 2, 3; each word: even token's fp16,
# odd token's) as fp16x2: $0 even tokens of pairs (0, 2), $1 odd (0, 2), $2 even (1, 3), $3 odd
_PARITIES_OF_QUADS = gl.constexpr("""
{
.reg .b32 a, b, c, d;
mov.b64 {a, b}, $4;
mov.b64 {c, d}, $5;
prmt.b32 $0, a, c, 0x5410;
prmt.b32 $1, a, c, 0x7632;
prmt.b32 $2, b, d, 0x5410;
prmt.b32 $3, b, d, 0x7632;
}
""")
# an fp16x2 register as its two halves (a register-pair view: no instruction)
_HALVES = gl.constexpr("mov.b32 {$0, $1}, $2;")
# the four fp16 of a 64-bit word
_QUARTERS = gl.constexpr("mov.b64 {$0, $1, $2, $3}, $4;")


@gluon.jit
def _perm16(k):
    """Operand index ``k = 16 kt + 8 b + 2 t + h`` -> item ``16 kt + 4 t + 2 h + b`` (channel or
    token pair): the item whose byte ``b + 2 h`` of word ``4 kt + t`` feeds position ``k``."""
    return (k // 16) * 16 + ((k // 2) % 4) * 4 + (k % 2) * 2 + (k // 8) % 2


@gluon.jit
def _halves(x):
    h0, h1 = gl.inline_asm_elementwise(
        _HALVES, "=h,=h,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=1
    )
    return gl.join(h0, h1)


@gluon.jit
def _operand(r0, r1, W: gl.constexpr, K: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
    """fp16x2 registers ``[W, N, K / 4]`` of bytes (0, 2) and (1, 3) of each word as the ``[W,
    K, N]`` B operand (``k = 16 kt + 8 b + 2 t + h`` for word ``4 kt + t``, half ``h`` of
    ``r_b``). The layouts agree: the conversion is no instruction."""
    x = gl.join(_halves(r0), _halves(r1))  # [W, n, word, h, b]
    x = gl.reshape(x, [W, N, K // 16, 4, 2, 2])
    x = gl.reshape(gl.permute(x, [0, 2, 5, 3, 4, 1]), [W, K, N])
    return gl.convert_layout(x, layout)


@gluon.jit
def _k_vector(p0, p1, W: gl.constexpr, K: gl.constexpr, layout: gl.constexpr):
    """fp16x2 ``[W, K / 4]`` (items ``(4 q, 4 q + 2)`` and ``(4 q + 1, 4 q + 3)`` of quad ``q =
    4 kt + t``) as the fp16 ``[W, K]`` vector along an operand's ``k`` (``_perm16`` order)."""
    x = gl.join(_halves(p0), _halves(p1))  # [W, quad, h, b]
    x = gl.reshape(x, [W, K // 16, 4, 2, 2])
    x = gl.reshape(gl.permute(x, [0, 1, 4, 2, 3]), [W, K])
    return gl.convert_layout(x, layout)


@gluon.jit
def _axis(n: gl.constexpr, axis: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``axis`` of a rank-3 ``layout``, expanded to rank 3."""
    if axis == 0:
        x = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        x = gl.expand_dims(gl.expand_dims(x, 1), 2)
    elif axis == 1:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        x = gl.expand_dims(gl.expand_dims(x, 0), 2)
    else:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        x = gl.expand_dims(gl.expand_dims(x, 0), 1)
    return x


@gluon.jit
def _chunk(it, warp, walk, geo: gl.constexpr):
    """Step ``it``'s chunk of each warp (``warp``: the warp index, broadcast as the result
    should be): its record pointer, its block's index in the request, the chunk within the
    block, and whether it is a packed record of this split (pool blocks and chunks past the
    split are not). ``walk``: the cache, the request's block-table row, the block-to-slot map,
    the KV head and the split's chunk range; ``geo``: ``(W, HK, NCH, STRIDE)``."""
    KV, bt_row, BLOCK_TO_SLOT, h, ch_lo, ch_hi = walk
    W: gl.constexpr = geo[0]
    HK: gl.constexpr = geo[1]
    NCH: gl.constexpr = geo[2]
    STRIDE: gl.constexpr = geo[3]
    ci = ch_lo + it * W + warp
    valid = ci < ch_hi
    bi = ci // NCH
    blk = gl.load(bt_row + bi, mask=valid, other=0).to(gl.int64)
    slot = gl.load(BLOCK_TO_SLOT + blk, mask=valid, other=0)
    rec = KV + (blk * HK + h) * STRIDE
    return rec, bi, ci % NCH, valid & (slot < 0)


@gluon.jit
def _copy_meta(it, walk, geo: gl.constexpr, copies: gl.constexpr):
    """Step ``it``'s chunks as :func:`_issue` needs them, one block-table walk per copy
    layout (``copies``: K's, V's, the scales'; their loads are the step's only wait before its
    copies, so they run ahead)."""
    W: gl.constexpr = geo[0]
    ws = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, copies[2])), 1)
    rk, _bi, ck, _p = _chunk(it, _axis(W, 0, copies[0]), walk, geo)
    rv, _bi, cv, _p = _chunk(it, _axis(W, 0, copies[1]), walk, geo)
    rs, _bi, cs, ps = _chunk(it, ws, walk, geo)
    return rk, ck, rv, cv, rs, cs, ps


@gluon.jit
def _issue(
    stage,
    meta,
    bufs,
    D: gl.constexpr,
    G: gl.constexpr,
    NC: gl.constexpr,
    VG: gl.constexpr,
    offs: gl.constexpr,
    copies: gl.constexpr,
):
    """Start the copies of a step's chunks into ``stage``: the code words (K rows in
    ``_perm16`` order of the token pairs; V both parities' byte columns, the chunk's 32 pairs
    of each in order) and every scale the step reads, in the order its reads want them.
    ``meta`` (:func:`_copy_meta`): record pointer and chunk (and, for the scales, whether the
    record is packed: pool blocks' scales land as zeros) of each warp's chunk in the three
    copy layouts. ``offs``: the record's field offsets, ``copies``: the copy layouts. Chunks
    past the split read block 0's record (valid, unused)."""
    OFF_KC: gl.constexpr = offs[0]
    OFF_KS: gl.constexpr = offs[1]
    OFF_KZ: gl.constexpr = offs[2]
    OFF_KT: gl.constexpr = offs[3]
    OFF_VC: gl.constexpr = offs[4]
    OFF_VCS: gl.constexpr = offs[5]
    OFF_VS: gl.constexpr = offs[6]
    OFF_VZ: gl.constexpr = offs[7]
    k_copy: gl.constexpr = copies[0]
    v_copy: gl.constexpr = copies[1]
    s_copy: gl.constexpr = copies[2]
    rk, ck, rv, cv, rs, cs, ps = meta
    k_buf, v_buf, ks_buf, kz_buf, kt_buf, vsa_buf, vsb_buf, vza_buf, vzb_buf, vc_buf = bufs
    i32 = gl.pointer_type(gl.int32)
    i64 = gl.pointer_type(gl.int64)
    row = ck * 32 + _perm16(_axis(32, 1, k_copy))
    k_src = (rk + OFF_KC + row * D).to(i32) + _axis(D // 4, 2, k_copy)
    async_copy.async_copy_global_to_shared(k_buf.index(stage), k_src)
    col = _axis(2 * NC, 1, v_copy)  # parity * NC + byte column
    v_src = rv + OFF_VC + (col // NC) * (NC * (G // 2)) + (col % NC) * (G // 2) + cv * 32
    v_src = v_src.to(i32) + _axis(8, 2, v_copy)
    async_copy.async_copy_global_to_shared(v_buf.index(stage), v_src)
    quad = gl.expand_dims(gl.arange(0, D // 4, layout=gl.SliceLayout(0, s_copy)), 0)
    async_copy.async_copy_global_to_shared(
        ks_buf.index(stage), (rs + OFF_KS).to(i64) + quad, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        kz_buf.index(stage), (rs + OFF_KZ).to(i64) + quad, mask=ps
    )
    n = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, s_copy)), 0)
    kt_src = (rs + OFF_KT).to(i32) + cs * 32 + _perm16(n)  # score column n: pair _perm16(n)
    async_copy.async_copy_global_to_shared(kt_buf.index(stage), kt_src, mask=ps)
    q = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, s_copy)), 0)
    pairs = cs * 16 + 2 * q  # the 64-bit word of pairs (4 q, 4 q + 1); + 1: (4 q + 2, 4 q + 3)
    vs = (rs + OFF_VS).to(i64) + pairs
    vz = (rs + OFF_VZ).to(i64) + pairs
    async_copy.async_copy_global_to_shared(vsa_buf.index(stage), vs, mask=ps)
    async_copy.async_copy_global_to_shared(vsb_buf.index(stage), vs + 1, mask=ps)
    async_copy.async_copy_global_to_shared(vza_buf.index(stage), vz, mask=ps)
    async_copy.async_copy_global_to_shared(vzb_buf.index(stage), vz + 1, mask=ps)
    ncol = gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(0, s_copy)), 0)
    if VG == 4:  # noqa: SIM108 (a constexpr branch) the four channel scales of column n: 64 bits
        vc_src = (rs + OFF_VCS).to(i64) + ncol
    else:
        vc_src = (rs + OFF_VCS).to(i32) + ncol
    async_copy.async_copy_global_to_shared(vc_buf.index(stage), vc_src, mask=ps)
    async_copy.commit_group()


@gluon.jit
def _pv(p, f, g, magic: gl.constexpr, vs, vz, pv, FOLD: gl.constexpr, W: gl.constexpr, NC, bop):
    """``pv + P V`` of one field of one parity: operand ``(x - magic) * vs + vz``, or with
    ``FOLD`` the raw ``x`` (the scale is in ``p``, the rest in the chain's start,
    :func:`_pv_init`)."""
    x = _operand(f, g, W, 32, NC, bop)
    if not FOLD:
        x = (x - magic) * vs + vz
    return mma_v2(p, x, pv)


@gluon.jit
def _pv_init(zero, magic: gl.constexpr, pz, ps, FOLD: gl.constexpr):
    """Where a field's ``P V`` chain starts: 0, or with ``FOLD`` the row terms of the raw
    codes, ``pz - magic * ps`` (the probabilities' zeros, the magic on their scaled sum)."""
    if FOLD:
        zero = gl.broadcast(pz - magic * ps, zero)[0]
    return zero


@gluon.jit
def _field(acc, a3, p, codes, magic: gl.constexpr, vc, terms, zero, FOLD: gl.constexpr, W, NC, bop):
    """A V field's accumulator after a step: rescaled by ``a3``, plus the step's ``P V`` of
    both parities (one MMA chain) in the field's channel scales ``vc``. ``p``: the even and
    odd tokens' probabilities; ``codes``: the field's registers of bytes (0, 2) and (1, 3),
    even then odd; ``terms``: the operands' scales and zeros (``vs_e, vz_e, vs_o, vz_o``) and
    v5f's row terms (``pz, ps``)."""
    pe, po = p
    fe, ge, fo, go = codes
    vs_e, vz_e, vs_o, vz_o, pz, ps = terms
    pv = _pv(pe, fe, ge, magic, vs_e, vz_e, _pv_init(zero, magic, pz, ps, FOLD), FOLD, W, NC, bop)
    pv = _pv(po, fo, go, magic, vs_o, vz_o, pv, FOLD, W, NC, bop)
    return acc * a3 + pv * vc.to(gl.float32)


@gluon.jit
def _split_chunks(seq_len, split, G: gl.constexpr, NCH: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """The chunk range ``[ch_lo, ch_hi)`` of a request's split ``split``: its blocks as
    attention._split_blocks gives them to v4's kernel (a Triton function, which a Gluon
    kernel cannot call): one split rule for every variant."""
    n_blocks = gl.cdiv(seq_len, G)
    if NUM_SPLITS > 1:
        per = gl.cdiv(n_blocks, NUM_SPLITS)
        blk_lo = split * per
        blk_hi = gl.minimum(blk_lo + per, n_blocks)
    else:
        blk_lo = 0
        blk_hi = n_blocks
    return blk_lo * NCH, gl.maximum(blk_hi, blk_lo) * NCH


@gluon.jit
def _stage_buffers(
    STAGES: gl.constexpr, W: gl.constexpr, D: gl.constexpr, NC: gl.constexpr, VG: gl.constexpr
):
    """The shared-memory stages :func:`_issue` copies a step's code words and scales into."""
    k_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[2, 1, 0])
    v_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=4, max_phase=2, order=[2, 1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    vc_dtype: gl.constexpr = gl.int64 if VG == 4 else gl.int32
    return (
        gl.allocate_shared_memory(gl.int32, [STAGES, W, 32, D // 4], k_smem),
        gl.allocate_shared_memory(gl.int32, [STAGES, W, 2 * NC, 8], v_smem),
        gl.allocate_shared_memory(gl.int64, [STAGES, W, D // 4], flat),  # k_scale, quads
        gl.allocate_shared_memory(gl.int64, [STAGES, W, D // 4], flat),  # k_zero
        gl.allocate_shared_memory(gl.int32, [STAGES, W, 32], flat),  # k_token_scale, pair words
        gl.allocate_shared_memory(gl.int64, [STAGES, W, 8], flat),  # v_scale, pairs 4q, 4q + 1
        gl.allocate_shared_memory(gl.int64, [STAGES, W, 8], flat),  # v_scale, pairs 4q + 2, 4q + 3
        gl.allocate_shared_memory(gl.int64, [STAGES, W, 8], flat),  # v_zero, as v_scale
        gl.allocate_shared_memory(gl.int64, [STAGES, W, 8], flat),
        gl.allocate_shared_memory(vc_dtype, [STAGES, W, NC], flat),  # v_channel_scale by column
    )


@gluon.jit
def _pairs_of_quad(words):
    """:data:`_PAIRS_OF_QUAD` on 64-bit quads of fp16: the pairs of items (0, 2) and (1, 3)."""
    return gl.inline_asm_elementwise(
        _PAIRS_OF_QUAD, "=r,=r,l", [words], dtype=(gl.int32, gl.int32), is_pure=True, pack=1
    )


@gluon.jit
def _parities_of_quads(first, second):
    """:data:`_PARITIES_OF_QUADS` on two 64-bit quads of fp16: four fp16x2 registers."""
    return gl.inline_asm_elementwise(
        _PARITIES_OF_QUADS,
        "=r,=r,=r,=r,l,l",
        [first, second],
        dtype=(gl.int32,) * 4,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _k_scale_pairs(stage, bufs, quads: gl.constexpr):
    """A step's K channel scales and zeros as fp16x2 pairs of items ``(4q, 4q + 2)`` and ``(4q
    + 1, 4q + 3)`` of each quad (:func:`_k_vector`'s input): ``ks0, ks1, kz0, kz1``."""
    ks0, ks1 = _pairs_of_quad(bufs[2].index(stage).load(quads))
    kz0, kz1 = _pairs_of_quad(bufs[3].index(stage).load(quads))
    return ks0, ks1, kz0, kz1


@gluon.jit
def _token_scale_pairs(stage, bufs, quads: gl.constexpr, along: gl.constexpr, AXIS: gl.constexpr):
    """A step's per-token scales: K's token scales of the even and odd tokens as fp16 along the
    score axis ``AXIS`` (loaded in ``along``, that axis's slice layout), and V's token scales
    and zeros as fp16x2 pairs (``se0, so0, se1, so1`` and ``ze0, zo0, ze1, zo1``: even and odd
    tokens, :func:`_k_vector`'s input)."""
    ktw = gl.expand_dims(bufs[4].index(stage).load(along), AXIS)
    kt_e, kt_o = gl.inline_asm_elementwise(
        _HALVES, "=h,=h,r", [ktw], dtype=(gl.float16,) * 2, is_pure=True, pack=1
    )
    vs = _parities_of_quads(bufs[5].index(stage).load(quads), bufs[6].index(stage).load(quads))
    vz = _parities_of_quads(bufs[7].index(stage).load(quads), bufs[8].index(stage).load(quads))
    return kt_e, kt_o, vs, vz


@gluon.jit
def _v_channel_scales(stage, bufs, along: gl.constexpr, AXIS: gl.constexpr, VG: gl.constexpr):
    """A step's V channel scales, one fp16 tensor per field (``VG``), along the output axis
    ``AXIS`` (loaded in ``along``, that axis's slice layout)."""
    vcw = gl.expand_dims(bufs[9].index(stage).load(along), AXIS)
    if VG == 4:
        vc = gl.inline_asm_elementwise(
            _QUARTERS, "=h,=h,=h,=h,l", [vcw], dtype=(gl.float16,) * 4, is_pure=True, pack=1
        )
    else:
        vc = gl.inline_asm_elementwise(
            _HALVES, "=h,=h,r", [vcw], dtype=(gl.float16,) * 2, is_pure=True, pack=1
        )
    return vc


@gluon.jit
def _v_field_codes(v_e, v_o, VG: gl.constexpr):
    """Each V field's code registers from the even and odd rows' words (``VG`` fields of
    bytes (0, 2) and (1, 3) of the even rows, then of the odd ones; magics 512, 128, 32, 8 for
    2-bit fields, 512 and 32 for nibbles)."""
    if VG == 4:
        e0, e1, e2, e3, e4, e5, e6, e7 = gl.inline_asm_elementwise(
            _UNPACK2,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [v_e],
            dtype=(gl.int32,) * 8,
            is_pure=True,
            pack=1,
        )
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _UNPACK2,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [v_o],
            dtype=(gl.int32,) * 8,
            is_pure=True,
            pack=1,
        )
        fields = ((e0, e4, o0, o4), (e1, e5, o1, o5), (e2, e6, o2, o6), (e3, e7, o3, o7))
    else:
        e0, e1, e2, e3 = gl.inline_asm_elementwise(
            _UNPACK4, "=r,=r,=r,=r,r", [v_e], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _UNPACK4, "=r,=r,=r,=r,r", [v_o], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
        fields = ((e0, e1, o0, o1), (e2, e3, o2, o3))  # type: ignore[assignment]  # 2 fields
    return fields


@gluon.jit
def _store_split(
    accs,
    m,
    l_acc,
    qi,
    out_ch,
    lq,
    Q_AXIS: gl.constexpr,
    where,
    HQ: gl.constexpr,
    QPK: gl.constexpr,
    D: gl.constexpr,
    VG: gl.constexpr,
):
    """Merge the W warps' states (``m``, ``l_acc``: ``[W, queries]``) and store the split's
    partial output and LSE; V's halving comes back as the factor 2. ``accs``: the four field
    accumulators, the queries along ``Q_AXIS`` (1: v5's rows, 2: v6's columns); ``qi``: the
    query index and ``out_ch`` the V byte column in their layout, ``lq`` the query index in
    the LSE's; ``where``: ``(O_PART, LSE_PART, split, b, h, n_rows_total)``."""
    O_PART, LSE_PART, split, b, h, n_rows_total = where
    acc0, acc1, acc2, acc3 = accs
    m_all = gl.max(m, axis=0)
    m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    wscale = gl.exp2(m - gl.expand_dims(m_safe, 0))  # [W, queries]; 0 for warps without tokens
    l_tot = gl.sum(l_acc * wscale, axis=0)
    l_safe = gl.where(l_tot > 0, l_tot, 1.0)
    lse = gl.where(l_tot > 0, m_all + gl.log2(l_safe), float("-inf"))
    out_scale = gl.expand_dims(wscale * gl.expand_dims(2.0 / l_safe, 0), 3 - Q_AXIS)
    prow = split.to(gl.int64) * n_rows_total + b.to(gl.int64) * HQ + h * QPK + qi
    obase = O_PART + prow * D + out_ch * VG
    q_ok = qi < QPK
    gl.store(obase, gl.expand_dims(gl.sum(acc0 * out_scale, axis=0), 0), mask=q_ok)
    gl.store(obase + 1, gl.expand_dims(gl.sum(acc1 * out_scale, axis=0), 0), mask=q_ok)
    if VG == 4:
        gl.store(obase + 2, gl.expand_dims(gl.sum(acc2 * out_scale, axis=0), 0), mask=q_ok)
        gl.store(obase + 3, gl.expand_dims(gl.sum(acc3 * out_scale, axis=0), 0), mask=q_ok)
    lptr = LSE_PART + split.to(gl.int64) * n_rows_total + b.to(gl.int64) * HQ + h * QPK + lq
    gl.store(lptr, lse, mask=lq < QPK)


@gluon.jit
def decode_v5_kernel(
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
    LAZY: gl.constexpr = False,
):
    """One program per (request, KV head, split), ``W`` warps (one of :data:`V5_WARP_COUNTS`):
    the split's packed records, 64 tokens per warp and step, ``STAGES`` pipeline stages (one
    of :data:`V5_STAGES`). Writes the split's normalized partial output (``O_PART``, fp32,
    rotated frame, natural channel order) and base-2 LSE (``LSE_PART``), as v4's kernel with
    ``PHASES=1``. ``q_rows``: ``QPK`` (see the query load). ``FOLD``: the operands are the raw
    codes (``magic + code / 2``), their scales folded into the query and the probabilities and
    their zeros and magics into per-row terms (``variant="v5f"``). ``LAZY`` (with ``FOLD`` and
    one warp; not launched yet, docs/kernel-notes.md): the accumulators rescaled only in steps
    where a row's maximum grew."""
    gl.static_assert(W == 1 or W == 2 or W == 4, "v5 runs 1, 2 or 4 warps per program")
    gl.static_assert(STAGES == 2 or STAGES == 3, "v5 pipelines 2 or 3 stages")
    gl.static_assert(D == 128, "v5 is written for head dim 128")
    gl.static_assert(VB == 2 or VB == 4, "v5 takes 2- or 4-bit values")
    gl.static_assert(QPK <= 16, "v5 takes up to 16 query heads per KV head")
    VG: gl.constexpr = 8 // VB  # V fields per byte
    # several warps would need a CTA-wide vote on the rescale
    gl.static_assert(not LAZY or (FOLD and W == 1), "LAZY takes FOLD and one warp")
    NC: gl.constexpr = D // VG  # byte columns of a V row (channels per field)
    NCH: gl.constexpr = G // 64  # chunks per block

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
    )
    aop: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    bop: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # the code words as registers: lane (g, t) holds rows g + 8 i and words t + 4 j of its
    # warp's chunk
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
    kvec: gl.constexpr = gl.SliceLayout(2, bop)  # [W, K] along an operand's k
    avec: gl.constexpr = gl.SliceLayout(1, aop)  # [W, K] along the A operand's k (same lanes)
    quads: gl.constexpr = gl.SliceLayout(1, words)  # [W, words] as lane t holds them
    rows_l: gl.constexpr = gl.SliceLayout(2, mma)  # [W, 16] along the query rows

    b = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ_LENS + b)

    # the query, row-normalized, as the A operand in the _perm16 channel order
    qr = _axis(16, 1, aop)
    # q_rows == QPK, as a run-time value: with the bound known at compile time the rows past
    # it become one shared zero register, and every MMA then copies its A operand into an
    # aligned register quad (97 moves per step)
    q_ok = qr < q_rows
    q_ptr = Q + (b.to(gl.int64) * HQ + h * QPK + qr) * D + _perm16(_axis(D, 2, aop))
    q = gl.load(q_ptr + 0 * _axis(W, 0, aop), mask=q_ok, other=0.0) * qk_scale  # [W, 16, D]
    qmax = gl.max(gl.abs(q), axis=2)
    qmax = gl.where(qmax > 0, qmax, 1.0)
    q16 = (q / gl.expand_dims(qmax, 2)).to(gl.float16)
    # the scores' row factor: the row maximum and K's halving
    row_scale2 = gl.convert_layout(qmax, rows_l) * 2.0  # [W, 16]
    row_scale = gl.expand_dims(row_scale2, 2)  # [W, 16, 1]

    ch_lo, ch_hi = _split_chunks(seq_len, split, G, NCH, NUM_SPLITS)
    n_it = gl.cdiv(ch_hi - ch_lo, W)
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

    bufs = _stage_buffers(STAGES, W, D, NC, VG)
    # STAGES - 1 steps' copies in flight; each step's block-table walk is issued a step before
    # its copies and one step before its masks, so no step waits on it
    walk = (KV, bt_row, BLOCK_TO_SLOT, h, ch_lo, ch_hi)
    geo: gl.constexpr = (W, HK, NCH, STRIDE)
    offs: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    copies: gl.constexpr = (k_copy, v_copy, s_copy)
    for st in gl.static_range(STAGES - 1):
        _issue(st, _copy_meta(st, walk, geo, copies), bufs, D, G, NC, VG, offs, copies)
    meta = _copy_meta(STAGES - 1, walk, geo, copies)
    warp_s = _axis(W, 0, mma)
    _r, bi, c, packed = _chunk(0, warp_s, walk, geo)

    n_col = _axis(32, 2, mma)  # score column n: token pair _perm16(n) of the chunk
    pair_n = _perm16(n_col)
    out_col = _axis(NC, 2, mma)  # [1, 1, NC]: byte column of V, the outputs' n
    cols: gl.constexpr = gl.SliceLayout(1, mma)  # [W, N] along the scores' / outputs' n

    m = gl.full([W, 16], float("-inf"), gl.float32, rows_l)
    l_acc = gl.zeros([W, 16], gl.float32, rows_l)
    zero = gl.zeros([W, 16, NC], gl.float32, mma)
    zero_s = gl.zeros([W, 16, 32], gl.float32, mma)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    for it in range(n_it):
        _issue((it + STAGES - 1) % STAGES, meta, bufs, D, G, NC, VG, offs, copies)
        meta = _copy_meta(it + STAGES, walk, geo, copies)
        _r, bi_next, c_next, packed_next = _chunk(it + 1, warp_s, walk, geo)

        async_copy.wait_group(STAGES - 1)
        stage = it % STAGES
        kw = bufs[0].index(stage).load(words)  # [W, 32, D / 4]
        vw = bufs[1].index(stage).load(words)  # [W, 2 NC, 8]
        # the chunk's scales (pool blocks' and chunks past the split's landed as zeros)
        ks0, ks1, kz0, kz1 = _k_scale_pairs(stage, bufs, quads)
        if not FOLD:  # (v5f takes them in other layouts, below)
            ks = gl.expand_dims(_k_vector(ks0, ks1, W, D, kvec), 2)  # [W, D, 1]
            kz = gl.expand_dims(_k_vector(kz0, kz1, W, D, kvec), 2) * 0.5
        kt_e, kt_o, vs, vz = _token_scale_pairs(stage, bufs, quads, cols, 1)  # kt: [W, 1, 32]
        se0, so0, se1, so1 = vs
        ze0, zo0, ze1, zo1 = vz
        if not FOLD:
            vs_e = gl.expand_dims(_k_vector(se0, se1, W, 32, kvec), 2)  # [W, 32, 1]
            vs_o = gl.expand_dims(_k_vector(so0, so1, W, 32, kvec), 2)
            vz_e = gl.expand_dims(_k_vector(ze0, ze1, W, 32, kvec), 2) * 0.5
            vz_o = gl.expand_dims(_k_vector(zo0, zo1, W, 32, kvec), 2) * 0.5
        vc = _v_channel_scales(stage, bufs, cols, 1, VG)  # [W, 1, NC] each

        # --- scores [W, 16, 32] of the even and odd tokens of the chunk's pairs ---
        lo0, lo1, hi0, hi1 = gl.inline_asm_elementwise(
            _UNPACK4, "=r,=r,=r,=r,r", [kw], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
        if FOLD:
            # q . ((x - magic) ks + kz / 2) = (q ks) . x + (q . kz / 2 - magic sum(q ks)): the
            # per-channel scale on the query, the rest one number per row (two small MMAs
            # against broadcast columns, so q ks is summed exactly as the big MMA uses it)
            q_s = q16 * gl.expand_dims(_k_vector(ks0, ks1, W, D, avec), 1)
            kz = gl.expand_dims(_k_vector(kz0, kz1, W, D, kvec), 2)  # [W, D, 1]
            ones_k = gl.full([W, D, 8], 1.0, gl.float16, bop)
            zero8 = gl.zeros([W, 16, 8], gl.float32, mma)
            qz = gl.max(mma_v2(q16, gl.broadcast(kz, ones_k)[0], zero8), axis=2) * 0.5
            qs = gl.max(mma_v2(q_s, ones_k, zero8), axis=2)
            x_e = _operand(lo0, lo1, W, D, 32, bop)  # magic + code / 2 of the even tokens
            s_e = mma_v2(q_s, x_e, gl.broadcast(gl.expand_dims(qz - 512.0 * qs, 2), zero_s)[0])
            x_o = _operand(hi0, hi1, W, D, 32, bop)
            s_o = mma_v2(q_s, x_o, gl.broadcast(gl.expand_dims(qz - 32.0 * qs, 2), zero_s)[0])
        else:
            k_e = (_operand(lo0, lo1, W, D, 32, bop) - 512.0) * ks + kz
            s_e = mma_v2(q16, k_e, zero_s)
            k_o = (_operand(hi0, hi1, W, D, 32, bop) - 32.0) * ks + kz
            s_o = mma_v2(q16, k_o, zero_s)
        pos = (bi * G + c * 64 + 2 * pair_n).to(gl.int32)  # [W, 1, 32], the even token
        # scores without their row factor (positive: the maximum commutes with it), so that
        # each probability is one fma and an exp2
        s_e = gl.where(packed & (pos < seq_len), s_e * kt_e.to(gl.float32), float("-inf"))
        s_o = gl.where(packed & (pos + 1 < seq_len), s_o * kt_o.to(gl.float32), float("-inf"))

        s_max = gl.maximum(gl.max(s_e, axis=2), gl.max(s_o, axis=2))
        m_new = gl.maximum(m, s_max * row_scale2)
        if LAZY:
            # rescale only in the steps where some row's maximum grew (alpha is exactly 1 in
            # the others; past the first chunks a new maximum is rare), so the accumulators
            # take one fma per element and step instead of a multiply and an fma
            if gl.max(gl.max((m_new > m).to(gl.int32), axis=1), axis=0) > 0:
                alpha = gl.exp2(m - gl.where(m_new == float("-inf"), 0.0, m_new))
                a3 = gl.expand_dims(alpha, 2)
                acc0 = acc0 * a3
                acc1 = acc1 * a3
                if VG == 4:
                    acc2 = acc2 * a3
                    acc3 = acc3 * a3
                l_acc = l_acc * alpha
                m = m_new
            m3 = gl.expand_dims(gl.where(m == float("-inf"), 0.0, m), 2)
            p_e = gl.exp2(gl.fma(s_e, row_scale, -m3))
            p_o = gl.exp2(gl.fma(s_o, row_scale, -m3))
            l_acc = l_acc + gl.sum(p_e, axis=2) + gl.sum(p_o, axis=2)
            a3 = 1.0
        else:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_use)
            m3 = gl.expand_dims(m_use, 2)
            p_e = gl.exp2(gl.fma(s_e, row_scale, -m3))
            p_o = gl.exp2(gl.fma(s_o, row_scale, -m3))
            l_acc = l_acc * alpha + gl.sum(p_e, axis=2) + gl.sum(p_o, axis=2)
            m = m_new
        pe16 = gl.convert_layout(p_e.to(gl.float16), aop)
        po16 = gl.convert_layout(p_o.to(gl.float16), aop)
        if not LAZY:
            a3 = gl.expand_dims(alpha, 2)
        if FOLD:
            # P . ((x - magic) vs + vz / 2) = (P vs) . x + (P . vz / 2 - magic sum(P vs)) per
            # field: the per-token scale on the probabilities, two per-row sums for all fields
            pe_s = pe16 * gl.expand_dims(_k_vector(se0, se1, W, 32, avec), 1)
            po_s = po16 * gl.expand_dims(_k_vector(so0, so1, W, 32, avec), 1)
            ones_v = gl.full([W, 32, 8], 1.0, gl.float16, bop)
            zero8v = gl.zeros([W, 16, 8], gl.float32, mma)
            vz_e = gl.broadcast(gl.expand_dims(_k_vector(ze0, ze1, W, 32, kvec), 2), ones_v)[0]
            vz_o = gl.broadcast(gl.expand_dims(_k_vector(zo0, zo1, W, 32, kvec), 2), ones_v)[0]
            pz = mma_v2(po16, vz_o, mma_v2(pe16, vz_e, zero8v))
            pz = gl.expand_dims(gl.max(pz, axis=2) * 0.5, 2)  # [W, 16, 1]
            ps = mma_v2(po_s, ones_v, mma_v2(pe_s, ones_v, zero8v))
            ps = gl.expand_dims(gl.max(ps, axis=2), 2)
            vs_e = 1.0  # unused with FOLD
            vs_o = 1.0
            pe16 = pe_s
            po16 = po_s
        else:
            pz = 0.0
            ps = 0.0

        # --- P V [W, 16, NC] per V field, both parities into one MMA chain ---
        p = (pe16, po16)
        terms = (vs_e, vz_e, vs_o, vz_o, pz, ps)
        v_e, v_o = gl.split(gl.permute(gl.reshape(vw, [W, 2, NC, 8]), [0, 2, 3, 1]))
        f = _v_field_codes(v_e, v_o, VG)
        if VG == 4:
            acc0 = _field(acc0, a3, p, f[0], 512.0, vc[0], terms, zero, FOLD, W, NC, bop)
            acc1 = _field(acc1, a3, p, f[1], 128.0, vc[1], terms, zero, FOLD, W, NC, bop)
            acc2 = _field(acc2, a3, p, f[2], 32.0, vc[2], terms, zero, FOLD, W, NC, bop)
            acc3 = _field(acc3, a3, p, f[3], 8.0, vc[3], terms, zero, FOLD, W, NC, bop)
        else:
            acc0 = _field(acc0, a3, p, f[0], 512.0, vc[0], terms, zero, FOLD, W, NC, bop)
            acc1 = _field(acc1, a3, p, f[1], 32.0, vc[1], terms, zero, FOLD, W, NC, bop)
        bi = bi_next
        c = c_next
        packed = packed_next
    async_copy.wait_group(0)

    rows = _axis(16, 1, mma)  # [1, 16, 1]
    lrow = gl.arange(0, 16, layout=gl.SliceLayout(0, rows_l))
    accs = (acc0, acc1, acc2, acc3)
    where = (O_PART, LSE_PART, split, b, h, n_rows_total)
    _store_split(accs, m, l_acc, rows, out_col, lrow, 1, where, HQ, QPK, D, VG)
