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

Only the code bytes move; every scale and zero point stays where §2.1 puts it, and the record
has the same size. Everything outside the cache (the reference codec, test vectors,
checkpoints, exported records) uses §2.1's order; :func:`to_cache_order` and
:func:`from_cache_order` convert. 5-bit codes straddle bytes and keep §2.1's order.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import numpy.typing as npt

from kvarn_format.geometry import record_layout
from kvarn_format.registry import DenseFormat

__all__ = ["CodeOrder", "code_orders", "code_sections", "from_cache_order", "to_cache_order"]


class CodeOrder(IntEnum):
    """How a code section's ``[rows][row bytes]`` matrix lies in memory."""

    #: row-major, as docs/format.md §2.1 stores it
    OFFICIAL = 0
    #: column-major: byte ``j`` of row ``r`` at ``j * rows + r``
    TRANSPOSED = 1
    #: even rows, then odd rows, each column-major: byte ``j`` of row ``r`` at
    #: ``(r % 2) * row_bytes * rows / 2 + j * rows / 2 + r // 2``
    PARITY = 2


def code_orders(fmt: DenseFormat) -> tuple[CodeOrder, CodeOrder]:
    """The in-cache orders of ``fmt``'s K and V code sections."""
    if fmt.key_bits == 4 and fmt.value_bits in (2, 4):
        return CodeOrder.TRANSPOSED, CodeOrder.PARITY
    return CodeOrder.OFFICIAL, CodeOrder.OFFICIAL


def code_sections(fmt: DenseFormat, head_dim: int) -> list[tuple[int, int, int, CodeOrder]]:
    """(offset, rows, row bytes, in-cache order) of the K and V code sections of a record."""
    layout = record_layout(fmt, head_dim)
    g, d = fmt.group, head_dim
    k_order, v_order = code_orders(fmt)
    return [
        (layout.field("k_codes").offset, d, g * fmt.key_bits // 8, k_order),
        (layout.field("v_codes").offset, g, d * fmt.value_bits // 8, v_order),
    ]


def _permute(section: npt.NDArray[np.uint8], rows: int, order: CodeOrder) -> npt.NDArray[np.uint8]:
    """``[..., rows, row_bytes]`` (official) -> ``[..., rows * row_bytes]`` in ``order``."""
    lead = section.shape[:-2]
    if order == CodeOrder.TRANSPOSED:
        out = np.swapaxes(section, -1, -2)
    elif order == CodeOrder.PARITY:
        pairs = section.reshape(*lead, rows // 2, 2, section.shape[-1])
        out = np.moveaxis(pairs, -3, -1)  # [..., parity, row_bytes, rows / 2]
    else:
        out = section
    return np.ascontiguousarray(out).reshape(*lead, -1)


def _unpermute(
    flat: npt.NDArray[np.uint8], rows: int, row_bytes: int, order: CodeOrder
) -> npt.NDArray[np.uint8]:
    """The inverse of :func:`_permute`: ``[..., rows * row_bytes]`` -> official
    ``[..., rows, row_bytes]``."""
    lead = flat.shape[:-1]
    if order == CodeOrder.TRANSPOSED:
        out = np.swapaxes(flat.reshape(*lead, row_bytes, rows), -1, -2)
    elif order == CodeOrder.PARITY:
        split = flat.reshape(*lead, 2, row_bytes, rows // 2)
        out = np.moveaxis(split, -1, -3).reshape(*lead, rows, row_bytes)
    else:
        out = flat.reshape(*lead, rows, row_bytes)
    return np.ascontiguousarray(out)


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
    out = records.copy()
    for off, rows, row_bytes, order in code_sections(fmt, head_dim):
        sec = records[..., off : off + rows * row_bytes]
        out[..., off : off + rows * row_bytes] = _permute(
            sec.reshape(*sec.shape[:-1], rows, row_bytes), rows, order
        )
    return out


def from_cache_order(
    records: npt.NDArray[np.uint8], fmt: DenseFormat, head_dim: int
) -> npt.NDArray[np.uint8]:
    """The inverse of :func:`to_cache_order`: records read from a paged cache, in §2.1's
    order."""
    _check_records(records, fmt, head_dim)
    out = records.copy()
    for off, rows, row_bytes, order in code_sections(fmt, head_dim):
        sec = records[..., off : off + rows * row_bytes]
        official = _unpermute(sec, rows, row_bytes, order)
        out[..., off : off + rows * row_bytes] = official.reshape(*sec.shape[:-1], -1)
    return out
