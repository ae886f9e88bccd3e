"""v6f's main loop with its code words copied by the tensor memory accelerator (``TMA``)
against ``cp.async`` (GPU only; thirty-ninth session).

v6f copies a step's K and V code words with 12 ``cp.async`` of 16 bytes per lane and the
address arithmetic for them; the ``TMA`` build issues two bulk tensor copies per step from
one lane onto an mbarrier (the scales still by ``cp.async``). Static (sm_90a): the loop's
instruction count is unchanged (1,229 against 1,232; ~70 copy instructions out, a fence,
the mbarrier wait and predicate work in), 224 registers uncapped, 168 with 4 bytes spilled
at ``maxnreg`` 168 (12 programs per SM, as v6f's shared memory allows).

Times the main-loop launch alone (graph replay, the served split count) for v6f, then the
``TMA`` build at each register cap, and checks that the partials are bit-identical to
v6f's (the same words in the same shared-memory order, the same math). Writes
``decode_v6_tma_ab.json`` to ``--out``. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools:packages/kvarn-kernels/scripts \\
        python3 packages/kvarn-kernels/scripts/decode_v6_tma_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
from decode_v6_probe import launch_buffers

SHAPES = ((64, 16384), (256, 4096), (64, 65536), (8, 16384), (1, 16384))
CAPS: tuple[int | None, ...] = (None,)


def launch_once(
    inp: dict[str, Any], b: dict[str, Any], splits: int, tma: bool, cap: int | None
) -> None:
    from kvarn_kernels.attention import _launch_v5

    _launch_v5(
        b["geo"], b["q_rot"], inp["kv"], inp["bt"], inp["seq_lens"], inp["b2s"],
        b["o_part"], b["lse_part"], b["d"] ** -0.5, b["n_rows"], splits, b["hq"], b["hk"],
        cap, None, None, "v6f", tma=tma,
    )  # fmt: skip


def timed(inp: dict[str, Any], splits: int, tma: bool, cap: int | None) -> float:
    b = launch_buffers(inp, splits)
    us, _mode = bk.timed(lambda: launch_once(inp, b, splits, tma, cap))
    return float(us)


def partials_equal(inp: dict[str, Any], splits: int, cap: int | None) -> bool:
    """Whether the ``TMA`` build's partial outputs and LSEs equal v6f's bit for bit."""
    import torch

    outs = []
    for tma in (False, True):
        b = launch_buffers(inp, splits)
        b["o_part"].fill_(float("nan"))
        b["lse_part"].fill_(float("nan"))
        launch_once(inp, b, splits, tma, cap if tma else None)
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
        print(f"{fmt}; main loop µs, graph replay, best of two; ratio to v6f", flush=True)
        for bsz, ctx in SHAPES:
            inp = bk.decode_inputs(fmt, bsz, ctx)
            splits = int(bk.bench_kvarn_decode(inp)["splits"])
            row: dict[str, Any] = {"format": fmt, "B": bsz, "ctx": ctx, "splits": splits}
            row["v6f"] = min(timed(inp, splits, False, None) for _ in range(2))
            for cap in CAPS:
                key = f"tma r{cap or 'auto'}"
                row[f"{key} equal"] = partials_equal(inp, splits, cap)
                row[key] = min(timed(inp, splits, True, cap) for _ in range(2))
            row["v6f again"] = min(timed(inp, splits, False, None) for _ in range(2))
            rows.append(row)
            (args.out / "decode_v6_tma_ab.json").write_text(json.dumps(rows, indent=1))
            base = min(row["v6f"], row["v6f again"])
            cells = [f"v6f {row['v6f']:.1f}/{row['v6f again']:.1f}"]
            for cap in CAPS:
                key = f"tma r{cap or 'auto'}"
                same = "" if row[f"{key} equal"] else " DIFFERS"
                cells.append(f"r{cap or 'auto'} {row[key]:.1f} ({row[key] / base:.3f}x{same})")
            print(f"B={bsz} ctx={ctx} splits={splits}: " + " | ".join(cells), flush=True)
            del inp
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
