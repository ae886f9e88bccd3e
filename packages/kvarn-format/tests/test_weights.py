"""Weight-size estimation from a config."""

from __future__ import annotations

import pytest

from kvarn_format.catalog import load_model, model_from_config
from kvarn_format.weights import (
    WeightFormat,
    estimate_weights,
    parse_weight_format,
    weight_format_from_config,
)

# A tiny dense model: 1 layer, hidden 256, 2 heads x 128, 1 KV head, MLP 512, vocab 1000, tied.
TINY = {
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}
# Linear weights (in x out):
#   q 256x256 = 65,536   k 256x128 = 32,768   v 256x128 = 32,768   o 256x256 = 65,536
#   gate_up 256x1024 = 262,144   down 512x256 = 131,072      -> 589,824 quantizable
#   embed 1000x256 = 256,000 (tied: no lm_head)
#   norms 2*256 + 256 = 768
TINY_LINEAR = 589_824
TINY_EMBED = 256_000
TINY_NORMS = 768


def test_tiny_param_count_and_bf16() -> None:
    e = estimate_weights(model_from_config(TINY, "tiny"), WeightFormat("bf16"))
    assert e.params == TINY_LINEAR + TINY_EMBED + TINY_NORMS
    assert e.total_bytes == 2 * e.params


def test_tiny_fp8() -> None:
    e = estimate_weights(model_from_config(TINY, "tiny"), parse_weight_format("fp8"))
    # one fp32 scale per 128x128 block: q 2x2, k 2x1, v 2x1, o 2x2, gate_up 2x8, down 4x2
    scales = (4 + 2 + 2 + 4 + 16 + 8) * 4
    assert e.total_bytes == TINY_LINEAR + scales + 2 * (TINY_EMBED + TINY_NORMS)


def test_tiny_int4() -> None:
    e = estimate_weights(model_from_config(TINY, "tiny"), parse_weight_format("int4"))
    # 0.5 B per weight + 2.5 B (fp16 scale + 4-bit zero) per 128 inputs per output:
    # groups = q 2*256 + k 2*128 + v 2*128 + o 2*256 + gate_up 2*1024 + down 4*256 = 4,608
    assert e.total_bytes == TINY_LINEAR // 2 + round(4_608 * 2.5) + 2 * (TINY_EMBED + TINY_NORMS)


def test_tiny_exl3() -> None:
    e = estimate_weights(model_from_config(TINY, "tiny"), parse_weight_format("exl3:4"))
    # 4 bits per weight + fp16 suh[in] and svh[out] per linear:
    # (in + out) summed = q 512 + k 384 + v 384 + o 512 + gate_up 1280 + down 768 = 3,840
    assert e.total_bytes == TINY_LINEAR // 2 + 2 * 3_840 + 2 * (TINY_EMBED + TINY_NORMS)


def test_qwen3_8b_matches_published_size() -> None:
    # embed + lm_head 2 * 151,936 * 4096 = 1,244,659,712
    # per layer q,o 4096^2 (x2) + k,v 4096*1024 (x2) + MLP 3*4096*12288 + norms 2*4096 + 2*128
    #   = 33,554,432 + 8,388,608 + 150,994,944 + 8,448 = 192,946,432; x 36 = 6,946,071,552
    # + final norm 4,096 -> 8,190,735,360 parameters (Qwen reports 8.2B)
    e = estimate_weights(load_model("Qwen3-8B"), WeightFormat("bf16"))
    assert e.params == 8_190_735_360
    assert e.total_bytes == 16_381_470_720


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("Qwen3-32B", 32.8),
        ("Qwen3-30B-A3B", 30.5),
        ("Llama-3.1-8B", 8.03),
        ("Llama-3.1-70B", 70.6),
        ("DeepSeek-V2-Lite", 15.7),
        ("DeepSeek-V3", 671.0),
        ("GLM-5.2", 744.0),
    ],
)
def test_published_parameter_counts(name: str, billions: float) -> None:
    e = estimate_weights(load_model(name), WeightFormat("bf16"))
    assert e.params / 1e9 == pytest.approx(billions, rel=0.01)


def test_moe_experts_dominate_and_scope() -> None:
    m = load_model("GLM-5.2")
    # Routed experts at 3.40 bpw, the rest BF16: about 347 GB, as the 348.7 GB EXL3 checkpoint.
    e = estimate_weights(m, parse_weight_format("exl3:3.4", scope="experts"))
    assert e.total_bytes / 1e9 == pytest.approx(348.7, rel=0.01)
    # 75 MoE layers x 256 experts x 3 x 6144 x 2048 parameters at 3.4 bits, plus fp16 suh/svh:
    # gate_up (in 6144 + out 4096) and down (in 2048 + out 6144) per expert.
    experts = 75 * 256 * 3 * 6144 * 2048
    sign_vectors = 75 * 256 * 2 * ((6144 + 4096) + (2048 + 6144))
    assert e.by_category["experts"] == pytest.approx(experts * 3.4 / 8 + sign_vectors, rel=1e-9)
    full = estimate_weights(m, parse_weight_format("exl3:3.4"))
    assert full.total_bytes < e.total_bytes


def test_tensor_parallel_share() -> None:
    m = load_model("Qwen3-8B")
    one = estimate_weights(m, WeightFormat("bf16"), tp=1)
    two = estimate_weights(m, WeightFormat("bf16"), tp=2)
    # Everything is split except norms (2 B * (36*(2*4096+256) + 4096) = 616,448 B).
    norms = 2 * (36 * (2 * 4096 + 256) + 4096)
    assert two.per_rank_bytes == (one.total_bytes - norms) // 2 + norms
    # 4 KV heads on 8 ranks: k/v are replicated, one head per rank.
    a3b = load_model("Qwen3-30B-A3B")
    per8 = estimate_weights(a3b, WeightFormat("bf16"), tp=8)
    kv_whole = 2 * 2 * 48 * 2048 * 4 * 128  # k and v, bf16, 48 layers, 4 heads of 128
    router = 2 * 48 * 2048 * 128  # replicated
    norms = 2 * (48 * (2 * 2048 + 2 * 128) + 2048)  # replicated
    split = per8.total_bytes - kv_whole - router - norms
    expected = split / 8 + kv_whole / 4 + router + norms
    assert per8.per_rank_bytes == pytest.approx(expected, abs=2)


def test_checkpoint_format_from_config() -> None:
    fmt, note = weight_format_from_config(load_model("DeepSeek-V3"))
    assert fmt.kind == "fp8" and "fp8" in note
    exl3 = model_from_config(
        {**TINY, "quantization_config": {"quant_method": "exl3", "bits": 3.5, "head_bits": 6}}, "x"
    )
    fmt, _ = weight_format_from_config(exl3)
    assert (fmt.kind, fmt.bits, fmt.head_bits) == ("exl3", 3.5, 6.0)
    awq = model_from_config(
        {**TINY, "quantization_config": {"quant_method": "awq", "bits": 4}}, "x"
    )
    assert weight_format_from_config(awq)[0].kind == "int4"
    odd = model_from_config({**TINY, "quantization_config": {"quant_method": "bitnet"}}, "x")
    fmt, note = weight_format_from_config(odd)
    assert fmt.kind == "bf16" and "not modelled" in note


def test_parse_weight_format_errors() -> None:
    assert parse_weight_format("EXL3:3.40").bits == 3.4
    with pytest.raises(ValueError, match="unknown weight format"):
        parse_weight_format("q4_k_m")
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        parse_weight_format("exl3:9")
    with pytest.raises(ValueError, match="scope"):
        parse_weight_format("fp8", scope="attention")
