"""The small-batch decode plan before and after the thirty-fifth session, in one run (GPU only).

Before: v4c below 8 requests (v1 for 5-bit codes) at the split rule's four programs per SM,
and a merge that unrolled at most 16 partials (one loop trip per partial beyond). After: v6f
from one request (its count itself below 8, three times it from 8), v4c and v1 at two
programs per SM, and the merge unrolled in chunks of 16 up to 128 partials. Four plans per
shape, each twice in alternation (µs per layer, CUDA-graph replay):

* ``old``: the old kernel and split count with the old merge (``MERGE_UNROLL_MAX_SPLITS =
  16``);
* ``old plan, new merge``: the same kernel and count with the chunked merge;
* ``new plan, old merge``: ``decode_plan``'s kernel and count now with the old merge;
* ``new``: ``decode_plan``'s kernel and count now, chunked merge.

The new plan's output is compared with the old one's (both against the same inputs). Writes
``decode_small_batch_ab.json`` to ``--out`` and prints a table, then each kernel of the new
plan at B = 1 and 4 / 16K (k4v2_g128, torch profiler). On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_small_batch_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

FORMATS = ("kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k5v5_g64")
SHAPES = ((1, 4096), (1, 16384), (2, 16384), (4, 4096), (4, 16384), (8, 16384))  # (B, ctx)
OLD_MERGE_UNROLL = 16


def old_plan(inp: dict[str, Any]) -> tuple[str, int]:
    """The variant and split count ``decode_plan`` gave before this session."""
    bsz = int(inp["q"].shape[0])
    rule = bk.rule_splits(inp)
    if inp["fmt"] == "kvarn_k5v5_g64":
        return "v1", rule
    return ("v6f", 3 * rule) if bsz >= 8 else ("v4c", rule)


def main() -> None:
    import torch

    from kvarn_kernels import attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--quick", action="store_true", help="the two 4-bit-key formats at B = 1, 4 and 8 only"
    )
    args = ap.parse_args()
    formats = FORMATS[:2] if args.quick else FORMATS
    shapes = [s for s in SHAPES if s[0] != 2] if args.quick else SHAPES
    new_unroll = attention.MERGE_UNROLL_MAX_SPLITS
    rows: list[dict[str, Any]] = []
    print(
        "| format | B / ctx | old (plan) | old plan, new merge | new plan, old merge "
        "| new (plan) | new / old |"
    )
    print("|---|---|---|---|---|---|---|")
    for fmt in formats:
        for bsz, ctx in shapes:
            inp = bk.decode_inputs(fmt, bsz, ctx)
            variant, splits = old_plan(inp)
            times: dict[str, list[float]] = {
                "old": [],
                "old_new_merge": [],
                "new_old_merge": [],
                "new": [],
            }
            new_plan: dict[str, Any] = {}
            for _round in range(2):
                attention.MERGE_UNROLL_MAX_SPLITS = OLD_MERGE_UNROLL
                r = bk.bench_kvarn_decode(inp, variant=variant, num_splits=splits)
                times["old"].append(r["us"])
                times["new_old_merge"].append(bk.bench_kvarn_decode(inp)["us"])
                attention.MERGE_UNROLL_MAX_SPLITS = new_unroll
                r = bk.bench_kvarn_decode(inp, variant=variant, num_splits=splits)
                times["old_new_merge"].append(r["us"])
                new_plan = bk.bench_kvarn_decode(inp)
                times["new"].append(new_plan["us"])
            attention.MERGE_UNROLL_MAX_SPLITS = OLD_MERGE_UNROLL
            ref = bk.decode_once(inp, variant=variant, num_splits=splits).float()
            attention.MERGE_UNROLL_MAX_SPLITS = new_unroll
            got = bk.decode_once(inp).float()
            max_diff = float((got - ref).abs().max())
            best = {k: min(v) for k, v in times.items()}
            row = {
                "format": fmt,
                "B": bsz,
                "context": ctx,
                "old_plan": [variant, splits],
                "new_plan": [new_plan["variant"], new_plan["splits"]],
                "us": times,
                "new_over_old": best["new"] / best["old"],
                "max_abs_diff_new_vs_old": max_diff,
            }
            rows.append(row)
            print(
                f"| {fmt} | {bsz} / {ctx // 1024}K | {best['old']:.1f} ({variant} {splits}) | "
                f"{best['old_new_merge']:.1f} | {best['new_old_merge']:.1f} | "
                f"{best['new']:.1f} ({new_plan['variant']} {new_plan['splits']}) | "
                f"{row['new_over_old']:.3f}x (diff {max_diff:.1e}) |",
                flush=True,
            )
            del inp
            torch.cuda.empty_cache()
    # Where the new plan's time goes at one and four requests (torch profiler, chunked merge)
    from decode_v6_probe import print_kernel_shares  # this script's folder is on sys.path

    shares = print_kernel_shares(((1, 16384), (4, 16384)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_small_batch_ab.json").write_text(
        json.dumps({"rows": rows, "kernel_shares": shares}, indent=1)
    )


if __name__ == "__main__":
    main()
