"""bench_serving's rows: what an engine process's exit code and result file make of a row."""

from __future__ import annotations

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
