"""The NumPy reference codec of the KVarN record format (docs/format.md).

This is the executable definition of the format: the GPU store and decode kernels are tested
against it, and the quality tools use it to measure the error of every format. It composes the
small primitives of :mod:`kvarn_format.hadamard`, :mod:`kvarn_format.sinkhorn`,
:mod:`kvarn_format.quant` and :mod:`kvarn_format.packing`, and writes every field at the offset
that :func:`kvarn_format.geometry.record_layout` gives (offsets are never recomputed here).

Pipeline of a dense tile (one block of ``G`` tokens of one KV head, format-spec §2):

1. rotate K and V by the Hadamard matrix (``x @ H``) and round to fp16 with saturation, as the
   serving side stores them in its fp16 pool (``encode_*`` functions; ``encode_rotated_*``
   start here with values already rotated);
2. orient the tiles so the quantization axis is the row: K as ``[R=D channels, C=G tokens]``,
   V as ``[R=G tokens, C=D channels]``;
3. Sinkhorn scales (best-imbalance, 8 iterations) rounded to fp16, the tile divided by them;
4. asymmetric min/max RTN per row of the balanced tile;
5. absorb the RTN step and minimum into the row's Sinkhorn scale, store fp16 fields and packed
   codes at the geometry offsets.

Decoding reads the fp16 fields back and computes, in float32,
``K[d, t] = (q * k_scale[d] + k_zero[d]) * k_token_scale[t]`` and
``V[t, d] = (q * v_scale[t] + v_zero[t]) * v_channel_scale[d]`` in the rotated frame.

Overflow guard (not in the sources, which would store ``inf`` here): a row's absorbed zero can
exceed the fp16 range by up to ``e^0.3`` when the tile holds values near fp16 max, because the
other axis' Sinkhorn scale may be as small as ``e^-0.3``. When any absorbed field of a tile would
exceed 65504, that tile's absorbed row fields are divided by ``2**m`` and its other-axis scales
multiplied by ``2**m`` (``m`` = 1 in practice), which leaves every decoded value unchanged. Values
that still do not fit saturate at +-65504; a record never holds ``inf`` or NaN.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from kvarn_format.geometry import Field, RecordLayout, SlotRounding, record_layout
from kvarn_format.hadamard import hadamard_matrix, rotate
from kvarn_format.packing import pack_codes, unpack_codes
from kvarn_format.quant import FP16_MAX, bf16_bits_to_float32, rtn, to_bf16_bits, to_fp16
from kvarn_format.registry import DenseFormat, KVarNFormat, MLAFormat, check_dense_head_dim
from kvarn_format.sinkhorn import sinkhorn, sinkhorn_batched

__all__ = [
    "DENSE_SINKHORN_ITERS",
    "MLA_SINKHORN_ITERS",
    "NonFiniteInputError",
    "decode_mla_tile",
    "decode_mla_tiles",
    "decode_rotated_mla_tile",
    "decode_rotated_mla_tiles",
    "decode_rotated_tile",
    "decode_rotated_tiles",
    "decode_tile",
    "decode_tiles",
    "encode_mla_tile",
    "encode_mla_tiles",
    "encode_rotated_mla_tile",
    "encode_rotated_mla_tiles",
    "encode_rotated_tile",
    "encode_rotated_tiles",
    "encode_tile",
    "encode_tiles",
    "fake_quantize",
    "fake_quantize_mla",
    "hadamard_matrix",
    "pack_codes",
    "rtn",
    "rtn_kivi",
    "sinkhorn",
    "unpack_codes",
]

#: Sinkhorn iterations of the dense formats (format-spec §2.4: lowered from 16 upstream).
DENSE_SINKHORN_ITERS: Final[int] = 8
#: Sinkhorn iterations of the MLA formats.
MLA_SINKHORN_ITERS: Final[int] = 16

#: Tiles processed together inside the batched codec: large enough to amortize NumPy call
#: overhead, small enough that a chunk's float32 temporaries stay within a few MB.
_CHUNK: Final[int] = 64

_F32 = np.float32
F32Array = npt.NDArray[np.float32]
U8Array = npt.NDArray[np.uint8]


class NonFiniteInputError(ValueError):
    """The input of an encoder holds NaN or Inf, which the format cannot represent."""


# --------------------------------------------------------------------------------------------
# validation


def _float_array(name: str, x: npt.ArrayLike, expected: str) -> npt.NDArray[np.floating]:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ValueError(
            f"{name} must be a floating-point array of shape {expected}, got dtype {arr.dtype}"
        )
    return arr


def _check_finite(name: str, arr: npt.NDArray[np.floating]) -> None:
    finite = np.isfinite(arr)
    if not finite.all():
        bad = int(arr.size - np.count_nonzero(finite))
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise NonFiniteInputError(
            f"{name} holds {bad} NaN/Inf value(s) (first at index {first}); KVarN encodes "
            "finite values only. Fix the producer of these activations (or keep this layer "
            "out of the quantized cache)."
        )


def _dense_inputs(
    fmt: KVarNFormat, k: npt.ArrayLike, v: npt.ArrayLike, batched: bool
) -> tuple[DenseFormat, npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    if not isinstance(fmt, DenseFormat):
        raise ValueError(
            f"{fmt} is not a dense format; use the MLA functions (encode_mla_tile, ...) for it"
        )
    g = fmt.group
    expected = "[N, G, D]" if batched else "[G, D]"
    ka = _float_array("k", k, expected)
    va = _float_array("v", v, expected)
    ndim = 3 if batched else 2
    if ka.ndim != ndim or ka.shape[-2] != g:
        raise ValueError(f"k must have shape {expected} with G={g} for {fmt.name}, got {ka.shape}")
    if va.shape != ka.shape:
        raise ValueError(f"v must have the same shape as k {ka.shape}, got {va.shape}")
    check_dense_head_dim(fmt, int(ka.shape[-1]))
    _check_finite("k", ka)
    _check_finite("v", va)
    return fmt, ka, va


def _records(name: str, layout: RecordLayout, records: npt.ArrayLike, batched: bool) -> U8Array:
    arr = np.asarray(records)
    expected = f"[N, {layout.tile_bytes}]" if batched else f"[{layout.tile_bytes}]"
    if (
        arr.dtype != np.uint8
        or arr.ndim != (2 if batched else 1)
        or (arr.shape[-1] != layout.tile_bytes)
    ):
        raise ValueError(
            f"{name} must be a uint8 array of shape {expected} for {layout.dtype} "
            f"(head_dim {layout.head_dim}, slot_rounding {layout.slot_rounding!r}), "
            f"got {arr.dtype} {arr.shape}"
        )
    return arr if batched else arr[None]


# --------------------------------------------------------------------------------------------
# record field I/O (offsets only from the geometry)


def _put(rec: U8Array, field: Field, data: npt.NDArray[np.generic]) -> None:
    n = rec.shape[0]
    if field.dtype == "f16":
        raw = np.ascontiguousarray(data, dtype="<f2").reshape(n, -1).view(np.uint8)
    elif field.dtype == "bf16":
        raw = np.ascontiguousarray(data, dtype="<u2").reshape(n, -1).view(np.uint8)
    else:
        raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if raw.shape[1] != field.size:
        raise AssertionError(f"{field.name}: {raw.shape[1]} bytes for a {field.size}-byte field")
    rec[:, field.offset : field.end] = raw


def _get_u8(rec: U8Array, field: Field) -> U8Array:
    return rec[:, field.offset : field.end].reshape(rec.shape[0], *field.shape)


def _get_f16(rec: U8Array, field: Field) -> F32Array:
    raw = np.ascontiguousarray(rec[:, field.offset : field.end])
    return raw.view("<f2").astype(_F32).reshape(rec.shape[0], *field.shape)


def _get_bf16(rec: U8Array, field: Field) -> F32Array:
    raw = np.ascontiguousarray(rec[:, field.offset : field.end])
    return bf16_bits_to_float32(raw.view("<u2")).reshape(rec.shape[0], *field.shape)


# --------------------------------------------------------------------------------------------
# the tile quantizer shared by K, V and the MLA latent


def _fp16_values(x: npt.NDArray[np.floating]) -> F32Array:
    """What the fp16 side pool holds: saturating round to fp16, widened to float32."""
    return to_fp16(x).astype(_F32)


def _quantize_rows(
    tiles: F32Array, bits: int, iters: int, use_sinkhorn: bool
) -> tuple[U8Array, npt.NDArray[np.float16], npt.NDArray[np.float16], npt.NDArray[np.float16]]:
    """Quantize tiles ``[N, R, C]`` along rows.

    Returns ``(codes [N, R, C], row_scale [N, R], row_zero [N, R], col_scale [N, C])`` with the
    three scalar fields as stored (fp16): ``x[r, c] ~ (codes * row_scale[r] + row_zero[r]) *
    col_scale[c]``.
    """
    n, r, c = tiles.shape
    if use_sinkhorn and iters > 0:
        col_s, row_s = sinkhorn_batched(tiles, iters)
    else:
        col_s = np.ones((n, c), dtype=_F32)
        row_s = np.ones((n, r), dtype=_F32)
    # Balance with the scales exactly as stored, so the other-axis scale adds no error.
    col_s = to_fp16(col_s).astype(_F32)
    row_s = to_fp16(row_s).astype(_F32)
    balanced = tiles / col_s[:, None, :]
    balanced /= row_s[:, :, None]
    codes, step, lo = rtn(balanced, bits)
    a = row_s * step
    z = row_s * lo
    # Overflow guard (module docstring): move a power of two from the row fields to the
    # column scale when the row fields would leave the fp16 range.
    peak = np.maximum(np.abs(a).max(axis=1), np.abs(z).max(axis=1))
    need = np.ceil(np.log2(np.maximum(peak, _F32(1.0)) / _F32(FP16_MAX)))
    room = np.floor(np.log2(_F32(FP16_MAX) / col_s.max(axis=1)))
    shift = np.clip(np.minimum(need, room), 0, None).astype(_F32)
    if np.any(shift > 0):
        factor = np.exp2(shift)
        a = a / factor[:, None]
        z = z / factor[:, None]
        col_s = col_s * factor[:, None]
    return codes, to_fp16(a), to_fp16(z), to_fp16(col_s)


def _check_iters(iters: int) -> int:
    if isinstance(iters, bool) or not isinstance(iters, int | np.integer) or iters < 0:
        raise ValueError(f"sinkhorn_iters must be a non-negative integer, got {iters!r}")
    return int(iters)


# --------------------------------------------------------------------------------------------
# dense tiles


def _encode_dense(
    fmt: DenseFormat,
    k: npt.NDArray[np.floating],
    v: npt.NDArray[np.floating],
    *,
    original: bool,
    use_sinkhorn: bool,
    iters: int,
    slot_rounding: SlotRounding,
) -> U8Array:
    n, _, d = k.shape
    layout = record_layout(fmt, d, slot_rounding=slot_rounding)
    out = np.zeros((n, layout.tile_bytes), dtype=np.uint8)
    f = layout.field
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(start + _CHUNK, n))
        rec = out[sl]
        k_rot = _fp16_values(rotate(k[sl]) if original else k[sl])  # [n, G, D]
        v_rot = _fp16_values(rotate(v[sl]) if original else v[sl])  # [n, G, D]
        k_tile = np.ascontiguousarray(k_rot.transpose(0, 2, 1))  # [n, D, G]: rows = channels
        codes, k_scale, k_zero, k_tok = _quantize_rows(k_tile, fmt.key_bits, iters, use_sinkhorn)
        _put(rec, f("k_codes"), pack_codes(codes, fmt.key_bits))
        _put(rec, f("k_scale"), k_scale)
        _put(rec, f("k_zero"), k_zero)
        _put(rec, f("k_token_scale"), k_tok)
        codes, v_scale, v_zero, v_chan = _quantize_rows(
            v_rot, fmt.value_bits, iters, use_sinkhorn
        )  # rows = tokens
        _put(rec, f("v_codes"), pack_codes(codes, fmt.value_bits))
        _put(rec, f("v_channel_scale"), v_chan)
        _put(rec, f("v_scale"), v_scale)
        _put(rec, f("v_zero"), v_zero)
    return out


def _decode_dense(
    fmt: DenseFormat, rec: U8Array, layout: RecordLayout, *, original: bool
) -> tuple[F32Array, F32Array]:
    n = rec.shape[0]
    g, d = fmt.group, layout.head_dim
    f = layout.field
    k_out = np.empty((n, g, d), dtype=_F32)
    v_out = np.empty((n, g, d), dtype=_F32)
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(start + _CHUNK, n))
        r = rec[sl]
        kq = unpack_codes(_get_u8(r, f("k_codes")), fmt.key_bits, g).astype(_F32)  # [n, D, G]
        k = kq * _get_f16(r, f("k_scale"))[:, :, None]
        k += _get_f16(r, f("k_zero"))[:, :, None]
        k *= _get_f16(r, f("k_token_scale"))[:, None, :]
        vq = unpack_codes(_get_u8(r, f("v_codes")), fmt.value_bits, d).astype(_F32)  # [n, G, D]
        v = vq * _get_f16(r, f("v_scale"))[:, :, None]
        v += _get_f16(r, f("v_zero"))[:, :, None]
        v *= _get_f16(r, f("v_channel_scale"))[:, None, :]
        k = k.transpose(0, 2, 1)
        k_out[sl] = _unrotate(k) if original else k
        v_out[sl] = _unrotate(v) if original else v
    return k_out, v_out


def encode_rotated_tiles(
    fmt: KVarNFormat,
    k_rot: npt.ArrayLike,
    v_rot: npt.ArrayLike,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = DENSE_SINKHORN_ITERS,
    slot_rounding: SlotRounding = "align8",
) -> U8Array:
    """Encode ``N`` dense tiles already in the rotated frame into records ``uint8[N, tile_bytes]``.

    ``k_rot`` and ``v_rot`` are ``[N, G, D]`` (tokens, channels), as a kernel reads them from the
    fp16 side pool; they are rounded to fp16 with saturation first, so fp16 inputs pass
    unchanged. ``sinkhorn=False`` skips variance normalization (all Sinkhorn scales 1), the
    "Hadamard + RTN" ablation; the record stays valid and decodes normally.
    """
    dense, ka, va = _dense_inputs(fmt, k_rot, v_rot, batched=True)
    return _encode_dense(
        dense,
        ka,
        va,
        original=False,
        use_sinkhorn=sinkhorn,
        iters=_check_iters(sinkhorn_iters),
        slot_rounding=slot_rounding,
    )


def decode_rotated_tiles(
    fmt: KVarNFormat,
    records: npt.ArrayLike,
    head_dim: int,
    *,
    slot_rounding: SlotRounding = "align8",
) -> tuple[F32Array, F32Array]:
    """Decode records ``uint8[N, tile_bytes]`` to rotated-frame ``(k, v)``, each ``[N, G, D]``."""
    if not isinstance(fmt, DenseFormat):
        raise ValueError(f"{fmt} is not a dense format; use decode_mla_tiles for it")
    layout = record_layout(fmt, head_dim, slot_rounding=slot_rounding)
    rec = _records("records", layout, records, batched=True)
    return _decode_dense(fmt, rec, layout, original=False)


def _unrotate(x_rot: F32Array) -> F32Array:
    """Inverse rotation (H is its own inverse), returned as float32."""
    return rotate(x_rot).astype(_F32)


def encode_tiles(
    fmt: KVarNFormat,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = DENSE_SINKHORN_ITERS,
    slot_rounding: SlotRounding = "align8",
) -> U8Array:
    """Encode ``N`` dense tiles ``[N, G, D]`` given in the original frame.

    Each tile is rotated by H in float64, then rounded to fp16 with saturation (the dtype of
    the serving side pool; rotated values can exceed the fp16 range even when the inputs do
    not) and encoded as by :func:`encode_rotated_tiles`.
    """
    dense, ka, va = _dense_inputs(fmt, k, v, batched=True)
    return _encode_dense(
        dense,
        ka,
        va,
        original=True,
        use_sinkhorn=sinkhorn,
        iters=_check_iters(sinkhorn_iters),
        slot_rounding=slot_rounding,
    )


def decode_tiles(
    fmt: KVarNFormat,
    records: npt.ArrayLike,
    head_dim: int,
    *,
    slot_rounding: SlotRounding = "align8",
) -> tuple[F32Array, F32Array]:
    """Decode records to original-frame ``(k, v)``, each ``[N, G, D]`` float32."""
    if not isinstance(fmt, DenseFormat):
        raise ValueError(f"{fmt} is not a dense format; use decode_mla_tiles for it")
    layout = record_layout(fmt, head_dim, slot_rounding=slot_rounding)
    rec = _records("records", layout, records, batched=True)
    return _decode_dense(fmt, rec, layout, original=True)


def encode_rotated_tile(
    fmt: KVarNFormat,
    k_rot: npt.ArrayLike,
    v_rot: npt.ArrayLike,
    *,
    sinkhorn_iters: int = DENSE_SINKHORN_ITERS,
    sinkhorn: bool = True,
    slot_rounding: SlotRounding = "align8",
) -> U8Array:
    """Encode one rotated-frame tile (``k_rot``, ``v_rot`` ``[G, D]``) to ``uint8[tile_bytes]``."""
    _, ka, va = _dense_inputs(fmt, k_rot, v_rot, batched=False)
    return encode_rotated_tiles(
        fmt,
        ka[None],
        va[None],
        sinkhorn=sinkhorn,
        sinkhorn_iters=sinkhorn_iters,
        slot_rounding=slot_rounding,
    ).reshape(-1)


def encode_tile(
    fmt: KVarNFormat,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    sinkhorn_iters: int = DENSE_SINKHORN_ITERS,
    sinkhorn: bool = True,
    slot_rounding: SlotRounding = "align8",
) -> U8Array:
    """Encode one original-frame tile (``k``, ``v`` ``[G, D]``) to ``uint8[tile_bytes]``."""
    _, ka, va = _dense_inputs(fmt, k, v, batched=False)
    return encode_tiles(
        fmt,
        ka[None],
        va[None],
        sinkhorn=sinkhorn,
        sinkhorn_iters=sinkhorn_iters,
        slot_rounding=slot_rounding,
    ).reshape(-1)


def decode_rotated_tile(
    fmt: KVarNFormat,
    record: npt.ArrayLike,
    head_dim: int,
    *,
    slot_rounding: SlotRounding = "align8",
) -> tuple[F32Array, F32Array]:
    """Decode one record to rotated-frame ``(k, v)``, each ``[G, D]`` float32."""
    if not isinstance(fmt, DenseFormat):
        raise ValueError(f"{fmt} is not a dense format; use decode_mla_tile for it")
    layout = record_layout(fmt, head_dim, slot_rounding=slot_rounding)
    rec = _records("record", layout, record, batched=False)
    k, v = decode_rotated_tiles(fmt, rec, head_dim, slot_rounding=slot_rounding)
    return k[0], v[0]


def decode_tile(
    fmt: KVarNFormat,
    record: npt.ArrayLike,
    head_dim: int,
    *,
    slot_rounding: SlotRounding = "align8",
) -> tuple[F32Array, F32Array]:
    """Decode one record to original-frame ``(k, v)``, each ``[G, D]`` float32."""
    k_rot, v_rot = decode_rotated_tile(fmt, record, head_dim, slot_rounding=slot_rounding)
    return _unrotate(k_rot), _unrotate(v_rot)


def fake_quantize(
    fmt: KVarNFormat,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    rotated: bool = False,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = DENSE_SINKHORN_ITERS,
) -> tuple[F32Array, F32Array]:
    """``decode(encode(k, v))`` for ``[N, G, D]`` tiles: what attention sees after the cache.

    With ``rotated=False`` inputs and outputs are in the original frame; with ``rotated=True``
    both are in the rotated frame (no rotation is applied).
    """
    _, ka, _ = _dense_inputs(fmt, k, v, batched=True)
    d = int(ka.shape[-1])
    enc = encode_rotated_tiles if rotated else encode_tiles
    dec = decode_rotated_tiles if rotated else decode_tiles
    records = enc(fmt, k, v, sinkhorn=sinkhorn, sinkhorn_iters=sinkhorn_iters)
    return dec(fmt, records, d)


def rtn_kivi(
    k: npt.ArrayLike, v: npt.ArrayLike, key_bits: int, value_bits: int
) -> tuple[F32Array, F32Array]:
    """Plain KIVI-style RTN baseline on tiles ``[..., G, D]``; returns dequantized ``(k, v)``.

    K is quantized per channel over the tile's tokens and V per token over its channels, with
    min/max RTN at the given widths: no rotation, no Sinkhorn, group = tile. Scales and zeros
    are kept in float32 (not rounded to fp16), which if anything favours the baseline.
    """
    ka = _float_array("k", k, "[..., G, D]")
    va = _float_array("v", v, "[..., G, D]")
    if ka.ndim < 2 or va.shape != ka.shape:
        raise ValueError(f"k and v must share a shape [..., G, D], got {ka.shape} and {va.shape}")
    _check_finite("k", ka)
    _check_finite("v", va)
    kt = np.swapaxes(ka.astype(_F32), -1, -2)
    codes, step, lo = rtn(kt, key_bits)
    k_hat = codes.astype(_F32) * step[..., None] + lo[..., None]
    codes, step, lo = rtn(va.astype(_F32), value_bits)
    v_hat = codes.astype(_F32) * step[..., None] + lo[..., None]
    return np.ascontiguousarray(np.swapaxes(k_hat, -1, -2)), v_hat


# --------------------------------------------------------------------------------------------
# MLA tiles


def _mla_inputs(
    fmt: KVarNFormat, latent: npt.ArrayLike, rope: npt.ArrayLike, batched: bool
) -> tuple[MLAFormat, npt.NDArray[np.floating], npt.NDArray[np.floating]]:
    if not isinstance(fmt, MLAFormat):
        raise ValueError(f"{fmt} is not an MLA format; use encode_tile / encode_tiles for it")
    g, r, p = fmt.group, fmt.latent_rank, fmt.rope_dim
    lead = "N, " if batched else ""
    la = _float_array("latent", latent, f"[{lead}{g}, {r}]")
    ra = _float_array("rope", rope, f"[{lead}{g}, {p}]")
    ndim = 3 if batched else 2
    if la.ndim != ndim or la.shape[-2:] != (g, r):
        raise ValueError(f"latent must have shape [{lead}{g}, {r}] for {fmt.name}, got {la.shape}")
    if ra.shape != (*la.shape[:-1], p):
        raise ValueError(f"rope must have shape [{lead}{g}, {p}] for {fmt.name}, got {ra.shape}")
    _check_finite("latent", la)
    _check_finite("rope", ra)
    return fmt, la, ra


def _token_major(fmt: MLAFormat) -> bool:
    """g128 (official) stores latent codes token-major; the g64 family channel-major."""
    return fmt.group == 128


def _encode_mla(
    fmt: MLAFormat,
    latent: npt.NDArray[np.floating],
    rope: npt.NDArray[np.floating],
    *,
    original: bool,
    use_sinkhorn: bool,
    iters: int,
) -> U8Array:
    n = latent.shape[0]
    layout = record_layout(fmt)
    out = np.zeros((n, layout.tile_bytes), dtype=np.uint8)
    f = layout.field
    bits = fmt.latent_bits
    rope_field = f("rope")
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(start + _CHUNK, n))
        rec = out[sl]
        lat = _fp16_values(rotate(latent[sl]) if original else latent[sl])  # [n, G, R]
        tile = np.ascontiguousarray(lat.transpose(0, 2, 1))  # [n, R, G]: rows = channels
        codes, scale, zero, tok = _quantize_rows(tile, bits, iters, use_sinkhorn)
        if _token_major(fmt):
            codes = np.ascontiguousarray(codes.transpose(0, 2, 1))  # [n, G, R]
        _put(rec, f("latent_codes"), pack_codes(codes, bits))
        _put(rec, f("latent_scale"), scale)
        _put(rec, f("latent_zero"), zero)
        _put(rec, f("latent_token_scale"), tok)
        if rope_field.dtype == "bf16":
            _put(rec, rope_field, to_bf16_bits(rope[sl]))
        else:
            _put(rec, rope_field, to_fp16(rope[sl]))
    return out


def _decode_mla(fmt: MLAFormat, rec: U8Array, *, original: bool) -> tuple[F32Array, F32Array]:
    layout = record_layout(fmt)
    n = rec.shape[0]
    g, r, bits = fmt.group, fmt.latent_rank, fmt.latent_bits
    f = layout.field
    rope_field = f("rope")
    lat_out = np.empty((n, g, r), dtype=_F32)
    for start in range(0, n, _CHUNK):
        sl = slice(start, min(start + _CHUNK, n))
        packed = _get_u8(rec[sl], f("latent_codes"))
        if _token_major(fmt):
            q = unpack_codes(packed, bits, r).transpose(0, 2, 1).astype(_F32)  # [n, R, G]
        else:
            q = unpack_codes(packed, bits, g).astype(_F32)
        lat = q * _get_f16(rec[sl], f("latent_scale"))[:, :, None]
        lat += _get_f16(rec[sl], f("latent_zero"))[:, :, None]
        lat *= _get_f16(rec[sl], f("latent_token_scale"))[:, None, :]
        lat = lat.transpose(0, 2, 1)
        lat_out[sl] = _unrotate(lat) if original else lat
    rope = _get_bf16(rec, rope_field) if rope_field.dtype == "bf16" else _get_f16(rec, rope_field)
    return lat_out, rope


def encode_rotated_mla_tiles(
    fmt: KVarNFormat,
    latent_rot: npt.ArrayLike,
    rope: npt.ArrayLike,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = MLA_SINKHORN_ITERS,
) -> U8Array:
    """Encode ``N`` MLA tiles: rotated latent ``[N, G, R]`` and RoPE key ``[N, G, 64]``.

    The latent takes the K path: tile ``[R channels, G tokens]``, Sinkhorn, per-channel RTN.
    The RoPE part is stored exactly as fp16 (g128) or round-to-nearest-even bf16 (g64 family),
    saturating at the type's largest finite value.
    """
    mla, la, ra = _mla_inputs(fmt, latent_rot, rope, batched=True)
    return _encode_mla(
        mla, la, ra, original=False, use_sinkhorn=sinkhorn, iters=_check_iters(sinkhorn_iters)
    )


def decode_rotated_mla_tiles(fmt: KVarNFormat, records: npt.ArrayLike) -> tuple[F32Array, F32Array]:
    """Decode MLA records ``uint8[N, tile_bytes]`` to ``(latent_rot [N, G, R], rope [N, G, 64])``."""
    if not isinstance(fmt, MLAFormat):
        raise ValueError(f"{fmt} is not an MLA format; use decode_tiles for it")
    rec = _records("records", record_layout(fmt), records, batched=True)
    return _decode_mla(fmt, rec, original=False)


def encode_mla_tiles(
    fmt: KVarNFormat,
    latent: npt.ArrayLike,
    rope: npt.ArrayLike,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = MLA_SINKHORN_ITERS,
) -> U8Array:
    """Encode ``N`` MLA tiles given in the original frame (the latent is rotated by H_R here)."""
    mla, la, ra = _mla_inputs(fmt, latent, rope, batched=True)
    return _encode_mla(
        mla, la, ra, original=True, use_sinkhorn=sinkhorn, iters=_check_iters(sinkhorn_iters)
    )


def decode_mla_tiles(fmt: KVarNFormat, records: npt.ArrayLike) -> tuple[F32Array, F32Array]:
    """Decode MLA records to original-frame ``(latent [N, G, R], rope [N, G, 64])``."""
    if not isinstance(fmt, MLAFormat):
        raise ValueError(f"{fmt} is not an MLA format; use decode_tiles for it")
    rec = _records("records", record_layout(fmt), records, batched=True)
    return _decode_mla(fmt, rec, original=True)


def encode_rotated_mla_tile(
    fmt: KVarNFormat,
    latent_rot: npt.ArrayLike,
    rope: npt.ArrayLike,
    *,
    sinkhorn_iters: int = MLA_SINKHORN_ITERS,
    sinkhorn: bool = True,
) -> U8Array:
    """Encode one MLA tile with a rotated latent ``[G, R]`` and RoPE ``[G, 64]``."""
    _, la, ra = _mla_inputs(fmt, latent_rot, rope, batched=False)
    return encode_rotated_mla_tiles(
        fmt, la[None], ra[None], sinkhorn=sinkhorn, sinkhorn_iters=sinkhorn_iters
    ).reshape(-1)


def encode_mla_tile(
    fmt: KVarNFormat,
    latent: npt.ArrayLike,
    rope: npt.ArrayLike,
    *,
    sinkhorn_iters: int = MLA_SINKHORN_ITERS,
    sinkhorn: bool = True,
) -> U8Array:
    """Encode one MLA tile: latent ``[G, 512]`` (original frame) and RoPE key ``[G, 64]``."""
    _, la, ra = _mla_inputs(fmt, latent, rope, batched=False)
    return encode_mla_tiles(
        fmt, la[None], ra[None], sinkhorn=sinkhorn, sinkhorn_iters=sinkhorn_iters
    ).reshape(-1)


def decode_rotated_mla_tile(fmt: KVarNFormat, record: npt.ArrayLike) -> tuple[F32Array, F32Array]:
    """Decode one MLA record to ``(latent_rot [G, R], rope [G, 64])``."""
    if not isinstance(fmt, MLAFormat):
        raise ValueError(f"{fmt} is not an MLA format; use decode_tile for it")
    rec = _records("record", record_layout(fmt), record, batched=False)
    lat, rope = decode_rotated_mla_tiles(fmt, rec)
    return lat[0], rope[0]


def decode_mla_tile(fmt: KVarNFormat, record: npt.ArrayLike) -> tuple[F32Array, F32Array]:
    """Decode one MLA record to original-frame ``(latent [G, R], rope [G, 64])``."""
    lat, rope = decode_rotated_mla_tile(fmt, record)
    return _unrotate(lat), rope


def fake_quantize_mla(
    fmt: KVarNFormat,
    latent: npt.ArrayLike,
    rope: npt.ArrayLike,
    rotated: bool = False,
    *,
    sinkhorn: bool = True,
    sinkhorn_iters: int = MLA_SINKHORN_ITERS,
) -> tuple[F32Array, F32Array]:
    """``decode(encode(latent, rope))`` for ``[N, G, ...]`` MLA tiles (see :func:`fake_quantize`)."""
    if rotated:
        rec = encode_rotated_mla_tiles(
            fmt, latent, rope, sinkhorn=sinkhorn, sinkhorn_iters=sinkhorn_iters
        )
        return decode_rotated_mla_tiles(fmt, rec)
    rec = encode_mla_tiles(fmt, latent, rope, sinkhorn=sinkhorn, sinkhorn_iters=sinkhorn_iters)
    return decode_mla_tiles(fmt, rec)
