import pytest

from kvarn_format import (
    DENSE_DTYPES,
    MLA_DTYPES,
    VALID_DTYPES,
    CacheDTypeError,
    DenseFormat,
    MLAFormat,
    UnsupportedGeometryError,
    is_kvarn_dtype,
    parse_cache_dtype,
)
from kvarn_format.registry import check_dense_head_dim, check_mla_geometry

ADMITTED = {
    "kvarn_k4v2_g128": ("dense", 4, 2, 128),
    "kvarn_k4v4_g128": ("dense", 4, 4, 128),
    "kvarn_k4v2_g64": ("dense", 4, 2, 64),
    "kvarn_k4v4_g64": ("dense", 4, 4, 64),
    "kvarn_k5v5_g64": ("dense", 5, 5, 64),
    "kvarn_mla_k4_g128": ("mla", 4, None, 128),
    "kvarn_mla_k2_g64": ("mla", 2, None, 64),
    "kvarn_mla_k4_g64": ("mla", 4, None, 64),
    "kvarn_mla_k5_g64": ("mla", 5, None, 64),
}


def test_table_is_exactly_the_admitted_set() -> None:
    assert set(VALID_DTYPES) == set(ADMITTED)
    assert len(VALID_DTYPES) == len(ADMITTED)
    assert set(DENSE_DTYPES) | set(MLA_DTYPES) == set(VALID_DTYPES)


@pytest.mark.parametrize("name", sorted(ADMITTED))
def test_parse_admitted(name: str) -> None:
    kind, bits, vbits, group = ADMITTED[name]
    fmt = parse_cache_dtype(name)
    assert fmt.name == name == str(fmt)
    assert fmt.kind == kind
    assert fmt.group == fmt.block_size == group
    if isinstance(fmt, DenseFormat):
        assert (fmt.key_bits, fmt.value_bits) == (bits, vbits)
    else:
        assert isinstance(fmt, MLAFormat)
        assert fmt.latent_bits == bits
        assert (fmt.latent_rank, fmt.rope_dim) == (512, 64)
    assert is_kvarn_dtype(name)
    with pytest.raises(AttributeError):
        fmt.group = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "auto",
        "fp8",
        "kvarn",
        "KVARN_K4V2_G128",
        "kvarn_K4v2_g128",
        " kvarn_k4v2_g128",
        "kvarn_k4v2_g128 ",
        "kvarn_k4v2_g128\n",
        "kvarn_k04v2_g128",
        "kvarn_k4v2_g0128",
        "kvarn_k3v3_g32",
        "kvarn_k4v2_g32",
        "kvarn_k4v2_g256",
        "kvarn_k5v5_g128",
        "kvarn_k2v2_g128",
        "kvarn_mla_k5_g128",
        "kvarn_mla_k3_g64",
        "kvarn_mla_k4v2_g128",
        "xkvarn_k4v2_g128",
        "kvarn-k4v2-g128",
        "turboquant_k3v4_nc",
        "kvarn_k4v2_g128_",
        "kvarn_k4v2",
    ],
)
def test_rejects_everything_else(bad: str) -> None:
    with pytest.raises(CacheDTypeError) as err:
        parse_cache_dtype(bad)
    assert isinstance(err.value, ValueError)
    for valid in VALID_DTYPES:
        assert valid in str(err.value)
    assert not is_kvarn_dtype(bad)


def test_rejects_non_string() -> None:
    with pytest.raises(CacheDTypeError, match="must be a string"):
        parse_cache_dtype(128)  # type: ignore[arg-type]


def test_environment_cannot_change_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVARN_SINKHORN_ITERS", "KVARN_GROUP", "KVARN_KEY_BITS", "KVARN_MLA_BITS"):
        monkeypatch.setenv(var, "3")
    fmt = parse_cache_dtype("kvarn_k4v2_g128")
    assert isinstance(fmt, DenseFormat)
    assert (fmt.key_bits, fmt.value_bits, fmt.group) == (4, 2, 128)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_dense_head_dims_supported(head_dim: int) -> None:
    fmt = parse_cache_dtype("kvarn_k4v2_g128")
    assert isinstance(fmt, DenseFormat)
    check_dense_head_dim(fmt, head_dim)


@pytest.mark.parametrize("head_dim", [0, 32, 80, 96, 112, 192, 1024])
def test_dense_head_dim_unsupported(head_dim: int) -> None:
    fmt = parse_cache_dtype("kvarn_k4v4_g64")
    assert isinstance(fmt, DenseFormat)
    with pytest.raises(UnsupportedGeometryError, match="64, 128, 256, 512"):
        check_dense_head_dim(fmt, head_dim)


def test_mla_geometry() -> None:
    fmt = parse_cache_dtype("kvarn_mla_k5_g64")
    assert isinstance(fmt, MLAFormat)
    check_mla_geometry(fmt, 512, 64)
    with pytest.raises(UnsupportedGeometryError, match="latent rank of 512"):
        check_mla_geometry(fmt, 256, 64)
    with pytest.raises(UnsupportedGeometryError, match="64-dim RoPE"):
        check_mla_geometry(fmt, 512, 32)
