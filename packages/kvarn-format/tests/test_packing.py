"""Bit packing: round trips, and the exact byte order the kernels depend on."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvarn_format.packing import pack_codes, packed_row_bytes, unpack_codes


def _pack_bit_by_bit(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent reference: write every code bit to its stream position one at a time."""
    rows, n = codes.shape
    out = np.zeros((rows, n * bits // 8), dtype=np.uint8)
    for r in range(rows):
        for i in range(n):
            for b in range(bits):
                if (int(codes[r, i]) >> b) & 1:
                    pos = i * bits + b
                    out[r, pos // 8] |= 1 << (pos % 8)
    return out


@st.composite
def _codes(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    bits = draw(st.sampled_from([2, 4, 5]))
    rows = draw(st.integers(1, 4))
    n = 8 * draw(st.integers(1, 9))
    codes = draw(arrays(np.uint8, (rows, n), elements=st.integers(0, (1 << bits) - 1)))
    return codes, bits


@settings(max_examples=60, deadline=None)
@given(_codes())
def test_round_trip_and_matches_bitstream_reference(case: tuple[np.ndarray, int]) -> None:
    codes, bits = case
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8
    assert packed.shape == (codes.shape[0], codes.shape[1] * bits // 8)
    np.testing.assert_array_equal(packed, _pack_bit_by_bit(codes, bits))
    np.testing.assert_array_equal(unpack_codes(packed, bits, codes.shape[1]), codes)


def test_four_bit_low_nibble_is_even_index() -> None:
    packed = pack_codes(np.array([[0x1, 0x2, 0x3, 0xF]], dtype=np.uint8), 4)
    assert packed.tolist() == [[0x21, 0xF3]]


def test_two_bit_byte_order() -> None:
    c = [1, 2, 3, 0, 3, 3, 0, 1]
    packed = pack_codes(np.array([c], dtype=np.uint8), 2)
    assert packed[0, 0] == c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6
    assert packed[0, 1] == c[4] | c[5] << 2 | c[6] << 4 | c[7] << 6


def test_five_bit_positions_cross_bytes() -> None:
    # code i occupies stream bits [5i, 5i+5); bit j lives in byte j // 8 at bit j % 8
    for i in range(8):
        codes = np.zeros((1, 8), dtype=np.uint8)
        codes[0, i] = 0b10001  # lowest and highest bit of the code set
        expected = np.zeros(5, dtype=np.uint8)
        for pos in (5 * i, 5 * i + 4):
            expected[pos // 8] |= 1 << (pos % 8)
        np.testing.assert_array_equal(pack_codes(codes, 5)[0], expected)
    # code 1 = 31 fills bits 5..9: top three bits of byte 0 and the low two of byte 1
    assert pack_codes(np.array([[0, 31, 0, 0, 0, 0, 0, 0]], dtype=np.uint8), 5)[0, :2].tolist() == [
        0xE0,
        0x03,
    ]


def test_leading_axes_are_kept() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(3, 2, 64), dtype=np.uint8)
    packed = pack_codes(codes, 4)
    assert packed.shape == (3, 2, 32)
    np.testing.assert_array_equal(packed[1, 1], pack_codes(codes[1, 1:2], 4)[0])
    np.testing.assert_array_equal(unpack_codes(packed, 4, 64), codes)


def test_non_multiple_of_eight_rows_that_fill_whole_bytes() -> None:
    codes = np.array([[1, 2, 3, 4, 5, 6]], dtype=np.uint8)  # 6 x 4 bits = 3 bytes
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[0x21, 0x43, 0x65]]
    np.testing.assert_array_equal(unpack_codes(packed, 4, 6), codes)


def test_bad_input_fails_closed() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_codes(np.array([[4, 0, 0, 0]], dtype=np.uint8), 2)
    with pytest.raises(ValueError, match="whole number of bytes"):
        pack_codes(np.zeros((1, 3), dtype=np.uint8), 5)
    with pytest.raises(ValueError, match="integer array"):
        pack_codes(np.zeros((1, 8), dtype=np.float32), 4)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\]"):
        unpack_codes(np.zeros((1, 5), dtype=np.uint8), 4, 8)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(np.zeros((1, 4), dtype=np.int32), 4, 8)
    with pytest.raises(ValueError, match="1 to 8"):
        pack_codes(np.zeros((1, 8), dtype=np.uint8), 9)
    assert packed_row_bytes(128, 5) == 80
