"""Side-pool bookkeeping for one KV-cache group: pure Python, no torch, no vLLM.

KVarN keeps some blocks of every request in an fp16 *side pool* instead of the packed paged
cache: the request's first block (the sink, never quantized while the request lives) and every
block that is still being written. A block is quantized ("flushed") into its packed record only
once all of its ``G`` tokens are *committed*, so a speculative token that may still be rejected
is never frozen into the packed record.

This module decides, step by step, which physical block owns which pool slot, which blocks
to flush, and which slots to reclaim. It has no GPU state: it emits :class:`StepPlan` objects
that the vLLM metadata builder (``kvarn_vllm.runtime``) applies on the device before the
forward pass. Keeping it free of torch and vLLM makes every rule unit-testable.

The one invariant everything else relies on, per physical (kernel) block ``b``:

* ``b`` holds a pool slot  ->  the authoritative data of ``b`` is the fp16 slot;
* ``b`` holds no slot      ->  the authoritative data of ``b`` is its packed record.

Kernels read a block from wherever ``block_to_slot[b]`` says, so any block a request can see
(its own, or one it shares through a prefix-cache hit) is valid at all times.

**Direct flush** (default; ``direct_flush=False`` restores the pool-only path). A tile that a
step of two or more tokens completes, and whose tokens are all committed after that step, is
quantized *inside that step* from the step's own K/V (``StepPlan.direct_*``; kvarn-vllm runs
the store in each layer's KV update, before that layer's attention) and never takes a slot:
``block_to_slot`` is -1 for it from the start of the step. A *direct* tile may open with rows
an earlier step wrote into the pool (the chunk starts inside the request's in-progress
block): the store reads those rows from the old slot before the step writes anything, so the
slot is released in the same step and can take the step's new in-progress block. Sinks
(block 0) are never direct. Without direct flush, writes always go to the pool and full tiles
are flushed at the next step. Either way a block receives a slot before its first token is
written unless it is direct.

Pool need (the sizing rule of ``kvarn_format.sizing.side_pool_slots``): with direct flush a
request holds at most its sink and one in-progress block at any point of a step, plus the
uncommitted tiles speculative decoding adds; a one-token step that completes its block keeps
that slot until the next step's pass 1, which frees it before anything is allocated. With
``pool_only_upto`` (uniform verify graphs) a verify step whose committed token completes its
block keeps that slot the same way while its drafts open the next block: the sink, two blocks,
which is the one tile boundary per request that ``rollback_blocks`` already charges.

Request lifecycle comes from vLLM's scheduler output (new, cached, resumed, finished and
preempted requests, with their block ids), which every worker receives; see
``kvarn_vllm.runtime.step_input_from_scheduler_output``.

Prefix caching (vLLM caches only *full* blocks, and only blocks whose tokens are computed):

* when a request ends (finished or preempted), its full non-sink blocks that still hold slots
  are flushed so a later hit finds a valid packed record; partial blocks are dropped (vLLM
  never hits on them);
* its sink is *retired* rather than flushed: the block keeps its fp16 slot so that the next
  request with the same first block re-adopts it byte for byte and sees exactly the fp16 sink
  a run without caching would see. A retired sink is flushed (quantized, still valid) only when
  the pool needs its slot. A hit on a sink that was already flushed reads the quantized record:
  valid, but not bit-identical to a cold run (documented in docs/vllm-plugin.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CachedRequest",
    "NewRequest",
    "SidePoolExhaustedError",
    "SidePoolTracker",
    "StepInput",
    "StepPlan",
]


class SidePoolExhaustedError(RuntimeError):
    """The fp16 side pool has no free slot and nothing that can be evicted."""


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the worker sees for the first time (or again after preemption).

    ``block_ids`` are the scheduler's block ids for this KV-cache group; ``num_computed_tokens``
    is the prefix-cache hit length (a multiple of the block size) or 0.
    """

    req_id: str
    block_ids: Sequence[int]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class CachedRequest:
    """A running request scheduled again.

    ``new_block_ids`` are appended to its blocks (``None`` = no new blocks); when ``resumed``
    is set the request comes back from preemption and ``new_block_ids`` is its full block list.
    """

    req_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class StepInput:
    """What one scheduler step tells the worker, reduced to what the pool needs."""

    finished: Collection[str] = ()
    preempted: Collection[str] = ()
    new: Sequence[NewRequest] = ()
    cached: Sequence[CachedRequest] = ()
    #: Tokens scheduled this step per request (prompt chunk, decode token, drafts).
    num_scheduled: Mapping[str, int] = field(default_factory=dict)
    #: Speculative draft tokens among ``num_scheduled`` per request.
    num_spec: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepPlan:
    """Device work for one step.

    Before the forward pass, in this order:

    1. Flush: quantize pool slot ``flush_slots[i]`` into the packed record of block
       ``flush_blocks[i]`` (all pairs, every layer of the group).
    2. Map: set ``block_to_slot[map_blocks[i]] = map_slots[i]`` (``-1`` = no slot).

    During *this step's* forward pass, in every layer before its pool write and attention:

    3. Direct: quantize block ``direct_blocks[i]`` from the step's K/V rows of that block; its
       first ``direct_head_lens[i]`` tokens (0 = none) are read from pool slot
       ``direct_head_slots[i]`` (-1 when there is no head), which this step may reuse.
    """

    step: int
    flush_slots: list[int] = field(default_factory=list)
    flush_blocks: list[int] = field(default_factory=list)
    map_blocks: list[int] = field(default_factory=list)
    map_slots: list[int] = field(default_factory=list)
    direct_blocks: list[int] = field(default_factory=list)
    direct_head_slots: list[int] = field(default_factory=list)
    direct_head_lens: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.flush_slots or self.map_blocks or self.direct_blocks)


@dataclass(slots=True)
class _Request:
    blocks: list[int]
    #: The scheduler's computed-token count: where this step's tokens start.
    computed: int
    #: Tokens known to be final (never rolled back): safe to quantize.
    committed: int
    #: Tokens whose K/V have been written (prefix-hit tokens included).
    written: int
    #: Blocks [1, flushed_upto) have been considered for flushing already.
    flushed_upto: int = 1
    #: The block whose sink reference this request holds (pool-resident block 0), if any.
    sink: int | None = None


class SidePoolTracker:
    """Slot allocator and flush planner for one KV-cache group.

    Args:
        num_slots: slots in each layer's side pool.
        group: tokens per tile (= kernel block size ``G``).
        blocks_per_scheduler_block: how many ``G``-token kernel blocks one scheduler block
            holds (1 unless vLLM's hybrid page unification enlarged the group's block size).
        prefix_caching: whether vLLM's prefix cache may hand a finished request's blocks to a
            later request; if not, finished requests' slots are simply dropped.
        spec_margin: tokens by which the scheduler's computed-token count may be optimistic
            (async scheduling with speculative decoding counts drafts before verification);
            flushes stay this many tokens behind it.
        direct_flush: quantize the tiles a multi-token step completes inside that step
            (``StepPlan.direct_*``) instead of giving them pool slots.
        pool_only_upto: steps of at most this many tokens of a request never go direct (0:
            none). With FULL CUDA graphs for uniform verify batches (1 + drafts tokens per
            request), such a step may be replayed from a graph whose KV update was captured
            without direct tiles: its completed tiles then wait in the pool for the next
            step's flush, as a decode's do.
    """

    def __init__(
        self,
        num_slots: int,
        group: int,
        *,
        blocks_per_scheduler_block: int = 1,
        prefix_caching: bool = True,
        spec_margin: int = 0,
        direct_flush: bool = True,
        pool_only_upto: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        if blocks_per_scheduler_block < 1:
            raise ValueError(
                f"blocks_per_scheduler_block must be >= 1, got {blocks_per_scheduler_block}"
            )
        if spec_margin < 0:
            raise ValueError(f"spec_margin must be >= 0, got {spec_margin}")
        if pool_only_upto < 0:
            raise ValueError(f"pool_only_upto must be >= 0, got {pool_only_upto}")
        self.num_slots = num_slots
        self.group = group
        self.ratio = blocks_per_scheduler_block
        self.prefix_caching = prefix_caching
        self.spec_margin = spec_margin
        self.direct_flush = direct_flush
        self.pool_only_upto = pool_only_upto

        # Stack of free slots; popping from the end hands out low slot ids first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}
        self._sink_refs: dict[int, int] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()
        self._reqs: dict[str, _Request] = {}
        # Requests whose committed count moved (insertion-ordered so plans are deterministic).
        self._dirty: dict[str, None] = {}
        self._pending: list[StepPlan] = []
        self._plan = StepPlan(step=0)
        self._step = 0
        self.peak_slots_used = 0
        self.total_flushed = 0
        self.total_direct = 0
        #: Committed tiles of short steps kept in the pool for the next step's flush
        #: (``pool_only_upto``) instead of going direct.
        self.total_kept_for_graphs = 0

    # ------------------------------------------------------------------ queries
    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self._free)

    def slot_of(self, block: int) -> int | None:
        """The pool slot of kernel block ``block``, or ``None`` when it lives packed."""
        return self._slot_of.get(block)

    def resident_blocks(self) -> dict[int, int]:
        """A copy of the block -> slot map (for tests and debugging)."""
        return dict(self._slot_of)

    def retired_sinks(self) -> list[int]:
        """Retired sink blocks, least recently retired first."""
        return list(self._retired)

    def request_blocks(self, req_id: str) -> list[int]:
        """Kernel block ids of a live request."""
        return list(self._reqs[req_id].blocks)

    def live_requests(self) -> list[str]:
        return list(self._reqs)

    def take_pending(self) -> list[StepPlan]:
        """Plans produced since the last call, oldest first (each applied once)."""
        plans, self._pending = self._pending, []
        return plans

    # ------------------------------------------------------------------ the step
    def step(self, inp: StepInput) -> StepPlan:
        """Advance one scheduler step; returns (and queues) the device plan for it."""
        self._step += 1
        self._plan = StepPlan(step=self._step)

        for req_id in (*inp.finished, *(inp.preempted or ())):
            self._release(req_id)
        for new in inp.new:
            self._release(new.req_id)  # a re-added id (streaming input) starts afresh
            self._register(new.req_id, new.block_ids, new.num_computed_tokens)
        for cached in inp.cached:
            req = self._reqs.get(cached.req_id)
            if cached.resumed or req is None:
                self._release(cached.req_id)
                self._register(
                    cached.req_id, cached.new_block_ids or (), cached.num_computed_tokens
                )
                continue
            if cached.new_block_ids:
                req.blocks.extend(self._kernel_blocks(cached.new_block_ids))
            req.computed = cached.num_computed_tokens
            req.committed = max(req.committed, cached.num_computed_tokens - self.spec_margin)
            self._dirty[cached.req_id] = None

        # Pass 1: flush every committed full block of the requests that moved, so their
        # slots are free before this step allocates.
        for req_id in list(self._dirty):
            req = self._reqs.get(req_id)
            if req is not None:
                self._flush_committed(req)
        self._dirty.clear()

        # Pass 2: give every block that receives tokens this step a slot, unless the step
        # completes and commits it (direct).
        for req_id, num_tokens in inp.num_scheduled.items():
            req = self._reqs.get(req_id)
            if req is None:
                raise KeyError(
                    f"kvarn side pool: request {req_id!r} is scheduled but was never added; "
                    "the worker missed a scheduler output"
                )
            if num_tokens <= 0:
                continue
            spec = inp.num_spec.get(req_id, 0)
            start = req.computed
            end = start + num_tokens
            last = (end - 1) // self.group
            if last >= len(req.blocks):
                raise ValueError(
                    f"kvarn side pool: request {req_id!r} writes token {end - 1} but has only "
                    f"{len(req.blocks)} blocks of {self.group} tokens"
                )
            # After this step's forward, every non-draft token written is committed.
            final = end - spec - self.spec_margin
            # One-token steps (decodes) never go direct: CUDA graphs capture pure-decode
            # batches, whose KV update must not depend on the step; nor do steps that a
            # uniform verify graph may replay (pool_only_upto).
            direct = self.direct_flush and num_tokens >= max(2, self.pool_only_upto + 1)
            for index in range(start // self.group, last + 1):
                block = req.blocks[index]
                committed_tile = index >= 1 and (index + 1) * self.group <= final
                if (
                    direct
                    and committed_tile
                    and self._make_direct(block, max(0, start - index * self.group))
                ):
                    continue
                if committed_tile and self.direct_flush and num_tokens >= 2 and not direct:
                    self.total_kept_for_graphs += 1
                self._ensure_slot(block)
            req.written = end
            self._dirty[req_id] = None
            req.committed = max(req.committed, final)

        self.peak_slots_used = max(self.peak_slots_used, self.slots_used)
        plan = self._plan
        if not plan.empty:
            self._pending.append(plan)
        return plan

    # ------------------------------------------------------------------ internals
    def _kernel_blocks(self, block_ids: Iterable[int]) -> list[int]:
        r = self.ratio
        if r == 1:
            return list(block_ids)
        return [b * r + j for b in block_ids for j in range(r)]

    def _register(self, req_id: str, block_ids: Sequence[int], num_computed: int) -> None:
        blocks = self._kernel_blocks(block_ids)
        req = _Request(
            blocks=blocks,
            computed=num_computed,
            committed=max(0, num_computed - self.spec_margin),
            written=num_computed,
        )
        self._reqs[req_id] = req
        self._dirty[req_id] = None
        if not blocks:
            return
        sink = blocks[0]
        if sink in self._slot_of:
            # Pool-resident: a live request's sink (shared prefix) or a retired sink.
            self._retired.pop(sink, None)
            self._sink_refs[sink] = self._sink_refs.get(sink, 0) + 1
            req.sink = sink
        elif num_computed < self.group:
            # Block 0 is written from scratch now; its slot is allocated in pass 2.
            self._sink_refs[sink] = self._sink_refs.get(sink, 0) + 1
            req.sink = sink
        # else: a prefix hit on a sink that was flushed earlier -> packed sink (valid).

    def _flush_committed(self, req: _Request) -> None:
        upto = min(req.committed // self.group, len(req.blocks))
        for index in range(max(req.flushed_upto, 1), upto):
            block = req.blocks[index]
            if block in self._slot_of and not self._is_sink(block):
                self._flush(block)
        req.flushed_upto = max(req.flushed_upto, upto)

    def _is_sink(self, block: int) -> bool:
        return block in self._sink_refs or block in self._retired

    def _release(self, req_id: str) -> None:
        req = self._reqs.pop(req_id, None)
        self._dirty.pop(req_id, None)
        if req is None:
            return
        # Every token written so far is final now; vLLM caches only the accepted ones, so a
        # full block with a rejected draft is never hit and flushing it is harmless.
        full = min(req.written // self.group, len(req.blocks))
        for index, block in enumerate(req.blocks):
            if block not in self._slot_of:
                continue
            if index == 0 and req.sink == block:
                refs = self._sink_refs.get(block, 0) - 1
                if refs > 0:
                    self._sink_refs[block] = refs
                    continue
                self._sink_refs.pop(block, None)
                if self.prefix_caching and full >= 1:
                    self._retired[block] = None
                    self._retired.move_to_end(block)
                else:
                    self._drop(block)
            elif self._is_sink(block):
                continue
            elif index < full and self.prefix_caching:
                self._flush(block)
            else:
                self._drop(block)

    def _ensure_slot(self, block: int) -> None:
        if block in self._slot_of:
            # A retired sink whose block vLLM handed out again as a fresh block: it is now
            # an ordinary block of the new owner (its old bytes get overwritten).
            if block in self._retired and block not in self._sink_refs:
                self._retired.pop(block)
            return
        if not self._free:
            self._evict_retired()
        slot = self._free.pop()
        self._slot_of[block] = slot
        self._plan.map_blocks.append(block)
        self._plan.map_slots.append(slot)

    def _make_direct(self, block: int, head: int) -> bool:
        """Plan ``block`` as a direct tile; ``head`` of its tokens are already in its slot.

        Returns False (the caller gives it a slot instead) when its earlier rows are not in
        the pool, which the rules above never produce, or when it is a live request's sink.
        """
        if block in self._sink_refs:
            return False
        slot = self._slot_of.get(block)
        if head:
            if slot is None:
                return False
            head_slot = slot
        else:
            head_slot = -1
        if slot is not None:
            # With a head: the store reads the head rows before this step's writes, so the
            # slot can serve this step already. Without one, the slot is stale (a retired sink
            # vLLM handed out again, or rejected drafts): all G rows are rewritten now.
            self._drop(block)
        self._plan.direct_blocks.append(block)
        self._plan.direct_head_slots.append(head_slot)
        self._plan.direct_head_lens.append(head)
        self.total_direct += 1
        return True

    def _evict_retired(self) -> None:
        if not self._retired:
            raise SidePoolExhaustedError(
                f"kvarn side pool exhausted: all {self.num_slots} slots hold live sink or "
                f"in-progress blocks ({len(self._reqs)} live requests). The pool is sized from "
                "max_num_seqs (and, with KVARN_DIRECT_FLUSH=0, max_num_batched_tokens); lower "
                "--max-num-seqs or --max-num-batched-tokens, and report the schedule: the "
                "sizing rule should have made this impossible."
            )
        block, _ = self._retired.popitem(last=False)
        self._flush(block)

    def _flush(self, block: int) -> None:
        slot = self._slot_of.pop(block)
        self._plan.flush_slots.append(slot)
        self._plan.flush_blocks.append(block)
        self._unmap(block, slot)
        self.total_flushed += 1

    def _drop(self, block: int) -> None:
        slot = self._slot_of.pop(block)
        self._unmap(block, slot)

    def _unmap(self, block: int, slot: int) -> None:
        self._retired.pop(block, None)
        self._free.append(slot)
        self._plan.map_blocks.append(block)
        self._plan.map_slots.append(-1)
