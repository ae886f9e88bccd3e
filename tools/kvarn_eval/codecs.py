"""Cache codecs: what the KV cache holds for each token, and what a flushed tile turns into.

A :class:`TileCodec` is the pluggable quantizer of the harness. The CPU path wraps the NumPy
reference codec of ``kvarn-format`` (the executable definition of the format; this module never
re-implements it); a GPU path can wrap the Triton store and decode kernels behind the same two
methods. All tensors are in the model's original frame (post-RoPE keys), float32:

* :meth:`TileCodec.store` maps new tokens ``[..., T, D]`` to what the cache holds for them before
  any flush: the fp16 side pool for KVarN (rounded in the rotated frame), fp16 for the plain
  cache, or the whole-cache quantization of the 8-bit baselines;
* :meth:`TileCodec.quantize_tiles` maps complete tiles ``[N, G, D]`` (taken from the pool) to
  their quantize -> dequantize image. It is only called when ``group`` is not ``None``, for
  tiles at index ``>= sink_tiles``.

Names (``--formats`` / ``--baselines`` of ``tools/eval_quality.py``):

==================  =====================================================================
``fp16``            fp16 cache: the reference every metric is measured against
``identity``        no rounding at all (tests: must reproduce the plain forward exactly)
``kvarn_k4v2_g128`` a KVarN dense dtype: Hadamard + Sinkhorn + RTN, via the reference codec
``had_k4v2_g128``   the same without Sinkhorn (Hadamard + RTN ablation, ``sinkhorn=False``)
``rtn_k4v2_g128``   KIVI-style RTN at the same bits/group: per-channel K, per-token V
``int8_token``      8-bit symmetric per-token-per-head cache (the fp8 stand-in); all tokens
``fp8_e4m3``        float8 e4m3 cache with scale 1.0 (vLLM's uncalibrated default); all tokens
==================  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Final, Protocol, runtime_checkable

import numpy as np
import torch

from kvarn_format.hadamard import hadamard_matrix
from kvarn_format.reference import fake_quantize, rtn_kivi
from kvarn_format.registry import (
    DENSE_DTYPES,
    DenseFormat,
    check_dense_head_dim,
    parse_cache_dtype,
)

__all__ = [
    "BACKENDS",
    "BACKEND_SUFFIX",
    "BASELINE_KINDS",
    "FP16_MAX",
    "FP16Cache",
    "Fp8E4M3Cache",
    "IdentityCache",
    "Int8PerTokenCache",
    "KVarNCodec",
    "RTNKiviCodec",
    "TileCodec",
    "base_name",
    "codec_names",
    "make_codec",
    "pool_rotated",
    "unrotate",
]

FP16_MAX: Final[float] = 65504.0
#: Prefixes of the per-format baselines: ``rtn_<k..v.._g..>``, ``had_<...>``.
BASELINE_KINDS: Final[tuple[str, ...]] = ("rtn", "had")
_WHOLE_CACHE: Final[tuple[str, ...]] = ("fp16", "identity", "int8_token", "fp8_e4m3")
#: Where a KVarN codec runs: the NumPy reference, the Triton store kernel with the harness's
#: attention, the whole serving path (store, pool and attention kernels), or the reference
#: codec with the attention computed in fp16 (the control row of the kernel comparison).
BACKENDS: Final[tuple[str, ...]] = ("reference", "kernels-store", "kernels", "reference-attn16")
#: Codec name suffix of each backend.
BACKEND_SUFFIX: Final[dict[str, str]] = {
    "reference": "",
    "kernels-store": "+store",
    "kernels": "+kernels",
    "reference-attn16": "+attn16",
}

KV = tuple[torch.Tensor, torch.Tensor]
_CPU: Final[torch.device] = torch.device("cpu")


@runtime_checkable
class TileCodec(Protocol):
    """A KV-cache quantizer as the tiled cache sees it (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def group(self) -> int | None:
        """Tile length in tokens, or ``None`` when no tile is ever flushed."""
        ...

    @property
    def sink_tiles(self) -> int:
        """Leading tiles that stay in the pool for the request's lifetime."""
        ...

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Image of new tokens ``[..., T, D]`` as the cache holds them before any flush."""
        ...

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Quantize -> dequantize image of complete tiles ``[N, G, D]``."""
        ...


def _fp16_round(x: torch.Tensor) -> torch.Tensor:
    """Saturating round to fp16 (as the serving pool stores), widened back to x's dtype."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(x.dtype)


@cache
def _hadamard(d: int, device: torch.device = _CPU) -> torch.Tensor:
    return torch.from_numpy(np.array(hadamard_matrix(d), dtype=np.float32)).to(device)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the channel axis in float32 (H is its own inverse).

    The cache holds every row in the original frame, in float32, so a KVarN pool value ``p``
    (fp16, rotated) is kept as ``float32(p @ H)``. Rotating it back at flush time gives ``p``
    to within about ``1e-7`` of the row's norm, and the fp16 rounding in the codec restores
    ``p`` exactly except for elements below about ``1e-4`` of their row's norm, which may land
    one fp16 ulp away (measured: 14 of 49,152 elements on random tiles). Such elements carry
    no weight in attention; the codec still sees a valid fp16 tile and applies the format
    exactly to it.
    """
    return x.to(torch.float32) @ _hadamard(int(x.shape[-1]), x.device)


def pool_rotated(x: torch.Tensor) -> torch.Tensor:
    """The fp16 side-pool value of original-frame rows: ``fp16(saturate(x @ H))`` as float32.

    Exactly what :class:`KVarNCodec` hands the reference codec, so a kernel codec that starts
    from it sees the same tile bits.
    """
    return _fp16_round(_rotate(x)).to(torch.float32)


def unrotate(x_rot: torch.Tensor) -> torch.Tensor:
    """Rotated-frame rows back to the original frame in float32 (H is its own inverse)."""
    return _rotate(x_rot)


def _no_tiles(name: str) -> KV:
    raise RuntimeError(f"codec {name!r} has no tiles to quantize (group is None)")


@dataclass(frozen=True)
class IdentityCache:
    """Stores K/V untouched and never flushes: the cache must then equal transformers' own."""

    name: str = "identity"
    group: int | None = None
    sink_tiles: int = 0

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return k, v

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _no_tiles(self.name)


@dataclass(frozen=True)
class FP16Cache:
    """A plain fp16 KV cache (vLLM ``--kv-cache-dtype auto`` on an fp16 model): the reference."""

    name: str = "fp16"
    group: int | None = None
    sink_tiles: int = 0

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _fp16_round(k), _fp16_round(v)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _no_tiles(self.name)


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax int8 per token and head, fp16 scale: ``round(x / s) * s``."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = _fp16_round(amax / 127.0).clamp_min(2.0**-14)  # all-zero rows stay exactly zero
    q = torch.clamp(torch.round(x / scale), -127, 127)
    return q * scale


@dataclass(frozen=True)
class Int8PerTokenCache:
    """8-bit per-token cache standing in for fp8: every token is quantized when stored.

    Not a KVarN format: like vLLM's fp8 cache it has no sink and no fp16 tail, so it is the
    "8 bits everywhere" point of comparison.
    """

    name: str = "int8_token"
    group: int | None = None
    sink_tiles: int = 0

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _int8_per_token(k), _int8_per_token(v)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _no_tiles(self.name)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


@dataclass(frozen=True)
class Fp8E4M3Cache:
    """float8 e4m3 cache with a unit scale, every token (vLLM ``fp8`` without calibration)."""

    name: str = "fp8_e4m3"
    group: int | None = None
    sink_tiles: int = 0

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _fp8(k), _fp8(v)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _no_tiles(self.name)


@dataclass(frozen=True)
class KVarNCodec:
    """A dense KVarN format through the NumPy reference codec (``sinkhorn=False``: ablation).

    The pool image is the fp16 rounding of ``k @ H`` (rotated frame), un-rotated for the
    attention that runs in the original frame; since H is orthonormal the scores and outputs
    equal those of attention in the rotated frame up to float32 rounding. A flushed tile is
    re-rotated (recovering the pool's fp16 values) and goes through
    ``kvarn_format.reference.fake_quantize(..., rotated=True)``: Sinkhorn, RTN, fp16 fields,
    bit packing and decoding, exactly as the format defines them.
    """

    fmt: DenseFormat
    sinkhorn: bool = True
    sink_tiles: int = 1
    label: str = field(default="")
    #: Compute this row's attention in fp16 (q, K, V, output), as a serving attention library
    #: does: the control row (``+attn16``) for the serving kernels' distance from this codec.
    attention_fp16: bool = False

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = self.fmt.name if self.sinkhorn else "had_" + self.fmt.name.removeprefix("kvarn_")
        return base + ("+attn16" if self.attention_fp16 else "")

    @property
    def group(self) -> int:
        return self.fmt.group

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        def pool(x: torch.Tensor) -> torch.Tensor:
            return _rotate(_fp16_round(_rotate(x))).to(x.dtype)

        return pool(k), pool(v)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        k_rot = _fp16_round(_rotate(k)).to(torch.float32).cpu().numpy()
        v_rot = _fp16_round(_rotate(v)).to(torch.float32).cpu().numpy()
        kq, vq = fake_quantize(self.fmt, k_rot, v_rot, rotated=True, sinkhorn=self.sinkhorn)
        return (
            _rotate(torch.from_numpy(kq).to(k.device)).to(k.dtype),
            _rotate(torch.from_numpy(vq).to(v.device)).to(v.dtype),
        )


@dataclass(frozen=True)
class RTNKiviCodec:
    """KIVI-style RTN baseline (no rotation, no Sinkhorn) on the same tile schedule as KVarN.

    The pool is a plain fp16 cache in the original frame; a flushed tile goes through
    ``kvarn_format.reference.rtn_kivi``: per-channel keys, per-token values, min/max RTN.
    """

    key_bits: int
    value_bits: int
    tile: int
    sink_tiles: int = 1

    @property
    def name(self) -> str:
        return f"rtn_k{self.key_bits}v{self.value_bits}_g{self.tile}"

    @property
    def group(self) -> int:
        return self.tile

    def store(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        return _fp16_round(k), _fp16_round(v)

    def quantize_tiles(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        kq, vq = rtn_kivi(k.cpu().numpy(), v.cpu().numpy(), self.key_bits, self.value_bits)
        return (
            torch.from_numpy(kq).to(device=k.device, dtype=k.dtype),
            torch.from_numpy(vq).to(device=v.device, dtype=v.dtype),
        )


def codec_names() -> list[str]:
    """Every name :func:`make_codec` accepts (other backends: a ``+store``, ``+kernels`` or
    ``+attn16`` suffix on the ``kvarn_*`` and ``had_*`` names)."""
    suffixes = [d.removeprefix("kvarn_") for d in DENSE_DTYPES]
    names = list(_WHOLE_CACHE) + list(DENSE_DTYPES)
    for kind in BASELINE_KINDS:
        names += [f"{kind}_{s}" for s in suffixes]
    return names


def base_name(name: str) -> str:
    """The codec name without its kernel-backend suffix (``kvarn_k4v2_g64+kernels`` ->
    ``kvarn_k4v2_g64``)."""
    return name.partition("+")[0]


def make_codec(name: str, head_dim: int, backend: str = "reference") -> TileCodec:
    """Build the codec called ``name`` (see the module docstring) for a model's head_dim.

    ``backend`` applies to the ``kvarn_*`` and ``had_*`` codecs: ``reference`` (the NumPy
    codec), ``kernels-store`` or ``kernels`` (:mod:`kvarn_eval.kernel_codecs`), or
    ``reference-attn16`` (the NumPy codec, attention in fp16); the name then carries the
    backend's suffix (``+store``, ``+kernels``, ``+attn16``), which may also be given in
    ``name``.
    Raises ``ValueError`` listing the valid names for an unknown name, and the registry's
    ``UnsupportedGeometryError`` when the format does not take this head_dim.
    """
    name, plus, suffix = name.partition("+")
    if plus:
        by_suffix = {v.removeprefix("+"): k for k, v in BACKEND_SUFFIX.items() if v}
        if suffix not in by_suffix:
            valid = ", ".join(v for v in BACKEND_SUFFIX.values() if v)
            raise ValueError(f"unknown backend suffix '+{suffix}'; valid: {valid}")
        backend = by_suffix[suffix]
    if backend not in BACKENDS:
        raise ValueError(f"unknown codec backend {backend!r}; valid: {', '.join(BACKENDS)}")
    simple: dict[str, TileCodec] = {
        "fp16": FP16Cache(),
        "identity": IdentityCache(),
        "int8_token": Int8PerTokenCache(),
        "fp8_e4m3": Fp8E4M3Cache(),
    }
    if name in simple:
        return simple[name]
    kind, _, rest = name.partition("_")
    dtype = name if kind == "kvarn" else f"kvarn_{rest}"
    if (kind in BASELINE_KINDS or kind == "kvarn") and dtype in DENSE_DTYPES:
        fmt = parse_cache_dtype(dtype)
        assert isinstance(fmt, DenseFormat)
        check_dense_head_dim(fmt, head_dim)
        if kind in ("kvarn", "had") and backend in ("kernels-store", "kernels"):
            from kvarn_eval.kernel_codecs import KernelKVarNCodec

            return KernelKVarNCodec(fmt, serving=backend == "kernels", sinkhorn=kind == "kvarn")
        if kind in ("kvarn", "had"):
            return KVarNCodec(
                fmt, sinkhorn=kind == "kvarn", attention_fp16=backend == "reference-attn16"
            )
        return RTNKiviCodec(fmt.key_bits, fmt.value_bits, fmt.group)
    raise ValueError(f"unknown codec {name!r}; valid: {', '.join(codec_names())}")
