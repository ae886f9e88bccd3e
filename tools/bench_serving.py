#!/usr/bin/env python3
"""Serving benchmark: the project's standard burst workload, one vLLM engine per cache dtype.

The workload (docs in ../shared/docs/gpu.md): Qwen3-8B architecture with dummy weights,
256 requests of 6144 random prompt tokens each, 512 generated tokens each (``ignore_eos``),
``dtype=float16``, ``gpu_memory_utilization=0.90``, ``max_model_len=16384``,
``max_num_seqs=256``, CUDA graphs on (vLLM's default torch.compile + FULL_AND_PIECEWISE).
For every cache dtype one engine runs in its own subprocess; it reports vLLM's KV capacity
(``num_gpu_blocks * block_size``) and total tokens/s (prompt + generated) over the timed
``generate`` call. A short warm-up ``generate`` runs first (it JIT-compiles the Triton
kernels of every path: first chunk, continuation, decode, flush), untimed.

Each row is written to ``--out`` as JSON as soon as it finishes, so a run can be split over
several calls (each engine start costs about 150 s the first time and about 30 s with a warm
compile cache); the table is rebuilt from every row in ``--out`` and ``results.json`` holds
them all in one file. With ``--resume`` a call skips the dtypes whose row in ``--out`` is
already ``ok``, so a call that the device's 600 s limit cut short is re-issued unchanged and
goes on where it stopped (sixteenth session: the full table took four calls).
``--warm-only`` starts each engine and runs only its warm-up (rows ``warmed``, never in the
docs): it fills the machine's compile caches, which ``tools/gpu_caches.py`` carries to the next
machine, where an engine then loads its compiled model (nineteenth session: torch.compile 9 s
in all, against 27-34 s cold).
``--gpus N`` (the device tool's 2-GPU kind) runs N engines at once, one per GPU, each a
separate process with its own ``CUDA_VISIBLE_DEVICES``: the baseline (fp16) runs first on
every GPU, as ``auto`` on GPU 0 and ``auto[gpu 1]``..., the other rows go in order to the
next free GPU, and every row's ratios are against the baseline row of its own GPU (the two
baseline rows also show how alike the GPUs are). All of issue 4's rows then take about half
the wall time of one GPU: one session's device time instead of two.
``--write-docs`` replaces the serving section of docs/benchmarks.md with the table (other
sections are kept). On the device tool, copy ``results.json`` to
``$OUT`` and write the docs here with ``--report``:

    # device (one dtype per call; /tmp/bench persists while the machine stays warm)
    python3 tools/bench_serving.py --dtypes auto --out /tmp/bench && cp /tmp/bench/results.json /tmp/bench/summary.md $OUT/
    python3 tools/bench_serving.py --dtypes kvarn_k4v2_g128 --out /tmp/bench && cp /tmp/bench/results.json /tmp/bench/summary.md $OUT/
    # here, with the fetched results.json in DIR
    python3 tools/bench_serving.py --report --out DIR --write-docs
    # a smaller workload
    python3 tools/bench_serving.py --num-prompts 64 --prompt-len 2048 --output-len 128 --out /tmp/small

Agent workload (``--workload agents``): what KV capacity buys when it is the limit. Each of
``--num-prompts`` conversations starts from its own ``--prompt-len``-token prefix (system
prompt and task); ``--turns`` times, a ``--tool-len``-token tool result is appended and
``--output-len`` tokens are generated, all conversations' turns in one ``generate`` call, the
next turn's prompt being the whole conversation so far. Prefix caching is on (vLLM's
default), so a turn recomputes only what the cache lost since the previous turn: with more
conversations than an fp16 cache holds, fp16 evicts and recomputes, a cache with 4x the
tokens does not. Reported per dtype: total tok/s over all turns ((prompt + generated) / time,
prompt tokens counting cached ones, as the burst does), the prefix-cache hit share (vLLM's
``num_cached_tokens`` over prompt tokens) and each turn's time. Defaults: 256 conversations,
4096-token prefixes, 4 turns of 512 + 128 tokens (6,656 tokens per conversation at the end:
1.7M tokens in all, more than fp16's and fp8's capacity on the H200, less than
``kvarn_k4v2_g128``'s), written to the docs' agent section.

    python3 tools/bench_serving.py --workload agents --dtypes auto,kvarn_k4v2_g128 --out /tmp/ag

Profiled burst (``--profile``): where does each dtype's time go? The child engine gets vLLM's
torch profiler (``profiler_config``: stacks, shapes, memory and FLOPs off) and
``LLM.start_profile()`` / ``stop_profile()`` around the timed ``generate``; profile a window
of engine steps (``--profile-steps SKIP,COUNT``: vLLM's ``delay_iterations`` /
``max_iterations``) or use a smaller ``--num-prompts`` (a profile of the whole burst is slow
and large), and keep the prompt and output lengths. The child also sets
``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` (vLLM's and kvarn-vllm's host ranges:
``gpu_model_runner: *``, ``schedule: *``, ``kvarn: build``, ``kvarn: direct flush``...) and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the engine's own
IPC: it lets the child send two small functions to its worker with ``collective_rpc``: one
drops the chrome-trace export, which only costs time here as nothing can fetch a trace of
hundreds of MB, unless ``--profile-trace``; one builds the tables below from the
profiler's ``key_averages()``). Per dtype the child writes ONE text file next to its row,
``profile_<label>.txt``, with sections: device kernels only (sorted by self CUDA time, names
up to 140 characters), host ranges (CPU total), the top host ops by self CPU time, totals
(including GPU and host time per step kind, from vLLM's ``execute_context_*`` step
annotations) and vLLM's own ``profiler_out_0.txt`` table. The parent parses them (column
positions from each table's header line, us/ms/s units) and writes ``profile.md``: per dtype
the top kernels with their share, kernel time grouped by category side by side, host ranges
side by side. Profiled rows are marked in ``summary.md`` and refused by ``--write-docs``
(profiling slows the run: they are not benchmark numbers). ``--report`` rebuilds
``profile.md`` from a fetched folder (``results.json`` + ``profile_*.txt``). The profiling
code (the child's collection, the table parser, ``profile.md``) is in ``serving_profile.py``.

    # device: both dtypes in one call, kvarn first (it matters most if time runs out).
    # The fourth session's 96-prompt profile of the whole timed run did not finish in 260 s
    # for kvarn; a window of 60 steps of the standard burst (mixed prefill and decode steps,
    # after ~40 prefill-heavy ones) bounds the profiler's cost instead.
    source .gpu/env.sh >/dev/null && rm -rf /tmp/prof && python3 tools/bench_serving.py \
        --dtypes kvarn_k4v2_g128,auto --profile --profile-steps 40,60 --timeout 290 \
        --out /tmp/prof; cp /tmp/prof/profile.md /tmp/prof/results.json \
        /tmp/prof/profile_*.txt $OUT/; tail -n 4 /tmp/prof/log_*.txt
    # here: copy the fetched files to a writable DIR (--report rewrites summary.md there)
    python3 tools/bench_serving.py --report --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e as common
from serving_profile import collect_profile, profile_env, profiler_config, write_profile_summary

DOCS = common.ROOT / "docs" / "benchmarks.md"
#: Printed by the child right before the timed ``generate``.
TIMED_MARK = "kvarn-bench: timed generate starts"
START = "<!-- serving:start -->"
END = "<!-- serving:end -->"
#: docs/benchmarks.md markers of each workload's section
MARKERS = {"burst": (START, END), "agents": ("<!-- agents:start -->", "<!-- agents:end -->")}
#: Per-workload defaults of the length options (``None`` on the command line).
WORKLOAD_DEFAULTS = {
    "burst": {"prompt_len": 6144, "output_len": 512},
    "agents": {"prompt_len": 4096, "output_len": 128},
}
#: What issue 4's table needs in one run: fp16, fp8 (bf16 model: vLLM's FA3 fp8 path needs
#: it), TurboQuant's k3v4_nc preset and every dense KVarN format. Measured walls per row on
#: an H200 (sixteenth session): fp16 296 s as a fresh machine's first engine, KVarN 160-173
#: s, TurboQuant 326 s with warm caches and ~480 s without (217 s of start-up: its Triton
#: kernels compile during graph capture), so ~2,000 s in all: split it over device calls
#: (each at most 600 s) with ``--dtypes`` and ``--resume`` into one ``--out``, or run it on
#: two GPUs at once (``--gpus 2``, ~1,000 s). Seventeenth session, warm machine: fp8 180 s,
#: KVarN 158-204 s (``kvarn_k5v5_g64`` the longest).
DEFAULT_DTYPES = ",".join(
    (
        "auto",
        "fp8:bfloat16",
        "turboquant_k3v4_nc",
        "kvarn_k4v2_g128",
        "kvarn_k4v4_g128",
        "kvarn_k4v2_g64",
        "kvarn_k4v4_g64",
        "kvarn_k5v5_g64",
    )
)


def child_main(args: argparse.Namespace) -> int:
    cache_dtype, model_dtype = args.child_dtype, args.model_dtype
    if cache_dtype.startswith("kvarn"):
        import kvarn_vllm

        kvarn_vllm.ensure_registered()
    import torch
    from vllm import LLM, SamplingParams

    model_dir = common.resolve_model_dir(args.model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(args.seed)
    # Token-id prompts (vLLM's TokensPrompt dicts; typed loosely for its overloads).
    prompts: list[Any] = [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]}
        for _ in range(args.num_prompts)
    ]
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
        seed=args.seed,
    )
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    prof_dir = Path(args.profile_dir).resolve()
    if args.profile:
        prof_dir.mkdir(parents=True, exist_ok=True)
        # A table left by an earlier run must not pass for this one's.
        for stale in prof_dir.glob("profiler_out_*.txt"):
            stale.unlink()
        skip, steps = _profile_steps(args.profile_steps)
        kwargs["profiler_config"] = profiler_config(prof_dir, skip, steps)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    # Warm-up: short prompts (first chunks, decode, flush) and one prompt longer than the
    # batch budget (a chunked-prefill continuation), so the Triton kernels are compiled
    # before the timed call.
    budget = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    long_len = min(budget + 256, args.max_model_len - 16, args.prompt_len)
    # Fresh tokens, so the timed prompts get no prefix-cache hits from the warm-up.
    warm_rng = random.Random(args.seed + 1)
    warm_prompts: list[Any] = [
        {"prompt_token_ids": [warm_rng.randrange(100, vocab - 100) for _ in range(n)]}
        for n in (min(args.prompt_len, 600),) * 3 + (long_len,)
    ]
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    llm.generate(warm_prompts, warm, use_tqdm=False)
    warmup = time.perf_counter() - t
    engine_facts = {
        "cache_dtype": cache_dtype,
        "model_dtype": model_dtype,
        "runner": args.runner,
        "tp": args.tp,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
        "startup_s": round(startup, 1),
        "warmup_s": round(warmup, 1),
    }
    if args.warm_only:
        Path(args.child_out).write_text(json.dumps({**engine_facts, "warm_only": True}))
        print(f"kvarn-bench child done: {cache_dtype} warmed", flush=True)
        return 0
    sp = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if args.profile:
        llm.start_profile()
    print(TIMED_MARK, flush=True)  # the parent counts the Triton compiles logged after it
    workload: dict[str, Any] = {}
    if args.workload == "agents":

        def generate(batch: list[list[int]]) -> list[tuple[list[int], int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
            return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

        prefixes = [list(p["prompt_token_ids"]) for p in prompts]
        workload = run_agent_turns(generate, prefixes, args.turns, args.tool_len, rng, vocab)
        elapsed = sum(workload["turn_s"])
        generated, prompt_tokens = workload["generated_tokens"], workload["prompt_tokens"]
        num_requests = len(prompts) * args.turns
    else:
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
        num_requests = len(outs)
    profile_info: dict[str, Any] = {}
    if args.profile:
        profile_info = collect_profile(
            llm, prof_dir, Path(args.child_profile_out), keep_trace=args.profile_trace
        )
    result = {
        **engine_facts,
        "elapsed_s": round(elapsed, 2),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "total_tok_s": round((prompt_tokens + generated) / elapsed, 1),
        "output_tok_s": round(generated / elapsed, 1),
        "requests": num_requests,
        "workload": args.workload,
        **workload,
    }
    result.update(profile_info)
    Path(args.child_out).write_text(json.dumps(result))
    print(f"kvarn-bench child done: {cache_dtype} {result['total_tok_s']} tok/s", flush=True)
    return 0


def run_agent_turns(
    generate: Callable[[list[list[int]]], list[tuple[list[int], int]]],
    prefixes: list[list[int]],
    turns: int,
    tool_len: int,
    rng: random.Random,
    vocab: int,
) -> dict[str, Any]:
    """The agent workload's turns (module docstring): ``generate`` takes every conversation's
    prompt and returns each one's generated tokens and prefix-cache hit count."""
    history = [list(p) for p in prefixes]
    prompt_tokens = generated = cached = 0
    turn_s: list[float] = []
    for _ in range(turns):
        for h in history:
            h.extend(rng.randrange(100, vocab - 100) for _ in range(tool_len))
        t = time.perf_counter()
        outs = generate([list(h) for h in history])
        turn_s.append(time.perf_counter() - t)
        for h, (tokens, hits) in zip(history, outs, strict=True):
            prompt_tokens += len(h)
            cached += hits
            generated += len(tokens)
            h.extend(tokens)
    return {
        "turns": turns,
        "tool_len": tool_len,
        "turn_s": [round(x, 4) for x in turn_s],
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "cached_tokens": cached,
        "prefix_cache_hit": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
    }


def _profile_steps(spec: str) -> tuple[int, int]:
    """``--profile-steps SKIP,COUNT`` as integers (``""``: the whole run, ``(0, 0)``)."""
    if not spec:
        return 0, 0
    try:
        skip, count = (int(x) for x in spec.split(","))
    except ValueError:
        msg = f"--profile-steps takes SKIP,COUNT (two integers), got {spec!r}"
        raise SystemExit(msg) from None
    if skip < 0 or count < 1:
        raise SystemExit(f"--profile-steps needs SKIP >= 0 and COUNT >= 1, got {spec!r}")
    return skip, count


def child_outcome(rc: int, child_out: Path, log_text: str) -> dict[str, Any]:
    """A row's result fields from its engine process's exit code and result file.

    The child writes ``child_out`` right after its timed ``generate`` (``--warm-only``: after
    its warm-up, the row's status then ``warmed``), so a timeout after that
    (vLLM's engine teardown: the seventh session's fp16 run finished its measurement and was
    killed at the limit while shutting down) loses no measurement: the row is ok and says it
    was killed. Without the file, a timeout or a failure is the row's status.
    """
    if child_out.is_file() and rc in (0, 124):
        fields: dict[str, Any] = json.loads(child_out.read_text())
        fields["status"] = "warmed" if fields.get("warm_only") else "ok"
        if rc == 124:
            fields["killed_after_timed_run"] = True
        return fields
    return {
        "status": "timeout" if rc == 124 else f"error rc={rc}",
        "error": common.error_tail(log_text),
    }


def table(rows: list[dict[str, Any]], baseline: str) -> str:
    """The markdown table; every row's ratios are against the baseline row of the GPU it ran
    on (``--gpus``; rows of a single-GPU run have no ``gpu`` and share one baseline)."""
    bases = {
        int(r.get("gpu") or 0): r
        for r in rows
        if r.get("status") == "ok" and r["label"] == gpu_label(baseline, int(r.get("gpu") or 0))
    }
    several_gpus = any(r.get("gpu") for r in rows)
    lines = [
        "| `--kv-cache-dtype` | KV capacity (tokens) | vs fp16 | total tok/s | vs fp16 "
        "| output tok/s | timed s | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gpu = int(r.get("gpu") or 0)
        name = r["label"]
        if several_gpus and name != gpu_label(baseline, gpu):
            name += f" (GPU {gpu})"
        if r.get("status") == "warmed":
            lines.append(
                f"| {name} | {r['kv_tokens']:,} | | | | | | warmed (--warm-only, no timed run): "
                f"start-up {r['startup_s']} s, warm-up {r['warmup_s']} s, wall {r['wall_s']} s |"
            )
            continue
        if r.get("status") != "ok":
            err = (r.get("error") or "").splitlines()[-1:] or [""]
            lines.append(f"| {name} | | | | | | | {r.get('status')}: {err[0][:80]} |")
            continue
        base = bases.get(gpu)
        cap = tput = ""
        if base:
            cap = f"{r['kv_tokens'] / base['kv_tokens']:.2f}" if base["kv_tokens"] else ""
            tput = f"{r['total_tok_s'] / base['total_tok_s']:.2f}"
        status = "ok (profiled: not a benchmark number)" if r.get("profiled") else "ok"
        if "prefix_cache_hit" in r:
            status += f"; prefix-cache hits {100 * r['prefix_cache_hit']:.0f}%"
        if r.get("killed_after_timed_run"):
            status += "; killed at --timeout in engine teardown, after its timed run"
        if r.get("jit_compiles_timed"):
            # each one stalled the timed run for seconds (vLLM's JIT monitor)
            status += f"; {len(r['jit_compiles_timed'])} Triton compiles in the timed run"
        lines.append(
            f"| {name} | {r['kv_tokens']:,} | {cap} | {r['total_tok_s']:,.0f} | {tput} "
            f"| {r['output_tok_s']:,.0f} | {r['elapsed_s']} | {status} |"
        )
    return "\n".join(lines)


def section(rows: list[dict[str, Any]], meta: dict[str, Any], baseline: str) -> str:
    cmds = list(dict.fromkeys(meta.get("commands", [])))  # run order: a split run reads in sequence
    first = rows[0] if rows else {}
    workload = meta.get("workload", "burst")
    start, end = MARKERS[workload]
    engine = (
        f"Qwen3-8B architecture with dummy weights, max_model_len {meta.get('max_model_len')}, "
        f"max_num_seqs {meta.get('max_num_seqs')}, gpu_memory_utilization "
        f"{meta.get('gpu_mem_util')}, TP {meta.get('tp')}, one engine per process."
    )
    if workload == "agents":
        title = (
            "## Serving: agent workload (vLLM 0.23.0, `tools/bench_serving.py --workload agents`)"
        )
        what = (
            f"{meta.get('num_prompts')} conversations, each a {meta.get('prompt_len')}-token "
            f"prefix then {meta.get('turns')} turns of {meta.get('tool_len')} tool-result "
            f"tokens + {meta.get('output_len')} generated tokens (ignore_eos), every turn's "
            "prompt the whole conversation so far, prefix caching on; "
            + engine
            + " Total tok/s = (prompt + generated tokens of all turns) / their time; prompt "
            "tokens count the prefix-cache hits, whose share is in the status column."
        )
    else:
        title = "## Serving: burst workload (vLLM 0.23.0, `tools/bench_serving.py`)"
        what = (
            f"{first.get('requests', meta.get('num_prompts'))} requests x "
            f"{meta.get('prompt_len')} prompt tokens + {meta.get('output_len')} generated "
            "tokens (ignore_eos), "
            + engine
            + " Total tok/s = (prompt + generated tokens) / time of the timed `generate` call."
        )
    body = [
        start,
        title,
        "",
        f"GPU: {meta.get('gpu', 'unknown')}; measured {meta.get('date', '')}. Workload: {what} "
        "`NAME:bfloat16` rows run the model in bf16 (vLLM's FA3 fp8 path needs it); the "
        "others in fp16.",
        "",
        table(rows, baseline),
        "",
        "Commands:",
        "",
        "```",
        *cmds,
        "```",
        end,
    ]
    return "\n".join(body)


def write_docs(text: str, workload: str = "burst") -> None:
    start, end = MARKERS[workload]
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    old = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if start in old and end in old:
        new = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _m: text, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    DOCS.write_text(new)


def planned_rows(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(cache dtype, model dtype, row label) of each ``--dtypes`` entry, in order."""
    jobs = []
    for spec in (s for s in args.dtypes.split(",") if s.strip()):
        cache_dtype, model_dtype = common.parse_dtype(spec, args.model_dtype)
        label = common.row_label(cache_dtype, model_dtype, args.runner, args.model_dtype)
        decode_variant = os.environ.get("KVARN_DECODE_VARIANT", "").strip()
        if decode_variant and cache_dtype.startswith("kvarn_"):
            label += f"[decode {decode_variant}]"  # a candidate kernel (kvarn-vllm's env)
        context = os.environ.get("KVARN_PREFILL_CONTEXT", "").strip().lower()
        if context and context != "dequant" and cache_dtype.startswith("kvarn_"):
            label += f"[context {context}]"  # the continuation chunks' method (kvarn-vllm's env)
        jobs.append((cache_dtype, model_dtype, label))
    return jobs


def gpu_label(label: str, gpu: int) -> str:
    """The label of a row that runs on every GPU (the baseline) when it runs on GPU ``gpu``:
    GPU 0 keeps the plain label, so single-GPU tables and ``--baseline`` read as before."""
    return label if gpu == 0 else f"{label}[gpu {gpu}]"


def run_rows_on_gpus(
    args: argparse.Namespace, out: Path, jobs: list[tuple[str, str, str]], done: set[str]
) -> None:
    """``--gpus N``: one engine per GPU (``--tp`` GPUs each) at a time, N at once. The
    baseline runs first on every GPU, so that each row is compared with the baseline row of
    the GPU it ran on; the other rows go, in order, to whichever GPU is free next."""
    base = next((j for j in jobs if j[2] == args.baseline), None)
    if base is None:
        raise SystemExit(
            f"--gpus {args.gpus} needs the baseline {args.baseline!r} in --dtypes: every GPU "
            "runs it first, and its rows are compared with that GPU's baseline row"
        )
    rest = [j for j in jobs if j is not base and not (args.resume and j[2] in done)]
    skipped = [j[2] for j in jobs if j is not base and j not in rest]
    for label in skipped:
        print(f"[{label}] already measured in {out} (--resume): skipped", flush=True)
    queue = list(reversed(rest))  # popped from the end: in --dtypes order
    lock = threading.Lock()

    def next_job(gpu: int, first: bool) -> tuple[str, str, str] | None:
        if first:
            label = gpu_label(base[2], gpu)
            if not (args.resume and label in done):
                return base[0], base[1], label
            print(f"[{label}] already measured in {out} (--resume): skipped", flush=True)
        with lock:
            return queue.pop() if queue else None

    def worker(gpu: int) -> None:
        devices = ",".join(str(gpu * args.tp + i) for i in range(args.tp))
        first = True
        while (job := next_job(gpu, first)) is not None:
            print(f"[GPU {gpu}] {job[2]} ...", flush=True)
            run_row(args, out, *job, first=first, gpu=gpu, devices=devices)
            first = False

    threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in range(args.gpus)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=1.0)
    except BaseException:  # SIGTERM's SystemExit reaches this thread only: stop the engines
        common.kill_running_children()
        raise


def run_row(
    args: argparse.Namespace,
    out: Path,
    cache_dtype: str,
    model_dtype: str,
    label: str,
    *,
    first: bool,
    gpu: int | None = None,
    devices: str | None = None,
) -> dict[str, Any]:
    """One engine process for one row; the row goes to ``out/row_<label>.json``. ``first``:
    the first engine of this call on its GPU (more time, see ``--first-timeout``);
    ``devices``: its ``CUDA_VISIBLE_DEVICES`` (``gpu``: their index in ``--gpus``)."""
    safe = common.file_safe(label)
    child_out = out / f"child_{safe}.json"
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
        args.runner,
        "--child-out",
        str(child_out),
        "--num-prompts",
        str(args.num_prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--gpu-mem-util",
        str(args.gpu_mem_util),
        "--tp",
        str(args.tp),
        "--seed",
        str(args.seed),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens or 0),
        "--workload",
        args.workload,
        "--turns",
        str(args.turns),
        "--tool-len",
        str(args.tool_len),
    ]
    if args.warm_only:
        cmd.append("--warm-only")
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    env = common.child_env(args.runner)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    profile_file = out / f"profile_{safe}.txt"
    if args.profile:
        profile_file.unlink(missing_ok=True)
        cmd += [
            "--profile",
            "--profile-dir",
            str(Path(args.profile_dir) / safe),
            "--child-profile-out",
            str(profile_file),
        ]
        if args.profile_trace:
            cmd.append("--profile-trace")
        if args.profile_steps:
            cmd += ["--profile-steps", args.profile_steps]
        env = profile_env(env)
    t0 = time.perf_counter()
    # The first engine of a call on a fresh machine also fills vLLM's and FlashInfer's
    # caches: ~100 s more than the next one (fourteenth session: a 107 s stretch after
    # graph capture in the first engine's log, 8 s in the second's)
    limit = (args.first_timeout or args.timeout + 120) if first else args.timeout
    rc, text = common.run_child(cmd, env, out / f"log_{safe}.txt", limit)
    row: dict[str, Any] = {
        "label": label,
        "order": time.time(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if gpu is not None:
        row.update(gpu=gpu, devices=devices)
    if args.profile:
        row.update(profiled=True, profile_file=profile_file.name)
    row.update(common.log_facts(text))
    if TIMED_MARK in text:
        timed_log = text.split(TIMED_MARK, 1)[1]
        row["jit_compiles_timed"] = common.jit_compiles(timed_log)
    row.update(child_outcome(rc, child_out, text))
    if "error" in row:
        print(row["error"], flush=True)
    (out / f"row_{safe}.json").write_text(json.dumps(row))
    where = "" if gpu is None else f" on GPU {gpu}"
    print(
        f"    -> {label}{where}: {row['status']} ({row.get('total_tok_s', '-')} tok/s, "
        f"{row.get('kv_tokens', '-')} KV tokens) in {row['wall_s']} s",
        flush=True,
    )
    return row


def parent_main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta: dict[str, Any] = common.load_meta(out)
    if not args.report:
        warn = common.check_plugin_entry_point()
        if warn:
            print(f"WARNING: {warn}", flush=True)
        meta.update(
            gpu=common.gpu_name(),
            date=time.strftime("%Y-%m-%d"),
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            gpu_mem_util=args.gpu_mem_util,
            tp=args.tp,
            gpus=args.gpus,
            profile=bool(args.profile),
            workload=args.workload,
            **(
                {"turns": args.turns, "tool_len": args.tool_len}
                if args.workload == "agents"
                else {}
            ),
        )
        command = "python3 tools/bench_serving.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        meta.setdefault("commands", [])
        if command not in meta["commands"]:
            meta["commands"].append(command)
        meta_path.write_text(json.dumps(meta, indent=2))
        jobs = planned_rows(args)
        # A warmed row stands for its dtype only in a --warm-only run.
        finished = ("ok", "warmed") if args.warm_only else ("ok",)
        done = {str(r.get("label")) for r in common.load_rows(out) if r.get("status") in finished}
        if args.gpus == 1:
            started = 0
            for cache_dtype, model_dtype, label in jobs:
                if args.resume and label in done:
                    print(f"[{label}] already measured in {out} (--resume): skipped", flush=True)
                    continue
                print(f"[{started + 1}/{len(jobs)}] {label} ...", flush=True)
                run_row(args, out, cache_dtype, model_dtype, label, first=started == 0)
                started += 1
        else:
            run_rows_on_gpus(args, out, jobs, done)
    rows = common.load_rows(out)
    if not args.report:
        common.write_results(out, rows)
    text = table(rows, args.baseline)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    profile_errors: list[str] = []
    if any(r.get("profiled") for r in rows):
        profile_errors = write_profile_summary(out, rows, meta, args.baseline)
        print(f"wrote {out / 'profile.md'}" + "".join(f"\n  {e}" for e in profile_errors))
    if args.write_docs and rows:
        if any(r.get("status") == "warmed" for r in rows):
            print(
                "refusing --write-docs: rows in this --out were only warmed (--warm-only), "
                "not measured",
                flush=True,
            )
            return 1
        if any(r.get("profiled") for r in rows):
            print(
                "refusing --write-docs: rows in this --out were profiled (slower than the "
                "benchmark); write the docs from an unprofiled run's folder",
                flush=True,
            )
            return 1
        workload = meta.get("workload", "burst")
        write_docs(section(rows, meta, args.baseline), workload)
        print(f"wrote the {workload} section of {DOCS}")
    ok = all(r.get("status") in ("ok", "warmed") for r in rows) and not profile_errors
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default=DEFAULT_DTYPES, help="comma list of NAME[:MODEL_DTYPE]")
    ap.add_argument("--model-dtype", default="float16")
    ap.add_argument("--runner", default="default", choices=["default", "v1", "v2"])
    ap.add_argument("--baseline", default="auto")
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOAD_DEFAULTS),
        default="burst",
        help="burst: the standard burst; agents: multi-turn conversations (module docstring)",
    )
    ap.add_argument("--num-prompts", type=int, default=256, help="requests or conversations")
    ap.add_argument("--prompt-len", type=int, default=None, help="6144 (burst), 4096 (agents)")
    ap.add_argument("--output-len", type=int, default=None, help="512 (burst), 128 (agents)")
    ap.add_argument("--turns", type=int, default=4, help="agents: turns per conversation")
    ap.add_argument("--tool-len", type=int, default=512, help="agents: tokens added per turn")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--gpu-mem-util", type=float, default=0.90)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="run N engines at once, one per GPU (--tp GPUs each); the baseline runs on "
        "every GPU first and each row is compared with its own GPU's baseline row",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--timeout", type=float, default=560, help="seconds per engine process")
    ap.add_argument(
        "--first-timeout",
        type=float,
        default=None,
        help="seconds for the first engine process (default: --timeout + 120, for the caches "
        "a fresh machine fills in its first engine start)",
    )
    ap.add_argument("--out", default="bench_serving_out")
    ap.add_argument("--report", action="store_true", help="only rebuild the table from --out")
    ap.add_argument(
        "--warm-only",
        action="store_true",
        help="start each engine and run only its warm-up, no timed run (rows: 'warmed'): "
        "fills this machine's compile caches for a later run, see tools/gpu_caches.py",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="skip the dtypes whose row in --out is already ok (re-issue a call the device's "
        "time limit cut short, unchanged)",
    )
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help="replace the serving section of docs/benchmarks.md",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch-profile the timed generate of each engine and write profile.md "
        "(use a smaller --num-prompts; see the module docstring)",
    )
    ap.add_argument(
        "--profile-dir",
        default="/tmp/kvarn_bench_profile",
        help="vLLM's torch_profiler_dir (one folder per dtype below it; outside --out)",
    )
    ap.add_argument(
        "--profile-steps",
        default="",
        metavar="SKIP,COUNT",
        help="profile only COUNT engine steps of the timed run, after skipping SKIP "
        "(default: the whole timed run)",
    )
    ap.add_argument(
        "--profile-trace",
        action="store_true",
        help="keep vLLM's gzip chrome trace in --profile-dir (slow to write, large)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gpus < 1 or args.tp < 1:
        ap.error(f"--gpus and --tp must be >= 1, got {args.gpus} and {args.tp}")
    for name, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.profile_steps:
        if not args.profile:
            ap.error("--profile-steps needs --profile")
        _profile_steps(args.profile_steps)  # a bad window fails here, before any engine
    if args.child:
        if not args.max_num_batched_tokens:
            args.max_num_batched_tokens = None
        return child_main(args)
    common.exit_on_sigterm()
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
