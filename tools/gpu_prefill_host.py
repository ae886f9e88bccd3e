#!/usr/bin/env python3
"""Where does a short prefill-with-context call spend its time on the host?

``prefill_attention``'s dequantize-then-attend path took ~700 µs per call in the fifth
session's kernel check when its GPU work was ~33 µs ("dequant only" row), and an ad-hoc
timing of its Python code with the kernels stubbed out (on the CPU machine, not a tool here)
put that part well below it. An agent's turn (a short
chunk after a long cached prefix) pays that per layer, so the rest has to be found before
anything is changed. This tool runs the plugin's path (``method="dequant"`` with the host
copies of the lengths, vLLM's FA3 when importable) on one short-chunk case and reports:

* the wall time per call when calls are queued back to back (host-bound: what a serving step
  pays per layer), with the batch's ``context_plan`` shared across calls as the plugin does
  and, for comparison, planning in every call (the path before the plan existed), and the
  GPU time per call (CUDA events around one call after a sync);
* ``torch.profiler``'s host-side table over ``--calls`` calls, sorted by self CPU time: CUDA
  runtime calls (``cudaHostAlloc``, ``cudaMemcpyAsync``, ``cudaLaunchKernel``, ...), torch
  ops and the Python-level ranges, which says whether pinned-memory allocation, copies,
  launches or Python dominate.

On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:packages/kvarn-vllm/src \\
        python3 tools/gpu_prefill_host.py --out $OUT/prefill_host.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels as bk  # tools/ is not a package


def parser() -> argparse.ArgumentParser:
    """The options; the default case is ``bench_kernels``' short-chunk prefill shape."""
    ctx, q_len = bk.PREFILL_SHAPES[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument("--ctx", type=int, default=ctx, help="cached tokens")
    ap.add_argument("--q-len", type=int, default=q_len, help="chunk tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", type=Path, help="also write the report here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_prefill_host: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvarn_kernels import plan_prefill_context, prefill_attention

    # bench_kernels' prefill case: the sink and the chunk's tiles in the pool, records before
    c = bk.prefill_case(args.format, args.ctx, args.q_len, args.batch)
    cache = (c["kv"], c["pool_k"], c["pool_v"])
    call_args = (args.format, c["q"], *cache, c["bt"], c["qsl"], c["seqs"], c["b2s"], bk.D**-0.5)
    kw: dict[str, Any] = {"seq_lens_cpu": c["seq_host"], "query_start_loc_cpu": c["qsl_host"]}
    shared: dict[str, Any] = {}
    try:
        shared["varlen_attention"] = bk.vllm_fa3()
        attention = "vLLM FA3"
    except Exception as exc:  # without vLLM: torch's FlashAttention, as the kernels default
        attention = f"torch ({type(exc).__name__}: vLLM FA3 not importable)"
    kw.update(shared)
    out = torch.empty_like(c["q"])
    # The plugin's path: the batch's plan built once per step, shared by the layers.
    shared["context_plan"] = plan_prefill_context(
        c["group"], c["seq_host"], c["qsl_host"], num_kv_heads=bk.HK, head_dim=bk.D, device="cuda"
    )

    def call() -> None:
        prefill_attention(*call_args, out=out, **shared)

    def call_planning() -> None:  # each call plans and copies for itself (before the plan)
        prefill_attention(*call_args, out=out, **kw)

    def queued(fn: Callable[[], None]) -> float:
        for _ in range(5):  # compile and warm up
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / args.calls * 1e6

    queued_planning_us = queued(call_planning)
    queued_us = queued(call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(10):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    gpu_us = sorted(gpu)[len(gpu) // 2]

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    report = "\n".join(
        [
            f"{args.format}: {args.q_len} tokens after {args.ctx} cached, B = {args.batch}, "
            f"attention: {attention}",
            f"queued back to back, shared context_plan (the plugin): {queued_us:.1f} us per call",
            f"queued back to back, planning in every call: {queued_planning_us:.1f} us per call",
            f"one call after a sync, CUDA events: {gpu_us:.1f} us",
            "",
            f"torch.profiler over {args.calls} calls, by self CPU time:",
            table,
        ]
    )
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
