# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels and their @triton.jit helpers are untyped by nature; the public
# wrappers in this module are fully annotated.)
"""Fused attention over packed KVarN records and the fp16 side pool: decode and prefill.

One kernel serves both ops. A program owns a tile of query rows of one KV head (all the GQA
query heads of that head, times ``BQ`` query tokens, padded to at least 16 rows for
``tl.dot``) and one split of the request's blocks, and streams the blocks through the block
table, ``BN`` tokens at a time:

* a packed record is never dequantized to full values. The per-channel K scale is folded into
  the query and the per-token V scale into the probabilities, so the inner products run on the
  raw integer codes (``score[t] = k_tok[t] * (sum_d q[d] k_scale[d] code[d, t] + sum_d q[d]
  k_zero[d])`` and ``out[d] = v_chan[d] * (sum_t p[t] v_scale[t] code[t, d] + sum_t p[t]
  v_zero[t])``). Codes become fp16 by OR-ing them into the mantissa of 1024.0 (``0x6400``);
  the constant 1024 is subtracted once per row afterwards, outside the token loop;
* a block whose ``block_to_slot`` entry is a pool slot (the sink, the in-progress tile, a
  prefill chunk not yet flushed) is read from the fp16 pool instead. The record bytes of the
  next chunk are loaded one chunk ahead unconditionally (software prefetch), and a pool block
  overrides the record result with a branch; its record bytes are unused (they are random,
  or, with shadow rows, the tile's first ``SHADOW`` fp16 rows followed by random bytes: the
  branch replaces the scores and values computed from them, never scales them by zero, so a
  NaN among them cannot reach the result). With ``SHADOW > 0`` the pool holds ``G -
  SHADOW`` rows per slot and a tile's first rows are read from its block's record area
  (``_common.pool_row_ptrs``, :func:`kvarn_format.geometry.shadow_rows`);
* online softmax in base 2; split-K partials ``(acc / l, lse)`` go to an fp32 workspace and a
  second kernel merges the splits, un-rotates (``out @ H``, two fp16 MMAs on a hi/lo split of
  the fp32 result against the exact sign matrix) and casts to the query dtype.

Nothing depends on ``seq_lens`` values on the host: grids and split counts come from shapes
(batch, heads, ``block_table.shape[1]``), so both ops can be captured in a CUDA graph when the
caller passes a preallocated workspace.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from triton.language.extra.cuda import gdc_wait  # type: ignore[import-untyped]

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_format.cache_order import CodeOrder
from kvarn_format.registry import DENSE_DTYPES, KVarNFormat
from kvarn_kernels._common import (
    ACT_DTYPES,
    SLICED_POINTERS,
    DenseGeometry,
    cdiv,
    check_device,
    check_dtype,
    check_head_dim,
    check_index_tensor,
    check_ndim,
    code_offsets,
    code_offsets_of_pair,
    debug_checks_enabled,
    dense_geometry,
    next_pow2,
    pool_row_ptrs,
    pool_shadow_rows,
    resolve_format,
    triton_interpret,
)
from kvarn_kernels._launch import PreparedLaunch, launch, pdl_supported
from kvarn_kernels.rotation import _check_pool, query_rotation, sign_matrix

if TYPE_CHECKING:
    from kvarn_kernels.context import ContextPlan, VarlenAttention
    from kvarn_kernels.decode_batch import DecodeBatchPlan, VerifyBatchPlan
    from kvarn_kernels.fused_prefill import FusedPrefillPlan

__all__ = [
    "DECODE_VARIANTS",
    "DecodePlan",
    "choose_decode_splits",
    "decode_attention",
    "decode_partials",
    "decode_plan",
    "decode_workspace_numel",
    "max_verify_partials",
    "prefill_attention",
    "prefill_method",
    "verify_plan",
]

#: The decode kernels ``decode_attention(variant=...)`` takes besides ``"auto"``.
DECODE_VARIANTS = (
    "v1", "v4", "v4b", "v4c", "v4d", "v5", "v5f", "v6", "v6f", "v6t", "v7", "v7f"
)  # fmt: skip
#: The variants that run :mod:`kvarn_kernels.decode_v4` (4-bit keys, 2/4-bit values).
V4_VARIANTS = ("v4", "v4b", "v4c", "v4d")
#: The Gluon variants with v5's copies, split counts and pool-phase launch:
#: :mod:`kvarn_kernels.decode_v5` (``"v5f"``: its folded scales) and
#: :mod:`kvarn_kernels.decode_v6` (``"v6"``: tokens in the MMA's M; ``"v6f"``: folded;
#: ``"v6t"``: v6f with every copy by the tensor memory accelerator, one warp, two stages) and
#: :mod:`kvarn_kernels.decode_v7` (``"v7"``: v6 on 5-bit codes in the byte-plane order;
#: ``"v7f"``: folded).
V5_VARIANTS = ("v5", "v5f", "v6", "v6f", "v6t", "v7", "v7f")
#: The variants with v6's transposed tiles (up to ``V6_MAX_QPK`` query heads per KV head).
V6_VARIANTS = ("v6", "v6f", "v6t", "v7", "v7f")
#: The variants that read 5-bit codes (``kvarn_k5v5_g64``) from the byte planes.
FIVE_BIT_VARIANTS = ("v7", "v7f")
#: The variants written in Gluon, which Triton's interpreter cannot run (GPU only).
GPU_ONLY_DECODE_VARIANTS = V5_VARIANTS
#: The variants whose pool phase runs in a launch of its own (a partial more to merge).
POOL_SPLIT_VARIANTS = ("v4d", *V5_VARIANTS)
#: Variants whose kernel and merge are launched as programmatic dependents where the GPU
#: takes them (:func:`kvarn_kernels._launch.pdl_supported`): each is dispatched while the
#: kernel before it drains and waits only before what that one wrote.
PDL_VARIANTS = ("v6", "v6f", "v6t", "prefill_v3", "prefill_v4")


#: The query rows per program ``decode_attention(mma_rows=...)`` takes (v4 variants).
MMA_ROWS = (4, 8, 16)


def check_mma_rows(mma_rows: int, num_q_heads: int, num_kv_heads: int) -> None:
    """Raise ``ValueError`` unless ``mma_rows`` is one of :data:`MMA_ROWS` that holds the GQA
    group (at least its power of two)."""
    gqa = next_pow2(num_q_heads // num_kv_heads)
    if mma_rows not in MMA_ROWS or mma_rows < gqa:
        raise ValueError(
            f"mma_rows must be a power of two from {max(4, gqa)} to 16 (4 or more, and at "
            f"least the GQA ratio's power of two, {gqa}), got {mma_rows}"
        )


def decode_partials(variant: str, num_splits: int) -> int:
    """Partial outputs a decode launch of ``variant`` with ``num_splits`` splits writes and
    merges (what to pass :func:`decode_workspace_numel` for a preallocated workspace)."""
    return num_splits + (variant in POOL_SPLIT_VARIANTS)


_LOG2E = 1.4426950408889634
_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)


# ---------------------------------------------------------------------------------------------
# record access


@triton.jit
def _load_codes(
    section,
    row0,
    R: tl.constexpr,
    ROWS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    byte0,
    N: tl.constexpr,
    BITS: tl.constexpr,
    ORDER: tl.constexpr,
    valid,
):
    """Raw bytes of ``N`` codes starting at byte ``byte0`` of rows ``row0 .. row0 + R - 1`` of
    a code section of ``ROWS`` rows of ``ROW_BYTES`` bytes, in the section's in-cache order
    ``ORDER`` (:func:`code_offsets`; ``row0`` even for order 2), as two tensors.

    2/4 bits: the packed bytes ``[R, N*BITS/8]`` (16-byte loads) and an unused dummy.
    5 bits: eight codes span five bytes (group ``g``: bytes ``5g .. 5g + 4``, low bits
    first), returned as ``[R, N/8]`` uint32 words of each group's bits 0-31 and 32-39. In
    the byte planes (orders 3 and 4) that is one byte load per plane; in the official order
    (0), rows and sections start on 4-byte boundaries (records are 8-byte aligned, rows a
    multiple of 40 bytes), so a group lies in the two aligned words around its first byte,
    both inside the row: two 32-bit loads and a funnel shift per group, where one load per
    byte took five (and the planes' registers spilled: docs/kernel-notes.md, sixteenth
    session).
    """
    r = tl.arange(0, R)
    if BITS == 5 and ORDER != 0:
        # the byte planes (orders 3 and 4): the group's five bytes from five planes
        grp = byte0 // 5 + tl.arange(0, N // 8)
        off = code_offsets((row0 + r)[:, None], 5 * grp[None, :], ROWS, ROW_BYTES, ORDER)
        p0 = tl.load(section + off, mask=valid, other=0).to(tl.uint32)
        for b in tl.static_range(1, 4):
            byte = tl.load(section + off + b * (ROW_BYTES // 5) * ROWS, mask=valid, other=0)
            p0 = p0 | (byte.to(tl.uint32) << (8 * b))
        p1 = tl.load(section + off + 4 * (ROW_BYTES // 5) * ROWS, mask=valid, other=0)
        p1 = p1.to(tl.uint32)
    elif BITS == 5:
        tl.static_assert(ROW_BYTES % 4 == 0, "5-bit rows are whole 32-bit words")
        first = byte0 + tl.arange(0, N // 8) * 5
        word = (section + (row0 + r)[:, None] * ROW_BYTES + (first - first % 4)[None, :]).to(
            tl.pointer_type(tl.uint32)
        )
        w0 = tl.load(word, mask=valid, other=0).to(tl.uint64)
        w1 = tl.load(word + 1, mask=valid, other=0).to(tl.uint64)
        bits = ((w1 << 32) | w0) >> (8 * (first % 4)).to(tl.uint64)[None, :]
        p0 = bits.to(tl.uint32)
        p1 = (bits >> 32).to(tl.uint32)
    else:
        NB: tl.constexpr = N * BITS // 8
        j = tl.arange(0, NB)
        if ORDER == 2:
            # even and odd rows lie in two column-major halves: load each by row pair (which
            # Triton sees as contiguous) and interleave them back in registers
            pr = row0 // 2 + tl.arange(0, R // 2)
            ev = tl.load(
                section
                + code_offsets_of_pair(pr[:, None], 0, byte0 + j[None, :], ROWS, ROW_BYTES, 2),
                mask=valid,
                other=0,
            )
            od = tl.load(
                section
                + code_offsets_of_pair(pr[:, None], 1, byte0 + j[None, :], ROWS, ROW_BYTES, 2),
                mask=valid,
                other=0,
            )
            p0 = tl.reshape(tl.permute(tl.join(ev, od), (0, 2, 1)), [R, NB])
        else:
            off = code_offsets((row0 + r)[:, None], byte0 + j[None, :], ROWS, ROW_BYTES, ORDER)
            p0 = tl.load(section + off, mask=valid, other=0)
        p1 = tl.zeros([1, 1], dtype=tl.uint8)
    return p0, p1


# PTX for the GPU fast path: four packed code bytes in, their codes out as fp16 pairs holding
# 1024 + code (the code OR-ed into the mantissa of 1024.0, 0x6400). prmt spreads bytes 0,1 and
# 2,3 into the low bytes of the two halves; lop3 computes (x & mask) | 0x64006400.
_UNPACK4_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xEA;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, t1, 0x000F000F, 0x64006400, 0xEA;
}
""")
_UNPACK2_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 t0, t1, u0, u1;
prmt.b32 t0, $8, 0, 0x4140;
prmt.b32 t1, $8, 0, 0x4342;
lop3.b32 $0, t0, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $1, t1, 0x00030003, 0x64006400, 0xEA;
shr.b32 u0, t0, 2;
shr.b32 u1, t1, 2;
lop3.b32 $2, u0, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $3, u1, 0x00030003, 0x64006400, 0xEA;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 $4, u0, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $5, u1, 0x00030003, 0x64006400, 0xEA;
shr.b32 u0, t0, 6;
shr.b32 u1, t1, 6;
lop3.b32 $6, u0, 0x00030003, 0x64006400, 0xEA;
lop3.b32 $7, u1, 0x00030003, 0x64006400, 0xEA;
}
""")


@triton.jit
def _codes_f16(b0, b1, N: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr):
    """Unpack to ``[R, N]`` fp16 holding ``1024 + code`` (exact: the code sits in the mantissa).

    ``FAST`` (GPU only) unpacks four bytes per PTX block, about one instruction per code.
    """
    if FAST and BITS == 4:
        lo, hi = tl.inline_asm_elementwise(
            _UNPACK4_ASM,
            "=r,=r,=r,=r,r",
            [b0],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
        f = tl.interleave(lo, hi)
    elif FAST and BITS == 2:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _UNPACK2_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [b0],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
        f = tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))
    else:
        if BITS == 4:
            c = tl.interleave(b0 & 15, b0 >> 4)
        elif BITS == 2:
            c = tl.interleave(
                tl.interleave(b0 & 3, (b0 >> 4) & 3), tl.interleave((b0 >> 2) & 3, b0 >> 6)
            )
        else:  # b0, b1: each group's bits 0-31 and 32-39 (_load_codes)
            c0 = b0 & 31
            c1 = (b0 >> 5) & 31
            c2 = (b0 >> 10) & 31
            c3 = (b0 >> 15) & 31
            c4 = (b0 >> 20) & 31
            c5 = (b0 >> 25) & 31
            c6 = ((b0 >> 30) | (b1 << 2)) & 31
            c7 = (b1 >> 3) & 31
            c = tl.interleave(
                tl.interleave(tl.interleave(c0, c4), tl.interleave(c2, c6)),
                tl.interleave(tl.interleave(c1, c5), tl.interleave(c3, c7)),
            )
        f = (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    return f


@triton.jit
def _load_f16(ptr, valid):
    return tl.load(ptr, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _load_chunk(
    rec,
    c,
    valid,
    D: tl.constexpr,
    G: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
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
):
    """Everything chunk ``c`` (tokens ``c*BN ..``) of record ``rec`` contributes."""
    dd = tl.arange(0, D)
    tt = c * BN + tl.arange(0, BN)
    k0, k1 = _load_codes(
        rec + OFF_KC, 0, D, D, G * KB // 8, c * (BN * KB // 8), BN, KB, K_ORDER, valid
    )
    v0, v1 = _load_codes(rec + OFF_VC, c * BN, BN, G, D * VB // 8, 0, D, VB, V_ORDER, valid)
    ks = _load_f16((rec + OFF_KS).to(tl.pointer_type(tl.float16)) + dd, valid)
    kz = _load_f16((rec + OFF_KZ).to(tl.pointer_type(tl.float16)) + dd, valid)
    kt = _load_f16((rec + OFF_KT).to(tl.pointer_type(tl.float16)) + tt, valid)
    vcs = _load_f16((rec + OFF_VCS).to(tl.pointer_type(tl.float16)) + dd, valid)
    vs = _load_f16((rec + OFF_VS).to(tl.pointer_type(tl.float16)) + tt, valid)
    vz = _load_f16((rec + OFF_VZ).to(tl.pointer_type(tl.float16)) + tt, valid)
    return k0, k1, v0, v1, ks, kz, kt, vcs, vs, vz


@triton.jit
def _split_blocks(n_blocks, split, NUM_SPLITS: tl.constexpr):
    """Blocks ``[lo, hi)`` of split ``split`` (split-K over a request's blocks; may be empty)."""
    if NUM_SPLITS > 1:
        per = tl.cdiv(n_blocks, NUM_SPLITS)
        lo = split * per
        hi = tl.minimum(lo + per, n_blocks)
    else:
        lo = 0
        hi = n_blocks
    return lo, hi


@triton.jit
def _norm(x):
    """max |x| as a positive scale (1 for an all-zero vector)."""
    m = tl.max(tl.abs(x), axis=0)
    return tl.where(m > 0, m, 1.0)


# ---------------------------------------------------------------------------------------------
# the attention kernel


@triton.jit
def _prefill_tile(QSL, num_reqs, pid, BQ: tl.constexpr, B_P: tl.constexpr):
    """The request ``b`` of prefill tile ``pid`` (``BQ`` query tokens), its query rows
    ``q_begin .. q_end - 1`` and the tile's first token ``first`` (the tile is empty when
    ``first >= q_end``). Tiles of request ``r`` start at ``qsl[r] // BQ + r``, an upper bound
    of the tiles before it, so the grid needs only ``cdiv(T, BQ) + B`` programs."""
    ridx = tl.arange(0, B_P)
    qsl_v = tl.load(QSL + ridx, mask=ridx < num_reqs, other=0)
    starts = qsl_v // BQ + ridx
    b = tl.sum(((starts <= pid) & (ridx < num_reqs)).to(tl.int32), axis=0) - 1
    q_begin = tl.load(QSL + b)
    q_end = tl.load(QSL + b + 1)
    first = q_begin + (pid - (q_begin // BQ + b)) * BQ
    return b, q_begin, q_end, first


#: The fewest request slots (``B_P``, a compile-time constant) a prefill tile searches for its
#: request: a batch of ``B`` requests takes ``next_pow2(B + 1)`` slots, at least this many, so
#: that batches of up to 127 requests share one compile. The slots are spread one a thread
#: over the program's warps (4 or more), so 128 slots cost only a cross-warp reduction once
#: a program: 8 SASS instructions and 2 barriers more than 2 slots in the warp-specialized
#: v3 (the loads past the batch are predicated off).
MIN_REQUEST_SLOTS = 128


def request_slots(num_reqs: int) -> int:
    """The prefill kernels' ``B_P`` for a batch of ``num_reqs`` requests."""
    return max(next_pow2(num_reqs + 1), MIN_REQUEST_SLOTS)


#: Integer arguments of the v1 kernel that follow the batch in a way the warm-up's batches
#: of 1 and 16 requests do not cover. Triton specializes an int argument on being 1 and on
#: being a multiple of 16, so the request count selected a third compile at 2-15, 17-31, ...
#: requests while serving (the twelfth session's kvarn_k5v5_g64 engine compiled v1 in its
#: timed run). The row count ``n_rows_total`` (requests x query heads) stays specialized: its
#: classes at 1 and 16 requests are the ones every batch size falls in, as for v4.
BATCH_INTS = ("num_reqs",)


@triton.jit(do_not_specialize=BATCH_INTS, do_not_specialize_on_alignment=SLICED_POINTERS)
def _attn_kernel(
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
    max_blocks,
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
    DECODE: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    m = tl.arange(0, BLOCK_M)
    mi = m // QPK_P  # query token of the row within the tile
    mj = m % QPK_P  # query head of the row within the KV head's group
    if DECODE:
        b = pid
        seq_len = tl.load(SEQ_LENS + b)
        tok = b + mi * 0
        row_ok = (mi < 1) & (mj < QPK)
        q_pos = seq_len - 1 + mi * 0
        kv_len = seq_len
    else:
        b, q_begin, q_end, first = _prefill_tile(QSL, num_reqs, pid, BQ, B_P)
        if first >= q_end:
            return
        seq_len = tl.load(SEQ_LENS + b)
        tok = first + mi
        row_ok = (mi < BQ) & (mj < QPK) & (tok < q_end)
        q_pos = seq_len - (q_end - q_begin) + (tok - q_begin)
        kv_len = seq_len - (q_end - q_begin) + tl.minimum(first + BQ, q_end) - q_begin

    dd = tl.arange(0, D)
    rows = tok.to(tl.int64) * HQ + h * QPK + mj
    q = tl.load(Q + rows[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    q = q * qk_scale
    # Per-row normalization keeps the fp16 MMA operands within [-1, 1] for any query scale.
    qmax = tl.max(tl.abs(q), axis=1)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    qn = q / qmax[:, None]
    qn16 = qn.to(tl.float16)

    n_blocks = tl.cdiv(kv_len, G)
    blk_lo, blk_hi = _split_blocks(n_blocks, split, NUM_SPLITS)
    NCH: tl.constexpr = G // BN
    n_it = tl.maximum(blk_hi - blk_lo, 0) * NCH

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    tn = tl.arange(0, BN)

    if PREFETCH:
        # Prefetch chunk 0.
        ok = n_it > 0
        blk = tl.load(bt_row + blk_lo, mask=ok & (blk_lo < max_blocks), other=0).to(tl.int64)
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
        if PREFETCH:
            c_k0 = k0
            c_k1 = k1
            c_v0 = v0
            c_v1 = v1
            c_ks = ks
            c_kz = kz
            c_kt = kt
            c_vcs = vcs
            c_vs = vs
            c_vz = vz
            c_slot = slot
            c_blk = blk

            # Issue the next chunk's loads before computing this one.
            nit = it + 1
            n_ok = nit < n_it
            n_bi = blk_lo + nit // NCH
            n_c = nit % NCH
            blk = tl.load(bt_row + n_bi, mask=n_ok & (n_bi < max_blocks), other=0).to(tl.int64)
            slot = tl.load(BLOCK_TO_SLOT + blk, mask=n_ok, other=0)
            (k0, k1, v0, v1, ks, kz, kt, vcs, vs, vz) = _load_chunk(
                KV + (blk * HK + h) * STRIDE,
                n_c,
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

        else:
            c_blk = tl.load(bt_row + bi).to(tl.int64)
            c_slot = tl.load(BLOCK_TO_SLOT + c_blk)
            (
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
            ) = _load_chunk(
                KV + (c_blk * HK + h) * STRIDE,
                c,
                it < n_it,
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

        tpos = bi * G + c * BN + tn
        # --- scores from the record: fold k_scale into q, run the MMA on raw codes ---
        ksn = _norm(c_ks)
        qk16 = (qn * (c_ks / ksn)[None, :]).to(tl.float16)
        # zero-point term minus the 1024 offset of the codes, in one reduction
        zt = tl.sum(qn * c_kz[None, :] - (1024.0 * ksn) * qk16.to(tl.float32), axis=1)
        kcodes = _codes_f16(c_k0, c_k1, BN, KB, FAST_UNPACK)  # [D, BN]
        raw = tl.dot(qk16, kcodes)
        s = (raw * ksn + zt[:, None]) * (c_kt[None, :] * qmax[:, None])
        if c_slot >= 0:
            # fp16 pool block (sink, in-progress tile, unflushed prefill chunk). Rows past
            # kv_len are masked: pool rows hold NaN poison or stale tokens, and the record area
            # past a shadowed tile's written rows holds random bytes.
            if SHADOW == 0:
                # pool_row_ptrs' SHADOW == 0 address as integer offsets, the code that was
                # timed (the pointer form compiles to different SASS)
                prow = ((c_slot.to(tl.int64) * G + c * BN + tn) * HK + h) * D
                kp_ptr = POOL_K + prow[None, :] + dd[:, None]
            else:
                ps = c_slot.to(tl.int64)
                krow = pool_row_ptrs(
                    POOL_K, KV, ps, c_blk, c * BN + tn, h, 0, HK, D, G, SHADOW, STRIDE
                )
                kp_ptr = krow[None, :] + dd[:, None]
            kmask = tpos < kv_len
            kp = tl.load(kp_ptr, mask=kmask[None, :], other=0.0)
            s = tl.dot(qn16, kp) * qmax[:, None]
        keep = (tpos[None, :] <= q_pos[:, None]) & (tpos[None, :] < kv_len)
        s = tl.where(keep, s, float("-inf"))

        # --- online softmax (base 2) ---
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # --- values from the record: fold v_scale into p, MMA on raw codes ---
        vsn = _norm(c_vs)
        pw16 = (p * (c_vs / vsn)[None, :]).to(tl.float16)
        zs = tl.sum(p * c_vz[None, :] - (1024.0 * vsn) * pw16.to(tl.float32), axis=1)
        vcodes = _codes_f16(c_v0, c_v1, D, VB, FAST_UNPACK)  # [BN, D]
        rawv = tl.dot(pw16, vcodes)
        pv = (rawv * vsn + zs[:, None]) * c_vcs[None, :]
        if c_slot >= 0:
            if SHADOW == 0:
                prow = ((c_slot.to(tl.int64) * G + c * BN + tn) * HK + h) * D
                vp_ptr = POOL_V + prow[:, None] + dd[None, :]
            else:
                ps = c_slot.to(tl.int64)
                vrow = pool_row_ptrs(
                    POOL_V, KV, ps, c_blk, c * BN + tn, h, 1, HK, D, G, SHADOW, STRIDE
                )
                vp_ptr = vrow[:, None] + dd[None, :]
            vmask = tpos < kv_len
            vp = tl.load(vp_ptr, mask=vmask[:, None], other=0.0)
            pv = tl.dot(p.to(tl.float16), vp)
        acc = acc * alpha[:, None] + pv

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    prow_out = split.to(tl.int64) * n_rows_total + rows
    tl.store(O_PART + prow_out[:, None] * D + dd[None, :], o, mask=row_ok[:, None])
    tl.store(LSE_PART + prow_out, lse, mask=row_ok)


#: Splits whose partial loads the unrolled merge issues together.
MERGE_CHUNK: tl.constexpr = tl.constexpr(16)


@triton.jit
def _merge_unrotate_kernel(
    O_PART,
    LSE_PART,
    OUT,
    S_MAT,
    TOKENS,
    n_rows,
    inv_sqrt_d,
    NUM_SPLITS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge split partials by log-sum-exp, un-rotate (``@ H``) and cast to the output dtype.

    ``PDL``: launched as a programmatic dependent of the kernel that wrote the partials
    (:func:`kvarn_kernels._launch.launch`), so it waits for that one before anything else.

    ``UNROLL`` (0, or the power of two at or above ``NUM_SPLITS``; see
    :data:`MERGE_UNROLL_MAX_SPLITS`): the split loop unrolled :data:`MERGE_CHUNK` splits at a
    time, so a chunk's partial loads are in flight together rather than one loop trip's at a
    time (the chunks bound the registers the loads hold).

    ``ROWS_PER_TOKEN > 0`` (verify): only the first ``TOKENS[0] * ROWS_PER_TOKEN`` rows hold
    partials (``TOKENS`` is ``query_start_loc[B]`` on the device); the rows of a padded batch's
    tail tokens, which no program visited, are written as zeros."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    visited = rmask
    if ROWS_PER_TOKEN > 0:
        visited = rmask & (rows < tl.load(TOKENS) * ROWS_PER_TOKEN)
    rows64 = rows.to(tl.int64)
    dd = tl.arange(0, D)
    if UNROLL > 0:
        # online over chunks of MERGE_CHUNK partials: every per-row vector is a load's or a
        # reduction of the partials' own layout, so no weight changes layout (a two-pass form
        # with the maximum taken over a [rows, splits] tile converted each partial's weight
        # through shared memory: two barriers a partial)
        mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        wsum = tl.zeros([BLOCK_R], dtype=tl.float32)
        o = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        for c0 in range(0, NUM_SPLITS, MERGE_CHUNK):
            m_new = mx
            for jj in tl.static_range(MERGE_CHUNK):
                ok = rmask & (c0 + jj < NUM_SPLITS)
                lse = tl.load(LSE_PART + (c0 + jj) * n_rows + rows64, mask=ok, other=float("-inf"))
                m_new = tl.maximum(m_new, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(mx - m_use)
            o = o * alpha[:, None]
            wsum = wsum * alpha
            for jj in tl.static_range(MERGE_CHUNK):
                j = c0 + jj
                ok = rmask & (j < NUM_SPLITS)
                lse = tl.load(LSE_PART + j * n_rows + rows64, mask=ok, other=float("-inf"))
                part = tl.load(
                    O_PART + (j * n_rows + rows64)[:, None] * D + dd[None, :],
                    mask=ok[:, None],
                    other=0.0,
                )
                w = tl.exp2(lse - m_use)
                o += w[:, None] * part
                wsum += w
            mx = m_new
        o = o / tl.where(wsum > 0, wsum, 1.0)[:, None]
    elif NUM_SPLITS > 1:
        mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for sp in range(NUM_SPLITS):
            lse = tl.load(LSE_PART + sp * n_rows + rows64, mask=rmask, other=float("-inf"))
            mx = tl.maximum(mx, lse)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        o = tl.zeros([BLOCK_R, D], dtype=tl.float32)
        wsum = tl.zeros([BLOCK_R], dtype=tl.float32)
        for sp in range(NUM_SPLITS):
            lse = tl.load(LSE_PART + sp * n_rows + rows64, mask=rmask, other=float("-inf"))
            w = tl.exp2(lse - mx)
            part = tl.load(
                O_PART + (sp * n_rows + rows64)[:, None] * D + dd[None, :],
                mask=rmask[:, None],
                other=0.0,
            )
            o += w[:, None] * part
            wsum += w
        o = o / tl.where(wsum > 0, wsum, 1.0)[:, None]
    else:
        o = tl.load(O_PART + rows64[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
    # (where, not a product: unvisited partials are uninitialized and may be NaN)
    o = tl.where(visited[:, None], o, 0.0)
    # fp32 result as hi + lo fp16 parts: two MMAs against the exact +-1 matrix keep ~22 bits.
    hi32 = tl.minimum(tl.maximum(o, -_FP16_MAX), _FP16_MAX)
    hi = hi32.to(tl.float16)
    lo = (o - hi.to(tl.float32)).to(tl.float16)
    cols = tl.arange(0, BLOCK_N)
    for n0 in tl.static_range(0, D, BLOCK_N):
        smat = tl.load(S_MAT + dd[:, None] * D + (n0 + cols)[None, :])
        y = tl.dot(hi, smat)
        y = tl.dot(lo, smat, y)
        y = y * inv_sqrt_d
        ptrs = OUT + rows64[:, None] * D + (n0 + cols)[None, :]
        if OUT_BF16:
            tl.store(ptrs, y.to(tl.bfloat16), mask=rmask[:, None])
        else:
            y = tl.minimum(tl.maximum(y, -_FP16_MAX), _FP16_MAX)
            tl.store(ptrs, y.to(tl.float16), mask=rmask[:, None])


# ---------------------------------------------------------------------------------------------
# launch helpers

#: Why the fused attention kernel (v1; decode, verify rows and ``method="fused"`` prefill)
#: refuses ``prefetch=False`` at head dim 512 on a GPU. The H200 compile of that branch gives
#: wrong results (8 warps or 4, PTX or plain unpack); the default register-prefetch branch is
#: right in the same configurations, as is Triton's interpreter in every one. The environment
#: variable lets the GPU test that shows the fault run the branch anyway.
HEAD_DIM_512_GPU_MESSAGE = (
    "prefetch=False is disabled at head_dim 512 on CUDA GPUs: that branch of the fused "
    "attention kernel gave wrong results on an H200 (relative error 1.2e3; the default "
    "prefetch=True is right there, tests test_head_dim_512_on_gpu, 2026-11-30). Use the "
    "default prefetch=True"
)
UNSAFE_HEAD_DIM_512_ENV = "KVARN_KERNELS_UNSAFE_HEAD_DIM_512"


def _fused_kernel_refuses(head_dim: int, device_type: str, variant: str, prefetch: bool) -> bool:
    """Whether the v1 kernel must refuse this call (:data:`HEAD_DIM_512_GPU_MESSAGE`)."""
    return (
        head_dim > 256
        and not prefetch
        and device_type == "cuda"
        and variant not in V4_VARIANTS
        and os.environ.get(UNSAFE_HEAD_DIM_512_ENV) != "1"
    )


@cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8


def _chunk_tokens(d: int, g: int) -> int:
    """Tokens per inner step: the whole tile while ``D * BN <= 128 * 64``."""
    return max(16, min(g, (128 * 64) // d))


def choose_decode_splits(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    device: torch.device,
    *,
    programs_per_sm: int = 4,
) -> int:
    """Split count from static shapes only (CUDA-graph safe): enough programs to fill the GPU.

    Aims at about ``programs_per_sm`` programs per SM, and at least 4 blocks per split,
    rounded down to a power of two. The split count is a compile-time constant of the decode
    and merge kernels, so every distinct value is a separate Triton compile (seconds each).
    A serving engine decodes every batch size from 1 to ``max_num_seqs`` (mixed
    prefill/decode batches run eagerly at any size): unrounded, that is ~15 values, most
    first seen while serving; the powers of two (at most 7) are all met by vLLM's CUDA-graph
    capture sizes at start-up.
    """
    return decode_splits_for_sms(
        batch, num_kv_heads, max_blocks, _num_sms(device), programs_per_sm=programs_per_sm
    )


def decode_splits_for_sms(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    num_sms: int,
    *,
    programs_per_sm: int = 4,
    blocks_per_split: int = 4,
) -> int:
    """:func:`choose_decode_splits`'s rule for a GPU of ``num_sms`` SMs, without a device
    (``blocks_per_split``: the fewest blocks a split is planned for).

    Non-decreasing in ``num_sms`` and in ``programs_per_sm``, non-increasing in
    ``blocks_per_split``: its value at an SM count bounds every GPU with fewer (what a
    process that must not initialize CUDA, vLLM's engine, sizes workspaces with)."""
    if programs_per_sm < 1:
        raise ValueError(f"programs_per_sm must be >= 1, got {programs_per_sm}")
    if blocks_per_split < 1:
        raise ValueError(f"blocks_per_split must be >= 1, got {blocks_per_split}")
    progs = max(1, batch * num_kv_heads)
    want = cdiv(programs_per_sm * num_sms, progs)
    cap = max(1, cdiv(max_blocks, blocks_per_split))
    splits = int(max(1, min(want, cap, 64)))
    return 1 << (splits.bit_length() - 1)


def choose_verify_splits(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_blocks: int,
    device: torch.device,
) -> int:
    """:func:`verify_attention`'s split count for ``batch`` requests: decode's rule
    (:func:`choose_decode_splits`) for its ``batch * verify_token_groups(...)`` programs per
    KV head (static shapes only; the warm-up compiles every value it can return)."""
    groups = verify_token_groups(num_q_heads, num_kv_heads, max_query_len)
    return choose_decode_splits(batch * groups, num_kv_heads, max_blocks, device)


def verify_plan(
    fmt: KVarNFormat | str,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_blocks: int,
    device: torch.device,
    *,
    variant: str = "auto",
) -> DecodePlan:
    """The kernel and split count :func:`verify_attention` runs for ``batch`` requests of up to
    ``max_query_len`` query tokens over block tables ``max_blocks`` wide on ``device``, with
    the same ``variant`` and no ``num_splits`` (static shapes only, so CUDA-graph safe).

    ``"auto"``: one pass per request (v4c) at :func:`choose_verify_splits`'s count where v4
    reads the codes; v7f where ``"auto"`` decodes on it (5-bit codes on sm_90): one decode
    row per query token, up to 8 // GQA of a request's tokens side by side in a program's
    query columns, at v7f's decode split count for as many rows as programs (v1 read the
    context 5x slower there: docs/kernel-notes.md, thirty-seventh session); else one v1 row
    per query token at :func:`choose_verify_splits`'s count. A preallocated workspace needs
    ``decode_workspace_numel(batch * max_query_len, num_q_heads, head_dim, plan.partials)``
    elements. Raises ``ValueError`` where :func:`verify_attention` would."""
    dense = resolve_format(fmt)
    check_head_dim(head_dim)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    geo = dense_geometry(dense, head_dim, record_layout(dense, head_dim).tile_bytes)
    chosen = _resolve_verify_variant(geo, variant, num_q_heads // num_kv_heads, device)
    splits = _verify_splits(
        chosen, geo, batch, num_q_heads, num_kv_heads, max_query_len, max_blocks, device
    )
    return DecodePlan(chosen, splits)


def max_verify_partials(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_blocks: int,
    *,
    max_sms: int,
) -> int:
    """The most partial outputs :func:`verify_plan` (``"auto"``) can plan for ``batch``
    requests of ``max_query_len`` tokens on a GPU of up to ``max_sms`` SMs, any format, from
    shapes only: a bound for a workspace sized before the GPU is known (for
    ``batch * max_query_len`` rows)."""
    from kvarn_kernels.decode_v7 import V7_MAX_QPK

    qpk = num_q_heads // num_kv_heads
    groups = verify_token_groups(num_q_heads, num_kv_heads, max_query_len)
    most = decode_splits_for_sms(batch * groups, num_kv_heads, max_blocks, max_sms)
    if qpk <= V7_MAX_QPK:  # v7f's verify programs on 5-bit codes
        for name in DENSE_DTYPES:
            fmt = resolve_format(name)
            if fmt.key_bits == 5:
                programs = _v7_verify_programs(batch, qpk, max_query_len)
                splits = _splits_for_sms(
                    "v7f", programs, qpk, num_kv_heads, max_blocks, max_sms, fmt.group
                )
                most = max(most, decode_partials("v7f", splits))
    return most


def _v7_verify_tokens(qpk: int, max_query_len: int) -> int:
    """Query tokens a v7 verify program takes side by side: the most (a power of two, up to
    ``max_query_len``) whose ``qpk`` query heads fit its 8 columns."""
    from kvarn_kernels.decode_v7 import V7_MAX_QPK

    tokens = 1
    while tokens < max_query_len and 2 * tokens * qpk <= V7_MAX_QPK:
        tokens *= 2
    return tokens


def _v7_verify_programs(batch: int, qpk: int, max_query_len: int) -> int:
    """v7's verify programs per (KV head, split): each request's ``max_query_len`` tokens
    in groups of :func:`_v7_verify_tokens` (the count decode's split rule sizes for)."""
    return batch * cdiv(max_query_len, _v7_verify_tokens(qpk, max_query_len))


def _resolve_verify_variant(
    geo: DenseGeometry, variant: str, qpk: int, device: torch.device | None
) -> str:
    """:func:`verify_attention`'s kernel: ``variant`` checked as :func:`decode_attention`
    checks it; ``"auto"`` is v7f where it serves the geometry on ``device``, else decode's
    default without a device (v4c; v1 for the codes v4 cannot read)."""
    if variant == "auto" and _v7_serves(geo, qpk, device):
        variant = "v7f"
    variant = _resolve_decode_variant(geo, variant, qpk=qpk)
    if variant in POOL_SPLIT_VARIANTS and variant not in FIVE_BIT_VARIANTS:
        raise ValueError(
            f"variant={variant!r} is a decode variant; verify_attention takes v4c, v1 or, on "
            "5-bit codes, v7 and v7f"
        )
    return variant


def _verify_splits(
    variant: str,
    geo: DenseGeometry,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_query_len: int,
    max_blocks: int,
    device: torch.device,
) -> int:
    """:func:`verify_attention`'s split count for ``variant``: the 5-bit kernels' decode count
    for as many rows as their verify programs (:func:`_v7_verify_programs`), else
    :func:`choose_verify_splits`."""
    if variant in FIVE_BIT_VARIANTS:
        programs = _v7_verify_programs(batch, num_q_heads // num_kv_heads, max_query_len)
        return _default_splits(
            variant, programs, num_q_heads, num_kv_heads, max_blocks, device, geo.group
        )
    return choose_verify_splits(batch, num_q_heads, num_kv_heads, max_query_len, max_blocks, device)


def decode_workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements a preallocated ``decode_attention`` workspace needs."""
    rows = batch * num_q_heads
    return rows * head_dim + num_splits * rows * (head_dim + 1)


def _v4_launch(
    geo: DenseGeometry,
    q_rot: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    softmax_scale: float,
    n_rows: int,
    num_splits: int,
    fast: bool,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    hq: int,
    round7: bool = False,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
    masked_scales: bool = False,
    mma_rows: int | None = None,
    pool_split: bool = False,
    max_registers: int | None = None,
) -> PreparedLaunch:
    """The launch of the v4 decode kernel (:mod:`kvarn_kernels.decode_v4`) into the split workspace;
    ``round7``: with round 7's batched pool phase and wide scale loads (``variant="v4b"``);
    ``masked_scales``: with them, the tile scales of pool blocks masked at the load
    (``variant="v4c"``); ``pool_split`` (``variant="v4d"``): the main loop alone (the caller
    launches :func:`_pool_launch` into partial ``num_splits``).
    With ``query_start_loc`` (``[B + 1]``, speculative verify) request ``b`` has the query rows
    ``query_start_loc[b] ..`` (at most ``max_query_len``) and ``hq`` query heads."""
    from kvarn_kernels.decode_v4 import decode_v4_config, decode_v4_kernel

    t = int(block_table.shape[0])
    hk = int(pool_k.shape[2])
    qpk = hq // hk
    multi = query_start_loc is not None
    # verify: as many of a request's query tokens per program as fill the MMA's rows
    tpp = _verify_tokens_per_program(qpk) if multi else 1
    ntg = verify_token_groups(hq, hk, max_query_len) if multi else 1
    cfg = decode_v4_config(geo.head_dim, geo.group, verify=multi)
    warps = num_warps or cfg["num_warps"]
    return PreparedLaunch(
        decode_v4_kernel,
        (t * ntg, hk, num_splits),
        (
            q_rot,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            query_start_loc if multi else seq_lens,
            float(softmax_scale) * _LOG2E,
            block_table.stride(0),
            n_rows,
        ),
        {
            "HQ": hq,
            "HK": hk,
            "QPK": qpk,
            "BLOCK_Q": mma_rows or decode_mma_rows(qpk, verify=multi),
            "D": geo.head_dim,
            "G": geo.group,
            "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
            "KB": geo.key_bits,
            "VB": geo.value_bits,
            "STRIDE": geo.record_stride,
            **geo.offsets(),
            "BN": block_n or cfg["block_n"],
            "W": warps,
            "SCAN": cfg["scan"],
            "NUM_SPLITS": num_splits,
            "FAST_UNPACK": fast,
            "POOL_BATCHED": round7,
            "WIDE_SCALES": round7,
            "MASKED_SCALES": masked_scales,
            "MULTI": multi,
            "TPP": tpp,
            "NTG": ntg,
            "PHASES": 1 if pool_split else 0,
        },
        warps,
        num_stages=num_stages or cfg["num_stages"],
        maxnreg=max_registers,  # registers per thread (the main loop's launch only)
    )


def _pool_launch(
    geo: DenseGeometry,
    q_rot: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    softmax_scale: float,
    n_rows: int,
    part: int,
    hq: int,
) -> PreparedLaunch:
    """The launch of attention over each request's fp16 pool tiles into partial ``part``
    (:mod:`kvarn_kernels.decode_pool`, one program per request and KV head)."""
    from kvarn_kernels.decode_pool import (
        POOL_CHUNK_TOKENS,
        POOL_MAX_REGISTERS,
        POOL_STAGES,
        POOL_WARPS,
        decode_pool_kernel,
    )

    hk = int(pool_k.shape[2])
    qpk = hq // hk
    return PreparedLaunch(
        decode_pool_kernel,
        (int(block_table.shape[0]), hk),
        (
            q_rot,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            float(softmax_scale) * _LOG2E,
            block_table.stride(0),
            n_rows,
            part,
        ),
        {
            "HQ": hq,
            "HK": hk,
            "QPK": qpk,
            "BLOCK_Q": _mma_rows(qpk),
            "D": geo.head_dim,
            "G": geo.group,
            "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
            "STRIDE": geo.record_stride,
            "BN": min(POOL_CHUNK_TOKENS, geo.group),
            "SCAN": 64,
            "STAGES": POOL_STAGES,
        },
        POOL_WARPS,
        num_stages=POOL_STAGES,
        maxnreg=POOL_MAX_REGISTERS,
    )


def _prefill_fused_launch(
    variant: str,
    geo: DenseGeometry,
    q_rot: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    query_start_loc: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    softmax_scale: float,
    n_rows: int,
    num_splits: int,
    hq: int,
    fast: bool,
    block_m: int | None,
    block_n: int | None,
    num_warps: int | None,
    pdl: bool,
) -> PreparedLaunch:
    """The launch of a fused prefill kernel into ``num_splits`` partials: ``"prefill_v2"``
    (:mod:`kvarn_kernels.prefill_v2`), ``"prefill_v3"`` (:mod:`kvarn_kernels.prefill_v3`,
    the same grid and arguments; ``block_m`` 64 or 128 picks its warps) or ``"prefill_v4"``
    (:mod:`kvarn_kernels.prefill_v4`, the same at 64 rows). ``pdl``: v3 and v4 launched as
    programmatic dependents of the queries' rotation (:func:`kvarn_kernels._launch.launch`)."""
    from kvarn_kernels.prefill_v2 import PREFILL_V2_WARPS, default_block_m, prefill_v2_kernel

    t = n_rows // hq
    hk = int(pool_k.shape[2])
    qpk = hq // hk
    qpk_p = next_pow2(qpk)
    rows = max(block_m or default_block_m(geo.head_dim), qpk_p)
    if variant == "prefill_v4":
        rows = 64
    bq = rows // qpk_p
    b = int(query_start_loc.shape[0]) - 1
    grid = (cdiv(t, bq) + b, hk, num_splits)
    # the two kernels take the same pointers, scalars and shape constants
    args = (
        q_rot,
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        seq_lens,
        block_to_slot,
        query_start_loc,
        o_part,
        lse_part,
        float(softmax_scale) * _LOG2E,
        block_table.stride(0),
        n_rows,
        b,
    )
    shape = {
        "HQ": hq,
        "HK": hk,
        "QPK": qpk,
        "QPK_P": qpk_p,
        "BQ": bq,
        "B_P": request_slots(b),
        "D": geo.head_dim,
        "G": geo.group,
        "VB": geo.value_bits,
        "STRIDE": geo.record_stride,
        "NUM_SPLITS": num_splits,
    }
    offsets = geo.offsets()
    if variant == "prefill_v4":
        from kvarn_kernels import prefill_v4

        del offsets["K_ORDER"], offsets["V_ORDER"]  # v3's orders (_v4_serves checks them)
        consts = {
            **shape,
            **offsets,
            "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
            "RING": prefill_v4.V4_RING,
            "LAZY": prefill_v4.V4_LAZY_SOFTMAX,
            "PDL": pdl,
        }
        return PreparedLaunch(prefill_v4.prefill_v4_kernel, grid, args, consts, 4, pdl=pdl)
    if variant == "prefill_v3":
        from kvarn_kernels import prefill_v3

        # v3 is written for one pair of in-cache orders (_v3_serves checks them)
        del offsets["K_ORDER"], offsets["V_ORDER"]
        consts = {
            **shape,
            **offsets,
            "W": rows // 16,
            "DEQ16": prefill_v3.V3_DEQ16,
            "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
            "PDL": pdl,
        }
        if prefill_v3.V3_WARP_SPECIALIZED and rows == 128:
            cp = prefill_v3.WS_CONSUMER_PARTITIONS
            ws = {
                "STAGES": prefill_v3.WS_STAGES,
                "PW": prefill_v3.WS_PRODUCER_WARPS,
                "PREGS": prefill_v3.WS_PRODUCER_REGS,
                "CP": prefill_v3.WS_CONSUMER_PARTITIONS,
                "CREGS": prefill_v3.WS_CONSUMER_REGS,
                "RING": prefill_v3.WS_RING,
                "PROBE": prefill_v3.WS_PROBE,
                "SPREAD": prefill_v3.WS_SPREAD_STORES,
            }
            return PreparedLaunch(
                prefill_v3.prefill_v3ws_kernel,
                grid,
                args,
                {**consts, **ws, "W": 8 // cp},
                8 // cp,
                maxnreg=prefill_v3.WS_MAXNREG,
                pdl=pdl,
            )
        return PreparedLaunch(prefill_v3.prefill_v3_kernel, grid, args, consts, rows // 16, pdl=pdl)
    return PreparedLaunch(
        prefill_v2_kernel,
        grid,
        args,
        {
            **shape,
            **offsets,
            "BLOCK_M": rows,
            "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
            "KB": geo.key_bits,
            "BN": block_n or min(geo.group, 64),
            "FAST_UNPACK": fast,
        },
        num_warps or PREFILL_V2_WARPS,
    )


def _launch_v5(*args: Any, **kwargs: Any) -> None:
    """Launch :func:`_v5_launch`'s main loop now (the probe and A/B scripts' entry)."""
    _v5_launch(*args, **kwargs).run()


def _v5_launch(
    geo: DenseGeometry,
    q_rot: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    softmax_scale: float,
    n_rows: int,
    num_splits: int,
    hq: int,
    hk: int,
    max_registers: int | None,
    num_warps: int | None,
    num_stages: int | None,
    variant: str = "v5",
    probe: int = 0,
    tokens_per_program: int = 1,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
    block_scales: bool | None = None,
    pdl: bool = False,
) -> PreparedLaunch:
    """The launch of the main loop of ``variant`` (:data:`V5_VARIANTS`: :mod:`kvarn_kernels.decode_v5`,
    ``"v5f"`` its folded form, ``"v6"`` :mod:`kvarn_kernels.decode_v6`) into partials ``0 ..
    num_splits - 1``; the pool phase follows as v4d's (partial ``num_splits``).
    ``max_registers`` caps the main loop's registers per thread (``maxnreg``);
    ``num_warps``: warps per program (default ``V5_WARPS``); ``num_stages``: pipeline stages
    (default 2). ``probe`` (v6 only, timing): :data:`kvarn_kernels.decode_v6.PROBE_COPIES_ONLY`
    or ``PROBE_COMPUTE_ONLY``, whose partials are not attention. ``tokens_per_program`` > 1
    (v7 only; the rows :func:`verify_rows` lays out, ``query_start_loc`` the requests', each
    of up to ``max_query_len`` tokens): a program takes up to that many of a request's tokens
    side by side (``decode_v7_kernel``'s ``TOK``). ``"v6t"``: v6f's ``TMA`` build (its
    descriptors: :func:`v6_tma_descriptors`). ``block_scales`` (v6 at one warp, 128-token
    tiles): ``decode_v6_kernel``'s ``BLOCK_SCALES``; None: on for v6t where
    :func:`v6t_block_scales` says so (at :data:`V6T_BLOCK_MAX_REGISTERS` unless
    ``max_registers`` is given), off otherwise. ``pdl`` (v6 only): launched as a programmatic
    dependent of the queries' rotation."""
    from kvarn_kernels.decode_v5 import V5_WARPS, decode_v5_kernel
    from kvarn_kernels.decode_v6 import decode_v6_kernel
    from kvarn_kernels.decode_v7 import decode_v7_kernel

    offsets = {k: v for k, v in geo.offsets().items() if k.startswith("OFF_")}
    v6 = variant in ("v6", "v6f", "v6t")
    if probe and not v6:
        raise ValueError(f"probe={probe} is a decode_v6 option, not {variant!r}'s")
    # every constexpr given, defaults too: launch() takes its direct path for a full tail
    options: dict[str, bool | int] = {"FOLD": variant in ("v5f", "v6f", "v6t", "v7f")}
    grid_x = int(block_table.shape[0])
    v7_args: tuple[Any, ...] = ()  # v7: the query start locations; v6: its descriptors
    tma = False
    if variant in FIVE_BIT_VARIANTS:
        kernel = decode_v7_kernel
        groups = 1
        v7_args = (seq_lens,)  # QSL: unread at one token per program
        if tokens_per_program > 1:
            if query_start_loc is None:
                raise ValueError("tokens_per_program > 1 takes the verify batch's query_start_loc")
            groups = cdiv(max_query_len, tokens_per_program)
            grid_x = (int(query_start_loc.shape[0]) - 1) * groups
            v7_args = (query_start_loc,)
        options.update({"TOK": tokens_per_program, "GPR": groups})
    elif tokens_per_program != 1:
        raise ValueError(f"tokens_per_program is a v7 option, not {variant!r}'s")
    else:
        kernel = decode_v6_kernel if v6 else decode_v5_kernel
        options["VB"] = geo.value_bits
        # v6t on a cache its boxes cannot address (a hybrid model's padded records, which a
        # plan made from the format alone does not see) copies as v6f: the same partials
        tma = variant == "v6t" and v6t_fits(geo) and _tma_addressable(kv_cache)
        if block_scales is None:  # the variant's own choice
            block_scales = tma and v6t_block_scales(geo)
            if block_scales:
                max_registers = max_registers or V6T_BLOCK_MAX_REGISTERS
        if block_scales and not (v6 and geo.group == 128 and (num_warps or V5_WARPS) == 1):
            raise ValueError("block_scales is a one-warp v6 option on 128-token tiles")
        options.update(
            {"PROBE": probe, "TMA": tma, "BLOCK_SCALES": block_scales, "PDL": pdl}
            if v6
            else {"LAZY": False}
        )
        if v6:  # the TMA build's descriptors (None for the others; ``tma`` did the checks)
            v7_args = (
                _v6_tma_descriptors_at(geo, kv_cache.data_ptr(), kv_cache.numel())
                if tma
                else (None,) * 4
            )
    return PreparedLaunch(
        kernel,
        (grid_x, hk, num_splits),
        (
            q_rot,
            kv_cache,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            float(softmax_scale) * _LOG2E,
            block_table.stride(0),
            n_rows,
            hq // hk,
            *v7_args,
        ),
        {
            "HQ": hq,
            "HK": hk,
            "QPK": hq // hk,
            "D": geo.head_dim,
            "G": geo.group,
            "STRIDE": geo.record_stride,
            **offsets,
            "NUM_SPLITS": num_splits,
            "W": num_warps or V5_WARPS,
            "STAGES": num_stages or 2,
            **options,
        },
        num_warps or V5_WARPS,
        maxnreg=max_registers,
        pdl=pdl and v6,
        # v6t's descriptors: built once per cache (_v6_tma_descriptors_at)
        descriptors=4 if tma else 0,
    )


@cache  # asked in every v6t launch
def v6t_fits(geo: DenseGeometry) -> bool:
    """Whether v6's ``TMA`` build reads ``geo``'s records: head dim 128 and every field, and
    the record stride, on a multiple of :data:`kvarn_kernels.decode_v6.V6_TMA_ROW_BYTES` (the
    registry's 4-bit-key formats are; a hybrid model's padded records may not be)."""
    from kvarn_kernels.decode_v6 import V6_TMA_ROW_BYTES

    row = V6_TMA_ROW_BYTES
    offsets = (off for name, off in geo.offsets().items() if name.startswith("OFF_"))
    return (
        geo.head_dim == row and geo.record_stride % row == 0 and not any(o % row for o in offsets)
    )


#: v6t's register cap where it works out a tile's channel scales once
#: (:func:`v6t_block_scales`): uncapped the compiler takes 225 and fits 9 programs on an SM,
#: at 168 (12 programs, as plain v6t) it spills 16 bytes. Fortieth session, H100 with an
#: H200's bandwidth share (``scripts/decode_sm_share.py``, k4v2_g128, main loop, against plain
#: v6t in the same process, bit-identical partials): 0.96x at B = 64 / 16K (370.6 and 373.3
#: against 387.3 and 387.4 µs), 0.97x at 256 / 4K; uncapped 1.06x, 160 registers 0.99x.
V6T_BLOCK_MAX_REGISTERS = 168


@cache
def v6t_block_scales(geo: DenseGeometry) -> bool:
    """Whether v6t works out a 128-token tile's K channel scales, zeros, scaled query and V
    channel scales once for the tile's two chunks (``decode_v6_kernel``'s ``BLOCK_SCALES``):
    on 128-token tiles with 2-bit values, where it measured faster at an H200's bandwidth per
    SM (:data:`V6T_BLOCK_MAX_REGISTERS`). With 4-bit values it measured 0.99-1.01x (k4v4_g128,
    same run), so those keep the plain build."""
    return v6t_fits(geo) and geo.group == 128 and geo.value_bits == 2


def _tma_addressable(kv_cache: torch.Tensor) -> bool:
    """Whether a tensor descriptor can start at ``kv_cache`` (contiguous, 16-byte aligned)."""
    return kv_cache.is_contiguous() and kv_cache.data_ptr() % 16 == 0


def v6_tma_descriptors(geo: DenseGeometry, kv_cache: torch.Tensor) -> tuple[Any, ...]:
    """The tensor-memory-accelerator descriptors of v6's ``TMA`` build for ``kv_cache``
    (contiguous records of ``geo``; coordinates count 128-byte rows of the cache):

    * K's code words, a chunk's 32 token-pair rows in the ``_perm16`` order (row ``16 kt + 8
      b + 2 t + h`` of the box is pair ``16 kt + 4 t + 2 h + b``: the box's dimensions are
      ``kt, b, t, h`` with the strides of those pairs);
    * V's, both parities' byte columns of a chunk;
    * 256-byte fields (a block's K channel scales, K zeros, V channel scales) and 128-byte
      ones (a chunk's K token scales, V token scales, V token zeros), as rows of 64-bit words.

    They are built once per (geometry, address, size) and then looked up: an eager decode
    calls this in every layer. Their base is the cache's address (:class:`_CacheAddress`), not
    the tensor, so a cached descriptor keeps no cache memory alive, and one found for a new
    tensor at a freed tensor's address is exactly the one it would get built anew.
    """
    from kvarn_kernels.decode_v6 import V6_TMA_ROW_BYTES

    if not v6t_fits(geo) or not _tma_addressable(kv_cache):
        raise ValueError(
            "v6's TMA build reads a contiguous, 16-byte aligned cache whose records and fields "
            f"start on multiples of {V6_TMA_ROW_BYTES} bytes (head dim 128): {geo.fmt.name}, "
            f"record stride {geo.record_stride}: use variant='v6f'"
        )
    return _v6_tma_descriptors_at(geo, kv_cache.data_ptr(), kv_cache.numel())


@dataclass(frozen=True, slots=True)
class _CacheAddress:
    """A tensor descriptor's base as its launch reads it (``data_ptr()`` and ``dtype``)
    without a reference to the tensor that holds the memory."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


@lru_cache(maxsize=256)
def _v6_tma_descriptors_at(geo: DenseGeometry, address: int, nbytes: int) -> tuple[Any, ...]:
    """:func:`v6_tma_descriptors` of a checked cache of ``nbytes`` bytes at ``address``."""
    from triton.experimental.gluon.language import (  # type: ignore[import-untyped]
        NVMMASharedLayout,
    )
    from triton.experimental.gluon.nvidia.hopper import (  # type: ignore[import-untyped]
        TensorDescriptor,
    )

    from kvarn_kernels.decode_v6 import V6_TMA_ROW_BYTES

    row, d, g = V6_TMA_ROW_BYTES, geo.head_dim, geo.group
    nc = d * geo.value_bits // 8  # V's byte columns
    words = _CacheAddress(address, torch.int32)
    rows = nbytes // row
    k_desc = TensorDescriptor(
        words,
        [2, rows, 4, 2, d // 4],
        [16 * d // 4, d // 4, 4 * d // 4, 2 * d // 4, 1],
        [2, 2, 4, 2, d // 4],
        NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=5),
    )
    v_desc = TensorDescriptor(
        words,
        [rows, g // 64, 2, nc, 8],
        [row // 4, 8, nc * g // 8, g // 8, 1],
        [1, 1, 2, nc, 8],
        NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=5),
    )
    quads = _CacheAddress(address, torch.int64)
    flat = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=2)
    s256 = TensorDescriptor(quads, [rows, row // 8], [row // 8, 1], [2, row // 8], flat)
    s128 = TensorDescriptor(quads, [rows, row // 8], [row // 8, 1], [1, row // 8], flat)
    return k_desc, v_desc, s256, s128


@dataclass(frozen=True)
class _SideStream:
    """A device's side stream for :func:`_forked`, with the fork and join events it records
    every time: made once (a stream made during CUDA-graph capture would still work, but the
    warm-up before capture makes it). An event may be recorded again once waited on: a wait
    takes the work recorded at the time of the wait, so reusing the two saves creating and
    destroying two events a call, which ``Stream.wait_stream`` does."""

    stream: torch.cuda.Stream
    fork: torch.cuda.Event
    join: torch.cuda.Event


_SIDE_STREAMS: dict[int, _SideStream] = {}


@contextlib.contextmanager
def _forked(device: torch.device) -> Iterator[contextlib.AbstractContextManager[Any]]:
    """A fork and join around the body: it gets a context to launch on a side stream that
    starts after the work queued so far, and the current stream waits for the side stream
    at the end (graph capture records both as branches of the graph). Off CUDA the side
    context is a no-op, so the launches run in order."""
    if device.type != "cuda":
        yield contextlib.nullcontext()
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(index)
    if side is None:
        side = _SIDE_STREAMS.setdefault(
            index,
            _SideStream(
                torch.cuda.Stream(device=index),  # type: ignore[no-untyped-call]
                torch.cuda.Event(),  # type: ignore[no-untyped-call]
                torch.cuda.Event(),  # type: ignore[no-untyped-call]
            ),
        )
    current = torch.cuda.current_stream(index)
    side.fork.record(current)
    side.stream.wait_event(side.fork)
    try:
        yield torch.cuda.stream(side.stream)
    finally:
        side.join.record(side.stream)
        current.wait_event(side.join)


@dataclass(frozen=True)
class _AttentionLaunches:
    """The launches of one attention call (:func:`_attention_launches`), in order: the
    queries' rotation, the attention kernel, the pool tiles' kernel where the variant splits
    them off (:data:`POOL_SPLIT_VARIANTS`), and the merge."""

    geo: DenseGeometry
    rotation: PreparedLaunch
    main: PreparedLaunch
    pool: PreparedLaunch | None
    #: the pool kernel runs on a side stream next to the main loop (the v5 kernels), not after
    #: it (v4d)
    pool_on_side: bool
    merge: PreparedLaunch

    def run(
        self,
        device: torch.device,
        replacements: Sequence[Mapping[int, object]] | None = None,
    ) -> None:
        """Run them on ``device`` (the current stream), each with its :attr:`launches`
        entry's arguments or, given ``replacements`` (one per launch, in order), those with
        the arguments at the mapped positions replaced (another layer's tensors of the same
        layout: :meth:`~kvarn_kernels._launch.PreparedLaunch.run_replacing`)."""
        launches = self.launches

        def start(i: int) -> None:
            if replacements is None:
                launches[i].run()
            else:
                launches[i].run_replacing(replacements[i])

        start(0)
        if self.pool is None:
            start(1)
        elif self.pool_on_side:
            # The pool tiles (the fp16 sink and in-progress tiles, their own partial) do not
            # wait for the main loop: on a side stream their programs run next to the main
            # launch's, instead of in a launch of their own after its last wave. Launched
            # second: v4's pool phase (255 registers a thread) launched first held the SMs
            # before the main loop's first wave (twenty-second session: 0.97-0.98x at
            # B >= 64); decode_pool's order is not re-timed.
            with _forked(device) as side:
                start(1)
                with side:
                    start(2)
        else:  # v4d: after its main loop, on the same stream
            start(1)
            start(2)
        start(len(launches) - 1)

    @property
    def launches(self) -> tuple[PreparedLaunch, ...]:
        """The launches in order (three without a pool kernel)."""
        pool = () if self.pool is None else (self.pool,)
        return (self.rotation, self.main, *pool, self.merge)


def _launch(geo: DenseGeometry, q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Rotate the queries, run the attention kernel into the split workspace, merge and
    un-rotate: :func:`_attention_launches` (the same parameters), run on ``q``'s device."""
    launches = _attention_launches(geo, q, *args, **kwargs)
    if launches is not None:
        launches.run(q.device)


def _attention_launches(
    geo: DenseGeometry,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,
    workspace: torch.Tensor,
    num_splits: int,
    decode: bool,
    block_n: int | None,
    num_warps: int | None,
    fast_unpack: bool | None = None,
    prefetch: bool = True,
    block_m: int | None = None,
    variant: str = "v1",
    num_stages: int | None = None,
    max_query_len: int = 1,
    mma_rows: int | None = None,
    max_registers: int | None = None,
    tokens_per_program: int = 1,
) -> _AttentionLaunches | None:
    """The launches of a decode, verify or (v1) prefill call, not yet run; None for no rows.
    ``decode`` with a ``query_start_loc`` (the v4 kernels only): speculative verify rows, at
    most ``max_query_len`` per request. ``tokens_per_program``: v7's (:func:`_v5_launch`)."""
    t, hq, d = (int(s) for s in q.shape)
    if _fused_kernel_refuses(d, q.device.type, variant, prefetch):
        raise NotImplementedError(HEAD_DIM_512_GPU_MESSAGE)
    hk = int(pool_k.shape[2])
    qpk = hq // hk
    qpk_p = next_pow2(qpk)
    n_rows = t * hq
    if n_rows == 0:
        return None
    parts = decode_partials(variant, num_splits)
    # the fused prefill kernels, v6's decode and their merge start while the kernel before
    # them drains
    pdl = variant in PDL_VARIANTS and pdl_supported(q.device)
    q_rot = workspace[: n_rows * d]
    o_part = workspace[n_rows * d : n_rows * d * (1 + parts)]
    lse_part = workspace[n_rows * d * (1 + parts) : n_rows * (d * (1 + parts) + parts)]
    fast = (not triton_interpret()) if fast_unpack is None else fast_unpack
    pool = (
        _pool_launch(
            geo,
            q_rot,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            softmax_scale,
            n_rows,
            num_splits,
            hq,
        )
        if variant in POOL_SPLIT_VARIANTS  # the pool tiles' own partial, num_splits
        else None
    )
    if variant in V5_VARIANTS:
        main = _v5_launch(
            geo,
            q_rot,
            kv_cache,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            softmax_scale,
            n_rows,
            num_splits,
            hq,
            hk,
            max_registers,
            num_warps,
            num_stages,
            variant,
            tokens_per_program=tokens_per_program,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            pdl=pdl,
        )
    elif variant in V4_VARIANTS:
        main = _v4_launch(
            geo,
            q_rot,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            seq_lens,
            block_to_slot,
            o_part,
            lse_part,
            softmax_scale,
            n_rows,
            num_splits,
            fast,
            block_n,
            num_warps,
            num_stages,
            round7=variant != "v4",
            masked_scales=variant in ("v4c", "v4d"),
            pool_split=variant in POOL_SPLIT_VARIANTS,
            hq=hq,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            mma_rows=mma_rows,
            max_registers=max_registers,
        )
    else:
        if decode:
            bq = 1
            block_m = _mma_rows(qpk)
            b = t
            grid_x = b
        else:
            assert query_start_loc is not None
            block_m = max(block_m or (64 if d <= 128 else 32), qpk_p)
            bq = block_m // qpk_p
            b = int(query_start_loc.shape[0]) - 1
            grid_x = cdiv(t, bq) + b
        bn = block_n or _chunk_tokens(d, geo.group)
        main = PreparedLaunch(
            _attn_kernel,
            (grid_x, hk, num_splits),
            (
                q_rot,
                kv_cache,
                pool_k,
                pool_v,
                block_table,
                seq_lens,
                block_to_slot,
                query_start_loc if query_start_loc is not None else seq_lens,
                o_part,
                lse_part,
                float(softmax_scale) * _LOG2E,
                block_table.stride(0),
                int(block_table.shape[1]),
                n_rows,
                b,
            ),
            {
                "HQ": hq,
                "HK": hk,
                "QPK": qpk,
                "QPK_P": qpk_p,
                "BQ": bq,
                "BLOCK_M": block_m,
                # the request search of prefill tiles only: a constant for decode, whose
                # batch size would otherwise select a new compile per power of two
                "B_P": 1 if decode else request_slots(b),
                "D": d,
                "G": geo.group,
                "SHADOW": pool_shadow_rows(pool_k, geo.group, kv_cache),
                "KB": geo.key_bits,
                "VB": geo.value_bits,
                "STRIDE": geo.record_stride,
                **geo.offsets(),
                "BN": bn,
                "NUM_SPLITS": num_splits,
                "DECODE": decode,
                "FAST_UNPACK": fast,
                "PREFETCH": prefetch,
            },
            num_warps or (4 if d <= 128 and decode else 8),
        )
    # verify: a padded batch's tail tokens (past query_start_loc[B]) come out as zeros (the
    # pointer is 16-byte aligned or not with B: two compiles, both in the warm-up)
    tokens = query_start_loc[-1:] if decode and query_start_loc is not None else None
    return _AttentionLaunches(
        geo,
        query_rotation(q, q_rot),
        main,
        pool,
        variant in V5_VARIANTS,
        _merge_launch(o_part, lse_part, out, n_rows, parts, hq, pdl, tokens),
    )


def _merge_launch(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    n_rows: int,
    parts: int,
    hq: int,
    pdl: bool,
    tokens: torch.Tensor | None = None,
) -> PreparedLaunch:
    """The launch of :func:`_merge_unrotate_kernel` on ``n_rows`` rows of ``parts`` partials
    into ``out``; ``tokens`` (verify): the one-element count of real tokens, past which rows
    come out as zeros."""
    d = int(out.shape[-1])
    block_r = 16
    return PreparedLaunch(
        _merge_unrotate_kernel,
        (cdiv(n_rows, block_r),),
        (
            o_part,
            lse_part,
            out,
            sign_matrix(d, out.device, torch.float16),
            lse_part if tokens is None else tokens,
            n_rows,
            1.0 / math.sqrt(d),
        ),
        {
            "NUM_SPLITS": parts,
            "D": d,
            "BLOCK_R": block_r,
            "BLOCK_N": min(d, 128),
            "OUT_BF16": out.dtype == torch.bfloat16,
            "ROWS_PER_TOKEN": 0 if tokens is None else hq,
            "UNROLL": _merge_unroll(parts),
            "PDL": pdl,
        },
        4,
        pdl=pdl,
    )


#: Unroll the merge's split loop (:func:`_merge_unrotate_kernel`'s ``UNROLL``, a chunk of
#: :data:`MERGE_CHUNK` splits at a time) up to this many partials; 0 never. Up to the
#: thirty-fourth session 16, unchunked: one request's 33 partials (v4c at 32 splits) then
#: merged one loop trip at a time, 10.7 µs of a 44 µs decode at B = 1 / 16K (H100, torch
#: profiler), against 3.5 µs for 16 unrolled partials at 4K. Chunked (H200, thirty-sixth
#: session, ``scripts/decode_small_batch_ab.py``): v6f's decode 0.93x at 65 partials
#: (k4v2_g64 B = 1 / 16K, 40.2 to 37.5 µs), 0.99-1.01x elsewhere; the merge itself still took
#: 10.4 µs at 33 partials there (one request: two programs).
MERGE_UNROLL_MAX_SPLITS = 128


def _merge_unroll(parts: int) -> int:
    """:func:`_merge_unrotate_kernel`'s ``UNROLL`` for ``parts`` partials."""
    return next_pow2(parts) if 1 < parts <= MERGE_UNROLL_MAX_SPLITS else 0


def _check_common(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    out: torch.Tensor | None,
    q_layout: str,
) -> tuple[DenseGeometry, torch.Tensor]:
    dense = resolve_format(fmt)
    _, rows, hk, d = _check_pool(pool_k, pool_v)
    if rows > dense.group:
        raise ValueError(
            f"{dense.name} has {dense.group}-token tiles but the pool holds {rows} rows per slot"
        )
    check_ndim("q", q, 3, q_layout)
    check_dtype("q", q, ACT_DTYPES)
    if q.shape[2] != d:
        raise ValueError(f"q has head_dim {q.shape[2]} but the pool has head_dim {d}")
    hq = int(q.shape[1])
    if hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hk} KV heads")
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, Hk, tile_bytes]")
    check_dtype("kv_cache", kv_cache, (torch.uint8,))
    if kv_cache.shape[1] != hk or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [num_blocks, {hk}, tile_bytes] uint8 tensor; got "
            f"{tuple(kv_cache.shape)}"
        )
    geo = dense_geometry(dense, d, int(kv_cache.shape[2]))
    # A pool with fewer than G rows per slot keeps each tile's first rows in its block's record
    # area (shadow rows): refuse more than the record stride holds.
    pool_shadow_rows(pool_k, dense.group, kv_cache)
    check_ndim("block_table", block_table, 2, "[B, max_blocks]")
    check_dtype("block_table", block_table, (torch.int32,))
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous")
    check_index_tensor("seq_lens", seq_lens, 1, "[B]")
    check_index_tensor("block_to_slot", block_to_slot, 1, "[num_blocks]")
    if seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"seq_lens has {seq_lens.shape[0]} entries for {block_table.shape[0]} block-table rows"
        )
    check_device(
        q.device,
        kv_cache=kv_cache,
        pool_k=pool_k,
        pool_v=pool_v,
        block_table=block_table,
        seq_lens=seq_lens,
        block_to_slot=block_to_slot,
    )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {str(q.dtype).removeprefix('torch.')} tensor of shape "
                f"{tuple(q.shape)}; got {str(out.dtype).removeprefix('torch.')} {tuple(out.shape)}"
            )
        check_device(q.device, out=out)
    return geo, out


def _q_for_kernel(q: torch.Tensor) -> torch.Tensor:
    return q if q.stride(-1) == 1 else q.contiguous()


def _v4_supports(geo: DenseGeometry) -> bool:
    """v4 reads codes field by field (whole bytes): 4-bit keys with 2- or 4-bit values."""
    return geo.key_bits == 4 and geo.value_bits in (2, 4)


#: The smallest decode batch ``variant="auto"`` runs v5 for, and v6f's split factor
#: (:data:`~kvarn_kernels.decode_v5.V5_ONE_WARP_SPLITS`) starts at: below it v5's second
#: launch (the pool phase) cost more than its loop saved (H200, fifteenth session, k4v2_g128
#: at 16K: 1.21x v4c's time at B = 1, 0.87x at B = 8, 0.78x at B = 64).
V5_MIN_BATCH = 8
#: The smallest decode batch ``variant="auto"`` runs v6f for. H100, thirty-fifth session
#: (``scripts/decode_small_batch_splits.py``, µs per layer, graph replay, each kernel at its
#: best split count): v6f, its pool tiles on a side stream, took 0.84x v4c's time at B = 4 /
#: 16K (k4v2_g64 53.8 against 64.1, k4v2_g128 54.8 against 65.6), 0.90-0.99x at B = 1.
V6_MIN_BATCH = 1
#: Programs per SM the split rule aims at below :data:`V5_MIN_BATCH` for the 4-warp kernels
#: (v4c, v1), where the rule's four made each program too short. H100, thirty-fifth session
#: (``scripts/decode_small_batch_splits.py``, µs per layer, graph replay): at 16K the rule's
#: four took 1.12-1.59x the sweep's best at B = 1 (k4v2_g64 on v4c 59.5 against 37.4 at 16
#: splits, k5v5_g64 on v1 64.6 against 54.0 at 32) and 1.02-1.17x at B = 4; two take
#: 1.00-1.11x, and leave 4K's counts as they were (capped at 4 blocks per split).
SMALL_BATCH_PROGRAMS_PER_SM = 2
#: v6f's split rule below :data:`V5_MIN_BATCH` requests: eight one-warp programs per SM, at
#: least this many tokens per split, and at most :data:`V6_SMALL_BATCH_MAX_SPLITS` splits. H200,
#: thirty-sixth session (``scripts/decode_small_batch_splits.py``, the chunked merge, µs per
#: layer, graph replay): the rule's four programs per SM and four blocks per split took
#: 1.05x the sweep's best at k4v2_g64 B = 1 / 16K (64 splits 38.0 against 32 splits 36.1),
#: 1.07-1.08x at B = 4 / 16K (16 splits against 32) and 1.09x at k4v2_g128 B = 1 / 4K (8
#: splits against 16); this rule picks the best count at all six shapes swept (B = 1 and 4 at
#: 16K, B = 1 at 4K, both group sizes), as it does on the thirty-fifth session's H100 sweep
#: to within 1%. v7f (5-bit codes) takes the same rule: on the H200 (thirty-seventh session)
#: its counts were the sweep's best at B = 1 / 16K and 4K and 1.01x it at B = 4 / 16K (32
#: splits 56.3 µs against 16 splits 55.7).
V6_SMALL_BATCH_PROGRAMS_PER_SM = 8
#: The fewest tokens a v6f split is planned for below :data:`V5_MIN_BATCH` requests.
SMALL_BATCH_TOKENS_PER_SPLIT = 256
#: The most splits v6f is planned for below :data:`V5_MIN_BATCH` requests.
V6_SMALL_BATCH_MAX_SPLITS = 32
#: The GPUs (CUDA compute capabilities) ``variant="auto"`` runs v5 on: sm_90 (H100, H200),
#: the architecture it was timed on (an H200).
V5_AUTO_CAPABILITIES = ((9, 0),)


#: The peak memory bandwidth per SM (GB/s, from the device's memory clock and bus width)
#: from which ``variant="auto"`` runs v6t rather than v6f: where each SM has more bandwidth
#: than its math can use, v6f's loop is bound by its instruction stream, and v6t's issues
#: 10% fewer instructions a step. Thirty-ninth session, on an H100 (25 GB/s per SM) with 38
#: of its 132 SMs held so that each of the other 94 had an H200's share (~32 GB/s of measured
#: copy bandwidth; ``scripts/decode_sm_share.py``, which reproduced the H200's v6f main loop
#: within 3%): v6t's main loop took 0.89x v6f's time at B = 64 / 16K and 256 / 4K
#: (k4v2_g128), 0.92-0.94x at k4v4_g128 and k4v2_g64. On the whole H100 it took 0.89-0.95x at
#: 64K and at one request but 1.03-1.08x at B = 256 / 4K and at k4v2_g64: so not there.
V6T_MIN_GBPS_PER_SM = 30.0


@cache
def _capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return int(major), int(minor)


@cache
def _gbps_per_sm(device_index: int) -> float:
    """The device's peak memory bandwidth per SM in GB/s (double data rate on its bus; 0
    where torch does not report the memory clock)."""
    props = torch.cuda.get_device_properties(device_index)
    clock_khz = float(getattr(props, "memory_clock_rate", 0) or 0)
    bus_bits = float(getattr(props, "memory_bus_width", 0) or 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 / props.multi_processor_count


def _v6t_pays(device: torch.device | None) -> bool:
    """Whether ``variant="auto"`` runs v6t on ``device`` (:data:`V6T_MIN_GBPS_PER_SM`)."""
    if device is None or device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _gbps_per_sm(index) >= V6T_MIN_GBPS_PER_SM


def _v3_serves(geo: DenseGeometry, device: torch.device) -> bool:
    """Whether the Gluon fused prefill (:mod:`kvarn_kernels.prefill_v3`) runs this call."""
    from kvarn_kernels.prefill_v3 import V3_HEAD_DIMS

    if device.type != "cuda" or triton_interpret():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return (
        geo.head_dim in V3_HEAD_DIMS
        and (geo.k_order, geo.v_order) == (CodeOrder.TRANSPOSED, CodeOrder.PARITY)
        and _capability(index) == (9, 0)
    )


def _v4_serves(geo: DenseGeometry, device: torch.device) -> bool:
    """Whether the transposed fused prefill (:mod:`kvarn_kernels.prefill_v4`) runs this call:
    where v3 runs, with 2-bit values."""
    from kvarn_kernels.prefill_v4 import V4_VALUE_BITS

    return _v3_serves(geo, device) and geo.value_bits in V4_VALUE_BITS


def _gluon_timed_on(device: torch.device | None) -> bool:
    """Whether ``device`` is a GPU the Gluon decode kernels were timed on
    (:data:`V5_AUTO_CAPABILITIES`), outside the Triton interpreter."""
    if device is None or device.type != "cuda" or triton_interpret():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability(index) in V5_AUTO_CAPABILITIES


def _v5_serves(geo: DenseGeometry, qpk: int, device: torch.device | None) -> bool:
    """Whether v5 runs this geometry on ``device`` and was timed there (``variant="auto"``)."""
    from kvarn_kernels.decode_v5 import V5_HEAD_DIMS, V5_MAX_QPK

    return (
        geo.head_dim in V5_HEAD_DIMS
        and (geo.k_order, geo.v_order) == (CodeOrder.TRANSPOSED, CodeOrder.PARITY)
        and qpk <= V5_MAX_QPK
        and _gluon_timed_on(device)
    )


def _v7_serves(geo: DenseGeometry, qpk: int, device: torch.device | None) -> bool:
    """Whether v7f runs this geometry (5-bit codes in 64-token tiles, the byte-plane order)
    on ``device`` and was timed there (``variant="auto"``)."""
    from kvarn_kernels.decode_v5 import V5_HEAD_DIMS
    from kvarn_kernels.decode_v7 import V7_MAX_QPK

    return (
        (geo.key_bits, geo.value_bits, geo.group) == (5, 5, 64)
        and geo.head_dim in V5_HEAD_DIMS
        and (geo.k_order, geo.v_order) == (CodeOrder.PLANES, CodeOrder.PLANES_PAIRED)
        and qpk <= V7_MAX_QPK
        and _gluon_timed_on(device)
    )


def default_decode_variant(
    geo: DenseGeometry,
    prefetch: bool,
    v4_option: bool,
    *,
    batch: int = 0,
    qpk: int = 1,
    device: torch.device | None = None,
    shape_option: bool = False,
) -> str:
    """The decode kernel ``variant="auto"`` runs.

    The Gluon kernels, one warp per program, on the GPUs of :data:`V5_AUTO_CAPABILITIES`, at
    head dim 128 with the in-cache code order, unless a tuning option of another kernel was
    given (``v4_option``; ``shape_option``: ``block_n``, ``num_warps`` or ``fast_unpack``): v6f
    (:mod:`kvarn_kernels.decode_v6`; v6t, its copies by the tensor memory accelerator, on
    GPUs of :data:`V6T_MIN_GBPS_PER_SM`) up to 8 query heads per KV head from
    :data:`V6_MIN_BATCH` requests, v5 (:mod:`kvarn_kernels.decode_v5`) up to 16 from
    :data:`V5_MIN_BATCH`. H200,
    seventeenth session (k4v2_g128, µs per layer, graph replay, one ``bench_kernels.py
    --variants decode`` run): v6f against v5 89 vs 96 at B = 8 / 16K, 376 vs 459 at B = 64 /
    16K, 465 vs 549 at B = 256 / 4K; all v6/v6f tests and memcheck passed on the same
    machine. Earlier, H200, fifteenth session (µs per layer at 16K, v5 against v4c, one
    kernel-check run): k4v2_g128 460 vs 591 at B = 64 and 1,740 vs 2,280 at B = 256;
    k4v4_g128 467 vs 609 and 1,804 vs 2,507; k4v2_g64 445 vs 561; all 68 tests of the
    ``decode_v5`` group passed in the same run.

    Otherwise:
    v4c at head dims up to 256, wherever the v4 family can read the codes (4-bit keys with
    2/4-bit values). The H200 (tenth session, one kernel-check run, 16K context, µs per
    layer) measured v4c against v4b: k4v2_g128 B = 64 886 vs 904, B = 256 3,164 vs 3,412;
    k4v4_g128 863 vs 963 and 3,394 vs 3,358 (the one shape where it was not faster, +1%);
    k4v2_g64 841 vs 864; head dim 256 4,923 vs 5,893 (v4 5,798, v1 6,354); and v4b in turn
    no slower than v4 or v1 at head dim 128 (seventh session). With 8 query rows
    (:func:`decode_mma_rows`) on both, v4c against v4d (eleventh session): k4v2_g128 677 vs
    662 and 2,577 vs 2,821; k4v4_g128 735 vs 722 and 3,172 vs 2,983; k4v2_g64 651 vs 666;
    head dim 256 (one stage) 3,238 vs 3,191: mixed, and v4c needs no extra partial, so v4c
    stays.

    5-bit codes (``kvarn_k5v5_g64``, stored as byte planes): v7f
    (:mod:`kvarn_kernels.decode_v7`) from one request under the same conditions as v6f
    (sm_90, head dim 128, up to 8 query heads per KV head, no other kernel's option), at
    v6f's split counts. H200, thirty-seventh session (``scripts/decode_v7_ab.py``, µs per
    layer, graph replay): v7f against v1 448.5 vs 2,307.3 at B = 64 / 16K, 460.3 vs 2,372.6 at
    B = 256 / 4K, 93.5 vs 308.3 at B = 8 / 16K, 38.6 vs 57.8 at B = 1 / 16K; outputs within
    1.3e-3 of v1's; the 33 GPU tests of the 5-bit kernels and the code order passed on the
    same machine. Otherwise v1 for 5-bit codes and head dim 512 (v4 is correct there but not
    timed), and whenever a v1-only option (``prefetch=False``) is given; a v4-only option
    (``v4_option``: ``num_stages`` was given) keeps the v4 family at 512 too.
    """
    gluon = prefetch and not (v4_option or shape_option)
    if gluon and _v7_serves(geo, qpk, device):
        return "v7f"
    if not _v4_supports(geo) or not prefetch:
        return "v1"
    if gluon and _v5_serves(geo, qpk, device):
        from kvarn_kernels.decode_v6 import V6_MAX_QPK

        if qpk <= V6_MAX_QPK and batch >= V6_MIN_BATCH:
            return "v6t" if _v6t_pays(device) and v6t_fits(geo) else "v6f"
        if batch >= V5_MIN_BATCH:
            return "v5"
    if v4_option or geo.head_dim <= 256:
        return "v4c"
    return "v1"


def decode_attention(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    fast_unpack: bool | None = None,
    prefetch: bool = True,
    variant: str = "auto",
    num_stages: int | None = None,
    mma_rows: int | None = None,
    max_registers: int | None = None,
    batch_plan: DecodeBatchPlan | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per request over packed records and the side pool.

    Args:
        fmt: dense KVarN format (or its dtype string).
        q: ``[B, Hq, D]`` fp16/bf16, unrotated; ``Hq`` a multiple of ``Hk`` (any GQA ratio).
        kv_cache: ``uint8 [num_blocks, Hk, tile_bytes]`` packed records, code bytes in the
            in-cache order (docs/format.md §7.1), as the store writes them.
        pool_k, pool_v: ``[num_slots, G - R, Hk, D]`` fp16 rotated side pool. ``R`` (shadow
            rows; 0 for whole-tile slots) is the tile size minus the pool's rows per slot: a
            pool tile's first ``R`` rows are read from its block's record area in
            ``kv_cache`` (:func:`kvarn_format.geometry.shadow_rows` bounds ``R``; more
            raises).
        block_table: ``[B, max_blocks]`` int32 block ids of each request.
        seq_lens: ``[B]`` int32 tokens of each request including the current one (whose K/V
            is already in the pool); 0 gives a zero output row.
        block_to_slot: ``[num_blocks]`` int32 pool slot of a block, or -1 (packed record).
        softmax_scale: scale of ``q . k``.
        out: optional ``[B, Hq, D]`` output in q's dtype.
        workspace: optional contiguous fp32 tensor with at least
            ``decode_workspace_numel(B, Hq, D, decode_partials(variant, num_splits))``
            elements (preallocate it, with a fixed ``num_splits``, for CUDA-graph capture).
        num_splits: split-K factor; default :func:`choose_decode_splits` (static shapes only;
            for ``variant="v5"``, that times 3 for one-warp programs, ``4 / num_warps`` for
            more: :func:`decode_plan` says what a shape gets).
        block_n, num_warps: tuning overrides (tokens per inner step, warps per program;
            ``variant="v5"`` takes ``num_warps`` only; with either, ``"auto"`` leaves v5 out).
            Experimental: only the defaults are covered by the GPU tests (see
            docs/kernel-notes.md).
        fast_unpack: unpack 2/4-bit codes with inline PTX (default: on for GPUs, off in the
            Triton interpreter, which cannot run PTX).
        prefetch: load the next chunk's record bytes into registers before computing the
            current one (default on; v1 only).
        variant: ``"auto"`` (default: :func:`default_decode_variant`: v6f (v6t on an H200)
            or v5 on an H100/H200 at head dim 128, v4c otherwise), ``"v1"`` (this
            module's kernel: any format) or ``"v4"`` (:mod:`kvarn_kernels.decode_v4`: one
            chunk per warp, codes unpacked in the MMA operand layout; 4-bit keys with 2/4-bit
            values only). Both compute the same attention. On the H200 at B = 64, 16K, v4
            takes 906 µs for k4v2_g128 and 995 µs for k4v4_g128, v1 1,558 and 1,611 µs
            (1.7x and 1.6x; B = 256 and g64 tiles likewise). See docs/kernel-notes.md.
            ``"v4b"``: v4 whose pool phase (the fp16 sink and in-progress tiles) takes one
            block per step across the warps and whose main loop reads the per-token and
            V channel scales with wide loads (round 7). ``"v4c"``: v4b whose scale loads skip pool
            blocks (masked loads) instead of zeroing the values afterwards (15% fewer
            instructions in its loop; H200: 2-16% faster than v4b at 9 of 10 shapes timed).
            ``"v4d"``: v4c in two launches, the main loop alone (without the pool phase's
            code, fewer spills) and then the pool phase alone into one more partial per
            request to merge (experimental; with 8 rows 2% faster than v4c at k4v2_g128
            B = 64 and 9% slower at B = 256, eleventh session, 2-3% faster at six shapes in
            the twelfth; a preallocated workspace needs ``decode_partials("v4d",
            num_splits)`` splits' room).
            ``"v5"`` (:mod:`kvarn_kernels.decode_v5`, GPU only): v4d with its main loop
            written in Gluon, every register layout stated, so the in-cache code words unpack
            straight into MMA operands (0.75x v4c's loop instructions at one warp); head dim
            128, up to 16 query heads per KV head. H200, fifteenth session, one warp per
            program (the default): 0.72-0.80x v4c's time at B = 64 and 256 (16K) at the
            three formats it reads, 0.87x at B = 8, 1.21x at B = 1. ``num_warps`` (1, the
            default, 2 or 4), ``num_stages`` (2, the default, or 3) and ``max_registers``
            apply to its main loop. ``"v5f"`` (experimental): v5 with the raw codes as MMA
            operands, K's channel scales folded into the query and V's token scales into
            the probabilities, their zeros and magics into per-row terms (0.81x v5's loop
            instructions at one warp, static count). ``"v6"`` (experimental, not yet run on
            a GPU; :mod:`kvarn_kernels.decode_v6`): v5 with both MMAs transposed, the tokens
            in the MMA's M, up to 8 query heads per KV head (half v5's MMAs, 168 registers
            instead of 231 at one warp, static count); ``"v6f"``: v6 with v5f's folding;
            ``"v6t"``: v6f with every copy by the tensor memory accelerator (one warp, two
            stages).
        num_stages: the v4 kernels only: software-pipeline depth of the code-byte loads
            (default: the launch config's, 2 at head dim 128, 1 from 256:
            ``decode_v4.decode_v4_config``).
        mma_rows: the v4 kernels only: query rows of a program's tile, a power of two from 4
            and the GQA ratio's (``next_pow2(Hq // Hk)``) to 16. Default 8 (or the GQA
            ratio's power of two above 8): Triton pads the MMA's 16 rows inside the MMA, and
            the smaller tile keeps fewer accumulator registers (H200: 0.76-0.93x the time of
            16 rows at every shape timed, :func:`decode_mma_rows`).
        max_registers: the v4 kernels and v5: registers per thread of the main-loop kernel
            (Triton's ``maxnreg``; experimental). Round 6 found caps slower where they made
            v4 spill; v4d with 4 rows at 168 registers took 1.17x / 1.11x the time of
            uncapped v4d with 8 rows at k4v2_g128 B = 64 / 256 (eleventh session).
        batch_plan: the batch's :class:`kvarn_kernels.DecodeBatchPlan`
            (:func:`kvarn_kernels.plan_decode_batch`), shared by the layers of a step: pass
            its own ``block_table``, ``seq_lens`` and ``block_to_slot``, and no tuning
            options (the plan holds them). A layout's first call is checked as an unplanned
            one; later layers only launch.

    Returns ``[B, Hq, D]`` in q's dtype, unrotated. No host sync, no data-dependent host logic.
    """
    if batch_plan is not None:
        if (
            any(
                x is not None
                for x in (
                    workspace,
                    num_splits,
                    block_n,
                    num_warps,
                    fast_unpack,
                    num_stages,
                    mma_rows,
                    max_registers,
                )
            )
            or not prefetch
            or variant != "auto"
        ):
            raise ValueError(
                "with a batch_plan, pass variant, num_splits, mma_rows and workspace to "
                "plan_decode_batch instead (the other tuning options do not apply)"
            )
        return batch_plan.attend(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            (block_table, seq_lens, block_to_slot),
            softmax_scale,
            out,
        )
    setup = _decode_setup(
        fmt,
        q,
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        seq_lens,
        block_to_slot,
        out,
        workspace,
        softmax_scale,
        num_splits=num_splits,
        variant=variant,
        mma_rows=mma_rows,
        block_n=block_n,
        num_warps=num_warps,
        fast_unpack=fast_unpack,
        prefetch=prefetch,
        num_stages=num_stages,
        max_registers=max_registers,
    )
    _launch(
        setup.geo,
        _q_for_kernel(q),
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        seq_lens,
        block_to_slot,
        None,
        softmax_scale,
        setup.out,
        setup.workspace,
        setup.num_splits,
        True,
        block_n,
        num_warps,
        fast_unpack,
        prefetch,
        variant=setup.variant,
        num_stages=num_stages,
        mma_rows=mma_rows,
        max_registers=max_registers,
    )
    return setup.out


@dataclass(frozen=True)
class _DecodeSetup:
    """A decode call's checked inputs and choices (:func:`_decode_setup`)."""

    geo: DenseGeometry
    out: torch.Tensor
    variant: str
    num_splits: int
    workspace: torch.Tensor


def _decode_setup(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    out: torch.Tensor | None,
    workspace: torch.Tensor | None,
    softmax_scale: float,
    *,
    num_splits: int | None,
    variant: str,
    mma_rows: int | None,
    block_n: int | None = None,
    num_warps: int | None = None,
    fast_unpack: bool | None = None,
    prefetch: bool = True,
    num_stages: int | None = None,
    max_registers: int | None = None,
) -> _DecodeSetup:
    """:func:`decode_attention`'s checks, its kernel variant and split count, and its output
    and workspace (allocated where not given)."""
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    geo, out = _check_common(
        fmt, q, kv_cache, pool_k, pool_v, block_table, seq_lens, block_to_slot, out, "[B, Hq, D]"
    )
    if q.shape[0] != block_table.shape[0]:
        raise ValueError(f"q has {q.shape[0]} requests but block_table has {block_table.shape[0]}")
    bsz, hq, d = (int(s) for s in q.shape)
    hk = int(pool_k.shape[2])
    variant = _resolve_decode_variant(
        geo,
        variant,
        prefetch,
        num_stages,
        mma_rows,
        max_registers,
        batch=bsz,
        qpk=hq // hk,
        device=q.device,
        shape_option=any(o is not None for o in (block_n, num_warps, fast_unpack)),
    )
    if max_registers is not None and not 64 <= max_registers <= 255:
        raise ValueError(f"max_registers must lie in [64, 255], got {max_registers}")
    if mma_rows is not None:
        check_mma_rows(mma_rows, hq, hk)
    splits = num_splits or _default_splits(
        variant, bsz, hq, hk, int(block_table.shape[1]), q.device, geo.group, block_n, num_warps
    )
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    need = decode_workspace_numel(bsz, hq, d, decode_partials(variant, splits))
    return _DecodeSetup(geo, out, variant, splits, _workspace(workspace, need, q.device))


def _default_splits(
    variant: str,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    device: torch.device,
    group: int,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> int:
    """A decode launch's split count when none is given (:func:`_splits_for_sms`)."""
    qpk = num_q_heads // num_kv_heads
    sms = _num_sms(device)
    return _splits_for_sms(
        variant, batch, qpk, num_kv_heads, max_blocks, sms, group, block_n, num_warps
    )


def _splits_for_sms(
    variant: str,
    batch: int,
    qpk: int,
    num_kv_heads: int,
    max_blocks: int,
    num_sms: int,
    group: int,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> int:
    """``variant``'s default split count on a GPU of ``num_sms`` SMs (``group``: tokens per
    block): the split rule (:func:`decode_splits_for_sms`) times v5's factor for its warps
    per program from :data:`V5_MIN_BATCH` requests; below it, v6f's and v7f's own rule
    (:data:`V6_SMALL_BATCH_PROGRAMS_PER_SM`), the rule itself for v5 (the one-warp factor's 3x
    was only timed from B = 8) and :data:`SMALL_BATCH_PROGRAMS_PER_SM` for v4c and v1."""
    small = batch < V5_MIN_BATCH
    if small and variant in ("v4c", "v1"):
        density = SMALL_BATCH_PROGRAMS_PER_SM
        return decode_splits_for_sms(
            batch, num_kv_heads, max_blocks, num_sms, programs_per_sm=density
        )
    if small and variant in ("v6f", "v6t", "v7f"):
        splits = decode_splits_for_sms(
            batch,
            num_kv_heads,
            max_blocks,
            num_sms,
            programs_per_sm=V6_SMALL_BATCH_PROGRAMS_PER_SM,
            blocks_per_split=max(1, SMALL_BATCH_TOKENS_PER_SPLIT // group),
        )
        return min(splits, V6_SMALL_BATCH_MAX_SPLITS)
    factor = 1
    if variant in V5_VARIANTS:
        factor = _v5_split_factor(qpk, block_n, num_warps, variant)  # checks the options
        if small:
            factor = 1
    return factor * decode_splits_for_sms(batch, num_kv_heads, max_blocks, num_sms)


def max_decode_partials(
    variant: str,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    *,
    max_sms: int,
) -> int:
    """The most partial outputs :func:`decode_plan` can plan for ``batch`` requests with
    ``variant`` (``"auto"``: any kernel it may pick) on a GPU of up to ``max_sms`` SMs, from
    shapes only (no device): a bound for a workspace sized before the GPU is known."""
    if variant != "auto" and variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be 'auto' or one of {DECODE_VARIANTS}, got {variant!r}")
    from kvarn_kernels.decode_v5 import V5_MAX_QPK
    from kvarn_kernels.decode_v6 import V6_MAX_QPK
    from kvarn_kernels.decode_v7 import V7_MAX_QPK

    qpk = num_q_heads // num_kv_heads
    # the largest tile of the registry: the fewest blocks per split any plan is made for
    group = max(parse_cache_dtype(name).group for name in DENSE_DTYPES)
    if variant != "auto":
        candidates: tuple[str, ...] = (variant,)
    else:  # v1 and v4c; v5 serves up to 16 heads from 8 requests, v6f and v7f up to 8
        gluon = (
            ("v5", V5_MAX_QPK, V5_MIN_BATCH),
            ("v6f", V6_MAX_QPK, V6_MIN_BATCH),
            ("v6t", V6_MAX_QPK, V6_MIN_BATCH),
            ("v7f", V7_MAX_QPK, V6_MIN_BATCH),
        )
        serving = (v for v, most, least in gluon if qpk <= most and batch >= least)
        candidates = ("v1", "v4c", *serving)
    return max(
        decode_partials(v, _splits_for_sms(v, batch, qpk, num_kv_heads, max_blocks, max_sms, group))
        for v in candidates
    )


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """What :func:`decode_attention` runs for a batch shape with its default options: the
    kernel variant and its split count. Preallocating callers (a serving engine with
    CUDA-graph capture) pass both, and size the workspace for :attr:`partials`."""

    variant: str
    num_splits: int

    @property
    def partials(self) -> int:
        """Partial outputs the launch merges (:func:`decode_partials`)."""
        return decode_partials(self.variant, self.num_splits)


#: The longest chunk (query tokens of a request) :func:`prefill_method` sends to the fused
#: kernel. On an H200 (docs/kernel-notes.md, twenty-eighth session) the Gluon fused prefill
#: at 64 tokens after 6-16K of context took 0.97-1.04x the dequantize path's GPU time and
#: 0.58x, 0.75x and 0.93x its eager time (B = 1, 4, 16: the dequantize path's host work).
#: At 128 tokens it took 1.21x the GPU time (B = 1), so larger batches would lose; from 256
#: tokens 1.5-2x.
FUSED_PREFILL_MAX_QUERY = 64


def prefill_method(
    fmt: KVarNFormat | str, head_dim: int, max_query_len: int, device: torch.device
) -> str:
    """The faster :func:`prefill_attention` method for a batch whose longest request has
    ``max_query_len`` query tokens: ``"fused"`` for chunks of up to
    :data:`FUSED_PREFILL_MAX_QUERY` tokens where the Gluon kernel
    (:mod:`kvarn_kernels.prefill_v3`) runs this format on ``device``, else ``"dequant"``
    (the Triton fused kernels were no faster than the dequantize path where measured)."""
    dense = resolve_format(fmt)
    check_head_dim(head_dim)
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    geo = dense_geometry(dense, head_dim, record_layout(dense, head_dim).tile_bytes)
    if max_query_len <= FUSED_PREFILL_MAX_QUERY and _v3_serves(geo, device):
        return "fused"
    return "dequant"


def decode_plan(
    fmt: KVarNFormat | str,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_blocks: int,
    device: torch.device,
    *,
    variant: str = "auto",
    mma_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    fast_unpack: bool | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
) -> DecodePlan:
    """The variant and split count :func:`decode_attention` picks for ``batch`` requests of
    ``num_q_heads`` query heads over block tables ``max_blocks`` wide on ``device`` (static
    shapes only, so CUDA-graph safe), with the same ``variant`` and tuning options and no
    ``num_splits``. Raises ``ValueError`` where :func:`decode_attention` would."""
    dense = resolve_format(fmt)
    check_head_dim(head_dim)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    geo = dense_geometry(dense, head_dim, record_layout(dense, head_dim).tile_bytes)
    chosen = _resolve_decode_variant(
        geo,
        variant,
        num_stages=num_stages,
        mma_rows=mma_rows,
        max_registers=max_registers,
        batch=batch,
        qpk=num_q_heads // num_kv_heads,
        device=device,
        shape_option=any(o is not None for o in (block_n, num_warps, fast_unpack)),
    )
    splits = _default_splits(
        chosen, batch, num_q_heads, num_kv_heads, max_blocks, device, geo.group, block_n, num_warps
    )
    return DecodePlan(chosen, splits)


def _resolve_decode_variant(
    geo: DenseGeometry,
    variant: str,
    prefetch: bool = True,
    num_stages: int | None = None,
    mma_rows: int | None = None,
    max_registers: int | None = None,
    *,
    batch: int = 0,
    qpk: int = 1,
    device: torch.device | None = None,
    shape_option: bool = False,
) -> str:
    """The decode kernel a call runs: ``variant`` checked against the format and the
    variant-only options, ``"auto"`` resolved by :func:`default_decode_variant` (``batch``,
    ``qpk``: query heads per KV head, ``device``, ``shape_option``: its inputs)."""
    if variant != "auto" and variant not in DECODE_VARIANTS:
        raise ValueError(f"variant must be 'auto' or one of {DECODE_VARIANTS}, got {variant!r}")
    if variant == "auto":
        v4_only = (num_stages, mma_rows, max_registers)
        variant = default_decode_variant(
            geo,
            prefetch,
            v4_option=any(o is not None for o in v4_only),
            batch=batch,
            qpk=qpk,
            device=device,
            shape_option=shape_option,
        )
    if variant != "v1" and not prefetch:
        raise ValueError(
            f"prefetch=False applies to variant='v1' only ({variant} pipelines its loads)"
        )
    for option, value, takers in (
        ("num_stages", num_stages, (*V4_VARIANTS, *V5_VARIANTS)),
        ("mma_rows", mma_rows, V4_VARIANTS),
        ("max_registers", max_registers, (*V4_VARIANTS, *V5_VARIANTS)),
    ):
        if variant == "v1" and value is not None:
            raise ValueError(f"{option} applies to the variants {takers} only")
    if variant in FIVE_BIT_VARIANTS:
        if (geo.key_bits, geo.value_bits, geo.group) != (5, 5, 64):
            raise ValueError(
                f"variant={variant!r} takes 5-bit keys and values in 64-token tiles "
                f"(kvarn_k5v5_g64); {geo.fmt.name} is not: use variant='auto'"
            )
    elif variant in (*V4_VARIANTS, *V5_VARIANTS) and not _v4_supports(geo):
        raise ValueError(
            f"variant={variant!r} takes 4-bit keys with 2- or 4-bit values; {geo.fmt.name} has "
            f"k{geo.key_bits}v{geo.value_bits}: use variant='v1'"
        )
    if variant in V5_VARIANTS:
        _check_v5(geo, num_stages, mma_rows, variant, qpk)
    return variant


def _v5_split_factor(
    qpk: int, block_n: int | None, num_warps: int | None, variant: str = "v5"
) -> int:
    """Check a launch's shape options for ``variant`` (one of :data:`V5_VARIANTS`;
    ``ValueError``) and return the factor on its default split count: ``V5_SPLIT_WARPS /
    num_warps``, so that as many warps are in flight as the split rule's 4-warp programs
    give, and :data:`~kvarn_kernels.decode_v5.V5_ONE_WARP_SPLITS` for one-warp programs."""
    from kvarn_kernels.decode_v5 import (
        V5_ONE_WARP_SPLITS,
        V5_SPLIT_WARPS,
        V5_WARP_COUNTS,
        V5_WARPS,
    )

    _check_query_heads_per_kv_head(qpk, variant)
    if block_n is not None:
        raise ValueError(f"block_n does not apply to variant={variant!r} (64-token chunks)")
    if num_warps is not None and num_warps not in V5_WARP_COUNTS:
        raise ValueError(
            f"variant={variant!r} runs {V5_WARP_COUNTS} warps per program, got "
            f"num_warps={num_warps}"
        )
    if variant == "v6t" and num_warps not in (None, 1):
        raise ValueError(f"variant='v6t' runs one warp per program, got num_warps={num_warps}")
    warps = num_warps or V5_WARPS
    return V5_ONE_WARP_SPLITS if warps == 1 else V5_SPLIT_WARPS // warps


def _check_query_heads_per_kv_head(qpk: int, variant: str) -> None:
    """Raise ``ValueError`` where ``variant`` (one of :data:`V5_VARIANTS`) has fewer MMA
    columns (v6) or rows (v5) than ``qpk`` query heads per KV head."""
    from kvarn_kernels.decode_v5 import V5_MAX_QPK
    from kvarn_kernels.decode_v6 import V6_MAX_QPK

    most = V6_MAX_QPK if variant in V6_VARIANTS else V5_MAX_QPK
    if qpk > most:
        raise ValueError(
            f"variant={variant!r} takes up to {most} query heads per KV head, got {qpk}: use "
            "variant='v4c'"
        )


def _check_v5(
    geo: DenseGeometry,
    num_stages: int | None,
    mma_rows: int | None,
    variant: str = "v5",
    qpk: int = 1,
) -> None:
    """Raise ``ValueError`` where ``variant`` (one of :data:`V5_VARIANTS`, the Gluon kernels)
    does not apply: its head dims, ``qpk`` query heads per KV head, the in-cache code order, a
    GPU (Gluon has no interpreter), its stage counts, ``mma_rows`` (v5's tile has the MMA's 16
    rows)."""
    from kvarn_kernels.decode_v5 import V5_HEAD_DIMS, V5_STAGES

    name = repr(variant)
    _check_query_heads_per_kv_head(qpk, variant)
    if geo.head_dim not in V5_HEAD_DIMS:
        raise ValueError(
            f"variant={name} is written for head dims {V5_HEAD_DIMS}, got {geo.head_dim}: use "
            "variant='v4c'"
        )
    orders = (geo.k_order, geo.v_order)
    want = (CodeOrder.TRANSPOSED, CodeOrder.PARITY)
    if variant in FIVE_BIT_VARIANTS:
        want = (CodeOrder.PLANES, CodeOrder.PLANES_PAIRED)
    if orders != want:
        raise ValueError(
            f"variant={name} reads the in-cache code order (docs/format.md §7.1), which "
            f"{geo.fmt.name} does not use: use variant='v4c'"
        )
    if triton_interpret():  # GPU_ONLY_DECODE_VARIANTS
        raise ValueError(
            f"variant={name} is a Gluon kernel, which the Triton interpreter (TRITON_INTERPRET=1) "
            "cannot run: use variant='v4c'"
        )
    if mma_rows is not None:
        raise ValueError(f"mma_rows applies to the variants {V4_VARIANTS} only, not {name}")
    if num_stages is not None and num_stages not in V5_STAGES:
        raise ValueError(
            f"variant={name} pipelines {V5_STAGES} stages, got num_stages={num_stages}"
        )
    if variant == "v6t" and num_stages not in (None, 2):
        raise ValueError(f"variant='v6t' pipelines 2 stages, got num_stages={num_stages}")


def _check_varlen(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[DenseGeometry, torch.Tensor]:
    """:func:`_check_common` for ``[T, Hq, D]`` queries grouped by ``query_start_loc``."""
    geo, out = _check_common(
        fmt, q, kv_cache, pool_k, pool_v, block_table, seq_lens, block_to_slot, out, "[T, Hq, D]"
    )
    check_index_tensor("query_start_loc", query_start_loc, 1, "[B + 1]")
    if query_start_loc.shape[0] != block_table.shape[0] + 1:
        raise ValueError(
            f"query_start_loc must have B + 1 = {block_table.shape[0] + 1} entries; got "
            f"{query_start_loc.shape[0]}"
        )
    check_device(q.device, query_start_loc=query_start_loc)
    return geo, out


def verify_token_groups(num_q_heads: int, num_kv_heads: int, max_query_len: int) -> int:
    """Programs per (request, KV head, split) of :func:`verify_attention`'s v4 kernels: as
    many of a request's query tokens share one program as fill the 16 MMA rows that decode
    pads its ``Hq / Hk`` query heads to (4 tokens at GQA 4, 2 at GQA 8, 1 from GQA 16)."""
    return -(-max_query_len // _verify_tokens_per_program(num_q_heads // num_kv_heads))


def _mma_rows(qpk: int) -> int:
    """Query rows of a decode program: its ``qpk`` heads padded to the MMA's 16 or more."""
    return max(16, next_pow2(qpk))


def decode_mma_rows(qpk: int, *, verify: bool = False) -> int:
    """Query rows of a v4 decode program by default (``mma_rows=None``): the ``qpk`` query
    heads of a KV head padded to 8, not to the MMA's 16 (Triton pads inside the MMA, and the
    smaller tile frees registers: the tenth session's static count took k4v2_g128's spill
    from 760 to 220 bytes). The H200 (eleventh session, kernel check, 16K, µs per layer, v4c
    with 16 rows vs 8): k4v2_g128 B = 64 888 vs 677, B = 256 3,186 vs 2,577; k4v4_g128 867
    vs 735, 3,415 vs 3,172; k4v2_g64 842 vs 651; head dim 256 4,825 vs 4,020.
    ``verify`` (speculative verify's programs): 16 or more rows, which its extra query
    tokens fill (:func:`verify_token_groups`)."""
    return _mma_rows(qpk) if verify else max(8, next_pow2(qpk))


def _verify_tokens_per_program(qpk: int) -> int:
    return max(1, _mma_rows(qpk) // qpk)


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "width"])
def _verify_rows_kernel(
    BLOCK_TABLE,
    QSL,
    SEQ_LENS,
    ROW_TABLE,
    ROW_LENS,
    num_tokens,
    num_reqs,
    width,
    stride_bt,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """:func:`verify_rows` for ``BLOCK_T`` tokens and ``BLOCK_W`` block-table columns: the
    token's request is the number of request ends at or before it (clamped to the last),
    counted ``BLOCK_R`` requests at a time."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < num_tokens
    owner = tl.zeros([BLOCK_T], dtype=tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ends = tl.load(QSL + 1 + r, mask=r < num_reqs, other=2147483647)
        owner += tl.sum((ends[None, :] <= tok[:, None]).to(tl.int32), axis=1)
    owner = tl.minimum(owner, num_reqs - 1)
    if tl.program_id(1) == 0:
        end = tl.load(QSL + 1 + owner, mask=t_ok, other=0)
        lens = tl.load(SEQ_LENS + owner, mask=t_ok, other=0) - (end - 1 - tok)
        lens = tl.where(tok < tl.load(QSL + num_reqs), lens, 0)  # a padded batch's tail: 0
        tl.store(ROW_LENS + tok, lens.to(tl.int32), mask=t_ok)
    col = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = t_ok[:, None] & (col < width)[None, :]
    src = BLOCK_TABLE + owner.to(tl.int64)[:, None] * stride_bt + col[None, :]
    dst = ROW_TABLE + tok.to(tl.int64)[:, None] * width + col[None, :]
    tl.store(dst, tl.load(src, mask=ok), mask=ok)


def verify_rows(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify batch as decode rows, one per query token: the block-table row of the token's
    request and the length up to and including the token (token ``i`` of ``n`` of a request
    of ``L`` tokens sees ``L - n + i + 1``). Tokens past ``query_start_loc[B]`` (a padded
    batch's tail) get length 0, i.e. zero rows. One launch (it runs in every layer's verify
    call: torch's eight small ops took 10-17 µs of a 65 µs pass at B = 1, H100), no host
    sync."""
    width = int(block_table.shape[1])
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    table = block_table.new_empty((num_tokens, width))
    lens = torch.empty(num_tokens, dtype=torch.int32, device=block_table.device)
    reqs = int(query_start_loc.shape[0]) - 1
    if reqs == 0:  # no requests: every token is tail
        return table.zero_(), lens.zero_()
    if num_tokens == 0:
        return table, lens
    block_w = 128
    launch(
        _verify_rows_kernel,
        (cdiv(num_tokens, 16), max(1, cdiv(width, block_w))),
        (
            block_table,
            query_start_loc,
            seq_lens,
            table,
            lens,
            num_tokens,
            reqs,
            width,
            block_table.stride(0),
        ),
        {"BLOCK_T": 16, "BLOCK_R": 64, "BLOCK_W": block_w},
        num_warps=4,
    )
    return table, lens


def verify_attention(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    variant: str = "auto",
    check: bool | None = None,
    batch_plan: VerifyBatchPlan | None = None,
) -> torch.Tensor:
    """Speculative verify: a few query tokens per request (1 + drafts), causal, in one pass.

    The same attention as :func:`prefill_attention` (query ``i`` of a request's ``n`` sits at
    position ``seq_lens[r] - n + i`` and sees every position up to its own; their K/V already
    in the side pool), for batches of at most ``max_query_len`` query tokens per request,
    computed by the decode kernel with each request's query tokens in the MMA rows that
    decode pads with zeros: the context is read once per request (and per
    :func:`verify_token_groups` group of its tokens), not once per token. No host sync, no
    data-dependent host logic; ``seq_lens`` may be device-only (vLLM's host lengths of verify
    rows can be optimistic under async scheduling).

    Args:
        q: ``[T, Hq, D]`` fp16/bf16, unrotated; request ``r``'s tokens are rows
            ``query_start_loc[r] .. query_start_loc[r + 1] - 1``.
        query_start_loc: ``[B + 1]`` int32 cumulative query counts, ``qsl[B] <= T``: the
            rows of tokens past ``qsl[B]`` (the tail of a batch padded for a CUDA graph,
            whose padding requests have no tokens) come out as zeros.
        seq_lens: ``[B]`` int32 tokens of each request including its query tokens.
        max_query_len: the most query tokens any request has (a compile-time bound: pass the
            server's fixed 1 + drafts). Checked against ``query_start_loc`` only with
            ``check`` (that reads it on the host); the rows of a request's tokens past it
            would hold garbage.
        workspace: optional fp32, ``decode_workspace_numel(T, Hq, D, num_splits)`` elements.
        variant: as :func:`decode_attention`; with ``"v1"`` (the formats and head dims v4
            does not read) every query token is attended as its own decode row
            (:func:`verify_rows`), which reads the context once per token.
        check: ``True`` (or env ``KVARN_KERNELS_DEBUG=1``) reads ``query_start_loc`` on the
            host and raises if it is not non-decreasing from 0 to at most ``T`` or a request
            has more than ``max_query_len`` tokens (a host sync: keep it off under CUDA-graph
            capture).
        fmt, kv_cache, pool_k, pool_v, block_table, block_to_slot, softmax_scale, out,
            num_splits: as :func:`decode_attention`.
        batch_plan: the batch's :class:`kvarn_kernels.VerifyBatchPlan`
            (:func:`kvarn_kernels.plan_verify_batch`), shared by the layers of a step: pass its
            own index tensors and ``max_query_len``, and no ``variant``, ``num_splits`` or
            ``workspace`` (the plan holds them). A layout's first call is checked as an
            unplanned one (and works out the tokens' decode rows for v1 and v7 once); later
            layers only launch.

    Returns ``[T, Hq, D]`` in q's dtype, unrotated.
    """
    if batch_plan is not None:
        if workspace is not None or num_splits is not None or variant != "auto":
            raise ValueError(
                "with a batch_plan, pass variant, num_splits and workspace to "
                "plan_verify_batch instead"
            )
        if max_query_len != batch_plan.max_query_len:
            raise ValueError(
                f"max_query_len={max_query_len} but the batch_plan was built for "
                f"{batch_plan.max_query_len}"
            )
        return batch_plan.attend(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            (block_table, query_start_loc, seq_lens, block_to_slot),
            softmax_scale,
            out,
        )
    setup = _verify_setup(
        fmt,
        q,
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        query_start_loc,
        seq_lens,
        block_to_slot,
        softmax_scale,
        out,
        workspace,
        max_query_len=max_query_len,
        num_splits=num_splits,
        variant=variant,
        check=check,
    )
    launches = _verify_launches(
        setup,
        q,
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        query_start_loc,
        seq_lens,
        block_to_slot,
        softmax_scale,
        max_query_len,
    )
    if launches is not None:
        launches.run(q.device)
    return setup.out


@dataclass(frozen=True)
class _VerifySetup:
    """A verify call's checked inputs and choices (:func:`_verify_setup`)."""

    geo: DenseGeometry
    out: torch.Tensor
    variant: str
    num_splits: int
    workspace: torch.Tensor
    #: v1 and v7: the decode rows of the tokens (:func:`verify_rows`: their block-table rows
    #: and lengths), worked out once per batch; None for the v4 kernels
    rows: tuple[torch.Tensor, torch.Tensor] | None


def _verify_setup(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None,
    workspace: torch.Tensor | None,
    *,
    max_query_len: int,
    num_splits: int | None,
    variant: str,
    check: bool | None = None,
) -> _VerifySetup:
    """:func:`verify_attention`'s checks, kernel, split count, output and workspace (allocated
    where not given), and for the v1 and v7 kernels the tokens' decode rows (a launch)."""
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    geo, out = _check_varlen(
        fmt, q, kv_cache, pool_k, pool_v, block_table, query_start_loc, seq_lens, block_to_slot, out
    )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    t, hq, d = (int(s) for s in q.shape)
    hk = int(pool_k.shape[2])
    variant = _resolve_verify_variant(geo, variant, hq // hk, q.device)
    if debug_checks_enabled(check):
        starts = query_start_loc.tolist()
        counts = [b - a for a, b in pairwise(starts)]
        if starts[0] != 0 or starts[-1] > t or min(counts, default=0) < 0:
            raise ValueError(
                f"query_start_loc must be non-decreasing from 0 to at most T = {t}; got {starts}"
            )
        if max(counts, default=0) > max_query_len:
            raise ValueError(
                f"a request has {max(counts)} query tokens but max_query_len = {max_query_len}"
            )
    # verify_plan's count (the warm-up compiles what it selects)
    splits = num_splits or _verify_splits(
        variant,
        geo,
        int(block_table.shape[0]),
        hq,
        hk,
        max_query_len,
        int(block_table.shape[1]),
        q.device,
    )
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    rows = None
    if variant == "v1" or variant in FIVE_BIT_VARIANTS:  # one decode row per query token
        rows = verify_rows(block_table, query_start_loc, seq_lens, t)
    need = decode_workspace_numel(t, hq, d, decode_partials(variant, splits))
    return _VerifySetup(geo, out, variant, splits, _workspace(workspace, need, q.device), rows)


def _verify_launches(
    setup: _VerifySetup,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    max_query_len: int,
) -> _AttentionLaunches | None:
    """The launches of a verify call set up by :func:`_verify_setup`, not yet run."""
    variant = setup.variant
    table, lens = setup.rows or (block_table, seq_lens)
    # v1: each token a decode row; v4: a request's tokens in the MMA rows; v7: side by side
    # in its columns
    starts = None if variant == "v1" else query_start_loc
    options: dict[str, Any] = {}
    if variant in FIVE_BIT_VARIANTS:
        qpk = int(q.shape[1]) // int(pool_k.shape[2])
        options["tokens_per_program"] = _v7_verify_tokens(qpk, max_query_len)
    return _attention_launches(
        setup.geo,
        _q_for_kernel(q),
        kv_cache,
        pool_k,
        pool_v,
        table,
        lens,
        block_to_slot,
        starts,
        softmax_scale,
        setup.out,
        setup.workspace,
        setup.num_splits,
        True,
        None,
        None,
        variant=variant,
        max_query_len=1 if starts is None else max_query_len,
        **options,
    )


def prefill_attention(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    fast_unpack: bool | None = None,
    prefetch: bool = True,
    block_m: int | None = None,
    method: str = "dequant",
    fused_kernel: str = "auto",
    sdpa_backend: str = "auto",
    seq_lens_cpu: Sequence[int] | None = None,
    query_start_loc_cpu: Sequence[int] | None = None,
    max_workspace_bytes: int | None = None,
    varlen_attention: VarlenAttention | None = None,
    context_plan: ContextPlan | None = None,
    fused_plan: FusedPrefillPlan | None = None,
) -> torch.Tensor:
    """Causal attention of several query tokens per request over cached context.

    The chunk's own K/V must already be in the side pool (:func:`write_side_pool` runs
    first). Query ``i`` of request ``r`` (``q_len = qsl[r+1] - qsl[r]``) sits at position
    ``seq_lens[r] - q_len + i`` and attends to every position up to its own, read from the pool
    or from packed records. Covers chunked-prefill continuation, prefix-cache hits and
    speculative verify.

    Two methods compute it:

    * ``"dequant"`` (default, :mod:`kvarn_kernels.context`): one Triton launch dequantizes the
      context of every request into an fp16 workspace (records decoded, pool blocks copied),
      then FlashAttention (torch's varlen flash forward; ``scaled_dot_product_attention`` per
      request where that is unavailable) runs on it. Prefill is compute-bound, so
      materializing the context costs ~1% and the attention runs at library speed. It reads
      ``seq_lens`` and ``query_start_loc`` on the host: pass ``seq_lens_cpu`` and
      ``query_start_loc_cpu`` to avoid the device-to-host copy (not CUDA-graph capturable).
    * ``"fused"``: one kernel reads the records in its attention loop (no workspace, no host
      sync), split over the context, and a second merges the splits. It unpacks the context
      once per query tile, so it is for short chunks after a long context (an agent's turn),
      where the dequantize path spends more on the fp16 context than on the attention.
      ``fused_kernel`` picks the kernel: ``"v3"`` (:mod:`kvarn_kernels.prefill_v3`: Gluon,
      producer warps dequantizing the next chunks while consumer warpgroups run the
      wgmma and the softmax (64-row tiles: one partition); sm_90, 4-bit keys with
      2- or 4-bit values, head_dim 128), ``"v4"`` (:mod:`kvarn_kernels.prefill_v4`: Gluon,
      64-row tiles, no producer warps: each warpgroup dequantizes the codes in its registers
      as the wgmma operand of transposed scores; sm_90, 4-bit keys with 2-bit values,
      head_dim 128; not yet chosen by ``"auto"``), ``"v2"``
      (:mod:`kvarn_kernels.prefill_v2`: Triton, each chunk dequantized once per 128-row
      tile, head_dim <= 256), ``"v1"`` (the decode kernel's prefill mode, scales folded into
      64-row query tiles; every head dim), ``"auto"`` (the first of v3, v2, v1 that takes
      the call). On an H200 at 64 tokens after 16K of context v3 takes 1.53x FA3 fp16's GPU
      time and the dequantize path 1.73x, and eagerly 0.58x the dequantize path's time;
      :func:`prefill_method` picks the faster method for a batch (docs/benchmarks.md).

    Args:
        q: ``[T, Hq, D]`` fp16/bf16, unrotated.
        query_start_loc: ``[B + 1]`` int32 cumulative query counts (``qsl[B] == T``).
        seq_lens: ``[B]`` int32 total tokens of each request after this chunk.
        workspace: ``"fused"`` only: optional fp32,
            ``decode_workspace_numel(T, Hq, D, num_splits)`` elements.
        num_splits, block_n, num_warps, prefetch, block_m: ``"fused"`` only. ``num_splits``:
            split-K factor over the context (default: v2 and v3 :func:`prefill_v2_splits`, v1
            1); ``block_m``: query rows (tokens x GQA heads) per program (v2 and v3: default
            128, 64 above head dim 128; v3 takes 64 or 128; v1: default 64, 32 for D > 128,
            128 was slower on an H200 and does not compile at D = 256); ``block_n``,
            ``num_warps``: v1 and v2; ``prefetch=False``: v1 only.
        fused_kernel: ``"fused"`` only: ``"auto"``, ``"v1"``, ``"v2"``, ``"v3"`` or ``"v4"``
            (above).
        fast_unpack: as :func:`decode_attention` (both methods).
        method: ``"dequant"`` or ``"fused"`` (above).
        sdpa_backend: ``"dequant"`` only: ``"auto"`` (varlen FlashAttention on CUDA for
            head_dim <= 256, else per request), ``"varlen"`` or ``"per_request"``.
        seq_lens_cpu, query_start_loc_cpu: ``"dequant"`` only: host copies of ``seq_lens``
            and ``query_start_loc`` (sequences of ints); read back from the device if absent.
        max_workspace_bytes: ``"dequant"`` only: cap of the dequantized K+V workspace
            (default 512 MiB); requests are processed in groups under it, and a single
            request above it alone. The workspace holds ``4 * Hk * D`` bytes per context
            token of the group.
        varlen_attention: ``"dequant"`` only: a FlashAttention-style varlen forward to run on
            the dequantized workspace instead of torch's (see
            :data:`kvarn_kernels.context.VarlenAttention`; e.g. vLLM's FlashAttention-3, which
            the plugin passes). Overrides ``sdpa_backend``.
        context_plan: ``"dequant"`` only: the batch's
            :func:`~kvarn_kernels.context.plan_prefill_context`, built once and shared by the
            layers of a step (it replaces ``seq_lens_cpu``, ``query_start_loc_cpu`` and
            ``max_workspace_bytes``, and saves each call the planning and its host-to-device
            copy). It must describe this call's batch: shapes are checked, the lengths on
            the device are not (that would need a host sync).
        fused_plan: ``"fused"`` only: the batch's
            :func:`~kvarn_kernels.fused_prefill.plan_fused_prefill`, built once from its
            ``block_table``, ``query_start_loc``, ``seq_lens`` and ``block_to_slot`` (pass
            those very tensors) and shared by the layers of a step: each layer's call then
            skips the checks, the kernel choice and the launch set-up its layout's first
            call did (it takes ``fused_kernel``, ``num_splits`` and ``block_m``; calls
            sharing it must run on one stream).
        other arguments: as :func:`decode_attention`.

    Returns ``[T, Hq, D]`` in q's dtype, unrotated.
    """
    if method not in ("dequant", "fused"):
        raise ValueError(f"method must be 'dequant' or 'fused', got {method!r}")
    if fused_plan is not None and method != "fused":
        raise ValueError("fused_plan applies to method='fused' only")
    if method == "dequant":
        fused_only = {
            "workspace": workspace is not None,
            "num_splits": num_splits is not None,
            "block_n": block_n is not None,
            "num_warps": num_warps is not None,
            "prefetch": not prefetch,
            "block_m": block_m is not None,
            "fused_kernel": fused_kernel != "auto",
        }
        bad = [k for k, v in fused_only.items() if v]
        if bad:
            raise ValueError(
                f"{', '.join(bad)} apply to method='fused' only; drop them or pass method='fused'"
            )
        from kvarn_kernels.context import (
            DEFAULT_MAX_WORKSPACE_BYTES,
            SDPA_BACKENDS,
            plan_prefill_context,
            prefill_dequant_attention,
        )

        if sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {SDPA_BACKENDS}, got {sdpa_backend!r}")
        geo, out = _check_varlen(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            query_start_loc,
            seq_lens,
            block_to_slot,
            out,
        )
        t, d = int(q.shape[0]), int(q.shape[2])
        hk = int(pool_k.shape[2])
        if context_plan is None:
            context_plan = plan_prefill_context(
                geo.group,
                seq_lens.tolist() if seq_lens_cpu is None else seq_lens_cpu,
                query_start_loc.tolist() if query_start_loc_cpu is None else query_start_loc_cpu,
                num_kv_heads=hk,
                head_dim=d,
                device=q.device,
                max_workspace_bytes=(
                    DEFAULT_MAX_WORKSPACE_BYTES
                    if max_workspace_bytes is None
                    else max_workspace_bytes
                ),
            )
            if context_plan.num_tokens != t:
                raise ValueError(
                    f"query_start_loc must have B + 1 entries from 0 to T = {t}; got "
                    f"{list(context_plan.query_start_loc)}"
                )
        elif (seq_lens_cpu, query_start_loc_cpu, max_workspace_bytes) != (None, None, None):
            raise ValueError(
                "context_plan replaces seq_lens_cpu, query_start_loc_cpu and "
                "max_workspace_bytes: pass them to plan_prefill_context instead"
            )
        context_plan.check_call(geo.group, hk, d, q, block_table)
        if t:
            prefill_dequant_attention(
                geo,
                _q_for_kernel(q),
                kv_cache,
                pool_k,
                pool_v,
                block_table,
                block_to_slot,
                softmax_scale,
                out,
                context_plan,
                sdpa_backend=sdpa_backend,
                varlen_attention=varlen_attention,
            )
        return out
    if (
        sdpa_backend != "auto"
        or seq_lens_cpu is not None
        or query_start_loc_cpu is not None
        or max_workspace_bytes is not None
        or varlen_attention is not None
        or context_plan is not None
    ):
        raise ValueError(
            "sdpa_backend, seq_lens_cpu, query_start_loc_cpu, max_workspace_bytes, "
            "varlen_attention and context_plan apply to method='dequant' only"
        )
    from kvarn_kernels.fused_prefill import FusedPrefillPlan

    if fused_plan is None:
        fused_plan = FusedPrefillPlan(
            block_table,
            query_start_loc,
            seq_lens,
            block_to_slot,
            fused_kernel=fused_kernel,
            num_splits=num_splits,
            block_m=block_m,
            block_n=block_n,
            num_warps=num_warps,
            fast_unpack=fast_unpack,
            prefetch=prefetch,
            workspace=workspace,
        )
    elif (
        any(
            x is not None for x in (workspace, num_splits, block_n, num_warps, fast_unpack, block_m)
        )
        or not prefetch
        or fused_kernel != "auto"
    ):
        raise ValueError(
            "with a fused_plan, pass fused_kernel, num_splits and block_m to "
            "plan_fused_prefill instead (workspace, block_n, num_warps, fast_unpack and "
            "prefetch do not apply)"
        )
    return fused_plan.attend(
        fmt,
        q,
        kv_cache,
        pool_k,
        pool_v,
        block_table,
        query_start_loc,
        seq_lens,
        block_to_slot,
        softmax_scale,
        out,
    )


#: The largest head dim :mod:`kvarn_kernels.prefill_v2` takes (its ``[rows, D]`` fp32
#: accumulator).
PREFILL_V2_MAX_HEAD_DIM = 256


def prefill_v2_splits(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    num_sms: int,
    *,
    block_m: int = 128,
) -> int:
    """The fused prefill's split count over the context (host shapes only): about one
    program per SM (a program holds ``block_m`` query rows and a split's whole
    context; a second wave would take a whole split's time again), at least 4 context blocks
    per split, at most 64 splits, a power of two (each value is a compile of both kernels).
    Query tiles are counted as ``cdiv(T, tokens per tile)``, exact for one request and for
    requests of whole tiles."""
    qpk_p = next_pow2(num_q_heads // num_kv_heads)
    tiles = cdiv(num_tokens, max(block_m // qpk_p, 1))
    progs = max(1, tiles * num_kv_heads)
    want = cdiv(num_sms, progs)
    cap = max(1, cdiv(max_blocks, 4))
    splits = int(max(1, min(want, cap, 64)))
    return 1 << (splits.bit_length() - 1)


def fused_prefill_splits(
    kernel: str,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    num_sms: int,
    head_dim: int,
    *,
    block_m: int | None = None,
) -> int:
    """The default split count of fused prefill kernel ``kernel`` (``"v1"`` .. ``"v4"``):
    :func:`prefill_v2_splits` at v2's and v3's tile (``block_m``, default
    :func:`~kvarn_kernels.prefill_v2.default_block_m`) or v4's (64 rows,
    :data:`~kvarn_kernels.prefill_v4.V4_PROGRAMS_PER_SM` programs an SM); v1 runs one."""
    if kernel in ("v2", "v3"):
        from kvarn_kernels.prefill_v2 import default_block_m

        rows = block_m or default_block_m(head_dim)
        return prefill_v2_splits(
            num_tokens, num_q_heads, num_kv_heads, max_blocks, num_sms, block_m=rows
        )
    if kernel == "v4":
        from kvarn_kernels.prefill_v4 import V4_PROGRAMS_PER_SM

        sms = num_sms * V4_PROGRAMS_PER_SM
        return prefill_v2_splits(num_tokens, num_q_heads, num_kv_heads, max_blocks, sms, block_m=64)
    return 1


def _workspace(ws: torch.Tensor | None, need: int, device: torch.device) -> torch.Tensor:
    if ws is None:
        return torch.empty(need, dtype=torch.float32, device=device)
    if ws.dtype != torch.float32 or not ws.is_contiguous() or ws.numel() < need:
        raise ValueError(
            f"workspace must be a contiguous fp32 tensor of at least {need} elements "
            f"(decode_workspace_numel; for decode, of decode_plan(...).partials); got "
            f"{str(ws.dtype).removeprefix('torch.')} with "
            f"{ws.numel()} elements"
        )
    if ws.device != device:
        raise ValueError(f"workspace is on {ws.device} but q is on {device}")
    return ws.view(-1)
