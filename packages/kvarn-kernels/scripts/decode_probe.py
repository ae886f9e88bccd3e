# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Bottleneck probe for the round-2 decode kernel, v2 (METHOD.md: take parts away, time).

v1 and v2 both take ~1.56-1.60 ms at B = 64, 16K (k4v2_g128) although v2 issues ~30% fewer
instructions and k4v4 reads 25% more bytes in the same time: neither issue nor bandwidth
explains it. This script times copies of the v2 loop with one part removed at a time:

* ``pool``: no ``block_to_slot`` load and no pool branch in the loop;
* ``table``: block ids computed (``b * nb + i``) instead of read from the block table;
* ``scales``: constant scale vectors instead of the six per-chunk vector loads;
* ``mma``: codes loaded and unpacked, reduced with sums instead of the two MMAs;
* ``unpack``: raw code bytes summed (loads only).

Timing only: the outputs of the probes are not attention. Usage on the GPU::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/decode_probe.py
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvarn_kernels.attention import _codes_f16, _load_codes

# The round-2 (v2) kernel's helpers, kept here with the copy of its loop that the probe times
# (v2 itself was removed after round 3: v1 and v3 beat it everywhere it was measured; v3 went
# after round 4, beaten by v4). The probe needs nothing else from the package but v1's code
# loaders, so it keeps working as the kernels change.


@triton.jit
def _dequant(codes1024, half_scale, half_zero):
    """``fp16((code * scale + zero) / 2)`` from fp16 ``1024 + code`` and the halved fields.

    ``1024 + code - 1024`` is exact in fp16; the FMA rounds once.
    """
    return (codes1024 - 1024.0) * half_scale + half_zero


@triton.jit
def _centred(codes1024, half_scale, BITS: tl.constexpr):
    """``fp16((code - 2**(BITS-1)) * scale / 2)``: the code term alone, centred.

    The subtraction is exact; the product rounds once, to 2^-11 of at most half the row's
    range (the zero point, often much larger than the range, is added exactly elsewhere).
    """
    mid: tl.constexpr = 1024.0 + (1 << (BITS - 1))
    return (codes1024 - mid) * half_scale


@triton.jit
def _scales(rec, tok, dd, ok, OFF_KS, OFF_KZ, OFF_KT, OFF_VCS, OFF_VS, OFF_VZ):
    """One chunk's scale vectors (masked by ``ok``).

    Halved ``k_scale``, ``k_zero`` ``[D]`` and ``v_scale``, ``v_zero`` ``[BN]`` in fp16 (the
    operand side); ``2 * k_token_scale`` ``[BN]`` and ``2 * v_channel_scale`` ``[D]`` in fp32
    (the result side, undoing the halving). Halving an fp16 value is exact.
    """
    f16 = tl.pointer_type(tl.float16)
    ks = tl.load((rec + OFF_KS).to(f16) + dd, mask=ok, other=0.0) * 0.5
    kz = tl.load((rec + OFF_KZ).to(f16) + dd, mask=ok, other=0.0) * 0.5
    kt = tl.load((rec + OFF_KT).to(f16) + tok, mask=ok, other=0.0).to(tl.float32) * 2.0
    vs = tl.load((rec + OFF_VS).to(f16) + tok, mask=ok, other=0.0) * 0.5
    vz = tl.load((rec + OFF_VZ).to(f16) + tok, mask=ok, other=0.0) * 0.5
    vcs = tl.load((rec + OFF_VCS).to(f16) + dd, mask=ok, other=0.0).to(tl.float32) * 2.0
    return ks, kz, kt, vs, vz, vcs


@triton.jit
def probe_kernel(
    Q,
    KV,
    POOL_K,
    POOL_V,
    BLOCK_TABLE,
    SEQ_LENS,
    BLOCK_TO_SLOT,
    O_PART,
    qk_scale,
    stride_bt,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    STRIDE: tl.constexpr,
    OFF_KC: tl.constexpr,
    OFF_KS: tl.constexpr,
    OFF_KZ: tl.constexpr,
    OFF_KT: tl.constexpr,
    OFF_VC: tl.constexpr,
    OFF_VCS: tl.constexpr,
    OFF_VS: tl.constexpr,
    OFF_VZ: tl.constexpr,
    K_ORDER: tl.constexpr,
    V_ORDER: tl.constexpr,
    BN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    POOL: tl.constexpr,
    TABLE: tl.constexpr,
    SCALES: tl.constexpr,
    MMA: tl.constexpr,
    UNPACK: tl.constexpr,
    FAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    qi = tl.arange(0, BLOCK_Q)
    q_ok = qi < QPK
    seq_len = tl.load(SEQ_LENS + b)
    dd = tl.arange(0, D)
    rows = b.to(tl.int64) * HQ + h * QPK + qi
    qT = tl.load(Q + rows[None, :] * D + dd[:, None], mask=q_ok[None, :], other=0.0)
    qT = qT * qk_scale
    qmax = tl.max(tl.abs(qT), axis=0)
    qmax = tl.where(qmax > 0, qmax, 1.0)
    qn = qT / qmax[None, :]
    qT16 = qn.to(tl.float16)
    n_blocks = tl.cdiv(seq_len, G)
    per = tl.cdiv(n_blocks, NUM_SPLITS)
    blk_lo = split * per
    blk_hi = tl.minimum(blk_lo + per, n_blocks)
    NCH: tl.constexpr = G // BN
    n_it = tl.maximum(blk_hi - blk_lo, 0) * NCH
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_acc = tl.zeros([BN, BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([D, BLOCK_Q], dtype=tl.float32)
    probe = tl.zeros([D, BLOCK_Q], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b.to(tl.int64) * stride_bt
    tn = tl.arange(0, BN)
    K_ROW: tl.constexpr = G * KB // 8
    V_ROW: tl.constexpr = D * VB // 8
    ks = tl.full([D], 0.01, tl.float16)
    kz = tl.full([D], -0.05, tl.float16)
    kt = tl.full([BN], 1.0, tl.float32)
    vs = tl.full([BN], 0.01, tl.float16)
    vz = tl.full([BN], -0.05, tl.float16)
    vcs = tl.full([D], 1.0, tl.float32)
    for it in range(0, n_it):
        bi = blk_lo + it // NCH
        c = it % NCH
        if TABLE:  # noqa: SIM108 (Triton constexpr branch)
            blk = tl.load(bt_row + bi).to(tl.int64)
        else:
            blk = b.to(tl.int64) * stride_bt + bi
        rec = KV + (blk * HK + h) * STRIDE
        tok = c * BN + tn
        live = bi * G + tok < seq_len
        if SCALES:
            ks, kz, kt, vs, vz, vcs = _scales(
                rec, tok, dd, True, OFF_KS, OFF_KZ, OFF_KT, OFF_VCS, OFF_VS, OFF_VZ
            )
        k0, k1 = _load_codes(
            rec + OFF_KC, 0, D, D, K_ROW, c * (BN * KB // 8), BN, KB, K_ORDER, True
        )
        v0, v1 = _load_codes(rec + OFF_VC, c * BN, BN, G, V_ROW, 0, D, VB, V_ORDER, True)
        if not UNPACK:
            probe += tl.sum(k0.to(tl.float32), axis=1)[:, None]
            probe += tl.sum(tl.sum(v0.to(tl.float32), axis=1), axis=0)
        else:
            kc = _codes_f16(k0, k1, BN, KB, FAST)
            vdq = _dequant(_codes_f16(v0, v1, D, VB, FAST), vs[:, None], vz[:, None])
            if not MMA:
                probe += tl.sum(_centred(kc, ks[:, None], KB).to(tl.float32), axis=1)[:, None]
                probe += tl.sum(vdq.to(tl.float32), axis=0)[:, None]
            else:
                mid: tl.constexpr = 1 << (KB - 1)
                zq = tl.sum(qn * (kz.to(tl.float32) + mid * ks.to(tl.float32))[:, None], axis=0)
                sT = tl.dot(tl.trans(_centred(kc, ks[:, None], KB)), qT16)
                sT = (sT + zq[None, :]) * kt[:, None]
                if POOL:
                    slot = tl.load(BLOCK_TO_SLOT + blk)
                    if slot >= 0:
                        prow = (slot.to(tl.int64) * G + tok) * HK + h
                        kpT = tl.load(
                            POOL_K + prow[:, None] * D + dd[None, :], mask=live[:, None], other=0.0
                        )
                        sT = tl.dot(kpT, qT16)
                sT = sT * qmax[None, :]
                sT = tl.where(live[:, None], sT, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sT, axis=0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                pT = tl.exp2(sT - m_use[None, :])
                l_acc = l_acc * alpha[None, :] + pT
                m_i = m_new
                pvT = tl.dot(tl.trans(vdq), pT.to(tl.float16)) * vcs[:, None]
                acc = acc * alpha[None, :] + pvT
    out = acc / tl.maximum(tl.sum(l_acc, axis=0), 1e-30)[None, :] + probe
    prow_out = split.to(tl.int64) * (tl.num_programs(0) * HQ) + rows
    tl.store(O_PART + prow_out[None, :] * D + dd[:, None], out, mask=q_ok[None, :])


PROBES: dict[str, dict[str, int]] = {
    "full (v2 loop)": dict(POOL=1, TABLE=1, SCALES=1, MMA=1, UNPACK=1),
    "- pool": dict(POOL=0, TABLE=1, SCALES=1, MMA=1, UNPACK=1),
    "- pool - table": dict(POOL=0, TABLE=0, SCALES=1, MMA=1, UNPACK=1),
    "- pool - scales": dict(POOL=0, TABLE=1, SCALES=0, MMA=1, UNPACK=1),
    "- pool - scales - table": dict(POOL=0, TABLE=0, SCALES=0, MMA=1, UNPACK=1),
    "- pool - scales - mma": dict(POOL=0, TABLE=1, SCALES=0, MMA=0, UNPACK=1),
    "loads only": dict(POOL=0, TABLE=1, SCALES=0, MMA=0, UNPACK=0),
}
SHAPES: list[tuple[int, int, int, int]] = [
    (128, 8, 3, 128),
    (64, 4, 3, 0),
]  # BN, warps, stages, cap


def launch(inp: dict[str, Any], flags: dict[str, int], shape: tuple[int, int, int, int]) -> Any:
    import torch

    from kvarn_format import parse_cache_dtype, record_layout
    from kvarn_kernels._common import dense_geometry

    fmt = parse_cache_dtype(inp["fmt"])
    d, hk, hq = 128, 8, 32
    geo = dense_geometry(fmt, d, record_layout(fmt, d).tile_bytes)
    bsz = inp["q"].shape[0]
    splits = inp["splits"]
    out = torch.empty(splits * bsz * hq * d, device=inp["q"].device)
    q32 = inp["q"].float()
    bn, warps, stages, cap = shape
    extra = {"maxnreg": cap} if cap else {}

    def fn() -> None:
        probe_kernel[(bsz, hk, splits)](
            q32,
            inp["kv"],
            inp["pool_k"],
            inp["pool_v"],
            inp["bt"],
            inp["seq_lens"],
            inp["b2s"],
            out,
            0.125,
            inp["bt"].stride(0),
            HQ=hq,
            HK=hk,
            QPK=4,
            BLOCK_Q=8,
            D=d,
            G=geo.group,
            KB=geo.key_bits,
            VB=geo.value_bits,
            STRIDE=geo.record_stride,
            **geo.offsets(),
            BN=bn,
            NUM_SPLITS=splits,
            **flags,
            FAST=inp["q"].device.type == "cuda",
            num_warps=warps,
            num_stages=stages,
            **extra,
        )

    return fn


def _warm(args: tuple[str, tuple[int, int, int, int]]) -> str:
    import bench_kernels as bk

    name, shape = args
    inp = bk.decode_inputs("kvarn_k4v2_g128", 2, 2048)
    inp["splits"] = 2
    launch(inp, PROBES[name], shape)()
    return name


def main() -> None:
    import bench_kernels as bk
    import torch

    jobs = [(n, s) for s in SHAPES for n in PROBES]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 4)) as ex:
        list(ex.map(_warm, jobs))
    inp = bk.decode_inputs("kvarn_k4v2_g128", 64, 16384)
    inp["splits"] = 2
    rows = []
    for name, shape in jobs:
        us, _ = bk.timed(launch(inp, PROBES[name], shape))
        gbs = inp["bytes"] / us / 1e3
        rows.append({"probe": name, "shape": shape, "us": us, "GB/s": gbs})
        print(f"{name:28s} BN={shape[0]:3d} w={shape[1]} {us:9.1f} us {gbs:7.0f} GB/s", flush=True)
    torch.cuda.synchronize()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    main()
