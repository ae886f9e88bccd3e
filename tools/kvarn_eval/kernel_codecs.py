"""KVarN through the real serving kernels of ``kvarn-kernels`` (issue 5, GPU part).

Two codecs, both named after the dense format with a backend suffix:

``kvarn_<fmt>+store``
    Only the store is a serving kernel. The pool and the completed tile's fp16 bits are
    exactly those the reference codec receives (:func:`kvarn_eval.codecs.pool_rotated`); the
    tile is packed into a record by the Triton store kernel (:func:`kvarn_kernels.flush_tiles`)
    and decoded back by kvarn-kernels' torch decoder
    (:func:`kvarn_kernels.reference.dequantize_records`, the reference decoder's fp32
    operations). The harness's own attention then reads that image, so against the reference
    codec this row isolates the store kernel: under the Triton interpreter its records, and so
    its logits, equal the reference's (tested).

``kvarn_<fmt>+kernels``
    The serving path. Every layer keeps, per group of rows sharing the codec, what vLLM keeps
    per attention layer: a paged record cache ``uint8 [blocks, Hk, tile_bytes]``, the rotated
    fp16 side pool ``[slots, G, Hk, D]``, ``block_to_slot`` and a block table. Tokens are
    rotated into the pool by the Triton rotation kernel (:func:`kvarn_kernels.rotate`, the
    kernel ``write_side_pool`` runs), complete tiles are flushed by ``flush_tiles`` (and their
    slots released), and the row's attention output is replaced by
    :func:`kvarn_kernels.prefill_attention` (several query tokens) or
    :func:`kvarn_kernels.decode_attention` (one) reading records and pool through the block
    table. Queries go in as fp16 and the output comes back as fp16, as in serving. The
    harness's float32 buffer for the row holds the decoded records (as ``+store`` would);
    the harness's own attention over it still runs, but its output for the row is replaced.

The model itself runs in float32 (the harness's choice, see ``assets.load_model``), so the
pool is written by rotating the float32 K/V (the reference codec's input), not by
``write_side_pool``, which takes the fp16/bf16 activations of a serving model; both use the
same Triton rotation kernel. Without CUDA the kernels run in Triton's interpreter, which must
be enabled (``TRITON_INTERPRET=1``) before ``kvarn_kernels`` is first imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvarn_eval.codecs import pool_rotated, unrotate
from kvarn_format.geometry import record_layout
from kvarn_format.registry import DenseFormat

__all__ = [
    "KernelKVarNCodec",
    "ServingGroup",
    "check_kernels_usable",
]


def check_kernels_usable(device: torch.device | str) -> None:
    """Fail with a clear message when the Triton kernels cannot run on ``device``.

    On the CPU they need Triton's interpreter, switched on before ``kvarn_kernels`` (which
    decorates its kernels at import) is imported.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(
            "the kernel backends need CUDA, or TRITON_INTERPRET=1 set before kvarn_kernels is "
            "imported (CPU interpreter, tiny sizes only); use --codec-backend reference on a CPU"
        )


def _kk() -> Any:
    import kvarn_kernels

    return kvarn_kernels


def _pool_rows(x: torch.Tensor) -> torch.Tensor:
    """``fp16(saturate(x @ H))`` by the Triton rotation kernel (what the side pool holds)."""
    rot: torch.Tensor = _kk().rotate(x.contiguous())
    return rot


def _decode_records(
    fmt: DenseFormat, records: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``uint8 [N, tile_bytes]`` to original-frame float32 ``[N, G, D]`` K and V."""
    from kvarn_kernels.reference import dequantize_records

    k_rot, v_rot = dequantize_records(fmt, records, head_dim)
    return unrotate(k_rot), unrotate(v_rot)


@dataclass(frozen=True, eq=False)
class KernelKVarNCodec:
    """A dense KVarN format through the Triton kernels (module docstring).

    ``serving=False`` is the ``+store`` backend (store kernel only), ``serving=True`` the
    ``+kernels`` backend (store, pool and attention kernels). ``sinkhorn=False`` runs the store
    with zero Sinkhorn iterations (unit scales: the ``had_*`` ablation). ``eq=False``: rows
    share state only when they share the codec object.
    """

    fmt: DenseFormat
    serving: bool = False
    sinkhorn: bool = True
    sink_tiles: int = 1
    label: str = field(default="")

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = self.fmt.name if self.sinkhorn else "had_" + self.fmt.name.removeprefix("kvarn_")
        return base + ("+kernels" if self.serving else "+store")

    @property
    def group(self) -> int:
        return self.fmt.group

    @property
    def sinkhorn_iters(self) -> int:
        from kvarn_format.reference import DENSE_SINKHORN_ITERS

        return DENSE_SINKHORN_ITERS if self.sinkhorn else 0

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool image, as the reference codec's (the serving rows' attention reads their
        own pool instead, written by :meth:`ServingGroup.write`)."""
        return unrotate(pool_rotated(k)).to(k.dtype), unrotate(pool_rotated(v)).to(v.dtype)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool tile -> ``flush_tiles`` records -> torch decoder, for tiles ``[N, G, D]``."""
        n, g, d = (int(s) for s in k.shape)
        pool_k = pool_rotated(k).to(torch.float16).reshape(n, g, 1, d)
        pool_v = pool_rotated(v).to(torch.float16).reshape(n, g, 1, d)
        tile_bytes = record_layout(self.fmt, d).tile_bytes
        records = torch.zeros((n, 1, tile_bytes), dtype=torch.uint8, device=k.device)
        ids = torch.arange(n, dtype=torch.int32, device=k.device)
        _kk().flush_tiles(
            self.fmt, pool_k, pool_v, ids, records, ids, sinkhorn_iters=self.sinkhorn_iters
        )
        kq, vq = _decode_records(self.fmt, records[:, 0], d)
        return kq.to(k.dtype), vq.to(v.dtype)


class ServingGroup:
    """One layer's serving state for the rows sharing one ``serving`` codec.

    Row ``i`` of the group (batch row ``rows[i]``) owns ``max_blocks`` consecutive blocks
    (from ``i * max_blocks`` when built) of a paged record cache; every block starts with its
    own pool slot (``block_to_slot[b] = b``) and gives it up when flushed. Sequence positions
    count from the row's first real token (``offsets``: left padding of batched prompts is
    never written).
    """

    def __init__(
        self,
        codec: KernelKVarNCodec,
        rows: Sequence[int],
        offsets: Sequence[int],
        heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device,
    ) -> None:
        check_kernels_usable(device)
        self.codec = codec
        self.rows = list(rows)
        self.offsets = [int(offsets[r]) for r in self.rows]
        self.heads, self.head_dim, self.device = heads, head_dim, device
        g = codec.group
        self.max_blocks = -(-capacity // g)
        nb = len(self.rows) * self.max_blocks
        self.tile_bytes = record_layout(codec.fmt, head_dim).tile_bytes
        self.kv_cache = torch.zeros((nb, heads, self.tile_bytes), dtype=torch.uint8, device=device)
        self.pool_k = torch.zeros((nb, g, heads, head_dim), dtype=torch.float16, device=device)
        self.pool_v = torch.zeros_like(self.pool_k)
        self.block_to_slot = torch.arange(nb, dtype=torch.int32, device=device)
        self.block_table = self.block_to_slot.reshape(len(self.rows), self.max_blocks).clone()
        self.seq = [0] * len(self.rows)  # real tokens stored per row
        self._block_base = [i * self.max_blocks for i in range(len(self.rows))]
        self._row_idx = torch.tensor(self.rows, dtype=torch.long, device=device)
        self._new = [0] * len(self.rows)  # real tokens of the current step per row

    def select(self, new_index: dict[int, int]) -> bool:
        """Keep the rows present in ``new_index`` (old batch row -> new); False when none is.

        A dropped row's blocks stay allocated (unused); the kept rows' state is unchanged.
        """
        keep = [i for i, r in enumerate(self.rows) if r in new_index]
        self.rows = [new_index[self.rows[i]] for i in keep]
        self.offsets = [self.offsets[i] for i in keep]
        self.seq = [self.seq[i] for i in keep]
        self._new = [self._new[i] for i in keep]
        self._block_base = [self._block_base[i] for i in keep]
        self.block_table = self.block_table[keep].contiguous()
        self._row_idx = torch.tensor(self.rows, dtype=torch.long, device=self.device)
        return bool(keep)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Store a step's tokens (buffer positions ``start..``) of the group's rows in the pool.

        ``key_states``/``value_states`` are the whole batch ``[B, Hk, T, D]``. Padding
        positions (before a row's offset) are not written, as vLLM never sees them.
        """
        t = int(key_states.shape[2])
        g = self.codec.group
        src: list[int] = []  # index into the group's [R * T] token rows
        dst: list[int] = []  # pool slot index (block * G + offset in block)
        for i, off in enumerate(self.offsets):
            first = max(start, off)  # first real buffer position of this step
            n_real = max(0, start + t - first)
            if self.seq[i] + n_real > self.max_blocks * g:
                raise ValueError(
                    f"row {self.rows[i]} needs more than the {self.max_blocks * g} tokens its "
                    "serving cache was built for; pass a larger capacity"
                )
            for pos in range(first, start + t):
                p = pos - off
                src.append(i * t + pos - start)
                dst.append((self._block_base[i] + p // g) * g + p % g)
            self._new[i] = n_real
            self.seq[i] += n_real
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for x, pool in ((key_states, self.pool_k), (value_states, self.pool_v)):
            rows = x.index_select(0, self._row_idx).permute(0, 2, 1, 3)  # [R, T, Hk, D]
            tokens = rows.reshape(-1, self.heads, self.head_dim).index_select(0, src_t)
            pool.view(-1, self.heads, self.head_dim)[dst_t] = _pool_rows(tokens)

    def flush(self, spans: Sequence[tuple[int, int, int]]) -> list[tuple[torch.Tensor, ...]]:
        """Flush ``(group row index, first tile, end tile)`` spans with ``flush_tiles``.

        Returns, per span, the decoded image ``(k, v)`` as ``[Hk * n, G, D]`` float32 in the
        original frame (head-major, as :meth:`TiledLayer.put_tiles` takes it).
        """
        if not spans:
            return []
        blocks = torch.cat(
            [
                torch.arange(self._block_base[i] + a, self._block_base[i] + b, dtype=torch.int32)
                for i, a, b in spans
            ]
        ).to(self.device)
        src = self.block_to_slot[blocks.long()].clone()
        if bool((src < 0).any()):
            raise RuntimeError("a tile was flushed twice (its pool slot is already released)")
        _kk().flush_tiles(
            self.codec.fmt,
            self.pool_k,
            self.pool_v,
            src,
            self.kv_cache,
            blocks,
            sinkhorn_iters=self.codec.sinkhorn_iters,
        )
        self.block_to_slot[blocks.long()] = -1
        out: list[tuple[torch.Tensor, ...]] = []
        at = 0
        for _, a, b in spans:
            n = b - a
            rec = self.kv_cache[blocks[at : at + n].long()]  # [n, Hk, bytes]
            rec = rec.transpose(0, 1).reshape(self.heads * n, self.tile_bytes)
            out.append(_decode_records(self.codec.fmt, rec, self.head_dim))
            at += n
        return out

    def attention(self, query: torch.Tensor, out: torch.Tensor, scaling: float) -> None:
        """Replace the group rows' attention output by the serving kernels' output.

        ``query``: the batch's ``[B, Hq, T, D]`` queries (post-RoPE, unrotated);
        ``out``: the batch's ``[B, T, Hq, D]`` output, overwritten in place for the group's rows
        at their real (non-padding) tokens. Call after :meth:`write` of the same step.
        """
        kk = _kk()
        t = int(query.shape[2])
        sel = [i for i in range(len(self.rows)) if self._new[i] > 0]
        if not sel:
            return
        idx = torch.tensor(sel, dtype=torch.long, device=self.device)
        table = self.block_table.index_select(0, idx).contiguous()
        seq = [self.seq[i] for i in sel]
        seq_t = torch.tensor(seq, dtype=torch.int32, device=self.device)
        if t == 1:
            q = query[[self.rows[i] for i in sel], :, 0].to(torch.float16).contiguous()
            o = kk.decode_attention(
                self.codec.fmt,
                q,
                self.kv_cache,
                self.pool_k,
                self.pool_v,
                table,
                seq_t,
                self.block_to_slot,
                scaling,
            )
            for j, i in enumerate(sel):
                out[self.rows[i], 0] = o[j].to(out.dtype)
            return
        qs = [query[self.rows[i], :, t - self._new[i] :].transpose(0, 1) for i in sel]
        q = torch.cat(qs).to(torch.float16).contiguous()  # [sum n, Hq, D]
        qsl = [0]
        for i in sel:
            qsl.append(qsl[-1] + self._new[i])
        o = kk.prefill_attention(
            self.codec.fmt,
            q,
            self.kv_cache,
            self.pool_k,
            self.pool_v,
            table,
            torch.tensor(qsl, dtype=torch.int32, device=self.device),
            seq_t,
            self.block_to_slot,
            scaling,
            seq_lens_cpu=seq,
            query_start_loc_cpu=qsl,
        )
        for j, i in enumerate(sel):
            out[self.rows[i], t - self._new[i] :] = o[qsl[j] : qsl[j + 1]].to(out.dtype)
