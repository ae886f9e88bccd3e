"""tools/gpu_ncu_decode.py: its arguments reach decode_attention (the run itself needs a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


def test_launches_the_case_twice_with_its_arguments(
    load_tool: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = load_tool("gpu_ncu_decode")
    import torch

    calls: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(tool.bk, "decode_inputs", lambda fmt, b, ctx: (fmt, b, ctx))
    monkeypatch.setattr(tool.bk, "decode_once", lambda inp, **kw: calls.append((inp, kw)))
    assert tool.main(["--format", "kvarn_k4v4_g128", "--batch", "8", "--ctx", "4096"]) == 0
    assert calls == [(("kvarn_k4v4_g128", 8, 4096), {"variant": "auto"})] * 2
    calls.clear()
    assert tool.main(["--variant", "v1"]) == 0
    assert calls == [(("kvarn_k4v2_g128", 64, 16384), {"variant": "v1"})] * 2


def test_without_a_gpu_it_says_so(
    load_tool: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = load_tool("gpu_ncu_decode")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main([]) == 2
