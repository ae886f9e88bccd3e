"""GPU only: a small end-to-end run of tools/gpu_e2e.py (fp16 and kvarn_k4v2_g128).

Needs a CUDA GPU with the vLLM 0.23 bundle (see ../shared/docs/gpu.md); skipped elsewhere.
It checks what must hold whatever the (dummy) weights: both engines start and serve, no
logprob is NaN/inf, CUDA graphs were captured, and KVarN holds at least 3x fp16's tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_e2e_small(tmp_path: Path) -> None:
    out = tmp_path / "e2e"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_e2e.py"),
            "--dtypes",
            "auto,kvarn_k4v2_g128",
            "--num-prompts",
            "4",
            "--prompt-lens",
            "300,2500",
            "--max-tokens",
            "16",
            "--require-graphs",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {
        json.loads(f.read_text())["label"]: json.loads(f.read_text())
        for f in out.glob("row_*.json")
    }
    fp16, kvarn = rows["auto"], rows["kvarn_k4v2_g128"]
    assert kvarn["non_finite_logprobs"] == 0
    assert kvarn["cuda_graphs_captured"]
    assert kvarn["kv_tokens"] >= 3 * fp16["kv_tokens"]
