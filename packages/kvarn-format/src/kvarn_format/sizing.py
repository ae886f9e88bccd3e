"""KV budget sizing: how many cache blocks, tokens and max-length requests fit on a GPU.

The solver mirrors how vLLM 0.23 sizes its KV cache, then adds what KVarN needs besides the
paged blocks, all in one budget per worker (one tensor-parallel rank):

1. ``requested = ceil(total_gpu_memory * gpu_memory_utilization)`` (vLLM ``request_memory``).
2. ``available = requested - weights - activation peak - CUDA-graph/non-torch overhead``
   (vLLM ``Worker.determine_available_memory``). Weights come from :mod:`kvarn_format.weights`
   unless given; the rest from :func:`estimate_overhead` unless given.
3. From ``available`` KVarN takes, before any block is counted:

   * the **side pool**: per quantized layer, ``POOL`` fp16 slots of one tile each, holding
     every request's sink tile and in-progress tile, plus speculative-decoding rollback tiles
     (below). Format-spec §4.3 also reserves the tiles of in-flight prefill chunks; kvarn-vllm
     quantizes those in the step that writes them (*direct flush*), so the dense rule drops
     that term unless ``ServingConfig.direct_flush`` is off (:func:`side_pool_slots`);
   * the **shared MLA workspace** (format-spec §5.2), for the g64 MLA formats only: one
     dequantization arena per worker, shared by all local MLA layers, whose size grows with
     the number of blocks ``N``.

4. ``num_blocks`` is the largest ``N`` with
   ``N * sum(page_bytes of every layer) + workspace(N) + pools <= available``: without a
   workspace that is vLLM's ``available // sum(pages)`` (the uniform-type KV group case of
   ``get_kv_cache_config_from_groups``); with one it is found by binary search.
5. ``kv_tokens = num_blocks * block_size``, as vLLM reports its "GPU KV cache size".
   ``max_concurrency = num_blocks // ceil(max_model_len / block_size)`` whole requests. With
   dense KVarN each request's first block is a sink whose data lives in the fp16 pool, so its
   paged block is allocated but holds nothing; vLLM still allocates it, and so do we.

Everything that does not fit fails closed with :class:`BudgetError`, which says what to change.

**Speculative decoding.** With ``spec_tokens = n > 0`` a request's draft tokens may run into a
tile that is not yet committed, so ``rollback_blocks = ceil(max_num_seqs * n / G) +
max_num_seqs`` more tiles may be resident (the fork's MTP rollback term, format-spec §5.2).
We add them to every KVarN side pool and to the MLA workspace's transient rows. The official
dense formula (§4.3) leaves them out; we reserve them so that a draft crossing a tile
boundary can never run out of slots at run time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from kvarn_format.catalog import ModelGeometry, load_model
from kvarn_format.geometry import (
    SlotRounding,
    padded_record_stride,
    record_layout,
    shadow_rows,
)
from kvarn_format.registry import (
    DENSE_DTYPES,
    MLA_DTYPES,
    VALID_DTYPES,
    CacheDTypeError,
    DenseFormat,
    KVarNFormat,
    MLAFormat,
    UnsupportedGeometryError,
    check_dense_head_dim,
    check_mla_geometry,
    parse_cache_dtype,
)
from kvarn_format.weights import (
    WeightFormat,
    estimate_weights,
    parse_weight_format,
    weight_format_from_config,
)

__all__ = [
    "ANCHOR_FIXED_OVERHEAD_BYTES",
    "BASELINE_DTYPES",
    "GPUS",
    "BudgetError",
    "CacheFormat",
    "GpuSpec",
    "KVBudget",
    "KVPlan",
    "LayerCache",
    "MLAWorkspace",
    "OverheadEstimate",
    "ServingConfig",
    "SidePool",
    "WorkerMemory",
    "WorkspaceBreakdown",
    "dense_pool_rows",
    "dense_slot_bytes",
    "estimate_overhead",
    "layer_caches",
    "mla_workspace_bytes",
    "plan",
    "resolve_cache_format",
    "resolve_gpu",
    "rollback_blocks",
    "side_pool_slots",
    "solve_kv_budget",
    "valid_cache_dtypes",
    "worker_memory",
]

GiB: Final[int] = 1 << 30
MiB: Final[int] = 1 << 20


class BudgetError(ValueError):
    """The requested configuration does not fit in GPU memory."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU's memory as the CUDA runtime reports it (what vLLM multiplies by utilization)."""

    name: str
    total_bytes: int
    nominal: str
    source: str

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB


#: nvidia-smi reported 143,771 MiB on the project's H200 while CUDA reported 143,156 MiB: the
#: driver keeps 615 MiB. For the GPUs we could not measure we subtract the same 615 MiB from
#: their nvidia-smi totals.
_DRIVER_RESERVE_MIB: Final[int] = 143_771 - 143_156


def _from_smi(name: str, smi_mib: int, nominal: str) -> GpuSpec:
    return GpuSpec(
        name,
        (smi_mib - _DRIVER_RESERVE_MIB) * MiB,
        nominal,
        f"nvidia-smi total {smi_mib:,} MiB (public) minus the {_DRIVER_RESERVE_MIB} MiB the "
        "driver kept on our H200; not measured here",
    )


GPUS: Final[dict[str, GpuSpec]] = {
    "h200": GpuSpec(
        "h200",
        150_109_880_320,
        "141 GB HBM3e",
        "measured: torch.cuda.mem_get_info() total on the project's H200 "
        "(139.80 GiB; nvidia-smi shows 143,771 MiB)",
    ),
    "h100": _from_smi("h100", 81_559, "80 GB HBM3 (SXM)"),
    "a100-80g": _from_smi("a100-80g", 81_920, "80 GB HBM2e"),
    "l40s": _from_smi("l40s", 46_068, "48 GB GDDR6"),
    "rtx-pro-6000": _from_smi("rtx-pro-6000", 97_887, "96 GB GDDR7 (Blackwell)"),
}


def resolve_gpu(gpu: GpuSpec | str | float) -> GpuSpec:
    """A preset name (``h200``, ``h100``, ``a100-80g``, ``l40s``, ``rtx-pro-6000``), or a number:
    the total memory in GiB as the CUDA runtime reports it."""
    if isinstance(gpu, GpuSpec):
        return gpu
    if isinstance(gpu, int | float) and not isinstance(gpu, bool):
        gib = float(gpu)
    else:
        key = str(gpu).strip().lower()
        if key in GPUS:
            return GPUS[key]
        try:
            gib = float(key.removesuffix("gib").removesuffix("gb"))
        except ValueError:
            raise ValueError(
                f"unknown GPU {gpu!r}: use one of {', '.join(GPUS)} or a memory size in GiB"
            ) from None
    if not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"GPU memory must be a positive number of GiB, got {gpu!r}")
    return GpuSpec(f"{gib:g}GiB", round(gib * GiB), f"{gib:g} GiB", "given on the command line")


# ---------------------------------------------------------------------------------------------
# Serving configuration


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The vLLM scheduler limits that size the side pool, the workspace and concurrency.

    ``direct_flush``: whether the server quantizes the tiles a prefill chunk completes inside
    the step that writes them (kvarn-vllm's default; env ``KVARN_DIRECT_FLUSH=0`` turns it off).
    It only changes the dense side-pool rule (:func:`side_pool_slots`).
    """

    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    spec_tokens: int = 0
    direct_flush: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.spec_tokens, bool) or not isinstance(self.spec_tokens, int):
            raise ValueError(f"spec_tokens must be an integer, got {self.spec_tokens!r}")
        if self.spec_tokens < 0:
            raise ValueError(f"spec_tokens must be >= 0, got {self.spec_tokens}")
        if not isinstance(self.direct_flush, bool):
            raise ValueError(f"direct_flush must be a bool, got {self.direct_flush!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM's SchedulerConfig rejects this too.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )


def rollback_blocks(serving: ServingConfig, group: int) -> int:
    """Tiles that speculative drafts can hold beyond each request's committed tiles.

    ``ceil(max_num_seqs * n / G) + max_num_seqs`` when ``n = spec_tokens > 0``, else 0
    (format-spec §5.2: every request may cross one tile boundary, and the drafts themselves
    fill ``n`` tokens each).
    """
    if serving.spec_tokens == 0:
        return 0
    return _ceil_div(serving.max_num_seqs * serving.spec_tokens, group) + serving.max_num_seqs


# ---------------------------------------------------------------------------------------------
# Cache formats and per-layer pages


BASELINE_DTYPES: Final[tuple[str, ...]] = ("auto", "fp8")
_FP16_NAMES: Final = frozenset({"auto", "fp16", "bf16", "float16", "bfloat16"})
_FP8_NAMES: Final = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})

#: vLLM's default block size for the stock dense backends, and FlashMLA's for MLA on Hopper.
DEFAULT_DENSE_BLOCK: Final[int] = 16
DEFAULT_MLA_BLOCK: Final[int] = 64


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """A ``--kv-cache-dtype`` value: a stock vLLM cache (fp16/bf16, fp8) or a KVarN format."""

    name: str
    kind: Literal["fp16", "fp8", "kvarn"]
    kvarn: KVarNFormat | None = None

    @property
    def element_bytes(self) -> int:
        return 1 if self.kind == "fp8" else 2


def resolve_cache_format(cache_dtype: str) -> CacheFormat:
    """Map a cache dtype string to a :class:`CacheFormat`; unknown strings raise
    :class:`CacheDTypeError` listing every valid string."""
    if cache_dtype in _FP16_NAMES:
        return CacheFormat("auto" if cache_dtype == "auto" else cache_dtype, "fp16")
    if cache_dtype in _FP8_NAMES:
        return CacheFormat(cache_dtype, "fp8")
    try:
        fmt = parse_cache_dtype(cache_dtype)
    except CacheDTypeError:
        raise CacheDTypeError(
            f"Unknown cache dtype {cache_dtype!r}. Valid: auto, fp16, bf16, fp8, "
            f"{', '.join(VALID_DTYPES)}"
        ) from None
    return CacheFormat(fmt.name, "kvarn", fmt)


def valid_cache_dtypes(model: ModelGeometry) -> tuple[str, ...]:
    """``auto``, ``fp8`` and every KVarN format this model's geometry can take."""
    out = list(BASELINE_DTYPES)
    full = model.count("full") > 0
    if model.count("linear") or not full:
        return tuple(out)
    if model.mla is not None:
        for name in MLA_DTYPES:
            fmt = parse_cache_dtype(name)
            assert isinstance(fmt, MLAFormat)
            try:
                check_mla_geometry(fmt, model.mla.kv_lora_rank, model.mla.qk_rope_head_dim)
            except UnsupportedGeometryError:
                continue
            out.append(name)
    else:
        for name in DENSE_DTYPES:
            dense = parse_cache_dtype(name)
            assert isinstance(dense, DenseFormat)
            try:
                check_dense_head_dim(dense, model.head_dim)
            except UnsupportedGeometryError:
                continue
            out.append(name)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SidePool:
    """A per-layer full-precision side pool: ``slot_bytes`` per slot per layer.

    ``rule`` picks the slot count (:func:`side_pool_slots`): ``dense`` (format-spec §4.3, less
    the prefill-chunk term under direct flush),
    ``mla_g128`` (official MLA, §5.1) or ``mla_g64`` (community g64 family, §5.2).
    """

    rule: Literal["dense", "mla_g128", "mla_g64"]
    group: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class MLAWorkspace:
    """The geometry of the shared MLA dequantization workspace (format-spec §5.2).

    All MLA layers of one worker share one workspace, so they must agree on it.
    """

    dtype: str
    group: int
    latent_rank: int
    rope_dim: int
    latent_bits: int
    tile_bytes: int
    topk: int


#: The only geometries the workspace envelope accepts ([FORK] ``workspace_envelope``):
#: (group, latent rank, rope dim, bits) -> tile bytes.
_WORKSPACE_GEOMETRIES: Final[dict[tuple[int, int, int, int], int]] = {
    (64, 512, 64, 2): 18_560,
    (64, 512, 64, 4): 26_752,
    (64, 512, 64, 5): 30_848,
}


@dataclass(frozen=True, slots=True)
class LayerCache:
    """``count`` identical attention layers on one worker and how their KV cache is stored."""

    role: str
    dtype: str
    count: int
    #: Bytes of one block (``block_size`` tokens) of one layer.
    page_bytes: int
    side_pool: SidePool | None = None
    workspace: MLAWorkspace | None = None

    def __post_init__(self) -> None:
        if self.count < 0 or self.page_bytes < 0:
            raise ValueError(f"layer cache {self.role!r}: count and page_bytes must be >= 0")


def dense_pool_rows(fmt: DenseFormat, head_dim: int, *, shadow: bool = True) -> int:
    """Rows per dense side-pool slot: the tile's ``G`` less its shadow rows.

    With ``shadow`` (kvarn-vllm's default; env ``KVARN_SHADOW_ROWS=0`` turns it off) the
    first :func:`~kvarn_format.geometry.shadow_rows` rows of a pool tile live in the idle
    record area of its block (of the unpadded record, so padded hybrid strides agree).
    """
    if not shadow:
        return fmt.group
    return fmt.group - shadow_rows(fmt.group, head_dim, record_layout(fmt, head_dim).tile_bytes)


def dense_slot_bytes(
    fmt: DenseFormat, num_kv_heads: int, head_dim: int, *, shadow: bool = True
) -> int:
    """Bytes of one dense side-pool slot of one layer, K and V in fp16."""
    return 2 * dense_pool_rows(fmt, head_dim, shadow=shadow) * num_kv_heads * head_dim * 2


def side_pool_slots(pool: SidePool, serving: ServingConfig) -> int:
    """Slots of one side pool (the same slot index serves every layer).

    * ``dense`` with ``serving.direct_flush`` (kvarn-vllm's default): ``2*S + 8``: a sink and
      an in-progress tile per request, 8 spare.
    * ``dense`` without it: ``max(2*S + ceil(T/G) + 8, 8)`` (format-spec §4.3: also the tiles
      of the prefill chunks in flight, which then wait in the pool for the next step's flush).
    * ``mla_g128``: ``max(2*S, 64)`` (official MLA, §5.1; no sink, in-progress and prefill tiles).
    * ``mla_g64``: ``3*S + ceil(T/G) + 8`` (§5.2 lists a 128-token sink = 2 tiles and the current
      tile per request; the prefill and spare terms are ours, as for dense).

    Each rule adds :func:`rollback_blocks` when speculative decoding is on.

    Why ``2*S`` suffices under direct flush (kvarn-vllm's tracker, ``kvarn_vllm.tracker``):
    after a step, a request holds at most its sink (block 0) and the block its last token
    fell into when that block is partial; every tile a chunk of two or more tokens completes
    (and commits) is quantized inside that step and holds no slot, including the tile the
    chunk *started in*: its earlier rows are read from its slot before that step's writes, and
    the slot is free for the same step's new in-progress block. A one-token step (a decode)
    that completes its block keeps the slot until the next step's flush, which runs before
    that step allocates. So at any point of a step the live requests hold at most ``2*S``
    slots, whatever cuts the scheduler makes (token budget, ``long_prefill_token_threshold``,
    encoder budgets, several partial prefills): no term depends on how chunks are cut.
    Speculative decoding adds uncommitted tiles, covered by :func:`rollback_blocks`. A
    finished request's retired sink stays in the pool only while slots are free.
    """
    s, t, g = serving.max_num_seqs, serving.max_num_batched_tokens, pool.group
    if pool.rule == "dense":
        chunk = 0 if serving.direct_flush else _ceil_div(t, g)
        base = max(2 * s + chunk + 8, 8)
    elif pool.rule == "mla_g128":
        base = max(2 * s, 64)
    else:
        base = 3 * s + _ceil_div(t, g) + 8
    return base + rollback_blocks(serving, g)


def _tp_kv_heads(model: ModelGeometry, tp: int) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    if model.num_attention_heads % tp:
        raise UnsupportedGeometryError(
            f"{model.name}: {model.num_attention_heads} attention heads cannot be split over "
            f"tp={tp}; use a tp that divides them"
        )
    hk = model.num_kv_heads
    if hk >= tp and hk % tp:
        raise UnsupportedGeometryError(f"{model.name}: {hk} KV heads cannot be split over tp={tp}")
    if hk < tp and tp % hk:
        raise UnsupportedGeometryError(
            f"{model.name}: tp={tp} is not a multiple of its {hk} KV heads, so they cannot be "
            "replicated evenly"
        )
    return max(1, hk // tp)


def _indexer_cache(model: ModelGeometry, block: int) -> list[LayerCache]:
    """DSA models keep an fp8 key cache per layer for the sparse indexer (vLLM's
    ``DeepseekV32IndexerCache``: ``index_head_dim`` fp8 values plus one fp32 scale per 128)."""
    m = model.mla
    if m is None or not m.index_topk:
        return []
    width = m.index_head_dim + _ceil_div(m.index_head_dim, 128) * 4
    return [
        LayerCache(
            "DSA indexer keys (fp8, not quantized by KVarN)",
            "fp8",
            model.count("full"),
            block * width,
        )
    ]


def layer_caches(
    model: ModelGeometry,
    cache: CacheFormat | str,
    *,
    tp: int = 1,
    slot_rounding: SlotRounding = "align8",
    shadow_rows: bool = True,
) -> tuple[int, tuple[LayerCache, ...]]:
    """The block size and the per-worker layer caches of ``model`` under ``cache``.

    Dense KV heads are split over TP (``max(1, Hk // tp)`` per rank); MLA caches are
    replicated on every rank. KVarN quantizes the full-attention layers only; sliding-window
    layers stay fp16, sized like full-attention layers (conservative: vLLM's hybrid allocator
    keeps only the window), and the KVarN records are then padded so that their page divides
    the sliding layers' page (:func:`~kvarn_format.geometry.padded_record_stride`, the rule
    kvarn-vllm applies for vLLM's hybrid allocator).
    A format the model cannot take raises :class:`UnsupportedGeometryError` naming the valid
    ones. ``shadow_rows`` sizes dense side-pool slots without their shadow rows
    (:func:`dense_pool_rows`).
    """
    fmt = resolve_cache_format(cache) if isinstance(cache, str) else cache
    if model.count("linear"):
        raise UnsupportedGeometryError(
            f"{model.name} has {model.count('linear')} linear-attention/Mamba layers; their "
            "state is not modelled by this planner and KVarN does not quantize them"
        )
    hk = _tp_kv_heads(model, tp)
    n_full, n_sliding = model.count("full"), model.count("sliding")
    valid = valid_cache_dtypes(model)

    if fmt.kind != "kvarn":
        if model.mla is not None:
            block = DEFAULT_MLA_BLOCK
            per_token = model.mla.cache_width * fmt.element_bytes
            if fmt.kind == "fp8" and model.mla.index_topk:
                per_token = 656  # vLLM's fp8_ds_mla layout for DSA models
            layers = [LayerCache(f"MLA latent ({fmt.name})", fmt.name, n_full, block * per_token)]
            return block, (*layers, *_indexer_cache(model, block))
        block = DEFAULT_DENSE_BLOCK
        page = 2 * block * hk * model.head_dim * fmt.element_bytes
        caches = [LayerCache(f"full attention ({fmt.name})", fmt.name, n_full, page)]
        if n_sliding:
            caches.append(LayerCache(f"sliding window ({fmt.name})", fmt.name, n_sliding, page))
        return block, tuple(c for c in caches if c.count)

    kv = fmt.kvarn
    assert kv is not None
    if fmt.name not in valid:
        raise UnsupportedGeometryError(_unsupported_message(model, fmt.name, valid))
    if isinstance(kv, MLAFormat):
        assert model.mla is not None
        block = kv.group
        layout = record_layout(kv)
        if kv.group == 128:
            pool = SidePool("mla_g128", block, block * model.mla.cache_width * 2)
            ws = None
        else:
            # FP8 latent + BF16 RoPE per token (format-spec §5.2: 40,960 B per 64-token slot).
            pool = SidePool("mla_g64", block, block * (kv.latent_rank + 2 * kv.rope_dim))
            ws = MLAWorkspace(
                kv.name,
                kv.group,
                kv.latent_rank,
                kv.rope_dim,
                kv.latent_bits,
                layout.tile_bytes,
                model.mla.index_topk or 0,
            )
        layers = [
            LayerCache(f"MLA latent ({kv.name})", kv.name, n_full, layout.tile_bytes, pool, ws)
        ]
        return block, (*layers, *_indexer_cache(model, block))

    block = kv.group
    layout = record_layout(kv, model.head_dim, slot_rounding=slot_rounding)
    pool = SidePool("dense", block, dense_slot_bytes(kv, hk, model.head_dim, shadow=shadow_rows))
    sliding_page = 2 * block * hk * model.head_dim * 2
    # With sliding-window layers in the same cache, records are padded so that their page
    # divides the sliding layers' (kvarn-vllm does the same for vLLM's hybrid allocator).
    stride = layout.tile_bytes
    if n_sliding:
        stride = padded_record_stride(layout.tile_bytes, hk, [sliding_page])
    caches = [LayerCache(f"full attention ({kv.name})", kv.name, n_full, hk * stride, pool)]
    if n_sliding:
        # Sliding-window layers stay in full precision (format-spec §1.1), in blocks of G.
        caches.append(
            LayerCache("sliding window (fp16, not quantized)", "auto", n_sliding, sliding_page)
        )
    return block, tuple(caches)


def _unsupported_message(model: ModelGeometry, dtype: str, valid: Sequence[str]) -> str:
    if model.count("linear"):
        why = "it has linear-attention/Mamba layers"
    elif model.mla is not None and dtype in DENSE_DTYPES:
        why = "it uses MLA, so it needs an MLA format"
    elif model.mla is None and dtype in MLA_DTYPES:
        why = "it is not an MLA model, so it needs a dense format"
    elif model.mla is not None:
        why = (
            f"its MLA ranks (kv_lora_rank={model.mla.kv_lora_rank}, "
            f"rope={model.mla.qk_rope_head_dim}) differ from the format's 512+64"
        )
    elif model.count("full") == 0:
        why = "it has no full-attention layers to quantize"
    else:
        why = f"its head_dim {model.head_dim} is not supported"
    return (
        f"{dtype} cannot be used for {model.name}: {why}. Valid for this model: {', '.join(valid)}"
    )


# ---------------------------------------------------------------------------------------------
# The shared MLA workspace


@dataclass(frozen=True, slots=True)
class WorkspaceBreakdown:
    """The terms of the shared MLA workspace for ``num_blocks`` blocks (format-spec §5.2)."""

    num_blocks: int
    page_rows: int
    selected_rows: int
    transient_rows: int
    dense_rows: int
    dense_arena_bytes: int
    remap_bytes: int
    rotation_bytes: int
    slot_map_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.dense_arena_bytes + self.remap_bytes + self.rotation_bytes + self.slot_map_bytes


def mla_workspace_bytes(
    ws: MLAWorkspace, num_blocks: int, serving: ServingConfig
) -> WorkspaceBreakdown:
    """The shared dequantization workspace of one worker, for ``num_blocks`` KV blocks.

    ``dense_rows = roundup_G(max(N*G, active_rows*topk, transient_rows))`` rows of bf16
    latent+RoPE, an int32 top-k remap of ``T*topk``, bf16 rotation rows ``T*R`` and an int32
    physical-slot map of ``N*G``; ``transient_rows = (ceil(T/G) + S + rollback) * G`` and
    ``active_rows = max(min(S*(1+n), T), S)`` (format-spec §5.2).
    """
    g = ws.group
    s, t, n = serving.max_num_seqs, serving.max_num_batched_tokens, serving.spec_tokens
    page_rows = num_blocks * g
    active_rows = max(min(s * (1 + n), t), s)
    selected_rows = active_rows * ws.topk
    transient_rows = (_ceil_div(t, g) + s + rollback_blocks(serving, g)) * g
    dense_rows = _ceil_div(max(page_rows, selected_rows, transient_rows), g) * g
    return WorkspaceBreakdown(
        num_blocks=num_blocks,
        page_rows=page_rows,
        selected_rows=selected_rows,
        transient_rows=transient_rows,
        dense_rows=dense_rows,
        dense_arena_bytes=dense_rows * (ws.latent_rank + ws.rope_dim) * 2,
        remap_bytes=t * ws.topk * 4,
        rotation_bytes=t * ws.latent_rank * 2,
        slot_map_bytes=page_rows * 4,
    )


def _shared_workspace(layers: Sequence[LayerCache]) -> MLAWorkspace | None:
    """The one workspace geometry of this worker; raise if layers disagree or it is not one the
    workspace accepts."""
    geoms = {c.workspace for c in layers if c.workspace is not None and c.count}
    if not geoms:
        return None
    if len(geoms) > 1:
        listed = "; ".join(
            f"{w.dtype} (G={w.group}, R={w.latent_rank}, rope={w.rope_dim}, "
            f"{w.latent_bits}-bit, {w.tile_bytes} B, top-k {w.topk})"
            for w in sorted(geoms, key=lambda w: (w.dtype, w.topk))
        )
        raise UnsupportedGeometryError(
            "the shared MLA workspace is allocated once per worker and needs one geometry "
            f"across all local MLA layers, but this worker mixes: {listed}. Use one "
            "kvarn_mla_*_g64 format for every layer."
        )
    (ws,) = geoms
    expected = _WORKSPACE_GEOMETRIES.get((ws.group, ws.latent_rank, ws.rope_dim, ws.latent_bits))
    if expected is None or expected != ws.tile_bytes:
        raise UnsupportedGeometryError(
            f"{ws.dtype}: the shared MLA workspace accepts only group 64, latent 512, rope 64 "
            f"with 2/4/5-bit tiles of 18,560/26,752/30,848 B; got G={ws.group}, "
            f"R={ws.latent_rank}, rope={ws.rope_dim}, {ws.latent_bits}-bit, {ws.tile_bytes} B"
        )
    return ws


# ---------------------------------------------------------------------------------------------
# The solver


@dataclass(frozen=True, slots=True)
class KVBudget:
    """How one worker's KV budget splits: every term in bytes, then blocks and tokens."""

    available_bytes: int
    block_size: int
    page_bytes_per_block: int
    side_pool_slots: int
    side_pool_bytes: int
    workspace: WorkspaceBreakdown | None
    num_blocks: int
    blocks_per_request: int
    layers: tuple[LayerCache, ...]

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.total_bytes if self.workspace is not None else 0

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.page_bytes_per_block

    @property
    def unused_bytes(self) -> int:
        return (
            self.available_bytes - self.kv_cache_bytes - self.side_pool_bytes - self.workspace_bytes
        )

    @property
    def kv_tokens(self) -> int:
        """``num_blocks * block_size``: the capacity vLLM reports."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> int:
        """Whole requests of ``max_model_len`` tokens that fit at once."""
        return self.num_blocks // self.blocks_per_request


def _pool_bytes(layers: Sequence[LayerCache], serving: ServingConfig) -> tuple[int, int]:
    slots_seen: set[int] = set()
    total = 0
    for c in layers:
        if c.side_pool is None or not c.count:
            continue
        slots = side_pool_slots(c.side_pool, serving)
        slots_seen.add(slots)
        total += slots * c.side_pool.slot_bytes * c.count
    return (max(slots_seen) if slots_seen else 0), total


def _max_seqs_that_fit(layers: Sequence[LayerCache], serving: ServingConfig, budget: int) -> int:
    """Largest max_num_seqs whose side pools (and one request's blocks) fit in ``budget``."""
    lo, hi = 0, serving.max_num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = replace(
            serving,
            max_num_seqs=mid,
            max_num_batched_tokens=max(serving.max_num_batched_tokens, mid),
        )
        if _pool_bytes(layers, trial)[1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def solve_kv_budget(
    layers: Sequence[LayerCache],
    available_bytes: int,
    serving: ServingConfig,
    *,
    block_size: int,
) -> KVBudget:
    """Split ``available_bytes`` of one worker between side pools, the shared MLA workspace and
    paged KV blocks, and count the blocks.

    ``num_blocks`` is the largest ``N`` with ``N * sum(page_bytes) + workspace(N) + pools <=
    available_bytes``. Raises :class:`BudgetError` when the pools or workspace alone do not
    fit, or when the blocks cannot hold one request of ``max_model_len`` tokens (vLLM refuses
    to start then), and :class:`UnsupportedGeometryError` when layers need incompatible
    shared workspaces.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    layers = tuple(layers)
    page_sum = sum(c.count * c.page_bytes for c in layers)
    if page_sum <= 0:
        raise ValueError("no KV cache layers to size")
    ws = _shared_workspace(layers)
    pool_slots, pool_bytes = _pool_bytes(layers, serving)
    blocks_per_request = _ceil_div(serving.max_model_len, block_size)

    if available_bytes <= 0:
        raise BudgetError(
            f"no memory is left for the KV cache ({available_bytes / GiB:.2f} GiB after weights "
            "and activations): use more GPUs (--tp), a higher --mem-util or smaller weights"
        )
    budget = available_bytes - pool_bytes
    ws_floor = mla_workspace_bytes(ws, 0, serving).total_bytes if ws is not None else 0
    if budget < ws_floor:
        fits = _max_seqs_that_fit(
            layers, serving, available_bytes - ws_floor - page_sum * blocks_per_request
        )
        need = f"the KVarN side pool ({pool_slots} slots, {pool_bytes / GiB:.2f} GiB)"
        if ws is not None:
            need += f" plus the MLA workspace's fixed rows ({ws_floor / GiB:.2f} GiB)"
        raise BudgetError(
            f"{need} exceeds the {available_bytes / GiB:.2f} GiB left for the KV cache at "
            f"max_num_seqs={serving.max_num_seqs}, max_num_batched_tokens="
            f"{serving.max_num_batched_tokens}, spec_tokens={serving.spec_tokens}; a pool for "
            f"at most {fits} sequences leaves room for one max_model_len request: lower "
            "--max-num-seqs or --max-num-batched-tokens"
        )

    if ws is None:
        num_blocks = budget // page_sum
        breakdown = None
    else:
        # workspace(N) grows with N, so the total is monotone: binary search the largest N.
        lo, hi = 0, budget // page_sum
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * page_sum + mla_workspace_bytes(ws, mid, serving).total_bytes <= budget:
                lo = mid
            else:
                hi = mid - 1
        num_blocks = lo
        breakdown = mla_workspace_bytes(ws, num_blocks, serving)

    result = KVBudget(
        available_bytes=available_bytes,
        block_size=block_size,
        page_bytes_per_block=page_sum,
        side_pool_slots=pool_slots,
        side_pool_bytes=pool_bytes,
        workspace=breakdown,
        num_blocks=num_blocks,
        blocks_per_request=blocks_per_request,
        layers=layers,
    )
    if num_blocks < blocks_per_request:
        parts = []
        if pool_bytes:
            parts.append(f"the side pool ({pool_bytes / GiB:.2f} GiB)")
        if breakdown is not None:
            parts.append(f"the MLA workspace ({breakdown.total_bytes / GiB:.2f} GiB)")
        extra = f" after {' and '.join(parts)}" if parts else ""
        raise BudgetError(
            f"only {num_blocks:,} blocks ({num_blocks * block_size:,} tokens) fit{extra}, fewer "
            f"than the {blocks_per_request:,} blocks one request of max_model_len="
            f"{serving.max_model_len:,} needs: lower --max-model-len or --max-num-seqs, or "
            "add memory"
        )
    return result


# ---------------------------------------------------------------------------------------------
# Activation and runtime overhead


#: CUDA-graph pool estimate plus non-torch allocations (cuBLAS workspaces, NCCL), as one lump.
#: Fitted so that the estimate reproduces the two H200 anchors measured with vLLM 0.23.0 in
#: docs/gpu.md (Qwen3-8B fp16 at utilization 0.90: 791,792 tokens for ``auto`` and 1,583,600
#: for ``fp8``; max_num_seqs 256, max_num_batched_tokens 16,384). Not calibrated for tp > 1.
ANCHOR_FIXED_OVERHEAD_BYTES: Final[int] = 334 * MiB


@dataclass(frozen=True, slots=True)
class OverheadEstimate:
    """Memory vLLM's profile run charges besides weights and KV: an estimate."""

    forward_peak_bytes: int
    sampler_peak_bytes: int
    fixed_bytes: int

    @property
    def activation_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.sampler_peak_bytes)

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.fixed_bytes


def estimate_overhead(
    model: ModelGeometry, serving: ServingConfig, *, tp: int = 1
) -> OverheadEstimate:
    """Estimate vLLM's profiled non-KV memory: the larger of the forward and sampler peaks,
    plus :data:`ANCHOR_FIXED_OVERHEAD_BYTES`.

    Forward peak: ``T * 2 B * (3*hidden + widest per-token intermediate)``, the widest of the
    attention projections (q, k, v and the output, per rank; MLA expands per-head K/V at
    prefill) and the MLP (gate_up + activation = 3*I per rank; for MoE, per routed expert
    ``3*I_e + hidden`` of fused-MoE caches plus the shared expert). Sampler peak:
    ``max_num_seqs * vocab * 4 B * 3`` (fp32 logits, probabilities, log-probabilities).
    """
    t, s = serving.max_num_batched_tokens, serving.max_num_seqs
    h = model.hidden_size
    heads = model.num_attention_heads // tp
    if model.mla is not None:
        m = model.mla
        attn = 2 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * heads * m.v_head_dim
        attn += m.cache_width
    else:
        attn = 2 * heads * model.head_dim + 2 * max(1, model.num_kv_heads // tp) * model.head_dim
    mlp = 3 * model.intermediate_size // tp if model.intermediate_size else 0
    if model.moe is not None and any(model.moe.moe_layers):
        moe = model.moe
        routed = moe.experts_per_token * (3 * moe.expert_intermediate_size // tp + h)
        mlp = max(mlp, routed + 3 * moe.shared_intermediate_size // tp)
    forward = t * 2 * (3 * h + max(attn, mlp))
    sampler = s * model.vocab_size * 4 * 3
    return OverheadEstimate(forward, sampler, ANCHOR_FIXED_OVERHEAD_BYTES)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True, slots=True)
class WorkerMemory:
    """One worker's memory before the KV cache: what vLLM requests, and what it charges first."""

    gpu: GpuSpec
    tp: int
    mem_util: float
    requested_bytes: int
    weight_bytes: int
    weight_format: str
    weight_note: str
    overhead: OverheadEstimate | None
    overhead_bytes: int

    @property
    def available_bytes(self) -> int:
        """What is left for the KV cache, its side pools and the MLA workspace."""
        return self.requested_bytes - self.weight_bytes - self.overhead_bytes


def worker_memory(
    model: ModelGeometry | str,
    serving: ServingConfig,
    *,
    gpu: GpuSpec | str | float = "h200",
    tp: int = 1,
    mem_util: float = 0.9,
    weights: WeightFormat | str | None = None,
    weight_bytes: int | None = None,
    overhead_bytes: int | None = None,
) -> WorkerMemory:
    """``requested = ceil(total * mem_util)``, the weights of one TP rank (estimated from the
    config in the checkpoint's own format unless ``weights`` names another or ``weight_bytes``
    gives them) and the profiled overhead (:func:`estimate_overhead` unless given)."""
    geo = _model(model)
    if isinstance(mem_util, bool) or not (
        isinstance(mem_util, int | float) and 0.0 < float(mem_util) <= 1.0
    ):
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {mem_util!r}")
    _tp_kv_heads(geo, tp)
    gpu_spec = resolve_gpu(gpu)
    if weight_bytes is not None:
        if weight_bytes < 0:
            raise ValueError(f"weight bytes must be >= 0, got {weight_bytes}")
        w_bytes, w_label, w_note = int(weight_bytes), "given", "given per GPU"
    else:
        if weights is None:
            wfmt, why = weight_format_from_config(geo)
        else:
            wfmt = parse_weight_format(weights) if isinstance(weights, str) else weights
            why = "chosen format"
        w_bytes = estimate_weights(geo, wfmt, tp=tp).per_rank_bytes
        w_label, w_note = wfmt.label, f"estimated: {why}"
    overhead: OverheadEstimate | None
    if overhead_bytes is not None:
        if overhead_bytes < 0:
            raise ValueError(f"overhead bytes must be >= 0, got {overhead_bytes}")
        overhead, o_bytes = None, int(overhead_bytes)
    else:
        overhead = estimate_overhead(geo, serving, tp=tp)
        o_bytes = overhead.total_bytes
    return WorkerMemory(
        gpu=gpu_spec,
        tp=tp,
        mem_util=float(mem_util),
        requested_bytes=math.ceil(gpu_spec.total_bytes * float(mem_util)),
        weight_bytes=w_bytes,
        weight_format=w_label,
        weight_note=w_note,
        overhead=overhead,
        overhead_bytes=o_bytes,
    )


@dataclass(frozen=True, slots=True)
class KVPlan:
    """A solved plan for one model, cache format and GPU, with every term of the budget."""

    model: str
    dtype: str
    tp: int
    gpu: GpuSpec
    mem_util: float
    serving: ServingConfig
    requested_bytes: int
    weight_bytes: int
    weight_format: str
    weight_note: str
    overhead: OverheadEstimate | None
    overhead_bytes: int
    budget: KVBudget
    fp16_kv_tokens: int | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def available_bytes(self) -> int:
        return self.budget.available_bytes

    @property
    def kv_tokens(self) -> int:
        return self.budget.kv_tokens

    @property
    def num_blocks(self) -> int:
        return self.budget.num_blocks

    @property
    def max_concurrency(self) -> int:
        return self.budget.max_concurrency

    @property
    def ratio_vs_fp16(self) -> float | None:
        """KV tokens relative to an fp16 cache under the same settings (None if fp16 does not
        fit)."""
        if not self.fp16_kv_tokens:
            return None
        return self.kv_tokens / self.fp16_kv_tokens

    def as_dict(self) -> dict[str, object]:
        """The ``kvarn plan --json`` row: a stable, flat, JSON-ready mapping."""
        b = self.budget
        ratio = self.ratio_vs_fp16
        return {
            "dtype": self.dtype,
            "fits": True,
            "error": None,
            "model": self.model,
            "tp": self.tp,
            "gpu": self.gpu.name,
            "gpu_total_bytes": self.gpu.total_bytes,
            "mem_util": self.mem_util,
            "max_model_len": self.serving.max_model_len,
            "max_num_seqs": self.serving.max_num_seqs,
            "max_num_batched_tokens": self.serving.max_num_batched_tokens,
            "spec_tokens": self.serving.spec_tokens,
            "block_size": b.block_size,
            "kv_tokens": self.kv_tokens,
            "num_blocks": b.num_blocks,
            "ratio_vs_fp16": None if ratio is None else round(ratio, 4),
            "max_concurrency": b.max_concurrency,
            "blocks_per_request": b.blocks_per_request,
            "requested_bytes": self.requested_bytes,
            "weight_bytes": self.weight_bytes,
            "weight_format": self.weight_format,
            "overhead_bytes": self.overhead_bytes,
            "available_bytes": b.available_bytes,
            "page_bytes_per_block": b.page_bytes_per_block,
            "kv_cache_bytes": b.kv_cache_bytes,
            "side_pool_slots": b.side_pool_slots,
            "side_pool_bytes": b.side_pool_bytes,
            "workspace_bytes": b.workspace_bytes,
            "unused_bytes": b.unused_bytes,
            "layers": [
                {
                    "role": c.role,
                    "dtype": c.dtype,
                    "count": c.count,
                    "page_bytes": c.page_bytes,
                    "side_pool_slot_bytes": c.side_pool.slot_bytes if c.side_pool else 0,
                }
                for c in b.layers
            ],
            "notes": list(self.notes),
        }


def _model(model: ModelGeometry | str) -> ModelGeometry:
    return load_model(model) if isinstance(model, str) else model


def plan(
    model: ModelGeometry | str,
    cache_dtype: str = "auto",
    *,
    gpu: GpuSpec | str | float = "h200",
    tp: int = 1,
    mem_util: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    spec_tokens: int = 0,
    direct_flush: bool = True,
    shadow_rows: bool = True,
    weights: WeightFormat | str | None = None,
    weight_bytes: int | None = None,
    overhead_bytes: int | None = None,
    slot_rounding: SlotRounding = "align8",
    with_fp16_baseline: bool = True,
    memory: WorkerMemory | None = None,
) -> KVPlan:
    """Plan the KV cache of ``model`` with ``cache_dtype`` on one worker of ``tp``.

    ``max_model_len`` defaults to the model's ``max_position_embeddings``. Weights default to
    the estimate for the checkpoint's own format (``weights`` overrides the format,
    ``weight_bytes`` the per-rank bytes); ``overhead_bytes`` overrides
    :func:`estimate_overhead`; ``memory`` (from :func:`worker_memory`) replaces all of these
    and the GPU. ``direct_flush=False`` sizes the dense side pool for a server run with
    ``KVARN_DIRECT_FLUSH=0``, ``shadow_rows=False`` its slots for ``KVARN_SHADOW_ROWS=0``. Raises :class:`UnsupportedGeometryError` for a format the model
    cannot take, :class:`BudgetError` when the configuration does not fit.
    """
    geo = _model(model)
    if max_model_len is None:
        if geo.max_position_embeddings is None:
            raise ValueError(f"{geo.name} has no max_position_embeddings: give max_model_len")
        max_model_len = geo.max_position_embeddings
    serving = ServingConfig(
        max_model_len, max_num_seqs, max_num_batched_tokens, spec_tokens, direct_flush
    )
    cache = resolve_cache_format(cache_dtype)
    block, layers = layer_caches(
        geo, cache, tp=tp, slot_rounding=slot_rounding, shadow_rows=shadow_rows
    )
    if memory is None:
        memory = worker_memory(
            geo,
            serving,
            gpu=gpu,
            tp=tp,
            mem_util=mem_util,
            weights=weights,
            weight_bytes=weight_bytes,
            overhead_bytes=overhead_bytes,
        )
    elif memory.tp != tp:
        raise ValueError(f"memory was computed for tp={memory.tp}, not tp={tp}")
    notes: list[str] = []
    if tp > 1 and memory.overhead is not None:
        notes.append("runtime overhead is calibrated at tp=1 only")
    available = memory.available_bytes
    budget = solve_kv_budget(layers, available, serving, block_size=block)

    fp16_tokens: int | None = None
    if with_fp16_baseline:
        if cache.kind == "fp16":
            fp16_tokens = budget.kv_tokens
        else:
            fb, fl = layer_caches(geo, "auto", tp=tp)
            try:
                fp16_tokens = solve_kv_budget(fl, available, serving, block_size=fb).kv_tokens
            except BudgetError:
                fp16_tokens = None
    if geo.count("sliding") and cache.kind == "kvarn":
        notes.append(
            f"{geo.count('sliding')} sliding-window layers stay fp16 and are sized like "
            "full-attention layers (conservative)"
        )
    if budget.max_concurrency > serving.max_num_seqs:
        notes.append(
            "the KV cache holds more max-length requests than the scheduler runs at once "
            f"(max_num_seqs={serving.max_num_seqs})"
        )
    return KVPlan(
        model=geo.name,
        dtype=cache.name,
        tp=tp,
        gpu=memory.gpu,
        mem_util=memory.mem_util,
        serving=serving,
        requested_bytes=memory.requested_bytes,
        weight_bytes=memory.weight_bytes,
        weight_format=memory.weight_format,
        weight_note=memory.weight_note,
        overhead=memory.overhead,
        overhead_bytes=memory.overhead_bytes,
        budget=budget,
        fp16_kv_tokens=fp16_tokens,
        notes=tuple(notes),
    )
