"""The model side of config.json: architecture and attention geometry.

Multimodal and wrapper checkpoints keep the language model's fields under ``text_config``;
the KV cache is the language model's, so the geometry is read from there when present.
MLA (DeepSeek-style latent attention) is recognised by a positive ``kv_lora_rank``: its cache
holds one ``kv_lora_rank``-wide latent plus a ``qk_rope_head_dim`` RoPE part per token and
layer, shared by all heads, so the dense notions of KV heads and head dim do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvarn_ckpt.problems import ProblemList

__all__ = ["AttentionGeometry", "language_config", "read_geometry"]


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """What the KV cache of one model looks like.

    ``kv_layers`` counts the layers that keep a full-attention KV cache (KVarN quantizes only
    those; sliding-window and linear-attention layers keep their own caches).
    """

    kind: Literal["dense", "mla"]
    model_type: str | None
    architectures: tuple[str, ...]
    num_layers: int
    kv_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    hidden_size: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model_type": self.model_type,
            "architectures": list(self.architectures),
            "num_layers": self.num_layers,
            "kv_layers": self.kv_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "sliding_window": self.sliding_window,
            "hidden_size": self.hidden_size,
        }


def language_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The dict that holds the language model's fields, and where it was found."""
    text = config.get("text_config")
    if isinstance(text, dict) and any(
        k in text for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")
    ):
        return text, "config.json:text_config"
    return config, "config.json"


def _int(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def read_geometry(config: dict[str, Any], problems: ProblemList) -> AttentionGeometry | None:
    """Read the attention geometry; report and return ``None`` when it is incomplete."""
    cfg, where = language_config(config)
    archs_raw = config.get("architectures") or cfg.get("architectures") or []
    archs = tuple(a for a in archs_raw if isinstance(a, str)) if isinstance(archs_raw, list) else ()
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None
    if model_type is None and isinstance(config.get("model_type"), str):
        model_type = config["model_type"]

    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    if layers is None or layers <= 0 or heads is None or heads <= 0:
        problems.error(
            "config.geometry",
            "config.json lacks a positive num_hidden_layers / num_attention_heads; the "
            "attention geometry cannot be determined",
            where,
        )
        return None

    kv_layers = layers
    layer_types = cfg.get("layer_types")
    sliding = _int(cfg, "sliding_window")
    if isinstance(layer_types, list) and layer_types:
        kv_layers = sum(1 for t in layer_types if t == "full_attention")
        others = sorted({str(t) for t in layer_types if t != "full_attention"})
        if others:
            problems.info(
                "config.layer_types",
                f"{kv_layers} of {len(layer_types)} layers use full attention; KVarN "
                f"quantizes only those ({', '.join(others)} layers keep their own cache)",
                where,
            )
    elif sliding is not None and sliding > 0 and cfg.get("use_sliding_window", True):
        problems.warning(
            "config.sliding_window",
            f"sliding_window={sliding} with no layer_types: every layer may be a "
            "sliding-window layer, which KVarN does not quantize",
            where,
        )

    kv_lora = _int(cfg, "kv_lora_rank")
    if kv_lora is not None and kv_lora > 0:
        rope = _int(cfg, "qk_rope_head_dim")
        if rope is None:
            problems.error(
                "config.geometry",
                "MLA model (kv_lora_rank set) without qk_rope_head_dim",
                where,
            )
            return None
        return AttentionGeometry(
            "mla",
            model_type,
            archs,
            layers,
            kv_layers,
            heads,
            1,
            kv_lora,
            kv_lora_rank=kv_lora,
            qk_rope_head_dim=rope,
            sliding_window=sliding,
            hidden_size=hidden,
        )

    kv_heads = _int(cfg, "num_key_value_heads")
    if kv_heads is None:
        kv_heads = heads
    head_dim = _int(cfg, "head_dim")
    if head_dim is None:
        if hidden is None or hidden % heads:
            problems.error(
                "config.geometry",
                "config.json has no head_dim and hidden_size is not a multiple of "
                "num_attention_heads",
                where,
            )
            return None
        head_dim = hidden // heads
    if kv_heads <= 0 or heads % kv_heads:
        problems.error(
            "config.geometry",
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
            where,
        )
        return None
    return AttentionGeometry(
        "dense",
        model_type,
        archs,
        layers,
        kv_layers,
        heads,
        kv_heads,
        head_dim,
        sliding_window=sliding,
        hidden_size=hidden,
    )
