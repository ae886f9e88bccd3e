"""The fused prefill-with-context path, prepared once per batch and replayed by every layer.

``prefill_attention(method="fused")`` rotates the queries, runs a fused kernel into split
partials and merges them: three launches. Around them an unprepared call checks eleven
tensors, picks the kernel and split count, builds three constexpr tables and slices a fresh
workspace: ~75 µs of Python a call on a 2-core CPU (``scripts/plan_host_cost.py``,
docs/kernel-notes.md, forty-fourth session). vLLM runs this attention eagerly, once per
layer, so a step with a continuation chunk paid it 36 times for one batch; a planned call
pays ~8.

A :class:`FusedPrefillPlan` holds one batch's index tensors and settings. The first call
with a given layout of the per-layer tensors (the queries, cache, pools and output: shapes,
strides, dtypes, devices) runs every check of an unprepared call and prepares the three
launches; each later call with that layout compares the layout and launches with its own
tensors in place. The plan's workspace is reused by those calls, so they must run on one
stream, one after another (as a model's layers do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn_format.registry import KVarNFormat
from kvarn_kernels import _launch as launcher
from kvarn_kernels._common import DenseGeometry, tensor_layouts, triton_interpret
from kvarn_kernels._launch import PreparedLaunch, pdl_supported
from kvarn_kernels.attention import (
    _LOG2E,
    PDL_VARIANTS,
    PREFILL_V2_MAX_HEAD_DIM,
    _check_varlen,
    _launch,
    _merge_launch,
    _num_sms,
    _prefill_fused_launch,
    _q_for_kernel,
    _v3_serves,
    _v4_serves,
    _workspace,
    decode_partials,
    decode_workspace_numel,
    fused_prefill_splits,
)
from kvarn_kernels.rotation import query_rotation, rotation_input

__all__ = ["FUSED_KERNELS", "FusedPrefillPlan", "plan_fused_prefill"]

#: The accepted values of ``fused_kernel`` (``prefill_attention``'s docstring says which runs
#: where).
FUSED_KERNELS = ("auto", "v1", "v2", "v3", "v4")


@dataclass(frozen=True)
class _Prepared:
    """What one layout of the per-layer tensors runs."""

    geo: DenseGeometry
    #: ``"v1"`` .. ``"v4"``
    kernel: str
    splits: int
    #: None for an empty batch
    workspace: torch.Tensor | None
    #: the rotation of the queries into the workspace, the fused kernel and the merge; None
    #: for an empty batch and for v1 (replayed through ``attention._launch``)
    launches: tuple[PreparedLaunch, PreparedLaunch, PreparedLaunch] | None


class FusedPrefillPlan:
    """One batch of ``prefill_attention(method="fused")`` calls: its index tensors, its
    settings and the launches prepared for each layout of the per-layer tensors.

    Build it once per batch with :func:`plan_fused_prefill` and pass it to each layer's
    ``prefill_attention(..., method="fused", fused_plan=plan)`` with the very index tensors
    it was built with. Calls sharing a plan share its workspace: run them on one stream.
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_to_slot: torch.Tensor,
        *,
        fused_kernel: str = "auto",
        num_splits: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        fast_unpack: bool | None = None,
        prefetch: bool = True,
        workspace: torch.Tensor | None = None,
    ) -> None:
        if block_m is not None and block_m not in (16, 32, 64, 128):
            raise ValueError(
                f"block_m must be 16, 32 or 64 (or 128 for head_dim <= 128), got {block_m}; "
                "Triton 3.6 fails to compile 128-row tiles at head_dim 256"
            )
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        if fused_kernel not in FUSED_KERNELS:
            raise ValueError(
                f"fused_kernel must be 'auto', 'v1', 'v2', 'v3' or 'v4', got {fused_kernel!r}"
            )
        if fused_kernel == "v4" and (
            block_m not in (None, 64) or block_n is not None or num_warps is not None
        ):
            raise ValueError(
                "fused_kernel='v4' runs 64-row tiles of 4 warps: drop block_m, "
                "block_n and num_warps"
            )
        if fused_kernel in ("v2", "v4") and not prefetch:
            raise ValueError("prefetch=False applies to fused_kernel='v1' only")
        self.block_table = block_table
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_to_slot = block_to_slot
        self.fused_kernel = fused_kernel
        self.num_splits = num_splits
        self.block_m = block_m
        self._block_n = block_n
        self._num_warps = num_warps
        self._fast_unpack = fast_unpack
        self._prefetch = prefetch
        self._workspace = workspace
        self._prepared: dict[tuple[object, ...], _Prepared] = {}

    def __repr__(self) -> str:
        return (
            f"FusedPrefillPlan({int(self.block_table.shape[0])} requests, "
            f"fused_kernel={self.fused_kernel!r}, {len(self._prepared)} layouts prepared)"
        )

    def attend(
        self,
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
    ) -> torch.Tensor:
        """``prefill_attention(method="fused")`` of one layer (its arguments, checked as
        there on a layout's first call)."""
        if not (
            block_table is self.block_table
            and query_start_loc is self.query_start_loc
            and seq_lens is self.seq_lens
            and block_to_slot is self.block_to_slot
        ):
            raise ValueError(
                "fused_plan was built for other block_table, query_start_loc, seq_lens or "
                "block_to_slot tensors: pass the plan's own (plan.block_table, ...) or build "
                "one for this batch with plan_fused_prefill"
            )
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        layout = (
            fmt,
            launcher.PROGRAMMATIC_LAUNCH,
            *tensor_layouts(q, kv_cache, pool_k, pool_v, out),
        )
        try:
            prepared = self._prepared.get(layout)
        except TypeError:  # an unhashable fmt: _prepare's checks name what is wrong with it
            prepared = None
        if prepared is None:
            prepared = self._prepare(fmt, q, kv_cache, pool_k, pool_v, softmax_scale, out)
            self._prepared[layout] = prepared
        if prepared.launches is not None:
            rotate, main, merge = prepared.launches
            # what query_rotation's launch read in the layout's first call, for this q
            rotate.run_replacing({0: rotation_input(_q_for_kernel(q))})
            scale = float(softmax_scale) * _LOG2E
            main.run_replacing({1: kv_cache, 2: pool_k, 3: pool_v, 10: scale})
            merge.run_replacing({2: out})
        elif prepared.workspace is not None:  # v1: the decode kernel's prefill mode
            _launch(
                prepared.geo,
                _q_for_kernel(q),
                kv_cache,
                pool_k,
                pool_v,
                block_table,
                seq_lens,
                block_to_slot,
                query_start_loc,
                softmax_scale,
                out,
                prepared.workspace,
                prepared.splits,
                False,
                self._block_n,
                self._num_warps,
                self._fast_unpack,
                self._prefetch,
                self.block_m,
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
        geo, out = _check_varlen(
            fmt,
            q,
            kv_cache,
            pool_k,
            pool_v,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.block_to_slot,
            out,
        )
        t, hq, d = (int(s) for s in q.shape)
        hk = int(pool_k.shape[2])
        block_m, prefetch = self.block_m, self._prefetch
        if block_m is not None and block_m > 64 and d > 128:
            raise ValueError(
                f"block_m must be 16, 32 or 64 (or 128 for head_dim <= 128), got {block_m}; "
                "Triton 3.6 fails to compile 128-row tiles at head_dim 256"
            )
        kernel = self.fused_kernel
        v3_ok = kernel in ("auto", "v3") and _v3_serves(geo, q.device)
        if kernel == "auto":
            kernel = "v2" if d <= PREFILL_V2_MAX_HEAD_DIM and prefetch else "v1"
            if kernel == "v2" and v3_ok and self._block_n is None:
                kernel = "v3"
        if kernel == "v3":  # asked for, or picked by "auto"
            if not v3_ok:
                raise ValueError(
                    "fused_kernel='v3' needs an sm_90 GPU, 4-bit keys with 2- or 4-bit values "
                    "and head_dim 128; use 'v2' or 'auto'"
                )
            if block_m is not None and block_m not in (64, 128):
                raise ValueError(f"fused_kernel='v3' takes block_m 64 or 128, got {block_m}")
            if self._block_n is not None or self._num_warps is not None or not prefetch:
                raise ValueError("block_n, num_warps and prefetch=False do not apply to 'v3'")
        if kernel == "v4" and not _v4_serves(geo, q.device):
            raise ValueError(
                "fused_kernel='v4' needs an sm_90 GPU, 4-bit keys with 2-bit values and "
                "head_dim 128; use 'v3' or 'auto'"
            )
        if kernel == "v2" and d > PREFILL_V2_MAX_HEAD_DIM:
            raise ValueError(
                f"fused_kernel='v2' takes head_dim <= {PREFILL_V2_MAX_HEAD_DIM}, got {d}; "
                "use 'v1' or 'auto'"
            )
        splits = self.num_splits or fused_prefill_splits(
            kernel,
            t,
            hq,
            hk,
            int(self.block_table.shape[1]),
            _num_sms(q.device),
            d,
            block_m=block_m,
        )
        if t == 0:
            return _Prepared(geo, kernel, splits, None, None)
        workspace = _workspace(self._workspace, decode_workspace_numel(t, hq, d, splits), q.device)
        if kernel == "v1":
            return _Prepared(geo, kernel, splits, workspace, None)
        variant = "prefill_" + kernel
        n_rows = t * hq
        parts = decode_partials(variant, splits)
        q_rot = workspace[: n_rows * d]
        o_part = workspace[n_rows * d : n_rows * d * (1 + parts)]
        lse_part = workspace[n_rows * d * (1 + parts) : n_rows * (d * (1 + parts) + parts)]
        pdl = variant in PDL_VARIANTS and pdl_supported(q.device)
        fast = (not triton_interpret()) if self._fast_unpack is None else self._fast_unpack
        launches = (
            query_rotation(_q_for_kernel(q), q_rot),
            _prefill_fused_launch(
                variant,
                geo,
                q_rot,
                kv_cache,
                pool_k,
                pool_v,
                self.block_table,
                self.seq_lens,
                self.block_to_slot,
                self.query_start_loc,
                o_part,
                lse_part,
                softmax_scale,
                n_rows,
                splits,
                hq,
                fast,
                block_m,
                self._block_n,
                self._num_warps,
                pdl,
            ),
            _merge_launch(o_part, lse_part, out, n_rows, parts, hq, pdl),
        )
        return _Prepared(geo, kernel, splits, workspace, launches)


def plan_fused_prefill(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    *,
    fused_kernel: str = "auto",
    num_splits: int | None = None,
    block_m: int | None = None,
) -> FusedPrefillPlan:
    """A :class:`FusedPrefillPlan` for one batch of ``prefill_attention(method="fused")``
    calls: pass it as ``fused_plan=`` with these very tensors to each layer's call.
    ``fused_kernel``, ``num_splits`` and ``block_m``: as ``prefill_attention``'s (checked
    here; those that depend on the queries and cache on the first call)."""
    return FusedPrefillPlan(
        block_table,
        query_start_loc,
        seq_lens,
        block_to_slot,
        fused_kernel=fused_kernel,
        num_splits=num_splits,
        block_m=block_m,
    )
