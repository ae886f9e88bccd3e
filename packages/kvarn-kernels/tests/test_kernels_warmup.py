"""kvarn_kernels.warmup: the scratch launches cover every compile a serving step can select."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

import kvarn_kernels._launch
from kvarn_format import parse_cache_dtype, record_layout
from kvarn_kernels import decode_attention, prefill_attention, rotate, verify_attention
from kvarn_kernels.attention import (
    choose_decode_splits,
    decode_plan,
    prefill_v2_splits,
    request_slots,
)
from kvarn_kernels.context import _dequant_context_kernel
from kvarn_kernels.rotation import _block_r, _rotate_rows_kernel
from kvarn_kernels.warmup import _token_counts, fused_prefill_batches, warmup

# The integer arguments of prefill-side kernels that change between steps or between the
# warm-up's scratch launches and a server's (its block-table width).
PER_STEP_INTEGERS = {
    _dequant_context_kernel: {"stride_bt", "n_progs"},
    _rotate_rows_kernel: {"n_rows"},
}


@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (64, 8), (8, 1), (12, 4), (40, 8), (128, 16)])
def test_token_counts_reach_every_rotation_row_tile(hq: int, hk: int) -> None:
    """Each row count a step can have (K/V rows T * Hk, query rows T * Hq) falls in a
    row-tile class that one of the warm-up's token counts also reaches."""
    counts = _token_counts(hq, hk)
    for heads in (hk, hq):
        reachable = {_block_r(t * heads) for t in range(1, 20_000)}
        warmed = {_block_r(t * heads) for t in counts}
        assert warmed == reachable, (heads, counts)


def test_warmup_runs_every_prefill_op(device: torch.device) -> None:
    """All launches go through the public ops' argument checks (on a CPU under the
    interpreter, where nothing is compiled) and return. (Grouped queries, 2 per KV head, on
    few heads: the interpreter's time follows the heads of the stores and of decode, while
    the prefill token counts reach the same row counts at any head count; 16/8 heads took
    76 s, 4/2 47 s.)"""
    n = warmup(
        "kvarn_k4v4_g128",
        head_dim=64,
        num_q_heads=4,
        num_kv_heads=2,
        device=device,
        dtype=torch.bfloat16,
    )
    # stores 2, rotation + pool write + prefill per token count, decode 1 split x 2 batches
    assert n == 2 + 3 * len(_token_counts(4, 2)) + 2


def test_warmup_compiles_decode_and_verify_for_every_split_count(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode, and with drafts verify_attention, launch once per split count a batch can take
    (two row counts each). The ops are recorded, not run: test_warmup_runs_every_prefill_op
    runs a whole warm-up, and the interpreter took 150 s for these server-sized ones (every
    launch pays for the scratch context of the wide table)."""
    import importlib

    from kvarn_kernels.attention import verify_token_groups

    warmup_module = importlib.import_module("kvarn_kernels.warmup")
    launches: list[tuple[str, int | None]] = []

    def recorder(name: str) -> Any:
        def record(*args: Any, **kw: Any) -> None:
            launches.append((name, kw.get("num_splits")))

        return record

    for name in (
        "flush_tiles",
        "flush_token_tiles",
        "rotate",
        "write_side_pool",
        "prefill_attention",
        "decode_attention",
        "verify_attention",
    ):
        monkeypatch.setattr(warmup_module, name, recorder(name))
    kw: dict[str, Any] = dict(head_dim=64, num_q_heads=8, num_kv_heads=2, device=device)
    server: dict[str, Any] = dict(max_num_seqs=64, block_table_width=32)
    dev = torch.device(device)
    decode_splits = {choose_decode_splits(b, 2, 32, dev) for b in range(1, 65)}
    assert len(decode_splits) > 1

    def run(**extra: Any) -> dict[str, list[int | None]]:
        launches.clear()
        n = warmup("kvarn_k4v2_g64", **kw, **server, **extra)
        assert n == len(launches) - 2  # the direct-flush job rotates its K and V rows first
        by_op: dict[str, list[int | None]] = {}
        for op, splits in launches:
            by_op.setdefault(op, []).append(splits)
        return by_op

    plain = run()
    assert sorted(plain["decode_attention"]) == sorted([*decode_splits] * 2)  # type: ignore[type-var]
    assert "verify_attention" not in plain
    with_drafts = run(verify_width=4)
    groups = verify_token_groups(8, 2, 4)
    splits = {choose_decode_splits(b * groups, 2, 32, dev) for b in range(1, 65)}
    assert sorted(with_drafts["verify_attention"]) == sorted([*splits] * 2)  # type: ignore[type-var]
    assert with_drafts["decode_attention"] == plain["decode_attention"]
    assert len(with_drafts["prefill_attention"]) == len(_token_counts(8, 2))
    assert len(with_drafts["rotate"]) == len(_token_counts(8, 2)) + 2


@pytest.mark.parametrize(
    ("hq", "hk", "d", "width", "seqs", "max_query", "budget"),
    [
        (32, 8, 128, 128, 40, 64, None),  # Qwen3-8B, auto
        (8, 1, 128, 128, 150, 16, None),  # rows not always a multiple of 16; two slot classes
        (12, 4, 64, 6, 20, 64, 300),  # a narrow table; the token budget bounds the batches
        (16, 2, 256, 64, 9, 700, 2048),  # fused for every chunk: a step's budget
    ],
)
def test_fused_prefill_batches_cover_every_compile_class(
    hq: int, hk: int, d: int, width: int, seqs: int, max_query: int, budget: int | None
) -> None:
    """Every batch a server can send to the fused prefill (1 to ``seqs`` requests of 1 to
    ``max_query`` tokens each, within the table and the budget) falls in the compile class
    of one warm-up batch, each warm-up batch is such a batch, and it is the smallest of its
    class."""
    g, sms = 64, 132
    from kvarn_kernels.prefill_v2 import default_block_m

    def compile_class(reqs: int, tokens: int) -> tuple[int, int, int]:
        rows = tokens * hq
        splits = prefill_v2_splits(tokens, hq, hk, width, sms, block_m=default_block_m(d))
        return splits, request_slots(reqs), 1 if rows == 1 else 16 if rows % 16 == 0 else 0

    longest = min(max_query, width * g - 1)
    cap = seqs * longest if budget is None else budget
    smallest: dict[tuple[int, int, int], int] = {}
    for reqs in range(1, seqs + 1):
        for tokens in range(reqs, min(reqs * longest, cap) + 1):
            key = compile_class(reqs, tokens)
            smallest[key] = min(smallest.get(key, tokens), tokens)
    batches = fused_prefill_batches(
        hq, hk, d, g, width, sms, max_num_seqs=seqs, max_query=max_query, max_tokens=budget
    )
    for reqs, tokens in batches:
        assert 1 <= reqs <= seqs and reqs <= tokens <= min(reqs * longest, cap)
    warmed = {compile_class(*b): b[1] for b in batches}
    assert warmed == smallest
    assert len(batches) == len(warmed)  # one batch per class
    assert fused_prefill_batches(hq, hk, d, g, width, sms, max_num_seqs=seqs, max_query=0) == []


def test_warmup_launches_the_fused_prefill_batches(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``fused_prefill_max_query``, one fused prefill per batch of
    :func:`fused_prefill_batches`, of those requests and tokens; none without it."""
    import importlib

    warmup_module = importlib.import_module("kvarn_kernels.warmup")
    fused: list[tuple[int, int]] = []

    def record(fmt: Any, q: torch.Tensor, *args: Any, method: str = "dequant", **kw: Any) -> None:
        if method == "fused":
            qsl = args[4]
            fused.append((int(qsl.numel()) - 1, int(q.shape[0])))
            assert int(qsl[-1]) == q.shape[0]

    monkeypatch.setattr(warmup_module, "prefill_attention", record)
    for name in ("flush_tiles", "flush_token_tiles", "rotate", "write_side_pool"):
        monkeypatch.setattr(warmup_module, name, lambda *args, **kw: args[0] if args else None)
    monkeypatch.setattr(warmup_module, "decode_attention", lambda *args, **kw: None)
    kw: dict[str, Any] = dict(head_dim=64, num_q_heads=8, num_kv_heads=1, device=device)
    server: dict[str, Any] = dict(max_num_seqs=20, block_table_width=8)
    warmup("kvarn_k4v2_g64", **kw, **server)
    assert fused == []
    warmup("kvarn_k4v2_g64", **kw, **server, fused_prefill_max_query=64)
    sms = (
        8
        if torch.device(device).type == "cpu"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )
    expected = fused_prefill_batches(8, 1, 64, 64, 8, sms, max_num_seqs=20, max_query=64)
    assert len(expected) > 3 and sorted(fused) == expected


def test_warmup_runs_the_servers_decode_variant(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's decode kernel (``variant``, ``mma_rows``) is the one warmed up."""
    import importlib

    # the module (the package's attribute ``warmup`` is the function)
    warmup_module = importlib.import_module("kvarn_kernels.warmup")
    seen: list[dict[str, Any]] = []
    real = warmup_module.decode_attention

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append({k: kw.get(k) for k in ("variant", "mma_rows")})
        return real(*args, **kw)

    monkeypatch.setattr(warmup_module, "decode_attention", spy)
    # only decode runs (the whole warm-up runs in test_warmup_runs_every_prefill_op)
    for name in ("flush_tiles", "flush_token_tiles", "write_side_pool", "prefill_attention"):
        monkeypatch.setattr(warmup_module, name, lambda *args, **kw: None)
    kw: dict[str, Any] = dict(head_dim=64, num_q_heads=8, num_kv_heads=2, device=device)
    warmup("kvarn_k4v2_g64", **kw, decode_variant="v4d", decode_mma_rows=4)
    assert seen and all(s == {"variant": "v4d", "mma_rows": 4} for s in seen)


def test_warmup_refuses_an_unknown_format(device: torch.device) -> None:
    with pytest.raises(ValueError, match="kvarn"):
        warmup("kvarn_k9v9_g128", head_dim=64, num_q_heads=4, num_kv_heads=1, device=device)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"fused_prefill_max_query": -1}, "fused_prefill_max_query must be >= 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
    ],
)
def test_warmup_refuses_bad_fused_prefill_bounds(
    device: torch.device, bad: dict[str, int], match: str
) -> None:
    geometry: dict[str, Any] = dict(head_dim=64, num_q_heads=4, num_kv_heads=1, device=device)
    with pytest.raises(ValueError, match=match):
        warmup("kvarn_k4v2_g64", **geometry, **bad)


def test_per_step_integers_are_not_specialized() -> None:
    """Triton specializes an integer on its value being 1 or a multiple of 16; one that
    changes per step would select a new compile in the middle of serving."""
    for kernel, names in PER_STEP_INTEGERS.items():
        if not isinstance(kernel, JITFunction):  # the interpreter's wrapper keeps the options
            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        unspecialized = {p.name for p in kernel.params if p.do_not_specialize}
        assert names <= unspecialized, (kernel.__name__, names - unspecialized)


def test_sliced_pointers_are_not_specialized_on_alignment() -> None:
    """The plugin passes each run's rows of the batch's block table and lengths, slices that
    start at any row: a prefill kernel specialized on their 16-byte alignment would compile
    again in the middle of serving whenever a run starts at another row."""
    from kvarn_kernels._common import SLICED_POINTERS
    from kvarn_kernels.attention import _attn_kernel
    from kvarn_kernels.prefill_v2 import prefill_v2_kernel
    from kvarn_kernels.prefill_v3 import prefill_v3_kernel, prefill_v3ws_kernel

    kernels = (
        _attn_kernel,
        prefill_v2_kernel,
        prefill_v3_kernel,
        prefill_v3ws_kernel,
        _dequant_context_kernel,
    )
    for kernel in kernels:
        if not isinstance(kernel, JITFunction):  # the interpreter's wrapper keeps the options
            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        names = {p.name for p in kernel.params}
        unaligned = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
        assert "BLOCK_TABLE" in names
        assert names & set(SLICED_POINTERS) <= unaligned, kernel.__name__


def _compiles(*kernels: Any) -> int:
    """The kernels' compiled variants, on every device."""
    return sum(len(c[0]) for k in kernels for c in k.device_caches.values())


def _compiled_variants() -> dict[str, int]:
    return {kernel.__name__: _compiles(kernel) for kernel in PER_STEP_INTEGERS}


@pytest.mark.gpu
@pytest.mark.parametrize("shadow", [0, 27])
def test_prefill_after_warmup_compiles_nothing(shadow: int) -> None:
    """After the warm-up, a prefill step shaped like a server's (a 79-wide block table whose
    rows are sliced from the batch's at an unaligned row, ragged requests, a token count the
    warm-up never used, whole-tile or shadowed pool slots) finds every kernel compiled."""
    dev = torch.device("cuda")
    fmt, g, hq, hk, d = "kvarn_k4v2_g128", 128, 32, 8, 128
    warmup(fmt, head_dim=d, num_q_heads=hq, num_kv_heads=hk, device=dev, shadow_rows=shadow)
    before = _compiled_variants()
    tile_bytes = record_layout(parse_cache_dtype(fmt), d).tile_bytes
    seq_lens, new_tokens = [3 * g + 5, 2 * g + 77], [301, 76]
    kv_cache = torch.zeros(8, hk, tile_bytes, dtype=torch.uint8, device=dev)
    pool_k = torch.zeros(2, g - shadow, hk, d, dtype=torch.float16, device=dev)
    block_table = torch.zeros(3, 79, dtype=torch.int32, device=dev)[1:]  # row 1: 316 bytes in
    block_table[0, :4] = torch.tensor([0, 1, 2, 3])
    block_table[1, :3] = torch.tensor([4, 5, 6])
    block_to_slot = torch.full((8,), -1, dtype=torch.int32, device=dev)
    starts = [0, new_tokens[0], sum(new_tokens)]
    q = rotate(torch.randn(sum(new_tokens), hq, d, device=dev, dtype=torch.float16))
    prefill_attention(
        fmt,
        q,
        kv_cache,
        pool_k,
        torch.zeros_like(pool_k),
        block_table,
        torch.tensor(starts, dtype=torch.int32, device=dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_to_slot,
        d**-0.5,
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=starts,
    )
    torch.cuda.synchronize()
    assert _compiled_variants() == before


# a server-shaped case for the decode and verify checks: 256 requests, a 128-wide block table
SERVER_FMT, SERVER_G, SERVER_HQ, SERVER_HK, SERVER_D = "kvarn_k4v2_g128", 128, 32, 8, 128


def _warm_like_a_server(
    verify_width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Warm up as the plugin does for that server; returns scratch ``kv_cache``, ``pool_k``
    and ``block_to_slot`` (no pooled block) for the calls to check."""
    dev = torch.device("cuda")
    warmup(
        SERVER_FMT,
        head_dim=SERVER_D,
        num_q_heads=SERVER_HQ,
        num_kv_heads=SERVER_HK,
        device=dev,
        verify_width=verify_width,
        max_num_seqs=256,
        block_table_width=128,
    )
    tile_bytes = record_layout(parse_cache_dtype(SERVER_FMT), SERVER_D).tile_bytes
    kv_cache = torch.zeros(8, SERVER_HK, tile_bytes, dtype=torch.uint8, device=dev)
    pool_k = torch.zeros(2, SERVER_G, SERVER_HK, SERVER_D, dtype=torch.float16, device=dev)
    block_to_slot = torch.full((8,), -1, dtype=torch.int32, device=dev)
    return kv_cache, pool_k, block_to_slot


def _attention_compiles() -> int:
    from kvarn_kernels.attention import _attn_kernel, _merge_unrotate_kernel
    from kvarn_kernels.decode_pool import decode_pool_kernel
    from kvarn_kernels.decode_v4 import decode_v4_kernel
    from kvarn_kernels.decode_v5 import decode_v5_kernel
    from kvarn_kernels.decode_v6 import decode_v6_kernel

    kernels = (
        decode_v4_kernel,
        decode_v5_kernel,
        decode_v6_kernel,
        decode_pool_kernel,
        _attn_kernel,
        _merge_unrotate_kernel,
    )
    return _compiles(*kernels)


@pytest.mark.gpu
def test_decode_after_warmup_compiles_nothing() -> None:
    """After the warm-up, eager decode batches of 1-256 requests find their kernels compiled:
    engines without FULL decode graphs (vLLM downgrades to piecewise graphs under speculative
    decoding) compiled decode mid-serving in the eighth session's H200 run."""
    kv_cache, pool_k, block_to_slot = _warm_like_a_server()
    before = _attention_compiles()
    dev, hq, hk, d = kv_cache.device, SERVER_HQ, SERVER_HK, SERVER_D
    block_table = torch.zeros(256, 128, dtype=torch.int32, device=dev)
    seq_lens = torch.full((256,), 3 * SERVER_G + 7, dtype=torch.int32, device=dev)
    for reqs in (1, 2, 3, 5, 17, 37, 64, 100, 200, 256):
        # as the plugin calls it: the variant and split count of decode_plan
        plan = decode_plan(SERVER_FMT, reqs, hq, hk, d, 128, dev)
        decode_attention(
            SERVER_FMT,
            torch.randn(reqs, hq, d, device=dev, dtype=torch.float16),
            kv_cache,
            pool_k,
            torch.zeros_like(pool_k),
            block_table[:reqs],
            seq_lens[:reqs],
            block_to_slot,
            d**-0.5,
            num_splits=plan.num_splits,
            variant=plan.variant,
        )
    torch.cuda.synchronize()
    assert _attention_compiles() == before


@pytest.mark.gpu
def test_verify_after_warmup_compiles_nothing() -> None:
    """After a warm-up with drafts, verify batches of several sizes on a server-shaped block
    table (128 wide; row slices copied as the plugin does) find their kernels compiled."""
    width = 4
    kv_cache, pool_k, block_to_slot = _warm_like_a_server(verify_width=width)
    before = _attention_compiles()
    dev, hq, d, g = kv_cache.device, SERVER_HQ, SERVER_D, SERVER_G
    for reqs in (1, 3, 37, 200):
        qlens = [1 + r % width for r in range(reqs)]
        t = sum(qlens)
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        verify_attention(
            SERVER_FMT,
            torch.randn(t, hq, d, device=dev, dtype=torch.float16),
            kv_cache,
            pool_k,
            torch.zeros_like(pool_k),
            torch.zeros(reqs, 128, dtype=torch.int32, device=dev),
            qsl.to(dev),
            torch.full((reqs,), 3 * g + 7, dtype=torch.int32, device=dev),
            block_to_slot,
            d**-0.5,
            max_query_len=width,
        )
    torch.cuda.synchronize()
    assert _attention_compiles() == before


@pytest.mark.gpu
def test_fused_prefill_after_warmup_compiles_nothing() -> None:
    """After a warm-up with ``fused_prefill_max_query`` (as the plugin's ``auto`` does),
    batches of short chunks of 1-256 requests (ragged, with and without cached context;
    their block-table rows and lengths sliced from a batch's at any row, as the plugin's runs
    are) find the fused prefill's kernels compiled: with it off, the fused kernels compiled
    while serving (docs/vllm-plugin.md)."""
    from kvarn_kernels.attention import _merge_unrotate_kernel
    from kvarn_kernels.prefill_v2 import prefill_v2_kernel
    from kvarn_kernels.prefill_v3 import prefill_v3_kernel, prefill_v3ws_kernel

    fused = (prefill_v3ws_kernel, prefill_v3_kernel, prefill_v2_kernel, _merge_unrotate_kernel)
    dev, hq, hk, d, g = torch.device("cuda"), SERVER_HQ, SERVER_HK, SERVER_D, SERVER_G
    width = 79  # rows of 316 bytes: one row in four starts 16-byte aligned
    warmup(
        SERVER_FMT,
        head_dim=d,
        num_q_heads=hq,
        num_kv_heads=hk,
        device=dev,
        max_num_seqs=256,
        block_table_width=width,
        fused_prefill_max_query=64,
        max_num_batched_tokens=8192,
    )
    before = _compiles(*fused)
    assert before > 0
    tile_bytes = record_layout(parse_cache_dtype(SERVER_FMT), d).tile_bytes
    kv_cache = torch.zeros(8, hk, tile_bytes, dtype=torch.uint8, device=dev)
    pool_k = torch.zeros(2, g, hk, d, dtype=torch.float16, device=dev)
    block_to_slot = torch.full((8,), -1, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(1)
    batch_table = torch.zeros(260, width, dtype=torch.int32, device=dev)
    batch_lens = torch.zeros(260, dtype=torch.int32, device=dev)
    for reqs in (1, 2, 3, 7, 20, 64, 127, 128, 200, 256):
        for start, longest in enumerate((1, 17, 64)):  # the run's first row: 0, 1, 2
            q_lens = torch.randint(1, longest + 1, (reqs,), generator=gen)
            context = torch.randint(0, 6 * g, (reqs,), generator=gen)
            qsl = [0, *q_lens.cumsum(0).tolist()]
            rows = slice(start, start + reqs)
            batch_lens[rows] = (q_lens + context).to(device=dev, dtype=torch.int32)
            prefill_attention(
                SERVER_FMT,
                torch.randn(qsl[-1], hq, d, device=dev, dtype=torch.float16),
                kv_cache,
                pool_k,
                torch.zeros_like(pool_k),
                batch_table[rows],
                torch.tensor(qsl, dtype=torch.int32, device=dev),
                batch_lens[rows],
                block_to_slot,
                d**-0.5,
                method="fused",
            )
    torch.cuda.synchronize()
    assert _compiles(*fused) == before


def test_gpu_launches_run_on_threads_on_the_callers_device_and_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the warm-up's launches run from several threads (their compiles overlap),
    each inside the caller's device and stream, every launch runs even when one fails, and
    the failure is raised afterwards; ``max_threads=1`` runs them in order on the caller's
    thread. (CUDA calls stubbed: the threading is what is checked here; the GPU tests
    ``test_*_after_warmup_compiles_nothing`` check the real warm-up.)"""
    import contextlib
    import importlib
    import threading
    import time

    # the module (the package's ``warmup`` attribute is the function)
    warmup_module = importlib.import_module("kvarn_kernels.warmup")

    entered: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev: "caller-stream")
    monkeypatch.setattr(
        torch.cuda,
        "device",
        lambda dev: contextlib.nullcontext(entered.append(("device", dev))),
    )
    monkeypatch.setattr(
        torch.cuda,
        "stream",
        lambda s: contextlib.nullcontext(entered.append(("stream", s))),
    )
    synced: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    made: list[torch.device] = []
    monkeypatch.setattr(warmup_module, "_make_device_caches", made.append)
    dev = torch.device("cuda", 1)
    ran: list[tuple[int, int]] = []

    def job(i: int) -> None:
        time.sleep(0.05)  # long enough for the pool to start every thread
        ran.append((i, threading.get_ident()))
        if i == 3:
            raise RuntimeError("launch 3 failed")

    jobs = [lambda i=i: job(i) for i in range(8)]
    with pytest.raises(RuntimeError, match="launch 3 failed"):
        warmup_module._run_all(jobs, dev, max_threads=4)
    assert sorted(i for i, _ in ran) == list(range(8))
    assert len({t for _, t in ran}) > 1 and threading.get_ident() not in {t for _, t in ran}
    assert entered.count(("device", dev)) == 8 and entered.count(("stream", "caller-stream")) == 8
    assert made == [dev]
    # a device without an index is the caller's current device, not the threads' (device 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    entered.clear()
    ran.clear()
    warmup_module._run_all([lambda: job(0), lambda: job(1)], torch.device("cuda"), max_threads=2)
    assert entered.count(("device", dev)) == 2 and sorted(i for i, _ in ran) == [0, 1]
    ran.clear()
    warmup_module._run_all([lambda i=i: job(i) for i in (0, 1, 2)], dev, max_threads=1)
    assert [i for i, _ in ran] == [0, 1, 2] and {t for _, t in ran} == {threading.get_ident()}


class _LaunchSpy:
    """Stands in for a Triton kernel: records what would select each launch's compile, and
    launches nothing (the interpreter took ~50 s a test to run the kernels, whose outputs
    these tests do not read): the keyword arguments (compile-time constants and launch
    options) and how Triton specializes each positional int argument (being 1, being a
    multiple of 16) unless it is one of ``runtime_ints`` (the kernel's
    ``do_not_specialize``; the interpreter does not keep that list, so the test passes
    it)."""

    def __init__(self, kernel: Any, runtime_ints: tuple[str, ...] = ()) -> None:
        self.kernel = kernel
        self.names = list(inspect.signature(kernel.fn).parameters)
        self.runtime_ints = runtime_ints
        self.constants: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        def run(*args: Any, **kw: Any) -> Any:
            ints = {
                name: native_specialize_impl(BaseBackend, a, False, True, True)
                for name, a in zip(self.names, args, strict=False)
                if type(a) is int and name not in self.runtime_ints
            }
            self.constants.append({**kw, **ints})

        return run


@pytest.mark.parametrize("variant", ["v1", "auto"])
def test_decode_compile_constants_do_not_depend_on_the_batch_size(
    device: torch.device, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up compiles decode for batches of 1 and 16 requests per split count; every
    other batch size must select the compile-time constants and int specializations of one of
    those, or serving compiles a new kernel when the batch first reaches it (the eleventh
    session's head-512 engine did, v1's request-search width following the batch size; the
    twelfth session's k5v5 engine too, v1's request count specialized on being 1 or a
    multiple of 16)."""
    import kvarn_kernels.attention as attention
    import kvarn_kernels.decode_v4 as decode_v4

    spies = {
        "v1": _LaunchSpy(attention._attn_kernel, attention.BATCH_INTS),
        "v4": _LaunchSpy(decode_v4.decode_v4_kernel),
    }
    monkeypatch.setattr(attention, "_attn_kernel", spies["v1"])
    monkeypatch.setattr(decode_v4, "decode_v4_kernel", spies["v4"])
    # every launch through kernel[grid](...), where the spies see it: launch() would call a
    # known specialization's launcher directly on a GPU
    monkeypatch.setattr(kvarn_kernels._launch, "triton_interpret", lambda: True)
    fmt, g, hq, hk, d = "kvarn_k4v2_g64", 64, 8, 2, 64
    tile_bytes = record_layout(parse_cache_dtype(fmt), d).tile_bytes
    kv_cache = torch.zeros(2, hk, tile_bytes, dtype=torch.uint8, device=device)
    pool_k = torch.zeros(2, g, hk, d, dtype=torch.float16, device=device)
    block_to_slot = torch.tensor([-1, 0], dtype=torch.int32, device=device)
    batches = (1, 16, 2, 3, 8, 21, 32, 33)  # the warm-up's two first
    for reqs in batches:
        table = torch.tensor([[0, 1]] * reqs, dtype=torch.int32, device=device)
        decode_attention(
            fmt,
            torch.randn(reqs, hq, d, device=device, dtype=torch.float16),
            kv_cache,
            pool_k,
            torch.zeros_like(pool_k),
            table,
            torch.full((reqs,), g + 1, dtype=torch.int32, device=device),
            block_to_slot,
            d**-0.5,
            num_splits=1,
            variant=variant,
        )
    launched = spies["v1" if variant == "v1" else "v4"].constants
    assert len(launched) == len(batches)
    warm = launched[:2]
    for reqs, kw in zip(batches[2:], launched[2:], strict=True):
        assert kw in warm, f"{reqs} requests: {kw} is none of the warm-up's {warm}"
