"""Side-pool bookkeeping: hand-worked scenarios plus a randomized serving simulation.

The simulation models what matters of vLLM's scheduler (paged blocks, a content-hashed
prefix cache with LRU eviction, chunked prefill, preemption with recompute, speculative
drafts that may be rejected) and of the device (pool slots, packed tiles). After every
step it checks that every position a scheduled request reads is found, with the right
content, wherever ``block_to_slot`` says the block lives. That is the property the
tracker exists for: a wrong flush (a draft frozen into a tile, a sink quantized too early,
a finished request's block lost before a prefix hit) shows up as a wrong read.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from kvarn_format.sizing import ServingConfig, SidePool, rollback_blocks, side_pool_slots
from kvarn_vllm.tracker import (
    CachedRequest,
    NewRequest,
    SidePoolExhaustedError,
    SidePoolTracker,
    StepInput,
    StepPlan,
)

G = 4


def _mapping(plans: list[StepPlan]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in plans:
        out.update(zip(p.map_blocks, p.map_slots, strict=True))
    return out


def _flushes(plans: list[StepPlan]) -> list[tuple[int, int]]:
    return [pair for p in plans for pair in zip(p.flush_slots, p.flush_blocks, strict=True)]


def test_prompt_then_decode_keeps_sink_and_tail_flushes_committed_blocks() -> None:
    tr = SidePoolTracker(num_slots=8, group=G, direct_flush=False)
    # A 10-token prompt in blocks 7, 3, 9.
    plan = tr.step(StepInput(new=[NewRequest("a", [7, 3, 9], 0)], num_scheduled={"a": 10}))
    assert plan.flush_blocks == []
    assert set(plan.map_blocks) == {7, 3, 9} and -1 not in plan.map_slots
    # Next step: the prompt is committed; block 3 (full, not the sink) is quantized,
    # block 7 (sink) and block 9 (in progress, 2 of 4 tokens) stay in the pool.
    slot3 = tr.slot_of(3)
    plan = tr.step(StepInput(cached=[CachedRequest("a", None, False, 10)], num_scheduled={"a": 1}))
    assert list(zip(plan.flush_slots, plan.flush_blocks, strict=True)) == [(slot3, 3)]
    assert tr.slot_of(3) is None and tr.slot_of(7) is not None and tr.slot_of(9) is not None
    # Tokens 11 and 12 complete block 9 and open block 5.
    tr.step(StepInput(cached=[CachedRequest("a", None, False, 11)], num_scheduled={"a": 1}))
    plan = tr.step(StepInput(cached=[CachedRequest("a", [5], False, 12)], num_scheduled={"a": 1}))
    assert plan.flush_blocks == [9]
    assert tr.slot_of(5) is not None
    assert tr.slot_of(7) is not None  # the sink is never quantized while the request lives
    assert tr.slots_used == 2


def test_only_committed_tokens_are_flushed_with_speculative_drafts() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    tr.step(StepInput(new=[NewRequest("a", [0, 1, 2], 0)], num_scheduled={"a": 5}))
    # Verify step: last token (pos 5) + 2 drafts (pos 6, 7) fill block 1 ...
    tr.step(
        StepInput(
            cached=[CachedRequest("a", None, False, 5)],
            num_scheduled={"a": 3},
            num_spec={"a": 2},
        )
    )
    # ... but both drafts are rejected: the scheduler reports 6 computed tokens.
    plan = tr.step(StepInput(cached=[CachedRequest("a", None, False, 6)], num_scheduled={"a": 1}))
    assert 1 not in plan.flush_blocks, "a block holding unverified drafts was quantized"
    assert tr.slot_of(1) is not None
    # Position 6 and 7 are rewritten; once 8 tokens are committed, block 1 is flushed.
    tr.step(StepInput(cached=[CachedRequest("a", None, False, 7)], num_scheduled={"a": 1}))
    plan = tr.step(StepInput(cached=[CachedRequest("a", None, False, 8)], num_scheduled={"a": 1}))
    assert plan.flush_blocks == [1]


def test_finished_request_flushes_full_blocks_and_retires_its_sink() -> None:
    tr = SidePoolTracker(num_slots=8, group=G, direct_flush=False)
    tr.step(StepInput(new=[NewRequest("a", [4, 5, 6], 0)], num_scheduled={"a": 10}))
    # Finishes right after its prompt (no later step ever committed blocks 5 and 6).
    plan = tr.step(StepInput(finished=["a"]))
    assert plan.flush_blocks == [5], "full non-sink blocks must hold valid packed tiles"
    assert tr.slot_of(6) is None, "partial blocks are dropped"
    assert tr.retired_sinks() == [4] and tr.slot_of(4) is not None
    # A prefix hit on blocks 4 and 5 re-adopts the fp16 sink as is and reads block 5 packed.
    plan = tr.step(StepInput(new=[NewRequest("b", [4, 5, 8], 8)], num_scheduled={"b": 2}))
    assert plan.flush_blocks == []
    assert tr.retired_sinks() == []
    assert tr.slot_of(4) is not None and tr.slot_of(5) is None and tr.slot_of(8) is not None


def test_without_prefix_caching_nothing_is_flushed_on_release() -> None:
    tr = SidePoolTracker(num_slots=8, group=G, prefix_caching=False)
    tr.step(StepInput(new=[NewRequest("a", [4, 5, 6], 0)], num_scheduled={"a": 10}))
    plan = tr.step(StepInput(finished=["a"]))
    assert plan.flush_blocks == []
    assert tr.slots_used == 0 and tr.retired_sinks() == []


def test_shared_sink_stays_until_last_owner_finishes() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    tr.step(StepInput(new=[NewRequest("a", [4, 5], 0)], num_scheduled={"a": 6}))
    tr.step(
        StepInput(
            new=[NewRequest("b", [4, 7], 4)],
            cached=[CachedRequest("a", None, False, 6)],
            num_scheduled={"a": 1, "b": 2},
        )
    )
    tr.step(StepInput(finished=["a"]))
    assert tr.slot_of(4) is not None and tr.retired_sinks() == []
    tr.step(StepInput(finished=["b"]))
    assert tr.retired_sinks() == [4]


def test_preempted_request_recomputes_and_hits_its_own_blocks() -> None:
    tr = SidePoolTracker(num_slots=8, group=G, direct_flush=False)
    tr.step(StepInput(new=[NewRequest("a", [1, 2, 3], 0)], num_scheduled={"a": 9}))
    plan = tr.step(StepInput(preempted=["a"]))
    assert plan.flush_blocks == [2]
    assert tr.live_requests() == []
    # Resumed (V1 style) with a hit on its first two blocks and a fresh third block.
    plan = tr.step(
        StepInput(cached=[CachedRequest("a", [1, 2, 11], True, 8)], num_scheduled={"a": 2})
    )
    assert tr.request_blocks("a") == [1, 2, 11]
    assert tr.slot_of(1) is not None and tr.slot_of(2) is None and tr.slot_of(11) is not None


def test_retired_sinks_are_evicted_under_pressure_then_pool_exhausts_loudly() -> None:
    tr = SidePoolTracker(num_slots=3, group=G, direct_flush=False)
    tr.step(StepInput(new=[NewRequest("a", [0, 1], 0)], num_scheduled={"a": 4}))
    tr.step(StepInput(finished=["a"]))
    assert tr.retired_sinks() == [0]
    # Three new blocks need three slots: the retired sink is quantized to make room.
    plan = tr.step(StepInput(new=[NewRequest("b", [5, 6, 7], 0)], num_scheduled={"b": 12}))
    assert (0 in plan.flush_blocks) and tr.slot_of(0) is None
    # Next step b's full blocks 6 and 7 are flushed (2 free slots), but c needs 3 and b's
    # live sink cannot be evicted.
    with pytest.raises(SidePoolExhaustedError, match="max-num-seqs"):
        tr.step(StepInput(new=[NewRequest("c", [8, 9, 10], 0)], num_scheduled={"c": 12}))


def test_scheduler_blocks_spanning_several_tiles_are_expanded() -> None:
    tr = SidePoolTracker(num_slots=8, group=G, blocks_per_scheduler_block=2, direct_flush=False)
    plan = tr.step(StepInput(new=[NewRequest("a", [3, 5], 0)], num_scheduled={"a": 9}))
    assert tr.request_blocks("a") == [6, 7, 10, 11]
    assert sorted(plan.map_blocks) == [6, 7, 10]


def test_unknown_request_and_missing_blocks_fail_closed() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    with pytest.raises(KeyError, match="never added"):
        tr.step(StepInput(num_scheduled={"ghost": 1}))
    with pytest.raises(ValueError, match="has only 1 blocks"):
        tr.step(StepInput(new=[NewRequest("a", [0], 0)], num_scheduled={"a": 5}))


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        SidePoolTracker(0, G)
    with pytest.raises(ValueError):
        SidePoolTracker(4, 0)
    with pytest.raises(ValueError):
        SidePoolTracker(4, G, spec_margin=-1)
    with pytest.raises(ValueError, match="pool_only_upto"):
        SidePoolTracker(4, G, pool_only_upto=-1)


def test_pending_plans_accumulate_in_order() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    tr.step(StepInput(new=[NewRequest("a", [0, 1, 2], 0)], num_scheduled={"a": 5}))
    tr.step(StepInput())  # nothing to flush or map: no plan
    tr.step(StepInput(cached=[CachedRequest("a", None, False, 5)], num_scheduled={"a": 4}))
    plans = tr.take_pending()
    assert [p.step for p in plans] == [1, 3]
    assert tr.take_pending() == []
    assert _mapping(plans)[0] == tr.slot_of(0)


# ----------------------------------------------------------------------------- direct flush


def _direct(plan: StepPlan) -> list[tuple[int, int, int]]:
    return list(zip(plan.direct_blocks, plan.direct_head_slots, plan.direct_head_lens, strict=True))


def test_direct_tiles_of_a_prompt_take_no_slot_and_are_never_flushed_again() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    # A 10-token prompt in blocks 7, 3, 9: block 3 is complete and committed after the step.
    plan = tr.step(StepInput(new=[NewRequest("a", [7, 3, 9], 0)], num_scheduled={"a": 10}))
    assert _direct(plan) == [(3, -1, 0)]
    assert set(plan.map_blocks) == {7, 9} and tr.slot_of(3) is None
    assert tr.slots_used == 2
    plan = tr.step(StepInput(cached=[CachedRequest("a", None, False, 10)], num_scheduled={"a": 1}))
    assert plan.flush_blocks == [] and _direct(plan) == []
    # It finishes: block 3 is already a packed record; nothing is flushed for it.
    plan = tr.step(StepInput(finished=["a"]))
    assert 3 not in plan.flush_blocks and tr.retired_sinks() == [7]
    # A prefix hit on blocks 7 and 3 reads the fp16 sink and the packed block 3.
    tr.step(StepInput(new=[NewRequest("b", [7, 3, 5], 8)], num_scheduled={"b": 3}))
    assert tr.slot_of(7) is not None and tr.slot_of(3) is None and tr.total_direct == 1


def test_chunk_starting_inside_a_block_frees_that_slot_for_its_new_tail() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    tr.step(StepInput(new=[NewRequest("a", [10, 11, 12, 13], 0)], num_scheduled={"a": 6}))
    s11 = tr.slot_of(11)
    assert s11 is not None and tr.slots_used == 2
    # Tokens 6..13: block 11 completes (its tokens 4, 5 are in slot s11), block 12 is written
    # whole, block 13 receives tokens 12, 13.
    plan = tr.step(StepInput(cached=[CachedRequest("a", None, False, 6)], num_scheduled={"a": 8}))
    assert _direct(plan) == [(11, s11, 2), (12, -1, 0)]
    assert tr.slot_of(11) is None and tr.slot_of(12) is None
    assert tr.slot_of(13) == s11, "the freed slot serves the new in-progress block"
    assert tr.slots_used == 2
    # The same step without direct flush needs a third slot (block 11 waits for its flush).
    old = SidePoolTracker(num_slots=8, group=G, direct_flush=False)
    old.step(StepInput(new=[NewRequest("a", [10, 11, 12, 13], 0)], num_scheduled={"a": 6}))
    old.step(StepInput(cached=[CachedRequest("a", None, False, 6)], num_scheduled={"a": 8}))
    assert old.slots_used == 4 and old.total_direct == 0


def test_sinks_drafts_margins_and_single_tokens_are_never_direct() -> None:
    tr = SidePoolTracker(num_slots=16, group=G)
    # The sink is block 0: never direct, even when the chunk completes it.
    plan = tr.step(StepInput(new=[NewRequest("a", [0, 1, 2], 0)], num_scheduled={"a": 8}))
    assert _direct(plan) == [(1, -1, 0)]
    assert tr.slot_of(0) is not None
    # A one-token step completing block 1 (position 7) keeps its slot until the next step.
    tr2 = SidePoolTracker(num_slots=16, group=G)
    tr2.step(StepInput(new=[NewRequest("b", [0, 1, 2], 0)], num_scheduled={"b": 7}))
    plan = tr2.step(StepInput(cached=[CachedRequest("b", None, False, 7)], num_scheduled={"b": 1}))
    assert _direct(plan) == [] and tr2.slot_of(1) is not None
    plan = tr2.step(StepInput(cached=[CachedRequest("b", None, False, 8)], num_scheduled={"b": 1}))
    assert plan.flush_blocks == [1]
    # A verify step whose drafts complete a block: not committed, not direct.
    tr3 = SidePoolTracker(num_slots=16, group=G)
    tr3.step(StepInput(new=[NewRequest("c", [0, 1, 2], 0)], num_scheduled={"c": 5}))
    plan = tr3.step(
        StepInput(
            cached=[CachedRequest("c", None, False, 5)], num_scheduled={"c": 3}, num_spec={"c": 2}
        )
    )
    assert _direct(plan) == [] and tr3.slot_of(1) is not None
    # Async scheduling with drafts: tiles ending within spec_margin of the chunk's end wait.
    tr4 = SidePoolTracker(num_slots=16, group=G, spec_margin=3)
    plan = tr4.step(StepInput(new=[NewRequest("d", [0, 1, 2, 3], 0)], num_scheduled={"d": 12}))
    assert _direct(plan) == [(1, -1, 0)] and tr4.slot_of(2) is not None


@pytest.mark.parametrize("pool_only_upto", [0, 3])
def test_short_steps_stay_in_the_pool_for_uniform_verify_graphs(pool_only_upto: int) -> None:
    """A verify step (1 + 2 drafts) whose committed token completes block 1: direct by
    default; with ``pool_only_upto`` = 3 (uniform verify graphs, whose replayed KV update has
    no direct tiles) the block keeps its slot and the next step flushes it. A longer step
    still goes direct."""
    tr = SidePoolTracker(num_slots=16, group=G, pool_only_upto=pool_only_upto)
    tr.step(StepInput(new=[NewRequest("a", [0, 1, 2], 0)], num_scheduled={"a": 7}))
    slot1 = tr.slot_of(1)  # holds tokens 4-6
    plan = tr.step(
        StepInput(
            cached=[CachedRequest("a", None, False, 7)], num_scheduled={"a": 3}, num_spec={"a": 2}
        )
    )
    if pool_only_upto:
        assert _direct(plan) == [] and tr.slot_of(1) is not None
        assert tr.total_kept_for_graphs == 1
        plan = tr.step(
            StepInput(cached=[CachedRequest("a", None, False, 8)], num_scheduled={"a": 1})
        )
        assert plan.flush_blocks == [1] and tr.slot_of(1) is None
    else:
        assert _direct(plan) == [(1, slot1, 3)]
        assert tr.slot_of(1) is None and tr.total_kept_for_graphs == 0
    # An 8-token chunk completing block 6 of another request goes direct either way.
    plan = tr.step(StepInput(new=[NewRequest("b", [5, 6, 7], 0)], num_scheduled={"b": 8}))
    assert [blk for blk, _, _ in _direct(plan)] == [6]


def test_a_block_rewritten_whole_drops_its_stale_slot() -> None:
    tr = SidePoolTracker(num_slots=8, group=G)
    tr.step(StepInput(new=[NewRequest("a", [4, 5], 0)], num_scheduled={"a": 6}))
    tr.step(StepInput(finished=["a"]))
    assert tr.retired_sinks() == [4]
    slots_before = tr.slots_used
    # vLLM evicted block 4 from its prefix cache and hands it to b as a fresh second block.
    plan = tr.step(StepInput(new=[NewRequest("b", [6, 4, 7], 0)], num_scheduled={"b": 9}))
    assert (4, -1, 0) in _direct(plan) and tr.slot_of(4) is None
    assert tr.retired_sinks() == [] and (4, -1) in zip(plan.map_blocks, plan.map_slots, strict=True)
    assert tr.slots_used == slots_before - 1 + 2  # b's sink 6 and tail 7; block 4 freed


# ----------------------------------------------------------------------------- simulation


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    generated: int = 0
    resumed: bool = False
    #: Block 0 came from the prefix cache (it may then be a packed record).
    sink_hit: bool = False


class _Sim:
    """A small vLLM-like engine driving the tracker, with a device model that checks reads.

    The scheduler follows vLLM 0.23's V1 ``Scheduler.schedule``: running requests first, in
    order, each taking ``min(need, budget)`` tokens (drafts included) and stopping when the
    budget is spent; preemption of the last running request when blocks run out; waiting
    requests only when nothing was preempted, with prefix-cache hits and the last one cut at
    the budget; blocks entered in the prefix cache when they are *scheduled* (so a request
    admitted later in the same step can hit a block being computed in it). The device applies
    the tracker's plans and, per forward, does what a layer does: direct tiles' heads are read
    from the pool first, then every token is written (pool slot or direct tile), then every
    request reads its whole history from wherever ``block_to_slot`` says.
    """

    def __init__(
        self,
        seed: int,
        *,
        num_blocks: int,
        num_slots: int,
        prefix_caching: bool,
        spec: int,
        v2_resume: bool,
        budget: int = 24,
        max_running: int = 6,
        long_prompts: bool = False,
        direct_flush: bool = True,
        spec_margin: int = 0,
        pool_only_upto: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.tr = SidePoolTracker(
            num_slots,
            G,
            prefix_caching=prefix_caching,
            direct_flush=direct_flush,
            spec_margin=spec_margin,
            pool_only_upto=pool_only_upto,
        )
        self.prefix_caching = prefix_caching
        self.spec = spec
        self.v2_resume = v2_resume
        self.budget = budget
        self.max_running = max_running
        self.long_prompts = long_prompts
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, tuple[int, ...]] = {}
        self.block_of_hash: dict[tuple[int, ...], int] = {}
        self.refs: dict[int, int] = {}
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.finished: list[str] = []
        self.block_to_slot: dict[int, int] = {}
        self.pool: dict[int, list[int | None]] = {s: [None] * G for s in range(num_slots)}
        self.tiles: dict[int, tuple[int | None, ...]] = {}
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(1000) for _ in range(n)] for n in (5, 9, 13)]
        self.reads = 0
        self.fp16_sink_hits = 0
        self.direct_tiles = 0
        self.direct_heads = 0
        self.same_step_hits = 0
        self.preemptions = 0
        #: Most slots held by live requests at once (retired sinks excluded: evictable).
        self.max_live = 0
        self._computing: set[int] = set()

    # -- scheduler side
    def add_request(self) -> None:
        prefix = self.rng.choice(self.prefixes)
        if self.long_prompts and self.rng.random() < 0.6:
            prefix = []  # a prompt of its own: its sink is not shared
        extra = self.rng.randrange(1, 40) if self.long_prompts else self.rng.randrange(0, 7)
        prompt = prefix + [self.rng.randrange(1000) for _ in range(extra)]
        self.waiting.append(
            _Req(f"r{self.next_id}", list(prompt), len(prompt), self.rng.randrange(1, 12))
        )
        self.next_id += 1

    def _alloc_block(self) -> int | None:
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(block, None)
        if h is not None:
            self.block_of_hash.pop(h, None)
        self.refs[block] = 1
        return block

    def _free_blocks(self, req: _Req) -> None:
        for block in reversed(req.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                self.free[block] = None
        req.blocks = []

    def _cache_full_blocks(self, req: _Req, upto: int) -> None:
        """vLLM's ``cache_blocks``: full blocks of final tokens up to position ``upto``."""
        if not self.prefix_caching:
            return
        for i in range(min(upto, len(req.tokens)) // G):
            h = tuple(req.tokens[: (i + 1) * G])
            if h not in self.block_of_hash:
                self.block_of_hash[h] = req.blocks[i]
                self.hash_of[req.blocks[i]] = h

    def _prefix_hit(self, req: _Req) -> None:
        if not self.prefix_caching:
            return
        for i in range((len(req.tokens) - 1) // G):
            block = self.block_of_hash.get(tuple(req.tokens[: (i + 1) * G]))
            if block is None:
                break
            if block in self.free:
                del self.free[block]
            self.refs[block] = self.refs.get(block, 0) + 1
            req.blocks.append(block)
            req.num_computed = (i + 1) * G
            if block in self._computing:
                self.same_step_hits += 1
            if i == 0:
                req.sink_hit = True
                if block in self.block_to_slot:
                    self.fp16_sink_hits += 1

    def _grow(self, req: _Req, upto_tokens: int) -> list[int] | None:
        new: list[int] = []
        while len(req.blocks) < -(-upto_tokens // G):
            block = self._alloc_block()
            if block is None:
                for b in new:  # vLLM allocates all or nothing
                    req.blocks.remove(b)
                    del self.refs[b]
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)
                return None
            req.blocks.append(block)
            new.append(block)
        return new

    def _preempt(self, victim: _Req) -> None:
        self._free_blocks(victim)
        victim.num_computed = 0
        victim.resumed = True
        victim.sink_hit = False
        self.waiting.insert(0, victim)
        self.preemptions += 1

    def step(self) -> None:
        finished, self.finished = self.finished, []
        preempted: list[str] = []
        new_data: list[NewRequest] = []
        cached: list[CachedRequest] = []
        sched: dict[str, int] = {}
        spec: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        budget = self.budget
        self._computing = set()
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            decoding = req.num_computed >= req.prompt_len
            k = self.spec if (self.spec and decoding) else 0
            need = (1 + k) if decoding else len(req.tokens) - req.num_computed
            n = min(need, budget)
            k = max(0, n - 1) if decoding and k else 0
            new_blocks = self._grow(req, req.num_computed + n + self.spec)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim.rid in sched:
                    budget += sched.pop(victim.rid)
                    spec.pop(victim.rid, None)
                    drafts.pop(victim.rid, None)
                    cached = [c for c in cached if c.req_id != victim.rid]
                if victim is req:
                    break
                new_blocks = self._grow(req, req.num_computed + n + self.spec)
            if new_blocks is None:
                break
            sched[req.rid] = n
            budget -= n
            if k:
                spec[req.rid] = k
                drafts[req.rid] = [self.rng.randrange(1000) for _ in range(k)]
            cached.append(CachedRequest(req.rid, new_blocks or None, False, req.num_computed))
            self._cache_full_blocks(req, req.num_computed + n - k)
            self._computing.update(req.blocks)
            index += 1
        while not preempted and self.waiting and budget > 0:
            if len(self.running) == self.max_running:
                break
            req = self.waiting[0]
            self._prefix_hit(req)
            n = min(len(req.tokens) - req.num_computed, budget)
            if self._grow(req, req.num_computed + n) is None:
                self._free_blocks(req)
                req.num_computed = 0
                req.sink_hit = False
                break
            self.waiting.pop(0)
            self.running.append(req)
            sched[req.rid] = n
            budget -= n
            if req.resumed and not self.v2_resume:
                cached.append(CachedRequest(req.rid, list(req.blocks), True, req.num_computed))
            else:
                new_data.append(NewRequest(req.rid, list(req.blocks), req.num_computed))
            req.resumed = False
            self._cache_full_blocks(req, req.num_computed + n)
            self._computing.update(req.blocks)
        plan = self.tr.step(
            StepInput(
                finished=finished,
                preempted=preempted,
                new=new_data,
                cached=cached,
                num_scheduled=sched,
                num_spec=spec,
            )
        )
        live = self.tr.slots_used - len(self.tr.retired_sinks())
        self.max_live = max(self.max_live, live)
        for pending in self.tr.take_pending():
            self._apply(pending)
        self._forward(plan, sched, drafts)

    # -- device side
    def _apply(self, plan: StepPlan) -> None:
        for slot, block in zip(plan.flush_slots, plan.flush_blocks, strict=True):
            content = tuple(self.pool[slot])
            assert None not in content, f"flushed a partial tile into block {block}"
            self.tiles[block] = content
        for block, slot in zip(plan.map_blocks, plan.map_slots, strict=True):
            if slot < 0:
                self.block_to_slot.pop(block, None)
            else:
                self.block_to_slot[block] = slot

    def _read(self, block: int, offset: int) -> int | None:
        slot = self.block_to_slot.get(block)
        if slot is not None:
            return self.pool[slot][offset]
        # Not pool-resident: the kernels read its packed record, which must have been written.
        tile = self.tiles.get(block)
        assert tile is not None, f"block {block} is neither in the pool nor a written record"
        return tile[offset]

    def _forward(self, plan: StepPlan, sched: dict[str, int], drafts: dict[str, list[int]]) -> None:
        by_id = {r.rid: r for r in self.running}
        # 1. Direct tiles: the head rows come from the pool before anything is written (the
        #    head's slot may serve another block in this very step).
        staged: dict[int, list[int | None]] = {}
        for block, slot, head in zip(
            plan.direct_blocks, plan.direct_head_slots, plan.direct_head_lens, strict=True
        ):
            assert block not in self.block_to_slot, f"direct block {block} still has a slot"
            row: list[int | None] = [None] * G
            if head:
                row[:head] = self.pool[slot][:head]
                self.direct_heads += 1
            staged[block] = row
        # 2. Writes: pool slots, or the direct tile being built.
        for rid, n in sched.items():
            req = by_id[rid]
            start = req.num_computed
            content = req.tokens[start : start + n - len(drafts.get(rid, []))] + drafts.get(rid, [])
            assert len(content) == n
            for i, tok in enumerate(content):
                pos = start + i
                block = req.blocks[pos // G]
                if block in staged:
                    staged[block][pos % G] = tok
                    continue
                slot = self.block_to_slot.get(block)
                assert slot is not None, f"{rid} writes position {pos} into a block without a slot"
                self.pool[slot][pos % G] = tok
        # 3. The direct tiles' records, written in this forward.
        for block, row in staged.items():
            assert None not in row, f"direct tile {block} was not completed by this step"
            self.tiles[block] = tuple(row)
            self.direct_tiles += 1
        # 4. Reads: every scheduled request attends to its whole history.
        for rid, n in sched.items():
            req = by_id[rid]
            start = req.num_computed
            content = req.tokens[start : start + n - len(drafts.get(rid, []))] + drafts.get(rid, [])
            expected = req.tokens[:start] + content
            if req.blocks[0] not in self.block_to_slot:
                assert req.sink_hit, f"{rid}: its own sink was quantized while it runs"
            for pos, tok in enumerate(expected):
                got = self._read(req.blocks[pos // G], pos % G)
                assert got == tok, f"{rid} reads position {pos}: got {got}, want {tok}"
                self.reads += 1
        for rid, n in sched.items():
            req = by_id[rid]
            if rid in drafts:
                # Verified: the last sampled token plus the first ``accepted`` drafts; the
                # rejected drafts' positions are rewritten by later steps.
                accepted = self.rng.randrange(0, len(drafts[rid]) + 1)
                del req.tokens[req.num_computed + 1 :]
                req.tokens.extend(drafts[rid][:accepted])
                req.num_computed += 1 + accepted
            else:
                req.num_computed += n
            self._cache_full_blocks(req, req.num_computed)
            if req.num_computed == len(req.tokens):
                if req.generated >= req.max_new:
                    self.running.remove(req)
                    self._free_blocks(req)
                    self.finished.append(rid)
                    continue
                req.tokens.append(self.rng.randrange(1000))
                req.generated += 1


@pytest.mark.parametrize("direct_flush", [True, False], ids=["direct", "pool"])
@pytest.mark.parametrize(
    ("seed", "prefix_caching", "spec", "v2_resume", "num_blocks"),
    [
        (0, True, 0, False, 40),
        (1, True, 0, True, 14),
        (2, False, 0, False, 40),
        (3, True, 2, False, 40),
        (4, True, 3, True, 16),
        (5, False, 2, True, 14),
    ],
)
def test_random_serving_reads_are_always_valid(
    seed: int, prefix_caching: bool, spec: int, v2_resume: bool, num_blocks: int, direct_flush: bool
) -> None:
    sim = _Sim(
        seed,
        num_blocks=num_blocks,
        num_slots=64,
        prefix_caching=prefix_caching,
        spec=spec,
        v2_resume=v2_resume,
        direct_flush=direct_flush,
    )
    for step in range(400):
        if step % 3 == 0 and len(sim.waiting) < 8:
            sim.add_request()
        sim.step()
    assert sim.reads > 2000
    assert sim.tr.total_flushed > 20
    if prefix_caching:
        assert sim.fp16_sink_hits > 0, "no request re-adopted a pool-resident sink"
    if direct_flush:
        assert sim.direct_tiles > 10 and sim.direct_tiles == sim.tr.total_direct
    else:
        assert sim.direct_tiles == 0
    # Live requests hold at most a sink and a few in-progress blocks each.
    live = len(sim.tr.live_requests())
    assert sim.tr.slots_used <= 3 * live + len(sim.tr.retired_sinks()) + sim.budget // G + 2


@pytest.mark.parametrize(
    (
        "seed",
        "max_running",
        "budget",
        "spec",
        "spec_margin",
        "prefix_caching",
        "num_blocks",
        "verify_graphs",
    ),
    [
        (10, 6, 24, 0, 0, True, 60, False),
        (11, 6, 64, 0, 0, True, 48, False),  # a larger token budget needs no more slots
        (12, 8, 8, 0, 0, False, 70, False),  # budget = max_num_seqs: many cut chunks
        (13, 6, 24, 2, 0, True, 60, False),
        (14, 6, 24, 3, 3, True, 60, False),  # async scheduling with drafts: commits lag 3
        (15, 4, 16, 0, 0, True, 24, False),  # tight KV cache: preemption mid-prefill
        # uniform verify graphs: steps of at most 1 + drafts tokens never go direct
        (16, 6, 24, 2, 0, True, 60, True),
        (17, 6, 24, 3, 3, True, 60, True),
        (18, 4, 16, 3, 3, True, 24, True),
    ],
)
def test_pool_rule_is_never_exhausted_under_vllm_like_schedules(
    seed: int,
    max_running: int,
    budget: int,
    spec: int,
    spec_margin: int,
    prefix_caching: bool,
    num_blocks: int,
    verify_graphs: bool,
) -> None:
    """The pool kvarn-format sizes for direct flush, *without* its 8 spare slots, never runs
    out: live requests never hold more than ``2*S`` slots plus the rollback tiles. Also with
    uniform verify graphs on (steps of at most 1 + drafts tokens never direct: a verify whose
    committed token completes its block keeps the slot while its drafts open the next)."""
    serving = ServingConfig(
        max_model_len=4096,
        max_num_seqs=max_running,
        max_num_batched_tokens=budget,
        spec_tokens=spec,
    )
    rollback = rollback_blocks(serving, G)
    slots = side_pool_slots(SidePool("dense", G, 0), serving) - 8
    assert slots == 2 * max_running + rollback
    sim = _Sim(
        seed,
        num_blocks=num_blocks,
        num_slots=slots,
        prefix_caching=prefix_caching,
        spec=spec,
        v2_resume=seed % 2 == 1,
        budget=budget,
        max_running=max_running,
        long_prompts=True,
        spec_margin=spec_margin,
        pool_only_upto=spec + 1 if verify_graphs else 0,
    )
    for _ in range(500):
        if len(sim.waiting) < 2 * max_running:
            sim.add_request()
        sim.step()  # raises SidePoolExhaustedError if the rule is short
    assert sim.reads > 5000 and sim.direct_tiles > 50
    assert sim.direct_heads > 5, "no chunk started inside a block that it then completed"
    assert sim.max_live <= 2 * max_running + rollback
    if verify_graphs:
        assert sim.tr.total_kept_for_graphs > 0, "no short step completed a committed tile"
    if prefix_caching:
        assert sim.same_step_hits + sim.fp16_sink_hits > 0
    if num_blocks < 30:
        assert sim.preemptions > 0


def test_old_pool_path_needs_the_chunk_term() -> None:
    """Without direct flush the same schedules need more than ``2*S`` slots (the reason for
    format-spec §4.3's ``ceil(T/G)`` term): the simulation above does measure something."""
    sim = _Sim(
        10,
        num_blocks=60,
        num_slots=64,
        prefix_caching=True,
        spec=0,
        v2_resume=False,
        budget=24,
        max_running=6,
        long_prompts=True,
        direct_flush=False,
    )
    for _ in range(300):
        if len(sim.waiting) < 12:
            sim.add_request()
        sim.step()
    assert sim.max_live > 2 * 6
