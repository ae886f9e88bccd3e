"""Dtype admission, engine checks and the plugin's patch discipline, on real vLLM objects."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from kvarn_format import DENSE_DTYPES, VALID_DTYPES, parse_cache_dtype
from kvarn_vllm import _patches
from kvarn_vllm.plugin import register


def _args(model: Path, **kw: object) -> EngineArgs:
    return EngineArgs(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        **kw,  # type: ignore[arg-type]
    )


def _cache_dtypes() -> tuple[str, ...]:
    import vllm.config.cache as cache_mod

    return typing.get_args(cache_mod.CacheDType)


def test_import_alone_patches_nothing() -> None:
    assert not _patches.is_applied()
    assert not any(d.startswith("kvarn") for d in _cache_dtypes())
    with pytest.raises(Exception, match="cache_dtype"):
        CacheConfig(cache_dtype="kvarn_k4v2_g128")  # type: ignore[arg-type]


def test_register_is_idempotent_and_revert_restores(kvarn: None) -> None:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.worker.gpu_worker import Worker

    first = Worker.execute_model
    register()
    register()
    assert Worker.execute_model is first
    assert set(VALID_DTYPES) <= set(_cache_dtypes())
    assert all(STR_DTYPE_TO_TORCH_DTYPE[d] == torch.uint8 for d in VALID_DTYPES)
    _patches.revert_all()
    assert not any(d.startswith("kvarn") for d in _cache_dtypes())
    assert "kvarn_k4v2_g128" not in STR_DTYPE_TO_TORCH_DTYPE
    assert not getattr(Worker.execute_model, "_kvarn_wrapped", False)
    register()  # the fixture reverts again


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_engine_args_accept_every_dense_dtype_with_tile_block_size(
    kvarn: None, qwen3_dir: Path, dtype: str
) -> None:
    config = _args(qwen3_dir, kv_cache_dtype=dtype).create_engine_config()
    fmt = parse_cache_dtype(dtype)
    assert config.cache_config.cache_dtype == dtype
    assert config.cache_config.block_size == fmt.group
    assert config.cache_config.user_specified_block_size
    assert "sliding_window" in config.cache_config.kv_cache_dtype_skip_layers


def test_cache_config_accepts_and_rejects_with_our_message(kvarn: None) -> None:
    assert CacheConfig(cache_dtype="kvarn_k4v4_g64").cache_dtype == "kvarn_k4v4_g64"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Unknown KVarN cache dtype 'kvarn_k4v2_g32'.*Valid:"):
        CacheConfig(cache_dtype="kvarn_k4v2_g32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Input should be"):
        CacheConfig(cache_dtype="not_a_dtype")  # type: ignore[arg-type]


def test_engine_args_reject_bad_dtype_and_conflicting_block_size(
    kvarn: None, qwen3_dir: Path
) -> None:
    with pytest.raises(ValueError, match=r"Unknown KVarN cache dtype.*kvarn_k4v2_g128"):
        _args(qwen3_dir, kv_cache_dtype="kvarn_k3v3_g128").create_engine_config()
    with pytest.raises(ValueError, match=r"needs --block-size 128.*got --block-size 16"):
        _args(qwen3_dir, kv_cache_dtype="kvarn_k4v2_g128", block_size=16).create_engine_config()
    ok = _args(qwen3_dir, kv_cache_dtype="kvarn_k4v2_g64", block_size=64).create_engine_config()
    assert ok.cache_config.block_size == 64


def test_cli_parses_kvarn_dtypes(kvarn: None) -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-cache-dtype", "kvarn_k5v5_g64"])
    assert args.kv_cache_dtype == "kvarn_k5v5_g64"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "kvarn_bogus"])


def test_auto_dtype_is_untouched(kvarn: None, qwen3_dir: Path) -> None:
    config = _args(qwen3_dir).create_engine_config()
    assert config.cache_config.cache_dtype in ("auto", "bfloat16")
    assert "sliding_window" not in (config.cache_config.kv_cache_dtype_skip_layers or [])


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "torch_dtype": "bfloat16",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    path = tmp_path_factory.mktemp("dsv2")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_mla_models_and_mla_dtypes_fail_closed(kvarn: None, mla_dir: Path, qwen3_dir: Path) -> None:
    # A dense dtype on an MLA model: kvarn-ckpt's resolver (when installed) rejects it first
    # with the geometry conflict; without it the plugin's own check does.
    with pytest.raises(ValueError, match=r"(?s)MLA.*(not yet supported|use one of the kvarn_mla)"):
        _args(mla_dir, kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()
    with pytest.raises(ValueError, match=r"MLA.*not yet supported"):
        _args(mla_dir, kv_cache_dtype="kvarn_mla_k4_g128").create_engine_config()
    with pytest.raises(
        ValueError, match=r"is an MLA format but .*(is not an MLA model|uses dense attention)"
    ):
        _args(qwen3_dir, kv_cache_dtype="kvarn_mla_k5_g64").create_engine_config()


def test_unsupported_head_size_fails_closed(kvarn: None, tmp_path: Path) -> None:
    from kvarn_vllm.testing import TINY_QWEN3, write_model_dir

    model = write_model_dir(tmp_path / "m", {**TINY_QWEN3, "head_dim": 96})
    with pytest.raises(ValueError, match="head_dim=96"):
        _args(model, kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()


def test_wrong_vllm_version_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.24.1")
    with pytest.raises(RuntimeError, match=r"requires vllm 0\.23\.x, found vllm 0\.24\.1"):
        register()
    assert not _patches.is_applied()


def test_unexpected_symbol_fails_closed_before_patching(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    def execute_model(self: object, scheduler_output: object, extra: int) -> None: ...

    monkeypatch.setattr(Worker, "execute_model", execute_model)
    with pytest.raises(_patches.PatchError, match=r"Worker.execute_model takes"):
        register()
    assert not _patches.is_applied()
    assert not any(d.startswith("kvarn") for d in _cache_dtypes()), "P1 ran before P6's check"


def test_every_patch_is_documented() -> None:
    ids = [p.id for p in _patches.PATCHES]
    assert ids == ["P1", "P2", "P3", "P4", "P5", "P6"]
    for patch in _patches.PATCHES:
        assert patch.target and len(patch.why) > 40 and patch.undo
        assert patch.vllm_version == "0.23"


def _declaring_dir(tmp_path: Path, dtype: str, block_size: int) -> Path:
    """A model folder whose config.json declares its KV format (kvarn-ckpt's schema)."""
    pytest.importorskip("kvarn_ckpt", reason="the checkpoint hook needs kvarn-ckpt installed")
    from kvarn_vllm.testing import TINY_QWEN3, write_model_dir

    config = dict(TINY_QWEN3)
    config["kv_cache_quant"] = {
        "format_version": 1,
        "method": "kvarn",
        "dtype": dtype,
        "block_size": block_size,
    }
    return write_model_dir(tmp_path / "declared", config)


def test_checkpoint_declared_format_is_used_when_user_gives_none(
    kvarn: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _declaring_dir(tmp_path, "kvarn_k4v4_g64", 64)
    with caplog.at_level("INFO", logger="vllm.kvarn"):
        config = _args(model).create_engine_config()
    assert config.cache_config.cache_dtype == "kvarn_k4v4_g64"
    assert config.cache_config.block_size == 64
    assert "declared by checkpoint" in caplog.text


def test_user_choice_beats_checkpoint_declaration(kvarn: None, tmp_path: Path) -> None:
    model = _declaring_dir(tmp_path, "kvarn_k4v4_g64", 64)
    config = _args(model, kv_cache_dtype="kvarn_k4v2_g128").create_engine_config()
    assert config.cache_config.cache_dtype == "kvarn_k4v2_g128"
    assert config.cache_config.block_size == 128


def test_checkpoint_declaring_a_format_the_model_cannot_take_fails_closed(
    kvarn: None, tmp_path: Path
) -> None:
    model = _declaring_dir(tmp_path, "kvarn_mla_k4_g64", 64)
    with pytest.raises(ValueError, match="kvarn_mla_k4_g64"):
        _args(model).create_engine_config()
