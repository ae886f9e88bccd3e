"""The dequantization kernel of ``prefill_attention(method="dequant")`` against the reference.

The records here are random code bytes with finite fp16 scale fields over a wide range, so
that products saturate fp16 and codes cover every value; blocks in the side pool, partial
last blocks and several KV heads are included. On the CPU the kernel runs in Triton's
interpreter (the plain unpack) and must match the reference's fp32 operations bit for bit; on
a GPU (the PTX unpack) the compiler may fuse the multiply-add, so a few elements can land one
fp32 rounding away. Two cases also run with shadow rows (the pool's first rows of each tile
moved into the record area of the tile's block), which must give the same workspace.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_format.geometry import shadow_rows
from kvarn_kernels._common import dense_geometry
from kvarn_kernels.context import dequant_context_into, dequant_plan
from kvarn_kernels.reference import gather_kv, shadow_view

# (format, head_dim): every bit width, G = 64 and 128, D = 64, 128 and 256.
CASES = [
    ("kvarn_k4v2_g128", 128),
    ("kvarn_k4v2_g128", 64),
    ("kvarn_k4v4_g128", 256),
    ("kvarn_k4v2_g64", 256),
    ("kvarn_k4v4_g64", 64),
    ("kvarn_k5v5_g64", 128),
    ("kvarn_k5v5_g64", 256),
]
HK = 2
# Shadow rows (last column): none, or for one 128-token and one 64-token format the most a
# record holds (28) and a single row.
PARAMS = [(n, d, 0) for n, d in CASES] + [
    ("kvarn_k4v2_g128", 64, "max"),
    ("kvarn_k5v5_g64", 128, 1),
]


def _f16_field(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """``n`` finite fp16 values with log-uniform magnitudes in [lo, hi] and random signs."""
    mag = np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def _random_cache(
    name: str, d: int, lens: list[int], device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    fmt = parse_cache_dtype(name)
    g = fmt.group
    layout = record_layout(fmt, d)
    rng = np.random.default_rng(seed)
    nbs = [-(-n // g) for n in lens]
    num_blocks = sum(nbs) + 2
    kv = rng.integers(0, 256, (num_blocks, HK, layout.tile_bytes), dtype=np.uint8)
    # finite scale fields; scales up to 2**13 so that some products exceed the fp16 range
    ranges = {
        "k_scale": (1e-3, 8192.0),
        "k_zero": (1e-3, 3e4),
        "k_token_scale": (0.05, 8.0),
        "v_channel_scale": (0.05, 8.0),
        "v_scale": (1e-3, 8192.0),
        "v_zero": (1e-3, 3e4),
    }
    for fname, (lo, hi) in ranges.items():
        f = layout.field(fname)
        n = f.size // 2
        vals = _f16_field(rng, num_blocks * HK * n, lo, hi).reshape(num_blocks, HK, n)
        kv[:, :, f.offset : f.offset + f.size] = vals.view(np.uint8)
    perm = rng.permutation(num_blocks)
    bt = np.full((len(lens), max(nbs)), -1, dtype=np.int32)
    pos = 0
    for r, nb in enumerate(nbs):
        bt[r, :nb] = perm[pos : pos + nb]
        pos += nb
    # pool: the first block of every request and every third block after it
    pooled = [int(bt[r, j]) for r, nb in enumerate(nbs) for j in range(nb) if j % 3 == 0]
    b2s = np.full(num_blocks, -1, dtype=np.int32)
    b2s[pooled] = np.arange(len(pooled), dtype=np.int32)
    pool = (rng.standard_normal((2, len(pooled), g, HK, d)) * 3e4).astype(np.float16)
    return {
        "kv": torch.from_numpy(kv).to(device),
        "bt": torch.from_numpy(bt).to(device),
        "b2s": torch.from_numpy(b2s).to(device),
        "pool_k": torch.from_numpy(pool[0]).to(device),
        "pool_v": torch.from_numpy(pool[1]).to(device),
    }


def _shadowed(c: dict[str, torch.Tensor], r: int, d: int) -> dict[str, torch.Tensor]:
    """The same cache with each pool tile's first ``r`` rows in its block's record area (over
    the random record bytes) and ``G - r`` rows per pool slot."""
    kv = c["kv"].clone()
    for blk, slot in enumerate(c["b2s"].tolist()):
        if slot >= 0:
            view = shadow_view(kv, blk, r, d)  # [Hk, 2, r, D]
            view[:, 0] = c["pool_k"][slot, :r].transpose(0, 1)
            view[:, 1] = c["pool_v"][slot, :r].transpose(0, 1)
    pool_k = c["pool_k"][:, r:].contiguous()
    pool_v = c["pool_v"][:, r:].contiguous()
    return {**c, "kv": kv, "pool_k": pool_k, "pool_v": pool_v}


def _dequant(
    geo: object, c: dict[str, torch.Tensor], plan: np.ndarray, rows: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    dev = c["kv"].device
    ws_k = torch.full((rows, HK, d), float("nan"), dtype=torch.float16, device=dev)
    ws_v = torch.full_like(ws_k, float("nan"))
    dequant_context_into(
        geo,  # type: ignore[arg-type]
        c["kv"],
        c["pool_k"],
        c["pool_v"],
        c["bt"],
        c["b2s"],
        torch.from_numpy(plan).to(dev),
        ws_k,
        ws_v,
    )
    return ws_k, ws_v


@pytest.mark.parametrize(("name", "d", "shadow"), PARAMS)
def test_dequant_context_matches_reference(
    device: torch.device, name: str, d: int, shadow: int | str
) -> None:
    """Every workspace row is K/2 and V/2 of the reference decode, records saturated to the
    fp16 range, pool blocks copied (with shadow rows: bit for bit what the same tiles give
    without)."""
    fmt = parse_cache_dtype(name)
    g = fmt.group
    lens = [2 * g + 5, g, 3 * g - 1]  # partial last blocks, a full one, pool blocks
    c = _random_cache(name, d, lens, device, seed=d + g)
    geo = dense_geometry(fmt, d, int(c["kv"].shape[-1]))
    plan, k_off = dequant_plan(lens, g)
    ws_k, ws_v = _dequant(geo, c, plan, k_off[-1], d)
    if shadow:
        r = shadow_rows(g, d, int(c["kv"].shape[-1])) if shadow == "max" else int(shadow)
        c = _shadowed(c, r, d)
        sh_k, sh_v = _dequant(geo, c, plan, k_off[-1], d)
        assert torch.equal(sh_k.view(torch.int16), ws_k.view(torch.int16))
        assert torch.equal(sh_v.view(torch.int16), ws_v.view(torch.int16))
        ws_k, ws_v = sh_k, sh_v  # and against the reference, which reads the shadow rows
    for r, n in enumerate(lens):
        k, v = gather_kv(name, c["kv"], c["pool_k"], c["pool_v"], c["bt"][r], n, c["b2s"])
        for what, got, full in (("K", ws_k, k), ("V", ws_v, v)):
            got_r = got[k_off[r] : k_off[r + 1]]
            # records saturate; pool rows are copied as they are (the random pool has infs)
            half = full * 0.5
            want = torch.where(half.isinf(), half, half.clamp(-65504.0, 65504.0)).half()
            assert not torch.isnan(got_r).any(), f"request {r} {what}: rows left unwritten"
            if device.type == "cpu":
                diff = int((got_r.view(torch.int16) != want.view(torch.int16)).sum())
                assert diff == 0, f"request {r} {what}: {diff} of {want.numel()} elements differ"
            else:
                # one fp32 rounding of operands up to ~1e5, times token scales up to 8
                torch.testing.assert_close(got_r.float(), want.float(), rtol=2e-3, atol=0.1)
    # the case does exercise saturation (the kernel clamps to the fp16 limit)
    assert bool((ws_k.abs() == 65504).any() or (ws_v.abs() == 65504).any())
