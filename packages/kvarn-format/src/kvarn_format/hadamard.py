"""The channel rotation of KVarN: an unrandomized Sylvester Hadamard matrix scaled by 1/sqrt(d).

Why this matrix (format-spec §2.2): it spreads an outlier channel's energy over all channels,
so a tile has no few dominant channels left for the per-row rounding to waste its range on. It
is symmetric and orthonormal (``H == H.T == inv(H)``), so the same matrix rotates K, V and Q
(``x @ H``) and un-rotates the attention output; scores are preserved because
``q . k == (q H) . (k H)``. There are no random signs or permutations: the format fixes H
exactly, so any implementation (NumPy, Triton, a checkpoint writer) produces the same frame.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import numpy.typing as npt

__all__ = ["hadamard_matrix", "rotate", "unrotate"]


@cache
def _hadamard(d: int) -> npt.NDArray[np.float64]:
    h: npt.NDArray[np.float64] = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < d:
        h = np.asarray(np.block([[h, h], [h, -h]]), dtype=np.float64)
    h = h / np.sqrt(float(d))
    h.setflags(write=False)
    return h


def hadamard_matrix(d: int) -> npt.NDArray[np.float64]:
    """The ``[d, d]`` Sylvester Hadamard matrix in natural order, divided by ``sqrt(d)``.

    Built by ``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``. ``d`` must be a power of two
    (the format uses 64, 128, 256 and 512). The returned array is cached and read-only.
    """
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a positive power of two, got {d!r}")
    return _hadamard(int(d))


def rotate(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """``x @ H`` over the last axis (the channel axis), computed in float64.

    Batched inputs are flattened to one 2-D GEMM, which takes NumPy's BLAS path even when
    ``x`` is a transposed view.
    """
    arr = np.ascontiguousarray(x, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError("rotate needs at least one axis (the channel axis)")
    d = arr.shape[-1]
    return (arr.reshape(-1, d) @ hadamard_matrix(d)).reshape(arr.shape)


def unrotate(x_rot: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Inverse of :func:`rotate`; equal to it because H is its own inverse."""
    return rotate(x_rot)
