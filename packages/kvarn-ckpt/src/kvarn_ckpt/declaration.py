"""The checkpoint's declaration of its KV cache format: ``config.json["kv_cache_quant"]``.

Schema, version 1 (docs/checkpoints.md is the normative text)::

    "kv_cache_quant": {
        "format_version": 1,              # int; readers refuse versions they do not know
        "method": "kvarn",                # the only method defined
        "dtype": "kvarn_mla_k4_g64",      # a kvarn-format registry string, byte for byte
        "block_size": 64,                 # == the dtype's tile size G (one tile = one block)
        "producer": "kvarn-ckpt 0.1.0"    # optional, free text provenance
    }

The dtype string stays the only carrier of geometry (design principle): ``block_size`` is a
redundant cross-check that catches a hand-edited dtype, never a second source of truth.
Unknown keys are reported and ignored, because no key may change the geometry.

The declaration belongs at the top level of config.json. A copy inside ``text_config`` or in
``quantization_config.json`` is read too; copies that disagree are a conflict. Another KV
quantization declared by the weight format (ModelOpt ``kv_cache_quant_algo``,
compressed-tensors ``kv_cache_scheme``) next to a KVarN declaration is reported as a warning: the KVarN
declaration wins, and the other method's scales go unused with a kvarn cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvarn_ckpt.checkpoint import Checkpoint
from kvarn_ckpt.problems import ProblemList
from kvarn_format import CacheDTypeError, parse_cache_dtype

__all__ = [
    "DECLARATION_KEY",
    "DECLARATION_VERSION",
    "KVDeclaration",
    "build_declaration",
    "find_declaration",
]

DECLARATION_KEY = "kv_cache_quant"
DECLARATION_VERSION = 1
_KNOWN_KEYS = frozenset({"format_version", "method", "dtype", "block_size", "producer"})


@dataclass(frozen=True, slots=True)
class KVDeclaration:
    """A parsed, registry-checked declaration (geometry is checked at resolution)."""

    dtype: str
    block_size: int
    format_version: int
    where: str
    producer: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "block_size": self.block_size,
            "format_version": self.format_version,
            "where": self.where,
            "producer": self.producer,
        }


def build_declaration(dtype: str, producer: str | None = None) -> dict[str, Any]:
    """The JSON object ``annotate`` writes for ``dtype`` (raises ``CacheDTypeError``)."""
    fmt = parse_cache_dtype(dtype)
    out: dict[str, Any] = {
        "format_version": DECLARATION_VERSION,
        "method": "kvarn",
        "dtype": fmt.name,
        "block_size": fmt.block_size,
    }
    if producer:
        out["producer"] = producer
    return out


def _parse(raw: object, where: str, problems: ProblemList) -> KVDeclaration | None:
    code = "declaration.invalid"
    if not isinstance(raw, dict):
        problems.error(
            code, f"{DECLARATION_KEY} must be an object, got {type(raw).__name__}", where
        )
        return None
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        problems.error(
            code, f"{DECLARATION_KEY}.format_version must be an integer, got {version!r}", where
        )
        return None
    if version != DECLARATION_VERSION:
        problems.error(
            "declaration.version",
            f"{DECLARATION_KEY}.format_version {version} is not supported (this kvarn-ckpt "
            f"reads version {DECLARATION_VERSION}); upgrade kvarn-ckpt or pass "
            "--kv-cache-dtype explicitly",
            where,
        )
        return None
    method = raw.get("method")
    if method != "kvarn":
        problems.error(
            code, f"{DECLARATION_KEY}.method is {method!r}; only 'kvarn' is defined", where
        )
        return None
    dtype = raw.get("dtype")
    if not isinstance(dtype, str):
        problems.error(code, f"{DECLARATION_KEY}.dtype must be a string, got {dtype!r}", where)
        return None
    try:
        fmt = parse_cache_dtype(dtype)
    except CacheDTypeError as e:
        problems.error("declaration.dtype", f"declared {e}", where)
        return None
    block = raw.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int):
        problems.error(
            code, f"{DECLARATION_KEY}.block_size must be an integer, got {block!r}", where
        )
        return None
    if block != fmt.block_size:
        problems.error(
            "declaration.block_size",
            f"declared block_size {block} does not match {dtype}, whose tile (= vLLM block) is "
            f"{fmt.block_size} tokens; fix the declaration with kvarn-ckpt annotate",
            where,
        )
        return None
    producer = raw.get("producer")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        problems.warning(
            "declaration.unknown_keys",
            f"{DECLARATION_KEY} has keys this reader does not know and ignores: "
            f"{', '.join(unknown)} (the dtype string alone carries the geometry)",
            where,
        )
    return KVDeclaration(
        dtype, block, version, where, producer if isinstance(producer, str) else None
    )


def _foreign_kv(ckpt: Checkpoint) -> list[tuple[str, str]]:
    """Non-KVarN KV-cache quantization declared by the weight format: (where, what)."""
    out: list[tuple[str, str]] = []
    for qc, where in (
        (ckpt.quantization_config, ckpt.quantization_config_where or "quantization_config"),
        (ckpt.quant_sidecar, "quantization_config.json"),
    ):
        if not isinstance(qc, dict):
            continue
        algo = qc.get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo:
            out.append((where, f"kv_cache_quant_algo={algo}"))
        scheme = qc.get("kv_cache_scheme")
        if isinstance(scheme, dict) and scheme:
            out.append((where, f"kv_cache_scheme={scheme}"))
    return out


def find_declaration(ckpt: Checkpoint, problems: ProblemList) -> KVDeclaration | None:
    """The checkpoint's KV declaration, or ``None``.

    Problems (invalid or conflicting declarations) are reported as errors into ``problems``;
    when there are any, ``None`` is returned so nothing downstream uses a doubtful format.
    """
    found: list[tuple[str, object]] = []
    if DECLARATION_KEY in ckpt.config:
        found.append(("config.json", ckpt.config[DECLARATION_KEY]))
    text = ckpt.config.get("text_config")
    if isinstance(text, dict) and DECLARATION_KEY in text:
        found.append(("config.json:text_config", text[DECLARATION_KEY]))
    if isinstance(ckpt.quant_sidecar, dict) and DECLARATION_KEY in ckpt.quant_sidecar:
        found.append(("quantization_config.json", ckpt.quant_sidecar[DECLARATION_KEY]))
    if not found:
        return None

    errors_before = problems.count("error")
    parsed = [(where, _parse(raw, where, problems)) for where, raw in found]
    decls = [d for _, d in parsed if d is not None]
    if problems.count("error") > errors_before:
        return None
    first = decls[0]
    for other in decls[1:]:
        if other.dtype != first.dtype:
            problems.error(
                "declaration.conflict",
                f"conflicting KV declarations: {first.where} declares {first.dtype} but "
                f"{other.where} declares {other.dtype}; keep one (kvarn-ckpt annotate "
                "rewrites config.json)",
                other.where,
            )
            return None
    for where, what in _foreign_kv(ckpt):
        problems.warning(
            "declaration.foreign_kv",
            f"{first.where} declares KVarN {first.dtype} and {where} also declares a KV "
            f"cache quantization ({what}); the KVarN declaration wins and those scales are "
            "unused with a kvarn cache dtype",
            where,
        )
    return first
