"""Device state of one KVarN KV-cache group: side pools, ``block_to_slot``, decode workspace.

One :class:`KvarnGroupRuntime` exists per KV-cache group of KVarN layers in a worker. The
metadata builders of the group share it (vLLM may create several builders for one group,
e.g. one per micro-batch). It owns:

* per layer, the fp16 side pools ``pool_k``/``pool_v`` ``[num_slots, G, Hk, D]`` (rotated);
* ``block_to_slot`` ``int32 [num_kernel_blocks]``, shared by all layers of the group;
* the decode workspace, fixed-size so CUDA graphs can capture the decode kernel;
* the :class:`~kvarn_vllm.tracker.SidePoolTracker` that decides flushes and slots.

Request lifecycle reaches the tracker through :func:`observe_scheduler_output`, which the
patched ``Worker.execute_model`` calls with every scheduler output before the model runner
runs (patch P6). The builder then applies the resulting plans on the device in ``build`` —
before the forward and never inside CUDA-graph capture — and hands the step's *direct tiles*
(:class:`DirectTiles`: the tiles this step's prefill chunks complete, quantized inside each
layer's KV update) to the impl.

Memory: the pools and the workspace are allocated when the real KV cache is initialized and
are charged in vLLM's KV budget by patch P5 (:mod:`kvarn_vllm.budget`), so the profiler never
sees them and vLLM never over-commits. While vLLM builds its throw-away profiling KV cache
(``num_gpu_blocks`` is still unknown) a runtime gets one-slot pools.
"""

from __future__ import annotations

import importlib
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvarn_format import DenseFormat, record_layout
from kvarn_format.sizing import dense_pool_rows, dense_slot_bytes
from kvarn_vllm.budget import pool_slots_for, prefill_context_setting, serving_limits
from kvarn_vllm.tracker import CachedRequest, NewRequest, SidePoolTracker, StepInput, StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvarn_kernels import DecodePlan
    from kvarn_vllm.specs import KvarnFullAttentionSpec

__all__ = [
    "DirectTiles",
    "KvarnGroupRuntime",
    "PoolPair",
    "live_runtimes",
    "observe_scheduler_output",
    "step_input_from_scheduler_output",
]

logger = logging.getLogger("vllm.kvarn")


@dataclass(frozen=True, slots=True)
class PoolPair:
    """The fp16 side pools of one layer, ``[num_slots, G, Hk, D]`` each, rotated."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True, slots=True)
class DirectTiles:
    """The tiles this step's forward quantizes straight from its K/V (one metadata build).

    All ``int32 [count]`` on the device, the arguments of ``kvarn_kernels.flush_token_tiles``:
    ``blocks`` receive the records; ``row_starts`` is the row, in this build's token order, of
    each tile's first token written this step (-1: the tile's tokens are not all in this
    build, so the store skips it); ``head_lens`` of its tokens (0 = none) come from pool slot
    ``head_slots``.
    """

    blocks: torch.Tensor
    row_starts: torch.Tensor
    head_slots: torch.Tensor
    head_lens: torch.Tensor
    count: int


# Live runtimes of this process; weak so that vLLM dropping its builders (after the profiling
# KV cache, or at shutdown) frees their pools.
_RUNTIMES: weakref.WeakSet[KvarnGroupRuntime] = weakref.WeakSet()


def live_runtimes() -> list[KvarnGroupRuntime]:
    """Runtimes alive in this process, oldest first."""
    return sorted(_RUNTIMES, key=lambda r: r.serial)


_SERIAL = iter(range(1 << 62))


class KvarnGroupRuntime:
    """Side pools, ``block_to_slot`` and the tracker of one KV-cache group of KVarN layers."""

    def __init__(
        self,
        spec: KvarnFullAttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        self.serial = next(_SERIAL)
        fmt = _dense(spec.kvarn_dtype)
        self.fmt: DenseFormat = fmt
        self.group = fmt.group
        self.head_size = spec.head_size
        self.num_kv_heads = spec.num_kv_heads
        self.layout = record_layout(fmt, spec.head_size)
        self.tile_stride = int(spec.tile_stride)  # the cache's record stride (padded: hybrid)
        self.device = device
        self.layer_names = tuple(layer_names)
        self.vllm_config = vllm_config
        cache = vllm_config.cache_config
        self.profiling = cache.num_gpu_blocks is None
        limits = serving_limits(vllm_config)
        self.num_slots = 1 if self.profiling else pool_slots_for(fmt, limits)
        # Rows per slot: with shadow rows on (the default), a tile's first group - pool_rows
        # rows live in its block's record area.
        self.shadow_on = limits.shadow_rows
        self.pool_rows = dense_pool_rows(fmt, spec.head_size, shadow=self.shadow_on)
        self.prefix_caching = bool(cache.enable_prefix_caching)
        self.spec_margin = limits.spec_margin
        #: Query tokens of a speculative verify row (1 + drafts); 0 without drafts.
        self.verify_width = limits.spec_tokens + 1 if limits.spec_tokens else 0
        #: Uniform verify batches (every request ``verify_width`` tokens) are FULL CUDA graphs.
        self.verify_graphs = limits.verify_graphs
        self.direct_flush = limits.direct_flush
        # The current step's direct tiles (host lists from the tracker), uploaded once per
        # step by the first build that needs them.
        self._direct_host: tuple[list[int], list[int], list[int]] | None = None
        self._direct_dev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._row_buf: torch.Tensor | None = None
        self._off_buf: torch.Tensor | None = None
        self._arange: torch.Tensor | None = None

        layers = get_layers_from_vllm_config(vllm_config, Attention, list(layer_names))
        self._layers = layers
        # Layers sharing another layer's KV cache read (and never write) that layer's pools.
        self.pool_owner: dict[str, str] = {}
        self.pools: dict[str, PoolPair] = {}
        shape = (self.num_slots, self.pool_rows, self.num_kv_heads, self.head_size)
        for name in layer_names:
            target = getattr(layers[name], "kv_sharing_target_layer_name", None) or name
            self.pool_owner[name] = target
        for owner in dict.fromkeys(self.pool_owner.values()):
            self.pools[owner] = PoolPair(
                torch.zeros(shape, dtype=torch.float16, device=device),
                torch.zeros(shape, dtype=torch.float16, device=device),
            )

        self.block_to_slot: torch.Tensor | None = None
        self.tracker: SidePoolTracker | None = None
        self.group_id: int | None = None
        self.decode_workspace: torch.Tensor | None = None
        self.max_blocks = -(-int(vllm_config.model_config.max_model_len) // self.group)
        self.num_q_heads = int(
            vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        )
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        #: decode_attention's variant and query rows per program (env, budget.py)
        self.decode_variant = limits.decode_variant
        self.decode_mma_rows = limits.decode_mma_rows
        #: continuation chunks' prefill method (env KVARN_PREFILL_CONTEXT, budget.py)
        self.prefill_context = prefill_context_setting()
        if self.decode_mma_rows is not None:
            # budget.decode_kernel_setting admits only MMA_ROWS: what fails here is the GQA group
            kernels: Any = importlib.import_module("kvarn_kernels.attention")
            try:
                kernels.check_mma_rows(self.decode_mma_rows, self.num_q_heads, self.num_kv_heads)
            except ValueError as exc:
                raise ValueError(
                    f"kvarn: KVARN_DECODE_MMA_ROWS={self.decode_mma_rows} is below this model's "
                    f"{self.num_q_heads // self.num_kv_heads} query heads per KV head: {exc}"
                ) from exc
        self._plans: dict[int, DecodePlan] = {}
        self._workspace_batch = 0
        _RUNTIMES.add(self)
        if not self.profiling:
            pool_bytes = len(self.pools) * self.num_slots * self.slot_bytes
            logger.info(
                "kvarn: %s side pool: %d slots x %d layers (%.2f GiB; %d of %d tile rows per "
                "slot, the rest in the blocks' record areas); prefix caching %s; "
                "direct flush %s",
                fmt.name,
                self.num_slots,
                len(self.pools),
                pool_bytes / (1 << 30),
                self.pool_rows,
                self.group,
                "on" if self.prefix_caching else "off",
                "on" if self.direct_flush else f"off ({limits.direct_flush_off_reason})",
            )
            if self.verify_width:
                logger.info(
                    "kvarn: speculative decoding with %d drafts: uniform verify batches %s",
                    self.verify_width - 1,
                    "in FULL CUDA graphs (KVARN_VERIFY_CUDA_GRAPHS=0 runs them eagerly)"
                    if self.verify_graphs
                    else "run eagerly, vLLM on piecewise graphs (KVARN_VERIFY_CUDA_GRAPHS=0)",
                )
            model_dtype = vllm_config.model_config.dtype
            if device.type == "cuda":
                # the backend serves fp16 and bf16 models only (supported_dtypes)
                act = model_dtype if model_dtype == torch.bfloat16 else torch.float16
                self._warm_up_kernels(act)

    def _warm_up_kernels(self, dtype: torch.dtype) -> None:
        """Compile the kernels of serving steps now: nothing compiles the prefill side before
        the first prompts, nor decode and verify when the engine captures no FULL decode
        graphs (speculative decoding, eager mode); those steps would otherwise each wait
        seconds for Triton (vLLM's JIT monitor logs it)."""
        kk: Any = importlib.import_module("kvarn_kernels")
        start = time.perf_counter()
        try:
            launches = kk.warmup(
                self.fmt,
                head_dim=self.head_size,
                num_q_heads=self.num_q_heads,
                num_kv_heads=self.num_kv_heads,
                device=self.device,
                dtype=dtype,
                shadow_rows=self.group - self.pool_rows,
                record_stride=self.tile_stride,
                # decode and verify for every split count a batch can take
                verify_width=self.verify_width,
                max_num_seqs=self.max_num_seqs,
                block_table_width=self.max_blocks,
                decode_variant=self.decode_variant,
                decode_mma_rows=self.decode_mma_rows,
                # the fused prefill for every batch of continuation chunks it can take
                fused_prefill_max_query=self.fused_prefill_max_query(),
                max_num_batched_tokens=self.max_num_batched_tokens,
            )
        except Exception as exc:  # a warm-up bug must not stop a server that would work
            logger.warning(
                "kvarn: kernel warm-up failed (%s: %s); the kernels will compile on "
                "first use instead. Please report this.",
                type(exc).__name__,
                exc,
            )
            return
        logger.info(
            "kvarn: serving kernels compiled (%d scratch launches, %.1f s); decode kernels: %s",
            launches,
            time.perf_counter() - start,
            self.decode_kernels_by_batch(),
        )

    # ------------------------------------------------------------------ geometry
    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer, K and V."""
        return dense_slot_bytes(self.fmt, self.num_kv_heads, self.head_size, shadow=self.shadow_on)

    def pools_for(self, layer_name: str) -> PoolPair:
        return self.pools[self.pool_owner[layer_name]]

    def kv_cache_of(self, layer_name: str) -> torch.Tensor:
        kv = self._layers[layer_name].kv_cache
        if not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            raise RuntimeError(f"kvarn: layer {layer_name} has no KV cache bound yet")
        return kv

    def ensure_block_table(self) -> torch.Tensor:
        """Allocate ``block_to_slot`` once the KV cache tensors exist (size = kernel blocks)."""
        if self.block_to_slot is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kvarn: block_to_slot must exist before CUDA-graph capture")
            owner = next(iter(self.pools))
            num_blocks = int(self.kv_cache_of(owner).shape[0])
            self.block_to_slot = torch.full(
                (num_blocks,), -1, dtype=torch.int32, device=self.device
            )
        return self.block_to_slot

    def context_method(self, max_query_len: int) -> str:
        """The ``prefill_attention`` method of a continuation run whose longest request has
        ``max_query_len`` query tokens: :attr:`prefill_context`, with ``auto`` decided per
        run by :func:`kvarn_kernels.prefill_method`."""
        if self.prefill_context != "auto":
            return self.prefill_context
        kk: Any = importlib.import_module("kvarn_kernels")
        method: str = kk.prefill_method(self.fmt, self.head_size, max_query_len, self.device)
        return method

    def fused_prefill_max_query(self) -> int:
        """The most query tokens of a request in a continuation run that goes to the fused
        prefill: none with ``dequant``, any with ``fused``, up to
        ``kvarn_kernels.FUSED_PREFILL_MAX_QUERY`` with ``auto`` where it picks the fused
        method at all."""
        if self.prefill_context == "fused":
            return self.max_num_batched_tokens
        if self.prefill_context == "auto" and self.context_method(1) == "fused":
            kk: Any = importlib.import_module("kvarn_kernels")
            return int(kk.FUSED_PREFILL_MAX_QUERY)
        return 0

    def decode_plan(self, batch: int) -> DecodePlan:
        """The decode kernel variant and split count for ``batch`` requests (static shapes
        only, so the same in every CUDA graph of that size and in the workspace sized for it)."""
        plan = self._plans.get(batch)
        if plan is None:
            kk: Any = importlib.import_module("kvarn_kernels")
            plan = kk.decode_plan(
                self.fmt,
                batch,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_size,
                self.max_blocks,
                self.device,
                variant=self.decode_variant,
                mma_rows=self.decode_mma_rows,
            )
            self._plans[batch] = plan
        return plan

    def decode_kernels_by_batch(self) -> str:
        """Which decode kernel serves which batch sizes, e.g. ``"v4c for B = 1-7, v6f for B =
        8-256"`` (for the start-up log: what a benchmark row ran)."""
        spans: list[list[Any]] = []  # [variant, first batch, last batch]
        for batch in range(1, max(self.max_num_seqs, 1) + 1):
            variant = self.decode_plan(batch).variant
            if spans and spans[-1][0] == variant:
                spans[-1][2] = batch
            else:
                spans.append([variant, batch, batch])
        return ", ".join(f"{v} for B = {lo}" + (f"-{hi}" if hi > lo else "") for v, lo, hi in spans)

    def decode_workspace_numel(self, max_batch: int) -> int:
        """fp32 elements of the decode workspace for batches of up to ``max_batch`` requests;
        with uniform verify graphs their verify passes share it (``verify_width`` rows per
        request), so no graph capture allocates one of its own."""
        kk: Any = importlib.import_module("kvarn_kernels")
        batches = range(1, max(max_batch, 1) + 1)
        need = [
            kk.decode_workspace_numel(
                b,
                self.num_q_heads,
                self.head_size,
                self.decode_plan(b).partials,
            )
            for b in batches
        ]
        if self.verify_graphs:
            need += [
                kk.decode_workspace_numel(
                    b * self.verify_width,
                    self.num_q_heads,
                    self.head_size,
                    self.verify_plan(b).partials,
                )
                for b in batches
            ]
        return int(max(need))

    def verify_plan(self, batch: int) -> Any:
        """The kernel and split count ``verify_attention`` runs for ``batch`` uniform verify
        requests (:func:`kvarn_kernels.verify_plan`)."""
        kk: Any = importlib.import_module("kvarn_kernels")
        return kk.verify_plan(
            self.fmt,
            batch,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_size,
            self.verify_width,
            self.max_blocks,
            self.device,
        )

    def ensure_decode_workspace(self, batch: int) -> torch.Tensor:
        """The fp32 decode workspace, sized once for ``max_num_seqs`` (and grown, outside
        CUDA-graph capture only, if a padded batch is larger)."""
        want = max(batch, self.max_num_seqs)
        ws = self.decode_workspace
        if ws is None or batch > self._workspace_batch:
            numel = self.decode_workspace_numel(want)
            if ws is None or ws.numel() < numel:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "kvarn: the decode workspace must be allocated before CUDA-graph capture"
                    )
                ws = torch.empty(numel, dtype=torch.float32, device=self.device)
                self.decode_workspace = ws
            self._workspace_batch = want
        return ws

    # ------------------------------------------------------------------ lifecycle
    def _resolve_group(self, kv_cache_config: Any) -> None:
        """Find this runtime's KV-cache group id and scheduler block size (once)."""
        if self.group_id is not None:
            return
        first = self.layer_names[0]
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            if first in group.layer_names:
                manager_block = int(group.kv_cache_spec.block_size)
                if manager_block % self.group:
                    raise RuntimeError(
                        f"kvarn: KV-cache group {gid} uses {manager_block}-token blocks, not a "
                        f"multiple of the {self.group}-token tile"
                    )
                self.group_id = gid
                self.tracker = SidePoolTracker(
                    self.num_slots,
                    self.group,
                    blocks_per_scheduler_block=manager_block // self.group,
                    prefix_caching=self.prefix_caching,
                    spec_margin=self.spec_margin,
                    direct_flush=self.direct_flush,
                    # a uniform verify batch may be a graph replay: no direct tiles in it
                    pool_only_upto=self.verify_width if self.verify_graphs else 0,
                )
                return
        raise RuntimeError(f"kvarn: layer {first} is in no KV-cache group of this worker")

    def observe(self, scheduler_output: Any, kv_cache_config: Any) -> None:
        """Feed one scheduler output to the tracker (CPU only; plans are applied in build)."""
        if self.profiling:
            return
        self._resolve_group(kv_cache_config)
        assert self.tracker is not None and self.group_id is not None
        plan = self.tracker.step(step_input_from_scheduler_output(scheduler_output, self.group_id))
        self._direct_dev = None
        self._direct_host = (
            (plan.direct_blocks, plan.direct_head_slots, plan.direct_head_lens)
            if plan.direct_blocks
            else None
        )

    def direct_tiles(self, slot_mapping: torch.Tensor, num_tokens: int) -> DirectTiles | None:
        """The current step's direct tiles as they sit in one metadata build (no host sync).

        ``slot_mapping[:num_tokens]`` maps this build's token rows to ``block * G + offset``
        (``-1`` = padding). A block's tokens of one step are consecutive rows at consecutive
        positions, so ``row - offset`` is the same for all of them: scattering it per block
        gives each tile's virtual first row, and the smallest offset per block is where the
        step's tokens of that block begin. A tile's head (rows read from the pool) is the
        tracker's head cut to that offset: with async scheduling and drafts the scheduler's
        computed count can run ahead of the positions the worker really writes, and rows the
        step rewrites must come from the step, not from the pool. A tile counts only if the
        rows it needs hold exactly its first new token and its last token (a build that does
        not contain the whole tile, e.g. a drafter's later pass or a dummy run, gets -1 and
        skips it).
        """
        host = self._direct_host
        if host is None or num_tokens <= 0:
            return None
        if self._direct_dev is None:
            blocks, slots, lens = (self._to_device(x) for x in host)
            self._direct_dev = (blocks, slots, lens)
        blocks, slots, lens = self._direct_dev
        table = self.ensure_block_table()
        num_blocks = int(table.shape[0])
        if self._row_buf is None or self._off_buf is None:
            # One spare entry at the end takes the padding tokens' scatter.
            self._row_buf = torch.zeros(num_blocks + 1, dtype=torch.int64, device=self.device)
            self._off_buf = torch.zeros(num_blocks + 1, dtype=torch.int64, device=self.device)
        if self._arange is None or self._arange.shape[0] < num_tokens:
            self._arange = torch.arange(
                max(num_tokens, 2 * self.max_num_seqs), dtype=torch.int64, device=self.device
            )
        g = self.group
        sm = slot_mapping[:num_tokens].long()
        t = self._arange[:num_tokens]
        valid = sm >= 0
        owner = torch.where(valid, torch.div(sm, g, rounding_mode="floor"), num_blocks)
        offset = torch.remainder(sm, g)
        self._row_buf.scatter_(0, owner, t - offset)
        self._off_buf.scatter_reduce_(0, owner, offset, reduce="amin", include_self=False)
        b = blocks.long()
        head = torch.minimum(lens.long(), self._off_buf[b])
        first = self._row_buf[b] + head
        last = first + (g - 1) - head
        inside = (first >= 0) & (last < num_tokens)
        found = (sm[first.clamp(0, num_tokens - 1)] == b * g + head) & (
            sm[last.clamp(0, num_tokens - 1)] == b * g + (g - 1)
        )
        rows = torch.where(inside & found, first, -1).to(torch.int32)
        return DirectTiles(blocks, rows, slots, head.to(torch.int32), len(host[0]))

    def apply_pending(self) -> None:
        """Run queued flushes and ``block_to_slot`` updates on the device (before the forward).

        All queued plans are merged: flushes only read pool slots, and a slot freed by one
        plan cannot be written again before a forward pass, so every flush reads the data it
        was planned for. The mapping keeps the last value per block.
        """
        if self.tracker is None:
            return
        plans = self.tracker.take_pending()
        if not plans:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kvarn: side-pool flushes must not run under CUDA-graph capture")
        table = self.ensure_block_table()
        flush_slots, flush_blocks, mapping = _merge(plans)
        if flush_slots:
            kvarn_kernels: Any = importlib.import_module("kvarn_kernels")

            src = self._to_device(flush_slots)
            dst = self._to_device(flush_blocks)
            for owner, pair in self.pools.items():
                kvarn_kernels.flush_tiles(
                    self.fmt, pair.k, pair.v, src, self.kv_cache_of(owner), dst
                )
        if mapping:
            blocks = self._to_device(list(mapping))
            slots = self._to_device(list(mapping.values()))
            table.index_copy_(0, blocks.long(), slots)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """Small host integers on the device without a host sync: from pinned memory the copy
        is queued like a kernel (a pageable copy would wait for the GPU to drain the stream)."""
        host = torch.tensor(values, dtype=torch.int32)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)


def _merge(plans: list[StepPlan]) -> tuple[list[int], list[int], dict[int, int]]:
    flush_slots: list[int] = []
    flush_blocks: list[int] = []
    mapping: dict[int, int] = {}
    for plan in plans:
        flush_slots.extend(plan.flush_slots)
        flush_blocks.extend(plan.flush_blocks)
        for block, slot in zip(plan.map_blocks, plan.map_slots, strict=True):
            mapping.pop(block, None)
            mapping[block] = slot
    return flush_slots, flush_blocks, mapping


def _dense(cache_dtype: str) -> DenseFormat:
    from kvarn_format import parse_cache_dtype

    fmt = parse_cache_dtype(cache_dtype)
    if not isinstance(fmt, DenseFormat):
        raise ValueError(f"{cache_dtype}: MLA formats are not yet supported by kvarn-vllm")
    return fmt


def step_input_from_scheduler_output(scheduler_output: Any, group_id: int) -> StepInput:
    """Reduce vLLM's ``SchedulerOutput`` to what the tracker of KV-cache group ``group_id`` needs."""
    new = [
        NewRequest(r.req_id, list(r.block_ids[group_id]), int(r.num_computed_tokens))
        for r in scheduler_output.scheduled_new_reqs
    ]
    cached_data = scheduler_output.scheduled_cached_reqs
    resumed = cached_data.resumed_req_ids
    cached = []
    for i, req_id in enumerate(cached_data.req_ids):
        blocks = cached_data.new_block_ids[i]
        cached.append(
            CachedRequest(
                req_id,
                None if blocks is None else list(blocks[group_id]),
                req_id in resumed,
                int(cached_data.num_computed_tokens[i]),
            )
        )
    return StepInput(
        finished=tuple(scheduler_output.finished_req_ids),
        preempted=tuple(scheduler_output.preempted_req_ids or ()),
        new=new,
        cached=cached,
        num_scheduled=dict(scheduler_output.num_scheduled_tokens),
        num_spec={k: len(v) for k, v in scheduler_output.scheduled_spec_decode_tokens.items()},
    )


def observe_scheduler_output(worker: Any, scheduler_output: Any) -> None:
    """Called (patch P6) at the start of every ``Worker.execute_model`` of this process."""
    runtimes = [r for r in live_runtimes() if not r.profiling]
    if not runtimes:
        return
    runner = getattr(worker, "model_runner", None)
    kv_cache_config = getattr(runner, "kv_cache_config", None)
    if kv_cache_config is None:
        # A KVarN KV cache exists but the runner exposes no KV-cache config: without the
        # request lifecycle the side pool cannot be kept right, so stop instead of serving
        # garbage.
        raise RuntimeError(
            f"kvarn: {type(runner).__name__} has no kv_cache_config; kvarn-vllm supports "
            "vLLM 0.23's GPU (V1 and V2) and CPU model runners only"
        )
    # A profiler range only with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, else a nullcontext.
    from vllm.v1.utils import record_function_or_nullcontext

    with record_function_or_nullcontext("kvarn: observe"):
        for runtime in runtimes:
            runtime.observe(scheduler_output, kv_cache_config)


def iter_layer_pools(runtime: KvarnGroupRuntime) -> Iterator[tuple[str, PoolPair]]:
    yield from runtime.pools.items()
