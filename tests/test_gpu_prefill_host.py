"""tools/gpu_prefill_host.py: the run needs a GPU; here, its refusal and its report's inputs."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


def test_without_a_gpu_it_says_so(
    load_tool: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tool = load_tool("gpu_prefill_host")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["--q-len", "16"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_default_case_is_the_benchmarks_short_chunk(
    load_tool: Callable[[str], ModuleType],
) -> None:
    """The profiled case is the short-chunk prefill shape bench_kernels times next to FA3."""
    tool = load_tool("gpu_prefill_host")
    args = tool.parser().parse_args([])
    assert (args.ctx, args.q_len, args.batch) == (*tool.bk.PREFILL_SHAPES[1], 1)
