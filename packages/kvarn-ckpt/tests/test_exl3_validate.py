"""Header-only EXL3 validation on synthetic stock-exllamav3 and GLM-TR3 checkpoints."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest

from kvarn_ckpt import inspect_checkpoint, open_checkpoint, trellis_bits, validate_exl3
from kvarn_ckpt.problems import ProblemList


def _validate(path: object) -> tuple[ProblemList, object]:
    ckpt = open_checkpoint(path)  # type: ignore[arg-type]
    problems = ProblemList()
    problems.extend(ckpt.problems.items())
    report = validate_exl3(ckpt, problems)
    return problems, report


def _errors(problems: ProblemList) -> list[tuple[str, str | None]]:
    return [(p.code, p.where) for p in problems if p.severity == "error"]


def test_trellis_bits() -> None:
    assert [trellis_bits(16 * k) for k in range(1, 9)] == [float(k) for k in range(1, 9)]
    assert trellis_bits(40) == 2.5 and trellis_bits(24) == 1.5 and trellis_bits(56) == 3.5
    assert trellis_bits(144) is None and trellis_bits(50) is None and trellis_bits(0) is None


def test_valid_exl3_checkpoint(kit: SimpleNamespace) -> None:
    problems, report = _validate(kit.exl3_dense(bits=3).write())
    assert _errors(problems) == []
    assert len(report.linears) == 14  # 7 linears x 2 layers
    assert report.mean_bpw == 3.0 and report.bits_histogram == {3.0: 14}
    assert report.markers_checked == report.markers_total == 14
    lin = report.linears["model.layers.1.self_attn.o_proj"]
    assert (lin.in_features, lin.out_features, lin.codebook) == (512, 256, "mcg")


def test_mixed_bitrates_mean_is_weighted(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense(bits=4)
    c.drop("model.layers.0.mlp.down_proj.trellis")
    c.add(
        "model.layers.0.mlp.down_proj.trellis",
        "I16",
        [32, 16, 32],
        shard="model-00002-of-00002.safetensors",
    )  # 2 bits, 512x256
    problems, report = _validate(c.write())
    assert _errors(problems) == []
    total = sum(i * o for i, o in kit.DENSE_LINEARS.values()) * 2
    assert report.mean_bpw == pytest.approx((4 * total - 2 * 512 * 256) / total)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda c: c.drop("model.layers.1.mlp.up_proj.svh"),
            [("exl3.missing_tensor", "model.layers.1.mlp.up_proj")],
        ),
        (
            lambda c: c.drop("model.layers.0.self_attn.k_proj.trellis"),
            [
                ("exl3.missing_tensor", "model.layers.0.self_attn.k_proj.suh"),
                ("exl3.missing_tensor", "model.layers.0.self_attn.k_proj.svh"),
                ("exl3.missing_tensor", "model.layers.0.self_attn.k_proj.mcg"),
                ("exl3.missing_module", "model.layers.0.self_attn.k_proj"),
            ],
        ),
        (
            lambda c: c.add(
                "model.layers.0.mlp.gate_proj.trellis",
                "I16",
                [16, 32, 50],
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.bits", "model.layers.0.mlp.gate_proj.trellis")],
        ),
        (
            lambda c: c.add(
                "model.layers.0.mlp.gate_proj.trellis",
                "F16",
                [16, 32, 64],
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.trellis", "model.layers.0.mlp.gate_proj.trellis")],
        ),
        (
            lambda c: c.add(
                "model.layers.0.mlp.gate_proj.svh",
                "F16",
                [500],
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.shape", "model.layers.0.mlp.gate_proj.svh")],
        ),
        (
            lambda c: c.add(
                "model.layers.0.mlp.gate_proj.suh",
                "BF16",
                [256],
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.dtype", "model.layers.0.mlp.gate_proj.suh")],
        ),
        (
            lambda c: c.add(
                "model.layers.1.self_attn.q_proj.mcg",
                "I32",
                [],
                struct.pack("<I", 7),
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.marker_value", "model.layers.1.self_attn.q_proj.mcg")],
        ),
        (
            lambda c: c.drop("model.layers.1.self_attn.q_proj.mcg"),
            [("exl3.codebook", "model.layers.1.self_attn.q_proj")],
        ),
        (
            lambda c: c.add(
                "model.layers.1.self_attn.q_proj.mul1",
                "I32",
                [],
                struct.pack("<I", kit_mul1()),
                shard="model-00002-of-00002.safetensors",
            ),
            [("exl3.codebook", "model.layers.1.self_attn.q_proj")],
        ),
    ],
    ids=[
        "missing-svh",
        "missing-trellis",
        "bad-width",
        "trellis-dtype",
        "svh-shape",
        "suh-dtype",
        "marker-value",
        "marker-missing",
        "both-markers",
    ],
)
def test_corrupt_exl3_tensors(kit: SimpleNamespace, mutate: object, expected: list) -> None:
    c = kit.exl3_dense()
    mutate(c)  # type: ignore[operator]
    problems, _ = _validate(c.write())
    assert sorted(_errors(problems)) == sorted(expected)


def kit_mul1() -> int:
    return 0x83DCD12D


def test_whole_module_missing_in_one_layer(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense()
    for leaf in ("trellis", "suh", "svh", "mcg"):
        c.drop(f"model.layers.1.mlp.down_proj.{leaf}")
    problems, _ = _validate(c.write())
    assert _errors(problems) == [("exl3.missing_module", "model.layers.1.mlp.down_proj")]


def test_module_kept_in_bf16_is_not_missing(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense()
    for leaf in ("trellis", "suh", "svh", "mcg"):
        c.drop(f"model.layers.1.mlp.down_proj.{leaf}")
    c.add("model.layers.1.mlp.down_proj.weight", "BF16", [256, 512])
    problems, _ = _validate(c.write())
    assert _errors(problems) == []


def test_sidecar_tensor_storage_is_cross_checked(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense(bits=4)
    prefix = "model.layers.0.mlp.gate_proj"
    c.extra_files["quantization_config.json"] = {
        **c.config["quantization_config"],
        "tensor_storage": {
            prefix: {
                "quant_format": "exl3",
                "bits_per_weight": 3,
                "mcg_multiplier": kit.MCG,
                "stored_tensors": {
                    f"{prefix}.trellis": {"shape": [16, 32, 64], "dtype": "torch.int16"},
                    f"{prefix}.suh": {"shape": [256], "dtype": "torch.float32"},
                },
            },
            "model.layers.0.mlp.ghost_proj": {"quant_format": "exl3", "bits_per_weight": 4},
        },
    }
    problems, _ = _validate(c.write())
    where = f"quantization_config.json:tensor_storage[{prefix}]"
    assert sorted(_errors(problems)) == sorted(
        [
            ("exl3.bits", where),
            ("sidecar.mismatch", where),  # suh dtype
            ("exl3.missing_tensor", "model.layers.0.mlp.ghost_proj"),
        ]
    )


def test_legacy_packed_signs_are_accepted(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense(bits=4, codebook="3inst")
    c.config["quantization_config"].pop("codebook")
    prefix = "model.layers.0.self_attn.o_proj"
    c.drop(f"{prefix}.suh")
    c.drop(f"{prefix}.svh")
    c.add(f"{prefix}.su", "I16", [512 // 16], shard="model-00002-of-00002.safetensors")
    c.add(f"{prefix}.sv", "I16", [256 // 16], shard="model-00002-of-00002.safetensors")
    problems, report = _validate(c.write())
    assert _errors(problems) == []
    lin = report.linears[prefix]
    assert (lin.su, lin.sv, lin.suh, lin.codebook) == (
        f"{prefix}.su",
        f"{prefix}.sv",
        None,
        "3inst",
    )


def test_dims_not_multiple_of_128(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense()
    prefix = "model.layers.0.mlp.gate_proj"
    c.add(f"{prefix}.trellis", "I16", [16, 30, 64], shard="model-00002-of-00002.safetensors")
    problems, _ = _validate(c.write())
    assert _errors(problems) == [("exl3.shape", f"{prefix}.trellis")]


def test_half_integer_rate_needs_mul1(kit: SimpleNamespace) -> None:
    c = kit.exl3_dense(bits=4, codebook="mul1")
    prefix = "model.layers.0.mlp.gate_proj"
    c.add(f"{prefix}.trellis", "I16", [16, 32, 40], shard="model-00002-of-00002.safetensors")
    problems, report = _validate(c.write())
    assert _errors(problems) == [] and report.linears[prefix].bits == 2.5
    c.drop(f"{prefix}.mul1")
    c.add(
        f"{prefix}.mcg",
        "I32",
        [],
        struct.pack("<I", kit.MCG),
        shard="model-00002-of-00002.safetensors",
    )
    c.config["quantization_config"]["codebook"] = None
    problems, _ = _validate(c.write())
    assert _errors(problems) == [("exl3.codebook", f"{prefix}.trellis")]


def test_undeclared_exl3_tensors_in_a_bf16_checkpoint(kit: SimpleNamespace) -> None:
    c = kit.bf16_dense()
    c.add_exl3("model.layers.0.mlp.extra_proj", 256, 256)
    report = inspect_checkpoint(c.write())
    assert [(p.code, p.severity) for p in report.problems] == [("weights.undeclared_exl3", "error")]
    assert report.exit_code == 1


# ------------------------------------------------------------------- TR3


def test_valid_tr3_checkpoint(kit: SimpleNamespace) -> None:
    problems, report = _validate(kit.tr3_mla().write())
    assert _errors(problems) == []
    # per layer: 4 experts x 3 projections x 2 ranks x (trellis, mcg, local vector) + 6 shared
    assert report.tr3 == {
        "layout": "shared_h_v1",
        "tp": 2,
        "moe_layers": [1, 2],
        "experts_per_layer": 4,
        "expected_tensors": 2 * (4 * 3 * 2 * 3 + 6),
        "found_tensors": 2 * (4 * 3 * 2 * 3 + 6),
    }
    assert len(report.linears) == 2 * 4 * 3 * 2
    lin = report.linears["model.layers.2.mlp.experts.3.up_proj.rank1"]
    assert lin.suh == "model.layers.2.mlp.experts.shared_h.up_proj.rank1.suh"
    assert lin.svh == "model.layers.2.mlp.experts.3.up_proj.rank1.svh"
    assert (lin.in_features, lin.out_features, lin.bits) == (256, 256, 4.0)
    down = report.linears["model.layers.1.mlp.experts.0.down_proj.rank0"]
    assert down.svh == "model.layers.1.mlp.experts.shared_h.down_proj.rank0.svh"
    assert report.mean_bpw == pytest.approx(sum(sum(k) for k in kit.TR3_K.values()) / 8)


def test_valid_tr3_per_expert_layout(kit: SimpleNamespace) -> None:
    problems, report = _validate(kit.tr3_mla(layout="per_expert_v1").write())
    assert _errors(problems) == []
    assert report.tr3["expected_tensors"] == 2 * 4 * 3 * 2 * 4


def test_tr3_missing_expert_slice(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    name = "model.layers.2.mlp.experts.1.down_proj.rank1"
    c.drop(f"{name}.trellis")
    problems, _ = _validate(c.write())
    assert sorted(_errors(problems)) == sorted(
        [
            ("exl3.missing_tensor", f"{name}.trellis"),
            ("tr3.count", "layer 2"),
            ("exl3.missing_tensor", f"{name}.suh"),  # orphaned vector
            ("exl3.missing_tensor", f"{name}.mcg"),  # orphaned marker
        ]
    )


def test_tr3_missing_shared_vector(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    shared = "model.layers.1.mlp.experts.shared_h.gate_proj.rank0.suh"
    c.drop(shared)
    problems, _ = _validate(c.write())
    errs = _errors(problems)
    # Reported once for the layer and once for every expert whose gate rank-0 slice needs it.
    assert errs.count(("exl3.missing_tensor", shared)) == 1 + 4
    assert ("tr3.count", "layer 1") in errs
    assert {code for code, _ in errs} == {"exl3.missing_tensor", "tr3.count"}


def test_tr3_wrong_slice_shape(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    name = "model.layers.1.mlp.experts.2.gate_proj.rank0.trellis"
    c.add(name, "I16", [16, 32, 48], shard="model-layer-001.safetensors")  # full width, not a slice
    c.add(
        "model.layers.1.mlp.experts.2.gate_proj.rank0.svh",
        "F16",
        [512],
        shard="model-layer-001.safetensors",
    )
    problems, _ = _validate(c.write())
    assert _errors(problems) == [("exl3.shape", name)]


def test_tr3_bits_disagree_with_tier_file(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    c.extra_files["tier_bitmap.json"] = {"1": {"k": [3, 4, 3, 4]}, "2": {"k": [4, 4, 3, 4]}}
    problems, _ = _validate(c.write())
    assert _errors(problems) == [("tr3.bits", "layer 1 expert 3")]


def test_tr3_bits_outside_k_values_and_mixed_within_expert(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    c.config["hybrid_tr3_tail"]["k_values"] = [3]
    c.add(
        "model.layers.2.mlp.experts.2.up_proj.rank0.trellis",
        "I16",
        [16, 16, 64],
        shard="model-layer-002.safetensors",
    )  # expert 2 of layer 2 is K3 elsewhere
    problems, _ = _validate(c.write())
    errs = _errors(problems)
    assert ("tr3.bits", "layer 2 expert 2") in errs  # mixes K3 and K4
    assert {code for code, _ in errs} == {"tr3.bits"}
    # experts with K4: layer 1 expert 1; layer 2 experts 0, 1, 3 (+ expert 2's K4 slice)
    assert len(errs) == 1 + 4 + 1 + 1  # mixed + K4 not in [3] + tier mismatch for L2E2


def test_tr3_ambiguous_per_expert_hidden_vector(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    prefix = "model.layers.1.mlp.experts.0.gate_proj.rank1"
    c.add(f"{prefix}.suh", "F16", [256], shard="model-layer-001.safetensors")
    problems, _ = _validate(c.write())
    assert ("tr3.layout", prefix) in _errors(problems)


def test_tr3_unexpected_expert_index(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    c.add_exl3(
        "model.layers.1.mlp.experts.9.gate_proj.rank0",
        256,
        256,
        3,
        shard="model-layer-001.safetensors",
        local_vectors=("svh",),
    )
    problems, _ = _validate(c.write())
    codes = {code for code, _ in _errors(problems)}
    assert codes == {"tr3.unexpected"}


def test_tr3_bad_schema_and_config(kit: SimpleNamespace) -> None:
    c = kit.tr3_mla()
    c.config["hybrid_tr3_tail"]["tensor_schema"] = "model.layers.{L}.experts.{X}.trellis"
    problems, _ = _validate(c.write())
    assert ("tr3.schema", "config.json:hybrid_tr3_tail") in _errors(problems)
    c = kit.tr3_mla()
    c.config["hybrid_tr3_tail"]["tp"] = 0
    problems, _ = _validate(c.write())
    assert ("tr3.config", "config.json:hybrid_tr3_tail") in _errors(problems)


def test_tr3_truncated_shard_is_reported(kit: SimpleNamespace) -> None:
    p = kit.tr3_mla().write()
    shard = p / "model-layer-002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    report = inspect_checkpoint(p)
    codes = [(x.code, x.where) for x in report.problems if x.severity == "error"]
    assert ("shard.header", "model-layer-002.safetensors") in codes
    assert ("tr3.count", "layer 2") in codes
    assert report.exit_code == 1
    assert json.dumps(report.as_dict())  # the JSON report still renders
