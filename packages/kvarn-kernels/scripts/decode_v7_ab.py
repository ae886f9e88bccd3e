"""v1 against v7 and v7f on ``kvarn_k5v5_g64``, in one run (GPU only).

For each shape: the three kernels' outputs compared (v7 and v7f against v1, the kernel
"auto" served the format with before v7f), then each kernel timed twice in alternation (µs per
layer, CUDA-graph replay, each at its own default split count). FA3 fp16 is not run here
(``tools/bench_kernels.py`` has it on the same shapes). Writes ``decode_v7_ab.json``
to ``--out`` and prints a table. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_v7_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

NAME = "kvarn_k5v5_g64"
SHAPES = ((64, 16384), (8, 16384), (1, 16384), (256, 4096), (64, 65536))  # (B, context)
KERNELS = ("v1", "v7", "v7f")


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="B = 64 and 8 at 16K only")
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    rows: list[dict[str, Any]] = []
    print("| B / context | v1 µs (splits) | v7 µs | v7f µs | v7f / v1 | max diff v7, v7f |")
    print("|---|---|---|---|---|---|")
    for bsz, ctx in shapes:
        inp = bk.decode_inputs(NAME, bsz, ctx)
        ref = bk.decode_once(inp, variant="v1").float()
        diff = {
            v: float((bk.decode_once(inp, variant=v).float() - ref).abs().max())
            for v in KERNELS[1:]
        }
        times: dict[str, list[float]] = {v: [] for v in KERNELS}
        splits: dict[str, int] = {}
        for _round in range(2):
            for v in KERNELS:
                r = bk.bench_kvarn_decode(inp, variant=v)
                times[v].append(r["us"])
                splits[v] = r["splits"]
        best = {v: min(t) for v, t in times.items()}
        rows.append(
            {"B": bsz, "context": ctx, "us": times, "splits": splits, "max_abs_diff_vs_v1": diff}
        )
        print(
            f"| {bsz} / {ctx // 1024}K | {best['v1']:.1f} ({splits['v1']}) | {best['v7']:.1f} "
            f"({splits['v7']}) | {best['v7f']:.1f} ({splits['v7f']}) | "
            f"{best['v7f'] / best['v1']:.3f}x | {diff['v7']:.1e}, {diff['v7f']:.1e} |",
            flush=True,
        )
        del inp
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_v7_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
