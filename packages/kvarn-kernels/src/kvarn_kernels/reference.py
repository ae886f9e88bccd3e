"""Pure-torch references of every op, in float64 where it matters, for tests and benchmarks.

They follow kvarn-format's reference codec: records decode exactly as
:func:`kvarn_format.reference.decode_rotated_tiles` does (same fp32 operations in the same
order; a test checks bit equality), the store reference *is* the reference encoder, and the
attention references work in float64 on the decoded values. They are written for clarity, not
speed (a Python loop over requests), and run on any device.
"""

from __future__ import annotations

import numpy as np
import torch

from kvarn_format.hadamard import hadamard_matrix as _np_hadamard
from kvarn_format.reference import encode_rotated_tiles
from kvarn_format.registry import KVarNFormat
from kvarn_kernels._common import (
    codes_from_cache_order,
    codes_to_cache_order,
    dense_geometry,
    pool_shadow_rows,
    resolve_format,
)

__all__ = [
    "decode_attention_ref",
    "dequantize_records",
    "flush_tiles_ref",
    "gather_kv",
    "pool_tile",
    "prefill_attention_ref",
    "rotate_ref",
    "shadow_view",
    "unpack_codes_torch",
    "write_side_pool_ref",
]


def _h64(d: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(_np_hadamard(d))).to(device)


def rotate_ref(x: torch.Tensor) -> torch.Tensor:
    """``fp16(saturate(x @ H))`` with the product in float64."""
    y = x.double() @ _h64(x.shape[-1], x.device)
    return y.clamp(-65504.0, 65504.0).to(torch.float16)


def shadow_view(kv_cache: torch.Tensor, block: int, shadow: int, head_dim: int) -> torch.Tensor:
    """The shadow rows in block ``block``'s record area, a writable fp16 view ``[Hk, 2, R, D]``
    (``[:, 0]`` K rows, ``[:, 1]`` V rows; kvarn_format.geometry.shadow_rows)."""
    hk = kv_cache.shape[1]
    area = kv_cache[block, :, : 4 * shadow * head_dim]
    return area.view(torch.float16).view(hk, 2, shadow, head_dim)


def pool_tile(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    slot: int,
    block: int,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole fp16 tile ``[G, Hk, D]`` (K, V) of pool-resident block ``block`` in ``slot``:
    its shadow rows from the block's record area, the rest from the pool slot."""
    shadow = pool_shadow_rows(pool_k, group, kv_cache)
    if shadow == 0:
        return pool_k[slot], pool_v[slot]
    assert kv_cache is not None  # pool_shadow_rows checked it
    rows = shadow_view(kv_cache, block, shadow, pool_k.shape[3]).transpose(0, 2)  # [R, 2, Hk, D]
    k = torch.cat([rows[:, 0].to(pool_k.device), pool_k[slot]])
    v = torch.cat([rows[:, 1].to(pool_v.device), pool_v[slot]])
    return k, v


def write_side_pool_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_to_slot: torch.Tensor,
    *,
    kv_cache: torch.Tensor | None = None,
    group: int | None = None,
) -> None:
    """Reference of :func:`kvarn_kernels.write_side_pool` (skips padding and pool-less blocks)."""
    g = pool_k.shape[1] if group is None else group
    shadow = pool_shadow_rows(pool_k, g, kv_cache)
    for t, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        blk, row = s // g, s % g
        ps = int(block_to_slot[blk])
        if ps < 0:
            continue
        if row < shadow:
            assert kv_cache is not None
            view = shadow_view(kv_cache, blk, shadow, pool_k.shape[3])
            view[:, 0, row] = rotate_ref(k[t]).to(kv_cache.device)
            view[:, 1, row] = rotate_ref(v[t]).to(kv_cache.device)
        else:
            pool_k[ps, row - shadow] = rotate_ref(k[t])
            pool_v[ps, row - shadow] = rotate_ref(v[t])


def flush_tiles_ref(
    fmt: KVarNFormat | str,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    src_slots: torch.Tensor,
    kv_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    sinkhorn_iters: int = 8,
) -> None:
    """Reference of :func:`kvarn_kernels.flush_tiles`: kvarn-format's NumPy encoder per tile."""
    dense = resolve_format(fmt)
    hk, d = pool_k.shape[2], pool_k.shape[3]
    stride = kv_cache.shape[2]
    tiles = [
        pool_tile(pool_k, pool_v, kv_cache, s, b, dense.group)
        for s, b in zip(src_slots.tolist(), dst_blocks.tolist(), strict=True)
    ]
    k = torch.stack([t[0] for t in tiles]).float().cpu().permute(0, 2, 1, 3)
    v = torch.stack([t[1] for t in tiles]).float().cpu().permute(0, 2, 1, 3)
    k_np = k.reshape(-1, dense.group, d).numpy()
    v_np = v.reshape(-1, dense.group, d).numpy()
    rec = torch.from_numpy(encode_rotated_tiles(dense, k_np, v_np, sinkhorn_iters=sinkhorn_iters))
    # Records padded to the cache's stride with zeros (what the store writes past the payload).
    padded = torch.zeros(rec.shape[0], stride, dtype=torch.uint8)
    padded[:, : rec.shape[1]] = rec
    padded = codes_to_cache_order(padded, dense_geometry(dense, d, stride))
    kv_cache[dst_blocks.long()] = padded.reshape(-1, hk, stride).to(kv_cache.device)


def unpack_codes_torch(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of the format's LSB-first bitstream packing: ``uint8[..., n*bits/8]`` to codes."""
    lead = packed.shape[:-1]
    grouped = packed.reshape(*lead, n // 8, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (grouped << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, n).to(torch.float32)


def dequantize_records(
    fmt: KVarNFormat | str, records: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``uint8 [N, stride]`` as a paged cache holds them (code bytes in the in-cache
    order, :mod:`kvarn_format.cache_order`) to rotated-frame ``(k, v)``, each fp32 ``[N, G, D]``.

    Same operations as ``kvarn_format.reference.decode_rotated_tiles``:
    ``k[d, t] = (code * k_scale[d] + k_zero[d]) * k_token_scale[t]`` and
    ``v[t, d] = (code * v_scale[t] + v_zero[t]) * v_channel_scale[d]``, in fp32.
    """
    dense = resolve_format(fmt)
    geo = dense_geometry(dense, head_dim, int(records.shape[-1]))
    records = codes_from_cache_order(records, geo)
    g, d = dense.group, head_dim
    n = records.shape[0]

    def f16(off: int, count: int) -> torch.Tensor:
        return records[:, off : off + 2 * count].contiguous().view(torch.float16).float()

    kq = unpack_codes_torch(
        records[:, geo.k_codes : geo.k_codes + d * g * dense.key_bits // 8].reshape(n, d, -1),
        dense.key_bits,
        g,
    )
    k = kq * f16(geo.k_scale, d)[:, :, None]
    k = k + f16(geo.k_zero, d)[:, :, None]
    k = k * f16(geo.k_token_scale, g)[:, None, :]
    vq = unpack_codes_torch(
        records[:, geo.v_codes : geo.v_codes + g * d * dense.value_bits // 8].reshape(n, g, -1),
        dense.value_bits,
        d,
    )
    v = vq * f16(geo.v_scale, g)[:, :, None]
    v = v + f16(geo.v_zero, g)[:, :, None]
    v = v * f16(geo.v_channel_scale, d)[:, None, :]
    return k.transpose(1, 2).contiguous(), v


def gather_kv(
    fmt: KVarNFormat | str,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    blocks: torch.Tensor,
    n_tokens: int,
    block_to_slot: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated-frame K and V ``[n_tokens, Hk, D]`` fp32 of one request, from pool or records."""
    dense = resolve_format(fmt)
    g, hk, d = dense.group, pool_k.shape[2], pool_k.shape[3]
    nb = -(-n_tokens // g)
    ks, vs = [], []
    for blk in blocks[:nb].tolist():
        slot = int(block_to_slot[blk])
        if slot >= 0:
            k, v = pool_tile(pool_k, pool_v, kv_cache, slot, blk, g)
            ks.append(k.float())
            vs.append(v.float())
        else:
            k, v = dequantize_records(dense, kv_cache[blk], d)  # [Hk, G, D]
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
    if not ks:
        empty = torch.zeros(0, hk, d, device=pool_k.device)
        return empty, empty
    return torch.cat(ks)[:n_tokens], torch.cat(vs)[:n_tokens]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 causal attention in the rotated frame; q [n, Hq, D] unrotated, k/v rotated."""
    d = q.shape[-1]
    h = _h64(d, q.device)
    hq, hk = q.shape[1], k.shape[1]
    q_rot = q.double() @ h
    kk = k.double().repeat_interleave(hq // hk, dim=1)  # [S, Hq, D]
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("nhd,shd->nhs", q_rot, kk) * scale
    t = torch.arange(k.shape[0], device=q.device)
    mask = t[None, None, :] <= pos[:, None, None]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    o = torch.einsum("nhs,shd->nhd", p, vv)
    return o @ h


def decode_attention_ref(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """float64 reference of :func:`kvarn_kernels.decode_attention` (returns float64)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = gather_kv(fmt, kv_cache, pool_k, pool_v, block_table[b], n, block_to_slot)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, pos, softmax_scale)[0]
    return out


def prefill_attention_ref(
    fmt: KVarNFormat | str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_to_slot: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """float64 reference of :func:`kvarn_kernels.prefill_attention` (returns float64)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    qsl = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        k, v = gather_kv(fmt, kv_cache, pool_k, pool_v, block_table[b], n, block_to_slot)
        pos = n - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        out[q0:q1] = _attend(q[q0:q1], k, v, pos, softmax_scale)
    return out


def fp16_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unquantized float64 attention in the original frame (quality yardstick for tests)."""
    hq, hk = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(hq // hk, dim=1)
    vv = v.double().repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("nhd,shd->nhs", q.double(), kk) * scale
    t = torch.arange(k.shape[0], device=q.device)
    s = s.masked_fill(~(t[None, None, :] <= pos[:, None, None]), float("-inf"))
    return torch.einsum("nhs,shd->nhd", torch.softmax(s, dim=-1), vv)
