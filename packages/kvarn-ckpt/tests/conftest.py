"""Builders for small synthetic checkpoints.

Tests write their own checkpoints into ``tmp_path``: a tiny dense (Qwen3-style) or MLA
(DeepSeek-style) config, safetensors shards written byte by byte here (so that corrupt files
are easy to make), and EXL3 linears whose trellis/suh/svh/marker tensors follow exllamav3's
conventions. Only shapes matter for validation; tests that decode weights fill the payloads.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

MCG = 0xCBAC1FED
MUL1 = 0x83DCD12D
_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "I16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
}


def write_safetensors(
    path: Path,
    tensors: dict[str, tuple[str, list[int], bytes | None]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file: ``{name: (dtype, shape, raw bytes or None for zeros)}``."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    blobs = []
    off = 0
    for name, (dtype, shape, data) in tensors.items():
        n = math.prod(shape) * _BITS[dtype] // 8
        blob = data if data is not None else bytes(n)
        assert len(blob) == n, (name, len(blob), n)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        blobs.append(blob)
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def dense_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "torch_dtype": "bfloat16",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
    }
    cfg.update(over)
    return cfg


def mla_config(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "torch_dtype": "bfloat16",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 3,
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
        "first_k_dense_replace": 1,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    }
    cfg.update(over)
    return cfg


class Ckpt:
    """A checkpoint under construction: config plus named tensors per shard."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.config = config
        self.shards: dict[str, dict[str, tuple[str, list[int], bytes | None]]] = {}
        self.extra_files: dict[str, Any] = {}

    def add(
        self,
        name: str,
        dtype: str,
        shape: list[int],
        data: bytes | None = None,
        shard: str = "model-00001-of-00002.safetensors",
    ) -> None:
        self.shards.setdefault(shard, {})[name] = (dtype, shape, data)

    def drop(self, name: str) -> None:
        for tensors in self.shards.values():
            tensors.pop(name, None)

    def add_exl3(
        self,
        prefix: str,
        n_in: int,
        n_out: int,
        bits: int = 4,
        codebook: str | None = "mcg",
        shard: str = "model-00002-of-00002.safetensors",
        local_vectors: tuple[str, ...] = ("suh", "svh"),
    ) -> None:
        self.add(f"{prefix}.trellis", "I16", [n_in // 16, n_out // 16, 16 * bits], shard=shard)
        if "suh" in local_vectors:
            self.add(f"{prefix}.suh", "F16", [n_in], shard=shard)
        if "svh" in local_vectors:
            self.add(f"{prefix}.svh", "F16", [n_out], shard=shard)
        if codebook == "mcg":
            self.add(f"{prefix}.mcg", "I32", [], struct.pack("<I", MCG), shard=shard)
        elif codebook == "mul1":
            self.add(f"{prefix}.mul1", "I32", [], struct.pack("<I", MUL1), shard=shard)

    def write(self, index: bool = True) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        weight_map = {}
        for shard, tensors in self.shards.items():
            write_safetensors(self.root / shard, tensors)
            weight_map.update({n: shard for n in tensors})
        if index:
            (self.root / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
            )
        for name, doc in self.extra_files.items():
            (self.root / name).write_text(json.dumps(doc))
        return self.root


DENSE_LINEARS = {
    "self_attn.q_proj": (256, 512),
    "self_attn.k_proj": (256, 256),
    "self_attn.v_proj": (256, 256),
    "self_attn.o_proj": (512, 256),
    "mlp.gate_proj": (256, 512),
    "mlp.up_proj": (256, 512),
    "mlp.down_proj": (512, 256),
}


def bf16_dense(root: Path, **over: Any) -> Ckpt:
    c = Ckpt(root, dense_config(**over))
    c.add("model.embed_tokens.weight", "BF16", [1024, 256])
    for layer in range(c.config["num_hidden_layers"]):
        for mod, (n_in, n_out) in DENSE_LINEARS.items():
            c.add(f"model.layers.{layer}.{mod}.weight", "BF16", [n_out, n_in])
        c.add(f"model.layers.{layer}.input_layernorm.weight", "BF16", [256])
    c.add("model.norm.weight", "BF16", [256])
    return c


def exl3_dense(root: Path, bits: int = 4, codebook: str = "mcg", **over: Any) -> Ckpt:
    c = Ckpt(root, dense_config(**over))
    c.config["quantization_config"] = {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": float(bits),
        "head_bits": 6,
        "codebook": codebook,
    }
    c.add("model.embed_tokens.weight", "BF16", [1024, 256])
    for layer in range(c.config["num_hidden_layers"]):
        for mod, (n_in, n_out) in DENSE_LINEARS.items():
            c.add_exl3(f"model.layers.{layer}.{mod}", n_in, n_out, bits, codebook)
        c.add(f"model.layers.{layer}.input_layernorm.weight", "BF16", [256])
    c.add("model.norm.weight", "BF16", [256])
    return c


def bf16_mla(root: Path, **over: Any) -> Ckpt:
    c = Ckpt(root, mla_config(**over))
    c.add("model.embed_tokens.weight", "BF16", [1024, 256])
    for layer in range(c.config["num_hidden_layers"]):
        c.add(f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", "BF16", [576, 256])
        c.add(f"model.layers.{layer}.self_attn.kv_b_proj.weight", "BF16", [1024, 512])
    return c


TR3_TP = 2
TR3_EXPERTS = 4
TR3_LAYERS = (1, 2)
TR3_K = {1: [3, 4, 3, 3], 2: [4, 4, 3, 4]}


def tr3_mla(root: Path, layout: str = "shared_h_v1") -> Ckpt:
    """A GLM-TR3-style MLA checkpoint: ModelOpt shim + hybrid_tr3_tail, rank-sliced experts."""
    c = bf16_mla(root)
    c.config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "ignore": ["*self_attn*", "model.layers.0.mlp*", "*shared_experts*", "*mlp.gate*"],
    }
    c.config["hybrid_tr3_tail"] = {
        "format": "exl3-trellis",
        "bits": "mixed",
        "k_values": [3, 4],
        "bits_per_expert": "tier_bitmap.json:k",
        "codebook": "mcg",
        "mcg_multiplier": MCG,
        "hessian": "ldlq-calibrated",
        "exllamav3_version": "0.0.43",
        "moe_layers": list(TR3_LAYERS),
        "experts_per_layer": TR3_EXPERTS,
        "nvfp4_keep_per_layer": 0,
        "tr3_tail_per_layer": TR3_EXPERTS,
        "tp": TR3_TP,
        "rotation_layout": layout,
        "shared_h_tensor_schema": "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}",
        "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}",
        "tier_bitmap": "tier_bitmap.json",
    }
    c.extra_files["tier_bitmap.json"] = {str(L): {"k": ks} for L, ks in TR3_K.items()}
    hidden, inter_r = 256, 512 // TR3_TP
    for layer in range(TR3_LAYERS[0], TR3_LAYERS[1] + 1):
        shard = f"model-layer-{layer:03d}.safetensors"
        for r in range(TR3_TP):
            if layout == "shared_h_v1":
                for proj, leaf in (("gate_proj", "suh"), ("up_proj", "suh"), ("down_proj", "svh")):
                    c.add(
                        f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank{r}.{leaf}",
                        "F16",
                        [hidden],
                        shard=shard,
                    )
        for e in range(TR3_EXPERTS):
            k = TR3_K[layer][e]
            for r in range(TR3_TP):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    prefix = f"model.layers.{layer}.mlp.experts.{e}.{proj}.rank{r}"
                    down = proj == "down_proj"
                    n_in, n_out = (inter_r, hidden) if down else (hidden, inter_r)
                    if layout == "shared_h_v1":
                        local = ("suh",) if down else ("svh",)
                    else:
                        local = ("suh", "svh")
                    c.add_exl3(prefix, n_in, n_out, k, "mcg", shard=shard, local_vectors=local)
    return c


def random_f16(rng: np.random.Generator, n: int, scale: float = 1.0) -> bytes:
    return (rng.standard_normal(n) * scale).astype(np.float16).tobytes()


@pytest.fixture
def kit(tmp_path: Path) -> SimpleNamespace:
    """Everything a test needs to write checkpoints; builders are bound to fresh
    directories under ``tmp_path`` (``name=`` picks the directory name)."""
    counter = iter(range(10_000))

    def at(fn: Callable[..., Ckpt]) -> Callable[..., Ckpt]:
        def make(*args: Any, name: str | None = None, **kw: Any) -> Ckpt:
            return fn(tmp_path / (name or f"ckpt{next(counter)}"), *args, **kw)

        return make

    return SimpleNamespace(
        bf16_dense=at(bf16_dense),
        exl3_dense=at(exl3_dense),
        bf16_mla=at(bf16_mla),
        tr3_mla=at(tr3_mla),
        Ckpt=Ckpt,
        write_safetensors=write_safetensors,
        dense_config=dense_config,
        mla_config=mla_config,
        random_f16=random_f16,
        MCG=MCG,
        MUL1=MUL1,
        TR3_K=TR3_K,
        TR3_TP=TR3_TP,
        TR3_EXPERTS=TR3_EXPERTS,
        TR3_LAYERS=TR3_LAYERS,
        DENSE_LINEARS=DENSE_LINEARS,
        tmp=tmp_path,
    )


@pytest.fixture(scope="module")
def vllm_env() -> Iterator[SimpleNamespace]:
    """A CPU platform, a current VllmConfig and a 1-process TP group (idempotent).

    ``KVARN_CKPT_VLLM_DEVICE=cuda`` leaves vLLM to detect its platform instead (the GPU run of
    the whole-model tests, started in a fresh process by ``test_models_on_cuda``)."""
    import vllm.platforms as platforms

    if os.environ.get("KVARN_CKPT_VLLM_DEVICE", "cpu") == "cpu" and (
        platforms._current_platform is None
    ):
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ctx = set_current_vllm_config(VllmConfig())
    ctx.__enter__()
    owned = not ps.model_parallel_is_initialized()
    if owned:
        init = f"file://{tempfile.mkdtemp()}/dist"
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=init, backend="gloo"
        )
        ps.initialize_model_parallel(1)
    from kvarn_ckpt import vllm_quant

    vllm_quant.register()
    try:
        yield SimpleNamespace(vq=vllm_quant)
    finally:
        if owned:  # leave the process as we found it for other packages' tests
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        ctx.__exit__(None, None, None)
