"""The 5-bit store with its codes as 32-bit words against the byte stores (GPU only).

``kvarn_kernels.store.STORE_5BIT_WORDS`` (docs/kernel-notes.md, thirty-third session): the
store of ``kvarn_k5v5_g64`` at the kernel table's shape (1024 tiles x 8 KV heads, head_dim
128) with the flag off and on, each timed twice in alternation, ``kvarn_k4v4_g64`` (the same
tile and Sinkhorn, 4-bit codes) as the same-run control; and the two forms' records on the
same input, which must be equal byte for byte. Writes ``store_words_ab.json`` to ``--out``
and prints a table. On the GPU machine::

    PYTHONPATH=packages/kvarn-format/src:packages/kvarn-kernels/src:tools \\
        python3 packages/kvarn-kernels/scripts/store_words_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import bench_kernels as bk  # tools/ on PYTHONPATH
import torch

from kvarn_format import parse_cache_dtype, record_layout
from kvarn_kernels import flush_tiles, rotate, store

FORMAT = "kvarn_k5v5_g64"
CONTROL = "kvarn_k4v4_g64"


def records(words: bool, n_tiles: int = 256) -> torch.Tensor:
    """The store's records of one seeded input with the flag set to ``words``."""
    store.STORE_5BIT_WORDS = words
    fmt = parse_cache_dtype(FORMAT)
    g = fmt.group
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (n_tiles * g, bk.HK, bk.D)
    pk = rotate(torch.randn(shape, device="cuda", generator=gen).half())
    pv = rotate(torch.randn(shape, device="cuda", generator=gen).half())
    tile = record_layout(fmt, bk.D).tile_bytes
    kv = torch.zeros(n_tiles, bk.HK, tile, dtype=torch.uint8, device="cuda")
    idx = torch.arange(n_tiles, dtype=torch.int32, device="cuda")
    flush_tiles(
        FORMAT, pk.view(n_tiles, g, bk.HK, bk.D), pv.view(n_tiles, g, bk.HK, bk.D), idx, kv, idx
    )
    torch.cuda.synchronize()
    return kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    mm = bk.ceilings()["bf16_tflops"]
    rows: list[dict[str, Any]] = []
    for rnd in range(2):
        for name, words in ((CONTROL, False), (FORMAT, False), (FORMAT, True)):
            store.STORE_5BIT_WORDS = words
            r = bk.guarded(lambda name=name: bk.bench_store(name, 1024, mm))
            rows.append({"round": rnd, "format": name, "words": words, **r})
            bk.log(f"{rnd} {name} words={words}: {r.get('us', r.get('error'))}")
    equal = bool(torch.equal(records(False), records(True)))
    store.STORE_5BIT_WORDS = True  # the default again
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_words_ab.json").write_text(
        json.dumps({"rows": rows, "records_equal": equal, "bf16_tflops": mm}, indent=1)
    )
    print(f"{'round':>5} {'format':16} {'words':>5} {'us':>9} {'share':>7}")
    for r in rows:
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "?")[:30]
        share = f"{100 * r['store_share']:.2f}%" if "store_share" in r else ""
        print(f"{r['round']:>5} {r['format']:16} {r['words']!s:>5} {us:>9} {share:>7}")
    print(f"records equal (words vs byte stores): {equal}")


if __name__ == "__main__":
    main()
