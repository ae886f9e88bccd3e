# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton JIT kernels and their @triton.jit helpers are untyped by nature; the public
# wrappers in this module are fully annotated.)
"""Hadamard rotation of activations along head_dim, and the fp16 side-pool writer.

The format fixes the rotation to ``x @ H`` with ``H`` the natural-order Sylvester matrix over
``sqrt(D)`` (kvarn_format.hadamard). The kernels never multiply by ``H`` itself: they multiply
by the exact ``+-1`` sign matrix on the tensor cores (fp16 or bf16 operands, fp32 accumulation:
every product is exact and only the fp32 sums round) and apply ``1/sqrt(D)`` once in fp32.
That is "rotate in fp32" at tensor-core speed. The result is cast to fp16 with saturation,
because the side pool and the quantizer are fp16: a rotated value past 65504 becomes +-65504,
never inf.

:func:`write_side_pool` fuses the rotation with the scatter into the paged fp16 side pool, so
an incoming token is read once and written once.
"""

from __future__ import annotations

import math
from functools import cache
from typing import cast

import numpy as np
import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_format.hadamard import hadamard_matrix as _np_hadamard
from kvarn_kernels._common import (
    ACT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_head_dim,
    check_index_tensor,
    check_ndim,
    debug_checks_enabled,
    pool_row_ptrs,
    pool_shadow_rows,
    tensor_layouts,
    triton_interpret,
)
from kvarn_kernels._launch import PreparedLaunch

__all__ = [
    "SidePoolWritePlan",
    "hadamard_matrix",
    "plan_side_pool_write",
    "query_rotation",
    "rotate",
    "rotate_f32",
    "rotate_into",
    "sign_matrix",
    "write_side_pool",
]

FP16_MAX = 65504.0
_FP16_MAX: tl.constexpr = tl.constexpr(FP16_MAX)


@cache
def hadamard_matrix(
    head_dim: int, device: torch.device | str, dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """The format's rotation ``H`` (``[D, D]``, symmetric, ``H @ H = I``) on ``device``.

    Built from :func:`kvarn_format.hadamard.hadamard_matrix` (float64) and cast to ``dtype``;
    cached per ``(head_dim, device, dtype)``. Do not modify the returned tensor.
    """
    check_head_dim(head_dim)
    h = torch.from_numpy(np.array(_np_hadamard(head_dim)))
    return h.to(device=torch.device(device), dtype=dtype)


@cache
def sign_matrix(head_dim: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """``H * sqrt(D)``: the exact ``+-1`` matrix the kernels multiply by (cached)."""
    check_head_dim(head_dim)
    s = np.rint(np.array(_np_hadamard(head_dim)) * np.sqrt(head_dim))
    return torch.from_numpy(s).to(device=torch.device(device), dtype=dtype).contiguous()


# n_rows changes every step; Triton would compile a variant per divisibility class of it
# (a stall of seconds on a serving step), and it only bounds a mask.
@triton.jit(do_not_specialize=["n_rows"])
def _rotate_rows_kernel(
    X,
    Y,
    S,
    SLOT_MAPPING,
    BLOCK_TO_SLOT,
    KV,
    n_rows,
    stride_xt,
    stride_xh,
    inv_sqrt_d,
    HK: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    SHADOW: tl.constexpr,
    STRIDE: tl.constexpr,
    IS_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_F32: tl.constexpr,
    SCATTER: tl.constexpr,
    OUT_BF16: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Rows ``r = t * HK + h`` of ``X[t, h, :]`` times the sign matrix, over sqrt(D).

    Plain mode writes row ``r`` of a contiguous ``Y[n_rows, D]``. Scatter mode writes token
    ``t``, head ``h`` to tile row ``s % G`` of block ``s // G`` in its pool slot
    ``block_to_slot[s // G]`` (``pool_row_ptrs``: the first ``SHADOW`` rows in the block's
    record area in ``KV``) with ``s = slot_mapping[t]``, and skips tokens with ``s < 0``
    (padding) or no pool slot.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_rows
    t = (rows // HK).to(tl.int64)
    h = (rows % HK).to(tl.int64)
    x_row = t * stride_xt + h * stride_xh
    if SCATTER:
        slot = tl.load(SLOT_MAPPING + t, mask=valid, other=-1).to(tl.int64)
        valid = valid & (slot >= 0)
        blk = tl.where(valid, slot // G, 0)
        pool_slot = tl.load(BLOCK_TO_SLOT + blk, mask=valid, other=-1).to(tl.int64)
        valid = valid & (pool_slot >= 0)
        y_base = pool_row_ptrs(Y, KV, pool_slot, blk, slot % G, h, IS_V, HK, D, G, SHADOW, STRIDE)
    else:
        y_base = Y + rows.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_C)
    for n0 in tl.static_range(0, D, BLOCK_C):
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_C):
            x = tl.load(X + x_row[:, None] + (k0 + cols)[None, :], mask=valid[:, None], other=0.0)
            s = tl.load(S + (k0 + cols)[:, None] * D + (n0 + cols)[None, :])
            acc = tl.dot(x, s, acc, input_precision="ieee") if IEEE else tl.dot(x, s, acc)
        y = acc * inv_sqrt_d
        y_ptrs = y_base[:, None] + (n0 + cols)[None, :]
        if OUT_F32:
            tl.store(y_ptrs, y, mask=valid[:, None])
        elif OUT_BF16:
            tl.store(y_ptrs, y.to(tl.bfloat16), mask=valid[:, None])
        else:
            # Saturate: |y| > 65504 becomes +-65504; NaN fails both tests and stays NaN.
            y = tl.where(y > _FP16_MAX, _FP16_MAX, y)
            y = tl.where(y < -_FP16_MAX, -_FP16_MAX, y)
            tl.store(y_ptrs, y.to(tl.float16), mask=valid[:, None])


#: Row counts at which the rotation kernel's row tile grows (16, 32, then 64 rows); each tile
#: is its own compile (kvarn_kernels.warmup launches one per class).
ROW_TILE_EDGES = (16, 4096)


def _block_r(n_rows: int) -> int:
    small, large = ROW_TILE_EDGES
    return 16 if n_rows <= small else (32 if n_rows <= large else 64)


def rotation_input(x: torch.Tensor) -> torch.Tensor:
    """What the rotation kernel reads for ``x``: ``x`` itself, or under the interpreter a bf16
    ``x`` widened to fp32 (NumPy, the interpreter's backend, has no bf16 matmul; exact). The
    same function of every tensor of one layout, so a prepared launch may take the next
    layer's ``rotation_input(x)`` in its place."""
    if x.dtype == torch.bfloat16 and triton_interpret():
        return x.float()
    return x


def rotate_launch(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    n_rows: int,
    hk: int,
    out_f32: bool,
    slot_mapping: torch.Tensor | None = None,
    block_to_slot: torch.Tensor | None = None,
    group: int = 1,
    scale: float = 1.0,
    kv_cache: torch.Tensor | None = None,
    shadow: int = 0,
    is_v: bool = False,
) -> PreparedLaunch:
    """The rotation kernel's launch on ``n_rows`` rows of ``x`` (read as
    :func:`rotation_input` gives it) into ``y``, not yet run (an empty one runs nothing)."""
    x = rotation_input(x)
    d = x.shape[-1]
    # x is [rows, D] or [T, Hk, D] (any strides but the last); rows are t * hk + h.
    stride_t = x.stride(0)
    stride_h = x.stride(1) if x.dim() == 3 else 0
    s = sign_matrix(d, x.device, x.dtype)
    block_r = _block_r(n_rows)
    block_c = min(d, 128)
    scatter = slot_mapping is not None
    dummy = s  # any tensor: the scatter-only pointers are not read in plain mode
    return PreparedLaunch(
        _rotate_rows_kernel,
        (cdiv(n_rows, block_r),),
        (
            x,
            y,
            s,
            slot_mapping if slot_mapping is not None else dummy,
            block_to_slot if block_to_slot is not None else dummy,
            kv_cache if kv_cache is not None else dummy,
            n_rows,
            stride_t,
            stride_h,
            float(scale) / math.sqrt(d),
        ),
        {
            "HK": hk,
            "D": d,
            "G": group,
            "SHADOW": shadow,
            "STRIDE": int(kv_cache.shape[-1]) if kv_cache is not None else 0,
            # K and V share one compile without shadow rows
            "IS_V": is_v and shadow > 0,
            "BLOCK_R": block_r,
            "BLOCK_C": block_c,
            "OUT_F32": out_f32,
            "SCATTER": scatter,
            "OUT_BF16": y.dtype == torch.bfloat16,
            "IEEE": x.dtype == torch.float32,
        },
        num_warps=4,
    )


def _check_rotate_input(x: torch.Tensor, allow_f32: bool) -> int:
    allowed = (*ACT_DTYPES, torch.float32) if allow_f32 else ACT_DTYPES
    check_dtype("x", x, allowed)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the head_dim axis)")
    d = int(x.shape[-1])
    check_head_dim(d)
    return d


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., D]`` by the format's Hadamard matrix: ``fp16(saturate(x @ H))``.

    ``x`` may be fp16, bf16 or fp32; products are exact and sums are fp32, then the result is
    rounded to fp16 with saturation (the side pool's representation). Returns a new contiguous
    fp16 tensor of ``x``'s shape. A ``[T, H, D]`` ``x`` with contiguous rows (a view of a
    fused QKV tensor) is read where it lies, not copied first.
    """
    d = _check_rotate_input(x, allow_f32=True)
    rows, hk = _readable_rows(x, d)
    y = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    rotate_launch(rows, y.view(-1, d), n_rows=x.numel() // d, hk=hk, out_f32=False).run()
    return y


def rotate_f32(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ H`` in fp32 without the fp16 cast (the attention ops rotate queries so).

    ``x`` is ``[..., D]`` fp16/bf16/fp32, read where it lies as :func:`rotate` reads it;
    ``out`` (optional) a contiguous fp32 tensor with ``x.numel()`` elements.
    """
    d = _check_rotate_input(x, allow_f32=True)
    rows, hk = _readable_rows(x, d)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or out.numel() != x.numel() or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {x.numel()} elements")
    rotate_launch(rows, out.view(-1, d), n_rows=x.numel() // d, hk=hk, out_f32=True).run()
    return out.reshape(x.shape)


def _readable_rows(x: torch.Tensor, d: int) -> tuple[torch.Tensor, int]:
    """``x`` as the rotation kernel reads it, and its rows per token (``HK``): a ``[T, H, D]``
    tensor with contiguous rows as it is (any token and head strides), anything else as
    ``[rows, D]`` (a copy where the rows cannot be viewed so)."""
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, int(x.shape[1])
    rows = x.reshape(-1, d)
    return (rows if rows.stride(-1) == 1 else rows.contiguous()), 1


def query_rotation(q: torch.Tensor, q_rot: torch.Tensor) -> PreparedLaunch:
    """The launch rotating ``[T, H, D]`` queries into ``q_rot``'s ``T * H`` contiguous fp32
    rows (``x @ H`` without the fp16 cast, as :func:`rotate_f32`), reading ``q`` through its
    strides: a query that is a view of a fused QKV tensor (vLLM's) is not copied first.
    ``q``'s rows must be contiguous (``stride(-1) == 1``)."""
    t, h, d = (int(s) for s in q.shape)
    return rotate_launch(q, q_rot.view(t * h, d), n_rows=t * h, hk=h, out_f32=True)


def rotate_into(x: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``out = scale * (x @ H)`` into a contiguous ``out`` of ``x``'s shape, fp16 (saturated),
    bf16 or fp32; ``x`` read where it lies as :func:`rotate` reads it. Internal helper of the
    attention ops (no argument checks beyond shapes)."""
    if x.shape != out.shape or not out.is_contiguous():
        raise ValueError("rotate_into needs a contiguous out of x's shape")
    d = int(x.shape[-1])
    rows, hk = _readable_rows(x, d)
    rotate_launch(
        rows,
        out.view(-1, d),
        n_rows=x.numel() // d,
        hk=hk,
        out_f32=out.dtype == torch.float32,
        scale=scale,
    ).run()
    return out


def _check_pool(pool_k: torch.Tensor, pool_v: torch.Tensor) -> tuple[int, int, int, int]:
    check_ndim("pool_k", pool_k, 4, "[num_slots, G - R, Hk, D]")
    check_dtype("pool_k", pool_k, (torch.float16,))
    check_dtype("pool_v", pool_v, (torch.float16,))
    if pool_v.shape != pool_k.shape:
        raise ValueError(
            f"pool_v must have pool_k's shape {tuple(pool_k.shape)}; got {tuple(pool_v.shape)}"
        )
    if not (pool_k.is_contiguous() and pool_v.is_contiguous()):
        raise ValueError("pool_k and pool_v must be contiguous [num_slots, G - R, Hk, D] tensors")
    n, g, hk, d = (int(s) for s in pool_k.shape)
    check_head_dim(d)
    return n, g, hk, d


def write_side_pool(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_to_slot: torch.Tensor,
    *,
    kv_cache: torch.Tensor | None = None,
    group: int | None = None,
    check: bool | None = None,
) -> None:
    """Rotate incoming K/V tokens and scatter them into the paged fp16 side pool.

    Args:
        k, v: ``[T, Hk, D]`` fp16 or bf16, unrotated (last dim contiguous).
        pool_k, pool_v: ``[num_slots, G - R, Hk, D]`` fp16, contiguous; written in place.
            ``R`` (shadow rows, default 0) is ``group`` minus the pool's rows per slot.
        slot_mapping: ``[T]`` int32/int64, vLLM slot ``block_id * G + offset``; ``-1`` skips
            the token (padding).
        block_to_slot: ``[num_blocks]`` int32, the pool slot of each block or ``-1``.
        kv_cache: the paged cache ``[num_blocks, Hk, record stride]`` uint8, needed when the
            pool has shadow rows: a tile's first ``R`` rows go to its block's record area
            (:func:`kvarn_format.geometry.shadow_rows`).
        group: the tile size ``G`` (the format's group); default the pool's rows per slot.
        check: when true (default: env ``KVARN_KERNELS_DEBUG=1``), raise ``ValueError`` if a
            token's block has no pool slot. Such tokens are a caller bug; without the check
            they are skipped (never written elsewhere). The check syncs with the host, so keep
            it off under CUDA-graph capture.

    Token ``t`` lands in tile row ``s % G`` of block ``s // G`` with ``s = slot_mapping[t]``,
    as ``fp16(saturate(x @ H))``: at ``pool[block_to_slot[s // G], s % G - R]``, or in the
    block's record area for rows ``< R``.
    """
    for launch in _side_pool_launches(
        k, v, pool_k, pool_v, slot_mapping, block_to_slot, kv_cache, group, check
    ):
        launch.run()


def _side_pool_launches(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_to_slot: torch.Tensor,
    kv_cache: torch.Tensor | None,
    group: int | None,
    check: bool | None,
) -> tuple[PreparedLaunch, PreparedLaunch]:
    """:func:`write_side_pool`'s checks, then its two launches (K's and V's), not yet run."""
    _, rows, hk, d = _check_pool(pool_k, pool_v)
    g = rows if group is None else group
    shadow = pool_shadow_rows(pool_k, g, kv_cache)
    if kv_cache is not None and shadow:
        check_dtype("kv_cache", kv_cache, (torch.uint8,))
        if kv_cache.dim() != 3 or int(kv_cache.shape[1]) != hk or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"kv_cache must be a [num_blocks, {hk}, record stride] uint8 cache; "
                f"got shape {tuple(kv_cache.shape)}"
            )
        check_device(pool_k.device, kv_cache=kv_cache)
    for name, x in (("k", k), ("v", v)):
        check_ndim(name, x, 3, "[T, Hk, D]")
        check_dtype(name, x, ACT_DTYPES)
        if tuple(x.shape[1:]) != (hk, d):
            raise ValueError(
                f"{name} must have shape [T, {hk}, {d}] to match the pool; got {tuple(x.shape)}"
            )
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must hold the same tokens; got {k.shape[0]} and {v.shape[0]}")
    check_ndim("slot_mapping", slot_mapping, 1, "[T]")
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens"
        )
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    check_index_tensor("block_to_slot", block_to_slot, 1, "[num_blocks]")
    check_device(
        pool_k.device,
        k=k,
        v=v,
        pool_v=pool_v,
        slot_mapping=slot_mapping,
        block_to_slot=block_to_slot,
    )
    t = int(k.shape[0])
    if debug_checks_enabled(check) and t:
        _check_slots(slot_mapping, block_to_slot, g)

    def scatter(x: torch.Tensor, pool: torch.Tensor, is_v: bool) -> PreparedLaunch:
        return rotate_launch(
            x,
            pool,
            n_rows=t * hk,
            hk=hk,
            out_f32=False,
            slot_mapping=slot_mapping,
            block_to_slot=block_to_slot,
            group=g,
            kv_cache=kv_cache if shadow else None,
            shadow=shadow,
            is_v=is_v,
        )

    return scatter(k, pool_k, False), scatter(v, pool_v, True)


class SidePoolWritePlan:
    """One step's :func:`write_side_pool` calls, one per layer: the step's slot mapping and
    block-to-slot map, and the launches prepared for each layout of the per-layer tensors.

    vLLM writes each layer's new K/V eagerly in every step a FULL CUDA graph does not replay
    (every step with a prefill in it), through the same slot mapping. The first call with a
    given layout of K, V, the pools and the cache (shapes, strides, dtypes, devices) runs
    every check of :func:`write_side_pool` and prepares its two launches; each later call
    with that layout compares the layout and launches with its own tensors in their place
    (:meth:`~kvarn_kernels._launch.PreparedLaunch.run_replacing`). Build it with
    :func:`plan_side_pool_write` and pass the very index tensors it holds to each call.
    """

    def __init__(
        self, slot_mapping: torch.Tensor, block_to_slot: torch.Tensor, *, group: int | None = None
    ) -> None:
        if group is not None and group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.slot_mapping = slot_mapping
        self.block_to_slot = block_to_slot
        self.group = group
        self._prepared: dict[tuple[object, ...], tuple[PreparedLaunch, PreparedLaunch]] = {}

    def __repr__(self) -> str:
        return (
            f"SidePoolWritePlan({int(self.slot_mapping.shape[0])} tokens, "
            f"{len(self._prepared)} layouts prepared)"
        )

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_to_slot: torch.Tensor,
        *,
        kv_cache: torch.Tensor | None = None,
        check: bool | None = None,
    ) -> None:
        """One layer's :func:`write_side_pool` (its arguments; ``slot_mapping`` and
        ``block_to_slot`` must be the plan's own)."""
        if slot_mapping is not self.slot_mapping or block_to_slot is not self.block_to_slot:
            raise ValueError(
                "the plan was built for other index tensors: pass plan.slot_mapping and "
                "plan.block_to_slot, or build one for this step"
            )
        layout = (
            *tensor_layouts(k, v, pool_k, pool_v),
            None if kv_cache is None else tensor_layouts(kv_cache),
        )
        prepared = self._prepared.get(layout)
        if prepared is None:
            prepared = _side_pool_launches(
                k, v, pool_k, pool_v, slot_mapping, block_to_slot, kv_cache, self.group, check
            )
            self._prepared[layout] = prepared
            for launch in prepared:
                launch.run()
            return
        if debug_checks_enabled(check) and int(k.shape[0]):
            _check_slots(slot_mapping, block_to_slot, cast(int, prepared[0].constexprs["G"]))
        for launch, x, pool in zip(prepared, (k, v), (pool_k, pool_v), strict=True):
            layer: dict[int, object] = {0: rotation_input(x), 1: pool}
            if launch.constexprs["SHADOW"]:  # the cache the shadow rows go to
                layer[5] = kv_cache
            launch.run_replacing(layer)


def plan_side_pool_write(
    slot_mapping: torch.Tensor, block_to_slot: torch.Tensor, *, group: int | None = None
) -> SidePoolWritePlan:
    """A :class:`SidePoolWritePlan` for one step's :func:`write_side_pool` calls: pass its
    :meth:`~SidePoolWritePlan.write` these very tensors in every layer. ``group``: as
    :func:`write_side_pool`'s (checked on the first call, with the pools)."""
    return SidePoolWritePlan(slot_mapping, block_to_slot, group=group)


def _check_slots(slot_mapping: torch.Tensor, block_to_slot: torch.Tensor, g: int) -> None:
    slots = slot_mapping.long()
    live = slots >= 0
    blocks = torch.where(live, slots // g, torch.zeros_like(slots))
    if bool((blocks >= block_to_slot.shape[0]).any()):
        raise ValueError("slot_mapping points past block_to_slot: a block id is out of range")
    missing = live & (block_to_slot.long()[blocks] < 0)
    if bool(missing.any()):
        idx = torch.nonzero(missing).flatten()[:8].tolist()
        raise ValueError(
            f"tokens {idx} (of {int(missing.sum())}) belong to blocks without a side-pool slot "
            "(block_to_slot == -1); allocate their pool slots before write_side_pool"
        )
