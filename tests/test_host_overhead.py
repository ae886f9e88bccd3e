"""tools/host_overhead.py on a tiny configuration: it runs, and reports what was asked.

The tool builds real vLLM objects on vLLM's CPU platform, which must be forced before vLLM is
imported (as packages/kvarn-vllm/tests/conftest.py does), hence the call at collection.
Timings' values are not checked, only that every one exists and is a positive finite number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvarn_vllm.testing import prepare_cpu_test_env

ON_CPU = prepare_cpu_test_env()

pytestmark = pytest.mark.skipif(not ON_CPU, reason="the tool runs on vLLM's CPU platform only")

BATCHES = (2, 3)
STEPS = 3
MIXED_REPS = 2


@pytest.fixture(scope="module")
def tool(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("host_overhead")


def _positive_finite(stats: dict[str, Any], n: int) -> None:
    assert stats["n"] == n
    for key in ("median_us", "p90_us", "mean_us", "min_us", "max_us"):
        assert math.isfinite(stats[key]) and stats[key] > 0, (key, stats)
    assert stats["min_us"] <= stats["median_us"] <= stats["p90_us"] <= stats["max_us"]


def test_main_reports_every_batch_and_step(
    tool: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "host.json"
    argv = [
        "--batch",
        ",".join(str(b) for b in BATCHES),
        "--context",
        "300",  # not a multiple of 128: requests start inside a block
        "--steps",
        str(STEPS),
        "--warmup",
        "1",
        "--layers",
        "2",
        "--mixed-reps",
        str(MIXED_REPS),
        "--chunk",
        "256",
        "--profile",
        str(BATCHES[-1]),
        "--json",
        str(out),
    ]
    assert tool.main(argv) == 0
    report = json.loads(out.read_text())
    assert [b["batch"] for b in report["batches"]] == list(BATCHES)
    assert report["settings"]["steps"] == STEPS and report["settings"]["layers"] == 2
    for b in report["batches"]:
        for kind, n in (
            ("decode", STEPS),
            ("mixed_first_chunk", MIXED_REPS),
            ("mixed_continuation", MIXED_REPS),
        ):
            r = b[kind]
            assert r["steps"] == n and len(r["observe_us"]) == len(r["build_us"]) == n
            for part in ("observe", "build", "total"):
                _positive_finite(r[part], n)
            assert r["flush_launches_per_step"] >= 0
    # Only the batch asked for is profiled, with build() itself among the top functions.
    assert "profile" not in report["batches"][0]
    prof = report["batches"][-1]["profile"]
    assert any("(build)" in row["function"] for row in prof["decode_build_top"])
    assert any("observe_scheduler_output" in row["function"] for row in prof["decode_observe_top"])
    printed = capsys.readouterr().out
    table = printed[printed.index("| batch |") :].splitlines()
    assert len(table) == 2 + 3 * len(BATCHES)  # header, rule, three step kinds per batch
    # The tool left no KVarN runtime alive (it would be fed by later observe calls).
    assert tool._live_runtimes() == 0


def test_crossing_blocks_flush_one_step_later(tool: ModuleType, tmp_path: Path) -> None:
    """With requests of staggered lengths, 130 decode steps cross every request's block
    boundary once: each crossing's full block is flushed one step later, through the counted
    flush kernel (one flush_tiles call per layer per step that flushes)."""
    out = tmp_path / "host.json"
    argv = ["--batch", "4", "--context", "256", "--steps", "130", "--layers", "2"]
    assert tool.main([*argv, "--mixed-reps", "0", "--json", str(out)]) == 0
    decode = json.loads(out.read_text())["batches"][0]["decode"]
    assert decode["steps"] == 130 and decode["observe"]["n"] == 130
    # Requests hold 256, 224, 192 and 160 tokens: each completes one block within the timed
    # steps; a flush is one flush_tiles call per layer, of one launch (two with shadow rows).
    launches = round(decode["flush_launches_per_step"] * 130)
    assert launches in (4 * 2 * 1, 4 * 2 * 2), launches


def test_batch_list_parsing(tool: ModuleType) -> None:
    assert tool.parser().parse_args(["--batch", "1,16, 64"]).batch == (1, 16, 64)
    with pytest.raises(SystemExit):
        tool.parser().parse_args(["--batch", "0,2"])
