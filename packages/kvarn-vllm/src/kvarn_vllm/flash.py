"""vLLM's FlashAttention as the varlen attention of KVarN's prefill-with-context path.

``kvarn_kernels.prefill_attention(method="dequant")`` dequantizes the cached context into an
fp16 workspace and runs a FlashAttention-style varlen forward on it. By default that is
torch's built-in FlashAttention-2; inside vLLM the plugin hands it vLLM's own
``flash_attn_varlen_func`` instead (FlashAttention-3 on Hopper), the kernel fp16 serving
uses for the same work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvarn_kernels.context import VarlenAttention

__all__ = ["varlen_attention_from_vllm"]


def varlen_attention_from_vllm(
    flash_attn_varlen_func: Callable[..., Any], fa_version: int | None
) -> VarlenAttention:
    """Adapt vLLM's ``flash_attn_varlen_func`` to :data:`kvarn_kernels.context.VarlenAttention`.

    Causal attention in FlashAttention is aligned bottom-right when a request has fewer
    queries than keys, which is what prefill with context needs.
    """
    extra: dict[str, Any] = {} if fa_version is None else {"fa_version": fa_version}

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
    ) -> torch.Tensor:
        out = flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=True,
            **extra,
        )
        # Some builds return (out, lse); the output comes first.
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    return attend
