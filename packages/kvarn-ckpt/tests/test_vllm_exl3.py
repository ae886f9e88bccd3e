"""The out-of-tree vLLM ``exl3`` quantization method on CPU: registration, detection,
per-shard weight loading into real vLLM linear layers, and forward against the decoder."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def _exl3_tensors(
    rng: np.random.Generator, n_in: int, n_out: int, bits: int, codebook: str
) -> dict[str, Any]:
    words = rng.integers(-(2**15), 2**15, size=(n_in // 16, n_out // 16, 16 * bits))
    t: dict[str, Any] = {
        "trellis": torch.from_numpy(words.astype(np.int16)),
        "suh": torch.from_numpy((rng.standard_normal(n_in) * 0.02).astype(np.float16)),
        "svh": torch.from_numpy(rng.standard_normal(n_out).astype(np.float16)),
    }
    if codebook != "3inst":
        t[codebook] = torch.tensor(0, dtype=torch.int32)
    return t


def _reference(t: dict[str, Any]) -> Any:
    from kvarn_ckpt.exl3_torch import codebook_from_markers, dequantize

    return dequantize(
        t["trellis"], t["suh"], t["svh"], codebook_from_markers(t.get("mcg"), t.get("mul1"))
    )


def _load(layer: Any, tensors: dict[str, Any], shard_id: object = None) -> None:
    params = dict(layer.named_parameters())
    for suffix, value in tensors.items():
        p = params[suffix]
        if shard_id is None:
            p.weight_loader(p, value)
        else:
            p.weight_loader(p, value, shard_id)


def _config(vq: Any, prefixes: set[str]) -> Any:
    cfg = vq.Exl3Config({"quant_method": "exl3", "bits": 4.0, "codebook": "mcg"})
    cfg.exl3_prefixes = prefixes
    cfg.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    return cfg


def test_registration_and_detection(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    vq = vllm_env.vq
    vq.register()  # idempotent
    assert QUANTIZATION_METHODS.count("exl3") == 1
    assert get_quantization_config("exl3") is vq.Exl3Config
    ov = vq.Exl3Config.override_quantization_method
    assert ov({"quant_method": "exl3"}, None) == "exl3"
    shim = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    tail = SimpleNamespace(hybrid_tr3_tail={"format": "exl3-trellis"})
    assert ov(shim, None, hf_config=tail) == "exl3"
    assert ov(shim, None, hf_config=SimpleNamespace()) is None
    assert ov({"quant_method": "exl3"}, "fp8") is None


def test_qkv_layer_loads_three_exl3_linears(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    cfg = _config(vllm_env.vq, {"m.q_proj", "m.k_proj", "m.v_proj"})
    layer = QKVParallelLinear(
        256,
        128,
        2,
        1,
        bias=False,
        quant_config=cfg,
        prefix="m.qkv_proj",
        params_dtype=torch.float32,
    )
    assert isinstance(layer.quant_method, vllm_env.vq.Exl3LinearMethod)
    rng = np.random.default_rng(0)
    parts = {
        "q": _exl3_tensors(rng, 256, 256, 4, "mcg"),
        "k": _exl3_tensors(rng, 256, 128, 3, "mcg"),
        "v": _exl3_tensors(rng, 256, 128, 2, "mul1"),
    }
    for sid, t in parts.items():
        _load(layer, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert "trellis" not in dict(layer.named_parameters())
    w = torch.cat([_reference(parts[s]) for s in "qkv"], dim=1)
    x = torch.randn(5, 256)
    out, _ = layer(x)
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-4)


def test_merged_and_row_layers_with_bias(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    cfg = _config(vllm_env.vq, {"m.gate_proj", "m.up_proj", "m.down_proj"})
    rng = np.random.default_rng(1)
    gate_up = MergedColumnParallelLinear(
        256,
        [256, 384],
        bias=False,
        quant_config=cfg,
        prefix="m.gate_up_proj",
        params_dtype=torch.float32,
    )
    parts = [_exl3_tensors(rng, 256, 256, 4, "mcg"), _exl3_tensors(rng, 256, 384, 4, "3inst")]
    for i, t in enumerate(parts):
        _load(gate_up, t, i)
    gate_up.quant_method.process_weights_after_loading(gate_up)
    down = RowParallelLinear(
        640, 256, bias=True, quant_config=cfg, prefix="m.down_proj", params_dtype=torch.float32
    )
    dt = _exl3_tensors(rng, 640, 256, 4, "mcg")
    _load(down, dt)
    bias = torch.randn(256)
    down.bias.weight_loader(down.bias, bias)
    down.quant_method.process_weights_after_loading(down)
    x = torch.randn(3, 256)
    h, _ = gate_up(x)
    torch.testing.assert_close(
        h, x @ torch.cat([_reference(t) for t in parts], 1), rtol=1e-5, atol=1e-4
    )
    y, _ = down(h)
    torch.testing.assert_close(y, h @ _reference(dt) + bias, rtol=1e-5, atol=1e-3)


def test_replicated_layer_with_legacy_signs(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from kvarn_ckpt.exl3_torch import dequantize

    cfg = _config(vllm_env.vq, {"m.proj"})
    layer = ReplicatedLinear(
        128, 128, bias=False, quant_config=cfg, prefix="m.proj", params_dtype=torch.float32
    )
    rng = np.random.default_rng(2)
    t = _exl3_tensors(rng, 128, 128, 3, "3inst")
    su = torch.from_numpy(rng.integers(-(2**15), 2**15, 8).astype(np.int16))
    sv = torch.from_numpy(rng.integers(-(2**15), 2**15, 8).astype(np.int16))
    _load(layer, {"trellis": t["trellis"], "su": su, "sv": sv})
    layer.quant_method.process_weights_after_loading(layer)
    from kvarn_ckpt.exl3_torch import unpack_signs

    w = dequantize(t["trellis"], unpack_signs(su), unpack_signs(sv), "3inst")
    x = torch.randn(2, 128)
    torch.testing.assert_close(layer(x)[0], x @ w, rtol=1e-5, atol=1e-4)


def test_missing_part_fails_after_loading(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    cfg = _config(vllm_env.vq, {"m.gate_proj", "m.up_proj"})
    layer = MergedColumnParallelLinear(
        256,
        [256, 256],
        bias=False,
        quant_config=cfg,
        prefix="m.gate_up_proj",
        params_dtype=torch.float32,
    )
    _load(layer, _exl3_tensors(np.random.default_rng(3), 256, 256, 4, "mcg"), 0)
    with pytest.raises(ValueError, match=r"loaded for parts \[0\] but the layer has 2"):
        layer.quant_method.process_weights_after_loading(layer)


def test_wrong_size_fails_after_loading(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    cfg = _config(vllm_env.vq, {"m.proj"})
    layer = ReplicatedLinear(
        256, 128, bias=False, quant_config=cfg, prefix="m.proj", params_dtype=torch.float32
    )
    _load(layer, _exl3_tensors(np.random.default_rng(4), 128, 128, 4, "mcg"))
    with pytest.raises(ValueError, match=r"decode to \[128, 128\].*expects \[256, 128\]"):
        layer.quant_method.process_weights_after_loading(layer)


def test_quant_method_selection(vllm_env: SimpleNamespace, kit: SimpleNamespace) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    vq = vllm_env.vq
    p = kit.exl3_dense().write()
    cfg = vq.Exl3Config.from_config({"quant_method": "exl3"})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    cfg.maybe_update_config(str(p))
    assert "model.layers.1.mlp.down_proj" in cfg.exl3_prefixes
    assert len(cfg.exl3_prefixes) == 14
    plain = ReplicatedLinear(128, 128, quant_config=cfg, prefix="model.norm_proj")
    assert isinstance(plain.quant_method, UnquantizedLinearMethod)
    assert isinstance(cfg._is_exl3("model.layers.0.self_attn.qkv_proj"), bool)
    assert cfg._is_exl3("model.layers.0.self_attn.qkv_proj")
    cfg.exl3_prefixes.discard("model.layers.0.self_attn.v_proj")
    with pytest.raises(ValueError, match="only some are EXL3"):
        cfg._is_exl3("model.layers.0.self_attn.qkv_proj")


def test_lm_head_at_tp1(vllm_env: SimpleNamespace) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = _config(vllm_env.vq, {"lm_head"})
    head = ParallelLMHead(384, 128, quant_config=cfg, prefix="lm_head", params_dtype=torch.float32)
    assert isinstance(head.quant_method, vllm_env.vq.Exl3LinearMethod)
    t = _exl3_tensors(np.random.default_rng(5), 128, 384, 6, "mcg")
    _load(head, t)
    head.quant_method.process_weights_after_loading(head)
    x = torch.randn(2, 128)
    logits = head.quant_method.apply(head, x)
    torch.testing.assert_close(logits, x @ _reference(t), rtol=1e-5, atol=1e-4)


def test_real_model_loader_maps_checkpoint_names(
    vllm_env: SimpleNamespace, kit: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own pipeline on a synthetic EXL3 Qwen3 checkpoint: quantization detected from
    config.json, EXL3 modules listed from the index, q/k/v and gate/up stacked into vLLM's
    fused layers by the model's load_weights, and every weight equal to the decoder's."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from kvarn_ckpt import open_checkpoint, validate_exl3
    from kvarn_ckpt.exl3_torch import dequantize_linear
    from kvarn_ckpt.problems import ProblemList

    monkeypatch.setenv("VLLM_PLUGINS", "")  # only this package's registration
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    c = kit.exl3_dense(bits=3, codebook="mcg", tie_word_embeddings=False)
    rng = np.random.default_rng(11)
    for tensors in c.shards.values():
        for name, (dt, shape, _) in list(tensors.items()):
            n = int(np.prod(shape)) if shape else 1
            if dt == "I16":
                data = rng.integers(-(2**15), 2**15, n).astype(np.int16).tobytes()
                tensors[name] = (dt, shape, data)
            elif dt == "F16":
                tensors[name] = (
                    dt,
                    shape,
                    (rng.standard_normal(n) * 0.05).astype(np.float16).tobytes(),
                )
    c.add("lm_head.weight", "BF16", [1024, 256])
    p = c.write()
    cfg = EngineArgs(
        model=str(p), skip_tokenizer_init=True, dtype="float32", max_model_len=512
    ).create_engine_config()
    assert cfg.model_config.quantization == "exl3"
    assert len(cfg.quant_config.exl3_prefixes) == 14
    with set_current_vllm_config(cfg):
        model = get_model_loader(cfg.load_config).load_model(
            vllm_config=cfg, model_config=cfg.model_config
        )
    ckpt = open_checkpoint(p)
    lin = validate_exl3(ckpt, ProblemList()).linears

    def ref(*names: str) -> Any:
        return torch.cat([dequantize_linear(ckpt, lin[n]) for n in names], 1).t()

    for i, layer in enumerate(model.model.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert torch.equal(
            layer.self_attn.qkv_proj.weight, ref(f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj")
        )
        assert torch.equal(layer.self_attn.o_proj.weight, ref(f"{a}.o_proj"))
        assert torch.equal(layer.mlp.gate_up_proj.weight, ref(f"{m}.gate_proj", f"{m}.up_proj"))
        assert torch.equal(layer.mlp.down_proj.weight, ref(f"{m}.down_proj"))
    assert type(model.lm_head.quant_method).__name__ == "UnquantizedEmbeddingMethod"
