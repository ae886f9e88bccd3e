"""tools/bench_kernels.py's report: the prefill rows and verdicts, per chunk shape."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def bk(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("bench_kernels")


def _rows(gpu_us: dict[tuple[str, int, int], float]) -> list[dict[str, Any]]:
    """Prefill rows at B = 1 with the given GPU times (eager times 2x them)."""
    return [
        {
            "kernel": k,
            "ctx": ctx,
            "q": q,
            "B": 1,
            "us": 2 * t,
            "gpu_us": t,
            "tflops": 1.0,
            "gpu_tflops": 2.0,
            "mode": "eager",
        }
        for (k, ctx, q), t in gpu_us.items()
    ]


def test_prefill_verdict_per_chunk_shape(bk: ModuleType) -> None:
    """Each chunk shape gets its own GPU-time ratios against FA3 fp16 on the same context,
    one per KVarN path, and a verdict on the faster path."""
    (long_ctx, long_q), (short_ctx, short_q) = bk.PREFILL_SHAPES
    rows = _rows(
        {
            ("kvarn_k4v2_g128 (FA3)", long_ctx, long_q): 980.0,
            ("kvarn_k4v2_g128 (fused)", long_ctx, long_q): 1500.0,
            ("fa3_fp16", long_ctx, long_q): 1000.0,
            ("kvarn_k4v2_g128 (FA3)", short_ctx, short_q): 300.0,
            ("kvarn_k4v2_g128 (fused)", short_ctx, short_q): 150.0,
            ("fa3_fp16", short_ctx, short_q): 100.0,
        }
    )
    res = {"ceilings": {"copy_gbs": 4000.0}, "decode": [], "store": [], "prefill": rows}
    lines = [line for line in bk.summary(res) if "Prefill with context" in line]
    assert len(lines) == 2
    assert f"({long_q} after {long_ctx})" in lines[0]
    assert "0.98x" in lines[0] and "1.50x" in lines[0] and "**met**" in lines[0]
    assert f"({short_q} after {short_ctx})" in lines[1]
    assert "3.00x" in lines[1] and "1.50x" in lines[1] and "**not met**" in lines[1]


def test_prefill_table_gives_eager_gpu_and_the_ratio_to_fa3(bk: ModuleType) -> None:
    """The prefill table has the eager and the GPU time of every row and the GPU time over
    FA3 fp16's on the same shape; a row without a GPU time (an older run, a failed capture)
    or with an error still renders."""
    (ctx, q), _ = bk.PREFILL_SHAPES
    rows = _rows({("fa3_fp8", ctx, q): 50.0, ("fa3_fp16", ctx, q): 100.0})
    rows.append({"kernel": "turboquant_k3v4_nc", "ctx": ctx, "q": q, "B": 1, "error": "boom"})
    rows.append({"kernel": "sdpa_fp16_noncausal", "ctx": ctx, "q": q, "B": 1, "us": 7.0})
    res = {
        "gpu": "GPU",
        "torch": "t",
        "triton": "tr",
        "date": "d",
        "ceilings": {"copy_gbs": 4000.0, "bf16_tflops": 600.0},
        "decode": [],
        "store": [],
        "prefill": rows,
    }
    text = bk.markdown(res, "cmd")
    assert "| fa3_fp8 | 2048 after 14336 | 1 | 100.0 | 50.0 | 2 | 0.50x |" in text
    assert "| fa3_fp16 | 2048 after 14336 | 1 | 200.0 | 100.0 | 2 | 1.00x |" in text
    assert "| turboquant_k3v4_nc | 2048 after 14336 | 1 | boom | - |  | - |" in text
    assert "| sdpa_fp16_noncausal | 2048 after 14336 | 1 | 7.0 | - |  | - |" in text


def test_rows_of_older_runs_read_as_the_long_chunk(bk: ModuleType) -> None:
    """A JSON from before the short-chunk shape has no ctx/q: it is the 2048-token chunk."""
    assert bk._chunk({"kernel": "fa3_fp16", "B": 1}) == "2048 after 14336"


def test_plain_splits_gives_the_split_rule_without_the_gluon_factor(
    bk: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plain_splits=True`` becomes the split rule's count for the case's batch and block
    table (replacing a given ``num_splits``); other options pass through unchanged."""
    import torch

    import kvarn_kernels

    calls: list[tuple[int, int, int]] = []

    def rule(batch: int, hk: int, blocks: int, device: torch.device) -> int:
        calls.append((batch, hk, blocks))
        return 3

    monkeypatch.setattr(kvarn_kernels, "choose_decode_splits", rule)
    inp = {"bt": torch.zeros(64, 129, dtype=torch.int32), "q": torch.zeros(64, 32, 128)}
    kw = {"variant": "v6f", "plain_splits": True, "num_splits": 12}
    assert bk.plain_split_option(inp, kw) == {"variant": "v6f", "num_splits": 3}
    assert calls == [(64, bk.HK, 129)]
    assert kw["plain_splits"] is True  # the caller's options are not changed
    assert bk.plain_split_option(inp, {"variant": "v5", "num_splits": 12}) == {
        "variant": "v5",
        "num_splits": 12,
    }
    assert len(calls) == 1


def test_decode_configs_are_named_and_selected_in_list_order(bk: ModuleType) -> None:
    """``--decode-configs`` takes config_label names, keeps DECODE_VARIANT_CONFIGS' order
    and refuses an unknown name, listing the known ones."""
    labels = [bk.config_label(c) for c in bk.DECODE_VARIANT_CONFIGS]
    assert len(set(labels)) == len(labels)  # every config reachable by its name
    assert bk.config_label({"variant": "v6f", "max_registers": 144}) == "v6f regs144"
    assert bk.config_label({"variant": "v5", "plain_splits": True}) == "v5 plain"
    picked = bk.select_decode_configs("v6f plain, v6f")
    assert [bk.config_label(c) for c in picked] == ["v6f", "v6f plain"]
    assert len(bk.select_decode_configs(None)) == len(labels)
    with pytest.raises(SystemExit, match=r"unknown.*v9.*known: v1"):
        bk.select_decode_configs("v6f,v9")
    with pytest.raises(SystemExit, match="empty list"):
        bk.select_decode_configs(" , ")


def test_decode_variants_table_names_config_and_errors(bk: ModuleType) -> None:
    rows = [
        {
            "B": 64,
            "ctx": 16384,
            "config": {"variant": "v6f"},
            "variant": "v6f",
            "splits": 8,
            "us": 351.25,
        },
        {"B": 64, "ctx": 16384, "config": {"variant": "v4c"}, "pool": 0, "error": "boom"},
    ]
    text = bk.decode_variants_table(rows).splitlines()
    assert "v6f" in text[1] and "351.2" in text[1] and " 8 " in text[1]
    assert "v4c no pool" in text[2] and "boom" in text[2]


def test_status_names_a_card_other_than_the_h200(bk: ModuleType) -> None:
    """The targets are the H200's: a run on another card says its verdicts are that card's;
    an H200 run (or an old run without a GPU name) adds nothing."""
    res: dict[str, Any] = {"ceilings": {"copy_gbs": 4000.0}, "decode": [], "store": []}
    res["prefill"] = []
    other = bk.summary({**res, "gpu": "NVIDIA H100 80GB HBM3"})
    assert any("NVIDIA H100 80GB HBM3" in line and "H200" in line for line in other)
    for gpu in ("NVIDIA H200", None):
        lines = bk.summary({**res, "gpu": gpu} if gpu else res)
        assert not any("the issue sets its targets" in line for line in lines)


def test_status_gives_small_batch_decode_against_fa3(bk: ModuleType) -> None:
    """The small-batch decode rows get one status line: FA3 fp16's time over k4v2_g128's at
    each small shape that has both rows (below 1x where KVarN is slower), and a run
    without them (or with one side failed) gets none."""

    def row(kernel: str, b: int, us: float | None) -> dict[str, Any]:
        r: dict[str, Any] = {"kernel": kernel, "B": b, "ctx": 16384}
        r.update({"us": us} if us is not None else {"error": "boom"})
        return r

    decode = [
        row("kvarn_k4v2_g128", 1, 40.0),
        row("fa3_fp16", 1, 30.0),
        row("kvarn_k4v2_g128", 8, 75.0),
        row("fa3_fp16", 8, 150.0),
    ]
    res: dict[str, Any] = {"ceilings": {"copy_gbs": 4000.0}, "store": [], "prefill": []}
    lines = [x for x in bk.summary({**res, "decode": decode}) if "small batches" in x]
    assert len(lines) == 1
    assert "B=1, 16K: 0.75x (40.0 against 30.0 µs)" in lines[0]
    assert "B=8, 16K: 2.00x (75.0 against 150.0 µs)" in lines[0]
    decode[1] = row("fa3_fp16", 1, None)
    lines = [x for x in bk.summary({**res, "decode": decode}) if "small batches" in x]
    assert len(lines) == 1 and "B=1" not in lines[0] and "B=8" in lines[0]
    assert not any("small batches" in x for x in bk.summary({**res, "decode": decode[:2]}))
