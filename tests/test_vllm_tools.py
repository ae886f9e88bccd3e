"""The GPU scripts' host-side logic (no GPU): comparisons, log parsing, tables, docs section."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def e2e(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("gpu_e2e")


@pytest.fixture(scope="module")
def bench(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("bench_serving")


def test_agreement_counts_matches_and_common_prefixes(e2e: ModuleType) -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[1, 2, 9, 4], [5, 6, 7, 8]]
    got = e2e.agreement(a, b)
    assert got == {"token_match": 0.875, "mean_common_prefix": 3.0, "exact_sequences": 1}


def test_dtype_specs_and_labels(e2e: ModuleType) -> None:
    assert e2e.parse_dtype("fp8:bfloat16", "float16") == ("fp8", "bfloat16")
    assert e2e.parse_dtype("kvarn_k4v2_g128", "float16") == ("kvarn_k4v2_g128", "float16")
    assert e2e.row_label("fp8", "bfloat16", "default", "float16") == "fp8:bfloat16"
    assert e2e.row_label("kvarn_k4v2_g128", "float16", "v1", "float16") == "kvarn_k4v2_g128@v1"
    assert e2e.row_label("auto", "float16", "default", "float16", 3) == "auto+ngram3"
    assert e2e.child_env("default", eager_verify=True)["KVARN_VERIFY_CUDA_GRAPHS"] == "0"
    assert e2e.child_env("v1")["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_speculative_config_is_a_valid_vllm_ngram_gpu_config(e2e: ModuleType) -> None:
    """The drafter settings gpu_e2e passes to LLM(...) build vLLM's own SpeculativeConfig."""
    from vllm.config import SpeculativeConfig

    assert e2e.speculative_config(0) is None
    cfg = SpeculativeConfig(**e2e.speculative_config(3))
    assert cfg.method == "ngram_gpu" and cfg.num_speculative_tokens == 3


def test_log_facts(e2e: ModuleType) -> None:
    text = "\n".join(
        [
            "INFO [kv_cache_utils.py:1744] GPU KV cache size: 3,456,789 tokens",
            "INFO kvarn: worker 0 KV cache capacity 3,456,768 tokens with kvarn_k4v2_g128 "
            "(27006 blocks of 128 tokens; 4.37x an fp16 cache in the same memory); side pool",
            "INFO [gpu_model_runner.py:6700] Graph capturing finished in 12 secs, took 0.5 GiB",
        ]
    )
    facts = e2e.log_facts(text)
    assert facts["vllm_kv_tokens_log"] == 3_456_789
    assert facts["kvarn_kv_tokens_log"] == 3_456_768
    assert facts["kvarn_ratio_vs_fp16_same_memory"] == 4.37
    assert facts["cuda_graphs_captured"] is True
    assert e2e.log_facts("nothing here")["cuda_graphs_captured"] is False


def test_peer_rows_may_pin_an_attention_backend_kvarn_rows_never(
    e2e: ModuleType, tmp_path: Path
) -> None:
    args = e2e.build_parser().parse_args(["--peer-attention-backend", "TRITON_ATTN"])
    peer = e2e.engine_kwargs(args, "auto", "float16", tmp_path)
    kvarn = e2e.engine_kwargs(args, "kvarn_k4v2_g128", "float16", tmp_path)
    assert peer["attention_backend"] == "TRITON_ATTN"
    assert "attention_backend" not in kvarn and kvarn["kv_cache_dtype"] == "kvarn_k4v2_g128"
    default = e2e.build_parser().parse_args([])
    assert "attention_backend" not in e2e.engine_kwargs(default, "auto", "float16", tmp_path)


def test_error_tail_leads_with_the_engine_cores_exception(e2e: ModuleType) -> None:
    log = "\n".join(
        [
            "(EngineCore pid=1) INFO 11-30 17:32:50 [runtime.py:231] kvarn: compiled",
            '(EngineCore pid=1) ERROR 11-30 17:32:56 [core.py:1195]   File "x.py", line 15',
            "(EngineCore pid=1) ERROR 11-30 17:32:56 [core.py:1195] ModuleNotFoundError: No "
            "module named 'cutlass'",
            "Traceback (most recent call last):",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    out = e2e.error_tail(log, lines=2)
    assert out.splitlines() == [
        "root cause: ModuleNotFoundError: No module named 'cutlass'",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    # no engine exception: the tail alone, as before
    assert e2e.error_tail("a\nValueError: bad\nb", lines=5) == "a\nValueError: bad"


def test_summary_table_reports_errors_as_rows(e2e: ModuleType) -> None:
    base = {
        "label": "auto",
        "status": "ok",
        "kv_tokens": 100,
        "tokens": [[1, 2]],
        "rerun_tokens": [[3, 4]],
        "non_finite_logprobs": 0,
        "cuda_graphs_captured": True,
        "startup_s": 30.0,
        "generate_s": 1.5,
    }
    kv = {**base, "label": "kvarn_k4v2_g128", "kv_tokens": 400, "tokens": [[1, 5]]}
    bad = {"label": "turboquant_k8v4", "status": "error rc=1"}
    table = e2e.summarize([base, kv, bad], "auto")
    assert "| kvarn_k4v2_g128 | ok | 400 | 4.00 | 0.500 |" in table
    assert "| turboquant_k8v4 | error rc=1 |" in table
    assert table.splitlines()[2].endswith("| 30.0 | 1.5 |")  # start-up and generate seconds
    compiled = {**kv, "jit_compiles_while_serving": ["_attn_kernel"]}
    table = e2e.summarize([base, compiled], "auto")
    assert table.splitlines()[3].endswith("| 1.5 (1 Triton compiles: _attn_kernel) |")
    # with drafts every row is labelled +ngramN; "auto" then means "auto+ngram3"
    drafted = [{**r, "label": r["label"] + "+ngram3"} for r in (base, kv)]
    table = e2e.summarize(drafted, "auto")
    assert "| kvarn_k4v2_g128+ngram3 | ok | 400 | 4.00 | 0.500 |" in table


def test_model_dir_falls_back_to_the_embedded_qwen3_8b(e2e: ModuleType, tmp_path: Path) -> None:
    found = e2e.resolve_model_dir(None)
    cfg = json.loads((found / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 36 and cfg["num_key_value_heads"] == 8
    with pytest.raises(SystemExit):
        e2e.resolve_model_dir(str(tmp_path / "missing"))


def test_embedded_model_dir_is_the_same_path_in_every_process(
    e2e: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No shared/ beside this checkout (as on the device): the embedded config is written to
    # a folder named by its digest, so vLLM's compile cache (keyed by the model path) hits.
    monkeypatch.setattr(e2e, "ROOT", tmp_path / "checkout" / "repo")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    first = e2e.resolve_model_dir(None)
    assert first.parent == tmp_path / "tmp" and first.name.startswith("kvarn-qwen3-8b-")
    (first / "config.json").write_text("{}")  # a damaged copy is rewritten, not trusted
    second = e2e.resolve_model_dir(None)
    assert second == first
    assert json.loads((second / "config.json").read_text()) == e2e.QWEN3_8B
    assert sorted(p.name for p in second.iterdir()) == ["config.json"]


def test_bench_docs_section_replaces_only_its_own_section(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\nkeep me\n")
    monkeypatch.setattr(bench, "DOCS", docs)
    rows = [
        {
            "label": "auto",
            "status": "ok",
            "kv_tokens": 791_792,
            "total_tok_s": 21_951.0,
            "output_tok_s": 1_500.0,
            "elapsed_s": 77.6,
            "requests": 256,
        },
        {
            "label": "kvarn_k4v2_g128",
            "status": "ok",
            "kv_tokens": 3_300_000,
            "total_tok_s": 23_000.0,
            "output_tok_s": 1_600.0,
            "elapsed_s": 74.0,
            "requests": 256,
        },
        {"label": "fp8:bfloat16", "status": "timeout", "error": "boom"},
    ]
    meta = {
        "gpu": "NVIDIA H200",
        "date": "2026-11-30",
        "prompt_len": 6144,
        "output_len": 512,
        "max_model_len": 16384,
        "max_num_seqs": 256,
        "gpu_mem_util": 0.9,
        "tp": 1,
        "commands": [
            "python3 tools/bench_serving.py --dtypes auto",
            "python3 tools/bench_serving.py --dtypes fp8:bfloat16",
            "python3 tools/bench_serving.py --dtypes auto",
        ],
    }
    bench.write_docs(bench.section(rows, meta, "auto"))
    first = docs.read_text()
    # a run split over calls lists its commands once each, in the order they ran
    assert first.index("--dtypes auto\n") < first.index("--dtypes fp8:bfloat16\n")
    assert first.count("--dtypes auto\n") == 1
    assert "keep me" in first and first.count(bench.START) == 1
    assert "| kvarn_k4v2_g128 | 3,300,000 | 4.17 | 23,000 | 1.05 |" in first
    assert "| fp8:bfloat16 | | | | | | | timeout: boom |" in first
    bench.write_docs(bench.section(rows[:1], meta, "auto"))
    second = docs.read_text()
    assert second.count(bench.START) == 1 and "keep me" in second
    assert "kvarn_k4v2_g128" not in second


def test_report_reads_a_fetched_results_file(
    bench: ModuleType, e2e: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device run leaves results.json; --report --write-docs rebuilds the section here."""
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    row = {
        "label": "auto",
        "status": "ok",
        "kv_tokens": 10,
        "total_tok_s": 5.0,
        "output_tok_s": 1.0,
        "elapsed_s": 2.0,
        "requests": 4,
        "order": 1,
    }
    meta = {
        "gpu": "NVIDIA H200",
        "prompt_len": 64,
        "output_len": 8,
        "commands": ["python3 tools/bench_serving.py --dtypes auto --out /tmp/bench"],
    }
    (fetched / "results.json").write_text(json.dumps({"meta": meta, "rows": [row]}))
    assert e2e.load_rows(fetched) == [row]
    # a fetch that kept some row files: results.json's other rows stay, a row file wins
    late = {**row, "label": "kvarn_k4v2_g128", "total_tok_s": 7.0, "order": 2}
    (fetched / "results.json").write_text(json.dumps({"meta": meta, "rows": [row, late]}))
    newer = {**row, "total_tok_s": 6.0}
    (fetched / "row_auto.json").write_text(json.dumps(newer))
    assert e2e.load_rows(fetched) == [newer, late]
    (fetched / "row_auto.json").unlink()
    (fetched / "results.json").write_text(json.dumps({"meta": meta, "rows": [row]}))
    docs = tmp_path / "benchmarks.md"
    monkeypatch.setattr(bench, "DOCS", docs)
    assert bench.main(["--report", "--out", str(fetched), "--write-docs"]) == 0
    text = docs.read_text()
    assert "NVIDIA H200" in text and "--dtypes auto --out /tmp/bench" in text
    assert "| auto | 10 | 1.00 | 5 | 1.00 |" in text


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("how", ["sigterm", "timeout", "exit"])
def test_run_child_leaves_no_engine_process_behind(tmp_path: Path, how: str) -> None:
    """An engine and the process it spawned (EngineCore, workers) are gone when the script is
    killed by ``timeout`` while it waits (the ninth session's leftover engine freed its GPU
    memory during the next engine's profiling), when the per-engine timeout fires, and when
    the engine exits leaving a straggler."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tools = Path(__file__).resolve().parents[1] / "tools"
    pids = tmp_path / "pids"
    engine = (
        "import os, subprocess, sys, time\n"
        "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{core.pid}}')\n"
        f"time.sleep({0 if how == 'exit' else 120})\n"
    )
    timeout = 8 if how == "timeout" else 60  # time enough to start both processes
    parent = (
        f"import sys; sys.path.insert(0, {str(tools)!r})\n"
        "from pathlib import Path\n"
        "import gpu_e2e\n"
        "gpu_e2e.exit_on_sigterm()\n"
        f"rc, _ = gpu_e2e.run_child([sys.executable, '-c', {engine!r}], {{}}, "
        f"Path({str(tmp_path / 'log.txt')!r}), {timeout})\n"
        "print('rc', rc)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pids.is_file() and pids.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    engine_pid, core_pid = (int(p) for p in pids.read_text().split())
    if how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    if how == "sigterm":
        assert proc.returncode == 128 + signal.SIGTERM
    else:
        assert f"rc {124 if how == 'timeout' else 0}" in out
    deadline = time.monotonic() + 5
    while (_alive(engine_pid) or _alive(core_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(engine_pid) and not _alive(core_pid)
