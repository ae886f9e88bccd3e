"""Model catalog: the attention geometry (and the sizes the weight estimate needs) of a model.

Planning capacity needs only a handful of ``config.json`` values: layer count and types, KV
heads and head dim (or the MLA ranks), and, for the weight estimate, the hidden, MLP, MoE and
vocabulary sizes. The catalog stores that subset for a few well-known models, in the same
key names as their Hugging Face ``config.json``, and parses it with the same code that reads
any ``config.json`` from disk, so a catalog entry and a downloaded config give the same
geometry.

Everything here is plain data and the standard library: no torch, no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "CATALOG",
    "CatalogEntry",
    "LayerKind",
    "MLAGeometry",
    "MoEGeometry",
    "ModelConfigError",
    "ModelGeometry",
    "catalog_names",
    "load_model",
    "model_from_config",
    "read_config",
]

LayerKind = Literal["full", "sliding", "linear"]


class ModelConfigError(ValueError):
    """A model config that is missing, unreadable, or lacks a key the planner needs."""


@dataclass(frozen=True, slots=True)
class MLAGeometry:
    """Multi-head latent attention ranks (DeepSeek-V2 style)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    #: DeepSeek sparse attention (DSA) indexer: tokens each query attends to; None = dense MLA.
    index_topk: int | None = None
    index_head_dim: int = 0
    index_n_heads: int = 0

    @property
    def cache_width(self) -> int:
        """Elements cached per token per layer: the latent plus the decoupled RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEGeometry:
    """Mixture-of-experts sizes, for the weight and activation estimates."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    #: Total intermediate width of the always-on shared expert(s); 0 when there are none.
    shared_intermediate_size: int
    #: Per decoder layer: True when the layer's MLP is the MoE block (False: dense MLP).
    moe_layers: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What the planner needs to know about a model, parsed from its ``config.json``."""

    name: str
    model_type: str
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    sliding_window: int | None
    mla: MLAGeometry | None
    moe: MoEGeometry | None
    torch_dtype: str
    #: ``quantization_config`` of the checkpoint, if any (drives the default weight format).
    quantization_config: Mapping[str, Any] | None = None
    source: str = ""
    attention_bias: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def count(self, kind: LayerKind) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    def describe(self) -> str:
        """One line: layers, heads and the attention kind."""
        if self.mla is not None:
            attn = (
                f"MLA kv_lora_rank={self.mla.kv_lora_rank} rope={self.mla.qk_rope_head_dim}, "
                f"{self.num_attention_heads} heads"
            )
            if self.mla.index_topk:
                attn += f", DSA top-k {self.mla.index_topk}"
        else:
            attn = (
                f"{self.num_attention_heads} q heads / {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}"
            )
        kinds = f"{self.num_layers} layers"
        if self.count("sliding") or self.count("linear"):
            kinds += (
                f" ({self.count('full')} full, {self.count('sliding')} sliding-window, "
                f"{self.count('linear')} linear)"
            )
        moe = ""
        if self.moe is not None:
            moe = f", MoE {self.moe.num_experts} experts top-{self.moe.experts_per_token}"
        return f"{self.name}: {kinds}, {attn}{moe}"


# ---------------------------------------------------------------------------------------------
# Parsing


def _text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a multimodal config: the language model's values win, top-level ones fill in."""
    inner = cfg.get("text_config")
    if inner is None:
        return dict(cfg)
    if not isinstance(inner, Mapping):
        raise ModelConfigError("config.json: 'text_config' must be an object")
    merged = {k: v for k, v in cfg.items() if k != "text_config"}
    merged.update(inner)
    return merged


def _req_int(cfg: Mapping[str, Any], key: str, *, minimum: int = 1) -> int:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"config.json is missing '{key}', which the planner needs")
    return _as_int(cfg, key, minimum=minimum)


def _as_int(cfg: Mapping[str, Any], key: str, *, minimum: int = 0) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelConfigError(
            f"config.json: '{key}' must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _opt_int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    if cfg.get(key) is None:
        return default
    return _as_int(cfg, key)


def _first_int(cfg: Mapping[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        if cfg.get(key) is not None:
            return _as_int(cfg, key)
    return None


_SLIDING_TYPES: Final = {"sliding_attention", "sliding_window", "local", "local_attention"}
_FULL_TYPES: Final = {"full_attention", "attention", "global", "global_attention"}
_LINEAR_TYPES: Final = {"linear_attention", "mamba", "mamba2", "conv", "ssm", "recurrent"}


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    """Per-layer attention kind from ``layer_types`` or the older sliding-window keys."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ModelConfigError("config.json: 'layer_types' must be a list of strings")
        if len(types) < num_layers:
            raise ModelConfigError(
                f"config.json: 'layer_types' lists {len(types)} layers but "
                f"num_hidden_layers is {num_layers}"
            )
        kinds: list[LayerKind] = []
        for t in types[:num_layers]:
            if t in _FULL_TYPES:
                kinds.append("full")
            elif t in _SLIDING_TYPES:
                kinds.append("sliding")
            elif t in _LINEAR_TYPES:
                kinds.append("linear")
            else:
                raise ModelConfigError(
                    f"config.json: unknown layer type {t!r} in 'layer_types' "
                    "(known: full_attention, sliding_attention, linear_attention, mamba)"
                )
        return tuple(kinds)
    window = cfg.get("sliding_window")
    use_sw = cfg.get("use_sliding_window")
    if window and (use_sw is True or (use_sw is None and "max_window_layers" not in cfg)):
        # Qwen2-style: the first ``max_window_layers`` layers use full attention.
        full_layers = _opt_int(cfg, "max_window_layers", 0) if use_sw else 0
        assert full_layers is not None
        full: LayerKind = "full"
        sliding: LayerKind = "sliding"
        out: list[LayerKind] = [full if i < full_layers else sliding for i in range(num_layers)]
        return tuple(out)
    all_full: list[LayerKind] = ["full"] * num_layers
    return tuple(all_full)


def _moe(cfg: Mapping[str, Any], num_layers: int, intermediate: int) -> MoEGeometry | None:
    experts = _first_int(cfg, ("n_routed_experts", "num_experts", "num_local_experts"))
    if not experts:
        return None
    top_k = _first_int(cfg, ("num_experts_per_tok", "moe_topk", "top_k"))
    if not top_k:
        raise ModelConfigError(
            "config.json is missing 'num_experts_per_tok', which a MoE model needs"
        )
    expert_inter = _first_int(cfg, ("moe_intermediate_size",)) or intermediate
    shared = 0
    n_shared = _opt_int(cfg, "n_shared_experts", 0) or 0
    if n_shared:
        shared = n_shared * expert_inter
    elif cfg.get("shared_expert_intermediate_size"):
        shared = _as_int(cfg, "shared_expert_intermediate_size")
    first_dense = _opt_int(cfg, "first_k_dense_replace", 0) or 0
    freq = _opt_int(cfg, "moe_layer_freq", 1) or 1
    sparse_step = _opt_int(cfg, "decoder_sparse_step", 1) or 1
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list):
        raise ModelConfigError("config.json: 'mlp_only_layers' must be a list of layer indices")
    moe_layers = tuple(
        i >= first_dense and i % freq == 0 and (i + 1) % sparse_step == 0 and i not in mlp_only
        for i in range(num_layers)
    )
    return MoEGeometry(experts, top_k, expert_inter, shared, moe_layers)


def model_from_config(cfg: Mapping[str, Any], name: str, *, source: str = "") -> ModelGeometry:
    """Parse a Hugging Face ``config.json`` mapping into a :class:`ModelGeometry`.

    Handles a nested ``text_config``; ``head_dim`` absent or null (then hidden/heads); MLA via
    ``kv_lora_rank``/``qk_rope_head_dim``; ``layer_types`` (full, sliding, linear); MoE expert
    counts. A missing key raises :class:`ModelConfigError` naming it.
    """
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{name}: config.json must be a JSON object")
    c = _text_config(cfg)
    num_layers = _req_int(c, "num_hidden_layers")
    hidden = _req_int(c, "hidden_size")
    heads = _req_int(c, "num_attention_heads")
    kv_heads = _opt_int(c, "num_key_value_heads") or heads
    head_dim = _opt_int(c, "head_dim")
    if not head_dim and c.get("kv_lora_rank") is None:
        if hidden % heads:
            raise ModelConfigError(
                f"config.json has no 'head_dim' and hidden_size {hidden} is not a multiple "
                f"of num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    head_dim = head_dim or 0
    vocab = _req_int(c, "vocab_size")
    intermediate = _opt_int(c, "intermediate_size", 0) or 0

    mla: MLAGeometry | None = None
    if c.get("kv_lora_rank") is not None:
        mla = MLAGeometry(
            kv_lora_rank=_req_int(c, "kv_lora_rank"),
            qk_rope_head_dim=_req_int(c, "qk_rope_head_dim"),
            qk_nope_head_dim=_req_int(c, "qk_nope_head_dim"),
            v_head_dim=_req_int(c, "v_head_dim"),
            q_lora_rank=_opt_int(c, "q_lora_rank"),
            index_topk=_opt_int(c, "index_topk"),
            index_head_dim=_opt_int(c, "index_head_dim", 0) or 0,
            index_n_heads=_opt_int(c, "index_n_heads", 0) or 0,
        )
        # vLLM caches one latent "head" per MLA layer.
        kv_heads = 1
        head_dim = mla.cache_width

    moe = _moe(c, num_layers, intermediate)
    if moe is None and not intermediate:
        raise ModelConfigError(
            "config.json is missing 'intermediate_size', which the planner needs"
        )

    dtype = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
    if not isinstance(dtype, str):
        raise ModelConfigError(f"config.json: 'torch_dtype' must be a string, got {dtype!r}")
    quant = cfg.get("quantization_config", c.get("quantization_config"))
    if quant is not None and not isinstance(quant, Mapping):
        raise ModelConfigError("config.json: 'quantization_config' must be an object")
    window = _opt_int(c, "sliding_window")
    max_pos = _opt_int(c, "max_position_embeddings")
    return ModelGeometry(
        name=name,
        model_type=str(c.get("model_type", "")),
        num_layers=num_layers,
        layer_kinds=_layer_kinds(c, num_layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        sliding_window=window,
        mla=mla,
        moe=moe,
        torch_dtype=dtype,
        quantization_config=quant,
        source=source,
        attention_bias=bool(c.get("attention_bias", False) or c.get("qkv_bias", False)),
    )


def read_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` (a file, or a directory that holds one).

    Raises :class:`ModelConfigError` with one line naming the file for a missing file, bad
    JSON or a non-object document.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelConfigError(f"no such model config: {p}") from None
    except OSError as e:
        raise ModelConfigError(f"cannot read {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ModelConfigError(f"{p} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p} must hold a JSON object")
    return data


# ---------------------------------------------------------------------------------------------
# The catalog


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    hf_id: str
    config: Mapping[str, Any]
    source: str


def _entry(name: str, hf_id: str, source: str, **config: Any) -> CatalogEntry:
    return CatalogEntry(name, hf_id, config, source)


_QWEN3_COMMON: Final[dict[str, Any]] = {
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "sliding_window": None,
    "use_sliding_window": False,
    "attention_bias": False,
}
_LLAMA31_COMMON: Final[dict[str, Any]] = {
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
}

_ENTRIES: Final[tuple[CatalogEntry, ...]] = (
    _entry(
        "Qwen3-8B",
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-8B config.json (public; same values as the project's "
        "shared/bench/qwen3-8b/config.json)",
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_window_layers=36,
        **_QWEN3_COMMON,
    ),
    _entry(
        "Qwen3-32B",
        "Qwen/Qwen3-32B",
        "Qwen/Qwen3-32B config.json (public, from memory of the published file)",
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_window_layers=64,
        **_QWEN3_COMMON,
    ),
    _entry(
        "Qwen3-30B-A3B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3-30B-A3B config.json (public, from memory of the published file)",
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_window_layers=48,
        **_QWEN3_COMMON,
    ),
    _entry(
        "Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B config.json (public, from memory; no head_dim key, so "
        "head_dim = 4096/32 = 128)",
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        **_LLAMA31_COMMON,
    ),
    _entry(
        "Llama-3.1-70B",
        "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.1-70B config.json (public, from memory; head_dim = 8192/64 = 128)",
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        **_LLAMA31_COMMON,
    ),
    _entry(
        "GLM-4.7-Flash",
        "zai-org/GLM-4.7-Flash",
        "zai-org/GLM-4.7-Flash config.json (public, from memory). Cross-checked against "
        "public model cards: 47 MLA layers, 20 heads, q_lora 768, kv_lora 512, qk_nope 192 + "
        "rope 64, v_head_dim 256, hidden 2048, 64 routed + 1 shared experts, top-4, ~202K "
        "context, ~62.5 GB of BF16 safetensors",
        model_type="glm4_moe_lite",
        architectures=["Glm4MoeLiteForCausalLM"],
        hidden_size=2048,
        intermediate_size=10240,
        moe_intermediate_size=1536,
        num_hidden_layers=47,
        num_attention_heads=20,
        num_key_value_heads=20,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        vocab_size=154880,
        max_position_embeddings=202752,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    _entry(
        "DeepSeek-V2-Lite",
        "deepseek-ai/DeepSeek-V2-Lite",
        "deepseek-ai/DeepSeek-V2-Lite config.json (public); the dimensions were verified to "
        "parse in vLLM 0.23 (docs/reference/vllm-0.23-integration.md §5)",
        model_type="deepseek_v2",
        architectures=["DeepseekV2ForCausalLM"],
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        vocab_size=102400,
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    _entry(
        "DeepSeek-V3",
        "deepseek-ai/DeepSeek-V3",
        "deepseek-ai/DeepSeek-V3 config.json (public, from memory): 671B parameters, FP8 "
        "block-128 checkpoint; the MTP layer (num_nextn_predict_layers) is not counted",
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        vocab_size=129280,
        max_position_embeddings=163840,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    ),
    _entry(
        "GLM-5.2",
        "zai-org/GLM-5.2",
        "GLM-5.2-class glm_moe_dsa geometry. MLA ranks (kv_lora 512, rope 64, q_lora 2048), "
        "64 heads, v_head_dim 256, DSA top-k 2048, 256 routed experts, 3 dense + 75 MoE "
        "layers: docs/reference/peers-and-assets.md §5 (GGUF card facts). hidden 6144, "
        "moe_intermediate 2048, qk_nope 192, vocab 154880 and the indexer sizes are the public "
        "GLM-5 config from memory; with them the routed experts at 3.40 bpw plus BF16 for the "
        "rest give ~346 GB, matching the 348.7 GB EXL3 checkpoint of §5",
        model_type="glm_moe_dsa",
        architectures=["GlmMoeDsaForCausalLM"],
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        num_attention_heads=64,
        num_key_value_heads=64,
        kv_lora_rank=512,
        q_lora_rank=2048,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
        vocab_size=154880,
        max_position_embeddings=202752,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
)

CATALOG: Final[dict[str, CatalogEntry]] = {e.name: e for e in _ENTRIES}


def catalog_names() -> tuple[str, ...]:
    return tuple(CATALOG)


def _lookup(name: str) -> CatalogEntry | None:
    key = name.strip().lower()
    for entry in _ENTRIES:
        if key in (entry.name.lower(), entry.hf_id.lower()):
            return entry
        # "Qwen/Qwen3-32B" → "qwen3-32b"; also accept an "-Instruct" suffix for Llama.
        if "/" in key and key.split("/", 1)[1] == entry.name.lower():
            return entry
    return None


def load_model(name_or_path: str | Path) -> ModelGeometry:
    """A catalog model by name (case-insensitive, with or without the HF org), or any
    ``config.json`` path (file or directory). Unknown names that are not files raise
    :class:`ModelConfigError` listing the catalog."""
    text = str(name_or_path)
    entry = _lookup(text)
    if entry is not None:
        return model_from_config(entry.config, entry.name, source=entry.source)
    path = Path(text)
    looks_like_path = path.suffix == ".json" or "/" in text or path.exists()
    if not looks_like_path:
        raise ModelConfigError(
            f"unknown model {text!r}: give a config.json path or one of "
            f"{', '.join(catalog_names())}"
        )
    cfg = read_config(path)
    name = path.parent.name if path.name == "config.json" else path.name
    return model_from_config(cfg, name or text, source=str(path))
