"""kvarn-kernels: Triton kernels for KVarN, one typed function per op, usable without vLLM.

Serving data model (per attention layer):

* paged cache ``kv_cache: uint8 [num_blocks, Hk, tile_bytes]``: one record per (block, KV
  head), laid out by :func:`kvarn_format.record_layout`;
* side pool ``pool_k, pool_v: fp16 [num_slots, G - R, Hk, D]``, rotated (``x @ H``); the
  first ``R`` rows of each pool tile (shadow rows, default 0) live in its block's record area;
* ``block_to_slot: int32 [num_blocks]``: a block's pool slot, or -1 when it is a packed record.

Ops: :func:`rotate`, :func:`write_side_pool` (with :func:`plan_side_pool_write`, a step's
writes prepared once for its layers), :func:`flush_tiles` (store from pool slots),
:func:`flush_token_tiles` (store straight from a step's rotated K/V rows),
:func:`decode_attention` (with :func:`decode_plan`, the kernel and split count it runs for a
batch shape, and :func:`plan_decode_batch`, its launches prepared once for a step's layers), :func:`verify_attention` (speculative verify: a few query tokens
per request in one decode-kernel pass, or one decode row per token; :func:`verify_plan`, and
:func:`plan_verify_batch`), :func:`prefill_attention` (with
:func:`plan_prefill_context` and :func:`plan_fused_prefill`, its per-batch schedules shared
by a step's layers), plus
:func:`hadamard_matrix` and :func:`warmup` (compiles the serving kernels before serving).
Pure-torch references live in :mod:`kvarn_kernels.reference`.
"""

from kvarn_kernels.attention import (
    FUSED_PREFILL_MAX_QUERY,
    DecodePlan,
    choose_decode_splits,
    decode_attention,
    decode_partials,
    decode_plan,
    decode_splits_for_sms,
    decode_workspace_numel,
    max_decode_partials,
    max_verify_partials,
    prefill_attention,
    prefill_method,
    verify_attention,
    verify_plan,
)
from kvarn_kernels.context import ContextPlan, plan_prefill_context
from kvarn_kernels.decode_batch import (
    DecodeBatchPlan,
    VerifyBatchPlan,
    plan_decode_batch,
    plan_verify_batch,
)
from kvarn_kernels.fused_prefill import FusedPrefillPlan, plan_fused_prefill
from kvarn_kernels.rotation import (
    SidePoolWritePlan,
    hadamard_matrix,
    plan_side_pool_write,
    rotate,
    write_side_pool,
)
from kvarn_kernels.store import flush_tiles, flush_token_tiles
from kvarn_kernels.warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "FUSED_PREFILL_MAX_QUERY",
    "ContextPlan",
    "DecodeBatchPlan",
    "DecodePlan",
    "FusedPrefillPlan",
    "SidePoolWritePlan",
    "VerifyBatchPlan",
    "choose_decode_splits",
    "decode_attention",
    "decode_partials",
    "decode_plan",
    "decode_splits_for_sms",
    "decode_workspace_numel",
    "flush_tiles",
    "flush_token_tiles",
    "hadamard_matrix",
    "max_decode_partials",
    "max_verify_partials",
    "plan_decode_batch",
    "plan_fused_prefill",
    "plan_prefill_context",
    "plan_side_pool_write",
    "plan_verify_batch",
    "prefill_attention",
    "prefill_method",
    "rotate",
    "verify_attention",
    "verify_plan",
    "warmup",
    "write_side_pool",
]
