"""Header-only safetensors parsing: exact results on good files, exact refusals on bad ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvarn_ckpt import SafetensorsHeaderError, read_header
from kvarn_ckpt.safetensors_header import MAX_HEADER_BYTES, read_tensor_bytes


def _raw(path: Path, header: dict[str, Any], payload: bytes, *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + payload)
    return path


def test_parses_names_shapes_and_absolute_offsets(kit: SimpleNamespace) -> None:
    p = kit.tmp / "a.safetensors"
    kit.write_safetensors(
        p,
        {
            "w": ("BF16", [4, 8], None),
            "t": ("I16", [2, 3, 64], None),
            "m": ("I32", [], b"\1\0\0\0"),
        },
        metadata={"format": "pt"},
    )
    h = read_header(p)
    assert set(h.tensors) == {"w", "t", "m"}
    assert h.metadata == {"format": "pt"}
    start = 8 + h.header_bytes
    assert (h.tensors["w"].dtype, h.tensors["w"].shape) == ("BF16", (4, 8))
    assert (h.tensors["w"].begin, h.tensors["w"].end) == (start, start + 64)
    assert h.tensors["t"].nbytes == 2 * 3 * 64 * 2
    assert h.tensors["m"].shape == () and h.tensors["m"].numel == 1
    assert read_tensor_bytes(h.tensors["m"]) == b"\1\0\0\0"
    assert h.trailing_bytes == 0


def test_reads_only_the_header(kit: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MiB payload is never read: exactly 8 + N bytes are."""
    p = kit.tmp / "big.safetensors"
    header = {"big": {"dtype": "F32", "shape": [4096, 4096], "data_offsets": [0, 4096 * 4096 * 4]}}
    raw = json.dumps(header).encode()
    with p.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4096 * 4096 * 4)  # sparse file
    read_sizes: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *a: Any, **k: Any) -> Any:
        f = real_open(self, *a, **k)
        real_read = f.read

        def read(n: int = -1) -> bytes:
            data: bytes = real_read(n)
            read_sizes.append(len(data))
            return data

        f.read = read
        return f

    monkeypatch.setattr(Path, "open", counting_open)
    h = read_header(p)
    assert h.tensors["big"].nbytes == 4096 * 4096 * 4
    assert sum(read_sizes) == 8 + len(raw)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.write_bytes(b"\x01\x02\x03"), "too short"),
        (lambda p: _raw(p, {}, b"", length=2**63), "exceeds"),
        (lambda p: _raw(p, {}, b"", length=MAX_HEADER_BYTES + 1), "exceeds"),
        (lambda p: _raw(p, {"x": 1}, b"", length=500), "truncated"),
        (lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{nope"), "not valid UTF-8 JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "not an object"),
        (
            lambda p: _raw(
                p, {"w": {"dtype": "F17", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"
            ),
            "unknown dtype",
        ),
        (
            lambda p: _raw(
                p, {"w": {"dtype": "F16", "shape": [-1], "data_offsets": [0, 2]}}, b"\0\0"
            ),
            "invalid shape",
        ),
        (
            lambda p: _raw(
                p, {"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 4
            ),
            "truncated",
        ),
        (
            lambda p: _raw(
                p, {"w": {"dtype": "F16", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8
            ),
            "span 8 bytes",
        ),
        (
            lambda p: _raw(
                p, {"w": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}}, b"\0" * 8
            ),
            "begin > end",
        ),
        (
            lambda p: _raw(
                p,
                {
                    "a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]},
                    "b": {"dtype": "F16", "shape": [4], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "overlap",
        ),
    ],
    ids=[
        "short",
        "absurd-length",
        "over-cap",
        "header-past-eof",
        "bad-json",
        "not-object",
        "bad-dtype",
        "bad-shape",
        "payload-truncated",
        "size-mismatch",
        "reversed",
        "overlap",
    ],
)
def test_refuses_corrupt_files(kit: SimpleNamespace, make: Any, needle: str) -> None:
    p = kit.tmp / "bad.safetensors"
    make(p)
    with pytest.raises(SafetensorsHeaderError, match=needle):
        read_header(p)


def test_read_tensor_bytes_refuses_large_tensors(kit: SimpleNamespace) -> None:
    p = kit.tmp / "a.safetensors"
    kit.write_safetensors(p, {"w": ("F32", [1024], None)})
    with pytest.raises(ValueError, match="at most 16"):
        read_tensor_bytes(read_header(p).tensors["w"], max_bytes=16)
