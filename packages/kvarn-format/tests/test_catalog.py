"""Model catalog and config.json parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvarn_format.catalog import (
    ModelConfigError,
    catalog_names,
    load_model,
    model_from_config,
    read_config,
)
from kvarn_format.registry import DENSE_DTYPES, MLA_DTYPES, UnsupportedGeometryError
from kvarn_format.sizing import layer_caches, valid_cache_dtypes

REQUIRED = {
    "Qwen3-8B",
    "Qwen3-32B",
    "Qwen3-30B-A3B",
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "GLM-4.7-Flash",
    "DeepSeek-V2-Lite",
}


def test_catalog_has_the_required_models_and_an_mla_flagship() -> None:
    names = set(catalog_names())
    assert names >= REQUIRED
    assert {"DeepSeek-V3", "GLM-5.2"} <= names
    for name in names:
        assert load_model(name).source, f"{name} has no source note"


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim", "mla"),
    [
        ("Qwen3-8B", 36, 8, 128, False),
        ("Qwen3-32B", 64, 8, 128, False),
        ("Qwen3-30B-A3B", 48, 4, 128, False),
        ("Llama-3.1-8B", 32, 8, 128, False),  # no head_dim key: 4096 / 32
        ("Llama-3.1-70B", 80, 8, 128, False),  # 8192 / 64
        ("GLM-4.7-Flash", 47, 1, 576, True),  # MLA: one 512+64 latent "head"
        ("DeepSeek-V2-Lite", 27, 1, 576, True),
        ("DeepSeek-V3", 61, 1, 576, True),
        ("GLM-5.2", 78, 1, 576, True),
    ],
)
def test_catalog_geometry(name: str, layers: int, kv_heads: int, head_dim: int, mla: bool) -> None:
    m = load_model(name)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.is_mla) == (layers, kv_heads, head_dim, mla)
    assert m.count("full") == layers
    if mla:
        assert m.mla is not None and (m.mla.kv_lora_rank, m.mla.qk_rope_head_dim) == (512, 64)


def test_moe_layers() -> None:
    v2 = load_model("DeepSeek-V2-Lite")
    assert v2.moe is not None
    # first_k_dense_replace = 1: layer 0 dense, 26 MoE layers; 2 shared experts of 1408.
    assert v2.moe.moe_layers[0] is False and sum(v2.moe.moe_layers) == 26
    assert v2.moe.shared_intermediate_size == 2 * 1408
    a3b = load_model("Qwen3-30B-A3B")
    assert a3b.moe is not None and sum(a3b.moe.moe_layers) == 48
    assert (a3b.moe.num_experts, a3b.moe.experts_per_token) == (128, 8)
    glm5 = load_model("GLM-5.2")
    assert glm5.mla is not None and glm5.mla.index_topk == 2048
    assert glm5.moe is not None and sum(glm5.moe.moe_layers) == 75


def test_lookup_is_forgiving_about_case_and_org() -> None:
    assert load_model("qwen3-32b").name == "Qwen3-32B"
    assert load_model("Qwen/Qwen3-32B").name == "Qwen3-32B"
    assert load_model("deepseek-ai/DeepSeek-V2-Lite").name == "DeepSeek-V2-Lite"
    with pytest.raises(ModelConfigError, match="unknown model 'Qwen9'") as exc:
        load_model("Qwen9")
    assert "Qwen3-8B" in str(exc.value)


def test_valid_formats_per_model() -> None:
    assert valid_cache_dtypes(load_model("Qwen3-8B")) == ("auto", "fp8", *DENSE_DTYPES)
    assert valid_cache_dtypes(load_model("GLM-4.7-Flash")) == ("auto", "fp8", *MLA_DTYPES)


def _write(tmp_path: Path, cfg: object, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


TOY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "intermediate_size": 1024,
}


def test_config_path_file_and_directory(tmp_path: Path) -> None:
    path = _write(tmp_path, TOY)
    by_file = load_model(path)
    by_dir = load_model(str(tmp_path))
    assert by_file.head_dim == by_dir.head_dim == 128
    assert by_file.num_kv_heads == 2
    assert by_file.name == tmp_path.name


def test_head_dim_null_means_hidden_over_heads() -> None:
    assert model_from_config({**TOY, "head_dim": None}, "t").head_dim == 128
    assert model_from_config({**TOY, "head_dim": 256}, "t").head_dim == 256
    # num_key_value_heads absent: plain multi-head attention.
    no_kv = {k: v for k, v in TOY.items() if k != "num_key_value_heads"}
    assert model_from_config(no_kv, "t").num_kv_heads == 4


def test_nested_text_config() -> None:
    cfg = {
        "architectures": ["SomeVLM"],
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 1152},
        "text_config": {**TOY, "num_hidden_layers": 6},
    }
    m = model_from_config(cfg, "vlm")
    assert m.num_layers == 6 and m.hidden_size == 512 and m.torch_dtype == "bfloat16"


def test_mla_detection() -> None:
    cfg = {
        **TOY,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": None,
    }
    m = model_from_config(cfg, "mla")
    assert m.mla is not None and m.num_kv_heads == 1 and m.head_dim == 576
    odd = model_from_config({**cfg, "kv_lora_rank": 256}, "mla256")
    assert valid_cache_dtypes(odd) == ("auto", "fp8")
    with pytest.raises(UnsupportedGeometryError, match="kv_lora_rank=256"):
        layer_caches(odd, "kvarn_mla_k4_g64")


def test_layer_types() -> None:
    cfg = {
        **TOY,
        "num_hidden_layers": 6,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    }
    m = model_from_config(cfg, "gemma-like")
    assert (m.count("sliding"), m.count("full")) == (5, 1)
    hybrid = model_from_config(
        {
            **TOY,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
        "hybrid",
    )
    assert hybrid.count("linear") == 3
    assert valid_cache_dtypes(hybrid) == ("auto", "fp8")
    with pytest.raises(UnsupportedGeometryError, match="linear-attention"):
        layer_caches(hybrid, "auto")
    with pytest.raises(ModelConfigError, match="unknown layer type 'weird'"):
        model_from_config({**TOY, "layer_types": ["weird", "full_attention"]}, "x")
    with pytest.raises(ModelConfigError, match="lists 1 layers"):
        model_from_config({**TOY, "layer_types": ["full_attention"]}, "x")


def test_qwen2_style_sliding_window_keys() -> None:
    # use_sliding_window false (Qwen2.5, Qwen3): all full attention despite a sliding_window value.
    off = model_from_config({**TOY, "sliding_window": 4096, "use_sliding_window": False}, "q")
    assert off.count("full") == 2
    # On, with the first max_window_layers layers full.
    on = model_from_config(
        {
            **TOY,
            "num_hidden_layers": 4,
            "sliding_window": 4096,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
        "q",
    )
    assert on.layer_kinds == ("full", "sliding", "sliding", "sliding")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no such model config"):
        load_model(tmp_path / "nope.json")
    with pytest.raises(ModelConfigError, match="no such model config"):
        read_config(tmp_path)  # a directory without config.json


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 2,')
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model(path)
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_model(path)


@pytest.mark.parametrize(
    "key", ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"]
)
def test_missing_key_is_named(tmp_path: Path, key: str) -> None:
    cfg = {k: v for k, v in TOY.items() if k != key}
    with pytest.raises(ModelConfigError, match=f"missing '{key}'"):
        load_model(_write(tmp_path, cfg))


def test_missing_mla_key_is_named() -> None:
    with pytest.raises(ModelConfigError, match="missing 'qk_rope_head_dim'"):
        model_from_config({**TOY, "kv_lora_rank": 512}, "x")


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ModelConfigError, match="'num_hidden_layers' must be an integer"):
        model_from_config({**TOY, "num_hidden_layers": "two"}, "x")
    with pytest.raises(ModelConfigError, match="not a multiple"):
        model_from_config({**TOY, "num_attention_heads": 3}, "x")
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        model_from_config({**TOY, "num_experts": 8}, "x")
