"""Lazy safetensors header parsing: the 8-byte length and the JSON header, never the payload.

A safetensors file is ``u64 little-endian header length N``, ``N bytes of JSON`` (padded with
spaces), then the raw tensor bytes; each header entry gives ``dtype``, ``shape`` and
``data_offsets`` relative to the end of the header. Validating a 350 GB checkpoint must not
read 350 GB, so this module reads ``8 + N`` bytes per shard and checks everything it can from
the header and the file size alone: offsets inside the file, sizes that match shape and dtype,
no overlapping tensors. A header length larger than the file or above the format's 100 MB cap
is reported as truncation or corruption before anything is allocated.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvarn_ckpt.problems import SafetensorsHeaderError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "read_header",
    "read_tensor_bytes",
]

#: The safetensors format caps the JSON header at 100 MB (``safetensors`` rejects larger ones
#: with ``HeaderTooLarge``); a length above this is corruption, not a big model.
MAX_HEADER_BYTES = 100_000_000

#: Bits per element of every dtype string the safetensors format defines (0.4 to 0.8).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte
    file: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """The parsed header of one safetensors file."""

    path: Path
    header_bytes: int
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    #: Payload bytes after the last tensor; the format leaves none, so they are reported.
    trailing_bytes: int = 0


def _fail(path: Path, what: str) -> SafetensorsHeaderError:
    return SafetensorsHeaderError(f"{path}: {what}")


def read_header(
    path: str | os.PathLike[str], *, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Parse the header of ``path`` without reading tensor data.

    Raises :class:`SafetensorsHeaderError` for: a file shorter than 8 bytes; a header length
    above ``max_header_bytes`` or past the end of the file (truncated download); a header
    that is not a UTF-8 JSON object; an entry with an unknown dtype, a bad shape, offsets
    outside the payload, a byte size that does not match shape and dtype, or tensors that
    overlap.
    """
    p = Path(path)
    try:
        file_size = p.stat().st_size
    except OSError as e:
        raise _fail(p, f"cannot stat: {e.strerror or e}") from e
    if file_size < 8:
        raise _fail(p, f"{file_size} bytes is too short for a safetensors file (needs 8+)")
    with p.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > max_header_bytes:
            raise _fail(
                p,
                f"header length {n} exceeds the {max_header_bytes}-byte cap: the file is "
                "corrupt or not a safetensors file",
            )
        if 8 + n > file_size:
            raise _fail(
                p,
                f"header length {n} runs past the end of the {file_size}-byte file: the file "
                "is truncated (re-download it)",
            )
        raw = f.read(n)
    if len(raw) != n:
        raise _fail(p, f"short read of the header ({len(raw)} of {n} bytes)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(p, f"header is not valid UTF-8 JSON: {e}") from e
    if not isinstance(doc, dict):
        raise _fail(p, f"header is a JSON {type(doc).__name__}, not an object")

    data_start = 8 + n
    payload = file_size - data_start
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise _fail(p, "__metadata__ must map strings to strings")
            metadata = dict(entry)
            continue
        tensors[name] = _parse_entry(p, name, entry, data_start, payload)

    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    prev_end = data_start
    prev_name = None
    for t in ordered:
        if t.begin < prev_end and t.nbytes > 0:
            raise _fail(p, f"tensors {prev_name!r} and {t.name!r} overlap in the payload")
        if t.nbytes > 0:
            prev_end, prev_name = t.end, t.name
    last = max((t.end for t in ordered), default=data_start)
    return SafetensorsHeader(p, n, file_size, tensors, metadata, file_size - last)


def _parse_entry(p: Path, name: str, entry: object, data_start: int, payload: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(p, f"entry {name!r} is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail(p, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(p, f"tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _fail(p, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    lo, hi = offsets
    if not 0 <= lo <= hi:
        raise _fail(p, f"tensor {name!r} has data_offsets {offsets} with begin > end")
    if hi > payload:
        raise _fail(
            p,
            f"tensor {name!r} ends at payload byte {hi} but the file holds only {payload} "
            "payload bytes: the file is truncated (re-download it)",
        )
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != hi - lo:
        raise _fail(
            p,
            f"tensor {name!r} is {dtype}{shape} = {bits / 8:g} bytes but its data_offsets "
            f"span {hi - lo} bytes",
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + lo, data_start + hi, p)


def read_tensor_bytes(info: TensorInfo, *, max_bytes: int = 1 << 20) -> bytes:
    """Read the raw bytes of one small tensor (a codebook marker, a sign vector).

    Refuses tensors above ``max_bytes`` so that validation can never turn into reading whole
    shards by accident.
    """
    if info.nbytes > max_bytes:
        raise ValueError(
            f"{info.name} is {info.nbytes} bytes; read_tensor_bytes reads at most {max_bytes}"
        )
    with info.file.open("rb") as f:
        f.seek(info.begin)
        data = f.read(info.nbytes)
    if len(data) != info.nbytes:
        raise SafetensorsHeaderError(f"{info.file}: short read of {info.name}: file truncated")
    return data
