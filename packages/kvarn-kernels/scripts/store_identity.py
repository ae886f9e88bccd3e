"""CPU (interpreter) identity rate and decoded-error ratio of the store variants vs the reference.

For each variant: the share of records byte-identical to ``kvarn_format.reference``'s, and
for the others the ratio of decoded error (against the input tile) to the reference's own.
Under ``TRITON_INTERPRET=1`` the sums are NumPy's, so v1 is exact and v2/v3 show only their
algebraic differences (one-pass pivoted stds, products in another order); on the GPU the
tree-ordered sums add v1's ~1-ulp noise on top. Used for docs/kernel-notes.md.

    TRITON_INTERPRET=1 uv run python packages/kvarn-kernels/scripts/store_identity.py \\
        [--tiles 24] [--bias 0,8] [--variants v1,v2,v3]

``--bias b`` adds ``b`` times each channel's spread as a per-channel offset (K-like channel
means, which is where one-pass variance loses bits: mean/std = b).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

from kvarn_format import from_cache_order, parse_cache_dtype, record_layout
from kvarn_format.reference import decode_rotated_tiles, encode_rotated_tiles
from kvarn_kernels import flush_tiles
from kvarn_kernels.testing import random_kv


def measure(name: str, d: int, tiles: int, bias: float, variant: str) -> tuple[float, float, int]:
    fmt = parse_cache_dtype(name)
    g, hk = fmt.group, 2
    gen = torch.Generator().manual_seed(7)
    k = random_kv(tiles * g, hk, d, generator=gen).float()
    v = random_kv(tiles * g, hk, d, generator=gen, outliers=False).float()
    if bias:
        k = k + bias * k.std(dim=0, keepdim=True) * torch.sign(torch.randn(1, hk, d, generator=gen))
    pool_k = k.half().reshape(tiles, g, hk, d)
    pool_v = v.half().reshape(tiles, g, hk, d)
    kv = torch.zeros((tiles, hk, record_layout(fmt, d).tile_bytes), dtype=torch.uint8)
    idx = torch.arange(tiles, dtype=torch.int32)
    flush_tiles(name, pool_k, pool_v, idx, kv, idx, variant=variant)
    kt = pool_k.float().permute(0, 2, 1, 3).reshape(-1, g, d).numpy()
    vt = pool_v.float().permute(0, 2, 1, 3).reshape(-1, g, d).numpy()
    ref = encode_rotated_tiles(fmt, kt, vt)
    got = from_cache_order(kv.reshape(-1, kv.shape[2]).numpy(), fmt, d)
    same = np.all(ref == got, axis=1)
    worst = 1.0
    bad = np.nonzero(~same)[0]
    if bad.size:
        kr, vr = decode_rotated_tiles(fmt, ref[bad], d)
        kg, vg = decode_rotated_tiles(fmt, got[bad], d)
        for x, r_dec, g_dec in ((kt[bad], kr, kg), (vt[bad], vr, vg)):
            e_ref = np.linalg.norm((r_dec - x).reshape(bad.size, -1), axis=1)
            e_got = np.linalg.norm((g_dec - x).reshape(bad.size, -1), axis=1)
            worst = max(worst, float(np.max((e_got + 1e-6) / (e_ref + 1e-6))))
    return float(same.mean()), worst, int(same.size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=24)
    ap.add_argument("--bias", default="0,8")
    ap.add_argument("--variants", default="v1,v2,v3")
    ap.add_argument("--formats", default="kvarn_k4v2_g64:64,kvarn_k4v2_g128:128")
    args = ap.parse_args()
    print(
        f"{'format':18s} {'D':>4s} {'bias':>5s} {'variant':8s} {'identical':>10s} {'worst err ratio':>16s}"
    )
    for spec in args.formats.split(","):
        name, d = spec.split(":")
        for bias in (float(b) for b in args.bias.split(",")):
            for variant in args.variants.split(","):
                same, worst, n = measure(name, int(d), args.tiles, bias, variant)
                print(
                    f"{name:18s} {d:>4s} {bias:5.1f} {variant:8s} {same:9.1%} ({n}) {worst:10.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
