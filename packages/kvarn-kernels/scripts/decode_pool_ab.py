"""The pool-tile launch's shapes (GPU only): :mod:`kvarn_kernels.decode_pool` at several chunk
sizes, warp counts, register caps and pipeline stages, at the bench's decode shapes
(docs/kernel-notes.md, twenty-third and thirty-fourth sessions; the A/B against v4's pool
phase, which it replaced, ran at commit ``8185346``).

For each shape: the served plan (graph replay, µs) with each configuration, every one timed
twice in alternation; the pool launch alone; and the served outputs against the first
configuration's. Writes ``decode_pool_ab.json`` to ``--out`` and prints a table. On
the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_pool_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
from decode_v6_probe import launch_buffers  # this script's folder

SHAPES: tuple[tuple[int, int], ...] = (
    (8, 16384),
    (64, 16384),
    (256, 4096),
    (256, 6144),
)
#: (name, chunk tokens, warps, register cap, pipeline stages); the first is the default
#: (2 stages since the thirty-fourth session), the others are timed against it
CONFIGS: tuple[tuple[str, int, int, int | None, int], ...] = (
    ("bn64 w4 s2", 64, 4, None, 2),
    ("bn64 w4 s1", 64, 4, None, 1),
    ("bn32 w4 s2", 32, 4, None, 2),
    ("bn64 w4 s1 r128", 64, 4, 128, 1),
)


def configure(bn: int, warps: int, max_registers: int | None, stages: int) -> None:
    from kvarn_kernels import decode_pool

    decode_pool.POOL_CHUNK_TOKENS = bn
    decode_pool.POOL_WARPS = warps
    decode_pool.POOL_MAX_REGISTERS = max_registers
    decode_pool.POOL_STAGES = stages


def pool_alone(inp: dict[str, Any], splits: int) -> float:
    """µs of the pool launch alone (graph replay), as configured."""
    from kvarn_kernels.attention import _pool_launch

    b = launch_buffers(inp, splits)

    def launch() -> None:
        _pool_launch(
            b["geo"],
            b["q_rot"],
            inp["kv"],
            inp["pool_k"],
            inp["pool_v"],
            inp["bt"],
            inp["seq_lens"],
            inp["b2s"],
            b["o_part"],
            b["lse_part"],
            b["d"] ** -0.5,
            b["n_rows"],
            splits,
            b["hq"],
        ).run()

    us, _mode = bk.timed(launch)
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("decode_pool_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    res: dict[str, Any] = {"format": args.format, "shapes": []}
    lines = [f"{args.format}; µs, graph replay; served plan (two runs) | pool launch alone"]
    for bsz, ctx in SHAPES:
        inp = bk.decode_inputs(args.format, bsz, ctx)
        row: dict[str, Any] = {"B": bsz, "ctx": ctx, "configs": {}}
        base = None
        for rep in range(2):
            for name, *config in CONFIGS:
                configure(*config)
                r = bk.guarded(lambda inp=inp: bk.bench_kvarn_decode(inp))
                cell = row["configs"].setdefault(name, {"served": [], "splits": r.get("splits")})
                cell["served"].append(r.get("us", r.get("error")))
                if rep == 0:
                    splits = int(r.get("splits", 1))
                    cell["pool_alone"] = bk.guarded(
                        lambda inp=inp, s=splits: {"us": pool_alone(inp, s)}
                    ).get("us")
                    out = bk.decode_once(inp).float()
                    base = out if base is None else base
                    cell["max_abs_diff_vs_first"] = float((out - base).abs().max())
                    cell["finite"] = bool(torch.isfinite(out).all())
        configure(*CONFIGS[0][1:])
        res["shapes"].append(row)
        (args.out / "decode_pool_ab.json").write_text(json.dumps(res, indent=1))
        for name, cell in row["configs"].items():
            lines.append(
                f"B={bsz} ctx={ctx} {name:12s} served {cell['served']} ({cell['splits']} splits)"
                f" | alone {cell.get('pool_alone')} | diff {cell.get('max_abs_diff_vs_first'):.2e}"
                f" finite {cell.get('finite')}"
            )
            print(lines[-1], flush=True)
        del inp
        torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
