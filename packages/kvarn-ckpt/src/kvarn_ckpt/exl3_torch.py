"""A CPU reference decoder for EXL3 trellis weights, in plain torch.

exllamav3 reconstructs weights only in CUDA kernels; this module is the readable, device-
independent version of the same math, written from the format's definition:

1. **Trellis ring.** Each 16x16 tile of the ``[in, out]`` weight is a ring of ``256 * K``
   bits stored MSB-first in 32-bit words (two int16 words each, little-endian in memory).
   Weight ``i`` of the tile (in ring order) owns ``D(i)`` new bits ending at ring position
   ``S(i) = D(0) + ... + D(i)``; its decoder *state* is the 16-bit window of ring bits
   ``[S(i) - 16, S(i))``, wrapping around the ring (a tail-biting bitshift trellis, QTIP
   style). Integer rates have ``D(i) = K``; the half-integer rates ``KA + 0.5`` alternate
   ``KA`` and ``KA + 1`` bits (mask 0xAAAA over each run of 16).
2. **Codebook.** A state ``s`` (16 bits) maps to one fp16 value:

   * 3INST: ``x = s * 89226354 + 64248484 (mod 2^32)``; mcg: ``x = s * 0xCBAC1FED``;
     both then ``x = (x & 0x8fff8fff) ^ 0x3b603b60``, read the two 16-bit halves of ``x`` as
     fp16 numbers and add them (rounded to fp16);
   * mul1: ``x = s * 0x83DCD12D (mod 2^32)``, ``b`` = the sum of the four bytes of ``x``,
     value = fp16(``(1024 + b) * k_inv + k_bias``) with the fp16 constants
     ``k_inv = 0x1eee`` (1/147.7) and ``k_bias = 0xc931`` (-10.38), one rounding.

3. **Tile order.** Ring position ``p = 8 t + j`` (``t`` 0..31, ``j`` 0..7) holds tile element
   row ``2 (t % 4) + (j & 1) + 8 ((j >> 1) & 1)``, column ``t // 4 + 8 ((j >> 2) & 1)``: the
   tensor-core fragment order the encoder works in.
4. **Sandwich.** With ``Wq`` the ``[in, out]`` matrix of decoded values and ``H`` the 128x128
   Sylvester Hadamard matrix divided by sqrt(128), applied blockwise:
   ``W = diag(svh) . had_r( diag(suh) . had_l(Wq) )``, where ``had_l`` multiplies each
   128-row block by ``H`` from the left and ``had_r`` each 128-column block from the right.
   The layer computes ``y = x @ W (+ bias)``.

Everything after the codebook runs in float32 (exllamav3's own ``get_weight_tensor`` rounds
to fp16 between steps, so the two agree to fp16 rounding). Importing this module imports
torch; ``kvarn_ckpt`` itself never does.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from kvarn_ckpt.exl3 import HADAMARD_BLOCK, MCG_MULTIPLIER, MUL1_MULTIPLIER, Exl3Linear
from kvarn_format.hadamard import hadamard_matrix

if TYPE_CHECKING:
    from kvarn_ckpt.checkpoint import Checkpoint

__all__ = [
    "Codebook",
    "codebook_from_markers",
    "decode_states",
    "dequantize",
    "dequantize_linear",
    "exl3_matmul",
    "load_linear_tensors",
    "reconstruct_inner",
    "ring_windows",
    "tile_order",
    "unpack_signs",
    "unpack_states",
]

Codebook = Literal["3inst", "mcg", "mul1"]
_3INST_MULT, _3INST_ADD = 89226354, 64248484
_MASK, _XOR = 0x8FFF8FFF, 0x3B603B60
_MUL1_K_INV, _MUL1_K_BIAS = 0x1EEE, 0xC931
_TILES_PER_CHUNK = 8192


def _half_bits(v: int) -> float:
    return float(np.array([v], dtype=np.uint16).view(np.float16)[0])


@cache
def tile_order() -> tuple[int, ...]:
    """``order[p]`` = row-major index (``16 r + c``) of the tile element at ring position p."""
    out = []
    for p in range(256):
        t, j = divmod(p, 8)
        r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
        c = t // 4 + 8 * ((j >> 2) & 1)
        out.append(16 * r + c)
    return tuple(out)


def _steps(bits: float) -> list[int]:
    """New bits per ring position, D(i), for one 256-weight tile."""
    if float(bits).is_integer() and 1 <= bits <= 8:
        return [int(bits)] * 256
    ka = int(bits)
    if ka + 0.5 != bits or not 1 <= ka <= 7:
        raise ValueError(f"EXL3 bitrate must be an integer 1..8 or KA+0.5, got {bits}")
    return [ka + ((0xAAAA >> (i % 16)) & 1) for i in range(256)]


@cache
def ring_windows(bits: float) -> tuple[int, ...]:
    """Start bit of every state's 16-bit window in the ring, for bitrate ``bits``."""
    steps = _steps(bits)
    ring = sum(steps)
    ends = np.cumsum(steps)
    return tuple(int((e - 16) % ring) for e in ends)


def _bits_of(trellis: torch.Tensor) -> float:
    w = int(trellis.shape[-1])
    if w % 16 == 0:
        return float(w // 16)
    if w % 16 == 8:
        return (w - 8) / 16 + 0.5
    raise ValueError(f"trellis last dim {w} is not 16*K or 16*K+8")


def unpack_states(trellis: torch.Tensor, bits: float | None = None) -> torch.Tensor:
    """The 16-bit decoder states of every weight: int64 ``[..., 256]`` in ring order."""
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16, got {trellis.dtype}")
    bits = _bits_of(trellis) if bits is None else bits
    words16 = trellis.to(torch.int64) & 0xFFFF
    if words16.shape[-1] % 2:
        raise ValueError("a trellis tile must hold an even number of int16 words")
    # Two int16 words in memory order make one little-endian 32-bit word of the ring.
    w32 = words16[..., 0::2] | (words16[..., 1::2] << 16)
    nw = w32.shape[-1]
    if nw * 32 != sum(_steps(bits)):
        raise ValueError(f"trellis of {nw * 2} words does not hold 256 weights of {bits} bits")
    starts = torch.tensor(ring_windows(bits), dtype=torch.int64, device=trellis.device)
    wi, off = starts >> 5, starts & 31
    hi = w32[..., wi]
    lo = w32[..., (wi + 1) % nw]
    both = (hi << 32) | lo  # bits [32 wi, 32 wi + 64) of the ring, MSB first
    # 16-bit window at ring bit ``off`` of the 64-bit chunk; the arithmetic shift of a
    # negative int64 is harmless because of the mask.
    return (both >> (48 - off)) & 0xFFFF


def _u16_to_half(x: torch.Tensor) -> torch.Tensor:
    signed = torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)
    return signed.view(torch.float16)


def decode_states(states: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Map 16-bit states (any int tensor) to their fp16 codebook values."""
    s = states.to(torch.int64) & 0xFFFF
    if codebook in ("3inst", "mcg"):
        x = (s * _3INST_MULT + _3INST_ADD) if codebook == "3inst" else (s * MCG_MULTIPLIER)
        x = (x & 0xFFFFFFFF & _MASK) ^ _XOR
        lo = _u16_to_half(x & 0xFFFF).to(torch.float32)
        hi = _u16_to_half(x >> 16).to(torch.float32)
        # Both halves lie in [1/8, 2) in magnitude, so the float32 sum is exact and the
        # cast to fp16 is the one rounding of the hardware half add.
        return (lo + hi).to(torch.float16)
    if codebook == "mul1":
        x = (s * MUL1_MULTIPLIER) & 0xFFFFFFFF
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        k_inv, k_bias = _half_bits(_MUL1_K_INV), _half_bits(_MUL1_K_BIAS)
        # (1024 + b) * k_inv is exact in float32 (11 x 11 bits) and so is adding k_bias,
        # so the cast is the single rounding of the fp16 fused multiply-add.
        return ((1024 + b).to(torch.float32) * k_inv + k_bias).to(torch.float16)
    raise ValueError(f"unknown EXL3 codebook {codebook!r} (3inst, mcg, mul1)")


def reconstruct_inner(trellis: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """The rotated-basis weight ``Wq`` (fp16 ``[in, out]``) before the Hadamard sandwich."""
    if trellis.dim() != 3:
        raise ValueError(f"trellis must be [in/16, out/16, words], got {list(trellis.shape)}")
    tk, tn, _ = trellis.shape
    bits = _bits_of(trellis)
    if not float(bits).is_integer() and codebook != "mul1":
        raise ValueError(f"half-integer rate {bits} exists only with the mul1 codebook")
    flat = trellis.reshape(tk * tn, -1)
    order = torch.tensor(tile_order(), dtype=torch.int64, device=trellis.device)
    tiles = torch.empty((tk * tn, 256), dtype=torch.float16, device=trellis.device)
    for a in range(0, tk * tn, _TILES_PER_CHUNK):
        vals = decode_states(unpack_states(flat[a : a + _TILES_PER_CHUNK], bits), codebook)
        tiles[a : a + _TILES_PER_CHUNK, order] = vals
    return tiles.view(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(tk * 16, tn * 16)


@cache
def _hadamard_128() -> torch.Tensor:
    return torch.from_numpy(np.array(hadamard_matrix(HADAMARD_BLOCK), dtype=np.float32))


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy ``.su``/``.sv``: int16 words of sign bits (bit b of word i -> element 16 i + b,
    set = -1) to a float32 +-1 vector."""
    w = packed.to(torch.int64) & 0xFFFF
    bits = (w.unsqueeze(-1) >> torch.arange(16, device=packed.device)) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).reshape(-1)


def dequantize(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: Codebook = "3inst",
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense ``[in, out]`` weight of one EXL3 linear (``y = x @ W``)."""
    w = reconstruct_inner(trellis, codebook).to(torch.float32)
    n_in, n_out = w.shape
    if n_in % HADAMARD_BLOCK or n_out % HADAMARD_BLOCK:
        raise ValueError(f"EXL3 weight {n_in}x{n_out} is not a multiple of {HADAMARD_BLOCK}")
    if tuple(suh.shape) != (n_in,) or tuple(svh.shape) != (n_out,):
        raise ValueError(
            f"suh {list(suh.shape)} / svh {list(svh.shape)} do not match the {n_in}x{n_out} trellis"
        )
    h = _hadamard_128().to(w.device)
    w = (h @ w.view(-1, HADAMARD_BLOCK, n_out)).view(n_in, n_out)
    w = w * suh.to(torch.float32).unsqueeze(1)
    w = (w.view(n_in, -1, HADAMARD_BLOCK) @ h).view(n_in, n_out)
    w = w * svh.to(torch.float32).unsqueeze(0)
    return w.to(dtype)


def exl3_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W (+ bias)`` for a dequantized ``[in, out]`` weight, in ``x``'s dtype."""
    y = x @ weight.to(x.dtype)
    return y + bias.to(y.dtype) if bias is not None else y


def codebook_from_markers(mcg: torch.Tensor | None, mul1: torch.Tensor | None) -> Codebook:
    """The codebook named by a linear's marker tensors (none: 3INST)."""
    if mcg is not None and mul1 is not None:
        raise ValueError("a linear cannot carry both .mcg and .mul1 markers")
    if mcg is not None:
        return "mcg"
    return "mul1" if mul1 is not None else "3inst"


def load_linear_tensors(ckpt: Checkpoint, lin: Exl3Linear) -> dict[str, torch.Tensor]:
    """Read just the tensors of one validated linear (``trellis``, ``suh``, ``svh``,
    ``bias``) from their shards; shared-H and legacy packed vectors are resolved."""
    from safetensors import safe_open

    def read(name: str) -> torch.Tensor:
        info = ckpt.tensors[name]
        with safe_open(str(info.file), framework="pt") as f:
            t: torch.Tensor = f.get_tensor(name)
        return t

    out = {"trellis": read(lin.trellis)}
    out["suh"] = read(lin.suh) if lin.suh else unpack_signs(read(lin.su or ""))
    out["svh"] = read(lin.svh) if lin.svh else unpack_signs(read(lin.sv or ""))
    if lin.bias:
        out["bias"] = read(lin.bias)
    return out


def dequantize_linear(
    ckpt: Checkpoint, lin: Exl3Linear, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense ``[in, out]`` weight of a validated linear of ``ckpt``."""
    t = load_linear_tensors(ckpt, lin)
    return dequantize(
        t["trellis"],
        t["suh"],
        t["svh"],
        lin.codebook,  # type: ignore[arg-type]
        dtype=dtype,
    )


def concat_rank_slices(
    weights: Iterable[torch.Tensor], proj: Literal["gate_proj", "up_proj", "down_proj"]
) -> torch.Tensor:
    """Join TR3 rank slices of one expert projection into the full ``[in, out]`` weight:
    gate/up are sliced along the output (N), down along the input (K)."""
    parts = list(weights)
    return torch.cat(parts, dim=0 if proj == "down_proj" else 1)
