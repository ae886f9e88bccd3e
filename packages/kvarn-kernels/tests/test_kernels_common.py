"""Host-side helpers of kvarn_kernels._common."""

from __future__ import annotations

import pytest
import torch
import triton  # type: ignore[import-untyped]

from kvarn_format import parse_cache_dtype, record_layout, to_cache_order
from kvarn_kernels._common import (
    cdiv,
    codes_from_cache_order,
    codes_to_cache_order,
    dense_geometry,
    next_pow2,
)


def test_host_integer_helpers_match_triton() -> None:
    """The plain-Python stand-ins for ``triton.cdiv`` and ``triton.next_power_of_2`` (whose
    constexpr-function calls cost microseconds per eager launch) give the same numbers."""
    for n in range(1, 1100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 4, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert cdiv(0, 4) == 0


@pytest.mark.parametrize(
    ("name", "d", "pad"),
    [("kvarn_k4v2_g128", 128, 0), ("kvarn_k4v4_g64", 64, 256), ("kvarn_k5v5_g64", 64, 0)],
)
def test_torch_cache_order_matches_kvarn_format(name: str, d: int, pad: int) -> None:
    """The torch twins of ``kvarn_format.to_cache_order`` give the same bytes (records padded
    to a larger stride too) and undo each other."""
    fmt = parse_cache_dtype(name)
    stride = record_layout(fmt, d).tile_bytes + pad
    gen = torch.Generator().manual_seed(0)
    records = torch.randint(0, 256, (3, 2, stride), generator=gen, dtype=torch.uint8)
    geo = dense_geometry(fmt, d, stride)
    cached = codes_to_cache_order(records, geo)
    expected = to_cache_order(records.numpy(), fmt, d)
    assert torch.equal(cached, torch.from_numpy(expected))
    assert torch.equal(codes_from_cache_order(cached, geo), records)
