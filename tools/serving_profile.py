"""Profiling for ``tools/bench_serving.py --profile``: the child's collection, the tables.

Who calls it: ``bench_serving.py`` only. Its child (one vLLM engine per cache dtype) takes
:func:`profiler_config` for the engine and, after the timed ``generate``,
:func:`collect_profile`, which stops vLLM's torch profiler and writes one
``profile_<label>.txt`` per dtype; its parent runs the child under :func:`profile_env` and
builds ``profile.md`` from those files with :func:`write_profile_summary` (also from a
fetched folder, ``--report``). See bench_serving.py's docstring for the workflow.

Two parts. The child side sends two small functions to vLLM's worker with
``LLM.collective_rpc`` (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: the engine's IPC then
cloudpickles them): :func:`_worker_skip_trace_export` drops the chrome-trace export and
:func:`_worker_profile_tables` builds kernel / host-range / host-op tables from the
profiler's ``key_averages()``. They must be pickled BY VALUE: ``tools/`` is not a package and
cloudpickle would otherwise pickle a function of an importable module by reference (module
name + qualname), which the engine core and the worker can only load if they can import this
file too. :func:`collect_profile` registers this module with
``cloudpickle.register_pickle_by_value`` first, and both functions are self-contained
(imports inside, no module globals), so they unpickle anywhere torch is installed.

The host side needs no GPU, no vLLM and no torch: it parses ``key_averages().table()`` text
(column positions from each table's dashed line, us/ms/s units), groups kernels into
categories by name and renders ``profile.md``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------- profile: child

#: Marks a section of a ``profile_<label>.txt`` file (the text after it, up to the next mark).
SECTION = "## kvarn-bench profile: "
#: CPU-side ranges reported in the host table: vLLM's custom scopes and kvarn-vllm's ranges
#: (both only exist with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, which ``--profile`` sets).
HOST_RANGE_PREFIXES = ("kvarn:", "gpu_model_runner:", "schedule:", "llm_engine step:")
#: vLLM's per-step annotation (``Worker.annotate_profile``): prompt and decode rows/tokens.
STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
PROFILE_ROW_LIMIT = 200
PROFILE_NAME_WIDTH = 140


class ProfileTableError(ValueError):
    """A profiler table is missing or cannot be read."""


def profiler_config(prof_dir: Path, skip_steps: int = 0, steps: int = 0) -> dict[str, Any]:
    """vLLM's ``profiler_config`` for ``--profile``: the torch profiler, cheap settings.

    Stacks, shapes, memory and FLOPs stay off (each adds per-op overhead and table columns);
    gzip stays on in case ``--profile-trace`` keeps the chrome trace. ``skip_steps`` and
    ``steps`` (``--profile-steps``; 0: all) profile only a window of engine steps of the
    timed run, so that a full-size burst can be profiled in bounded time.
    """
    return {
        "delay_iterations": skip_steps,
        "max_iterations": steps,
        "profiler": "torch",
        "torch_profiler_dir": str(prof_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_record_shapes": False,
        "torch_profiler_with_memory": False,
        "torch_profiler_with_flops": False,
        "torch_profiler_use_gzip": True,
        "torch_profiler_dump_cuda_time_total": True,
    }


def profile_env(env: dict[str, str]) -> dict[str, str]:
    """The child's environment for ``--profile``.

    ``VLLM_CUSTOM_SCOPES_FOR_PROFILING`` turns vLLM's ``record_function_or_nullcontext``
    ranges on (kvarn-vllm's ``kvarn: *`` ranges use the same switch, so they cost nothing in
    normal runs). ``VLLM_ALLOW_INSECURE_SERIALIZATION`` lets ``collective_rpc`` carry the two
    small functions below to the worker; it only concerns the engine's local IPC.
    """
    env = dict(env)
    env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def _worker_skip_trace_export(worker: Any) -> bool:
    """Runs in the vLLM worker (``collective_rpc``), before ``stop_profile``.

    vLLM's wrapper exports a gzip chrome trace when its profiler stops: for a burst that is
    hundreds of MB of JSON and a minute or more of writing and gzip, and nothing here can
    fetch it. Dropping ``on_trace_ready`` skips only that; the ``key_averages`` table is still
    written. Returns whether a torch profiler was found.
    """
    prof = getattr(getattr(worker, "profiler", None), "profiler", None)
    if prof is None or not hasattr(prof, "on_trace_ready"):
        return False
    prof.on_trace_ready = None
    return True


def _worker_profile_tables(
    worker: Any,
    row_limit: int = PROFILE_ROW_LIMIT,
    name_width: int = PROFILE_NAME_WIDTH,
    prefixes: tuple[str, ...] | list[str] = HOST_RANGE_PREFIXES,
    self_top: int = 40,
) -> dict[str, Any]:
    """Runs in the vLLM worker (``collective_rpc``), after ``stop_profile``: the tables.

    vLLM's own ``profiler_out_0.txt`` mixes CPU ops, kernels and step annotations (a GPU
    annotation row spans a whole step) in 100 rows with names cut at 55 characters; here the
    device kernels are separated (device events without annotations), names kept longer and
    the CPU-side ranges put in their own table. Self-contained (imports inside): it is
    pickled by value.
    """
    import re as _re

    from torch._C._autograd import DeviceType
    from torch.autograd.profiler_util import EventList

    event_list: Any = EventList  # untyped in torch

    prof = getattr(getattr(worker, "profiler", None), "profiler", None)
    if prof is None:
        return {"error": "the worker has no torch profiler (was profiler_config applied?)"}
    averages = list(prof.key_averages())
    cpu = [e for e in averages if e.device_type == DeviceType.CPU]
    device = [e for e in averages if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    gpu_ranges = [e for e in averages if e.device_type != DeviceType.CPU and e.is_user_annotation]
    step_re = _re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
    steps: dict[str, dict[str, float]] = {
        kind: {"steps": 0, "host_us": 0.0, "gpu_span_us": 0.0, "prompt_tokens": 0, "decode_rows": 0}
        for kind in ("with prefill", "decode only")
    }
    for e in cpu:
        m = step_re.match(e.key)
        if m:
            s = steps["with prefill" if int(m.group(1)) else "decode only"]
            s["steps"] += e.count
            s["host_us"] += e.cpu_time_total
            s["prompt_tokens"] += int(m.group(2)) * e.count
            s["decode_rows"] += int(m.group(3)) * e.count
    for e in gpu_ranges:
        m = step_re.match(e.key)
        if m:
            steps["with prefill" if int(m.group(1)) else "decode only"]["gpu_span_us"] += (
                e.device_time_total
            )
    starts = tuple(prefixes)
    ranges = [e for e in cpu if e.key.startswith(starts)]

    def table(events: list[Any], sort_by: str, limit: int) -> str:
        if not events:
            return ""
        return str(
            event_list(events, use_device=events[0].use_device).table(
                sort_by=sort_by, row_limit=limit, max_name_column_width=name_width
            )
        )

    return {
        "totals": {
            "device_us": sum(e.self_device_time_total for e in device),
            "kernel_calls": sum(e.count for e in device),
            "distinct_kernels": len(device),
            "host_self_cpu_us": sum(e.self_cpu_time_total for e in cpu),
            "steps": steps,
        },
        "kernels": table(device, "self_cuda_time_total", row_limit),
        "host ranges": table(ranges, "cpu_time_total", row_limit),
        "host self cpu": table(cpu, "self_cpu_time_total", self_top),
    }


def profile_sections(parts: list[tuple[str, str]]) -> str:
    """``[(name, text)]`` -> the text of a ``profile_<label>.txt`` file."""
    out = []
    for name, text in parts:
        out.append(f"{SECTION}{name}\n{text.rstrip()}\n")
    return "\n".join(out)


def split_sections(text: str) -> dict[str, str]:
    """A ``profile_<label>.txt`` file -> ``{section: text}``; text without marks is one
    section named ``vllm profiler_out_0`` (a raw ``profiler_out_0.txt`` reads as well)."""
    if SECTION not in text:
        return {"vllm profiler_out_0": text}
    sections: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if line.startswith(SECTION):
            if name is not None:
                sections[name] = "\n".join(body).rstrip("\n")
            name, body = line[len(SECTION) :].strip(), []
        elif name is not None:
            body.append(line)
    if name is not None:
        sections[name] = "\n".join(body).rstrip("\n")
    return sections


def pickle_worker_functions_by_value() -> None:
    """Make cloudpickle carry this module's functions by value to vLLM's processes.

    Without it cloudpickle pickles :func:`_worker_profile_tables` by reference (this module's
    name and the qualname), and the engine core or the worker could load it only if it can
    import ``serving_profile`` (``tools/`` on its ``sys.path``: true for forked processes, not
    something to rely on). By value, the two self-contained worker functions load anywhere.
    """
    import cloudpickle  # type: ignore[import-untyped]

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def collect_profile(llm: Any, prof_dir: Path, dest: Path, *, keep_trace: bool) -> dict[str, Any]:
    """Stop the profiler after the timed ``generate`` and write ``dest`` (one small text file).

    Returns the row's profile facts. Raises :class:`ProfileTableError` (after writing what it
    has) when neither our tables nor vLLM's ``profiler_out_0.txt`` came back.
    """
    info: dict[str, Any] = {"profiled": True, "profile_file": dest.name}
    pickle_worker_functions_by_value()
    if not keep_trace:
        try:
            found = llm.collective_rpc(_worker_skip_trace_export)
            info["profile_trace"] = "skipped" if any(found) else "no profiler found"
        except Exception as exc:  # the export then runs: slower, same tables
            info["profile_trace"] = f"kept ({type(exc).__name__}: {str(exc)[:200]})"
    else:
        info["profile_trace"] = str(prof_dir)
    t0 = time.perf_counter()
    llm.stop_profile()
    info["profile_stop_s"] = round(time.perf_counter() - t0, 1)
    parts: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    try:
        got = llm.collective_rpc(_worker_profile_tables)[0]
        if got.get("error"):
            info["profile_rpc_error"] = got["error"]
        else:
            parts.append(("totals", json.dumps(got["totals"])))
            parts += [(k, got[k]) for k in ("kernels", "host ranges", "host self cpu")]
    except Exception as exc:
        info["profile_rpc_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    info["profile_tables_s"] = round(time.perf_counter() - t0, 1)
    vllm_table = prof_dir / "profiler_out_0.txt"
    if vllm_table.is_file():
        parts.append(("vllm profiler_out_0", vllm_table.read_text(errors="replace")))
    else:
        info["profile_vllm_table"] = f"missing: {vllm_table}"
    dest.write_text(profile_sections(parts))
    if not any(name in ("kernels", "vllm profiler_out_0") for name, _ in parts):
        raise ProfileTableError(
            f"no profiler table: vLLM wrote no {vllm_table} and the worker tables failed "
            f"({info.get('profile_rpc_error', 'no error text')}); check that vLLM accepted "
            "profiler_config (log_<label>.txt) and that the child ran with --profile"
        )
    return info


# ----------------------------------------------------------------------------- profile: tables

_SEP_RE = re.compile(r"^-{3,}(?: {2}-{3,})* *$")
_TIME_RE = re.compile(r"^(-?\d+(?:\.\d*)?|-?\.\d+)(ns|us|ms|s)$")
_TIME_SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
#: Trailing text columns of key_averages tables (not numbers; they may hold spaces).
_TEXT_TAIL = ("Input Shapes", "Source Location")


def parse_cell(raw: str) -> float:
    """A key_averages cell -> float: times in microseconds (``ns``/``us``/``ms``/``s``),
    percentages as numbers (``12.50%`` -> 12.5), ``NaN`` as nan, counts as they are."""
    text = raw.strip()
    if text == "NaN":
        return math.nan
    if text.endswith("%"):
        return float(text[:-1])
    m = _TIME_RE.match(text)
    if m:
        return float(m.group(1)) * _TIME_SCALE[m.group(2)]
    try:
        return float(int(text))
    except ValueError:
        raise ProfileTableError(f"not a time, percentage or count: {raw!r}") from None


@dataclass
class TableRow:
    name: str
    values: dict[str, float]

    def get(self, header: str) -> float:
        return self.values.get(header, 0.0)


@dataclass
class KeyAveragesTable:
    """One ``key_averages().table()`` as text: headers, rows and the ``... time total`` lines."""

    headers: list[str]
    rows: list[TableRow]
    footer: dict[str, float]
    #: ``CUDA`` (from the ``Self CUDA`` header); empty when the table has no device columns.
    device: str

    def device_total_us(self) -> float | None:
        return self.footer.get(f"Self {self.device} time total") if self.device else None


def _extents(sep: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"-+", sep)]


def parse_key_averages(text: str) -> list[KeyAveragesTable]:
    """Every key_averages table in ``text``.

    Column positions come from the dashed line above each header: torch pads every cell to
    its column and cuts the name to fit, so the name (and overload) column is sliced there;
    the numeric columns are read as whitespace-separated tokens after it, so a value wider
    than its column (which pushes the rest of its line right) does not shift the others.
    """
    lines = text.splitlines()
    tables: list[KeyAveragesTable] = []
    i = 0
    while i + 2 < len(lines):
        if not (_SEP_RE.match(lines[i]) and _SEP_RE.match(lines[i + 2])):
            i += 1
            continue
        ext = _extents(lines[i])
        # Header cells can be wider than their column (torch 2.11's "CUDA time avg" is 13 in
        # 12) and then push the rest right; they never hold two spaces in a row, cells are
        # always two or more apart.
        headers = re.split(r"\s{2,}", lines[i + 1].strip())
        if not headers or headers[0] != "Name" or len(headers) != len(ext):
            raise ProfileTableError(
                f"line {i + 2}: a key_averages header is 'Name' and one title per column "
                f"({len(ext)}); got {headers[:4]}..."
            )
        n_text = 2 if len(headers) > 1 and headers[1] == "Overload Name" else 1
        numeric = []
        for h in headers[n_text:]:
            if h in _TEXT_TAIL or (h.startswith("Total ") and h.endswith("FLOPs")):
                break
            numeric.append(h)
        # ``Self CUDA`` (or ``Self XPU``...): the device columns' name; absent without them.
        device = next(
            (
                h[len("Self ") :]
                for h in headers
                if h.startswith("Self ") and h != "Self CPU" and not h.endswith(("%", "Mem"))
            ),
            "",
        )
        cut = ext[n_text - 1][1]
        rows: list[TableRow] = []
        j = i + 3
        while j < len(lines) and not _SEP_RE.match(lines[j]):
            line = lines[j]
            name = line[: ext[0][1]].strip()
            tokens = line[cut:].split()
            if not name and not tokens:
                j += 1  # a stack-trace continuation or a blank line
                continue
            if len(tokens) < len(numeric):
                raise ProfileTableError(
                    f"line {j + 1}: {len(tokens)} values for {len(numeric)} numeric columns "
                    f"({', '.join(numeric)}): {line.strip()[:160]!r}"
                )
            values = {h: parse_cell(t) for h, t in zip(numeric, tokens, strict=False)}
            if name:
                rows.append(TableRow(name, values))
            j += 1
        footer: dict[str, float] = {}
        k = j + 1
        while k < len(lines):
            m = re.match(r"^(Self \S+ time total): (\S+)\s*$", lines[k])
            if not m:
                break
            footer[m.group(1)] = parse_cell(m.group(2))
            k += 1
        tables.append(KeyAveragesTable(headers, rows, footer, device))
        i = k
    return tables


def kernel_category(name: str) -> str:
    """Which group a device kernel belongs to (by name; torch may cut names at 55 chars).

    kvarn's Triton kernels keep their function names: ``decode_v4_kernel``, the Gluon
    ``decode_v5_kernel`` / ``decode_v6_kernel`` / ``decode_v7_kernel``, ``decode_pool_kernel``,
    ``_attn_kernel``, ``_merge_unrotate_kernel`` and ``_verify_rows_kernel`` (decode and
    speculative verify), ``_dequant_context_kernel`` (continuation chunks),
    ``prefill_v2_kernel`` / ``prefill_v3_kernel`` / ``prefill_v3ws_kernel`` /
    ``prefill_v4_kernel`` (the fused
    prefill, ``method="fused"``), ``_flush_kernel`` (tile quantize + store, direct and pooled) and
    ``_rotate_rows_kernel`` (every Hadamard rotation: the side-pool write, the flush input
    and the continuation queries; one kernel, so the split comes from the host ranges).
    """
    low = name.lower()
    decode = ("decode_v4_kernel", "decode_v5_kernel", "decode_v6_kernel", "decode_v7_kernel")
    decode += ("decode_pool_kernel", "_attn_kernel", "_merge_unrotate_kernel", "_verify_rows")
    if low.startswith(decode):
        return "kvarn decode attention"
    if low.startswith(
        ("prefill_v2_kernel", "prefill_v3_kernel", "prefill_v3ws_kernel", "prefill_v4_kernel")
    ):
        return "kvarn prefill attention (fused)"
    if low.startswith("_dequant_context_kernel"):
        return "kvarn prefill dequant"
    if low.startswith("_flush_kernel"):
        return "kvarn flush (quantize + store)"
    if low.startswith("_rotate_rows_kernel"):
        return "kvarn rotate (pool write, flush in, queries)"
    if "nccl" in low:
        return "NCCL"
    if "reshape_and_cache" in low:
        return "vLLM KV write (reshape_and_cache)"
    if "flash" in low or "fmha" in low:
        return "FlashAttention"
    gemm = ("gemm", "nvjet", "cublas", "cutlass", "xmma", "gemv", "splitkreduce", "s16816")
    if any(k in low for k in gemm):
        return "GEMM"
    if low.startswith("triton_"):
        return "torch.compile (Inductor Triton)"
    if low.startswith(("memcpy", "memset")):
        return "memcpy / memset"
    return "other"


CATEGORY_ORDER = (
    "GEMM",
    "FlashAttention",
    "kvarn decode attention",
    "kvarn prefill dequant",
    "kvarn prefill attention (fused)",
    "kvarn flush (quantize + store)",
    "kvarn rotate (pool write, flush in, queries)",
    "vLLM KV write (reshape_and_cache)",
    "torch.compile (Inductor Triton)",
    "NCCL",
    "memcpy / memset",
    "other",
)
NOT_LISTED = "kernels below the table's row limit"


def _is_step_or_range(name: str, cpu_names: set[str]) -> bool:
    return bool(
        STEP_RE.match(name)
        or name.startswith(HOST_RANGE_PREFIXES)
        or re.match(r"^ProfilerStep#\d+$", name)
        or name in cpu_names
    )


def device_rows(table: KeyAveragesTable) -> list[TableRow]:
    """The kernel (and memcpy/memset) rows of a table.

    Device events have no CPU time; of those, the GPU-side copies of ranges (vLLM's step
    annotations, ``record_function`` ranges: same name as a CPU row, or a known pattern) are
    spans, not kernels, and are left out.
    """
    d = table.device
    if not d:
        return []
    cpu_names = {r.name for r in table.rows if r.get("CPU total") > 0}
    out = []
    for r in table.rows:
        if r.get("Self CPU") != 0 or r.get("CPU total") != 0:
            continue
        if r.get(f"Self {d}") <= 0 or _is_step_or_range(r.name, cpu_names):
            continue
        out.append(r)
    return out


@dataclass
class DtypeProfile:
    """What ``profile.md`` shows of one dtype's profile."""

    label: str
    source: str
    device_total_us: float
    kernels: list[tuple[str, float, int]]  # name, self device us, calls
    ranges: list[tuple[str, float, int, float]]  # name, CPU total us, calls, device total us
    host_self: list[tuple[str, float, int]]  # name, self CPU us, calls
    totals: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def categories(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, us, _ in self.kernels:
            cat = kernel_category(name)
            out[cat] = out.get(cat, 0.0) + us
        rest = self.device_total_us - sum(out.values())
        if rest > 1e-3 * max(self.device_total_us, 1.0):
            out[NOT_LISTED] = rest
        return out


def load_profile(path: Path, label: str, elapsed_s: float | None = None) -> DtypeProfile:
    """Read one ``profile_<label>.txt`` (or a raw ``profiler_out_0.txt``)."""
    if not path.is_file():
        raise ProfileTableError(
            f"{path}: no profiler table for {label}. A --profile child writes it next to its "
            f"row; see log_{label}.txt (did the child finish, did vLLM accept profiler_config?)"
        )
    sections = split_sections(path.read_text(errors="replace"))
    notes: list[str] = []
    totals: dict[str, Any] = {}
    if sections.get("totals", "").strip():
        totals = json.loads(sections["totals"])
    vllm_tables = parse_key_averages(sections.get("vllm profiler_out_0", ""))
    kernel_tables = [t for t in parse_key_averages(sections.get("kernels", "")) if t.device]
    if kernel_tables:
        table, source = kernel_tables[0], "worker key_averages (device events only)"
    elif vllm_tables:
        table, source = vllm_tables[0], "vLLM profiler_out_0.txt (top 100 rows, mixed)"
        notes.append(
            "kernels from vLLM's mixed table: device rows told apart by zero CPU time; "
            "names cut at 55 characters"
        )
    else:
        raise ProfileTableError(
            f"{path}: no key_averages table in sections {sorted(sections)} "
            "(expected 'kernels' or 'vllm profiler_out_0')"
        )
    d = table.device
    if not d:
        # E.g. vLLM's CPU worker (CPU activity only): the host tables still mean something.
        notes.append("no device (CUDA) columns in the profile: host side only")
    kernels = [(r.name, r.get(f"Self {d}"), int(r.get("# of Calls"))) for r in device_rows(table)]
    kernels.sort(key=lambda k: -k[1])
    device_total = table.device_total_us()
    if device_total is None:
        device_total = sum(k[1] for k in kernels)
        if d:
            notes.append(f"no 'Self {d} time total' line: total = listed kernels")
    range_tables = parse_key_averages(sections.get("host ranges", ""))
    ranges_src = range_tables[0].rows if range_tables else []
    if not range_tables and vllm_tables:
        ranges_src = [
            r
            for r in vllm_tables[0].rows
            if r.get("CPU total") > 0 and r.name.startswith(HOST_RANGE_PREFIXES)
        ]
    ranges = []
    for r in ranges_src:
        dev_total = r.get(f"{d} total")
        ranges.append((r.name, r.get("CPU total"), int(r.get("# of Calls")), dev_total))
    ranges.sort(key=lambda x: -x[1])
    self_tables = parse_key_averages(sections.get("host self cpu", ""))
    host_self = (
        [(r.name, r.get("Self CPU"), int(r.get("# of Calls"))) for r in self_tables[0].rows]
        if self_tables
        else []
    )
    return DtypeProfile(
        label=label,
        source=source,
        device_total_us=float(device_total),
        kernels=kernels,
        ranges=ranges,
        host_self=host_self,
        totals=totals,
        elapsed_s=elapsed_s,
        notes=notes,
    )


def _ms(us: float) -> str:
    return f"{us / 1e3:,.1f}"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else ""


def _cell(name: str, width: int = 110) -> str:
    name = name if len(name) <= width else name[: width - 3] + "..."
    return "`" + name.replace("|", "\\|").replace("`", "'") + "`"


def render_profile_md(
    profiles: list[DtypeProfile],
    meta: dict[str, Any],
    baseline: str,
    errors: list[str] | None = None,
    top: int = 30,
) -> str:
    """``profile.md``: kernel time by category side by side, top kernels, host ranges."""
    base = next((p for p in profiles if p.label == baseline), None)
    labels = [p.label for p in profiles]
    lines = [
        "# Profiled burst: where the time goes",
        "",
        f"GPU: {meta.get('gpu', 'unknown')}; measured {meta.get('date', '?')}. Workload: "
        f"{meta.get('num_prompts')} requests x {meta.get('prompt_len')} prompt + "
        f"{meta.get('output_len')} generated tokens, max_num_seqs {meta.get('max_num_seqs')}; "
        "torch profiler (vLLM profiler_config) around the timed `generate` only. Times are "
        "under the profiler (slower than the benchmark): compare dtypes, not absolute "
        "numbers. Kernel time = sum of device kernel durations (CUDA-graph replays included); "
        "`idle` = timed wall - kernel time (host-bound gaps, if kernels do not overlap).",
        "",
    ]
    for err in errors or []:
        lines.append(f"**error:** {err}")
    if errors:
        lines.append("")
    if not profiles:
        lines.append("No profile could be read.")
        return "\n".join(lines) + "\n"

    head = "| category |" + "".join(f" {x} ms | share |" for x in labels)
    sep = "|---|" + "---|---|" * len(labels)
    if base is not None and len(profiles) > 1:
        others = [p for p in profiles if p is not base]
        head += "".join(f" {p.label} - {base.label} ms |" for p in others)
        sep += "---|" * len(others)
    else:
        others = []
    cats = [p.categories() for p in profiles]
    names = [c for c in CATEGORY_ORDER if any(c in x for x in cats)]
    names += [NOT_LISTED] if any(NOT_LISTED in x for x in cats) else []
    lines += ["## Kernel time by category", "", head, sep]

    def row(title: str, vals: list[float], share: bool = True) -> str:
        cells = "".join(
            f" {_ms(v)} | {_pct(v, p.device_total_us) if share else ''} |"
            for v, p in zip(vals, profiles, strict=True)
        )
        if others and base is not None:
            b = vals[profiles.index(base)]
            cells += "".join(f" {_ms(vals[profiles.index(p)] - b)} |" for p in others)
        return f"| {title} |{cells}"

    for name in names:
        lines.append(row(name, [c.get(name, 0.0) for c in cats]))
    lines.append(row("**kernel time total**", [p.device_total_us for p in profiles]))
    if all(p.elapsed_s for p in profiles):
        walls = [float(p.elapsed_s or 0) * 1e6 for p in profiles]
        lines.append(row("timed wall (profiled)", walls, share=False))
        idle = [w - p.device_total_us for w, p in zip(walls, profiles, strict=True)]
        lines.append(row("idle = wall - kernel time", idle, share=False))
    lines.append("")

    steps_rows = []
    for kind in ("with prefill", "decode only"):
        cells = []
        for p in profiles:
            s = (p.totals.get("steps") or {}).get(kind)
            if not s:
                cells.append(" | | |")
                continue
            cells.append(f" {int(s['steps'])} | {_ms(s['gpu_span_us'])} | {_ms(s['host_us'])} |")
        steps_rows.append(f"| {kind} |" + "".join(cells))
    if any(p.totals.get("steps") for p in profiles):
        lines += [
            "## Steps (vLLM's `execute_context_*` annotations)",
            "",
            "GPU span = first to last kernel of the step's forward; host = CPU time inside "
            "`execute_model` for those steps.",
            "",
            "| steps |" + "".join(f" {x} steps | GPU span ms | host ms |" for x in labels),
            "|---|" + "---|---|---|" * len(labels),
            *steps_rows,
            "",
        ]

    for p in profiles:
        lines += [
            f"## Top {top} kernels: {p.label}",
            "",
            f"Source: {p.source}; {len(p.kernels)} kernels listed, kernel time "
            f"{_ms(p.device_total_us)} ms." + "".join(f" {n}." for n in p.notes),
            "",
            "| # | kernel | category | ms | share | calls | avg us |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, (name, us, calls) in enumerate(p.kernels[:top], 1):
            avg = f"{us / calls:,.1f}" if calls else ""
            lines.append(
                f"| {i} | {_cell(name)} | {kernel_category(name)} | {_ms(us)} "
                f"| {_pct(us, p.device_total_us)} | {calls:,} | {avg} |"
            )
        lines.append("")

    range_names: list[str] = []
    for p in profiles:
        for r in p.ranges:
            if r[0] not in range_names:
                range_names.append(r[0])
    if range_names:
        lines += [
            "## Host ranges (CPU total; `kvarn: *` from kvarn-vllm, others vLLM's scopes)",
            "",
            "`device ms` = kernels launched inside the range outside CUDA graphs (captured "
            "decode replays are not attributed to ranges).",
            "",
            "| range |" + "".join(f" {x} CPU ms | calls | device ms |" for x in labels),
            "|---|" + "---|---|---|" * len(labels),
        ]
        for rn in range_names:
            cells = []
            for p in profiles:
                hit = next((r for r in p.ranges if r[0] == rn), None)
                cells.append(f" {_ms(hit[1])} | {hit[2]:,} | {_ms(hit[3])} |" if hit else " | | |")
            lines.append(f"| {_cell(rn)} |" + "".join(cells))
        lines.append("")
    for p in profiles:
        if not p.host_self:
            continue
        total = float(p.totals.get("host_self_cpu_us") or 0.0)
        lines += [
            f"## Top host ops by self CPU time: {p.label}",
            "",
            "| op | self CPU ms | share | calls |",
            "|---|---|---|---|",
        ]
        for name, us, calls in p.host_self[:15]:
            lines.append(f"| {_cell(name)} | {_ms(us)} | {_pct(us, total)} | {calls:,} |")
        lines.append("")
    return "\n".join(lines)


def write_profile_summary(
    out: Path, rows: list[dict[str, Any]], meta: dict[str, Any], baseline: str
) -> list[str]:
    """Write ``out/profile.md`` from the rows' profile files; returns the errors."""
    from gpu_e2e import file_safe  # here, not at import: the worker functions load anywhere

    profiles: list[DtypeProfile] = []
    errors: list[str] = []
    for r in rows:
        if not (r.get("profiled") or r.get("profile_file")):
            continue
        label = r["label"]
        path = out / (r.get("profile_file") or f"profile_{file_safe(label)}.txt")
        if r.get("status") != "ok":
            errors.append(f"{label}: run {r.get('status')}; reading whatever profile it left")
        try:
            prof = load_profile(path, label, r.get("elapsed_s"))
        except (ProfileTableError, ValueError) as exc:
            errors.append(f"{label}: {exc}")
            continue
        profiles.append(prof)
        if prof.device_total_us <= 0:
            errors.append(f"{label}: no device kernel time in {path.name} (CUDA not recorded?)")
    text = render_profile_md(profiles, meta, baseline, errors)
    (out / "profile.md").write_text(text)
    return errors
