"""Variance normalization ("Sinkhorn") of a tile in the log domain (format-spec §2.4).

Why: min/max rounding of a row wastes its levels when a few columns (tokens for K, channels
for V) have much larger spread than the rest. Dividing the tile by one scale per column and
one per row, chosen so that all column and row standard deviations become similar, lets every
row use its levels on typical values; the scales are stored and multiplied back at decode.

The algorithm alternates a column update and a row update for a fixed number of iterations
and keeps the scaling with the lowest imbalance seen so far (ties go to the later state; the
identity scaling is the starting best), because the iteration is not monotone and the last
state can be worse than an earlier one. All arithmetic is float32, standard deviations are
unbiased (divide by N-1) and computed in two passes (mean, then centred squares) so that rows
with a large common offset do not lose precision.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "CLIP_STD_MAX",
    "CLIP_STD_MIN",
    "IMBALANCE_EPS",
    "LOG_SCALE_MAX",
    "LOG_SCALE_MIN",
    "imbalance",
    "sinkhorn",
    "sinkhorn_batched",
]

#: Standard deviations are clamped to this range before taking their log.
CLIP_STD_MIN: Final[float] = 1e-3
CLIP_STD_MAX: Final[float] = 1e3
#: Accumulated log-scales are clipped to this range: a scale lies in [e^-0.3, e^10].
LOG_SCALE_MIN: Final[float] = -0.3
LOG_SCALE_MAX: Final[float] = 10.0
#: Floor of the smallest standard deviation in the imbalance ratio.
IMBALANCE_EPS: Final[float] = 1e-8

_F32 = np.float32


def _std(x: npt.NDArray[np.float32], axis: int) -> npt.NDArray[np.float32]:
    """Unbiased standard deviation along ``axis`` (float32, two-pass)."""
    n = x.shape[axis]
    centred = x - x.mean(axis=axis, keepdims=True, dtype=_F32)
    np.square(centred, out=centred)
    var = np.asarray(centred.sum(axis=axis, dtype=_F32), dtype=_F32) / _F32(max(n - 1, 1))
    return np.asarray(np.sqrt(var), dtype=_F32)


def _ratio(std: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    top = np.asarray(std.max(axis=-1), dtype=_F32)
    return np.asarray(top / np.maximum(std.min(axis=-1), _F32(IMBALANCE_EPS)), dtype=_F32)


def imbalance(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``max/min`` of the column stds plus ``max/min`` of the row stds of ``x[..., R, C]``.

    2.0 means perfectly balanced. The minimum std is floored at 1e-8, so a constant tile
    scores 0 (its stds are all zero) rather than NaN.
    """
    arr = np.asarray(x, dtype=_F32)
    if arr.ndim < 2:
        raise ValueError(f"imbalance needs a tile [..., R, C], got shape {arr.shape}")
    return _ratio(_std(arr, -2)) + _ratio(_std(arr, -1))


def _step(log_s: npt.NDArray[np.float32], std: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    clamped = np.clip(std, _F32(CLIP_STD_MIN), _F32(CLIP_STD_MAX))
    return np.asarray(
        np.clip(log_s + np.log(clamped), _F32(LOG_SCALE_MIN), _F32(LOG_SCALE_MAX)), dtype=_F32
    )


def sinkhorn_batched(
    x: npt.ArrayLike, iters: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Best-imbalance Sinkhorn scales of a batch of tiles ``x[N, R, C]``.

    Returns ``(col_scale [N, C], row_scale [N, R])`` (float32, each in ``[e^-0.3, e^10]``);
    the balanced tile is ``x / col_scale[:, None, :] / row_scale[:, :, None]``. Per iteration:
    column stds (over rows) of the current tile update the column log-scales, the tile is
    re-divided, row stds update the row log-scales, the tile is re-divided, and the state is
    kept when its imbalance is ``<=`` the best so far.
    """
    if isinstance(iters, bool) or not isinstance(iters, int | np.integer) or iters < 0:
        raise ValueError(f"sinkhorn iterations must be a non-negative integer, got {iters!r}")
    arr = np.asarray(x, dtype=_F32)
    if arr.ndim != 3 or arr.shape[1] < 2 or arr.shape[2] < 2:
        raise ValueError(f"sinkhorn_batched needs tiles [N, R, C] with R, C >= 2, got {arr.shape}")
    n, r, c = arr.shape
    log_c = np.zeros((n, c), dtype=_F32)
    log_r = np.zeros((n, r), dtype=_F32)
    best_c = np.zeros((n, c), dtype=_F32)
    best_r = np.zeros((n, r), dtype=_F32)
    col_std = _std(arr, -2)
    best = _ratio(col_std) + _ratio(_std(arr, -1))
    for _ in range(int(iters)):
        log_c = _step(log_c, col_std)
        inv_c = np.exp(-log_c)
        inv_r = np.exp(-log_r)
        cur = arr * inv_c[:, None, :]
        cur *= inv_r[:, :, None]
        log_r = _step(log_r, _std(cur, -1))
        inv_r = np.exp(-log_r)
        cur = arr * inv_c[:, None, :]
        cur *= inv_r[:, :, None]
        col_std = _std(cur, -2)
        score = _ratio(col_std) + _ratio(_std(cur, -1))
        take = score <= best
        best = np.where(take, score, best)
        best_c = np.where(take[:, None], log_c, best_c)
        best_r = np.where(take[:, None], log_r, best_r)
    return np.exp(best_c).astype(_F32), np.exp(best_r).astype(_F32)


def sinkhorn(
    x: npt.ArrayLike, iters: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Best-imbalance Sinkhorn scales of one tile ``x[R, C]``: ``(col_scale [C], row_scale [R])``.

    See :func:`sinkhorn_batched`, which this calls with a batch of one.
    """
    arr = np.asarray(x, dtype=_F32)
    if arr.ndim != 2:
        raise ValueError(f"sinkhorn needs one tile [R, C], got shape {arr.shape}")
    col, row = sinkhorn_batched(arr[None], iters)
    return col[0], row[0]
