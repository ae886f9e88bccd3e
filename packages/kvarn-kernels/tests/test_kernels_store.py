"""flush_tiles against kvarn-format's reference encoder (bytes) and decoder (values), and
flush_token_tiles (tiles read from token rows, optionally opening with pool rows) against
flush_tiles on the same data. Shadowed pools (each tile's first rows in its block's record
area) must give exactly the records of the unshadowed pool holding the same tiles.

Under the Triton interpreter the kernel's fp32 sums are NumPy's, so records must be
byte-identical. On the GPU the sums inside a standard deviation run as a tree across
threads; that moves a std by about one fp32 ulp, which can move a stored fp16 Sinkhorn
scale by one fp16 ulp (when the fp32 value sits next to an fp16 rounding boundary) and then
change the codes of that tile. Those tiles are still valid encodings of the same data: the
test bounds how many there are and requires that their decoded error against the input is
no worse than the reference's own, within 2%.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvarn_format import from_cache_order, parse_cache_dtype, record_layout
from kvarn_format.geometry import shadow_rows
from kvarn_format.reference import decode_rotated_tiles, encode_rotated_tiles
from kvarn_kernels import flush_tiles, flush_token_tiles
from kvarn_kernels._common import dense_geometry
from kvarn_kernels.reference import flush_tiles_ref, shadow_view
from kvarn_kernels.store import _shadow_parts
from kvarn_kernels.testing import random_kv

INTERPRET = not torch.cuda.is_available()


def _pool(
    g: int, hk: int, d: int, slots: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = random_kv(slots * g, hk, d, generator=gen).reshape(slots, g, hk, d)
    v = random_kv(slots * g, hk, d, generator=gen, outliers=False).reshape(slots, g, hk, d)
    k[0, :, 0] = 0.5  # a constant tile (all stds zero)
    v[0, :, 0] = -2.0
    if slots > 1:
        k[1, 3, -1] = 3000.0  # one huge outlier token
        v[1, :, -1, 7] *= 500.0  # an outlier channel
    return k.half().to(device), v.half().to(device)


def _check_records(
    name: str,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    src: torch.Tensor,
    kv: torch.Tensor,
    dst: torch.Tensor,
    rounding: str,
    exact: bool,
    min_identical: float = 0.75,
    max_ratio: float = 1.02,
) -> None:
    fmt = parse_cache_dtype(name)
    _, g, _hk, d = pool_k.shape
    slots = src.long().cpu()
    k = pool_k[slots].float().cpu().permute(0, 2, 1, 3).reshape(-1, g, d).numpy()
    v = pool_v[slots].float().cpu().permute(0, 2, 1, 3).reshape(-1, g, d).numpy()
    ref = encode_rotated_tiles(fmt, k, v, slot_rounding=rounding)  # type: ignore[arg-type]
    got = from_cache_order(kv[dst.long()].cpu().reshape(-1, kv.shape[2]).numpy(), fmt, d)
    same = np.all(ref == got, axis=1)
    if exact:
        assert same.all(), f"{int((~same).sum())} of {same.size} records differ"
        return
    bad = np.nonzero(~same)[0]
    ratios = [1.0]
    if bad.size:
        kr, vr = decode_rotated_tiles(fmt, ref[bad], d, slot_rounding=rounding)  # type: ignore[arg-type]
        kg, vg = decode_rotated_tiles(fmt, got[bad], d, slot_rounding=rounding)  # type: ignore[arg-type]
        for x, r_dec, g_dec in ((k[bad], kr, kg), (v[bad], vr, vg)):
            err_ref = np.linalg.norm((r_dec - x).reshape(bad.size, -1), axis=1)
            err_got = np.linalg.norm((g_dec - x).reshape(bad.size, -1), axis=1)
            # The slack (2^-9 of the tile's norm, fp16-rounding level) covers degenerate tiles
            # that the reference happens to reconstruct exactly (a constant tile kept at the
            # identity scaling, err_ref = 0) while a valid alternative scaling leaves fp16
            # rounding noise; it is far below any 2- to 5-bit quantization error.
            slack = 2.0**-9 * np.linalg.norm(x.reshape(bad.size, -1), axis=1)
            ratios += list((err_got + 1e-6) / (err_ref + slack + 1e-6))
    stats = (
        f"{same.mean():.1%} of {same.size} records byte-identical; decoded-error ratio of the "
        f"others: max {max(ratios):.4f}, mean {np.mean(ratios):.4f}"
    )
    print(stats)
    assert same.mean() >= min_identical, stats
    assert max(ratios) <= max_ratio, stats


CPU_CASES = [
    ("kvarn_k4v2_g64", 64, 2, 3),
    ("kvarn_k4v4_g64", 64, 1, 2),
    ("kvarn_k5v5_g64", 64, 2, 2),
    ("kvarn_k4v2_g128", 64, 1, 2),
    ("kvarn_k4v4_g128", 128, 1, 2),
]


# One-pass (pivoted) stds differ from the reference's two-pass ones by fp32 rounding (v3's and
# v4's, which also take the products in another order: rowstd(x * c) * r for rowstd(x * c * r);
# the bars are named after v2, the first one-pass store, removed in the thirteenth session).
# Sinkhorn keeps its best-imbalance iteration, and on the stress tiles (a constant tile, one
# huge outlier token) near-equal scores then pick another iteration: a different, equally
# balanced scaling whose decoded error can be a little larger on that tile.
V2_BARS = {"min_identical": 0.6, "max_ratio": 1.25}
VARIANTS = ["v1", "v3", "v4"]
VARIANT_IDS = ["variant1", "variant3", "variant4"]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize(("name", "d", "hk", "n"), CPU_CASES)
def test_flush_tiles_matches_reference_bytes(
    device: torch.device, name: str, d: int, hk: int, n: int, variant: str
) -> None:
    fmt = parse_cache_dtype(name)
    g = fmt.group
    pool_k, pool_v = _pool(g, hk, d, n + 1, seed=d + n, device=device)
    tile = record_layout(fmt, d).tile_bytes
    num_blocks = n + 3
    kv = torch.randint(0, 256, (num_blocks, hk, tile), dtype=torch.uint8).to(device)
    before = kv.clone()
    src = torch.arange(n, dtype=torch.int32, device=device).flip(0)
    dst = torch.randperm(num_blocks)[:n].to(torch.int32).to(device)
    flush_tiles(name, pool_k, pool_v, src, kv, dst, variant=variant)
    if variant == "v1":
        _check_records(name, pool_k, pool_v, src, kv, dst, "align8", exact=INTERPRET)
    else:
        # Half of these few records are stress tiles: bound the error only (the identity
        # rate is checked on more tiles below and in the GPU test).
        bars = {**V2_BARS, "min_identical": 0.0}
        _check_records(name, pool_k, pool_v, src, kv, dst, "align8", exact=False, **bars)
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[dst.long().cpu()] = False
    assert torch.equal(kv.cpu()[untouched], before.cpu()[untouched])


@pytest.mark.parametrize("variant", ["v3", "v4"])
def test_flush_tiles_identity_rate(device: torch.device, variant: str) -> None:
    name, d, hk, n = "kvarn_k4v2_g64", 64, 2, 8
    pool_k, pool_v = _pool(64, hk, d, n, seed=21, device=device)
    tile = record_layout(parse_cache_dtype(name), d).tile_bytes
    kv = torch.zeros((n, hk, tile), dtype=torch.uint8, device=device)
    src = torch.arange(n, dtype=torch.int32, device=device)
    flush_tiles(name, pool_k, pool_v, src, kv, src, variant=variant)
    _check_records(name, pool_k, pool_v, src, kv, src, "align8", exact=False, **V2_BARS)


@pytest.mark.parametrize(
    ("name", "d", "shadow"),
    [("kvarn_k4v2_g64", 64, False), ("kvarn_k4v4_g128", 64, True), ("kvarn_k5v5_g64", 128, False)],
)
def test_flush_v4_matches_v3(device: torch.device, name: str, d: int, shadow: bool) -> None:
    """v4 computes v3's values (its per-row and per-column work in a compact layout, through
    scratch in the record's own code bytes, and its divisions through shared reciprocals).
    Under the interpreter, whose sums are NumPy's in any layout, its records are v3's byte
    for byte, also where the scratch shares the record area with shadow rows. On the GPU the
    entries' sums in the pivots run in another order, so there it is held to v3's bars."""
    fmt = parse_cache_dtype(name)
    g, hk, n = fmt.group, 2, 5
    tile = record_layout(fmt, d).tile_bytes
    pool_k, pool_v = _pool(g, hk, d, n, seed=41, device=device)
    pool_v[2] = 0.25  # a constant V tile
    kv = torch.randint(0, 256, (n + 2, hk, tile), dtype=torch.uint8, device=device)
    src = torch.arange(n, dtype=torch.int32, device=device)
    dst = torch.tensor([3, 0, 6, 2, 5], dtype=torch.int32, device=device)

    def flush(variant: str) -> torch.Tensor:
        out = kv.clone()
        pk, pv = pool_k, pool_v
        if shadow:
            r = shadow_rows(g, d, tile)
            pk, pv = _shadowed(pool_k, pool_v, out, dict(enumerate(dst.tolist())), r)
        flush_tiles(name, pk, pv, src, out, dst, variant=variant)
        return out

    got, want = flush("v4"), flush("v3")
    if INTERPRET:
        assert torch.equal(got.cpu(), want.cpu()), "v4's records differ from v3's"
    else:
        bars = {**V2_BARS, "min_identical": 0.0}
        _check_records(name, pool_k, pool_v, src, got, dst, "align8", exact=False, **bars)


@pytest.mark.gpu
def test_store_division_is_correctly_rounded(device: torch.device) -> None:
    """v4's division through the divisor's correctly rounded reciprocal and one fma
    correction (store._div_by) equals IEEE division on the GPU, on the operand ranges the
    store divides: fp16 tile values over Sinkhorn scales, and RTN offsets over steps."""
    import triton
    import triton.language as tl

    from kvarn_kernels.store import _div_by

    @triton.jit
    def div_kernel(X, D, OUT, N: tl.constexpr) -> None:
        i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        ok = i < N
        x = tl.load(X + i, mask=ok, other=1.0)
        d = tl.load(D + i, mask=ok, other=1.0)
        tl.store(OUT + i, _div_by(x, tl.div_rn(1.0, d), d, True), mask=ok)

    gen = torch.Generator().manual_seed(5)
    n = 1 << 22
    cases = [
        (
            (torch.randn(n, generator=gen) * 300).half().float(),
            torch.empty(n).uniform_(-0.3, 10.0, generator=gen).exp().half().float(),
        ),
        (
            torch.rand(n, generator=gen) * 2e4,
            (10.0 ** torch.empty(n).uniform_(-10, 3, generator=gen)).clamp_min(1e-10),
        ),
        (
            torch.randn(n, generator=gen) * torch.empty(n).uniform_(-12, 12, generator=gen).exp(),
            torch.empty(n).uniform_(-25, 12, generator=gen).exp(),
        ),
    ]
    for x, d in cases:
        x, d = x.to(device), d.to(device)
        out = torch.empty_like(x)
        div_kernel[(triton.cdiv(n, 1024),)](x, d, out, n)
        want = x / d
        bad = int((out != want).sum())
        assert bad == 0, f"{bad} quotients differ from IEEE division"


def test_flush_tiles_head_dim_256_pow2_stride(device: torch.device) -> None:
    name = "kvarn_k4v2_g64"
    fmt = parse_cache_dtype(name)
    pool_k, pool_v = _pool(64, 1, 256, 1, seed=3, device=device)
    stride = record_layout(fmt, 256, slot_rounding="pow2").tile_bytes
    kv = torch.randint(0, 256, (2, 1, stride), dtype=torch.uint8).to(device)
    src = torch.tensor([0], dtype=torch.int32, device=device)
    dst = torch.tensor([1], dtype=torch.int32, device=device)
    flush_tiles(name, pool_k, pool_v, src, kv, dst, variant="v1")  # v1: exact under INTERPRET
    _check_records(name, pool_k, pool_v, src, kv, dst, "pow2", exact=INTERPRET)


def test_flush_tiles_head_dim_512_torch_path(device: torch.device) -> None:
    # D=512 runs as batched torch ops, whose reductions are not NumPy's: bounded, not exact.
    # With 512-wide rows a tile holds more scales that can sit on an fp16 rounding boundary,
    # and an ulp in a std can move Sinkhorn's best-imbalance pick to another iteration (a
    # different, equally valid scaling): looser bounds than the Triton path.
    name = "kvarn_k4v4_g64"
    pool_k, pool_v = _pool(64, 2, 512, 2, seed=5, device=device)
    tile = record_layout(parse_cache_dtype(name), 512).tile_bytes
    kv = torch.zeros((3, 2, tile), dtype=torch.uint8, device=device)
    src = torch.tensor([1, 0], dtype=torch.int32, device=device)
    dst = torch.tensor([2, 0], dtype=torch.int32, device=device)
    flush_tiles(name, pool_k, pool_v, src, kv, dst)
    _check_records(
        name,
        pool_k,
        pool_v,
        src,
        kv,
        dst,
        "align8",
        exact=False,
        min_identical=0.25,
        max_ratio=1.25,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "d"),
    [
        ("kvarn_k4v2_g128", 128),
        ("kvarn_k4v4_g128", 128),
        ("kvarn_k4v2_g64", 128),
        ("kvarn_k4v4_g64", 128),
        ("kvarn_k5v5_g64", 128),
        ("kvarn_k4v2_g128", 256),
        ("kvarn_k4v2_g128", 64),
        ("kvarn_k5v5_g64", 512),
    ],
)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_flush_tiles_many_tiles_gpu(device: torch.device, name: str, d: int, variant: str) -> None:
    fmt = parse_cache_dtype(name)
    hk, n = 8, 64
    pool_k, pool_v = _pool(fmt.group, hk, d, n, seed=11, device=device)
    tile = record_layout(fmt, d).tile_bytes
    kv = torch.randint(0, 256, (2 * n, hk, tile), dtype=torch.uint8, device=device)
    src = torch.randperm(n).to(torch.int32).to(device)
    dst = (torch.randperm(2 * n)[:n]).to(torch.int32).to(device)
    flush_tiles(name, pool_k, pool_v, src, kv, dst, variant=variant)
    loose = d > 256 or variant != "v1"  # the torch path (see the D=512 test), or V2_BARS
    _check_records(
        name,
        pool_k,
        pool_v,
        src,
        kv,
        dst,
        "align8",
        exact=False,
        min_identical=(0.25 if d > 256 else V2_BARS["min_identical"]) if loose else 0.75,
        max_ratio=1.25 if loose else 1.02,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("group", "tiles but the pool holds"),
        ("stride", "record at head_dim"),
        ("slots_dtype", "src_slots must have dtype"),
        ("mla", "MLA format"),
        ("variant", "variant must be"),
    ],
)
def test_flush_tiles_validation(device: torch.device, change: str, message: str) -> None:
    name = "kvarn_mla_k4_g128" if change == "mla" else "kvarn_k4v2_g64"
    g = 128 if change == "group" else 64
    pool = torch.zeros(1, g, 1, 64, dtype=torch.float16, device=device)
    tile = record_layout(parse_cache_dtype("kvarn_k4v2_g64"), 64).tile_bytes
    kv = torch.zeros(
        1, 1, tile - (8 if change == "stride" else 0), dtype=torch.uint8, device=device
    )
    idx_dtype = torch.int64 if change == "slots_dtype" else torch.int32
    src = torch.zeros(1, dtype=idx_dtype, device=device)
    dst = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=message):
        flush_tiles(
            name, pool, pool.clone(), src, kv, dst, variant="v9" if change == "variant" else "v1"
        )


# ----------------------------------------------------------------------------- token rows


def _token_rows(
    n_rows: int, hk: int, d: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = random_kv(n_rows, hk, d, generator=gen)
    v = random_kv(n_rows, hk, d, generator=gen, outliers=False)
    return k.half().to(device), v.half().to(device)


def _expected_records(
    name: str,
    tiles_k: list[torch.Tensor],
    tiles_v: list[torch.Tensor],
    kv_like: torch.Tensor,
    variant: str = "v1",
) -> torch.Tensor:
    """Records of ``[G, Hk, D]`` tiles as flush_tiles writes them from pool slots 0..N-1."""
    pool_k = torch.stack(tiles_k).contiguous()
    pool_v = torch.stack(tiles_v).contiguous()
    n = pool_k.shape[0]
    out = torch.zeros((n, *kv_like.shape[1:]), dtype=torch.uint8, device=kv_like.device)
    idx = torch.arange(n, dtype=torch.int32, device=kv_like.device)
    flush_tiles(name, pool_k, pool_v, idx, out, idx, variant=variant)
    return out


@pytest.mark.parametrize(
    ("name", "d", "hk", "variant"),
    [
        ("kvarn_k4v2_g64", 64, 2, "v1"),
        ("kvarn_k5v5_g64", 64, 1, "v1"),
        ("kvarn_k4v4_g128", 64, 1, "v1"),
        ("kvarn_k4v2_g64", 64, 1, "v4"),
        ("kvarn_k4v4_g128", 64, 1, "v3"),
    ],
)
def test_flush_token_tiles_equals_flush_tiles_bytes(
    device: torch.device, name: str, d: int, hk: int, variant: str
) -> None:
    """Tiles read from token rows (at rows that are not multiples of G) and tiles that open
    with side-pool rows give exactly flush_tiles' records on the same data."""
    fmt = parse_cache_dtype(name)
    g = fmt.group
    k_rows, v_rows = _token_rows(3 * g + 7, hk, d, seed=d + hk, device=device)
    pool_k, pool_v = _pool(g, hk, d, 3, seed=5, device=device)
    tile = record_layout(fmt, d).tile_bytes
    kv = torch.randint(0, 256, (6, hk, tile), dtype=torch.uint8).to(device)
    before = kv.clone()
    # tile 0: rows [5, 5+G); tile 1: pool slot 2's first 9 rows, then rows [2G+7-(G-9), ...)
    # (ends at the last row); tile 2: rows [G+3, 2G+3); tile 3: skipped (negative row).
    head = 9
    starts = [5, 3 * g + 7 - (g - head), g + 3, -1]
    lens = [0, head, 0, 0]
    slots = [-1, 2, 7, 1]  # slots of head-less tiles are ignored, whatever they hold
    dst = [4, 0, 2, 5]
    i32 = {"dtype": torch.int32, "device": device}
    flush_token_tiles(
        name,
        k_rows,
        v_rows,
        torch.tensor(starts, **i32),
        kv,
        torch.tensor(dst, **i32),
        pool_k=pool_k,
        pool_v=pool_v,
        head_slots=torch.tensor(slots, **i32),
        head_lens=torch.tensor(lens, **i32),
        variant=variant,
        check=True,
    )
    tiles_k = [
        k_rows[5 : 5 + g],
        torch.cat([pool_k[2, :head], k_rows[starts[1] :]]),
        k_rows[g + 3 : 2 * g + 3],
    ]
    tiles_v = [
        v_rows[5 : 5 + g],
        torch.cat([pool_v[2, :head], v_rows[starts[1] :]]),
        v_rows[g + 3 : 2 * g + 3],
    ]
    want = _expected_records(name, tiles_k, tiles_v, kv, variant)
    for i, block in enumerate(dst[:3]):
        assert torch.equal(kv[block].cpu(), want[i].cpu()), f"tile {i} differs from flush_tiles"
    untouched = [b for b in range(6) if b not in dst[:3]]
    assert torch.equal(kv[untouched].cpu(), before[untouched].cpu()), "a skipped tile was written"
    # Without heads (all four head arguments left out) the same rows give the same records.
    kv2 = before.clone()
    flush_token_tiles(
        name,
        k_rows,
        v_rows,
        torch.tensor([5, g + 3], **i32),
        kv2,
        torch.tensor([4, 2], **i32),
        variant=variant,
    )
    assert torch.equal(kv2[4].cpu(), want[0].cpu()) and torch.equal(kv2[2].cpu(), want[2].cpu())


def test_flush_token_tiles_head_dim_512_torch_path(device: torch.device) -> None:
    name = "kvarn_k4v4_g64"
    fmt = parse_cache_dtype(name)
    g, hk, d = 64, 1, 512
    k_rows, v_rows = _token_rows(g + 11, hk, d, seed=9, device=device)
    pool_k, pool_v = _pool(g, hk, d, 2, seed=4, device=device)
    tile = record_layout(fmt, d).tile_bytes
    kv = torch.randint(0, 256, (3, hk, tile), dtype=torch.uint8).to(device)
    before = kv.clone()
    i32 = {"dtype": torch.int32, "device": device}
    flush_token_tiles(
        name,
        k_rows,
        v_rows,
        torch.tensor([11, g + 11 - (g - 20), -1], **i32),
        kv,
        torch.tensor([1, 0, 2], **i32),
        pool_k=pool_k,
        pool_v=pool_v,
        head_slots=torch.tensor([0, 1, 0], **i32),
        head_lens=torch.tensor([0, 20, 0], **i32),
    )
    tiles_k = [k_rows[11 : 11 + g], torch.cat([pool_k[1, :20], k_rows[g + 11 - 44 :]])]
    tiles_v = [v_rows[11 : 11 + g], torch.cat([pool_v[1, :20], v_rows[g + 11 - 44 :]])]
    want = _expected_records(name, tiles_k, tiles_v, kv)
    assert torch.equal(kv[1].cpu(), want[0].cpu())
    assert torch.equal(kv[0].cpu(), want[1].cpu())
    assert torch.equal(kv[2].cpu(), before[2].cpu()), "the skipped tile was written"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("partial_heads", "go together"),
        ("rows_dtype", "k_rows must have dtype"),
        ("rows_shape", "v_rows must have k_rows' shape"),
        ("starts_dtype", "row_starts must have dtype"),
        ("pool_geometry", "the pool holds"),
        ("past_end", "reads rows"),
        ("head_len", "head_lens must lie in"),
        ("head_slot", "head_slots must name pool slots"),
        ("block", "dst_blocks must lie in"),
    ],
)
def test_flush_token_tiles_validation(device: torch.device, change: str, message: str) -> None:
    name = "kvarn_k4v2_g64"
    g, d = 64, 64
    rows = torch.zeros(g + 4, 1, d, dtype=torch.float16, device=device)
    v_rows = rows.clone() if change != "rows_shape" else rows[:-1].clone()
    if change == "rows_dtype":
        rows = rows.float()
    pool = torch.zeros(2, g, 2 if change == "pool_geometry" else 1, d, dtype=torch.float16)
    pool = pool.to(device)
    tile = record_layout(parse_cache_dtype(name), d).tile_bytes
    kv = torch.zeros(2, 1, tile, dtype=torch.uint8, device=device)
    i32 = {"dtype": torch.int32, "device": device}
    starts = torch.tensor(
        [10 if change == "past_end" else 0], dtype=torch.int64 if change == "starts_dtype" else None
    ).to(device)
    if change != "starts_dtype":
        starts = starts.to(torch.int32)
    dst = torch.tensor([7 if change == "block" else 1], **i32)
    slots = torch.tensor([9 if change == "head_slot" else 0], **i32)
    lens = torch.tensor([g if change == "head_len" else 3], **i32)
    kwargs: dict[str, Any] = {
        "pool_k": pool,
        "pool_v": pool.clone(),
        "head_slots": slots,
        "head_lens": lens,
    }
    if change == "partial_heads":
        del kwargs["head_lens"]
    with pytest.raises(ValueError, match=message):
        flush_token_tiles(name, rows, v_rows, starts, kv, dst, check=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "d"), [("kvarn_k4v2_g128", 128), ("kvarn_k4v4_g128", 128)])
def test_flush_token_tiles_many_tiles_gpu(device: torch.device, name: str, d: int) -> None:
    """Token-row tiles (every other one opening with pool rows) against the reference codec,
    with flush_tiles' GPU bars (the masked kernel runs the same arithmetic)."""
    fmt = parse_cache_dtype(name)
    g, hk, n = fmt.group, 8, 48
    k_rows, v_rows = _token_rows(n * g + 5, hk, d, seed=13, device=device)
    pool_k, pool_v = _pool(g, hk, d, n, seed=17, device=device)
    heads = [(i * 37) % g if i % 2 else 0 for i in range(n)]
    starts = [i * g + 5 for i in range(n)]
    tile = record_layout(fmt, d).tile_bytes
    kv = torch.zeros((n, hk, tile), dtype=torch.uint8, device=device)
    i32 = {"dtype": torch.int32, "device": device}
    idx = torch.arange(n, **i32)
    flush_token_tiles(
        name,
        k_rows,
        v_rows,
        torch.tensor(starts, **i32),
        kv,
        idx,
        pool_k=pool_k,
        pool_v=pool_v,
        head_slots=idx,
        head_lens=torch.tensor(heads, **i32),
    )
    tiles_k = torch.stack(
        [
            torch.cat([pool_k[i, :h], k_rows[s : s + g - h]])
            for i, (s, h) in enumerate(zip(starts, heads, strict=True))
        ]
    )
    tiles_v = torch.stack(
        [
            torch.cat([pool_v[i, :h], v_rows[s : s + g - h]])
            for i, (s, h) in enumerate(zip(starts, heads, strict=True))
        ]
    )
    _check_records(name, tiles_k, tiles_v, idx, kv, idx, "align8", exact=False)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_flush_tiles_padded_stride_zeroes_the_padding(device: torch.device, variant: str) -> None:
    """A cache padded past the record (hybrid page unification; any multiple of 8 bytes):
    the payload is the record at its usual offsets and the padding is zeroed."""
    name, d = "kvarn_k4v2_g128", 64
    fmt = parse_cache_dtype(name)
    tile = record_layout(fmt, d).tile_bytes
    stride = 8192
    pool_k, pool_v = _pool(128, 2, d, 2, seed=4, device=device)
    kv = torch.randint(0, 256, (3, 2, stride), dtype=torch.uint8).to(device)
    src = torch.tensor([1, 0], dtype=torch.int32, device=device)
    dst = torch.tensor([2, 0], dtype=torch.int32, device=device)
    flush_tiles(name, pool_k, pool_v, src, kv, dst, variant=variant)
    assert not bool(kv[dst.long(), :, tile:].any()), "padding not zeroed"
    unpadded = torch.zeros((3, 2, tile), dtype=torch.uint8, device=device)
    flush_tiles(name, pool_k, pool_v, src, unpadded, dst, variant=variant)
    assert torch.equal(kv[dst.long(), :, :tile].cpu(), unpadded[dst.long()].cpu())


# ----------------------------------------------------------------------------- shadow rows


def _shadowed(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    kv: torch.Tensor,
    slot_blocks: dict[int, int],
    shadow: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools as write_side_pool leaves them with ``shadow`` rows: slot ``s``'s first rows
    go to the record area of its block ``slot_blocks[s]`` in ``kv`` (in place), the pools keep
    the other ``G - shadow`` rows."""
    d = pool_k.shape[3]
    for slot, block in slot_blocks.items():
        area = shadow_view(kv, block, shadow, d)  # [Hk, 2, R, D]
        area[:, 0] = pool_k[slot, :shadow].transpose(0, 1)
        area[:, 1] = pool_v[slot, :shadow].transpose(0, 1)
    return pool_k[:, shadow:].contiguous(), pool_v[:, shadow:].contiguous()


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize(
    ("name", "d", "hk", "stride_factor", "order"),
    [
        # unpadded record: the V fields start past the K shadow rows, V's launch runs first
        ("kvarn_k4v2_g64", 64, 2, 1, (1, 0)),
        # record padded to twice its size: the shadow rows reach past the K fields, K first
        ("kvarn_k4v4_g128", 64, 1, 2, (0, 1)),
    ],
)
def test_flush_tiles_shadow_rows(
    device: torch.device,
    name: str,
    d: int,
    hk: int,
    stride_factor: int,
    order: tuple[int, int],
    variant: str,
) -> None:
    """A shadowed pool flushes to the records of the same tiles unshadowed, byte for byte,
    although each record is written over the rows it was read from; v1 equals the
    reference (which reads the shadow rows itself) under the interpreter."""
    fmt = parse_cache_dtype(name)
    g = fmt.group
    stride = record_layout(fmt, d).tile_bytes * stride_factor
    r = shadow_rows(g, d, stride)
    # The launch order this case exercises (a wrong order fails the byte comparison below
    # under the interpreter, which runs the programs of a launch one after another).
    assert _shadow_parts(dense_geometry(fmt, d, stride), r) == order
    pool_k, pool_v = _pool(g, hk, d, 3, seed=d + hk, device=device)  # with the stress tiles
    kv = torch.randint(0, 256, (5, hk, stride), dtype=torch.uint8).to(device)
    # Slots 2 and 0 are flushed into their blocks 4 and 1; slot 1 (block 3) stays pooled.
    pk, pv = _shadowed(pool_k, pool_v, kv, {2: 4, 0: 1, 1: 3}, r)
    assert pk.shape[1] == g - r
    i32 = {"dtype": torch.int32, "device": device}
    src = torch.tensor([2, 0], **i32)
    dst = torch.tensor([4, 1], **i32)
    got = kv.clone()
    flush_tiles(name, pk, pv, src, got, dst, variant=variant)
    want = kv.clone()
    flush_tiles(name, pool_k, pool_v, src, want, dst, variant=variant)
    assert torch.equal(got.cpu(), want.cpu()), "shadowed and unshadowed records differ"
    # Blocks 0, 2 and 3 (3 still holding slot 1's shadow rows) are untouched.
    assert torch.equal(got[[0, 2, 3]].cpu(), kv[[0, 2, 3]].cpu())
    if variant == "v1" and INTERPRET:
        ref = kv.clone()
        flush_tiles_ref(name, pk, pv, src, ref, dst)
        assert torch.equal(got.cpu(), ref.cpu()), "records differ from flush_tiles_ref"


@pytest.mark.parametrize("variant", ["v1", "v3", "v4"])
def test_flush_token_tiles_shadowed_heads(device: torch.device, variant: str) -> None:
    """Heads of a shadowed pool shorter than, as long as and longer than the shadow rows
    (read from the destination block's record area, then from the slot): the records of
    the same heads in an unshadowed pool, and flush_tiles' records of the same tiles."""
    name, d, hk = "kvarn_k4v2_g64", 64, 2
    fmt = parse_cache_dtype(name)
    g = fmt.group
    tile = record_layout(fmt, d).tile_bytes
    r = shadow_rows(g, d, tile)
    k_rows, v_rows = _token_rows(3 * g, hk, d, seed=31, device=device)
    pool_k, pool_v = _pool(g, hk, d, 4, seed=8, device=device)
    # heads: < R, == R, > R, none (slot -1), and a skipped tile (negative row) with a head.
    lens = [5, r, 40, 0, 7]
    slots = [1, 3, 0, -1, 2]
    dst = [2, 5, 0, 4, 1]
    starts = [0, 10, 50, 100, -1]
    kv = torch.randint(0, 256, (6, hk, tile), dtype=torch.uint8).to(device)
    # Every pooled slot's shadow rows live in its block (slot 2 -> block 1: the skipped tile).
    pk, pv = _shadowed(pool_k, pool_v, kv, {1: 2, 3: 5, 0: 0, 2: 1}, r)
    i32 = {"dtype": torch.int32, "device": device}
    heads = {"head_slots": torch.tensor(slots, **i32), "head_lens": torch.tensor(lens, **i32)}

    def flush(pools: tuple[torch.Tensor, torch.Tensor], **extra: Any) -> torch.Tensor:
        out = kv.clone()
        flush_token_tiles(
            name,
            k_rows,
            v_rows,
            torch.tensor(starts, **i32),
            out,
            torch.tensor(dst, **i32),
            pool_k=pools[0],
            pool_v=pools[1],
            **heads,
            variant=variant,
            **extra,
        )
        return out

    got = flush((pk, pv), check=True)
    want = flush((pool_k, pool_v))
    assert torch.equal(got.cpu(), want.cpu()), "shadowed and unshadowed heads differ"
    assert torch.equal(got[[1, 3]].cpu(), kv[[1, 3]].cpu()), "a skipped or foreign block changed"
    tiles_k, tiles_v = (
        [
            torch.cat([pool[s, :h], rows[b : b + g - h]])
            for s, h, b in zip(slots[:4], lens[:4], starts[:4], strict=True)
        ]
        for pool, rows in ((pool_k, k_rows), (pool_v, v_rows))
    )
    expected = _expected_records(name, tiles_k, tiles_v, kv, variant)
    for i, block in enumerate(dst[:4]):
        assert torch.equal(got[block].cpu(), expected[i].cpu()), f"tile {i} (head {lens[i]})"


def test_flush_shadow_rows_head_dim_512_torch_path(device: torch.device) -> None:
    """The torch path (head dim 512) reads shadow rows too: pool flush and direct flush."""
    name = "kvarn_k4v4_g64"
    fmt = parse_cache_dtype(name)
    g, hk, d = 64, 1, 512
    tile = record_layout(fmt, d).tile_bytes
    r = shadow_rows(g, d, tile)
    pool_k, pool_v = _pool(g, hk, d, 2, seed=6, device=device)
    kv = torch.randint(0, 256, (3, hk, tile), dtype=torch.uint8).to(device)
    pk, pv = _shadowed(pool_k, pool_v, kv, {0: 2, 1: 0}, r)
    i32 = {"dtype": torch.int32, "device": device}
    src, dst = torch.tensor([1, 0], **i32), torch.tensor([0, 2], **i32)
    got, want = kv.clone(), kv.clone()
    flush_tiles(name, pk, pv, src, got, dst)
    flush_tiles(name, pool_k, pool_v, src, want, dst)
    assert torch.equal(got.cpu(), want.cpu())
    # Direct flush: slot 1's head (longer than R) opens the tile written to block 0.
    k_rows, v_rows = _token_rows(g, hk, d, seed=2, device=device)
    starts, blocks = torch.tensor([0], **i32), torch.tensor([0], **i32)
    heads = {"head_slots": torch.tensor([1], **i32), "head_lens": torch.tensor([r + 3], **i32)}
    got, want = kv.clone(), kv.clone()
    flush_token_tiles(name, k_rows, v_rows, starts, got, blocks, pool_k=pk, pool_v=pv, **heads)
    flush_token_tiles(
        name, k_rows, v_rows, starts, want, blocks, pool_k=pool_k, pool_v=pool_v, **heads
    )
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("op", ["flush_tiles", "flush_token_tiles"])
def test_shadow_rows_validation(device: torch.device, op: str) -> None:
    """A pool with more shadow rows than the record area holds is refused, naming the limit;
    so is a pool with more rows than the tile."""
    name, d = "kvarn_k4v2_g64", 64
    fmt = parse_cache_dtype(name)
    g = fmt.group
    tile = record_layout(fmt, d).tile_bytes
    limit = shadow_rows(g, d, tile)
    kv = torch.zeros(2, 1, tile, dtype=torch.uint8, device=device)
    i32 = {"dtype": torch.int32, "device": device}
    zero = torch.zeros(1, **i32)
    for rows, message in ((g - limit - 1, "holds at most"), (g + 1, "the pool holds")):
        pool = torch.zeros(2, rows, 1, d, dtype=torch.float16, device=device)
        with pytest.raises(ValueError, match=message):
            if op == "flush_tiles":
                flush_tiles(name, pool, pool.clone(), zero, kv, zero)
            else:
                x = torch.zeros(g, 1, d, dtype=torch.float16, device=device)
                flush_token_tiles(
                    name,
                    x,
                    x.clone(),
                    zero,
                    kv,
                    zero,
                    pool_k=pool,
                    pool_v=pool.clone(),
                    head_slots=zero,
                    head_lens=torch.ones(1, **i32),
                )


def test_flush_token_tiles_refuses_two_tiles_into_one_block(device: torch.device) -> None:
    """Two tiles written into one record would race (and with shadow rows one would read the
    other's output); the debug check names it, skipped tiles (row -1) do not count."""
    name, g, d = "kvarn_k4v2_g64", 64, 64
    rows = torch.zeros(2 * g, 1, d, dtype=torch.float16, device=device)
    tile = record_layout(parse_cache_dtype(name), d).tile_bytes
    kv = torch.zeros(3, 1, tile, dtype=torch.uint8, device=device)
    starts = torch.tensor([0, g], dtype=torch.int32, device=device)
    same = torch.tensor([2, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="dst_blocks must be distinct"):
        flush_token_tiles(name, rows, rows.clone(), starts, kv, same, check=True)
    skipped = torch.tensor([0, -1], dtype=torch.int32, device=device)
    flush_token_tiles(name, rows, rows.clone(), skipped, kv, same, check=True)


@pytest.mark.parametrize("variant", ["v1", "v4"])
@pytest.mark.parametrize("d", [64, 128])
def test_5bit_word_stores_write_the_byte_stores_bytes(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, d: int, variant: str
) -> None:
    """``STORE_5BIT_WORDS``: 5-bit codes stored as 32-bit words give the byte stores' records
    byte for byte, in the plain flush and in the masked token flush (a skipped tile, a tile
    opening with side-pool rows), and leave every other block alone."""
    from kvarn_kernels import store

    name, hk = "kvarn_k5v5_g64", 2
    g = parse_cache_dtype(name).group
    pool_k, pool_v = _pool(g, hk, d, 3, seed=d, device=device)
    k_rows, v_rows = _token_rows(3 * g + 7, hk, d, seed=d + 1, device=device)
    tile = record_layout(parse_cache_dtype(name), d).tile_bytes
    start = torch.randint(0, 256, (6, hk, tile), dtype=torch.uint8).to(device)
    i32 = {"dtype": torch.int32, "device": device}

    def records(words: bool) -> torch.Tensor:
        monkeypatch.setattr(store, "STORE_5BIT_WORDS", words)
        kv = start.clone()
        flush_tiles(
            name, pool_k, pool_v, torch.tensor([2, 0], **i32), kv, torch.tensor([1, 4], **i32)
        )
        flush_token_tiles(
            name,
            k_rows,
            v_rows,
            torch.tensor([5, 2 * g + 7 - (g - 9), -1], **i32),
            kv,
            torch.tensor([0, 3, 5], **i32),
            pool_k=pool_k,
            pool_v=pool_v,
            head_slots=torch.tensor([-1, 1, 2], **i32),
            head_lens=torch.tensor([0, 9, 0], **i32),
            variant=variant,
            check=True,
        )
        return kv

    by_bytes, by_words = records(False), records(True)
    assert not torch.equal(by_bytes[[0, 1, 3, 4]], start[[0, 1, 3, 4]])  # the blocks written
    assert torch.equal(by_words, by_bytes)
