"""Host µs per launch of one compiled Triton kernel (the rotation), three ways, GPU only:
through the JIT (``kernel[grid](...)``), through :func:`kvarn_kernels._launch.launch`, and
the parts of ``launch()``'s own work (its key, the device lookup, the interpreter and hook
checks). Then whole ops as a server calls them eagerly (a mixed batch's decode, at the
served plan of v6f and of v4c; a store flush), with ``launch()``'s direct path and with
every launch sent through the JIT, in alternation. Two rounds; the second is the warm one
(docs/kernel-notes.md, twenty-fifth and twenty-sixth sessions)::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/launch_overhead.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

from kvarn_kernels import _launch

CALLS = 3000
_interpret = _launch.triton_interpret  # restored after the JIT rows


def main() -> None:
    import torch

    from kvarn_kernels.rotation import _rotate_rows_kernel, sign_matrix

    x = torch.randn(64 * 32, 128, device="cuda").half()
    y = torch.empty_like(x)
    s = sign_matrix(128, x.device, x.dtype)
    args = (x, y, s, s, s, s, x.shape[0], 128, 0, 0.1)
    consts = {
        "HK": 1, "D": 128, "G": 1, "SHADOW": 0, "STRIDE": 0, "IS_V": False, "BLOCK_R": 32,
        "BLOCK_C": 128, "OUT_F32": False, "SCATTER": False, "OUT_BF16": False, "IEEE": False,
    }  # fmt: skip
    grid = (x.shape[0] // 32,)
    parts: dict[str, Callable[[], Any]] = {
        "kernel[grid](...)": lambda: _rotate_rows_kernel[grid](*args, **consts, num_warps=4),
        "launch()": lambda: _launch.launch(_rotate_rows_kernel, grid, args, consts, num_warps=4),
        "  its key": lambda: _launch.launch_key(
            _rotate_rows_kernel, args, consts, {"num_warps": 4}
        ),
        "  torch.cuda.current_device": torch.cuda.current_device,
        "  interpreter and hook checks": lambda: (
            _launch.triton_interpret(),
            _launch._hooks_installed(),
        ),
    }
    for rnd in (1, 2):
        for name, fn in parts.items():
            print(f"round {rnd}  {name:32s} {bk.host_us(fn, CALLS, sync_every=50):7.1f} µs")
    ops = whole_ops()
    for rnd in (1, 2):
        for name, fn in ops.items():
            for path in ("launch()", "JIT"):
                # the JIT path: launch() sends every call through kernel[grid](...), as under
                # the interpreter
                _launch.triton_interpret = (lambda: True) if path == "JIT" else _interpret
                us = bk.host_us(fn, 300, sync_every=10)
                print(f"round {rnd}  {name:32s} {path:9s} {us:7.1f} µs")
        _launch.triton_interpret = _interpret


def whole_ops() -> dict[str, Callable[[], Any]]:
    """Eager calls of the ops whose launches moved to ``launch()`` this session: decode at
    B = 64 and 4K of context (small, so the GPU keeps up with the host) at v6f's, v6t's and v4c's
    served plans, and a store flush of 64 tiles."""
    import torch

    from kvarn_kernels import flush_tiles

    inp = bk.decode_inputs("kvarn_k4v2_g128", 64, 4096)
    ops: dict[str, Callable[[], Any]] = {}
    for variant in ("v6f", "v6t", "v4c"):
        out = torch.empty_like(inp["q"])
        ops[f"decode {variant} B=64 4K"] = lambda v=variant, o=out: bk.decode_once(
            inp, variant=v, out=o
        )
    n = 64
    pk = torch.randn(n, 128, bk.HK, bk.D, device="cuda").half()
    kv = torch.empty_like(inp["kv"][:n])
    idx = torch.arange(n, device="cuda", dtype=torch.int32)
    ops["flush 64 tiles"] = lambda: flush_tiles("kvarn_k4v2_g128", pk, pk, idx, kv, idx)
    return ops


if __name__ == "__main__":
    main()
