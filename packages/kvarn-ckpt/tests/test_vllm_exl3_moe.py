"""EXL3 routed MoE experts and a tensor-parallel EXL3 lm_head in vLLM, on CPU.

Layer tests build real ``FusedMoE`` / ``ParallelLMHead`` layers, feed them checkpoint-named
tensors the way the models' ``load_weights`` do (through vLLM's own expert mapping), and
compare against the reference decoder and against vLLM's unquantized layer loaded with the
decoded weights. Tensor parallelism is simulated in one process by building the layer for
each rank (vLLM reads the rank at construction; the 1-process all-reduce is the identity).
Model tests load synthetic Qwen3-MoE (stock EXL3 experts) and DeepSeek-V2 (GLM TR3
rank-sliced experts with shared-H vectors) checkpoints through vLLM's model loader next to
dense twins holding the decoded weights, and compare every parameter and the MoE forward.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

H, E, TOPK = 256, 4, 2
_ids = itertools.count(100)


def _prefix() -> str:
    """A fresh layer prefix: vLLM registers every FusedMoE by name in the current config."""
    return f"model.layers.{next(_ids)}.mlp.experts"


def _linear(
    rng: np.random.Generator,
    n_in: int,
    n_out: int,
    bits: int = 4,
    codebook: str = "mcg",
    vectors: tuple[str, ...] = ("suh", "svh"),
) -> dict[str, Any]:
    words = rng.integers(-(2**15), 2**15, size=(n_in // 16, n_out // 16, 16 * bits))
    t: dict[str, Any] = {"trellis": torch.from_numpy(words.astype(np.int16))}
    if "suh" in vectors:
        t["suh"] = torch.from_numpy((rng.standard_normal(n_in) * 0.03).astype(np.float16))
    if "svh" in vectors:
        t["svh"] = torch.from_numpy((rng.standard_normal(n_out) * 0.5).astype(np.float16))
    if codebook == "mcg":
        t["mcg"] = torch.tensor(-873653267, dtype=torch.int32)  # 0xCBAC1FED as int32
    elif codebook == "mul1":
        t["mul1"] = torch.tensor(-2082680531, dtype=torch.int32)  # 0x83DCD12D
    return t


def _decode(t: dict[str, Any], suh: Any = None, svh: Any = None) -> Any:
    from kvarn_ckpt.exl3_torch import codebook_from_markers, dequantize

    return dequantize(
        t["trellis"],
        t["suh"] if suh is None else suh,
        t["svh"] if svh is None else svh,
        codebook_from_markers(t.get("mcg"), t.get("mul1")),
    )


def _stock_experts(
    rng: np.random.Generator, inter: int
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Checkpoint tensors ``experts.{e}.{proj}.<suffix>`` and per expert the dense [in, out]."""
    names: dict[str, Any] = {}
    dense: dict[int, dict[str, Any]] = {}
    codebooks = ["mcg", "3inst", "mul1", "mcg"]
    for e in range(E):
        dense[e] = {}
        for proj, (n_in, n_out) in {
            "gate_proj": (H, inter),
            "up_proj": (H, inter),
            "down_proj": (inter, H),
        }.items():
            t = _linear(rng, n_in, n_out, bits=3 + e % 2, codebook=codebooks[e])
            names.update({f"experts.{e}.{proj}.{k}": v for k, v in t.items()})
            dense[e][proj] = _decode(t)
    return names, dense


def _tr3_experts(
    rng: np.random.Generator, inter: int, slices: int, shared: bool
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """TR3-named rank slices (``experts.{e}.{proj}.rank{r}``), optionally with shared-H
    vectors, and per expert the dense [in, out] weight the slices make together."""
    from kvarn_ckpt.exl3_torch import concat_rank_slices

    per = inter // slices
    names: dict[str, Any] = {}
    hidden_side = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}
    shared_vec: dict[tuple[str, int], Any] = {}
    if shared:
        for proj, leaf in hidden_side.items():
            for r in range(slices):
                v = torch.from_numpy((rng.standard_normal(H) * 0.05).astype(np.float16))
                shared_vec[(proj, r)] = v
                names[f"experts.shared_h.{proj}.rank{r}.{leaf}"] = v
    dense: dict[int, dict[str, Any]] = {}
    for e in range(E):
        dense[e] = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            n_in, n_out = (per, H) if proj == "down_proj" else (H, per)
            parts = []
            for r in range(slices):
                local = ("suh",) if proj == "down_proj" else ("svh",)
                vecs = local if shared else ("suh", "svh")
                t = _linear(rng, n_in, n_out, 3 + e % 2, vectors=vecs)
                names.update({f"experts.{e}.{proj}.rank{r}.{k}": v for k, v in t.items()})
                hv = shared_vec.get((proj, r))
                kw = {hidden_side[proj]: hv} if hv is not None else {}
                parts.append(_decode(t, **kw))
            dense[e][proj] = concat_rank_slices(parts, proj)  # type: ignore[arg-type]
    return names, dense


def _config(vq: Any, layer_prefixes: list[str], tail: dict[str, Any] | None = None) -> Any:
    cfg = vq.Exl3Config({"quant_method": "exl3"}, tail)
    cfg.exl3_prefixes = {
        f"{p}.{e}.{proj}" for p in layer_prefixes for e in range(E) for proj in ("gate_proj",)
    }
    return cfg


def _tail(slices: int, layout: str, layer: int) -> dict[str, Any]:
    return {
        "format": "exl3-trellis",
        "bits": 4,
        "codebook": "mcg",
        "moe_layers": [layer, layer],
        "experts_per_layer": E,
        "nvfp4_keep_per_layer": 0,
        "tp": slices,
        "rotation_layout": layout,
        "shared_h_tensor_schema": "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}",
        "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}",
    }


def _moe(cfg: Any, prefix: str, inter: int, tp: int | None = None) -> Any:
    from vllm.model_executor.layers.fused_moe import FusedMoE

    return FusedMoE(
        num_experts=E,
        top_k=TOPK,
        hidden_size=H,
        intermediate_size=inter,
        params_dtype=torch.float32,
        renormalize=True,
        quant_config=cfg,
        tp_size=tp,
        prefix=prefix,
    )


def _load_like_a_model(layer: Any, names: dict[str, Any]) -> None:
    """What Qwen3-MoE's / DeepSeek-V2's ``load_weights`` do with expert tensors: rewrite the
    name through vLLM's expert mapping and call the parameter's loader with the ids."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    params = dict(layer.named_parameters())
    mapping = FusedMoE.make_expert_params_mapping(layer, "gate_proj", "down_proj", "up_proj", E)
    for name, tensor in names.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                key = name.replace(weight_name, param_name).removeprefix("experts.")
                p = params[key]
                ok = p.weight_loader(
                    p, tensor, key, shard_id=shard_id, expert_id=expert_id, return_success=True
                )
                assert ok
                break
        else:  # not an expert tensor (shared_h): a plain loader call, as Qwen3-MoE makes
            p = params[name.removeprefix("experts.")]
            p.weight_loader(p, tensor)


def _dense_twin(
    prefix: str, inter: int, dense: dict[int, dict[str, Any]], tp: int | None = None
) -> Any:
    """vLLM's unquantized FusedMoE with the decoded weights, through its own loader."""
    layer = _moe(None, prefix, inter, tp)
    for e, w in dense.items():
        for shard, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(
                param, w[proj].t().contiguous(), f"experts.{shard}_weight", shard, e
            )
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _forward(layer: Any, x: Any, logits: Any) -> Any:
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, get_current_vllm_config()):
        return layer(x, logits)


def _unregister(prefix: str) -> None:
    from vllm.config import get_current_vllm_config

    cc = get_current_vllm_config().compilation_config
    cc.static_forward_context.pop(prefix)
    cc.static_all_moe_layers.remove(prefix)


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make the next layers believe they are tensor-parallel rank ``r``."""
    import vllm.model_executor.layers.fused_moe.config as moe_config
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    def set_rank(r: int, world: int = 2) -> None:
        monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda: r)
        for mod in (vpe, linear):
            monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: r)
            monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: world)

    return set_rank


def test_stock_experts_load_and_match_the_unquantized_layer(vllm_env: SimpleNamespace) -> None:
    vq = vllm_env.vq
    from kvarn_ckpt.vllm_moe import Exl3MoEMethod

    inter = 384
    names, dense = _stock_experts(np.random.default_rng(0), inter)
    prefix = _prefix()
    layer = _moe(_config(vq, [prefix]), prefix, inter)
    assert isinstance(layer.quant_method, Exl3MoEMethod)
    _load_like_a_model(layer, names)
    layer.quant_method.process_weights_after_loading(layer)
    assert {n for n, _ in layer.named_parameters()} == {"w13_weight", "w2_weight"}
    for e in range(E):
        torch.testing.assert_close(layer.w13_weight[e, :inter], dense[e]["gate_proj"].t())
        torch.testing.assert_close(layer.w13_weight[e, inter:], dense[e]["up_proj"].t())
        torch.testing.assert_close(layer.w2_weight[e], dense[e]["down_proj"].t())
    ref = _dense_twin(_prefix(), inter, dense)
    x = torch.randn(7, H) * 0.5
    logits = torch.randn(7, E)
    torch.testing.assert_close(_forward(layer, x, logits), _forward(ref, x, logits))


@pytest.mark.parametrize(
    ("inter", "slices", "shared"),
    [(384, 1, False), (512, 2, True), (512, 4, False)],
    ids=["stock-unaligned-192-per-rank", "tr3-tp2-shared-h", "tr3-tp4-per-expert"],
)
def test_two_ranks_sum_to_the_full_layer(
    vllm_env: SimpleNamespace,
    as_rank: Callable[..., None],
    inter: int,
    slices: int,
    shared: bool,
) -> None:
    """Serving TP2: each rank decodes only its share (a window of one stored tensor, whole
    TR3 slices, or several), and the ranks' partial outputs add up to the full layer."""
    rng = np.random.default_rng(slices)
    n = next(_ids)
    if slices == 1:
        names, dense = _stock_experts(rng, inter)
        tail = None
    else:
        names, dense = _tr3_experts(rng, inter, slices, shared)
        tail = _tail(slices, "shared_h_v1" if shared else "per_expert_v1", n)
    prefix = f"model.layers.{n}.mlp.experts"
    x = torch.randn(5, H) * 0.5
    logits = torch.randn(5, E)
    ip = inter // 2
    total = torch.zeros(5, H)
    for r in range(2):
        as_rank(r)
        cfg = _config(vllm_env.vq, [prefix], tail)
        if tail is not None:
            cfg.exl3_prefixes = {f"{prefix}.0.gate_proj.rank0"}
        layer = _moe(cfg, prefix, inter, tp=2)
        assert (layer.tp_rank, layer.tp_size) == (r, 2)
        _load_like_a_model(layer, names)
        layer.quant_method.process_weights_after_loading(layer)
        for e in range(E):
            cols = slice(r * ip, (r + 1) * ip)
            torch.testing.assert_close(
                layer.w13_weight[e, :ip], dense[e]["gate_proj"][:, cols].t(), rtol=1e-6, atol=1e-6
            )
            torch.testing.assert_close(
                layer.w13_weight[e, ip:], dense[e]["up_proj"][:, cols].t(), rtol=1e-6, atol=1e-6
            )
            torch.testing.assert_close(
                layer.w2_weight[e], dense[e]["down_proj"][cols].t(), rtol=1e-6, atol=1e-6
            )
        total += _forward(layer, x, logits)
        _unregister(prefix)  # the next rank's layer takes the same name
    as_rank(0, 1)
    ref = _dense_twin(_prefix(), inter, dense)
    torch.testing.assert_close(total, _forward(ref, x, logits), rtol=1e-5, atol=1e-5)


def test_missing_and_misplaced_expert_tensors_fail_closed(vllm_env: SimpleNamespace) -> None:
    vq = vllm_env.vq
    names, _ = _stock_experts(np.random.default_rng(3), 256)
    prefix = _prefix()
    layer = _moe(_config(vq, [prefix]), prefix, 256)
    _load_like_a_model(layer, {k: v for k, v in names.items() if k != "experts.2.up_proj.svh"})
    with pytest.raises(ValueError, match=r"expert 2 up_proj: no \.svh vector was loaded"):
        layer.quant_method.process_weights_after_loading(layer)

    prefix = _prefix()
    layer = _moe(_config(vq, [prefix]), prefix, 256)
    _load_like_a_model(layer, {k: v for k, v in names.items() if not k.startswith("experts.3.")})
    with pytest.raises(ValueError, match=r"expert 3 gate_proj: no \.trellis was loaded"):
        layer.quant_method.process_weights_after_loading(layer)

    with pytest.raises(ValueError, match=r"expected int16 \[16, 16, 16\*bits\]"):
        _load_like_a_model(
            layer, {"experts.0.gate_proj.trellis": names["experts.0.down_proj.trellis"][:, :8]}
        )
    with pytest.raises(ValueError, match="dense expert weight"):
        p = layer.w13_weight
        p.weight_loader(p, torch.zeros(256, H), "experts.w13_weight", shard_id="w1", expert_id=0)


def test_tr3_layouts_that_cannot_be_routed_fail_at_construction(
    vllm_env: SimpleNamespace,
) -> None:
    vq = vllm_env.vq
    n = next(_ids)
    prefix = f"model.layers.{n}.mlp.experts"
    bad = _tail(2, "per_expert_v1", n)
    bad["tensor_schema"] = "model.layers.{L}.moe.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
    with pytest.raises(NotImplementedError, match="does not name experts"):
        _moe(_config(vq, [prefix], bad), prefix, 512)
    _unregister(prefix)  # FusedMoE registers its name before asking for the method
    keep = _tail(2, "per_expert_v1", n)
    keep["nvfp4_keep_per_layer"] = 8
    with pytest.raises(NotImplementedError, match="NVFP4"):
        _moe(_config(vq, [prefix], keep), prefix, 512)
    _unregister(prefix)
    count = _tail(2, "per_expert_v1", n)
    count["experts_per_layer"] = 8
    with pytest.raises(ValueError, match="experts_per_layer is 8 but the model's layer has 4"):
        _moe(_config(vq, [prefix], count), prefix, 512)
    _unregister(prefix)
    sliced = _config(vq, [])
    sliced.exl3_prefixes = {f"{prefix}.0.gate_proj.rank0"}
    with pytest.raises(NotImplementedError, match="no hybrid_tr3_tail"):
        _moe(sliced, prefix, 512)
    _unregister(prefix)
    # outside moe_layers and no EXL3 tensors there: vLLM's own unquantized method
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    cfg = _config(vq, [], _tail(2, "per_expert_v1", n + 1000))
    assert type(_moe(cfg, prefix, 512).quant_method) is UnquantizedFusedMoEMethod


def test_shared_h_v1_rejects_a_per_expert_hidden_vector(vllm_env: SimpleNamespace) -> None:
    n = next(_ids)
    prefix = f"model.layers.{n}.mlp.experts"
    cfg = _config(vllm_env.vq, [prefix], _tail(2, "shared_h_v1", n))
    layer = _moe(cfg, prefix, 512)
    names, _ = _tr3_experts(np.random.default_rng(5), 512, 2, True)
    names["experts.1.gate_proj.rank0.suh"] = torch.zeros(H, dtype=torch.float16)
    with pytest.raises(ValueError, match="keeps the hidden-side vector only under shared_h"):
        _load_like_a_model(layer, names)


# ----------------------------------------------------------------------------- lm_head


def test_lm_head_split_over_two_ranks(
    vllm_env: SimpleNamespace, as_rank: Callable[..., None]
) -> None:
    """Vocab 880 (stored as 896 EXL3 columns) over TP2: vLLM pads each rank to 448 rows,
    so rank 1 owns tokens [448, 880), which start off a 128-wide Hadamard block."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    vocab = 880
    t = _linear(np.random.default_rng(6), H, 896, bits=5)
    full = _decode(t)[:, :vocab]  # [H, vocab]
    x = torch.randn(3, H)
    logits = []
    for r in range(2):
        as_rank(r, 2)
        cfg = vllm_env.vq.Exl3Config({"quant_method": "exl3"})
        cfg.exl3_prefixes = {"lm_head"}
        head = ParallelLMHead(
            vocab, H, quant_config=cfg, prefix="lm_head", params_dtype=torch.float32
        )
        idx = head.shard_indices
        rows = slice(idx.org_vocab_start_index, idx.org_vocab_end_index)
        assert (rows.start, rows.stop) == ((0, 448), (448, 880))[r]
        n = rows.stop - rows.start
        params = dict(head.named_parameters())
        for k, v in t.items():
            params[k].weight_loader(params[k], v)
        head.quant_method.process_weights_after_loading(head)
        assert head.weight.shape == (head.num_embeddings_per_partition, H)
        torch.testing.assert_close(head.weight[:n], full[:, rows].t(), rtol=1e-6, atol=1e-6)
        assert head.weight[n:].shape[0] == 448 - n and not head.weight[n:].any()  # padding
        logits.append(head.quant_method.apply(head, x)[:, :n])
    torch.testing.assert_close(torch.cat(logits, 1), x @ full, rtol=1e-5, atol=1e-4)


def test_linear_layers_split_off_block_boundaries(
    vllm_env: SimpleNamespace, as_rank: Callable[..., None]
) -> None:
    """Dense EXL3 linears at TP2 where each rank owns 192 of 384 columns / rows: each rank
    decodes the enclosing 128-aligned window and keeps its share."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    rng = np.random.default_rng(9)
    gate, up = _linear(rng, H, 384), _linear(rng, H, 384, codebook="3inst")
    down = _linear(rng, 384, H, bits=3)
    cfg = _config(vllm_env.vq, [])
    cfg.exl3_prefixes = {"m.gate_proj", "m.up_proj", "m.down_proj"}
    cfg.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    x = torch.randn(4, H)
    g_full, u_full = x @ _decode(gate), x @ _decode(up)
    y = torch.zeros(4, H)
    for r in range(2):
        as_rank(r, 2)
        gu = MergedColumnParallelLinear(
            H,
            [384, 384],
            bias=False,
            quant_config=cfg,
            prefix="m.gate_up_proj",
            params_dtype=torch.float32,
        )
        dn = RowParallelLinear(
            384, H, bias=False, quant_config=cfg, prefix="m.down_proj", params_dtype=torch.float32
        )
        assert (gu.tp_rank, gu.tp_size, dn.input_size_per_partition) == (r, 2, 192)
        for layer, parts in ((gu, [gate, up]), (dn, [down])):
            params = dict(layer.named_parameters())
            for i, t in enumerate(parts):
                for k, v in t.items():
                    if layer is gu:
                        params[k].weight_loader(params[k], v, i)
                    else:
                        params[k].weight_loader(params[k], v)
            layer.quant_method.process_weights_after_loading(layer)
        cols = slice(192 * r, 192 * (r + 1))
        h, _ = gu(x)
        torch.testing.assert_close(h, torch.cat([g_full[:, cols], u_full[:, cols]], 1))
        part, _ = dn(g_full[:, cols])
        y += part
    torch.testing.assert_close(y, g_full @ _decode(down), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- whole models


def _write(root: Path, config: dict[str, Any], tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    return root


def _load_model(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    monkeypatch.setenv("VLLM_PLUGINS", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = EngineArgs(
        model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256
    ).create_engine_config()
    with set_current_vllm_config(cfg):
        model = get_model_loader(cfg.load_config).load_model(
            vllm_config=cfg, model_config=cfg.model_config
        )
    return model, cfg


def _compare_models(a: Any, b: Any) -> None:
    """Every parameter equal: the EXL3 model decoded on the device, the twin on the CPU."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        torch.testing.assert_close(value, pb[name], rtol=1e-5, atol=1e-6, msg=name)


def _moe_block_forward(model: Any, cfg: Any, layer: int, x: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    device = next(model.parameters()).device
    if device.type == "cuda":
        from vllm.v1.worker import workspace

        # The CUDA modular fused-MoE kernel takes its scratch from the workspace manager,
        # which vLLM's GPU model runner sets up; this test has no runner.
        if not workspace.is_workspace_manager_initialized():
            workspace.init_workspace_manager(device)
    x = x.to(device)
    with set_current_vllm_config(cfg), set_forward_context(None, cfg):
        return model.model.layers[layer].mlp(x).cpu()


def _f32(rng: np.random.Generator, *shape: int, scale: float = 0.05) -> Any:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def test_qwen3_moe_exl3_checkpoint_equals_its_dense_twin(
    vllm_env: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock EXL3 everywhere a Qwen3-MoE has linears (attention, experts, lm_head), dense
    router and norms, through vLLM's own loader; the twin holds the decoded weights."""
    rng = np.random.default_rng(7)
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "torch_dtype": "float32",
        "hidden_size": H,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    exl3: dict[str, Any] = {}
    dense: dict[str, Any] = {
        "model.embed_tokens.weight": _f32(rng, 1024, H),
        "model.norm.weight": 1 + _f32(rng, H),
    }

    def quantized(prefix: str, n_in: int, n_out: int, bits: int) -> None:
        t = _linear(rng, n_in, n_out, bits)
        exl3.update({f"{prefix}.{k}": v for k, v in t.items()})
        dense[f"{prefix}.weight"] = _decode(t).t().contiguous()

    quantized("lm_head", H, 1024, 6)
    for i in range(2):
        p = f"model.layers.{i}"
        for mod, (n_in, n_out) in {
            "q_proj": (H, 512),
            "k_proj": (H, 256),
            "v_proj": (H, 256),
            "o_proj": (512, H),
        }.items():
            quantized(f"{p}.self_attn.{mod}", n_in, n_out, 4)
        for e in range(E):
            for proj, (n_in, n_out) in {
                "gate_proj": (H, 256),
                "up_proj": (H, 256),
                "down_proj": (256, H),
            }.items():
                quantized(f"{p}.mlp.experts.{e}.{proj}", n_in, n_out, 3)
        dense[f"{p}.mlp.gate.weight"] = _f32(rng, E, H, scale=0.5)
        for norm, n in (
            ("self_attn.q_norm", 128),
            ("self_attn.k_norm", 128),
            ("input_layernorm", H),
            ("post_attention_layernorm", H),
        ):
            dense[f"{p}.{norm}.weight"] = 1 + _f32(rng, n)
    plain = {k: v for k, v in dense.items() if f"{k[: -len('.weight')]}.trellis" not in exl3}
    q_config = dict(config, quantization_config={"quant_method": "exl3", "bits": 3.0})
    ckpt = _write(tmp_path / "exl3", q_config, {**plain, **exl3})
    twin = _write(tmp_path / "dense", config, dense)
    model, cfg = _load_model(ckpt, monkeypatch)
    ref, ref_cfg = _load_model(twin, monkeypatch)
    assert cfg.model_config.quantization == "exl3"
    assert type(model.model.layers[0].mlp.experts.quant_method).__name__ == "Exl3MoEMethod"
    _compare_models(model, ref)
    x = torch.randn(6, H)
    for i in range(2):
        torch.testing.assert_close(
            _moe_block_forward(model, cfg, i, x), _moe_block_forward(ref, ref_cfg, i, x)
        )


def test_deepseek_tr3_checkpoint_equals_its_dense_twin(
    vllm_env: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLM TR3's layout (ModelOpt shim + hybrid_tr3_tail, experts sliced for TP2, shared-H
    vectors) through DeepSeek-V2's loader, the one GLM-5.2 uses in vLLM. MLA does not run
    on vLLM's CPU platform, so the synthetic model uses DeepSeek's MHA attention: zero
    qk head dims select it, and ``VLLM_MLA_DISABLE`` keeps vLLM from sizing an MLA cache
    for the (integer) ``kv_lora_rank`` that newer transformers' strict configs require."""
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    rng = np.random.default_rng(8)
    config: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "torch_dtype": "float32",
        "hidden_size": H,
        "intermediate_size": 512,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_nope_head_dim": 0,
        "qk_rope_head_dim": 0,
        "v_head_dim": 0,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOPK,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "vocab_size": 1024,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    dense: dict[str, Any] = {
        "model.embed_tokens.weight": _f32(rng, 1024, H),
        "model.norm.weight": 1 + _f32(rng, H),
        "lm_head.weight": _f32(rng, 1024, H),
    }
    for i in range(2):
        p = f"model.layers.{i}"
        for mod, (n_in, n_out) in {
            "q_proj": (H, H),
            "k_proj": (H, H),
            "v_proj": (H, H),
            "o_proj": (H, H),
        }.items():
            dense[f"{p}.self_attn.{mod}.weight"] = _f32(rng, n_out, n_in)
        mlp = f"{p}.mlp" if i == 0 else f"{p}.mlp.shared_experts"
        for proj, (n_in, n_out) in {
            "gate_proj": (H, 512),
            "up_proj": (H, 512),
            "down_proj": (512, H),
        }.items():
            dense[f"{mlp}.{proj}.weight"] = _f32(rng, n_out, n_in)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"{p}.{norm}.weight"] = 1 + _f32(rng, H)
    dense["model.layers.1.mlp.gate.weight"] = _f32(rng, E, H, scale=0.5)
    names, experts = _tr3_experts(rng, 512, 2, shared=True)
    exl3 = {f"model.layers.1.mlp.{k}": v for k, v in names.items()}
    for e, w in experts.items():
        for proj, weight in w.items():
            dense[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = weight.t().contiguous()
    plain = {k: v for k, v in dense.items() if ".mlp.experts." not in k}
    tail = _tail(2, "shared_h_v1", 1)
    q_config = dict(
        config,
        quantization_config={
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "ignore": ["*self_attn*", "model.layers.0.mlp*", "*shared_experts*", "*mlp.gate*"],
        },
        hybrid_tr3_tail=tail,
    )
    model, cfg = _load_model(_write(tmp_path / "tr3", q_config, {**plain, **exl3}), monkeypatch)
    ref, ref_cfg = _load_model(_write(tmp_path / "dense", config, dense), monkeypatch)
    assert cfg.model_config.quantization == "exl3"
    assert type(model.model.layers[1].mlp.experts.quant_method).__name__ == "Exl3MoEMethod"
    _compare_models(model, ref)
    x = torch.randn(6, H)
    torch.testing.assert_close(
        _moe_block_forward(model, cfg, 1, x), _moe_block_forward(ref, ref_cfg, 1, x)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_models_on_cuda() -> None:
    """The two whole-model tests again, in a fresh process on vLLM's CUDA platform: the
    reference decoder runs on the GPU and the experts through vLLM's CUDA fused MoE."""
    if os.environ.get("KVARN_CKPT_VLLM_DEVICE"):
        pytest.skip("already the CUDA run")
    args = ["-q", "-x", "-p", "no:cacheprovider", "--import-mode=importlib", "-k", "twin"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(Path(__file__))],
        env=dict(os.environ, KVARN_CKPT_VLLM_DEVICE="cuda"),
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]
