"""The harness's attention: SDPA with grouped K/V, and error recording per layer and token.

The harness registers one extra attention implementation with transformers: SDPA reading
grouped K/V in place (the outputs equal transformers' ``sdpa``), plus an optional observer.
While an :class:`AttentionErrorRecorder` is active, every attention call also measures, per
batch row and query token, two relative errors of the attention output (before ``o_proj``,
all query heads of the token together):

* ``local``: the output with the row's quantized cache vs the output with the *same* query and
  the same row's unquantized K/V (the cache keeps an exact copy). This isolates what the KV
  quantization of this layer does, given its inputs;
* ``e2e``: the output vs the reference row's output at the same layer and position. Rows share
  the token sequence, so this includes the drift that earlier layers and earlier tokens'
  errors have carried into this layer's inputs: error accumulation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvarn_eval.cache import TiledKVCache, last_updated_layer

__all__ = ["ATTN_IMPL", "AttentionErrorRecorder", "install", "recording"]

ATTN_IMPL: Final[str] = "kvarn_eval_sdpa"
_ACTIVE: ContextVar[AttentionErrorRecorder | None] = ContextVar("kvarn_eval_rec", default=None)


def _relative(diff: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token ``||diff|| / ||ref||`` for ``[B, T, H, D]`` tensors -> ``[B, T]``."""
    num = diff.flatten(2).norm(dim=-1)
    den = ref.flatten(2).norm(dim=-1).clamp_min(1e-12)
    rel: torch.Tensor = num / den
    return rel


class AttentionErrorRecorder:
    """Collects ``local`` and ``e2e`` errors (module docstring) for every layer and token."""

    def __init__(self, cache: TiledKVCache, num_layers: int, ref_row: int = 0) -> None:
        self.cache = cache
        self.ref_row = ref_row
        self._local: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._e2e: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def observe(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        out: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> None:
        idx = int(getattr(module, "layer_idx", -1))
        layer = self.cache.tiled_layer(idx)
        if not layer.keep_exact:
            raise ValueError("AttentionErrorRecorder needs a TiledKVCache built with keep_exact")
        exact, _ = _sdpa_gqa(
            module, query, layer.exact_keys, layer.exact_values, attention_mask, **kwargs
        )
        self._local[idx].append(_relative(out - exact, exact).float())
        ref = out[self.ref_row : self.ref_row + 1]
        self._e2e[idx].append(_relative(out - ref, ref.expand_as(out)).float())

    def _stack(self, parts: list[list[torch.Tensor]]) -> npt.NDArray[np.float32]:
        if any(not p for p in parts):
            raise RuntimeError("no attention call was recorded for some layer")
        return np.stack([torch.cat(p, dim=1).cpu().numpy() for p in parts]).astype(np.float32)

    def local(self) -> npt.NDArray[np.float32]:
        """``[layers, rows, tokens]`` local relative error."""
        return self._stack(self._local)

    def e2e(self) -> npt.NDArray[np.float32]:
        """``[layers, rows, tokens]`` error vs the reference row."""
        return self._stack(self._e2e)


def _sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped K/V read in place (``enable_gqa``).

    transformers only uses ``enable_gqa`` without a mask; with the causal mask of a chunk
    that has a cache before it, it copies K/V once per query head (``repeat_kv``), which on
    the CPU made attention over an 8K cache 2-3x slower. The arithmetic is the same: on the
    CPU the outputs are bit-identical (tested against ``sdpa``).
    """
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None
        is_causal = bool(is_causal and getattr(module, "is_causal", True))
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    out, weights = _sdpa_gqa(module, query, key, value, attention_mask, **kwargs)
    layer = last_updated_layer()
    if layer is not None and layer.fp16_attention_rows and key is layer.keys:
        rows = layer.fp16_attention_rows
        mask = attention_mask
        if mask is not None and mask.shape[0] > 1:
            mask = mask[rows]
        if mask is not None and mask.is_floating_point():
            mask = mask.half()
        half, _ = _sdpa_gqa(
            module,
            query[rows].half(),
            key[rows].half(),
            value[rows].half(),
            mask,
            **kwargs,
        )
        out[rows] = half.to(out.dtype)
    if layer is not None and layer.serving:
        # Rows of a serving-kernel codec read their own paged cache (kernel_codecs.py).
        if key is not layer.keys:
            raise RuntimeError(
                "the attention call does not read the cache layer updated last; the serving "
                "kernel rows cannot be matched to their cache"
            )
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        layer.serving_attention(query, out, float(scaling))
    rec = _ACTIVE.get()
    if rec is not None:
        rec.observe(module, query, out, attention_mask, kwargs)
    return out, weights


def install(model: PreTrainedModel) -> None:
    """Route the model's attention through the observable SDPA (same numerics as ``sdpa``)."""
    if getattr(model.config, "_attn_implementation", None) == ATTN_IMPL:
        return
    AttentionInterface.register(ATTN_IMPL, _attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
    model.set_attn_implementation(ATTN_IMPL)


@contextmanager
def recording(recorder: AttentionErrorRecorder) -> Iterator[AttentionErrorRecorder]:
    """Make ``recorder`` observe every attention call inside the ``with`` block."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)
