"""The ``kvarn-ckpt`` CLI through ``main(argv)``, plus one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvarn_ckpt.cli import main
from kvarn_format.sizing import plan


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_text_report(kit: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    p = kit.exl3_dense(bits=3).write()
    code, out, _ = _run(capsys, "inspect", str(p), "--kv-cache-dtype", "kvarn_k4v2_g128")
    assert code == 0
    assert "architecture: Qwen3ForCausalLM" in out
    assert "weights: exl3, declared bits 3.0, codebook mcg; 14 EXL3 linears at 3.0 bits" in out
    assert "resolved kvarn_k4v2_g128 (source: user)" in out
    # 108 B/token/KV head (a 13,824 B tile over 128 tokens), 2 KV heads, 2 layers
    assert "kv bytes/token: 432 (432 per rank) vs fp16 2048" in out
    assert "problems: none" in out


def test_inspect_json_mla_declared_with_capacity(
    kit: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    p = kit.tr3_mla().write()
    assert _run(capsys, "annotate", str(p), "--kv-cache-dtype", "kvarn_mla_k4_g64")[0] == 0
    code, out, _ = _run(
        capsys, "inspect", str(p), "--json", "--gpu", "h200", "--max-model-len", "2048"
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["architecture"]["kind"] == "mla"
    assert doc["weight_format"]["kind"] == "exl3-tr3"
    assert doc["kv_format"] == {
        "declared": "kvarn_mla_k4_g64",
        "resolved": "kvarn_mla_k4_g64",
        "source": "declared",
        "user": None,
        "heuristic": None,
    }
    kv = doc["kv_bytes"]
    assert (kv["tile_bytes"], kv["group"]) == (26752, 64)  # 418 B/token
    assert kv["bytes_per_token"] == 418 * 3 and kv["fp16_bytes_per_token"] == 1152 * 3
    assert doc["exl3"]["tr3"]["found_tensors"] == doc["exl3"]["tr3"]["expected_tensors"]
    assert doc["errors"] == 0
    assert [x["code"] for x in doc["problems"]] == ["tr3.tp_mismatch", "resolve.declared"]
    cap = doc["capacity"]
    stored = doc["weights"]["stored_bytes"]
    from kvarn_format.catalog import model_from_config

    cfg = json.loads((p / "config.json").read_text())
    want = plan(
        model_from_config(cfg, p.name),
        "kvarn_mla_k4_g64",
        gpu="h200",
        max_model_len=2048,
        weight_bytes=stored,
    )
    assert cap["kv_tokens"] == want.kv_tokens > 0
    assert cap["block_size"] == 64


def test_inspect_exits_non_zero_on_errors(
    kit: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    c = kit.exl3_dense()
    c.drop("model.layers.0.mlp.up_proj.suh")
    code, out, _ = _run(capsys, "inspect", str(c.write()))
    assert code == 1
    assert "error: exl3.missing_tensor" in out


def test_resolve_and_annotate(kit: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    p = kit.bf16_dense(name="tiny-KVarN-K4V2").write()
    code, out, err = _run(capsys, "resolve", str(p))
    assert (code, out.strip()) == (0, "none")
    assert "suggests kvarn_k4v2_g128" in err
    code, out, _ = _run(capsys, "resolve", str(p), "--accept-name-heuristic")
    assert (code, out.strip()) == (0, "kvarn_k4v2_g128")
    code, out, _ = _run(capsys, "annotate", str(p), "--kv-cache-dtype", "kvarn_k4v2_g64")
    assert code == 0 and "declared kv_cache_quant kvarn_k4v2_g64" in out
    assert json.loads((p / "config.json").read_text())["kv_cache_quant"]["producer"].startswith(
        "kvarn-ckpt "
    )
    code, out, _ = _run(capsys, "resolve", str(p), "--json")
    assert code == 0 and json.loads(out)["source"] == "declared"
    code, out, err = _run(capsys, "resolve", str(p), "--kv-cache-dtype", "kvarn_mla_k4_g64")
    assert (code, out.strip()) == (1, "none") and "is an MLA format" in err


def test_annotate_refusal_exit_code(
    kit: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    p = kit.bf16_mla().write()
    code, _, err = _run(capsys, "annotate", str(p), "--kv-cache-dtype", "kvarn_k4v2_g128")
    assert code == 1 and "refusing to annotate kvarn_k4v2_g128" in err
    code, _, err = _run(
        capsys, "annotate", str(p), "--kv-cache-dtype", "kvarn_mla_k4_g64", "--block-size", "128"
    )
    assert code == 1 and "block size 128" in err


def test_missing_directory(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "inspect", "/nonexistent/ckpt")
    assert code == 1 and "is not a directory" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["inspect"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["inspect", ".", "--tp", "0"])
    assert e.value.code == 2


def test_subprocess_json_and_no_torch_import(kit: SimpleNamespace) -> None:
    """The console entry point in a fresh interpreter: JSON out, and neither torch nor vLLM
    gets imported by kvarn_ckpt."""
    p = kit.bf16_mla().write()
    code = (
        "import sys, runpy; sys.argv = ['kvarn-ckpt', 'inspect', sys.argv[1], '--json', "
        "'--kv-cache-dtype', 'kvarn_mla_k2_g64'];\n"
        "try:\n    runpy.run_module('kvarn_ckpt.cli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'\n"
        "    raise\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(p)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kv_format"]["resolved"] == "kvarn_mla_k2_g64"
    assert doc["kv_bytes"]["tile_bytes"] == 18560  # 290 B/token
