"""Store and decode launches of every variant, small enough for compute-sanitizer.

Usage (on the GPU machine)::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src \\
        compute-sanitizer --tool memcheck --error-exitcode 3 python3 tools/gpu_memcheck.py

The case is built by :func:`kvarn_kernels.testing.build_case`, which poisons unused memory
(NaN pool rows, random record bytes, ``-1`` block-table entries), so an out-of-bounds read
also shows up as a non-finite output. Exit status 0 only when every output is finite. Every
launch runs twice: with whole-tile pool slots and with the serving default, shadow rows
(each pool tile's first rows in its block's record area; the store then flushes the tile into
its own block, as serving does).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_format.geometry import shadow_rows
from kvarn_kernels import decode_attention, flush_tiles
from kvarn_kernels.attention import DECODE_VARIANTS, GPU_ONLY_DECODE_VARIANTS
from kvarn_kernels.store import STORE_VARIANTS
from kvarn_kernels.testing import build_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="kvarn_k4v2_g128")
    ap.add_argument(
        "--store-variants", default=",".join(STORE_VARIANTS), help="flush_tiles variants"
    )
    ap.add_argument(
        "--decode-variants",
        help="decode_attention variants (default: all; on the CPU those the interpreter runs)",
    )
    ap.add_argument("--device", default="cuda", help="cpu runs under TRITON_INTERPRET=1")
    ap.add_argument(
        "--small",
        action="store_true",
        help="2 KV heads and shorter requests (the CPU test's case: the interpreter is slow)",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    cpu_only = dev.type == "cpu"
    decode_variants = args.decode_variants or ",".join(
        v for v in DECODE_VARIANTS if not (cpu_only and v in GPU_ONLY_DECODE_VARIANTS)
    )
    hk, hq, d = (2, 8, 128) if args.small else (8, 32, 128)
    lens = [300, 3, 129] if args.small else [1000, 3, 517]
    fmt = parse_cache_dtype(args.format)
    q = torch.randn(3, hq, d, device=dev, dtype=torch.float16)
    ok = True
    for shadow in (0, shadow_rows(fmt.group, d, record_layout(fmt, d).tile_bytes)):
        case = build_case(args.format, d, hk, lens, device=dev, seed=1, shadow_rows=shadow)
        for variant in decode_variants.split(","):
            out = decode_attention(
                *case.decode_args(args.format, q, 1.0 / math.sqrt(d)),
                variant=variant,
            )
            if dev.type == "cuda":
                torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            ok &= finite
            print(f"decode {variant}, shadow rows {shadow}: launched, output finite: {finite}")
        # Request 0's sink: a full pool tile (1000 or 300 tokens). Whole-tile slots: its record goes
        # to a spare block; shadowed: to its own block (which holds its first rows), each
        # variant on a fresh copy of the cache.
        sink = case.block_table[0, :1].long()
        slots = case.block_to_slot[sink].to(torch.int32)
        spare = torch.tensor([case.kv_cache.shape[0] - 1], device=dev, dtype=torch.int32)
        dst = sink.to(torch.int32) if shadow else spare
        for variant in args.store_variants.split(","):
            cache = case.kv_cache.clone() if shadow else case.kv_cache
            flush_tiles(args.format, case.pool_k, case.pool_v, slots, cache, dst, variant=variant)
            print(f"store {variant}, shadow rows {shadow}: launched")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
