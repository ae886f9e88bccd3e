"""Short-chunk prefill with cached context (GPU only, vLLM's FA3 importable): the fused
kernel :mod:`kvarn_kernels.prefill_v2` against the plugin's dequantize-then-FA3 path, the
v1 fused kernel and, on caches of the same shape, FA3 on fp16 and e4m3 and vLLM's TurboQuant
attention (``turboquant_k3v4_nc``), in one run (docs/kernel-notes.md, twenty-fourth session).

For each shape (cached tokens, chunk tokens, requests): every path eager (as a server runs
prefill), the fused ones and FA3 also from a CUDA graph (their GPU time), v2 at several split
counts, chunk sizes and tile heights; outputs against the dequantize path's. Writes
``prefill_v2_ab.json`` to ``--out`` and prints a table. On the GPU machine::

    source .gpu/env.sh && PYTHONPATH=$PYTHONPATH:tools \\
        python3 packages/kvarn-kernels/scripts/prefill_v2_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

FMT = "kvarn_k4v2_g128"
#: (cached tokens, chunk tokens, requests)
SHAPES: tuple[tuple[int, int, int], ...] = (
    (16320, 64, 1),
    (16320, 64, 4),
    (16256, 128, 1),
    (6080, 64, 16),
    (14336, 2048, 1),
    (16128, 256, 1),
    (15872, 512, 1),
    (3584, 512, 8),
)


#: The rows ``--short`` keeps (prefixes of the path names).
SHORT_PATHS = ("dequant", "v3 auto", "v3 ws", "v4")


@contextlib.contextmanager
def module_settings(module: Any, settings: dict[str, Any]) -> Iterator[None]:
    """``module``'s attributes set to ``settings`` for the body, then restored."""
    saved = {k: getattr(module, k) for k in settings}
    for k, v in settings.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def run_shape(ctx: int, q_len: int, bsz: int, short: bool = False) -> list[dict[str, Any]]:
    import torch

    from kvarn_kernels import prefill_attention, prefill_v3
    from kvarn_kernels.attention import _num_sms, fused_prefill_splits

    c = bk.prefill_case(FMT, ctx, q_len, bsz)
    args = bk.prefill_args(c)
    scale = bk.D**-0.5
    out = torch.empty_like(c["q"])
    plan = bk.prefill_plan(c)
    fa3 = bk.vllm_fa3()
    shape = (int(c["q"].shape[0]), bk.HQ, bk.HK, int(c["bt"].shape[1]), _num_sms(c["q"].device))
    auto = fused_prefill_splits("v3", *shape, bk.D)
    auto4 = fused_prefill_splits("v4", *shape, bk.D)

    def fused(**kw: Any) -> Callable[[], Any]:
        return lambda: prefill_attention(FMT, c["q"], *args, scale, out=out, method="fused", **kw)

    def v3_with(settings: dict[str, Any], **kw: Any) -> Callable[[], None]:
        """v3 with module settings of :mod:`kvarn_kernels.prefill_v3` changed for this row
        (``V3_WARP_SPECIALIZED``, ``V3_DEQ16``, the ``WS_`` constants)."""

        def run() -> None:
            with module_settings(prefill_v3, settings):
                fused(fused_kernel="v3", **kw)()

        return run

    one_partition = {"V3_WARP_SPECIALIZED": False}

    paths: list[tuple[str, Callable[[], Any], bool]] = [
        (
            "dequant+FA3",
            lambda: prefill_attention(
                FMT, c["q"], *args, scale, out=out, context_plan=plan, varlen_attention=fa3
            ),
            True,
        ),
        (f"v2 auto (splits {auto})", fused(fused_kernel="v2"), True),
        (
            f"v2 splits {max(1, auto // 2)}",
            fused(fused_kernel="v2", num_splits=max(1, auto // 2)),
            True,
        ),
        (f"v2 splits {2 * auto}", fused(fused_kernel="v2", num_splits=2 * auto), True),
        ("v2 bn32", fused(fused_kernel="v2", num_splits=auto, block_n=32), True),
        ("v2 bn128", fused(fused_kernel="v2", num_splits=auto, block_n=128), True),
        ("v2 m64 w4", fused(fused_kernel="v2", num_splits=auto, block_m=64, num_warps=4), True),
        (f"v3 auto (splits {auto})", fused(fused_kernel="v3"), True),
        (f"v3 splits {2 * auto}", fused(fused_kernel="v3", num_splits=2 * auto), True),
        ("v3 m64", fused(fused_kernel="v3", block_m=64), True),
        ("v3 one partition", v3_with(one_partition), True),
        ("v3 fp32 dequant", v3_with({**one_partition, "V3_DEQ16": False}), True),
        # timing probes (prefill_v3.WS_PROBE): wrong outputs by design
        ("v3 ws probe: consumers alone", v3_with({"WS_PROBE": 1}), True),
        ("v3 ws probe: producer alone", v3_with({"WS_PROBE": 2}), True),
        ("v3 ws probe: hand-over only", v3_with({"WS_PROBE": 3}), True),
        (f"v4 auto (splits {auto4})", fused(fused_kernel="v4"), True),
        (
            f"v4 splits {max(1, auto4 // 2)}",
            fused(fused_kernel="v4", num_splits=max(1, auto4 // 2)),
            True,
        ),
        (f"v4 splits {2 * auto4}", fused(fused_kernel="v4", num_splits=2 * auto4), True),
        ("v1 (splits 1)", fused(fused_kernel="v1"), False),
        (f"v1 splits {auto}", fused(fused_kernel="v1", num_splits=auto), True),
    ]
    if short:
        paths = [p for p in paths if p[0].startswith(SHORT_PATHS)]
    if q_len > 512:  # the slow fused paths at the long chunk: the default of each only
        paths = [p for p in paths if "splits" not in p[0] or "auto" in p[0]]
        paths = [p for p in paths if p[0] not in ("v2 bn32", "v2 bn128", "v2 m64 w4", "v3 m64")]

    rows: list[dict[str, Any]] = []
    base = None
    for name, fn, graph_too in paths:
        r = bk.guarded(lambda fn=fn: {"us": bk.timed(fn, graph=False)[0]})
        fn()
        torch.cuda.synchronize()
        o = out.float().clone()
        base = o if base is None else base
        r["rel_diff"] = float((o - base).norm() / base.norm())
        r["finite"] = bool(torch.isfinite(o).all())
        if graph_too:
            r["graph_us"] = bk.guarded(lambda fn=fn: {"us": bk.timed(fn, graph=True)[0]}).get("us")
        rows.append({"path": name, **r})
        bk.log(f"{ctx}+{q_len} B={bsz} {name}: {r}")
    peers: tuple[tuple[str, Callable[[], dict[str, Any]]], ...] = (
        ("FA3 fp16", lambda: bk.bench_fa3_prefill(ctx, q_len, bsz)),
        ("FA3 fp8", lambda: bk.bench_fa3_prefill(ctx, q_len, bsz, fp8=True)),
        ("TurboQuant k3v4_nc", lambda: bk.bench_tq_prefill("turboquant_k3v4_nc", ctx, q_len, bsz)),
    )
    for name, peer in peers:
        r = bk.guarded(peer)
        rows.append({"path": name, "us": r.get("us"), "graph_us": r.get("gpu_us")})
        bk.log(f"{ctx}+{q_len} B={bsz} {name}: {r}")
    flops = bsz * 4 * bk.HQ * bk.D * (q_len * ctx + q_len * q_len / 2)
    for r in rows:
        r.update(ctx=ctx, q_len=q_len, B=bsz, gflop=flops / 1e9)
    return rows


def profile_once(
    ctx: int,
    q_len: int,
    bsz: int,
    kernel: str,
    probe: int = 0,
    settings: dict[str, int] | None = None,
) -> None:
    """Two fused calls (the first compiles), synchronized: what ``ncu --launch-skip`` and
    compute-sanitizer take. ``kernel``: ``"v2"``, ``"v3"``, ``"v3ws"`` (v3's
    warp-specialized form) or ``"v4"``; ``probe``: v3ws's ``WS_PROBE`` (0: the real kernel);
    ``settings``: other :mod:`kvarn_kernels.prefill_v3` or :mod:`kvarn_kernels.prefill_v4`
    settings for the calls."""
    import torch

    from kvarn_kernels import prefill_attention, prefill_v3, prefill_v4

    prefill_v3.V3_WARP_SPECIALIZED = kernel == "v3ws"
    prefill_v3.WS_PROBE = probe
    c = bk.prefill_case(FMT, ctx, q_len, bsz)
    args = bk.prefill_args(c)
    settings = settings or {}
    v3_settings = {k: v for k, v in settings.items() if hasattr(prefill_v3, k)}
    v4_settings = {k: v for k, v in settings.items() if k not in v3_settings}
    with module_settings(prefill_v3, v3_settings), module_settings(prefill_v4, v4_settings):
        for _ in range(2):
            prefill_attention(
                FMT, c["q"], *args, bk.D**-0.5, method="fused", fused_kernel=kernel[:2]
            )
    torch.cuda.synchronize()


def parse_setting(text: str) -> tuple[str, int]:
    """``NAME=INT`` for ``--setting``: an integer or boolean setting of
    :mod:`kvarn_kernels.prefill_v3` or :mod:`kvarn_kernels.prefill_v4` (``V3_DEQ16=0``,
    ``WS_RING=3``, ``V4_LAZY_SOFTMAX=0``)."""
    from kvarn_kernels import prefill_v3, prefill_v4

    name, sep, value = text.partition("=")
    current = getattr(prefill_v3, name, getattr(prefill_v4, name, None))
    if not sep or not isinstance(current, int) or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=INT with NAME an integer or boolean setting of"
            " prefill_v3 or prefill_v4"
        )
    return name, int(value)


def kernel_breakdown(ctx: int, q_len: int, bsz: int, calls: int = 20) -> list[dict[str, Any]]:
    """Each GPU kernel's time per call (torch.profiler) for the warp-specialized fused path,
    its hand-over-only probe, the dequantize path and FA3 fp16 at one shape: where the
    fixed part of a fused call goes (docs/kernel-notes.md, twenty-seventh session)."""
    import torch

    from kvarn_kernels import attention, prefill_attention, prefill_v3

    c = bk.prefill_case(FMT, ctx, q_len, bsz)
    args = bk.prefill_args(c)
    scale = bk.D**-0.5
    out = torch.empty_like(c["q"])
    plan = bk.prefill_plan(c)
    fa3 = bk.vllm_fa3()

    def fused(probe: int, merge_unroll: int | None = None) -> Callable[[], Any]:
        """The fused call with ``WS_PROBE = probe`` (and the merge's unroll limit)."""
        merge = {} if merge_unroll is None else {"MERGE_UNROLL_MAX_SPLITS": merge_unroll}

        def run() -> None:
            with (
                module_settings(prefill_v3, {"WS_PROBE": probe}),
                module_settings(attention, merge),
            ):
                prefill_attention(FMT, c["q"], *args, scale, out=out, method="fused")

        return run

    paths: list[tuple[str, Callable[[], Any]]] = [
        ("v3 ws", fused(0)),
        ("v3 ws probe: hand-over only", fused(3)),
        ("v3 ws probe: hand-over only, merge as a loop", fused(3, 0)),
        (
            "dequant+FA3",
            lambda: prefill_attention(
                FMT, c["q"], *args, scale, out=out, context_plan=plan, varlen_attention=fa3
            ),
        ),
        ("FA3 fp16", bk.fa3_call(bsz, q_len, ctx + q_len)),
    ]
    rows: list[dict[str, Any]] = []
    for name, fn in paths:
        prof = bk.cuda_profile(fn, calls)
        for e in prof.key_averages():
            if e.device_type.name != "CUDA" or e.count < calls:
                continue
            us = e.device_time_total / calls
            rows.append({"path": name, "kernel": e.key[:90], "us": us, "per_call": e.count / calls})
            bk.log(f"{ctx}+{q_len} B={bsz} {name}: {e.key[:70]} {us:.1f} us x{e.count // calls}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The run as a table for docs/benchmarks.md: each path's graph time (its GPU time) and
    eager time, and both as a ratio to FA3 fp16's in the same run."""
    fa3 = {(r["ctx"], r["q_len"], r["B"]): r for r in rows if r["path"] == "FA3 fp16"}
    out = [
        "| chunk | B | path | graph µs | vs FA3 (graph) | eager µs | vs FA3 (eager) | rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = fa3[(r["ctx"], r["q_len"], r["B"])]
        g, e = r.get("graph_us"), r.get("us")
        out.append(
            f"| {r['q_len']} after {r['ctx']} | {r['B']} | {r['path']} | "
            + (f"{g:,.1f} | {g / f['graph_us']:.2f}x" if g and f.get("graph_us") else "- | -")
            + " | "
            + (f"{e:,.1f} | {e / f['us']:.2f}x" if e and f.get("us") else "- | -")
            + " | "
            + (f"{r['rel_diff']:.1e}" if "rel_diff" in r else "-")
            + " |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--short", action="store_true", help=f"only the rows {SHORT_PATHS}")
    ap.add_argument(
        "--shapes", type=int, default=len(SHAPES), help="only the first N shapes of SHAPES"
    )
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="each GPU kernel's time per call at the first two shapes (torch.profiler), only",
    )
    ap.add_argument(
        "--once",
        choices=("v2", "v3", "v3ws", "v4"),
        help="two calls of this fused kernel at the first shape and nothing else (a profiler's)",
    )
    ap.add_argument(
        "--probe",
        type=int,
        default=0,
        choices=(0, 1, 2, 3),
        help="with --once v3ws: the timing probe (prefill_v3.WS_PROBE; 0: the real kernel)",
    )
    ap.add_argument("--shape", type=int, default=0, help="with --once: index into SHAPES")
    ap.add_argument(
        "--setting",
        type=parse_setting,
        action="append",
        default=[],
        metavar="NAME=INT",
        help="with --once: a prefill_v3 or prefill_v4 setting (repeatable), e.g. WS_RING=3",
    )
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.once:
        profile_once(*SHAPES[a.shape], a.once, a.probe, dict(a.setting))
        return
    if a.kernels:
        kernels = [r for shape in SHAPES[:2] for r in kernel_breakdown(*shape)]
        (a.out / "prefill_kernels.json").write_text(json.dumps(kernels, indent=1))
        return
    rows: list[dict[str, Any]] = []
    for shape in SHAPES[: a.shapes]:
        rows += run_shape(*shape, short=a.short)
        (a.out / "prefill_v2_ab.json").write_text(json.dumps(rows, indent=1))
    (a.out / "prefill_fused.md").write_text(markdown(rows))
    fa3 = {(r["ctx"], r["q_len"], r["B"]): r for r in rows if r["path"] == "FA3 fp16"}
    print(
        f"{'shape':22s} {'path':22s} {'eager us':>9s} {'graph us':>9s} {'/FA3 e':>7s} "
        f"{'/FA3 g':>7s} {'rel diff':>9s}"
    )
    for r in rows:
        f = fa3[(r["ctx"], r["q_len"], r["B"])]
        us, gus = r.get("us"), r.get("graph_us")
        re_ = f"{us / f['us']:.2f}" if us and f.get("us") else "-"
        rg = f"{gus / f['graph_us']:.2f}" if gus and f.get("graph_us") else "-"
        print(
            f"{r['q_len']}@{r['ctx']} B={r['B']:<3d}      {r['path']:22s} "
            f"{us or float('nan'):9.1f} {gus or float('nan'):9.1f} {re_:>7s} {rg:>7s} "
            f"{r.get('rel_diff', float('nan')):9.2e}"
        )


if __name__ == "__main__":
    main()
