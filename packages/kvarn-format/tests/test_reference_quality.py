"""Error ordering of the reference codec: more bits help, KVarN beats plain KIVI RTN in MSE."""

import numpy as np
import pytest

from kvarn_format import VALID_DTYPES, DenseFormat, MLAFormat, parse_cache_dtype
from kvarn_format.reference import fake_quantize, fake_quantize_mla, rtn_kivi


def _rel(x_hat: np.ndarray, x: np.ndarray) -> float:
    return float(np.sum((x_hat - x) ** 2) / np.sum(x**2))


def _outlier_kv(seed: int, n: int, g: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys: channel bias, 10-50x outlier channels, log-normal token scales, a massive token
    per tile; values: Student-t with token scales."""
    rng = np.random.default_rng(seed)
    mag = np.ones(d)
    mag[rng.choice(d, max(2, d // 32), replace=False)] = rng.uniform(10, 50, max(2, d // 32))
    bias = rng.normal(0, 1, d)
    tok = np.exp(rng.normal(0, 0.5, (n, g, 1)))
    k = (rng.standard_normal((n, g, d)) + bias) * mag * tok
    k[np.arange(n), rng.integers(0, g, n), :2] *= 40.0
    v = rng.standard_t(3, (n, g, d)) * np.exp(rng.normal(0, 0.5, (n, g, 1)))
    return k, v


def _dense(name: str) -> DenseFormat:
    fmt = parse_cache_dtype(name)
    assert isinstance(fmt, DenseFormat)
    return fmt


@pytest.mark.parametrize("name", VALID_DTYPES)
def test_every_format_round_trips(name: str) -> None:
    fmt = parse_cache_dtype(name)
    rng = np.random.default_rng(len(name))
    g = fmt.group
    limit = {2: 0.35, 4: 0.02, 5: 0.005}
    if isinstance(fmt, MLAFormat):
        lat = rng.standard_normal((2, g, 512))
        rope = rng.standard_normal((2, g, 64))
        lat_hat, rope_hat = fake_quantize_mla(fmt, lat, rope)
        assert lat_hat.shape == lat.shape and lat_hat.dtype == np.float32
        assert _rel(lat_hat, lat) < limit[fmt.latent_bits]
        np.testing.assert_allclose(rope_hat, rope, rtol=2**-8)
    else:
        k = rng.standard_normal((2, g, 128))
        v = rng.standard_normal((2, g, 128))
        k_hat, v_hat = fake_quantize(fmt, k, v)
        assert k_hat.shape == k.shape and k_hat.dtype == np.float32
        assert _rel(k_hat, k) < limit[fmt.key_bits]
        assert _rel(v_hat, v) < limit[fmt.value_bits]


def test_error_shrinks_with_bits_dense() -> None:
    k, v = _outlier_kv(0, 8, 64, 128)
    errs = {}
    for name in ("kvarn_k4v2_g64", "kvarn_k4v4_g64", "kvarn_k5v5_g64"):
        k_hat, v_hat = fake_quantize(_dense(name), k, v)
        errs[name] = (_rel(k_hat, k), _rel(v_hat, v))
    # same K path for the two k4 formats
    assert errs["kvarn_k4v2_g64"][0] == errs["kvarn_k4v4_g64"][0]
    assert errs["kvarn_k4v4_g64"][0] > 2 * errs["kvarn_k5v5_g64"][0]
    assert errs["kvarn_k4v2_g64"][1] > 10 * errs["kvarn_k4v4_g64"][1]
    assert errs["kvarn_k4v4_g64"][1] > 2 * errs["kvarn_k5v5_g64"][1]


def test_k4v4_beats_k4v2_on_values_g128() -> None:
    k, v = _outlier_kv(1, 4, 128, 128)
    _, v2 = fake_quantize(_dense("kvarn_k4v2_g128"), k, v)
    _, v4 = fake_quantize(_dense("kvarn_k4v4_g128"), k, v)
    assert _rel(v4, v) < 0.1 * _rel(v2, v)


@pytest.mark.parametrize(("name", "head_dim"), [("kvarn_k4v2_g128", 128), ("kvarn_k4v4_g64", 64)])
def test_kvarn_beats_kivi_rtn_on_outlier_heavy_data(name: str, head_dim: int) -> None:
    fmt = _dense(name)
    k, v = _outlier_kv(2, 8, fmt.group, head_dim)
    k_kv, v_kv = fake_quantize(fmt, k, v)
    k_rtn, v_rtn = rtn_kivi(k, v, fmt.key_bits, fmt.value_bits)
    assert _rel(k_kv, k) < 0.6 * _rel(k_rtn, k)
    assert _rel(v_kv, v) < 0.5 * _rel(v_rtn, v)
    # Sinkhorn itself contributes on K: better than Hadamard + RTN alone
    k_had, _ = fake_quantize(fmt, k, v, sinkhorn=False)
    assert _rel(k_kv, k) < 0.8 * _rel(k_had, k)
