"""A transformers KV cache that flushes completed tiles through a codec, as the serving path does.

Serving semantics being reproduced (docs/architecture.md "Life of a token", format-spec §2.1):

* every new token's K/V goes to the side pool (fp16, rotated for KVarN): :meth:`TileCodec.store`;
* a request's first tile (the sink) and the tile still being filled stay in the pool;
* before a step's forward, every tile whose ``G`` tokens were all stored by *earlier* steps and
  that is not a sink is flushed: replaced by its quantize -> dequantize image
  (:meth:`TileCodec.quantize_tiles`). The step that completes a tile still reads it from the
  pool; the next step reads the quantized image.

The flush happens inside :meth:`TiledLayer.update`, before the new tokens are appended, which is
"before the step's forward" for that layer. A token in tile ``c`` therefore always sees tiles
``1..c-1`` quantized, the sink and tile ``c`` in fp16, whatever the step size, as long as no
step crosses a tile boundary: feeding text in steps of one tile (or of any divisor of it) gives
the same logits as token-by-token decoding. Keys are post-RoPE, as vLLM stores them.

Batch rows are independent requests of equal length, each with its own codec, so one batched
forward pass evaluates the fp16 reference and every quantizer on the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvarn_eval.codecs import TileCodec

__all__ = ["FlushEvent", "TiledKVCache", "TiledLayer"]

#: (row, first tile, end tile) of one flush, recorded for tests and debugging.
FlushEvent = tuple[int, int, int]


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the cache's small tensor ops on one thread.

    The codec works on a few 64x64 tiles at a time; with two intra-op threads such ops spend
    far longer in thread hand-off than in arithmetic (16 ms instead of 0.1 ms for one rotation
    on a busy 2-core machine). The model's large matmuls keep the configured thread count.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class TiledLayer(DynamicLayer):
    """One layer's cache: preallocated ``[B, Hk, capacity, D]`` buffers and per-row flush state.

    ``keys``/``values`` are views of the first ``length`` positions (what attention reads).
    With ``keep_exact`` the unmodified K/V are kept too (``exact_keys``/``exact_values``), so the
    attention output with and without quantization can be compared at every layer.
    ``offsets[b]`` is the number of left-padding positions of row ``b`` (prompts of different
    lengths in one batch): that row's tiles start at buffer index ``offsets[b]``.
    """

    def __init__(
        self,
        codecs: Sequence[TileCodec],
        *,
        keep_exact: bool = False,
        capacity: int = 256,
        offsets: Sequence[int] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.codecs = list(codecs)
        self.offsets = [0] * len(self.codecs) if offsets is None else [int(o) for o in offsets]
        if len(self.offsets) != len(self.codecs) or min(self.offsets, default=0) < 0:
            raise ValueError("offsets must give one non-negative padding length per codec row")
        self.keep_exact = keep_exact
        self.length = 0
        self.flushed = [0] * len(self.codecs)
        self.flush_log: list[FlushEvent] = []
        self._capacity_hint = max(1, capacity)
        self._kbuf = torch.empty(0)
        self._vbuf = torch.empty(0)
        self._kx = torch.empty(0)
        self._vx = torch.empty(0)
        self.exact_keys = torch.empty(0)
        self.exact_values = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if batch != len(self.codecs):
            raise ValueError(
                f"the cache was built for {len(self.codecs)} rows (one codec per row) but the "
                f"model ran a batch of {batch}; pass one codec per batch row"
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (batch, heads, self._capacity_hint, dim)
        self._kbuf = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._vbuf = torch.zeros_like(self._kbuf)
        if self.keep_exact:
            self._kx = torch.zeros_like(self._kbuf)
            self._vx = torch.zeros_like(self._kbuf)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        cap = self._kbuf.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)

        def grown(buf: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(
                (buf.shape[0], buf.shape[1], new_cap, buf.shape[3]),
                dtype=buf.dtype,
                device=buf.device,
            )
            out[:, :, : self.length] = buf[:, :, : self.length]
            return out

        self._kbuf, self._vbuf = grown(self._kbuf), grown(self._vbuf)
        if self.keep_exact:
            self._kx, self._vx = grown(self._kx), grown(self._vx)

    def flush(self) -> None:
        """Quantize every complete, not yet flushed, non-sink tile of every row."""
        for row, codec in enumerate(self.codecs):
            g = codec.group
            if g is None:
                continue
            off = self.offsets[row]
            complete = max(0, self.length - off) // g
            start = max(self.flushed[row], codec.sink_tiles)
            if complete > start:
                lo, hi = off + start * g, off + complete * g
                heads, dim = self._kbuf.shape[1], self._kbuf.shape[3]
                n = complete - start
                k = self._kbuf[row, :, lo:hi].reshape(heads * n, g, dim)
                v = self._vbuf[row, :, lo:hi].reshape(heads * n, g, dim)
                kq, vq = codec.quantize_tiles(k, v)
                self._kbuf[row, :, lo:hi] = kq.reshape(heads, n * g, dim).to(self.dtype)
                self._vbuf[row, :, lo:hi] = vq.reshape(heads, n * g, dim).to(self.dtype)
                self.flush_log.append((row, start, complete))
            self.flushed[row] = max(self.flushed[row], complete)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        with _one_thread():
            return self._update(key_states, value_states)

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.flush()
        t = key_states.shape[-2]
        end = self.length + t
        self._grow(end)
        for row, codec in enumerate(self.codecs):
            k_img, v_img = codec.store(key_states[row], value_states[row])
            self._kbuf[row, :, self.length : end] = k_img
            self._vbuf[row, :, self.length : end] = v_img
        if self.keep_exact:
            self._kx[:, :, self.length : end] = key_states
            self._vx[:, :, self.length : end] = value_states
            self.exact_keys = self._kx[:, :, :end]
            self.exact_values = self._vx[:, :, :end]
        self.length = end
        self.keys = self._kbuf[:, :, :end]
        self.values = self._vbuf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("TiledLayer does not support cropping (no speculative rollback)")


class TiledKVCache(Cache):
    """One :class:`TiledLayer` per decoder layer; row ``b`` of every batch uses ``codecs[b]``."""

    def __init__(
        self,
        codecs: Sequence[TileCodec],
        num_layers: int,
        *,
        keep_exact: bool = False,
        capacity: int = 256,
        offsets: Sequence[int] | None = None,
    ) -> None:
        if not codecs:
            raise ValueError("TiledKVCache needs at least one codec (one per batch row)")
        self.codecs = list(codecs)
        layers: list[Any] = [
            TiledLayer(self.codecs, keep_exact=keep_exact, capacity=capacity, offsets=offsets)
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)

    def tiled_layer(self, idx: int) -> TiledLayer:
        layer = self.layers[idx]
        assert isinstance(layer, TiledLayer)
        return layer
