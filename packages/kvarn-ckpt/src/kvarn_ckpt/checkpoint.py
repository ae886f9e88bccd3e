"""Reading a checkpoint directory: configs, the shard index and every shard's header.

Nothing here reads tensor payloads. :func:`open_checkpoint` collects what the other modules
need (the raw config dicts, the weight format, a name -> :class:`TensorInfo` map) and reports
every structural problem it meets into ``Checkpoint.problems`` rather than stopping at the
first, so one ``inspect`` run shows the whole picture.

Weight formats recognised:

* ``bf16`` / ``fp16`` / ``fp32``: no ``quantization_config``.
* ``exl3``: ``quantization_config.quant_method == "exl3"`` (exllamav3's ``compile.py``), with
  the optional ``quantization_config.json`` sidecar whose ``tensor_storage`` lists every
  module's stored tensors.
* ``exl3-tr3``: a ModelOpt ``quantization_config`` shim (``quant_method: "modelopt"``) next to
  a ``hybrid_tr3_tail`` block with ``format: "exl3-trellis"``: routed MoE experts are EXL3,
  rank-sliced for a fixed TP, and everything else is BF16. The block is read from the top
  level of config.json (where the GLM TR3 encoder writes it) or from inside
  ``quantization_config``.
* anything else is reported as ``other:<quant_method>`` and its weights are not validated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvarn_ckpt.model_config import AttentionGeometry, language_config, read_geometry
from kvarn_ckpt.problems import CheckpointError, ProblemList, SafetensorsHeaderError
from kvarn_ckpt.safetensors_header import SafetensorsHeader, TensorInfo, read_header

__all__ = ["Checkpoint", "WeightFormat", "load_json_object", "open_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
QUANT_SIDECAR = "quantization_config.json"


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How the weights are stored.

    ``kind`` is ``"bf16" | "fp16" | "fp32" | "exl3" | "exl3-tr3" | "other:<method>"``;
    ``declared_bits`` is the checkpoint's own bits-per-weight claim (EXL3's target average,
    TR3's ``bits`` or ``"mixed"``); ``codebook`` is EXL3's declared codebook when stated.
    """

    kind: str
    declared_bits: float | str | None = None
    codebook: str | None = None
    quant_method: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "declared_bits": self.declared_bits,
            "codebook": self.codebook,
            "quant_method": self.quant_method,
        }


@dataclass
class Checkpoint:
    """Everything read from a checkpoint directory, headers only."""

    path: Path
    config: dict[str, Any]
    config_text: str
    language_config: dict[str, Any]
    language_config_where: str
    geometry: AttentionGeometry | None
    quantization_config: dict[str, Any] | None
    quantization_config_where: str | None
    quant_sidecar: dict[str, Any] | None
    hybrid_tr3_tail: dict[str, Any] | None
    weight_format: WeightFormat
    weight_map: dict[str, str]
    headers: dict[str, SafetensorsHeader]
    tensors: dict[str, TensorInfo]
    problems: ProblemList = field(default_factory=ProblemList)

    @property
    def name(self) -> str:
        return self.path.name


def load_json_object(path: Path) -> dict[str, Any]:
    """Load a JSON file that must hold an object; raise :class:`CheckpointError` otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} holds a JSON {type(doc).__name__}, not an object")
    return doc


def _quantization_config(
    config: dict[str, Any], lang: dict[str, Any], lang_where: str
) -> tuple[dict[str, Any] | None, str | None]:
    for cfg, where in ((config, "config.json"), (lang, lang_where)):
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict):
            return qc, f"{where}:quantization_config"
    return None, None


def _hybrid_tail(
    config: dict[str, Any], lang: dict[str, Any], qc: dict[str, Any] | None
) -> dict[str, Any] | None:
    for holder in (config, lang, qc or {}):
        tail = holder.get("hybrid_tr3_tail")
        if isinstance(tail, dict):
            return tail
    return None


def _weight_format(
    lang: dict[str, Any],
    config: dict[str, Any],
    qc: dict[str, Any] | None,
    tail: dict[str, Any] | None,
    problems: ProblemList,
) -> WeightFormat:
    if tail is not None and tail.get("format") == "exl3-trellis":
        method = qc.get("quant_method") if qc else None
        if qc is not None and method not in ("modelopt", "exl3"):
            problems.warning(
                "config.quantization",
                f"hybrid_tr3_tail is present but quantization_config.quant_method is "
                f"{method!r}, not the ModelOpt shim ('modelopt') the TR3 layout uses",
                "config.json",
            )
        bits = tail.get("bits")
        return WeightFormat(
            "exl3-tr3",
            bits if isinstance(bits, (int, float, str)) and not isinstance(bits, bool) else None,
            tail.get("codebook") if isinstance(tail.get("codebook"), str) else None,
            method if isinstance(method, str) else None,
        )
    if tail is not None:
        problems.error(
            "config.hybrid_tr3_tail",
            f"hybrid_tr3_tail.format is {tail.get('format')!r}; only 'exl3-trellis' is known",
            "config.json",
        )
    if qc is None:
        dtype = next(
            (
                d
                for d in (
                    lang.get("torch_dtype"),
                    lang.get("dtype"),
                    config.get("torch_dtype"),
                    config.get("dtype"),
                )
                if isinstance(d, str)
            ),
            "bfloat16",
        )
        kind = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(
            dtype, "bf16"
        )
        return WeightFormat(kind)
    method = qc.get("quant_method")
    if method == "exl3":
        bits = qc.get("bits")
        codebook = qc.get("codebook")
        if codebook is not None and codebook not in ("mcg", "mul1", "3inst"):
            problems.error(
                "config.quantization",
                f"quantization_config.codebook is {codebook!r}; exllamav3 writes 'mcg', "
                "'mul1' or '3inst'",
                "config.json",
            )
        return WeightFormat(
            "exl3",
            bits if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None,
            codebook if isinstance(codebook, str) else None,
            "exl3",
        )
    problems.info(
        "config.quantization",
        f"quant_method {method!r} is not EXL3; its weights are not validated by kvarn-ckpt",
        "config.json",
    )
    return WeightFormat(f"other:{method}", quant_method=str(method))


def _shard_files(root: Path, problems: ProblemList) -> tuple[dict[str, str], list[str]]:
    """The weight map (tensor -> shard file) and the list of shard files to read."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            index = load_json_object(index_path)
        except CheckpointError as e:
            problems.error("index.invalid", str(e), INDEX_FILE)
            return {}, []
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            problems.error(
                "index.invalid", "weight_map must map tensor names to file names", INDEX_FILE
            )
            return {}, []
        files = sorted(set(wm.values()))
        for fname in files:
            if Path(fname).name != fname or fname in ("", ".", ".."):
                problems.error(
                    "index.invalid", f"shard name {fname!r} is not a plain file name", INDEX_FILE
                )
        return dict(wm), [f for f in files if Path(f).name == f and f not in ("", ".", "..")]
    if (root / SINGLE_FILE).is_file():
        return {}, [SINGLE_FILE]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    if found:
        problems.warning(
            "index.missing",
            f"no {INDEX_FILE}; reading all {len(found)} *.safetensors files in the directory",
            str(root),
        )
    else:
        problems.error("index.missing", "no safetensors weights found", str(root))
    return {}, found


def open_checkpoint(path: str | os.PathLike[str], *, read_weights: bool = True) -> Checkpoint:
    """Read config.json, the quantization configs, the index and every shard header.

    ``read_weights=False`` stops after the JSON files (what KV-format resolution needs, so a
    serving start-up does not read every shard header). Raises :class:`CheckpointError` only
    when there is nothing to inspect (no directory, no readable config.json); every other
    problem lands in ``Checkpoint.problems``.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (expected a checkpoint directory)")
    cfg_path = root / "config.json"
    config = load_json_object(cfg_path)
    config_text = cfg_path.read_text(encoding="utf-8")
    problems = ProblemList()

    lang, lang_where = language_config(config)
    geometry = read_geometry(config, problems)
    qc, qc_where = _quantization_config(config, lang, lang_where)
    tail = _hybrid_tail(config, lang, qc)
    wf = _weight_format(lang, config, qc, tail, problems)

    sidecar: dict[str, Any] | None = None
    if (root / QUANT_SIDECAR).is_file():
        try:
            sidecar = load_json_object(root / QUANT_SIDECAR)
        except CheckpointError as e:
            problems.error("sidecar.invalid", str(e), QUANT_SIDECAR)

    weight_map, files = _shard_files(root, problems) if read_weights else ({}, [])
    headers: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        fpath = root / fname
        if not fpath.is_file():
            problems.error(
                "shard.missing", f"shard {fname} named by the index does not exist", fname
            )
            continue
        try:
            hdr = read_header(fpath)
        except SafetensorsHeaderError as e:
            problems.error("shard.header", str(e), fname)
            continue
        headers[fname] = hdr
        if hdr.trailing_bytes:
            problems.warning(
                "shard.trailing_bytes",
                f"{hdr.trailing_bytes} bytes after the last tensor (not produced by "
                "safetensors writers)",
                fname,
            )
        for name, info in hdr.tensors.items():
            if weight_map and weight_map.get(name) != fname:
                problems.warning(
                    "index.unlisted",
                    f"tensor {name} is in {fname} but the index maps it to "
                    f"{weight_map.get(name)!r}",
                    fname,
                )
                continue
            if name in tensors:
                problems.error(
                    "shard.duplicate",
                    f"tensor {name} appears in {tensors[name].file.name} and {fname}",
                    fname,
                )
                continue
            tensors[name] = info
    for name, fname in weight_map.items():
        if fname in headers and name not in headers[fname].tensors:
            problems.error(
                "index.dangling",
                f"the index maps {name} to {fname}, whose header has no such tensor",
                fname,
            )
    return Checkpoint(
        root,
        config,
        config_text,
        lang,
        lang_where,
        geometry,
        qc,
        qc_where,
        sidecar,
        tail,
        wf,
        weight_map,
        headers,
        tensors,
        problems,
    )
