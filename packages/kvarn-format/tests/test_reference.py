"""The dense reference codec: primitives, error bound, record layout, robustness."""

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn_format import DENSE_DTYPES, DenseFormat, parse_cache_dtype, record_layout
from kvarn_format.hadamard import hadamard_matrix
from kvarn_format.packing import pack_codes
from kvarn_format.reference import (
    DENSE_SINKHORN_ITERS,
    MLA_SINKHORN_ITERS,
    NonFiniteInputError,
    decode_rotated_tile,
    decode_rotated_tiles,
    decode_tile,
    decode_tiles,
    encode_rotated_tile,
    encode_rotated_tiles,
    encode_tile,
    encode_tiles,
    fake_quantize,
    rtn,
    rtn_kivi,
    sinkhorn,
)
from kvarn_format.sinkhorn import LOG_SCALE_MAX, LOG_SCALE_MIN, imbalance, sinkhorn_batched


def _dense(name: str) -> DenseFormat:
    fmt = parse_cache_dtype(name)
    assert isinstance(fmt, DenseFormat)
    return fmt


def _fields(fmt: DenseFormat, head_dim: int, record: np.ndarray) -> dict[str, np.ndarray]:
    """Read every fp16 field of a record straight from the geometry offsets."""
    out = {}
    for f in record_layout(fmt, head_dim).fields:
        if f.dtype == "f16":
            out[f.name] = record[f.offset : f.end].view("<f2").astype(np.float64)
    return out


def _outlier_tiles(rng: np.random.Generator, n: int, g: int, d: int) -> tuple[Any, Any]:
    """Keys with 10-50x outlier channels, channel bias, per-token scale and a massive token;
    heavy-tailed values."""
    tok = np.exp(rng.normal(0.0, 0.6, (n, g, 1)))
    chan = np.ones(d)
    chan[rng.choice(d, 4, replace=False)] = rng.uniform(10, 50, 4)
    k = (rng.standard_normal((n, g, d)) + rng.normal(0, 1, d)) * chan * tok
    k[:, 0, :] *= 30.0
    v = rng.standard_t(3, (n, g, d)) * tok
    return k, v


def _as_fp16(x: np.ndarray) -> np.ndarray:
    """What the fp16 pool holds: saturate, round to fp16, widen to float32."""
    return np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)


def _fp16_rot(rng: np.random.Generator, g: int, d: int, scale: float = 1.0) -> np.ndarray:
    return _as_fp16(rng.standard_normal((g, d)) * scale)


# ---------------------------------------------------------------------------------------------
# primitives


def test_constants() -> None:
    assert DENSE_SINKHORN_ITERS == 8
    assert MLA_SINKHORN_ITERS == 16


def test_rtn_rounds_half_to_even_and_clamps() -> None:
    x = np.array([[0.0, 0.5, 1.5, 2.5, 3.0]], dtype=np.float32)  # step 1, lo 0
    codes, scale, lo = rtn(x, 2)
    assert codes.tolist() == [[0, 0, 2, 2, 3]]
    assert scale.tolist() == [1.0]
    assert lo.tolist() == [0.0]


def test_rtn_constant_row_has_floor_scale() -> None:
    codes, scale, lo = rtn(np.full((2, 8), 3.25, dtype=np.float32), 4)
    assert np.all(codes == 0)
    np.testing.assert_allclose(scale, 1e-10)
    np.testing.assert_array_equal(lo, 3.25)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([2, 4, 5]))
def test_rtn_error_within_half_step(seed: int, bits: int) -> None:
    x = np.random.default_rng(seed).standard_t(2, (4, 64)).astype(np.float32)
    codes, scale, lo = rtn(x, bits)
    assert codes.max() <= (1 << bits) - 1
    err = np.abs(codes * scale[:, None] + lo[:, None] - x)
    assert np.all(err <= 0.5 * scale[:, None] * (1 + 1e-5) + 1e-6 * np.abs(x))


def _sinkhorn_by_the_spec(x: np.ndarray, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Straight transcription of the format-spec pseudo-code, with np.std(ddof=1)."""

    def imb(t: np.ndarray) -> float:
        cs, rs = t.std(axis=0, ddof=1), t.std(axis=1, ddof=1)
        return float(cs.max() / max(cs.min(), 1e-8) + rs.max() / max(rs.min(), 1e-8))

    lc = np.zeros(x.shape[1], np.float32)
    lr = np.zeros(x.shape[0], np.float32)
    best, bc, br = imb(x), np.ones_like(lc), np.ones_like(lr)
    for _ in range(iters):
        cur = x / np.exp(lc)[None, :] / np.exp(lr)[:, None]
        lc = np.clip(lc + np.log(np.clip(cur.std(axis=0, ddof=1), 1e-3, 1e3)), -0.3, 10)
        cur = x / np.exp(lc)[None, :] / np.exp(lr)[:, None]
        lr = np.clip(lr + np.log(np.clip(cur.std(axis=1, ddof=1), 1e-3, 1e3)), -0.3, 10)
        cur = x / np.exp(lc)[None, :] / np.exp(lr)[:, None]
        m = imb(cur)
        if m <= best:
            best, bc, br = m, np.exp(lc), np.exp(lr)
    return bc, br


@pytest.mark.parametrize("seed", range(4))
def test_sinkhorn_matches_spec_transcription(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, _ = _outlier_tiles(rng, 1, 64, 128)
    tile = (k[0] @ hadamard_matrix(128)).T.astype(np.float32)  # K orientation [D, G]
    col, row = sinkhorn(tile, 8)
    ref_col, ref_row = _sinkhorn_by_the_spec(tile.astype(np.float64), 8)
    np.testing.assert_allclose(col, ref_col, rtol=2e-4)
    np.testing.assert_allclose(row, ref_row, rtol=2e-4)


def test_sinkhorn_reduces_imbalance_and_keeps_scale_bounds() -> None:
    rng = np.random.default_rng(7)
    tiles = rng.standard_normal((6, 128, 64)).astype(np.float32)
    tiles *= np.exp(rng.normal(0, 1.5, (6, 1, 64))).astype(np.float32)  # unbalanced columns
    tiles *= np.exp(rng.normal(0, 1.0, (6, 128, 1))).astype(np.float32)  # and rows
    col, row = sinkhorn_batched(tiles, 8)
    assert col.shape == (6, 64) and row.shape == (6, 128)
    for s in (col, row):
        assert np.all(s >= np.exp(np.float32(LOG_SCALE_MIN)) * (1 - 1e-6))
        assert np.all(s <= np.exp(np.float32(LOG_SCALE_MAX)) * (1 + 1e-6))
    balanced = tiles / col[:, None, :] / row[:, :, None]
    before, after = imbalance(tiles), imbalance(balanced)
    assert np.all(after <= before)
    assert np.all(after < 0.5 * before)
    # the balanced tile times its scales is the tile again
    np.testing.assert_allclose(balanced * col[:, None, :] * row[:, :, None], tiles, rtol=1e-5)
    # batched equals one at a time
    c2, r2 = sinkhorn(tiles[3], 8)
    np.testing.assert_array_equal(c2, col[3])
    np.testing.assert_array_equal(r2, row[3])


def test_sinkhorn_zero_iterations_and_ties() -> None:
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    col, row = sinkhorn(x, 0)
    np.testing.assert_array_equal(col, 1.0)
    np.testing.assert_array_equal(row, 1.0)
    # An all-zero tile scores 0 in every state, so the ``<=`` rule keeps the last state, whose
    # log-scales sit at the lower clip (std 0 -> clamped to 1e-3 -> log clipped to -0.3).
    col, row = sinkhorn(np.zeros((16, 8), np.float32), 8)
    np.testing.assert_allclose(col, np.exp(LOG_SCALE_MIN), rtol=1e-6)
    np.testing.assert_allclose(row, np.exp(LOG_SCALE_MIN), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# error bound in the rotated frame


def _check_bound(fmt: DenseFormat, rec: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """|x_hat - x| <= step/2 + fp16 slack, per element, with the fields as stored."""
    d = k.shape[1]
    f = _fields(fmt, d, rec)
    k_hat, v_hat = decode_rotated_tile(fmt, rec, d)

    def bound(a: np.ndarray, z: np.ndarray, b: np.ndarray, bits: int, x: np.ndarray) -> Any:
        qmax = (1 << bits) - 1
        u = 2.0**-10  # twice the fp16 unit roundoff
        tiny = 2.0**-24  # fp16 subnormal spacing
        slack = b * ((qmax + 1) * (np.abs(a) * u + tiny) + np.abs(z) * u + tiny)
        return 0.5 * np.abs(a) * b + slack + 1e-5 * np.abs(x) + 1e-30

    # K[t, d]: row = channel d (scale, zero), column = token t
    ka, kz, kt = f["k_scale"][None, :], f["k_zero"][None, :], f["k_token_scale"][:, None]
    kb = bound(ka, kz, kt, fmt.key_bits, k)
    # V[t, d]: row = token t (scale, zero), column = channel d
    va, vz, vc = f["v_scale"][:, None], f["v_zero"][:, None], f["v_channel_scale"][None, :]
    vb = bound(va, vz, vc, fmt.value_bits, v)
    assert np.all(np.abs(k_hat - k) <= kb), float(np.max(np.abs(k_hat - k) - kb))
    assert np.all(np.abs(v_hat - v) <= vb), float(np.max(np.abs(v_hat - v) - vb))


@pytest.mark.parametrize("name", DENSE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_error_within_quantization_bound(name: str, head_dim: int) -> None:
    fmt = _dense(name)
    rng = np.random.default_rng(head_dim)
    k, v = _outlier_tiles(rng, 1, fmt.group, head_dim)
    h = hadamard_matrix(head_dim)
    k_rot = (k[0] @ h).astype(np.float16).astype(np.float32)
    v_rot = (v[0] @ h).astype(np.float16).astype(np.float32)
    rec = encode_rotated_tile(fmt, k_rot, v_rot)
    _check_bound(fmt, rec, k_rot, v_rot)


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(DENSE_DTYPES),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1e-4, 1.0, 300.0, 2e4]),
)
def test_error_bound_property(name: str, seed: int, magnitude: float) -> None:
    fmt = _dense(name)
    rng = np.random.default_rng(seed)
    k = _fp16_rot(rng, fmt.group, 64, magnitude)
    v = _fp16_rot(rng, fmt.group, 64, magnitude)
    k[rng.integers(fmt.group), :] *= 8  # a loud token
    v[:, rng.integers(64)] *= 8  # a loud channel
    k, v = _as_fp16(k), _as_fp16(v)
    _check_bound(fmt, encode_rotated_tile(fmt, k, v), k, v)


def test_original_frame_round_trip_and_frames_agree() -> None:
    fmt = _dense("kvarn_k4v4_g64")
    rng = np.random.default_rng(3)
    k, v = _outlier_tiles(rng, 1, 64, 128)
    rec = encode_tile(fmt, k[0], v[0])
    h = hadamard_matrix(128)
    rec_rot = encode_rotated_tile(fmt, k[0] @ h, v[0] @ h)
    np.testing.assert_array_equal(rec, rec_rot)
    k_hat, v_hat = decode_tile(fmt, rec, 128)
    k_rot_hat, v_rot_hat = decode_rotated_tile(fmt, rec, 128)
    np.testing.assert_allclose(k_hat, k_rot_hat @ h, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(v_hat, v_rot_hat @ h, rtol=1e-5, atol=1e-4)
    rel = np.linalg.norm(k_hat - k[0]) / np.linalg.norm(k[0])
    assert rel < 0.1


# ---------------------------------------------------------------------------------------------
# record layout


def test_hand_built_record_decodes_by_the_geometry_offsets() -> None:
    fmt = _dense("kvarn_k4v2_g64")
    g, d = 64, 64
    layout = record_layout(fmt, d)
    rng = np.random.default_rng(11)
    kq = rng.integers(0, 16, (d, g), dtype=np.uint8)  # [channel][token]
    vq = rng.integers(0, 4, (g, d), dtype=np.uint8)  # [token][channel]
    values = {
        "k_scale": rng.uniform(0.1, 2, d),
        "k_zero": rng.uniform(-3, 3, d),
        "k_token_scale": rng.uniform(0.75, 4, g),
        "v_channel_scale": rng.uniform(0.75, 4, d),
        "v_scale": rng.uniform(0.1, 2, g),
        "v_zero": rng.uniform(-3, 3, g),
    }
    rec = np.zeros(layout.tile_bytes, dtype=np.uint8)
    for name, val in values.items():
        fld = layout.field(name)
        rec[fld.offset : fld.end] = val.astype("<f2").view(np.uint8)
        values[name] = val.astype(np.float16).astype(np.float64)
    kc, vc = layout.field("k_codes"), layout.field("v_codes")
    rec[kc.offset : kc.end] = pack_codes(kq, 4).ravel()
    rec[vc.offset : vc.end] = pack_codes(vq, 2).ravel()
    k_hat, v_hat = decode_rotated_tile(fmt, rec, d)
    k_exp = (kq * values["k_scale"][:, None] + values["k_zero"][:, None]) * values["k_token_scale"][
        None, :
    ]
    v_exp = (vq * values["v_scale"][:, None] + values["v_zero"][:, None]) * values[
        "v_channel_scale"
    ][None, :]
    np.testing.assert_allclose(k_hat, k_exp.T, rtol=1e-6)
    np.testing.assert_allclose(v_hat, v_exp, rtol=1e-6)


def test_encoded_fields_land_at_geometry_offsets() -> None:
    fmt = _dense("kvarn_k5v5_g64")
    rng = np.random.default_rng(5)
    k, v = _fp16_rot(rng, 64, 128), _fp16_rot(rng, 64, 128)
    rec = encode_rotated_tile(fmt, k, v)
    layout = record_layout(fmt, 128)
    f = _fields(fmt, 128, rec)
    # rebuild the decode by hand from the raw field bytes: codes unpacked bit by bit
    kc = layout.field("k_codes")
    bits = np.unpackbits(rec[kc.offset : kc.end].reshape(128, -1), axis=1, bitorder="little")
    kq = (bits.reshape(128, 64, 5) * (1 << np.arange(5))).sum(axis=2)  # [channel][token]
    k_exp = (kq * f["k_scale"][:, None] + f["k_zero"][:, None]) * f["k_token_scale"][None, :]
    np.testing.assert_allclose(decode_rotated_tile(fmt, rec, 128)[0], k_exp.T, rtol=1e-6)
    # Sinkhorn scales are never below e^-0.3 and the per-channel V scale is one of them
    assert np.all(f["v_channel_scale"] >= 0.74)
    assert np.all(f["k_token_scale"] >= 0.74)


def test_pad_bytes_zero_with_pow2_slots() -> None:
    fmt = _dense("kvarn_k4v2_g128")
    layout = record_layout(fmt, 256, slot_rounding="pow2")
    assert layout.pad_bytes > 0
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 128, 256)), rng.standard_normal((2, 128, 256))
    rec = encode_tiles(fmt, k, v, slot_rounding="pow2")
    assert rec.shape == (2, layout.tile_bytes)
    assert not rec[:, layout.payload_bytes :].any()
    dense = encode_tiles(fmt, k, v)
    np.testing.assert_array_equal(rec[:, : layout.payload_bytes], dense[:, : layout.payload_bytes])
    k1, v1 = decode_tiles(fmt, rec, 256, slot_rounding="pow2")
    k2, v2 = decode_tiles(fmt, dense, 256)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)


def test_deterministic_and_batch_independent() -> None:
    fmt = _dense("kvarn_k4v2_g128")
    rng = np.random.default_rng(9)
    k, v = _outlier_tiles(rng, 70, 128, 64)  # more than one internal chunk
    a = encode_tiles(fmt, k, v)
    b = encode_tiles(fmt, k.copy(), v.copy())
    np.testing.assert_array_equal(a, b)
    for i in (0, 63, 64, 69):
        np.testing.assert_array_equal(a[i], encode_tile(fmt, k[i], v[i]))
    kb, vb = decode_tiles(fmt, a, 64)
    k1, v1 = decode_tile(fmt, a[65], 64)
    np.testing.assert_array_equal(kb[65], k1)
    np.testing.assert_array_equal(vb[65], v1)


def test_sinkhorn_off_is_a_valid_record_with_unit_scales() -> None:
    fmt = _dense("kvarn_k4v4_g128")
    rng = np.random.default_rng(4)
    k, v = _fp16_rot(rng, 128, 128), _fp16_rot(rng, 128, 128)
    rec = encode_rotated_tiles(fmt, k[None], v[None], sinkhorn=False)[0]
    f = _fields(fmt, 128, rec)
    np.testing.assert_array_equal(f["k_token_scale"], 1.0)
    np.testing.assert_array_equal(f["v_channel_scale"], 1.0)
    _check_bound(fmt, rec, k, v)
    np.testing.assert_array_equal(rec, encode_rotated_tile(fmt, k, v, sinkhorn_iters=0))
    assert not np.array_equal(rec, encode_rotated_tile(fmt, k, v))


# ---------------------------------------------------------------------------------------------
# robustness


def _degenerate(kind: str, g: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "zeros":
        return np.zeros((g, d))
    if kind == "constant":
        return np.full((g, d), 3.7)
    if kind == "huge_outlier":
        x = rng.standard_normal((g, d))
        x[5, 7] = 6.5e4
        return x
    if kind == "near_fp16_max":
        return rng.choice([-65504.0, 65504.0, 60000.0, -1.0], size=(g, d))
    if kind == "tiny":
        return rng.standard_normal((g, d)) * 1e-8
    if kind == "one_token_max":
        x = rng.standard_normal((g, d)) * 1e-3
        x[3] = -65504.0
        return x
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["zeros", "constant", "huge_outlier", "near_fp16_max", "tiny", "one_token_max"]
)
@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k5v5_g64"])
def test_degenerate_tiles_stay_finite(kind: str, name: str) -> None:
    fmt = _dense(name)
    for d in (64, 256):
        x = _degenerate(kind, fmt.group, d)
        for rotated in (False, True):
            if rotated:
                rec = encode_rotated_tile(fmt, x, x[::-1])
                k_hat, v_hat = decode_rotated_tile(fmt, rec, d)
            else:
                rec = encode_tile(fmt, x, x[::-1])
                k_hat, v_hat = decode_tile(fmt, rec, d)
            assert np.all(np.isfinite(k_hat)) and np.all(np.isfinite(v_hat))
            assert np.all(np.isfinite(np.concatenate(list(_fields(fmt, d, rec).values()))))
            if kind in ("zeros", "tiny"):
                assert np.abs(k_hat).max() < 1e-5 and np.abs(v_hat).max() < 1e-5
            if kind == "constant" and not rotated:
                np.testing.assert_allclose(k_hat, x, rtol=5e-3)
            if rotated and kind in ("near_fp16_max", "one_token_max"):
                x16 = _as_fp16(x)
                _check_bound(fmt, rec, x16, x16[::-1])


def test_overflowing_absorbed_zero_is_rescaled_not_inf() -> None:
    # a token row near -fp16 max whose channel scales sit at e^-0.3: v_zero would be ~88k
    fmt = _dense("kvarn_k4v4_g128")
    rng = np.random.default_rng(1)
    v = (rng.standard_normal((128, 128)) * 0.01).astype(np.float32)
    v[5, :] = -65504 * rng.uniform(0.9, 1.0, 128)
    v[5, :64] = 65504
    v = v.astype(np.float16).astype(np.float32)
    rec = encode_rotated_tile(fmt, v.T.copy(), v)
    f = _fields(fmt, 128, rec)
    assert f["v_channel_scale"].max() > np.exp(0.0)  # a power of two moved onto the scale
    assert all(np.all(np.isfinite(x)) for x in f.values())
    _check_bound(fmt, rec, v.T.copy(), v)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises(bad: float) -> None:
    fmt = _dense("kvarn_k4v2_g64")
    k = np.zeros((64, 128), np.float32)
    v = np.zeros((64, 128), np.float32)
    k[2, 3] = bad
    for fn in (encode_tile, encode_rotated_tile):
        with pytest.raises(NonFiniteInputError, match=r"k holds 1 NaN/Inf.*\(2, 3\)"):
            fn(fmt, k, v)
        with pytest.raises(NonFiniteInputError, match="v holds"):
            fn(fmt, v, k)
    with pytest.raises(NonFiniteInputError):
        fake_quantize(fmt, k[None], v[None])
    with pytest.raises(NonFiniteInputError):
        rtn_kivi(k, v, 4, 2)
    assert issubclass(NonFiniteInputError, ValueError)


def test_bad_shapes_and_dtypes_name_the_expected_shape() -> None:
    fmt = _dense("kvarn_k4v2_g128")
    x = np.zeros((128, 128), np.float32)
    with pytest.raises(ValueError, match=r"\[G, D\] with G=128"):
        encode_tile(fmt, x[:64], x[:64])
    with pytest.raises(ValueError, match=r"same shape"):
        encode_tile(fmt, x, x[:, :64])
    with pytest.raises(ValueError, match=r"\[N, G, D\]"):
        encode_tiles(fmt, x, x)
    with pytest.raises(ValueError, match="floating-point"):
        encode_tile(fmt, x.astype(np.int32), x)
    with pytest.raises(ValueError, match="head_dim=96"):
        encode_tile(fmt, x[:, :96], x[:, :96])
    rec = encode_tile(fmt, x, x)
    with pytest.raises(ValueError, match=r"uint8 array of shape \[13824\]"):
        decode_tile(fmt, rec[:-8], 128)
    with pytest.raises(ValueError, match=r"\[N, 13824\]"):
        decode_tiles(fmt, rec, 128)
    with pytest.raises(ValueError, match="not a dense format"):
        encode_tile(parse_cache_dtype("kvarn_mla_k4_g128"), x, x)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        encode_rotated_tile(fmt, x, x, sinkhorn_iters=-1)
    with pytest.raises(ValueError, match=r"\[\.\.\., G, D\]"):
        rtn_kivi(x, x[:, :64], 4, 2)


# ---------------------------------------------------------------------------------------------
# batched API, fake quantization and the KIVI baseline


def test_fake_quantize_equals_decode_of_encode() -> None:
    fmt = _dense("kvarn_k4v2_g64")
    rng = np.random.default_rng(8)
    k, v = _outlier_tiles(rng, 3, 64, 128)
    kh, vh = fake_quantize(fmt, k, v)
    k2, v2 = decode_tiles(fmt, encode_tiles(fmt, k, v), 128)
    np.testing.assert_array_equal(kh, k2)
    np.testing.assert_array_equal(vh, v2)
    kr, vr = fake_quantize(fmt, k, v, rotated=True)
    k3, v3 = decode_rotated_tiles(fmt, encode_rotated_tiles(fmt, k, v), 128)
    np.testing.assert_array_equal(kr, k3)
    np.testing.assert_array_equal(vr, v3)


def test_rtn_kivi_axes() -> None:
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 64, 128))
    v = rng.standard_normal((2, 64, 128))
    k[:, :, 5] += 100.0  # per-channel offset: KIVI's per-channel K absorbs it exactly
    kh, vh = rtn_kivi(k, v, 4, 2)
    k_err = np.abs(kh - k)
    step_k = (k.max(axis=1) - k.min(axis=1)) / 15  # per (tile, channel)
    assert np.all(k_err <= 0.5 * step_k[:, None, :] + 1e-4)
    step_v = (v.max(axis=2) - v.min(axis=2)) / 3  # per (tile, token)
    assert np.all(np.abs(vh - v) <= 0.5 * step_v[:, :, None] + 1e-5)
