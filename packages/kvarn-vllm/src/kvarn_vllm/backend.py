"""The KVarN attention backend for vLLM 0.23: backend class, metadata builder and impl.

* :class:`KvarnAttentionBackend` declares what it serves (dense ``kvarn_*`` dtypes of one tile
  size ``G``, head sizes 64/128/256/512, block size ``G``, decoder self-attention only) so that
  vLLM's own ``validate_configuration`` rejects everything else. There is one subclass per
  ``G`` because vLLM asks a backend for its block sizes without saying which dtype.
* :class:`KvarnMetadataBuilder` is a thin adapter: it applies the side-pool plans of
  :class:`~kvarn_vllm.runtime.KvarnGroupRuntime` (flushes, ``block_to_slot``) before the
  forward, splits the batch (decodes first, then runs of first prefill chunks and of
  continuations) and hands the impl what it needs.
* :class:`KvarnAttentionImpl` quantizes the tiles this step completes straight from its K/V
  (direct flush) and writes the rest (rotated, fp16) into the side pool in
  ``do_kv_cache_update``, then routes: decode rows -> the fused decode kernel; first prefill
  chunks (``seq_len == query_len``) -> FlashAttention on the raw K/V (torch SDPA where
  ``vllm.vllm_flash_attn`` is unavailable, e.g. on CPU); continuations and verifies ->
  prefill-with-context over pool and packed tiles.

CUDA graphs: pure-decode batches are captured (``UNIFORM_SINGLE_TOKEN_DECODE``, so vLLM's
default ``FULL_AND_PIECEWISE`` mode keeps full graphs for decode and piecewise graphs around
attention otherwise). Everything a captured decode reads (``block_to_slot``, the pools, the
workspace, vLLM's block table and seq_lens) is a persistent buffer, and the split count is
fixed from ``max_model_len``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

# Profiler ranges (``kvarn: *``): a ``record_function`` only with
# VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 (tools/bench_serving.py --profile), else a nullcontext.
from vllm.v1.utils import record_function_or_nullcontext as _prof_range

from kvarn_format import DENSE_DTYPES, DENSE_HEAD_DIMS, DenseFormat, parse_cache_dtype
from kvarn_vllm.budget import verify_graphs_setting
from kvarn_vllm.runtime import DirectTiles, KvarnGroupRuntime
from kvarn_vllm.specs import KvarnFullAttentionSpec, lookup_tile_stride

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.kv_cache_interface import AttentionSpec

    from kvarn_kernels.context import ContextPlan, VarlenAttention
    from kvarn_kernels.decode_batch import DecodeBatchPlan, VerifyBatchPlan
    from kvarn_kernels.fused_prefill import FusedPrefillPlan
    from kvarn_kernels.rotation import SidePoolWritePlan

__all__ = [
    "BACKENDS",
    "KvarnAttentionBackend",
    "KvarnAttentionBackendG64",
    "KvarnAttentionBackendG128",
    "KvarnAttentionImpl",
    "KvarnMetadata",
    "KvarnMetadataBuilder",
    "backend_for",
]

logger = logging.getLogger("vllm.kvarn")


def _kernels() -> Any:
    import kvarn_kernels

    return kvarn_kernels


def _dense(cache_dtype: str) -> DenseFormat:
    fmt = parse_cache_dtype(cache_dtype)
    if not isinstance(fmt, DenseFormat):
        raise ValueError(
            f"{cache_dtype} is an MLA format: MLA models are not yet supported by kvarn-vllm"
        )
    return fmt


# ---------------------------------------------------------------------------------------------
# Backend


class KvarnAttentionBackend(AttentionBackend):
    """Base of the per-tile-size backends; never selected itself."""

    #: Tokens per tile (= block size) this backend serves.
    group: ClassVar[int] = 0

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = []

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ evaluates AttentionBackendEnum[get_name()]; CUSTOM is the slot
        # vLLM reserves for out-of-tree backends (registered by patch P2).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KvarnAttentionImpl]:
        return KvarnAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvarnMetadataBuilder]:
        return KvarnMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return [cls.group]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # 512 since the tenth session: decode, prefill with context (both methods) and verify
        # passed at 512 on an H200 (kernel-check group head_dim_512); the one kernel branch
        # that was wrong there (v1 without register prefetch) is refused and never serves.
        return list(DENSE_HEAD_DIMS)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, Hk, tile_stride)`` uint8: one record per (block, KV head)."""
        fmt = _dense(cache_dtype_str)
        if block_size != fmt.group:
            raise ValueError(
                f"{cache_dtype_str} needs kernel blocks of {fmt.group} tokens (one tile), got "
                f"{block_size}"
            )
        stride = lookup_tile_stride(cache_dtype_str, num_kv_heads, head_size)
        return (num_blocks, num_kv_heads, stride)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        # None on CPU (Triton interpreter); the Triton kernels need Ampere or newer on CUDA.
        return capability is None or capability.major >= 8

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # A connector would move packed blocks without their side-pool state.
        return False

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        device_capability: Any,
    ) -> str | None:
        if block_size is not None and block_size % cls.group:
            return (
                f"block_size {block_size} is not a multiple of the {cls.group}-token tile; "
                f"pass --block-size {cls.group}"
            )
        return None


class KvarnAttentionBackendG64(KvarnAttentionBackend):
    """KVarN dense formats with 64-token tiles."""

    group = 64
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [d for d in DENSE_DTYPES if d.endswith("_g64")]


class KvarnAttentionBackendG128(KvarnAttentionBackend):
    """KVarN dense formats with 128-token tiles."""

    group = 128
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [
        d for d in DENSE_DTYPES if d.endswith("_g128")
    ]


BACKENDS: dict[int, type[KvarnAttentionBackend]] = {
    KvarnAttentionBackendG64.group: KvarnAttentionBackendG64,
    KvarnAttentionBackendG128.group: KvarnAttentionBackendG128,
}


def backend_for(cache_dtype: str) -> type[KvarnAttentionBackend]:
    """The backend class serving ``cache_dtype`` (raises for MLA and unknown dtypes)."""
    fmt = _dense(cache_dtype)
    try:
        return BACKENDS[fmt.group]
    except KeyError:
        raise ValueError(f"no KVarN backend for {fmt.group}-token tiles") from None


# ---------------------------------------------------------------------------------------------
# Metadata

# One runtime per (layers, KV-cache generation), shared by the builders vLLM creates for one
# group (e.g. one per micro-batch). Weak: it dies with the builders of a discarded KV cache.
_RUNTIME_BY_KEY: weakref.WeakValueDictionary[tuple[Any, ...], KvarnGroupRuntime] = (
    weakref.WeakValueDictionary()
)


def _shared_runtime(
    spec: KvarnFullAttentionSpec,
    layer_names: list[str],
    vllm_config: VllmConfig,
    device: torch.device,
) -> KvarnGroupRuntime:
    key = (
        tuple(layer_names),
        id(vllm_config),
        vllm_config.cache_config.num_gpu_blocks,
        str(device),
    )
    runtime = _RUNTIME_BY_KEY.get(key)
    if runtime is None:
        runtime = KvarnGroupRuntime(spec, layer_names, vllm_config, device)
        _RUNTIME_BY_KEY[key] = runtime
    return runtime


@dataclass(slots=True)
class PrefillRun:
    """Consecutive prefill rows of one kind: ``first`` chunks, ``context`` continuations or
    ``verify`` rows (speculative verification under async scheduling:
    :meth:`KvarnMetadataBuilder._prefill_runs`)."""

    kind: str
    req_start: int
    req_end: int
    tok_start: int
    tok_end: int
    max_query_len: int
    max_seq_len: int
    #: ``[n + 1]`` int32 on the device: query offsets relative to ``tok_start``.
    cu_seqlens: torch.Tensor
    #: Host copies: query lengths, total lengths and relative query offsets of the rows
    #: (the SDPA fallback and prefill-with-context read them instead of syncing).
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    cu_host: list[int] = field(default_factory=list)
    #: ``context`` runs: the ``prefill_attention`` method, decided once here for every layer
    #: (``"dequant"`` or ``"fused"``: the runtime's ``context_method``).
    context_method: str = "dequant"
    #: ``context`` runs on the dequantize path: kvarn-kernels' schedule of the run, built once
    #: here and shared by every layer's ``prefill_attention`` (saves each layer the planning
    #: and its copy).
    context_plan: ContextPlan | None = None
    #: ``context`` runs on the fused kernel: kvarn-kernels' plan of the run, holding its
    #: block-table rows, device query offsets and lengths and the block-to-slot map, built
    #: once here; every layer passes those very tensors with it and skips the checks and
    #: launch set-up the first layer did.
    fused_plan: FusedPrefillPlan | None = None
    #: ``verify`` runs: the run's block-table rows and device lengths, copied once per step
    #: into fresh tensors (16-byte aligned: Triton compiles a kernel again for a pointer
    #: that is not, and a slice from a run's first row need not be); the uniform run's are
    #: the runner's own (they start at row 0).
    verify_block_table: torch.Tensor | None = None
    verify_seq_lens: torch.Tensor | None = None
    #: The uniform verify run of a batch a FULL CUDA graph may capture: it runs in the
    #: runtime's fixed workspace at the runtime's split count (nothing allocated in a capture).
    uniform: bool = False
    #: ``verify`` runs: kvarn-kernels' plan of the run (its index tensors above, the
    #: block-to-slot map, the server's fixed tokens per request; for the uniform run the
    #: runtime's workspace and split count), built once here; the first layer checks and sets
    #: up the launches, the others only launch.
    verify_plan: VerifyBatchPlan | None = None


@dataclass(slots=True)
class KvarnMetadata(AttentionMetadata):
    runtime: KvarnGroupRuntime
    block_to_slot: torch.Tensor
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    max_seq_len: int
    prefill_runs: list[PrefillRun]
    #: Tiles this step's forward quantizes from its own K/V, or None (never in capture builds
    #: or pure-decode batches).
    direct: DirectTiles | None = None
    #: The decode rows' launches, prepared by the first layer and replayed by the others
    #: (vLLM runs them eagerly in every step with a prefill in it); None without decode rows.
    decode_batch_plan: DecodeBatchPlan | None = None
    #: The side-pool write's launches, made by the first layer's ``do_kv_cache_update`` for
    #: the slot mapping vLLM passes it and replayed by the layers passing the same tensor.
    pool_write_plan: SidePoolWritePlan | None = None


class KvarnMetadataBuilder(AttentionMetadataBuilder[KvarnMetadata]):
    """Applies the side-pool plan, then describes the batch for the impl."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not isinstance(kv_cache_spec, KvarnFullAttentionSpec):
            raise TypeError(
                f"kvarn: the KVarN backend got a {type(kv_cache_spec).__name__} for layers "
                f"{layer_names[:3]}...; the spec hook (patch P3) did not run in this process"
            )
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        self.runtime = _shared_runtime(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: AttentionSpec
    ) -> AttentionCGSupport:
        """FULL graphs for single-token decode batches and, with drafts, for uniform verify
        batches (unless ``KVARN_VERIFY_CUDA_GRAPHS=0``: vLLM then runs an engine with drafts
        on piecewise graphs only, attention eager)."""
        spec = vllm_config.speculative_config
        drafts = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        if verify_graphs_setting(drafts):
            return AttentionCGSupport.UNIFORM_BATCH
        return cls._cudagraph_support

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KvarnMetadata:
        with _prof_range("kvarn: build"):
            with _prof_range("kvarn: apply_pending"):
                self.runtime.apply_pending()
            cam = common_attn_metadata
            direct = None
            if cam.max_query_len >= 2:
                # The tracker only plans direct tiles for requests with two or more tokens in
                # the step, so a batch of single tokens (what FULL CUDA graphs capture and
                # replay) never carries them; skipping it keeps decode replays step-independent.
                with _prof_range("kvarn: direct_tiles"):
                    direct = self.runtime.direct_tiles(cam.slot_mapping, cam.num_actual_tokens)
                if direct is not None and self._uniform_verify(cam):
                    # a graph replay would skip them (the tracker's pool_only_upto forbids it)
                    raise RuntimeError(
                        "kvarn: a uniform verify batch carries direct tiles; please report this"
                    )
            return self._describe(cam, direct)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> KvarnMetadata:
        # No side-pool work at capture time: only describe the (dummy) decode batch.
        cam = common_attn_metadata
        if cam.max_query_len > 1 and not self._uniform_verify(cam):
            # a multi-token capture must be the uniform verify run: any other description
            # would be replayed on copies made at capture time
            raise RuntimeError(
                f"kvarn: vLLM captures a FULL CUDA graph of {cam.num_reqs} requests and "
                f"{cam.num_actual_tokens} tokens, which is not a uniform verify batch of "
                f"{self.runtime.verify_width} tokens per request; please report this"
            )
        return self._describe(cam)

    def _describe(
        self, cam: CommonAttentionMetadata, direct: DirectTiles | None = None
    ) -> KvarnMetadata:
        if not cam.causal:
            raise ValueError("kvarn: non-causal attention is not supported")
        table = self.runtime.ensure_block_table()
        runs: list[PrefillRun] = []
        if self._uniform_verify(cam):
            runs = [self._uniform_verify_run(cam)]
            num_decodes = num_decode_tokens = 0
        else:
            num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
                cam, decode_threshold=1
            )
            if num_prefills:
                rt = self.runtime
                runs = self._prefill_runs(
                    cam,
                    num_decodes,
                    self.kv_cache_spec,
                    verify_width=rt.verify_width,
                    exact_host_lens=not rt.spec_margin,
                    context_method=rt.context_method,
                    block_to_slot=table,
                )
        # The fixed decode workspace exists before any decode kernel runs (or is captured).
        workspace = self.runtime.ensure_decode_workspace(num_decodes)
        for run in runs:
            if run.kind == "verify":
                run.verify_plan = self._verify_plan(run, table, workspace)
        decode_batch_plan = None
        if num_decodes:
            plan = self.runtime.decode_plan(num_decodes)
            decode_batch_plan = _kernels().plan_decode_batch(
                cam.block_table_tensor[:num_decodes],
                cam.seq_lens[:num_decodes],
                table,
                variant=plan.variant,
                num_splits=plan.num_splits,
                mma_rows=self.runtime.decode_mma_rows,
                workspace=workspace,
            )
        return KvarnMetadata(
            runtime=self.runtime,
            block_to_slot=table,
            num_actual_tokens=cam.num_actual_tokens,
            slot_mapping=cam.slot_mapping,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            query_start_loc=cam.query_start_loc,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            max_seq_len=cam.max_seq_len,
            prefill_runs=runs,
            direct=direct,
            decode_batch_plan=decode_batch_plan,
        )

    def _verify_plan(
        self, run: PrefillRun, block_to_slot: torch.Tensor, workspace: torch.Tensor
    ) -> VerifyBatchPlan:
        """kvarn-kernels' plan of a verify run: a fixed ``max_query_len`` per server (1 +
        drafts: one compile, not one per length); the uniform run (which a FULL graph may
        capture) in the runtime's workspace at its split count."""
        assert run.verify_block_table is not None and run.verify_seq_lens is not None
        rt = self.runtime
        fixed: dict[str, Any] = {}
        if run.uniform:
            fixed = {"workspace": workspace, "num_splits": rt.verify_plan(run.req_end).num_splits}
        plan: VerifyBatchPlan = _kernels().plan_verify_batch(
            run.verify_block_table,
            run.cu_seqlens,
            run.verify_seq_lens,
            block_to_slot,
            max_query_len=max(rt.verify_width, run.max_query_len),
            **fixed,
        )
        return plan

    def _uniform_verify(self, cam: CommonAttentionMetadata) -> bool:
        """Whether this batch is one a FULL CUDA graph of uniform verify batches captures or
        replays: every request ``verify_width`` tokens (after vLLM's padding, which adds
        requests without tokens and counts their ``verify_width`` tokens each)."""
        width = self.runtime.verify_width
        return (
            self.runtime.verify_graphs
            and width > 1
            and cam.max_query_len == width
            and cam.num_actual_tokens == cam.num_reqs * width
        )

    def _uniform_verify_run(self, cam: CommonAttentionMetadata) -> PrefillRun:
        """The whole batch as one verify run on vLLM's own persistent tensors.

        A replayed graph reads the addresses it captured: the block table, device lengths and
        query offsets are the runner's buffers (refilled in place every step), never copies.
        Every row is attended by :func:`kvarn_kernels.verify_attention`, each token up to
        itself on the device lengths: right for verify rows and for any other row of at most
        ``verify_width`` tokens (a short prompt or continuation), whose tokens the KV update
        has written to the pool (the tracker keeps such steps out of the direct flush). The
        padding requests have no tokens; the padded tail's rows come out as zeros."""
        n = cam.num_reqs
        return PrefillRun(
            kind="verify",
            req_start=0,
            req_end=n,
            tok_start=0,
            tok_end=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            cu_seqlens=cam.query_start_loc[: n + 1],
            verify_block_table=cam.block_table_tensor[:n],
            verify_seq_lens=cam.seq_lens[:n],
            uniform=True,
        )

    @staticmethod
    def _prefill_runs(
        cam: CommonAttentionMetadata,
        first_row: int,
        spec: AttentionSpec,
        verify_width: int = 0,
        exact_host_lens: bool = True,
        context_method: Callable[[int], str] | None = None,
        block_to_slot: torch.Tensor | None = None,
    ) -> list[PrefillRun]:
        """The batch's rows from ``first_row`` on, in runs of one kind: ``first`` chunks,
        ``context`` continuations (planned on the host lengths) and ``verify`` rows.

        A verify row is a speculative verification: a request past its prompt
        (``is_prefilling`` False) scheduling at most ``verify_width`` (1 + drafts) tokens.
        Its query tokens are attended by the decode kernel in one pass per request
        (:func:`kvarn_kernels.verify_attention`), each up to itself on the device lengths:
        faster than the planned path, whose host time dominates a few tokens, and under
        async scheduling (``exact_host_lens`` False) also the only correct path, because
        vLLM's host lengths of verify rows then assume every draft of the previous step was
        accepted and a plan on them would put the queries past the true end of the context.
        Without ``is_prefilling`` in the metadata, continuation rows of at most
        ``verify_width`` tokens count as verify rows when the host lengths are not exact (on
        the device lengths, any row is attended correctly). ``context_method`` gives a
        context run's ``prefill_attention`` method from its longest query (default: the
        dequantize path). Dequantize runs carry a ``ContextPlan``; fused runs a
        ``FusedPrefillPlan`` when ``block_to_slot`` (the cache's block-to-slot map) is
        given."""
        qsl = cam.query_start_loc_cpu.numpy()[: cam.num_reqs + 1]
        seq_cpu = cam.seq_lens_cpu_upper_bound
        if seq_cpu is None:
            seq_cpu = cam.seq_lens.to("cpu")
        seq = seq_cpu.numpy()[: cam.num_reqs].astype(np.int64)
        q_lens = np.diff(qsl).astype(np.int64)
        prefilling = None if cam.is_prefilling is None else cam.is_prefilling.cpu().numpy()

        def kind_of(r: int) -> str:
            if seq[r] == q_lens[r]:
                return "first"
            if q_lens[r] <= verify_width and (
                not bool(prefilling[r]) if prefilling is not None else not exact_host_lens
            ):
                return "verify"
            return "context"

        runs: list[PrefillRun] = []
        row = first_row
        while row < cam.num_reqs:
            if q_lens[row] == 0:
                row += 1
                continue
            kind = kind_of(row)
            end = row + 1
            while end < cam.num_reqs and q_lens[end] > 0 and kind_of(end) == kind:
                end += 1
            t0, t1 = int(qsl[row]), int(qsl[end])
            cu = cam.query_start_loc[row : end + 1] - t0
            cu_host = [int(x) - t0 for x in qsl[row : end + 1]]
            seq_host = [int(x) for x in seq[row:end]]
            max_query_len = int(q_lens[row:end].max())
            plan = fused_plan = verify_table = verify_lens = None
            method = "dequant"
            if kind == "verify":
                verify_table = cam.block_table_tensor[row:end].clone()
                verify_lens = cam.seq_lens[row:end].clone()
            if kind == "context" and context_method is not None:
                method = context_method(max_query_len)
            if kind == "context" and method == "fused" and block_to_slot is not None:
                fused_plan = _kernels().plan_fused_prefill(
                    cam.block_table_tensor[row:end], cu, cam.seq_lens[row:end], block_to_slot
                )
            if kind == "context" and method == "dequant":
                plan = _kernels().plan_prefill_context(
                    spec.block_size,
                    seq_host,
                    cu_host,
                    num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_size,
                    device=cam.query_start_loc.device,
                    max_workspace_bytes=PREFILL_WORKSPACE_BYTES,
                )
            runs.append(
                PrefillRun(
                    kind=kind,
                    req_start=row,
                    req_end=end,
                    tok_start=t0,
                    tok_end=t1,
                    max_query_len=max_query_len,
                    max_seq_len=int(seq[row:end].max()),
                    cu_seqlens=cu,
                    query_lens=[int(x) for x in q_lens[row:end]],
                    seq_lens=seq_host,
                    cu_host=cu_host,
                    context_method=method,
                    context_plan=plan,
                    fused_plan=fused_plan,
                    verify_block_table=verify_table,
                    verify_seq_lens=verify_lens,
                )
            )
            row = end
        return runs


# ---------------------------------------------------------------------------------------------
# Impl


_SDPA_LOGGED = False

#: Cap of prefill-with-context's dequantized K/V workspace (kvarn-kernels' default), also
#: what the memory-profiling run reserves for it.
PREFILL_WORKSPACE_BYTES = 512 << 20


def _metadata_for(layer_name: str) -> KvarnMetadata | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    raw: Any = get_forward_context().attn_metadata
    if isinstance(raw, list):
        # Speculative decoding passes one dict per draft step; [0] is the target model's.
        raw = raw[0] if raw else None
    if isinstance(raw, dict):
        raw = raw.get(layer_name)
    return raw if isinstance(raw, KvarnMetadata) else None


def flash_attention_takes(head_size: int) -> bool:
    """Whether vLLM's FlashAttention can run this head size here; where it cannot, first
    chunks and context attention fall back to torch SDPA instead of failing mid-forward.

    FA3 stops at 256; vLLM sends larger heads to FA4, whose CuTe kernels import the
    ``cutlass`` DSL package, but vLLM only checks that FA4's source file exists (an install
    without the package, such as the device bundle of docs/gpu.md, fails in the forward).
    """
    import importlib.util

    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    if not FlashAttentionBackend.supports_head_size(head_size):
        return False
    return head_size <= 256 or importlib.util.find_spec("cutlass") is not None


class KvarnAttentionImpl(AttentionImpl[KvarnMetadata]):
    """Side-pool write, then decode / first-chunk / context attention by batch part."""

    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "logits soft-capping": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "attention sinks": extra.get("sinks") is not None,
        }
        bad = [what for what, flag in unsupported.items() if flag]
        if bad:
            raise ValueError(
                f"kvarn: {kv_cache_dtype} does not support {', '.join(bad)} in this layer; add "
                "the layer to --kv-cache-dtype-skip-layers or use another --kv-cache-dtype"
            )
        self.fmt = _dense(kv_cache_dtype)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"kvarn: {num_heads} query heads are not a multiple of {self.num_kv_heads}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._fa: Any = None
        self._fa_version: int | None = None
        self._fa_checked = False
        self._varlen: VarlenAttention | None = None

    # ------------------------------------------------------------------ KV write
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Quantize this step's direct tiles, then write the other tokens into the side pool.

        Direct tiles (the tiles this step's prefill chunks complete, see
        ``kvarn_vllm.tracker``) are stored into their packed records from the step's K/V,
        rotated to fp16 exactly as the pool would hold them; a tile that opens with rows an
        earlier step left in the pool reads them first, because this step may reuse that slot
        (the pool write comes second). Both happen before this layer's attention, which then
        finds every block it reads. The remaining tokens (sinks, in-progress blocks, drafts)
        go to the pool; ``write_side_pool`` skips the tokens of blocks without a slot.
        """
        layer_name = str(getattr(layer, "layer_name", ""))
        meta = _metadata_for(layer_name)
        if meta is None:
            return
        n = int(slot_mapping.shape[0])
        if n == 0:
            return
        pools = meta.runtime.pools_for(layer_name)
        kk = _kernels()
        direct = meta.direct
        if direct is not None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "kvarn: a step with direct tiles is being captured in a CUDA graph; the "
                    "KV-cache update must run outside graphs (vLLM's default splitting op) or "
                    "set KVARN_DIRECT_FLUSH=0"
                )
            # Temporaries of 2 * n * Hk * D fp16 elements, freed before attention; the profiled
            # prefill transients (>= 2 * n * Hq * D elements plus the workspace) cover them.
            with _prof_range("kvarn: direct flush"):
                kk.flush_token_tiles(
                    self.fmt,
                    kk.rotate(key[:n]),
                    kk.rotate(value[:n]),
                    direct.row_starts,
                    kv_cache,
                    direct.blocks,
                    pool_k=pools.k,
                    pool_v=pools.v,
                    head_slots=direct.head_slots,
                    head_lens=direct.head_lens,
                )
        with _prof_range("kvarn: pool write"):
            plan = meta.pool_write_plan
            if plan is None or plan.slot_mapping is not slot_mapping:
                # vLLM passes each layer of a KV-cache group the same slot mapping
                plan = kk.plan_side_pool_write(
                    slot_mapping, meta.block_to_slot, group=self.fmt.group
                )
                meta.pool_write_plan = plan
            plan.write(
                key[:n],
                value[:n],
                pools.k,
                pools.v,
                slot_mapping,
                meta.block_to_slot,
                kv_cache=kv_cache,  # each pool tile's shadow rows go to its block's record area
                # Direct tiles' tokens have no slot by design: the debug check would flag them.
                check=False if direct is not None else None,
            )

    # ------------------------------------------------------------------ attention
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvarnMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:
            # Memory profiling run: vLLM skips attention. Touch the transient buffers a real
            # step of this size would need so the profiler's peak includes them.
            self._profile_transients(query)
            return output.zero_()
        meta = attn_metadata
        n = meta.num_actual_tokens
        if n == 0:
            return output
        name = layer.layer_name  # type: ignore[attr-defined]
        pools = meta.runtime.pools_for(name)
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        kk = _kernels()

        ndt = meta.num_decode_tokens
        decode = meta.decode_batch_plan
        if decode is not None:
            with _prof_range("kvarn: decode"):
                kk.decode_attention(
                    self.fmt,
                    q[:ndt],
                    kv_cache,
                    pools.k,
                    pools.v,
                    decode.block_table,
                    decode.seq_lens,
                    decode.block_to_slot,
                    self.scale,
                    out=out[:ndt],
                    batch_plan=decode,
                )
        if meta.prefill_runs:
            k = key[:n].view(n, self.num_kv_heads, self.head_size)
            v = value[:n].view(n, self.num_kv_heads, self.head_size)
            for run in meta.prefill_runs:
                t0, t1 = run.tok_start, run.tok_end
                if run.kind == "first":
                    with _prof_range("kvarn: first chunk"):
                        self._first_chunk(q[t0:t1], k[t0:t1], v[t0:t1], out[t0:t1], run)
                    continue
                if run.kind == "verify":
                    # each query token up to itself, on the device lengths (the host ones may
                    # be optimistic); the context read once per request
                    plan = run.verify_plan
                    assert plan is not None
                    with _prof_range("kvarn: verify"):
                        kk.verify_attention(
                            self.fmt,
                            q[t0:t1],
                            kv_cache,
                            pools.k,
                            pools.v,
                            plan.block_table,
                            plan.query_start_loc,
                            plan.seq_lens,
                            plan.block_to_slot,
                            self.scale,
                            max_query_len=plan.max_query_len,
                            out=out[t0:t1],
                            batch_plan=plan,
                        )
                    continue
                fused = run.fused_plan
                # the batch's index tensors: a plan's own, which it checks by identity
                index = (
                    (fused.block_table, fused.query_start_loc, fused.seq_lens, fused.block_to_slot)
                    if fused is not None
                    else (
                        meta.block_table[run.req_start : run.req_end],
                        run.cu_seqlens,
                        meta.seq_lens[run.req_start : run.req_end],
                        meta.block_to_slot,
                    )
                )
                context = (self.fmt, q[t0:t1], kv_cache, pools.k, pools.v, *index, self.scale)
                with _prof_range("kvarn: context rows"):
                    if run.context_method == "fused":
                        kk.prefill_attention(
                            *context, out=out[t0:t1], method="fused", fused_plan=fused
                        )
                    else:
                        kk.prefill_attention(
                            *context,
                            out=out[t0:t1],
                            varlen_attention=self._varlen_attention(),
                            context_plan=run.context_plan,
                        )
        return output

    def _profile_transients(self, query: torch.Tensor) -> None:
        # Prefill-with-context's temporaries: the dequantized K/V workspace (capped) plus an
        # fp16 copy of q and an fp16 output for every token of the step.
        n = int(query.shape[0])
        size = PREFILL_WORKSPACE_BYTES + 2 * n * self.num_heads * self.head_size * 2
        tmp = torch.empty(size, dtype=torch.uint8, device=query.device)
        del tmp

    # ------------------------------------------------------------------ first chunks
    def _varlen_attention(self) -> VarlenAttention | None:
        """vLLM's FlashAttention (FA3 on Hopper) for the dequantized context of continuation
        chunks, as for first chunks; None lets kvarn-kernels use torch's attention."""
        if self._varlen is None:
            fa = self._flash_attn()
            if fa is None:
                return None
            from kvarn_vllm.flash import varlen_attention_from_vllm

            self._varlen = varlen_attention_from_vllm(fa, self._fa_version)
        return self._varlen

    def _flash_attn(self) -> Any:
        if not self._fa_checked:
            self._fa_checked = True
            from vllm.platforms import current_platform

            if current_platform.is_cuda():
                try:
                    from vllm.v1.attention.backends.fa_utils import (
                        get_flash_attn_version,
                        is_flash_attn_varlen_func_available,
                    )

                    if is_flash_attn_varlen_func_available() and flash_attention_takes(
                        self.head_size
                    ):
                        from vllm.v1.attention.backends import fa_utils

                        self._fa = getattr(fa_utils, "flash_attn_varlen_func")  # noqa: B009
                        self._fa_version = get_flash_attn_version(head_size=self.head_size)
                except ImportError:  # pragma: no cover - CUDA wheel without FA
                    self._fa = None
            global _SDPA_LOGGED
            if self._fa is None and not _SDPA_LOGGED:
                _SDPA_LOGGED = True
                logger.info(
                    "kvarn: first prefill chunks use torch SDPA (no FlashAttention for head "
                    "size %d here)",
                    self.head_size,
                )
        return self._fa

    def _first_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        run: PrefillRun,
    ) -> None:
        """Causal attention of first chunks over their own raw (unquantized) K/V."""
        fa = self._flash_attn()
        if fa is not None:
            kwargs: dict[str, Any] = {}
            if self._fa_version is not None:
                kwargs["fa_version"] = self._fa_version
            fa(
                q=q,
                k=k,
                v=v,
                cu_seqlens_q=run.cu_seqlens,
                cu_seqlens_k=run.cu_seqlens,
                max_seqlen_q=run.max_query_len,
                max_seqlen_k=run.max_query_len,
                softmax_scale=self.scale,
                causal=True,
                out=out,
                **kwargs,
            )
            return
        start = 0
        for length in run.query_lens:
            end = start + length
            qi = q[start:end].transpose(0, 1)
            ki = k[start:end].transpose(0, 1)
            vi = v[start:end].transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = oi.transpose(0, 1).to(out.dtype)
            start = end
