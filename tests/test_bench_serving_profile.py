"""tools/bench_serving.py --profile, host side (no GPU): the profiling code of
tools/serving_profile.py (table parser, kernel categories, profile.md, the child's collection
logic with fakes, the worker functions' pickling) and the CLI plumbing with a stub child."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

# vLLM's profiler_out_0.txt of a kvarn run, in torch 2.11's key_averages().table() format
# (sort_by="self_cuda_time_total", 55-character names): kernels, CPU ops, a CPU range of
# kvarn-vllm, vLLM's step annotations both as CPU ranges and as GPU spans (the rows with
# 0 CPU time whose names are steps: not kernels). Made by torch's own formatter; trailing
# spaces stripped as an editor would (the tables torch makes in the tests below keep them).
SAMPLE_VLLM = """\
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
                                                   Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg     Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
              nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN         0.00%       0.000us         0.00%       0.000us       0.000us        7.200s        55.63%        7.200s        2.400s             3
                                               aten::mm         0.15%      70.000us         0.15%      70.000us      35.000us        4.800s        37.09%        4.800s        2.400s             2
void cutlass::device_kernel<flash::enable_sm90_or_la...         0.00%       0.000us         0.00%       0.000us       0.000us        2.500s        19.32%        2.500s        1.250s             2
     triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0         0.00%       0.000us         0.00%       0.000us       0.000us        1.280s         9.89%        1.280s     640.000ms             2
                                       decode_v4_kernel         0.00%       0.000us         0.00%       0.000us       0.000us        1.240s         9.58%        1.240s     310.000ms             4
              execute_context_2(8192)_generation_30(30)         0.00%       0.000us         0.00%       0.000us       0.000us     824.000ms         6.37%     824.000ms     412.000ms             2
                                          _flush_kernel         0.00%       0.000us         0.00%       0.000us       0.000us     288.000ms         2.23%     288.000ms      96.000ms             3
                                    _rotate_rows_kernel         0.00%       0.000us         0.00%       0.000us       0.000us     257.500ms         1.99%     257.500ms      51.500ms             5
                                _dequant_context_kernel         0.00%       0.000us         0.00%       0.000us       0.000us     176.500ms         1.36%     176.500ms      88.250ms             2
                 execute_context_0(0)_generation_96(96)         0.00%       0.000us         0.00%       0.000us       0.000us      54.750ms         0.42%      54.750ms      18.250ms             3
void vllm::reshape_and_cache_flash_kernel<__half, __...         0.00%       0.000us         0.00%       0.000us       0.000us     900.000us         0.01%     900.000us     450.000us             2
                         Memcpy HtoD (Pinned -> Device)         0.00%       0.000us         0.00%       0.000us       0.000us      13.000us         0.00%      13.000us       3.250us             4
                    vllm::unified_attention_with_output        18.18%       8.300ms        18.18%       8.300ms       4.150ms       0.000us         0.00%       0.000us       0.000us             2
                                        cudaGraphLaunch         0.54%     246.000us         0.54%     246.000us      61.500us       0.000us         0.00%       0.000us       0.000us             4
                                       cuLaunchKernelEx         0.05%      23.750us         0.05%      23.750us       4.750us       0.000us         0.00%       0.000us       0.000us             5
                                           kvarn: build        12.02%       5.490ms        12.02%       5.490ms       1.830ms       0.000us         0.00%       0.000us       0.000us             3
                           gpu_model_runner: preprocess        19.12%       8.730ms        19.12%       8.730ms       2.910ms       0.000us         0.00%       0.000us       0.000us             3
                 execute_context_0(0)_generation_96(96)        49.93%      22.800ms        49.93%      22.800ms       7.600ms       0.000us         0.00%       0.000us       0.000us             3
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
Self CPU time total: 45.660ms
Self CUDA time total: 12.943s

"""

SAMPLE_KERNELS = {
    "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN",
    "void cutlass::device_kernel<flash::enable_sm90_or_la...",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
    "decode_v4_kernel",
    "_flush_kernel",
    "_rotate_rows_kernel",
    "_dequant_context_kernel",
    "void vllm::reshape_and_cache_flash_kernel<__half, __...",
    "Memcpy HtoD (Pinned -> Device)",
}


@pytest.fixture(scope="module")
def prof(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    """tools/serving_profile.py: the profiling code bench_serving.py imports."""
    return load_tool("serving_profile")


@pytest.fixture(scope="module")
def bench(load_tool: Callable[[str], ModuleType], prof: ModuleType) -> ModuleType:
    """tools/bench_serving.py, loaded after ``prof`` so that it imports that same module."""
    module = load_tool("bench_serving")
    assert module.collect_profile is prof.collect_profile
    return module


# ----------------------------------------------------------------------------- tables from torch


def torch_table(
    spec: Sequence[tuple[str, float, float, int, str]],
    name_width: int = 55,
    shapes: bool = False,
    device: str | None = "cuda",
) -> str:
    """A key_averages table made by the installed torch's own formatter.

    ``spec``: (name, cpu_us, device_us, calls, kind) with kind ``cpu`` (a CPU op), ``kernel``
    (a device event) or ``span`` (a GPU-side annotation).
    """
    from torch.autograd import DeviceType  # type: ignore[attr-defined]
    from torch.autograd.profiler_util import EventList, FunctionEvent

    events = []
    i = 0
    for thread, (name, cpu_us, dev_us, calls, kind) in enumerate(spec, 1):
        for c in range(calls):
            i += 1
            dur = dev_us if kind != "cpu" else cpu_us
            ev = FunctionEvent(  # type: ignore[no-untyped-call]
                id=i,
                name=name,
                thread=thread,
                start_us=c * 10_000_000,
                end_us=c * 10_000_000 + dur,
                use_device=device,
                device_type=DeviceType.CPU if kind == "cpu" else DeviceType.CUDA,
                is_user_annotation=kind == "span",
                stack=[],
                input_shapes=[[4, 128], [128]] if shapes and kind == "cpu" else [],
            )
            events.append(ev)
    el: Any = EventList(events, use_device=device)  # type: ignore[no-untyped-call]
    el._build_tree()
    averages = el.key_averages(group_by_input_shapes=shapes)
    return str(averages.table(sort_by="self_cuda_time_total", max_name_column_width=name_width))


# ----------------------------------------------------------------------------- parser


def test_parses_vllm_sample_columns_units_and_footer(prof: ModuleType) -> None:
    tables = prof.parse_key_averages(SAMPLE_VLLM)
    assert len(tables) == 1
    t = tables[0]
    assert t.headers[0] == "Name" and t.device == "CUDA"
    assert "Self CUDA %" in t.headers and t.headers[-1] == "# of Calls"
    assert len(t.rows) == 18
    rows = {r.name: r for r in t.rows}
    nv = rows["nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN"]
    assert nv.get("Self CUDA") == pytest.approx(7.2e6)  # seconds -> us
    assert nv.get("Self CUDA %") == pytest.approx(55.63)
    assert nv.get("# of Calls") == 3
    tri = rows["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"]
    assert tri.get("CUDA time avg") == pytest.approx(640_000.0)  # ms -> us
    assert rows["Memcpy HtoD (Pinned -> Device)"].get("Self CUDA") == pytest.approx(13.0)
    assert rows["kvarn: build"].get("CPU total") == pytest.approx(5_490.0)
    # The truncated name is read whole, with its "..." (the column is sliced, not split).
    assert "void cutlass::device_kernel<flash::enable_sm90_or_la..." in rows
    assert t.footer["Self CPU time total"] == pytest.approx(45_660.0)
    assert t.device_total_us() == pytest.approx(12.943e6)


def test_device_rows_leave_out_cpu_ops_and_step_spans(prof: ModuleType) -> None:
    t = prof.parse_key_averages(SAMPLE_VLLM)[0]
    kernels = prof.device_rows(t)
    assert {r.name for r in kernels} == SAMPLE_KERNELS
    # What is left is the footer's device total (annotations are not in it; the footer is
    # rounded to 1 ms here).
    total = t.device_total_us()
    assert sum(r.get("Self CUDA") for r in kernels) == pytest.approx(total, abs=500.0)


def test_a_value_wider_than_its_column_does_not_shift_the_others(prof: ModuleType) -> None:
    line = next(ln for ln in SAMPLE_VLLM.splitlines() if ln.strip().startswith("decode_v4"))
    wide = line[: line.rstrip().rfind(" ")] + " 123456789012345  "
    tables = prof.parse_key_averages(SAMPLE_VLLM.replace(line, wide))
    row = next(r for r in tables[0].rows if r.name == "decode_v4_kernel")
    assert row.get("# of Calls") == 123456789012345
    assert row.get("Self CUDA") == pytest.approx(1.24e6)


def test_parse_errors_say_where(prof: ModuleType) -> None:
    lines = SAMPLE_VLLM.splitlines()
    short = lines[4][:90]  # a row cut after its first values
    with pytest.raises(prof.ProfileTableError, match=r"line 5: \d+ values for 10"):
        prof.parse_key_averages("\n".join([*lines[:4], short, *lines[5:]]))
    bad = lines[3].replace("7.200s", "7.200xs", 1)
    with pytest.raises(prof.ProfileTableError, match=r"7\.200xs"):
        prof.parse_key_averages("\n".join([*lines[:3], bad, *lines[4:]]))
    assert prof.parse_key_averages("no table here\n---\n") == []
    assert math.isnan(prof.parse_cell("NaN"))
    assert prof.parse_cell("1.5ns") == pytest.approx(0.0015)


def test_parser_reads_the_installed_torch_tables(prof: ModuleType) -> None:
    """Tables made by this torch's formatter: long names, NaN shares, Input Shapes."""
    long_name = "void cutlass::device_kernel<flash::enable_sm90_or_later<" + "x" * 150 + ">"
    spec = [
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", 0, 2_500_000, 2, "kernel"),
        (long_name, 0, 900.5, 3, "kernel"),
        ("_flush_kernel", 0, 42.25, 4, "kernel"),
        ("execute_context_0(0)_generation_8(8)", 0, 9_000, 1, "span"),
    ]
    t = prof.parse_key_averages(torch_table(spec, name_width=140))[0]
    got = {r.name: r for r in prof.device_rows(t)}
    assert set(got) == {spec[0][0], long_name[:137] + "...", "_flush_kernel"}
    assert got["_flush_kernel"].get("Self CUDA") == pytest.approx(4 * 42.25)
    assert got["_flush_kernel"].get("# of Calls") == 4
    assert math.isnan(got["_flush_kernel"].get("Self CPU %"))  # no CPU events at all
    # The footer has 4 significant digits (5.003s).
    assert t.device_total_us() == pytest.approx(5_000_000 + 3 * 900.5 + 4 * 42.25, abs=500.0)
    cpu = [("aten::mm", 35.0, 0, 2, "cpu"), ("_flush_kernel", 0, 10.0, 1, "kernel")]
    t2 = prof.parse_key_averages(torch_table(cpu, shapes=True))[0]
    assert "Input Shapes" in t2.headers
    mm = next(r for r in t2.rows if r.name == "aten::mm")
    assert mm.get("CPU total") == pytest.approx(70.0) and mm.get("# of Calls") == 2


# ----------------------------------------------------------------------------- categories


def test_kernel_categories(prof: ModuleType) -> None:
    cat = prof.kernel_category
    assert cat("decode_v4_kernel") == "kvarn decode attention"
    assert cat("_attn_kernel") == cat("_merge_unrotate_kernel") == "kvarn decode attention"
    assert cat("_dequant_context_kernel") == "kvarn prefill dequant"
    assert cat("_flush_kernel") == "kvarn flush (quantize + store)"
    assert cat("_rotate_rows_kernel").startswith("kvarn rotate")
    assert cat("void cutlass::device_kernel<flash::enable_sm90_or_la...") == "FlashAttention"
    assert cat("void flash::prepare_varlen_num_blocks_kernel<128, 176>(...)") == "FlashAttention"
    # vLLM's fp16 KV write has "flash" in its name but is not attention.
    assert cat("void vllm::reshape_and_cache_flash_kernel<__half, __...").startswith("vLLM KV")
    assert cat("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN") == "GEMM"
    assert cat("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16>") == "GEMM"
    assert cat("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64") == "GEMM"
    assert cat("ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevKernelArgs)") == "NCCL"
    assert cat("triton_poi_fused_mul_silu_slice_1").startswith("torch.compile")
    assert cat("Memset (Device)") == "memcpy / memset"
    assert cat("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "other"
    assert set(prof.CATEGORY_ORDER) >= {cat(n) for n in SAMPLE_KERNELS}


def test_every_kvarn_triton_kernel_has_a_kvarn_category(prof: ModuleType) -> None:
    """A kvarn-kernels kernel renamed or added must not fall into 'other' unnoticed."""
    src = "\n".join(
        p.read_text() for p in (ROOT / "packages/kvarn-kernels/src/kvarn_kernels").glob("*.py")
    )
    # a launch's grid may index tensors (``k[(x.shape[0], h)](``): up to the line's last ``](``
    launched = set(re.findall(r"^\s+(\w+)\[.*\]\(", src, re.M))
    # and launches through kvarn_kernels._launch.launch(kernel, grid, ...) or prepared ones,
    # PreparedLaunch(kernel, grid, ...)
    launched |= set(re.findall(r"\b(?:launch|PreparedLaunch)\(\s*(?:\w+\.)*(\w+),", src))
    jitted = set(re.findall(r"@(?:triton|gluon)\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", src))
    kernels = launched & jitted
    expected = {"decode_v4_kernel", "decode_pool_kernel", "_flush_kernel", "_rotate_rows_kernel"}
    assert expected | {"prefill_v2_kernel", "prefill_v3_kernel", "prefill_v4_kernel"} <= kernels
    for name in kernels:
        assert prof.kernel_category(name).startswith("kvarn"), name


# ----------------------------------------------------------------------------- files and md


def _profile_text(prof: ModuleType, flavour: str) -> str:
    """A child's profile file: totals, worker kernels table, host ranges, vLLM's table."""
    if flavour == "auto":
        kernels = [
            ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", 0, 20_000_000, 4, "kernel"),
            (
                "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::Fwd>>",
                0,
                8e6,
                2,
                "kernel",
            ),
            ("void vllm::reshape_and_cache_flash_kernel<__half>", 0, 300_000, 2, "kernel"),
        ]
        ranges = [("gpu_model_runner: preprocess", 2_000, 0, 10, "cpu")]
    else:
        kernels = [
            ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", 0, 20_000_000, 4, "kernel"),
            (
                "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::Fwd>>",
                0,
                7e6,
                2,
                "kernel",
            ),
            ("decode_v4_kernel", 0, 3_000_000, 2, "kernel"),
            ("_flush_kernel", 0, 1_500_000, 2, "kernel"),
            ("_rotate_rows_kernel", 0, 400_000, 2, "kernel"),
        ]
        ranges = [
            ("gpu_model_runner: preprocess", 3_000, 0, 10, "cpu"),
            ("kvarn: build", 1_200, 0, 10, "cpu"),
        ]
    totals = {
        "device_us": sum(k[2] * k[3] for k in kernels),
        "host_self_cpu_us": 9_000.0,
        "steps": {
            "with prefill": {"steps": 5, "host_us": 4e3, "gpu_span_us": 2e7, "prompt_tokens": 9},
            "decode only": {"steps": 7, "host_us": 2e3, "gpu_span_us": 8e6, "prompt_tokens": 0},
        },
    }
    return str(
        prof.profile_sections(
            [
                ("totals", json.dumps(totals)),
                ("kernels", torch_table(kernels, name_width=140)),
                ("host ranges", torch_table(ranges)),
                ("host self cpu", torch_table([("cudaGraphLaunch", 60.0, 0, 3, "cpu")])),
                ("vllm profiler_out_0", SAMPLE_VLLM),
            ]
        )
    )


def test_sections_round_trip_and_fallbacks(prof: ModuleType, tmp_path: Path) -> None:
    text = prof.profile_sections([("totals", "{}"), ("kernels", "a\nb")])
    assert prof.split_sections(text) == {"totals": "{}", "kernels": "a\nb"}
    assert prof.split_sections(SAMPLE_VLLM) == {"vllm profiler_out_0": SAMPLE_VLLM}
    raw = tmp_path / "profiler_out_0.txt"  # a bare vLLM table reads too, with a note
    raw.write_text(SAMPLE_VLLM)
    p = prof.load_profile(raw, "kvarn_k4v2_g128")
    assert p.source.startswith("vLLM profiler_out_0.txt")
    assert {k[0] for k in p.kernels} == SAMPLE_KERNELS
    assert p.kernels[0][0].startswith("nvjet")  # sorted by time
    assert [r[0] for r in p.ranges] == ["gpu_model_runner: preprocess", "kvarn: build"]
    assert p.notes and "55 characters" in p.notes[0]
    with pytest.raises(prof.ProfileTableError, match=r"profile_auto\.txt.*log_auto\.txt"):
        prof.load_profile(tmp_path / "profile_auto.txt", "auto")
    empty = tmp_path / "empty.txt"
    empty.write_text(prof.profile_sections([("totals", "{}")]))
    with pytest.raises(prof.ProfileTableError, match="no key_averages table"):
        prof.load_profile(empty, "auto")


def test_a_cpu_only_profile_keeps_the_host_side(prof: ModuleType, tmp_path: Path) -> None:
    """vLLM's CPU worker profiles CPU activity only: no device columns, host ranges kept."""
    host = [("kvarn: build", 50.0, 0, 2, "cpu"), ("gpu_model_runner: forward", 900.0, 0, 2, "cpu")]
    path = tmp_path / "profile_auto.txt"
    path.write_text(
        prof.profile_sections([("vllm profiler_out_0", torch_table(host, device=None))])
    )
    p = prof.load_profile(path, "auto", elapsed_s=1.0)
    assert p.kernels == [] and p.device_total_us == 0
    assert "no device (CUDA) columns" in p.notes[-1]
    assert [r[0] for r in p.ranges] == ["gpu_model_runner: forward", "kvarn: build"]
    rows = [{"label": "auto", "status": "ok", "profiled": True, "profile_file": path.name}]
    errors = prof.write_profile_summary(tmp_path, rows, {}, "auto")
    assert errors == ["auto: no device kernel time in profile_auto.txt (CUDA not recorded?)"]
    md = (tmp_path / "profile.md").read_text()
    assert "| `kvarn: build` | 0.1 | 2 | 0.0 |" in md and "CUDA not recorded" in md


def test_profile_md_side_by_side(prof: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(_profile_text(prof, "auto"))
    (tmp_path / "k.txt").write_text(_profile_text(prof, "kvarn"))
    auto = prof.load_profile(tmp_path / "a.txt", "auto", elapsed_s=120.0)
    kv = prof.load_profile(tmp_path / "k.txt", "kvarn_k4v2_g128", elapsed_s=130.0)
    assert auto.source.startswith("worker key_averages")  # the kernels section wins
    assert kv.categories()["kvarn flush (quantize + store)"] == pytest.approx(3e6)
    meta = {"gpu": "NVIDIA H200", "num_prompts": 96, "prompt_len": 6144, "output_len": 512}
    md = prof.render_profile_md([auto, kv], meta, "auto")
    assert "| category | auto ms | share | kvarn_k4v2_g128 ms | share |" in md
    assert "kvarn_k4v2_g128 - auto ms" in md
    # GEMM 80 s in both (same time, shares of different totals), FlashAttention 16 -> 14 s.
    assert "| GEMM | 80,000.0 | 82.8% | 80,000.0 | 77.1% | 0.0 |" in md
    assert "| FlashAttention | 16,000.0 | 16.6% | 14,000.0 | 13.5% | -2,000.0 |" in md
    assert "| kvarn decode attention | 0.0 | 0.0% | 6,000.0 | 5.8% | 6,000.0 |" in md
    assert "| **kernel time total** | 96,600.0 | 100.0% | 103,800.0 | 100.0% | 7,200.0 |" in md
    assert "| idle = wall - kernel time | 23,400.0 |  | 26,200.0 |  | 2,800.0 |" in md
    assert "## Top 30 kernels: kvarn_k4v2_g128" in md
    assert "| 1 | `nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN` | GEMM | 80,000.0 |" in md
    assert "| `kvarn: build` | | | | 12.0 | 10 | 0.0 |" in md
    assert "| with prefill | 5 | 20,000.0 | 4.0 | 5 | 20,000.0 | 4.0 |" in md
    assert "## Top host ops by self CPU time: auto" in md


def test_profiler_config_matches_vllm_profiler_config_fields(
    prof: ModuleType, tmp_path: Path
) -> None:
    """The keys exist on vLLM 0.23's ProfilerConfig (read from its source, not imported:
    importing vllm here would fix its platform for the rest of the session)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    src = Path(next(iter(spec.submodule_search_locations))) / "config" / "profiler.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ProfilerConfig")
    fields = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    cfg = prof.profiler_config(tmp_path)
    assert set(cfg) <= fields
    assert cfg["profiler"] == "torch" and cfg["torch_profiler_dir"] == str(tmp_path)
    assert not cfg["torch_profiler_with_stack"] and not cfg["torch_profiler_record_shapes"]
    assert not cfg["torch_profiler_with_memory"] and cfg["torch_profiler_use_gzip"]


# ----------------------------------------------------------------------------- child side


def _cpu_profile() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with (
                record_function("execute_context_1(16)_generation_3(3)"),
                record_function("kvarn: build"),
            ):
                torch.ones(8).add_(1)
        with record_function("execute_context_0(0)_generation_4(4)"):
            torch.zeros(4).mul_(2)
    return prof


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_worker_functions_on_a_real_cpu_profile(prof: ModuleType) -> None:
    torch_prof = _cpu_profile()
    worker = SimpleNamespace(profiler=SimpleNamespace(profiler=torch_prof))
    got = prof._worker_profile_tables(worker)
    steps = got["totals"]["steps"]
    assert steps["with prefill"]["steps"] == 2 and steps["with prefill"]["prompt_tokens"] == 32
    assert steps["decode only"]["steps"] == 1 and steps["decode only"]["decode_rows"] == 4
    assert got["kernels"] == ""  # no device events on a CPU profile
    ranges = prof.parse_key_averages(got["host ranges"])[0]
    assert [(r.name, r.get("# of Calls")) for r in ranges.rows] == [("kvarn: build", 2)]
    assert prof.parse_key_averages(got["host self cpu"])[0].rows
    assert "error" in prof._worker_profile_tables(SimpleNamespace())
    torch_prof.on_trace_ready = print
    assert prof._worker_skip_trace_export(worker) is True and torch_prof.on_trace_ready is None
    assert prof._worker_skip_trace_export(SimpleNamespace(profiler=None)) is False


class FakeLLM:
    """What collect_profile uses of vllm.LLM, with the worker in this process."""

    def __init__(self, prof_dir: Path, worker: Any, vllm_text: str | None, rpc_ok: bool) -> None:
        self.prof_dir, self.worker, self.vllm_text, self.rpc_ok = (
            prof_dir,
            worker,
            vllm_text,
            rpc_ok,
        )
        self.calls: list[str] = []

    def collective_rpc(self, fn: Any) -> list[Any]:
        self.calls.append(fn.__name__)
        if not self.rpc_ok:
            raise TypeError("Object of type function is not serializable")
        return [fn(self.worker)]

    def stop_profile(self) -> None:
        self.calls.append("stop_profile")
        if self.vllm_text is not None:
            (self.prof_dir / "profiler_out_0.txt").write_text(self.vllm_text)


def test_worker_functions_travel_by_value(prof: ModuleType, tmp_path: Path) -> None:
    """vLLM's IPC cloudpickles the two rpc functions; the engine core and the worker must
    load them without importing serving_profile (tools/ is not a package). A fresh Python
    that cannot import it loads them only once collect_profile's registration is done."""
    import cloudpickle

    loader = (
        "import pickle, sys, types\n"
        "skip, tables = pickle.loads(sys.stdin.buffer.read())\n"
        "print(skip(types.SimpleNamespace(profiler=None)), tables(types.SimpleNamespace()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fns = (prof._worker_skip_trace_export, prof._worker_profile_tables)

    def load_elsewhere() -> tuple[int, str, str]:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", loader],
            input=cloudpickle.dumps(fns),
            capture_output=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
        )
        return proc.returncode, proc.stdout.decode(), proc.stderr.decode(errors="replace")

    registered = prof.__name__ in cloudpickle.list_registry_pickle_by_value()
    if registered:
        cloudpickle.unregister_pickle_by_value(prof)
    try:
        rc, _, err = load_elsewhere()  # by reference: the failure the registration prevents
        assert rc != 0 and "No module named 'serving_profile'" in err
        prof.pickle_worker_functions_by_value()
        rc, out, err = load_elsewhere()
        assert rc == 0, err[-2000:]
        assert out.startswith("False {'error': 'the worker has no torch profiler")
    finally:
        if not registered and prof.__name__ in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.unregister_pickle_by_value(prof)


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_collect_profile_writes_one_file(prof: ModuleType, tmp_path: Path) -> None:
    worker = SimpleNamespace(profiler=SimpleNamespace(profiler=_cpu_profile()))
    llm = FakeLLM(tmp_path, worker, SAMPLE_VLLM, rpc_ok=True)
    dest = tmp_path / "profile_auto.txt"
    info = prof.collect_profile(llm, tmp_path, dest, keep_trace=False)
    assert llm.calls == ["_worker_skip_trace_export", "stop_profile", "_worker_profile_tables"]
    assert info["profiled"] and info["profile_file"] == "profile_auto.txt"
    assert info["profile_trace"] == "skipped"
    sections = prof.split_sections(dest.read_text())
    assert list(sections) == [
        "totals",
        "kernels",
        "host ranges",
        "host self cpu",
        "vllm profiler_out_0",
    ]
    assert json.loads(sections["totals"])["steps"]["with prefill"]["steps"] == 2
    # The RPC failing leaves vLLM's table (and says why); nothing at all is an error.
    info = prof.collect_profile(
        FakeLLM(tmp_path, worker, SAMPLE_VLLM, rpc_ok=False), tmp_path, dest, keep_trace=False
    )
    assert "not serializable" in info["profile_rpc_error"]
    assert info["profile_trace"].startswith("kept")
    assert list(prof.split_sections(dest.read_text())) == ["vllm profiler_out_0"]
    (tmp_path / "profiler_out_0.txt").unlink()
    with pytest.raises(prof.ProfileTableError, match="no profiler table"):
        prof.collect_profile(
            FakeLLM(tmp_path, worker, None, rpc_ok=False), tmp_path, dest, keep_trace=True
        )


# ----------------------------------------------------------------------------- CLI plumbing


def _stub_child(prof: ModuleType, seen: list[tuple[list[str], dict[str, str]]], write: bool) -> Any:
    def run_child(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> Any:
        seen.append((cmd, env))
        dtype = cmd[cmd.index("--child-dtype") + 1]
        row = {
            "cache_dtype": dtype,
            "kv_tokens": 1000 if dtype == "auto" else 4000,
            "total_tok_s": 100.0,
            "output_tok_s": 10.0,
            "elapsed_s": 30.0,
            "requests": int(cmd[cmd.index("--num-prompts") + 1]),
        }
        if "--profile" in cmd:
            out = Path(cmd[cmd.index("--child-profile-out") + 1])
            row.update(profiled=True, profile_file=out.name)
            if write:
                out.write_text(_profile_text(prof, "auto" if dtype == "auto" else "kvarn"))
        Path(cmd[cmd.index("--child-out") + 1]).write_text(json.dumps(row))
        log.write_text("kvarn-bench child done\n")
        return 0, "kvarn-bench child done\n"

    return run_child


def test_cli_profile_plumbing(
    bench: ModuleType, prof: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(bench.common, "run_child", _stub_child(prof, seen, write=True))
    monkeypatch.setattr(bench, "DOCS", tmp_path / "benchmarks.md")
    out = tmp_path / "prof"
    argv = ["--dtypes", "auto,kvarn_k4v2_g128", "--profile", "--num-prompts", "8"]
    argv += ["--out", str(out), "--profile-dir", str(tmp_path / "traces")]
    assert bench.main(argv) == 0
    assert len(seen) == 2
    for (cmd, env), safe in zip(seen, ("auto", "kvarn_k4v2_g128"), strict=True):
        assert "--profile" in cmd and "--profile-trace" not in cmd
        assert cmd[cmd.index("--num-prompts") + 1] == "8"
        assert cmd[cmd.index("--prompt-len") + 1] == "6144"  # lengths kept
        assert cmd[cmd.index("--output-len") + 1] == "512"
        assert cmd[cmd.index("--profile-dir") + 1] == str(tmp_path / "traces" / safe)
        assert cmd[cmd.index("--child-profile-out") + 1] == str(out / f"profile_{safe}.txt")
        assert env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] == "1"
        assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    # The child parses what the parent passed.
    got: list[Any] = []

    def fake_child_main(a: Any) -> int:
        got.append(a)
        return 0

    monkeypatch.setattr(bench, "child_main", fake_child_main)
    assert bench.main(seen[1][0][2:]) == 0
    child = got[0]
    assert child.profile and not child.profile_trace and child.num_prompts == 8
    assert child.child_dtype == "kvarn_k4v2_g128"
    assert child.child_profile_out == str(out / "profile_kvarn_k4v2_g128.txt")
    md = (out / "profile.md").read_text()
    assert "| category | auto ms | share | kvarn_k4v2_g128 ms | share |" in md
    assert "kvarn flush (quantize + store)" in md
    assert "ok (profiled" in (out / "summary.md").read_text()
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert all(r["profiled"] for r in rows)
    assert json.loads((out / "meta.json").read_text())["profile"] is True
    # Fetched folder: --report rebuilds profile.md; --write-docs refuses profiled rows.
    (out / "profile.md").unlink()
    assert bench.main(["--report", "--out", str(out)]) == 0
    assert (out / "profile.md").is_file()
    assert bench.main(["--report", "--out", str(out), "--write-docs"]) == 1
    assert not (tmp_path / "benchmarks.md").exists()


def test_cli_profile_missing_table_fails_clearly(
    bench: ModuleType, prof: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(bench.common, "run_child", _stub_child(prof, seen, write=False))
    out = tmp_path / "prof"
    assert bench.main(["--dtypes", "auto", "--profile", "--out", str(out)]) == 1
    md = (out / "profile.md").read_text()
    assert "**error:** auto:" in md and "no profiler table for auto" in md


def test_cli_without_profile_keeps_the_plain_child(
    bench: ModuleType, prof: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(bench.common, "run_child", _stub_child(prof, seen, write=False))
    monkeypatch.delenv("VLLM_CUSTOM_SCOPES_FOR_PROFILING", raising=False)
    out = tmp_path / "plain"
    assert bench.main(["--dtypes", "auto", "--out", str(out)]) == 0
    cmd, env = seen[0]
    assert "--profile" not in cmd and "--child-profile-out" not in cmd
    assert "VLLM_CUSTOM_SCOPES_FOR_PROFILING" not in env
    assert not (out / "profile.md").exists()
    assert "| ok |" in (out / "summary.md").read_text()


def test_triton_compiles_in_the_timed_run_are_counted(
    bench: ModuleType, prof: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiles vLLM's JIT monitor logs after the child's timed-run mark count against the
    row (they stall the timed run); those of the untimed warm-up do not."""
    seen: list[tuple[list[str], dict[str, str]]] = []
    stub = _stub_child(prof, seen, write=False)
    warn = "WARNING [jit_monitor.py:103] Triton kernel JIT compilation during inference: {}.\n"

    def run_child(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> Any:
        stub(cmd, env, log, timeout)
        text = warn.format("_flush_kernel") + bench.TIMED_MARK + "\n"
        text += warn.format("decode_v4_kernel") + warn.format("_merge_unrotate_kernel")
        return 0, text

    monkeypatch.setattr(bench.common, "run_child", run_child)
    out = tmp_path / "jit"
    assert bench.main(["--dtypes", "kvarn_k4v2_g128", "--out", str(out)]) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["jit_compiles_timed"] == ["decode_v4_kernel", "_merge_unrotate_kernel"]
    assert row["jit_compiles_while_serving"][0] == "_flush_kernel"
    assert "ok; 2 Triton compiles in the timed run |" in (out / "summary.md").read_text()


def test_profile_steps_window(
    bench: ModuleType, prof: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--profile-steps SKIP,COUNT`` reaches the child and vLLM's profiler config; a bad
    window, or one without --profile, fails before any engine starts."""
    cfg = prof.profiler_config(tmp_path, 40, 25)
    assert (cfg["delay_iterations"], cfg["max_iterations"]) == (40, 25)
    assert prof.profiler_config(tmp_path)["max_iterations"] == 0  # the whole run
    seen: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(bench.common, "run_child", _stub_child(prof, seen, write=True))
    out = tmp_path / "win"
    argv = ["--dtypes", "auto", "--profile", "--profile-steps", "40,25", "--out", str(out)]
    assert bench.main([*argv, "--profile-dir", str(tmp_path / "t")]) == 0
    cmd = seen[0][0]
    assert cmd[cmd.index("--profile-steps") + 1] == "40,25"
    for bad in (["--profile", "--profile-steps", "40"], ["--profile-steps", "1,2"]):
        with pytest.raises(SystemExit):
            bench.main(["--dtypes", "auto", "--out", str(out), *bad])
    assert len(seen) == 1
