"""KV specs, page sizes, backend routing and KV-budget charging with real vLLM objects."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvarn_format import DENSE_DTYPES, DenseFormat, parse_cache_dtype, record_layout
from kvarn_format.sizing import ServingConfig, SidePool, side_pool_slots
from kvarn_vllm.specs import KvarnFullAttentionSpec, hybrid_tile_stride

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata


def _config(model: Path, dtype: str = "kvarn_k4v2_g128", **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype=dtype,
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        **kw,
    ).create_engine_config()


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("head", [64, 128, 256, 512])
def test_page_size_is_hk_records_and_matches_the_cache_shape(dtype: str, head: int) -> None:
    from kvarn_vllm.backend import backend_for

    fmt = parse_cache_dtype(dtype)
    assert isinstance(fmt, DenseFormat)
    tile = record_layout(fmt, head).tile_bytes
    spec = KvarnFullAttentionSpec.for_layer(
        cache_dtype=dtype, block_size=fmt.group, num_kv_heads=8, head_size=head
    )
    assert spec.page_size_bytes == 8 * tile
    assert spec.max_memory_usage_bytes.__func__  # inherited, uses page_size_bytes
    # vLLM's reshape invariant: the cache shape holds exactly one page per block.
    shape = backend_for(dtype).get_kv_cache_shape(5, fmt.group, 8, head, dtype)
    assert math.prod(shape) == 5 * spec.page_size_bytes
    # A scheduler block of k tiles (hybrid page unification) is k records per head.
    assert spec.copy_with_new_block_size(3 * fmt.group).page_size_bytes == 3 * 8 * tile


def test_qwen3_8b_numbers() -> None:
    spec = KvarnFullAttentionSpec.for_layer(
        cache_dtype="kvarn_k4v2_g128", block_size=128, num_kv_heads=8, head_size=128
    )
    assert spec.tile_bytes == 13_824  # 108 B/token/head: 4.74x fewer than fp16's 512
    assert spec.page_size_bytes == 8 * 13_824


def test_spec_validation_and_merge() -> None:
    with pytest.raises(ValueError, match=r"multiple of 128.*--block-size 128"):
        KvarnFullAttentionSpec.for_layer(
            cache_dtype="kvarn_k4v2_g128", block_size=64, num_kv_heads=2, head_size=128
        )
    a = KvarnFullAttentionSpec.for_layer(
        cache_dtype="kvarn_k4v2_g64", block_size=64, num_kv_heads=2, head_size=128
    )
    merged = KvarnFullAttentionSpec.merge([a, a])
    assert merged == a and merged.page_size_bytes == a.page_size_bytes
    b = KvarnFullAttentionSpec.for_layer(
        cache_dtype="kvarn_k4v4_g64", block_size=64, num_kv_heads=2, head_size=128
    )
    with pytest.raises((ValueError, AssertionError)):
        KvarnFullAttentionSpec.merge([a, b])


def test_hybrid_tile_stride() -> None:
    # Qwen-like D=128: a bf16 sliding page of 65536 B/head is not a multiple of 13824.
    assert hybrid_tile_stride(13_824, 8, [8 * 65_536]) == 16_384
    assert hybrid_tile_stride(13_824, 8, []) == 13_824
    # D=256 (Gemma-like): kvarn-format's pow2 rounding (256 B/token) already divides.
    assert hybrid_tile_stride(32_768, 4, [4 * 131_072]) == 32_768
    with pytest.raises(ValueError, match="skip-layers"):
        hybrid_tile_stride(13_824, 1, [13_825 * 3])


def _attention_layers(config: Any, n: int, sliding: dict[int, int] | None = None) -> list[Any]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    model = config.model_config
    heads = model.get_num_attention_heads(config.parallel_config)
    kv_heads = model.get_num_kv_heads(config.parallel_config)
    head = model.get_head_size()
    with set_current_vllm_config(config):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return [
                Attention(
                    heads,
                    head,
                    head**-0.5,
                    num_kv_heads=kv_heads,
                    cache_config=config.cache_config,
                    per_layer_sliding_window=(sliding or {}).get(i),
                    prefix=f"model.layers.{i}.self_attn.attn",
                )
                for i in range(n)
            ]
        finally:
            torch.set_default_dtype(default)


def test_routing_sends_only_kvarn_layers_to_the_kvarn_backend(kvarn: None, qwen3_dir: Path) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn_vllm.backend import KvarnAttentionBackendG128

    config = _config(qwen3_dir, kv_cache_dtype_skip_layers=["1"])
    layers = _attention_layers(config, 3)
    assert [layer.kv_cache_dtype for layer in layers] == [
        "kvarn_k4v2_g128",
        "auto",
        "kvarn_k4v2_g128",
    ]
    assert layers[0].attn_backend is KvarnAttentionBackendG128
    assert layers[1].attn_backend.get_name() == "CPU_ATTN"
    specs = [layer.get_kv_cache_spec(config) for layer in layers]
    assert isinstance(specs[0], KvarnFullAttentionSpec)
    assert type(specs[1]) is FullAttentionSpec
    assert specs[0].page_size_bytes == 2 * 13_824
    assert specs[1].page_size_bytes == 2 * 128 * 2 * 128 * 2


@pytest.mark.parametrize(
    ("head", "fa4", "cutlass", "uses_fa"),
    [
        (128, False, False, True),
        (256, False, False, True),
        (512, False, True, False),  # FA3 only: no FlashAttention at 512
        (512, True, False, False),  # FA4's file without the cutlass DSL it imports
        (512, True, True, True),
    ],
)
def test_first_chunks_use_flash_attention_only_where_it_takes_the_head_size(
    kvarn: None,
    monkeypatch: pytest.MonkeyPatch,
    head: int,
    fa4: bool,
    cutlass: bool,
    uses_fa: bool,
) -> None:
    """At 512 the impl must fall back to torch SDPA for first chunks and context attention
    unless FA4 can run, not hand FlashAttention a size it fails on."""
    import importlib.util

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import fa_utils, flash_attn

    from kvarn_vllm.backend import KvarnAttentionImpl

    def flash_attn_varlen_func(**kw: Any) -> torch.Tensor:  # never called here
        raise AssertionError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (find_spec("os") if cutlass else None) if name == "cutlass" else find_spec(name, *a)
        ),
    )
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", flash_attn_varlen_func, raising=False)
    monkeypatch.setattr(fa_utils, "is_flash_attn_varlen_func_available", lambda: True)
    monkeypatch.setattr(fa_utils, "get_flash_attn_version", lambda **kw: 4 if head > 256 else 3)
    monkeypatch.setattr(flash_attn, "is_fa_version_supported", lambda v: v == 3 or fa4)
    impl = KvarnAttentionImpl(32, head, head**-0.5, 8, kv_cache_dtype="kvarn_k4v2_g128")
    fa = impl._flash_attn()
    assert (fa is flash_attn_varlen_func) is uses_fa
    assert (fa is None) is not uses_fa
    assert (impl._varlen_attention() is None) is not uses_fa


def test_routing_fails_closed_for_unsupported_layers(kvarn: None, qwen3_dir: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.selector import get_attn_backend

    config = _config(qwen3_dir)
    with set_current_vllm_config(config):
        with pytest.raises(ValueError, match="head_size not supported"):
            get_attn_backend(96, torch.bfloat16, "kvarn_k4v2_g128")
        with pytest.raises(ValueError, match="MLA attention with KVarN is not yet supported"):
            get_attn_backend(576, torch.bfloat16, "kvarn_k4v2_g128", use_mla=True)
        with pytest.raises(
            ValueError, match=r"attention type AttentionType.ENCODER_ONLY not supported"
        ):
            get_attn_backend(
                128, torch.bfloat16, "kvarn_k4v2_g128", attn_type=AttentionType.ENCODER_ONLY
            )
        with pytest.raises(ValueError, match="attention sinks not supported"):
            get_attn_backend(128, torch.bfloat16, "kvarn_k4v2_g128", has_sink=True)


@pytest.mark.parametrize(
    ("direct", "shadow"),
    [("1", "1"), ("0", "1"), ("1", "0")],
    ids=["direct", "pool", "whole_tile_slots"],
)
def test_get_kv_cache_configs_charges_the_side_pool(
    kvarn: None,
    qwen3_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    direct: str,
    shadow: str,
) -> None:
    import vllm.v1.engine.core as core
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn_vllm.budget import reservation_for_worker

    monkeypatch.setenv("KVARN_DIRECT_FLUSH", direct)
    monkeypatch.setenv("KVARN_SHADOW_ROWS", shadow)
    config = _config(qwen3_dir)
    kv = {
        f"model.layers.{i}.self_attn.attn": KvarnFullAttentionSpec.for_layer(
            cache_dtype="kvarn_k4v2_g128", block_size=128, num_kv_heads=8, head_size=128
        )
        for i in range(36)
    }
    available = 8 << 30
    res = reservation_for_worker(config, kv, available)
    assert res is not None
    slots = side_pool_slots(
        SidePool("dense", 128, 0),
        ServingConfig(
            max_model_len=4096,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            direct_flush=direct == "1",
        ),
    )
    # Direct flush drops format-spec §4.3's ceil(T/G) prefill-chunk term.
    assert slots == 2 * 64 + 8 + (0 if direct == "1" else 2048 // 128)
    assert res.pool_slots == slots
    # A slot holds 128 tile rows, or 101 with shadow rows (13,824 // (4 * 128) = 27 of them
    # live in the block's record area).
    rows = 101 if shadow == "1" else 128
    assert res.pool_bytes == slots * 2 * rows * 8 * 128 * 2 * 36
    assert res.workspace_bytes > 0 and res.table_bytes > 0

    with caplog.at_level(logging.INFO, logger="vllm.kvarn"):
        (cfg,) = core.get_kv_cache_configs(config, [kv], [available])
    page = 8 * 13_824
    assert cfg.num_blocks == (available - res.total_bytes) // (36 * page)
    assert any("KV cache capacity" in r.getMessage() for r in caplog.records)
    assert f"{cfg.num_blocks * 128:,} tokens" in caplog.text

    # KVarN layers and full-precision skip layers share one group with per-layer pages.
    mixed = dict(kv)
    mixed["model.layers.0.self_attn.attn"] = FullAttentionSpec(
        block_size=128, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    res_mixed = reservation_for_worker(config, mixed, available)
    assert res_mixed is not None and res_mixed.kvarn_layers == 35
    (cfg,) = core.get_kv_cache_configs(config, [mixed], [available])
    assert len(cfg.kv_cache_groups) == 1
    per_block = 35 * page + 2 * 128 * 8 * 128 * 2
    assert cfg.num_blocks == (available - res_mixed.total_bytes) // per_block


def test_budget_too_small_fails_closed(kvarn: None, qwen3_dir: Path) -> None:
    import vllm.v1.engine.core as core

    config = _config(qwen3_dir)
    kv = {
        "model.layers.0.self_attn.attn": KvarnFullAttentionSpec.for_layer(
            cache_dtype="kvarn_k4v2_g128", block_size=128, num_kv_heads=8, head_size=128
        )
    }
    with pytest.raises(ValueError, match=r"side pool .* leave nothing .*--max-num-seqs"):
        core.get_kv_cache_configs(config, [kv], [1 << 20])


def test_hybrid_sliding_window_model_gets_unifiable_pages(kvarn: None, tmp_path: Path) -> None:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    from kvarn_vllm.testing import TINY_QWEN3, write_model_dir

    model = write_model_dir(tmp_path / "m", {**TINY_QWEN3, "head_dim": 256})
    config = _config(model)
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    layers = _attention_layers(config, 4, sliding={1: 512, 3: 512})
    assert [layer.kv_cache_dtype for layer in layers] == [
        "kvarn_k4v2_g128",
        "auto",
        "kvarn_k4v2_g128",
        "auto",
    ]
    specs = {layer.layer_name: layer.get_kv_cache_spec(config) for layer in layers}
    kv0 = specs["model.layers.0.self_attn.attn"]
    assert isinstance(kv0, KvarnFullAttentionSpec)
    fmt = parse_cache_dtype("kvarn_k4v2_g128")
    assert kv0.tile_stride == record_layout(fmt, 256, slot_rounding="pow2").tile_bytes
    groups = get_kv_cache_groups(config, dict(specs))
    assert len(groups) == 2
    sizes = {g.kv_cache_spec.page_size_bytes for g in groups}
    assert len(sizes) == 1, "vLLM could not unify the page sizes"


def _batch(qsl: list[int], seq: list[int], max_blocks: int) -> CommonAttentionMetadata:
    """vLLM's metadata of a CPU batch with query offsets ``qsl`` and lengths ``seq`` (zeroed
    block table and slot mapping)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = qsl[-1]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        num_reqs=len(seq),
        num_actual_tokens=n,
        max_query_len=max(b - a for a, b in itertools.pairwise(qsl)),
        max_seq_len=max(seq),
        block_table_tensor=torch.zeros((len(seq), max_blocks), dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
    )


def test_capture_build_applies_no_side_pool_work(kvarn: None, qwen3_dir: Path) -> None:
    from kvarn_vllm.backend import KvarnMetadataBuilder
    from kvarn_vllm.tracker import NewRequest, StepInput

    config = _config(qwen3_dir)
    config.cache_config.num_gpu_blocks = 8
    layers = _attention_layers(config, 1)
    spec = layers[0].get_kv_cache_spec(config)
    layers[0].kv_cache = torch.zeros((8, 2, spec.tile_stride), dtype=torch.uint8)
    builder = KvarnMetadataBuilder(spec, [layers[0].layer_name], config, torch.device("cpu"))
    rt = builder.runtime
    assert rt.num_slots == 2 * 64 + 8
    from kvarn_vllm.tracker import SidePoolTracker

    rt.tracker = SidePoolTracker(rt.num_slots, 128)
    rt.group_id = 0
    rt.tracker.step(StepInput(new=[NewRequest("a", [1], 0)], num_scheduled={"a": 3}))
    cam = _batch([0, 1], [1], 32)
    # Direct tiles pending for this step never reach a capture build nor a batch of single
    # tokens (the batches FULL CUDA graphs replay).
    rt._direct_host = ([2], [-1], [0])
    meta = builder.build_for_cudagraph_capture(cam)
    assert meta.num_decodes == 1 and not meta.prefill_runs and meta.direct is None
    assert int(meta.block_to_slot[1]) == -1, "capture must not apply queued plans"
    assert meta.runtime.decode_workspace is not None
    # the decode rows' launches are prepared once for the layers: the runner's own tensors
    # (what the graph replays) and the fixed workspace and plan the runtime picked
    decode = meta.decode_batch_plan
    assert decode is not None and decode.block_to_slot is meta.block_to_slot
    assert decode.block_table.data_ptr() == cam.block_table_tensor.data_ptr()
    assert decode.seq_lens.data_ptr() == cam.seq_lens.data_ptr()
    assert decode._workspace is meta.runtime.decode_workspace
    chosen = rt.decode_plan(1)
    assert (decode.variant, decode.num_splits) == (chosen.variant, chosen.num_splits)
    meta = builder.build(0, cam)
    assert int(meta.block_to_slot[1]) == rt.tracker.slot_of(1)
    assert meta.direct is None


def test_kv_cache_update_prepares_the_pool_write_once_a_step(kvarn: None, qwen3_dir: Path) -> None:
    """``do_kv_cache_update`` makes the step's side-pool write plan on the first layer, for
    the slot mapping vLLM passes it, and the other layers given that tensor replay it; each
    layer's pool then holds what an unplanned ``write_side_pool`` writes. A step passing
    another slot mapping gets a plan of its own."""
    from vllm.forward_context import set_forward_context

    from kvarn_kernels import write_side_pool
    from kvarn_vllm.backend import KvarnMetadataBuilder
    from kvarn_vllm.tracker import NewRequest, SidePoolTracker, StepInput

    config = _config(qwen3_dir)
    config.cache_config.num_gpu_blocks = 8
    layers = _attention_layers(config, 2)
    spec = layers[0].get_kv_cache_spec(config)
    for layer in layers:
        layer.kv_cache = torch.zeros((8, spec.num_kv_heads, spec.tile_stride), dtype=torch.uint8)
    shape = (3, spec.num_kv_heads, spec.head_size)
    names = [layer.layer_name for layer in layers]
    builder = KvarnMetadataBuilder(spec, names, config, torch.device("cpu"))
    rt = builder.runtime
    rt.tracker = SidePoolTracker(rt.num_slots, 128)
    rt.group_id = 0
    rt.tracker.step(StepInput(new=[NewRequest("a", [1], 0)], num_scheduled={"a": 3}))
    meta = builder.build(0, _batch([0, 3], [3], 32))
    gen = torch.Generator().manual_seed(3)
    steps: list[object] = []
    for _ in range(2):
        slots = torch.tensor([128, 129, 250], dtype=torch.int64)  # block 1: shadow rows, pool
        plans = []
        with set_forward_context(dict.fromkeys(names, meta), config):
            for layer in layers:
                key = torch.randn(shape, generator=gen).to(torch.bfloat16)
                value = torch.randn(shape, generator=gen).to(torch.bfloat16)
                pools = rt.pools_for(layer.layer_name)
                want_k, want_v = pools.k.clone(), pools.v.clone()
                want_kv = layer.kv_cache.clone()
                write_side_pool(
                    key, value, want_k, want_v, slots, meta.block_to_slot,
                    kv_cache=want_kv, group=128,
                )  # fmt: skip
                layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slots)
                assert torch.equal(pools.k, want_k) and torch.equal(pools.v, want_v)
                assert torch.equal(layer.kv_cache, want_kv)
                assert bool((pools.k != 0).any()), "a token went to the pool"
                assert bool((layer.kv_cache[1] != 0).any()), "two went to the record area"
                plans.append(meta.pool_write_plan)
        assert plans[0] is not None and plans[0] is plans[1]
        assert plans[0].slot_mapping is slots and plans[0].block_to_slot is meta.block_to_slot
        steps.append(plans[0])
    assert steps[0] is not steps[1], "another slot mapping: another plan"


def test_capture_of_multi_token_batches_is_the_uniform_verify_run(
    kvarn: None, qwen3_dir: Path
) -> None:
    """A FULL capture of a multi-token batch must be the uniform verify run (its tensors the
    runner's own, replayed every step); anything else is a loud error, not a graph replayed
    on copies made at capture time."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir)
    config.cache_config.num_gpu_blocks = 8
    (layer,) = _attention_layers(config, 1)
    spec = layer.get_kv_cache_spec(config)
    layer.kv_cache = torch.zeros((8, 2, spec.tile_stride), dtype=torch.uint8)
    builder = KvarnMetadataBuilder(spec, [layer.layer_name], config, torch.device("cpu"))
    rt = builder.runtime
    uniform = _batch([0, 4, 8, 8], [4, 4, 0], 32)  # two requests of 4 tokens, one padding
    with pytest.raises(RuntimeError, match="not a uniform verify batch"):
        builder.build_for_cudagraph_capture(uniform)  # verify graphs off
    rt.verify_width, rt.verify_graphs = 4, True
    uniform.num_actual_tokens = 12  # the padding request's share of the padded tokens
    meta = builder.build_for_cudagraph_capture(uniform)
    (run,) = meta.prefill_runs
    assert run.kind == "verify" and run.tok_end == 12 and meta.num_decodes == 0
    assert run.verify_block_table.data_ptr() == uniform.block_table_tensor.data_ptr()
    # the run's kvarn-kernels plan: its own tensors, the runtime's workspace and split count
    plan = run.verify_plan
    assert plan is not None and plan.block_table is run.verify_block_table
    assert plan.query_start_loc is run.cu_seqlens and plan.seq_lens is run.verify_seq_lens
    assert plan.block_to_slot is meta.block_to_slot and plan.max_query_len == 4
    assert plan._workspace is rt.decode_workspace
    assert plan.num_splits == rt.verify_plan(run.req_end).num_splits
    with pytest.raises(RuntimeError, match="not a uniform verify batch"):
        builder.build_for_cudagraph_capture(_batch([0, 4, 6], [9, 6], 32))


def test_context_runs_carry_one_plan_for_all_layers(kvarn: None, qwen3_dir: Path) -> None:
    """The builder plans each continuation run once (kvarn-kernels' ``ContextPlan``, or its
    ``FusedPrefillPlan`` for a run on the fused kernel, shared by the layers); first chunks
    attend to their own K/V and carry none."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir)
    spec = _attention_layers(config, 1)[0].get_kv_cache_spec(config)
    # rows: one decode, a first chunk of 5, two continuations (3 after 200, 2 after 7)
    qsl = [0, 1, 6, 9, 11]
    seq = [40, 5, 203, 9]
    cam = _batch(qsl, seq, 4)
    first, context = KvarnMetadataBuilder._prefill_runs(cam, 1, spec)
    assert (first.kind, first.req_start, first.req_end, first.context_plan) == ("first", 1, 2, None)
    assert (context.kind, context.req_start, context.req_end) == ("context", 2, 4)
    plan = context.context_plan
    assert plan is not None
    assert plan.seq_lens == (203, 9) and plan.query_start_loc == (0, 3, 5)
    assert (plan.group, plan.num_kv_heads, plan.head_dim) == (
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
    )
    assert plan.max_blocks == 2 and len(plan.groups) == 1
    grp = plan.groups[0]
    assert grp.rows == 212 and grp.blocks is not None and grp.cu_seqlens is not None
    assert grp.cu_seqlens.tolist() == [[0, 3, 5], [0, 203, 212]]
    assert context.context_method == "dequant"
    # a run the fused kernel takes (the method is asked once, with the run's longest query)
    # carries no plan
    asked: list[int] = []

    def fused(max_query_len: int) -> str:
        asked.append(max_query_len)
        return "fused"

    _, context = KvarnMetadataBuilder._prefill_runs(cam, 1, spec, context_method=fused)
    assert (context.context_method, context.context_plan, asked) == ("fused", None, [3])
    assert context.fused_plan is None  # no block-to-slot map to plan with
    # with the cache's block-to-slot map, the fused run carries its plan: the run's rows
    table = torch.full((8,), -1, dtype=torch.int32)
    _, context = KvarnMetadataBuilder._prefill_runs(
        cam, 1, spec, context_method=fused, block_to_slot=table
    )
    fused_plan = context.fused_plan
    assert fused_plan is not None and context.context_plan is None
    assert fused_plan.block_to_slot is table
    assert torch.equal(fused_plan.block_table, cam.block_table_tensor[2:4])
    assert fused_plan.query_start_loc.tolist() == [0, 3, 5]
    assert fused_plan.seq_lens.tolist() == [203, 9]


def test_verify_rows_are_verify_runs(kvarn: None, qwen3_dir: Path) -> None:
    """Speculative verify rows (past the prompt, at most 1 + drafts tokens) become ``verify``
    runs, carrying their own block-table rows and device lengths, with no host plan; rows still
    in their prompt stay planned ``context`` runs. Under async scheduling vLLM's host lengths
    of verify rows are optimistic, so without ``is_prefilling`` every short continuation is
    a verify run there, and none is when the host lengths are exact."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir)
    spec = _attention_layers(config, 1)[0].get_kv_cache_spec(config)
    # rows: a decode, a prompt continuation (3 after 200), two verify rows (4 tokens each)
    cam = _batch([0, 1, 4, 8, 12], [40, 203, 60, 90], 4)
    cam.block_table_tensor = torch.arange(16, dtype=torch.int32).view(4, 4)
    cam.is_prefilling = torch.tensor([False, True, False, False])

    def runs(**kw: Any) -> list[Any]:
        return KvarnMetadataBuilder._prefill_runs(cam, 1, spec, **kw)

    for exact in (True, False):
        context, verify = runs(verify_width=4, exact_host_lens=exact)
        assert [(r.kind, r.req_start, r.req_end) for r in (context, verify)] == [
            ("context", 1, 2),
            ("verify", 2, 4),
        ]
        assert context.context_plan is not None and verify.context_plan is None
        # the run's rows (device lengths: vLLM's, not the host upper bounds), in fresh
        # tensors (a slice from row 2 would start 8 bytes past an aligned address)
        assert verify.verify_seq_lens is not None and verify.verify_block_table is not None
        assert verify.verify_seq_lens.tolist() == [60, 90]
        assert torch.equal(verify.verify_block_table, cam.block_table_tensor[2:4])
        assert verify.verify_seq_lens.data_ptr() != cam.seq_lens[2:].data_ptr()
        assert verify.cu_seqlens.tolist() == [0, 4, 8]
    # no drafts (verify width 0), or rows wider than a verify: planned continuations
    for width in (0, 3):
        (run,) = runs(verify_width=width)
        assert (run.kind, run.req_start, run.req_end) == ("context", 1, 4)
        assert run.context_plan is not None
    # without is_prefilling: short continuations are verify runs only when the host lengths
    # may be optimistic
    cam.is_prefilling = None
    (run,) = runs(verify_width=4, exact_host_lens=False)
    assert (run.kind, run.context_plan) == ("verify", None)
    (run,) = runs(verify_width=4)
    assert run.kind == "context"


@pytest.mark.parametrize("async_drafts", [False, True])
def test_runtime_knows_the_verify_width_and_async_drafts(
    kvarn: None, qwen3_dir: Path, async_drafts: bool
) -> None:
    """The builder's verify rows are 1 + drafts tokens wide, and the runtime knows when
    vLLM schedules asynchronously with drafts (host lengths of verify rows then optimistic).
    The CPU platform turns async scheduling off; on a GPU vLLM keeps it on by default for
    EAGLE and GPU n-gram drafts, set here by hand."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(
        qwen3_dir,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    config.scheduler_config.async_scheduling = async_drafts
    config.cache_config.num_gpu_blocks = 8
    layers = _attention_layers(config, 1)
    spec = layers[0].get_kv_cache_spec(config)
    rt = KvarnMetadataBuilder(spec, [layers[0].layer_name], config, torch.device("cpu")).runtime
    assert rt.verify_width == 4
    assert rt.spec_margin == (3 if async_drafts else 0)


def test_profiling_kv_cache_gets_a_one_slot_pool(kvarn: None, qwen3_dir: Path) -> None:
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir)
    assert config.cache_config.num_gpu_blocks is None
    layers = _attention_layers(config, 1)
    spec = layers[0].get_kv_cache_spec(config)
    builder = KvarnMetadataBuilder(spec, [layers[0].layer_name], config, torch.device("cpu"))
    assert builder.runtime.profiling and builder.runtime.num_slots == 1


def test_direct_flush_setting(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.config import CompilationMode

    from kvarn_vllm.budget import direct_flush_setting, serving_limits

    config = _config(qwen3_dir)
    assert direct_flush_setting(config) == (True, "")
    monkeypatch.setenv("KVARN_DIRECT_FLUSH", "0")
    on, why = direct_flush_setting(config)
    assert not on and "KVARN_DIRECT_FLUSH" in why
    assert not serving_limits(config).serving_config().direct_flush
    monkeypatch.setenv("KVARN_DIRECT_FLUSH", "maybe")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        direct_flush_setting(config)
    monkeypatch.setenv("KVARN_DIRECT_FLUSH", "1")
    # Micro-batching splits a step over several builds: off.
    config.parallel_config.ubatch_size = 2
    assert direct_flush_setting(config)[0] is False
    config.parallel_config.ubatch_size = 0
    # vLLM compilation that keeps the KV-cache update inside the (capturable) graph pieces.
    comp = config.compilation_config
    comp.mode = CompilationMode.VLLM_COMPILE
    comp.splitting_ops = ["vllm::unified_attention_with_output"]
    on, why = direct_flush_setting(config)
    assert not on and "unified_kv_cache_update" in why
    comp.splitting_ops.append("vllm::unified_kv_cache_update")
    comp.splitting_ops.append("vllm::unified_mla_kv_cache_update")
    assert direct_flush_setting(config)[0] is True


def test_verify_graphs_setting_and_cudagraph_support(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uniform verify batches are FULL CUDA graphs (``UNIFORM_BATCH``) with drafts unless
    ``KVARN_VERIFY_CUDA_GRAPHS=0``; otherwise single-token decode graphs (vLLM then runs an
    engine with drafts on piecewise graphs). A typo fails closed."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from kvarn_vllm.backend import KvarnMetadataBuilder
    from kvarn_vllm.budget import verify_graphs_setting

    config = _config(qwen3_dir)
    spec = _attention_layers(config, 1)[0].get_kv_cache_spec(config)

    def support() -> AttentionCGSupport:
        return KvarnMetadataBuilder.get_cudagraph_support(config, spec)

    single = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.delenv("KVARN_VERIFY_CUDA_GRAPHS", raising=False)
    assert verify_graphs_setting(3) and not verify_graphs_setting(0)
    assert support() is single  # no drafts configured
    config.speculative_config = SimpleNamespace(num_speculative_tokens=3)  # type: ignore[assignment]
    assert support() is AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setenv("KVARN_VERIFY_CUDA_GRAPHS", "0")
    assert support() is single and not verify_graphs_setting(3)
    monkeypatch.setenv("KVARN_VERIFY_CUDA_GRAPHS", "1")
    assert support() is AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setenv("KVARN_VERIFY_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        verify_graphs_setting(3)


def _serving_builder(
    qwen3_dir: Path, dtype: str = "kvarn_k4v2_g128", num_blocks: int = 8, num_layers: int = 1
) -> Any:
    """The metadata builder (and its runtime) of ``num_layers`` KVarN layers once the KV cache
    is sized, on the CPU; a fresh engine config each call, so a fresh runtime."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir, dtype)
    config.cache_config.num_gpu_blocks = num_blocks
    layers = _attention_layers(config, num_layers)
    spec = layers[0].get_kv_cache_spec(config)
    names = [layer.layer_name for layer in layers]
    return KvarnMetadataBuilder(spec, names, config, torch.device("cpu"))


def test_shadow_rows_setting_sizes_the_pool_slots(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On by default (a k4v2_g64 slot at head 128 keeps 64 - 7,296 // 512 = 50 rows), off
    with KVARN_SHADOW_ROWS=0 (whole tiles), and a typo fails closed."""
    from kvarn_vllm.budget import serving_limits, shadow_rows_setting

    for env, rows in (("1", 50), ("0", 64)):
        monkeypatch.setenv("KVARN_SHADOW_ROWS", env)
        builder = _serving_builder(qwen3_dir, "kvarn_k4v2_g64", num_blocks=16)
        rt = builder.runtime
        assert serving_limits(rt.vllm_config).shadow_rows is (env == "1")
        pools = rt.pools_for(rt.layer_names[0])
        assert tuple(pools.k.shape[1:]) == (rows, rt.num_kv_heads, 128)
        assert rt.slot_bytes == 2 * rows * rt.num_kv_heads * 128 * 2
    monkeypatch.setenv("KVARN_SHADOW_ROWS", "sometimes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        shadow_rows_setting()


@pytest.mark.parametrize("shadow", ["1", "0"])
def test_the_charged_pool_is_the_allocated_pool(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, shadow: str
) -> None:
    """The engine charges (patch P5) exactly the bytes the worker's runtime allocates for its
    side pools: more would waste KV capacity, less would over-commit the GPU."""
    from kvarn_vllm.budget import reservation_for_worker

    monkeypatch.setenv("KVARN_SHADOW_ROWS", shadow)
    builder = _serving_builder(qwen3_dir, "kvarn_k4v4_g128", num_blocks=16, num_layers=3)
    rt = builder.runtime
    specs = dict.fromkeys(rt.layer_names, builder.kv_cache_spec)
    res = reservation_for_worker(rt.vllm_config, specs, 1 << 30)
    assert res is not None
    allocated = sum(p.k.nbytes + p.v.nbytes for p in rt.pools.values())
    assert res.pool_slots == rt.num_slots
    assert allocated == res.pool_bytes


def test_verify_graphs_share_the_charged_decode_workspace(kvarn: None, qwen3_dir: Path) -> None:
    """With uniform verify graphs the verify passes run in the decode workspace (nothing is
    allocated inside a graph capture): the worker sizes it for both, and the engine's charge
    (an upper bound over GPUs of up to MAX_SMS_BOUND SMs) still covers it."""
    from kvarn_vllm.budget import decode_workspace_bytes

    rt = _serving_builder(qwen3_dir).runtime
    shape = (rt.max_num_seqs, rt.num_q_heads, rt.num_kv_heads, rt.head_size, rt.max_blocks)
    decode_only = 4 * rt.decode_workspace_numel(rt.max_num_seqs)
    assert decode_workspace_bytes(*shape) >= decode_only
    rt.verify_graphs, rt.verify_width = True, 4
    both = 4 * rt.decode_workspace_numel(rt.max_num_seqs)
    assert both > decode_only, "the verify passes need more rows than decode"
    assert decode_workspace_bytes(*shape, verify_width=4) >= both


def test_five_bit_verify_rows_on_v7f_fit_the_charged_workspace(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``"auto"`` decodes ``kvarn_k5v5_g64`` on v7f (an H200, faked here), its uniform
    verify batches run on v7f, a request's 4 tokens in one program (GQA 2): the worker's
    plan says so (v7f's decode plan for as many rows as programs), its workspace holds the
    plan's extra partial for every batch, and the engine's charge still bounds it."""
    from kvarn_kernels import attention
    from kvarn_vllm.budget import decode_workspace_bytes

    rt = _serving_builder(qwen3_dir, "kvarn_k5v5_g64").runtime
    rt.verify_graphs, rt.verify_width = True, 4
    assert rt.verify_plan(8).variant == "v1"  # a CPU
    monkeypatch.setattr(attention, "_gluon_timed_on", lambda device: True)
    monkeypatch.setattr(attention, "triton_interpret", lambda: False)  # nothing is launched
    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    assert rt.num_q_heads == 2 * rt.num_kv_heads  # GQA 2: 4 tokens fill a program's 8 columns
    for batch in (1, 2, 8, rt.max_num_seqs):
        plan = rt.verify_plan(batch)
        assert plan.variant == "v7f"
        assert plan == attention.decode_plan(
            "kvarn_k5v5_g64",
            batch,  # one program a request
            rt.num_q_heads,
            rt.num_kv_heads,
            rt.head_size,
            rt.max_blocks,
            rt.device,
        )
    shape = (rt.max_num_seqs, rt.num_q_heads, rt.num_kv_heads, rt.head_size, rt.max_blocks)
    need = 4 * rt.decode_workspace_numel(rt.max_num_seqs)
    assert decode_workspace_bytes(*shape, verify_width=4) >= need


def test_decode_kernel_setting_reaches_the_workspace_and_fails_closed(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVARN_DECODE_VARIANT`` / ``KVARN_DECODE_MMA_ROWS`` pick the decode kernel; v4d's
    extra partial is in the worker's workspace and in the engine's charge, and values the
    kernels do not take fail at start-up."""
    from kvarn_vllm.budget import decode_kernel_setting, decode_workspace_bytes

    assert decode_kernel_setting() == ("auto", None)
    base = _serving_builder(qwen3_dir).runtime
    shape = (base.max_num_seqs, base.num_q_heads, base.num_kv_heads, base.head_size)
    plain = 4 * base.decode_workspace_numel(base.max_num_seqs)
    monkeypatch.setenv("KVARN_DECODE_VARIANT", "v4d")
    monkeypatch.setenv("KVARN_DECODE_MMA_ROWS", "8")
    assert decode_kernel_setting() == ("v4d", 8)
    rt = _serving_builder(qwen3_dir).runtime
    assert (rt.decode_variant, rt.decode_mma_rows) == ("v4d", 8)
    with_pool = 4 * rt.decode_workspace_numel(rt.max_num_seqs)
    assert with_pool > plain, "v4d writes one partial more per request"
    assert decode_workspace_bytes(*shape, rt.max_blocks, decode_variant="v4d") >= with_pool
    for variant, rows, message in (
        ("v9", "", "KVARN_DECODE_VARIANT must be 'auto' or one of"),
        ("v4c", "12", "KVARN_DECODE_MMA_ROWS must be 4, 8 or 16"),
        ("v1", "8", "KVARN_DECODE_MMA_ROWS applies to the variants"),
    ):
        monkeypatch.setenv("KVARN_DECODE_VARIANT", variant)
        monkeypatch.setenv("KVARN_DECODE_MMA_ROWS", rows)
        with pytest.raises(ValueError, match=message):
            _serving_builder(qwen3_dir)


def test_prefill_context_setting_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVARN_PREFILL_CONTEXT`` picks the continuation chunks' prefill method (default
    ``dequant``); a value kvarn-kernels does not take raises at start-up, naming the choices."""
    from kvarn_vllm.budget import prefill_context_setting

    monkeypatch.delenv("KVARN_PREFILL_CONTEXT", raising=False)
    assert prefill_context_setting() == "dequant"
    for raw, want in (
        ("fused", "fused"),
        (" Fused ", "fused"),
        ("auto", "auto"),
        ("dequant", "dequant"),
        ("", "dequant"),
    ):
        monkeypatch.setenv("KVARN_PREFILL_CONTEXT", raw)
        assert prefill_context_setting() == want
    monkeypatch.setenv("KVARN_PREFILL_CONTEXT", "v3")
    with pytest.raises(ValueError, match="KVARN_PREFILL_CONTEXT must be one of"):
        prefill_context_setting()


def test_gluon_decode_plans_reach_the_workspace_the_charge_and_the_log(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``variant="auto"`` picks the Gluon kernels (v6f at Qwen3's 4 query heads per KV
    head on an H200, faked here), the worker's decode plan runs v6f at its split count (three
    times the rule's from 8 requests), its workspace holds the extra partial, the engine's
    charge (decode_workspace_bytes) still bounds it, and the start-up log's summary names
    it."""
    from kvarn_kernels import attention
    from kvarn_vllm.budget import decode_workspace_bytes

    base = _serving_builder(qwen3_dir).runtime
    plain = 4 * base.decode_workspace_numel(base.max_num_seqs)
    assert base.decode_plan(64).variant == "v4c"  # a CPU
    monkeypatch.setattr(attention, "_v5_serves", lambda geo, qpk, device: True)
    monkeypatch.setattr(attention, "triton_interpret", lambda: False)  # nothing is launched
    rt = _serving_builder(qwen3_dir).runtime
    assert rt.decode_plan(1).variant == "v6f"
    plan = rt.decode_plan(64)
    assert plan.variant == "v6f"  # Qwen3: 4 query heads per KV head
    top = rt.max_num_seqs
    assert rt.decode_kernels_by_batch() == f"v6f for B = 1-{top}"
    assert base.decode_kernels_by_batch() == f"v4c for B = 1-{top}"  # a CPU
    assert plan.num_splits == 3 * base.decode_plan(64).num_splits  # one-warp programs
    with_v5 = 4 * rt.decode_workspace_numel(rt.max_num_seqs)
    assert with_v5 > plain
    shape = (rt.max_num_seqs, rt.num_q_heads, rt.num_kv_heads, rt.head_size, rt.max_blocks)
    assert decode_workspace_bytes(*shape) >= with_v5


def test_decode_mma_rows_below_the_gqa_group_fail_at_start_up(
    kvarn: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvarn_vllm.testing import TINY_QWEN3, write_model_dir

    gqa8 = write_model_dir(
        tmp_path / "m", {**TINY_QWEN3, "num_attention_heads": 16, "num_key_value_heads": 2}
    )
    monkeypatch.setenv("KVARN_DECODE_MMA_ROWS", "4")
    with pytest.raises(ValueError, match="KVARN_DECODE_MMA_ROWS=4 is below this model's 8"):
        _serving_builder(gqa8)


def test_direct_tiles_rows_come_from_the_slot_mapping(kvarn: None, qwen3_dir: Path) -> None:
    """The device derivation of each direct tile's first new row, without a host sync."""
    from kvarn_vllm.backend import KvarnMetadataBuilder

    config = _config(qwen3_dir, "kvarn_k4v2_g64")
    config.cache_config.num_gpu_blocks = 16
    layers = _attention_layers(config, 1)
    spec = layers[0].get_kv_cache_spec(config)
    layers[0].kv_cache = torch.zeros((16, 2, spec.tile_stride), dtype=torch.uint8)
    builder = KvarnMetadataBuilder(spec, [layers[0].layer_name], config, torch.device("cpu"))
    rt = builder.runtime
    g = 64
    # Rows: one decode token of block 9, then a chunk of positions 104..263 over blocks 3
    # (positions 104..127; 40 earlier rows in the pool), 5 (128..191), 7 (192..255) and 11
    # (256..263), then padding.
    slots = [9 * g + 17]
    blocks = [2, 3, 5, 7, 11]
    slots += [blocks[p // g] * g + p % g for p in range(104, 264)]
    slots += [-1, -1]
    sm = torch.tensor(slots, dtype=torch.int64)
    # Plan: 3 opens with 40 pool rows (slot 4); 5 and 7 are whole; 13 is not in this build.
    rt._direct_host = ([3, 5, 7, 13], [4, -1, -1, -1], [40, 0, 0, 0])
    rt._direct_dev = None
    tiles = rt.direct_tiles(sm, len(slots) - 2)
    assert tiles is not None and tiles.count == 4
    assert tiles.row_starts.tolist() == [1, 1 + 24, 1 + 24 + 64, -1]
    assert tiles.head_lens.tolist() == [40, 0, 0, 0]
    # A later build of the same step that holds only part of tile 7 skips it (and the rest).
    part = sm[:100]
    tiles = rt.direct_tiles(part, 100)
    assert tiles is not None and tiles.row_starts.tolist() == [1, 25, -1, -1]
    # The scheduler counted three tokens more than the worker writes (async scheduling with
    # drafts): the step's tokens of block 3 start at offset 37, so those rows come from the
    # step and only 37 from the pool; the other tiles keep their rows.
    early = [9 * g + 17] + [blocks[p // g] * g + p % g for p in range(101, 261)]
    tiles = rt.direct_tiles(torch.tensor(early, dtype=torch.int64), len(early))
    assert tiles is not None
    assert tiles.head_lens.tolist() == [37, 0, 0, 0]
    assert tiles.row_starts.tolist() == [1, 1 + 27, 1 + 27 + 64, -1]
    # No direct tiles this step: nothing to do.
    rt._direct_host = None
    assert rt.direct_tiles(sm, len(slots) - 2) is None


def test_runtime_warms_up_the_prefill_kernels_with_its_geometry(
    kvarn: None, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the serving runtime compiles the prefill-side kernels at start-up with the
    layer geometry (per rank) and the model dtype; on a CPU it skips the warm-up."""
    import kvarn_kernels

    calls: list[dict[str, object]] = []

    def fake_warmup(fmt: object, **kw: object) -> int:
        calls.append({"fmt": fmt, **kw})
        return 7

    monkeypatch.setattr(kvarn_kernels, "warmup", fake_warmup)
    builder = _serving_builder(qwen3_dir)
    assert calls == [], "no warm-up on a CPU"
    builder.runtime._warm_up_kernels(torch.bfloat16)
    (call,) = calls
    assert call["fmt"] is builder.runtime.fmt
    # the fixture's small Qwen3: 4 query heads, 2 KV heads, head_dim 128
    assert (call["head_dim"], call["num_q_heads"], call["num_kv_heads"]) == (128, 4, 2)
    assert call["dtype"] == torch.bfloat16 and call["device"] == torch.device("cpu")
    # ...and the pool and cache geometry the kernels specialize on: shadow rows and stride.
    rt = builder.runtime
    assert call["shadow_rows"] == rt.group - rt.pool_rows > 0
    assert call["record_stride"] == rt.layout.tile_bytes  # not a hybrid model: unpadded


@pytest.mark.parametrize(
    ("context", "v3_serves", "expected"),
    [("dequant", True, 0), ("auto", False, 0), ("auto", True, 64), ("fused", False, "budget")],
)
def test_runtime_warms_up_the_fused_prefill_it_may_run(
    kvarn: None,
    qwen3_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    context: str,
    v3_serves: bool,
    expected: int | str,
) -> None:
    """The warm-up compiles the fused prefill for the chunks the server sends it: none with
    ``dequant`` (or ``auto`` where the Gluon kernel does not run), chunks of up to
    ``FUSED_PREFILL_MAX_QUERY`` tokens with ``auto``, any within the step's token budget
    with ``fused``."""
    import kvarn_kernels

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kvarn_kernels, "warmup", lambda fmt, **kw: calls.append(kw) or 1)
    monkeypatch.setattr(
        kvarn_kernels,
        "prefill_method",
        lambda fmt, d, max_query_len, dev: (
            "fused" if v3_serves and max_query_len <= 64 else "dequant"
        ),
    )
    monkeypatch.setenv("KVARN_PREFILL_CONTEXT", context)
    rt = _serving_builder(qwen3_dir).runtime
    rt._warm_up_kernels(torch.float16)
    (call,) = calls
    budget = rt.max_num_batched_tokens
    assert call["max_num_batched_tokens"] == budget > 64
    assert call["fused_prefill_max_query"] == (budget if expected == "budget" else expected)


def test_a_failing_warmup_is_logged_not_fatal(
    kvarn: None,
    qwen3_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import kvarn_kernels

    def broken_warmup(fmt: object, **kw: object) -> int:
        raise RuntimeError("scratch launch failed")

    monkeypatch.setattr(kvarn_kernels, "warmup", broken_warmup)
    builder = _serving_builder(qwen3_dir)
    with caplog.at_level(logging.WARNING, logger="vllm.kvarn"):
        builder.runtime._warm_up_kernels(torch.float16)
    assert "kernel warm-up failed (RuntimeError: scratch launch failed)" in caplog.text
