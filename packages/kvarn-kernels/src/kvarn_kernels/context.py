# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels are untyped by nature; the Python functions in this module are fully
# annotated.)
"""Prefill with cached context: dequantize the context once, then library attention.

Prefill is compute-bound (a 2048-token chunk over 16K of context is ~0.5 TFLOP per layer).
The fused kernel (``attention._attn_kernel``, ``prefill_attention(method="fused")``) re-unpacks
the whole context for every 64-row query tile, so the unpack, not the MMA, sets its time
(72 TFLOP/s on an H200). Here the context is materialized instead, which the design allows
for prefill (the "never write dequantized KV to HBM" rule is for decode):

1. one Triton launch dequantizes every context block of the batch into a packed fp16
   workspace ``[total_context_tokens, Hk, D]`` for K and for V -- records decoded with the
   reference decoder's fp32 operations, pool blocks copied -- in the rotated frame, halved
   (exact; it keeps every value the codec can write inside fp16, see ``decode_v4``);
2. the rotated, pre-scaled queries attend to it with FlashAttention (torch's varlen flash
   forward: one call for all requests, GQA native, bottom-right causal alignment), or with
   ``torch.nn.functional.scaled_dot_product_attention`` per request (``causal_lower_right``
   on CUDA; an explicit bottom-right mask where FlashAttention does not apply: the CPU and
   head_dim 512);
3. the output is un-rotated (``@ H``) and scaled back in one Triton pass into ``out``.

Requests are processed in groups whose workspace stays under ``max_workspace_bytes``; a single
request larger than the cap is processed alone (its workspace then exceeds the cap). The
extra HBM traffic (writing and reading ~4 bytes per context token and KV head per K/V) is
~1% of the attention's time at the benchmark shape.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels._common import (
    DenseGeometry,
    cdiv,
    pool_row_ptrs,
    pool_shadow_rows,
    triton_interpret,
)
from kvarn_kernels._launch import launch
from kvarn_kernels.attention import _codes_f16, _load_codes
from kvarn_kernels.rotation import rotate_into

__all__ = [
    "DEFAULT_MAX_WORKSPACE_BYTES",
    "SDPA_BACKENDS",
    "ContextGroup",
    "ContextPlan",
    "VarlenAttention",
    "dequant_context_into",
    "dequant_plan",
    "plan_prefill_context",
    "prefill_dequant_attention",
]

#: Default cap of the dequantized-context workspace (K and V together), in bytes.
DEFAULT_MAX_WORKSPACE_BYTES = 512 << 20
#: Accepted values of ``sdpa_backend``.
SDPA_BACKENDS = ("auto", "varlen", "per_request")
_FP16_MAX: tl.constexpr = tl.constexpr(65504.0)


# n_progs changes every step and stride_bt is the server's block-table width (the warm-up's
# scratch table has another), and the block table is a run's rows of the batch's, aligned or
# not (_common.SLICED_POINTERS); unspecialized, so none is a new compile (seconds) in the
# middle of serving. All only address scalar loads, so specializing them bought nothing.
_UNSPECIALIZED = {
    "do_not_specialize": ["stride_bt", "n_progs"],
    "do_not_specialize_on_alignment": ["BLOCK_TABLE"],
}


@triton.jit(**_UNSPECIALIZED)
def _dequant_context_kernel(
    KV,
    POOL_K,
    POOL_V,
    BLOCK_TABLE,
    BLOCK_TO_SLOT,
    PLAN,
    OUT_K,
    OUT_V,
    stride_bt,
    n_progs,
    HK: tl.constexpr,
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
    BT: tl.constexpr,
    FAST_UNPACK: tl.constexpr,
):
    """One program per (context block of a request, KV head).

    ``PLAN`` is int32 ``[4, n_progs]``: request row, block index within the request, first
    workspace row, valid tokens. Writes ``k / 2`` and ``v / 2`` (rotated frame, fp16) to rows
    ``row0 .. row0 + n - 1`` of ``OUT_K``/``OUT_V`` ``[rows, HK, D]``. A pool block's first
    ``SHADOW`` rows are read from its record area (``_common.pool_row_ptrs``); only the
    record branch decodes record bytes, so those rows never pass for a record.
    """
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.load(PLAN + pid).to(tl.int64)
    j = tl.load(PLAN + n_progs + pid)
    row0 = tl.load(PLAN + 2 * n_progs + pid).to(tl.int64)
    n = tl.load(PLAN + 3 * n_progs + pid)
    blk = tl.load(BLOCK_TABLE + r * stride_bt + j).to(tl.int64)
    slot = tl.load(BLOCK_TO_SLOT + blk)
    dd = tl.arange(0, D)
    tt = tl.arange(0, BT)
    rec = KV + (blk * HK + h) * STRIDE
    f16 = tl.pointer_type(tl.float16)
    for c in tl.static_range(0, G // BT):
        tok = c * BT + tt
        ok = tok < n
        dst = ((row0 + tok) * HK + h)[:, None] * D + dd[None, :]  # [BT, D]
        if slot >= 0:
            # rows past n are masked: NaN/stale pool rows, random bytes past the shadow rows
            if SHADOW == 0:
                # pool_row_ptrs' SHADOW == 0 address as integer offsets, as before shadow
                # rows (the pointer form compiles to different SASS)
                src = ((slot.to(tl.int64) * G + tok) * HK + h)[:, None] * D + dd[None, :]
                kp_ptr = POOL_K + src
                vp_ptr = POOL_V + src
            else:
                s64 = slot.to(tl.int64)
                krow = pool_row_ptrs(POOL_K, KV, s64, blk, tok, h, 0, HK, D, G, SHADOW, STRIDE)
                vrow = pool_row_ptrs(POOL_V, KV, s64, blk, tok, h, 1, HK, D, G, SHADOW, STRIDE)
                kp_ptr = krow[:, None] + dd[None, :]
                vp_ptr = vrow[:, None] + dd[None, :]
            kp = tl.load(kp_ptr, mask=ok[:, None], other=0.0)
            vp = tl.load(vp_ptr, mask=ok[:, None], other=0.0)
            tl.store(OUT_K + dst, kp * 0.5, mask=ok[:, None])
            tl.store(OUT_V + dst, vp * 0.5, mask=ok[:, None])
        else:
            # K: codes [D, BT] along tokens; k = (code * k_scale + k_zero) * k_token_scale.
            k0, k1 = _load_codes(
                rec + OFF_KC, 0, D, D, G * KB // 8, c * (BT * KB // 8), BT, KB, K_ORDER, True
            )
            kc = _codes_f16(k0, k1, BT, KB, FAST_UNPACK).to(tl.float32) - 1024.0
            ks = tl.load((rec + OFF_KS).to(f16) + dd).to(tl.float32)
            kz = tl.load((rec + OFF_KZ).to(f16) + dd).to(tl.float32)
            kt = tl.load((rec + OFF_KT).to(f16) + tok).to(tl.float32)
            k = kc * ks[:, None]
            k = k + kz[:, None]
            k = k * (0.5 * kt[None, :])
            k = tl.minimum(tl.maximum(k, -_FP16_MAX), _FP16_MAX)
            tl.store(OUT_K + tl.trans(dst), k.to(tl.float16), mask=ok[None, :])
            # V: codes [BT, D] along channels; v = (code * v_scale + v_zero) * v_channel_scale.
            v0, v1 = _load_codes(rec + OFF_VC, c * BT, BT, G, D * VB // 8, 0, D, VB, V_ORDER, True)
            vc = _codes_f16(v0, v1, D, VB, FAST_UNPACK).to(tl.float32) - 1024.0
            vs = tl.load((rec + OFF_VS).to(f16) + tok).to(tl.float32)
            vz = tl.load((rec + OFF_VZ).to(f16) + tok).to(tl.float32)
            vcs = tl.load((rec + OFF_VCS).to(f16) + dd).to(tl.float32)
            v = vc * vs[:, None]
            v = v + vz[:, None]
            v = v * (0.5 * vcs[None, :])
            v = tl.minimum(tl.maximum(v, -_FP16_MAX), _FP16_MAX)
            tl.store(OUT_V + dst, v.to(tl.float16), mask=ok[:, None])


#: A FlashAttention-style varlen forward that :func:`kvarn_kernels.prefill_attention` may use
#: instead of torch's: ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
#: softmax_scale)`` with ``q`` ``[Tq, Hq, D]``, ``k``/``v`` ``[Tk, Hk, D]`` fp16 (GQA: ``Hq`` a
#: multiple of ``Hk``), int32 cumulative lengths, causal attention aligned bottom-right (the
#: last query of a request sees all its keys), returning ``[Tq, Hq, D]``. For example vLLM's
#: ``flash_attn_varlen_func`` (FlashAttention-3 on Hopper) wrapped to this signature.
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
    torch.Tensor,
]


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    """torch's FlashAttention-2 varlen forward: CUDA, fp16/bf16, head_dim <= 256, % 8."""
    d = int(q.shape[-1])
    return q.is_cuda and d <= 256 and d % 8 == 0 and not triton_interpret()


def _attend_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """One FlashAttention call for all requests; causal is bottom-right aligned there."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=2.0
    )[0]
    return out  # type: ignore[no-any-return]


def _attend_external(
    fn: VarlenAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """The caller's varlen attention, with the same scale as :func:`_attend_varlen` (the
    workspace holds K/2 and V/2, so the scores are rescaled by 2)."""
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, 2.0)
    if out.shape != q.shape:
        raise ValueError(
            f"varlen_attention returned shape {tuple(out.shape)}, expected {tuple(q.shape)}"
        )
    return out.to(q.dtype)


def _attend_per_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_off: Sequence[int],
    k_off: Sequence[int],
    out: torch.Tensor,
) -> None:
    """``scaled_dot_product_attention`` per request with bottom-right causal alignment.

    On CUDA with a FlashAttention head size, torch's ``causal_lower_right`` bias (dispatched
    to FlashAttention); otherwise an explicit boolean mask per query chunk, bounding the
    ``[Hq, Lq, Lk]`` score memory of the backend that takes masks.
    """
    hq = int(q.shape[1])
    budget = 1 << 26  # score elements per call
    for r in range(len(q_off) - 1):
        q0, q1, k0, k1 = q_off[r], q_off[r + 1], k_off[r], k_off[r + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        kr = k[k0:k1].transpose(0, 1)[None]
        vr = v[k0:k1].transpose(0, 1)[None]
        if _flash_varlen_ok(q):
            from torch.nn.attention.bias import causal_lower_right

            qr = q[q0:q1].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=causal_lower_right(lq, lk), scale=2.0, enable_gqa=True
            )
            out[q0:q1] = o[0].transpose(0, 1)
            continue
        step = max(1, budget // max(1, hq * lk))
        for a in range(0, lq, step):
            b = min(lq, a + step)
            qr = q[q0 + a : q0 + b].transpose(0, 1)[None]
            # query i of the request sits at position lk - lq + i and sees keys <= it
            pos = torch.arange(lk - lq + a, lk - lq + b, device=q.device)
            mask = torch.arange(lk, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=mask, scale=2.0, enable_gqa=True
            )
            out[q0 + a : q0 + b] = o[0].transpose(0, 1)


@dataclass(frozen=True)
class ContextGroup:
    """Requests ``req_start .. req_end - 1`` of a :class:`ContextPlan`, attended together
    from one dequantized workspace of ``rows`` context tokens."""

    req_start: int
    req_end: int
    #: The group's query tokens are ``tok_start .. tok_end - 1`` of the batch.
    tok_start: int
    tok_end: int
    rows: int
    max_query_len: int
    max_context_len: int
    #: Query and workspace offsets of the group's requests, relative to the group.
    q_off: tuple[int, ...]
    k_off: tuple[int, ...]
    #: :func:`dequant_plan` of the group on the device (``[4, blocks]`` int32), and ``q_off``
    #: / ``k_off`` as one ``[2, n + 1]`` int32 tensor for varlen attention; ``None`` when the
    #: group has no query tokens.
    blocks: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


@dataclass(frozen=True)
class ContextPlan:
    """The host-side schedule of one prefill-with-context batch.

    Validated lengths, the request groups under the workspace cap and their small device
    tensors (built with one non-blocking copy). Build it once per batch with
    :func:`plan_prefill_context` and pass it to every layer's
    ``prefill_attention(..., context_plan=plan)``: each layer then skips the planning and
    the copies, which are most of a short chunk's host time.
    """

    group: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    seq_lens: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    #: Block-table columns the longest request needs.
    max_blocks: int
    groups: tuple[ContextGroup, ...]

    @property
    def num_tokens(self) -> int:
        """Query tokens of the batch (``T``)."""
        return self.query_start_loc[-1]

    def check_call(
        self,
        group: int,
        num_kv_heads: int,
        head_dim: int,
        q: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """Raise ``ValueError`` when a call's tensors do not fit this plan (cheap: shapes only;
        the lengths on the device cannot be compared without a host sync)."""
        planned = (
            len(self.seq_lens),
            self.num_tokens,
            self.group,
            self.num_kv_heads,
            self.head_dim,
        )
        called = (int(block_table.shape[0]), int(q.shape[0]), group, num_kv_heads, head_dim)
        if planned != called:

            def describe(b: int, t: int, g: int, hk: int, d: int) -> str:
                return f"{b} requests, {t} query tokens, {g}-token tiles, {hk} KV heads of {d}"

            raise ValueError(
                f"context_plan was built for {describe(*planned)} channels; this call has "
                f"{describe(*called)} channels"
            )
        if q.device != self.device:
            raise ValueError(f"context_plan's tensors are on {self.device} but q is on {q.device}")
        if self.max_blocks > int(block_table.shape[1]):
            raise ValueError(
                f"seq_lens need up to {self.max_blocks} blocks but block_table has "
                f"{int(block_table.shape[1])} columns"
            )


_ALIGN_INT32 = 4  # int32 elements in 16 bytes


def _aligned(n: int) -> int:
    """``n`` int32 elements rounded up to a whole number of 16-byte units."""
    return cdiv(n, _ALIGN_INT32) * _ALIGN_INT32


def plan_prefill_context(
    group: int,
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
) -> ContextPlan:
    """The :class:`ContextPlan` of a batch whose request ``r`` has ``seq_lens[r]`` tokens in
    all, the last ``query_start_loc[r + 1] - query_start_loc[r]`` of them queries.

    ``group`` is the format's tile size (``KVarNFormat.group``). Requests are grouped while
    the group's dequantized K+V workspace (``4 * num_kv_heads * head_dim`` bytes per context
    token) stays under ``max_workspace_bytes``; a single request above the cap is a group of
    its own. Raises ``ValueError`` on inconsistent lengths.
    """
    if max_workspace_bytes < 1:
        raise ValueError(f"max_workspace_bytes must be positive, got {max_workspace_bytes}")
    seq = tuple(int(x) for x in seq_lens)
    qsl = tuple(int(x) for x in query_start_loc)
    nreq = len(seq)
    if len(qsl) != nreq + 1 or qsl[0] != 0 or any(b < a for a, b in itertools.pairwise(qsl)):
        raise ValueError(
            f"query_start_loc must have {nreq + 1} non-decreasing entries from 0; got {list(qsl)}"
        )
    q_lens = [qsl[r + 1] - qsl[r] for r in range(nreq)]
    for r in range(nreq):
        if q_lens[r] > seq[r]:
            raise ValueError(
                f"request {r} has {q_lens[r]} query tokens but seq_lens = {seq[r]}: every query "
                "token must be part of the request's context (0 <= q_len <= seq_len)"
            )
    dev = _concrete_device(torch.device(device))
    # Keys of requests without queries are not needed.
    klen = [seq[r] if q_lens[r] else 0 for r in range(nreq)]
    per_token = 2 * num_kv_heads * head_dim * 2  # K and V, fp16
    spans: list[tuple[int, int, int]] = []
    r = 0
    while r < nreq:
        e, tokens = r, 0
        while e < nreq and (e == r or (tokens + klen[e]) * per_token <= max_workspace_bytes):
            tokens += klen[e]
            e += 1
        spans.append((r, e, tokens))
        r = e
    # All groups' device tensors in one copy: each group's [4, blocks] plan and [2, n + 1]
    # offsets flattened one after the other, then viewed back (contiguous, as the kernel
    # reads the plan). Each piece starts on a 16-byte boundary: Triton compiles a kernel
    # again for a pointer argument that is not 16-byte aligned, and a second group's plan at
    # an odd offset was such a compile in the middle of serving (agent workload, H200).
    host: list[np.ndarray] = []
    metas = []
    for r0, r1, rows in spans:
        t0, t1 = qsl[r0], qsl[r1]
        blocks, k_off = dequant_plan(klen[r0:r1], group, r0)
        q_off = [qsl[i] - t0 for i in range(r0, r1 + 1)]
        if t1 > t0:
            for piece in (blocks.ravel(), np.asarray([q_off, k_off], dtype=np.int32).ravel()):
                host += [piece, np.zeros(_aligned(len(piece)) - len(piece), dtype=np.int32)]
        metas.append((r0, r1, t0, t1, rows, q_off, k_off, int(blocks.shape[1])))
    flat = _host_to_device(np.concatenate(host), dev) if host else None
    groups: list[ContextGroup] = []
    at = 0
    for r0, r1, t0, t1, rows, q_off, k_off, nblocks in metas:
        g_blocks = g_cu = None
        if t1 > t0 and flat is not None:
            g_blocks = flat[at : at + 4 * nblocks].view(4, nblocks)
            at += _aligned(4 * nblocks)
            g_cu = flat[at : at + 2 * len(q_off)].view(2, len(q_off))
            at += _aligned(2 * len(q_off))
        groups.append(
            ContextGroup(
                req_start=r0,
                req_end=r1,
                tok_start=t0,
                tok_end=t1,
                rows=rows,
                max_query_len=max(q_lens[r0:r1], default=0),
                max_context_len=max(klen[r0:r1], default=0),
                q_off=tuple(q_off),
                k_off=tuple(k_off),
                blocks=g_blocks,
                cu_seqlens=g_cu,
            )
        )
    return ContextPlan(
        group=group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=dev,
        seq_lens=seq,
        query_start_loc=qsl,
        max_blocks=max((-(-s // group) for s in seq), default=0),
        groups=tuple(groups),
    )


def prefill_dequant_attention(
    geo: DenseGeometry,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    plan: ContextPlan,
    *,
    sdpa_backend: str,
    varlen_attention: VarlenAttention | None = None,
) -> None:
    """The ``method="dequant"`` path of :func:`kvarn_kernels.prefill_attention` (arguments
    already validated there, ``plan`` checked against them)."""
    t, hq, d = (int(s) for s in q.shape)
    backend = sdpa_backend
    if varlen_attention is not None:
        backend = "external"
    elif backend == "auto":
        backend = "varlen" if _flash_varlen_ok(q) else "per_request"
    if backend == "varlen" and not _flash_varlen_ok(q):
        raise ValueError(
            "sdpa_backend='varlen' needs a CUDA tensor with head_dim <= 256 (torch's "
            "FlashAttention); use 'per_request' or 'auto'"
        )

    # Queries: rotated, softmax scale folded in, fp16 (the workspace dtype).
    q16 = torch.empty((t, hq, d), dtype=torch.float16, device=q.device)
    rotate_into(q, q16, float(softmax_scale))  # q read where it lies (a QKV view: no copy)
    # One group: the attention library's output is used as is; several: gathered in o16.
    o16: torch.Tensor | None = None if len(plan.groups) == 1 else torch.zeros_like(q16)
    for grp in plan.groups:
        o16 = _run_group(
            geo,
            q16,
            o16,
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            block_to_slot,
            grp,
            backend,
            varlen_attention,
        )
    if o16 is None:  # no request has query tokens
        o16 = torch.zeros_like(q16)
    # out = 2 * (o @ H): the workspace held K/2 and V/2, the scores were rescaled by 2.
    rotate_into(o16.view(t * hq, d), out.view(t * hq, d), 2.0)


def _concrete_device(dev: torch.device) -> torch.device:
    """``dev`` with its index: a plain ``cuda`` is the current CUDA device.

    Tensors report ``cuda:0``, never ``cuda``, so a plan built for ``"cuda"`` must name the
    index to compare equal with the tensors of the calls it serves.
    """
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _host_to_device(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Copy a small host array to ``dev`` without a host sync.

    A copy from pageable memory makes the host wait until the GPU has drained the stream, and
    then the GPU idles while Python launches the next kernels. From pinned memory the copy is
    queued like a kernel; PyTorch's pinned-memory cache keeps the buffer alive until the copy
    has run.
    """
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _run_group(
    geo: DenseGeometry,
    q16: torch.Tensor,
    o16: torch.Tensor | None,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    block_to_slot: torch.Tensor,
    grp: ContextGroup,
    backend: str,
    varlen_attention: VarlenAttention | None = None,
) -> torch.Tensor:
    """Attention of one plan group: into ``o16`` when given, else into a new ``[T, Hq, D]``
    tensor (only when the group is the whole batch). Returns the output."""
    hk, d = int(pool_k.shape[2]), int(pool_k.shape[3])
    t0, t1 = grp.tok_start, grp.tok_end
    if grp.blocks is None or grp.cu_seqlens is None:  # no query tokens
        return torch.zeros_like(q16) if o16 is None else o16
    ws_k = torch.empty((max(grp.rows, 1), hk, d), dtype=torch.float16, device=q16.device)
    ws_v = torch.empty_like(ws_k)
    dequant_context_into(
        geo, kv_cache, pool_k, pool_v, block_table, block_to_slot, grp.blocks, ws_k, ws_v
    )
    qg = q16[t0:t1]
    if backend in ("varlen", "external"):
        attend = _attend_varlen
        if varlen_attention is not None:
            attend = functools.partial(_attend_external, varlen_attention)
        cu = grp.cu_seqlens
        res = attend(
            qg,
            ws_k[: grp.rows],
            ws_v[: grp.rows],
            cu[0],
            cu[1],
            grp.max_query_len,
            grp.max_context_len,
        )
        if o16 is None:  # the whole batch: the library's output is the result
            return res
        o16[t0:t1] = res
        return o16
    if o16 is None:
        o16 = torch.zeros_like(q16)
    _attend_per_request(qg, ws_k, ws_v, grp.q_off, grp.k_off, o16[t0:t1])
    return o16


def dequant_plan(
    klen: Sequence[int], g: int, first_request: int = 0
) -> tuple[np.ndarray, list[int]]:
    """The dequantization plan of requests with ``klen`` context tokens each (rows
    ``first_request ..`` of the block table): int32 ``[4, blocks]`` (request row, block index,
    first workspace row, valid tokens; vectorized, a large batch has thousands of blocks)
    and the workspace offsets of the requests (``len(klen) + 1`` entries)."""
    kl = np.asarray(klen, dtype=np.int64)
    nb = -(-kl // g)
    k_off = [0, *np.cumsum(kl).tolist()]
    total = int(nb.sum())
    req = np.repeat(np.arange(first_request, first_request + len(kl), dtype=np.int64), nb)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
    row0 = np.repeat(np.asarray(k_off[:-1], dtype=np.int64), nb) + j * g
    ntok = np.minimum(g, np.repeat(kl, nb) - j * g)
    plan = np.ascontiguousarray(np.stack([req, j, row0, ntok]).astype(np.int32))
    return plan, [int(x) for x in k_off]


def dequant_context_into(
    geo: DenseGeometry,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    block_to_slot: torch.Tensor,
    plan: torch.Tensor,
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
) -> None:
    """One launch: every block of ``plan`` (:func:`dequant_plan`, on the device) into the
    workspaces ``ws_k``/``ws_v`` ``[rows, Hk, D]`` fp16 as K/2 and V/2 in the rotated frame.
    The pool may have shadow rows (``G - R`` rows per slot, a tile's first ``R`` rows in its
    block's record area of ``kv_cache``; :func:`kvarn_format.geometry.shadow_rows`).

    Also what ``tools/gpu_kernel_check.py`` times alone.
    """
    hk, d, g = int(pool_k.shape[2]), int(pool_k.shape[3]), geo.group
    shadow = pool_shadow_rows(pool_k, g, kv_cache)
    total = int(plan.shape[1])
    if total == 0:
        return
    bt = 32 if d <= 128 else (16 if d <= 256 else 8)
    launch(
        _dequant_context_kernel,
        (total, hk),
        (
            kv_cache,
            pool_k,
            pool_v,
            block_table,
            block_to_slot,
            plan,
            ws_k,
            ws_v,
            block_table.stride(0),
            total,
        ),
        {
            "HK": hk,
            "D": d,
            "G": g,
            "SHADOW": shadow,
            "KB": geo.key_bits,
            "VB": geo.value_bits,
            "STRIDE": geo.record_stride,
            **geo.offsets(),
            "BT": min(bt, g),
            "FAST_UNPACK": not triton_interpret(),
        },
        num_warps=4,
    )
