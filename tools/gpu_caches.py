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
manifest, and every entry's path, before it writes anything. vLLM's key includes the model
path: the tools' embedded Qwen3-8B config lives at a fixed path for that reason
(``gpu_e2e.resolve_model_dir``). To fill the caches without measuring anything, run
``bench_serving.py --warm-only``.
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
#: The archive's list of files: cache name, path in that cache, content digest, mode, mtime
#: (ns). The mtimes come back too: FlashInfer's JIT builds with ninja, whose deps log holds
#: each output's mtime, and a newer file (the unpack time) made it rebuild its sampling op,
#: ~110 s of nvcc, in every engine (nineteenth session).
INDEX = "index.json"
PART_PREFIX = "caches.tgz.part"
#: Under the device tool's 16 MiB per returned file.
DEFAULT_PART_MIB = 15
#: Under its 64 MiB per call, with room for the bundle's env.sh and overlay.
DEFAULT_MAX_MIB = 56


def cache_dirs() -> dict[str, Path]:
    """The compile caches of this machine by name: where vLLM, Triton, Inductor, FlashInfer
    and the CUDA driver keep them (their environment variables, else their defaults)."""
    home = Path.home()
    vllm_root = Path(os.environ.get("VLLM_CACHE_ROOT", home / ".cache" / "vllm"))
    user = os.environ.get("USER") or Path.home().name
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{user}")
    flashinfer_base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", home))
    return {
        "vllm_compile": vllm_root / "torch_compile_cache",
        "triton": Path(os.environ.get("TRITON_CACHE_DIR", home / ".triton" / "cache")),
        "inductor": Path(inductor),
        # FlashInfer's JIT-built kernels, and the driver's cache of PTX compiled for this GPU
        "flashinfer": flashinfer_base / ".cache" / "flashinfer",
        "cuda_ptx": Path(os.environ.get("CUDA_CACHE_PATH", home / ".nv" / "ComputeCache")),
    }


def pack(
    out: Path,
    part_mib: int = DEFAULT_PART_MIB,
    max_mib: int = DEFAULT_MAX_MIB,
    only: list[str] | None = None,
    newer_than: Path | None = None,
) -> int:
    """Write the caches that exist (``only``: those named; ``newer_than``: their files
    modified after that file was) as a gzipped tar in parts of ``part_mib`` MiB plus a
    manifest into ``out``; return the number of parts. Raises ``SystemExit`` when the archive
    is larger than ``max_mib`` (it could not be carried back): then pack what each device
    call added, ``newer_than`` a file touched at its start, and unpack every archive.

    Files with equal contents are stored once: every KV-cache dtype's engine compiles its
    own copy of the same model graphs under its own vLLM cache key."""
    roots = cache_dirs()
    unknown = sorted(set(only or ()) - set(roots))
    if unknown:
        raise SystemExit(
            f"gpu_caches: unknown cache {', '.join(unknown)}; known: {', '.join(roots)}"
        )
    since = newer_than.stat().st_mtime if newer_than else None
    index: list[list[object]] = []
    blobs: dict[str, bytes] = {}  # each distinct content, read once
    packed: dict[str, int] = {}
    for name, root in roots.items():
        if (only and name not in only) or not root.is_dir():
            continue
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and (since is None or p.stat().st_mtime > since)
        )
        size = 0
        for path in files:
            data = path.read_bytes()
            digest = _sha256(data)
            blobs.setdefault(digest, data)
            st = path.stat()
            index.append(
                [name, str(path.relative_to(root)), digest, st.st_mode & 0o777, st.st_mtime_ns]
            )
            size += len(data)
        packed[name] = len(files)
        print(f"gpu_caches: {name}: {len(files)} files, {size / 2**20:.1f} MiB from {root}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        _add_bytes(tar, INDEX, json.dumps(index).encode())
        for digest, blob in blobs.items():
            _add_bytes(tar, f"blobs/{digest}", blob)
    data = buf.getvalue()
    size_mib = len(data) / 2**20
    print(f"gpu_caches: {len(index)} files, {len(blobs)} distinct, {size_mib:.1f} MiB packed")
    if size_mib > max_mib:
        raise SystemExit(
            f"gpu_caches: the archive is {size_mib:.1f} MiB, more than the {max_mib} MiB a "
            f"device call carries; nothing written (--only packs fewer caches)"
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
    on a missing, changed or extra part, or an entry outside the caches (nothing is written
    then)."""
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
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        contents: dict[str, bytes] = {}
        for member in tar.getmembers():
            extracted = tar.extractfile(member)
            if extracted is None:
                raise SystemExit(f"gpu_caches: unexpected entry {member.name!r} in the archive")
            contents[member.name] = extracted.read()
    if INDEX not in contents:
        raise SystemExit(f"gpu_caches: no {INDEX} in the archive (not made by this tool)")
    index = json.loads(contents.pop(INDEX))
    roots = cache_dirs()
    targets: list[tuple[Path, bytes, int, int]] = []
    for name, rel, digest, mode, mtime_ns in index:
        rel_path = Path(rel)
        if name not in roots or rel_path.is_absolute() or ".." in rel_path.parts:
            raise SystemExit(f"gpu_caches: unexpected entry {name}/{rel} in the archive")
        if f"blobs/{digest}" not in contents:
            raise SystemExit(f"gpu_caches: the archive lacks the contents of {name}/{rel}")
        blob = contents[f"blobs/{digest}"]
        targets.append((roots[name] / rel_path, blob, int(mode), int(mtime_ns)))
    for path, blob, mode, mtime_ns in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
        path.chmod(mode)
        os.utime(path, ns=(mtime_ns, mtime_ns))
    print(f"gpu_caches: {len(targets)} files into {', '.join(str(p) for p in roots.values())}")
    return len(targets)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="archive this machine's compile caches into parts")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=int, default=DEFAULT_PART_MIB)
    p.add_argument("--max-mib", type=int, default=DEFAULT_MAX_MIB)
    p.add_argument(
        "--newer-than", type=Path, help="only files modified after this file was (see pack())"
    )
    p.add_argument(
        "--only",
        default="",
        help="comma list of caches to pack (default all: " + ", ".join(cache_dirs()) + ")",
    )
    u = sub.add_parser("unpack", help="check and extract parts made by pack")
    u.add_argument("src", type=Path, nargs="+", help="folders made by pack, in order")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        pack(args.out, args.part_mib, args.max_mib, only or None, args.newer_than)
    else:
        for src in args.src:
            unpack(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
