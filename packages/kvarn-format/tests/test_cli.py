"""The ``kvarn`` command line: output, the JSON interface, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvarn_format import cli
from kvarn_format.cli import PLAN_ROW_KEYS, main
from kvarn_format.registry import DENSE_DTYPES, MLA_DTYPES

INSPECT_KEYS = {
    "dtype",
    "kind",
    "head_dim",
    "group",
    "tile_bytes",
    "payload_bytes",
    "pad_bytes",
    "slot_rounding",
    "bytes_per_token_per_head",
    "ratio_vs_fp16",
    "bits_per_element",
    "fields",
    "head_dim_defaulted",
}
FIELD_KEYS = {"name", "offset", "size", "dtype", "shape", "bits", "meaning"}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must fail with status 2 and a single line on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_k4v2_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "inspect", "kvarn_k4v2_g128", "--head-dim", "128")
    assert code == 0
    assert "tile: 13,824 B" in out
    assert "108 B vs 512 B fp16 -> 4.74x" in out
    for name in ("k_codes", "k_scale", "v_codes", "v_zero"):
        assert name in out


def test_inspect_mla_k5_g64(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "inspect", "kvarn_mla_k5_g64")
    assert code == 0
    assert "tile: 30,848 B" in out and "482 B" in out


def test_inspect_dense_without_head_dim_says_128(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "inspect", "kvarn_k4v4_g128")
    assert code == 0
    assert "head_dim 128 (default" in out
    assert "tile: 17,920 B" in out


@pytest.mark.parametrize("dtype", [*DENSE_DTYPES, *MLA_DTYPES])
def test_inspect_json_schema(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    code, out, _ = _run(capsys, "inspect", dtype, "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) == INSPECT_KEYS
    assert d["dtype"] == dtype
    assert all(set(f) == FIELD_KEYS for f in d["fields"])
    assert sum(f["size"] for f in d["fields"]) == d["payload_bytes"]


def test_inspect_json_values(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(capsys, "inspect", "kvarn_k4v2_g128", "--head-dim", "128", "--json")
    d = json.loads(out)
    assert (d["tile_bytes"], d["bytes_per_token_per_head"], d["ratio_vs_fp16"]) == (
        13_824,
        108,
        4.7407,
    )
    assert d["head_dim_defaulted"] is False
    _, out, _ = _run(
        capsys,
        "inspect",
        "kvarn_k4v4_g128",
        "--head-dim",
        "256",
        "--slot-rounding",
        "pow2",
        "--json",
    )
    assert json.loads(out)["bytes_per_token_per_head"] == 512


def test_inspect_errors(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "inspect", "kvarn_k3v3_g32")
    assert "Unknown KVarN cache dtype 'kvarn_k3v3_g32'" in err and "kvarn_k4v2_g128" in err
    err = _error(capsys, "inspect", "kvarn_k4v2_g128", "--head-dim", "96")
    assert "head_dim=96" in err
    _usage_error(capsys, "inspect", "kvarn_k4v2_g128", "--head-dim", "zero")
    _usage_error(capsys, "inspect", "kvarn_k4v2_g128", "--slot-rounding", "pow3")


# ---------------------------------------------------------------------------------------------
# plan


def test_plan_default_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan")
    assert code == 0
    assert out.startswith("Qwen3-32B: 64 layers")
    assert "h200: 139.80 GiB" in out
    for dtype in ("auto", "fp8", *DENSE_DTYPES):
        assert f"\n{dtype} " in out
    assert "kvarn_mla" not in out


def test_plan_json_schema_and_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["dtype"] for r in rows] == ["auto", "fp8", *DENSE_DTYPES]
    for r in rows:
        assert tuple(r) == PLAN_ROW_KEYS
        assert r["fits"] is True and r["error"] is None
        assert r["kv_tokens"] == r["num_blocks"] * r["block_size"]
        assert r["max_concurrency"] == r["num_blocks"] // r["blocks_per_request"]
        assert (
            r["kv_cache_bytes"] + r["side_pool_bytes"] + r["workspace_bytes"] + r["unused_bytes"]
            == r["available_bytes"]
        )
    by = {r["dtype"]: r for r in rows}
    assert by["auto"]["ratio_vs_fp16"] == 1.0 and by["fp8"]["ratio_vs_fp16"] == 2.0
    assert 4.0 < by["kvarn_k4v2_g128"]["ratio_vs_fp16"] < 4.3
    assert by["auto"]["side_pool_bytes"] == 0 and by["kvarn_k4v2_g128"]["side_pool_bytes"] > 0
    assert all(r["workspace_bytes"] == 0 for r in rows)


def test_plan_mla_model_lists_mla_formats_with_workspace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, "plan", "--model", "GLM-4.7-Flash", "--tp", "2", "--json")
    assert code == 0
    rows = {r["dtype"]: r for r in json.loads(out)}
    assert list(rows) == ["auto", "fp8", *MLA_DTYPES]
    assert rows["kvarn_mla_k4_g64"]["workspace_bytes"] > 0
    assert rows["kvarn_mla_k4_g128"]["workspace_bytes"] == 0


def test_plan_one_dtype_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "Qwen3-8B",
        "--gpu",
        "h100",
        "--kv-cache-dtype",
        "kvarn_k4v2_g64",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "4096",
        "--spec-tokens",
        "2",
        "--mem-util",
        "0.85",
        "--json",
    )
    assert code == 0
    (row,) = json.loads(out)
    assert (row["dtype"], row["gpu"], row["spec_tokens"], row["max_model_len"]) == (
        "kvarn_k4v2_g64",
        "h100",
        2,
        32768,
    )
    # POOL = 2*64 + 8 + rollback (ceil(64*2/64) + 64 = 66) = 202 slots (direct flush: no
    # ceil(4096/64) prefill-chunk term)
    assert row["side_pool_slots"] == 202


def test_plan_weight_and_overhead_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "Qwen3-8B",
        "--gpu",
        "80",
        "--weight-gib",
        "10",
        "--overhead-gib",
        "1",
        "--kv-cache-dtype",
        "auto",
        "--json",
    )
    (row,) = json.loads(out)
    assert row["weight_bytes"] == 10 * 2**30 and row["overhead_bytes"] == 2**30
    _, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "GLM-5.2",
        "--tp",
        "8",
        "--gpu",
        "rtx-pro-6000",
        "--weights",
        "exl3:3.4",
        "--weights-scope",
        "experts",
        "--kv-cache-dtype",
        "kvarn_mla_k4_g64",
        "--max-model-len",
        "131072",
        "--json",
    )
    (row,) = json.loads(out)
    assert row["weight_format"] == "exl3:3.4 (experts only)" and row["fits"] is True


def test_plan_rows_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # 141 GB of bf16 Llama-3.1-70B weights on one H200: nothing fits, and every row says so.
    code, out, _ = _run(capsys, "plan", "--model", "Llama-3.1-70B", "--json")
    assert code == 0
    rows = json.loads(out)
    for r in rows:
        assert tuple(r) == PLAN_ROW_KEYS
        assert r["fits"] is False and "no memory is left" in r["error"]
        assert r["kv_tokens"] == 0 and r["ratio_vs_fp16"] is None
        # The memory terms are still reported, so the reader sees why.
        assert r["weight_bytes"] > r["requested_bytes"] > 0 and r["available_bytes"] < 0
    code, out, _ = _run(capsys, "plan", "--model", "Llama-3.1-70B")
    assert code == 0 and "does not fit: no memory is left" in out
    assert "per GPU: requested 125.82 GiB = weights 131.42 GiB" in out
    # Asking for one format that does not fit is an error.
    err = _error(capsys, "plan", "--model", "Llama-3.1-70B", "--kv-cache-dtype", "fp8")
    assert "no memory is left" in err


def test_plan_format_the_model_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "plan", "--kv-cache-dtype", "kvarn_mla_k5_g64")
    assert "Valid for this model: auto, fp8, kvarn_k4v2_g128" in err
    err = _error(capsys, "plan", "--kv-cache-dtype", "int3")
    assert "Unknown cache dtype 'int3'" in err


def test_plan_bad_model_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _error(capsys, "plan", "--model", str(tmp_path / "missing.json"))
    assert "no such model config" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in _error(capsys, "plan", "--model", str(bad))
    partial = tmp_path / "partial" / "config.json"
    partial.parent.mkdir()
    partial.write_text(json.dumps({"hidden_size": 1024, "num_attention_heads": 8}))
    assert "missing 'num_hidden_layers'" in _error(capsys, "plan", "--model", str(partial.parent))
    assert "unknown model 'NoSuchModel'" in _error(capsys, "plan", "--model", "NoSuchModel")


def test_plan_config_path_works(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 32000,
        "max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = _run(capsys, "plan", "--model", str(tmp_path), "--gpu", "l40s", "--json")
    assert code == 0
    rows = json.loads(out)
    assert rows[0]["model"] == tmp_path.name and rows[0]["max_model_len"] == 8192


def test_plan_argument_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--tp" in _usage_error(capsys, "plan", "--tp", "0")
    assert "--mem-util" in _usage_error(capsys, "plan", "--mem-util", "1.5")
    _usage_error(capsys, "plan", "--no-such-flag")
    _usage_error(capsys)
    assert "tp=3" in _error(capsys, "plan", "--tp", "3")
    assert "unknown GPU" in _error(capsys, "plan", "--gpu", "tpu-v9")
    assert "max_num_batched_tokens" in _error(
        capsys, "plan", "--max-num-seqs", "4096", "--max-num-batched-tokens", "1024"
    )
    assert "--weights-scope needs --weights" in _error(capsys, "plan", "--weights-scope", "experts")
    assert "unknown weight format" in _error(capsys, "plan", "--weights", "q4")


# ---------------------------------------------------------------------------------------------
# Extension registry and the installed script


def test_extension_module_adds_a_subcommand(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvarn_test_ext.py").write_text(
        textwrap.dedent(
            """
            from kvarn_format.cli import Subcommand

            def _configure(p):
                p.add_argument("--n", type=int, default=1)

            def _run(args):
                print("hello", args.n)
                return 0

            SUBCOMMAND = Subcommand("hello", "say hello", _configure, _run)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "EXTENSION_MODULES", ("kvarn_test_ext", "kvarn_absent_ext"))
    try:
        code, out, _ = _run(capsys, "hello", "--n", "3")
        assert code == 0 and out == "hello 3\n"
    finally:
        cli._REGISTRY.pop("hello", None)
        sys.modules.pop("kvarn_test_ext", None)


def _installed_kvarn() -> Path:
    script = Path(sys.executable).parent / "kvarn"
    if not script.exists():
        pytest.skip("the kvarn console script is not installed in this environment")
    return script


def test_installed_script(tmp_path: Path) -> None:
    script = _installed_kvarn()
    done = subprocess.run(
        [str(script), "plan", "--model", "Qwen3-8B", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows[0]["dtype"] == "auto" and tuple(rows[0]) == PLAN_ROW_KEYS
    bad = subprocess.run(
        [str(script), "inspect", "nope"], capture_output=True, text=True, check=False, timeout=120
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
