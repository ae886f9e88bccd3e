"""The KVarN cache dtype registry.

The dtype string is the only carrier of geometry: ``kvarn_k4v2_g128`` means 4-bit keys,
2-bit values and 128-token tiles. The registry is a fixed table of the combinations the
kernels implement. Nothing is parsed by pattern and nothing is normalized, so a string that
is not byte-for-byte in the table is rejected with the list of valid strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "DENSE_DTYPES",
    "DENSE_HEAD_DIMS",
    "MLA_DTYPES",
    "MLA_LATENT_RANK",
    "MLA_ROPE_DIM",
    "VALID_DTYPES",
    "CacheDTypeError",
    "DenseFormat",
    "KVarNFormat",
    "MLAFormat",
    "UnsupportedGeometryError",
    "check_dense_head_dim",
    "check_mla_geometry",
    "is_kvarn_dtype",
    "parse_cache_dtype",
]

#: Head dims the dense kernels implement.
DENSE_HEAD_DIMS: Final[tuple[int, ...]] = (64, 128, 256, 512)
#: The MLA latent rank (kv_lora_rank) and decoupled RoPE width the MLA formats implement.
MLA_LATENT_RANK: Final[int] = 512
MLA_ROPE_DIM: Final[int] = 64


class CacheDTypeError(ValueError):
    """An unknown or malformed KVarN cache dtype string."""


class UnsupportedGeometryError(ValueError):
    """A model geometry (head dim, ranks) that a KVarN format cannot take."""


@dataclass(frozen=True, slots=True)
class DenseFormat:
    """A dense (MHA/GQA) KVarN format: separate K and V tiles of ``group`` tokens."""

    name: str
    key_bits: int
    value_bits: int
    group: int

    kind: Literal["dense"] = "dense"

    @property
    def block_size(self) -> int:
        """vLLM block size: one tile is one block."""
        return self.group

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class MLAFormat:
    """An MLA KVarN format: one quantized latent tile (serving as K and V) plus a RoPE part."""

    name: str
    latent_bits: int
    group: int
    latent_rank: int = MLA_LATENT_RANK
    rope_dim: int = MLA_ROPE_DIM

    kind: Literal["mla"] = "mla"

    @property
    def block_size(self) -> int:
        """vLLM block size: one tile is one block."""
        return self.group

    def __str__(self) -> str:
        return self.name


KVarNFormat = DenseFormat | MLAFormat


def _dense(key_bits: int, value_bits: int, group: int) -> DenseFormat:
    return DenseFormat(f"kvarn_k{key_bits}v{value_bits}_g{group}", key_bits, value_bits, group)


def _mla(bits: int, group: int) -> MLAFormat:
    return MLAFormat(f"kvarn_mla_k{bits}_g{group}", bits, group)


_DENSE: Final[tuple[DenseFormat, ...]] = (
    _dense(4, 2, 128),
    _dense(4, 4, 128),
    _dense(4, 2, 64),
    _dense(4, 4, 64),
    _dense(5, 5, 64),
)
_MLA: Final[tuple[MLAFormat, ...]] = (
    _mla(4, 128),
    _mla(2, 64),
    _mla(4, 64),
    _mla(5, 64),
)
_ALL: Final[tuple[KVarNFormat, ...]] = (*_DENSE, *_MLA)
_TABLE: Final[dict[str, KVarNFormat]] = {f.name: f for f in _ALL}

DENSE_DTYPES: Final[tuple[str, ...]] = tuple(f.name for f in _DENSE)
MLA_DTYPES: Final[tuple[str, ...]] = tuple(f.name for f in _MLA)
VALID_DTYPES: Final[tuple[str, ...]] = DENSE_DTYPES + MLA_DTYPES


def is_kvarn_dtype(cache_dtype: object) -> bool:
    """True when ``cache_dtype`` is exactly one of the admitted KVarN strings."""
    return isinstance(cache_dtype, str) and cache_dtype in _TABLE


def parse_cache_dtype(cache_dtype: str) -> KVarNFormat:
    """Return the immutable format for an admitted KVarN dtype string.

    Raises :class:`CacheDTypeError` (a ``ValueError``) naming every valid string otherwise.
    """
    if not isinstance(cache_dtype, str):
        raise CacheDTypeError(
            f"KVarN cache dtype must be a string, got {type(cache_dtype).__name__}. "
            f"Valid: {', '.join(VALID_DTYPES)}"
        )
    fmt = _TABLE.get(cache_dtype)
    if fmt is None:
        raise CacheDTypeError(
            f"Unknown KVarN cache dtype {cache_dtype!r}. Valid: {', '.join(VALID_DTYPES)}"
        )
    return fmt


def check_dense_head_dim(fmt: DenseFormat, head_dim: int) -> None:
    """Raise :class:`UnsupportedGeometryError` unless the dense kernels take ``head_dim``."""
    if head_dim not in DENSE_HEAD_DIMS:
        raise UnsupportedGeometryError(
            f"{fmt.name} does not support head_dim={head_dim}; supported head dims: "
            f"{', '.join(map(str, DENSE_HEAD_DIMS))}. Use --kv-cache-dtype auto or fp8 "
            "for this model."
        )


def check_mla_geometry(fmt: MLAFormat, latent_rank: int, rope_dim: int) -> None:
    """Raise :class:`UnsupportedGeometryError` unless the MLA ranks match the format."""
    if (latent_rank, rope_dim) != (fmt.latent_rank, fmt.rope_dim):
        raise UnsupportedGeometryError(
            f"{fmt.name} needs an MLA latent rank of {fmt.latent_rank} with a "
            f"{fmt.rope_dim}-dim RoPE part; this model has kv_lora_rank={latent_rank}, "
            f"qk_rope_head_dim={rope_dim}."
        )
