"""Host µs of one v6t main-loop launch against v6f's, and of the work v6t's four tensor
descriptors add to each launch (GPU only; forty-first session).

v6t passes four TMA descriptors where v6f passes ``None``. Each launch then pays, on the host:
``launch()``'s key (Triton's ``native_specialize_impl`` formats each descriptor's block shape
and layout) and Triton's launcher wrapper, which encodes each descriptor's ``CUtensorMap``
(``make_tensordesc_arg`` -> ``fill_tma_descriptor``) and rebuilds the argument list. The
case is small (B = 8, 1K context) so that the GPU never holds the host back::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools:packages/kvarn-kernels/scripts \\
        python3 packages/kvarn-kernels/scripts/v6t_host_cost.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
from decode_v6_probe import launch_buffers, launch_main_loop

CALLS = 2000
SPLITS = 2


def per_call_us(fn: Callable[[], Any], calls: int = CALLS) -> float:
    """Host µs a call of ``fn``, which launches nothing."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("v6t_host_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton._C.libtriton import native_specialize_impl  # type: ignore[import-untyped]
    from triton.backends.nvidia.driver import make_tensordesc_arg  # type: ignore[import-untyped]

    from kvarn_kernels import _launch
    from kvarn_kernels.attention import _v6_tma_descriptors_at
    from kvarn_kernels.decode_v6 import decode_v6_kernel

    inp = bk.decode_inputs("kvarn_k4v2_g128", 8, 1024)
    b = launch_buffers(inp, SPLITS)
    launches = {
        variant: (lambda variant=variant: launch_main_loop(inp, b, SPLITS, variant=variant))
        for variant in ("v6f", "v6t")
    }
    for rnd in (1, 2, 3):
        for name, fn in launches.items():
            us = bk.host_us(fn, CALLS, sync_every=20)
            print(f"round {rnd}  {name} main-loop launch      {us:7.1f} µs", flush=True)

    descs = _v6_tma_descriptors_at(b["geo"], inp["kv"].data_ptr(), inp["kv"].numel())
    compiled = next(
        (
            hit[0]
            for key, hit in _launch._COMPILED.items()
            if key[0] is decode_v6_kernel
            and hit is not None
            and getattr(hit[0].metadata, "tensordesc_meta", None)
        ),
        None,
    )
    if compiled is None:
        print("no compiled v6t launch with tensor descriptors was kept", file=sys.stderr)
        return 1
    meta = compiled.metadata.tensordesc_meta
    backend = decode_v6_kernel.device_caches[torch.cuda.current_device()][3]
    parts: dict[str, Callable[[], Any]] = {
        "4 descriptors' key specialization": lambda: [
            native_specialize_impl(backend, d, False, True, True) for d in descs
        ],
        "4 descriptors' CUtensorMap encoding": lambda: [
            make_tensordesc_arg(d, m) for d, m in zip(descs, meta, strict=True)
        ],
        "the descriptors' cache lookup": lambda: _v6_tma_descriptors_at(
            b["geo"], inp["kv"].data_ptr(), inp["kv"].numel()
        ),
    }
    for name, fn in parts.items():
        print(f"  {name:40s} {per_call_us(fn):7.2f} µs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
