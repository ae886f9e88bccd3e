#!/usr/bin/env python3
"""Host (CPU, Python) time the KVarN plugin adds per engine step, outside the layers.

What it measures, per batch size, on a Qwen3-8B-like attention geometry (32 query heads,
8 KV heads, head 128, 36 layers in one KV-cache group, ``kvarn_k4v2_g128``, 128-token
blocks) with real vLLM 0.23 objects on its CPU platform (as
``packages/kvarn-vllm/tests/test_kvarn_vllm_serving.py``'s harness builds them):

* (a) ``kvarn_vllm.runtime.observe_scheduler_output``: what the patched
  ``Worker.execute_model`` runs on every scheduler output (the tracker's side-pool planning);
* (b) ``KvarnMetadataBuilder.build``: applying the queued plans (flushes, ``block_to_slot``),
  the direct tiles of prefill chunks and the batch description (prefill runs, context plans).

Requests first prefill their context in one untimed step (so the sinks sit in the side pool
and the other full tiles are packed, as after a real prefill), then ``--steps`` consecutive
pure-decode steps are timed after ``--warmup`` untimed ones: one token per request per step,
a new block when a request crosses a 128-token boundary, as vLLM's scheduler does. Request
``i`` holds ``context - (i * 128) // batch`` tokens, so boundary crossings (a new slot, and
the previous block's flush one step later) come at the steady rate of a batch of mixed
lengths, about ``batch / 128`` per step. Then ``--mixed-reps`` times, two prefill steps are
timed: half the batch decodes while ``--mixed-prefills`` new requests run a first
``--chunk``-token chunk ("first" step), and again while they continue with a second chunk
("continuation" step: prefill with context, direct tiles of a chunk that starts mid-prompt).

Limits:

* Only the plugin's per-step work outside the model is timed: building the
  ``SchedulerOutput`` and ``CommonAttentionMetadata`` (vLLM's cost) is not, and the layers are
  never called: the per-layer host work of the impl (``do_kv_cache_update``, ``forward``:
  36 layers of wrapper code and kernel launches, eager outside FULL CUDA graphs, i.e. in
  every prefill/mixed step) is NOT in these numbers.
* The flush kernel (``kvarn_kernels.store._flush_kernel``) is replaced by a counter: the
  Python wrapper of ``flush_tiles`` runs, the Triton launch does not (Triton's interpreter
  would execute the kernel on the host). The count of launches per step is reported; on a
  GPU each also costs a Triton launch's host time, which is not measured here.
* ``torch.cuda.is_available()`` is cached as a GPU worker has it (see
  :func:`cached_cuda_check`; ``--raw-cuda-check`` keeps this machine's slow uncached calls).
* CPU platform, CPU tensors: host-to-device copies are plain CPU copies and nothing is
  launched on a GPU, so CUDA launch and pinned-memory costs are absent. Times are this
  machine's CPU's (Python speed differs between hosts); compare rows, not absolute values
  across machines. One tensor-parallel rank; the KV cache tensor is shared by all layers
  (only its shape is read) to keep memory down; the side pools are real, sized for
  ``max_num_seqs = batch + --mixed-prefills``.

Usage::

    uv run python tools/host_overhead.py --batch 1,16,64,256 --context 4096 --steps 50 \\
        --json /tmp/host_overhead.json [--profile 64]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

DTYPE = "kvarn_k4v2_g128"
G = 128

#: Qwen3-8B's attention geometry; the rest only has to make a valid config (no weights load).
QWEN3_8B_LIKE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


@dataclass(frozen=True, slots=True)
class Settings:
    """One run's configuration (the CLI's options)."""

    batches: tuple[int, ...]
    context: int
    steps: int
    warmup: int = 2
    layers: int = 36
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mixed_reps: int = 10
    mixed_prefills: int = 2
    chunk: int = 2048
    profile: int | None = None
    profile_top: int = 12
    raw_cuda_check: bool = False


# ---------------------------------------------------------------------------------------------
# Statistics


def summarize(ns: Sequence[int]) -> dict[str, float]:
    """Median, p90, mean, min and max of nanosecond samples, in microseconds."""
    if not ns:
        return {"n": 0}
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "n": len(ns),
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
        "mean_us": float(us.mean()),
        "min_us": float(us.min()),
        "max_us": float(us.max()),
    }


@dataclass(slots=True)
class Samples:
    """Per-step samples of one kind of step."""

    observe_ns: list[int] = field(default_factory=list)
    build_ns: list[int] = field(default_factory=list)
    flush_launches: list[int] = field(default_factory=list)

    def add(self, observe: int, build: int, launches: int) -> None:
        self.observe_ns.append(observe)
        self.build_ns.append(build)
        self.flush_launches.append(launches)

    def report(self) -> dict[str, Any]:
        total = [a + b for a, b in zip(self.observe_ns, self.build_ns, strict=True)]
        return {
            "steps": len(total),
            "observe": summarize(self.observe_ns),
            "build": summarize(self.build_ns),
            "total": summarize(total),
            "flush_launches_per_step": (
                float(np.mean(self.flush_launches)) if self.flush_launches else 0.0
            ),
            "observe_us": [x / 1e3 for x in self.observe_ns],
            "build_us": [x / 1e3 for x in self.build_ns],
        }


# ---------------------------------------------------------------------------------------------
# The flush kernel, counted instead of launched


class _CountingKernel:
    """Stands in for a Triton ``JITFunction``: ``kernel[grid](*args, **consts)`` counts."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1

        return launch


@contextlib.contextmanager
def counted_flush_kernel() -> Iterator[_CountingKernel]:
    """Replace ``kvarn_kernels.store._flush_kernel`` by a launch counter for the block."""
    import kvarn_kernels.store as store

    counter = _CountingKernel()
    saved = store._flush_kernel
    store._flush_kernel = counter
    try:
        yield counter
    finally:
        store._flush_kernel = saved


@contextlib.contextmanager
def cached_cuda_check() -> Iterator[None]:
    """``torch.cuda.is_available()`` as cheap as on a GPU worker, for the block.

    vLLM sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so ``is_available()`` goes through
    ``torch.cuda.device_count()``, which caches its answer only once CUDA is initialized: on a
    GPU worker that is from the start (about 1 µs a call), on a machine without CUDA never, and
    every call tries to load NVML again (tens of µs). The plugin calls it in ``apply_pending``
    before flushes; caching the count (0) here removes a cost no GPU worker pays.
    """
    import torch.cuda

    saved = torch.cuda._cached_device_count
    torch.cuda._cached_device_count = 0
    try:
        yield
    finally:
        torch.cuda._cached_device_count = saved


def cuda_check_us(calls: int = 200) -> float:
    """Microseconds per ``torch.cuda.is_available()`` call in the current state."""
    import torch

    t0 = time.perf_counter_ns()
    for _ in range(calls):
        torch.cuda.is_available()
    return (time.perf_counter_ns() - t0) / calls / 1e3


# ---------------------------------------------------------------------------------------------
# The engine side: requests, blocks, scheduler outputs and common metadata


@dataclass(slots=True)
class _Req:
    rid: str
    blocks: list[int]
    computed: int = 0
    prompt: int = 0


@dataclass(slots=True)
class _Step:
    """One step as the scheduler cuts it: rows in batch order (decodes first)."""

    rows: list[tuple[str, int]]
    new: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)


class Engine:
    """Real vLLM config, Attention layers and KVarN builder for one batch size, and the
    scheduler's side of the steps (block allocation, ``SchedulerOutput``,
    ``CommonAttentionMetadata``), as the serving tests' harness does."""

    def __init__(self, s: Settings, model_dir: Path, batch: int, max_model_len: int) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        from kvarn_vllm.backend import KvarnAttentionBackend, KvarnMetadataBuilder, backend_for
        from kvarn_vllm.specs import KvarnFullAttentionSpec

        need = [-(-(s.context + _decode_steps(s)) // G)] * batch
        need += [-(-(2 * s.chunk) // G)] * (s.mixed_prefills * (s.mixed_reps + 1))
        self.num_blocks = 1 + sum(need)  # block 0 is vLLM's null block
        self.max_blocks = -(-max_model_len // G)
        decoders = max(1, batch // 2)
        self.config = EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            kv_cache_dtype=DTYPE,  # type: ignore[arg-type]  # admitted by the plugin
            max_model_len=max_model_len,
            max_num_seqs=batch + s.mixed_prefills,
            max_num_batched_tokens=max(8192, decoders + s.mixed_prefills * s.chunk),
            enable_prefix_caching=True,
        ).create_engine_config()
        if self.config.cache_config.block_size != G:
            raise RuntimeError(
                f"expected {G}-token blocks, got {self.config.cache_config.block_size}"
            )
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(s.layers)]
        with set_current_vllm_config(self.config):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                layers = [
                    Attention(
                        s.q_heads,
                        s.head_dim,
                        s.head_dim**-0.5,
                        num_kv_heads=s.kv_heads,
                        cache_config=self.config.cache_config,
                        prefix=name,
                    )
                    for name in names
                ]
            finally:
                torch.set_default_dtype(default)
            backend = backend_for(DTYPE)
            if not issubclass(backend, KvarnAttentionBackend):
                raise RuntimeError(f"{DTYPE} is not served by a KVarN backend")
            spec = layers[0].get_kv_cache_spec(self.config)
            if not isinstance(spec, KvarnFullAttentionSpec):
                raise RuntimeError(f"the plugin's spec hook did not run: {type(spec).__name__}")
            shape = backend.get_kv_cache_shape(self.num_blocks, G, s.kv_heads, s.head_dim, DTYPE)
            # Only the shape is read (the flush kernel is counted, not run): one tensor,
            # never written, serves every layer.
            cache = torch.empty(shape, dtype=torch.uint8)
            for layer in layers:
                if layer.attn_backend is not backend:
                    raise RuntimeError("the kvarn plugin did not route the layers to KVarN")
                layer.kv_cache = cache
            self.builder = KvarnMetadataBuilder(spec, names, self.config, torch.device("cpu"))
        kv_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        self.layers = layers
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(kv_cache_config=kv_config))
        self.reqs: dict[str, _Req] = {}
        self._next_block = 1

    # ------------------------------------------------------------------ scheduler side
    def add(self, rid: str, prompt: int) -> None:
        self.reqs[rid] = _Req(rid, [], 0, prompt)

    def schedule(
        self,
        rows: list[tuple[str, int]],
        *,
        new: Sequence[str] = (),
        finished: Sequence[str] = (),
    ) -> _Step:
        """Allocate the blocks the rows' tokens need (new block ids as the scheduler reports
        them) and return the step."""
        step = _Step(rows=rows, new=set(new), finished=set(finished))
        for rid, n in rows:
            req = self.reqs[rid]
            want = -(-(req.computed + n) // G)
            added = list(range(self._next_block, self._next_block + want - len(req.blocks)))
            if added:
                if added[-1] >= self.num_blocks:
                    raise RuntimeError("out of KV-cache blocks: the block estimate is wrong")
                self._next_block = added[-1] + 1
                req.blocks.extend(added)
                if rid not in step.new:
                    step.new_blocks[rid] = added
        return step

    def scheduler_output(self, step: _Step) -> Any:
        from kvarn_vllm.testing import ScheduledRequest, scheduler_output

        requests = []
        for rid, n in step.rows:
            req = self.reqs[rid]
            requests.append(
                ScheduledRequest(
                    rid,
                    n,
                    req.computed,
                    req.blocks,
                    new=rid in step.new,
                    prompt_token_ids=[0] * req.prompt,
                    new_block_ids=step.new_blocks.get(rid, ()),
                    num_output_tokens=max(0, req.computed - req.prompt),
                )
            )
        return scheduler_output(requests, step.finished)

    def common_metadata(self, step: _Step) -> Any:
        import torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        rows = [(self.reqs[rid], n) for rid, n in step.rows]
        qsl = np.zeros(len(rows) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum([n for _, n in rows])
        seq = np.asarray([r.computed + n for r, n in rows], dtype=np.int32)
        table = np.zeros((len(rows), self.max_blocks), dtype=np.int32)
        slots = []
        for i, (r, n) in enumerate(rows):
            blocks = np.asarray(r.blocks, dtype=np.int64)
            table[i, : len(blocks)] = blocks
            pos = np.arange(r.computed, r.computed + n)
            slots.append(blocks[pos // G] * G + pos % G)
        return CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.copy()),
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(seq.copy()),
            num_reqs=len(rows),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(n for _, n in rows),
            max_seq_len=int(seq.max()),
            block_table_tensor=torch.from_numpy(table),
            slot_mapping=torch.from_numpy(np.concatenate(slots)),
            seq_lens_cpu_upper_bound=torch.from_numpy(seq),
            is_prefilling=torch.tensor([r.computed + n <= r.prompt for r, n in rows]),
        )

    def advance(self, step: _Step) -> None:
        for rid, n in step.rows:
            self.reqs[rid].computed += n
        for rid in step.finished:
            self.reqs.pop(rid, None)


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass(slots=True)
class _Timer:
    engine: Engine
    counter: _CountingKernel
    #: When set, observe and build run under these profilers (``(observe, build)``).
    profiles: tuple[cProfile.Profile, cProfile.Profile] | None = None

    def run(self, step: _Step, into: Samples | None = None) -> None:
        """One step: observe then build (timed into ``into`` when given), then advance."""
        from kvarn_vllm.runtime import observe_scheduler_output

        e = self.engine
        out = e.scheduler_output(step)
        cam = e.common_metadata(step)
        launches = self.counter.launches
        prof = self.profiles
        t0 = time.perf_counter_ns()
        if prof is None:
            observe_scheduler_output(e.worker, out)
            t1 = time.perf_counter_ns()
            meta = e.builder.build(0, cam)
        else:
            prof[0].runcall(observe_scheduler_output, e.worker, out)
            t1 = time.perf_counter_ns()
            meta = prof[1].runcall(e.builder.build, 0, cam)
        t2 = time.perf_counter_ns()
        if meta.num_actual_tokens != int(cam.num_actual_tokens):
            raise RuntimeError("the builder described another batch")
        if into is not None:
            into.add(t1 - t0, t2 - t1, self.counter.launches - launches)
        e.advance(step)


def _profile_rows(prof: cProfile.Profile, steps: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by cumulative time per step (the profiled call itself included)."""
    stats = pstats.Stats(prof)
    rows: list[dict[str, Any]] = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})" if line else func,
                "calls_per_step": nc / steps,
                "cum_us_per_step": ct / steps * 1e6,
                "self_us_per_step": tt / steps * 1e6,
            }
        )
    rows.sort(key=lambda r: -float(r["cum_us_per_step"]))
    return rows[:top]


def _decode_steps(s: Settings) -> int:
    """An upper bound on the tokens a decoding request adds (timed, profiled, mixed steps)."""
    return s.warmup + 2 * s.steps + 3 * (s.mixed_reps + 1) + 1


def _live_runtimes() -> int:
    from kvarn_vllm.runtime import live_runtimes

    return sum(1 for r in live_runtimes() if not r.profiling)


def measure_batch(s: Settings, model_dir: Path, batch: int) -> dict[str, Any]:
    """All timed steps of one batch size (a fresh engine, gone when this returns)."""
    gc.collect()
    if _live_runtimes():
        raise RuntimeError(
            "another KVarN runtime is alive in this process: observe_scheduler_output would "
            "feed it too and the timings would count both"
        )
    max_model_len = G * -(-(s.context + _decode_steps(s)) // G)
    max_model_len = max(max_model_len, 2 * s.chunk)
    engine = Engine(s, model_dir, batch, max_model_len)
    profiling = s.profile == batch
    with counted_flush_kernel() as counter:
        timer = _Timer(engine, counter)
        decoders = [f"r{i}" for i in range(batch)]
        for i, rid in enumerate(decoders):
            engine.add(rid, max(1, s.context - (i * G) // batch))
        # The context, prefilled in one untimed step.
        rows = [(rid, engine.reqs[rid].prompt) for rid in decoders]
        timer.run(engine.schedule(rows, new=decoders))
        gc.collect()

        decode = Samples()
        for i in range(s.warmup + s.steps):
            rows = [(rid, 1) for rid in decoders]
            timer.run(engine.schedule(rows), decode if i >= s.warmup else None)

        profiles: dict[str, tuple[cProfile.Profile, cProfile.Profile]] = {}
        if profiling:
            # As many decode steps again, profiled (cProfile's overhead stays out of the timings).
            timer.profiles = profiles["decode"] = (cProfile.Profile(), cProfile.Profile())
            for _ in range(s.steps):
                timer.run(engine.schedule([(rid, 1) for rid in decoders]))
            timer.profiles = None

        first, cont = Samples(), Samples()
        half = decoders[: max(1, batch // 2)]
        for rep in range(s.mixed_reps + (1 if profiling and s.mixed_reps else 0)):
            pre = [f"p{rep}_{j}" for j in range(s.mixed_prefills)]
            for rid in pre:
                engine.add(rid, 2 * s.chunk)
            dec = [(rid, 1) for rid in half]
            if rep == s.mixed_reps:  # the extra, profiled pair
                timer.profiles = profiles["mixed"] = (cProfile.Profile(), cProfile.Profile())
                timer.run(engine.schedule(dec + [(p, s.chunk) for p in pre], new=pre))
                timer.run(engine.schedule(dec + [(p, s.chunk) for p in pre]))
                timer.profiles = None
            else:
                timer.run(engine.schedule(dec + [(p, s.chunk) for p in pre], new=pre), first)
                timer.run(engine.schedule(dec + [(p, s.chunk) for p in pre]), cont)
            timer.run(engine.schedule(dec, finished=pre))

    result: dict[str, Any] = {
        "batch": batch,
        "num_blocks": engine.num_blocks,
        "side_pool_slots": engine.builder.runtime.num_slots,
        "decode": decode.report(),
        "mixed_first_chunk": first.report(),
        "mixed_continuation": cont.report(),
    }
    if profiles:
        # per step: the decode profile covers s.steps steps, the mixed one a pair of steps
        per_step = {"decode": s.steps, "mixed": 2}
        result["profile"] = {
            "note": "cProfile, in separate untimed steps (its overhead inflates absolute "
            "times): decode = as many decode steps as timed; mixed = one first-chunk and one "
            "continuation step",
        }
        for kind, (observe_prof, build_prof) in profiles.items():
            n = per_step[kind]
            result["profile"][f"{kind}_observe_top"] = _profile_rows(observe_prof, n, s.profile_top)
            result["profile"][f"{kind}_build_top"] = _profile_rows(build_prof, n, s.profile_top)
    del engine, timer
    gc.collect()
    return result


def run(s: Settings) -> dict[str, Any]:
    """Measure every batch size of ``s``; the JSON report."""
    from kvarn_vllm.testing import patched_vllm, prepare_cpu_test_env, write_model_dir

    if not prepare_cpu_test_env():
        raise SystemExit(
            "host_overhead: runs on vLLM's CPU platform only; hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run it on this machine"
        )
    import torch

    config = {
        **QWEN3_8B_LIKE,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.q_heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_size": s.q_heads * s.head_dim,
    }
    batches = []
    with contextlib.ExitStack() as stack:
        model_dir = write_model_dir(
            Path(stack.enter_context(tempfile.TemporaryDirectory())), config
        )
        stack.enter_context(patched_vllm())
        import vllm  # (sets PYTORCH_NVML_BASED_CUDA_CHECK=1)

        raw_check = cuda_check_us()
        if not s.raw_cuda_check:
            stack.enter_context(cached_cuda_check())
        check = cuda_check_us()
        for batch in s.batches:
            batches.append(measure_batch(s, model_dir, batch))

    return {
        "what": "host time per engine step of kvarn_vllm observe_scheduler_output and "
        "KvarnMetadataBuilder.build (CPU platform, layers not called, flush kernel counted)",
        "settings": {
            "kv_cache_dtype": DTYPE,
            "block_size": G,
            "context": s.context,
            "steps": s.steps,
            "warmup": s.warmup,
            "layers": s.layers,
            "q_heads": s.q_heads,
            "kv_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "mixed_reps": s.mixed_reps,
            "mixed_prefills": s.mixed_prefills,
            "chunk": s.chunk,
        },
        "environment": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda_check_us_uncached": raw_check,
            "cuda_check_us_measured": check,
            "cuda_check_cached": not s.raw_cuda_check,
        },
        "batches": batches,
    }


# ---------------------------------------------------------------------------------------------
# Report


def _cell(stats: dict[str, Any]) -> str:
    if not stats.get("n"):
        return "-"
    return f"{stats['median_us']:.0f} / {stats['p90_us']:.0f}"


STEP_KINDS = {
    "decode": "decode",
    "mixed_first_chunk": "mixed, first chunks",
    "mixed_continuation": "mixed, continuation",
}


def markdown_table(report: dict[str, Any]) -> str:
    """The summary table: median / p90 (and mean) microseconds per step."""
    st = report["settings"]
    lines = [
        f"Host µs per engine step, median / p90 ({st['kv_cache_dtype']}, {st['layers']} "
        f"layers, context {st['context']}; decode: {st['steps']} steps; mixed: half the "
        f"batch decoding + {st['mixed_prefills']} x {st['chunk']}-token chunks, "
        f"{st['mixed_reps']} steps each)",
        "",
        "| batch | step | observe | build | observe + build | mean | flush launches/step |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in report["batches"]:
        for key, label in STEP_KINDS.items():
            r = b[key]
            if not r["steps"]:
                continue
            lines.append(
                f"| {b['batch']} | {label} | {_cell(r['observe'])} | {_cell(r['build'])} | "
                f"{_cell(r['total'])} | {r['total']['mean_us']:.0f} | "
                f"{r['flush_launches_per_step']:.1f} |"
            )
    return "\n".join(lines)


def profile_text(report: dict[str, Any]) -> str:
    """The cProfile tables of the profiled batch size, if any."""
    out = []
    for b in report["batches"]:
        prof = b.get("profile")
        if not prof:
            continue
        for kind in ("decode", "mixed"):
            for part in ("build", "observe"):
                rows = prof.get(f"{kind}_{part}_top")
                if rows is None:
                    continue
                out.append(f"cProfile, batch {b['batch']}, {kind} steps, {part} (µs per step):")
                out.append(f"{'cum':>9} {'self':>9} {'calls':>8}  function")
                for row in rows:
                    out.append(
                        f"{row['cum_us_per_step']:9.1f} {row['self_us_per_step']:9.1f} "
                        f"{row['calls_per_step']:8.1f}  {row['function']}"
                    )
                out.append("")
    return "\n".join(out)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batch", type=_int_list, default=(1, 16, 64, 256), help="e.g. 1,16,64,256")
    ap.add_argument("--context", type=int, default=4096, help="tokens each request holds")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first")
    ap.add_argument("--layers", type=int, default=36, help="attention layers in the group")
    ap.add_argument("--mixed-reps", type=int, default=10, help="timed mixed step pairs (0: none)")
    ap.add_argument("--mixed-prefills", type=int, default=2, help="prefilling requests")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens of each prefill chunk")
    ap.add_argument("--profile", type=int, help="cProfile the decode steps of this batch size")
    ap.add_argument("--profile-top", type=int, default=12, help="functions listed per profile")
    ap.add_argument(
        "--raw-cuda-check",
        action="store_true",
        help="leave torch.cuda.is_available() uncached (slow here, unlike on a GPU worker)",
    )
    ap.add_argument("--json", type=Path, help="write the full numbers here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("context", "steps", "layers", "chunk", "mixed_prefills"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.mixed_reps < 0:
        raise SystemExit("--warmup and --mixed-reps must be >= 0")
    s = Settings(
        batches=args.batch,
        context=args.context,
        steps=args.steps,
        warmup=args.warmup,
        layers=args.layers,
        mixed_reps=args.mixed_reps,
        mixed_prefills=args.mixed_prefills,
        chunk=args.chunk,
        profile=args.profile,
        profile_top=args.profile_top,
        raw_cuda_check=args.raw_cuda_check,
    )
    report = run(s)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    text = profile_text(report)
    if text:
        print(text)
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
