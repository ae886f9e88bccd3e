"""Builders of paged test cases: a KV cache, side pool and block table holding known tokens.

Used by the tests and by ``tools/bench_kernels.py``. A case is built the way serving fills
it: every token is rotated into an fp16 pool, full tiles that are not pool-resident are
flushed into records, and the pool keeps the sink block, the in-progress block and any other
block the caller asks for. Unused memory is poisoned (NaN pool rows, random record bytes,
``-1`` block-table entries) so that a kernel reading what it should not shows up in the
result instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvarn_format import DenseFormat, record_layout
from kvarn_format.registry import KVarNFormat
from kvarn_kernels._common import resolve_format

__all__ = ["PagedCase", "build_case", "random_kv"]

Encoder = Literal["kernel", "reference"]


@dataclass
class PagedCase:
    """One paged batch: cache tensors plus the original-frame tokens that filled them."""

    fmt: DenseFormat
    head_dim: int
    num_kv_heads: int
    kv_cache: torch.Tensor
    pool_k: torch.Tensor
    pool_v: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    block_to_slot: torch.Tensor
    #: Original-frame K and V of each request, ``[n, Hk, D]`` in the activation dtype.
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def decode_args(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        softmax_scale: float,
        *,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[Any, ...]:
        """The positional arguments of ``decode_attention`` (and its reference) on this case;
        ``seq_lens`` replaces the case's own."""
        lens = self.seq_lens if seq_lens is None else seq_lens
        paged = (self.kv_cache, self.pool_k, self.pool_v, self.block_table)
        return (fmt, q, *paged, lens, self.block_to_slot, softmax_scale)

    def prefill_args(
        self,
        fmt: KVarNFormat | str,
        q: torch.Tensor,
        query_start_loc: torch.Tensor,
        softmax_scale: float,
    ) -> tuple[Any, ...]:
        """The positional arguments of ``prefill_attention`` (and its reference) on this case."""
        paged = (self.kv_cache, self.pool_k, self.pool_v, self.block_table)
        return (fmt, q, *paged, query_start_loc, self.seq_lens, self.block_to_slot, softmax_scale)


def random_kv(
    n: int,
    hk: int,
    d: int,
    *,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float16,
    outliers: bool = True,
) -> torch.Tensor:
    """Activation-like tokens: per-channel spread, a few outlier channels, a common offset."""
    x = torch.randn(n, hk, d, generator=generator)
    chan = torch.exp(torch.randn(1, hk, d, generator=generator) * 0.5)
    x = x * chan + 0.3 * torch.randn(1, hk, d, generator=generator)
    if outliers and d >= 8:
        idx = torch.randint(0, d, (max(1, d // 32),), generator=generator)
        x[:, :, idx] *= 20.0
    return x.to(dtype)


def build_case(
    fmt: KVarNFormat | str,
    head_dim: int,
    num_kv_heads: int,
    seq_lens: Sequence[int],
    *,
    device: torch.device | str,
    seed: int = 0,
    encoder: Encoder = "kernel",
    pool_from: list[int] | None = None,
    extra_blocks: int = 3,
    max_blocks: int | None = None,
    dtype: torch.dtype = torch.float16,
    constant_tile: bool = False,
    key_outliers: bool = True,
    value_scale: float = 1.0,
    record_stride: int | None = None,
    shadow_rows: int = 0,
) -> PagedCase:
    """Build a paged batch holding ``seq_lens[b]`` random tokens for each request ``b``.

    Block 0 of every request (the sink) and its last block live in the pool; with
    ``pool_from[b] = p`` every block holding a position ``>= p`` does too (an unflushed
    prefill chunk). All other blocks are packed records written by ``encoder`` ("kernel":
    :func:`write_side_pool` + :func:`flush_tiles`; "reference": the NumPy codec).
    ``constant_tile`` makes request 0's second block constant (a degenerate tile);
    ``key_outliers`` gives K a few channels 20x larger than the rest; ``value_scale``
    multiplies every token (saturating at the fp16 limit, as activations would).
    ``record_stride`` pads the cache's records to that many bytes (default: the record size),
    as a hybrid model's page unification does. ``shadow_rows`` ``R`` gives the pool ``G - R``
    rows per slot and keeps each pool tile's first ``R`` rows in its block's record area
    (:func:`kvarn_format.geometry.shadow_rows`); the rest of that area keeps its random bytes.
    """
    from kvarn_kernels.reference import flush_tiles_ref, write_side_pool_ref
    from kvarn_kernels.rotation import write_side_pool
    from kvarn_kernels.store import flush_tiles

    dense = resolve_format(fmt)
    dev = torch.device(device)
    g, hk, d = dense.group, num_kv_heads, head_dim
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // g) for n in seq_lens]
    mb = max_blocks if max_blocks is not None else max(max(nbs, default=1), 1)
    if mb < max(nbs, default=0):
        raise ValueError("max_blocks is smaller than the longest request")
    num_blocks = sum(nbs) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), mb), -1, dtype=torch.int32)
    pool_blocks: list[int] = []
    record_blocks: list[int] = []
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, nbs, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        block_table[b, :nb] = ids.to(torch.int32)
        start = pool_from[b] if pool_from is not None else n
        for i, blk in enumerate(ids.tolist()):
            in_pool = i == 0 or i == nb - 1 or (i + 1) * g > start
            (pool_blocks if in_pool else record_blocks).append(blk)

    layout = record_layout(dense, d)
    stride = layout.tile_bytes if record_stride is None else record_stride
    kv_cache = torch.randint(0, 256, (num_blocks, hk, stride), generator=gen, dtype=torch.uint8).to(
        dev
    )
    nan = float("nan")
    pool_rows = g - shadow_rows
    pool_k = torch.full(
        (len(pool_blocks) + 2, pool_rows, hk, d), nan, dtype=torch.float16, device=dev
    )
    pool_v = torch.full_like(pool_k, nan)
    block_to_slot = torch.full((num_blocks,), -1, dtype=torch.int32)
    for s, blk in enumerate(pool_blocks):
        block_to_slot[blk] = s + 1  # slot 0 stays unused (poisoned)

    keys = [
        random_kv(n, hk, d, generator=gen, dtype=dtype, outliers=key_outliers) for n in seq_lens
    ]
    values = [random_kv(n, hk, d, generator=gen, dtype=dtype, outliers=False) for n in seq_lens]
    if value_scale != 1.0:
        keys = [(x.float() * value_scale).clamp(-65504.0, 65504.0).to(dtype) for x in keys]
        values = [(x.float() * value_scale).clamp(-65504.0, 65504.0).to(dtype) for x in values]
    if constant_tile and seq_lens and seq_lens[0] >= 2 * g:
        keys[0][g : 2 * g] = 0.25
        values[0][g : 2 * g] = -1.5
    k_all = torch.cat(keys).to(dev) if keys else torch.zeros(0, hk, d, dtype=dtype, device=dev)
    v_all = torch.cat(values).to(dev) if values else torch.zeros_like(k_all)
    slot_mapping = (
        torch.cat(
            [
                block_table[b, torch.arange(n) // g].long() * g + torch.arange(n) % g
                for b, n in enumerate(seq_lens)
            ]
        ).to(dev)
        if seq_lens
        else torch.zeros(0, dtype=torch.int64, device=dev)
    )

    # Records: stage every non-pool tile in a scratch pool, then flush it.
    stage_k = torch.full(
        (max(len(record_blocks), 1), g, hk, d), nan, dtype=torch.float16, device=dev
    )
    stage_v = torch.full_like(stage_k, nan)
    stage_map = torch.full((num_blocks,), -1, dtype=torch.int32)
    for s, blk in enumerate(record_blocks):
        stage_map[blk] = s
    writer = write_side_pool if encoder == "kernel" else write_side_pool_ref
    flusher = flush_tiles if encoder == "kernel" else flush_tiles_ref
    if record_blocks:
        writer(k_all, v_all, stage_k, stage_v, slot_mapping, stage_map.to(dev))
        flusher(
            dense,
            stage_k,
            stage_v,
            torch.arange(len(record_blocks), dtype=torch.int32, device=dev),
            kv_cache,
            torch.tensor(record_blocks, dtype=torch.int32, device=dev),
        )
    writer(
        k_all,
        v_all,
        pool_k,
        pool_v,
        slot_mapping,
        block_to_slot.to(dev),
        kv_cache=kv_cache,
        group=g,
    )
    return PagedCase(
        fmt=dense,
        head_dim=d,
        num_kv_heads=hk,
        kv_cache=kv_cache,
        pool_k=pool_k,
        pool_v=pool_v,
        block_table=block_table.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_to_slot=block_to_slot.to(dev),
        keys=keys,
        values=values,
    )
