"""The adapter from vLLM's flash_attn_varlen_func to kvarn-kernels' VarlenAttention."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvarn_vllm.flash import varlen_attention_from_vllm


@pytest.mark.parametrize("fa_version", [3, None])
@pytest.mark.parametrize("returns_tuple", [False, True])
def test_arguments_reach_flash_attention(fa_version: int | None, returns_tuple: bool) -> None:
    seen: dict[str, Any] = {}

    def fake_fa(**kw: Any) -> Any:
        seen.update(kw)
        out = kw["q"] * 2
        return (out, None) if returns_tuple else out

    attend = varlen_attention_from_vllm(fake_fa, fa_version)
    q, k, v = torch.ones(5, 4, 8), torch.zeros(9, 2, 8), torch.zeros(9, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 9])
    out = attend(q, k, v, cu_q, cu_k, 3, 5, 2.0)
    assert torch.equal(out, q * 2)
    assert seen["k"] is k and seen["v"] is v
    assert seen["cu_seqlens_q"] is cu_q and seen["cu_seqlens_k"] is cu_k
    assert (seen["max_seqlen_q"], seen["max_seqlen_k"]) == (3, 5)
    assert seen["softmax_scale"] == 2.0 and seen["causal"] is True
    assert seen.get("fa_version") == fa_version
