"""kvarn-format: the KVarN cache dtype registry, record geometry, KV budget sizing and the
NumPy reference codec. NumPy only: no torch, no GPU."""

from kvarn_format.geometry import Field, RecordLayout, fp16_bytes_per_token, record_layout
from kvarn_format.registry import (
    DENSE_DTYPES,
    DENSE_HEAD_DIMS,
    MLA_DTYPES,
    VALID_DTYPES,
    CacheDTypeError,
    DenseFormat,
    KVarNFormat,
    MLAFormat,
    UnsupportedGeometryError,
    is_kvarn_dtype,
    parse_cache_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "DENSE_DTYPES",
    "DENSE_HEAD_DIMS",
    "MLA_DTYPES",
    "VALID_DTYPES",
    "CacheDTypeError",
    "DenseFormat",
    "Field",
    "KVarNFormat",
    "MLAFormat",
    "RecordLayout",
    "UnsupportedGeometryError",
    "fp16_bytes_per_token",
    "is_kvarn_dtype",
    "parse_cache_dtype",
    "record_layout",
]
