"""Mapping a serving rank's share of an EXL3 axis onto stored slices and Hadamard windows."""

from __future__ import annotations

import pytest

from kvarn_ckpt.exl3 import RankPiece, aligned_window, rank_pieces


def test_aligned_window_on_and_off_block_boundaries() -> None:
    assert aligned_window(0, 512, 512) == (0, 512, 0)
    assert aligned_window(256, 128, 512) == (256, 384, 0)
    # 768 over 4 ranks: rank 1 owns [192, 384) -> decode [128, 384), keep from 64.
    assert aligned_window(192, 192, 768) == (128, 384, 64)
    # a padded lm_head shard: vocab 896 over 2 ranks, rank 1 owns [448, 896)
    assert aligned_window(448, 448, 896) == (384, 896, 64)
    assert aligned_window(1, 1, 128) == (0, 128, 1)


@pytest.mark.parametrize(
    ("start", "size", "full"), [(0, 1, 100), (-1, 4, 128), (0, 0, 128), (100, 100, 128)]
)
def test_aligned_window_rejects_bad_ranges(start: int, size: int, full: int) -> None:
    with pytest.raises(ValueError):
        aligned_window(start, size, full)


def test_rank_pieces_tr3_tp4_at_lower_and_higher_serving_tp() -> None:
    # 2048 intermediate stored as 4 rank slices of 512 (a TR3 TP4 checkpoint).
    assert rank_pieces(2048, 4, 1, 0) == [RankPiece(r, 0, 512, 0, 512, 512 * r) for r in range(4)]
    assert rank_pieces(2048, 4, 2, 1) == [
        RankPiece(2, 0, 512, 0, 512, 0),
        RankPiece(3, 0, 512, 0, 512, 512),
    ]
    assert rank_pieces(2048, 4, 4, 3) == [RankPiece(3, 0, 512, 0, 512, 0)]
    # TP8: rank 3 owns [768, 1024), the second half of stored slice 1.
    assert rank_pieces(2048, 4, 8, 3) == [RankPiece(1, 256, 512, 0, 256, 0)]


def test_rank_pieces_unaligned_share_of_one_stored_tensor() -> None:
    # Qwen3-30B-A3B-like: 768 over 4 ranks (192 each), experts stored whole.
    assert rank_pieces(768, 1, 4, 1) == [RankPiece(0, 128, 384, 64, 192, 0)]
    # 384 stored as 3 slices of 128, served over 2 ranks: rank 0 takes slice 0 and half of 1.
    assert rank_pieces(384, 3, 2, 0) == [
        RankPiece(0, 0, 128, 0, 128, 0),
        RankPiece(1, 0, 128, 0, 64, 128),
    ]


@pytest.mark.parametrize(
    ("full", "stored", "tp"),
    [(2048, 4, 1), (2048, 4, 2), (2048, 4, 8), (768, 1, 4), (768, 2, 3), (1536, 3, 4)],
)
def test_rank_pieces_cover_the_axis_exactly_once(full: int, stored: int, tp: int) -> None:
    per = full // stored
    covered: list[int] = []
    for rank in range(tp):
        pieces = rank_pieces(full, stored, tp, rank)
        dest = 0
        for p in pieces:
            assert p.lo % 128 == 0 and p.hi % 128 == 0 and 0 <= p.lo < p.hi <= per
            assert p.lo + p.offset + p.size <= p.hi and p.dest == dest
            covered.extend(
                range(p.stored * per + p.lo + p.offset, p.stored * per + p.lo + p.offset + p.size)
            )
            dest += p.size
        assert dest == full // tp
    assert covered == list(range(full))


def test_rank_pieces_rejects_uneven_splits() -> None:
    with pytest.raises(ValueError, match="does not split"):
        rank_pieces(1000, 4, 3, 0)
    with pytest.raises(ValueError, match="bad split"):
        rank_pieces(1024, 2, 2, 2)
