"""tools/bench_kernels.py's report: the prefill rows and verdicts, per chunk shape."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bk(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("bench_kernels")


def _rows(us: dict[tuple[str, int, int], float]) -> list[dict[str, Any]]:
    return [
        {"kernel": k, "ctx": ctx, "q": q, "B": 1, "us": t, "tflops": 1.0, "mode": "eager"}
        for (k, ctx, q), t in us.items()
    ]


def test_prefill_verdict_per_chunk_shape(bk: ModuleType) -> None:
    """Each chunk shape gets its own ratio and verdict against FA3 on the same context."""
    (long_ctx, long_q), (short_ctx, short_q) = bk.PREFILL_SHAPES
    rows = _rows(
        {
            ("kvarn_k4v2_g128 (FA3)", long_ctx, long_q): 980.0,
            ("fa3_fp16", long_ctx, long_q): 1000.0,
            ("kvarn_k4v2_g128 (FA3)", short_ctx, short_q): 300.0,
            ("fa3_fp16", short_ctx, short_q): 100.0,
        }
    )
    res = {"ceilings": {"copy_gbs": 4000.0}, "decode": [], "store": [], "prefill": rows}
    lines = [line for line in bk.summary(res) if "Prefill with context" in line]
    assert len(lines) == 2
    assert f"({long_q} after {long_ctx})" in lines[0] and "0.98x" in lines[0]
    assert "**met**" in lines[0]
    assert f"({short_q} after {short_ctx})" in lines[1] and "3.00x" in lines[1]
    assert "**not met**" in lines[1]


def test_rows_of_older_runs_read_as_the_long_chunk(bk: ModuleType) -> None:
    """A JSON from before the short-chunk shape has no ctx/q: it is the 2048-token chunk."""
    assert bk._chunk({"kernel": "fa3_fp16", "B": 1}) == "2048 after 14336"
