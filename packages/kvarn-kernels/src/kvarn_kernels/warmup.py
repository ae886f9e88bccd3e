"""Compile the kernels of serving steps before serving starts.

Triton compiles a kernel the first time it meets a new set of compile-time constants, and a
compile takes seconds. The kernels of prefill steps (rotation, side-pool writes, the two store
paths, the context dequantization) are not compiled by a serving engine's CUDA-graph capture,
and neither is decode when the engine captures no FULL decode graphs (eager mode, or vLLM's
piecewise downgrade under speculative decoding), so without a warm-up the first steps of a
server stall for several seconds per kernel (vLLM's JIT monitor logs each one).
:func:`warmup` launches each of them once on small scratch tensors, with the constants a
serving step uses, so that the compiled kernels are in Triton's cache when the real steps
come.

What selects a compile, and how the scratch launches match the serving ones:

* dtypes and constexprs: the model dtype for activations, fp16 pools, the format's geometry,
  the store paths' flags (pool flush: no head rows, unmasked; direct flush: head rows,
  masked);
* the rotation's row tile (16 / 32 / 64 rows, from the row count): one launch per class,
  for the K/V rows (``T * Hk``) and the query rows (``T * Hq``);
* decode and verify: the split count and the block table's row stride (compile-time
  constants: one launch per split count a batch can take, on a table of the server's width)
  and the query-row count (specialized: one request and 16, both divisibility classes);
* integer arguments of the prefill side: the per-step counts are not specialized
  (``do_not_specialize``), and the strides of contiguous scratch tensors fall in the same
  divisibility class as vLLM's (multiples of 16 at every supported head dim);
* the fused prefill (``prefill_attention(method="fused")``, when the server sends chunks to
  it): its split count and request slots (compile-time constants that follow the batch's
  requests and tokens) and its row count's divisibility class. Every batch a server can form
  is walked on the host and one scratch batch launched per class found, the smallest.

Nothing outside the scratch tensors is read or written.

On a GPU the launches run from a pool of threads: Triton's compiler releases the GIL in its
long passes (and ``ptxas`` is a subprocess), so the compiles overlap (two threads on two
cores: 1.64-1.91x over five runs, ``scripts/compile_threads.py``). The inputs are made
before any launch (the generator is not thread-safe), every launch goes to the caller's
device and stream, and an error in any launch is raised once all have finished.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import accumulate
from typing import Any

import torch

from kvarn_format import record_layout
from kvarn_format.registry import KVarNFormat
from kvarn_kernels._common import resolve_format
from kvarn_kernels.attention import (
    _num_sms,
    decode_attention,
    decode_plan,
    prefill_attention,
    prefill_v2_splits,
    request_slots,
    verify_attention,
    verify_plan,
)
from kvarn_kernels.prefill_v2 import default_block_m
from kvarn_kernels.rotation import ROW_TILE_EDGES, rotate, write_side_pool
from kvarn_kernels.store import flush_tiles, flush_token_tiles

__all__ = ["warmup"]


def _token_counts(num_q_heads: int, num_kv_heads: int) -> list[int]:
    """Token counts whose K/V rows and query rows cover every row-tile class of both."""
    counts = {1}
    for heads in (num_kv_heads, num_q_heads):
        for edge in ROW_TILE_EDGES:
            counts.add(max(1, edge // heads))  # at the edge (inside the smaller class)
            counts.add(edge // heads + 1)  # just past it
    return sorted(counts)


def warmup(
    fmt: KVarNFormat | str,
    *,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float16,
    shadow_rows: int = 0,
    record_stride: int | None = None,
    verify_width: int = 0,
    max_num_seqs: int = 1,
    block_table_width: int = 1,
    max_threads: int | None = None,
    decode_variant: str = "auto",
    decode_mma_rows: int | None = None,
    fused_prefill_max_query: int = 0,
    max_num_batched_tokens: int | None = None,
) -> int:
    """Launch every kernel a serving step can select once on scratch tensors (those that a
    FULL CUDA-graph capture compiles too); returns the launch count.

    Args:
        fmt: the dense KVarN format served (or its dtype string).
        head_dim, num_q_heads, num_kv_heads: the attention layer's geometry (per rank).
        device: the serving device; on a CPU (Triton's interpreter) nothing is compiled and
            the warm-up only runs the ops, one after the other.
        dtype: the model's activation dtype (fp16 or bf16).
        shadow_rows: the server's shadow rows per pool tile (its pools hold ``G -
            shadow_rows`` rows per slot; :func:`kvarn_format.geometry.shadow_rows`): a
            compile-time constant of every kernel that touches the pool.
        record_stride: the server's record stride in bytes (default the record size; a
            hybrid model pads it), also a compile-time constant.
        verify_width: with speculative decoding, 1 + drafts (0: none). Then
            :func:`verify_attention`'s kernel is compiled too, like decode's.
        max_num_seqs, block_table_width: the server's largest batch and block-table width.
            :func:`decode_attention`'s kernels are compiled for every split count that a
            batch of 1 to ``max_num_seqs`` requests takes on a ``block_table_width``-wide
            table (the split count and the table's row stride are compile-time constants),
            for query-row counts in both of Triton's divisibility classes.
        max_threads: threads that launch (and so compile) at once on a GPU; default the
            machine's CPU count, at most 16. 1 launches in order on the calling thread.
        decode_variant, decode_mma_rows: the server's :func:`decode_attention` ``variant``
            and ``mma_rows``.
        fused_prefill_max_query: the most query tokens of one request in a batch the server
            runs through ``prefill_attention(method="fused")``: ``FUSED_PREFILL_MAX_QUERY``
            where :func:`~kvarn_kernels.prefill_method` picks the method, the step's token
            budget where every continuation goes fused; 0 (default) where none does. The
            fused kernels are then compiled for every batch of 1 to ``max_num_seqs`` requests
            of up to that many tokens each, on a ``block_table_width``-wide table.
        max_num_batched_tokens: the server's token budget of a step (bounds those batches;
            default ``max_num_seqs * fused_prefill_max_query``).
    """
    dense = resolve_format(fmt)
    if fused_prefill_max_query < 0:
        raise ValueError(f"fused_prefill_max_query must be >= 0, got {fused_prefill_max_query}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    dev = torch.device(device)
    g, hk, hq, d = dense.group, num_kv_heads, num_q_heads, head_dim
    tile_bytes = record_layout(dense, d).tile_bytes if record_stride is None else record_stride
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    # Two pool slots, two packed blocks; block 1 lives in slot 0.
    pool_k = torch.zeros(2, g - shadow_rows, hk, d, dtype=torch.float16, device=dev)
    pool_v = torch.zeros_like(pool_k)
    kv_cache = torch.zeros(2, hk, tile_bytes, dtype=torch.uint8, device=dev)
    block_to_slot = torch.tensor([-1, 0], dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    # Each launch with its inputs made now; they run below. Launches share the scratch cache
    # and pools: what one writes there another may read, and every value is thrown away.
    jobs: list[Callable[[], object]] = []

    # Stores: the pool flush (slot 0 -> block 0) and the direct flush of a step's rows
    # opening with pool rows (the plugin always passes the head tensors).
    jobs.append(lambda: flush_tiles(dense, pool_k, pool_v, zero, kv_cache, zero))
    rows_k, rows_v = randn(g, hk, d), randn(g, hk, d)
    jobs.append(
        lambda: flush_token_tiles(
            dense,
            rotate(rows_k),
            rotate(rows_v),
            zero,
            kv_cache,
            zero,
            pool_k=pool_k,
            pool_v=pool_v,
            head_slots=zero,
            head_lens=one,
        )
    )

    scale = d**-0.5
    for t in _token_counts(hq, hk):
        k, v, q = randn(t, hk, d), randn(t, hk, d), randn(t, hq, d)
        jobs.append(partial(rotate, k))
        # Every token skipped (slot -1): the scatter kernel compiles and writes nothing.
        skip = torch.full((t,), -1, dtype=torch.int64, device=dev)
        jobs.append(
            partial(
                write_side_pool,
                *(k, v, pool_k, pool_v, skip, block_to_slot),
                kv_cache=kv_cache,
                group=g,
                check=False,
            )
        )
        # A request whose t query tokens follow one packed block; its last block is pooled.
        seq = g + t
        blocks = -(-seq // g)
        table = torch.zeros(1, blocks, dtype=torch.int32, device=dev)
        table[0, -1] = 1
        qsl = torch.tensor([0, t], dtype=torch.int32, device=dev)
        lens = torch.tensor([seq], dtype=torch.int32, device=dev)
        jobs.append(
            partial(
                prefill_attention,
                *(dense, q, kv_cache, pool_k, pool_v, table, qsl, lens, block_to_slot, scale),
                seq_lens_cpu=[seq],
                query_start_loc_cpu=[0, t],
            )
        )

    # Requests in block 1 (pool slot 0) on a server-wide block table, one request (whose
    # query-row count may not be a multiple of 16) and 16 (whose count is).
    server_table = torch.ones(16, max(block_table_width, 1), dtype=torch.int32, device=dev)
    batches = range(1, max(max_num_seqs, 1) + 1)

    def on_server_table(
        op: Callable[..., torch.Tensor], q: torch.Tensor, reqs: int, *lens: torch.Tensor, **kw: Any
    ) -> Callable[[], object]:
        paged = (kv_cache, pool_k, pool_v, server_table[:reqs])
        return partial(op, dense, q, *paged, *lens, block_to_slot, scale, **kw)

    # Decode: the kernel and its split count (a compile-time constant) follow the batch size.
    # Engines that capture FULL decode graphs compile these while capturing; without them
    # (eager mode, or verify batches left out of graphs) the first decode steps would.
    plans = {
        decode_plan(
            dense,
            b,
            hq,
            hk,
            d,
            block_table_width,
            dev,
            variant=decode_variant,
            mma_rows=decode_mma_rows,
        )
        for b in batches
    }
    for plan in sorted(plans, key=lambda p: (p.variant, p.num_splits)):
        for reqs in (1, 16):
            # a packed tile and one pool row when the table is that wide
            lens = torch.full(
                (reqs,), min(g + 1, server_table.shape[1] * g), dtype=torch.int32, device=dev
            )
            q = randn(reqs, hq, d)
            jobs.append(
                on_server_table(
                    decode_attention,
                    q,
                    reqs,
                    lens,
                    num_splits=plan.num_splits,
                    variant=plan.variant,
                    mma_rows=decode_mma_rows,
                )
            )

    if verify_width > 0:
        verify_plans = {
            verify_plan(dense, b, hq, hk, d, verify_width, block_table_width, dev) for b in batches
        }
        # Requests of verify_width tokens.
        for reqs in (1, 16):
            t = reqs * verify_width
            qsl = torch.arange(0, t + 1, verify_width, dtype=torch.int32, device=dev)
            lens = torch.full((reqs,), verify_width, dtype=torch.int32, device=dev)
            for plan in sorted(verify_plans, key=lambda p: (p.variant, p.num_splits)):
                q = randn(t, hq, d)
                jobs.append(
                    on_server_table(
                        verify_attention,
                        q,
                        reqs,
                        qsl,
                        lens,
                        max_query_len=verify_width,
                        num_splits=plan.num_splits,
                        variant=plan.variant,
                    )
                )
    fused_batches = fused_prefill_batches(
        hq,
        hk,
        d,
        g,
        block_table_width,
        _num_sms(dev),
        max_num_seqs=max(max_num_seqs, 1),
        max_query=fused_prefill_max_query,
        max_tokens=max_num_batched_tokens,
    )

    def fused_prefill(reqs: int, tokens: int) -> None:
        # each request after one packed block where the table has room; zeros, made here
        # rather than up front (a batch can be large): only the kernels' compile matters
        q_lens = [tokens // reqs + (r < tokens % reqs) for r in range(reqs)]
        room = block_table_width * g
        seq_lens = [n + g if n + g <= room else n for n in q_lens]
        qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        table = torch.ones(reqs, block_table_width, dtype=torch.int32, device=dev)
        table[:, 0] = 0  # block 0 packed, then block 1 (pool slot 0)
        q = torch.zeros(tokens, hq, d, dtype=dtype, device=dev)
        paged = (kv_cache, pool_k, pool_v, table, qsl, lens, block_to_slot)
        prefill_attention(dense, q, *paged, scale, method="fused")

    jobs.extend(partial(fused_prefill, reqs, tokens) for reqs, tokens in fused_batches)
    _run_all(jobs, dev, max_threads)
    return len(jobs)


def fused_prefill_batches(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group: int,
    block_table_width: int,
    num_sms: int,
    *,
    max_num_seqs: int,
    max_query: int,
    max_tokens: int | None = None,
) -> list[tuple[int, int]]:
    """(requests, tokens) of the smallest batch of each compile class of the fused prefill:
    the class is its split count (:func:`~kvarn_kernels.attention.prefill_v2_splits` on a
    ``block_table_width``-wide table and ``num_sms`` SMs), its request slots
    (:func:`~kvarn_kernels.attention.request_slots`) and the JIT's class of its row count
    (``tokens x num_q_heads``: 1, a multiple of 16, other), over batches of 1 to
    ``max_num_seqs`` requests of 1 to ``max_query`` tokens each that fit the table, at most
    ``max_tokens`` tokens in all (default ``max_num_seqs * max_query``)."""
    if max_query <= 0:
        return []
    longest = min(max_query, block_table_width * group - 1)  # tokens of one request
    budget = max_num_seqs * longest if max_tokens is None else max_tokens
    block_m = default_block_m(head_dim)
    found: dict[tuple[int, int, int], tuple[int, int]] = {}
    by_slots: dict[int, list[int]] = {}
    for reqs in range(1, max_num_seqs + 1):
        by_slots.setdefault(request_slots(reqs), []).append(reqs)
    for slots, members in by_slots.items():
        lo, hi = members[0], members[-1]
        for tokens in range(lo, min(hi * longest, budget) + 1):
            reqs = max(lo, -(-tokens // longest))  # the fewest requests that hold them
            rows = tokens * num_q_heads
            splits = prefill_v2_splits(
                tokens, num_q_heads, num_kv_heads, block_table_width, num_sms, block_m=block_m
            )
            row_class = 1 if rows == 1 else 16 if rows % 16 == 0 else 0
            found.setdefault((splits, slots, row_class), (reqs, tokens))
    return sorted(found.values())


def _run_all(jobs: list[Callable[[], object]], dev: torch.device, max_threads: int | None) -> None:
    """Run ``jobs``: in order on a CPU (the interpreter is not thread-safe) or with one
    thread; on a GPU from up to ``max_threads`` threads, each on ``dev`` and the caller's
    stream (the scratch tensors belong to it), then wait for the device."""
    threads = min(16, os.cpu_count() or 1) if max_threads is None else max_threads
    if dev.type != "cuda" or threads <= 1:
        for job in jobs:
            job()
        return
    if dev.index is None:  # "cuda" is the caller's current device; a new thread's is 0
        dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(dev)
    _make_device_caches(dev)

    def on_device(job: Callable[[], object]) -> None:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            job()

    with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
        futures = [pool.submit(on_device, job) for job in jobs]
    for future in futures:  # every launch has finished; the first error is raised
        future.result()
    torch.cuda.synchronize(dev)


def _make_device_caches(dev: torch.device) -> None:
    """Create each kvarn kernel's per-device cache on this thread. Triton makes it on first
    use through a ``defaultdict``; two threads meeting a kernel first at the same time could
    each make one, and the kernels compiled into the losing cache would compile again while
    serving (found reading Triton 3.6's ``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

    from kvarn_kernels import (
        _common,
        attention,
        context,
        decode_pool,
        decode_v4,
        decode_v5,
        decode_v6,
        prefill_v2,
        prefill_v3,
        rotation,
        store,
    )

    modules = (
        *(_common, attention, context, rotation, store),
        *(decode_pool, decode_v4, decode_v5, decode_v6, prefill_v2, prefill_v3),
    )
    with torch.cuda.device(dev):
        index = torch.cuda.current_device()
        for module in modules:
            for obj in vars(module).values():
                if isinstance(obj, JITFunction):
                    obj.device_caches[index]
