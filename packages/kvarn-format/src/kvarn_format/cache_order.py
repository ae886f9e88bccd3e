"""The in-cache code order: where a serving engine's paged cache keeps a record's code bytes.

A record (docs/format.md §2.1) stores K codes channel-major (``[D][G * kb / 8]``) and V codes
token-major (``[G][D * vb / 8]``). The decode kernels feed the codes to matrix-multiply units
whose operands want the other axis contiguous: two consecutive channels of one token pair for
the scores ``q K``, two tokens (an even and an odd one, as K's nibbles pair them) of one
channel for ``P V``. So the paged cache of a serving process keeps the code bytes of the
formats the fast kernels serve (4-bit keys, 2- or 4-bit values) in another order, docs/format.md
§8 (a kvarn choice):

* K, :attr:`CodeOrder.TRANSPOSED`: ``[G * kb / 8][D]``, byte ``j`` of channel ``d`` at
  ``j * D + d`` (a byte still holds tokens ``2j`` and ``2j + 1``).
* V, :attr:`CodeOrder.PARITY`: ``[2][D * vb / 8][G / 2]``, byte ``n`` of token ``t`` at
  ``(t % 2) * (D * vb / 8) * (G / 2) + n * (G / 2) + t // 2`` (a byte still holds
  ``8 / vb`` channels of one token).

5-bit codes straddle bytes (a group of eight codes is five bytes, code ``i`` at bits ``5i ..
5i + 4``), so their operand registers are cut from two bytes each. Their sections keep each
group's five bytes as five planes, so that a register's two bytes come from two aligned
words of consecutive channels (K) or tokens (V):

* K, :attr:`CodeOrder.PLANES`: ``[5][G / 8][D]``, byte ``b`` of group ``c`` of channel
  ``d`` (tokens ``8c .. 8c + 7``) at ``b * (G / 8) * D + c * D + d``.
* V, :attr:`CodeOrder.PLANES_PAIRED`: ``[5][D / 8][G]``, byte ``b`` of group ``c`` of token
  ``t = 8g + j`` (channels ``8c .. 8c + 7``) at ``b * (D / 8) * G + c * G + 16 * (g // 2) +
  2 * j + g % 2``: the same token of two consecutive groups of eight tokens side by side
  (the decode kernel's score rows hold token ``j`` of eight token groups).

Only the code bytes move; every scale and zero point stays where §2.1 puts it, and the record
has the same size. Everything outside the cache (the reference codec, test vectors,
checkpoints, exported records) uses §2.1's order; :func:`to_cache_order` and
:func:`from_cache_order` convert.
"""

from __future__ import annotations

from enum import IntEnum
from functools import cache

import numpy as np
import numpy.typing as npt

from kvarn_format.geometry import record_layout
from kvarn_format.registry import DenseFormat

__all__ = [
    "PLANE_ORDERS",
    "CodeOrder",
    "cache_permutation",
    "code_orders",
    "from_cache_order",
    "paired_row_position",
    "to_cache_order",
]


class CodeOrder(IntEnum):
    """How a code section's ``[rows][row bytes]`` matrix lies in memory."""

    #: row-major, as docs/format.md §2.1 stores it
    OFFICIAL = 0
    #: column-major: byte ``j`` of row ``r`` at ``j * rows + r``
    TRANSPOSED = 1
    #: even rows, then odd rows, each column-major: byte ``j`` of row ``r`` at
    #: ``(r % 2) * row_bytes * rows / 2 + j * rows / 2 + r // 2``
    PARITY = 2
    #: 5-bit codes, five byte planes: byte ``b`` of group ``c`` (row bytes ``5c .. 5c + 4``)
    #: of row ``r`` at ``b * groups * rows + c * rows + r``
    PLANES = 3
    #: as :attr:`PLANES` with the rows of each 16 interleaved: row ``r = 8g + j`` at
    #: position ``16 * (g // 2) + 2 * j + g % 2`` (rows a multiple of 16)
    PLANES_PAIRED = 4


#: The orders of 5-bit code sections.
PLANE_ORDERS = (CodeOrder.PLANES, CodeOrder.PLANES_PAIRED)


def code_orders(fmt: DenseFormat) -> tuple[CodeOrder, CodeOrder]:
    """The in-cache orders of ``fmt``'s K and V code sections."""
    if fmt.key_bits == 4 and fmt.value_bits in (2, 4):
        return CodeOrder.TRANSPOSED, CodeOrder.PARITY
    if fmt.key_bits == 5 and fmt.value_bits == 5:
        return CodeOrder.PLANES, CodeOrder.PLANES_PAIRED
    return CodeOrder.OFFICIAL, CodeOrder.OFFICIAL


def paired_row_position(row: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Where :attr:`CodeOrder.PLANES_PAIRED` puts row ``row`` (``8g + j``) within its plane
    column: ``16 * (g // 2) + 2 * j + g % 2``."""
    g, j = row // 8, row % 8
    return 16 * (g // 2) + 2 * j + g % 2


def _code_sections(fmt: DenseFormat, head_dim: int) -> list[tuple[int, int, int, CodeOrder]]:
    """(offset, rows, row bytes, in-cache order) of the K and V code sections of a record."""
    layout = record_layout(fmt, head_dim)
    g, d = fmt.group, head_dim
    k_order, v_order = code_orders(fmt)
    return [
        (layout.field("k_codes").offset, d, g * fmt.key_bits // 8, k_order),
        (layout.field("v_codes").offset, g, d * fmt.value_bits // 8, v_order),
    ]


@cache
def cache_permutation(fmt: DenseFormat, head_dim: int) -> npt.NDArray[np.int64]:
    """The in-cache order as a gather over a record's payload: byte ``i`` of a cached record
    is byte ``perm[i]`` of the same record in §2.1's order (``i`` < payload bytes; padding
    stays in place). Read-only; :func:`to_cache_order` and :func:`from_cache_order` (and
    kvarn-kernels' torch twins) are this gather and its inverse."""
    perm = np.arange(record_layout(fmt, head_dim).payload_bytes, dtype=np.int64)
    for off, rows, row_bytes, order in _code_sections(fmt, head_dim):
        official = perm[off : off + rows * row_bytes].reshape(rows, row_bytes)
        cached: npt.NDArray[np.int64] = official
        if order == CodeOrder.TRANSPOSED:
            cached = official.T
        elif order == CodeOrder.PARITY:  # [parity, row bytes, row pair]
            cached = official.reshape(rows // 2, 2, row_bytes).transpose(1, 2, 0)
        elif order in PLANE_ORDERS:  # [plane, group, row]
            cached = official.reshape(rows, row_bytes // 5, 5).transpose(2, 1, 0)
            if order == CodeOrder.PLANES_PAIRED:
                at = np.empty_like(cached)
                at[:, :, paired_row_position(np.arange(rows, dtype=np.int64))] = cached
                cached = at
        perm[off : off + rows * row_bytes] = cached.reshape(-1)
    perm.flags.writeable = False
    return perm


def _check_records(records: npt.NDArray[np.uint8], fmt: DenseFormat, head_dim: int) -> None:
    if not isinstance(fmt, DenseFormat):
        raise TypeError(f"the in-cache code order is defined for dense formats, got {fmt!r}")
    if records.dtype != np.uint8:
        raise TypeError(f"records must be uint8, got {records.dtype}")
    need = record_layout(fmt, head_dim).payload_bytes
    if records.ndim < 1 or records.shape[-1] < need:
        raise ValueError(
            f"records' last dim must hold a {fmt.name} record at head_dim {head_dim} "
            f"(at least {need} bytes), got shape {records.shape}"
        )


def to_cache_order(
    records: npt.NDArray[np.uint8], fmt: DenseFormat, head_dim: int
) -> npt.NDArray[np.uint8]:
    """A copy of ``records`` (``[..., record bytes]``, §2.1's order) with the code bytes in
    the in-cache order of ``fmt``. Bytes past the payload (padding) are kept."""
    _check_records(records, fmt, head_dim)
    perm = cache_permutation(fmt, head_dim)
    out = records.copy()
    out[..., : perm.size] = records[..., perm]
    return out


def from_cache_order(
    records: npt.NDArray[np.uint8], fmt: DenseFormat, head_dim: int
) -> npt.NDArray[np.uint8]:
    """The inverse of :func:`to_cache_order`: records read from a paged cache, in §2.1's
    order."""
    _check_records(records, fmt, head_dim)
    perm = cache_permutation(fmt, head_dim)
    out = records.copy()
    out[..., perm] = records[..., : perm.size]
    return out
