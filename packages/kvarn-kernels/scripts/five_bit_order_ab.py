"""``kvarn_k5v5_g64``'s prefill and verify paths in one kernel tree (GPU only), to compare the
byte-plane code order with the official order it replaced (thirty-seventh session).

The plane order made v1 1.13-1.19x slower and the prefill's dequantize kernel reads the
planes byte by byte (40 byte loads, docs/kernel-notes.md); this times what that touches:
``prefill_attention`` on the dequantize path (2,048 tokens after 14K, 64 after 16K at B = 1
and 4, 512 after 4K at B = 4; eager and CUDA-graph replay, best of two; vLLM's FA3 after the
dequantization when vLLM is importable, as the plugin serves it, else torch's attention) and
``bench_kernels.bench_verify`` (3 drafts: the verify pass, decode rows, the planned and fused
prefill paths). Run it once per tree, each in its own process, and compare the JSON files;
the second tree is the commit before the plane order, unpacked next to the checkout (the
device copies the working tree, not the history)::

    git archive 184f93f packages/kvarn-format/src packages/kvarn-kernels/src | tar -x -C old/
    # on the GPU machine, after `source .gpu/env.sh` (vLLM's bundle, docs: gpu.md):
    PYTHONPATH=$PYTHONPATH:tools \\
        python3 packages/kvarn-kernels/scripts/five_bit_order_ab.py --tag planes --out $OUT
    PYTHONPATH=/root/site:old/packages/kvarn-format/src:old/packages/kvarn-kernels/src:\\
    packages/kvarn-vllm/src:tools \\
        python3 packages/kvarn-kernels/scripts/five_bit_order_ab.py --tag official --out $OUT

(``--prefill-only`` skips the verify rows.)

Inputs are drawn afresh in each process, so the two trees' outputs are not compared here
(the GPU tests compare each tree with the reference).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

NAME = "kvarn_k5v5_g64"
PREFILL_SHAPES = ((14336, 2048, 1), (16320, 64, 1), (16320, 64, 4), (4096, 512, 4))
VERIFY_SHAPES = ((4092, 4, 32), (16380, 4, 8))  # (context before, 1 + drafts, requests)


def _gpu_us(row: dict[str, Any]) -> float:
    return float(row.get("gpu_us", row["us"]))


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True, help="this tree's name in the output file")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prefill-only", action="store_true", help="skip the verify rows")
    args = ap.parse_args()
    prefill: list[dict[str, Any]] = []
    print(f"| {args.tag} | chunk | B | eager µs | GPU µs |")
    print("|---|---|---|---|---|")
    try:  # the dequantized context's attention as served: vLLM's FA3 when importable
        fa: dict[str, Any] = {"varlen_attention": bk.vllm_fa3()}
    except ImportError:
        fa = {}
    print(f"prefill attention after the dequantization: {'FA3' if fa else 'torch'}")
    for ctx, q_len, bsz in PREFILL_SHAPES:
        runs = [bk.bench_prefill(NAME, ctx, q_len, bsz, **fa) for _round in range(2)]
        best = min(runs, key=_gpu_us)
        prefill.append({"ctx": ctx, "q_len": q_len, "B": bsz, **best})
        print(
            f"| prefill | {q_len} after {ctx} | {bsz} | {best['us']:.1f} | {_gpu_us(best):.1f} |",
            flush=True,
        )
        torch.cuda.empty_cache()
    verify: list[dict[str, Any]] = []
    for ctx, width, bsz in () if args.prefill_only else VERIFY_SHAPES:
        for row in bk.bench_verify(NAME, ctx, width, bsz):
            verify.append(row)
            us = row.get("us", float("nan"))
            print(
                f"| verify {row['path']} | {width} after {ctx} | {bsz} | {us:.1f} | |", flush=True
            )
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    attention = "FA3" if fa else "torch"
    result = {"tag": args.tag, "attention": attention, "prefill": prefill, "verify": verify}
    (args.out / f"five_bit_order_{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
