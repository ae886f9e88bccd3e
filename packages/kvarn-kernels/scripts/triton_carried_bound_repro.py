"""A Triton 3.6 miscompile found in the twenty-third session (docs/kernel-notes.md), reduced.

A loop-carried count ``seen`` (the positives of the windows before this one) feeds an inner
loop's lower bound. The TTIR carries ``seen`` and computes ``(r + seen) % NP``; after the
TTGIR passes the loop-carried value is gone and the bound is ``r % NP``, as if ``seen`` were
always 0. Triton's interpreter runs the source as written, so CPU tests pass and the GPU is
wrong. The same with ``seen`` starting from a loaded value: the bound is hoisted out of the
loop with the initial count in it. Compiles for sm_90a on any machine (no GPU) and prints both IRs' loops and bounds::

    uv run python packages/kvarn-kernels/scripts/triton_carried_bound_repro.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).parent))

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from static_kernels import compile_kernel


@triton.jit
def carried_bound(X, OUT, n, NP: tl.constexpr):  # type: ignore[no-untyped-def]
    r = tl.program_id(0)
    seen = 0
    acc = 0.0
    for g0 in range(0, n, 64):
        n_pos = tl.sum((tl.load(X + g0 + tl.arange(0, 64)) > 0).to(tl.int32), axis=0)
        # this program's positives of the window: global rank seen + k = r modulo NP
        for k in range((r + seen) % NP, n_pos, NP):
            acc += k.to(tl.float32)
        seen += n_pos
    tl.store(OUT + r, acc)


def main() -> int:
    k = compile_kernel(carried_bound, {"X": "*i32", "OUT": "*fp32", "n": "i32"}, {"NP": 2}, 4, 1)
    for ir in ("ttir", "ttgir"):
        print(ir)
        for line in k.asm[ir].splitlines():
            if "scf.for" in line or "remsi" in line:
                print("   ", line.strip()[:120])
    # the outer loop's results: (i32, f32) while it carries the count, (f32) once dropped
    outer = next(line for line in k.asm["ttgir"].splitlines() if "scf.for" in line)
    results = re.search(r"-> \(([^)]*)\)", outer)
    carried = results is not None and "i32" in results.group(1)
    print("TTGIR's outer loop carries the count:", carried)
    return 0


if __name__ == "__main__":
    sys.exit(main())
