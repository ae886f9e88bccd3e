"""Reading checkpoint directories: index, shards, configs and weight-format detection."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvarn_ckpt import CheckpointError, inspect_checkpoint, open_checkpoint


def _codes(ckpt: object) -> list[tuple[str, str]]:
    return [(p.severity, p.code) for p in ckpt.problems]  # type: ignore[attr-defined]


def test_single_file_checkpoint(kit: SimpleNamespace) -> None:
    c = kit.bf16_dense()
    c.shards = {"model.safetensors": {k: v for s in c.shards.values() for k, v in s.items()}}
    ckpt = open_checkpoint(c.write(index=False))
    assert _codes(ckpt) == [] and len(ckpt.tensors) == 18
    assert ckpt.weight_format.kind == "bf16"


def test_shards_without_index_warn(kit: SimpleNamespace) -> None:
    ckpt = open_checkpoint(kit.exl3_dense().write(index=False))
    assert _codes(ckpt) == [("warning", "index.missing")]
    assert len(ckpt.headers) == 2


def test_index_pointing_at_a_missing_shard(kit: SimpleNamespace) -> None:
    p = kit.exl3_dense().write()
    (p / "model-00002-of-00002.safetensors").unlink()
    ckpt = open_checkpoint(p)
    assert ("error", "shard.missing") in _codes(ckpt)
    report = inspect_checkpoint(p)
    assert report.exit_code == 1


def test_index_naming_a_tensor_the_shard_lacks(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    index = json.loads((p / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.norm.weight"] = "model-00009.safetensors"
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    codes = _codes(open_checkpoint(p))
    assert ("error", "index.dangling") in codes
    assert ("warning", "index.unlisted") in codes  # model.norm.weight sits in another shard
    assert ("error", "shard.missing") in codes


def test_text_config_nesting(kit: SimpleNamespace) -> None:
    inner = kit.mla_config()
    c = kit.Ckpt(
        kit.tmp / "vl",
        {
            "architectures": ["SomeVLForConditionalGeneration"],
            "model_type": "some_vl",
            "text_config": inner,
        },
    )
    c.add("x", "BF16", [2])
    ckpt = open_checkpoint(c.write())
    assert ckpt.language_config_where == "config.json:text_config"
    assert ckpt.geometry is not None and ckpt.geometry.kind == "mla"
    assert ckpt.geometry.architectures == ("SomeVLForConditionalGeneration",)


def test_weight_formats(kit: SimpleNamespace) -> None:
    assert (
        open_checkpoint(kit.bf16_dense(torch_dtype="float16").write()).weight_format.kind == "fp16"
    )
    wf = open_checkpoint(kit.exl3_dense(bits=3).write()).weight_format
    assert (wf.kind, wf.declared_bits, wf.codebook) == ("exl3", 3.0, "mcg")
    wf = open_checkpoint(kit.tr3_mla().write()).weight_format
    assert (wf.kind, wf.declared_bits, wf.quant_method) == ("exl3-tr3", "mixed", "modelopt")
    c = kit.bf16_dense()
    c.config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    ckpt = open_checkpoint(c.write())
    assert ckpt.weight_format.kind == "other:awq"
    assert _codes(ckpt) == [("info", "config.quantization")]


def test_incomplete_geometry(kit: SimpleNamespace) -> None:
    c = kit.bf16_dense()
    del c.config["num_attention_heads"]
    ckpt = open_checkpoint(c.write())
    assert ckpt.geometry is None and ("error", "config.geometry") in _codes(ckpt)


def test_sliding_and_linear_layers(kit: SimpleNamespace) -> None:
    c = kit.bf16_dense(layer_types=["full_attention", "sliding_attention"])
    ckpt = open_checkpoint(c.write())
    assert ckpt.geometry is not None and ckpt.geometry.kv_layers == 1
    assert _codes(ckpt) == [("info", "config.layer_types")]


def test_not_a_checkpoint(kit: SimpleNamespace) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(kit.tmp / "nope")
    (kit.tmp / "broken").mkdir()
    (kit.tmp / "broken" / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(kit.tmp / "broken")
