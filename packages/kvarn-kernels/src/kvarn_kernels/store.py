# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels and their @triton.jit helpers are untyped by nature; the public
# wrappers in this module are fully annotated.)
"""Store (flush): quantize full tiles of rotated fp16 tokens into packed records, one launch.

For every ``(tile n, KV head h)`` one program quantizes the K tile and another the V tile and
writes the record at ``kv_cache[dst_blocks[n], h]``; the whole batch is one launch, grid
``(N, Hk, 2)``. The source is addressed by token rows of a ``[rows, Hk, D]`` fp16 tensor:

* :func:`flush_tiles` reads side-pool slots (slot ``s`` is row ``s * G`` of the pool viewed as
  ``[num_slots * G, Hk, D]``): tiles that filled up in the pool over several steps;
* :func:`flush_token_tiles` reads a step's rotated K/V directly (tile ``n`` = rows
  ``row_starts[n] ...``), optionally opening with rows already in a pool slot: the tiles a
  prefill chunk completes, quantized in the step that writes them (kvarn-vllm's direct
  flush), so they never take a pool slot.

Both run the same kernel, so their records are byte-identical on the same data. The code
bytes are written in the in-cache order of docs/format.md §7.1 (the decode kernels' operand
order); ``kvarn_format.from_cache_order`` gives the reference codec's records.

Shadow rows: a side pool may hold ``G - R`` rows per slot, each pool tile's first ``R`` rows
(K and V) living in the idle record area of the tile's own block
(:func:`kvarn_format.geometry.shadow_rows`, :func:`kvarn_kernels._common.pool_row_ptrs`). A
flush reads those rows from the block it writes the record into, so it overwrites its own
input: every program loads its whole tile before it stores anything (a CTA barrier between
the two), and the K and V halves of one ``(block, head)`` record, which are separate programs,
run as two launches ordered so that the first never writes the second's shadow rows
(:func:`_shadow_parts`). ``R = 0`` is the one-launch kernel with the old addressing.

The arithmetic mirrors the reference codec
(:mod:`kvarn_format.reference`) operation by operation, in the same order and with
correctly-rounded fp32 division, square root, exp and log:

1. Sinkhorn with best-imbalance tracking in the log domain (two-pass unbiased stds, column
   update then row update, ``<=`` keeps the later state);
2. the best scales rounded to fp16, the tile divided by them;
3. min/max RTN per row, round half to even;
4. the RTN step and minimum absorbed into the row scale, the power-of-two overflow guard,
   fp16 fields, codes packed LSB-first (a dense bitstream for 5 bits).

The one difference is the order of the fp32 sums inside a standard deviation (a tree across
threads on the GPU, NumPy's pairwise/sequential order in the reference). It moves a std by an
ulp or so, which can move a stored fp16 scale by one ulp and then flip codes of that tile; the
tests measure how often and bound the dequantized difference. Under ``TRITON_INTERPRET=1`` the
sums are NumPy's own and the records are byte-identical.

The tile lives in registers, which covers ``D * G <= 256 * 128``. Head dim 512 goes through
the same algorithm written with batched torch ops (:func:`_flush_torch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from triton.language.extra import libdevice  # type: ignore[import-untyped]

from kvarn_format import DenseFormat, record_layout
from kvarn_format.registry import KVarNFormat
from kvarn_kernels._common import (
    DenseGeometry,
    check_device,
    check_dtype,
    check_head_dim,
    check_index_tensor,
    check_ndim,
    code_offsets,
    code_offsets_of_pair,
    codes_to_cache_order,
    debug_checks_enabled,
    dense_geometry,
    next_pow2,
    pool_row_ptrs,
    pool_shadow_rows,
    resolve_format,
    triton_interpret,
)
from kvarn_kernels._launch import launch

__all__ = ["flush_tiles", "flush_token_tiles"]

_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)

#: Store variants (the ``variant`` argument): all write records in the same format. v1 follows
#: the reference operation by operation; v3 takes fewer instructions per Sinkhorn iteration at
#: the price of fp32-rounding differences in the stds (bounded by the tests). (v2, one-pass
#: pivoted stds, slower than v3 on the H200 since the fourth session, was removed in the
#: thirteenth.)
#: v4, the default since the thirteenth session, computes v3's values with fewer
#: instructions: the per-row and per-column work once per entry, and the divisions through
#: shared reciprocals (H200, 1024 tiles x 8 heads: 3.6 ms against v3's 5.9 and v1's 8.6 at
#: k4v2_g128, 1.5 against 2.7 at k4v2_g64; docs/kernel-notes.md, store round 5).
STORE_VARIANTS = ("v1", "v3", "v4")

#: 5-bit codes written as 32-bit words (five per 32 codes) instead of five byte stores per 8
#: codes: 40 word stores a program for 160 byte stores (docs/kernel-notes.md, thirty-third
#: and thirty-fourth sessions). The default since the thirty-fourth: byte-identical records
#: on an H100 at the table's size and in the store tests, and ``kvarn_k5v5_g64``'s store
#: 0.78x the byte stores' time (1,616 against 2,063 µs for 1024 tiles x 8 heads; 1.09x the
#: 4-bit ``kvarn_k4v4_g64``'s, from 1.40x). False gives the byte stores back.
STORE_5BIT_WORDS = True


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    y = libdevice.exp(x) if PRECISE else tl.exp(x)
    return y


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    y = libdevice.log(x) if PRECISE else tl.log(x)
    return y


@triton.jit
def _log2(x, PRECISE: tl.constexpr):
    y = libdevice.log2(x) if PRECISE else tl.log2(x)
    return y


@triton.jit
def _std(x, AXIS: tl.constexpr, N: tl.constexpr):
    """Unbiased std along AXIS in two passes, as the reference (mean, then centred squares)."""
    mean = tl.div_rn(tl.sum(x, axis=AXIS), float(N))
    centred = x - mean[None, :] if AXIS == 0 else x - mean[:, None]
    var = tl.div_rn(tl.sum(centred * centred, axis=AXIS), float(N - 1))
    return tl.sqrt_rn(var)


@triton.jit
def _ratio(std):
    return tl.div_rn(tl.max(std, axis=0), tl.maximum(tl.min(std, axis=0), 1e-8))


@triton.jit
def _log_step(log_s, std, PRECISE: tl.constexpr):
    clamped = tl.minimum(tl.maximum(std, 1e-3), 1e3)
    return tl.minimum(tl.maximum(log_s + _log(clamped, PRECISE), -0.3), 10.0)


@triton.jit
def _to_f16(x):
    return tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX).to(tl.float16)


@triton.jit
def _sinkhorn_v1(x, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, PRECISE: tl.constexpr):
    """Best-imbalance Sinkhorn log-scales of ``x [R, C]`` (reference: sinkhorn_batched),
    operation by operation: two-pass stds, separate max and min reductions."""
    col_std = _std(x, 0, R)
    best = _ratio(col_std) + _ratio(_std(x, 1, C))
    log_c = tl.zeros([C], dtype=tl.float32)
    log_r = tl.zeros([R], dtype=tl.float32)
    best_c = tl.zeros([C], dtype=tl.float32)
    best_r = tl.zeros([R], dtype=tl.float32)
    for _ in range(ITERS):
        log_c = _log_step(log_c, col_std, PRECISE)
        inv_c = _exp(-log_c, PRECISE)
        inv_r = _exp(-log_r, PRECISE)
        cur = x * inv_c[None, :]
        cur = cur * inv_r[:, None]
        log_r = _log_step(log_r, _std(cur, 1, C), PRECISE)
        inv_r = _exp(-log_r, PRECISE)
        cur = x * inv_c[None, :]
        cur = cur * inv_r[:, None]
        col_std = _std(cur, 0, R)
        score = _ratio(col_std) + _ratio(_std(cur, 1, C))
        take = score <= best
        best = tl.where(take, score, best)
        best_c = tl.where(take, log_c, best_c)
        best_r = tl.where(take, log_r, best_r)
    return best_c, best_r


@triton.jit
def _add2(a_s, a_q, b_s, b_q):
    return a_s + b_s, a_q + b_q


@triton.jit
def _maxmin(a_hi, a_lo, b_hi, b_lo):
    return tl.maximum(a_hi, b_hi), tl.minimum(a_lo, b_lo)


@triton.jit
def _std_of_deviations(d, pivot, AXIS: tl.constexpr, N: tl.constexpr, FUSED: tl.constexpr):
    """``(std, mean)`` along AXIS from the deviations ``d`` of the values from ``pivot``."""
    if FUSED:
        s, q = tl.reduce((d, d * d), AXIS, _add2)
    else:
        # Triton's interpreter runs a custom combine element by element (minutes per tile);
        # separate reductions compute the same values.
        s = tl.sum(d, axis=AXIS)
        q = tl.sum(d * d, axis=AXIS)
    mean_d = s * (1.0 / N)  # N is a power of two: exact
    var = tl.maximum(q - s * mean_d, 0.0) * (1.0 / (N - 1))
    return tl.sqrt_rn(var), pivot + mean_d


@triton.jit
def _imbalance_ratio(std, FUSED: tl.constexpr):
    """``max / max(min, 1e-8)`` with max and min in one reduction."""
    if FUSED:
        hi, lo = tl.reduce((std, std), 0, _maxmin)
    else:
        hi = tl.max(std, axis=0)
        lo = tl.min(std, axis=0)
    return tl.div_rn(hi, tl.maximum(lo, 1e-8))


@triton.jit
def _std_mean(x, AXIS: tl.constexpr, N: tl.constexpr):
    """:func:`_std` (two passes, the reference's arithmetic) that also returns the mean."""
    mean = tl.sum(x, axis=AXIS) * (1.0 / N)  # N is a power of two: exactly the division
    centred = x - mean[None, :] if AXIS == 0 else x - mean[:, None]
    var = tl.div_rn(tl.sum(centred * centred, axis=AXIS), float(N - 1))
    return tl.sqrt_rn(var), mean


@triton.jit
def _scaled_std(x, scale, pivot, AXIS: tl.constexpr, N: tl.constexpr, FUSED: tl.constexpr):
    """Unbiased std along AXIS of ``x * scale`` (``scale`` runs along AXIS), in one pass.

    One fused multiply-add per element forms ``d = x * scale - pivot`` (``pivot`` runs along
    the other axis), and one reduction sums ``(d, d^2)``: 3 instructions per element, the
    scaled tile is never stored. Exact in real arithmetic for any pivot; in fp32 it loses
    ``~log2(1 + (mean - pivot)^2 / var)`` bits, nothing for a pivot near the mean. Returns
    ``(std, mean)``.
    """
    d = x * scale[None, :] - pivot[:, None] if AXIS == 1 else x * scale[:, None] - pivot[None, :]
    return _std_of_deviations(d, pivot, AXIS, N, FUSED)


@triton.jit
def _additive_mean(own_mean, other_dev, scale, N: tl.constexpr, FUSED: tl.constexpr):
    """Means along the scaled axis of ``x * scale`` if ``x`` were exactly additive,
    ``x[i, j] = own_mean[i] + other_dev[j]``: ``own_mean * mean(scale) + mean(other_dev *
    scale)``, from two vector sums. A pivot for :func:`_scaled_std` that follows a new
    scaling exactly on offset-dominated rows/columns (K channels with large means), where a
    stale pivot would cost the one-pass variance most of its bits."""
    if FUSED:
        s, t = tl.reduce((scale, other_dev * scale), 0, _add2)
    else:
        s = tl.sum(scale, axis=0)
        t = tl.sum(other_dev * scale, axis=0)
    return own_mean * (s * (1.0 / N)) + t * (1.0 / N)


@triton.jit
def _sinkhorn_v3(
    x,
    R: tl.constexpr,
    C: tl.constexpr,
    ITERS: tl.constexpr,
    PRECISE: tl.constexpr,
    FUSED: tl.constexpr = True,
    ADDITIVE_PIVOT: tl.constexpr = True,
    COMPACT: tl.constexpr = False,
    SCR=None,
    ok=True,
    MASKED: tl.constexpr = False,
):
    """:func:`_sinkhorn_v1`'s iteration with two tile statistics instead of three.

    Stds are positively homogeneous: for ``cur = x * inv_c[None, :] * inv_r[:, None]``,
    ``rowstd(cur) = inv_r * rowstd(x * inv_c)`` and ``colstd(cur) = inv_c * colstd(x * inv_r)``
    exactly in real arithmetic. One iteration needs the row stds of ``cur`` with the old row
    scale (the row update), and the column and row stds with the new one (the next column
    update and the imbalance score); all three come from two tile passes:

    * ``S = rowstd(x * inv_c)`` (new column scale): the row update uses ``inv_r_old * S``,
      the score ``inv_r_new * S``;
    * ``T = colstd(x * inv_r_new)``: the score and the next column update use ``inv_c * T``.

    Each pass is :func:`_scaled_std`: one FMA, one add and one FMA per element (v1: six
    passes over the tile per iteration, ``cur`` formed twice), against a pivot that is the
    previous estimate of the mean of the same row or column (exact two-pass means of ``x``
    before the first iteration, which also gives the reference's starting score
    bit-for-bit). ``exp(-log_r)`` at the top of an iteration is the one computed at the end
    of the previous one; the max and min of each ratio share a reduction. The transcendental
    and division work per row and column is what remains (one sqrt, log and exp per entry
    per iteration, plus a multiplication; v1 has two divisions and one to two more sqrts).

    Numerics: the stds differ from the two-pass stds of ``cur`` by fp32 rounding (products
    taken in another order, one-pass sums about a pivot); the tests bound the effect
    (``V2_BARS``, named after the removed v2, the first one-pass variant).

    ``COMPACT`` (v4): the per-row and per-column work in a compact layout (:func:`_compact`,
    ``R + C`` fp32 of scratch at ``SCR``, rows first; ``ok`` and ``MASKED`` as for the record
    stores): the stds, scales, pivots' sums, the score and the best state are computed once
    per entry, not once per copy. The operations and their order are the same, except the
    sums over entries in the pivots (another order of the same fp32 terms); under the
    interpreter, whose sums are NumPy's either way, the result is the same exactly.
    """
    col_std, col_mean = _std_mean(x, 0, R)
    row_std, row_mean = _std_mean(x, 1, C)
    col_std = _compacted(col_std, SCR, R, ok, C, MASKED, COMPACT)
    row_std = _compacted(row_std, SCR, 0, ok, R, MASKED, COMPACT)
    best = _imbalance_ratio(col_std, FUSED) + _imbalance_ratio(row_std, FUSED)
    log_c = tl.zeros([C], dtype=tl.float32)
    log_r = tl.zeros([R], dtype=tl.float32)
    best_c = tl.zeros([C], dtype=tl.float32)
    best_r = tl.zeros([R], dtype=tl.float32)
    inv_r = tl.full([R], 1.0, dtype=tl.float32)
    row_piv = row_mean
    col_piv = col_mean
    if ADDITIVE_PIVOT:
        row_own = _compacted(row_mean, SCR, 0, ok, R, MASKED, COMPACT)
        grand = tl.sum(row_own, axis=0) * (1.0 / R)
        row_dev = row_own - grand
        col_dev = _compacted(col_mean, SCR, R, ok, C, MASKED, COMPACT) - grand
    for _ in range(ITERS):
        log_c = _log_step(log_c, col_std, PRECISE)
        inv_c = _exp(-log_c, PRECISE)
        if ADDITIVE_PIVOT:
            row_piv = _additive_mean(row_mean, col_dev, inv_c, C, FUSED)
        s_row, row_piv = _scaled_std(x, inv_c, row_piv, 1, C, FUSED)
        s_row = _compacted(s_row, SCR, 0, ok, R, MASKED, COMPACT)
        log_r = _log_step(log_r, s_row * inv_r, PRECISE)
        inv_r = _exp(-log_r, PRECISE)
        if ADDITIVE_PIVOT:
            col_piv = _additive_mean(col_mean, row_dev, inv_r, R, FUSED)
        t_col, col_piv = _scaled_std(x, inv_r, col_piv, 0, R, FUSED)
        col_std = _compacted(t_col, SCR, R, ok, C, MASKED, COMPACT) * inv_c
        score = _imbalance_ratio(col_std, FUSED) + _imbalance_ratio(s_row * inv_r, FUSED)
        take = score <= best
        best = tl.where(take, score, best)
        best_c = tl.where(take, log_c, best_c)
        best_r = tl.where(take, log_r, best_r)
    return best_c, best_r


@triton.jit
def _compact(v, SCR, ok, N: tl.constexpr, MASKED: tl.constexpr):
    """(v4) The vector ``v [N]`` in a layout of one entry per thread, through ``N`` fp32 of
    scratch at ``SCR`` (written and read back by the whole CTA; ``ok``/``MASKED`` as for the
    record stores, a skipped tile reads ones).

    A reduction over a tile axis leaves its result replicated over every thread that held a
    part of that row or column (16 copies of a column entry per thread at 128 x 128 and 4
    warps), and Triton then runs the per-entry math (sqrt, log, exp, clamps, the score) in
    that layout, once per copy. The round trip through memory is the layout change plain
    ``tl`` cannot ask for: the load's layout is the coalesced one, one entry per thread, and
    the math that follows stays there until a tile pass needs the vector broadcast again.
    """
    i = tl.arange(0, N)
    _st(SCR + i, v, ok & (i < N), MASKED)
    tl.debug_barrier()  # the entries this thread loads were stored by others
    j = tl.arange(0, N)
    w = tl.load(SCR + j, mask=ok & (j < N), other=1.0)
    tl.debug_barrier()  # every thread has read before the scratch is written again
    return w


@triton.jit
def _compacted(v, SCR, OFFSET: tl.constexpr, ok, N: tl.constexpr, MASKED, COMPACT: tl.constexpr):
    """``v`` through :func:`_compact` at ``SCR + OFFSET`` when ``COMPACT``, else as it is."""
    if COMPACT:  # noqa: SIM108 (a constexpr branch, as everywhere here)
        y = _compact(v, SCR + OFFSET, ok, N, MASKED)
    else:
        y = v
    return y


@triton.jit
def _div_by(x, rcp, d, FAST: tl.constexpr):
    """(v4) ``x / d`` correctly rounded, from ``rcp``, the correctly rounded reciprocal of
    ``d``: ``q = x * rcp``, then one Newton correction with an exact fma residual, ``q + (x - q
    d) rcp`` (Markstein's division; correctly rounded for normal operands, which these are:
    tile values over scales in [e^-0.3, e^10 * 2^k], RTN offsets over steps >= 1e-10).
    Three instructions per element where ``div_rn`` takes a division sequence each; the
    reciprocals are one ``div_rn`` per row or column. The interpreter has no exact fma, so
    there (``FAST`` off) it divides."""
    if FAST:
        q = x * rcp
        y = tl.fma(q, -d, x)
        y = tl.fma(y, rcp, q)
    else:
        y = tl.div_rn(x, d)
    return y


@triton.jit
def _st(ptrs, vals, mask, MASKED: tl.constexpr):
    """Store, predicated on ``mask`` only in the masked kernel (the pool flush has no masks)."""
    if MASKED:
        tl.store(ptrs, vals, mask=mask)
    else:
        tl.store(ptrs, vals)


@triton.jit
def _load_tile(
    SRC,
    src_base,
    HEAD,
    head_base,
    head_len,
    ok,
    stride_r,
    stride_c,
    R: tl.constexpr,
    C: tl.constexpr,
    TOK_ROWS: tl.constexpr,
    HAS_HEAD: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The tile ``x[r, c]`` in fp32; tokens run along rows (``TOK_ROWS``) or columns.

    Token ``j`` of the tile is at ``SRC + src_base + j * (token stride)``; with a head, tokens
    ``j < head_len`` are read from ``HEAD + head_base`` instead (same strides). ``ok`` false
    (masked kernel only) reads nothing and yields zeros.
    """
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    offs = r[:, None] * stride_r + c[None, :] * stride_c
    if HAS_HEAD:
        tok = r[:, None] + 0 * c[None, :] if TOK_ROWS else c[None, :] + 0 * r[:, None]
        in_head = tok < head_len
        body = tl.load(SRC + src_base + offs, mask=(tok >= head_len) & ok, other=0.0)
        head = tl.load(HEAD + head_base + offs, mask=in_head & ok, other=0.0)
        x = tl.where(in_head, head, body)
    elif MASKED:
        every = (r[:, None] < R) & (c[None, :] < C) & ok
        x = tl.load(SRC + src_base + offs, mask=every, other=0.0)
    else:
        x = tl.load(SRC + src_base + offs)
    return x.to(tl.float32)


@triton.jit
def _load_shadowed_tile(
    SRC,
    src_base,
    POOL,
    KV,
    slot,
    blk,
    h,
    pool_len,
    ok,
    stride_r,
    stride_c,
    R: tl.constexpr,
    C: tl.constexpr,
    TOK_ROWS: tl.constexpr,
    HAS_BODY: tl.constexpr,
    MASKED: tl.constexpr,
    IS_V: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    SHADOW: tl.constexpr,
    STRIDE: tl.constexpr,
):
    """:func:`_load_tile` for a shadowed pool: tokens ``j < pool_len`` are tile rows of pool
    slot ``slot`` (``POOL [slots, G - SHADOW, HK, D]``), the first ``SHADOW`` of them in
    block ``blk``'s record area (:func:`pool_row_ptrs`); tokens ``j >= pool_len`` (with
    ``HAS_BODY``) are at ``SRC + src_base + j * (token stride)`` as in :func:`_load_tile`.

    The row pointers are formed per token (``[R, 1]`` or ``[1, C]``) and the channel offset is
    added after, so the compiler still sees contiguous channels (vector loads).
    """
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    if TOK_ROWS:
        tok = r[:, None].to(tl.int64)
        chan = c[None, :]
    else:
        tok = c[None, :].to(tl.int64)
        chan = r[:, None]
    rows = pool_row_ptrs(POOL, KV, slot, blk, tok, h, IS_V, HK, D, G, SHADOW, STRIDE)
    pooled = rows + chan
    if HAS_BODY:
        offs = r[:, None] * stride_r + c[None, :] * stride_c
        in_pool = tok < pool_len
        body = tl.load(SRC + src_base + offs, mask=(tok >= pool_len) & ok, other=0.0)
        head = tl.load(pooled, mask=in_pool & ok, other=0.0)
        x = tl.where(in_pool, head, body)
    elif MASKED:
        x = tl.load(pooled, mask=(tok < pool_len) & ok, other=0.0)
    else:
        x = tl.load(pooled)
    return x.to(tl.float32)


@triton.jit
def _load_half(
    SRC,
    src_base,
    HEAD,
    head_base,
    KV,
    head_slot,
    blk,
    h,
    head_len,
    ok,
    stride_r,
    stride_c,
    R: tl.constexpr,
    C: tl.constexpr,
    TOK_ROWS: tl.constexpr,
    HAS_HEAD: tl.constexpr,
    MASKED: tl.constexpr,
    HK: tl.constexpr,
    SHADOW: tl.constexpr,
    STRIDE: tl.constexpr,
):
    """One half of a record's tile (K: ``TOK_ROWS`` false, ``[D, G]``; V: true, ``[G, D]``):
    :func:`_load_tile`, or with shadow rows :func:`_load_shadowed_tile` and a CTA barrier.

    The barrier is the in-place hazard's: the record this program stores next overwrites the
    shadow rows just read (this ``(block, head)``'s record area). All of this CTA's loads
    precede it, all of its stores follow it; no other program of the launch touches the area.
    """
    if SHADOW == 0:
        return _load_tile(
            SRC,
            src_base,
            HEAD,
            head_base,
            head_len,
            ok,
            stride_r,
            stride_c,
            R,
            C,
            TOK_ROWS,
            HAS_HEAD,
            MASKED,
        )
    else:
        d: tl.constexpr = C if TOK_ROWS else R  # channels
        g: tl.constexpr = R if TOK_ROWS else C  # tokens
        x = _load_shadowed_tile(
            SRC,
            src_base,
            HEAD if HAS_HEAD else SRC,
            KV,
            head_slot,
            blk,
            h,
            head_len,
            ok,
            stride_r,
            stride_c,
            R,
            C,
            TOK_ROWS,
            HAS_HEAD,
            MASKED,
            TOK_ROWS,
            HK,
            d,
            g,
            SHADOW,
            STRIDE,
        )
        tl.debug_barrier()
        return x


@triton.jit
def _quantize_tile(
    x,
    ok,
    REC,
    OFF_CODES: tl.constexpr,
    OFF_ROW_SCALE: tl.constexpr,
    OFF_ROW_ZERO: tl.constexpr,
    OFF_COL_SCALE: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    ITERS: tl.constexpr,
    PRECISE: tl.constexpr,
    MASKED: tl.constexpr,
    V3: tl.constexpr = False,
    ORDER: tl.constexpr = 0,
    V4: tl.constexpr = False,
    WORDS5: tl.constexpr = False,
):
    """Quantize the fp32 tile ``x [R, C]`` along rows into the record at ``REC``, its code
    bytes in the section's in-cache order ``ORDER`` (:func:`code_offsets`).

    In the masked kernel nothing is stored when ``ok`` is false. ``V4``: the per-row and
    per-column work in a compact layout through scratch in the record's own code bytes
    (``R * C * BITS / 8 >= 4 (R + C)`` bytes for every admitted geometry), which the codes,
    stored last, overwrite; the record is the same. ``WORDS5``: 5-bit codes stored as 32-bit
    words (:data:`STORE_5BIT_WORDS`); the bytes are the same.
    """
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    ok_r = (r < R) & ok
    ok_c = (c < C) & ok

    # --- Sinkhorn, best-imbalance state in the log domain (reference: sinkhorn_batched) ---
    scratch = (REC + OFF_CODES).to(tl.pointer_type(tl.float32))
    if V4:
        tl.static_assert(OFF_CODES % 4 == 0, "v4's scratch is fp32 in the code section")
        best_c, best_r = _sinkhorn_v3(
            x, R, C, ITERS, PRECISE, PRECISE, True, True, scratch, ok, MASKED
        )
    elif V3:
        # PRECISE is off exactly under the interpreter: no tuple reductions there.
        best_c, best_r = _sinkhorn_v3(x, R, C, ITERS, PRECISE, PRECISE)
    else:
        best_c, best_r = _sinkhorn_v1(x, R, C, ITERS, PRECISE)

    # --- scales as stored (fp16), balance, RTN (reference: _quantize_rows, rtn) ---
    col_s = _to_f16(_exp(best_c, PRECISE)).to(tl.float32)
    row_s = _to_f16(_exp(best_r, PRECISE)).to(tl.float32)
    qmax: tl.constexpr = (1 << BITS) - 1
    if V4:
        # the same correctly rounded quotients, through one reciprocal per divisor
        inv_col = tl.div_rn(1.0, col_s)
        inv_row = tl.div_rn(1.0, row_s)
        bal = _div_by(x, inv_col[None, :], col_s[None, :], PRECISE)
        bal = _div_by(bal, inv_row[:, None], row_s[:, None], PRECISE)
        lo_t = tl.min(bal, axis=1)  # the tile's layout, for the offsets below
        lo = _compact(lo_t, scratch, ok, R, MASKED)
        hi = _compact(tl.max(bal, axis=1), scratch + R, ok, R, MASKED)
        step = tl.maximum(tl.div_rn(hi - lo, float(qmax)), 1e-10)
        inv_step = tl.div_rn(1.0, step)
        y = _div_by(bal - lo_t[:, None], inv_step[:, None], step[:, None], PRECISE)
    else:
        bal = tl.div_rn(x, col_s[None, :])
        bal = tl.div_rn(bal, row_s[:, None])
        lo = tl.min(bal, axis=1)
        hi = tl.max(bal, axis=1)
        step = tl.maximum(tl.div_rn(hi - lo, float(qmax)), 1e-10)
        y = tl.div_rn(bal - lo[:, None], step[:, None])
    # Round half to even: adding and removing 1.5 * 2**23 leaves the nearest-even integer
    # (y lies in [0, qmax] up to rounding, far inside the trick's [0, 2**22) range).
    y = (y + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(y, 0.0), float(qmax)).to(tl.int32)

    # --- absorption and the power-of-two overflow guard ---
    a = row_s * step
    z = row_s * lo
    peak = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(z), axis=0))
    need = tl.ceil(_log2(tl.div_rn(tl.maximum(peak, 1.0), _FP16_MAX), PRECISE))
    room = tl.floor(_log2(tl.div_rn(_FP16_MAX, tl.max(col_s, axis=0)), PRECISE))
    shift = tl.maximum(tl.minimum(need, room), 0.0)
    # 2**shift built from its exponent bits: exact, no exp2 rounding.
    factor = ((shift.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    a = tl.div_rn(a, factor)
    z = tl.div_rn(z, factor)
    col_s = col_s * factor
    _st((REC + OFF_ROW_SCALE).to(tl.pointer_type(tl.float16)) + r, _to_f16(a), ok_r, MASKED)
    _st((REC + OFF_ROW_ZERO).to(tl.pointer_type(tl.float16)) + r, _to_f16(z), ok_r, MASKED)
    _st((REC + OFF_COL_SCALE).to(tl.pointer_type(tl.float16)) + c, _to_f16(col_s), ok_c, MASKED)

    # --- pack codes along the row, LSB first ---
    row_bytes: tl.constexpr = C * BITS // 8
    if BITS == 4 or BITS == 2:
        if BITS == 4:
            ev, od = tl.split(tl.reshape(q, [R, C // 2, 2]))
            packed = (ev | (od << 4)).to(tl.uint8)
        else:
            b0, b1 = tl.split(tl.reshape(q, [R, C // 4, 2, 2]))
            c0, c2 = tl.split(b0)
            c1, c3 = tl.split(b1)
            packed = (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8)
        jb = tl.arange(0, row_bytes)
        if ORDER == 2:
            # even rows, then odd rows: addressed by row pair, which Triton sees as contiguous
            pe, po = tl.split(tl.permute(tl.reshape(packed, [R // 2, 2, row_bytes]), (0, 2, 1)))
            pr = tl.arange(0, R // 2)
            ok_p = ((pr < R // 2) & ok)[:, None] & (jb < row_bytes)[None, :]
            off_e = code_offsets_of_pair(pr[:, None], 0, jb[None, :], R, row_bytes, 2)
            off_o = code_offsets_of_pair(pr[:, None], 1, jb[None, :], R, row_bytes, 2)
            _st(REC + OFF_CODES + off_e, pe, ok_p, MASKED)
            _st(REC + OFF_CODES + off_o, po, ok_p, MASKED)
        else:
            _st(
                REC + OFF_CODES + code_offsets(r[:, None], jb[None, :], R, row_bytes, ORDER),
                packed,
                ok_r[:, None] & (jb < row_bytes)[None, :],
                MASKED,
            )
    else:
        tl.static_assert(BITS == 5, "code widths are 2, 4 or 5")
        s0, s1 = tl.split(tl.reshape(q, [R, C // 8, 2, 2, 2]))
        s00, s01 = tl.split(s0)
        s10, s11 = tl.split(s1)
        c0, c4 = tl.split(s00)
        c2, c6 = tl.split(s01)
        c1, c5 = tl.split(s10)
        c3, c7 = tl.split(s11)
        if ORDER != 0:
            # the byte planes (orders 3 and 4): byte b of every group goes to plane b
            jb = tl.arange(0, C // 8)
            base = REC + OFF_CODES + code_offsets(r[:, None], 5 * jb[None, :], R, row_bytes, ORDER)
            plane: tl.constexpr = (C // 8) * R
            m5 = ok_r[:, None] & (jb < C // 8)[None, :]
            _st(base, ((c0 | (c1 << 5)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + plane, (((c1 >> 3) | (c2 << 2) | (c3 << 7)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + 2 * plane, (((c3 >> 1) | (c4 << 4)) & 0xFF).to(tl.uint8), m5, MASKED)
            byte3 = ((c4 >> 4) | (c5 << 1) | (c6 << 6)) & 0xFF
            _st(base + 3 * plane, byte3.to(tl.uint8), m5, MASKED)
            _st(base + 4 * plane, (((c6 >> 2) | (c7 << 3)) & 0xFF).to(tl.uint8), m5, MASKED)
        elif WORDS5:
            tl.static_assert(C % 32 == 0 and OFF_CODES % 4 == 0, "5-bit rows go out as words")
            # 32 codes are 160 bits, five little-endian 32-bit words: word stores, not byte
            # stores five bytes apart. A group of 8 codes is 40 bits (code i at bit 5 i), and
            # each word is cut from two of four consecutive groups.
            grp = (
                c0.to(tl.int64)
                | (c1.to(tl.int64) << 5)
                | (c2.to(tl.int64) << 10)
                | (c3.to(tl.int64) << 15)
                | (c4.to(tl.int64) << 20)
                | (c5.to(tl.int64) << 25)
                | (c6.to(tl.int64) << 30)
                | (c7.to(tl.int64) << 35)
            )
            NQ: tl.constexpr = C // 32
            even, odd = tl.split(tl.reshape(grp, [R, NQ, 2, 2]))
            g0, g2 = tl.split(even)
            g1, g3 = tl.split(odd)
            jq = tl.arange(0, NQ)
            words = (REC + OFF_CODES).to(tl.pointer_type(tl.int32))
            base = words + r[:, None] * (row_bytes // 4) + 5 * jq[None, :]
            m5 = ok_r[:, None] & (jq < NQ)[None, :]
            _st(base + 0, g0.to(tl.int32), m5, MASKED)
            _st(base + 1, ((g0 >> 32) | (g1 << 8)).to(tl.int32), m5, MASKED)
            _st(base + 2, ((g1 >> 24) | (g2 << 16)).to(tl.int32), m5, MASKED)
            _st(base + 3, ((g2 >> 16) | (g3 << 24)).to(tl.int32), m5, MASKED)
            _st(base + 4, (g3 >> 8).to(tl.int32), m5, MASKED)
        else:
            jb = tl.arange(0, C // 8)
            base = REC + OFF_CODES + r[:, None] * row_bytes + 5 * jb[None, :]
            m5 = ok_r[:, None] & (jb < C // 8)[None, :]
            _st(base + 0, ((c0 | (c1 << 5)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + 1, (((c1 >> 3) | (c2 << 2) | (c3 << 7)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + 2, (((c3 >> 1) | (c4 << 4)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + 3, (((c4 >> 4) | (c5 << 1) | (c6 << 6)) & 0xFF).to(tl.uint8), m5, MASKED)
            _st(base + 4, (((c6 >> 2) | (c7 << 3)) & 0xFF).to(tl.uint8), m5, MASKED)


@triton.jit
def _flush_kernel(
    SRC_K,
    SRC_V,
    SRC_ROWS,
    HEAD_K,
    HEAD_V,
    HEAD_SLOTS,
    HEAD_LENS,
    KV_CACHE,
    DST_BLOCKS,
    HK: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    STRIDE: tl.constexpr,
    PAYLOAD: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
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
    ITERS: tl.constexpr,
    PRECISE: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_HEAD: tl.constexpr,
    MASKED: tl.constexpr,
    V3: tl.constexpr = False,
    SHADOW: tl.constexpr = 0,
    PART: tl.constexpr = -1,
    V4: tl.constexpr = False,
    WORDS5: tl.constexpr = False,
):
    """Grid ``(N, Hk, 2)``: program ``(n, h, 0)`` quantizes tile n's K, ``(n, h, 1)`` its V.

    The source is token rows ``SRC[rows, Hk, D]`` (fp16, rotated): tile ``n`` starts at row
    ``SRC_ROWS[n] * ROW_SCALE`` (``ROW_SCALE = G`` reads pool slots, ``1`` token rows). With a
    head, its first ``HEAD_LENS[n]`` tokens are pool slot ``HEAD_SLOTS[n]``'s first rows and
    ``SRC_ROWS[n]`` is the row of its token ``HEAD_LENS[n]``. In the masked kernel a tile with
    a negative row is skipped (nothing is read or written).

    ``SHADOW > 0``: the pools hold ``G - SHADOW`` rows per slot and a pool tile's first
    ``SHADOW`` rows are in the record area of its block, which is the destination block
    ``DST_BLOCKS[n]`` (:func:`pool_row_ptrs`). Without a head, ``SRC_K``/``SRC_V`` are then the
    pools themselves and ``SRC_ROWS[n]`` the tile's slot (the pool flush); with a head, the
    head's rows come through the same addressing. ``PART`` 0 or 1 (grid ``(N, Hk, 1)``) runs
    only the K or only the V programs: see :func:`_shadow_parts` for why a shadowed store is
    two launches.
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    which = tl.program_id(2) if PART < 0 else PART
    blk = tl.load(DST_BLOCKS + n).to(tl.int64)
    head_base = 0  # the head's offset in an unshadowed pool (shadowed ones use pool_row_ptrs)
    if HAS_HEAD:
        row = tl.load(SRC_ROWS + n).to(tl.int64) * ROW_SCALE
        ok = row >= 0
        head_len = tl.load(HEAD_LENS + n)
        head_slot = tl.load(HEAD_SLOTS + n).to(tl.int64)
        # A tile without a head may carry any slot id (e.g. -1): keep the address sane.
        head_slot = tl.where(head_len > 0, head_slot, 0)
        if SHADOW == 0:
            head_base = head_slot * (G * HK * D) + h * D
        src_base = (row - head_len) * (HK * D) + h * D
    elif SHADOW == 0:
        row = tl.load(SRC_ROWS + n).to(tl.int64) * ROW_SCALE
        ok = row >= 0
        head_len = 0
        head_slot = 0
        src_base = row * (HK * D) + h * D
    else:
        # The pool flush of a shadowed pool: the whole tile comes from slot SRC_ROWS[n].
        head_slot = tl.load(SRC_ROWS + n).to(tl.int64)
        ok = head_slot >= 0
        head_len = G
        src_base = 0
    rec = KV_CACHE + (blk * HK + h) * STRIDE
    if which == 0:
        # K tile [R = D channels, C = G tokens]: rows are channels (per-channel RTN).
        xk = _load_half(
            SRC_K,
            src_base,
            HEAD_K,
            head_base,
            KV_CACHE,
            head_slot,
            blk,
            h,
            head_len,
            ok,
            1,
            HK * D,
            D,
            G,
            False,
            HAS_HEAD,
            MASKED,
            HK,
            SHADOW,
            STRIDE,
        )
        _quantize_tile(
            xk,
            ok,
            rec,
            OFF_KC,
            OFF_KS,
            OFF_KZ,
            OFF_KT,
            D,
            G,
            KB,
            ITERS,
            PRECISE,
            MASKED,
            V3,
            K_ORDER,
            V4,
            WORDS5,
        )
    else:
        # V tile [R = G tokens, C = D channels]: rows are tokens (per-token RTN).
        xv = _load_half(
            SRC_V,
            src_base,
            HEAD_V,
            head_base,
            KV_CACHE,
            head_slot,
            blk,
            h,
            head_len,
            ok,
            HK * D,
            1,
            G,
            D,
            True,
            HAS_HEAD,
            MASKED,
            HK,
            SHADOW,
            STRIDE,
        )
        _quantize_tile(
            xv,
            ok,
            rec,
            OFF_VC,
            OFF_VS,
            OFF_VZ,
            OFF_VCS,
            G,
            D,
            VB,
            ITERS,
            PRECISE,
            MASKED,
            V3,
            V_ORDER,
            V4,
            WORDS5,
        )
        if STRIDE > PAYLOAD:
            # Zero the record's padding so records are byte-identical to the reference.
            for p0 in tl.static_range(PAYLOAD, STRIDE, PAD_BLOCK):
                p = p0 + tl.arange(0, PAD_BLOCK)
                _st(rec + p, tl.zeros([PAD_BLOCK], dtype=tl.uint8), (p < STRIDE) & ok, True)


def _num_warps(d: int, g: int) -> int:
    # H200, 1024 tiles x 8 heads (docs/kernel-notes.md): the cross-warp reductions of the
    # stds dominate, so the fewest warps that hold the tile without spilling win: 2 for
    # 128 x 64 (4.1 ms vs 5.0 ms at 4 warps), 4 for 128 x 128 (8.6 ms vs 11.0 at 8, 53 at 2).
    elems = d * g
    return 2 if elems <= 128 * 64 else (4 if elems <= 128 * 128 else 16)


def _check_iters_variant(sinkhorn_iters: int, variant: str) -> None:
    if (
        isinstance(sinkhorn_iters, bool)
        or not isinstance(sinkhorn_iters, int)
        or sinkhorn_iters < 0
    ):
        raise ValueError(f"sinkhorn_iters must be a non-negative int, got {sinkhorn_iters!r}")
    if variant not in STORE_VARIANTS:
        raise ValueError(f"variant must be one of {STORE_VARIANTS}, got {variant!r}")


@dataclass(frozen=True, slots=True)
class _Heads:
    """Pool rows that open some tiles (:func:`flush_token_tiles`'s ``head_*`` arguments)."""

    pool_k: torch.Tensor
    pool_v: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor


@cache  # on every shadowed flush's host path: the layout walk once per geometry
def _shadow_parts(geo: DenseGeometry, shadow: int) -> tuple[int, int]:
    """The order of the K (0) and V (1) launches of a store that reads shadow rows.

    A record's K fields and V fields are written by different programs, which may run in any
    order within a launch, while the K and V shadow rows of the same ``(block, head)`` are
    read from the record area those fields overwrite (K rows in bytes ``[0, 2RD)``, V rows in
    ``[2RD, 4RD)``). So the two halves run as two launches (stream-ordered), the first being
    one whose writes miss the other half's shadow rows: V first when the V fields and the
    padding (which V's programs zero) start at or past ``2RD`` (every unpadded record), K
    first when the K fields end at or before ``2RD`` (a cache padded to about twice the
    record). Each program then only overwrites its own shadow rows, after reading them.
    """
    fields = record_layout(geo.fmt, geo.head_dim).fields
    k_start = min(f.offset for f in fields if f.name.startswith("k_"))
    k_end = max(f.offset + f.size for f in fields if f.name.startswith("k_"))
    v_start = min(f.offset for f in fields if f.name.startswith("v_"))
    half = 2 * shadow * geo.head_dim  # bytes of one side's R fp16 rows

    def hits(lo: int, hi: int, a: int, b: int) -> bool:
        return lo < b and a < hi

    if not hits(v_start, geo.record_stride, 0, half):
        return (1, 0)
    if not hits(k_start, k_end, half, 2 * half):
        return (0, 1)
    raise ValueError(  # not reachable with kvarn-format's layouts (K fields precede V's)
        f"{geo.fmt.name} at head_dim {geo.head_dim} with {shadow} shadow rows in a "
        f"{geo.record_stride}-byte record: both the K and V fields overlap the other half's "
        "shadow rows, so no launch order is safe; use fewer shadow rows"
    )


def _launch(
    geo: DenseGeometry,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    rows: torch.Tensor,
    row_scale: int,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: _Heads | None,
    masked: bool,
    sinkhorn_iters: int,
    num_warps: int | None,
    variant: str,
    shadow: int = 0,
) -> None:
    """The shared store: ``src_k/src_v`` are token rows ``[rows, Hk, D]`` fp16 (contiguous).

    With ``shadow`` rows (the pools' first rows in the destination blocks' record areas) and
    no heads, ``src_k/src_v`` are the pools ``[slots, G - shadow, Hk, D]`` and ``rows`` their
    slots (the pool flush); with heads, the heads' pools are shadowed.
    """
    n = int(rows.shape[0])
    if n == 0:
        return
    hk = int(src_k.shape[-2])
    if geo.head_dim > 256:
        _flush_torch(
            geo,
            src_k,
            src_v,
            rows,
            row_scale,
            kv_cache,
            dst_blocks,
            sinkhorn_iters,
            heads,
            masked,
            shadow,
        )
        return
    pad = geo.record_stride - geo.payload_bytes
    # Pointers the kernel does not read without a head: any tensor on the device.
    head_k = heads.pool_k if heads is not None else src_k
    head_v = heads.pool_v if heads is not None else src_v
    head_slots = heads.slots if heads is not None else rows
    head_lens = heads.lens if heads is not None else rows
    args = (src_k, src_v, rows, head_k, head_v, head_slots, head_lens, kv_cache, dst_blocks)
    consts = dict(
        HK=hk,
        D=geo.head_dim,
        G=geo.group,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        PAYLOAD=geo.payload_bytes,
        PAD_BLOCK=max(16, next_pow2(min(max(pad, 1), 4096))),
        **geo.offsets(),
        ITERS=sinkhorn_iters,
        PRECISE=not triton_interpret(),
        V3=variant == "v3",
        V4=variant == "v4",
        WORDS5=STORE_5BIT_WORDS and 5 in (geo.key_bits, geo.value_bits),
        ROW_SCALE=row_scale,
        HAS_HEAD=heads is not None,
        MASKED=masked,
    )
    warps = num_warps or _num_warps(geo.head_dim, geo.group)
    if shadow == 0:
        launch(
            _flush_kernel, (n, hk, 2), args, {**consts, "SHADOW": 0, "PART": -1}, num_warps=warps
        )
        return
    # Two launches, K and V halves in a hazard-free order (_shadow_parts).
    for part in _shadow_parts(geo, shadow):
        launch(
            _flush_kernel,
            (n, hk, 1),
            args,
            {**consts, "SHADOW": shadow, "PART": part},
            num_warps=warps,
        )


def flush_tiles(
    fmt: KVarNFormat | str,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    src_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    sinkhorn_iters: int = 8,
    num_warps: int | None = None,
    variant: str = "v4",
) -> None:
    """Quantize full side-pool tiles and scatter their records into the paged cache.

    Args:
        fmt: a dense KVarN format (or its dtype string); its group ``G`` is the tile size.
        pool_k, pool_v: ``[num_slots, G - R, Hk, D]`` fp16, rotated (as
            :func:`write_side_pool` stores them); read only. ``R`` (shadow rows, usually 0)
            is ``G`` minus the pool's rows per slot: tile ``n``'s first ``R`` rows are then
            read from the record area of its destination block ``dst_blocks[n]`` (where
            :func:`write_side_pool` put them), at most
            :func:`kvarn_format.geometry.shadow_rows` of them.
        src_slots: ``[N]`` int32 pool slots holding full tiles.
        kv_cache: ``uint8 [num_blocks, Hk, tile_bytes]`` (tile_bytes from
            ``record_layout(fmt, D)``, ``align8`` or ``pow2``); records are written in place,
            over the shadow rows they were quantized from.
        dst_blocks: ``[N]`` int32 block ids receiving the records, distinct (a block with
            shadow rows must be the one its tile's slot belongs to).
        sinkhorn_iters: Sinkhorn iterations (the dense formats use 8).
        num_warps: tuning override (warps per tile program).
        variant: ``"v4"`` (default: v3's values in fewer instructions, the per-row and
            per-column work once per entry, :func:`_sinkhorn_v3` with ``COMPACT``, and the
            correctly rounded divisions through shared reciprocals, :func:`_div_by`; 0.62x
            v3's time on the H200), ``"v3"`` (two one-pass tile statistics per Sinkhorn iteration,
            from the homogeneity of stds, see :func:`_sinkhorn_v3`; 1.44x v1's speed),
            or ``"v1"`` (the reference's operations in order: byte-identical records up to
            fp32 reduction order). v3 and v4 stds differ from the reference's by fp32
            rounding, which can flip a code or the Sinkhorn iteration kept; the tests bound
            the decoded difference. Head dim 512 runs the torch path for all.

    One launch per call for head dims up to 256 (grid ``(N, Hk, 2)``: K and V tiles; two
    launches ``(N, Hk, 1)`` with shadow rows, see the module docstring); head dim 512 runs
    the same algorithm as batched torch ops. Every tile must be full (``G`` written tokens):
    the pool's unwritten rows would otherwise enter the statistics. The kernel is
    :func:`flush_token_tiles`'s: without shadow rows a pool slot ``s`` is token row ``s * G``
    of the pool viewed as ``[num_slots * G, Hk, D]``.
    """
    dense = resolve_format(fmt)
    geo, shadow = _check_flush_args(dense, pool_k, pool_v, src_slots, kv_cache, dst_blocks)
    _check_iters_variant(sinkhorn_iters, variant)
    _, g, hk, d = (int(s) for s in pool_k.shape)
    _launch(
        geo,
        pool_k if shadow else pool_k.view(-1, hk, d),
        pool_v if shadow else pool_v.view(-1, hk, d),
        src_slots,
        g,
        kv_cache,
        dst_blocks,
        None,
        False,
        sinkhorn_iters,
        num_warps,
        variant,
        shadow,
    )


def flush_token_tiles(
    fmt: KVarNFormat | str,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    row_starts: torch.Tensor,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    pool_k: torch.Tensor | None = None,
    pool_v: torch.Tensor | None = None,
    head_slots: torch.Tensor | None = None,
    head_lens: torch.Tensor | None = None,
    sinkhorn_iters: int = 8,
    num_warps: int | None = None,
    variant: str = "v4",
    check: bool | None = None,
) -> None:
    """Quantize tiles whose tokens are consecutive rows of a ``[rows, Hk, D]`` tensor.

    This is how a prefill chunk's full tiles become packed records in the step that writes
    them, without passing through the side pool: ``k_rows``/``v_rows`` are the step's K/V
    rotated to fp16 (:func:`rotate`, exactly what :func:`write_side_pool` would have stored),
    and tile ``n`` is rows ``[row_starts[n], row_starts[n] + G)``. Records are byte-identical
    to :func:`flush_tiles` on the same data (the same kernel).

    A tile may open with rows already in the side pool (a chunk that starts inside a tile the
    previous step began): with ``pool_k``, ``pool_v``, ``head_slots`` and ``head_lens`` given,
    tile ``n``'s tokens ``j < head_lens[n]`` are ``pool[head_slots[n], j]`` and its tokens
    ``j >= head_lens[n]`` are row ``row_starts[n] + j - head_lens[n]`` (so ``row_starts[n]``
    is the row of its first token that is not in the pool). ``head_lens[n] = 0`` means no
    head; its ``head_slots[n]`` is then ignored. With a shadowed pool (``G - R`` rows per
    slot), head tokens ``j < R`` are read from the record area of ``dst_blocks[n]`` (the
    block the slot belongs to, which ``kv_cache`` is: the record is written over them) and
    tokens ``R <= j < head_lens[n]`` are ``pool[head_slots[n], j - R]``.

    Args:
        fmt: a dense KVarN format (or its dtype string).
        k_rows, v_rows: ``[rows, Hk, D]`` fp16, rotated, contiguous; read only.
        row_starts: ``[N]`` int32. A tile with ``row_starts[n] < 0`` is skipped: nothing is
            read and its record is left as is. This lets a caller derive the rows on the
            device (no host sync) and drop tiles whose tokens are not in this batch.
        kv_cache: ``uint8 [num_blocks, Hk, tile_bytes]``; records are written in place.
        dst_blocks: ``[N]`` int32 block ids receiving the records.
        pool_k, pool_v: ``[num_slots, G - R, Hk, D]`` fp16 side pools holding the heads
            (``R`` shadow rows, usually 0, as for :func:`flush_tiles`).
        head_slots, head_lens: ``[N]`` int32; ``0 <= head_lens[n] < G``.
        sinkhorn_iters, num_warps, variant: as for :func:`flush_tiles`.
        check: when true (default: env ``KVARN_KERNELS_DEBUG=1``), read the index tensors back
            and raise ``ValueError`` for a tile reaching past ``k_rows`` or the pool, a bad
            head length or a block id out of range. It syncs with the host: keep it off under
            CUDA-graph capture.
    """
    dense = resolve_format(fmt)
    heads_given = [x is not None for x in (pool_k, pool_v, head_slots, head_lens)]
    if any(heads_given) and not all(heads_given):
        raise ValueError(
            "pool_k, pool_v, head_slots and head_lens go together: pass all four (tiles that "
            "open with side-pool rows) or none"
        )
    for name, x in (("k_rows", k_rows), ("v_rows", v_rows)):
        check_ndim(name, x, 3, "[rows, Hk, D]")
        check_dtype(name, x, (torch.float16,))
        if not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [rows, Hk, D] tensor")
    if v_rows.shape != k_rows.shape:
        raise ValueError(
            f"v_rows must have k_rows' shape {tuple(k_rows.shape)}; got {tuple(v_rows.shape)}"
        )
    _, hk, d = (int(s) for s in k_rows.shape)
    check_head_dim(d)
    _check_cache(kv_cache, hk, "k_rows")
    geo = dense_geometry(dense, d, int(kv_cache.shape[2]))
    _check_index_pair("row_starts", row_starts, dst_blocks)
    check_device(k_rows.device, v_rows=v_rows, row_starts=row_starts, kv_cache=kv_cache)
    check_device(k_rows.device, dst_blocks=dst_blocks)
    heads: _Heads | None = None
    shadow = 0
    if all(heads_given):
        assert pool_k is not None and pool_v is not None
        assert head_slots is not None and head_lens is not None
        from kvarn_kernels.rotation import _check_pool

        _, g, phk, pd = _check_pool(pool_k, pool_v)
        if g > dense.group or (phk, pd) != (hk, d):
            raise ValueError(
                f"the pool holds [*, {g}, {phk}, {pd}] tiles but {dense.name} over k_rows "
                f"needs [*, {dense.group} - shadow rows, {hk}, {d}]"
            )
        shadow = pool_shadow_rows(pool_k, dense.group, kv_cache)
        for name, idx in (("head_slots", head_slots), ("head_lens", head_lens)):
            check_index_tensor(name, idx, 1, "[N]")
            if idx.shape != row_starts.shape:
                raise ValueError(
                    f"{name} has {idx.shape[0]} entries for {row_starts.shape[0]} tiles"
                )
        check_device(
            k_rows.device, pool_k=pool_k, pool_v=pool_v, head_slots=head_slots, head_lens=head_lens
        )
        heads = _Heads(pool_k, pool_v, head_slots, head_lens)
    _check_iters_variant(sinkhorn_iters, variant)
    if debug_checks_enabled(check) and row_starts.shape[0]:
        _check_token_tiles(geo, int(k_rows.shape[0]), row_starts, kv_cache, dst_blocks, heads)
    _launch(
        geo,
        k_rows,
        v_rows,
        row_starts,
        1,
        kv_cache,
        dst_blocks,
        heads,
        True,
        sinkhorn_iters,
        num_warps,
        variant,
        shadow,
    )


def _check_token_tiles(
    geo: DenseGeometry,
    num_rows: int,
    row_starts: torch.Tensor,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: _Heads | None,
) -> None:
    rows = row_starts.long().cpu()
    live = rows >= 0
    lens = heads.lens.long().cpu() if heads is not None else torch.zeros_like(rows)
    if bool(((lens < 0) | (lens >= geo.group)).any()):
        raise ValueError(f"head_lens must lie in [0, {geo.group}) (a head is part of one tile)")
    ends = rows + geo.group - lens
    bad = live & (ends > num_rows)
    if bool(bad.any()):
        n = int(torch.nonzero(bad).flatten()[0])
        raise ValueError(
            f"tile {n} reads rows [{int(rows[n])}, {int(ends[n])}) but k_rows has {num_rows} rows"
        )
    if heads is not None:
        slots = heads.slots.long().cpu()
        with_head = live & (lens > 0)
        if bool((with_head & ((slots < 0) | (slots >= heads.pool_k.shape[0]))).any()):
            raise ValueError(
                f"head_slots must name pool slots in [0, {heads.pool_k.shape[0]}) for tiles "
                "with a head"
            )
    blocks = dst_blocks.long().cpu()
    if bool((live & ((blocks < 0) | (blocks >= kv_cache.shape[0]))).any()):
        raise ValueError(f"dst_blocks must lie in [0, {kv_cache.shape[0]})")
    if torch.unique(blocks[live]).numel() != int(live.sum()):
        # Two tiles into one block race on its record (and, with shadow rows, read rows the
        # other overwrites).
        raise ValueError("dst_blocks must be distinct: two tiles would write the same record")


def _check_cache(kv_cache: torch.Tensor, hk: int, source: str) -> None:
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, Hk, tile_bytes]")
    check_dtype("kv_cache", kv_cache, (torch.uint8,))
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.shape[1] != hk:
        raise ValueError(f"kv_cache has {kv_cache.shape[1]} KV heads but {source} has {hk}")


def _check_index_pair(name: str, src: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    check_index_tensor(name, src, 1, "[N]")
    check_index_tensor("dst_blocks", dst_blocks, 1, "[N]")
    if src.shape != dst_blocks.shape:
        raise ValueError(
            f"{name} and dst_blocks must have the same length; got {src.shape[0]} "
            f"and {dst_blocks.shape[0]}"
        )


def _check_flush_args(
    fmt: DenseFormat,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    src_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
) -> tuple[DenseGeometry, int]:
    """The geometry and the pool's shadow rows ``R`` (``G`` minus its rows per slot)."""
    from kvarn_kernels.rotation import _check_pool

    _, g, hk, d = _check_pool(pool_k, pool_v)
    if g > fmt.group:
        raise ValueError(f"{fmt.name} has {fmt.group}-token tiles but the pool holds G={g}")
    _check_cache(kv_cache, hk, "the pool")
    geo = dense_geometry(fmt, d, int(kv_cache.shape[2]))
    shadow = pool_shadow_rows(pool_k, fmt.group, kv_cache)
    _check_index_pair("src_slots", src_slots, dst_blocks)
    check_device(
        pool_k.device, pool_v=pool_v, src_slots=src_slots, kv_cache=kv_cache, dst_blocks=dst_blocks
    )
    return geo, shadow


# ---------------------------------------------------------------------------------------------
# head dim 512: the same algorithm as batched torch ops (a tile does not fit in registers)


def _t_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    n = x.shape[dim]
    centred = x - x.sum(dim=dim, keepdim=True) / n
    return torch.sqrt((centred * centred).sum(dim=dim) / max(n - 1, 1))


def _t_ratio(std: torch.Tensor) -> torch.Tensor:
    return std.amax(dim=-1) / std.amin(dim=-1).clamp_min(1e-8)


def _t_step(log_s: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (log_s + torch.log(std.clamp(1e-3, 1e3))).clamp(-0.3, 10.0)


def _t_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504.0, 65504.0).to(torch.float16)


def _quantize_rows_torch(
    x: torch.Tensor, bits: int, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched ``[N, R, C]`` fp32 version of the reference's ``_quantize_rows``."""
    n, r, c = x.shape
    log_c = x.new_zeros(n, c)
    log_r = x.new_zeros(n, r)
    best_c = x.new_zeros(n, c)
    best_r = x.new_zeros(n, r)
    col_std = _t_std(x, 1)
    best = _t_ratio(col_std) + _t_ratio(_t_std(x, 2))
    for _ in range(iters):
        log_c = _t_step(log_c, col_std)
        inv_c = torch.exp(-log_c)
        cur = x * inv_c[:, None, :] * torch.exp(-log_r)[:, :, None]
        log_r = _t_step(log_r, _t_std(cur, 2))
        cur = x * inv_c[:, None, :] * torch.exp(-log_r)[:, :, None]
        col_std = _t_std(cur, 1)
        score = _t_ratio(col_std) + _t_ratio(_t_std(cur, 2))
        take = score <= best
        best = torch.where(take, score, best)
        best_c = torch.where(take[:, None], log_c, best_c)
        best_r = torch.where(take[:, None], log_r, best_r)
    col_s = _t_fp16(torch.exp(best_c)).float()
    row_s = _t_fp16(torch.exp(best_r)).float()
    bal = x / col_s[:, None, :] / row_s[:, :, None]
    qmax = float((1 << bits) - 1)
    lo = bal.amin(dim=2)
    hi = bal.amax(dim=2)
    step = ((hi - lo) / qmax).clamp_min(1e-10)
    q = torch.round((bal - lo[:, :, None]) / step[:, :, None]).clamp(0, qmax).to(torch.uint8)
    a = row_s * step
    z = row_s * lo
    peak = torch.maximum(a.abs().amax(dim=1), z.abs().amax(dim=1))
    need = torch.ceil(torch.log2(peak.clamp_min(1.0) / 65504.0))
    room = torch.floor(torch.log2(65504.0 / col_s.amax(dim=1)))
    factor = torch.exp2(torch.minimum(need, room).clamp_min(0.0))
    a = a / factor[:, None]
    z = z / factor[:, None]
    col_s = col_s * factor[:, None]
    return q, _t_fp16(a), _t_fp16(z), _t_fp16(col_s)


def _pack_torch(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first bitstream packing of ``codes[..., n]`` (n a multiple of 8) into bytes."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    grouped = codes.reshape(*lead, n // 8, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (grouped << shifts).sum(dim=-1)  # disjoint bits: the sum is an OR
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF
    return out.reshape(*lead, n // 8 * bits).to(torch.uint8)


def _put_field(rec: torch.Tensor, offset: int, data: torch.Tensor) -> None:
    raw = data.contiguous().view(torch.uint8).reshape(rec.shape[0], -1)
    rec[:, offset : offset + raw.shape[1]] = raw


def _pool_tiles_torch(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    shadow: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole tiles ``[m, G, Hk, D]`` of pool slots ``slots``; with ``shadow`` rows, their first
    rows come from the record areas of ``blocks`` (a copy: read before the records are
    written over them)."""
    if shadow == 0:
        return pool_k[slots], pool_v[slots]
    hk, d = pool_k.shape[2], pool_k.shape[3]
    area = kv_cache[blocks][:, :, : 4 * shadow * d].contiguous()
    rows = area.view(torch.float16).view(-1, hk, 2, shadow, d).transpose(1, 3)  # [m, R, 2, Hk, D]
    k = torch.cat([rows[:, :, 0], pool_k[slots]], dim=1)
    v = torch.cat([rows[:, :, 1], pool_v[slots]], dim=1)
    return k, v


def _flush_torch(
    geo: DenseGeometry,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    rows: torch.Tensor,
    row_scale: int,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    iters: int,
    heads: _Heads | None,
    masked: bool,
    shadow: int = 0,
) -> None:
    """The store for head dim 512, on token rows like the kernel (no host sync).

    With ``shadow`` rows and no heads, ``src_k/src_v`` are the pools and ``rows`` their slots
    (:func:`_launch`). Each chunk gathers its tiles (copies) before it writes their records,
    so records written over shadow rows never feed a tile.
    """
    hk = src_k.shape[-2]
    g = geo.group
    last_row = src_k.shape[0] - 1
    j = torch.arange(g, device=src_k.device)
    chunk = max(1, 256 // hk)
    for start in range(0, rows.shape[0], chunk):
        first = rows[start : start + chunk].long() * row_scale
        blocks = dst_blocks[start : start + chunk].long()
        m = first.shape[0]
        if shadow and heads is None:
            slots = rows[start : start + chunk].long()
            k, v = _pool_tiles_torch(src_k, src_v, kv_cache, slots, blocks, shadow)
        else:
            lens = (
                heads.lens[start : start + chunk].long()
                if heads is not None
                else torch.zeros_like(first)
            )
            idx = ((first - lens)[:, None] + j[None, :]).clamp(0, last_row)
            k = src_k[idx]  # [m, G, Hk, D]
            v = src_v[idx]
        if heads is not None:
            slots = heads.slots[start : start + chunk].long()
            slots = torch.where(lens > 0, slots, 0).clamp(0, heads.pool_k.shape[0] - 1)
            in_head = (j[None, :] < lens[:, None])[:, :, None, None]
            head_k, head_v = _pool_tiles_torch(
                heads.pool_k, heads.pool_v, kv_cache, slots, blocks, shadow
            )
            k = torch.where(in_head, head_k, k)
            v = torch.where(in_head, head_v, v)
        k = k.float().permute(0, 2, 3, 1).reshape(m * hk, geo.head_dim, g)
        v = v.float().permute(0, 2, 1, 3).reshape(m * hk, g, geo.head_dim)
        rec = torch.zeros(m * hk, geo.record_stride, dtype=torch.uint8, device=kv_cache.device)
        codes, ks, kz, kt = _quantize_rows_torch(k, geo.key_bits, iters)
        _put_field(rec, geo.k_codes, _pack_torch(codes, geo.key_bits))
        _put_field(rec, geo.k_scale, ks)
        _put_field(rec, geo.k_zero, kz)
        _put_field(rec, geo.k_token_scale, kt)
        codes, vs, vz, vc = _quantize_rows_torch(v, geo.value_bits, iters)
        _put_field(rec, geo.v_codes, _pack_torch(codes, geo.value_bits))
        _put_field(rec, geo.v_channel_scale, vc)
        _put_field(rec, geo.v_scale, vs)
        _put_field(rec, geo.v_zero, vz)
        out = codes_to_cache_order(rec, geo).reshape(m, hk, geo.record_stride)
        if masked:
            # Skipped tiles keep their records (a select, not a host-side filter: no sync).
            out = torch.where((first >= 0)[:, None, None], out, kv_cache[blocks])
        kv_cache[blocks] = out
