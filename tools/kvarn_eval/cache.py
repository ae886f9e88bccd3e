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
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvarn_eval.codecs import TileCodec

if TYPE_CHECKING:
    from kvarn_eval.kernel_codecs import ServingGroup

__all__ = ["FlushEvent", "TiledKVCache", "TiledLayer", "group_rows", "last_updated_layer"]

_LAST: list[TiledLayer | None] = [None]


def last_updated_layer() -> TiledLayer | None:
    """Take the :class:`TiledLayer` whose ``update`` ran last (and forget it).

    transformers calls a layer's attention right after that layer's cache update, so this is
    the layer the next attention call reads; taking it once keeps a stale layer from being
    matched to a later attention call that used another cache.
    """
    layer, _LAST[0] = _LAST[0], None
    return layer


#: (row, first tile, end tile) of one flush, recorded for tests and debugging.
FlushEvent = tuple[int, int, int]


def group_rows(codecs: Sequence[TileCodec]) -> list[tuple[TileCodec, list[int]]]:
    """Rows grouped by codec object (identity), in first-seen order: ``[(codec, rows)]``."""
    groups: dict[int, tuple[TileCodec, list[int]]] = {}
    for row, codec in enumerate(codecs):
        groups.setdefault(id(codec), (codec, []))[1].append(row)
    return list(groups.values())


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
        self._store_groups = self._groups(torch.device("cpu"))
        self.length = 0
        self.flushed = [0] * len(self.codecs)
        self.flush_log: list[FlushEvent] = []
        self._capacity_hint = max(1, capacity)
        self.serving: list[ServingGroup] = []
        self._serving_rows: set[int] = set()
        self.fp16_attention_rows = self._fp16_attention_rows()
        self._kbuf = torch.empty(0)
        self._vbuf = torch.empty(0)
        self._kx = torch.empty(0)
        self._vx = torch.empty(0)
        self.exact_keys = torch.empty(0)
        self.exact_values = torch.empty(0)

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None
    ) -> None:
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
        self._store_groups = self._groups(self.device)
        self.serving = []
        for codec, rows in group_rows(self.codecs):
            if getattr(codec, "serving", False):
                from kvarn_eval.kernel_codecs import KernelKVarNCodec, ServingGroup

                assert isinstance(codec, KernelKVarNCodec)
                self.serving.append(
                    ServingGroup(
                        codec, rows, self.offsets, heads, dim, self._capacity_hint, self.device
                    )
                )
        self._serving_rows = {r for grp in self.serving for r in grp.rows}
        self.fp16_attention_rows = self._fp16_attention_rows()
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

    def due(self, row: int) -> tuple[int, int] | None:
        """``(first tile, end tile)`` of row ``row``'s complete, unflushed, non-sink tiles."""
        g = self.codecs[row].group
        if g is None:
            return None
        complete = max(0, self.length - self.offsets[row]) // g
        start = max(self.flushed[row], self.codecs[row].sink_tiles)
        return (start, complete) if complete > start else None

    def tiles(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s tiles ``start..end-1`` as ``[heads * n, G, D]`` K and V."""
        g = self.codecs[row].group
        assert g is not None
        lo, hi = self.offsets[row] + start * g, self.offsets[row] + end * g
        heads, dim = self._kbuf.shape[1], self._kbuf.shape[3]
        n = end - start
        k = self._kbuf[row, :, lo:hi].reshape(heads * n, g, dim)
        v = self._vbuf[row, :, lo:hi].reshape(heads * n, g, dim)
        return k, v

    def put_tiles(self, row: int, start: int, end: int, kq: torch.Tensor, vq: torch.Tensor) -> None:
        """Write the quantized image of tiles ``start..end-1`` back and mark them flushed."""
        g = self.codecs[row].group
        assert g is not None
        lo, hi = self.offsets[row] + start * g, self.offsets[row] + end * g
        heads, dim = self._kbuf.shape[1], self._kbuf.shape[3]
        self._kbuf[row, :, lo:hi] = kq.reshape(heads, (end - start) * g, dim).to(self.dtype)
        self._vbuf[row, :, lo:hi] = vq.reshape(heads, (end - start) * g, dim).to(self.dtype)
        self.flush_log.append((row, start, end))
        self.flushed[row] = max(self.flushed[row], end)

    def flush(self) -> None:
        """Quantize every complete, not yet flushed, non-sink tile of every row.

        Normally :meth:`TiledKVCache.flush` has already done this for every layer at once
        before the step; this per-layer pass then finds nothing to do. It keeps a layer used
        on its own (tests) correct.
        """
        for row, codec in enumerate(self.codecs):
            span = self.due(row)
            if span is None or row in self._serving_rows:
                continue
            k, v = self.tiles(row, *span)
            kq, vq = codec.quantize_tiles(k, v)
            self.put_tiles(row, *span, kq, vq)
        self.flush_serving()

    def flush_serving(self) -> None:
        """Flush the due tiles of the serving rows with the store kernel, in their own cache.

        The buffer image of those tiles becomes the decoded records (what the kernels read).
        """
        for grp in self.serving:
            spans = [
                (i, row, span)
                for i, row in enumerate(grp.rows)
                if (span := self.due(row)) is not None
            ]
            images = grp.flush([(i, a, b) for i, _, (a, b) in spans])
            for (_, row, (a, b)), (kq, vq) in zip(spans, images, strict=True):
                self.put_tiles(row, a, b, kq, vq)

    def serving_attention(self, query: torch.Tensor, out: torch.Tensor, scaling: float) -> None:
        """Overwrite the serving rows' attention output with the kernels' (this step)."""
        for grp in self.serving:
            grp.attention(query, out, scaling)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        _LAST[0] = self
        with _one_thread():
            return self._update(key_states, value_states)

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.flush()
        t = key_states.shape[-2]
        end = self.length + t
        self._grow(end)
        for codec, row_list, rows in self._store_groups:
            if len(row_list) == 1:
                r = row_list[0]
                k_img, v_img = codec.store(key_states[r], value_states[r])
                self._kbuf[r, :, self.length : end] = k_img
                self._vbuf[r, :, self.length : end] = v_img
            else:
                k_img, v_img = codec.store(key_states[rows], value_states[rows])
                self._kbuf[rows, :, self.length : end] = k_img
                self._vbuf[rows, :, self.length : end] = v_img
        for grp in self.serving:
            grp.write(key_states, value_states, self.length)
        if self.keep_exact:
            self._kx[:, :, self.length : end] = key_states
            self._vx[:, :, self.length : end] = value_states
            self.exact_keys = self._kx[:, :, :end]
            self.exact_values = self._vx[:, :, :end]
        self.length = end
        self.keys = self._kbuf[:, :, :end]
        self.values = self._vbuf[:, :, :end]
        return self.keys, self.values

    def _fp16_attention_rows(self) -> list[int]:
        """Rows whose codec asks for attention in fp16 (``attention_fp16``)."""
        return [r for r, c in enumerate(self.codecs) if getattr(c, "attention_fp16", False)]

    def _groups(self, device: torch.device) -> list[tuple[TileCodec, list[int], torch.Tensor]]:
        """Rows sharing a codec object, with their indices on ``device`` (one store call each:
        a decode step of 100 rows would otherwise spend longer in per-row rotations than in
        the model)."""
        return [
            (codec, rows, torch.tensor(rows, dtype=torch.long, device=device))
            for codec, rows in group_rows(self.codecs)
        ]

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only batch rows ``keep`` (in that order), e.g. requests that are finished.

        Rows are independent, so the kept rows' state is unchanged; their indices become
        ``0..len(keep)-1``.
        """
        self.codecs = [self.codecs[r] for r in keep]
        self.offsets = [self.offsets[r] for r in keep]
        self.flushed = [self.flushed[r] for r in keep]
        self.flush_log = []
        self.fp16_attention_rows = self._fp16_attention_rows()
        if not self.is_initialized:
            self._store_groups = self._groups(torch.device("cpu"))
            return
        self._store_groups = self._groups(self.device)
        idx = torch.tensor(list(keep), dtype=torch.long, device=self._kbuf.device)
        self._kbuf = self._kbuf.index_select(0, idx)
        self._vbuf = self._vbuf.index_select(0, idx)
        if self.keep_exact:
            self._kx = self._kx.index_select(0, idx)
            self._vx = self._vx.index_select(0, idx)
            self.exact_keys = self._kx[:, :, : self.length]
            self.exact_values = self._vx[:, :, : self.length]
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]
        new_index = {old: new for new, old in enumerate(keep)}
        self.serving = [g for g in self.serving if g.select(new_index)]
        self._serving_rows = {r for grp in self.serving for r in grp.rows}
        self.fp16_attention_rows = self._fp16_attention_rows()

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

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self.flush()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def flush(self) -> None:
        """Flush the due tiles of every layer and row, one ``quantize_tiles`` call per codec.

        Called when layer 0 receives a step's tokens, i.e. before the step's forward. A tile
        of layer ``l`` only changes when layer ``l`` appends tokens, so the tiles due at that
        moment are exactly those each layer would flush before its own update; batching them
        turns ``layers x rows`` small codec calls per step into one call per codec (the
        reference codec's cost is mostly per call). Tiles are independent in every codec, so
        the images do not depend on the batching.
        """
        layers = [self.tiled_layer(i) for i in range(len(self.layers))]
        if not layers or not layers[0].is_initialized:
            return
        with _one_thread():
            for layer in layers:
                layer.flush_serving()
            for codec, rows in group_rows(self.codecs):
                if codec.group is None or getattr(codec, "serving", False):
                    continue
                spans = [
                    (layer, row, span)
                    for layer in layers
                    for row in rows
                    if (span := layer.due(row)) is not None
                ]
                if not spans:
                    continue
                parts = [layer.tiles(row, *span) for layer, row, span in spans]
                kq, vq = codec.quantize_tiles(
                    torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
                )
                at = 0
                for (layer, row, span), (k, _) in zip(spans, parts, strict=True):
                    n = k.shape[0]
                    layer.put_tiles(row, *span, kq[at : at + n], vq[at : at + n])
                    at += n

    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only batch rows ``keep`` in every layer (see :meth:`TiledLayer.select_rows`)."""
        if not keep:
            raise ValueError("select_rows needs at least one row to keep")
        self.codecs = [self.codecs[r] for r in keep]
        for i in range(len(self.layers)):
            self.tiled_layer(i).select_rows(keep)

    def tiled_layer(self, idx: int) -> TiledLayer:
        layer = self.layers[idx]
        assert isinstance(layer, TiledLayer)
        return layer
