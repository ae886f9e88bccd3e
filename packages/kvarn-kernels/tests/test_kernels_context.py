"""The two dequantization kernels of ``prefill_attention(method="dequant")`` write the same bits.

``dequant_variant="v2"`` replaces v1's per-element ``- 1024`` and clamp with exact
equivalents (raw codes as fp16 subnormals against scales times 2**24; a saturating fp16
conversion on the GPU). The records here are random code bytes with finite fp16 scale fields
over a wide range, so that products saturate fp16 and codes cover every value; blocks in the
side pool, partial last blocks and several KV heads are included. On the CPU the kernels run
in Triton's interpreter; on a GPU the same test compares the PTX paths.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_kernels import prefill_attention
from kvarn_kernels._common import dense_geometry
from kvarn_kernels.context import dequant_context_into, dequant_plan

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


@pytest.mark.parametrize(("name", "d"), CASES)
def test_dequant_v2_bitwise_equals_v1(device: torch.device, name: str, d: int) -> None:
    fmt = parse_cache_dtype(name)
    g = fmt.group
    lens = [2 * g + 5, g, 3 * g - 1]  # partial last blocks, a full one, pool blocks
    c = _random_cache(name, d, lens, device, seed=d + g)
    geo = dense_geometry(fmt, d, int(c["kv"].shape[-1]))
    plan, k_off = dequant_plan(lens, g)
    plan_t = torch.from_numpy(plan).to(device)
    out = {}
    for variant in ("v1", "v2"):
        ws_k = torch.full((k_off[-1], HK, d), float("nan"), dtype=torch.float16, device=device)
        ws_v = torch.full_like(ws_k, float("nan"))
        dequant_context_into(
            geo, c["kv"], c["pool_k"], c["pool_v"], c["bt"], c["b2s"], plan_t, ws_k, ws_v, variant
        )
        out[variant] = (ws_k, ws_v)
    for i, what in enumerate(("K", "V")):
        a = out["v1"][i].view(torch.int16)
        b = out["v2"][i].view(torch.int16)
        assert not torch.isnan(out["v1"][i]).any(), f"{what}: v1 left rows unwritten"
        diff = int((a != b).sum())
        assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ between v1 and v2"
    # the case does exercise saturation (both paths clamp to the fp16 limit)
    assert bool((out["v1"][0].abs() == 65504).any() or (out["v1"][1].abs() == 65504).any())


def test_prefill_dequant_variant_same_output(device: torch.device) -> None:
    """``prefill_attention(dequant_variant="v2")`` gives v1's output bit for bit; a bad
    variant, or one passed with ``method="fused"``, is refused."""
    name, d, hq = "kvarn_k4v2_g64", 64, 4
    lens, qlens = [150, 70], [30, 6]
    c = _random_cache(name, d, lens, device, seed=7)
    # moderate scales so that the attention is well conditioned (not needed for the equality)
    q = (torch.randn(sum(qlens), hq, d, generator=torch.Generator().manual_seed(2)) * 1e-4).half()
    q = q.to(device)
    qsl = torch.tensor([0, *np.cumsum(qlens).tolist()], dtype=torch.int32, device=device)
    seqs = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (name, q, c["kv"], c["pool_k"], c["pool_v"], c["bt"], qsl, seqs, c["b2s"], d**-0.5)
    res = [
        prefill_attention(*args, dequant_variant=v)  # type: ignore[arg-type]
        for v in ("v1", "v2")
    ]
    assert torch.equal(res[0].view(torch.int16), res[1].view(torch.int16))
    with pytest.raises(ValueError, match="dequant_variant must be one of"):
        prefill_attention(*args, dequant_variant="v3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="apply to method='dequant' only"):
        prefill_attention(*args, method="fused", dequant_variant="v2")  # type: ignore[arg-type]
