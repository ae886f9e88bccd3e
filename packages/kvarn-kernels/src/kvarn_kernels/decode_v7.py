# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon JIT kernels are untyped by nature.)
"""Decode attention v7: v6's transposed loop on 5-bit codes, read from the byte planes.

A group of eight 5-bit codes is five bytes, code ``j`` at bits ``5j .. 5j + 4``, so an operand
value needs two bytes. The cache keeps 5-bit sections as five byte planes
(:class:`kvarn_format.CodeOrder` ``PLANES`` for K, ``PLANES_PAIRED`` for V): one 32-bit word of
plane ``b`` holds byte ``b`` of four channels (K) or four tokens (V), so one ``prmt`` of the
words of planes ``b`` and ``b + 1`` puts a field's two bytes, for two channels or two tokens,
into the two halves of a register, and one ``lop3`` cuts the field and ORs it into the
mantissa of its own power of two (the field magic of :mod:`kvarn_kernels.decode_v5`: a field
at bit ``s`` of its half, ``s <= 5``, with magic ``2**(9 - s)`` reads ``magic + code / 2``).
Fields that lie inside one byte skip the ``prmt``; fields 3 and 6 (``s`` = 7 and 6) take one
shift.

Which token is which score row. The scores are ``S^T = K Q^T`` as in v6, tokens along M, in two
operands of 32 rows: the even fields (codes 0, 2, 4, 6 of each group) and the odd ones. Row
``r`` of either is token ``8 (r % 8) + 2 (r // 8)`` (plus 1 for the odd operand): group ``r %
8`` of the chunk's eight groups of eight tokens, so a lane's rows (``g`` and ``g + 8`` of each
tile) share a group and each register holds one field of two channels. ``P V``'s B operand (the
probabilities, ``k`` along those rows) then meets V's A operand with its two tokens of a register
from groups ``2t`` and ``2t + 1`` at one code index: the tokens ``PLANES_PAIRED`` sets side by
side, bytes (0, 1) of a word for the even operand and (2, 3) for the odd one.

K's channels follow v5's relabelling (:func:`kvarn_kernels.decode_v5._perm16`: lane ``t``'s
word of k-tile ``kt`` is channels ``16 kt + 4 t .. + 3``, its bytes (0, 2) and (1, 3) the
register pairs), the query and K's channel scales with them. V's eight fields (channels ``8h +
i``) each keep an output accumulator ``[16 channel groups, 8 query columns]``.

Numerics as v6 without the fold: operands are dequantized values halved into fp16, ``(x -
magic) * scale + zero / 2``, fp32 scores and accumulators; K's token scale and the query's row
maximum scale the scores, V's channel scale the outputs, the halvings come back as a factor 2.
GPU only (Gluon has no interpreter); ``kvarn_k5v5_g64`` at head dim 128, up to 8 query heads per
KV head. v7f (the fold) is ``variant="auto"``'s kernel there since the thirty-seventh session
(H200: 0.19x v1's time from B = 64, docs/kernel-notes.md).
"""

from __future__ import annotations

from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
    mma_v2,
)

from kvarn_kernels.decode_v5 import (
    _QUARTERS,
    _axis,
    _chunk,
    _halves,
    _pairs_of_quad,
    _perm16,
    _split_chunks,
)
from kvarn_kernels.decode_v6 import (
    V6_MAX_QPK,
    _k_channel_operands,
    _mma_column_sum,
    _mma_column_sum2,
    _online_softmax,
    _operand_a,
)

__all__ = ["V7_MAX_QPK", "decode_v7_kernel"]

#: Query heads per KV head v7 takes: the 8 columns of one ``m16n8k16`` N tile.
V7_MAX_QPK = V6_MAX_QPK

# K: the five plane words of four channels (bytes 0..3 of each: channels 4t .. 4t + 3) of one
# token group in, its eight fields out as fp16x2 registers of channels (0, 2) ($0 .. $7) and
# (1, 3) ($8 .. $15), field j holding magic_j + code / 2 with magics 512, 16, 128, 32, 32, 256,
# 32, 64. Fields 0, 2, 5 and 7 lie in one byte (lop3 on the word, or on it shifted by 8 for
# bytes 1 and 3); 1, 3, 4 and 6 straddle two planes (prmt 0x6240 / 0x7351 pairs bytes (0, 2)
# / (1, 3) of both words), 3 and 6 shifted to bit 4 first.
_UNPACK5_K = gl.constexpr("""
{
.reg .b32 s, x, y;
lop3.b32 $0, $16, 0x001F001F, 0x60006000, 0xEA;
shr.b32 s, $16, 8;
lop3.b32 $8, s, 0x001F001F, 0x60006000, 0xEA;
prmt.b32 x, $16, $17, 0x6240;
prmt.b32 y, $16, $17, 0x7351;
lop3.b32 $1, x, 0x03E003E0, 0x4C004C00, 0xEA;
lop3.b32 $9, y, 0x03E003E0, 0x4C004C00, 0xEA;
lop3.b32 $2, $17, 0x007C007C, 0x58005800, 0xEA;
shr.b32 s, $17, 8;
lop3.b32 $10, s, 0x007C007C, 0x58005800, 0xEA;
prmt.b32 x, $17, $18, 0x6240;
prmt.b32 y, $17, $18, 0x7351;
shr.b32 x, x, 3;
shr.b32 y, y, 3;
lop3.b32 $3, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $11, y, 0x01F001F0, 0x50005000, 0xEA;
prmt.b32 x, $18, $19, 0x6240;
prmt.b32 y, $18, $19, 0x7351;
lop3.b32 $4, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $12, y, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $5, $19, 0x003E003E, 0x5C005C00, 0xEA;
shr.b32 s, $19, 8;
lop3.b32 $13, s, 0x003E003E, 0x5C005C00, 0xEA;
prmt.b32 x, $19, $20, 0x6240;
prmt.b32 y, $19, $20, 0x7351;
shr.b32 x, x, 2;
shr.b32 y, y, 2;
lop3.b32 $6, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $14, y, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $7, $20, 0x00F800F8, 0x54005400, 0xEA;
shr.b32 s, $20, 8;
lop3.b32 $15, s, 0x00F800F8, 0x54005400, 0xEA;
}
""")
# V: the five plane words of four token positions of one channel group in, its eight fields
# out as fp16x2 registers of positions (0, 1) ($0 .. $7: the even operand's tokens) and (2, 3)
# ($8 .. $15: the odd operand's), with the K fields' magics (prmt 0x5140 / 0x7362)
_UNPACK5_V = gl.constexpr("""
{
.reg .b32 x, y;
prmt.b32 x, $16, $17, 0x5140;
prmt.b32 y, $16, $17, 0x7362;
lop3.b32 $0, x, 0x001F001F, 0x60006000, 0xEA;
lop3.b32 $8, y, 0x001F001F, 0x60006000, 0xEA;
lop3.b32 $1, x, 0x03E003E0, 0x4C004C00, 0xEA;
lop3.b32 $9, y, 0x03E003E0, 0x4C004C00, 0xEA;
prmt.b32 x, $17, $18, 0x5140;
prmt.b32 y, $17, $18, 0x7362;
lop3.b32 $2, x, 0x007C007C, 0x58005800, 0xEA;
lop3.b32 $10, y, 0x007C007C, 0x58005800, 0xEA;
shr.b32 x, x, 3;
shr.b32 y, y, 3;
lop3.b32 $3, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $11, y, 0x01F001F0, 0x50005000, 0xEA;
prmt.b32 x, $18, $19, 0x5140;
prmt.b32 y, $18, $19, 0x7362;
lop3.b32 $4, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $12, y, 0x01F001F0, 0x50005000, 0xEA;
prmt.b32 x, $19, $20, 0x5140;
prmt.b32 y, $19, $20, 0x7362;
lop3.b32 $5, x, 0x003E003E, 0x5C005C00, 0xEA;
lop3.b32 $13, y, 0x003E003E, 0x5C005C00, 0xEA;
shr.b32 x, x, 2;
shr.b32 y, y, 2;
lop3.b32 $6, x, 0x01F001F0, 0x50005000, 0xEA;
lop3.b32 $14, y, 0x01F001F0, 0x50005000, 0xEA;
prmt.b32 x, $20, $20, 0x5140;
prmt.b32 y, $20, $20, 0x7362;
lop3.b32 $7, x, 0x00F800F8, 0x54005400, 0xEA;
lop3.b32 $15, y, 0x00F800F8, 0x54005400, 0xEA;
}
""")
#: Field ``j``'s magic: the power of two whose mantissa step at the field's bit is 1/2.
FIELD_MAGICS = (512.0, 16.0, 128.0, 32.0, 32.0, 256.0, 32.0, 64.0)


@gluon.jit
def _unpack5(p0, p1, p2, p3, p4, ASM: gl.constexpr):
    """:data:`_UNPACK5_K` or :data:`_UNPACK5_V` on five plane words (int32 tensors of one
    layout): sixteen int32 tensors of fp16x2, fields 0..7 of one register pair, then of the
    other."""
    return gl.inline_asm_elementwise(
        ASM,
        "=r," * 16 + "r,r,r,r,r",
        [p0, p1, p2, p3, p4],
        dtype=(gl.int32,) * 16,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _halves_of(words):
    """The two fp16 halves of int32 words (a register-pair view: no instruction)."""
    return gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;",
        "=h,=h,r",
        [words],
        dtype=(gl.float16,) * 2,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _stack4(a, b, c, d):
    """Four ``[W, 8, N]`` tensors as ``[W, 32, N]``, ``a``'s rows first."""
    x = gl.join(gl.join(a, b), gl.join(c, d))  # [W, 8, N, 2 (a|b), 2 (ab|cd)]
    x = gl.permute(x, [0, 4, 3, 1, 2])
    return gl.reshape(x, [x.shape[0], 32, x.shape[4]])


@gluon.jit
def _k_rows(f, magic_rows, ks, kz, FOLD: gl.constexpr, W: gl.constexpr, D: gl.constexpr, aop):
    """The A operand ``[W, 32, D]`` of four K fields (``f``: their (0, 2) registers, then their
    (1, 3) ones, each ``[W, 8 groups, D / 4 words]``), dequantized: ``(x - magic) * ks + kz``
    (``magic_rows`` along the rows, the scales along k), or with ``FOLD`` the raw codes."""
    r02 = _stack4(f[0], f[1], f[2], f[3])
    r13 = _stack4(f[4], f[5], f[6], f[7])
    a = _operand_a(r02, r13, W, 32, D, aop)
    if not FOLD:
        a = (a - magic_rows) * ks + kz
    return a


@gluon.jit
def _v_operand(r, W: gl.constexpr, NH: gl.constexpr, aop: gl.constexpr):
    """fp16x2 registers ``[W, NH, 16 words]`` (word ``4t + q`` of lane ``t``, its two tokens the
    halves) as the ``[W, NH, 32]`` A operand, ``k = 8q + 2t + half``."""
    x = _halves(r)  # [W, NH, 16, 2]
    x = gl.reshape(x, [W, NH, 4, 4, 2])  # [W, h, t, q, half]
    x = gl.reshape(gl.permute(x, [0, 1, 3, 2, 4]), [W, NH, 32])
    return gl.convert_layout(x, aop)


@gluon.jit
def _v_field(
    acc, a3, pb, codes, magic: gl.constexpr, scales, vc, zero, FOLD: gl.constexpr, W, NH, aop
):
    """A V field's ``[W, NH, 8]`` accumulator after a step: rescaled by ``a3``, plus both
    operands' ``V^T P^T`` (one chain) in the field's channel scales ``vc``. ``codes``: the
    field's registers for the even and the odd rows; ``scales``: ``vs_e, vz_e, vs_o, vz_o``
    along k, or with ``FOLD`` (the raw codes against probabilities that carry the token
    scales) the columns' sums ``pz, ps`` whose ``pz - magic * ps`` starts the chain."""
    pb_e, pb_o = pb
    a_e = _v_operand(codes[0], W, NH, aop)
    a_o = _v_operand(codes[1], W, NH, aop)
    if FOLD:
        pz, ps = scales
        start = gl.broadcast(gl.expand_dims(pz - magic * ps, 1), zero)[0]
    else:
        vs_e, vz_e, vs_o, vz_o = scales
        a_e = (a_e - magic) * vs_e + vz_e
        a_o = (a_o - magic) * vs_o + vz_o
        start = zero
    pv = mma_v2(a_o, pb_o, mma_v2(a_e, pb_e, start))
    return acc * a3 + pv * vc.to(gl.float32)


@gluon.jit
def _issue(
    it, stage, walk, geo: gl.constexpr, warps, where, bufs, offs: gl.constexpr, NG, NH, D, G
):
    """Start the copies of step ``it``'s tiles into ``stage``: the five K and five V planes
    (16-byte copies), K's channel scales and zeros, the token scale words of K and V in
    score-row order, V's channel scales (pool blocks' scales land as zeros)."""
    OFF_KC: gl.constexpr = offs[0]
    OFF_KS: gl.constexpr = offs[1]
    OFF_KZ: gl.constexpr = offs[2]
    OFF_KT: gl.constexpr = offs[3]
    OFF_VC: gl.constexpr = offs[4]
    OFF_VCS: gl.constexpr = offs[5]
    OFF_VS: gl.constexpr = offs[6]
    OFF_VZ: gl.constexpr = offs[7]
    k_buf, v_buf, ks_buf, kz_buf, kt_buf, vs_buf, vz_buf, vc_buf = bufs
    k_row, k_word, v_row, v_word, quad, pair_word = where
    i32 = gl.pointer_type(gl.int32)
    i64 = gl.pointer_type(gl.int64)
    rk, _bi, _c, _p = _chunk(it, warps[0], walk, geo)
    rv, _bi, _c, _p = _chunk(it, warps[1], walk, geo)
    rs, _bi, _c, ps = _chunk(it, warps[2], walk, geo)
    for pl in gl.static_range(5):
        k_src = (rk + OFF_KC + pl * (NG * D) + k_row * D).to(i32) + k_word
        async_copy.async_copy_global_to_shared(k_buf.index(stage * 5 + pl), k_src)
        v_src = (rv + OFF_VC + pl * (NH * G) + v_row * G).to(i32) + v_word
        async_copy.async_copy_global_to_shared(v_buf.index(stage * 5 + pl), v_src)
    async_copy.async_copy_global_to_shared(
        ks_buf.index(stage), (rs + OFF_KS).to(i64) + quad, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        kz_buf.index(stage), (rs + OFF_KZ).to(i64) + quad, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        kt_buf.index(stage), (rs + OFF_KT).to(i32) + pair_word, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        vs_buf.index(stage), (rs + OFF_VS).to(i32) + pair_word, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        vz_buf.index(stage), (rs + OFF_VZ).to(i32) + pair_word, mask=ps
    )
    async_copy.async_copy_global_to_shared(
        vc_buf.index(stage), (rs + OFF_VCS).to(i64) + quad, mask=ps
    )
    async_copy.commit_group()


@gluon.jit
def _column_rows(col, b, n_tok, QPK: gl.constexpr, TOK: gl.constexpr):
    """Query column ``col``'s row and head (column ``c``: row ``b + c // QPK``, the last of
    the ``TOK`` for the padding columns; head ``c % QPK``) and whether it is a query of one
    of the program's ``n_tok`` rows: one rule for the query's load and the partials' stores."""
    row = b + gl.minimum(col // QPK, TOK - 1)
    return row, col % QPK, (col < TOK * QPK) & (col // QPK < n_tok)


@gluon.jit
def decode_v7_kernel(
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
    QSL,
    HQ: gl.constexpr,
    HK: gl.constexpr,
    QPK: gl.constexpr,
    D: gl.constexpr,
    G: gl.constexpr,
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
    TOK: gl.constexpr = 1,
    GPR: gl.constexpr = 1,
):
    """One program per (request, KV head, split), ``W`` warps, one 64-token tile per warp and
    step, as :func:`kvarn_kernels.decode_v6.decode_v6_kernel` (same grid, partial outputs and
    LSE; the pool tiles are :mod:`kvarn_kernels.decode_pool`'s launch). ``FOLD``
    (``variant="v7f"``): v6f's fold, the raw codes as A operands, K's channel scales on the
    query and V's token scales on the probabilities, the zeros and the fields' magics as
    per-row and per-column sums that start the MMA chains.

    ``TOK`` > 1 (speculative verify, rows as :func:`kvarn_kernels.attention.verify_rows` lays
    them out, one per query token): program ``i`` along the grid's first axis takes request
    ``i // GPR``'s tokens ``TOK (i % GPR) ..`` (``QSL``: ``query_start_loc``), up to ``TOK``
    of them, their ``QPK`` query heads side by side in the 8 columns (column ``c``: token
    ``c // QPK``, head ``c % QPK``), so they read the context once between them, each column
    masked at its own row's length; it writes the partials of its tokens' rows only (a
    padded batch's tail rows are the merge's to zero)."""
    gl.static_assert(W == 1 or W == 2 or W == 4, "v7 runs 1, 2 or 4 warps per program")
    gl.static_assert(STAGES == 2 or STAGES == 3, "v7 pipelines 2 or 3 stages")
    gl.static_assert(D == 128, "v7 is written for head dim 128")
    gl.static_assert(G == 64, "v7 reads 64-token tiles")
    gl.static_assert(QPK <= 8, "v7 takes up to 8 query heads per KV head")
    gl.static_assert(TOK * QPK <= 8, "v7's 8 columns hold TOK rows of QPK query heads")
    NG: gl.constexpr = G // 8  # token groups of a tile (K plane rows)
    NH: gl.constexpr = D // 8  # channel groups (V plane rows; channels per V field)
    KW: gl.constexpr = D // 4  # K plane words of a token group
    VW: gl.constexpr = G // 4  # V plane words of a channel group
    NQ: gl.constexpr = 8  # query columns

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
    )
    aop: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    bop: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K words: lane (g, t) holds group g's words t + 4 kt; V words: lane (g, t) rows g and g + 8,
    # words 4t .. 4t + 3
    k_words: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 1],
        threads_per_warp=[1, 8, 4],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    v_words: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 4],
        threads_per_warp=[1, 8, 4],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    copy16: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 4],
        threads_per_warp=[1, 4, 8],
        warps_per_cta=[W, 1, 1],
        order=[2, 1, 0],
    )
    s_copy: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[W, 1], order=[1, 0]
    )
    # the V channel scales' 64-bit words (channels 4p .. 4p + 3), two a lane: channel group h's
    vc_pairs: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 2], threads_per_warp=[2, 16], warps_per_cta=[W, 1], order=[1, 0]
    )
    avec: gl.constexpr = gl.SliceLayout(1, aop)  # [W, K] along the A operand's k
    bvec: gl.constexpr = gl.SliceLayout(2, bop)  # [W, K] along the B operand's k
    quads: gl.constexpr = gl.SliceLayout(1, k_words)  # [W, words] as lane t holds them
    rows_l: gl.constexpr = gl.SliceLayout(2, mma)  # [W, M] along the accumulators' rows
    cols_l: gl.constexpr = gl.SliceLayout(1, mma)  # [W, 8] along the query columns

    k_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[2, 1, 0])
    v_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=2, max_phase=4, order=[2, 1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    k_buf = gl.allocate_shared_memory(gl.int32, [STAGES * 5, W, NG, KW], k_smem)
    v_buf = gl.allocate_shared_memory(gl.int32, [STAGES * 5, W, NH, VW], v_smem)
    ks_buf = gl.allocate_shared_memory(gl.int64, [STAGES, W, D // 4], flat)
    kz_buf = gl.allocate_shared_memory(gl.int64, [STAGES, W, D // 4], flat)
    kt_buf = gl.allocate_shared_memory(gl.int32, [STAGES, W, 32], flat)
    vs_buf = gl.allocate_shared_memory(gl.int32, [STAGES, W, 32], flat)
    vz_buf = gl.allocate_shared_memory(gl.int32, [STAGES, W, 32], flat)
    vc_buf = gl.allocate_shared_memory(gl.int64, [STAGES, W, D // 4], flat)

    h = gl.program_id(1)
    split = gl.program_id(2)
    if TOK == 1:
        b = gl.program_id(0)
        n_tok = 1
        seq_len = gl.load(SEQ_LENS + b)
    else:  # the program's first row, and how many of its TOK rows are its request's tokens
        req = gl.program_id(0) // GPR
        first = (gl.program_id(0) % GPR) * TOK
        q_lo = gl.load(QSL + req)
        b = q_lo + first
        n_tok = gl.minimum(gl.load(QSL + req + 1) - q_lo - first, TOK)
        seq_len = gl.load(SEQ_LENS + b, mask=n_tok > 0, other=0)
        for t in gl.static_range(1, TOK):  # the longest row's tiles: the last token's
            seq_len = gl.maximum(seq_len, gl.load(SEQ_LENS + b + t, mask=t < n_tok, other=0))

    # the query, column-normalized, as the B operand [W, D, 8] in the _perm16 channel order
    q_row, q_head, q_ok = _column_rows(_axis(NQ, 2, bop), b, n_tok, QPK, TOK)
    q_ptr = Q + (q_row.to(gl.int64) * HQ + h * QPK + q_head) * D + _perm16(_axis(D, 1, bop))
    q = gl.load(q_ptr + 0 * _axis(W, 0, bop), mask=q_ok, other=0.0) * qk_scale
    qmax = gl.max(gl.abs(q), axis=1)  # [W, 8]
    qmax = gl.where(qmax > 0, qmax, 1.0)
    q16 = (q / gl.expand_dims(qmax, 1)).to(gl.float16)
    col_scale2 = gl.convert_layout(qmax, cols_l) * 2.0  # the scores' column factor, K's halving
    col_scale = gl.expand_dims(col_scale2, 1)  # [W, 1, 8]

    NCH: gl.constexpr = 1  # one 64-token chunk per tile
    ch_lo, ch_hi = _split_chunks(seq_len, split, G, NCH, NUM_SPLITS)
    n_it = gl.cdiv(ch_hi - ch_lo, W)
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt
    walk = (KV, bt_row, BLOCK_TO_SLOT, h, ch_lo, ch_hi)
    geo: gl.constexpr = (W, HK, NCH, STRIDE)

    # copy sources within a record: K plane b rows (token groups), V plane b rows (channel
    # groups), 16-byte vectors
    k_row = _axis(NG, 1, copy16)
    k_word = _axis(KW, 2, copy16)
    v_row = _axis(NH, 1, v_words)
    v_word = _axis(VW, 2, v_words)
    # the per-token scale words in score-row order: row r of the even operand is token 8 (r % 8)
    # + 2 (r // 8), whose pair word (with the odd operand's token) is 4 (r % 8) + r // 8
    srow = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, s_copy)), 0)
    pair_word = 4 * (srow % 8) + srow // 8
    quad = gl.expand_dims(gl.arange(0, D // 4, layout=gl.SliceLayout(0, s_copy)), 0)
    ws = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, s_copy)), 1)
    warp_k = _axis(W, 0, copy16)
    warp_v = _axis(W, 0, v_words)

    # field magics along the K operands' rows: even rows' fields 0, 2, 4, 6 by r // 8, odd 1,
    # 3, 5, 7
    fr = _axis(32, 1, aop) // 8  # [1, 32, 1]
    magic_e = gl.where(fr == 0, 512.0, gl.where(fr == 1, 128.0, 32.0)).to(gl.float16)
    magic_o = gl.where(fr == 0, 16.0, gl.where(fr == 1, 32.0, gl.where(fr == 2, 256.0, 64.0))).to(
        gl.float16
    )

    bufs = (k_buf, v_buf, ks_buf, kz_buf, kt_buf, vs_buf, vz_buf, vc_buf)
    offs: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    where = (k_row, k_word, v_row, v_word, quad, pair_word)
    warps = (warp_k, warp_v, ws)
    for st in gl.static_range(STAGES - 1):
        _issue(st, st, walk, geo, warps, where, bufs, offs, NG, NH, D, G)

    warp_s = _axis(W, 0, mma)
    _r, bi, c, packed = _chunk(0, warp_s, walk, geo)
    token_r = 8 * (_axis(32, 1, mma) % 8) + 2 * (_axis(32, 1, mma) // 8)  # even rows' tokens
    col_row, col_head, col_ok = _column_rows(_axis(NQ, 2, mma), b, n_tok, QPK, TOK)
    if TOK == 1:  # noqa: SIM108 (a constexpr branch)
        col_len = seq_len
    else:  # [1, 1, 8]: a column sees its own row's tokens only
        col_len = gl.load(SEQ_LENS + col_row, mask=col_ok, other=0)
    out_h = _axis(NH, 1, mma)  # [1, NH, 1]: the outputs' channel group

    m = gl.full([W, NQ], float("-inf"), gl.float32, cols_l)
    l_acc = gl.zeros([W, NQ], gl.float32, cols_l)
    zero = gl.zeros([W, NH, NQ], gl.float32, mma)
    zero_s = gl.zeros([W, 32, NQ], gl.float32, mma)
    # the folds' column sums as MMAs against rows of ones (or of the zeros): 16 rows, one tile
    zero_c = gl.zeros([W, 16, NQ], gl.float32, mma)
    ones_d = gl.full([W, 16, D], 1.0, gl.float16, aop)
    ones_p = gl.full([W, 16, 32], 1.0, gl.float16, aop)
    magic_e32 = gl.convert_layout(magic_e, mma).to(gl.float32)  # [1, 32, 1] along the rows
    magic_o32 = gl.convert_layout(magic_o, mma).to(gl.float32)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    acc4 = zero
    acc5 = zero
    acc6 = zero
    acc7 = zero
    for it in range(n_it):
        # the copies of step it + STAGES - 1 into the stage step it - 1 read
        nxt = it + STAGES - 1
        _issue(nxt, nxt % STAGES, walk, geo, warps, where, bufs, offs, NG, NH, D, G)
        _r, bi_next, c_next, packed_next = _chunk(it + 1, warp_s, walk, geo)

        async_copy.wait_group(STAGES - 1)
        stage = it % STAGES

        # --- scales ---
        ks0, ks1 = _pairs_of_quad(ks_buf.index(stage).load(quads))
        kz0, kz1 = _pairs_of_quad(kz_buf.index(stage).load(quads))
        ks, kz = _k_channel_operands((ks0, ks1, kz0, kz1), W, D, avec, bvec, FOLD)
        ktw = gl.expand_dims(kt_buf.index(stage).load(rows_l), 2)  # [W, 32, 1]
        kt_e, kt_o = _halves_of(ktw)
        if FOLD:  # V's token scales on the probabilities' k [W, 32, 1], the zeros on A's k
            vs_e, vs_o = _halves_of(gl.expand_dims(vs_buf.index(stage).load(bvec), 2))
        else:  # both on the codes' k: [W, 1, 32]
            vs_e, vs_o = _halves_of(gl.expand_dims(vs_buf.index(stage).load(avec), 1))
        vz_e, vz_o = _halves_of(gl.expand_dims(vz_buf.index(stage).load(avec), 1))
        vca, vcb = gl.split(gl.reshape(vc_buf.index(stage).load(vc_pairs), [W, NH, 2]))
        vca = gl.expand_dims(gl.convert_layout(vca, gl.SliceLayout(2, mma)), 2)  # [W, NH, 1]
        vcb = gl.expand_dims(gl.convert_layout(vcb, gl.SliceLayout(2, mma)), 2)
        vc0, vc1, vc2, vc3 = gl.inline_asm_elementwise(
            _QUARTERS, "=h,=h,=h,=h,l", [vca], dtype=(gl.float16,) * 4, is_pure=True, pack=1
        )
        vc4, vc5, vc6, vc7 = gl.inline_asm_elementwise(
            _QUARTERS, "=h,=h,=h,=h,l", [vcb], dtype=(gl.float16,) * 4, is_pure=True, pack=1
        )

        # --- scores [W, 32 rows, 8 columns] of the even and the odd fields ---
        kf = _unpack5(
            k_buf.index(stage * 5).load(k_words),
            k_buf.index(stage * 5 + 1).load(k_words),
            k_buf.index(stage * 5 + 2).load(k_words),
            k_buf.index(stage * 5 + 3).load(k_words),
            k_buf.index(stage * 5 + 4).load(k_words),
            _UNPACK5_K,
        )
        even = (kf[0], kf[2], kf[4], kf[6], kf[8], kf[10], kf[12], kf[14])
        odd = (kf[1], kf[3], kf[5], kf[7], kf[9], kf[11], kf[13], kf[15])
        k_e = _k_rows(even, magic_e, ks, kz, FOLD, W, D, aop)
        k_o = _k_rows(odd, magic_o, ks, kz, FOLD, W, D, aop)
        if FOLD:
            # q . ((x - magic) ks + kz / 2) = x . (q ks) + (q . kz / 2 - magic sum(q ks)): the
            # magic is the row's field's, the rest one number per query column
            q_s = q16 * ks
            qs = gl.expand_dims(_mma_column_sum(ones_d, q_s, zero_c), 1)  # [W, 1, 8]
            qz = gl.expand_dims(_mma_column_sum(gl.broadcast(kz, ones_d)[0], q16, zero_c), 1)
            qz = qz * 0.5
            s_e = mma_v2(k_e, q_s, gl.broadcast(qz - magic_e32 * qs, zero_s)[0])
            s_o = mma_v2(k_o, q_s, gl.broadcast(qz - magic_o32 * qs, zero_s)[0])
        else:
            s_e = mma_v2(k_e, q16, zero_s)
            s_o = mma_v2(k_o, q16, zero_s)
        pos = (bi * G + c * 64 + token_r).to(gl.int32)  # [W, 32, 1], the even rows' tokens
        s_e = gl.where(packed & (pos < col_len), s_e * kt_e.to(gl.float32), float("-inf"))
        s_o = gl.where(packed & (pos + 1 < col_len), s_o * kt_o.to(gl.float32), float("-inf"))

        m, l_acc, pb_e, pb_o, a3 = _online_softmax(s_e, s_o, m, l_acc, col_scale, col_scale2, bop)
        if FOLD:
            # (x - magic) vs + vz / 2 against P: x against P vs, plus per column and field
            # P . vz / 2 - magic sum(P vs), from two column sums for all fields
            vz_e16 = gl.broadcast(vz_e, ones_p)[0]
            vz_o16 = gl.broadcast(vz_o, ones_p)[0]
            pz = _mma_column_sum2((vz_e16, vz_o16), (pb_e, pb_o), zero_c) * 0.5
            pb_e = pb_e * vs_e
            pb_o = pb_o * vs_o
            ps = _mma_column_sum2((ones_p, ones_p), (pb_e, pb_o), zero_c)
            v_scales = (pz, ps)
        else:  # (a constexpr branch: the unfolded operands' four terms, not the fold's two)
            v_scales = (vs_e, vz_e * 0.5, vs_o, vz_o * 0.5)  # type: ignore[assignment]
        pb = (pb_e, pb_o)

        # --- V^T P^T [W, NH, 8] per V field ---
        vf = _unpack5(
            v_buf.index(stage * 5).load(v_words),
            v_buf.index(stage * 5 + 1).load(v_words),
            v_buf.index(stage * 5 + 2).load(v_words),
            v_buf.index(stage * 5 + 3).load(v_words),
            v_buf.index(stage * 5 + 4).load(v_words),
            _UNPACK5_V,
        )
        acc0 = _v_field(acc0, a3, pb, (vf[0], vf[8]), 512.0, v_scales, vc0, zero, FOLD, W, NH, aop)
        acc1 = _v_field(acc1, a3, pb, (vf[1], vf[9]), 16.0, v_scales, vc1, zero, FOLD, W, NH, aop)
        acc2 = _v_field(acc2, a3, pb, (vf[2], vf[10]), 128.0, v_scales, vc2, zero, FOLD, W, NH, aop)
        acc3 = _v_field(acc3, a3, pb, (vf[3], vf[11]), 32.0, v_scales, vc3, zero, FOLD, W, NH, aop)
        acc4 = _v_field(acc4, a3, pb, (vf[4], vf[12]), 32.0, v_scales, vc4, zero, FOLD, W, NH, aop)
        acc5 = _v_field(acc5, a3, pb, (vf[5], vf[13]), 256.0, v_scales, vc5, zero, FOLD, W, NH, aop)
        acc6 = _v_field(acc6, a3, pb, (vf[6], vf[14]), 32.0, v_scales, vc6, zero, FOLD, W, NH, aop)
        acc7 = _v_field(acc7, a3, pb, (vf[7], vf[15]), 64.0, v_scales, vc7, zero, FOLD, W, NH, aop)
        bi = bi_next
        c = c_next
        packed = packed_next
    async_copy.wait_group(0)

    # --- merge the warps' states, store the split's partial (V's halving: the factor 2) ---
    m_all = gl.max(m, axis=0)
    m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    wscale = gl.exp2(m - gl.expand_dims(m_safe, 0))  # [W, 8]; 0 for warps without tokens
    l_tot = gl.sum(l_acc * wscale, axis=0)
    l_safe = gl.where(l_tot > 0, l_tot, 1.0)
    lse = gl.where(l_tot > 0, m_all + gl.log2(l_safe), float("-inf"))
    out_scale = gl.expand_dims(wscale * gl.expand_dims(2.0 / l_safe, 0), 1)  # [W, 1, 8]
    prow = split.to(gl.int64) * n_rows_total + col_row.to(gl.int64) * HQ + h * QPK + col_head
    obase = O_PART + prow * D + out_h * 8
    accs = (acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
    for i in gl.static_range(8):
        gl.store(obase + i, gl.expand_dims(gl.sum(accs[i] * out_scale, axis=0), 0), mask=col_ok)
    lcol = gl.arange(0, NQ, layout=gl.SliceLayout(0, cols_l))
    l_row, l_head, l_ok = _column_rows(lcol, b, n_tok, QPK, TOK)
    lptr = LSE_PART + split.to(gl.int64) * n_rows_total + l_row.to(gl.int64) * HQ + h * QPK + l_head
    gl.store(lptr, lse, mask=l_ok)
