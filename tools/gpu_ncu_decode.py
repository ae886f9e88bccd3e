"""One decode-attention case for Nsight Compute: why is decode v4 at a quarter of the bandwidth?

Launches ``decode_attention`` on the benchmark's case (Qwen3-8B layer geometry: 32 query and
8 KV heads, head_dim 128; ``--batch`` requests of ``--ctx`` tokens) exactly twice: the first
launch compiles and warms up, the second is the one to profile. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src \\
    ncu --clock-control none --kernel-name regex:decode_v4 --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 tools/gpu_ncu_decode.py > $OUT/ncu_v4.txt

(``--clock-control none``: leave the clocks as they are, as the device notes ask.) Without
ncu it prints the two launches' times, which is a quick check that the case runs.

The sections above say *that* v4 is latency-bound (fifth session: 0.45 instructions issued
per scheduler cycle, 0.58 eligible of ~2 resident warps); the stall reasons say on *what*.
The text report does not print WarpStateStats' breakdown, so ask for the per-reason metrics
(cycles per issued instruction spent in each stall) and the source-level sampling::

    ncu --clock-control none --kernel-name regex:decode_v4 --launch-skip 1 --launch-count 1 \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
        --section SourceCounters python3 tools/gpu_ncu_decode.py > $OUT/ncu_stalls.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels as bk  # tools/ is not a package


def main(argv: list[str] | None = None) -> int:
    from kvarn_kernels.attention import DECODE_VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--variant", default="auto", choices=["auto", *DECODE_VARIANTS])
    ap.add_argument("--num-warps", type=int, help="v5 only: warps per program")
    ap.add_argument("--num-stages", type=int, help="v5 only: copy pipeline depth")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_ncu_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    inp = bk.decode_inputs(args.format, args.batch, args.ctx)
    kw: dict[str, object] = {"variant": args.variant}
    if args.num_warps is not None:
        kw["num_warps"] = args.num_warps
    if args.num_stages is not None:
        kw["num_stages"] = args.num_stages
    for launch in ("compile + warm-up", "profiled"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        bk.decode_once(inp, **kw)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        print(f"{launch}: {ms:.2f} ms (host-timed, includes launch overhead)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
