"""tools/gpu_caches.py: the compile caches packed into parts and unpacked on another machine."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def caches(
    load_tool: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ModuleType:
    """The tool with its cache directories under ``tmp_path/machine``."""
    machine = tmp_path / "machine"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(machine / "vllm"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(machine / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(machine / "inductor"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(machine / "home"))
    monkeypatch.setenv("CUDA_CACHE_PATH", str(machine / "nv"))
    return load_tool("gpu_caches")


def _fill(tool: ModuleType) -> dict[Path, bytes]:
    dirs = tool.cache_dirs()
    files = {
        dirs["vllm_compile"] / "abc123" / "rank_0_0" / "backbone" / "artifact": os.urandom(3000),
        dirs["triton"] / "K7" / "decode_v6_kernel.cubin": os.urandom(70_000),
        dirs["inductor"] / "fxgraph" / "x" / "entry": b"graph",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _wipe(files: dict[Path, bytes]) -> None:
    for path in files:
        path.unlink()


def test_pack_then_unpack_restores_every_file(caches: ModuleType, tmp_path: Path) -> None:
    files = _fill(caches)
    out = tmp_path / "out"
    # parts of 1 MiB: the random cubin does not compress, so there is more than one part
    # only if the archive is larger than that; here one, with its checksum in the manifest
    assert caches.pack(out, part_mib=1) == 1
    manifest = json.loads((out / caches.MANIFEST).read_text())
    assert manifest["files"] == {"vllm_compile": 1, "triton": 1, "inductor": 1}
    stamps = {path: path.stat().st_mtime_ns - 10**12 for path in files}  # 1,000 s earlier
    for path, ns in stamps.items():
        os.utime(path, ns=(ns, ns))
    caches.pack(out, part_mib=1)
    _wipe(files)
    assert caches.unpack(out) == 3
    for path, data in files.items():
        assert path.read_bytes() == data
        # kept: FlashInfer's ninja rebuilds an output newer than its deps log says
        assert path.stat().st_mtime_ns == stamps[path]


def test_pack_splits_into_parts_and_refuses_an_archive_too_large(
    caches: ModuleType, tmp_path: Path
) -> None:
    dirs = caches.cache_dirs()
    big = dirs["triton"] / "big.bin"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(2_500_000))  # incompressible: ~2.4 MiB archived
    assert caches.pack(tmp_path / "three", part_mib=1) == 3
    with pytest.raises(SystemExit, match=r"more than the 2 MiB a device call carries"):
        caches.pack(tmp_path / "none", part_mib=1, max_mib=2)
    assert not (tmp_path / "none").exists()  # nothing written
    big.unlink()
    assert caches.unpack(tmp_path / "three") == 1
    assert len(big.read_bytes()) == 2_500_000


@pytest.mark.parametrize("damage", ["missing", "changed", "extra"])
def test_unpack_refuses_damaged_parts_and_writes_nothing(
    caches: ModuleType, tmp_path: Path, damage: str
) -> None:
    files = _fill(caches)
    out = tmp_path / "out"
    caches.pack(out)
    _wipe(files)
    part = out / f"{caches.PART_PREFIX}00"
    if damage == "missing":
        part.unlink()
    elif damage == "changed":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte
        part.write_bytes(bytes(data))
    else:
        (out / f"{caches.PART_PREFIX}07").write_bytes(b"stray")
    message = {"missing": "is missing", "changed": "does not match", "extra": "not in the manifest"}
    with pytest.raises(SystemExit, match=message[damage]):
        caches.unpack(out)
    assert not any(path.exists() for path in files)


def test_unpack_needs_a_manifest(caches: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no manifest\.json"):
        caches.unpack(tmp_path)


def test_equal_files_are_stored_once_and_only_selects_caches(
    caches: ModuleType, tmp_path: Path
) -> None:
    """Every dtype's engine writes its own copy of the same compiled graphs: those go into the
    archive once and come back at every path. ``only`` packs the named caches alone."""
    dirs = caches.cache_dirs()
    artifact = os.urandom(400_000)  # incompressible: two stored copies would show in the size
    copies = [dirs["vllm_compile"] / key / "rank_0_0" / "artifact" for key in ("fp16", "kvarn")]
    for path in copies:
        path.parent.mkdir(parents=True)
        path.write_bytes(artifact)
    (dirs["triton"]).mkdir(parents=True)
    (dirs["triton"] / "k.cubin").write_bytes(b"cubin")
    caches.pack(tmp_path / "all")
    assert (tmp_path / "all" / f"{caches.PART_PREFIX}00").stat().st_size < 500_000
    caches.pack(tmp_path / "triton", only=["triton"])
    manifest = json.loads((tmp_path / "triton" / caches.MANIFEST).read_text())
    assert manifest["files"] == {"triton": 1}
    with pytest.raises(SystemExit, match="unknown cache nvcc"):
        caches.pack(tmp_path / "bad", only=["nvcc"])
    for path in copies:
        path.unlink()
    assert caches.unpack(tmp_path / "all") == 3
    assert all(path.read_bytes() == artifact for path in copies)


@pytest.mark.parametrize("craft", ["escape", "no_index"])
def test_unpack_refuses_a_crafted_archive(caches: ModuleType, tmp_path: Path, craft: str) -> None:
    """An index that points out of a cache directory, or none at all (a tar not made by
    pack), is refused with a message; nothing is written."""
    _fill(caches)
    src = tmp_path / "crafted"
    caches.pack(src)
    data = b"".join(p.read_bytes() for p in sorted(src.glob(f"{caches.PART_PREFIX}*")))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    if craft == "escape":
        index = json.loads(members[caches.INDEX])
        index[0][1] = "../../escaped"
        members[caches.INDEX] = json.dumps(index).encode()
    else:
        del members[caches.INDEX]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    archive = buf.getvalue()
    for old in src.glob(f"{caches.PART_PREFIX}*"):
        old.unlink()
    (src / f"{caches.PART_PREFIX}00").write_bytes(archive)
    digest = hashlib.sha256(archive).hexdigest()
    part = {"name": f"{caches.PART_PREFIX}00", "bytes": len(archive), "sha256": digest}
    (src / caches.MANIFEST).write_text(json.dumps({"parts": [part], "files": {}, "sha256": digest}))
    message = "unexpected entry" if craft == "escape" else "no index.json in the archive"
    with pytest.raises(SystemExit, match=message):
        caches.unpack(src)
    assert not (tmp_path / "machine" / "escaped").exists()
