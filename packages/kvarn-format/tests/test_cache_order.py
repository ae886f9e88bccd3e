"""The in-cache code order (docs/format.md §8): byte positions, round trips, the untouched
fields, and the formats that keep the official order."""

from __future__ import annotations

import numpy as np
import pytest

from kvarn_format import (
    CodeOrder,
    code_orders,
    encode_rotated_tiles,
    from_cache_order,
    parse_cache_dtype,
    record_layout,
    to_cache_order,
)


def _records(name: str, d: int, n: int = 3, seed: int = 0) -> np.ndarray:
    fmt = parse_cache_dtype(name)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, fmt.group, d)).astype(np.float16)
    v = rng.standard_normal((n, fmt.group, d)).astype(np.float16)
    return encode_rotated_tiles(fmt, k, v)


@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k5v5_g64"])
@pytest.mark.parametrize("d", [64, 128])
def test_round_trip_and_untouched_fields(name: str, d: int) -> None:
    fmt = parse_cache_dtype(name)
    rec = _records(name, d)
    cached = to_cache_order(rec, fmt, d)
    assert cached.shape == rec.shape
    np.testing.assert_array_equal(from_cache_order(cached, fmt, d), rec)
    layout = record_layout(fmt, d)
    for f in layout.fields:
        sl = slice(f.offset, f.end)
        if f.name in ("k_codes", "v_codes") and code_orders(fmt)[0] != CodeOrder.OFFICIAL:
            # a permutation of the same bytes, and (random records) not the identity
            assert sorted(cached[:, sl].ravel()) == sorted(rec[:, sl].ravel())
            assert not np.array_equal(cached[:, sl], rec[:, sl])
        else:
            np.testing.assert_array_equal(cached[:, sl], rec[:, sl])


def test_byte_positions_k4v2() -> None:
    """K byte j of channel d at j * D + d; V byte n of token t at
    (t % 2) * NB * G / 2 + n * G / 2 + t // 2 (NB = bytes of a token row)."""
    name, d = "kvarn_k4v2_g128", 128
    fmt = parse_cache_dtype(name)
    layout = record_layout(fmt, d)
    g = fmt.group
    rec = np.zeros((1, layout.tile_bytes), np.uint8)
    kc, vc = layout.field("k_codes").offset, layout.field("v_codes").offset
    k_row, v_row = g // 2, d // 4
    rec[0, kc + 5 * k_row + 7] = 0xA7  # channel 5, byte 7 (tokens 14, 15)
    rec[0, vc + 9 * v_row + 3] = 0x3C  # token 9, byte 3 (channels 12..15)
    cached = to_cache_order(rec, fmt, d)
    assert cached[0, kc + 7 * d + 5] == 0xA7
    assert cached[0, vc + 1 * v_row * (g // 2) + 3 * (g // 2) + 4] == 0x3C
    assert np.count_nonzero(cached) == 2


def test_orders_by_format() -> None:
    parsed = parse_cache_dtype("kvarn_k4v4_g128")
    assert code_orders(parsed) == (CodeOrder.TRANSPOSED, CodeOrder.PARITY)
    assert code_orders(parse_cache_dtype("kvarn_k5v5_g64")) == (
        CodeOrder.OFFICIAL,
        CodeOrder.OFFICIAL,
    )


def test_bad_input_is_refused() -> None:
    fmt = parse_cache_dtype("kvarn_k4v2_g128")
    with pytest.raises(TypeError, match="uint8"):
        to_cache_order(np.zeros((1, 13824), np.int32), fmt, 128)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 13824 bytes"):
        from_cache_order(np.zeros((1, 100), np.uint8), fmt, 128)
    with pytest.raises(TypeError, match="dense"):
        to_cache_order(
            np.zeros((1, 100), np.uint8),
            parse_cache_dtype("kvarn_mla_k4_g128"),  # type: ignore[arg-type]
            512,
        )
