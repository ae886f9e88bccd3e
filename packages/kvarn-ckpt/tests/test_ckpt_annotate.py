"""``annotate``: validated, byte-preserving, atomic writes of the KV declaration."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvarn_ckpt import CheckpointError, annotate, resolve_kv_format
from kvarn_ckpt.annotate import edit_member


def _pure_insertion(old: str, new: str) -> str:
    """The text inserted into ``old`` to give ``new``; fails if anything else changed."""
    p = 0
    while p < len(old) and old[p] == new[p]:
        p += 1
    q = 0
    while q < len(old) - p and old[-1 - q] == new[-1 - q]:
        q += 1
    assert p + q == len(old), "bytes outside the inserted member changed"
    return new[p : len(new) - q]


ODD_CONFIG = (
    '{\n    "architectures": ["Qwen3ForCausalLM"],\n    "rms_norm_eps": 1e-06,\n'
    '    "rope_theta": 1.0E+6,\n    "hidden_size": 256, "num_hidden_layers": 2,\n'
    '    "num_attention_heads": 4,\n    "num_key_value_heads": 2,\n    "head_dim": 128,\n'
    '    "name": "caf\\u00e9 \\"quoted\\" {not a brace}",\n'
    '    "nested": {"a": [1, 2, {"b": "}"}]}\n}\n'
)


def test_insert_keeps_every_other_byte(kit: SimpleNamespace) -> None:
    root = kit.tmp / "odd"
    root.mkdir()
    (root / "config.json").write_text(ODD_CONFIG)
    res = annotate(root, "kvarn_k4v2_g128", producer="kvarn-ckpt test")
    new = (root / "config.json").read_text()
    assert res.changed and res.previous is None and new == res.new_text
    inserted = _pure_insertion(ODD_CONFIG, new)
    assert inserted.startswith(',\n    "kv_cache_quant": {\n        "format_version": 1,')
    doc = json.loads(new)
    assert doc["kv_cache_quant"] == {
        "format_version": 1,
        "method": "kvarn",
        "dtype": "kvarn_k4v2_g128",
        "block_size": 128,
        "producer": "kvarn-ckpt test",
    }
    assert list(doc)[-1] == "kv_cache_quant"
    assert resolve_kv_format(root).dtype == "kvarn_k4v2_g128"


def test_replace_changes_only_the_member_value(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    annotate(p, "kvarn_k4v2_g128")
    before = (p / "config.json").read_text()
    with pytest.raises(CheckpointError, match="--replace"):
        annotate(p, "kvarn_k4v4_g64")
    assert (p / "config.json").read_text() == before
    res = annotate(p, "kvarn_k4v4_g64", replace=True)
    after = (p / "config.json").read_text()
    assert res.previous == "kvarn_k4v2_g128"
    old_member = json.dumps(json.loads(before)["kv_cache_quant"], indent=2).replace("\n", "\n  ")
    new_member = json.dumps(json.loads(after)["kv_cache_quant"], indent=2).replace("\n", "\n  ")
    assert after == before.replace(old_member, new_member)
    assert json.loads(after)["kv_cache_quant"]["block_size"] == 64


def test_same_declaration_is_a_no_op(kit: SimpleNamespace) -> None:
    p = kit.bf16_mla().write()
    annotate(p, "kvarn_mla_k4_g64")
    st = (p / "config.json").stat()
    res = annotate(p, "kvarn_mla_k4_g64")
    assert not res.changed and res.previous == "kvarn_mla_k4_g64"
    assert (p / "config.json").stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize(
    ("builder", "dtype", "kw", "needle"),
    [
        ("bf16_dense", "kvarn_k3v2_g128", {}, "Unknown KVarN cache dtype 'kvarn_k3v2_g128'"),
        ("bf16_dense", "kvarn_mla_k4_g64", {}, "is an MLA format"),
        ("bf16_mla", "kvarn_k4v2_g128", {}, "is a dense format"),
        ("bf16_dense", "kvarn_k4v2_g128", {"block_size": 64}, "block size 64"),
        ("bf16_dense", "kvarn_k4v2_g128", {"tensor_parallel_size": 3}, "tensor_parallel_size=3"),
    ],
    ids=["unknown-dtype", "mla-on-dense", "dense-on-mla", "block-size", "tp"],
)
def test_refusals_leave_the_file_untouched(
    kit: SimpleNamespace, builder: str, dtype: str, kw: dict[str, int], needle: str
) -> None:
    p = getattr(kit, builder)().write()
    before = (p / "config.json").read_bytes()
    with pytest.raises(CheckpointError, match=needle):
        annotate(p, dtype, **kw)  # type: ignore[arg-type]
    assert (p / "config.json").read_bytes() == before
    assert sorted(os.listdir(p)) == sorted(x.name for x in p.iterdir())
    assert not [x for x in os.listdir(p) if x.endswith(".tmp")]


def test_refuses_a_conflicting_text_config_copy(kit: SimpleNamespace) -> None:
    c = kit.bf16_dense()
    c.config["text_config"] = {
        "kv_cache_quant": {
            "format_version": 1,
            "method": "kvarn",
            "dtype": "kvarn_k4v4_g128",
            "block_size": 128,
        }
    }
    p = c.write()
    with pytest.raises(CheckpointError, match="text_config also declares"):
        annotate(p, "kvarn_k4v2_g128")


def test_dry_run_writes_nothing(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    before = (p / "config.json").read_bytes()
    res = annotate(p, "kvarn_k4v2_g64", dry_run=True)
    assert res.changed and json.loads(res.new_text)["kv_cache_quant"]["dtype"] == "kvarn_k4v2_g64"
    assert (p / "config.json").read_bytes() == before


def test_atomic_write_keeps_mode_and_leaves_no_temp_files(kit: SimpleNamespace) -> None:
    p = kit.bf16_dense().write()
    cfg = p / "config.json"
    os.chmod(cfg, 0o640)
    annotate(p, "kvarn_k4v2_g128")
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o640
    assert not [x for x in os.listdir(p) if x.startswith(".config.json.")]


@pytest.mark.parametrize(
    ("text", "inserted"),
    [
        ('{"a": 1, "b": [1, 2]}', ', "kv_cache_quant": {"x": 1}'),
        ('{\n\t"a": 1\n}\n', ',\n\t"kv_cache_quant": {\n\t\t"x": 1\n\t}'),
        ('{\n  "a": {"k": "v"}\n}', ',\n  "kv_cache_quant": {\n    "x": 1\n  }'),
        ("{}", '"kv_cache_quant": {"x": 1}'),
        ("  {  }  ", '"kv_cache_quant": {"x": 1}'),
    ],
    ids=["one-line", "tabs", "two-spaces", "empty", "empty-spaced"],
)
def test_edit_member_styles(text: str, inserted: str) -> None:
    new = edit_member(text, "kv_cache_quant", {"x": 1})
    assert _pure_insertion(text, new) == inserted
    assert json.loads(new)["kv_cache_quant"] == {"x": 1}


def test_edit_member_refuses_duplicate_keys() -> None:
    with pytest.raises(ValueError, match="2 top-level"):
        edit_member('{"kv_cache_quant": 1, "kv_cache_quant": 2}', "kv_cache_quant", {})


def test_no_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        annotate(tmp_path, "kvarn_k4v2_g128")
