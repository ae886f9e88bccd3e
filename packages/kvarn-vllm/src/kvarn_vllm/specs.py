"""The KV-cache spec of a KVarN layer: vLLM's full-attention spec with a packed page size.

One vLLM block of a KVarN layer is one tile of ``G`` tokens per KV head, stored as one packed
record of ``tile_bytes`` (from :func:`kvarn_format.record_layout`, never recomputed here). vLLM's
default page formula (``2 * block_size * Hk * D * itemsize``) knows nothing of that, hence this
subclass. It needs no registration: vLLM's KV-spec registry looks specs up along the MRO and
finds :class:`FullAttentionSpec`, so KVarN layers and full-precision skip layers share one
KV-cache group (with per-layer page sizes) and the stock full-attention manager.

``tile_stride`` is the distance between consecutive records in the cache tensor. It equals
``tile_bytes`` except in models that mix full-attention and sliding-window layers, where vLLM's
hybrid allocator needs one page size to divide the other: then each record is padded so that
the sliding-window layers' page is a whole multiple of ours (:func:`hybrid_tile_stride`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Self

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvarn_format import DenseFormat, parse_cache_dtype, record_layout
from kvarn_format.geometry import padded_record_stride

__all__ = [
    "KvarnFullAttentionSpec",
    "hybrid_tile_stride",
    "lookup_tile_stride",
    "record_tile_stride",
]

# Tile strides chosen by the spec hook of this process, read back when vLLM asks the backend
# for the cache tensor shape (a static method that only sees (dtype, Hk, D)).
_TILE_STRIDES: dict[tuple[str, int, int], int] = {}


def record_tile_stride(cache_dtype: str, num_kv_heads: int, head_size: int, stride: int) -> None:
    """Remember the record stride the spec of this (dtype, Hk, D) layer uses."""
    key = (cache_dtype, num_kv_heads, head_size)
    previous = _TILE_STRIDES.get(key)
    if previous is not None and previous != stride:
        raise ValueError(
            f"kvarn: layers with {cache_dtype}, {num_kv_heads} KV heads and head size "
            f"{head_size} asked for record strides {previous} and {stride}; every such layer "
            "of one model must use the same page size"
        )
    _TILE_STRIDES[key] = stride


def lookup_tile_stride(cache_dtype: str, num_kv_heads: int, head_size: int) -> int:
    """The record stride for a layer geometry: the recorded one, else the record size."""
    stride = _TILE_STRIDES.get((cache_dtype, num_kv_heads, head_size))
    if stride is not None:
        return stride
    return _dense_layout_bytes(cache_dtype, head_size)


def clear_tile_strides() -> None:
    """Forget recorded strides (tests)."""
    _TILE_STRIDES.clear()


def _dense_format(cache_dtype: str) -> DenseFormat:
    fmt = parse_cache_dtype(cache_dtype)
    if not isinstance(fmt, DenseFormat):
        raise ValueError(
            f"{cache_dtype} is an MLA format; MLA models are not yet supported by kvarn-vllm"
        )
    return fmt


def _dense_layout_bytes(cache_dtype: str, head_size: int) -> int:
    return record_layout(_dense_format(cache_dtype), head_size).tile_bytes


def hybrid_tile_stride(tile_bytes: int, num_kv_heads: int, other_pages: list[int]) -> int:
    """The record stride that lets vLLM's hybrid allocator unify page sizes.

    ``other_pages`` are the page sizes of the layers that end up in *other* KV-cache groups
    (sliding-window layers kept in full precision): vLLM raises unless every page divides the
    largest one, and KVarN pages are the smaller ones. The rule is kvarn-format's
    :func:`~kvarn_format.geometry.padded_record_stride` (the planner sizes hybrid models with
    it too); when no stride works, the error says what to pass to vLLM instead.
    """
    try:
        return padded_record_stride(tile_bytes, num_kv_heads, other_pages)
    except ValueError as exc:
        raise ValueError(
            f"kvarn: {exc}; vLLM cannot put these layers in one KV cache. Add the other "
            "layers' indices to --kv-cache-dtype-skip-layers or use --kv-cache-dtype auto/fp8."
        ) from None


@dataclass(frozen=True, kw_only=True)
class KvarnFullAttentionSpec(FullAttentionSpec):
    """Full attention stored as packed KVarN records: ``Hk * tile_stride`` bytes per tile.

    ``block_size`` may be a multiple of the tile size ``G`` (vLLM's hybrid allocator enlarges
    block sizes to unify pages); the page then holds ``block_size // G`` tiles per head, so the
    page size stays linear in ``block_size`` as vLLM's page unification requires.
    """

    kvarn_dtype: str = ""
    tile_bytes: int = 0
    tile_stride: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[no-untyped-call]
        if not self.kvarn_dtype:
            return  # FullAttentionSpec.merge builds a bare instance first; see merge()
        fmt = _dense_format(self.kvarn_dtype)
        if self.block_size % fmt.group:
            raise ValueError(
                f"{self.kvarn_dtype} stores {fmt.group}-token tiles, so its block size must be "
                f"a multiple of {fmt.group}; got {self.block_size}. Pass --block-size "
                f"{fmt.group} (or leave it unset)."
            )
        if self.tile_stride < self.tile_bytes or self.tile_stride % 8:
            raise ValueError(
                f"tile_stride {self.tile_stride} must be a multiple of 8 and >= tile_bytes "
                f"{self.tile_bytes}"
            )
        if self.head_size_v != self.head_size:
            raise ValueError(
                f"{self.kvarn_dtype} needs equal K and V head sizes, got {self.head_size} and "
                f"{self.head_size_v}"
            )

    @property
    def group(self) -> int:
        """Tokens per tile (``G``)."""
        return _dense_format(self.kvarn_dtype).group

    @property
    def tiles_per_block(self) -> int:
        return self.block_size // self.group

    @property
    def real_page_size_bytes(self) -> int:
        if not self.kvarn_dtype:
            return super().real_page_size_bytes
        return self.tiles_per_block * self.num_kv_heads * self.tile_stride

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        merged = super().merge(specs)
        first = specs[0]
        for spec in specs[1:]:
            if (spec.kvarn_dtype, spec.tile_bytes, spec.tile_stride) != (
                first.kvarn_dtype,
                first.tile_bytes,
                first.tile_stride,
            ):
                raise ValueError(
                    "All KVarN layers in one KV cache group must share dtype and record size; "
                    f"got {first.kvarn_dtype}/{first.tile_stride} and "
                    f"{spec.kvarn_dtype}/{spec.tile_stride}"
                )
        return replace(
            merged,
            kvarn_dtype=first.kvarn_dtype,
            tile_bytes=first.tile_bytes,
            tile_stride=first.tile_stride,
        )

    @classmethod
    def for_layer(
        cls,
        *,
        cache_dtype: str,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        tile_stride: int | None = None,
        **extra: Any,
    ) -> KvarnFullAttentionSpec:
        """The spec of one KVarN layer; the record size comes from kvarn-format."""
        import torch

        tile_bytes = _dense_layout_bytes(cache_dtype, head_size)
        return cls(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size,
            dtype=torch.uint8,
            kvarn_dtype=cache_dtype,
            tile_bytes=tile_bytes,
            tile_stride=tile_bytes if tile_stride is None else tile_stride,
            **extra,
        )
