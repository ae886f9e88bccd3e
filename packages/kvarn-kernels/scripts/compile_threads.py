"""Do Triton compiles overlap on threads? Time four decode-kernel compiles for sm_90a (no GPU
needed) in order and from a thread pool, each run in a fresh Triton cache.

The warm-up (:mod:`kvarn_kernels.warmup`) launches from threads on the premise that Triton
releases the GIL in its long compile passes; this checks the premise on the machine at hand.

    uv run python packages/kvarn-kernels/scripts/compile_threads.py [--threads N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SPLITS = (1, 2, 4, 8)  # a compile-time constant: four distinct compiles


def compile_decode(splits: int) -> None:
    import static_variants

    static_variants._decode_v4("kvarn_k4v2_g128", round7=True, splits=splits)


def child(threads: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import static_variants  # noqa: F401  (imports outside the timed part)

    import kvarn_kernels.decode_v4  # noqa: F401

    start = time.perf_counter()
    if threads <= 1:
        for n in SPLITS:
            compile_decode(n)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(compile_decode, SPLITS))
    print(f"{time.perf_counter() - start:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    times = {}
    for threads in (1, min(args.threads, len(SPLITS))):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            env.pop("TRITON_INTERPRET", None)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(threads)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            times[threads] = float(out.split()[-1])
    (one, many), (t1, tn) = times.keys(), times.values()
    print(
        f"{len(SPLITS)} compiles: {one} thread {t1:.2f} s, {many} threads {tn:.2f} s "
        f"({t1 / tn:.2f}x, {os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
