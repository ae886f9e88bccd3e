"""Time header-level validation of a GLM-5.2-TR3-sized tensor set (no shard files needed).

The layout is the published one (peers-and-assets.md §5): layers 3..78, 256 experts, TP4,
shared_h_v1, K3 trellis slices of a 6144 x 2048 expert MLP. The tensor table is built in
memory (one 4-byte marker file stands in for the shards), so this measures the validator
itself on 701,328 tensors, and checks the expected count of 9,228 EXL3 tensors per layer.

    uv run python packages/kvarn-ckpt/tools/scale_tr3.py
"""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

from kvarn_ckpt.checkpoint import Checkpoint, WeightFormat
from kvarn_ckpt.exl3 import MCG_MULTIPLIER, validate_exl3
from kvarn_ckpt.model_config import read_geometry
from kvarn_ckpt.problems import ProblemList
from kvarn_ckpt.safetensors_header import TensorInfo

FIRST, LAST, EXPERTS, TP, HIDDEN, INTER = 3, 78, 256, 4, 6144, 2048


def main() -> None:
    root = Path(tempfile.mkdtemp())
    marker = root / "marker.bin"
    marker.write_bytes(struct.pack("<I", MCG_MULTIPLIER))
    ir = INTER // TP
    t: dict[str, TensorInfo] = {}

    def add(name: str, dtype: str, shape: list[int], nbytes: int = 0) -> None:
        t[name] = TensorInfo(name, dtype, tuple(shape), 0, nbytes, marker)

    for layer in range(FIRST, LAST + 1):
        for r in range(TP):
            for proj, leaf in (("gate_proj", "suh"), ("up_proj", "suh"), ("down_proj", "svh")):
                add(
                    f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank{r}.{leaf}",
                    "F16",
                    [HIDDEN],
                )
        for e in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for r in range(TP):
                    p = f"model.layers.{layer}.mlp.experts.{e}.{proj}.rank{r}"
                    down = proj == "down_proj"
                    tiles = [ir // 16, HIDDEN // 16] if down else [HIDDEN // 16, ir // 16]
                    add(f"{p}.trellis", "I16", [*tiles, 48])
                    add(f"{p}.{'suh' if down else 'svh'}", "F16", [ir])
                    add(f"{p}.mcg", "I32", [], 4)
    tail = {
        "format": "exl3-trellis",
        "bits": 3,
        "codebook": "mcg",
        "mcg_multiplier": MCG_MULTIPLIER,
        "moe_layers": [FIRST, LAST],
        "experts_per_layer": EXPERTS,
        "tp": TP,
        "rotation_layout": "shared_h_v1",
        "shared_h_tensor_schema": "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}",
        "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}",
    }
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "n_routed_experts": EXPERTS,
        "hybrid_tr3_tail": tail,
    }
    problems = ProblemList()
    ckpt = Checkpoint(
        root,
        cfg,
        "",
        cfg,
        "config.json",
        read_geometry(cfg, problems),
        {"quant_method": "modelopt"},
        "config.json",
        None,
        tail,
        WeightFormat("exl3-tr3", 3, "mcg", "modelopt"),
        {},
        {},
        t,
        problems,
    )
    t0 = time.perf_counter()
    report = validate_exl3(ckpt, problems)
    dt = time.perf_counter() - t0
    assert report.tr3 is not None
    per_layer = report.tr3["expected_tensors"] // (LAST - FIRST + 1)
    print(
        f"{len(t):,} tensors validated in {dt:.1f} s; {per_layer:,} EXL3 tensors per MoE "
        f"layer; errors: {problems.count('error')}"
    )
    assert per_layer == 9228 and problems.count("error") == 0


if __name__ == "__main__":
    main()
