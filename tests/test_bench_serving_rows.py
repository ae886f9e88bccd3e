"""bench_serving's rows: what an engine process's exit code and result file make of a row."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bs(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("bench_serving")


RESULT = {
    "cache_dtype": "auto",
    "kv_tokens": 791792,
    "total_tok_s": 21591.8,
    "output_tok_s": 1660.9,
    "elapsed_s": 78.92,
}


def _row(bs: ModuleType, tmp_path: Path, rc: int, *, with_result: bool) -> dict[str, object]:
    child_out = tmp_path / "child_auto.json"
    if with_result:
        child_out.write_text(json.dumps(RESULT))
    row: dict[str, object] = {"label": "auto"}
    row.update(bs.child_outcome(rc, child_out, "Traceback ...\nRuntimeError: boom\n"))
    return row


def test_a_clean_exit_with_a_result_is_ok(bs: ModuleType, tmp_path: Path) -> None:
    row = _row(bs, tmp_path, 0, with_result=True)
    assert row["status"] == "ok" and row["total_tok_s"] == 21591.8
    assert "killed_after_timed_run" not in row


def test_a_timeout_after_the_timed_run_keeps_the_measurement(
    bs: ModuleType, tmp_path: Path
) -> None:
    row = _row(bs, tmp_path, 124, with_result=True)
    assert row["status"] == "ok" and row["killed_after_timed_run"] is True
    text = bs.table([row], "auto")
    assert "21,592" in text and "killed at --timeout in engine teardown" in text


@pytest.mark.parametrize(("rc", "status"), [(124, "timeout"), (1, "error rc=1")])
def test_no_result_file_is_a_failed_row(
    bs: ModuleType, tmp_path: Path, rc: int, status: str
) -> None:
    row = _row(bs, tmp_path, rc, with_result=False)
    assert row["status"] == status and "boom" in str(row["error"])
    assert "| auto | | |" in bs.table([row], "auto")


def test_a_crash_after_writing_the_result_is_not_ok(bs: ModuleType, tmp_path: Path) -> None:
    """A non-zero exit other than the timeout (e.g. a crash at exit) is not trusted."""
    assert _row(bs, tmp_path, 1, with_result=True)["status"] == "error rc=1"


# ---------------------------------------------------------------------------------------------
# the agent workload


def test_agent_turns_grow_each_conversation_and_count_cache_hits(bs: ModuleType) -> None:
    """Every turn's prompt is the previous turn's prompt plus its output plus a new tool
    result; token counts and the hit share come from what ``generate`` reports."""
    import random

    seen: list[list[list[int]]] = []

    def generate(batch: list[list[int]]) -> list[tuple[list[int], int]]:
        seen.append(batch)
        # a perfect prefix cache: everything but this turn's tool tokens was cached
        previous = seen[-2] if len(seen) > 1 else None
        hits = [len(p) + 3 if previous else 0 for p in (previous or batch)]
        return [([7, 8, 9], h) for h in hits]

    prefixes = [[1] * 10, [2] * 20]
    got = bs.run_agent_turns(generate, prefixes, 3, 5, random.Random(0), 1000)
    assert [len(p) for p in seen[0]] == [15, 25]
    for before, after in itertools.pairwise(seen):
        for p, q in zip(before, after, strict=True):
            assert q[: len(p) + 3] == [*p, 7, 8, 9] and len(q) == len(p) + 3 + 5
    assert got["prompt_tokens"] == (15 + 25) + (23 + 33) + (31 + 41)
    assert got["generated_tokens"] == 3 * 2 * 3
    assert got["cached_tokens"] == (18 + 28) + (26 + 36)
    assert got["prefix_cache_hit"] == round(got["cached_tokens"] / got["prompt_tokens"], 4)
    assert len(got["turn_s"]) == 3 and prefixes == [[1] * 10, [2] * 20]  # inputs untouched


def test_agent_rows_go_to_their_own_docs_section(
    bs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- serving:start -->\nburst table\n<!-- serving:end -->\n")
    monkeypatch.setattr(bs, "DOCS", docs)
    row = {
        "label": "kvarn_k4v2_g128",
        "status": "ok",
        **RESULT,
        "prefix_cache_hit": 0.8123,
        "workload": "agents",
    }
    meta = {"workload": "agents", "num_prompts": 256, "prompt_len": 4096, "turns": 4}
    text = bs.section([row], meta, "auto")
    assert text.startswith("<!-- agents:start -->") and "agent workload" in text
    assert "prefix-cache hits 81%" in text
    bs.write_docs(text, "agents")
    bs.write_docs(text.replace("81%", "82%"), "agents")  # replaced, not appended twice
    new = docs.read_text()
    assert "burst table" in new and new.count("<!-- agents:start -->") == 1 and "82%" in new


def test_length_defaults_follow_the_workload(
    bs: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: dict[str, object] = {}

    def fake_parent(args: object) -> int:
        got.update(vars(args))
        return 0

    monkeypatch.setattr(bs, "parent_main", fake_parent)
    bs.main(["--workload", "agents"])
    assert (got["prompt_len"], got["output_len"], got["turns"]) == (4096, 128, 4)
    bs.main([])
    assert (got["prompt_len"], got["output_len"]) == (6144, 512)
    bs.main(["--workload", "agents", "--prompt-len", "1000"])
    assert got["prompt_len"] == 1000


def _fake_engines(
    bs: ModuleType, monkeypatch: pytest.MonkeyPatch, run_child: Callable[..., tuple[int, str]]
) -> None:
    """bench_serving's parent with ``run_child`` in place of engine processes, on no GPU."""
    monkeypatch.setattr(bs.common, "run_child", run_child)
    monkeypatch.setattr(bs.common, "check_plugin_entry_point", lambda: None)
    monkeypatch.setattr(bs.common, "gpu_name", lambda: "test")


def test_the_first_engine_gets_more_time_and_candidate_kernels_their_own_rows(
    bs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first engine process of a call gets ``--timeout + 120`` s (or ``--first-timeout``):
    on a fresh machine it also fills vLLM's and FlashInfer's caches. With
    ``KVARN_DECODE_VARIANT`` set, KVarN rows name the decode kernel they ran, and with
    ``KVARN_PREFILL_CONTEXT`` the continuation chunks' method."""
    limits: list[float] = []

    def fake_run_child(cmd: list[str], env: object, log: Path, limit: float) -> tuple[int, str]:
        limits.append(limit)
        return 1, "Traceback ...\nRuntimeError: no GPU here\n"

    _fake_engines(bs, monkeypatch, fake_run_child)
    monkeypatch.setenv("KVARN_DECODE_VARIANT", "v5")
    out = tmp_path / "bs"
    argv = ["--dtypes", "auto,kvarn_k4v2_g128", "--timeout", "100", "--out", str(out)]
    bs.main(argv)
    assert limits == [220, 100]
    labels = sorted(json.loads(p.read_text())["label"] for p in out.glob("row_*.json"))
    assert labels == ["auto", "kvarn_k4v2_g128[decode v5]"]
    bs.main([*argv, "--first-timeout", "300"])
    assert limits[2:] == [300, 100]
    # and the continuation chunks' method, when not the default
    monkeypatch.delenv("KVARN_DECODE_VARIANT")
    monkeypatch.setenv("KVARN_PREFILL_CONTEXT", "fused")
    out2 = tmp_path / "bs2"
    bs.main(["--dtypes", "auto,kvarn_k4v2_g128", "--timeout", "100", "--out", str(out2)])
    labels = sorted(json.loads(p.read_text())["label"] for p in out2.glob("row_*.json"))
    assert labels == ["auto", "kvarn_k4v2_g128[context fused]"]


def test_resume_skips_the_rows_already_measured(
    bs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--resume`` re-issues a cut-short call unchanged: dtypes with an ``ok`` row in
    ``--out`` are skipped, a failed one runs again, and the first engine it starts still
    gets the first engine's time."""
    started: list[tuple[str, float]] = []

    def fake_run_child(cmd: list[str], env: object, log: Path, limit: float) -> tuple[int, str]:
        dtype = cmd[cmd.index("--child-dtype") + 1]
        started.append((dtype, limit))
        out_file = Path(cmd[cmd.index("--child-out") + 1])
        if dtype != "turboquant_k3v4_nc":  # that one fails, as a timeout would
            out_file.write_text(json.dumps({**RESULT, "cache_dtype": dtype}))
            return 0, "ok"
        return 1, "Traceback ...\nRuntimeError: timed out\n"

    _fake_engines(bs, monkeypatch, fake_run_child)
    monkeypatch.delenv("KVARN_DECODE_VARIANT", raising=False)
    out = tmp_path / "bs"
    argv = ["--dtypes", "auto,turboquant_k3v4_nc,kvarn_k4v2_g128", "--timeout", "100"]
    argv += ["--out", str(out)]
    bs.main(argv)
    assert [d for d, _ in started] == ["auto", "turboquant_k3v4_nc", "kvarn_k4v2_g128"]
    started.clear()
    bs.main([*argv, "--resume"])
    assert started == [("turboquant_k3v4_nc", 220)]
    started.clear()
    bs.main(argv)  # without --resume every row runs again
    assert len(started) == 3


def test_warm_only_rows_fill_caches_and_never_pass_for_measurements(
    bs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--warm-only`` passes the flag to every engine; a row whose result says it only warmed
    is ``warmed``: a warm-only ``--resume`` skips it, a measuring run does not, and
    ``--write-docs`` refuses to publish it."""
    flags: list[bool] = []

    def fake_run_child(cmd: list[str], env: object, log: Path, limit: float) -> tuple[int, str]:
        flags.append("--warm-only" in cmd)
        dtype = cmd[cmd.index("--child-dtype") + 1]
        warmed = {"cache_dtype": dtype, "kv_tokens": 3503872, "startup_s": 95.0}
        fields = {**warmed, "warmup_s": 12.5, "warm_only": True} if flags[-1] else RESULT
        Path(cmd[cmd.index("--child-out") + 1]).write_text(json.dumps(fields))
        return 0, "ok"

    _fake_engines(bs, monkeypatch, fake_run_child)
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    monkeypatch.setattr(bs, "DOCS", docs)
    out = tmp_path / "bs"
    argv = ["--dtypes", "kvarn_k4v2_g128", "--out", str(out), "--resume"]
    assert bs.main([*argv, "--warm-only"]) == 0
    row = json.loads((out / "row_kvarn_k4v2_g128.json").read_text())
    assert row["status"] == "warmed" and flags == [True]
    text = bs.table([row], "auto")
    assert "warmed (--warm-only, no timed run): start-up 95.0 s, warm-up 12.5 s" in text
    assert bs.main([*argv, "--warm-only", "--write-docs"]) == 1  # skipped, then refused
    assert flags == [True] and docs.read_text() == "# Benchmarks\n"
    assert bs.main(argv) == 0  # a measuring run does not take the warmed row for its own
    assert flags == [True, False]
    assert json.loads((out / "row_kvarn_k4v2_g128.json").read_text())["status"] == "ok"


def test_rows_on_two_gpus_run_at_once_against_their_own_gpus_baseline(
    bs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--gpus 2``: the baseline starts on both GPUs at once (a barrier both engines must
    reach), the other rows go to the GPU that is free, each row's ratio is against its own
    GPU's baseline, and ``--resume`` skips every row already measured, baselines included."""
    import threading

    barrier = threading.Barrier(2, timeout=10)
    started: list[tuple[str, str, float]] = []
    # GPU 1 is 10% faster: its rows must be compared with its own baseline
    speed = {"0": 1.0, "1": 1.1}
    tok_s = {
        "auto": 20000.0,
        "kvarn_k4v2_g128": 28000.0,
        "fp8": 24000.0,
        "kvarn_k4v4_g128": 27000.0,
    }

    def fake_run_child(
        cmd: list[str], env: dict[str, str], log: Path, limit: float
    ) -> tuple[int, str]:
        dtype = cmd[cmd.index("--child-dtype") + 1]
        gpu = env["CUDA_VISIBLE_DEVICES"]
        started.append((dtype, gpu, limit))
        if dtype == "auto":
            barrier.wait()  # both baselines run at the same time
        result = {**RESULT, "cache_dtype": dtype, "total_tok_s": tok_s[dtype] * speed[gpu]}
        Path(cmd[cmd.index("--child-out") + 1]).write_text(json.dumps(result))
        return 0, "ok"

    _fake_engines(bs, monkeypatch, fake_run_child)
    monkeypatch.delenv("KVARN_DECODE_VARIANT", raising=False)
    out = tmp_path / "bs"
    argv = ["--dtypes", "kvarn_k4v2_g128,auto,fp8,kvarn_k4v4_g128", "--gpus", "2"]
    argv += ["--timeout", "100", "--out", str(out)]
    assert bs.main(argv) == 0
    assert sorted((d, g) for d, g, _ in started if d == "auto") == [("auto", "0"), ("auto", "1")]
    expected = ["auto", "auto", "fp8", "kvarn_k4v2_g128", "kvarn_k4v4_g128"]
    assert sorted(d for d, _, _ in started) == expected
    assert {g for d, g, lim in started if lim == 220} == {"0", "1"}  # each GPU's first engine
    rows = {r["label"]: r for r in bs.common.load_rows(out)}
    assert set(rows) == {"auto", "auto[gpu 1]", "kvarn_k4v2_g128", "fp8", "kvarn_k4v4_g128"}
    text = bs.table(list(rows.values()), "auto")
    for label in ("kvarn_k4v2_g128", "fp8", "kvarn_k4v4_g128"):
        gpu = rows[label]["gpu"]
        ratio = f"{tok_s[label] / tok_s['auto']:.2f}"  # the same on either GPU
        assert f"| {label} (GPU {gpu}) |" in text
        line = next(x for x in text.splitlines() if x.startswith(f"| {label} "))
        assert f"| {ratio} |" in line
    started.clear()
    assert bs.main([*argv, "--resume"]) == 0
    assert started == []
    with pytest.raises(SystemExit, match="needs the baseline"):
        bs.main(["--dtypes", "fp8,kvarn_k4v2_g128", "--gpus", "2", "--out", str(out)])
