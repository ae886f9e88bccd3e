"""Where the host time of an eager prefill-with-context call goes (GPU only, vLLM's FA3
importable): the plugin's planned dequantize-then-FA3 path and the fused kernel at the
bench's short chunk (64 tokens after 16,320, B = 1), each run many times without a sync under
``cProfile``; prints the per-call host microseconds of the top functions and writes the full
statistics to ``--out`` (docs/kernel-notes.md, twenty-fourth session)::

    source .gpu/env.sh && PYTHONPATH=$PYTHONPATH:tools \\
        python3 packages/kvarn-kernels/scripts/prefill_host_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH

FMT = "kvarn_k4v2_g128"
CALLS = 300


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    import torch

    from kvarn_kernels import prefill_attention
    from kvarn_kernels.rotation import rotate_into

    c = bk.prefill_case(FMT, 16320, 64, 1)
    args = bk.prefill_args(c)
    scale = bk.D**-0.5
    out = torch.empty_like(c["q"])
    plan = bk.prefill_plan(c)
    fa3 = bk.vllm_fa3()
    t, hq, d = (int(s) for s in c["q"].shape)
    q16 = torch.empty((t, hq, d), dtype=torch.float16, device="cuda")
    paths: dict[str, Callable[[], Any]] = {
        "planned dequant+FA3": lambda: prefill_attention(
            FMT, c["q"], *args, scale, out=out, context_plan=plan, varlen_attention=fa3
        ),
        "fused v2": lambda: prefill_attention(
            FMT, c["q"], *args, scale, out=out, method="fused", fused_kernel="v2"
        ),
        "fused v3": lambda: prefill_attention(
            FMT, c["q"], *args, scale, out=out, method="fused", fused_kernel="v3"
        ),
        "rotate_into alone": lambda: rotate_into(
            c["q"].view(t * hq, d), q16.view(t * hq, d), scale
        ),
    }
    lines = components(c, args, plan, fa3, out)
    for name, fn in paths.items():
        us = bk.host_us(fn, CALLS)
        lines.append(f"{name:24s} {us:8.1f} µs host per call")
        prof = cProfile.Profile()
        fn()
        torch.cuda.synchronize()
        prof.enable()
        for i in range(CALLS):
            fn()
            if i % 20 == 19:
                torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
        st.print_stats(25)
        (a.out / f"host_{name.split()[0]}_{name.split()[1]}.txt").write_text(buf.getvalue())
        # the top functions by own time, µs per call
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]  # type: ignore[attr-defined]
        for (file, line, func), (_cc, nc, tt, ct, _callers) in rows:
            lines.append(
                f"    {1e6 * tt / CALLS:7.1f} own {1e6 * ct / CALLS:7.1f} cum µs/call "
                f"{nc / CALLS:5.1f}x {func} ({Path(file).name}:{line})"
            )
    text = "\n".join(lines)
    (a.out / "host_profile.txt").write_text(text)
    print(text)


def components(
    c: dict[str, Any], args: tuple[Any, ...], plan: Any, fa3: Any, out: Any
) -> list[str]:
    """Host µs per call of the planned dequantize path's parts, each alone (no profiler)."""
    import torch
    from triton.runtime import driver
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from kvarn_kernels import attention as att
    from kvarn_kernels import context as ctx
    from kvarn_kernels._launch import _tail
    from kvarn_kernels.rotation import _rotate_rows_kernel, rotate_into, sign_matrix

    q = c["q"]
    t, hq, d = (int(s) for s in q.shape)
    geo = att._check_varlen(FMT, q, *args, out)[0]
    grp = plan.groups[0]
    q16 = torch.empty((t, hq, d), dtype=torch.float16, device="cuda")
    ws_k = torch.empty((grp.rows, bk.HK, d), dtype=torch.float16, device="cuda")
    ws_v = torch.empty_like(ws_k)
    cu = grp.cu_seqlens
    assert cu is not None and grp.blocks is not None
    kv, pool_k, pool_v, bt, _qsl, _seqs, b2s = args
    x, y = q.view(t * hq, d), q16.view(t * hq, d)
    s = sign_matrix(d, q.device, q.dtype)
    rot_args = (x, y, s, s, s, s, t * hq, x.stride(0), 0, 0.1)
    rot_const = dict(
        HK=1,
        D=d,
        G=1,
        SHADOW=0,
        STRIDE=0,
        IS_V=False,
        BLOCK_R=32,
        BLOCK_C=128,
        OUT_F32=False,
        OUT_BF16=False,
        SCATTER=False,
        IEEE=False,
    )
    grid = (-(-t * hq // 32),)
    ck = _rotate_rows_kernel[grid](*rot_args, **rot_const, num_warps=4)
    tail = _tail(_rotate_rows_kernel, len(rot_args), rot_const)
    assert tail is not None
    values = (*rot_args, *tail)
    dev = torch.cuda.current_device()

    def direct() -> None:
        stream = driver.active.get_current_stream(dev)
        ck.run(grid[0], 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *values)

    parts: dict[str, Callable[[], Any]] = {
        "_check_varlen": lambda: att._check_varlen(FMT, q, *args, out),
        "plan.check_call": lambda: plan.check_call(geo.group, bk.HK, d, q, bt),
        "torch.empty (one workspace)": lambda: torch.empty_like(ws_k),
        "rotate_into (q)": lambda: rotate_into(x, y, 0.1),
        "rotate kernel[grid](...)": lambda: _rotate_rows_kernel[grid](
            *rot_args, **rot_const, num_warps=4
        ),
        "rotate compiled.run (direct)": direct,
        "dequant_context_into": lambda: ctx.dequant_context_into(
            geo, kv, pool_k, pool_v, bt, b2s, grp.blocks, ws_k, ws_v
        ),
        "FA3 through the adapter": lambda: ctx._attend_external(
            fa3, q16, ws_k, ws_v, cu[0], cu[1], grp.max_query_len, grp.max_context_len
        ),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(
            q=q16,
            k=ws_k,
            v=ws_v,
            cu_seqlens_q=cu[0],
            cu_seqlens_k=cu[1],
            max_seqlen_q=grp.max_query_len,
            max_seqlen_k=grp.max_context_len,
            softmax_scale=2.0,
            causal=True,
            fa_version=3,
        ),
    }
    lines = ["parts of the planned dequantize path, each alone:"]
    for name, fn in parts.items():
        lines.append(f"  {name:32s} {bk.host_us(fn, CALLS):8.1f} µs host per call")
    return lines


if __name__ == "__main__":
    main()
