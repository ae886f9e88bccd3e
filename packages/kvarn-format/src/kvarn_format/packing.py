"""Bit packing of quantization codes (docs/format.md, "Packing"; format-spec §2.6).

Every width uses one rule: the codes of a row form a little-endian bitstream in which code ``i``
occupies bits ``[i*bits, (i+1)*bits)`` and bit ``j`` of the stream is bit ``j % 8`` of byte
``j // 8``. For 2 and 4 bits that is exactly "LSB-first within bytes" (4-bit: the low nibble
holds the even index; 2-bit: ``byte = c0 | c1<<2 | c2<<4 | c3<<6``); for 5 bits codes cross
byte boundaries. Because of this single rule the implementation packs eight codes at a time
into a 64-bit word and splits the word into ``bits`` bytes, which is vectorized for every width.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["SUPPORTED_CODE_BITS", "pack_codes", "packed_row_bytes", "unpack_codes"]

#: Code widths the format uses (2 and 4 for the official presets, 5 for the fork presets).
#: The packer itself is correct for any width from 1 to 8.
SUPPORTED_CODE_BITS: Final[tuple[int, ...]] = (2, 4, 5)

_CODES_PER_WORD: Final[int] = 8  # eight codes of b bits are exactly b bytes


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int | np.integer) or not 1 <= int(bits) <= 8:
        raise ValueError(f"code width must be an integer from 1 to 8 bits, got {bits!r}")


def packed_row_bytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy; ``n * bits`` must be a multiple of 8."""
    _check_bits(bits)
    if n < 0 or (n * bits) % 8:
        raise ValueError(
            f"{n} codes of {bits} bits are not a whole number of bytes; rows must hold a "
            f"multiple of {8 // np.gcd(8, bits)} codes"
        )
    return n * bits // 8


def pack_codes(codes: npt.ArrayLike, bits: int) -> npt.NDArray[np.uint8]:
    """Pack ``codes[..., n]`` (integers in ``[0, 2**bits)``) into ``uint8[..., n*bits/8]``.

    Packing runs along the last axis; leading axes are kept. Out-of-range codes raise
    ``ValueError`` rather than being masked, because a silently truncated code would decode to
    a different value.
    """
    _check_bits(bits)
    arr = np.asarray(codes)
    if arr.ndim < 1:
        raise ValueError(f"codes must have at least one axis ([..., n]), got shape {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise ValueError(f"codes must be an integer array, got dtype {arr.dtype}")
    n = arr.shape[-1]
    nbytes = packed_row_bytes(n, bits)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << bits):
        raise ValueError(
            f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing, got values in "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
    lead = arr.shape[:-1]
    words = -(-n // _CODES_PER_WORD)
    padded = np.zeros((*lead, words * _CODES_PER_WORD), dtype=np.uint64)
    padded[..., :n] = arr
    grouped = padded.reshape(*lead, words, _CODES_PER_WORD)
    shifts = np.arange(_CODES_PER_WORD, dtype=np.uint64) * np.uint64(bits)
    word = np.bitwise_or.reduce(grouped << shifts, axis=-1)
    byte_shifts = np.arange(bits, dtype=np.uint64) * np.uint64(8)
    out = ((word[..., None] >> byte_shifts) & np.uint64(0xFF)).astype(np.uint8)
    return np.ascontiguousarray(out.reshape(*lead, words * bits)[..., :nbytes])


def unpack_codes(packed: npt.ArrayLike, bits: int, n: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_codes`: ``uint8[..., n*bits/8]`` to codes ``uint8[..., n]``."""
    _check_bits(bits)
    arr = np.asarray(packed)
    if arr.dtype != np.uint8:
        raise ValueError(f"packed codes must be uint8, got dtype {arr.dtype}")
    nbytes = packed_row_bytes(n, bits)
    if arr.ndim < 1 or arr.shape[-1] != nbytes:
        raise ValueError(
            f"packed rows of {n} {bits}-bit codes must have shape [..., {nbytes}], got {arr.shape}"
        )
    lead = arr.shape[:-1]
    words = -(-n // _CODES_PER_WORD)
    padded = np.zeros((*lead, words * bits), dtype=np.uint64)
    padded[..., :nbytes] = arr
    grouped = padded.reshape(*lead, words, bits)
    byte_shifts = np.arange(bits, dtype=np.uint64) * np.uint64(8)
    word = np.bitwise_or.reduce(grouped << byte_shifts, axis=-1)
    shifts = np.arange(_CODES_PER_WORD, dtype=np.uint64) * np.uint64(bits)
    mask = np.uint64((1 << bits) - 1)
    codes = ((word[..., None] >> shifts) & mask).astype(np.uint8)
    return np.ascontiguousarray(codes.reshape(*lead, words * _CODES_PER_WORD)[..., :n])
