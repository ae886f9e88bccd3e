"""Decode attention prepared once per batch and replayed by every layer.

vLLM runs attention eagerly, once per layer, in every step that is not a pure decode batch
(a FULL CUDA graph replays those): the decode rows of a step with a prefill in it go through
``decode_attention`` 36 times for one batch. An unplanned call checks eight tensors, picks
the kernel variant and split count, builds four launches' argument and constexpr tables and
slices the workspace: ~39 µs of Python (v4c) and ~56 µs (v6f) a call on a 2-core CPU with the
launches stubbed (docs/kernel-notes.md, forty-fifth session).

A :class:`DecodeBatchPlan` holds one batch's index tensors and options. The first call with a
given layout of the per-layer tensors (queries, cache, pools, output: shapes, strides,
dtypes, devices; the softmax scale; whether the cache can be a TMA base) runs every check of
an unplanned call and prepares its launches; each later call with that layout compares the
layout and launches with its own tensors in place of the first call's. The plan's workspace
is reused by those calls, so they must run on one stream, one after another (as a model's
layers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn_format.registry import KVarNFormat
from kvarn_kernels import _launch as launcher
from kvarn_kernels._common import DenseGeometry
from kvarn_kernels.attention import (
    _attention_launches,
    _AttentionLaunches,
    _decode_setup,
    _q_for_kernel,
    _tma_addressable,
    _v6_tma_descriptors_at,
)
from kvarn_kernels.rotation import rotation_input

__all__ = ["DecodeBatchPlan", "plan_decode_batch"]


@dataclass(frozen=True)
class _Prepared:
    """What one layout of the per-layer tensors runs, and the first call's tensors that the
    launches hold (replaced by each later call's own)."""

    geo: DenseGeometry
    #: None for an empty batch
    launches: _AttentionLaunches | None
    kv_cache: torch.Tensor
    pool_k: torch.Tensor
    pool_v: torch.Tensor
    out: torch.Tensor


class DecodeBatchPlan:
    """One batch of ``decode_attention`` calls: its index tensors, its options and the launches
    prepared for each layout of the per-layer tensors.

    Build it once per batch with :func:`plan_decode_batch` and pass it to each layer's
    ``decode_attention(..., batch_plan=plan)`` with the very index tensors it was built with.
    Calls sharing a plan share its workspace: run them on one stream.
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        block_to_slot: torch.Tensor,
        *,
        variant: str = "auto",
        num_splits: int | None = None,
        mma_rows: int | None = None,
        workspace: torch.Tensor | None = None,
    ) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.block_to_slot = block_to_slot
        self.variant = variant
        self.num_splits = num_splits
        self.mma_rows = mma_rows
        self._workspace = workspace
        self._prepared: dict[tuple[object, ...], _Prepared] = {}

    def __repr__(self) -> str:
        return (
            f"DecodeBatchPlan({int(self.block_table.shape[0])} requests, "
            f"variant={self.variant!r}, {len(self._prepared)} layouts prepared)"
        )

    def attend(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        block_to_slot: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """``decode_attention`` of one layer (its arguments, checked as there on a layout's
        first call)."""
        if not (
            block_table is self.block_table
            and seq_lens is self.seq_lens
            and block_to_slot is self.block_to_slot
        ):
            raise ValueError(
                "batch_plan was built for other block_table, seq_lens or block_to_slot "
                "tensors: pass the plan's own (plan.block_table, ...) or build one for this "
                "batch with plan_decode_batch"
            )
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        layout = (
            fmt,
            launcher.PROGRAMMATIC_LAUNCH,
            float(softmax_scale),
            _tma_addressable(kv_cache),  # whether v6t reads this cache by TMA
            *_layout(q),
            *_layout(kv_cache),
            *_layout(pool_k),
            *_layout(pool_v),
            *_layout(out),
        )
        try:
            prepared = self._prepared.get(layout)
        except TypeError:  # an unhashable fmt: the checks name what is wrong with it
            prepared = None
        if prepared is None:
            prepared = self._prepare(fmt, q, kv_cache, pool_k, pool_v, softmax_scale, out)
            self._prepared[layout] = prepared
            if prepared.launches is not None:
                prepared.launches.run(q.device)
            return out
        if prepared.launches is not None:
            prepared.launches.run(
                q.device, self._for_layer(prepared, q, kv_cache, pool_k, pool_v, out)
            )
        return out

    def _prepare(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor,
    ) -> _Prepared:
        setup = _decode_setup(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            self.block_table,
            self.seq_lens,
            self.block_to_slot,
            out,
            self._workspace,
            softmax_scale,
            num_splits=self.num_splits,
            variant=self.variant,
            mma_rows=self.mma_rows,
        )
        launches = _attention_launches(
            setup.geo,
            _q_for_kernel(q),
            kv_cache,
            pool_k,
            pool_v,
            self.block_table,
            self.seq_lens,
            self.block_to_slot,
            None,
            softmax_scale,
            out,
            setup.workspace,
            setup.num_splits,
            True,
            None,
            None,
            variant=setup.variant,
            mma_rows=self.mma_rows,
        )
        return _Prepared(setup.geo, launches, kv_cache, pool_k, pool_v, out)

    @staticmethod
    def _for_layer(
        prepared: _Prepared,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        out: torch.Tensor,
    ) -> list[tuple[object, ...]]:
        """The prepared launches' arguments with this layer's tensors where the first call's
        were."""
        assert prepared.launches is not None
        rotation, *rest = prepared.launches.launches
        swap: dict[int, object] = {
            id(prepared.kv_cache): kv_cache,
            id(prepared.pool_k): pool_k,
            id(prepared.pool_v): pool_v,
            id(prepared.out): out,
        }
        # the rotation reads what query_rotation's launch read in the layout's first call
        layer = [(rotation_input(_q_for_kernel(q)), *rotation.args[1:])]
        for launch in rest:
            args = tuple(swap.get(id(a), a) for a in launch.args)
            if launch.descriptors:  # v6t: this cache's own descriptors
                descs = _v6_tma_descriptors_at(prepared.geo, kv_cache.data_ptr(), kv_cache.numel())
                args = (*args[: -launch.descriptors], *descs)
            layer.append(args)
        return layer


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return (t.shape, t.stride(), t.dtype, t.device)


def plan_decode_batch(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    *,
    variant: str = "auto",
    num_splits: int | None = None,
    mma_rows: int | None = None,
    workspace: torch.Tensor | None = None,
) -> DecodeBatchPlan:
    """A :class:`DecodeBatchPlan` for one batch of ``decode_attention`` calls: pass it as
    ``batch_plan=`` with these very tensors to each layer's call. ``variant``,
    ``num_splits``, ``mma_rows`` and ``workspace``: as ``decode_attention``'s (checked on
    the first call, with the queries and cache)."""
    return DecodeBatchPlan(
        block_table,
        seq_lens,
        block_to_slot,
        variant=variant,
        num_splits=num_splits,
        mma_rows=mma_rows,
        workspace=workspace,
    )
