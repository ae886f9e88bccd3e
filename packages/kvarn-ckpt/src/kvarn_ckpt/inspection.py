"""``kvarn-ckpt inspect``: one report on a checkpoint, its weights and its KV format.

The report covers the architecture and attention geometry, the weight format and bits per
weight, the declared and the resolved KV format, the KV bytes per token (from kvarn-format's
record layout), optionally the capacity on a GPU (kvarn-format's sizing solver), and every
problem found, each with a severity. Errors make the CLI exit non-zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvarn_ckpt.checkpoint import Checkpoint, open_checkpoint
from kvarn_ckpt.exl3 import Exl3Report, summarize_dtypes, validate_exl3
from kvarn_ckpt.model_config import AttentionGeometry
from kvarn_ckpt.problems import Problem, ProblemList
from kvarn_ckpt.resolve import KVResolution, resolve_kv_format
from kvarn_format import fp16_bytes_per_token, is_kvarn_dtype, parse_cache_dtype, record_layout
from kvarn_format.registry import DenseFormat

__all__ = ["InspectReport", "format_report", "inspect_checkpoint", "kv_bytes_per_token"]


@dataclass
class InspectReport:
    """Everything ``inspect`` found. ``as_dict()`` is the ``--json`` output."""

    path: str
    geometry: AttentionGeometry | None
    weight_format: dict[str, Any]
    weights: dict[str, Any]
    exl3: Exl3Report | None
    resolution: KVResolution
    kv: dict[str, Any] | None
    capacity: dict[str, Any] | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(1 for p in self.problems if p.severity == "error")

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "architecture": self.geometry.as_dict() if self.geometry else None,
            "weight_format": self.weight_format,
            "weights": self.weights,
            "exl3": self.exl3.as_dict() if self.exl3 else None,
            "kv_format": {
                "declared": self.resolution.declared.dtype if self.resolution.declared else None,
                "resolved": self.resolution.dtype,
                "source": self.resolution.source,
                "user": self.resolution.user,
                "heuristic": self.resolution.hint.as_dict() if self.resolution.hint else None,
            },
            "kv_bytes": self.kv,
            "capacity": self.capacity,
            "problems": [p.as_dict() for p in self.problems],
            "errors": self.errors,
            "warnings": sum(1 for p in self.problems if p.severity == "warning"),
        }


def kv_bytes_per_token(dtype: str, geometry: AttentionGeometry, tp: int = 1) -> dict[str, Any]:
    """KV bytes per token for the whole model and per tensor-parallel rank.

    The per-record numbers come from :func:`kvarn_format.record_layout` (never recomputed
    here). Dense caches split KV heads over ranks (replicated when ``tp`` exceeds them); an
    MLA latent is replicated on every rank.
    """
    fmt = parse_cache_dtype(dtype)
    if isinstance(fmt, DenseFormat):
        layout = record_layout(fmt, geometry.head_dim)
        heads = geometry.num_kv_heads
        heads_per_rank = max(1, heads // tp)
    else:
        layout = record_layout(fmt)
        heads = heads_per_rank = 1
    per_layer = layout.bytes_per_token_per_head * heads
    fp16_per_layer = layout.fp16_bytes_per_token_per_head * heads
    return {
        "dtype": dtype,
        "tile_bytes": layout.tile_bytes,
        "group": layout.group,
        "bytes_per_token_per_head": layout.bytes_per_token_per_head,
        "kv_layers": geometry.kv_layers,
        "bytes_per_token": per_layer * geometry.kv_layers,
        "bytes_per_token_per_rank": layout.bytes_per_token_per_head
        * heads_per_rank
        * geometry.kv_layers,
        "fp16_bytes_per_token": fp16_per_layer * geometry.kv_layers,
        "ratio_vs_fp16": round(layout.ratio_vs_fp16, 4),
    }


def _fp16_only(geometry: AttentionGeometry) -> dict[str, Any]:
    per = fp16_bytes_per_token(geometry.kind, geometry.head_dim, geometry.qk_rope_head_dim or 64)
    heads = geometry.num_kv_heads if geometry.kind == "dense" else 1
    return {
        "dtype": None,
        "fp16_bytes_per_token": per * heads * geometry.kv_layers,
        "kv_layers": geometry.kv_layers,
    }


def _weights_summary(ckpt: Checkpoint, exl3: Exl3Report | None) -> dict[str, Any]:
    dtypes = summarize_dtypes(ckpt)
    total_bytes = sum(t.nbytes for t in ckpt.tensors.values())
    out: dict[str, Any] = {
        "shards": len(ckpt.headers),
        "tensors": len(ckpt.tensors),
        "stored_bytes": total_bytes,
        "elements_by_dtype": dtypes,
    }
    if exl3 is not None and exl3.quantized_weights:
        out["exl3_mean_bits_per_weight"] = round(exl3.mean_bpw or 0.0, 4)
        out["exl3_linears"] = len(exl3.linears)
        # Parameters: every EXL3 weight, plus every stored element that is not EXL3 data.
        exl3_bytes = sum(
            t.nbytes
            for n, t in ckpt.tensors.items()
            if n.rpartition(".")[2] in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
        )
        other_elems = sum(
            t.numel
            for n, t in ckpt.tensors.items()
            if n.rpartition(".")[2] not in ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
        )
        params = exl3.quantized_weights + other_elems
        out["parameters"] = params
        out["bits_per_parameter"] = round(8 * total_bytes / params, 4) if params else None
        out["exl3_stored_bytes"] = exl3_bytes
    else:
        params = sum(t.numel for t in ckpt.tensors.values())
        out["parameters"] = params
        out["bits_per_parameter"] = round(8 * total_bytes / params, 4) if params else None
    return out


def _check_plain_weights(ckpt: Checkpoint, problems: ProblemList) -> None:
    trellis = [n for n in ckpt.tensors if n.endswith(".trellis")]
    if trellis:
        problems.error(
            "weights.undeclared_exl3",
            f"{len(trellis)} EXL3 .trellis tensors are present but config.json declares no "
            "EXL3 quantization (no quantization_config / hybrid_tr3_tail); loaders will "
            "misread them",
            trellis[0],
        )
    want = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}.get(ckpt.weight_format.kind)
    floats = {d: n for d, n in summarize_dtypes(ckpt).items() if d in ("BF16", "F16", "F32")}
    if want and floats:
        main = max(floats, key=lambda d: floats[d])
        if main != want:
            problems.warning(
                "weights.dtype",
                f"config.json says {ckpt.weight_format.kind} but most weight elements are {main}",
                "config.json",
            )


def _capacity(
    ckpt: Checkpoint,
    dtype: str,
    gpu: str,
    tp: int,
    max_model_len: int | None,
    mem_util: float,
    problems: ProblemList,
) -> dict[str, Any] | None:
    from kvarn_format.catalog import ModelConfigError, model_from_config
    from kvarn_format.sizing import BudgetError, plan

    try:
        geo = model_from_config(ckpt.config, ckpt.name, source=str(ckpt.path))
    except ModelConfigError as e:
        problems.warning("capacity.model", f"capacity not computed: {e}")
        return None
    stored = sum(t.nbytes for t in ckpt.tensors.values())
    try:
        result = plan(
            geo,
            dtype,
            gpu=gpu,
            tp=tp,
            max_model_len=max_model_len,
            mem_util=mem_util,
            weight_bytes=-(-stored // tp),
        )
    except (BudgetError, ValueError) as e:
        problems.warning("capacity.plan", f"capacity on {gpu} not computed: {e}")
        return None
    out = result.as_dict()
    out["weight_note"] = (
        "stored checkpoint bytes / tp (as a native kernel would hold them; the kvarn-ckpt "
        "reference vLLM path dequantizes EXL3 to dense weights and needs more)"
    )
    return out


def inspect_checkpoint(
    path: str | os.PathLike[str],
    *,
    user_cache_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    accept_heuristic: bool = False,
    gpu: str | None = None,
    max_model_len: int | None = None,
    mem_util: float = 0.9,
) -> InspectReport:
    """Inspect a checkpoint directory. Raises ``CheckpointError`` only if there is no
    readable config.json; everything else is a problem in the report."""
    ckpt = open_checkpoint(path)
    problems = ProblemList()
    problems.extend(ckpt.problems.items())
    exl3: Exl3Report | None = None
    if ckpt.weight_format.kind in ("exl3", "exl3-tr3"):
        exl3 = validate_exl3(ckpt, problems)
    elif not ckpt.weight_format.kind.startswith("other:"):
        _check_plain_weights(ckpt, problems)
    tail_tp = (ckpt.hybrid_tr3_tail or {}).get("tp")
    if (
        ckpt.weight_format.kind == "exl3-tr3"
        and isinstance(tail_tp, int)
        and tail_tp != tensor_parallel_size
    ):
        problems.warning(
            "tr3.tp_mismatch",
            f"the routed experts are pre-sliced for tensor_parallel_size={tail_tp}; serving "
            f"with --tp {tensor_parallel_size} needs loaders that re-slice or merge them",
            "config.json:hybrid_tr3_tail",
        )

    res = resolve_kv_format(
        ckpt,
        user_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        accept_heuristic=accept_heuristic,
    )
    problems.extend(res.problems)

    kv: dict[str, Any] | None = None
    if ckpt.geometry is not None:
        kv = (
            kv_bytes_per_token(res.dtype, ckpt.geometry, tensor_parallel_size)
            if res.dtype is not None and is_kvarn_dtype(res.dtype) and res.ok
            else _fp16_only(ckpt.geometry)
        )
    capacity = None
    if gpu is not None:
        cap_dtype = res.dtype if res.dtype is not None and res.ok else "auto"
        capacity = _capacity(
            ckpt, cap_dtype, gpu, tensor_parallel_size, max_model_len, mem_util, problems
        )
    return InspectReport(
        str(ckpt.path),
        ckpt.geometry,
        ckpt.weight_format.as_dict(),
        _weights_summary(ckpt, exl3),
        exl3,
        res,
        kv,
        capacity,
        problems.items(),
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_report(r: InspectReport) -> str:
    """The human-readable report."""
    lines = [f"checkpoint: {r.path}"]
    g = r.geometry
    if g is not None:
        arch = ", ".join(g.architectures) or "?"
        if g.kind == "mla":
            attn = (
                f"MLA kv_lora_rank={g.kv_lora_rank} qk_rope_head_dim={g.qk_rope_head_dim}, "
                f"{g.num_attention_heads} heads"
            )
        else:
            attn = (
                f"dense, {g.num_attention_heads} q heads / {g.num_kv_heads} KV heads, "
                f"head_dim {g.head_dim}"
            )
        lines.append(
            f"architecture: {arch} (model_type {g.model_type}); {g.num_layers} layers "
            f"({g.kv_layers} with a full-attention KV cache); {attn}"
        )
    wf = r.weight_format
    w = r.weights
    wline = f"weights: {wf['kind']}"
    if wf.get("declared_bits") is not None:
        wline += f", declared bits {wf['declared_bits']}"
    if wf.get("codebook"):
        wline += f", codebook {wf['codebook']}"
    if "exl3_mean_bits_per_weight" in w:
        wline += (
            f"; {w['exl3_linears']} EXL3 linears at {w['exl3_mean_bits_per_weight']} "
            "bits per weight"
        )
    if w.get("bits_per_parameter") is not None:
        wline += f"; {w['bits_per_parameter']} bits per parameter overall"
    wline += f"; {w['tensors']} tensors in {w['shards']} shard(s), {_gib(w['stored_bytes'])}"
    lines.append(wline)
    if r.exl3 is not None and r.exl3.tr3 is not None:
        t = r.exl3.tr3
        lines.append(
            f"tr3: layout {t['layout']}, tp {t['tp']}, layers {t['moe_layers']}, "
            f"{t['experts_per_layer']} experts/layer; tensors "
            f"{t['found_tensors']}/{t['expected_tensors']}"
        )
    res = r.resolution
    declared = res.declared.dtype if res.declared else "none"
    lines.append(
        f"kv format: declared {declared}; resolved {res.dtype or 'none'} (source: {res.source})"
    )
    if res.hint is not None:
        lines.append(
            f"  name heuristic: {res.hint.label!r} -> "
            f"{', '.join(res.hint.candidates) or 'no candidate'}"
            f"{' (ambiguous)' if res.hint.ambiguous else ''}"
        )
    if r.kv is not None:
        if r.kv.get("dtype"):
            lines.append(
                f"kv bytes/token: {r.kv['bytes_per_token']:g} ({r.kv['bytes_per_token_per_rank']:g} "
                f"per rank) vs fp16 {r.kv['fp16_bytes_per_token']:g} = "
                f"{r.kv['ratio_vs_fp16']}x smaller; tile {r.kv['tile_bytes']} B / "
                f"{r.kv['group']} tokens"
            )
        else:
            lines.append(f"kv bytes/token: fp16 {r.kv['fp16_bytes_per_token']:g} (no KVarN format)")
    if r.capacity is not None:
        c = r.capacity
        ratio = f", {c['ratio_vs_fp16']}x fp16" if c.get("ratio_vs_fp16") else ""
        lines.append(
            f"capacity on {c['gpu']} (tp {c['tp']}, mem_util {c['mem_util']}): "
            f"{c['kv_tokens']:,} KV tokens{ratio}; {c['max_concurrency']} requests of "
            f"{c['max_model_len']:,} tokens"
        )
    if r.problems:
        lines.append(f"problems ({r.errors} error(s)):")
        lines.extend(f"  {p}" for p in r.problems)
    else:
        lines.append("problems: none")
    return "\n".join(lines)
