"""Programmatic dependent launch against plain launches, in one run (GPU only, sm_90).

``kvarn_kernels._launch.PROGRAMMATIC_LAUNCH`` switched off and on around the same calls, two
rounds in alternation, best of the rounds (docs/kernel-notes.md, forty-third session):

* the fused prefill (``fused_kernel`` v3 and v4) at 64 tokens after 16,320, B = 1 and 4:
  CUDA-graph replay and eager (µs per call, the queue drained every 200 calls);
* the served decode (``bench_kernels.bench_kvarn_decode``: the plan's splits, graph replay)
  on v6f and v6t at 16K, B = 1, 8 and 64.

Every PDL output is compared with the plain launch's (bit for bit). Writes ``pdl_ab.json``
to ``--out`` and prints a table. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/pdl_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

FMT = "kvarn_k4v2_g128"
ROUNDS = 2


def eager_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """GPU-and-host µs per call of ``fn`` queued back to back (what an eager caller sees)."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / calls


def ab(label: str, fn: Callable[[], Any], eager: bool) -> list[dict[str, Any]]:
    """``fn`` timed with PDL off and on, ``ROUNDS`` times in alternation; ``fn`` returns the
    call's output (compared bit for bit) or a ``bench_kvarn_decode`` row (timed by it)."""
    import torch

    from kvarn_kernels import _launch

    rows: list[dict[str, Any]] = []
    saved = _launch.PROGRAMMATIC_LAUNCH
    try:
        outputs: dict[bool, Any] = {}
        for rnd in range(ROUNDS):
            for pdl in (False, True):
                _launch.PROGRAMMATIC_LAUNCH = pdl
                first = fn()
                if isinstance(first, torch.Tensor):
                    outputs.setdefault(pdl, first.clone())
                    graph_us, _ = bk.timed(fn, graph=True)
                else:
                    graph_us = float(first["us"])
                row = {"case": label, "pdl": pdl, "round": rnd, "graph_us": graph_us}
                if eager:
                    row["eager_us"] = eager_us(fn)
                rows.append(row)
                bk.log(f"{label} pdl={pdl} round {rnd}: {row}")
        if outputs:
            rows.append({"case": label, "equal": bool(torch.equal(outputs[False], outputs[True]))})
    finally:
        _launch.PROGRAMMATIC_LAUNCH = saved
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | graph µs plain | graph µs PDL | PDL / plain | eager PDL / plain | equal |"]
    lines.append("|---|---|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]

        def best(pdl: bool, key: str, mine: list[dict[str, Any]] = mine) -> float:
            return min(r[key] for r in mine if r.get("pdl") is pdl and key in r)

        g0, g1 = best(False, "graph_us"), best(True, "graph_us")
        eager = "-"
        if any("eager_us" in r for r in mine):
            eager = f"{best(True, 'eager_us') / best(False, 'eager_us'):.3f}"
        equal = next((str(r["equal"]) for r in mine if "equal" in r), "-")
        lines.append(f"| {case} | {g0:.1f} | {g1:.1f} | {g1 / g0:.3f} | {eager} | {equal} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    from kvarn_kernels import prefill_attention

    rows: list[dict[str, Any]] = []
    for bsz in (1, 4):
        c = bk.prefill_case(FMT, 16320, 64, bsz)
        args = bk.prefill_args(c)
        for kernel in ("v3", "v4"):
            rows += ab(
                f"prefill {kernel} 64 after 16K, B={bsz}",
                lambda c=c, args=args, kernel=kernel: prefill_attention(
                    FMT, c["q"], *args, bk.D**-0.5, method="fused", fused_kernel=kernel
                ),
                eager=True,
            )
    for bsz in (1, 8, 64):
        inp = bk.decode_inputs(FMT, bsz, 16384)
        for variant in ("v6f", "v6t"):
            rows += ab(
                f"decode {variant} 16K, B={bsz}",
                lambda inp=inp, variant=variant: bk.bench_kvarn_decode(inp, variant=variant),
                eager=False,
            )
    (a.out / "pdl_ab.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
