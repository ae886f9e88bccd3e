"""Byte layout of one KVarN record: the single source of truth for sizes and offsets.

A dense record holds one tile (``group`` tokens) of one KV head; an MLA record holds one
latent tile of ``group`` tokens. Kernels, the vLLM plugin and the checkpoint loader all ask
:func:`record_layout` for offsets and never recompute them.

Packing conventions (docs/format.md):

* 2- and 4-bit codes are packed LSB-first within bytes along the last axis of the row-major
  code matrix (4-bit: low nibble = even index).
* 5-bit codes form one dense LSB-first bitstream: code ``i`` of a row starts at bit ``5 i``.
  Every row is a whole number of bytes for the admitted geometries, so each row's stream
  starts on a byte boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

from kvarn_format.registry import (
    DenseFormat,
    KVarNFormat,
    MLAFormat,
    check_dense_head_dim,
    check_mla_geometry,
)

__all__ = [
    "Field",
    "RecordLayout",
    "SlotRounding",
    "fp16_bytes_per_token",
    "padded_record_stride",
    "record_layout",
    "shadow_rows",
]

SlotRounding = Literal["align8", "pow2"]
FieldDType = Literal["u8", "f16", "bf16"]

_ITEM_BYTES: dict[FieldDType, int] = {"u8": 1, "f16": 2, "bf16": 2}


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a record.

    ``shape`` is the logical shape in elements of ``dtype`` (for code fields: rows by packed
    bytes per row); ``bits`` is the code width for code fields and ``None`` otherwise.
    """

    name: str
    offset: int
    size: int
    dtype: FieldDType
    shape: tuple[int, ...]
    bits: int | None
    meaning: str

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """The record of one tile: fields in storage order, then padding."""

    dtype: str
    kind: Literal["dense", "mla"]
    head_dim: int
    group: int
    fields: tuple[Field, ...]
    payload_bytes: int
    tile_bytes: int
    slot_rounding: SlotRounding

    @property
    def pad_bytes(self) -> int:
        return self.tile_bytes - self.payload_bytes

    @property
    def bytes_per_token_per_head(self) -> float:
        """Stored bytes per token per KV head (per token for MLA), padding included."""
        return self.tile_bytes / self.group

    @property
    def fp16_bytes_per_token_per_head(self) -> int:
        return fp16_bytes_per_token(self.kind, self.head_dim)

    @property
    def ratio_vs_fp16(self) -> float:
        """How many times fewer bytes than an fp16 cache of the same geometry."""
        return self.fp16_bytes_per_token_per_head / self.bytes_per_token_per_head

    @property
    def bits_per_element(self) -> float:
        elements = 2 * self.head_dim if self.kind == "dense" else self.head_dim + 64
        return 8 * self.bytes_per_token_per_head / elements

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(
            f"{self.dtype} has no field {name!r}; fields: {[f.name for f in self.fields]}"
        )

    def offsets(self) -> dict[str, int]:
        return {f.name: f.offset for f in self.fields}

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready description (the ``kvarn inspect --json`` interface)."""
        return {
            "dtype": self.dtype,
            "kind": self.kind,
            "head_dim": self.head_dim,
            "group": self.group,
            "tile_bytes": self.tile_bytes,
            "payload_bytes": self.payload_bytes,
            "pad_bytes": self.pad_bytes,
            "slot_rounding": self.slot_rounding,
            "bytes_per_token_per_head": self.bytes_per_token_per_head,
            "ratio_vs_fp16": round(self.ratio_vs_fp16, 4),
            "bits_per_element": round(self.bits_per_element, 4),
            "fields": [
                {
                    "name": f.name,
                    "offset": f.offset,
                    "size": f.size,
                    "dtype": f.dtype,
                    "shape": list(f.shape),
                    "bits": f.bits,
                    "meaning": f.meaning,
                }
                for f in self.fields
            ],
        }


def fp16_bytes_per_token(kind: Literal["dense", "mla"], head_dim: int, rope_dim: int = 64) -> int:
    """Bytes of an fp16 cache per token per KV head (dense K+V) or per token (MLA latent+rope)."""
    return 2 * 2 * head_dim if kind == "dense" else 2 * (head_dim + rope_dim)


class _Builder:
    def __init__(self) -> None:
        self.fields: list[Field] = []
        self.offset = 0

    def add(
        self,
        name: str,
        dtype: FieldDType,
        shape: tuple[int, ...],
        meaning: str,
        bits: int | None = None,
    ) -> None:
        count = 1
        for n in shape:
            count *= n
        size = count * _ITEM_BYTES[dtype]
        self.fields.append(Field(name, self.offset, size, dtype, shape, bits, meaning))
        self.offset += size


def _packed_bytes(count: int, bits: int) -> int:
    total_bits = count * bits
    if total_bits % 8:
        raise AssertionError(f"{count} codes of {bits} bits are not a whole number of bytes")
    return total_bits // 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _dense_layout(fmt: DenseFormat, head_dim: int, rounding: SlotRounding) -> RecordLayout:
    check_dense_head_dim(fmt, head_dim)
    d, g = head_dim, fmt.group
    b = _Builder()
    b.add(
        "k_codes",
        "u8",
        (d, _packed_bytes(g, fmt.key_bits)),
        "K codes, channel-major [D][G]: codes along tokens",
        fmt.key_bits,
    )
    b.add("k_scale", "f16", (d,), "per-channel absorbed K scale (Sinkhorn x RTN)")
    b.add("k_zero", "f16", (d,), "per-channel absorbed K zero point")
    b.add("k_token_scale", "f16", (g,), "per-token K Sinkhorn scale")
    b.add(
        "v_codes",
        "u8",
        (g, _packed_bytes(d, fmt.value_bits)),
        "V codes, token-major [G][D]: codes along channels",
        fmt.value_bits,
    )
    b.add("v_channel_scale", "f16", (d,), "per-channel V Sinkhorn scale")
    b.add("v_scale", "f16", (g,), "per-token absorbed V scale (Sinkhorn x RTN)")
    b.add("v_zero", "f16", (g,), "per-token absorbed V zero point")
    payload = b.offset
    if rounding == "pow2" and d >= 256:
        tile = _next_pow2(-(-payload // g)) * g
    else:
        tile = _round_up(payload, 8)
    return RecordLayout(fmt.name, "dense", d, g, tuple(b.fields), payload, tile, rounding)


def _mla_layout(fmt: MLAFormat) -> RecordLayout:
    r, g, rope = fmt.latent_rank, fmt.group, fmt.rope_dim
    b = _Builder()
    if g == 128:
        # Official layout: token-major codes, fp16 RoPE.
        b.add(
            "latent_codes",
            "u8",
            (g, _packed_bytes(r, fmt.latent_bits)),
            "latent codes, token-major [G][R]: codes along channels",
            fmt.latent_bits,
        )
        b.add("latent_scale", "f16", (r,), "per-channel absorbed latent scale")
        b.add("latent_zero", "f16", (r,), "per-channel absorbed latent zero point")
        b.add("latent_token_scale", "f16", (g,), "per-token latent Sinkhorn scale")
        b.add("rope", "f16", (g, rope), "decoupled RoPE key, exact, unrotated")
    else:
        # g64 family: channel-major codes, bf16 RoPE.
        b.add(
            "latent_codes",
            "u8",
            (r, _packed_bytes(g, fmt.latent_bits)),
            "latent codes, channel-major [R][G]: codes along tokens",
            fmt.latent_bits,
        )
        b.add("latent_scale", "f16", (r,), "per-channel absorbed latent scale")
        b.add("latent_zero", "f16", (r,), "per-channel absorbed latent zero point")
        b.add("latent_token_scale", "f16", (g,), "per-token latent Sinkhorn scale")
        b.add("rope", "bf16", (g, rope), "decoupled RoPE key, exact, unrotated")
    payload = b.offset
    return RecordLayout(
        fmt.name, "mla", r, g, tuple(b.fields), payload, _round_up(payload, 8), "align8"
    )


@cache
def record_layout(
    fmt: KVarNFormat, head_dim: int | None = None, *, slot_rounding: SlotRounding = "align8"
) -> RecordLayout:
    """The record layout of ``fmt``.

    Dense formats need ``head_dim``; the record is padded to a multiple of 8 bytes unless
    ``slot_rounding="pow2"``, which rounds the per-token slot of D >= 256 records up to a power
    of two (for models that mix head dims and need page sizes in power-of-two ratios).
    MLA formats ignore ``head_dim`` other than checking it equals the latent rank when given.
    """
    if slot_rounding not in ("align8", "pow2"):
        raise ValueError(f"slot_rounding must be 'align8' or 'pow2', got {slot_rounding!r}")
    if isinstance(fmt, DenseFormat):
        if head_dim is None:
            raise TypeError(f"{fmt.name} is a dense format: record_layout needs head_dim")
        return _dense_layout(fmt, head_dim, slot_rounding)
    if head_dim is not None and head_dim != fmt.latent_rank:
        check_mla_geometry(fmt, head_dim, fmt.rope_dim)
    return _mla_layout(fmt)


def padded_record_stride(tile_bytes: int, num_kv_heads: int, other_pages: Sequence[int]) -> int:
    """The smallest record stride >= ``tile_bytes`` whose page divides the other pages.

    A hybrid model keeps some layers unquantized (sliding-window layers, in fp16 or bf16) next
    to the KVarN layers; a paged allocator that gives every layer the same number of blocks
    needs each of those layers' page sizes (bytes per ``G``-token block) to be a whole multiple
    of the KVarN page, ``num_kv_heads * stride``. The stride is a multiple of 8 bytes, padded
    past the record (kvarn-kernels reads records at any such stride); padding beyond 2x the
    record would waste more than it saves and raises ``ValueError`` instead. Pages not larger
    than the KVarN page impose nothing.
    """
    if tile_bytes <= 0 or num_kv_heads <= 0:
        raise ValueError("tile_bytes and num_kv_heads must be positive")
    larger = sorted({p for p in other_pages if p > num_kv_heads * tile_bytes})
    if not larger:
        return tile_bytes
    stride = tile_bytes
    while stride <= 2 * tile_bytes:
        page = num_kv_heads * stride
        if all(p % page == 0 for p in larger):
            return stride
        stride += 8 - stride % 8 if stride % 8 else 8
    raise ValueError(
        f"no record stride between {tile_bytes} and {2 * tile_bytes} bytes makes the KVarN "
        f"page ({num_kv_heads} heads) divide the other layers' pages {larger}"
    )


def shadow_rows(group: int, head_dim: int, record_stride: int) -> int:
    """Rows of an fp16 side-pool tile that live in the record area of the block it shadows.

    While a tile is in the side pool (a sink, an in-progress tile), the block it belongs to
    holds no packed record yet: its ``record_stride`` bytes per KV head are idle. The first
    ``R`` rows of the tile, K and V, are kept there instead (per head, at the start of the
    head's record area: K rows ``0..R-1``, then V rows ``0..R-1``, ``head_dim`` fp16 each), so a
    pool slot holds only the other ``group - R`` rows. The flush that quantizes the tile reads
    those rows before it writes the record over them. ``R = record_stride // (4 * head_dim)``,
    at most ``group - 1``; it is about ``1 / ratio_vs_fp16`` of the tile (27 of 128 rows for
    kvarn_k4v2_g128 at head dim 128, 35 for kvarn_k4v4_g128).
    """
    if group <= 0 or head_dim <= 0 or record_stride <= 0:
        raise ValueError("group, head_dim and record_stride must be positive")
    return min(group - 1, record_stride // (4 * head_dim))
