"""Carry the GPU machine's compile caches from one session to the next.

An engine's start-up on a fresh machine is mostly compilation: vLLM's torch.compile cache is
keyed by the KV-cache dtype, so every row of the serving burst compiles its model anew, and
TurboQuant's and kvarn's Triton kernels compile during CUDA-graph capture. The timed runs do
not change with warm caches, but one session's device time then holds more rows
(docs/kernel-notes.md, eighteenth session). The device tool returns at most 8 files of 16 MiB
from ``$OUT`` and carries at most 64 MiB, so the caches travel as a few compressed parts::

    # on the GPU machine, after the engines ran:
    python3 tools/gpu_caches.py pack --out $OUT/caches
    # here: copy the returned parts into .gpu/caches/ (ignored), then carry ".gpu/caches":
    python3 tools/gpu_caches.py unpack .gpu/caches

The caches are the directories vLLM, Triton and Inductor use on that machine (their
environment variables, else their defaults). ``unpack`` checks every part against the
manifest before it writes anything.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
PART_PREFIX = "caches.tgz.part"
#: Under the device tool's 16 MiB per returned file.
DEFAULT_PART_MIB = 15
#: Under its 64 MiB per call, with room for the bundle's env.sh and overlay.
DEFAULT_MAX_MIB = 56


def cache_dirs() -> dict[str, Path]:
    """The compile caches of this machine by name: where vLLM, Triton and Inductor keep them
    (their environment variables, else their defaults)."""
    home = Path.home()
    vllm_root = Path(os.environ.get("VLLM_CACHE_ROOT", home / ".cache" / "vllm"))
    user = os.environ.get("USER") or Path.home().name
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{user}")
    return {
        "vllm_compile": vllm_root / "torch_compile_cache",
        "triton": Path(os.environ.get("TRITON_CACHE_DIR", home / ".triton" / "cache")),
        "inductor": Path(inductor),
    }


def pack(out: Path, part_mib: int = DEFAULT_PART_MIB, max_mib: int = DEFAULT_MAX_MIB) -> int:
    """Write the caches that exist as a gzipped tar in parts of ``part_mib`` MiB plus a
    manifest into ``out``; return the number of parts. Raises ``SystemExit`` when the archive
    is larger than ``max_mib`` (it could not be carried back)."""
    buf = io.BytesIO()
    packed: dict[str, int] = {}
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, root in cache_dirs().items():
            if root.is_dir():
                files = [p for p in root.rglob("*") if p.is_file()]
                for path in files:
                    tar.add(path, arcname=f"{name}/{path.relative_to(root)}", recursive=False)
                packed[name] = len(files)
                print(f"gpu_caches: {name}: {len(files)} files from {root}", flush=True)
    data = buf.getvalue()
    size_mib = len(data) / 2**20
    if size_mib > max_mib:
        raise SystemExit(
            f"gpu_caches: the archive is {size_mib:.1f} MiB, more than the {max_mib} MiB a "
            f"device call carries; nothing written"
        )
    out.mkdir(parents=True, exist_ok=True)
    step = part_mib * 2**20
    parts: list[dict[str, object]] = []
    for i in range(0, max(len(data), 1), step):
        chunk = data[i : i + step]
        name = f"{PART_PREFIX}{len(parts):02d}"
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"parts": parts, "files": packed, "sha256": _sha256(data)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"gpu_caches: {size_mib:.1f} MiB in {len(parts)} parts in {out}", flush=True)
    return len(parts)


def unpack(src: Path) -> int:
    """Check the parts in ``src`` against its manifest, then extract them into this
    machine's cache directories; return the number of files written. Raises ``SystemExit``
    on a missing, changed or extra part (nothing is written then)."""
    manifest_path = src / MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(f"gpu_caches: no {MANIFEST} in {src}")
    manifest = json.loads(manifest_path.read_text())
    chunks: list[bytes] = []
    for part in manifest["parts"]:
        path = src / part["name"]
        if not path.is_file():
            raise SystemExit(f"gpu_caches: part {part['name']} is missing from {src}")
        chunk = path.read_bytes()
        if len(chunk) != part["bytes"] or _sha256(chunk) != part["sha256"]:
            raise SystemExit(f"gpu_caches: part {part['name']} does not match the manifest")
        chunks.append(chunk)
    listed = {p["name"] for p in manifest["parts"]}
    extra = sorted(p.name for p in src.glob(f"{PART_PREFIX}*") if p.name not in listed)
    if extra:
        raise SystemExit(f"gpu_caches: parts not in the manifest: {', '.join(extra)}")
    data = b"".join(chunks)
    if _sha256(data) != manifest["sha256"]:
        raise SystemExit("gpu_caches: the joined parts do not match the manifest")
    roots = cache_dirs()
    written = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for member in members:
            name, _, rel = member.name.partition("/")
            if name not in roots or not rel:
                raise SystemExit(f"gpu_caches: unexpected entry {member.name!r} in the archive")
        for member in members:
            name, _, rel = member.name.partition("/")
            member.name = rel
            # the "data" filter refuses absolute paths, links out of the root and devices
            tar.extract(member, roots[name], filter="data")
            written += 1
    print(f"gpu_caches: {written} files into {', '.join(str(p) for p in roots.values())}")
    return written


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="archive this machine's compile caches into parts")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=int, default=DEFAULT_PART_MIB)
    p.add_argument("--max-mib", type=int, default=DEFAULT_MAX_MIB)
    u = sub.add_parser("unpack", help="check and extract parts made by pack")
    u.add_argument("src", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.out, args.part_mib, args.max_mib)
    else:
        unpack(args.src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
