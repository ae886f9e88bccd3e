"""KV format resolution: precedence user > declared > heuristic > none, geometry, conflicts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvarn_ckpt import KVFormatError, resolve_for_vllm, resolve_kv_format


def _declare(path: Path, dtype: str, block: int, where: str = "top", **extra: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    decl = {"format_version": 1, "method": "kvarn", "dtype": dtype, "block_size": block, **extra}
    if where == "top":
        cfg["kv_cache_quant"] = decl
    else:
        cfg.setdefault("text_config", {})["kv_cache_quant"] = decl
    (path / "config.json").write_text(json.dumps(cfg))


def _codes(res: Any, severity: str | None = None) -> list[str]:
    return [p.code for p in res.problems if severity is None or p.severity == severity]


def test_nothing_declared_resolves_to_none(kit: SimpleNamespace) -> None:
    res = resolve_kv_format(kit.bf16_dense().write())
    assert (res.dtype, res.source, res.declared, res.hint) == (None, "none", None, None)
    assert res.problems == () and res.ok


def test_declared_format_is_used(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128)
    res = resolve_kv_format(p)
    assert (res.dtype, res.source) == ("kvarn_k4v2_g128", "declared")
    assert res.declared is not None and res.declared.where == "config.json"
    assert _codes(res) == ["resolve.declared"] and res.ok


def test_user_auto_means_not_given(kit: SimpleNamespace) -> None:
    p = kit.bf16_mla().write()
    _declare(p, "kvarn_mla_k4_g64", 64)
    assert resolve_kv_format(p, "auto").dtype == "kvarn_mla_k4_g64"


def test_valid_user_choice_wins_and_logs_the_conflict(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128)
    res = resolve_kv_format(p, "kvarn_k4v4_g64")
    assert (res.dtype, res.source, res.ok) == ("kvarn_k4v4_g64", "user", True)
    (conflict,) = [p for p in res.problems if p.code == "resolve.conflict"]
    assert conflict.severity == "warning"
    assert "kvarn_k4v4_g64" in conflict.message and "kvarn_k4v2_g128" in conflict.message


def test_invalid_user_choice_fails_closed_naming_both(kit: SimpleNamespace) -> None:
    """The issue's example: dense kvarn_k4v2_g128 asked on an MLA checkpoint declaring
    kvarn_mla_k4_g64."""
    p = kit.bf16_mla().write()
    _declare(p, "kvarn_mla_k4_g64", 64)
    res = resolve_kv_format(p, "kvarn_k4v2_g128")
    assert (res.dtype, res.ok) == (None, False)
    (err,) = [p for p in res.problems if p.severity == "error"]
    assert err.code == "resolve.user_invalid"
    assert "kvarn_k4v2_g128" in err.message and "kvarn_mla_k4_g64" in err.message
    assert "uses MLA" in err.message and "which fits this model" in err.message
    with pytest.raises(KVFormatError, match="kvarn_k4v2_g128"):
        res.raise_for_errors()


def test_unknown_user_dtype_lists_valid_strings(kit: SimpleNamespace) -> None:
    res = resolve_kv_format(kit.bf16_dense().write(), "kvarn_k3v3_g128")
    assert res.dtype is None and _codes(res, "error") == ["resolve.user_invalid"]
    assert "kvarn_k4v2_g128" in res.problems[0].message  # the list of valid strings


def test_non_kvarn_user_dtype_passes_through(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128)
    res = resolve_kv_format(p, "fp8")
    assert (res.dtype, res.source, res.ok) == ("fp8", "user", True)
    assert _codes(res) == ["resolve.user_overrides"]


@pytest.mark.parametrize(
    ("builder", "dtype", "block", "over", "needle"),
    [
        ("bf16_dense", "kvarn_mla_k4_g64", 64, {}, "is an MLA format"),
        ("bf16_mla", "kvarn_k4v2_g128", 128, {}, "is a dense format"),
        ("bf16_dense", "kvarn_k4v2_g128", 128, {"head_dim": 96}, "head_dim=96"),
        ("bf16_mla", "kvarn_mla_k4_g64", 64, {"kv_lora_rank": 256}, "kv_lora_rank=256"),
    ],
    ids=["mla-dtype-dense-model", "dense-dtype-mla-model", "head-dim-96", "latent-256"],
)
def test_declared_format_the_geometry_cannot_take(
    kit: SimpleNamespace, builder: str, dtype: str, block: int, over: dict[str, Any], needle: str
) -> None:
    p = getattr(kit, builder)(**over).write()
    _declare(p, dtype, block)
    res = resolve_kv_format(p)
    assert (res.dtype, res.source, res.ok) == (None, "declared", False)
    assert _codes(res, "error") == ["resolve.declared_invalid"]
    assert needle in res.problems[0].message and dtype in res.problems[0].message


def test_tensor_parallel_geometry(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()  # 2 KV heads
    assert resolve_kv_format(p, "kvarn_k4v2_g128", tensor_parallel_size=4).ok  # replicated
    res = resolve_kv_format(p, "kvarn_k4v2_g128", tensor_parallel_size=3)
    assert not res.ok and "tensor_parallel_size=3" in res.problems[0].message


def test_conflicting_declarations(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128)
    _declare(p, "kvarn_k4v4_g128", 128, where="text")
    res = resolve_kv_format(p)
    assert (res.dtype, res.ok) == (None, False)
    assert _codes(res, "error") == ["declaration.conflict"]
    msg = res.problems[0].message
    assert "kvarn_k4v2_g128" in msg and "kvarn_k4v4_g128" in msg
    # A valid explicit choice still works; the checkpoint's conflict is kept as a warning.
    res = resolve_kv_format(p, "kvarn_k4v2_g64")
    assert (res.dtype, res.ok) == ("kvarn_k4v2_g64", True)
    assert "declaration.conflict" in _codes(res, "warning")


def test_foreign_kv_declaration_is_a_warning(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    c.config["quantization_config"]["kv_cache_quant_algo"] = "FP8"
    p = c.write()
    _declare(p, "kvarn_mla_k4_g64", 64)
    res = resolve_kv_format(p)
    assert (res.dtype, res.ok) == ("kvarn_mla_k4_g64", True)
    assert "declaration.foreign_kv" in _codes(res, "warning")


@pytest.mark.parametrize(
    ("decl", "code"),
    [
        (
            {"format_version": 2, "method": "kvarn", "dtype": "kvarn_k4v2_g128", "block_size": 128},
            "declaration.version",
        ),
        (
            {"format_version": 1, "method": "kvarn", "dtype": "kvarn_k4v2_g128", "block_size": 64},
            "declaration.block_size",
        ),
        (
            {"format_version": 1, "method": "kvarn", "dtype": "kvarn_k9v9_g128", "block_size": 128},
            "declaration.dtype",
        ),
        (
            {"format_version": 1, "method": "turbo", "dtype": "kvarn_k4v2_g128", "block_size": 128},
            "declaration.invalid",
        ),
        ("kvarn_k4v2_g128", "declaration.invalid"),
    ],
    ids=["version-2", "block-mismatch", "unknown-dtype", "other-method", "not-an-object"],
)
def test_bad_declarations_fail_closed(kit: SimpleNamespace, decl: Any, code: str) -> None:
    c = kit.bf16_dense()
    c.config["kv_cache_quant"] = decl
    res = resolve_kv_format(c.write())
    assert (res.dtype, res.ok) == (None, False)
    assert _codes(res, "error") == [code]


def test_unknown_declaration_keys_warn(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128, sink_tokens=128)
    res = resolve_kv_format(p)
    assert res.dtype == "kvarn_k4v2_g128"
    assert "declaration.unknown_keys" in _codes(res, "warning")


def test_name_heuristic_is_reported_not_trusted(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense(name="Qwen3-tiny-KVarN-K4V2").write()
    res = resolve_kv_format(p)
    assert (res.dtype, res.source) == (None, "none")
    assert res.hint is not None and res.hint.candidates[0] == "kvarn_k4v2_g128"
    assert _codes(res) == ["resolve.heuristic_candidate"]
    res = resolve_kv_format(p, accept_heuristic=True)
    assert (res.dtype, res.source) == ("kvarn_k4v2_g128", "heuristic")
    assert _codes(res, "warning") == ["resolve.heuristic_used"]


def test_name_heuristic_is_ambiguous_for_mla(kit: SimpleNamespace) -> None:
    p = kit.tr3_mla(name="GLM-5.2-EXL3-TR3-3.40bpw-KVarN-K4V2").write()
    res = resolve_kv_format(p, accept_heuristic=True)
    assert (res.dtype, res.source) == (None, "none")
    assert res.hint is not None and res.hint.ambiguous
    assert set(res.hint.candidates) >= {"kvarn_mla_k4_g64", "kvarn_mla_k2_g64"}
    assert _codes(res) == ["resolve.heuristic_ambiguous"]


def test_name_heuristic_full_string_and_hub_cache_path(kit: SimpleNamespace) -> None:
    root = kit.tmp / "models--org--Tiny-kvarn_mla_k5_g64" / "snapshots" / ("a" * 40)
    p = kit.Ckpt(root, kit.mla_config()).write()
    res = resolve_kv_format(p, accept_heuristic=True)
    assert res.hint is not None and res.hint.name == "org/Tiny-kvarn_mla_k5_g64"
    assert (res.dtype, res.source) == ("kvarn_mla_k5_g64", "heuristic")


def test_declaration_beats_the_name(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense(name="x-KVarN-K4V4").write()
    _declare(p, "kvarn_k4v2_g64", 64)
    res = resolve_kv_format(p, accept_heuristic=True)
    assert (res.dtype, res.source, res.hint) == ("kvarn_k4v2_g64", "declared", None)


# ------------------------------------------------------------------- the vLLM hook


def test_resolve_for_vllm(kit: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    p = kit.bf16_mla().write()
    assert resolve_for_vllm(p, None) is None
    assert resolve_for_vllm(p, "auto") is None
    _declare(p, "kvarn_mla_k4_g64", 64)
    with caplog.at_level(logging.INFO, logger="kvarn_ckpt"):
        assert resolve_for_vllm(str(p), "auto") == "kvarn_mla_k4_g64"
    assert "declared KV cache format kvarn_mla_k4_g64" in caplog.text
    assert resolve_for_vllm(p, "kvarn_mla_k2_g64") == "kvarn_mla_k2_g64"
    assert resolve_for_vllm(p, "bfloat16") == "bfloat16"
    with pytest.raises(KVFormatError, match="kvarn_k4v2_g128"):
        resolve_for_vllm(p, "kvarn_k4v2_g128")


def test_resolve_for_vllm_never_applies_the_heuristic(
    kit: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    p = kit.bf16_dense(name="m-KVarN-K4V2").write()
    with caplog.at_level(logging.WARNING, logger="kvarn_ckpt"):
        assert resolve_for_vllm(p, None) is None
    assert "suggests kvarn_k4v2_g128" in caplog.text


def test_resolve_for_vllm_unknown_model_keeps_the_users_value(kit: SimpleNamespace) -> None:
    assert resolve_for_vllm(kit.tmp / "does-not-exist", None) is None
    assert resolve_for_vllm("no-such-org/no-such-model-xyz", "fp8") == "fp8"


def test_resolution_reads_no_shard(kit: SimpleNamespace) -> None:
    """Resolving the KV format (the serving start-up path) never opens a shard."""
    p = kit.exl3_dense().write()
    _declare(p, "kvarn_k4v2_g128", 128)
    for shard in p.glob("*.safetensors"):
        shard.write_bytes(b"garbage")  # would fail any header read
    assert resolve_kv_format(p).dtype == "kvarn_k4v2_g128"
    assert resolve_for_vllm(p, None) == "kvarn_k4v2_g128"
