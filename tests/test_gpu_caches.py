"""tools/gpu_caches.py: the compile caches packed into parts and unpacked on another machine."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def caches(
    load_tool: Callable[[str], ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ModuleType:
    """The tool with its three cache directories under ``tmp_path/machine``."""
    machine = tmp_path / "machine"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(machine / "vllm"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(machine / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(machine / "inductor"))
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
    _wipe(files)
    assert caches.unpack(out) == 3
    for path, data in files.items():
        assert path.read_bytes() == data


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
