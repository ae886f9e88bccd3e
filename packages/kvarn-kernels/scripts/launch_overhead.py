"""Host µs per launch of one compiled Triton kernel (the rotation), three ways, GPU only:
through the JIT (``kernel[grid](...)``), through :func:`kvarn_kernels._launch.launch`, and
the parts of ``launch()``'s own work (its key, the device lookup, the interpreter and hook
checks). Two rounds; the second is the warm one (docs/kernel-notes.md, twenty-fifth
session)::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/launch_overhead.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

CALLS = 3000


def main() -> None:
    import torch

    from kvarn_kernels import _launch
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


if __name__ == "__main__":
    main()
