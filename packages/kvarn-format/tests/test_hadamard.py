"""The Sylvester Hadamard rotation: exact construction, orthonormality, score preservation."""

import numpy as np
import pytest

from kvarn_format.hadamard import hadamard_matrix, rotate, unrotate


@pytest.mark.parametrize("d", [1, 2, 64, 128, 256, 512])
def test_orthonormal_and_symmetric(d: int) -> None:
    h = hadamard_matrix(d)
    assert h.shape == (d, d)
    assert h.dtype == np.float64
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(h @ h, np.eye(d), atol=1e-12)


@pytest.mark.parametrize("d", [64, 128, 512])
def test_natural_order_entries(d: int) -> None:
    # Sylvester order: H[i, j] = (-1)^popcount(i & j) / sqrt(d); no random signs or permutation
    i, j = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
    parity = np.vectorize(lambda x: bin(x).count("1") % 2)(i & j)
    expected = np.where(parity == 1, -1.0, 1.0) / np.sqrt(d)
    np.testing.assert_array_equal(hadamard_matrix(d), expected)


def test_small_case_by_hand() -> None:
    s = 0.5
    expected = s * np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])
    np.testing.assert_array_equal(hadamard_matrix(4), expected)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_scores_preserved(d: int) -> None:
    rng = np.random.default_rng(d)
    q = rng.standard_normal((5, d))
    k = rng.standard_normal((7, d)) * np.where(np.arange(d) == 3, 40.0, 1.0)
    np.testing.assert_allclose(rotate(q) @ rotate(k).T, q @ k.T, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(unrotate(rotate(k)), k, atol=1e-10)


def test_outlier_channel_is_spread() -> None:
    x = np.zeros(128)
    x[17] = 100.0
    np.testing.assert_allclose(np.abs(rotate(x)), 100.0 / np.sqrt(128))


def test_cached_matrix_is_read_only() -> None:
    h = hadamard_matrix(64)
    assert h is hadamard_matrix(64)
    with pytest.raises(ValueError):
        h[0, 0] = 2.0


@pytest.mark.parametrize("bad", [0, -4, 3, 96, 2.0, True])
def test_rejects_non_powers_of_two(bad: object) -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(bad)  # type: ignore[arg-type]
