"""Decode and verify attention prepared once per batch and replayed by every layer.

vLLM runs attention eagerly, once per layer, in every step that is not a pure decode (or
uniform verify) batch, which a FULL CUDA graph replays: the decode rows of a step with a
prefill in it go through ``decode_attention`` 36 times for one batch, and a speculative
verify run through ``verify_attention``. An unplanned call checks eight tensors, picks the
kernel variant and split count, builds four launches' argument and constexpr tables and
slices the workspace: ~44 µs of Python (v4c) and ~57-59 µs (v6f, v6t) a decode call on a
2-core CPU with the launches stubbed (docs/kernel-notes.md, forty-fifth session).

A :class:`DecodeBatchPlan` (or :class:`VerifyBatchPlan`) holds one batch's index tensors and
options. The first call with a given layout of the per-layer tensors (queries, cache, pools,
output: shapes, strides, dtypes, devices; the softmax scale; whether the cache can be a TMA
base) runs every check of an unplanned call and prepares its launches; each later call with
that layout compares the layout and launches with its own tensors in place of the first
call's. The plan's workspace is reused by those calls, so they must run on one stream, one
after another (as a model's layers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn_format.registry import KVarNFormat
from kvarn_kernels import _launch as launcher
from kvarn_kernels._common import tensor_layouts
from kvarn_kernels.attention import (
    _attention_launches,
    _AttentionLaunches,
    _decode_setup,
    _q_for_kernel,
    _tma_addressable,
    _v6_tma_descriptors_at,
    _verify_launches,
    _verify_setup,
)
from kvarn_kernels.rotation import rotation_input

__all__ = ["DecodeBatchPlan", "VerifyBatchPlan", "plan_decode_batch", "plan_verify_batch"]


@dataclass(frozen=True)
class _Prepared:
    """What one layout of the per-layer tensors runs (None: an empty batch), and where the
    first call's cache, pools and output sit in the arguments of each launch after the
    rotation: argument position -> index into ``(kv_cache, pool_k, pool_v, out)`` (each later
    call puts its own there)."""

    launches: _AttentionLaunches | None
    positions: tuple[dict[int, int], ...]

    @classmethod
    def of(cls, launches: _AttentionLaunches | None, *layer: torch.Tensor) -> _Prepared:
        """``launches`` prepared with ``layer`` (the cache, pools and output)."""
        which = {id(t): j for j, t in enumerate(layer)}
        positions = tuple(
            {i: which[id(a)] for i, a in enumerate(launch.args) if id(a) in which}
            for launch in (launches.launches[1:] if launches is not None else ())
        )
        return cls(launches, positions)


class _BatchPlan:
    """What a decode and a verify plan share: the index tensors checked by identity, the
    launches prepared per layout, and their replay with each layer's own tensors."""

    #: the index tensors' names, in the order the op takes them (error messages)
    _index_names: tuple[str, ...] = ()

    def __init__(self, index: tuple[torch.Tensor, ...], workspace: torch.Tensor | None) -> None:
        self._index = index
        self._workspace = workspace
        self._prepared: dict[tuple[object, ...], _Prepared] = {}

    def attend(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        index: tuple[torch.Tensor, ...],
        softmax_scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """One layer's call (``decode_attention``'s or ``verify_attention``'s arguments,
        ``index`` its index tensors in order, checked as there on a layout's first call)."""
        if len(index) != len(self._index) or any(
            a is not b for a, b in zip(index, self._index, strict=True)
        ):
            raise ValueError(
                f"batch_plan was built for other index tensors: pass the plan's own "
                f"({', '.join(f'plan.{n}' for n in self._index_names)}) or build one for this "
                "batch"
            )
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        layout = (
            fmt,
            launcher.PROGRAMMATIC_LAUNCH,
            float(softmax_scale),
            _tma_addressable(kv_cache),  # whether v6t reads this cache by TMA
            *tensor_layouts(q, kv_cache, pool_k, pool_v, out),
        )
        try:
            prepared = self._prepared.get(layout)
        except TypeError:  # an unhashable fmt: the checks name what is wrong with it
            prepared = None
        if prepared is None:
            launches = self._prepare(fmt, q, kv_cache, pool_k, pool_v, softmax_scale, out)
            prepared = _Prepared.of(launches, kv_cache, pool_k, pool_v, out)
            self._prepared[layout] = prepared
            if launches is not None:
                launches.run(q.device)
        elif prepared.launches is not None:
            prepared.launches.run(q.device, _for_layer(prepared, q, kv_cache, pool_k, pool_v, out))
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
    ) -> _AttentionLaunches | None:
        """Check a layout's first call as the unplanned op does and set up its launches."""
        raise NotImplementedError


class DecodeBatchPlan(_BatchPlan):
    """One batch of ``decode_attention`` calls: its index tensors, its options and the launches
    prepared for each layout of the per-layer tensors.

    Build it once per batch with :func:`plan_decode_batch` and pass it to each layer's
    ``decode_attention(..., batch_plan=plan)`` with the very index tensors it was built with.
    Calls sharing a plan share its workspace: run them on one stream.
    """

    _index_names = ("block_table", "seq_lens", "block_to_slot")

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
        super().__init__((block_table, seq_lens, block_to_slot), workspace)
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.block_to_slot = block_to_slot
        self.variant = variant
        self.num_splits = num_splits
        self.mma_rows = mma_rows

    def __repr__(self) -> str:
        return (
            f"DecodeBatchPlan({int(self.block_table.shape[0])} requests, "
            f"variant={self.variant!r}, {len(self._prepared)} layouts prepared)"
        )

    def _prepare(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor,
    ) -> _AttentionLaunches | None:
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
        return _attention_launches(
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


class VerifyBatchPlan(_BatchPlan):
    """One batch of ``verify_attention`` calls (speculative verify), as
    :class:`DecodeBatchPlan` is of decode calls; for the v1 and v7 kernels the tokens' decode
    rows (:func:`kvarn_kernels.attention.verify_rows`) are worked out once for the batch.

    Build it with :func:`plan_verify_batch` and pass it to each layer's
    ``verify_attention(..., max_query_len=plan.max_query_len, batch_plan=plan)`` with the very
    index tensors it was built with. Calls sharing a plan share its workspace: run them on
    one stream.
    """

    _index_names = ("block_table", "query_start_loc", "seq_lens", "block_to_slot")

    def __init__(
        self,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_to_slot: torch.Tensor,
        *,
        max_query_len: int,
        variant: str = "auto",
        num_splits: int | None = None,
        workspace: torch.Tensor | None = None,
    ) -> None:
        if max_query_len < 1:
            raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        super().__init__((block_table, query_start_loc, seq_lens, block_to_slot), workspace)
        self.block_table = block_table
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_to_slot = block_to_slot
        self.max_query_len = max_query_len
        self.variant = variant
        self.num_splits = num_splits

    def __repr__(self) -> str:
        return (
            f"VerifyBatchPlan({int(self.block_table.shape[0])} requests, up to "
            f"{self.max_query_len} tokens each, variant={self.variant!r}, "
            f"{len(self._prepared)} layouts prepared)"
        )

    def _prepare(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        softmax_scale: float,
        out: torch.Tensor,
    ) -> _AttentionLaunches | None:
        index = (self.block_table, self.query_start_loc, self.seq_lens, self.block_to_slot)
        setup = _verify_setup(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            *index,
            softmax_scale,
            out,
            self._workspace,
            max_query_len=self.max_query_len,
            num_splits=self.num_splits,
            variant=self.variant,
        )
        return _verify_launches(
            setup, q, kv_cache, pool_k, pool_v, *index, softmax_scale, self.max_query_len
        )


def _for_layer(
    prepared: _Prepared,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    out: torch.Tensor,
) -> list[dict[int, object]]:
    """Each prepared launch's replacements for this layer: its tensors where the first
    call's were."""
    assert prepared.launches is not None
    layer = (kv_cache, pool_k, pool_v, out)
    # the rotation reads what query_rotation's launch read in the layout's first call
    replacements: list[dict[int, object]] = [{0: rotation_input(_q_for_kernel(q))}]
    for launch, positions in zip(prepared.launches.launches[1:], prepared.positions, strict=True):
        swap: dict[int, object] = {i: layer[j] for i, j in positions.items()}
        if launch.descriptors:  # v6t: this cache's own descriptors
            geo = prepared.launches.geo
            descs = _v6_tma_descriptors_at(geo, kv_cache.data_ptr(), kv_cache.numel())
            first = len(launch.args) - launch.descriptors
            swap.update(enumerate(descs, first))
        replacements.append(swap)
    return replacements


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


def plan_verify_batch(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    *,
    max_query_len: int,
    variant: str = "auto",
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
) -> VerifyBatchPlan:
    """A :class:`VerifyBatchPlan` for one batch of ``verify_attention`` calls: pass it as
    ``batch_plan=`` with these very tensors and ``max_query_len`` to each layer's call.
    ``variant``, ``num_splits`` and ``workspace``: as ``verify_attention``'s (checked on the
    first call, with the queries and cache)."""
    return VerifyBatchPlan(
        block_table,
        query_start_loc,
        seq_lens,
        block_to_slot,
        max_query_len=max_query_len,
        variant=variant,
        num_splits=num_splits,
        workspace=workspace,
    )
