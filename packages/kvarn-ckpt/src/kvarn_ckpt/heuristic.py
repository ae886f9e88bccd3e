"""The name heuristic: what a checkpoint's name suggests about its KV format.

Names like ``GLM-5.2-EXL3-TR3-3.40bpw-KVarN-K4V2`` are labels, not geometry. "K4V2" comes from
the dense preset family (4-bit keys, 2-bit values); an MLA model caches one latent that
serves as both K and V, and the published material maps the same label to two different MLA
formats (``kvarn_mla_k4_g64``, the runtime's default, 418 B/token; and
``kvarn_mla_k2_g64``, 290 B/token, in the model card). So:

* a full registry string in the name (``kvarn_mla_k4_g64``) gives one candidate;
* a ``KxVy`` label on a dense model gives the registry's dense formats with those widths,
  the 128-token tile first (the shipped default);
* a ``KxVy`` label on an MLA model is always **ambiguous** and never resolves.

The heuristic only ever proposes: resolution reports it as ``heuristic`` with a warning and
uses it only when the caller confirms (``--accept-name-heuristic``) and it is unambiguous.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvarn_ckpt.model_config import AttentionGeometry
from kvarn_format import DENSE_DTYPES, MLA_DTYPES, is_kvarn_dtype, parse_cache_dtype
from kvarn_format.registry import DenseFormat, MLAFormat

__all__ = ["NameHint", "checkpoint_names", "name_hint"]

_FULL = re.compile(r"kvarn[_-](mla[_-]k\d+|k\d+v\d+)[_-]g(\d+)", re.IGNORECASE)
_LABEL = re.compile(r"kvarn[_-]?k(\d)v(\d)(?![\d])", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class NameHint:
    """What a name suggests. ``candidates`` are registry strings, preferred first."""

    name: str
    label: str
    candidates: tuple[str, ...]
    ambiguous: bool
    reason: str

    @property
    def candidate(self) -> str | None:
        """The single usable candidate, or ``None`` when ambiguous or empty."""
        return None if self.ambiguous or not self.candidates else self.candidates[0]

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "label": self.label,
            "candidates": list(self.candidates),
            "ambiguous": self.ambiguous,
            "reason": self.reason,
        }


def _group(dtype: str) -> int:
    return parse_cache_dtype(dtype).group


def checkpoint_names(path: Path, config_name_or_path: object = None) -> list[str]:
    """Names a checkpoint goes by: its directory, its HF repo (from a hub cache path), and
    config.json's ``_name_or_path``."""
    names: list[str] = []
    parts = path.resolve().parts
    for i, part in enumerate(parts):
        # Hugging Face cache layout: models--ORG--NAME/snapshots/<sha>
        if part.startswith("models--") and i + 2 < len(parts) and parts[i + 1] == "snapshots":
            names.append(part[len("models--") :].replace("--", "/"))
    names.append(path.resolve().name)
    if isinstance(config_name_or_path, str) and config_name_or_path:
        names.append(config_name_or_path)
    return list(dict.fromkeys(names))


def name_hint(names: list[str], geometry: AttentionGeometry | None) -> NameHint | None:
    """The first hint found in ``names``, or ``None`` when no name mentions KVarN."""
    for name in names:
        m = _FULL.search(name)
        if m:
            dtype = "kvarn_" + m.group(1).lower().replace("-", "_") + "_g" + m.group(2)
            if is_kvarn_dtype(dtype):
                fmt = parse_cache_dtype(dtype)
                fits = geometry is None or fmt.kind == geometry.kind
                return NameHint(
                    name,
                    m.group(0),
                    (dtype,),
                    not fits,
                    "the name contains a registry string"
                    + (
                        ""
                        if fits
                        else f" for {fmt.kind} models, but this model is "
                        f"{geometry.kind if geometry else '?'}"
                    ),
                )
        m = _LABEL.search(name)
        if m:
            kb, vb = int(m.group(1)), int(m.group(2))
            label = m.group(0)
            if geometry is not None and geometry.kind == "mla":
                cands = tuple(
                    d
                    for d in MLA_DTYPES
                    if isinstance(f := parse_cache_dtype(d), MLAFormat)
                    and f.latent_bits in (kb, vb)
                )
                return NameHint(
                    name,
                    label,
                    tuple(sorted(cands, key=lambda d: (_group(d) != 64, d))),
                    True,
                    f"'{label}' is a dense-family label; an MLA model has one latent (K == V), "
                    "and the label is used for more than one MLA format",
                )
            dense = [
                d
                for d in DENSE_DTYPES
                if isinstance(f := parse_cache_dtype(d), DenseFormat)
                and (f.key_bits, f.value_bits) == (kb, vb)
            ]
            dense.sort(key=lambda d: -_group(d))
            if not dense:
                return NameHint(
                    name,
                    label,
                    (),
                    True,
                    f"no registry format has {kb}-bit keys and {vb}-bit values",
                )
            return NameHint(
                name,
                label,
                tuple(dense),
                False,
                f"'{label}' read as {kb}-bit keys / {vb}-bit values"
                + (
                    f"; tile size not in the name, {dense[0]} (largest tile) assumed"
                    if len(dense) > 1
                    else ""
                ),
            )
    return None
