"""v6's main loop (v6f, v6t or a probe) with part of the GPU's SMs held, so that each SM left
has an H200's share of the memory bandwidth (GPU only; thirty-ninth session).

On an H100 v6f's main loop at B = 64 / 16K streams ~90% of the copy bandwidth, so a change
that shortens its math cannot show there; on an H200 (1.4x the bandwidth, the same 132 SMs at
the same clock) the same loop reaches 68%, and its time follows its instruction count
(docs/kernel-notes.md, twenty-second and thirty-ninth sessions: this script reproduced the
H200's v6f main loop within 3%). Holding SMs idle gives the rest more bandwidth each: with
``--free-sms 94`` an H100's 3.04 TB/s is 32 GB/s per running SM, an H200's 4.27 TB/s over
132. A holder kernel (one program per held SM, all of
an SM's shared memory, spinning on a flag) is launched on a side stream; the timed launches
are replayed from a CUDA graph captured before it, timed with events on the main stream only
(a device-wide sync would wait for the holder), and the holder is released after.

Each build is ``NAME=JSON``: keyword arguments of ``kvarn_kernels.attention._launch_v5``
after its positional ones (``{"probe": 2}``, ``{"variant": "v6t"}``, ``{"max_registers":
144}``, ...; the variant is v6f unless given), so the script runs against any tree that has
those options; with ``"served": true`` the build is the whole ``decode_attention`` call at
its ``variant`` (the query's rotation, the pool tiles on a side stream, the merge) at the main
loop's split count. Each build's partials (or output) are compared with the first build's of
its kind (the probes' differ: they are not attention); a build may set its own ``"splits"``
(a split-count sweep; then a served build's output is compared with the first served
build's at the planned count by its largest difference, a main loop's partials not at
all). ``--shapes`` picks the cases; with ``--free-sms`` at the GPU's SM count nothing is
held (an H200's own times). Writes ``decode_sm_share.json`` to ``--out``. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools:packages/kvarn-kernels/scripts \\
        python3 packages/kvarn-kernels/scripts/decode_sm_share.py --out $OUT \\
        --build 'v6f={}' --build 'compute only={"probe": 2}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
from decode_v6_probe import launch_buffers, launch_main_loop
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]

SHAPES = ((64, 16384), (256, 4096))
#: Shared memory a holder program takes (128 + 64 + 32 KB, of an H100 SM's 228): less than
#: any decode program needs is left beside it (v6f's take 14.6 KB), so nothing else runs on
#: a held SM.
HOLD_SMEM_WORDS = (32768, 16384, 8192)


@gluon.jit
def _hold_sm(FLAG, COUNT, A: gl.constexpr, B: gl.constexpr, C: gl.constexpr):
    """Occupy one SM (its shared memory: three buffers of ``A``, ``B``, ``C`` words) until
    ``FLAG`` is set; count in on ``COUNT``."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    x = gl.arange(0, 32, layout=one)
    bufs = (
        gl.allocate_shared_memory(gl.int32, [A], flat),
        gl.allocate_shared_memory(gl.int32, [B], flat),
        gl.allocate_shared_memory(gl.int32, [C], flat),
    )
    for i in gl.static_range(3):
        bufs[i].slice(0, 32).store(x)
    gl.atomic_add(COUNT + x, x * 0 + 1, mask=x == 0)
    flag = gl.load(FLAG, volatile=True)
    while flag == 0:
        flag = gl.load(FLAG, volatile=True)
    for i in gl.static_range(3):  # the buffers read back (zero added): kept in the kernel
        gl.atomic_add(COUNT + x, bufs[i].slice(0, 32).load(one) * 0, mask=x == 0)


def replay_us(g: Any, reps: int = 40) -> float:
    """Median µs of ``reps`` replays, events on the current stream only (no device sync)."""
    import torch

    for _ in range(5):
        g.replay()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        g.replay()
        ev[i + 1].record()
    ev[-1].synchronize()
    return 1000.0 * statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))


def held_us(g: Any, free_sms: int) -> tuple[float, int]:
    """``replay_us(g)`` while all SMs but ``free_sms`` run a holder program; also how many
    holders had started before the release (should be all)."""
    import torch

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    hold = n_sm - free_sms
    if hold <= 0:
        return replay_us(g), 0
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    poll = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _hold_sm[(hold,)](flag, count, *HOLD_SMEM_WORDS, num_warps=1)
    started = 0
    t0 = time.time()
    while started < hold and time.time() - t0 < 5:
        with torch.cuda.stream(poll):
            started = int(count.cpu())
    us = replay_us(g)
    with torch.cuda.stream(poll):
        started = int(count.cpu())
        flag.fill_(1)
    torch.cuda.synchronize()
    return us, started


def _build(
    inp: dict[str, Any], splits: int, kw: dict[str, Any]
) -> tuple[Callable[[], None], tuple[Any, ...], bool]:
    """One build's launch on the case ``inp``, the tensors it writes, and whether it is the
    served call (``"served": true`` among its kwargs: ``decode_attention`` whole, with the
    query's rotation, the pool tiles and the merge, at ``variant``) or the main loop alone
    (``_launch_v5`` with the other kwargs)."""
    import torch

    from kvarn_kernels import decode_partials, decode_workspace_numel

    kw = dict(kw)
    if kw.pop("served", False):
        bsz, hq, d = (int(x) for x in inp["q"].shape)
        variant = kw.pop("variant", "v6f")
        parts = decode_partials(variant, splits)
        ws = torch.empty(decode_workspace_numel(bsz, hq, d, parts), device="cuda")
        out = torch.empty_like(inp["q"])

        def served() -> None:
            bk.decode_once(inp, out=out, workspace=ws, num_splits=splits, variant=variant, **kw)

        return served, (out,), True
    b = launch_buffers(inp, splits)

    def loop() -> None:
        launch_main_loop(inp, b, splits, **kw)

    return loop, (b["o_part"], b["lse_part"]), False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument("--free-sms", type=int, default=94)
    ap.add_argument("--build", action="append", required=True, help="NAME=JSON kwargs")
    ap.add_argument("--tag", default="", help="prefix of this tree's rows")
    ap.add_argument(
        "--shapes",
        default=",".join(f"{b}x{c}" for b, c in SHAPES),
        help="comma-separated BATCHxCONTEXT cases",
    )
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("decode_sm_share: needs a CUDA GPU", file=sys.stderr)
        return 2
    builds = {}
    for spec in args.build:
        name, _, kw = spec.partition("=")
        builds[args.tag + name] = json.loads(kw or "{}")
    rows: list[dict[str, Any]] = []
    out = args.out / f"decode_sm_share{args.tag.strip() and '_' + args.tag.strip()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.format}; µs, graph replay; all SMs | {args.free_sms} SMs free")
    shapes = [tuple(int(x) for x in case.split("x")) for case in args.shapes.split(",")]
    for bsz, ctx in shapes:
        inp = bk.decode_inputs(args.format, bsz, ctx)
        planned = int(bk.bench_kvarn_decode(inp)["splits"])
        refs: dict[bool, tuple[Any, ...]] = {}
        for name, kw in builds.items():
            kw = dict(kw)
            splits = int(kw.pop("splits", planned))
            fn, results, served = _build(inp, splits, kw)
            for t in results:  # slots no build writes compare equal
                t.fill_(float("nan"))
            g = bk.capture_graph(fn)
            free = replay_us(g)
            held, started = held_us(g, args.free_sms)
            # against the first build of its kind (probes' partials differ: not attention)
            same: bool | None = None
            diff: float | None = None
            if splits == planned:
                ref = refs.setdefault(served, tuple(t.clone() for t in results))
                same = all(
                    torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
                    for x, y in zip(ref, results, strict=True)
                )
            elif served and served in refs:  # another split count sums in another order
                diff = float((refs[served][0].float() - results[0].float()).abs().max())
            row = {"B": bsz, "ctx": ctx, "splits": splits, "build": name, "all_sms_us": free,
                   "held_us": held, "holders_started": started, "equal_to_first": same,
                   "max_diff_to_first": diff}  # fmt: skip
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1))
            note = {True: "", False: ", results differ", None: ""}[same]
            if diff is not None:
                note = f", {diff:.1e} from the first"
            print(f"B={bsz} ctx={ctx} splits={splits:<3d} {name:24s} {free:8.1f} | {held:8.1f} "
                  f"(holders {started}{note})", flush=True)  # fmt: skip
            del g
        del inp
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
