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
from kvarn_format.cache_order import paired_row_position


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


@pytest.mark.parametrize("d", [64, 128])
def test_byte_positions_k5v5(d: int) -> None:
    """K byte b of group c of channel d at b * (G / 8) * D + c * D + d; V byte b of group c
    of token t = 8g + j at b * (D / 8) * G + c * G + 16 (g // 2) + 2 j + g % 2."""
    fmt = parse_cache_dtype("kvarn_k5v5_g64")
    layout = record_layout(fmt, d)
    g = fmt.group
    kc, vc = layout.field("k_codes").offset, layout.field("v_codes").offset
    k_row, v_row = 5 * g // 8, 5 * d // 8
    rec = np.zeros((1, layout.tile_bytes), np.uint8)
    rec[0, kc + 5 * k_row + 5 * 3 + 4] = 0xA7  # channel 5, group 3 (tokens 24..31), byte 4
    rec[0, vc + 27 * v_row + 5 * 2 + 1] = 0x3C  # token 27 (g 3, j 3), group 2, byte 1
    rec[0, vc + 0 * v_row + 5 * 0 + 0] = 0x11  # token 0, group 0, byte 0: stays first
    cached = to_cache_order(rec, fmt, d)
    assert cached[0, kc + 4 * (g // 8) * d + 3 * d + 5] == 0xA7
    assert cached[0, vc + 1 * (d // 8) * g + 2 * g + 16 * 1 + 2 * 3 + 1] == 0x3C
    assert cached[0, vc] == 0x11
    assert np.count_nonzero(cached) == 3


def test_paired_row_position_is_a_permutation_of_each_16() -> None:
    pos = paired_row_position(np.arange(64, dtype=np.int64))
    assert sorted(pos.tolist()) == list(range(64))
    assert (pos // 16 == np.arange(64) // 16).all()
    # token j of groups 2k and 2k + 1 side by side
    assert pos[8 * 2 + 5] + 1 == pos[8 * 3 + 5]


def test_orders_by_format() -> None:
    parsed = parse_cache_dtype("kvarn_k4v4_g128")
    assert code_orders(parsed) == (CodeOrder.TRANSPOSED, CodeOrder.PARITY)
    assert code_orders(parse_cache_dtype("kvarn_k5v5_g64")) == (
        CodeOrder.PLANES,
        CodeOrder.PLANES_PAIRED,
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
