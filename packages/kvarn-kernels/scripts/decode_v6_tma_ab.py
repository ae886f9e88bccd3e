"""v6t (v6f with every copy by the tensor memory accelerator) against v6f: main-loop time and
bit-equal partials (GPU only; thirty-ninth session).

v6f copies a step's fields with 20 ``cp.async`` a lane, each with its address arithmetic, from
three block-table walks a step; v6t issues 8 bulk tensor copies from one lane onto one
mbarrier and walks the block table once (docs/kernel-notes.md: 1,108 loop instructions
against 1,232 at k4v2_g128, static). Both read the same words into the same shared-memory
order and do the same math, so their partial outputs must be equal bit for bit.

Times the main-loop launch alone (graph replay, best of two, the served split count) of
both at each format's shapes and compares the partials (NaN-filled buffers, so that unwritten
slots compare equal). On an H100 this measures a card where v6f already streams near the
bandwidth; ``scripts/decode_sm_share.py`` times both at an H200's bandwidth per SM. Writes
``decode_v6_tma_ab.json`` to ``--out``. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools:packages/kvarn-kernels/scripts \\
        python3 packages/kvarn-kernels/scripts/decode_v6_tma_ab.py --out $OUT \\
        --formats kvarn_k4v2_g128,kvarn_k4v2_g64,kvarn_k4v4_g128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
from decode_v6_probe import launch_buffers, launch_main_loop

SHAPES = ((64, 16384), (256, 4096), (64, 65536), (8, 16384), (1, 16384))


def timed(inp: dict[str, Any], splits: int, variant: str) -> float:
    b = launch_buffers(inp, splits)
    return min(
        float(bk.timed(lambda: launch_main_loop(inp, b, splits, variant=variant))[0])
        for _ in range(2)
    )


def partials_equal(inp: dict[str, Any], splits: int) -> bool:
    """Whether v6t's partial outputs and LSEs equal v6f's bit for bit."""
    import torch

    outs = []
    for variant in ("v6f", "v6t"):
        b = launch_buffers(inp, splits)
        b["o_part"].fill_(float("nan"))
        b["lse_part"].fill_(float("nan"))
        launch_main_loop(inp, b, splits, variant=variant)
        outs.append((b["o_part"], b["lse_part"]))
    torch.cuda.synchronize()
    return all(
        torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(*outs, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="kvarn_k4v2_g128")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("decode_v6_tma_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for fmt in args.formats.split(","):
        print(f"{fmt}; main loop µs, graph replay, best of two; v6t / v6f", flush=True)
        for bsz, ctx in SHAPES:
            inp = bk.decode_inputs(fmt, bsz, ctx)
            splits = int(bk.bench_kvarn_decode(inp)["splits"])
            row: dict[str, Any] = {"format": fmt, "B": bsz, "ctx": ctx, "splits": splits}
            row["v6f"] = timed(inp, splits, "v6f")
            row["v6t"] = timed(inp, splits, "v6t")
            row["v6f again"] = timed(inp, splits, "v6f")
            row["equal"] = partials_equal(inp, splits)
            rows.append(row)
            (args.out / "decode_v6_tma_ab.json").write_text(json.dumps(rows, indent=1))
            base = min(row["v6f"], row["v6f again"])
            same = "" if row["equal"] else " PARTIALS DIFFER"
            print(
                f"B={bsz} ctx={ctx} splits={splits}: v6f {row['v6f']:.1f}/{row['v6f again']:.1f}"
                f" | v6t {row['v6t']:.1f} ({row['v6t'] / base:.3f}x){same}",
                flush=True,
            )
            del inp
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
