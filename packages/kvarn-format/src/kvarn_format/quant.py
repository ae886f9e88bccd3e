"""Rounding primitives of the format: asymmetric min/max RTN and the 16-bit float stores.

Kept separate from the codec so each step can be tested on its own (format-spec §2.5):

* :func:`rtn` quantizes each row (last axis) to ``bits`` with its own min/max range, rounding
  half to even as ``torch.round`` and the Ascend ``CAST_RINT`` do.
* :func:`to_fp16` and :func:`to_bf16_bits` round to the record's 16-bit field types with
  saturation: a finite input never becomes ``inf`` in a record, because a single ``inf`` scale
  would turn a whole tile's attention into NaN.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BF16_MAX",
    "FP16_MAX",
    "RTN_MIN_SCALE",
    "bf16_bits_to_float32",
    "dequantize_rtn",
    "rtn",
    "to_bf16_bits",
    "to_fp16",
]

#: Largest finite float16.
FP16_MAX: Final[float] = 65504.0
#: Largest finite bfloat16 (0x7F7F).
BF16_MAX: Final[float] = float(np.uint32(0x7F7F0000).view(np.float32))
#: Floor of the RTN step, so a constant row does not divide by zero (format-spec §2.5).
RTN_MIN_SCALE: Final[float] = 1e-10


def to_fp16(x: npt.ArrayLike) -> npt.NDArray[np.float16]:
    """Round to float16 (nearest even) after clamping to ``[-65504, 65504]``.

    NaN is passed through unchanged (callers validate finiteness before this point).
    """
    arr = np.asarray(x)
    return np.clip(arr, -FP16_MAX, FP16_MAX).astype(np.float16)


def to_bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round to bfloat16 (nearest, ties to even) and return the raw bits.

    Values beyond the bfloat16 range saturate to +-``BF16_MAX``; NaN maps to a quiet NaN.
    NumPy has no bfloat16 type, so the rounding is done on the float32 bit pattern: add
    ``0x7FFF`` plus the lowest kept bit, then drop the low 16 bits.
    """
    arr = np.asarray(x, dtype=np.float64)
    nan = np.isnan(arr)
    f32 = np.clip(np.where(nan, 0.0, arr), -BF16_MAX, BF16_MAX).astype(np.float32)
    bits = f32.view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    out = rounded.astype(np.uint16)
    out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float32(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Widen raw bfloat16 bits to float32 (exact)."""
    arr = np.asarray(bits, dtype=np.uint16)
    return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)


def rtn(
    x: npt.ArrayLike, bits: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Asymmetric round-to-nearest of every row (last axis) of ``x`` to ``bits`` bits.

    Returns ``(codes, scale, lo)`` with ``codes`` uint8 of ``x``'s shape and ``scale``/``lo``
    float32 of shape ``x.shape[:-1]``, such that ``codes * scale + lo`` approximates ``x`` to
    within ``scale / 2``. Per row: ``lo = min``, ``hi = max``, ``qmax = 2**bits - 1``,
    ``scale = max((hi - lo) / qmax, 1e-10)``, ``codes = clip(rint((x - lo) / scale), 0, qmax)``
    where ``rint`` rounds half to even. Arithmetic is float32.
    """
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or not 1 <= bits <= 8:
        raise ValueError(f"RTN width must be an integer from 1 to 8 bits, got {bits!r}")
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim < 1 or arr.shape[-1] < 1:
        raise ValueError(f"rtn needs rows of at least one element ([..., n]), got {arr.shape}")
    qmax = np.float32((1 << int(bits)) - 1)
    lo = arr.min(axis=-1)
    hi = arr.max(axis=-1)
    scale = np.maximum((hi - lo) / qmax, np.float32(RTN_MIN_SCALE))
    q = np.rint((arr - lo[..., None]) / scale[..., None])
    codes = np.clip(q, 0, qmax).astype(np.uint8)
    return codes, scale.astype(np.float32), lo.astype(np.float32)


def dequantize_rtn(
    codes: npt.ArrayLike, scale: npt.ArrayLike, lo: npt.ArrayLike
) -> npt.NDArray[np.float32]:
    """``codes * scale + lo`` per row, in float32 (the inverse of :func:`rtn`)."""
    c = np.asarray(codes, dtype=np.float32)
    s = np.asarray(scale, dtype=np.float32)
    z = np.asarray(lo, dtype=np.float32)
    return c * s[..., None] + z[..., None]
