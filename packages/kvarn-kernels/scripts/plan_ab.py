"""Eager calls with and without a per-batch plan, in one run (GPU only): the fused prefill
(``FusedPrefillPlan``) and decode (``DecodeBatchPlan``).

A step of a 36-layer model (``kvarn_k4v2_g128``, Qwen3-8B's heads): each layer has its own
cache and pools (copies of one) and its queries are a strided view of a fused QKV tensor, as
vLLM passes them. The 36 calls are queued back to back, as vLLM runs attention between its
piecewise CUDA graphs, and timed per layer, unplanned and with one plan built per step (its
build counted in the step); every planned output is compared with the unplanned one bit for
bit. For scale: one call's GPU time (CUDA-graph replay) and, where vLLM is importable, FA3
fp16's eager call on the same shape.

* ``prefill``: a short continuation chunk, 64 tokens after 16,320, B = 1 and 4, the fused
  kernels given by ``--kernels`` (docs/kernel-notes.md, forty-fourth session);
* ``decode``: the decode rows of a mixed step, B = 8 and 64 at 4K, the served variant
  (``"auto"``; forty-fifth session);
* ``pool``: the side-pool write of 8 decode tokens (``SidePoolWritePlan``; forty-sixth
  session). ``--op both`` runs prefill and decode, ``all`` the three.

Writes ``plan_ab.json`` to ``--out``::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/plan_ab.py --out $OUT [--op prefill|decode]
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
LAYERS = 36
ROUNDS = 3


def step_us(step: Callable[[], None], steps: int = 20) -> float:
    """µs per layer of ``step`` (one call per layer) queued back to back, best of rounds."""
    import torch

    step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps / LAYERS * 1e6)
    return best


def prefill_rows(bsz: int, kernel: str) -> list[dict[str, Any]]:
    import torch

    from kvarn_kernels import plan_fused_prefill, prefill_attention

    c = bk.prefill_case(FMT, 16320, 64, bsz)
    t = int(c["q"].shape[0])
    layers = _layers(c["q"].shape[0], c["kv"], c["pool_k"], c["pool_v"])
    index = (c["bt"], c["qsl"], c["seqs"], c["b2s"])
    outs = {p: torch.empty(LAYERS, t, bk.HQ, bk.D, device="cuda").half() for p in (0, 1)}
    scale = bk.D**-0.5

    def layers_into(out: Any, **how: Any) -> None:
        for i, (q, kv, pk, pv) in enumerate(layers):
            prefill_attention(FMT, q, kv, pk, pv, *index, scale, out=out[i], method="fused", **how)

    def one_call() -> None:
        q0, kv0, pk0, pv0 = layers[0]
        prefill_attention(
            FMT,
            q0,
            kv0,
            pk0,
            pv0,
            *index,
            scale,
            out=outs[0][0],
            method="fused",
            fused_kernel=kernel,
        )

    return _compare(
        f"prefill {kernel} 64 after 16K, B={bsz}",
        lambda: layers_into(outs[0], fused_kernel=kernel),
        # one plan a step, its build counted
        lambda: layers_into(outs[1], fused_plan=plan_fused_prefill(*index, fused_kernel=kernel)),
        outs,
        one_call,
        lambda: bk.bench_fa3_prefill(16320, 64, bsz),
    )


def decode_rows(bsz: int) -> list[dict[str, Any]]:
    import torch

    from kvarn_kernels import decode_attention, plan_decode_batch

    c = bk.decode_inputs(FMT, bsz, 4096)
    layers = _layers(bsz, c["kv"], c["pool_k"], c["pool_v"])
    index = (c["bt"], c["seq_lens"], c["b2s"])
    outs = {p: torch.empty(LAYERS, bsz, bk.HQ, bk.D, device="cuda").half() for p in (0, 1)}
    scale = bk.D**-0.5

    def layers_into(out: Any, **how: Any) -> None:
        for i, (q, kv, pk, pv) in enumerate(layers):
            decode_attention(FMT, q, kv, pk, pv, *index, scale, out=out[i], **how)

    def one_call() -> None:
        q0, kv0, pk0, pv0 = layers[0]
        decode_attention(FMT, q0, kv0, pk0, pv0, *index, scale, out=outs[0][0])

    return _compare(
        f"decode auto 4K, B={bsz}",
        lambda: layers_into(outs[0]),
        lambda: layers_into(outs[1], batch_plan=plan_decode_batch(*index)),
        outs,
        one_call,
        lambda: bk.bench_fa3_decode(bsz, int(c["seq"])),
    )


def profile_mixed_step(bsz: int, out_dir: Path, steps: int = 20) -> None:
    """cProfile of ``steps`` eager steps of 36 layers, each layer as a mixed step runs it:
    the side-pool write of ``bsz`` decode tokens, their planned decode (4K), and a planned
    fused prefill of 64 tokens after 16,320 (B = 1, the served kernel). Where the host time
    of a mixed step goes: prints the functions by own time (µs a layer) and writes the full
    listing."""
    import cProfile
    import io
    import pstats

    import torch

    from kvarn_kernels import (
        decode_attention,
        plan_decode_batch,
        plan_fused_prefill,
        plan_side_pool_write,
        prefill_attention,
    )

    c = bk.decode_inputs(FMT, bsz, 4096)
    layers = _layers(bsz, c["kv"], c["pool_k"], c["pool_v"])
    index = (c["bt"], c["seq_lens"], c["b2s"])
    slots, g = _decode_slots(c)
    kv_new = torch.randn(LAYERS, 2, bsz, bk.HK, bk.D, device="cuda").half()
    out = torch.empty(LAYERS, bsz, bk.HQ, bk.D, device="cuda").half()
    p = bk.prefill_case(FMT, 16320, 64, 1)
    p_index = (p["bt"], p["qsl"], p["seqs"], p["b2s"])
    p_out = torch.empty_like(p["q"])
    scale = bk.D**-0.5

    def step() -> None:
        plan = plan_decode_batch(*index)
        fused = plan_fused_prefill(*p_index)
        writes = plan_side_pool_write(slots, c["b2s"], group=g)
        for i, (q, kv, pk, pv) in enumerate(layers):
            writes.write(kv_new[i, 0], kv_new[i, 1], pk, pv, slots, c["b2s"])
            decode_attention(FMT, q, kv, pk, pv, *index, scale, out=out[i], batch_plan=plan)
            prefill_attention(
                FMT, p["q"], p["kv"], p["pool_k"], p["pool_v"], *p_index, scale,
                out=p_out, method="fused", fused_plan=fused,
            )  # fmt: skip

    plain_us = step_us(step)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats(60)
    (out_dir / f"mixed_step_profile_B{bsz}.txt").write_text(text.getvalue())
    calls = steps * LAYERS
    print(f"mixed step, B={bsz} decode rows + 64 prefill tokens: {plain_us:.1f} µs a layer")
    print("| function | own µs a layer | cumulative µs a layer |")
    print("|---|---|---|")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # type: ignore[attr-defined]
    for (file, line, name), (_cc, _nc, tt, ct, _callers) in rows:
        where = f"{Path(file).name}:{line}({name})"
        print(f"| {where} | {tt / calls * 1e6:.2f} | {ct / calls * 1e6:.2f} |")


def pool_write_rows(bsz: int) -> list[dict[str, Any]]:
    """The side-pool write of ``bsz`` decode tokens in each of 36 layers (their own pools),
    unplanned and through one :class:`SidePoolWritePlan` a step."""
    import torch

    from kvarn_kernels import plan_side_pool_write, write_side_pool

    c = bk.decode_inputs(FMT, bsz, 4096)
    layers = _layers(bsz, c["kv"], c["pool_k"], c["pool_v"])
    slots, g = _decode_slots(c)
    kv_new = torch.randn(LAYERS, 2, bsz, bk.HK, bk.D, device="cuda").half()
    pools = {p: [(pk.clone(), pv.clone()) for _q, _kv, pk, pv in layers] for p in (0, 1)}

    def unplanned() -> None:
        for i, (pk, pv) in enumerate(pools[0]):
            write_side_pool(kv_new[i, 0], kv_new[i, 1], pk, pv, slots, c["b2s"], group=g)

    def planned() -> None:
        plan = plan_side_pool_write(slots, c["b2s"], group=g)
        for i, (pk, pv) in enumerate(pools[1]):
            plan.write(kv_new[i, 0], kv_new[i, 1], pk, pv, slots, c["b2s"])

    label = f"pool write, B={bsz}"
    rows: list[dict[str, Any]] = []
    for name, step in (("unplanned", unplanned), ("planned", planned)):
        rows.append({"case": label, "path": name, "eager_us": step_us(step)})
    equal = all(
        torch.equal(a, b)
        for x, y in zip(pools[0], pools[1], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    rows.append({"case": label, "equal": equal})
    pk0, pv0 = pools[0][0]
    gpu_us, mode = bk.timed(
        lambda: write_side_pool(kv_new[0, 0], kv_new[0, 1], pk0, pv0, slots, c["b2s"], group=g)
    )
    rows.append({"case": label, "path": "GPU time (graph)", "us": gpu_us, "mode": mode})
    rows.append({"case": label, "path": "FA3 fp16"})
    bk.log(f"{label}: {rows}")
    return rows


def _decode_slots(c: dict[str, Any]) -> tuple[Any, int]:
    """Each decode request's newest token's vLLM slot (its row in the in-progress block), and
    the tile size."""
    import torch

    g = int(c["pool_k"].shape[1])
    last = (c["seq_lens"].long() - 1) // g
    blocks = c["bt"].long().gather(1, last[:, None])[:, 0]
    return (blocks * g + (c["seq_lens"].long() - 1) % g).to(torch.int32), g


def _layers(tokens: int, kv: Any, pool_k: Any, pool_v: Any) -> list[tuple[Any, ...]]:
    """36 layers: their own copies of the cache and pools, their queries a strided view of a
    fused QKV tensor."""
    import torch

    qkv = torch.randn(LAYERS, tokens, bk.HQ + 2 * bk.HK, bk.D, device="cuda").half()
    return [(qkv[i, :, : bk.HQ], kv.clone(), pool_k.clone(), pool_v.clone()) for i in range(LAYERS)]


def _compare(
    label: str,
    unplanned: Callable[[], None],
    planned: Callable[[], None],
    outs: dict[int, Any],
    one_call: Callable[[], None],
    fa3: Callable[[], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Rows of one case: the step unplanned and planned (µs a layer), whether their outputs
    are equal, one call's GPU time and FA3 fp16's eager call."""
    import torch

    rows: list[dict[str, Any]] = []
    for name, step in (("unplanned", unplanned), ("planned", planned)):
        rows.append({"case": label, "path": name, "eager_us": step_us(step)})
        bk.log(f"{label} {name}: {rows[-1]}")
    rows.append({"case": label, "equal": bool(torch.equal(outs[0], outs[1]))})
    gpu_us, mode = bk.timed(one_call, graph=True)
    rows.append({"case": label, "path": "GPU time (graph)", "us": gpu_us, "mode": mode})
    rows.append({"case": label, "path": "FA3 fp16", **bk.guarded(fa3)})
    bk.log(f"{label}: {rows[-3:]}")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | eager µs/layer unplanned | planned | planned / unplanned | GPU µs (graph) "
        "| FA3 fp16 µs (prefill eager, decode graph) | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = {r.get("path", "equal"): r for r in rows if r["case"] == case}
        u, p = mine["unplanned"]["eager_us"], mine["planned"]["eager_us"]
        fa = mine["FA3 fp16"].get("us")
        lines.append(
            f"| {case} | {u:.1f} | {p:.1f} | {p / u:.3f} | {mine['GPU time (graph)']['us']:.1f} "
            f"| {'-' if fa is None else f'{fa:.1f}'} | {mine['equal']['equal']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--op", choices=("prefill", "decode", "pool", "both", "all"), default="both")
    ap.add_argument("--kernels", default="v3,v4", help="fused_kernel values, comma-separated")
    ap.add_argument(
        "--profile",
        type=int,
        metavar="B",
        help="only cProfile a mixed step's layers, B decode rows (host time by function)",
    )
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.profile:
        profile_mixed_step(a.profile, a.out)
        return
    rows: list[dict[str, Any]] = []
    if a.op in ("decode", "both", "all"):
        for bsz in (8, 64):
            rows += decode_rows(bsz)
    if a.op in ("pool", "all"):
        rows += pool_write_rows(8)
    if a.op in ("prefill", "both", "all"):
        for bsz in (1, 4):
            for kernel in a.kernels.split(","):
                rows += prefill_rows(bsz, kernel)
    (a.out / "plan_ab.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
