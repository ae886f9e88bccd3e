"""rotate / write_side_pool against the float64 reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_format.geometry import shadow_rows
from kvarn_format.hadamard import hadamard_matrix as np_hadamard
from kvarn_kernels import hadamard_matrix, plan_side_pool_write, rotate, write_side_pool
from kvarn_kernels.reference import pool_tile, rotate_ref, write_side_pool_ref


def _fp16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp16 ulps (through the ordered integer view of the bit patterns)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def test_hadamard_matrix_is_the_format_matrix(device: torch.device) -> None:
    h = hadamard_matrix(128, device, torch.float32)
    assert h is hadamard_matrix(128, device, torch.float32)  # cached
    np.testing.assert_allclose(h.cpu().numpy(), np_hadamard(128), rtol=0, atol=1e-7)
    eye = (h.double() @ h.double()).cpu()
    assert torch.allclose(eye, torch.eye(128, dtype=torch.float64), atol=1e-6)
    with pytest.raises(ValueError, match="head_dim 96"):
        hadamard_matrix(96, device)


@pytest.mark.parametrize(
    ("d", "dtype", "rows"),
    [
        (64, torch.float16, 37),
        (128, torch.bfloat16, 50),
        (128, torch.float32, 20),
        (256, torch.float16, 17),
        pytest.param(512, torch.bfloat16, 3000, marks=pytest.mark.gpu),
        pytest.param(128, torch.float16, 100_000, marks=pytest.mark.gpu),
    ],
)
def test_rotate_matches_reference(
    device: torch.device, d: int, dtype: torch.dtype, rows: int
) -> None:
    gen = torch.Generator().manual_seed(d + rows)
    x = (torch.randn(rows, d, generator=gen) * 4).to(dtype)
    x[0] = 60000.0  # rotated row 0 exceeds the fp16 range: must saturate, not overflow
    x = x.to(device)
    y = rotate(x)
    ref = rotate_ref(x)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert bool(torch.isfinite(y).all())
    assert float(y[0, 0]) == 65504.0
    # fp32 sums vs float64. The sums may carry an fp32 rounding error of the size of the sum of
    # |terms| (tensor cores accumulate in fp32 in their own order), which matters only where the
    # rotated value is much smaller than its terms; otherwise a value within ~1e-7 of an fp16
    # rounding boundary may land on the other side: one-ulp differences, rarely.
    d_ = x.shape[-1]
    terms = x.double().abs().sum(dim=-1, keepdim=True) / d_**0.5
    ulp16 = torch.maximum(ref.double().abs() * 2.0**-10, torch.full_like(terms, 2.0**-24))
    err = (y.double() - ref.double()).abs()
    assert bool((err <= ulp16 + d_ * 2.0**-23 * terms).all())
    ulps = _fp16_ulps(y, ref)
    assert float((ulps > 1).float().mean()) < 1e-4
    assert float((ulps > 0).float().mean()) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotate_reads_strided_token_views(device: torch.device, dtype: torch.dtype) -> None:
    """A ``[T, H, D]`` view of a fused QKV tensor (as vLLM passes K, V and Q) rotates to its
    contiguous copy's result bit for bit, through ``rotate`` and ``rotate_f32``, and neither
    copies it first (the rotation's launch gets the view itself)."""
    import kvarn_kernels.rotation as rotation
    from kvarn_kernels.rotation import rotate_f32

    qkv = torch.randn(9, 12, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    qkv = qkv.to(device)
    view = qkv[:, 8:10]  # two heads out of twelve
    read: list[int] = []
    rotate_launch = rotation.rotate_launch

    def spy(x: torch.Tensor, y: torch.Tensor, **kw: Any) -> Any:
        read.append(x.data_ptr())
        return rotate_launch(x, y, **kw)

    for fn in (rotate, rotate_f32):
        want = fn(view.contiguous())
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rotation, "rotate_launch", spy)
            read.clear()
            got = fn(view)
        assert torch.equal(got, want) and got.shape == view.shape and got.is_contiguous()
        assert read == [view.data_ptr()]


def test_write_side_pool_scatters_rotated_tokens(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    g, hk, d = 64, 2, 64
    t = 150
    k = torch.randn(t, hk, d, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(t, hk, d, generator=gen).half().to(device)
    block_to_slot = torch.tensor([3, -1, 0, 2, 1, -1], dtype=torch.int32, device=device)
    # unique destinations in pooled blocks, some padding (-1), some in block 1 (no pool slot)
    pooled = torch.tensor([0, 2, 3, 4, 1])
    positions = (pooled[:, None] * g + torch.arange(g)[None, :]).flatten()
    slots = positions[torch.randperm(positions.numel(), generator=gen)[:t]]
    slots[::7] = -1
    slots = slots.to(device)
    nan = float("nan")
    pool_k = torch.full((4, g, hk, d), nan, dtype=torch.float16, device=device)
    pool_v = torch.full_like(pool_k, nan)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    write_side_pool(k, v, pool_k, pool_v, slots, block_to_slot)
    write_side_pool_ref(k, v, ref_k, ref_v, slots.cpu(), block_to_slot.cpu())
    for got, ref in ((pool_k, ref_k), (pool_v, ref_v)):
        written = ~torch.isnan(ref)
        assert torch.equal(torch.isnan(got), torch.isnan(ref))  # nothing else touched
        assert int(_fp16_ulps(got[written], ref[written]).max()) <= 1
    assert bool(written.any())


def test_write_side_pool_rejects_tokens_without_pool_slot(device: torch.device) -> None:
    g, hk, d = 64, 1, 64
    k = torch.randn(2, hk, d).half().to(device)
    pool = torch.full((1, g, hk, d), float("nan"), dtype=torch.float16, device=device)
    pool_v = pool.clone()
    block_to_slot = torch.tensor([0, -1], dtype=torch.int32, device=device)
    slots = torch.tensor([3, g + 5], dtype=torch.int64, device=device)  # 2nd token: block 1
    with pytest.raises(ValueError, match="without a side-pool slot"):
        write_side_pool(k, k, pool, pool_v, slots, block_to_slot, check=True)
    write_side_pool(k, k, pool, pool_v, slots, block_to_slot, check=False)
    # the token of block 1 is skipped, never written elsewhere
    assert int((~torch.isnan(pool)).sum()) == hk * d


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k_dtype": torch.float32}, "k must have dtype"),
        ({"pool_dtype": torch.bfloat16}, "pool_k must have dtype"),
        ({"head_dim": 96}, "head_dim 96"),
        ({"slot_dtype": torch.float32}, "slot_mapping must have dtype"),
        ({"k_heads": 3}, "k must have shape"),
    ],
)
def test_write_side_pool_validation(
    device: torch.device, kwargs: dict[str, object], message: str
) -> None:
    d = int(kwargs.get("head_dim", 64))  # type: ignore[call-overload]
    hk = 2
    k_heads = int(kwargs.get("k_heads", hk))  # type: ignore[call-overload]
    k_dtype = kwargs.get("k_dtype", torch.float16)
    pool_dtype = kwargs.get("pool_dtype", torch.float16)
    slot_dtype = kwargs.get("slot_dtype", torch.int64)
    assert isinstance(k_dtype, torch.dtype) and isinstance(pool_dtype, torch.dtype)
    assert isinstance(slot_dtype, torch.dtype)
    k = torch.zeros(4, k_heads, d, dtype=k_dtype, device=device)
    pool = torch.zeros(2, 64, hk, d, dtype=pool_dtype, device=device)
    slots = torch.zeros(4, dtype=slot_dtype, device=device)
    b2s = torch.zeros(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=message):
        write_side_pool(k, k, pool, pool.clone(), slots, b2s)


def test_write_side_pool_shadow_rows(device: torch.device) -> None:
    """With a pool of G - R rows per slot, tile rows < R land in their block's record area
    (K rows, then V rows), the rest in the slot at row - R, as the reference puts them;
    padding tokens and tokens of pool-less blocks are written nowhere."""
    gen = torch.Generator().manual_seed(11)
    name, hk, d = "kvarn_k4v2_g64", 2, 64
    g = parse_cache_dtype(name).group
    stride = record_layout(parse_cache_dtype(name), d).tile_bytes
    r = shadow_rows(g, d, stride)
    t = 200
    k = torch.randn(t, hk, d, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(t, hk, d, generator=gen).half().to(device)
    b2s = [3, -1, 0, 2, 1, -1]  # blocks 1 and 5 have no pool slot
    block_to_slot = torch.tensor(b2s, dtype=torch.int32, device=device)
    positions = torch.randperm(len(b2s) * g, generator=gen)[:t]
    positions[::9] = -1  # padding
    slots = positions.to(device)
    nan = float("nan")
    pool_k = torch.full((4, g - r, hk, d), nan, dtype=torch.float16, device=device)
    pool_v = torch.full_like(pool_k, nan)
    kv = torch.randint(0, 256, (len(b2s), hk, stride), dtype=torch.uint8).to(device)
    before = kv.clone()
    ref_k, ref_v, ref_kv = pool_k.clone(), pool_v.clone(), kv.clone()
    write_side_pool(k, v, pool_k, pool_v, slots, block_to_slot, kv_cache=kv, group=g)
    write_side_pool_ref(
        k, v, ref_k, ref_v, slots.cpu(), block_to_slot.cpu(), kv_cache=ref_kv, group=g
    )
    for got, ref in ((pool_k, ref_k), (pool_v, ref_v)):
        written = ~torch.isnan(ref)
        assert torch.equal(torch.isnan(got), torch.isnan(ref))  # nothing else touched
        assert int(_fp16_ulps(got[written], ref[written]).max()) <= 1
    # The record areas: the shadow rows as the reference writes them (the random bytes where
    # no token went compare as equal fp16 bit patterns), nothing past them, nothing at all in
    # the blocks without a slot.
    area = 4 * r * d
    head = kv[:, :, :area].contiguous().view(torch.float16)
    ref_head = ref_kv[:, :, :area].contiguous().view(torch.float16)
    assert int(_fp16_ulps(head, ref_head).max()) <= 1
    assert torch.equal(kv[:, :, area:].cpu(), before[:, :, area:].cpu())
    assert torch.equal(kv[[1, 5]].cpu(), before[[1, 5]].cpu())
    pos = positions[positions >= 0]
    in_shadow = pos[((pos % g) < r) & (block_to_slot.cpu()[pos // g] >= 0)]
    in_pool = pos[((pos % g) >= r) & (block_to_slot.cpu()[pos // g] >= 0)]
    assert in_shadow.numel() > 0 and in_pool.numel() > 0
    for blk, slot in enumerate(b2s):
        if slot < 0:
            continue
        tk, tv = pool_tile(pool_k, pool_v, kv, slot, blk, g)
        rk, rv = pool_tile(ref_k, ref_v, ref_kv, slot, blk, g)
        assert tk.shape == (g, hk, d)
        rows = [int(p) % g for p in pos if int(p) // g == blk]
        for got, ref in ((tk, rk), (tv, rv)):
            assert int(_fp16_ulps(got[rows], ref[rows]).max()) <= 1, f"block {blk}"
            assert not bool(torch.isnan(got[rows]).any())


def test_write_side_pool_shadow_rows_validation(device: torch.device) -> None:
    """A pool of fewer than G rows needs the cache its shadow rows live in, and no more
    shadow rows than a record area holds."""
    name, hk, d = "kvarn_k4v2_g64", 1, 64
    g = parse_cache_dtype(name).group
    stride = record_layout(parse_cache_dtype(name), d).tile_bytes
    limit = shadow_rows(g, d, stride)
    k = torch.zeros(2, hk, d, dtype=torch.float16, device=device)
    slots = torch.tensor([0, 1], dtype=torch.int64, device=device)
    b2s = torch.zeros(2, dtype=torch.int32, device=device)
    kv = torch.zeros(2, hk, stride, dtype=torch.uint8, device=device)
    pool = torch.zeros(1, g - limit, hk, d, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="pass kv_cache"):
        write_side_pool(k, k, pool, pool.clone(), slots, b2s, group=g)
    small = torch.zeros(1, g - limit - 1, hk, d, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="holds at most"):
        write_side_pool(k, k, small, small.clone(), slots, b2s, kv_cache=kv, group=g)


@pytest.mark.parametrize("shadow", [False, True])
def test_side_pool_write_plan_writes_each_layer_as_unplanned(
    device: torch.device, shadow: bool
) -> None:
    """A :class:`SidePoolWritePlan` replayed by three layers (their own pools and caches; K/V
    strided views of a fused QKV tensor, then a contiguous bf16 layout, which prepares again)
    writes exactly what unplanned :func:`write_side_pool` calls write, shadow rows included."""
    gen = torch.Generator().manual_seed(5)
    name, hk, d = "kvarn_k4v2_g64", 2, 64
    g = parse_cache_dtype(name).group
    stride = record_layout(parse_cache_dtype(name), d).tile_bytes
    r = shadow_rows(g, d, stride) if shadow else 0
    t = 90
    b2s = torch.tensor([3, -1, 0, 2, 1, -1], dtype=torch.int32, device=device)
    pooled = torch.tensor([0, 2, 3, 4])
    positions = (pooled[:, None] * g + torch.arange(g)[None, :]).flatten()
    slots = positions[torch.randperm(positions.numel(), generator=gen)[:t]]
    slots[::7] = -1
    slots = slots.to(device)
    plan = plan_side_pool_write(slots, b2s, group=g)

    def layer_tensors(dtype: torch.dtype, fused: bool) -> tuple[torch.Tensor, ...]:
        qkv = torch.randn(t, 4 + 2 * hk, d, generator=gen).to(dtype).to(device)
        k, v = qkv[:, 4 : 4 + hk], qkv[:, 4 + hk :]
        if not fused:
            k, v = k.contiguous(), v.contiguous()
        pool = torch.randn(4, g - r, hk, d, generator=gen).half().to(device)
        kv = torch.randint(0, 256, (6, hk, stride), dtype=torch.uint8, generator=gen).to(device)
        return k, v, pool, pool.clone() + 1, kv

    for dtype, fused in ((torch.float16, True), (torch.float16, True), (torch.bfloat16, False)):
        k, v, pool_k, pool_v, kv = layer_tensors(dtype, fused)
        want = [x.clone() for x in (pool_k, pool_v, kv)]
        cache = {"kv_cache": kv} if shadow else {}
        want_cache = {"kv_cache": want[2]} if shadow else {}
        write_side_pool(k, v, want[0], want[1], slots, b2s, group=g, **want_cache)
        plan.write(k, v, pool_k, pool_v, slots, b2s, **cache)
        for got, ref in zip((pool_k, pool_v, kv), want, strict=True):
            assert torch.equal(got.cpu(), ref.cpu())
    assert "2 layouts prepared" in repr(plan)


def test_side_pool_write_plan_validation(device: torch.device) -> None:
    """The plan refuses other index tensors and a group below 1; a layout's first call runs
    write_side_pool's checks, and the debug check runs on every call it is asked for."""
    g, hk, d = 64, 1, 64
    k = torch.randn(2, hk, d).half().to(device)
    pool = torch.full((1, g, hk, d), float("nan"), dtype=torch.float16, device=device)
    b2s = torch.tensor([0, -1], dtype=torch.int32, device=device)
    slots = torch.tensor([3, g + 5], dtype=torch.int64, device=device)  # 2nd token: block 1
    with pytest.raises(ValueError, match="group must be >= 1"):
        plan_side_pool_write(slots, b2s, group=0)
    plan = plan_side_pool_write(slots, b2s)
    with pytest.raises(ValueError, match="other index tensors"):
        plan.write(k, k, pool, pool.clone(), slots.clone(), b2s)
    with pytest.raises(ValueError, match="k must have dtype"):
        plan.write(k.float(), k.float(), pool, pool.clone(), slots, b2s)
    plan.write(k, k, pool, pool.clone(), slots, b2s, check=False)  # prepares this layout
    with pytest.raises(ValueError, match="without a side-pool slot"):
        plan.write(k, k, pool, pool.clone(), slots, b2s, check=True)
