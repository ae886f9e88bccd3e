"""``kvarn-ckpt annotate``: write the KV declaration into config.json, safely.

Safety properties:

* **Validated first.** The dtype must be in the kvarn-format registry and fit the model's
  attention geometry (MLA vs dense, latent rank, head dim, heads vs TP); a ``block_size``
  given must equal the dtype's tile. A different existing declaration is only replaced with
  ``replace=True``.
* **Everything else byte for byte.** The file is edited as text: only the span of the
  ``kv_cache_quant`` member is inserted or replaced, in the file's own indentation style, so
  every other byte (key order, number spelling, whitespace, trailing newline) is unchanged.
  The result is parsed back and compared with the intended JSON before anything is written.
* **Atomic.** The new text goes to a temporary file in the same directory, is fsynced and
  then ``os.replace``d over config.json (keeping its permission bits), so a crash leaves
  either the old or the new file, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvarn_ckpt.checkpoint import load_json_object
from kvarn_ckpt.declaration import DECLARATION_KEY, build_declaration
from kvarn_ckpt.model_config import read_geometry
from kvarn_ckpt.problems import CheckpointError, ProblemList
from kvarn_ckpt.resolve import geometry_conflicts
from kvarn_format import CacheDTypeError, parse_cache_dtype

__all__ = ["AnnotateResult", "annotate", "edit_member"]


@dataclass(frozen=True, slots=True)
class AnnotateResult:
    path: Path
    dtype: str
    previous: str | None
    changed: bool
    new_text: str


# --------------------------------------------------------------------------- JSON text edit


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(s: str, i: int) -> int:
    """Index one past the closing quote of the string starting at ``s[i] == '"'``."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    raise ValueError("unterminated string")


def _scan_value(s: str, i: int) -> int:
    """Index one past the JSON value starting at ``i``."""
    if s[i] == '"':
        return _scan_string(s, i)
    if s[i] in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                i = _scan_string(s, i)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise ValueError("unterminated object or array")
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j


@dataclass(frozen=True, slots=True)
class _Member:
    key: str
    key_start: int
    value_start: int
    value_end: int


def _top_members(s: str) -> tuple[int, int, list[_Member]]:
    """(index of '{', index of the closing '}', members) of the top-level object."""
    i = _skip_ws(s, 0)
    if i >= len(s) or s[i] != "{":
        raise ValueError("config.json does not hold a JSON object")
    open_at = i
    i = _skip_ws(s, i + 1)
    members: list[_Member] = []
    if s[i] == "}":
        return open_at, i, members
    while True:
        if s[i] != '"':
            raise ValueError(f"expected a key at offset {i}")
        k_end = _scan_string(s, i)
        key = json.loads(s[i:k_end])
        j = _skip_ws(s, k_end)
        if s[j] != ":":
            raise ValueError(f"expected ':' at offset {j}")
        v_start = _skip_ws(s, j + 1)
        v_end = _scan_value(s, v_start)
        members.append(_Member(key, i, v_start, v_end))
        j = _skip_ws(s, v_end)
        if s[j] == ",":
            i = _skip_ws(s, j + 1)
            continue
        if s[j] == "}":
            return open_at, j, members
        raise ValueError(f"expected ',' or '}}' at offset {j}")


def _indent_of(s: str, open_at: int, members: list[_Member]) -> str | None:
    """The member indentation of the top-level object (``None``: single-line JSON)."""
    if not members:
        return None
    gap = s[open_at + 1 : members[0].key_start]
    if "\n" not in gap:
        return None
    return gap.rsplit("\n", 1)[1]


def _render(value: Any, indent: str | None) -> str:
    if indent is None:
        return json.dumps(value, separators=(", ", ": "))
    unit = indent if indent else "  "
    if set(unit) == {" "}:
        text = json.dumps(value, indent=len(unit))
    else:
        text = json.dumps(value, indent=unit)
    return text.replace("\n", "\n" + indent)


def edit_member(text: str, key: str, value: Any) -> str:
    """Set top-level ``key`` to ``value`` in the JSON ``text``, changing no other byte."""
    open_at, _close_at, members = _top_members(text)
    dupes = [m for m in members if m.key == key]
    if len(dupes) > 1:
        raise ValueError(f"config.json has {len(dupes)} top-level {key!r} keys")
    indent = _indent_of(text, open_at, members)
    rendered = _render(value, indent)
    if dupes:
        m = dupes[0]
        return text[: m.value_start] + rendered + text[m.value_end :]
    member = json.dumps(key) + ": " + rendered
    if not members:
        return text[: open_at + 1] + member + text[open_at + 1 :]
    last = members[-1]
    sep = ", " if indent is None else ",\n" + indent
    return text[: last.value_end] + sep + member + text[last.value_end :]


# --------------------------------------------------------------------------- annotate


def _atomic_write(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def annotate(
    path: str | os.PathLike[str],
    kv_cache_dtype: str,
    *,
    block_size: int | None = None,
    tensor_parallel_size: int = 1,
    replace: bool = False,
    dry_run: bool = False,
    producer: str | None = None,
) -> AnnotateResult:
    """Declare ``kv_cache_dtype`` in ``path/config.json``. Raises :class:`CheckpointError`
    (with a message saying what to change) instead of writing anything doubtful."""
    root = Path(path)
    cfg_path = root / "config.json" if root.is_dir() else root
    if cfg_path.name != "config.json" or not cfg_path.is_file():
        raise CheckpointError(f"no config.json at {root}")
    config = load_json_object(cfg_path)
    text = cfg_path.read_text(encoding="utf-8")

    try:
        fmt = parse_cache_dtype(kv_cache_dtype)
    except CacheDTypeError as e:
        raise CheckpointError(f"refusing to annotate: {e}") from e
    if block_size is not None and block_size != fmt.block_size:
        raise CheckpointError(
            f"refusing to annotate: block size {block_size} does not match {fmt.name}, whose "
            f"tile (= vLLM block) is {fmt.block_size} tokens"
        )
    problems = ProblemList()
    geometry = read_geometry(config, problems)
    if geometry is None:
        problems.raise_if_errors("refusing to annotate: the model geometry is unreadable")
        raise CheckpointError("refusing to annotate: the model geometry is unreadable")
    why = geometry_conflicts(fmt, geometry, tensor_parallel_size)
    if why:
        raise CheckpointError(
            f"refusing to annotate {fmt.name}: it cannot run on this model: {'; '.join(why)}"
        )

    previous: str | None = None
    old = config.get(DECLARATION_KEY)
    if old is not None:
        previous = old.get("dtype") if isinstance(old, dict) else repr(old)
        if previous != fmt.name and not replace:
            raise CheckpointError(
                f"config.json already declares {DECLARATION_KEY} = {json.dumps(old)}; pass "
                "--replace to overwrite it"
            )
    text_cfg = config.get("text_config")
    if isinstance(text_cfg, dict) and DECLARATION_KEY in text_cfg:
        inner = text_cfg[DECLARATION_KEY]
        inner_dtype = inner.get("dtype") if isinstance(inner, dict) else None
        if inner_dtype != fmt.name:
            raise CheckpointError(
                f"config.json:text_config also declares {DECLARATION_KEY} "
                f"({json.dumps(inner)}); remove it first, a checkpoint keeps one declaration"
            )

    decl = build_declaration(fmt.name, producer)
    if isinstance(old, dict) and old == decl:
        return AnnotateResult(cfg_path, fmt.name, previous, False, text)
    try:
        new_text = edit_member(text, DECLARATION_KEY, decl)
    except ValueError as e:
        raise CheckpointError(f"cannot edit {cfg_path} as text: {e}") from e
    expected = dict(config)
    expected[DECLARATION_KEY] = decl
    if json.loads(new_text) != expected:
        raise CheckpointError(
            "internal error: the edited config.json does not parse back to "
            "the intended content; nothing was written"
        )
    if not dry_run:
        _atomic_write(cfg_path, new_text)
    return AnnotateResult(cfg_path, fmt.name, previous, True, new_text)
