#!/usr/bin/env python3
"""`vllm serve` with the plugin under concurrent OpenAI-style completion requests.

Starts ``vllm serve`` (the OpenAI-compatible server) on the Qwen3-8B architecture with dummy
weights and no tokenizer, for each ``--kv-cache-dtype``, fires ``--requests`` completion
requests from ``--concurrency`` client threads (token-id prompts, ``ignore_eos``), and checks
every answer: HTTP 200, ``usage.completion_tokens == max_tokens``, and the generated token ids
returned. Prints one table row per dtype (requests ok, tokens, wall time, tokens/s); writes
JSON to ``--out``. The client uses only the standard library.

    python3 tools/gpu_serve.py --dtypes auto,kvarn_k4v2_g128 --out $OUT/serve
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_e2e as common

VOCAB = 151_000  # Qwen3's vocabulary is 151,936 entries; stay inside it


@dataclass
class Answer:
    ok: bool
    status: int
    completion_tokens: int
    token_ids: int
    seconds: float
    error: str = ""


def post_json(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:500]}


def one_request(
    base: str, model: str, prompt: list[int], max_tokens: int, timeout: float
) -> Answer:
    """One completion; ok when the server returned exactly ``max_tokens`` generated tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    try:
        status, data = post_json(f"{base}/v1/completions", body, timeout)
    except (OSError, ValueError) as exc:
        return Answer(False, 0, 0, 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    dt = time.perf_counter() - t0
    if status != 200:
        return Answer(False, status, 0, 0, dt, str(data.get("error", data))[:300])
    usage = data.get("usage") or {}
    choice = (data.get("choices") or [{}])[0]
    n_ids = len(choice.get("token_ids") or [])
    got = int(usage.get("completion_tokens", -1))
    ok = got == max_tokens and n_ids == max_tokens
    err = "" if ok else f"completion_tokens={got}, token_ids={n_ids}, expected {max_tokens}"
    return Answer(ok, status, got, n_ids, dt, err)


def fire(
    base: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    timeout: float,
) -> tuple[list[Answer], float]:
    """All prompts from ``concurrency`` threads; returns the answers and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(
            pool.map(lambda p: one_request(base, model, p, max_tokens, timeout), prompts)
        )
    return answers, time.perf_counter() - t0


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``/health`` until the server answers (False if it exits or the time runs out)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (OSError, ValueError):
            pass
        time.sleep(2)
    return False


def serve_command(args: argparse.Namespace, model_dir: Path, cache_dtype: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--served-model-name",
        "qwen3-8b-dummy",
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float16",
        "--kv-cache-dtype",
        cache_dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.concurrency),
        "--gpu-memory-utilization",
        str(args.gpu_mem_util),
        "--tensor-parallel-size",
        str(args.tp),
        "--port",
        str(args.port),
    ]


def run_dtype(args: argparse.Namespace, model_dir: Path, cache_dtype: str) -> dict[str, Any]:
    out = Path(args.out)
    log = out / f"serve_{cache_dtype}.log"
    base = f"http://127.0.0.1:{args.port}"
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.requests)
    ]
    row: dict[str, Any] = {"kv_cache_dtype": cache_dtype}
    with log.open("w") as fh:
        proc = subprocess.Popen(
            serve_command(args, model_dir, cache_dtype),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=common.child_env("default"),
            start_new_session=True,
        )
        try:
            t0 = time.perf_counter()
            if not wait_ready(base, proc, args.start_timeout):
                row.update(status="server did not start", start_s=time.perf_counter() - t0)
            else:
                row["start_s"] = round(time.perf_counter() - t0, 1)
                answers, wall = fire(
                    base, "qwen3-8b-dummy", prompts, args.max_tokens, args.concurrency, 600
                )
                good = [a for a in answers if a.ok]
                row.update(
                    status="ok" if len(good) == len(answers) else "failed requests",
                    requests=len(answers),
                    ok=len(good),
                    generated=sum(a.completion_tokens for a in good),
                    wall_s=round(wall, 2),
                    gen_tok_s=round(sum(a.completion_tokens for a in good) / wall, 1),
                    errors=[asdict(a) for a in answers if not a.ok][:5],
                )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text(errors="replace")
    row["jit_compiles_while_serving"] = common.jit_compiles(text)
    row["log_tail"] = common.error_tail(text)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| `--kv-cache-dtype` | status | requests ok | generated tokens | wall s | gen tok/s "
        "| Triton compiles while serving |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['status']} | {r.get('ok', '-')}/"
            f"{r.get('requests', '-')} | {r.get('generated', '-')} | {r.get('wall_s', '-')} | "
            f"{r.get('gen_tok_s', '-')} | "
            f"{', '.join(r.get('jit_compiles_while_serving', [])) or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default="auto,kvarn_k4v2_g128")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem-util", type=float, default=0.85)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default="gpu_serve_out")
    args = ap.parse_args(argv)
    if args.max_prompt + args.max_tokens > args.max_model_len:
        ap.error("--max-prompt + --max-tokens must fit in --max-model-len")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = common.resolve_model_dir(args.model_dir)
    rows = []
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        print(f"serving {dtype} ...", flush=True)
        row = run_dtype(args, model_dir, dtype)
        rows.append(row)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
        print(f"    -> {row['status']}", flush=True)
    text = table(rows)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
