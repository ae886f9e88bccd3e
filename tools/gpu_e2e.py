#!/usr/bin/env python3
"""End-to-end check of the KVarN vLLM plugin on a GPU: greedy agreement, NaNs, CUDA graphs.

For every cache dtype asked for, one vLLM engine runs in its own subprocess (one engine per
process, a timeout each, a crash becomes an error row) on the same token-id prompts, with
dummy weights of the Qwen3-8B architecture:

* greedy tokens of each dtype are compared with the fp16 (``auto``) run: per prompt, the
  length of the common prefix, and overall the fraction of positions that agree;
* every sampled token's logprob must be finite (a NaN or inf anywhere fails the row);
* the engine log must show CUDA graphs captured (and no downgrade to eager);
* a second ``generate`` over prompts that share prefixes with the first batch exercises
  vLLM's prefix cache (its agreement with the cold run is reported);
* the KV capacity (``num_gpu_blocks * block_size``) is reported.

Dummy weights make tokens meaningless but deterministic, so the agreement figures compare
cache dtypes with each other, not with a real model's quality (see docs/vllm-plugin.md).

Typical calls (from the repository root, after ``source .gpu/env.sh``):

    python3 tools/gpu_e2e.py --out /tmp/e2e                      # auto, fp8, tq k8v4, kvarn
    python3 tools/gpu_e2e.py --dtypes kvarn_k4v2_g128 --runners v1,v2 --out /tmp/e2e
    python3 tools/gpu_e2e.py --tp 2 --dtypes auto,kvarn_k4v2_g128 --out /tmp/e2e_tp2
    python3 tools/gpu_e2e.py --report /tmp/e2e                   # table from earlier rows
    # head size 512 (write the model with kvarn_vllm.testing.write_model_dir): vLLM's default
    # backend needs FlashAttention 4 there, TRITON_ATTN runs the fp16 row without it
    python3 tools/gpu_e2e.py --model-dir /tmp/m512 --peer-attention-backend TRITON_ATTN \
        --dtypes auto,kvarn_k4v2_g128 --out /tmp/e512

A dtype is ``NAME`` or ``NAME:MODEL_DTYPE`` (``fp8:bfloat16``: vLLM's FA3 fp8 path needs a
bf16 model). ``turboquant_*`` needs FlashAttention-2 (``gpu_bundle.py --with-fa2``).
By default engines start without torch.compile and capture full CUDA graphs for decode
batches only (``cudagraph_mode=FULL_DECODE_ONLY``), which starts in well under a minute;
``--compile`` uses vLLM's default (torch.compile + FULL_AND_PIECEWISE), closer to serving.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The Qwen3-8B architecture (public config.json values), used when no model folder is found.
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEFAULT_DTYPES = "auto,fp8:bfloat16,turboquant_k8v4,kvarn_k4v2_g128"


# ----------------------------------------------------------------------------- shared helpers


def resolve_model_dir(explicit: str | None) -> Path:
    """The Qwen3-8B config folder: ``--model-dir``, ``shared/`` in the checkout, ``../shared``,
    else a folder under the temporary directory holding the embedded config (the device only
    gets the checkout).

    That folder's name is the config's digest, the same in every process and on every
    machine: vLLM's torch.compile cache is keyed by the model path, so a fresh name per
    process made every engine compile its model anew, even with the cache carried over
    (tools/gpu_caches.py)."""
    if explicit:
        if not (Path(explicit) / "config.json").is_file():
            raise SystemExit(f"--model-dir {explicit}: no config.json there")
        return Path(explicit)
    for c in (ROOT / "shared/bench/qwen3-8b", ROOT.parent / "shared/bench/qwen3-8b"):
        if (c / "config.json").is_file():
            return c
    text = json.dumps(QWEN3_8B, indent=2)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"kvarn-qwen3-8b-{digest}"
    config = folder / "config.json"
    if not config.is_file() or config.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed, so an engine starting meanwhile never reads half a file.
        partial = folder / f"config.json.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, config)
    return folder


def parse_dtype(spec: str, default_model_dtype: str) -> tuple[str, str]:
    """``NAME[:MODEL_DTYPE]`` -> (cache dtype, model dtype)."""
    name, _, model = spec.partition(":")
    return name.strip(), (model.strip() or default_model_dtype)


def speculative_config(num_drafts: int) -> dict[str, Any] | None:
    """vLLM's GPU n-gram drafter with ``num_drafts`` tokens (None: no speculative decoding).

    GPU n-gram drafts keep vLLM's async scheduling on, whose host lengths of verify rows are
    optimistic: the case the plugin's verify path exists for. Dummy weights make greedy
    outputs repetitive, so n-gram lookups find drafts and verify rows do occur.
    """
    if num_drafts <= 0:
        return None
    return {
        "method": "ngram_gpu",
        "num_speculative_tokens": num_drafts,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def file_safe(label: str) -> str:
    """``label`` as a file-name part: every character but letters, digits and ``._-`` as
    ``_`` (the row, child, log and profile files of a row)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", label)


def row_label(
    cache_dtype: str,
    model_dtype: str,
    runner: str,
    default_model_dtype: str,
    spec_ngram: int = 0,
) -> str:
    label = cache_dtype
    if model_dtype != default_model_dtype:
        label += f":{model_dtype}"
    if runner != "default":
        label += f"@{runner}"
    if spec_ngram:
        label += f"+ngram{spec_ngram}"
    return label


def child_env(runner: str, eager_verify: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if eager_verify:  # no FULL CUDA graphs of uniform verify batches (kvarn-vllm's default)
        env["KVARN_VERIFY_CUDA_GRAPHS"] = "0"
    if runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    elif runner == "v2":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return env


def exit_on_sigterm() -> None:
    """Turn SIGTERM (what ``timeout`` sends) into ``SystemExit`` so that ``run_child`` kills the
    engine it is waiting on. Without it the engine's process group outlived a killed parent and
    freed its GPU memory during the next engine's memory profiling, which vLLM then rejects
    (ninth session)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


#: Engine processes running now (several at once when engines run on several GPUs), for
#: :func:`kill_running_children`.
_RUNNING: set[subprocess.Popen[bytes]] = set()
_RUNNING_LOCK = threading.Lock()


def run_child(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int, str]:
    """Run one engine process; kill its whole process group when it ends, on timeout, or
    when this process is stopped while waiting (see :func:`exit_on_sigterm`). Returns (rc,
    log text). Thread-safe: engines on several GPUs run it from one thread each."""
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:  # also whatever of the group outlived a finished engine
            _kill_group(proc)
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
    text = log.read_text(errors="replace")
    return rc, text


def kill_running_children() -> None:
    """Kill every engine :func:`run_child` is waiting on: what a stopped parent does when its
    waits run in other threads, which ``SystemExit`` does not reach."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the engine's process group (its EngineCore and workers too) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # the group is already empty
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


_JIT_WARNING = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")


def jit_compiles(text: str) -> list[str]:
    """Kernels vLLM's JIT monitor saw compiled after warm-up (each a latency spike), in order."""
    return _JIT_WARNING.findall(text)


def log_facts(text: str) -> dict[str, Any]:
    """What the engine log says about capacity, CUDA graphs, Triton compiles after start-up
    and the KVarN plugin."""
    facts: dict[str, Any] = {"jit_compiles_while_serving": jit_compiles(text)}
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", text)
    if m:
        facts["vllm_kv_tokens_log"] = int(m.group(1).replace(",", ""))
    m = re.search(
        r"kvarn: worker 0 KV cache capacity ([\d,]+) tokens.*?; ([\d.]+|nan)x an fp16", text
    )
    if m:
        facts["kvarn_kv_tokens_log"] = int(m.group(1).replace(",", ""))
        facts["kvarn_ratio_vs_fp16_same_memory"] = float(m.group(2))
    facts["cuda_graphs_captured"] = bool(
        re.search(r"Graph capturing finished|Capturing CUDA graphs", text)
    )
    downgrade = re.findall(r"setting cudagraph_mode=\w+|Overriding cudagraph_mode[^\n]*", text)
    if downgrade:
        facts["cudagraph_downgrades"] = sorted(set(downgrade))
    if "kvarn:" in text:
        facts["kvarn_log"] = [ln.strip() for ln in text.splitlines() if "kvarn:" in ln][:12]
    return facts


#: The exception line vLLM's engine core logs for the failure it dies of (the front end's own
#: traceback, the log's tail, only says the engine failed to start).
_ENGINE_EXCEPTION = re.compile(r"\bERROR\b[^\]]*\]\s+(\w+(?:Error|Exception)\b.*)")


def error_tail(text: str, lines: int = 12) -> str:
    """The log's last lines up to its last error line, led by the engine core's own last
    exception line (the root cause) when the engine logged one."""
    keep = [ln for ln in text.splitlines() if ln.strip()]
    tail = keep[-lines:]
    for i in range(len(keep) - 1, -1, -1):
        if "Error" in keep[i] or "error" in keep[i]:
            tail = keep[max(0, i - lines + 1) : i + 1]
            break
    causes = [m.group(1) for m in map(_ENGINE_EXCEPTION.search, keep) if m]
    return "\n".join(([f"root cause: {causes[-1]}"] if causes else []) + tail)


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


def check_plugin_entry_point() -> str | None:
    """None when vLLM will find the kvarn entry point in its own processes, else a warning."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    if "kvarn" not in names:
        return (
            "the kvarn vllm.general_plugins entry point is not installed (engine processes "
            "started with 'spawn' will reject kvarn dtypes); source .gpu/env.sh first"
        )
    return None


# ----------------------------------------------------------------------------- child


def make_prompts(seed: int, num: int, lengths: list[int], vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab - 100) for _ in range(lengths[i % len(lengths)])]
        for i in range(num)
    ]


def engine_kwargs(
    args: argparse.Namespace, cache_dtype: str, model_dtype: str, model_dir: Path
) -> dict[str, Any]:
    """The ``LLM`` arguments of one row."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=model_dtype,
        kv_cache_dtype=cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_mem_util,
        tensor_parallel_size=args.tp,
        enable_prefix_caching=True,
        seed=args.seed,
    )
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    # vLLM's GPU n-gram drafter is a torch.compile'd module ("No compilation mode is set"
    # without compilation, H200): drafts run with vLLM's default compilation
    if not args.compile and not args.spec_ngram:
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    spec = speculative_config(args.spec_ngram)
    if spec:
        kwargs["speculative_config"] = spec
    # KVarN rows are routed to the plugin's backend by their dtype; the others may be pinned
    # (e.g. TRITON_ATTN at head size 512, where vLLM's default needs FlashAttention 4)
    if args.peer_attention_backend and not cache_dtype.startswith("kvarn"):
        kwargs["attention_backend"] = args.peer_attention_backend
    return kwargs


def child_main(args: argparse.Namespace) -> int:
    import torch

    cache_dtype, model_dtype = args.child_dtype, args.model_dtype
    if cache_dtype.startswith("kvarn"):
        import kvarn_vllm

        kvarn_vllm.ensure_registered()
    from vllm import LLM, SamplingParams

    model_dir = resolve_model_dir(args.model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    prompts = make_prompts(args.seed, args.num_prompts, lengths, vocab)
    # Second batch: each prompt keeps its first half and gets a new tail, so vLLM's prefix
    # cache hits on whole blocks that the first batch computed (sinks and packed tiles).
    tails = make_prompts(args.seed + 1, args.num_prompts, [32], vocab)
    rerun = [p[: len(p) // 2] + t for p, t in zip(prompts, tails, strict=True)]

    kwargs = engine_kwargs(args, cache_dtype, model_dtype, model_dir)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    sp = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1
    )

    def gen(batch: list[list[int]]) -> tuple[list[list[int]], int, float]:
        t = time.perf_counter()
        # Token-id prompts (vLLM's TokensPrompt dicts; typed loosely for its overloads).
        prompts: list[Any] = [{"prompt_token_ids": p} for p in batch]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens, bad = [], 0
        for o in outs:
            comp = o.outputs[0]
            tokens.append(list(comp.token_ids))
            for entry in comp.logprobs or []:
                for lp in entry.values():
                    if not math.isfinite(lp.logprob):
                        bad += 1
        return tokens, bad, elapsed

    cold, bad_cold, t_cold = gen(prompts)
    warm, bad_warm, t_warm = gen(rerun)
    # The same prompts again: every full block but the last is a prefix-cache hit (retired
    # fp16 sinks and packed tiles); compared with this dtype's own cold run.
    same, bad_same, _ = gen(prompts)
    result = {
        "cache_dtype": cache_dtype,
        "model_dtype": model_dtype,
        "runner": args.runner,
        "tp": args.tp,
        "spec_ngram": args.spec_ngram,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
        "startup_s": round(startup, 1),
        "generate_s": round(t_cold, 2),
        "prefix_rerun_s": round(t_warm, 2),
        "non_finite_logprobs": bad_cold + bad_warm + bad_same,
        "tokens": cold,
        "rerun_tokens": warm,
        "same_prompt_rerun_match": agreement(cold, same)["token_match"],
        "cudagraph_mode_requested": str(
            llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
        ),
        "torch": torch.__version__,
    }
    Path(args.child_out).write_text(json.dumps(result))
    print(f"kvarn-e2e child done: {cache_dtype} kv_tokens={result['kv_tokens']:,}", flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Greedy agreement of two runs over the same prompts."""
    same = total = 0
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        total += n
        same += sum(1 for i in range(n) if x[i] == y[i])
        k = 0
        while k < n and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    return {
        "token_match": round(same / total, 4) if total else float("nan"),
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1) if prefixes else 0.0,
        "exact_sequences": sum(1 for x, y in zip(a, b, strict=True) if x == y),
    }


def summarize(rows: list[dict[str, Any]], baseline_label: str | None) -> str:
    by_label = {r["label"]: r for r in rows}
    base = by_label.get(baseline_label or "")
    if base is None and baseline_label:
        # a run with drafts labels its fp16 row "auto+ngramN": compare with that one
        drafted = [r for label, r in by_label.items() if label.startswith(baseline_label + "+")]
        base = drafted[0] if len(drafted) == 1 else None
    head = (
        "| dtype | status | KV tokens | vs fp16 | greedy match vs fp16 | mean common prefix "
        "| exact seqs | non-finite logprobs | CUDA graphs | prefix-rerun match vs fp16 "
        "| cached rerun vs own cold run | start s | generate s |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {r.get('status')} | | | | | | | | | | | |")
            continue
        ratio = agree = prefix = exact = rerun = ""
        if base and base.get("status") == "ok" and base.get("kv_tokens"):
            ratio = f"{r['kv_tokens'] / base['kv_tokens']:.2f}"
            a = agreement(base["tokens"], r["tokens"])
            agree, prefix, exact = (
                f"{a['token_match']:.3f}",
                f"{a['mean_common_prefix']}",
                (f"{a['exact_sequences']}/{len(r['tokens'])}"),
            )
            rerun = f"{agreement(base['rerun_tokens'], r['rerun_tokens'])['token_match']:.3f}"
        graphs = "yes" if r.get("cuda_graphs_captured") else "NO"
        if r.get("cudagraph_downgrades"):
            graphs += " (downgraded)"
        # Triton compiles after start-up land in the first generate: say so next to its time
        compiles = r.get("jit_compiles_while_serving") or []
        generate = f"{r.get('generate_s', '')}"
        if compiles:
            generate += f" ({len(compiles)} Triton compiles: {', '.join(compiles)})"
        lines.append(
            f"| {r['label']} | ok | {r['kv_tokens']:,} | {ratio} | {agree} | {prefix} | {exact} "
            f"| {r['non_finite_logprobs']} | {graphs} | {rerun} "
            f"| {r.get('same_prompt_rerun_match', '')} | {r['startup_s']} "
            f"| {generate} |"
        )
    return "\n".join(lines)


def load_rows(out: Path) -> list[dict[str, Any]]:
    """Rows of ``out``: those of the ``results.json`` a device run left, each replaced by its
    ``row_*.json`` file where there is one (a later run's row of the same label).

    ``results.json`` (meta and every row in one file) is what to copy to the device tool's
    ``$OUT``, which returns only so many files (the fifteenth session's fetch kept one row
    file of two); ``--report --out DIR`` reads it back here.
    """
    by_label: dict[str, dict[str, Any]] = {}
    if (out / "results.json").is_file():
        for row in json.loads((out / "results.json").read_text())["rows"]:
            by_label[str(row.get("label"))] = row
    for f in sorted(out.glob("row_*.json")):
        row = json.loads(f.read_text())
        by_label[str(row.get("label"))] = row
    return sorted(by_label.values(), key=lambda r: r.get("order", 0))


def write_results(out: Path, rows: list[dict[str, Any]]) -> None:
    """One file with the meta data and every row (for ``$OUT``)."""
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}))


def load_meta(out: Path) -> dict[str, Any]:
    if (out / "meta.json").is_file():
        meta: dict[str, Any] = json.loads((out / "meta.json").read_text())
        return meta
    if (out / "results.json").is_file():
        return dict(json.loads((out / "results.json").read_text()).get("meta", {}))
    return {}


def parent_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        rows = load_rows(out)
        print(summarize(rows, args.baseline))
        return 0
    warn = check_plugin_entry_point()
    if warn:
        print(f"WARNING: {warn}", flush=True)
    runners = [r.strip() for r in args.runners.split(",")]
    jobs: list[tuple[str, str, str]] = []
    for spec in args.dtypes.split(","):
        cache_dtype, model_dtype = parse_dtype(spec, args.model_dtype)
        use = runners if cache_dtype.startswith("kvarn") else ["default"]
        jobs += [(cache_dtype, model_dtype, r) for r in use]
    meta = {"gpu": gpu_name(), "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    order0 = len(list(out.glob("row_*.json")))
    for i, (cache_dtype, model_dtype, runner) in enumerate(jobs):
        label = row_label(cache_dtype, model_dtype, runner, args.model_dtype, args.spec_ngram)
        safe = file_safe(label)
        child_out = out / f"child_{safe}.json"
        log = out / f"log_{safe}.txt"
        child_out.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--child-dtype",
            cache_dtype,
            "--model-dtype",
            model_dtype,
            "--runner",
            runner,
            "--child-out",
            str(child_out),
            "--tp",
            str(args.tp),
            "--seed",
            str(args.seed),
            "--num-prompts",
            str(args.num_prompts),
            "--prompt-lens",
            args.prompt_lens,
            "--max-tokens",
            str(args.max_tokens),
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--gpu-mem-util",
            str(args.gpu_mem_util),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens or 0),
            "--spec-ngram",
            str(args.spec_ngram),
            "--peer-attention-backend",
            args.peer_attention_backend,
        ]
        if args.model_dir:
            cmd += ["--model-dir", args.model_dir]
        if args.compile:
            cmd.append("--compile")
        print(f"[{i + 1}/{len(jobs)}] {label} ...", flush=True)
        t0 = time.perf_counter()
        rc, text = run_child(cmd, child_env(runner, args.eager_verify), log, args.timeout)
        row: dict[str, Any] = {
            "label": label,
            "order": order0 + i,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        row.update(log_facts(text))
        if rc == 0 and child_out.is_file():
            row.update(json.loads(child_out.read_text()))
            if row["non_finite_logprobs"]:
                row["status"] = "NaN/inf logprobs"
            elif args.require_graphs and not row.get("cuda_graphs_captured"):
                row["status"] = "no CUDA graphs"
            else:
                row["status"] = "ok"
        else:
            row["status"] = "timeout" if rc == 124 else f"error rc={rc}"
            row["error"] = error_tail(text)
            print(row["error"], flush=True)
        (out / f"row_{safe}.json").write_text(json.dumps(row))
        print(f"    -> {row['status']} in {row['wall_s']} s", flush=True)
    rows = load_rows(out)
    write_results(out, rows)
    table = summarize(rows, args.baseline)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma list of NAME[:MODEL_DTYPE]")
    ap.add_argument(
        "--runners",
        default="default",
        help="for kvarn dtypes: comma list of default, v1, v2 (VLLM_USE_V2_MODEL_RUNNER)",
    )
    ap.add_argument("--model-dtype", default="float16")
    ap.add_argument("--baseline", default="auto", help="row label the others are compared with")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (2 on nvidia-h200-x2)")
    ap.add_argument(
        "--spec-ngram",
        type=int,
        default=0,
        help="speculative decoding with this many GPU n-gram drafts (rows labelled +ngramN, "
        "compared with auto+ngramN when the baseline has drafts too; implies --compile: the "
        "drafter needs vLLM's compilation)",
    )
    ap.add_argument(
        "--eager-verify",
        action="store_true",
        help="with --spec-ngram: KVARN_VERIFY_CUDA_GRAPHS=0 in the engines (uniform verify "
        "batches eager, vLLM on piecewise graphs; by default they are FULL CUDA graphs)",
    )
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument(
        "--prompt-lens",
        default="200,700,1500,3000",
        help="prompt lengths, cycled over the prompts (3000 > the batch budget "
        "exercises chunked prefill)",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--gpu-mem-util", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument(
        "--peer-attention-backend",
        default="",
        help="vLLM attention backend of the non-KVarN rows (e.g. TRITON_ATTN); default vLLM's",
    )
    ap.add_argument("--compile", action="store_true", help="vLLM's default torch.compile + graphs")
    ap.add_argument(
        "--require-graphs",
        action="store_true",
        help="mark rows without CUDA graphs in the log as failures",
    )
    ap.add_argument("--timeout", type=float, default=480, help="seconds per engine process")
    ap.add_argument("--out", default="gpu_e2e_out", help="folder for rows, logs and summary.md")
    ap.add_argument("--report", action="store_true", help="only print the table of --out")
    # child-only
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--runner", default="default", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        if not args.max_num_batched_tokens:
            args.max_num_batched_tokens = None
        return child_main(args)
    exit_on_sigterm()
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
