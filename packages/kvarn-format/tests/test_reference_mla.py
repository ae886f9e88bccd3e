"""The MLA reference codec: latent round trip, code orientation, exact RoPE storage."""

import numpy as np
import pytest

from kvarn_format import MLA_DTYPES, MLAFormat, parse_cache_dtype, record_layout
from kvarn_format.hadamard import hadamard_matrix
from kvarn_format.quant import BF16_MAX, bf16_bits_to_float32, to_bf16_bits
from kvarn_format.reference import (
    NonFiniteInputError,
    decode_mla_tile,
    decode_mla_tiles,
    decode_rotated_mla_tile,
    encode_mla_tile,
    encode_mla_tiles,
    encode_rotated_mla_tile,
    fake_quantize_mla,
)


def _mla(name: str) -> MLAFormat:
    fmt = parse_cache_dtype(name)
    assert isinstance(fmt, MLAFormat)
    return fmt


def _latent(rng: np.random.Generator, g: int) -> np.ndarray:
    """An RMS-normed-looking latent with a few louder channels and per-token scales."""
    x = rng.standard_normal((g, 512))
    x[:, rng.choice(512, 6, replace=False)] *= 8.0
    x *= np.exp(rng.normal(0, 0.3, (g, 1)))
    return x


def _fields(fmt: MLAFormat, record: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for f in record_layout(fmt).fields:
        if f.dtype == "f16":
            out[f.name] = record[f.offset : f.end].view("<f2").astype(np.float64)
    return out


def _bf16_nearest_even(x: float) -> float:
    """Independent bf16 rounding: pick the nearer of the two bf16 neighbours, ties to even."""
    bits = int(np.float32(x).view(np.uint32))
    lo = bits & 0xFFFF0000
    hi = lo + 0x10000
    rem = bits & 0xFFFF
    round_up = rem > 0x8000 or (rem == 0x8000 and (lo >> 16) & 1 == 1)
    chosen = hi if round_up else lo
    return float(np.uint32(chosen).view(np.float32))


@pytest.mark.parametrize("name", MLA_DTYPES)
def test_latent_round_trip_within_bound(name: str) -> None:
    fmt = _mla(name)
    g = fmt.group
    rng = np.random.default_rng(g + fmt.latent_bits)
    latent = _latent(rng, g)
    rope = rng.standard_normal((g, 64))
    rec = encode_mla_tile(fmt, latent, rope)
    assert rec.shape == (record_layout(fmt).tile_bytes,)
    # rotated frame: per-element bound from the stored fields (per-channel scale/zero,
    # per-token scale), as for dense K
    lat_rot = np.clip(latent @ hadamard_matrix(512), -65504, 65504)
    lat_rot = lat_rot.astype(np.float16).astype(np.float64)
    got_rot, _ = decode_rotated_mla_tile(fmt, rec)
    f = _fields(fmt, rec)
    a, z = f["latent_scale"][None, :], f["latent_zero"][None, :]
    b = f["latent_token_scale"][:, None]
    qmax = (1 << fmt.latent_bits) - 1
    slack = b * ((qmax + 1) * (np.abs(a) * 2**-10 + 2**-24) + np.abs(z) * 2**-10 + 2**-24)
    bound = 0.5 * np.abs(a) * b + slack + 1e-5 * np.abs(lat_rot)
    assert np.all(np.abs(got_rot - lat_rot) <= bound)
    # original frame: relative error in line with the bit width
    got, _ = decode_mla_tile(fmt, rec)
    rel = np.linalg.norm(got - latent) / np.linalg.norm(latent)
    assert rel < {2: 0.45, 4: 0.12, 5: 0.06}[fmt.latent_bits]


def test_error_shrinks_with_bits() -> None:
    rng = np.random.default_rng(0)
    latent = np.stack([_latent(rng, 64) for _ in range(4)])
    rope = rng.standard_normal((4, 64, 64))
    errs = []
    for name in ("kvarn_mla_k2_g64", "kvarn_mla_k4_g64", "kvarn_mla_k5_g64"):
        got, _ = fake_quantize_mla(_mla(name), latent, rope)
        errs.append(float(np.sum((got - latent) ** 2) / np.sum(latent**2)))
    assert errs[0] > 3 * errs[1] > 3 * 1.5 * errs[2]


def test_rope_exact_fp16_for_g128() -> None:
    fmt = _mla("kvarn_mla_k4_g128")
    rng = np.random.default_rng(1)
    rope16 = (rng.standard_normal((128, 64)) * 30).astype(np.float16)
    _, rope = decode_mla_tile(fmt, encode_mla_tile(fmt, _latent(rng, 128), rope16))
    np.testing.assert_array_equal(rope, rope16.astype(np.float32))
    # float32 input is rounded to the nearest fp16, saturating instead of overflowing
    rope32 = rng.standard_normal((128, 64)).astype(np.float32)
    rope32[0, 0] = 1e6
    _, rope = decode_mla_tile(fmt, encode_mla_tile(fmt, _latent(rng, 128), rope32))
    expected = np.clip(rope32, -65504, 65504).astype(np.float16).astype(np.float32)
    assert expected[0, 0] == 65504.0
    np.testing.assert_array_equal(rope, expected)


@pytest.mark.parametrize("name", ["kvarn_mla_k2_g64", "kvarn_mla_k4_g64", "kvarn_mla_k5_g64"])
def test_rope_bf16_rounded_for_g64_family(name: str) -> None:
    fmt = _mla(name)
    rng = np.random.default_rng(2)
    rope = (rng.standard_normal((64, 64)) * 100).astype(np.float32)
    _, got = decode_mla_tile(fmt, encode_mla_tile(fmt, _latent(rng, 64), rope))
    expected = np.vectorize(_bf16_nearest_even)(rope)
    np.testing.assert_array_equal(got, expected)
    # bf16 values pass through exactly
    exact = bf16_bits_to_float32(to_bf16_bits(rope))
    _, got = decode_mla_tile(fmt, encode_mla_tile(fmt, _latent(rng, 64), exact))
    np.testing.assert_array_equal(got, exact)


def test_bf16_rounding_ties_and_saturation() -> None:
    one = 1.0
    ulp = 2.0**-7  # bf16 spacing at 1.0
    cases = np.array(
        [one + ulp / 2, one + 3 * ulp / 2, -(one + ulp / 2), one + ulp / 2 + 2**-20, 3.4e38, -1e39],
        dtype=np.float64,
    )
    got = bf16_bits_to_float32(to_bf16_bits(cases)).astype(np.float64)
    assert got[0] == one  # tie -> even (mantissa 0)
    assert got[1] == one + 2 * ulp  # tie -> even (mantissa 2)
    assert got[2] == -one
    assert got[3] == one + ulp  # above the tie -> up
    assert got[4] == pytest.approx(BF16_MAX) and np.isfinite(got[4])
    assert got[5] == pytest.approx(-BF16_MAX)
    assert to_bf16_bits(np.array([np.nan]))[0] == 0x7FC0


def test_code_orientation_by_hand() -> None:
    """g128: token-major codes packed along channels; g64 family: channel-major along tokens."""
    for name in ("kvarn_mla_k4_g128", "kvarn_mla_k5_g64"):
        fmt = _mla(name)
        layout = record_layout(fmt)
        g, r, bits = fmt.group, 512, fmt.latent_bits
        t, c, code = 3, 10, (1 << bits) - 2
        rec = np.zeros(layout.tile_bytes, dtype=np.uint8)
        for fname, n in (("latent_scale", r), ("latent_token_scale", g)):
            fld = layout.field(fname)
            rec[fld.offset : fld.end] = np.ones(n, "<f2").view(np.uint8)
        codes = layout.field("latent_codes")
        start = (t * r + c) * bits if g == 128 else (c * g + t) * bits  # stream bit position
        for i in range(bits):
            if (code >> i) & 1:
                pos = start + i
                rec[codes.offset + pos // 8] |= 1 << (pos % 8)
        lat, _ = decode_rotated_mla_tile(fmt, rec)
        expected = np.zeros((g, r), np.float32)
        expected[t, c] = code
        np.testing.assert_array_equal(lat, expected)


def test_batched_equals_single_and_is_deterministic() -> None:
    fmt = _mla("kvarn_mla_k4_g64")
    rng = np.random.default_rng(3)
    latent = np.stack([_latent(rng, 64) for _ in range(3)])
    rope = rng.standard_normal((3, 64, 64))
    recs = encode_mla_tiles(fmt, latent, rope)
    np.testing.assert_array_equal(recs, encode_mla_tiles(fmt, latent.copy(), rope.copy()))
    np.testing.assert_array_equal(recs[1], encode_mla_tile(fmt, latent[1], rope[1]))
    lat, rp = decode_mla_tiles(fmt, recs)
    lat1, rp1 = decode_mla_tile(fmt, recs[2])
    np.testing.assert_array_equal(lat[2], lat1)
    np.testing.assert_array_equal(rp[2], rp1)
    rot = latent[0] @ hadamard_matrix(512)
    np.testing.assert_array_equal(recs[0], encode_rotated_mla_tile(fmt, rot, rope[0]))


def test_degenerate_latents_stay_finite() -> None:
    fmt = _mla("kvarn_mla_k4_g128")
    rope = np.zeros((128, 64))
    rng = np.random.default_rng(4)
    huge = rng.standard_normal((128, 512))
    huge[7, 3] = 6e4
    for lat in (np.zeros((128, 512)), np.full((128, 512), -2.5), huge, huge * 1e-9):
        got, _ = decode_mla_tile(fmt, encode_mla_tile(fmt, lat, rope))
        assert np.all(np.isfinite(got))
    got, _ = decode_mla_tile(fmt, encode_mla_tile(fmt, np.full((128, 512), -2.5), rope))
    np.testing.assert_allclose(got, -2.5, rtol=2e-3)


def test_bad_input_fails_closed() -> None:
    fmt = _mla("kvarn_mla_k5_g64")
    lat, rope = np.zeros((64, 512)), np.zeros((64, 64))
    bad = lat.copy()
    bad[1, 2] = np.nan
    with pytest.raises(NonFiniteInputError, match="latent"):
        encode_mla_tile(fmt, bad, rope)
    bad_rope = rope.copy()
    bad_rope[0, 0] = np.inf
    with pytest.raises(NonFiniteInputError, match="rope"):
        encode_mla_tile(fmt, lat, bad_rope)
    with pytest.raises(ValueError, match=r"latent must have shape \[64, 512\]"):
        encode_mla_tile(fmt, lat[:, :256], rope)
    with pytest.raises(ValueError, match=r"rope must have shape \[64, 64\]"):
        encode_mla_tile(fmt, lat, rope[:, :32])
    with pytest.raises(ValueError, match=r"\[30848\]"):
        decode_mla_tile(fmt, np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="not an MLA format"):
        encode_mla_tile(parse_cache_dtype("kvarn_k4v2_g64"), lat, rope)
