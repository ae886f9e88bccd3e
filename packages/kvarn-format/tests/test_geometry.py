import pytest

from kvarn_format import (
    DENSE_DTYPES,
    MLA_DTYPES,
    DenseFormat,
    UnsupportedGeometryError,
    parse_cache_dtype,
    record_layout,
)


def test_k4v2_g128_d128_headline() -> None:
    layout = record_layout(parse_cache_dtype("kvarn_k4v2_g128"), 128)
    assert layout.tile_bytes == 13_824
    assert layout.bytes_per_token_per_head == 108
    assert round(layout.ratio_vs_fp16, 2) == 4.74
    assert layout.pad_bytes == 0
    assert [f.name for f in layout.fields] == [
        "k_codes",
        "k_scale",
        "k_zero",
        "k_token_scale",
        "v_codes",
        "v_channel_scale",
        "v_scale",
        "v_zero",
    ]
    assert layout.offsets() == {
        "k_codes": 0,
        "k_scale": 8192,
        "k_zero": 8448,
        "k_token_scale": 8704,
        "v_codes": 8960,
        "v_channel_scale": 13056,
        "v_scale": 13312,
        "v_zero": 13568,
    }
    assert layout.field("k_codes").shape == (128, 64)
    assert layout.field("v_codes").shape == (128, 32)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "tile"),
    [
        ("kvarn_k4v4_g128", 128, 17_920),
        ("kvarn_k4v2_g64", 128, 7_296),
        ("kvarn_k4v4_g64", 128, 9_344),
        ("kvarn_k5v5_g64", 128, 11_392),
        ("kvarn_k4v2_g128", 256, 26_880),
        ("kvarn_mla_k4_g128", None, 51_456),
        ("kvarn_mla_k5_g64", None, 30_848),
        ("kvarn_mla_k4_g64", None, 26_752),
        ("kvarn_mla_k2_g64", None, 18_560),
    ],
)
def test_tile_bytes(dtype: str, head_dim: int | None, tile: int) -> None:
    assert record_layout(parse_cache_dtype(dtype), head_dim).tile_bytes == tile


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_dense_fields_tile_the_record(dtype: str, head_dim: int) -> None:
    fmt = parse_cache_dtype(dtype)
    assert isinstance(fmt, DenseFormat)
    layout = record_layout(fmt, head_dim)
    offset = 0
    for field in layout.fields:
        assert field.offset == offset
        offset = field.end
    assert layout.payload_bytes == offset
    g, d = fmt.group, head_dim
    assert offset == d * g * (fmt.key_bits + fmt.value_bits) // 8 + (3 * d + 3 * g) * 2
    assert layout.tile_bytes % 8 == 0 and 0 <= layout.pad_bytes < 8


def test_pow2_slot_rounding_is_opt_in() -> None:
    fmt = parse_cache_dtype("kvarn_k4v4_g128")
    assert record_layout(fmt, 256).bytes_per_token_per_head == 274
    pow2 = record_layout(fmt, 256, slot_rounding="pow2")
    assert pow2.bytes_per_token_per_head == 512
    assert pow2.pad_bytes == 512 * 128 - pow2.payload_bytes
    # D <= 128 never rounds to a power of two.
    assert record_layout(fmt, 128, slot_rounding="pow2").tile_bytes == 17_920
    with pytest.raises(ValueError, match="slot_rounding"):
        record_layout(fmt, 128, slot_rounding="nope")  # type: ignore[arg-type]


def test_mla_layouts() -> None:
    k4 = record_layout(parse_cache_dtype("kvarn_mla_k4_g128"))
    assert k4.bytes_per_token_per_head == 402
    assert k4.field("latent_codes").shape == (128, 256)
    assert k4.field("rope").dtype == "f16"
    k5 = record_layout(parse_cache_dtype("kvarn_mla_k5_g64"))
    assert k5.bytes_per_token_per_head == 482
    assert k5.field("latent_codes").shape == (512, 40)
    assert k5.field("rope").dtype == "bf16"
    assert k5.field("rope").offset == 20_480 + 2048 + 128
    for name in MLA_DTYPES:
        layout = record_layout(parse_cache_dtype(name))
        assert layout.kind == "mla" and layout.head_dim == 512


def test_bad_head_dims() -> None:
    with pytest.raises(UnsupportedGeometryError):
        record_layout(parse_cache_dtype("kvarn_k4v2_g128"), 96)
    with pytest.raises(TypeError, match="needs head_dim"):
        record_layout(parse_cache_dtype("kvarn_k4v2_g128"))
    with pytest.raises(UnsupportedGeometryError):
        record_layout(parse_cache_dtype("kvarn_mla_k5_g64"), 256)


def test_as_dict_is_json_ready() -> None:
    import json

    d = record_layout(parse_cache_dtype("kvarn_k4v2_g128"), 128).as_dict()
    assert json.loads(json.dumps(d))["tile_bytes"] == 13_824
    assert {"dtype", "tile_bytes", "bytes_per_token_per_head", "fields"} <= set(d)


def test_padded_record_stride() -> None:
    from kvarn_format.geometry import padded_record_stride

    # Qwen-like D=128, 8 KV heads: a 16-bit sliding page of 65,536 B per head is not a
    # multiple of the 13,824-byte k4v2_g128 record; 16,384 is the smallest stride that is.
    assert padded_record_stride(13_824, 8, [8 * 65_536]) == 16_384
    assert padded_record_stride(13_824, 8, []) == 13_824
    assert padded_record_stride(13_824, 8, [8 * 13_824, 1000]) == 13_824  # nothing larger
    # D=256 (Gemma-like): the pow2 layout's 32,768 bytes already divide.
    assert padded_record_stride(32_768, 4, [4 * 131_072]) == 32_768
    # Strides stay multiples of 8 bytes even when the record is not.
    assert padded_record_stride(7_290, 1, [3 * 7_296]) == 7_296
    with pytest.raises(ValueError, match="no record stride between 13824 and 27648"):
        padded_record_stride(13_824, 1, [13_825 * 3])
    with pytest.raises(ValueError, match="positive"):
        padded_record_stride(0, 1, [])


def test_shadow_rows_fill_the_record_area_with_k_and_v_rows() -> None:
    from kvarn_format.geometry import shadow_rows

    for name in DENSE_DTYPES:
        fmt = parse_cache_dtype(name)
        assert isinstance(fmt, DenseFormat)
        for d in (64, 128, 256):
            stride = record_layout(fmt, d).tile_bytes
            r = shadow_rows(fmt.group, d, stride)
            # R rows of K and of V (fp16) fit in the record; one more row of each does not.
            assert 4 * d * r <= stride < 4 * d * (r + 1)
            assert 0 < r < fmt.group
    assert shadow_rows(128, 128, 13_824) == 27  # kvarn_k4v2_g128
    assert shadow_rows(128, 128, 16_384) == 32  # the same record padded for a hybrid model
    assert shadow_rows(4, 8, 10_000) == 3  # never the whole tile: a slot keeps >= 1 row
    with pytest.raises(ValueError, match="positive"):
        shadow_rows(128, 0, 13_824)
