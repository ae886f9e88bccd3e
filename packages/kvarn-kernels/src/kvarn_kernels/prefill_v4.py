# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon JIT kernels are untyped by nature.)
"""Fused prefill v4: scores transposed, codes dequantized in registers, no producer warps.

:mod:`kvarn_kernels.prefill_v3`'s warp-specialized form spends its time on its structure, not
its math: every chunk is dequantized into shared memory by producer warps and handed over
(docs/kernel-notes.md, forty-first session). Here one warpgroup (4 warps, 64 query rows =
tokens x GQA heads of one KV head) does everything for its rows, transposed:

* scores ``S^T = K Q^T`` (``[64 keys, 64 rows]``): a chunk's K codes are dequantized in the
  warpgroup's registers as wgmma's A operand, the query rows are B in shared memory;
* outputs ``O^T += V^T P^T`` (``[128 channels, 64 rows]``): V's codes dequantized the same
  way as A, the probabilities ``P^T`` through shared memory as B;
* every warp copies its share of the chunks ahead into a ring with ``cp.async``
  (:func:`kvarn_kernels.prefill_v3._ring_issue`, v3's producer's copies), so nothing waits on
  a global load.

The unpacking needs no shuffles because keys and channels are relabelled to fit the wgmma A
fragment (a warp's 16 rows x 16 k: lane ``4 g + t`` holds rows ``g, g + 8`` at k ``2 t, 2 t +
1, 2 t + 8, 2 t + 9``):

* S^T row ``r = 16 w + 8 h + g`` is key ``2 P + h`` of the chunk, token pair ``P = 8 (g // 2)
  + 4 (w // 2) + 2 (g % 2) + w % 2`` (:func:`_token`): a K byte holds both keys of a pair (low
  nibble even), so one byte feeds rows ``g`` and ``g + 8`` of one lane;
* K's column ``c = 16 kb + 8 s + 2 t + e`` is channel ``32 t + 4 kb + 2 s + e``
  (:func:`_k_channel`; the query's columns follow): a lane's 8 code words are one 32-byte run
  of its pair's row, a word's bytes (0, 1) and (2, 3) unpack into fp16 pairs
  (:func:`kvarn_kernels.prefill_v3._unpack_asm`), and a pair's two channels are adjacent, as
  in the channel scales' words;
* V^T's columns are the keys in S^T's row order (``P^T``'s rows), so a lane's keys are 8
  consecutive pairs of each parity: two code words of one V byte column;
* V^T row ``r = 64 c + 16 w + 8 a + g`` is channel ``4 (8 w + g) + 2 c + a``
  (:func:`_v_channel`): the 4 fields of a 2-bit byte are a lane's 4 rows.

The softmax runs along the MMA's M (a key's scores sit in one warp, a query row's across the
warpgroup), so a column's maximum and sum cross the four warps; with
:data:`V4_LAZY_SOFTMAX` that happens only on the chunks that move a column's reference
maximum.

Numerics as v3's ``DEQ16``: ``k / 2`` and ``v / 2`` in fp16 pairs (K's codes read as ``base
+ code``, V's as ``magic + code / 2`` by :data:`kvarn_kernels.decode_v5._UNPACK2`; ``(x -
base) * scale + zero``, then the other axis' scale (halved for K), saturated to +-65504 with
NaN kept), fp32 scores and accumulators, the query row-normalized to fp16. GPU only (Gluon
has no interpreter); sm_90, 4-bit keys with 2-bit values, head dim 128, the in-cache
code orders v3 reads. Same grid, arguments and partials as v3.
"""

from __future__ import annotations

from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
)
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kvarn_kernels._common import PREFILL_UNSPECIALIZED
from kvarn_kernels.decode_v5 import _UNPACK2, _halves
from kvarn_kernels.prefill_v3 import (
    _chunk_block,
    _context_range,
    _pool_rows,
    _query_smem,
    _record_loads,
    _ring_copies,
    _ring_issue,
    _row_ids,
    _rows_layout,
    _tile_rows,
    _unpack_asm,
)

__all__ = [
    "V4_LAZY_SOFTMAX",
    "V4_PROGRAMS_PER_SM",
    "V4_RING",
    "V4_VALUE_BITS",
    "prefill_v4_kernel",
]

#: Ring slots of copied chunks: ``V4_RING - 1`` chunks' copies in flight while one is used.
V4_RING = 3
#: The online softmax's reference maxima move only when a chunk's scaled score would pass
#: one by more than :data:`LAZY_HEADROOM` (the probabilities stay below 2^15 in fp16), and
#: each thread keeps its own share of the sums until the end: the chunks between take no
#: cross-warp maximum or sum and no rescale of the accumulators.
V4_LAZY_SOFTMAX = True
LAZY_HEADROOM: gl.constexpr = gl.constexpr(15.0)
#: Programs an SM holds (255 registers a thread, 4 warps: two programs), for the split count.
V4_PROGRAMS_PER_SM = 2
#: Value widths v4 is written for (2-bit values: a V byte's 4 fields are a lane's 4 rows).
V4_VALUE_BITS = (2,)


@gluon.constexpr_function
def _mma_layout():
    """The warpgroup's accumulators: ``S^T [64, 64]`` and ``O^T [128, 64]`` (N = 64 rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.jit
def _token(r):
    """S^T row (and V^T column) ``r`` -> the chunk's key (module doc)."""
    g = r % 8
    w = r // 16
    return 2 * (8 * (g // 2) + 4 * (w // 2) + 2 * (g % 2) + w % 2) + (r // 8) % 2


@gluon.jit
def _k_channel(c):
    """K's (and the query's) column ``c`` -> channel (module doc)."""
    return ((c // 2) % 4) * 32 + (c // 16) * 4 + ((c // 8) % 2) * 2 + c % 2


@gluon.jit
def _v_channel(r):
    """V^T's (and O^T's) row ``r`` -> channel (module doc)."""
    return 4 * (8 * ((r // 16) % 4) + r % 8) + 2 * (r // 64) + (r // 8) % 2


# The same maps as shared-memory views: a view's offset bit ``i`` is the logical index whose
# element it holds (the channel or key's bit ``i`` read off the maps above), so a plain load
# of the view gathers the vector in operand order.
#: a chunk's 64 keys (fp16 token scales) in S^T row order
_KEY_VIEW: gl.constexpr = gl.SharedLinearLayout(offset_bases=[[8], [16], [1], [32], [2], [4]])
#: K's 128 channels (fp16 channel scales) in K column order
_K_CHANNEL_VIEW: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[1], [8], [16], [32], [64], [2], [4]]
)
#: V's 128 channels in V^T row order
_V_CHANNEL_VIEW: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[8], [64], [1], [2], [4], [16], [32]]
)
#: K's 32 code words of a token pair row, rows ``8 w + g`` in pair ``P(w, g)`` order
_K_WORDS_VIEW: gl.constexpr = gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0], [1, 0], [16, 0], [2, 0], [4, 0]]
)


@gluon.jit
def _dequant16x2(x, magic, scale, zero, mult, sat):
    """fp16 ``((x - magic) * scale + zero) * mult`` in pairs, saturated to +-65504 with NaN
    kept (``sat``: the 65504 pair; :func:`kvarn_kernels.prefill_v3._affine16x2_asm` with its
    constants as operands, which the compiler materializes once)."""
    return gl.inline_asm_elementwise(
        "{\n.reg .b32 t;\nsub.rn.f16x2 t, $1, $2;\nfma.rn.f16x2 t, t, $3, $4;\n"
        "mul.rn.f16x2 t, t, $5;\nmin.NaN.xorsign.abs.f16x2 $0, t, $6;\n}",
        "=r,r,r,r,r,r,r",
        [x, magic, scale, zero, mult, sat],
        dtype=gl.float16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _k_codes(words, A_OP: gl.constexpr):
    """A chunk's K code words ``[32 rows 8 w + g, 32 words]`` as the ``[64, 128]`` A operand
    of ``base + code`` (base 1024 for the even keys' rows, 64 for the odd ones'): each
    word's bytes (0, 1) and (2, 3) as fp16 pairs (:func:`kvarn_kernels.prefill_v3._unpack_asm`),
    so a pair holds two adjacent channels, as the channel scales' words do."""
    lo0, lo1, hi0, hi1 = gl.inline_asm_elementwise(
        _unpack_asm(4), "=r,=r,=r,=r,r", [words], dtype=(gl.int32,) * 4, is_pure=True, pack=1
    )
    # [row, word, e, s, h]: word 8 t + kb, e the pair's half, s the byte pair, h the nibble
    x = gl.join(gl.join(_halves(lo0), _halves(lo1)), gl.join(_halves(hi0), _halves(hi1)))
    x = gl.reshape(x, [4, 8, 4, 8, 2, 2, 2])  # [w, g, t, kb, e, s, h]
    x = gl.reshape(gl.permute(x, [0, 6, 1, 3, 5, 2, 4]), [64, 128])  # [w h g, kb s t e]
    return gl.convert_layout(x, A_OP)


@gluon.jit
def _v_field(fe, fo, f: gl.constexpr):
    """Field ``f`` of :data:`kvarn_kernels.decode_v5._UNPACK2`'s outputs of both parities
    (output ``f`` holds bytes (0, 2), output ``4 + f`` bytes (1, 3)): ``[col, t, u, e, s'',
    s]``."""
    even = gl.join(_halves(fe[f]), _halves(fe[4 + f]))
    odd = gl.join(_halves(fo[f]), _halves(fo[4 + f]))
    return gl.join(even, odd)


@gluon.jit
def _v_codes(w_even, w_odd, A_OP: gl.constexpr):
    """A chunk's 2-bit V code words of each parity (``[32 byte columns 8 w + g, 4 t, 2 u]``:
    keys of pairs ``8 t + 4 u .. + 3``) as the ``[128, 64]`` A operand of ``magic + code / 2``
    (magics 512, 128, 32, 8 by field ``2 c + a``)."""
    fe = gl.inline_asm_elementwise(
        _UNPACK2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w_even], dtype=(gl.int32,) * 8, is_pure=True, pack=1
    )
    fo = gl.inline_asm_elementwise(
        _UNPACK2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w_odd], dtype=(gl.int32,) * 8, is_pure=True, pack=1
    )
    # [col, t, u, e, s'', s, a, c]: field 2 c + a, s'' the byte pair, s the parity
    x = gl.join(
        gl.join(_v_field(fe, fo, 0), _v_field(fe, fo, 1)),
        gl.join(_v_field(fe, fo, 2), _v_field(fe, fo, 3)),
    )
    x = gl.reshape(x, [4, 8, 4, 2, 2, 2, 2, 2, 2])  # [w, g, t, u, e, s'', s, a, c]
    # rows 64 c + 16 w + 8 a + g, columns 16 (2 u + s'') + 8 s + 2 t + e
    x = gl.reshape(gl.permute(x, [8, 0, 7, 1, 3, 5, 6, 2, 4]), [128, 64])
    return gl.convert_layout(x, A_OP)


@gluon.jit
def _scale_rows(s_raw, r):
    """Ring slot ``r``'s scale rows (:func:`kvarn_kernels.prefill_v3._ring_issue`) as fp16:
    0-1 K channel scales, 2-3 K channel zeros, 4-5 V channel scales, 6 the chunk's K token
    scales, 7 its V token scales, 8 its V token zeros (64 fp16 a row)."""
    R: gl.constexpr = s_raw.type.shape[0]
    FLAT2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return s_raw._reinterpret(gl.float16, [R, 16 * 64], FLAT2).index(r)


@gluon.jit
def _record_k(ring, r, A_OP: gl.constexpr, KW: gl.constexpr):
    """Ring slot ``r``'s packed chunk as the dequantized ``k / 2`` A operand ``[64, 128]``."""
    k_raw, _v_raw, s_raw, _slot_raw = ring
    ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)
    COLS: gl.constexpr = gl.SliceLayout(0, A_OP)
    s16 = _scale_rows(s_raw, r)
    ks = s16.slice(0, 128)._reinterpret(gl.float16, [128], _K_CHANNEL_VIEW).load(COLS)
    kz = s16.slice(128, 128)._reinterpret(gl.float16, [128], _K_CHANNEL_VIEW).load(COLS)
    kt = s16.slice(384, 64)._reinterpret(gl.float16, [64], _KEY_VIEW).load(ROWS)
    # rows of even keys (low nibbles) read against 1024, odd ones against 64
    row = gl.arange(0, 64, layout=ROWS)
    base = gl.where((row // 8) % 2 == 0, 1024.0, 64.0).to(gl.float16)
    kw = k_raw.index(r)._reinterpret(gl.int32, [32, 32], _K_WORDS_VIEW).load(KW)
    return _dequant16x2(
        _k_codes(kw, A_OP),
        base[:, None],
        ks[None, :],
        kz[None, :],
        (kt * 0.5)[:, None],
        gl.full([64, 128], 65504.0, gl.float16, A_OP),
    )


@gluon.jit
def _record_v(ring, r, A_OP: gl.constexpr, VW: gl.constexpr):
    """Ring slot ``r``'s packed chunk as the dequantized ``V^T / 2`` A operand ``[128,
    64]``."""
    _k_raw, v_raw, s_raw, _slot_raw = ring
    ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)
    COLS: gl.constexpr = gl.SliceLayout(0, A_OP)
    s16 = _scale_rows(s_raw, r)
    vc = s16.slice(256, 128)._reinterpret(gl.float16, [128], _V_CHANNEL_VIEW).load(ROWS)
    vs = s16.slice(448, 64)._reinterpret(gl.float16, [64], _KEY_VIEW).load(COLS)
    vz = s16.slice(512, 64)._reinterpret(gl.float16, [64], _KEY_VIEW).load(COLS)
    # field 2 c + a of row 64 c + 16 w + 8 a + g read against 512 / 4^f
    row = gl.arange(0, 128, layout=ROWS)
    field = 2 * (row // 64) + (row // 8) % 2
    magic = gl.where(
        field == 0, 512.0, gl.where(field == 1, 128.0, gl.where(field == 2, 32.0, 8.0))
    ).to(gl.float16)
    FLAT4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])  # the dims after the first
    vw = v_raw.index(r)._reinterpret(gl.int32, [2, 32, 4, 2], FLAT4)
    return _dequant16x2(
        _v_codes(vw.index(0).load(VW), vw.index(1).load(VW), A_OP),
        magic[:, None],
        vs[None, :],
        (vz * 0.5)[None, :],
        vc[:, None],
        gl.full([128, 64], 65504.0, gl.float16, A_OP),
    )


@gluon.jit
def _pool_k(pool, slot, c, live_from, kv_len, h, geo: gl.constexpr, A_OP: gl.constexpr):
    """A pool block's chunk ``c`` (fp16) as the ``k / 2`` A operand; keys past ``kv_len``
    are zero (stale rows, NaN poison). ``geo``: KV heads, group, shadow rows and record
    stride."""
    ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)
    COLS: gl.constexpr = gl.SliceLayout(0, A_OP)
    t = c * 64 + _token(gl.arange(0, 64, layout=ROWS))
    k_src, _ = _pool_rows(pool, slot, t, h, geo[0], 128, geo[1], geo[2], geo[3])
    d = _k_channel(gl.arange(0, 128, layout=COLS))
    live = (live_from + t < kv_len)[:, None]
    return gl.load(k_src[:, None] + d[None, :], mask=live, other=0.0) * 0.5


@gluon.jit
def _pool_v(pool, slot, c, live_from, kv_len, h, geo: gl.constexpr, A_OP: gl.constexpr):
    """:func:`_pool_k`'s chunk as the ``V^T / 2`` A operand."""
    ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)
    COLS: gl.constexpr = gl.SliceLayout(0, A_OP)
    t = c * 64 + _token(gl.arange(0, 64, layout=COLS))
    _, v_src = _pool_rows(pool, slot, t, h, geo[0], 128, geo[1], geo[2], geo[3])
    d = _v_channel(gl.arange(0, 128, layout=ROWS))
    live = (live_from + t < kv_len)[None, :]
    return gl.load(v_src[None, :] + d[:, None], mask=live, other=0.0) * 0.5


@gluon.jit(**PREFILL_UNSPECIALIZED)
def prefill_v4_kernel(
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
    SHADOW: gl.constexpr,
    RING: gl.constexpr,
    LAZY: gl.constexpr,
    PDL: gl.constexpr,
):
    """:func:`kvarn_kernels.prefill_v3.prefill_v3_kernel`'s grid, arguments and partials at
    64 query rows a program (launched with ``num_warps=4``), transposed (module doc);
    ``RING``: :data:`V4_RING`; ``LAZY``: :data:`V4_LAZY_SOFTMAX`; ``PDL``: launched as a
    programmatic dependent (:func:`kvarn_kernels._launch.gdc_wait` before the queries, after
    the ring's first copies)."""
    W: gl.constexpr = 4
    M: gl.constexpr = 64
    BN: gl.constexpr = 64
    NCH: gl.constexpr = G // BN
    gl.static_assert(D == 128, "head dim 128")
    gl.static_assert(VB == 2, "2-bit values")
    gl.static_assert(G % BN == 0, "a tile must be whole chunks")
    gl.static_assert(RING >= 2, "a ring of two or more chunks")
    OL: gl.constexpr = _rows_layout(W)
    MMA: gl.constexpr = _mma_layout()
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)  # along the query rows
    KW: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    VW: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, M], gl.float16)

    pid = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    first, q_end, pos_lo, kv_len, _, rows, row_ok, b = _tile_rows(
        pid, h, QSL, SEQ_LENS, num_reqs, HQ, QPK, QPK_P, BQ, B_P, M, W, OL
    )
    blk_lo, n_it = _context_range(kv_len, split, G, NUM_SPLITS)
    n_it = gl.where(first < q_end, n_it, 0)  # a tile past its request's queries: no work
    bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

    # the ring of copied chunks (prefill_v3's producer's layout)
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    k_raw = gl.allocate_shared_memory(gl.int32, [RING, 32, D // 4], FLAT3)
    v_raw = gl.allocate_shared_memory(gl.int32, [RING, D * VB // 4, 8], FLAT3)
    s_raw = gl.allocate_shared_memory(gl.int32, [RING, 16, 32], FLAT3)
    slot_raw = gl.allocate_shared_memory(
        BLOCK_TO_SLOT.dtype.element_ty, [RING, 1], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    ring = (k_raw, v_raw, s_raw, slot_raw)
    OFFSETS: gl.constexpr = (OFF_KC, OFF_KS, OFF_KZ, OFF_KT, OFF_VC, OFF_VCS, OFF_VS, OFF_VZ)
    LOADS: gl.constexpr = _record_loads(D, G, VB, OFFSETS, W)
    COPIES: gl.constexpr = _ring_copies(W)
    GEO: gl.constexpr = (HK, G, SHADOW, STRIDE)  # the pool operands'
    for i in gl.static_range(RING - 1):
        blk = _chunk_block(bt_row, blk_lo, i, n_it, NCH)
        _ring_issue(ring, i, KV, BLOCK_TO_SLOT, blk, i, n_it, h, HK, STRIDE, NCH, LOADS, COPIES)
        async_copy.commit_group()

    # the query rows, row-normalized, in K's column order; the scores' factor back (k / 2)
    dq = _k_channel(gl.arange(0, D, layout=gl.SliceLayout(0, OL)))
    q_smem, col_scale = _query_smem(Q, rows, row_ok, qk_scale, M, D, OL, dq, PDL)
    col_scale = gl.convert_layout(col_scale, COLS)
    p_smem = gl.allocate_shared_memory(gl.float16, [BN, M], P_SMEM)
    m_col = gl.arange(0, M, layout=COLS)
    q_pos = pos_lo + m_col // QPK_P
    key_row = _token(gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)))
    fence_async_shared()
    gl.thread_barrier()

    # the columns' running maxima (LAZY: their reference maxima, +inf for a column that sees
    # no key of the split, so that its probabilities are zero without a NaN)
    m_i = gl.full([M], float("-inf"), gl.float32, COLS)
    l_i = gl.zeros([M], gl.float32, COLS)
    # LAZY: each thread's share of the sums, its two rows of a column added ([w, g, column])
    l_part = gl.sum(gl.reshape(gl.zeros([BN, M], gl.float32, MMA), [4, 2, 8, M]), axis=1)
    PART_COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, l_part.type.layout))
    acc = gl.zeros([D, M], gl.float32, MMA)
    zero_s = gl.zeros([BN, M], gl.float32, MMA)
    blk_next = _chunk_block(bt_row, blk_lo, RING - 1, n_it, NCH)
    for it in range(n_it):
        r = it % RING
        async_copy.wait_group(RING - 2)  # this thread's copies of chunk it landed
        gl.thread_barrier()  # and every thread's; slot it - 1 read by all
        slot = gl.max(slot_raw.index(r).load(COPIES[2]), axis=0)
        pool = (POOL_K, POOL_V, KV, _chunk_block(bt_row, blk_lo, it, n_it, NCH))
        start = (blk_lo + it // NCH) * G  # the chunk's tile's first key
        if slot >= 0:
            k = _pool_k(pool, slot, it % NCH, start, kv_len, h, GEO, A_OP)
        else:
            k = _record_k(ring, r, A_OP, KW)
        s_tok = warpgroup_mma(k, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # under the scores' MMA: V's operand, the next copies, the masks' positions
        if slot >= 0:
            v = _pool_v(pool, slot, it % NCH, start, kv_len, h, GEO, A_OP)
        else:
            v = _record_v(ring, r, A_OP, VW)
        j = it + RING - 1
        _ring_issue(
            ring, j % RING, KV, BLOCK_TO_SLOT, blk_next, j, n_it, h, HK, STRIDE, NCH, LOADS, COPIES
        )
        blk_next = _chunk_block(bt_row, blk_lo, j + 1, n_it, NCH)
        async_copy.commit_group()
        t0 = start + (it % NCH) * BN
        s = warpgroup_mma_wait(0, deps=[s_tok])
        if t0 + BN - 1 > pos_lo:  # some row must not see some key of the chunk
            t_pos = t0 + key_row
            keep = (t_pos[:, None] <= q_pos[None, :]) & (t_pos < kv_len)[:, None]
            s = gl.where(keep, s, float("-inf"))
        if LAZY:
            # the columns' reference maxima move only when a score would pass them by more
            # than LAZY_HEADROOM (and on the split's first chunk, which sets them): no
            # cross-warp maximum, no rescale and no cross-warp sum on the other chunks
            z = s * col_scale[None, :] - m_i[None, :]
            top = gl.max(gl.reshape(z, [BN * M]), axis=0)
            if (it == 0) | (top > LAZY_HEADROOM):
                m_new = gl.maximum(m_i, gl.max(s, axis=0) * col_scale)
                # a column without a key on the split's first chunk has none on its others
                # (they lie further past its position)
                m_new = gl.where(m_new == float("-inf"), float("inf"), m_new)
                alpha = gl.where(m_i == m_new, 1.0, gl.exp2(m_i - m_new))
                acc = acc * alpha[None, :]
                l_part = l_part * gl.convert_layout(alpha, PART_COLS)[None, None, :]
                z = s * col_scale[None, :] - m_new[None, :]
                m_i = m_new
            p = gl.exp2(z)
            l_part = l_part + gl.sum(gl.reshape(p, [4, 2, 8, M]), axis=1)
        else:
            # col_scale > 0: a column's maximum is col_scale times the raw one
            m_new = gl.maximum(m_i, gl.max(s, axis=0) * col_scale)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s * col_scale[None, :] - m_use[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            acc = acc * alpha[None, :]
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(v, p_smem, acc)
    async_copy.wait_group(0)
    if LAZY:
        l_i = gl.convert_layout(gl.sum(gl.sum(l_part, axis=0), axis=0), COLS)

    # the split's partials: O = 2 acc / l (k and v halved), the base-2 LSE
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    o = acc * (2.0 / l_safe)[None, :]
    out_rows, out_ok = _row_ids(m_col, first, q_end, h, HQ, QPK, QPK_P)
    out_row = split.to(gl.int64) * n_rows_total + out_rows
    od = _v_channel(gl.arange(0, D, layout=gl.SliceLayout(1, MMA)))
    gl.store(O_PART + out_row[None, :] * D + od[:, None], o, mask=out_ok[None, :])
    gl.store(LSE_PART + out_row, lse, mask=out_ok)
