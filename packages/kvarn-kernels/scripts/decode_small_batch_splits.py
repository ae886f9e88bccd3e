"""The small-batch kernels' split counts: v4c on 64- and 128-token tiles, v1 on 5-bit codes
(GPU only).

At B = 1 / 16K the g64 formats decode at 0.71-0.73x FA3 fp16's speed and k4v2_g128 at 1.03x
(H100, thirty-fourth session's kernel table). v4c serves B < 8; the split rule gives g64 64
splits of 4 blocks (256 tokens each) where g128 gets 32 of 512 tokens. This times v4c at
split counts 4-128 for k4v2_g64 and k4v2_g128 at B = 1 and 4 (16K) and B = 1 (4K), each
twice, CUDA-graph replay; v1 and v7f (``kvarn_k5v5_g64``) and v6f on the same shapes.
Writes ``decode_small_batch_splits.json`` to ``--out`` and prints a table. On the GPU
machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_small_batch_splits.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

CASES = (
    ("kvarn_k4v2_g64", "v4c"),
    ("kvarn_k4v2_g128", "v4c"),
    ("kvarn_k5v5_g64", "v1"),
    # the Gluon kernel below V5_MIN_BATCH: its pool tiles on a side stream, one-warp programs
    ("kvarn_k4v2_g64", "v6f"),
    ("kvarn_k4v2_g128", "v6f"),
    ("kvarn_k5v5_g64", "v7f"),  # its 5-bit counterpart, on v6f's rule
)
SHAPES = ((1, 16384), (4, 16384), (1, 4096))  # (B, context)
SPLITS = (4, 8, 16, 32, 64, 128)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print("| format | variant | B | context | splits | µs (two rounds) | rule's count |")
    print("|---|---|---|---|---|---|---|")
    for fmt, variant in CASES:
        for bsz, ctx in SHAPES:
            inp = bk.decode_inputs(fmt, bsz, ctx)
            rule = bk.rule_splits(inp)
            for splits in SPLITS:
                if splits * 64 > ctx:
                    continue  # splits of under one 64-token step
                us = []
                for _round in range(2):
                    r = bk.guarded(
                        lambda inp=inp, s=splits, v=variant: bk.bench_kvarn_decode(
                            inp, variant=v, num_splits=s
                        )
                    )
                    us.append(r.get("us", r.get("error")))
                rows.append(
                    {
                        "format": fmt,
                        "variant": variant,
                        "B": bsz,
                        "context": ctx,
                        "splits": splits,
                        "rule": rule,
                        "us": us,
                    }
                )
                print(
                    f"| {fmt} | {variant} | {bsz} | {ctx} | {splits} | {us} | {rule} |", flush=True
                )
            del inp
            torch.cuda.empty_cache()
    # Where one request's time goes: each kernel of the served plan (torch profiler)
    from decode_v6_probe import print_kernel_shares  # this script's folder is on sys.path

    shares = print_kernel_shares(((1, 16384), (1, 4096)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_small_batch_splits.json").write_text(
        json.dumps({"sweep": rows, "kernel_shares": shares}, indent=1)
    )


if __name__ == "__main__":
    main()
