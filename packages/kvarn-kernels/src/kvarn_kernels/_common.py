"""Shared validation and geometry plumbing of the kernels.

Every size and offset a kernel uses comes from :func:`kvarn_format.record_layout`; this module
turns a layout into the small set of integers the Triton kernels take as compile-time
constants, and checks the tensors the public functions receive so that a wrong dtype, shape or
device fails with a message that says what to change instead of producing garbage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_format import DENSE_HEAD_DIMS, DenseFormat, parse_cache_dtype, record_layout
from kvarn_format.cache_order import CodeOrder, cache_permutation, code_orders
from kvarn_format.geometry import shadow_rows
from kvarn_format.registry import KVarNFormat

__all__ = [
    "ACT_DTYPES",
    "PREFILL_UNSPECIALIZED",
    "SLICED_POINTERS",
    "DenseGeometry",
    "check_device",
    "check_dtype",
    "check_head_dim",
    "check_index_tensor",
    "check_ndim",
    "code_offsets",
    "code_offsets_of_pair",
    "codes_from_cache_order",
    "codes_to_cache_order",
    "debug_checks_enabled",
    "dense_geometry",
    "pool_row_ptrs",
    "pool_shadow_rows",
    "resolve_format",
    "tensor_layouts",
    "triton_interpret",
]

#: Activation dtypes the ops accept for q/k/v.
ACT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

#: Pointer arguments of the prefill kernels that a server passes as row slices of its
#: batch's tensors (kvarn-vllm: a run's rows of the block table and of the sequence lengths).
#: A slice's address is 16-byte aligned or not with the run's first row, and Triton compiles
#: once per alignment of each pointer: so these are not specialized on it
#: (``do_not_specialize_on_alignment``), and any slice runs the warm-up's compile.
SLICED_POINTERS = ("BLOCK_TABLE", "SEQ_LENS")

#: The JIT options of the fused prefill kernels (v2, v3): the per-step counts are not
#: specialized, nor the alignment of the row slices a server passes.
PREFILL_UNSPECIALIZED = {
    "do_not_specialize": ["num_reqs", "stride_bt"],
    "do_not_specialize_on_alignment": SLICED_POINTERS,
}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a constexpr function whose call costs
    ~2.5 µs of argument unwrapping, several times per eager launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); host-side ``next_power_of_2``."""
    return 1 << max(n - 1, 0).bit_length()


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def debug_checks_enabled(flag: bool | None) -> bool:
    """Resolve a per-call ``check`` flag; ``None`` reads ``KVARN_KERNELS_DEBUG`` (default off).

    The debug checks read device tensors back to the host, so they are off by default and
    must stay off under CUDA-graph capture.
    """
    if flag is not None:
        return flag
    return os.environ.get("KVARN_KERNELS_DEBUG", "0") not in ("", "0")


def tensor_layouts(*tensors: torch.Tensor) -> tuple[object, ...]:
    """Each tensor's shape, strides, dtype and device, in one flat tuple: the part of a
    per-batch plan's key (:mod:`kvarn_kernels.fused_prefill`, :mod:`kvarn_kernels.decode_batch`)
    that says whether a layer's tensors take the launches prepared for another's."""
    return tuple(x for t in tensors for x in (t.shape, t.stride(), t.dtype, t.device))


def resolve_format(fmt: KVarNFormat | str) -> DenseFormat:
    """Accept a :class:`DenseFormat` or its dtype string; reject MLA and unknown formats."""
    resolved = parse_cache_dtype(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(resolved, DenseFormat):
        raise ValueError(
            f"{resolved} is an MLA format; the dense kernels take only dense formats "
            "(kvarn_k4v2_g128, kvarn_k4v4_g128, kvarn_k4v2_g64, kvarn_k4v4_g64, kvarn_k5v5_g64)"
        )
    return resolved


def check_head_dim(head_dim: int) -> None:
    if head_dim not in DENSE_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the KVarN kernels; supported head dims: "
            f"{', '.join(map(str, DENSE_HEAD_DIMS))}"
        )


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(
            f"{name} must have dtype {names}; got {str(t.dtype).removeprefix('torch.')}"
        )


def check_ndim(name: str, t: torch.Tensor, ndim: int, expected: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {expected}; got {tuple(t.shape)}")


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_index_tensor(name: str, t: torch.Tensor, ndim: int, expected: str) -> None:
    check_ndim(name, t, ndim, expected)
    check_dtype(name, t, (torch.int32,))
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


@dataclass(frozen=True, slots=True)
class DenseGeometry:
    """Compile-time constants of one (format, head_dim, record stride) for the kernels."""

    fmt: DenseFormat
    head_dim: int
    group: int
    key_bits: int
    value_bits: int
    #: Bytes between consecutive records in the paged cache (the cache tensor's last dim).
    record_stride: int
    payload_bytes: int
    k_codes: int
    k_scale: int
    k_zero: int
    k_token_scale: int
    v_codes: int
    v_channel_scale: int
    v_scale: int
    v_zero: int
    #: In-cache order of the K and V code sections (:mod:`kvarn_format.cache_order`).
    k_order: CodeOrder
    v_order: CodeOrder

    def offsets(self) -> dict[str, int]:
        """Field offsets and code orders as keyword arguments of the kernels."""
        return {
            "K_ORDER": int(self.k_order),
            "V_ORDER": int(self.v_order),
            "OFF_KC": self.k_codes,
            "OFF_KS": self.k_scale,
            "OFF_KZ": self.k_zero,
            "OFF_KT": self.k_token_scale,
            "OFF_VC": self.v_codes,
            "OFF_VCS": self.v_channel_scale,
            "OFF_VS": self.v_scale,
            "OFF_VZ": self.v_zero,
        }


@cache
def dense_geometry(fmt: DenseFormat, head_dim: int, record_stride: int) -> DenseGeometry:
    """Geometry for a paged cache whose records are ``record_stride`` bytes apart.

    ``record_stride`` is kvarn-format's record size (``record_layout(fmt, head_dim)``, either
    slot rounding) or any larger multiple of 8 bytes: a serving engine pads records so that a
    hybrid model's page sizes divide each other (kvarn-vllm's ``hybrid_tile_stride``). The
    fields sit at the same offsets; the bytes past the payload are padding (the store zeroes
    them).
    """
    check_head_dim(head_dim)
    layout = record_layout(fmt, head_dim)
    if record_stride < layout.tile_bytes or record_stride % 8:
        raise ValueError(
            f"kv_cache's last dim is {record_stride} bytes, but a {fmt.name} record at head_dim "
            f"{head_dim} needs {layout.tile_bytes} bytes (record_layout(fmt, head_dim)"
            ".tile_bytes), or a larger multiple of 8 bytes for padded records; allocate the "
            "cache from kvarn-format's geometry"
        )
    off = layout.offsets()
    k_order, v_order = code_orders(fmt)
    return DenseGeometry(
        fmt=fmt,
        head_dim=head_dim,
        group=fmt.group,
        key_bits=fmt.key_bits,
        value_bits=fmt.value_bits,
        record_stride=record_stride,
        payload_bytes=layout.payload_bytes,
        k_codes=off["k_codes"],
        k_scale=off["k_scale"],
        k_zero=off["k_zero"],
        k_token_scale=off["k_token_scale"],
        v_codes=off["v_codes"],
        v_channel_scale=off["v_channel_scale"],
        v_scale=off["v_scale"],
        v_zero=off["v_zero"],
        k_order=k_order,
        v_order=v_order,
    )


def pool_shadow_rows(pool_k: torch.Tensor, group: int, kv_cache: torch.Tensor | None) -> int:
    """The shadow rows ``R`` of a side pool: ``group`` minus its rows per slot.

    A pool ``[num_slots, G, Hk, D]`` holds whole tiles (``R = 0``). A pool with ``G - R`` rows
    per slot keeps each tile's first ``R`` rows in the record area of the block the tile
    belongs to (:func:`kvarn_format.geometry.shadow_rows`), which needs that block's cache
    ``kv_cache`` and at most ``shadow_rows(G, D, record stride)`` rows.
    """
    rows, d = int(pool_k.shape[1]), int(pool_k.shape[3])
    shadow = group - rows
    if shadow == 0:
        return 0
    if shadow < 0:
        raise ValueError(f"the side pool has {rows} rows per slot, more than the tile's {group}")
    if kv_cache is None:
        raise ValueError(
            f"the side pool has {rows} rows per slot for {group}-token tiles: its first {shadow} "
            "rows live in the records of the blocks they belong to, so pass kv_cache"
        )
    limit = shadow_rows(group, d, int(kv_cache.shape[-1]))
    if shadow > limit:
        raise ValueError(
            f"the side pool has {rows} rows per slot for {group}-token tiles, so {shadow} rows "
            f"would live in each block's record area, which holds at most {limit} "
            f"(kvarn_format.geometry.shadow_rows({group}, {d}, {int(kv_cache.shape[-1])}))"
        )
    return shadow


@triton.jit  # type: ignore[untyped-decorator]
def code_offsets(  # type: ignore[no-untyped-def]  # a Triton JIT helper
    row, col, ROWS: tl.constexpr, COLS: tl.constexpr, ORDER: tl.constexpr
):
    """Byte offsets in a code section of ``ROWS`` rows of ``COLS`` bytes (K: channels of
    token-pair bytes; V: tokens of channel bytes) of the bytes ``(row, col)`` (broadcast
    tensors), in the section's in-cache order ``ORDER`` (:class:`kvarn_format.CodeOrder`:
    0 row-major, 1 column-major, 3 and 4 the byte planes of 5-bit codes). Order 2 (even rows, then odd rows) is addressed by row pair,
    :func:`code_offsets_of_pair`: with ``row // 2`` in the address Triton's contiguity
    analysis does not see consecutive bytes."""
    tl.static_assert(ORDER != 2, "order 2 is addressed by row pair: code_offsets_of_pair")
    if ORDER == 1:
        off = col * ROWS + row
    elif ORDER == 3 or ORDER == 4:
        # five byte planes of the 5-bit groups (byte b of group c: column 5c + b); order 4
        # interleaves each 16 rows (kvarn_format.cache_order.paired_row_position)
        if ORDER == 4:
            row = 16 * (row // 16) + 2 * (row % 8) + (row // 8) % 2
        off = (col % 5) * ((COLS // 5) * ROWS) + (col // 5) * ROWS + row
    else:
        off = row * COLS + col
    return off


@triton.jit  # type: ignore[untyped-decorator]
def code_offsets_of_pair(  # type: ignore[no-untyped-def]  # a Triton JIT helper
    pair, PARITY: tl.constexpr, col, ROWS: tl.constexpr, COLS: tl.constexpr, ORDER: tl.constexpr
):
    """:func:`code_offsets` of row ``2 * pair + PARITY``, and the addressing of order 2: byte
    ``col`` of the row at ``PARITY * COLS * ROWS / 2 + col * ROWS / 2 + pair``."""
    if ORDER == 2:
        off = PARITY * (COLS * (ROWS // 2)) + col * (ROWS // 2) + pair
    else:
        off = code_offsets(pair * 2 + PARITY, col, ROWS, COLS, ORDER)
    return off


def _cache_permutation(geo: DenseGeometry, device: torch.device) -> torch.Tensor:
    return torch.tensor(cache_permutation(geo.fmt, geo.head_dim), device=device)


def codes_to_cache_order(records: torch.Tensor, geo: DenseGeometry) -> torch.Tensor:
    """``records`` (``uint8 [..., record bytes]`` in docs/format.md §2.1's order) with their
    code bytes in the in-cache order, as a new tensor (torch twin of
    :func:`kvarn_format.to_cache_order`: the same gather)."""
    perm = _cache_permutation(geo, records.device)
    out = records.clone()
    out[..., : perm.numel()] = records[..., perm]
    return out


def codes_from_cache_order(records: torch.Tensor, geo: DenseGeometry) -> torch.Tensor:
    """The inverse of :func:`codes_to_cache_order`: records read from a paged cache in §2.1's
    order (a new tensor)."""
    perm = _cache_permutation(geo, records.device)
    out = records.clone()
    out[..., perm] = records[..., : perm.numel()]
    return out


@triton.jit  # type: ignore[untyped-decorator]
def pool_row_ptrs(  # type: ignore[no-untyped-def]  # a Triton JIT helper: tl values, untyped
    POOL,
    KV,
    slot,
    blk,
    row,
    h,
    IS_V: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    SHADOW: tl.constexpr,
    STRIDE: tl.constexpr,
):
    """fp16 pointers to channel 0 of tile row(s) ``row`` of head ``h`` of a pool-resident
    block ``blk`` in pool slot ``slot`` (K pool with ``IS_V`` 0, V pool with 1).

    Rows ``>= SHADOW`` are pool rows ``row - SHADOW`` of the slot (``[slots, G - SHADOW, HK,
    D]``); rows ``< SHADOW`` are in the block's record area of head ``h`` (``KV`` is the paged
    uint8 cache, ``STRIDE`` bytes per record): K rows first, then V rows, ``D`` fp16 each.
    Arguments broadcast; pass int64 indices.
    """
    if SHADOW == 0:
        return POOL + ((slot * G + row) * HK + h) * D
    else:
        pooled = row >= SHADOW
        in_pool = POOL + ((slot * (G - SHADOW) + tl.where(pooled, row - SHADOW, 0)) * HK + h) * D
        record = (KV + (blk * HK + h) * STRIDE).to(tl.pointer_type(tl.float16))
        in_record = record + (IS_V * SHADOW + tl.where(pooled, 0, row)) * D
        return tl.where(pooled, in_pool, in_record)
