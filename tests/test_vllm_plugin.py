"""kvarn-vllm as vLLM sees it: the installed entry point, loaded by vLLM's own plugin loader.

Runs in a fresh interpreter so that nothing this test session patched or imported leaks in:
vLLM's ``load_general_plugins`` must find ``kvarn`` in the ``vllm.general_plugins`` group of
the installed distribution and, through it, admit the KVarN dtypes and pin the block size.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

SNIPPET = r"""
import json, sys, typing
from kvarn_vllm.testing import prepare_cpu_test_env, write_model_dir, TINY_QWEN3
prepare_cpu_test_env()
from pathlib import Path
import vllm.config.cache as cache_mod
before = [d for d in typing.get_args(cache_mod.CacheDType) if d.startswith("kvarn")]
from vllm.plugins import load_general_plugins
load_general_plugins()
after = [d for d in typing.get_args(cache_mod.CacheDType) if d.startswith("kvarn")]
from vllm.engine.arg_utils import EngineArgs
model = write_model_dir(Path(sys.argv[1]), TINY_QWEN3)
cfg = EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                 kv_cache_dtype="kvarn_k4v2_g64", max_model_len=512).create_engine_config()
print("RESULT " + json.dumps({"before": before, "after": after,
                              "block_size": cfg.cache_config.block_size,
                              "dtype": cfg.cache_config.cache_dtype}))
"""


def test_entry_point_is_declared() -> None:
    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert "kvarn" in eps, "kvarn-vllm is not installed with its vllm.general_plugins entry point"
    assert eps["kvarn"].value == "kvarn_vllm.plugin:register"
    from kvarn_vllm.plugin import register

    assert eps["kvarn"].load() is register


@pytest.mark.slow
def test_vllm_loads_the_plugin_in_a_fresh_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "VLLM_PLUGINS": "kvarn"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["before"] == [], "importing vLLM alone must not admit kvarn dtypes"
    assert "kvarn_k4v2_g128" in result["after"]
    assert result["dtype"] == "kvarn_k4v2_g64" and result["block_size"] == 64
