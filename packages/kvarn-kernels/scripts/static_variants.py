"""Kernel variants compiled by static_kernels.py (Qwen3-8B decode/prefill/store shapes)."""

from __future__ import annotations

from typing import Any

from static_kernels import VARIANTS, compile_kernel, variant

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_kernels._common import dense_geometry
from kvarn_kernels.decode_v6 import PROBE_COMPUTE_ONLY, PROBE_COPIES_ONLY

__all__ = ["VARIANTS"]


def _geo(name: str, d: int = 128) -> Any:
    fmt = parse_cache_dtype(name)
    return dense_geometry(fmt, d, record_layout(fmt, d).tile_bytes)


#: Pointer and scalar argument types shared by the decode kernels (v1 adds ``QSL``).
DECODE_SIG = {
    "Q": "*fp32",
    "KV": "*u8",
    "POOL_K": "*fp16",
    "POOL_V": "*fp16",
    "BLOCK_TABLE": "*i32",
    "SEQ_LENS": "*i32",
    "BLOCK_TO_SLOT": "*i32",
    "O_PART": "*fp32",
    "LSE_PART": "*fp32",
    "qk_scale": "fp32",
}


def _decode_v1(
    name: str,
    bn: int = 64,
    warps: int = 4,
    fast: bool = True,
    pf: bool = True,
    block_m: int | None = None,
) -> Any:
    """The v1 kernel as decode, or with ``block_m`` as the fused prefill (``block_m / 4``
    query tokens of 4 heads per program)."""
    from kvarn_kernels.attention import _attn_kernel

    geo = _geo(name)
    sig = {**DECODE_SIG, "QSL": "*i32"}
    consts = dict(
        SHADOW=0,  # whole-tile pool slots (shadow rows: a separate compile)
        HQ=32,
        HK=8,
        QPK=4,
        QPK_P=4,
        BQ=1 if block_m is None else block_m // 4,
        BLOCK_M=16 if block_m is None else block_m,
        B_P=2,
        D=128,
        G=geo.group,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        **geo.offsets(),
        BN=bn,
        NUM_SPLITS=4,
        DECODE=block_m is None,
        FAST_UNPACK=fast,
        PREFETCH=pf,
    )
    return compile_kernel(_attn_kernel, sig, consts, warps)


for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k5v5_g64"):
    variant(f"decode_v1 {_n} bn64 w4")(lambda _n=_n: _decode_v1(_n))
# v1's launch shapes at the 5-bit format it alone serves (scripts/decode_v1_sweep.py)
for _bn, _w in ((64, 8), (32, 4), (32, 8)):
    variant(f"decode_v1 kvarn_k5v5_g64 bn{_bn} w{_w}")(
        lambda _bn=_bn, _w=_w: _decode_v1("kvarn_k5v5_g64", bn=_bn, warps=_w)
    )
variant("prefill_v1 kvarn_k4v2_g128 m64 w8")(
    lambda: _decode_v1("kvarn_k4v2_g128", warps=8, block_m=64)
)


def _decode_v4(
    name: str,
    bn: int = 64,
    warps: int = 4,
    stages: int = 2,
    d: int = 128,
    qpk: int = 4,
    fast: bool = True,
    round7: bool = False,
    verify_tokens: int = 0,
    splits: int = 4,
    masked: bool = False,
    mma_rows: int = 16,
    pool_split: bool = False,
) -> Any:
    """The v4 kernel for 8 KV heads and ``qpk`` query heads per KV head (``round7``:
    ``variant="v4b"``; ``verify_tokens``: ``verify_attention``'s kernel with that many query
    tokens per request; ``splits``: the split count, a compile-time constant; ``masked``:
    ``variant="v4c"``'s masked scale loads, with ``round7``; ``mma_rows``: the query rows of
    a program, at least the GQA ratio's power of two; ``pool_split``: ``variant="v4d"``'s
    main-loop kernel, without the pool phase, with ``masked``)."""
    from kvarn_kernels.decode_v4 import decode_v4_kernel

    geo = _geo(name, d)
    consts = dict(
        SHADOW=0,  # whole-tile pool slots (shadow rows: a separate compile)
        HQ=8 * qpk,
        HK=8,
        QPK=qpk,
        BLOCK_Q=max(mma_rows, 1 << (qpk - 1).bit_length()),
        D=d,
        G=geo.group,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        **geo.offsets(),
        BN=bn,
        W=warps,
        SCAN=64,
        NUM_SPLITS=splits,
        FAST_UNPACK=fast,
        POOL_BATCHED=round7,
        WIDE_SCALES=round7,
        MASKED_SCALES=masked,
        PHASES=1 if pool_split else 0,
    )
    tpp = max(1, consts["BLOCK_Q"] // qpk) if verify_tokens else 1
    consts.update(MULTI=bool(verify_tokens), TPP=tpp, NTG=-(-max(verify_tokens, 1) // tpp))
    sig = {**DECODE_SIG, "QSL": "*i32"}
    return compile_kernel(decode_v4_kernel, sig, consts, warps, stages)


def _dequant_context(name: str, d: int = 128, bt: int = 32) -> Any:
    """The context dequantization kernel."""
    from kvarn_kernels.context import _dequant_context_kernel

    geo = _geo(name, d)
    sig = {
        "KV": "*u8",
        "POOL_K": "*fp16",
        "POOL_V": "*fp16",
        "BLOCK_TABLE": "*i32",
        "BLOCK_TO_SLOT": "*i32",
        "PLAN": "*i32",
        "OUT_K": "*fp16",
        "OUT_V": "*fp16",
    }
    consts = dict(
        SHADOW=0,  # whole-tile pool slots (shadow rows: a separate compile)
        HK=8,
        D=d,
        G=geo.group,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        **geo.offsets(),
        BT=min(bt, geo.group),
        FAST_UNPACK=True,
    )
    return compile_kernel(_dequant_context_kernel, sig, consts, 4, 3)


for _n, _d, _bt in (
    ("kvarn_k4v2_g128", 128, 32),
    ("kvarn_k5v5_g64", 128, 32),
    ("kvarn_k4v4_g64", 256, 16),
    ("kvarn_k4v2_g128", 64, 32),
):
    variant(f"dequant_context {_n} d{_d} bt{_bt}")(
        lambda _n=_n, _d=_d, _bt=_bt: _dequant_context(_n, _d, _bt)
    )


def _rotate(out_kind: str) -> Any:
    from kvarn_kernels.rotation import _rotate_rows_kernel

    sig = {
        "X": "*fp16",
        "Y": "*" + out_kind,
        "S": "*fp16",
        "SLOT_MAPPING": "*fp16",
        "BLOCK_TO_SLOT": "*fp16",
        "inv_sqrt_d": "fp32",
    }
    consts = dict(
        SHADOW=0,  # whole-tile pool slots (shadow rows: a separate compile)
        STRIDE=0,
        IS_V=False,
        HK=1,
        D=128,
        G=1,
        BLOCK_R=32,
        BLOCK_C=128,
        OUT_F32=out_kind == "fp32",
        SCATTER=False,
        IEEE=False,
        OUT_BF16=out_kind == "bf16",
    )
    return compile_kernel(_rotate_rows_kernel, sig, consts, 4, 3)


for _k in ("fp16", "bf16", "fp32"):
    variant(f"rotate out {_k}")(lambda _k=_k: _rotate(_k))


def _store(
    name: str,
    d: int = 128,
    warps: int = 4,
    kernel: str = "v1",
    tokens: bool = False,
    shadow: int = 0,
    part: int = -1,
    words5: bool = False,
) -> Any:
    """The store kernel as flush_tiles launches it, or (``tokens``) as flush_token_tiles;
    ``shadow`` rows > 0: one of the two launches (``part`` 0: K, 1: V) of a shadowed pool;
    ``words5``: 5-bit codes stored as words (``store.STORE_5BIT_WORDS``)."""
    from kvarn_kernels import store

    geo = _geo(name, d)
    fn = store._flush_kernel
    sig = {
        "SRC_K": "*fp16",
        "SRC_V": "*fp16",
        "SRC_ROWS": "*i32",
        "HEAD_K": "*fp16",
        "HEAD_V": "*fp16",
        "HEAD_SLOTS": "*i32",
        "HEAD_LENS": "*i32",
        "KV_CACHE": "*u8",
        "DST_BLOCKS": "*i32",
    }
    pad = geo.record_stride - geo.payload_bytes
    consts = dict(
        HK=8,
        D=d,
        G=geo.group,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        PAYLOAD=geo.payload_bytes,
        PAD_BLOCK=max(16, 1 << (max(pad, 1) - 1).bit_length()),
        **geo.offsets(),
        ITERS=8,
        PRECISE=True,
        V3=kernel == "v3",
        V4=kernel == "v4",
        ROW_SCALE=1 if tokens else geo.group,
        HAS_HEAD=tokens,
        MASKED=tokens,
        SHADOW=shadow,
        PART=part,
        WORDS5=words5,
    )
    return compile_kernel(fn, sig, consts, warps, 3)


for _k in ("v1", "v3", "v4"):
    for _n, _w in (
        ("kvarn_k4v2_g128", 4),
        ("kvarn_k4v2_g64", 2),
        ("kvarn_k4v2_g128", 8),
        ("kvarn_k4v4_g64", 2),
        ("kvarn_k5v5_g64", 2),
    ):
        variant(f"store_{_k} {_n} w{_w}")(lambda _n=_n, _w=_w, _k=_k: _store(_n, 128, _w, _k))
variant("store_v4 kvarn_k5v5_g64 w2 words")(
    lambda: _store("kvarn_k5v5_g64", 128, 2, "v4", words5=True)
)
for _n, _w in (("kvarn_k4v2_g128", 4), ("kvarn_k4v4_g128", 4), ("kvarn_k5v5_g64", 2)):
    variant(f"store_tokens {_n} w{_w}")(lambda _n=_n, _w=_w: _store(_n, 128, _w, "v1", True))
# Shadowed pools (kvarn_k4v2_g128 at D = 128: 27 shadow rows): each launch runs one half.
for _tok in (False, True):
    for _part in (0, 1):
        variant(f"store_v3 shadow27 {'tokens' if _tok else 'pool'} part{_part}")(
            lambda _tok=_tok, _part=_part: _store("kvarn_k4v2_g128", 128, 4, "v3", _tok, 27, _part)
        )


def _decode_v4_default(
    name: str,
    d: int,
    qpk: int,
    round7: bool = False,
    verify_tokens: int = 0,
    masked: bool = False,
    mma_rows: int | None = None,
    pool_split: bool = False,
    num_stages: int | None = None,
) -> Any:
    """v4 (or v4b) with ``decode_v4_config``'s shape and ``decode_attention``'s default query
    rows, as ``decode_attention`` launches it (``verify_tokens``: as ``verify_attention``
    launches it, 16 rows)."""
    from kvarn_kernels.attention import decode_mma_rows
    from kvarn_kernels.decode_v4 import decode_v4_config

    verify = verify_tokens > 0
    cfg = decode_v4_config(d, parse_cache_dtype(name).group, verify=verify)
    if mma_rows is None:
        mma_rows = decode_mma_rows(qpk, verify=verify)
    return _decode_v4(
        name,
        cfg["block_n"],
        cfg["num_warps"],
        num_stages or cfg["num_stages"],
        d,
        qpk,
        round7=round7,
        verify_tokens=verify_tokens,
        masked=masked,
        mma_rows=mma_rows,
        pool_split=pool_split,
    )


# v4's default shape away from the timed case (D = 128, GQA 4, 128-token tiles): other head
# dims, GQA ratios and 64-token tiles (variant="auto" runs v4 up to D = 256, v1 at D = 512).
for _n, _d, _qpk in (
    ("kvarn_k4v2_g128", 64, 1),
    ("kvarn_k4v4_g64", 256, 8),
    ("kvarn_k4v2_g128", 256, 4),
    ("kvarn_k4v2_g128", 512, 8),
    ("kvarn_k4v2_g64", 128, 16),
):
    variant(f"decode_v4 default {_n} d{_d} qpk{_qpk}")(
        lambda _n=_n, _d=_d, _qpk=_qpk: _decode_v4_default(_n, _d, _qpk)
    )

# v4b (round 7: the pool phase one block per step across the warps) at the timed shape and
# the other head dims and tile sizes; its main loop must compile as v4's.
for _n, _d, _qpk in (
    ("kvarn_k4v2_g128", 128, 4),
    ("kvarn_k4v4_g128", 128, 4),
    ("kvarn_k4v2_g128", 64, 1),
    ("kvarn_k4v4_g64", 256, 8),
    ("kvarn_k4v2_g64", 128, 16),
):
    variant(f"decode_v4b default {_n} d{_d} qpk{_qpk}")(
        lambda _n=_n, _d=_d, _qpk=_qpk: _decode_v4_default(_n, _d, _qpk, round7=True)
    )

# v4c (ninth session): v4b with the pool blocks' tile scales masked at the load, and v4d; with
# the default query rows (8 since the eleventh session) or the MMA's 16 or 4 (``mma_rows``,
# tenth session), and the default pipeline depth (one stage from head dim 256 since the
# eleventh session) or another (eleventh session's candidates at head dim 128)
for _n, _d, _rows, _stages in (
    ("kvarn_k4v2_g128", 128, 16, None),
    ("kvarn_k4v4_g128", 128, 16, None),
    ("kvarn_k4v2_g128", 256, 16, 2),
    ("kvarn_k4v2_g128", 128, None, None),
    ("kvarn_k4v4_g128", 128, None, None),
    ("kvarn_k4v2_g128", 256, None, 2),
    ("kvarn_k4v2_g128", 256, None, None),
    ("kvarn_k4v2_g128", 128, 4, None),
    ("kvarn_k4v2_g128", 128, None, 1),
    ("kvarn_k4v2_g128", 128, None, 3),
    ("kvarn_k4v2_g64", 128, None, None),  # one request's decode, g64 against g128
):
    for _v in ("v4c", "v4d"):
        _tag = "" if _rows is None else f" mma{_rows}"
        _tag += "" if _stages is None else f" s{_stages}"
        variant(f"decode_{_v} default {_n} d{_d} qpk4{_tag}")(
            lambda _n=_n, _d=_d, _rows=_rows, _v=_v, _stages=_stages: _decode_v4_default(
                _n,
                _d,
                4,
                round7=True,
                masked=True,
                mma_rows=_rows,
                pool_split=_v == "v4d",
                num_stages=_stages,
            )
        )


for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g128"):
    for _bn, _w, _st, _f in (
        (64, 4, 2, True),
        (32, 4, 3, True),
        (32, 4, 3, False),
        (32, 8, 3, True),
    ):
        variant(f"decode_v4 {_n} bn{_bn} w{_w} s{_st}{'' if _f else ' plain'}")(
            lambda _n=_n, _bn=_bn, _w=_w, _st=_st, _f=_f: _decode_v4(_n, _bn, _w, _st, fast=_f)
        )

# verify_attention's kernel (speculative verify, 1 + 3 drafts): GQA 4 fills the 16 MMA rows
# with one request's 4 tokens, GQA 8 takes two programs of 2 tokens.
for _n, _qpk, _r7 in (
    ("kvarn_k4v2_g128", 4, True),
    ("kvarn_k4v4_g128", 4, True),
    ("kvarn_k4v2_g128", 8, True),
    ("kvarn_k4v2_g128", 4, False),
):
    variant(f"decode_v4{'b' if _r7 else ''} verify4 {_n} d128 qpk{_qpk}")(
        lambda _n=_n, _qpk=_qpk, _r7=_r7: _decode_v4_default(_n, 128, _qpk, _r7, verify_tokens=4)
    )
variant("decode_v4c verify4 kvarn_k4v2_g128 d128 qpk4")(
    lambda: _decode_v4_default("kvarn_k4v2_g128", 128, 4, True, verify_tokens=4, masked=True)
)


def _decode_v5(
    name: str,
    qpk: int = 4,
    warps: int = 4,
    stages: int = 2,
    fold: bool = False,
    lazy: bool = False,
) -> Any:
    """The Gluon v5 main loop (:mod:`kvarn_kernels.decode_v5`) at Qwen3-8B's decode shape."""
    from kvarn_kernels.decode_v5 import decode_v5_kernel

    consts = {**_gluon_decode_consts(name, qpk, warps, stages, fold), "LAZY": lazy}
    return compile_kernel(decode_v5_kernel, DECODE_SIG, consts, warps)


def _gluon_decode_consts(
    name: str, qpk: int, warps: int, stages: int, fold: bool
) -> dict[str, Any]:
    """The compile-time constants v5 and v6 share, at 8 KV heads, head dim 128, 2 splits."""
    geo = _geo(name)
    return {
        "HQ": 8 * qpk,
        "HK": 8,
        "QPK": qpk,
        "D": 128,
        "G": geo.group,
        "VB": geo.value_bits,
        "STRIDE": geo.record_stride,
        **{k: v for k, v in geo.offsets().items() if k.startswith("OFF_")},
        "NUM_SPLITS": 2,
        "W": warps,
        "STAGES": stages,
        "FOLD": fold,
    }


# v5 (fourteenth session): the main loop in Gluon, every register layout stated; also with
# fewer warps per program (the pipeline's barriers then wait on fewer warps) and with three
# pipeline stages (copies two steps ahead)
for _n, _w, _s in (
    ("kvarn_k4v2_g128", 4, 2),
    ("kvarn_k4v4_g128", 4, 2),
    ("kvarn_k4v2_g64", 4, 2),
    ("kvarn_k4v2_g128", 2, 2),
    ("kvarn_k4v2_g128", 1, 2),
    ("kvarn_k4v2_g128", 4, 3),
    ("kvarn_k4v2_g128", 1, 3),
):
    variant(f"decode_v5 {_n} d128 qpk4 w{_w} s{_s}")(
        lambda _n=_n, _w=_w, _s=_s: _decode_v5(_n, warps=_w, stages=_s)
    )


# v5f (fifteenth session): v5 with the raw codes as operands, the scales folded into the query
# and the probabilities, the zeros and magics into per-row terms
for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64"):
    variant(f"decode_v5f {_n} d128 qpk4 w1 s2")(
        lambda _n=_n: _decode_v5(_n, warps=1, stages=2, fold=True)
    )

# v5f with lazy rescaling (not launched yet): the common path's count
variant("decode_v5f kvarn_k4v2_g128 d128 qpk4 w1 s2 lazy")(
    lambda: _decode_v5("kvarn_k4v2_g128", warps=1, stages=2, fold=True, lazy=True)
)


def _decode_v6(
    name: str,
    qpk: int = 4,
    warps: int = 1,
    stages: int = 2,
    fold: bool = False,
    probe: int = 0,
    tma: bool = False,
    block: bool = False,
    maxnreg: int | None = None,
    pdl: bool = False,
) -> Any:
    """The Gluon v6 main loop (:mod:`kvarn_kernels.decode_v6`: tokens in the MMA's M) at
    Qwen3-8B's decode shape; ``tma``: its code words copied by the tensor memory accelerator
    (the descriptors' types from :func:`kvarn_kernels.attention.v6_tma_descriptors` on a
    small CPU cache); ``pdl``: built for a programmatic dependent launch."""
    import torch

    from kvarn_kernels.attention import v6_tma_descriptors
    from kvarn_kernels.decode_v6 import decode_v6_kernel

    consts = {**_gluon_decode_consts(name, qpk, warps, stages, fold), "PROBE": probe, "TMA": tma}
    consts.update(BLOCK_SCALES=block, PDL=pdl)
    sig = dict(DECODE_SIG)
    if tma:
        geo = _geo(name)
        cache = torch.zeros(4 * 8 * geo.record_stride, dtype=torch.uint8)
        names = ("K_DESC", "V_DESC", "S256_DESC", "S128_DESC")
        for arg, desc in zip(names, v6_tma_descriptors(geo, cache), strict=True):
            shape = ",".join(str(x) for x in desc.block_shape)
            dtype = "i64" if desc.base.dtype == torch.int64 else "i32"
            sig[arg] = f"tensordesc<{dtype}[{shape}],{desc.layout!r}>"
    else:
        consts.update({"K_DESC": None, "V_DESC": None, "S256_DESC": None, "S128_DESC": None})
    return compile_kernel(decode_v6_kernel, sig, consts, warps, maxnreg=maxnreg)


# v6 (sixteenth session): v5 transposed, tokens in the MMA's M
for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64"):
    variant(f"decode_v6 {_n} d128 qpk4 w1 s2")(lambda _n=_n: _decode_v6(_n))
    # v6f: v5f's folding on v6 (the scales on the B operands, a quarter of the values)
    variant(f"decode_v6f {_n} d128 qpk4 w1 s2")(lambda _n=_n: _decode_v6(_n, fold=True))
    # timing probes (twenty-second session): the copies alone, the math alone
    variant(f"decode_v6f {_n} d128 qpk4 w1 s2 copies-only")(
        lambda _n=_n: _decode_v6(_n, fold=True, probe=int(PROBE_COPIES_ONLY.value))
    )
    variant(f"decode_v6f {_n} d128 qpk4 w1 s2 compute-only")(
        lambda _n=_n: _decode_v6(_n, fold=True, probe=int(PROBE_COMPUTE_ONLY.value))
    )
    # v6t (thirty-ninth session): every copy by the tensor memory accelerator
    variant(f"decode_v6t {_n} d128 qpk4 w1 s2")(lambda _n=_n: _decode_v6(_n, fold=True, tma=True))


def _decode_v7(warps: int = 1, stages: int = 2, fold: bool = False, tokens: int = 1) -> Any:
    """The Gluon v7 main loop (:mod:`kvarn_kernels.decode_v7`: v6 on 5-bit codes in the byte
    planes) at Qwen3-8B's decode shape (``tokens``: verify rows per program)."""
    from kvarn_kernels.decode_v7 import decode_v7_kernel

    consts = {
        **_gluon_decode_consts("kvarn_k5v5_g64", 4, warps, stages, fold),
        "TOK": tokens,
        "GPR": 2 if tokens > 1 else 1,  # 4-token verify
    }
    del consts["VB"]
    return compile_kernel(decode_v7_kernel, {**DECODE_SIG, "QSL": "*i32"}, consts, warps)


# v7 (thirty-sixth session; the 5-bit default since the thirty-seventh): 5-bit codes from the byte planes
variant("decode_v7 kvarn_k5v5_g64 d128 qpk4 w1 s2")(lambda: _decode_v7())
variant("decode_v7f kvarn_k5v5_g64 d128 qpk4 w1 s2")(lambda: _decode_v7(fold=True))
# thirty-eighth session: verify's rows two to a program (their 4 query heads side by side)
variant("decode_v7f kvarn_k5v5_g64 d128 qpk4 w1 s2 tok2")(lambda: _decode_v7(fold=True, tokens=2))


def _decode_pool(
    name: str, d: int = 128, qpk: int = 4, bn: int = 64, warps: int = 4, stages: int = 2
) -> Any:
    """The pool-tile kernel of the launches with a pool phase of its own (v4d's and the
    Gluon variants'; twenty-third session: v4's pool phase, which it replaced, had 255
    registers and 52 bytes of spill at 4 warps)."""
    from kvarn_kernels.decode_pool import decode_pool_kernel

    geo = _geo(name, d)
    consts = dict(
        HQ=8 * qpk,
        HK=8,
        QPK=qpk,
        BLOCK_Q=max(16, 1 << (qpk - 1).bit_length()),
        D=d,
        G=geo.group,
        SHADOW=0,
        STRIDE=geo.record_stride,
        BN=min(bn, geo.group),
        SCAN=64,
        STAGES=stages,
    )
    return compile_kernel(decode_pool_kernel, DECODE_SIG, consts, warps, stages)


for _n in ("kvarn_k4v2_g128", "kvarn_k4v2_g64"):
    variant(f"decode_pool {_n} d128 qpk4")(lambda _n=_n: _decode_pool(_n))
    variant(f"decode_pool {_n} d128 qpk4 bn32")(lambda _n=_n: _decode_pool(_n, bn=32))
    variant(f"decode_pool {_n} d128 qpk4 w8")(lambda _n=_n: _decode_pool(_n, warps=8))
    variant(f"decode_pool {_n} d128 qpk4 bn128 w8")(lambda _n=_n: _decode_pool(_n, bn=128, warps=8))
    variant(f"decode_pool {_n} d128 qpk4 s1")(lambda _n=_n: _decode_pool(_n, stages=1))


def _prefill_v2(
    name: str,
    d: int = 128,
    block_m: int = 128,
    bn: int = 64,
    warps: int = 8,
    stages: int = 3,
    maxnreg: int | None = None,
) -> Any:
    """The fused prefill of short chunks (``prefill_attention(method="fused")``)."""
    from kvarn_kernels.prefill_v2 import prefill_v2_kernel

    geo = _geo(name, d)
    consts = dict(
        HQ=32,
        HK=8,
        QPK=4,
        QPK_P=4,
        BQ=block_m // 4,
        BLOCK_M=block_m,
        B_P=2,
        D=d,
        G=geo.group,
        SHADOW=0,
        KB=geo.key_bits,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        **geo.offsets(),
        BN=min(bn, geo.group),
        NUM_SPLITS=8,
        FAST_UNPACK=True,
    )
    sig = {**DECODE_SIG, "QSL": "*i32"}
    return compile_kernel(prefill_v2_kernel, sig, consts, warps, stages, maxnreg)


for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g64", "kvarn_k5v5_g64"):
    variant(f"prefill_v2 {_n} m128 w8")(lambda _n=_n: _prefill_v2(_n))
variant("prefill_v2 kvarn_k4v2_g128 m64 w4")(
    lambda: _prefill_v2("kvarn_k4v2_g128", block_m=64, warps=4)
)
variant("prefill_v2 kvarn_k4v2_g128 m128 bn32 w8")(lambda: _prefill_v2("kvarn_k4v2_g128", bn=32))
variant("prefill_v2 kvarn_k4v2_g128 m128 w4")(lambda: _prefill_v2("kvarn_k4v2_g128", warps=4))
variant("prefill_v2 kvarn_k4v4_g64 d256 m128 w8")(lambda: _prefill_v2("kvarn_k4v4_g64", d=256))
variant("prefill_v2 kvarn_k4v4_g64 d256 m64 w8")(
    lambda: _prefill_v2("kvarn_k4v4_g64", d=256, block_m=64)
)
variant("prefill_v2 kvarn_k4v4_g64 d64 m128 w8")(lambda: _prefill_v2("kvarn_k4v4_g64", d=64))
variant("prefill_v2 kvarn_k4v2_g128 m128 bn128 w8")(lambda: _prefill_v2("kvarn_k4v2_g128", bn=128))
variant("prefill_v2 kvarn_k4v2_g128 m128 w8 s1")(lambda: _prefill_v2("kvarn_k4v2_g128", stages=1))
for _r in (128, 168):
    variant(f"prefill_v2 kvarn_k4v2_g128 m128 w8 r{_r}")(
        lambda _r=_r: _prefill_v2("kvarn_k4v2_g128", maxnreg=_r)
    )
    variant(f"prefill_v2 kvarn_k4v2_g128 m64 w4 r{_r}")(
        lambda _r=_r: _prefill_v2("kvarn_k4v2_g128", block_m=64, warps=4, maxnreg=_r)
    )
    variant(f"prefill_v2 kvarn_k4v2_g128 m64 w4 bn32 r{_r}")(
        lambda _r=_r: _prefill_v2("kvarn_k4v2_g128", block_m=64, warps=4, bn=32, maxnreg=_r)
    )


def _prefill_consts(name: str, rows: int, pdl: bool = True) -> dict[str, Any]:
    """The Gluon fused prefills' shape constants at ``rows`` query rows a program (4 heads
    of a token each, 8 splits); ``pdl``: launched as programmatic dependents (as on sm_90)."""
    geo = _geo(name)
    return dict(
        HQ=32,
        HK=8,
        QPK=4,
        QPK_P=4,
        BQ=rows // 4,
        B_P=128,  # attention.request_slots: at least 128
        D=128,
        G=geo.group,
        VB=geo.value_bits,
        STRIDE=geo.record_stride,
        **{k: v for k, v in geo.offsets().items() if k not in ("K_ORDER", "V_ORDER")},
        NUM_SPLITS=8,
        PDL=pdl,
    )


def _prefill_v3(
    name: str,
    warps: int = 8,
    deq16: bool = True,
    ws: bool = False,
    shadow: int = 0,
    pdl: bool = True,
    **ws_settings: Any,
) -> Any:
    """The Gluon fused prefill (asynchronous wgmma), ``16 * warps`` query rows; ``ws``: its
    warp-specialized form (producer warps dequantizing), ``ws_settings`` overriding the
    module's ``WS_`` constants (``PREGS=208``, ``PROBE=1``, ``MAXNREG=...``); ``shadow``:
    the side pool's shadow rows; ``pdl``: :func:`_prefill_consts`'."""
    from kvarn_kernels import prefill_v3 as p3

    consts = dict(
        **_prefill_consts(name, 16 * warps, pdl),
        W=warps,
        DEQ16=deq16,
        SHADOW=shadow,
    )
    sig = {**DECODE_SIG, "QSL": "*i32"}
    if ws:
        consts.update(
            STAGES=p3.WS_STAGES,
            PW=p3.WS_PRODUCER_WARPS,
            PREGS=p3.WS_PRODUCER_REGS,
            CP=p3.WS_CONSUMER_PARTITIONS,
            CREGS=p3.WS_CONSUMER_REGS,
            RING=p3.WS_RING,
            PROBE=p3.WS_PROBE,
            SPREAD=p3.WS_SPREAD_STORES,
        )
        maxnreg = ws_settings.pop("MAXNREG", p3.WS_MAXNREG)
        consts.update(ws_settings)
        consts["W"] = warps // consts["CP"]
        return compile_kernel(p3.prefill_v3ws_kernel, sig, consts, consts["W"], maxnreg=maxnreg)
    return compile_kernel(p3.prefill_v3_kernel, sig, consts, warps)


for _n in ("kvarn_k4v2_g128", "kvarn_k4v4_g64"):
    for _w in (4, 8):
        variant(f"prefill_v3 {_n} w{_w}")(lambda _n=_n, _w=_w: _prefill_v3(_n, _w))
        variant(f"prefill_v3fp32 {_n} w{_w}")(lambda _n=_n, _w=_w: _prefill_v3(_n, _w, False))
    variant(f"prefill_v3ws {_n} w8")(lambda _n=_n: _prefill_v3(_n, 8, ws=True))
    variant(f"prefill_v3ws1 {_n} w8")(lambda _n=_n: _prefill_v3(_n, 8, ws=True, CP=1))
    variant(f"prefill_v3ws_unspread {_n} w8")(
        lambda _n=_n: _prefill_v3(_n, 8, ws=True, SPREAD=False)
    )
    variant(f"prefill_v3ws_shadow {_n} w8")(lambda _n=_n: _prefill_v3(_n, 8, ws=True, shadow=27))
    variant(f"prefill_v3_shadow {_n} w4")(lambda _n=_n: _prefill_v3(_n, 4, shadow=27))


def _prefill_v4(name: str, shadow: int = 0, lazy: bool | None = None, pdl: bool = True) -> Any:
    """The transposed producer-free fused prefill (64 query rows, 4 warps); ``shadow``: the
    side pool's shadow rows; ``lazy``: its softmax (default :data:`V4_LAZY_SOFTMAX`);
    ``pdl``: :func:`_prefill_consts`'."""
    from kvarn_kernels import prefill_v4 as p4

    consts = dict(
        **_prefill_consts(name, 64, pdl),
        SHADOW=shadow,
        RING=p4.V4_RING,
        LAZY=p4.V4_LAZY_SOFTMAX if lazy is None else lazy,
    )
    sig = {**DECODE_SIG, "QSL": "*i32"}
    return compile_kernel(p4.prefill_v4_kernel, sig, consts, 4)


for _n in ("kvarn_k4v2_g128", "kvarn_k4v2_g64"):
    variant(f"prefill_v4 {_n} w4")(lambda _n=_n: _prefill_v4(_n))
variant("prefill_v4_shadow kvarn_k4v2_g128 w4")(lambda: _prefill_v4("kvarn_k4v2_g128", shadow=27))
variant("prefill_v4_eager_max kvarn_k4v2_g128 w4")(
    lambda: _prefill_v4("kvarn_k4v2_g128", lazy=False)
)


def _merge(parts: int, warps: int = 4, pdl: bool = False) -> Any:
    """The merge and un-rotation of ``parts`` partials as :func:`attention._launch` compiles
    it for decode (16 rows a program, head dim 128, fp16 out), at ``warps`` warps; ``pdl``:
    as for the fused prefill's (a programmatic dependent)."""
    from kvarn_kernels import attention

    sig = {"O_PART": "*fp32", "LSE_PART": "*fp32", "OUT": "*fp16", "S_MAT": "*fp16"}
    sig.update({"TOKENS": "*fp32", "inv_sqrt_d": "fp32"})
    consts = dict(
        NUM_SPLITS=parts,
        D=128,
        BLOCK_R=16,
        BLOCK_N=128,
        OUT_BF16=False,
        ROWS_PER_TOKEN=0,
        UNROLL=attention._merge_unroll(parts),
        PDL=pdl,
    )
    return compile_kernel(attention._merge_unrotate_kernel, sig, consts, warps)


# the served partial counts below 8 requests: v6f at 8-64 splits plus its pool partial, v4c's
for _parts in (9, 17, 32, 33, 65):
    variant(f"merge parts{_parts}")(lambda _parts=_parts: _merge(_parts))
    variant(f"merge w8 parts{_parts}")(lambda _parts=_parts: _merge(_parts, 8))


# v6t as served on 128-token tiles with 2-bit values (fortieth session): a tile's channel-scale
# work once for its two chunks, at attention.V6T_BLOCK_MAX_REGISTERS
variant("v6t_block_scales kvarn_k4v2_g128 d128 qpk4 w1 s2 r168")(
    lambda: _decode_v6("kvarn_k4v2_g128", fold=True, tma=True, block=True, maxnreg=168)
)
