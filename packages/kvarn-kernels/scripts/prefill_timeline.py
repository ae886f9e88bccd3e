"""Where a short-chunk prefill's GPU time goes between its kernels (GPU only; FA3 rows where
vLLM is importable): each path captured in a CUDA graph, the graph replayed under
torch.profiler, and every replay's kernels laid out in time: each kernel's duration, the gap
before it (from the previous kernel's end, in the same replay) and the replay's span (first
kernel's start to last kernel's end), averaged over the replays. Beside it, the replay's time
as ``bench_kernels.timed`` measures it (docs/kernel-notes.md, forty-sixth session).

Shapes: 64 tokens after 16,320, B = 1 and 4. Paths: the fused v3 kernel at its default split
count and at half and twice that, v4, and FA3 fp16 on a paged cache of the same shape. Writes
``prefill_timeline.json`` to ``--out`` and prints a table::

    source .gpu/env.sh && PYTHONPATH=$PYTHONPATH:tools \\
        python3 packages/kvarn-kernels/scripts/prefill_timeline.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

FMT = "kvarn_k4v2_g128"
REPLAYS = 30


def kernel_events(graph_replay: Callable[[], None], replays: int) -> list[dict[str, Any]]:
    """The CUDA kernels of ``replays`` replays, sorted by start (chrome-trace ``ts``/``dur``
    in µs)."""
    prof = bk.cuda_profile(graph_replay, replays, warmup=5)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e
    ]
    return sorted(events, key=lambda e: float(e["ts"]))


def layout(events: list[dict[str, Any]], replays: int) -> dict[str, Any]:
    """Per kernel position of a replay: name, mean duration and mean gap before it; and the
    mean span of a replay. Fails loudly if the replays do not hold the same count of
    kernels."""
    if not events or len(events) % replays:
        raise RuntimeError(f"{len(events)} kernels in {replays} replays: not a whole number each")
    k = len(events) // replays
    kernels = [{"kernel": e["name"][:80], "dur_us": 0.0, "gap_us": 0.0} for e in events[:k]]
    span = 0.0
    for r in range(replays):
        one = events[r * k : (r + 1) * k]
        starts = [float(e["ts"]) for e in one]
        ends = [s + float(e["dur"]) for s, e in zip(starts, one, strict=True)]
        for i in range(k):
            kernels[i]["dur_us"] += (ends[i] - starts[i]) / replays
            if i:  # negative where a kernel overlaps the one before it (a side stream)
                kernels[i]["gap_us"] += (starts[i] - ends[i - 1]) / replays
        span += (max(ends) - starts[0]) / replays
    busy = sum(x["dur_us"] for x in kernels)
    return {"kernels": kernels, "span_us": span, "busy_us": busy}


def paths(bsz: int) -> list[tuple[str, Callable[[], Any]]]:
    from kvarn_kernels import plan_fused_prefill, prefill_attention
    from kvarn_kernels.attention import _num_sms, fused_prefill_splits

    c = bk.prefill_case(FMT, 16320, 64, bsz)
    index = (c["bt"], c["qsl"], c["seqs"], c["b2s"])
    args = bk.prefill_args(c)
    scale = bk.D**-0.5
    out = c["q"].new_empty(c["q"].shape)
    shape = (int(c["q"].shape[0]), bk.HQ, bk.HK, int(c["bt"].shape[1]), _num_sms(c["q"].device))
    auto = fused_prefill_splits("v3", *shape, bk.D)

    def planned(kernel: str, splits: int | None = None) -> Callable[[], Any]:
        plan = plan_fused_prefill(*index, fused_kernel=kernel, num_splits=splits)
        return lambda: prefill_attention(
            FMT, c["q"], *args, scale, out=out, method="fused", fused_plan=plan
        )

    rows: list[tuple[str, Callable[[], Any]]] = [
        (f"v3 (splits {auto})", planned("v3")),
        (f"v3 splits {max(1, auto // 2)}", planned("v3", max(1, auto // 2))),
        (f"v3 splits {2 * auto}", planned("v3", 2 * auto)),
        ("v4", planned("v4")),
    ]
    if bk.vllm_available():
        rows.append(("FA3 fp16", bk.fa3_call(bsz, 64, 16320 + 64)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4", help="request counts, comma-separated")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for bsz in (int(x) for x in a.batches.split(",")):
        for name, fn in paths(bsz):
            fn()
            graph = bk.capture_graph(fn)
            timed_us, _ = bk.timed(graph.replay, graph=False)
            r = {"B": bsz, "path": name, "timed_us": timed_us}
            r.update(layout(kernel_events(graph.replay, REPLAYS), REPLAYS))
            results.append(r)
            bk.log(f"B={bsz} {name}: timed {timed_us:.1f} span {r['span_us']:.1f}")
    (a.out / "prefill_timeline.json").write_text(json.dumps(results, indent=1))
    print("| B | path | replay µs | span µs | kernels busy µs | kernel: dur (gap before) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ks = "; ".join(
            f"{k['kernel'][:28]}: {k['dur_us']:.1f} ({k['gap_us']:.1f})" for k in r["kernels"]
        )
        print(
            f"| {r['B']} | {r['path']} | {r['timed_us']:.1f} | {r['span_us']:.1f} "
            f"| {r['busy_us']:.1f} | {ks} |"
        )


if __name__ == "__main__":
    main()
