"""tools/gpu_memcheck.py launches every store and decode variant the kernels offer.

The script runs under compute-sanitizer on the GPU machine, where a stale variant name would
cost a device call; here it runs on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_memcheck_script_launches_all_variants_on_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_memcheck.py"), "--device", "cpu", "--small"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from kvarn_kernels.attention import DECODE_VARIANTS, GPU_ONLY_DECODE_VARIANTS
    from kvarn_kernels.store import STORE_VARIANTS

    lines = proc.stdout.splitlines()
    assert lines == [
        line
        for shadow in (0, 27)  # kvarn_k4v2_g128 at head dim 128: 13,824 // 512
        for line in (
            *(
                f"decode {v}, shadow rows {shadow}: launched, output finite: True"
                for v in DECODE_VARIANTS
                if v not in GPU_ONLY_DECODE_VARIANTS  # Gluon: no interpreter
            ),
            *(f"store {v}, shadow rows {shadow}: launched" for v in STORE_VARIANTS),
        )
    ]
