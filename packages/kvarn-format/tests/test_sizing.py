"""KV budget solver: hand-computed cases. Every expected number is derived in the comments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvarn_format.catalog import catalog_names, load_model, model_from_config
from kvarn_format.registry import UnsupportedGeometryError, parse_cache_dtype
from kvarn_format.sizing import (
    ANCHOR_FIXED_OVERHEAD_BYTES,
    GPUS,
    BudgetError,
    LayerCache,
    MLAWorkspace,
    ServingConfig,
    SidePool,
    dense_pool_rows,
    layer_caches,
    mla_workspace_bytes,
    plan,
    resolve_cache_format,
    resolve_gpu,
    rollback_blocks,
    side_pool_slots,
    solve_kv_budget,
    valid_cache_dtypes,
)

# ---------------------------------------------------------------------------------------------
# Dense KVarN on Qwen3-8B geometry (36 layers, 8 KV heads, head_dim 128), kvarn_k4v2_g128:
#   page per layer  = Hk * tile = 8 * 13,824          = 110,592 B
#   page per block  = 36 * 110,592                    = 3,981,312 B
#   pool slot/layer = G * Hk * D * 2 (K,V) * 2 (fp16) = 128 * 8 * 128 * 4 = 524,288 B
# With max_num_seqs S=4, max_num_batched_tokens T=256, direct flush (the default):
#   POOL = 2*4 + 8 = 16 slots (without direct flush: + ceil(256/128) = 18)
#   pool bytes = 16 * 524,288 * 36 = 301,989,888 B
QWEN8_PAGE = 3_981_312
QWEN8_POOL = 301_989_888
SMALL = ServingConfig(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)


def _qwen8_k4v2() -> tuple[int, tuple[LayerCache, ...]]:
    """Whole-tile pool slots (no shadow rows): the solver tests' hand arithmetic."""
    return layer_caches(load_model("Qwen3-8B"), "kvarn_k4v2_g128", shadow_rows=False)


def test_dense_pages_and_pool_match_hand_arithmetic() -> None:
    block, layers = _qwen8_k4v2()
    assert block == 128
    (full,) = layers
    assert full.count == 36 and full.page_bytes == 110_592
    assert full.side_pool is not None and full.side_pool.slot_bytes == 524_288
    # With shadow rows (the default), a tile's first 13,824 // (4 * 128) = 27 rows live in its
    # block's 13,824-byte record area: 101 rows per slot, 2 * 101 * 8 * 128 * 2 bytes.
    _, (shadowed,) = layer_caches(load_model("Qwen3-8B"), "kvarn_k4v2_g128")
    assert shadowed.side_pool is not None and shadowed.side_pool.slot_bytes == 413_696
    assert dense_pool_rows(parse_cache_dtype("kvarn_k4v4_g128"), 128) == 128 - 35  # 17,920 B
    assert side_pool_slots(full.side_pool, SMALL) == 16
    assert side_pool_slots(full.side_pool, replace(SMALL, direct_flush=False)) == 18
    assert full.workspace is None


def test_exact_fit_and_one_byte_short() -> None:
    block, layers = _qwen8_k4v2()
    exact = QWEN8_POOL + 100 * QWEN8_PAGE
    b = solve_kv_budget(layers, exact, SMALL, block_size=block)
    assert b.num_blocks == 100
    assert b.unused_bytes == 0
    assert b.side_pool_bytes == QWEN8_POOL
    assert b.kv_tokens == 100 * 128
    # One byte short of the 100th page: 99 blocks, and a page minus one byte is left over.
    short = solve_kv_budget(layers, exact - 1, SMALL, block_size=block)
    assert short.num_blocks == 99
    assert short.unused_bytes == QWEN8_PAGE - 1


def test_one_page_over_is_not_a_block() -> None:
    block, layers = _qwen8_k4v2()
    # 100 pages plus (one page - 1 byte): still 100 blocks.
    over = QWEN8_POOL + 100 * QWEN8_PAGE + QWEN8_PAGE - 1
    assert solve_kv_budget(layers, over, SMALL, block_size=block).num_blocks == 100
    # A full extra page: 101.
    assert solve_kv_budget(layers, over + 1, SMALL, block_size=block).num_blocks == 101


def test_concurrency_counts_whole_requests() -> None:
    block, layers = _qwen8_k4v2()
    # max_model_len 1000 -> ceil(1000/128) = 8 blocks per request; 100 blocks -> 12 requests
    # (the 4 remaining blocks do not make a 13th). The first (sink) block of each request is
    # allocated like any other, as vLLM does.
    serving = ServingConfig(1000, 4, 256)
    b = solve_kv_budget(layers, QWEN8_POOL + 100 * QWEN8_PAGE, serving, block_size=block)
    assert b.blocks_per_request == 8
    assert b.max_concurrency == 12


def test_fails_closed_when_one_request_does_not_fit() -> None:
    block, layers = _qwen8_k4v2()
    # max_model_len 1024 needs 8 blocks; only 7 fit.
    with pytest.raises(BudgetError, match="fewer than the 8 blocks one request"):
        solve_kv_budget(layers, QWEN8_POOL + 7 * QWEN8_PAGE, SMALL, block_size=block)


def test_pool_that_does_not_fit_raises_and_says_how_many_seqs_fit() -> None:
    block, layers = _qwen8_k4v2()
    with pytest.raises(BudgetError, match="side pool") as exc:
        solve_kv_budget(layers, QWEN8_POOL - 1, SMALL, block_size=block)
    assert "max-num-seqs" in str(exc.value)


# ---------------------------------------------------------------------------------------------
# The shared MLA workspace, kvarn_mla_k5_g64 on DeepSeek-V2-Lite geometry (27 MLA layers):
#   page per block = 27 * 30,848 = 832,896 B
#   pool slot/layer = 64 * (512 fp8 latent + 64*2 bf16 rope) = 40,960 B
#   with S=4, T=256, no spec: POOL = 3*4 + ceil(256/64) + 8 = 24 slots
#   pool bytes = 24 * 40,960 * 27 = 26,542,080 B
# workspace(N), topk 0: page_rows = 64N; transient_rows = (ceil(256/64) + 4 + 0) * 64 = 512;
#   dense_rows = max(64N, 512) (a multiple of 64)
#   arena = dense_rows * (512+64) * 2 = 1152 per row; rotation = 256 * 512 * 2 = 262,144;
#   slot map = 64N * 4 = 256N; remap = 0 (topk 0)
#   for N >= 8: workspace = 73,728N + 256N + 262,144 = 73,984N + 262,144
# Total(N) = 832,896N + 73,984N + 262,144 + 26,542,080 = 906,880N + 26,804,224.
MLA_PAGE = 832_896
MLA_POOL = 26_542_080


def _v2lite_k5() -> tuple[int, tuple[LayerCache, ...]]:
    return layer_caches(load_model("DeepSeek-V2-Lite"), "kvarn_mla_k5_g64")


def test_workspace_formula() -> None:
    _, (lat,) = _v2lite_k5()
    assert lat.workspace is not None
    ws = mla_workspace_bytes(lat.workspace, 1000, SMALL)
    assert ws.page_rows == 64_000
    assert ws.transient_rows == 512
    assert ws.dense_rows == 64_000
    assert ws.total_bytes == 73_984 * 1000 + 262_144
    # Below 8 blocks the transient rows dominate the arena: 512 rows at N = 2.
    assert mla_workspace_bytes(lat.workspace, 2, SMALL).dense_rows == 512


def test_workspace_charged_once_across_layers() -> None:
    block, (lat,) = _v2lite_k5()
    assert lat.count == 27 and lat.page_bytes == 30_848
    available = 906_880 * 1000 + 26_804_224
    b = solve_kv_budget((lat,), available, SMALL, block_size=block)
    assert b.num_blocks == 1000
    assert b.side_pool_bytes == MLA_POOL
    # Charged once: 74.2 MB, not 27 times that.
    assert b.workspace_bytes == 73_984 * 1000 + 262_144
    assert b.unused_bytes == 0
    assert solve_kv_budget((lat,), available - 1, SMALL, block_size=block).num_blocks == 999
    # Splitting the same layers into two groups with the same geometry changes nothing.
    halves = (
        LayerCache(lat.role, lat.dtype, 13, lat.page_bytes, lat.side_pool, lat.workspace),
        LayerCache(lat.role, lat.dtype, 14, lat.page_bytes, lat.side_pool, lat.workspace),
    )
    split = solve_kv_budget(halves, available, SMALL, block_size=block)
    assert split.num_blocks == 1000 and split.workspace_bytes == b.workspace_bytes


def test_speculative_rollback_blocks_in_the_combined_budget() -> None:
    block, (lat,) = _v2lite_k5()
    spec = ServingConfig(1024, 4, 256, spec_tokens=3)
    # rollback = ceil(4*3/64) + 4 = 5 tiles
    assert rollback_blocks(spec, 64) == 5
    # pool: 24 + 5 = 29 slots -> 29 * 40,960 * 27 = 32,071,680 B
    assert lat.side_pool is not None and side_pool_slots(lat.side_pool, spec) == 29
    # workspace: transient_rows = (4 + 4 + 5) * 64 = 832; for N >= 13 it is 73,984N + 262,144.
    assert mla_workspace_bytes(lat.workspace, 1000, spec).transient_rows == 832  # type: ignore[arg-type]
    available = 906_880 * 1000 + 26_804_224
    b = solve_kv_budget((lat,), available, spec, block_size=block)
    # N = floor((available - 262,144 - 32,071,680) / 906,880) = floor(901,350,400 / 906,880) = 993
    assert b.num_blocks == 993
    assert b.side_pool_bytes == 32_071_680


def test_speculative_rollback_fails_closed_when_it_does_not_fit() -> None:
    block, layers = _qwen8_k4v2()
    # Exactly enough for the pool and one request (8 blocks) without speculation...
    available = QWEN8_POOL + 8 * QWEN8_PAGE
    assert solve_kv_budget(layers, available, SMALL, block_size=block).num_blocks == 8
    # ...with 4 speculative tokens, rollback = ceil(4*4/128) + 4 = 5 more slots
    # (5 * 524,288 * 36 = 94,371,840 B) push it over: the solver refuses.
    spec = ServingConfig(1024, 4, 256, spec_tokens=4)
    assert rollback_blocks(spec, 128) == 5
    with pytest.raises(BudgetError):
        solve_kv_budget(layers, available, spec, block_size=block)
    # The same budget minus the rollback slots' bytes still fits 8 blocks with spec on.
    fits = solve_kv_budget(layers, available + 94_371_840, spec, block_size=block)
    assert fits.num_blocks == 8 and fits.side_pool_slots == 21


def test_incompatible_workspace_geometries_raise() -> None:
    _, (k5,) = _v2lite_k5()
    _, (k4,) = layer_caches(load_model("DeepSeek-V2-Lite"), "kvarn_mla_k4_g64")
    with pytest.raises(UnsupportedGeometryError, match="one geometry"):
        solve_kv_budget((k5, k4), 10**12, SMALL, block_size=64)


def test_unknown_workspace_geometry_raises() -> None:
    bad = MLAWorkspace("kvarn_mla_k3_g64", 64, 512, 64, 3, 22_656, 0)
    layer = LayerCache("MLA", "x", 4, 22_656, None, bad)
    with pytest.raises(UnsupportedGeometryError, match="accepts only"):
        solve_kv_budget((layer,), 10**12, SMALL, block_size=64)


@pytest.mark.parametrize("name", catalog_names())
def test_only_g64_mla_formats_reserve_the_workspace(name: str) -> None:
    model = load_model(name)
    for dtype in valid_cache_dtypes(model):
        _, layers = layer_caches(model, dtype)
        has_ws = any(c.workspace is not None for c in layers)
        assert has_ws == (dtype.startswith("kvarn_mla_") and dtype.endswith("_g64")), dtype
        if dtype in ("auto", "fp8"):
            assert all(c.side_pool is None for c in layers)


def test_fp16_fp8_and_dense_kvarn_solve_without_workspace() -> None:
    for dtype in ("auto", "fp8", "kvarn_k4v2_g128", "kvarn_k5v5_g64"):
        p = plan("Qwen3-8B", dtype)
        assert p.budget.workspace is None and p.budget.workspace_bytes == 0
    assert plan("DeepSeek-V2-Lite", "kvarn_mla_k4_g128").budget.workspace_bytes == 0


# ---------------------------------------------------------------------------------------------
# Pages per format and TP


def test_fp16_and_fp8_pages() -> None:
    model = load_model("Qwen3-8B")
    # fp16: 2 (K,V) * 16 tokens * 8 heads * 128 * 2 B = 65,536 B per layer
    block, (c,) = layer_caches(model, "auto")
    assert block == 16 and c.page_bytes == 65_536 and c.count == 36
    _, (c8,) = layer_caches(model, "fp8")
    assert c8.page_bytes == 32_768
    # MLA: (512 + 64) * 2 B per token, 64-token blocks, no KV heads.
    block, (m,) = layer_caches(load_model("DeepSeek-V2-Lite"), "auto")
    assert block == 64 and m.page_bytes == 64 * 1152


def test_tp_splits_dense_heads_and_replicates_mla() -> None:
    qwen = load_model("Qwen3-8B")
    assert layer_caches(qwen, "kvarn_k4v2_g128", tp=2)[1][0].page_bytes == 4 * 13_824
    # 4 KV heads over tp=8: one replicated head per rank.
    a3b = load_model("Qwen3-30B-A3B")
    assert layer_caches(a3b, "auto", tp=8)[1][0].page_bytes == 2 * 16 * 1 * 128 * 2
    v2 = load_model("DeepSeek-V2-Lite")
    assert layer_caches(v2, "kvarn_mla_k4_g64", tp=4)[1][0].page_bytes == 26_752
    with pytest.raises(UnsupportedGeometryError, match="tp=3"):
        layer_caches(qwen, "auto", tp=3)


def test_sliding_layers_stay_fp16() -> None:
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 1000,
        "intermediate_size": 2048,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    model = model_from_config(cfg, "toy")
    block, layers = layer_caches(model, "kvarn_k4v2_g128")
    assert block == 128
    full, sliding = layers
    # 13,824-byte records padded to 16,384 so that the page divides the sliding layers' page
    assert (full.count, full.page_bytes) == (2, 2 * 16_384)
    assert (sliding.count, sliding.page_bytes, sliding.side_pool) == (
        2,
        2 * 128 * 2 * 128 * 2,
        None,
    )


def test_formats_the_model_cannot_take_raise() -> None:
    with pytest.raises(UnsupportedGeometryError, match="needs an MLA format"):
        plan("DeepSeek-V2-Lite", "kvarn_k4v2_g128")
    with pytest.raises(UnsupportedGeometryError, match="dense format") as exc:
        plan("Qwen3-8B", "kvarn_mla_k5_g64")
    assert "kvarn_k4v2_g128" in str(exc.value)  # lists the valid ones
    odd = model_from_config(
        {
            "num_hidden_layers": 2,
            "hidden_size": 960,
            "num_attention_heads": 10,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "intermediate_size": 100,
        },
        "head96",
    )
    assert valid_cache_dtypes(odd) == ("auto", "fp8")
    with pytest.raises(UnsupportedGeometryError, match="head_dim 96"):
        layer_caches(odd, "kvarn_k4v2_g128")


def test_side_pool_rules() -> None:
    s = ServingConfig(4096, max_num_seqs=128, max_num_batched_tokens=2048)
    # Direct flush (default): no prefill-chunk term, whatever the token budget.
    assert side_pool_slots(SidePool("dense", 128, 1), s) == 2 * 128 + 8
    big = replace(s, max_num_batched_tokens=65536)
    assert side_pool_slots(SidePool("dense", 128, 1), big) == 2 * 128 + 8
    old = replace(s, direct_flush=False)
    assert side_pool_slots(SidePool("dense", 128, 1), old) == 2 * 128 + 16 + 8
    spec = replace(s, spec_tokens=2)
    assert side_pool_slots(SidePool("dense", 128, 1), spec) == 2 * 128 + 8 + 2 + 128
    # The MLA rules do not depend on direct flush.
    assert side_pool_slots(SidePool("mla_g64", 64, 1), old) == 3 * 128 + 32 + 8
    assert side_pool_slots(SidePool("mla_g128", 128, 1), s) == 256
    assert side_pool_slots(SidePool("mla_g128", 128, 1), ServingConfig(4096, 10, 2048)) == 64
    assert side_pool_slots(SidePool("mla_g64", 64, 1), s) == 3 * 128 + 32 + 8


def test_serving_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ServingConfig(1024, max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="spec_tokens"):
        ServingConfig(1024, spec_tokens=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        ServingConfig(0)
    with pytest.raises(ValueError, match="direct_flush"):
        ServingConfig(1024, direct_flush=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Whole plans


def test_h200_fp16_and_fp8_anchors_reproduced() -> None:
    """docs/gpu.md: vLLM 0.23.0 on an H200, Qwen3-8B in fp16, utilization 0.90,
    max_model_len 16,384, max_num_seqs 256 (LLM class: max_num_batched_tokens 16,384)
    reported 791,792 tokens for auto and 1,583,600 for fp8. The fixed overhead constant was
    fitted to these two runs, so this guards the formula, not its generality."""
    kw = {"max_model_len": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 16384}
    auto = plan("Qwen3-8B", "auto", weights="fp16", **kw)  # type: ignore[arg-type]
    assert auto.kv_tokens == 791_792
    fp8 = plan("Qwen3-8B", "fp8", weights="fp16", **kw)  # type: ignore[arg-type]
    assert fp8.kv_tokens == 1_583_600
    # The terms: requested = ceil(150,109,880,320 * 0.9); weights 8,190,735,360 params * 2 B;
    # forward peak 16,384 tokens * 2 B * (3*4096 + 3*12288) = 1,610,612,736 B.
    assert auto.requested_bytes == math.ceil(150_109_880_320 * 0.9)
    assert auto.weight_bytes == 16_381_470_720
    assert auto.overhead is not None
    assert auto.overhead.forward_peak_bytes == 1_610_612_736
    assert auto.overhead_bytes == 1_610_612_736 + ANCHOR_FIXED_OVERHEAD_BYTES


def test_qwen3_8b_standard_burst_kvarn_predictions() -> None:
    """The H200 standard burst (docs/benchmarks.md). vLLM 0.23.0 reported 3,360,128 tokens for
    kvarn_k4v2_g128 with the format-spec pool (648 slots); the same plan without direct flush
    predicts 3,360,512 (3 blocks over). With direct flush the pool is 2*256 + 8 = 520 slots
    (128 x 36 x 524,288 B = 2.25 GiB less); vLLM then reported 3,437,824 (k4v2) and 2,652,032
    (k4v4) tokens, one block under these plans. Shadow rows (the default since) shrink each
    slot to 101 rows (k4v2) or 93 (k4v4): the predictions for the next GPU run."""
    kw = {"max_model_len": 16384, "max_num_seqs": 256, "max_num_batched_tokens": 16384}
    whole = {**kw, "shadow_rows": False}
    old = plan("Qwen3-8B", "kvarn_k4v2_g128", direct_flush=False, **whole)  # type: ignore[arg-type]
    assert old.budget.side_pool_slots == 648 and old.kv_tokens == 3_360_512
    k4v2 = plan("Qwen3-8B", "kvarn_k4v2_g128", **whole)  # type: ignore[arg-type]
    assert k4v2.budget.side_pool_slots == 520
    assert old.budget.side_pool_bytes - k4v2.budget.side_pool_bytes == 128 * 36 * 524_288
    assert k4v2.kv_tokens == 3_438_080  # 4.342x the planned fp16 791,792
    k4v4 = plan("Qwen3-8B", "kvarn_k4v4_g128", **whole)  # type: ignore[arg-type]
    assert k4v4.kv_tokens == 2_652_288  # 3.350x
    shadow_k4v2 = plan("Qwen3-8B", "kvarn_k4v2_g128", **kw)  # type: ignore[arg-type]
    assert shadow_k4v2.budget.side_pool_bytes == 520 * 36 * 413_696
    assert shadow_k4v2.kv_tokens == 3_504_640  # 4.426x
    shadow_k4v4 = plan("Qwen3-8B", "kvarn_k4v4_g128", **kw)  # type: ignore[arg-type]
    assert shadow_k4v4.budget.side_pool_bytes == 520 * 36 * 2 * 93 * 8 * 128 * 2
    assert shadow_k4v4.kv_tokens == 2_718_848  # 3.434x: issue 4's 3.4x


def test_qwen3_32b_k4v2_a_bit_above_4x() -> None:
    p = plan("Qwen3-32B", "kvarn_k4v2_g128")
    assert p.ratio_vs_fp16 is not None and 4.0 < p.ratio_vs_fp16 < 4.3
    # Side pool: 2*128 + 8 = 264 slots * 413,696 B (101 rows: shadow rows) * 64 layers.
    assert p.budget.side_pool_bytes == 264 * 413_696 * 64
    assert p.kv_tokens == p.num_blocks * 128
    # Every byte is accounted for.
    b = p.budget
    assert b.kv_cache_bytes + b.side_pool_bytes + b.unused_bytes == p.available_bytes
    assert p.requested_bytes == p.weight_bytes + p.overhead_bytes + p.available_bytes


def test_plan_fails_closed_when_weights_do_not_fit() -> None:
    with pytest.raises(BudgetError, match="no memory is left"):
        plan("Llama-3.1-70B", "auto")  # 141 GB of bf16 weights on one H200
    assert plan("Llama-3.1-70B", "kvarn_k4v2_g128", tp=2).kv_tokens > 0


def test_plan_overrides() -> None:
    p = plan("Qwen3-8B", "auto", weight_bytes=10 * 2**30, overhead_bytes=2**30, gpu=80)
    assert p.gpu.total_bytes == 80 * 2**30
    assert p.available_bytes == math.ceil(80 * 2**30 * 0.9) - 11 * 2**30
    assert p.overhead is None


def test_gpu_presets_and_numbers() -> None:
    assert resolve_gpu("H200") is GPUS["h200"]
    assert resolve_gpu("24").total_bytes == 24 * 2**30
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_gpu("tpu")
    with pytest.raises(ValueError, match="positive"):
        resolve_gpu(-1)


def test_unknown_cache_dtype_lists_valid() -> None:
    with pytest.raises(ValueError, match="kvarn_k4v2_g128") as exc:
        resolve_cache_format("int4")
    assert "fp8" in str(exc.value)
