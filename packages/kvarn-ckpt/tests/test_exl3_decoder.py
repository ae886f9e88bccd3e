"""The torch reference EXL3 decoder against an independent scalar/NumPy statement of the math.

The reference side here is written differently on purpose: the trellis ring is built and read
as a string of '0'/'1' characters, codebook values come from ``struct`` half-precision
packing and NumPy's float16 rounding, tiles are placed element by element, and the Hadamard
matrix is built from its closed form ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)``.
"""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvarn_ckpt import open_checkpoint, validate_exl3  # noqa: E402
from kvarn_ckpt.exl3_torch import (  # noqa: E402
    codebook_from_markers,
    decode_states,
    dequantize,
    dequantize_linear,
    exl3_matmul,
    reconstruct_inner,
    tile_order,
    unpack_signs,
    unpack_states,
)
from kvarn_ckpt.problems import ProblemList  # noqa: E402

CODEBOOK_SCALE = 1.24371088  # exllamav3 exl3_lib/quantize.py: std of the 3INST codebook


# --------------------------------------------------------------------------- reference side


def _steps(bits: float) -> list[int]:
    if float(bits).is_integer():
        return [int(bits)] * 256
    ka = int(bits)
    return [ka + (1 if i % 2 else 0) for i in range(256)]  # mask 0xAAAA: odd positions


def ref_pack(new_bits: list[list[int]], bits: float) -> tuple[np.ndarray, list[list[int]]]:
    """Pack tiles given each weight's new bits; return (int16 words, expected states)."""
    steps = _steps(bits)
    words_all, states_all = [], []
    for vals in new_bits:
        ring = "".join(format(v, f"0{d}b") for v, d in zip(vals, steps, strict=True))
        n = len(ring)
        assert n % 32 == 0
        w16: list[int] = []
        for t in range(n // 32):
            w32 = int(ring[32 * t : 32 * t + 32], 2)
            w16 += [w32 & 0xFFFF, w32 >> 16]  # a little-endian uint32 in memory
        ends = np.cumsum(steps)
        states = [int("".join(ring[(e - 16 + k) % n] for k in range(16)), 2) for e in ends]
        words_all.append(np.array(w16, dtype=np.uint16).view(np.int16))
        states_all.append(states)
    return np.stack(words_all), states_all


def _half(bits16: int) -> float:
    return float(struct.unpack("<e", struct.pack("<H", bits16))[0])


def ref_value(state: int, codebook: str) -> float:
    if codebook in ("3inst", "mcg"):
        x = (state * 89226354 + 64248484) if codebook == "3inst" else state * 0xCBAC1FED
        x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
        return float(np.float16(_half(x & 0xFFFF) + _half(x >> 16)))
    x = (state * 0x83DCD12D) & 0xFFFFFFFF
    b = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return float(np.float16((1024 + b) * _half(0x1EEE) + _half(0xC931)))


def ref_hadamard(n: int) -> np.ndarray:
    i = np.arange(n)
    pop = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(pop % 2, -1.0, 1.0) / math.sqrt(n)


def ref_dequant(states: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
    """states: [tk, tn, 256] in ring order -> float64 [in, out]."""
    tk, tn, _ = states.shape
    wq = np.zeros((tk * 16, tn * 16))
    cache: dict[int, float] = {}
    for a in range(tk):
        for b in range(tn):
            for p in range(256):
                t, j = divmod(p, 8)
                r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
                c = t // 4 + 8 * ((j >> 2) & 1)
                s = int(states[a, b, p])
                if s not in cache:
                    cache[s] = ref_value(s, codebook)
                wq[16 * a + r, 16 * b + c] = cache[s]
    h = ref_hadamard(128)
    n_in, n_out = wq.shape
    w = np.zeros_like(wq)
    for i in range(0, n_in, 128):
        w[i : i + 128] = h @ wq[i : i + 128]
    w *= suh.astype(np.float64)[:, None]
    for j in range(0, n_out, 128):
        w[:, j : j + 128] = w[:, j : j + 128] @ h
    return w * svh.astype(np.float64)[None, :]


def _random_trellis(rng: np.random.Generator, tk: int, tn: int, bits: float):  # type: ignore[no-untyped-def]
    steps = _steps(bits)
    vals = [[int(rng.integers(0, 1 << d)) for d in steps] for _ in range(tk * tn)]
    words, states = ref_pack(vals, bits)
    trellis = torch.from_numpy(words.reshape(tk, tn, -1).copy())
    return trellis, np.array(states, dtype=np.int64).reshape(tk, tn, 256)


# --------------------------------------------------------------------------- tests


def test_tile_order_is_the_tensor_core_fragment_order() -> None:
    order = tile_order()
    assert sorted(order) == list(range(256))
    # thread 0 holds rows 0,1,8,9 of columns 0 and 8; thread 1 starts at row 2; thread 4 at col 1
    assert order[:8] == (0, 16, 128, 144, 8, 24, 136, 152)
    assert order[8] == 2 * 16 and order[32] == 1


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_unpack_states_matches_the_bitstring_ring(bits: float) -> None:
    rng = np.random.default_rng(int(bits * 10))
    trellis, states = _random_trellis(rng, 2, 3, bits)
    assert trellis.shape[-1] == int(16 * bits)
    got = unpack_states(trellis)
    assert got.dtype == torch.int64 and got.shape == (2, 3, 256)
    assert np.array_equal(got.numpy(), states)


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebooks_match_the_scalar_definition_on_every_state(codebook: str) -> None:
    states = torch.arange(65536)
    got = decode_states(states, codebook).to(torch.float64).numpy()  # type: ignore[arg-type]
    want = np.array([ref_value(s, codebook) for s in range(65536)])
    assert np.array_equal(got, want)


def test_3inst_codebook_scale_is_the_published_constant() -> None:
    vals = decode_states(torch.arange(65536), "3inst").to(torch.float64)
    assert float(vals.std(unbiased=False)) == pytest.approx(CODEBOOK_SCALE, abs=1e-6)
    assert abs(float(vals.mean())) < 1e-3


def test_hadamard_is_sylvester_natural_order() -> None:
    from kvarn_format.hadamard import hadamard_matrix

    assert np.array_equal(hadamard_matrix(128), ref_hadamard(128))


@pytest.mark.parametrize(
    ("bits", "codebook"), [(2, "3inst"), (3, "mcg"), (4, "mul1"), (2.5, "mul1")]
)
def test_dequantize_matches_the_reference(bits: float, codebook: str) -> None:
    rng = np.random.default_rng(7)
    trellis, states = _random_trellis(rng, 8, 16, bits)  # 128 x 256 weight
    suh = (rng.choice([-1.0, 1.0], 128) * rng.uniform(0.01, 0.02, 128)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], 256) * rng.uniform(0.9, 1.1, 256)).astype(np.float16)
    w = dequantize(trellis, torch.from_numpy(suh), torch.from_numpy(svh), codebook)  # type: ignore[arg-type]
    assert w.shape == (128, 256) and w.dtype == torch.float32
    want = ref_dequant(states, suh, svh, codebook)
    np.testing.assert_allclose(w.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())
    inner = reconstruct_inner(trellis, codebook)  # type: ignore[arg-type]
    assert inner.dtype == torch.float16 and inner.shape == (128, 256)


def test_half_integer_rates_need_mul1() -> None:
    trellis, _ = _random_trellis(np.random.default_rng(0), 8, 8, 2.5)
    with pytest.raises(ValueError, match="mul1"):
        reconstruct_inner(trellis, "mcg")


def test_dequantize_rejects_mismatched_vectors() -> None:
    trellis, _ = _random_trellis(np.random.default_rng(0), 8, 8, 2)
    with pytest.raises(ValueError, match="do not match"):
        dequantize(
            trellis, torch.ones(64, dtype=torch.float16), torch.ones(128, dtype=torch.float16)
        )


def test_legacy_packed_signs() -> None:
    words = torch.tensor([0b1000000000000101, 0], dtype=torch.int64).to(torch.int16)
    signs = unpack_signs(words)
    want = [1.0] * 32
    for b in (0, 2, 15):
        want[b] = -1.0
    assert signs.tolist() == want


def test_matmul_and_markers() -> None:
    x = torch.randn(3, 128, dtype=torch.float64)
    w = torch.randn(128, 256, dtype=torch.float32)
    b = torch.randn(256)
    y = exl3_matmul(x, w, b)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ w.double() + b.double())
    assert codebook_from_markers(None, None) == "3inst"
    assert codebook_from_markers(torch.tensor(1), None) == "mcg"
    assert codebook_from_markers(None, torch.tensor(1)) == "mul1"
    with pytest.raises(ValueError):
        codebook_from_markers(torch.tensor(1), torch.tensor(1))


def test_dequantize_linear_from_a_tr3_checkpoint_uses_the_shared_vector(
    kit: SimpleNamespace,
) -> None:
    rng = np.random.default_rng(3)
    c = kit.tr3_mla()
    prefix = "model.layers.1.mlp.experts.2.gate_proj.rank1"
    shared = "model.layers.1.mlp.experts.shared_h.gate_proj.rank1.suh"
    trellis, states = _random_trellis(rng, 16, 16, 3)  # 256 x 256, K3 (layer 1 expert 2)
    suh = rng.standard_normal(256).astype(np.float16)
    svh = rng.standard_normal(256).astype(np.float16)
    shard = "model-layer-001.safetensors"
    c.add(f"{prefix}.trellis", "I16", [16, 16, 48], trellis.numpy().tobytes(), shard=shard)
    c.add(shared, "F16", [256], suh.tobytes(), shard=shard)
    c.add(f"{prefix}.svh", "F16", [256], svh.tobytes(), shard=shard)
    ckpt = open_checkpoint(c.write())
    report = validate_exl3(ckpt, ProblemList())
    lin = report.linears[prefix]
    assert lin.suh == shared
    w = dequantize_linear(ckpt, lin)
    want = ref_dequant(states, suh, svh, "mcg")
    np.testing.assert_allclose(w.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dequantize_on_cuda_matches_cpu() -> None:
    rng = np.random.default_rng(9)
    words = rng.integers(-(2**15), 2**15, size=(24, 32, 48)).astype(np.int16)
    trellis = torch.from_numpy(words)
    suh = torch.from_numpy(rng.standard_normal(384).astype(np.float16))
    svh = torch.from_numpy(rng.standard_normal(512).astype(np.float16))
    for codebook in ("3inst", "mcg", "mul1"):
        cpu = dequantize(trellis, suh, svh, codebook)  # type: ignore[arg-type]
        gpu = dequantize(trellis.cuda(), suh.cuda(), svh.cuda(), codebook)  # type: ignore[arg-type]
        assert torch.equal(
            reconstruct_inner(trellis.cuda(), codebook).cpu(),  # type: ignore[arg-type]
            reconstruct_inner(trellis, codebook),
        )  # type: ignore[arg-type]
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)
