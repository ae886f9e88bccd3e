"""The three measurements: teacher-forced metrics, greedy generation, error accumulation.

Every run puts the fp16 reference in batch row 0 and one codec per further row, all reading the
same tokens (teacher forcing) or their own greedy tokens (generation), so one batched forward
pass per step serves every codec and the comparison is always made on identical inputs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tqdm import tqdm  # type: ignore[import-untyped]

from kvarn_eval.assets import ModelBundle
from kvarn_eval.attention import AttentionErrorRecorder, install, recording
from kvarn_eval.cache import TiledKVCache
from kvarn_eval.codecs import FP16Cache, TileCodec

__all__ = [
    "AccumulationResult",
    "GenerationResult",
    "TeacherForcedResult",
    "accumulation",
    "chat_prompt_ids",
    "check_chunk",
    "generate",
    "greedy",
    "model_device",
    "teacher_forced",
]

F32 = npt.NDArray[np.float32]


def check_chunk(codecs: Sequence[TileCodec], chunk: int) -> None:
    """Fail unless every tile size is a multiple of ``chunk``.

    A forward step that crossed a tile boundary would let its later tokens read the tile it
    just completed in fp16, which serving with one-tile chunks never does.
    """
    for c in codecs:
        if c.group is not None and c.group % chunk:
            raise ValueError(
                f"chunk {chunk} does not divide the tile size {c.group} of {c.name}; "
                "use a chunk that divides every group (e.g. 64)"
            )


def model_device(bundle: ModelBundle) -> torch.device:
    """The device the model's weights live on (inputs are created there)."""
    return next(bundle.model.parameters()).device


def _names(codecs: Sequence[TileCodec]) -> list[str]:
    return [c.name for c in codecs]


@dataclass
class TeacherForcedResult:
    """Per-token metrics, arrays ``[rows, windows, predictions]``; row 0 is the reference."""

    corpus: str
    names: list[str]
    nll: F32
    kl: F32
    top1: npt.NDArray[np.bool_]
    seconds: float
    pairs: list[tuple[int, int]] = field(default_factory=list)
    pair_kl: F32 = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))
    pair_top1: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros((0, 0, 0), bool))

    def pair_summary(self, contexts: Sequence[int]) -> list[dict[str, Any]]:
        """Per pair ``(a, b)`` and context: mean ``KL(p_a || p_b)`` and argmax agreement."""
        out: list[dict[str, Any]] = []
        for ctx in contexts:
            n = ctx - 1
            for i, (a, b) in enumerate(self.pairs):
                out.append(
                    {
                        "corpus": self.corpus,
                        "context": ctx,
                        "a": self.names[a],
                        "b": self.names[b],
                        "kl": float(self.pair_kl[i, :, :n].mean(dtype=np.float64)),
                        "kl_max": float(self.pair_kl[i, :, :n].max()),
                        "top1": float(self.pair_top1[i, :, :n].mean(dtype=np.float64)),
                    }
                )
        return out

    def summary(self, contexts: Sequence[int]) -> list[dict[str, Any]]:
        """Perplexity, mean KL and top-1 agreement over the first ``ctx`` tokens of each window.

        Causality makes the first ``ctx`` positions of a longer window exactly a ``ctx``-token
        run, so one pass at the longest context gives every shorter one.
        """
        rows: list[dict[str, Any]] = []
        for ctx in contexts:
            n = ctx - 1
            if n > self.nll.shape[2]:
                raise ValueError(f"context {ctx} exceeds the evaluated window")
            ref_ppl = float(np.exp(self.nll[0, :, :n].mean(dtype=np.float64)))
            for i, name in enumerate(self.names):
                ppl = float(np.exp(self.nll[i, :, :n].mean(dtype=np.float64)))
                rows.append(
                    {
                        "corpus": self.corpus,
                        "context": ctx,
                        "codec": name,
                        "ppl": ppl,
                        "ppl_delta_pct": 100.0 * (ppl / ref_ppl - 1.0),
                        "kl": float(self.kl[i, :, :n].mean(dtype=np.float64)),
                        "top1": float(self.top1[i, :, :n].mean(dtype=np.float64)),
                        "tokens": int(n * self.nll.shape[1]),
                    }
                )
        return rows

    def kl_by_position(self, bin_size: int) -> F32:
        """Mean KL per row in position bins of ``bin_size`` tokens: ``[rows, bins]``."""
        n = self.kl.shape[2] // bin_size * bin_size
        binned = self.kl[:, :, :n].reshape(self.kl.shape[0], self.kl.shape[1], -1, bin_size)
        return np.asarray(binned.mean(axis=(1, 3)), dtype=np.float32)


def _step(
    model: Any, ids: torch.Tensor, cache: TiledKVCache, last_only: bool = False
) -> torch.Tensor:
    out = model(
        input_ids=ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1 if last_only else 0,
    )
    logits: torch.Tensor = out.logits
    return logits.float()


@torch.inference_mode()
def teacher_forced(
    bundle: ModelBundle,
    codecs: Sequence[TileCodec],
    windows: Sequence[Sequence[int]],
    *,
    corpus: str,
    chunk: int = 64,
    progress: bool = True,
    pairs: Sequence[tuple[int, int]] = (),
) -> TeacherForcedResult:
    """Run every window through all codecs at once, ``chunk`` tokens per forward step.

    Metrics per predicted token against row 0: the negative log-likelihood of the true next
    token (-> perplexity), ``KL(p_ref || p_row)`` and whether the argmax matches. ``pairs``
    ``(a, b)`` of rows also get ``KL(p_a || p_b)`` and argmax agreement (e.g. a codec's
    reference implementation against its kernels, on identical inputs).
    """
    check_chunk(codecs, chunk)
    install(bundle.model)
    if not windows or len({len(w) for w in windows}) != 1:
        raise ValueError("teacher_forced needs one or more windows of equal length")
    t0 = time.perf_counter()
    rows, length = len(codecs), len(windows[0])
    nll = np.zeros((rows, len(windows), length - 1), np.float32)
    kl = np.zeros_like(nll)
    top1 = np.zeros(nll.shape, np.bool_)
    pair_list = [(int(a), int(b)) for a, b in pairs]
    pair_kl = np.zeros((len(pair_list), *nll.shape[1:]), np.float32)
    pair_top1 = np.zeros(pair_kl.shape, np.bool_)
    dev = model_device(bundle)
    steps = len(windows) * ((length + chunk - 1) // chunk)
    bar = tqdm(total=steps, desc="teacher-forced", unit="chunk", disable=not progress)
    for w, window in enumerate(windows):
        ids = torch.tensor(window, dtype=torch.long, device=dev)[None].expand(rows, -1)
        cache = TiledKVCache(codecs, bundle.num_layers, capacity=length)
        for s in range(0, length, chunk):
            e = min(s + chunk, length)
            logp = torch.log_softmax(_step(bundle.model, ids[:, s:e], cache), dim=-1)
            n = min(e, length - 1) - s  # positions with a next token
            if n > 0:
                lp = logp[:, :n]
                target = ids[0, s + 1 : s + 1 + n]
                picked = lp.gather(-1, target.expand(rows, n)[..., None])[..., 0]
                nll[:, w, s : s + n] = (-picked).cpu().numpy()
                # KL(p_ref || p_row) = sum_v p_ref (lp_ref - lp_row): one batched matmul over
                # the vocabulary on the (small) log-ratio; row 0 is exactly zero.
                ratio = lp[0][None] - lp
                kl_step = torch.einsum("tv,rtv->rt", lp[0].exp(), ratio)
                kl[:, w, s : s + n] = kl_step.cpu().numpy()
                am = lp.argmax(-1)
                top1[:, w, s : s + n] = (am == am[0:1]).cpu().numpy()
                for p_i, (a, b) in enumerate(pair_list):
                    lr = lp[a] - lp[b]
                    pair_kl[p_i, w, s : s + n] = (lp[a].exp() * lr).sum(-1).cpu().numpy()
                    pair_top1[p_i, w, s : s + n] = (am[a] == am[b]).cpu().numpy()
            bar.update(1)
    bar.close()
    return TeacherForcedResult(
        corpus,
        _names(codecs),
        nll,
        kl,
        top1,
        time.perf_counter() - t0,
        pairs=pair_list,
        pair_kl=pair_kl,
        pair_top1=pair_top1,
    )


def chat_prompt_ids(bundle: ModelBundle, prompt: str) -> list[int]:
    """Token ids of a one-turn chat, using the chat template embedded in the GGUF tokenizer."""
    ids: Any = bundle.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,  # transformers 5 returns a BatchEncoding by default
    )
    if isinstance(ids, Mapping):  # a tokenizer that ignores return_dict
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _eos_id(bundle: ModelBundle) -> int:
    eos = bundle.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos, int) or eos < 0:
        raise ValueError("the tokenizer has no <|im_end|> token; cannot find the end of a turn")
    return eos


@torch.inference_mode()
def greedy(
    bundle: ModelBundle,
    codecs: Sequence[TileCodec],
    prompts: Sequence[Sequence[int]],
    n_new: int,
    *,
    chunk: int = 64,
    suppress_eos: bool = False,
    progress: bool = True,
    desc: str = "generate",
    stop_with_first: bool = False,
) -> npt.NDArray[np.int64]:
    """Greedy decoding of ``n_new`` tokens for every (prompt, codec): ``[prompts, codecs, n_new]``.

    All prompts run in one batch (row ``p * len(codecs) + c``), left-padded to the longest;
    each row's tiles start after its padding (:class:`~kvarn_eval.cache.TiledLayer` offsets),
    its positions count from its first real token and the padding is masked out, so a row
    computes what the prompt alone would (up to float rounding). One decode step then serves
    every prompt and codec, which on a CPU costs little more than one row: the step is bound
    by reading the weights. The prompt is prefilled in ``chunk``-token steps where that is
    exact for every row, otherwise one token per step.
    Decoding stops early once every row has ended its turn (later slots hold
    ``<|im_end|>``). With ``suppress_eos`` the end-of-turn token is never chosen. With
    ``stop_with_first`` a prompt's rows leave the batch as soon as its first codec's row (the
    reference) has ended its turn: their later slots hold ``<|im_end|>``, and the comparison
    over the reference's turn (:func:`generate`) is unchanged.
    """
    check_chunk(codecs, chunk)
    install(bundle.model)
    n_codecs, n_prompts = len(codecs), len(prompts)
    if n_prompts == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy needs at least one non-empty prompt")
    eos = _eos_id(bundle)
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    rows = n_prompts * n_codecs
    dev = model_device(bundle)
    row_pad = torch.tensor([pads[r // n_codecs] for r in range(rows)], device=dev)
    ids = torch.full((rows, longest), eos, dtype=torch.long, device=dev)
    for r in range(rows):
        p = prompts[r // n_codecs]
        ids[r, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=dev)
    cache = TiledKVCache(
        [codecs[r % n_codecs] for r in range(rows)],
        bundle.num_layers,
        capacity=longest + n_new,
        offsets=row_pad.tolist(),
    )
    padded = any(pads)
    total = longest + n_new
    mask = (torch.arange(total, device=dev)[None, :] >= row_pad[:, None]).long()
    positions = (torch.arange(total, device=dev)[None, :] - row_pad[:, None]).clamp_min(0)

    active = list(range(rows))  # batch row j is original row active[j]

    def step(tokens: torch.Tensor, at: int) -> torch.Tensor:
        n = tokens.shape[1]
        out = bundle.model(
            input_ids=tokens,
            attention_mask=mask[:, : at + n] if padded else None,
            position_ids=positions[:, at : at + n],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    # Without padding, tile-aligned chunks are exact. With padding, a chunk is exact while
    # every row's positions in it stay below two tiles (before that no non-sink tile can be
    # due for a flush); past that the prompt goes one token per step.
    groups = [c.group for c in codecs if c.group is not None]
    safe = 2 * min(groups) + min(pads) if groups else longest
    logits = torch.empty(0)
    s = 0
    while s < longest:
        n = chunk if not padded or s + chunk <= safe else 1
        n = min(n, longest - s)
        logits = step(ids[:, s : s + n], s)
        s += n
    out = np.full((rows, n_new), eos, dtype=np.int64)
    done = np.zeros(rows, dtype=np.bool_)
    bar = tqdm(total=n_new, desc=desc, unit="step", disable=not progress)
    for i in range(n_new):
        if suppress_eos:
            logits[:, eos] = -torch.inf
        nxt = logits.argmax(-1)
        out[active, i] = nxt.cpu().numpy()
        done |= out[:, i] == eos
        bar.update(1)
        if done.all() or i == n_new - 1:
            break
        if stop_with_first:
            ended = {r // n_codecs for r in active if r % n_codecs == 0 and out[r, i] == eos}
            if ended:
                # Those prompts' turns are over: nothing after this step is compared, so
                # their rows leave the batch (the other rows compute exactly what they would).
                keep = [j for j, r in enumerate(active) if r // n_codecs not in ended]
                active = [active[j] for j in keep]
                cache.select_rows(keep)
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                nxt, mask, positions = nxt[sel], mask[sel], positions[sel]
        logits = step(nxt[:, None], longest + i)
    bar.close()
    return out.reshape(n_prompts, n_codecs, n_new)


@dataclass
class GenerationResult:
    """Greedy generation per prompt and row, compared with row 0 over its turn."""

    names: list[str]
    prompts: list[str]
    tokens: list[npt.NDArray[np.int64]]  # per prompt [rows, n_new]
    ref_lengths: list[int]
    n_new: int
    seconds: float
    first_divergence: list[list[int | None]] = field(default_factory=list)  # [prompt][row]
    agreement: list[list[float]] = field(default_factory=list)  # [prompt][row]

    def summary(self) -> list[dict[str, Any]]:
        """Per codec: mean token agreement, divergence counts and the median first divergence."""
        out: list[dict[str, Any]] = []
        for i, name in enumerate(self.names):
            firsts = [p[i] for p in self.first_divergence]
            diverged = [f for f in firsts if f is not None]
            out.append(
                {
                    "codec": name,
                    "agreement": float(np.mean([p[i] for p in self.agreement])),
                    "prompts": len(self.prompts),
                    "identical": len(firsts) - len(diverged),
                    "median_first_divergence": float(np.median(diverged)) if diverged else None,
                    "min_first_divergence": min(diverged) if diverged else None,
                }
            )
        return out


def generate(
    bundle: ModelBundle,
    codecs: Sequence[TileCodec],
    prompts: Sequence[str],
    n_new: int,
    *,
    chunk: int = 64,
    progress: bool = True,
) -> GenerationResult:
    """Greedy generation for each prompt with every codec (row 0 the fp16 reference).

    The comparison covers the reference's turn: its tokens up to and including its first
    ``<|im_end|>``, or all ``n_new``. Agreement is the share of those positions where a row
    produced the same token; the first divergence is the first such position that differs.
    """
    t0 = time.perf_counter()
    eos = _eos_id(bundle)
    res = GenerationResult(_names(codecs), list(prompts), [], [], n_new, 0.0)
    all_toks = greedy(
        bundle,
        codecs,
        [chat_prompt_ids(bundle, p) for p in prompts],
        n_new,
        chunk=chunk,
        progress=progress,
        stop_with_first=True,
    )
    for toks in all_toks:
        ends = np.nonzero(toks[0] == eos)[0]
        ref_len = int(ends[0]) + 1 if len(ends) else n_new
        same = toks[:, :ref_len] == toks[0:1, :ref_len]
        firsts: list[int | None] = []
        for row in same:
            bad = np.nonzero(~row)[0]
            firsts.append(int(bad[0]) if len(bad) else None)
        res.tokens.append(toks)
        res.ref_lengths.append(ref_len)
        res.first_divergence.append(firsts)
        res.agreement.append([float(x) for x in same.mean(axis=1)])
    res.seconds = time.perf_counter() - t0
    return res


@dataclass
class AccumulationResult:
    """Attention-output errors ``[layers, rows, tokens]`` along one long fp16 trajectory."""

    names: list[str]
    prompt_len: int
    tokens: list[int]
    local: F32
    e2e: F32
    seconds: float

    def decode_steps(self) -> tuple[F32, F32]:
        """The errors of the generated positions only (decode steps 0, 1, ...)."""
        return self.local[:, :, self.prompt_len :], self.e2e[:, :, self.prompt_len :]


@torch.inference_mode()
def accumulation(
    bundle: ModelBundle,
    codecs: Sequence[TileCodec],
    prompt: str,
    n_steps: int,
    *,
    chunk: int = 64,
    progress: bool = True,
) -> AccumulationResult:
    """Attention-output error per layer and decode step over a long greedy generation.

    First the fp16 cache generates ``n_steps`` tokens greedily (end of turn suppressed, so the
    trajectory is long). Then every codec replays that same trajectory with error recording
    (:mod:`kvarn_eval.attention`). Replaying in ``chunk``-token steps is equivalent to decoding
    one token per step, because tiles are flushed only when complete (:mod:`kvarn_eval.cache`),
    and it keeps every row on identical tokens, so the errors measure the cache alone.
    """
    check_chunk(codecs, chunk)
    install(bundle.model)
    t0 = time.perf_counter()
    prompt_ids = chat_prompt_ids(bundle, prompt)
    gen = greedy(
        bundle,
        [FP16Cache()],
        [prompt_ids],
        n_steps,
        chunk=chunk,
        suppress_eos=True,
        progress=progress,
        desc="fp16 trajectory",
    )
    seq = list(prompt_ids) + [int(t) for t in gen[0, 0]]
    rows = len(codecs)
    cache = TiledKVCache(codecs, bundle.num_layers, keep_exact=True, capacity=len(seq))
    rec = AttentionErrorRecorder(cache, bundle.num_layers)
    ids = torch.tensor(seq, dtype=torch.long, device=model_device(bundle))[None].expand(rows, -1)
    with recording(rec):
        for s in tqdm(range(0, len(seq), chunk), desc="replay", unit="chunk", disable=not progress):
            _step(bundle.model, ids[:, s : s + chunk], cache, last_only=True)
    return AccumulationResult(
        _names(codecs), len(prompt_ids), seq, rec.local(), rec.e2e(), time.perf_counter() - t0
    )
