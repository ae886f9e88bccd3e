"""Where decode v6f's time goes at the bench's shapes (GPU only; timing, not attention).

Three questions, one run (docs/kernel-notes.md, twenty-second session):

1. **Copies or math?** The main loop alone (no pool phase, no merge), as served, against
   the same launch with ``PROBE_COPIES_ONLY`` (every copy and wait of the loop, no math)
   and ``PROBE_COMPUTE_ONLY`` (the whole step on the prologue's stage, no
   copy in the loop). If one probe takes about the main loop's time, that part is the limit;
   if both are well under it, the loop loses its time in not overlapping them.
2. **The split count.** The served plan at other split counts (one-warp programs, 12 per SM:
   1,584 slots on an H200).
3. **The served plan's kernels.** Each kernel's share of one served launch (query rotation,
   pool phase, main loop, merge), from the torch profiler.

Writes ``decode_v6_probe.json`` to ``--out`` and prints a table. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_v6_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

#: (batch, context, split counts to try besides the served plan's)
SHAPES: tuple[tuple[int, int, tuple[int, ...]], ...] = (
    (64, 16384, (4, 6, 12, 16, 32)),
    (256, 4096, (2, 3, 6, 8)),
    (256, 6144, (2, 3, 6, 8)),
    (64, 65536, (4, 12, 16, 32)),
)


def launch_buffers(inp: dict[str, Any], splits: int) -> dict[str, Any]:
    """What one of the served plan's launches takes on the case ``inp`` at ``splits`` splits
    (v6f's partial count): the geometry, the query as the launch reads it (unrotated: a
    timing case) and fresh partial buffers."""
    import torch

    from kvarn_format import parse_cache_dtype, record_layout
    from kvarn_kernels._common import dense_geometry
    from kvarn_kernels.attention import decode_partials

    fmt = parse_cache_dtype(inp["fmt"])
    bsz, hq, d = (int(x) for x in inp["q"].shape)
    n_rows = bsz * hq
    parts = decode_partials("v6f", splits)
    return {
        "geo": dense_geometry(fmt, d, record_layout(fmt, d).tile_bytes),
        "hq": hq,
        "hk": int(inp["pool_k"].shape[2]),
        "d": d,
        "n_rows": n_rows,
        "q_rot": inp["q"].float().reshape(-1),
        "o_part": torch.empty(n_rows * d * parts, device="cuda"),
        "lse_part": torch.empty(n_rows * parts, device="cuda"),
    }


def launch_main_loop(inp: dict[str, Any], b: dict[str, Any], splits: int, **kw: Any) -> None:
    """One main-loop launch (``kvarn_kernels.attention._launch_v5``) on the case ``inp`` into
    the buffers ``b`` (:func:`launch_buffers`): v6f unless ``kw`` names another ``variant``;
    ``kw``: its keyword options."""
    from kvarn_kernels.attention import _launch_v5

    kw = {"max_registers": None, "num_warps": None, "num_stages": None, "variant": "v6f", **kw}
    _launch_v5(
        b["geo"], b["q_rot"], inp["kv"], inp["bt"], inp["seq_lens"], inp["b2s"],
        b["o_part"], b["lse_part"], b["d"] ** -0.5, b["n_rows"], splits, b["hq"], b["hk"],
        **kw,
    )  # fmt: skip


def main_loop_only(inp: dict[str, Any], splits: int, probe: int) -> float:
    """µs of the v6f main-loop launch alone (graph replay) on the case ``inp``."""
    b = launch_buffers(inp, splits)
    us, _mode = bk.timed(lambda: launch_main_loop(inp, b, splits, probe=probe))
    return us


def kernel_shares(inp: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU kernel's mean µs per served launch (20 launches under the torch profiler)."""
    prof = bk.cuda_profile(lambda: bk.decode_once(inp), 20, warmup=1)
    rows = []
    for ev in prof.key_averages():
        dev_us = float(getattr(ev, "device_time_total", 0.0) or 0.0)
        if dev_us > 0 and ev.count:
            rows.append({"kernel": ev.key[:80], "us_per_launch": dev_us / 20, "count": ev.count})
    return sorted(rows, key=lambda r: -r["us_per_launch"])


def print_kernel_shares(
    shapes: tuple[tuple[int, int], ...], fmt: str = "kvarn_k4v2_g128"
) -> dict[str, list[dict[str, Any]]]:
    """:func:`kernel_shares` of the served plan at each ``(batch, context)``, printed, keyed
    ``"B/context"``."""
    shares: dict[str, list[dict[str, Any]]] = {}
    for bsz, ctx in shapes:
        inp = bk.decode_inputs(fmt, bsz, ctx)
        shares[f"{bsz}/{ctx}"] = kernel_shares(inp)
        for r in shares[f"{bsz}/{ctx}"]:
            print(f"B={bsz} ctx={ctx}: {r['us_per_launch']:8.2f} µs  {r['kernel']}")
        del inp
    return shares


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    import torch

    from kvarn_kernels.decode_v6 import PROBE_COMPUTE_ONLY, PROBE_COPIES_ONLY

    if not torch.cuda.is_available():
        print("decode_v6_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_gbs = bk.ceilings()["copy_gbs"]
    res: dict[str, Any] = {"format": args.format, "copy_gbs": copy_gbs, "shapes": []}
    lines = [f"copy bandwidth {copy_gbs:,.0f} GB/s; {args.format}; µs, graph replay"]
    for bsz, ctx, other_splits in SHAPES:
        inp = bk.decode_inputs(args.format, bsz, ctx)
        served = bk.bench_kvarn_decode(inp)
        splits = int(served["splits"])
        gbs = inp["bytes"] / (served["us"] * 1e-6) / 1e9
        row: dict[str, Any] = {"B": bsz, "ctx": ctx, "served": served, "served_gbs": gbs}
        row["main_loop"] = main_loop_only(inp, splits, 0)
        row["copies_only"] = main_loop_only(inp, splits, int(PROBE_COPIES_ONLY.value))
        row["compute_only"] = main_loop_only(inp, splits, int(PROBE_COMPUTE_ONLY.value))
        row["splits"] = {}
        for s in other_splits:
            r = bk.guarded(lambda s=s, inp=inp: bk.bench_kvarn_decode(inp, num_splits=s))
            row["splits"][s] = r.get("us", r.get("error"))
        if bsz == 64 and ctx == 16384:
            row["kernels"] = kernel_shares(inp)
        res["shapes"].append(row)
        (args.out / "decode_v6_probe.json").write_text(json.dumps(res, indent=1))
        lines.append(
            f"B={bsz} ctx={ctx}: served {served['us']:.1f} ({served['variant']}, {splits} splits,"
            f" {gbs:,.0f} GB/s = {gbs / copy_gbs:.0%} of copy) | main loop {row['main_loop']:.1f}"
            f" | copies only {row['copies_only']:.1f} | compute only {row['compute_only']:.1f}"
            f" | splits {row['splits']}"
        )
        print(lines[-1], flush=True)
        del inp
        torch.cuda.empty_cache()
    for r in res["shapes"][0].get("kernels", []):
        lines.append(f"  {r['us_per_launch']:8.1f} µs x{r['count'] // 20}  {r['kernel']}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
