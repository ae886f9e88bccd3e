"""v1 decode's launch shape at the formats only v1 serves (GPU only).

``kvarn_k5v5_g64`` decodes on v1, the one kernel that reads 5-bit codes, at the split count
:func:`kvarn_kernels.choose_decode_splits` gives (about four programs per SM), 4 warps and a
whole 64-token tile per step: 0.50x FA3 fp16's speed at B = 64 / 16K on the H200 (thirty-second
session's table). v1's 5-bit loop holds ~240 registers a thread, so two 4-warp programs fill
an SM and the default count leaves ~4 waves of 8 warps per SM. This sweeps the split count (1x,
2x, 4x the rule's), the warps (4, 8) and the step (32, 64 tokens) at B = 64 and 8 (16K), each
configuration timed twice in alternation (CUDA-graph replay), and checks every output
against the default's. Writes ``decode_v1_sweep.json`` to ``--out`` and prints a table. On
the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_v1_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

SHAPES: tuple[tuple[int, int], ...] = ((64, 16384), (8, 16384))
#: (split factor on the rule's count, warps, tokens per step); the first is the default
CONFIGS: tuple[tuple[int, int, int], ...] = (
    (1, 4, 64),
    (2, 4, 64),
    (4, 4, 64),
    (1, 8, 64),
    (1, 4, 32),
    (2, 4, 32),
)


def label(factor: int, warps: int, bn: int) -> str:
    return f"splits x{factor} w{warps} bn{bn}"


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--format", default="kvarn_k5v5_g64")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for bsz, ctx in SHAPES:
        inp = bk.decode_inputs(args.format, bsz, ctx)
        rule = bk.rule_splits(inp)
        base = None
        for rnd in range(2):
            for factor, warps, bn in CONFIGS:
                kw: dict[str, Any] = {
                    "variant": "v1",
                    "num_splits": rule * factor,
                    "num_warps": warps,
                    "block_n": bn,
                }
                r = bk.guarded(lambda kw=kw, inp=inp: bk.bench_kvarn_decode(inp, **kw))
                row = {"B": bsz, "ctx": ctx, "config": label(factor, warps, bn), "round": rnd}
                if rnd == 0 and "error" not in r:
                    o = bk.decode_once(inp, **kw).float()
                    base = o if base is None else base
                    row["rel_diff_vs_default"] = float((o - base).norm() / base.norm())
                    row["finite"] = bool(torch.isfinite(o).all())
                rows.append({**row, **r})
                bk.log(f"{row} {r}")
        del inp
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_v1_sweep.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.format}, v1, µs (two rounds), ratio of the mean to the default's")
    print("| B / context | config | splits | µs | ratio | rel diff |")
    print("|---|---|---|---|---|---|")
    for bsz, ctx in SHAPES:
        mine = [r for r in rows if (r["B"], r["ctx"]) == (bsz, ctx)]
        times: dict[str, list[float]] = {}
        for r in mine:
            times.setdefault(r["config"], []).append(float(r.get("us", float("nan"))))
        default = sum(times[label(*CONFIGS[0])]) / 2
        for r in (r for r in mine if r["round"] == 0):
            us = times[r["config"]]
            print(
                f"| {bsz} / {ctx // 1024}K | {r['config']} | {r.get('splits', '-')} | "
                f"{us[0]:,.1f}, {us[1]:,.1f} | {sum(us) / 2 / default:.3f}x | "
                f"{r.get('rel_diff_vs_default', float('nan')):.1e} |"
            )


if __name__ == "__main__":
    main()
