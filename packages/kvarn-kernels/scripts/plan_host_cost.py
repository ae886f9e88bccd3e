"""Python host time of the planned calls against unplanned ones, with every kernel launch
stubbed out (CPU, no GPU needed; docs/kernel-notes.md, forty-fourth and forty-fifth sessions).

* ``prefill``: 64 query tokens of Qwen3-8B's heads (32 over 8 KV heads, head dim 128) after
  1,024 cached tokens of ``kvarn_k4v2_g128``, ``fused_kernel="v3"`` forced (the served kernel
  on sm_90), unplanned and with a :class:`kvarn_kernels.FusedPrefillPlan`;
* ``decode``: 8 requests of 1,024 tokens, the same heads and format, each served decode
  variant forced (v4c, v6f, v6t: the Gluon ones resolve as on a GPU, since nothing runs),
  unplanned and with a :class:`kvarn_kernels.DecodeBatchPlan`;
* ``verify``: 8 requests of 4 draft-verify tokens after 1,024, v4c, unplanned and with a
  :class:`kvarn_kernels.VerifyBatchPlan`;
* ``pool``: the side-pool write of 8 tokens, unplanned and with a
  :class:`kvarn_kernels.SidePoolWritePlan` (K/V contiguous and strided views of a fused QKV
  tensor);
* ``launch``: one prepared launch of v6f's main loop (the decode case's), its compiled
  kernel's launcher stubbed: ``launch()`` with another layer's tensors against
  ``PreparedLaunch.run_replacing`` (forty-sixth session).

The queries are contiguous and a strided view of a fused QKV tensor (as vLLM passes them).
Prints the best of three runs of ``--calls`` calls in µs a call::

    TRITON_INTERPRET=1 PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src \\
        python3 packages/kvarn-kernels/scripts/plan_host_cost.py [--op prefill|decode|verify]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any, cast


def best_us(fn: Callable[[], Any], calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument(
        "--op", choices=("prefill", "decode", "verify", "pool", "launch", "all"), default="all"
    )
    a = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the case is built without a GPU

    import torch

    import kvarn_kernels._launch as launcher
    import kvarn_kernels.attention as attention
    import kvarn_kernels.fused_prefill as fused_prefill
    from kvarn_kernels import (
        decode_attention,
        plan_decode_batch,
        plan_fused_prefill,
        plan_side_pool_write,
        plan_verify_batch,
        prefill_attention,
        verify_attention,
        write_side_pool,
    )
    from kvarn_kernels.testing import build_case

    name, d, hq, hk = "kvarn_k4v2_g128", 128, 32, 8

    recorded: list[tuple[Any, ...]] = []

    def no_launch(*args: object, **kw: object) -> None:
        recorded.append((*args, kw))

    real_launch = launcher.launch
    launcher.launch = no_launch  # type: ignore[assignment]
    fused_prefill._v3_serves = lambda geo, device: True  # type: ignore[attr-defined]
    fused_prefill._num_sms = lambda device: 132  # type: ignore[attr-defined]
    attention.triton_interpret = lambda: False  # type: ignore[attr-defined]  # Gluon variants
    print("| call | queries | unplanned µs | planned µs |")
    print("|---|---|---|---|")
    if a.op in ("prefill", "all"):
        case = build_case(name, d, hk, [1024 + 64], device="cpu", seed=1, encoder="reference")
        qkv = torch.randn(64, hq + 2 * hk, d).half()
        qsl = torch.tensor([0, 64], dtype=torch.int32)
        for label, q in _queries(qkv, hq):
            args = case.prefill_args(name, q, qsl, d**-0.5)
            plan = plan_fused_prefill(*args[5:9], fused_kernel="v3")
            _row(
                f"prefill v3 | {label}",
                prefill_attention,
                args,
                {"method": "fused", "fused_kernel": "v3"},
                {"method": "fused", "fused_plan": plan},
                a.calls,
            )
    if a.op in ("decode", "all"):
        case = build_case(name, d, hk, [1024] * 8, device="cpu", seed=1, encoder="reference")
        qkv = torch.randn(8, hq + 2 * hk, d).half()
        ws = torch.empty(attention.decode_workspace_numel(8, hq, d, 8))
        for variant in ("v4c", "v6f", "v6t"):
            for label, q in _queries(qkv, hq):
                args = case.decode_args(name, q, d**-0.5)
                plan = plan_decode_batch(*args[5:8], variant=variant, num_splits=4, workspace=ws)
                _row(
                    f"decode {variant} | {label}",
                    decode_attention,
                    args,
                    {"variant": variant, "num_splits": 4, "workspace": ws},
                    {"batch_plan": plan},
                    a.calls,
                )
    if a.op in ("verify", "all"):
        lens = [1024 + 4] * 8
        case = build_case(name, d, hk, lens, device="cpu", seed=1, encoder="reference")
        qkv = torch.randn(32, hq + 2 * hk, d).half()
        qsl = torch.arange(0, 33, 4, dtype=torch.int32)
        ws = torch.empty(attention.decode_workspace_numel(32, hq, d, 8))
        for label, q in _queries(qkv, hq):
            args = case.prefill_args(name, q, qsl, d**-0.5)
            plan = plan_verify_batch(
                *args[5:9], max_query_len=4, variant="v4c", num_splits=4, workspace=ws
            )
            _row(
                f"verify v4c | {label}",
                verify_attention,
                args,
                {"max_query_len": 4, "variant": "v4c", "num_splits": 4, "workspace": ws},
                {"max_query_len": 4, "batch_plan": plan},
                a.calls,
            )
    if a.op in ("pool", "all"):
        g = 128
        pool_k = torch.zeros(16, g, hk, d).half()
        pool_v = torch.zeros_like(pool_k)
        b2s = torch.arange(64, dtype=torch.int32) % 16
        slots = torch.arange(8, dtype=torch.int32) * g + 5
        qkv = torch.randn(8, hq + 2 * hk, d).half()
        writes = plan_side_pool_write(slots, b2s, group=g)
        for label, (k, v) in (
            ("contiguous", (qkv[:, hq : hq + hk].contiguous(), qkv[:, hq + hk :].contiguous())),
            ("strided (QKV view)", (qkv[:, hq : hq + hk], qkv[:, hq + hk :])),
        ):
            us = [
                best_us(fn, a.calls)
                for fn in (
                    lambda k=k, v=v: write_side_pool(k, v, pool_k, pool_v, slots, b2s, group=g),
                    lambda k=k, v=v: writes.write(k, v, pool_k, pool_v, slots, b2s),
                )
            ]
            print(f"| pool write | {label} | {us[0]:.1f} | {us[1]:.1f} |")
    if a.op in ("launch", "all"):
        recorded.clear()
        case = build_case(name, d, hk, [1024] * 8, device="cpu", seed=1, encoder="reference")
        ws = torch.empty(attention.decode_workspace_numel(8, hq, d, 8))
        args = case.decode_args(name, torch.randn(8, hq, d).half(), d**-0.5)
        decode_attention(*args, variant="v6f", num_splits=4, workspace=ws)
        launcher.launch = real_launch
        _launch_row(recorded[1], a.calls)  # rotation, main loop, pool, merge


def _launch_row(main_loop: tuple[Any, ...], calls: int) -> None:
    """``launch()`` against ``run_replacing`` for one prepared launch whose key is known,
    with the launcher stubbed and the GPU-side lookups faked (current device 0, Triton's base
    backend): the host work in front of the launcher."""
    import torch
    from triton.backends.compiler import BaseBackend  # type: ignore[import-untyped]

    import kvarn_kernels._launch as launcher

    kernel, grid, args, constexprs, kw = main_loop
    kernel.device_caches = {0: (None, None, None, BaseBackend, None)}
    launcher.triton_interpret = lambda: False  # type: ignore[attr-defined]
    launcher._raw_stream = lambda dev: 0  # type: ignore[attr-defined]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    launcher._current_device = lambda: 0  # type: ignore[attr-defined]

    class Compiled:
        function = packed_metadata = None

        def run(self, *a: object) -> None:
            return None

    p = launcher.PreparedLaunch(kernel, grid, tuple(args), constexprs, **kw)
    options = launcher._options(p.num_warps, p.num_stages, p.maxnreg, p.pdl)
    key = launcher.launch_key(kernel, p.args, constexprs, options)
    launcher._COMPILED[key] = (Compiled(), launcher._tail(kernel, len(p.args), constexprs))
    tensors = [i for i, x in enumerate(p.args) if isinstance(x, torch.Tensor)][:4]
    layer = {i: cast(torch.Tensor, p.args[i]).clone() for i in tensors}
    replaced = [layer.get(i, x) for i, x in enumerate(p.args)]
    us = [best_us(fn, calls) for fn in (lambda: p.run(replaced), lambda: p.run_replacing(layer))]
    print(
        f"| v6f main-loop launch, {len(layer)} of {len(p.args)} arguments replaced | - "
        f"| {us[0]:.1f} (launch()) | {us[1]:.1f} (run_replacing) |"
    )


def _row(
    call: str,
    op: Callable[..., Any],
    args: tuple[Any, ...],
    unplanned: dict[str, Any],
    planned: dict[str, Any],
    calls: int,
) -> None:
    """Print one table row: ``op(*args, out=..., **unplanned)`` against ``**planned``."""
    out = args[1].new_empty(args[1].shape)  # contiguous, the queries' dtype
    us = [best_us(lambda kw=kw: op(*args, out=out, **kw), calls) for kw in (unplanned, planned)]
    print(f"| {call} | {us[0]:.1f} | {us[1]:.1f} |")


def _queries(qkv: Any, hq: int) -> tuple[tuple[str, Any], ...]:
    return (("contiguous", qkv[:, :hq].contiguous()), ("strided (QKV view)", qkv[:, :hq]))


if __name__ == "__main__":
    main()
