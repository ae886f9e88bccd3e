"""Weight-size estimation from a model config, so capacity can be planned without a checkpoint.

The model is broken into its linear layers (with their in/out features and how tensor
parallelism splits them) plus the parameters that are never quantized (embeddings, norms,
router). A :class:`WeightFormat` then says how many bytes each linear weight costs:

* ``bf16`` / ``fp16``: 2 bytes per parameter.
* ``fp8``: 1 byte per linear weight plus one fp32 scale per 128x128 block (DeepSeek-V3 style);
  embeddings, ``lm_head``, router and norms stay 16-bit.
* ``int4``: 4-bit weights with one fp16 scale and one 4-bit zero point per 128 inputs (the
  AWQ/GPTQ group-128 layout: 4.16 bits per weight); the rest 16-bit.
* ``exl3:<bpw>``: EXL3 trellis weights at ``bpw`` bits plus the two fp16 sign/scale vectors
  of each linear (``suh`` [in], ``svh`` [out]); ``lm_head`` at ``head_bits`` (6 by default).

``scope="experts"`` quantizes only the routed experts of a MoE model and keeps everything else
16-bit, as the GLM-5.2 EXL3 checkpoint does (docs/reference/peers-and-assets.md §5).

Multi-token-prediction layers (``num_nextn_predict_layers``) are not counted: vLLM loads them
only when they serve as the speculative drafter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from kvarn_format.catalog import ModelConfigError, ModelGeometry

__all__ = [
    "Linear",
    "WeightEstimate",
    "WeightFormat",
    "estimate_weights",
    "linear_layers",
    "parse_weight_format",
    "weight_format_from_config",
]

Shard = Literal["tp", "replicated", "kv"]
Category = Literal[
    "attention", "mlp", "experts", "shared_experts", "router", "embedding", "lm_head"
]


@dataclass(frozen=True, slots=True)
class Linear:
    """``count`` identical ``in_features x out_features`` weight matrices."""

    name: str
    in_features: int
    out_features: int
    count: int
    category: Category
    shard: Shard

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.count


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How linear weights are stored. See the module docstring for each kind's byte cost."""

    kind: Literal["bf16", "fp16", "fp8", "int4", "exl3"]
    bits: float = 16.0
    head_bits: float = 6.0
    scope: Literal["linear", "experts"] = "linear"

    @property
    def label(self) -> str:
        text = f"exl3:{self.bits:g}" if self.kind == "exl3" else self.kind
        return text + (" (experts only)" if self.scope == "experts" else "")


_FORMAT_RE: Final = re.compile(r"^(bf16|fp16|fp8|int4|exl3:(\d+(?:\.\d+)?))$")


def parse_weight_format(text: str, *, scope: str = "linear") -> WeightFormat:
    """Parse ``bf16``, ``fp16``, ``fp8``, ``int4`` or ``exl3:<bpw>`` (bpw in [1, 8])."""
    if scope not in ("linear", "experts"):
        raise ValueError(f"weight scope must be 'linear' or 'experts', got {scope!r}")
    m = _FORMAT_RE.match(text.strip().lower())
    if m is None:
        raise ValueError(
            f"unknown weight format {text!r}; use bf16, fp16, fp8, int4 or exl3:<bits per "
            "weight> (e.g. exl3:3.4)"
        )
    sc: Literal["linear", "experts"] = "experts" if scope == "experts" else "linear"
    if m.group(2) is not None:
        bits = float(m.group(2))
        if not 1.0 <= bits <= 8.0:
            raise ValueError(f"EXL3 bits per weight must be in [1, 8], got {bits:g}")
        return WeightFormat("exl3", bits, scope=sc)
    kind = m.group(1)
    bits_of = {"bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int4": 4.0}
    if kind == "bf16":
        return WeightFormat("bf16", bits_of[kind], scope=sc)
    if kind == "fp16":
        return WeightFormat("fp16", bits_of[kind], scope=sc)
    if kind == "fp8":
        return WeightFormat("fp8", bits_of[kind], scope=sc)
    return WeightFormat("int4", bits_of[kind], scope=sc)


def weight_format_from_config(model: ModelGeometry) -> tuple[WeightFormat, str]:
    """The checkpoint's own weight format, from ``quantization_config``, with a note saying how
    it was decided. Unknown methods fall back to 16-bit and say so."""
    q = model.quantization_config
    if not q:
        return WeightFormat("bf16"), f"{model.torch_dtype} checkpoint (no quantization_config)"
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return WeightFormat("fp8", 8.0), "quantization_config: fp8"
    if method == "exl3":
        bits = q.get("bits")
        if not isinstance(bits, int | float) or isinstance(bits, bool):
            raise ModelConfigError("config.json: EXL3 quantization_config is missing 'bits'")
        head = q.get("head_bits", 6)
        head_bits = float(head) if isinstance(head, int | float) else 6.0
        return WeightFormat("exl3", float(bits), head_bits), f"quantization_config: exl3 {bits}"
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin") and q.get("bits", 4) == 4:
        return WeightFormat("int4", 4.0), f"quantization_config: {method} 4-bit"
    return WeightFormat("bf16"), (
        f"quantization_config method {method or '?'} is not modelled; assumed 16-bit "
        "(pass an explicit weight format)"
    )


def linear_layers(model: ModelGeometry) -> tuple[Linear, ...]:
    """Every weight matrix of the model, grouped by shape."""
    h = model.hidden_size
    attn_layers = model.num_layers
    out: list[Linear] = []
    if model.mla is not None:
        m = model.mla
        heads = model.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            out.append(Linear("q_a_proj", h, m.q_lora_rank, attn_layers, "attention", "replicated"))
            out.append(
                Linear("q_b_proj", m.q_lora_rank, heads * qk, attn_layers, "attention", "tp")
            )
        else:
            out.append(Linear("q_proj", h, heads * qk, attn_layers, "attention", "tp"))
        out.append(Linear("kv_a_proj", h, m.cache_width, attn_layers, "attention", "replicated"))
        out.append(
            Linear(
                "kv_b_proj",
                m.kv_lora_rank,
                heads * (m.qk_nope_head_dim + m.v_head_dim),
                attn_layers,
                "attention",
                "tp",
            )
        )
        out.append(Linear("o_proj", heads * m.v_head_dim, h, attn_layers, "attention", "tp"))
        if m.index_topk and m.index_n_heads and m.index_head_dim:
            q_in = m.q_lora_rank or h
            idx = m.index_n_heads * m.index_head_dim
            out.append(Linear("indexer.wq_b", q_in, idx, attn_layers, "attention", "replicated"))
            out.append(
                Linear("indexer.wk", h, m.index_head_dim, attn_layers, "attention", "replicated")
            )
            out.append(
                Linear(
                    "indexer.weights_proj",
                    h,
                    m.index_n_heads,
                    attn_layers,
                    "attention",
                    "replicated",
                )
            )
    else:
        qd = model.num_attention_heads * model.head_dim
        kvd = model.num_kv_heads * model.head_dim
        out.append(Linear("q_proj", h, qd, attn_layers, "attention", "tp"))
        out.append(Linear("k_proj", h, kvd, attn_layers, "attention", "kv"))
        out.append(Linear("v_proj", h, kvd, attn_layers, "attention", "kv"))
        out.append(Linear("o_proj", qd, h, attn_layers, "attention", "tp"))

    moe = model.moe
    n_moe = sum(moe.moe_layers) if moe is not None else 0
    n_dense = model.num_layers - n_moe
    if n_dense:
        inter = model.intermediate_size
        if not inter:
            raise ModelConfigError(
                "config.json is missing 'intermediate_size' for the dense MLP layers"
            )
        out.append(Linear("mlp.gate_up_proj", h, 2 * inter, n_dense, "mlp", "tp"))
        out.append(Linear("mlp.down_proj", inter, h, n_dense, "mlp", "tp"))
    if moe is not None and n_moe:
        e, ei = moe.num_experts, moe.expert_intermediate_size
        out.append(Linear("experts.gate_up_proj", h, 2 * ei, n_moe * e, "experts", "tp"))
        out.append(Linear("experts.down_proj", ei, h, n_moe * e, "experts", "tp"))
        if moe.shared_intermediate_size:
            si = moe.shared_intermediate_size
            out.append(Linear("shared.gate_up_proj", h, 2 * si, n_moe, "shared_experts", "tp"))
            out.append(Linear("shared.down_proj", si, h, n_moe, "shared_experts", "tp"))
        out.append(Linear("router", h, e, n_moe, "router", "replicated"))

    out.append(Linear("embed_tokens", model.vocab_size, h, 1, "embedding", "tp"))
    if not model.tie_word_embeddings:
        out.append(Linear("lm_head", h, model.vocab_size, 1, "lm_head", "tp"))
    return tuple(out)


def _other_params(model: ModelGeometry) -> int:
    """Norm weights and biases: small, replicated, always 16-bit."""
    h = model.hidden_size
    n = model.num_layers * 2 * h + h
    if model.mla is not None:
        n += model.num_layers * (model.mla.kv_lora_rank + (model.mla.q_lora_rank or 0))
    else:
        if model.model_type.startswith("qwen3"):
            n += model.num_layers * 2 * model.head_dim  # q_norm, k_norm
        if model.attention_bias:
            n += (
                model.num_layers
                * (model.num_attention_heads + 2 * model.num_kv_heads)
                * (model.head_dim)
            )
    return n


@dataclass(frozen=True, slots=True)
class WeightEstimate:
    """Estimated weight bytes, in total and on one tensor-parallel rank."""

    format: WeightFormat
    tp: int
    params: int
    total_bytes: int
    per_rank_bytes: int
    by_category: dict[str, int]

    @property
    def bits_per_param(self) -> float:
        return 8 * self.total_bytes / self.params


def _quantized(lin: Linear, fmt: WeightFormat) -> bool:
    if fmt.kind in ("bf16", "fp16") or lin.category in ("router", "embedding"):
        return False
    if fmt.scope == "experts":
        return lin.category == "experts"
    if lin.category == "lm_head":
        return fmt.kind == "exl3"
    return True


def _linear_bytes(lin: Linear, fmt: WeightFormat) -> float:
    """Bytes of all ``lin.count`` matrices, before tensor-parallel splitting."""
    n_in, n_out, count = lin.in_features, lin.out_features, lin.count
    if not _quantized(lin, fmt):
        return 2.0 * n_in * n_out * count
    if fmt.kind == "fp8":
        scales = -(-n_in // 128) * -(-n_out // 128) * 4
        return float((n_in * n_out + scales) * count)
    if fmt.kind == "int4":
        groups = -(-n_in // 128) * n_out
        return (n_in * n_out * 0.5 + groups * 2.5) * count
    bits = fmt.head_bits if lin.category == "lm_head" else fmt.bits
    return (n_in * n_out * bits / 8 + 2 * (n_in + n_out)) * count


def estimate_weights(model: ModelGeometry, fmt: WeightFormat, *, tp: int = 1) -> WeightEstimate:
    """Estimate the bytes of the model's weights in ``fmt``, and the share of one TP rank.

    TP-split matrices (column/row parallel, vocab parallel, experts) are divided by ``tp``;
    replicated ones (MLA down-projections, router, norms) are counted whole on every rank; K/V
    projections are split while there are at least ``tp`` KV heads and replicated per rank
    otherwise, as vLLM does.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    total = 0.0
    per_rank = 0.0
    params = 0
    by_cat: dict[str, float] = {}
    for lin in linear_layers(model):
        b = _linear_bytes(lin, fmt)
        total += b
        params += lin.params
        by_cat[lin.category] = by_cat.get(lin.category, 0.0) + b
        if lin.shard == "replicated":
            per_rank += b
        elif lin.shard == "kv":
            per_rank += b * max(1, model.num_kv_heads // tp) / model.num_kv_heads
        else:
            per_rank += b / tp
    other = _other_params(model)
    params += other
    total += 2 * other
    per_rank += 2 * other
    by_cat["norms"] = 2.0 * other
    return WeightEstimate(
        format=fmt,
        tp=tp,
        params=params,
        total_bytes=round(total),
        per_rank_bytes=round(per_rank),
        by_category={k: round(v) for k, v in by_cat.items()},
    )
