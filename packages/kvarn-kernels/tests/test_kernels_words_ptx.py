"""The PTX of decode v4's ``unpack="words"`` path, evaluated on the CPU.

The interpreter runs the plain-Triton fallback of that path, so the attention tests do not
see the PTX. Here a small evaluator of the three instructions it uses (``prmt.b32`` in its
default mode, ``shr.b32``, ``lop3.b32`` with the ``(a & b) | c`` table 0xEA) runs the module's
own PTX strings on random word pairs and checks every output against the fallback's codes:
the byte selection, the masks, the fp16 magic constants and the offsets the kernel subtracts.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvarn_kernels import decode_v4


def _run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Evaluate ``asm`` (the instructions above only) on 32-bit registers ``regs``."""

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), val(src[2])
            pool = a | (b << 32)
            out = 0
            for i in range(4):
                s = (sel >> (4 * i)) & 0xF
                assert s < 8, "sign-replicating selectors are not used"
                out |= ((pool >> (8 * s)) & 0xFF) << (8 * i)
            regs[dst] = out
        elif op == "shr.b32":
            regs[dst] = (val(src[0]) & 0xFFFFFFFF) >> val(src[1])
        elif op == "lop3.b32":
            assert val(src[3]) == 0xEA
            regs[dst] = ((val(src[0]) & val(src[1])) | val(src[2])) & 0xFFFFFFFF
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


def _halves(r: int) -> tuple[float, float]:
    """The two fp16 halves of a 32-bit register (element 0 in the low half, as Triton packs)."""
    h = np.array([r & 0xFFFF, r >> 16], dtype=np.uint16).view(np.float16)
    return float(h[0]), float(h[1])


def _pair_regs(w0: int, w1: int) -> dict[str, int]:
    """``_PAIR_ASM`` on one word pair: ``$0..$3`` = ``x, x >> 8, y, y >> 8``."""
    return _run_ptx(decode_v4._PAIR_ASM.value, {"$4": w0, "$5": w1})


def _field(asm: str, x: int) -> int:
    return _run_ptx(asm, {"$1": x})["$0"]


def _code(w: int, bit: int, bits: int) -> int:
    return (w >> bit) & ((1 << bits) - 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_words4_ptx_matches_fallback(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for w0, w1 in rng.integers(0, 2**32, size=(200, 2), dtype=np.uint64).tolist():
        r = _pair_regs(w0, w1)
        for half, (x, xs) in enumerate(((r["$0"], r["$1"]), (r["$2"], r["$3"]))):
            # _words4: outputs 2 * byte + nibble of bytes 2 * half, 2 * half + 1
            for j, (reg, asm, off) in enumerate(
                (
                    (x, decode_v4._F_LO4.value, 1024.0),
                    (x, decode_v4._F_HI4.value, 64.0),
                    (xs, decode_v4._F_LO4.value, 1024.0),
                    (xs, decode_v4._F_HI4.value, 64.0),
                )
            ):
                got = _halves(_field(asm, reg))
                bit = 16 * half + 4 * j
                want = (_code(w0, bit, 4), _code(w1, bit, 4))
                assert (got[0] - off, got[1] - off) == want, (hex(w0), hex(w1), half, j)


@pytest.mark.parametrize("seed", [0, 1])
def test_words2_ptx_matches_fallback(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fields = [
        (decode_v4._F_2B0.value, 1024.0),
        (decode_v4._F_2B1.value, 256.0),
        (decode_v4._F_2B2.value, 64.0),
        (decode_v4._F_2B3.value, 16.0),
    ]
    for w0, w1 in rng.integers(0, 2**32, size=(200, 2), dtype=np.uint64).tolist():
        r = _pair_regs(w0, w1)
        for f, (asm, off) in enumerate(fields):
            # _words2: field f of bytes 0..3 from x, x >> 8, y, y >> 8
            for byte, reg in enumerate((r["$0"], r["$1"], r["$2"], r["$3"])):
                got = _halves(_field(asm, reg))
                bit = 8 * byte + 2 * f
                want = (_code(w0, bit, 2), _code(w1, bit, 2))
                assert (got[0] - off, got[1] - off) == want, (hex(w0), hex(w1), f, byte)


def test_field_offsets_in_kernel_match_ptx_magic() -> None:
    """The offsets the kernel subtracts are the fp16 constants the PTX ORs in."""
    src = Path(decode_v4.__file__).read_text()
    for name, off in (
        ("_F_LO4", 1024.0),
        ("_F_HI4", 64.0),
        ("_F_2B0", 1024.0),
        ("_F_2B1", 256.0),
        ("_F_2B2", 64.0),
        ("_F_2B3", 16.0),
    ):
        magic = int(re.findall(r"0x[0-9A-F]{8}", getattr(decode_v4, name).value)[1], 16)
        assert _halves(magic) == (off, off)
        assert re.search(rf"{name}, {off}\)|{name}, {off}, FAST\)", src), name
