"""Charging KVarN's extra memory in vLLM's KV budget, and reporting the resulting capacity.

Besides its paged blocks a KVarN layer needs an fp16 *side pool* (every request's sink tile and
in-progress tile; without direct flush also the tiles of in-flight prefill chunks, see
:func:`direct_flush_setting`), and the decode kernel needs a
fixed-size split-K workspace. vLLM's memory profiler cannot see them (they are allocated when
the KV cache is, after profiling), so patch P5 subtracts them from each worker's available KV
memory before vLLM counts blocks: vLLM then never over-commits, with or without
``kv_cache_memory_bytes``.

The slot count and the slot size are kvarn-format's (:func:`kvarn_format.sizing.side_pool_slots`,
:func:`kvarn_format.sizing.dense_slot_bytes`), the single source of truth the offline planner
(``kvarn plan``) uses too. A slot holds a tile less its shadow rows, which live in the idle
record area of the tile's block (:func:`shadow_rows_setting`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvarn_format import DenseFormat, parse_cache_dtype
from kvarn_format.sizing import (
    ServingConfig,
    SidePool,
    dense_slot_bytes,
    side_pool_slots,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "DIRECT_FLUSH_ENV",
    "SHADOW_ROWS_ENV",
    "Reservation",
    "ServingLimits",
    "decode_workspace_bytes",
    "direct_flush_setting",
    "log_capacity",
    "pool_slots_for",
    "reservation_for_worker",
    "serving_limits",
    "shadow_rows_setting",
    "verify_graphs_setting",
]

logger = logging.getLogger("vllm.kvarn")


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """The scheduler limits that size the side pool and the decode workspace."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    spec_tokens: int
    #: Tokens the scheduler's computed count may run ahead of verified ones (async + spec).
    spec_margin: int
    #: Whether prefill chunks' full tiles are quantized in the step that writes them.
    direct_flush: bool = True
    #: Why direct flush is off ("" when it is on).
    direct_flush_off_reason: str = ""
    #: Whether pool slots leave each tile's shadow rows in its block's record area.
    shadow_rows: bool = True
    #: Whether uniform speculative-verify batches run as FULL CUDA graphs
    #: (:func:`verify_graphs_setting`).
    verify_graphs: bool = False
    #: The decode kernel and its query rows per program (:func:`decode_kernel_setting`).
    decode_variant: str = "auto"
    decode_mma_rows: int | None = None

    def serving_config(self) -> ServingConfig:
        return ServingConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
            spec_tokens=self.spec_tokens,
            direct_flush=self.direct_flush,
        )


#: Set to 0 to turn direct flush off: prefill tiles then go through the side pool and are
#: flushed at the next step, and the pool gets format-spec §4.3's ``ceil(T/G)`` term back.
DIRECT_FLUSH_ENV = "KVARN_DIRECT_FLUSH"


def direct_flush_setting(vllm_config: VllmConfig) -> tuple[bool, str]:
    """Whether this configuration quantizes prefill tiles in the step that writes them.

    Returns ``(on, reason_if_off)``. Evaluated identically in the engine process (which sizes
    the pool, patch P5) and in every worker (which sizes and runs it), from fields vLLM does
    not change after building the config. Off when:

    * env ``KVARN_DIRECT_FLUSH=0`` (the escape hatch);
    * micro-batching (``--enable-dbo`` / ``ubatch_size > 1``): a step's tokens would be split
      over several metadata builds, and a tile split between two of them would be written by
      neither;
    * vLLM's compilation (``VLLM_COMPILE``) keeps the KV-cache update inside the compiled
      pieces (custom ``splitting_ops`` without ``vllm::unified_kv_cache_update``, e.g. with
      Inductor graph partition): piecewise CUDA graphs would then capture the update of a
      dummy batch and replay it without the step's direct tiles. By default vLLM 0.23 splits
      the graph at that op, so the update runs eagerly and may depend on the step.
    """
    if not _env_flag(DIRECT_FLUSH_ENV):
        return False, f"{DIRECT_FLUSH_ENV}={os.environ[DIRECT_FLUSH_ENV].strip().lower()}"
    parallel = vllm_config.parallel_config
    if (
        bool(getattr(parallel, "enable_dbo", False))
        or int(getattr(parallel, "ubatch_size", 0) or 0) > 1
    ):
        return False, "micro-batching (DBO) splits a step over several metadata builds"
    from vllm.config import CompilationMode

    comp = vllm_config.compilation_config
    if (
        comp.mode == CompilationMode.VLLM_COMPILE
        and not comp.splitting_ops_contain_kv_cache_update()
    ):
        return False, (
            "vllm::unified_kv_cache_update is not a graph-splitting op, so piecewise CUDA "
            "graphs could capture the KV-cache update"
        )
    return True, ""


#: Uniform speculative-verify batches (every request 1 + drafts tokens) are captured in FULL
#: CUDA graphs, as vLLM's FlashAttention backend does (on since the ninth session's H200 run,
#: docs/vllm-plugin.md); set to 0 to leave them eager, vLLM then running engines with drafts
#: on piecewise graphs.
VERIFY_GRAPHS_ENV = "KVARN_VERIFY_CUDA_GRAPHS"


def verify_graphs_setting(spec_tokens: int) -> bool:
    """Whether uniform verify batches are captured in FULL CUDA graphs: with speculative
    decoding, unless env ``KVARN_VERIFY_CUDA_GRAPHS=0``. Then the tracker keeps steps of at most
    ``1 + spec_tokens`` tokens out of the direct flush (``SidePoolTracker(pool_only_upto=)``):
    a replayed graph's KV update cannot depend on the step."""
    return spec_tokens > 0 and _env_flag(VERIFY_GRAPHS_ENV)


#: Set to 0 to give every side-pool slot whole tiles: no tile rows are kept in the record
#: area of the block a pool tile belongs to (costs ~21-27% more pool memory).
SHADOW_ROWS_ENV = "KVARN_SHADOW_ROWS"


def shadow_rows_setting() -> bool:
    """Whether side-pool slots leave each tile's first rows in its block's idle record area
    (:func:`kvarn_format.geometry.shadow_rows`); env ``KVARN_SHADOW_ROWS=0`` turns it off.
    Read in the engine process (which charges the pool) and in every worker (which allocates
    it), so both must see the same environment, as with ``KVARN_DIRECT_FLUSH``."""
    return _env_flag(SHADOW_ROWS_ENV)


#: The decode kernel variant of kvarn-kernels' ``decode_attention`` (default ``auto``, its own
#: choice), and the query rows per program of the v4 variants (default their 16): for timing
#: candidates in serving before they become the default (docs/kernel-notes.md).
DECODE_VARIANT_ENV = "KVARN_DECODE_VARIANT"
DECODE_MMA_ROWS_ENV = "KVARN_DECODE_MMA_ROWS"


def decode_kernel_setting() -> tuple[str, int | None]:
    """``(variant, mma_rows)`` for decode batches, from env ``KVARN_DECODE_VARIANT`` and
    ``KVARN_DECODE_MMA_ROWS``; a value kvarn-kernels does not take raises here, at start-up.
    Read in the engine process (a variant's extra partials count in the charged decode
    workspace) and in every worker, so both must see the same environment."""
    from kvarn_kernels.attention import DECODE_VARIANTS, MMA_ROWS, V4_VARIANTS

    variant = os.environ.get(DECODE_VARIANT_ENV, "").strip().lower() or "auto"
    if variant != "auto" and variant not in DECODE_VARIANTS:
        raise ValueError(
            f"{DECODE_VARIANT_ENV} must be 'auto' or one of {DECODE_VARIANTS}, got {variant!r}"
        )
    raw = os.environ.get(DECODE_MMA_ROWS_ENV, "").strip()
    if not raw:
        return variant, None
    if raw not in {str(rows) for rows in MMA_ROWS}:
        raise ValueError(f"{DECODE_MMA_ROWS_ENV} must be 4, 8 or 16, got {raw!r}")
    if variant == "v1":
        raise ValueError(f"{DECODE_MMA_ROWS_ENV} applies to the variants {V4_VARIANTS} only")
    return variant, int(raw)


#: How continuation chunks attend to their cached context: ``dequant`` (default: the context
#: dequantized to fp16, then FlashAttention), ``fused`` (kvarn-kernels' fused prefill, one
#: kernel on the packed records: v3 on Hopper) or ``auto`` (per batch,
#: :func:`kvarn_kernels.prefill_method`: fused for chunks of up to 64 tokens where v3 runs,
#: where it took 0.58-0.93x the dequantize path's eager time; docs/kernel-notes.md,
#: twenty-eighth session).
PREFILL_CONTEXT_ENV = "KVARN_PREFILL_CONTEXT"
PREFILL_CONTEXT_METHODS = ("auto", "dequant", "fused")


def prefill_context_setting() -> str:
    """The ``prefill_attention`` method for continuation chunks, from env
    ``KVARN_PREFILL_CONTEXT`` (``dequant`` when unset); another value raises here, at
    start-up. Read in every worker."""
    method = os.environ.get(PREFILL_CONTEXT_ENV, "").strip().lower() or "dequant"
    if method not in PREFILL_CONTEXT_METHODS:
        raise ValueError(
            f"{PREFILL_CONTEXT_ENV} must be one of {PREFILL_CONTEXT_METHODS}, got {method!r}"
        )
    return method


def _env_flag(name: str, default: bool = True) -> bool:
    """An on/off environment switch (``default`` when unset or empty); anything but 0/1 (or
    false/true, off/on, no/yes) raises."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("0", "false", "off", "no"):
        return False
    if raw not in ("1", "true", "on", "yes"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return True


def serving_limits(vllm_config: VllmConfig) -> ServingLimits:
    sched = vllm_config.scheduler_config
    spec_cfg = vllm_config.speculative_config
    spec_tokens = int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0) if spec_cfg else 0
    async_sched = bool(getattr(sched, "async_scheduling", False))
    direct, why_not = direct_flush_setting(vllm_config)
    decode_variant, decode_mma_rows = decode_kernel_setting()
    return ServingLimits(
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        spec_tokens=spec_tokens,
        spec_margin=spec_tokens if async_sched else 0,
        direct_flush=direct,
        direct_flush_off_reason=why_not,
        shadow_rows=shadow_rows_setting(),
        verify_graphs=verify_graphs_setting(spec_tokens),
        decode_variant=decode_variant,
        decode_mma_rows=decode_mma_rows,
    )


def pool_slots_for(fmt: DenseFormat, limits: ServingLimits) -> int:
    """Side-pool slots per layer for these limits (kvarn-format's dense rule: ``2*S + 8`` plus
    rollback tiles with direct flush, plus ``ceil(T/G)`` without)."""
    return side_pool_slots(SidePool("dense", fmt.group, 0), limits.serving_config())


#: SM count assumed when bounding the decode workspace in the engine process (which must not
#: initialize CUDA): at least every current NVIDIA data-center GPU (H100/H200 132, B200 148).
MAX_SMS_BOUND = 160


def decode_workspace_bytes(
    max_batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_blocks: int,
    verify_width: int = 0,
    decode_variant: str = "auto",
) -> int:
    """Upper bound of the decode workspace the worker allocates (fp32 elements x 4).

    The worker sizes it with :func:`kvarn_kernels.decode_workspace_numel` for every batch size
    up to ``max_num_seqs`` at the split count the kernels choose on the real device; with
    ``verify_width`` (uniform verify graphs on) also for those batches' verify passes, which
    share it (``verify_width`` rows per request).
    """
    import kvarn_kernels

    def numel(rows: int, partials: int) -> int:
        return int(kvarn_kernels.decode_workspace_numel(rows, num_q_heads, head_size, partials))

    largest = 0
    for b in range(1, max(max_batch, 1) + 1):
        partials = kvarn_kernels.max_decode_partials(
            decode_variant, b, num_q_heads, num_kv_heads, max_blocks, max_sms=MAX_SMS_BOUND
        )
        largest = max(largest, numel(b, partials))
        if verify_width:  # verify_width rows per request
            partials = kvarn_kernels.max_verify_partials(
                b, num_q_heads, num_kv_heads, verify_width, max_blocks, max_sms=MAX_SMS_BOUND
            )
            largest = max(largest, numel(b * verify_width, partials))
    return 4 * largest


@dataclass(frozen=True, slots=True)
class Reservation:
    """What KVarN takes from one worker's KV memory before vLLM counts blocks."""

    cache_dtype: str
    kvarn_layers: int
    pool_slots: int
    pool_bytes: int
    workspace_bytes: int
    table_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.workspace_bytes + self.table_bytes


def _num_q_heads(vllm_config: VllmConfig) -> int:
    model = vllm_config.model_config
    return int(model.get_num_attention_heads(vllm_config.parallel_config))


def reservation_for_worker(
    vllm_config: VllmConfig, specs: dict[str, Any], available_bytes: int
) -> Reservation | None:
    """The side pools, decode workspace and ``block_to_slot`` table of one worker's KVarN layers.

    ``specs`` is that worker's layer -> KV-cache spec map. ``None`` when it has no KVarN layer.
    """
    from kvarn_vllm.specs import KvarnFullAttentionSpec

    kvarn = [s for s in specs.values() if isinstance(s, KvarnFullAttentionSpec)]
    if not kvarn:
        return None
    dtypes = {s.kvarn_dtype for s in kvarn}
    if len(dtypes) != 1:
        raise ValueError(f"kvarn: one worker mixes KVarN formats {sorted(dtypes)}")
    cache_dtype = dtypes.pop()
    fmt = parse_cache_dtype(cache_dtype)
    assert isinstance(fmt, DenseFormat)
    limits = serving_limits(vllm_config)
    slots = pool_slots_for(fmt, limits)
    pool_bytes = sum(
        slots * dense_slot_bytes(fmt, s.num_kv_heads, s.head_size, shadow=limits.shadow_rows)
        for s in kvarn
    )
    head_size = max(s.head_size for s in kvarn)
    num_kv_heads = max(s.num_kv_heads for s in kvarn)
    workspace = decode_workspace_bytes(
        limits.max_num_seqs,
        _num_q_heads(vllm_config),
        num_kv_heads,
        head_size,
        -(-limits.max_model_len // fmt.group),
        verify_width=limits.spec_tokens + 1 if limits.verify_graphs else 0,
        decode_variant=limits.decode_variant,
    )
    # block_to_slot holds one int32 per G-token block; bound the block count from above.
    page_sum = sum(int(s.page_size_bytes) for s in specs.values()) or 1
    min_tiles = min(s.tiles_per_block for s in kvarn)
    table = 4 * max(0, available_bytes // page_sum) * max(min_tiles, 1)
    return Reservation(cache_dtype, len(kvarn), slots, pool_bytes, workspace, table)


def shrink_available_memory(
    vllm_config: VllmConfig, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
) -> tuple[list[int], list[Reservation | None]]:
    """Subtract each worker's reservation; raise when nothing is left for the KV cache."""
    reservations = [
        reservation_for_worker(vllm_config, specs, avail)
        for specs, avail in zip(kv_cache_specs, available_memory, strict=True)
    ]
    out: list[int] = []
    for avail, res in zip(available_memory, reservations, strict=True):
        if res is None:
            out.append(avail)
            continue
        left = avail - res.total_bytes
        if left <= 0:
            raise ValueError(
                f"kvarn: the {res.cache_dtype} side pool ({res.pool_slots} slots x "
                f"{res.kvarn_layers} layers = {_size(res.pool_bytes)}) and decode "
                f"workspace ({_size(res.workspace_bytes)}) leave nothing of the "
                f"{_size(avail)} available for the KV cache: lower "
                "--max-num-seqs or --max-num-batched-tokens, or raise "
                "--gpu-memory-utilization / --kv-cache-memory-bytes"
            )
        out.append(left)
    return out, reservations


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def log_capacity(
    vllm_config: VllmConfig,
    kv_cache_configs: list[Any],
    reservations: list[Reservation | None],
    available_before: list[int],
) -> list[int]:
    """Log the KVarN capacity in tokens per worker; returns the token counts logged."""
    from kvarn_vllm.specs import KvarnFullAttentionSpec

    tokens_out: list[int] = []
    for rank, (config, res, avail) in enumerate(
        zip(kv_cache_configs, reservations, available_before, strict=True)
    ):
        if res is None:
            continue
        block_size = 0
        fp16_page = 0
        for group in config.kv_cache_groups:
            spec = group.kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)
            layer_specs = list(inner.values()) if inner else [spec] * len(group.layer_names)
            for s in layer_specs:
                if isinstance(s, KvarnFullAttentionSpec):
                    block_size = max(block_size, s.block_size)
                    fp16_page += 2 * s.block_size * s.num_kv_heads * s.head_size * 2
                else:
                    fp16_page += int(s.page_size_bytes)
        tokens = config.num_blocks * block_size
        tokens_out.append(tokens)
        fp16_tokens = (avail // fp16_page) * block_size if fp16_page else 0
        ratio = tokens / fp16_tokens if fp16_tokens else float("nan")
        logger.info(
            "kvarn: worker %d KV cache capacity %s tokens with %s (%d blocks of %d tokens; "
            "%.2fx an fp16 cache in the same memory); side pool %d slots x %d layers = %s "
            "and decode workspace %s charged to the KV budget",
            rank,
            f"{tokens:,}",
            res.cache_dtype,
            config.num_blocks,
            block_size,
            ratio,
            res.pool_slots,
            res.kvarn_layers,
            _size(res.pool_bytes),
            _size(res.workspace_bytes),
        )
    return tokens_out
