"""The scheduler side of compaction (rcstat_vllm/engine/block_exchange.py) against a fake block pool: no engine."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.block_exchange import (
    BlockPool,
    EngineCompaction,
    swap_in_fresh_blocks,
)
from rcstat_vllm.engine.pressure_policy import cover
from rcstat_vllm.engine.requests import Phase
from rcstat_vllm.reports import CompressionReport, CopyRun, StepCompactions

BLOCK = 16


def queued(state: EngineCompaction) -> list:
    """The compactions waiting for the next scheduler output, in the order queued."""
    return [r.compaction for r in state.requests.in_phase(Phase.AWAITING_COMPACTION)]


def parked(state: EngineCompaction) -> set[str]:
    return {r.req_id for r in state.requests.in_phase(Phase.PLANNED)}


def relieve(state: EngineCompaction, pool, blocks_wanted: int, running, reason: str) -> int:
    """Lazy eviction as the scheduler hook applies it, for ``blocks_wanted`` blocks: the policy's choice among the
    parked plans of running requests (``running(req_id)`` None: not running), compacted."""
    plans = state.parked(running)
    return state.relieve_pressure(pool, cover(blocks_wanted - pool.get_num_free_blocks(), reason, plans), running)


def copied(state: EngineCompaction, *req_ids: str, kind: str = "prompt") -> None:
    """The worker ran these requests' copies (its step output reaches the scheduler: what counts them)."""
    state.observe_step(StepCompactions(tuple(CopyRun(req_id, kind, 0.0) for req_id in req_ids)))


@dataclass(eq=False)
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    is_null: bool = False
    #: a prefix-cache entry's hash (vLLM's ``KVCacheBlock.block_hash``), None when the block is not cached
    block_hash: object = None


class FakePool:
    """vLLM 0.32's BlockPool as the exchange sees it: a free queue, reference counts, a null block (id 0), with
    vLLM's order (block_pool.py ``free_blocks``, kv_cache_utils ``FreeKVCacheBlockQueue``): a freed block that is
    no prefix-cache entry goes to the front of the queue (the freed ones in the order given), so the next
    allocation reuses it first; a cached one is appended at the end (evictable, reused last), and loses its hash
    when it is taken again. ``test_fake_pool_orders_its_free_queue_as_vllms_block_pool`` runs both side by side."""

    def __init__(self, num_blocks: int):
        self.blocks = [FakeBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free = deque(self.blocks[1:])
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def get_new_blocks(self, num_blocks: int) -> list[FakeBlock]:
        if num_blocks > len(self.free):
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        taken = [self.free.popleft() for _ in range(num_blocks)]
        for block in taken:
            block.block_hash = None  # an evictable cache entry is evicted when its block is reused
            block.ref_cnt += 1
        self.calls.append(("get", tuple(b.block_id for b in taken)))
        return taken

    def free_blocks(self, ordered_blocks) -> None:
        ordered = list(ordered_blocks)
        first, last = [], []
        for block in ordered:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (first if block.block_hash is None else last).append(block)
        self.free.extendleft(reversed(first))
        self.free.extend(last)
        self.calls.append(("free", tuple(b.block_id for b in ordered)))

    def get_num_free_blocks(self) -> int:
        return len(self.free)


def _protocol_members(protocol) -> set[str]:
    """The names a Protocol class declares (attributes and methods), not those every class has."""
    return {name for name in (*vars(protocol), *getattr(protocol, "__annotations__", {})) if not name.startswith("_")}


def test_fake_pool_and_vllms_block_pool_have_what_the_exchange_uses():
    """The exchange's BlockPool protocol is a static contract only (not checked at run time): here every member it
    names exists, with the same parameters, on vLLM's BlockPool and on the fake these tests run against."""
    import inspect

    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    from rcstat_vllm.engine.block_exchange import Block

    real = VllmBlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BLOCK)
    members = _protocol_members(BlockPool)
    assert members == {"null_block", "get_new_blocks", "free_blocks", "get_num_free_blocks"}
    for pool in (real, FakePool(4)):
        for name in members:
            assert hasattr(pool, name), (type(pool).__name__, name)
            if callable(getattr(BlockPool, name, None)):
                want = list(inspect.signature(getattr(BlockPool, name)).parameters)[1:]
                assert list(inspect.signature(getattr(pool, name)).parameters) == want, (type(pool).__name__, name)
        for name in _protocol_members(Block):
            assert hasattr(pool.null_block, name), (type(pool).__name__, "null_block", name)
        assert pool.null_block.is_null and pool.null_block.block_id == 0


def test_fake_pool_orders_its_free_queue_as_vllms_block_pool():
    """The same allocations and frees, some of the freed blocks prefix-cache entries, on vLLM's BlockPool (caching
    on) and on FakePool: the same block ids come back in the same order, with the same free counts. Freed blocks
    that are no cache entries are reused first (most recently freed first), cached ones last."""
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    real, fake = VllmBlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK), FakePool(16)

    def cache(pool, block):  # what vLLM's cache_full_blocks leaves on a full block
        key = make_block_hash_with_group_id(BlockHash(b"%d" % block.block_id), 0)
        if pool is real:
            block.set_block_hash(key)
            real.cached_block_hash_to_block.insert(key, block)
        else:
            block.block_hash = key

    def both(operation):
        got = [operation(pool) for pool in (real, fake)]
        ids = [[b.block_id for b in blocks] if blocks is not None else None for blocks in got]
        assert ids[0] == ids[1] and real.get_num_free_blocks() == fake.get_num_free_blocks()
        return ids[0]

    lists = {}
    assert both(lambda pool: lists.setdefault(pool, {}).setdefault("a", pool.get_new_blocks(5))) == [1, 2, 3, 4, 5]
    both(lambda pool: lists[pool].setdefault("b", pool.get_new_blocks(3)))
    for pool in (real, fake):
        for block in lists[pool]["a"][:2]:
            cache(pool, block)  # a's first two blocks are prefix-cache entries
    both(lambda pool: pool.free_blocks(reversed(lists[pool]["a"])))  # as vLLM frees a request: tail first
    assert both(lambda pool: pool.get_new_blocks(4)) == [5, 4, 3, 9]  # a's uncached blocks first, newest first
    both(lambda pool: pool.free_blocks(lists[pool]["b"]))
    assert both(lambda pool: pool.get_new_blocks(11)) == [6, 7, 8, *range(10, 16), 2, 1]  # cached ones last
    assert real.get_num_free_blocks() == fake.get_num_free_blocks() == 0


def allocate(pool: FakePool, num_blocks: int) -> list[FakeBlock]:
    """A request's block list after its prefill (as vLLM's manager allocates it)."""
    return pool.get_new_blocks(num_blocks)


def report(keep_blocks: int, prompt_tokens: int, cached_tokens: int = 0, req_id: str = "r") -> CompressionReport:
    return CompressionReport(
        req_id, prompt_tokens, "rc", keep_blocks, block_size=BLOCK, num_cached_tokens=cached_tokens
    )


def test_fresh_blocks_taken_before_freeing_when_the_pool_has_room():
    pool = FakePool(20)
    blocks = allocate(pool, 6)
    prompt_ids = [b.block_id for b in blocks]
    pool.calls.clear()
    compaction, freed = swap_in_fresh_blocks(pool, blocks, report(2, 6 * BLOCK))
    assert compaction.cancelled_reason is None
    assert [kind for kind, _ in pool.calls] == ["get", "free"]
    assert not set(compaction.block_ids) & set(prompt_ids)  # no block is both a copy's source and destination
    assert freed == 4


def test_fresh_blocks_taken_after_freeing_when_the_pool_is_short():
    pool = FakePool(7)
    blocks = allocate(pool, 6)
    assert pool.get_num_free_blocks() == 0
    pool.calls.clear()
    compaction, freed = swap_in_fresh_blocks(pool, blocks, report(2, 6 * BLOCK))
    assert compaction.cancelled_reason is None
    assert [kind for kind, _ in pool.calls] == ["free", "get"]
    assert len(compaction.block_ids) == 2
    assert freed == 4


def test_prompt_blocks_freed_tail_first():
    pool = FakePool(20)
    blocks = allocate(pool, 4)
    ids = [b.block_id for b in blocks]
    pool.calls.clear()
    swap_in_fresh_blocks(pool, blocks, report(1, 4 * BLOCK))
    assert pool.calls[1] == ("free", tuple(reversed(ids)))


def test_refused_when_even_freeing_first_is_short():
    """Prompt blocks shared with running requests free nothing: the request stays uncompressed, untouched."""
    pool = FakePool(5)
    blocks = allocate(pool, 4)
    for block in blocks:
        block.ref_cnt += 1  # another running request holds them too
    before = list(blocks)
    pool.calls.clear()
    compaction, freed = swap_in_fresh_blocks(pool, blocks, report(2, 4 * BLOCK))
    assert compaction.cancelled_reason == "no free blocks to copy the kept KV into"
    assert compaction.block_ids == ()
    assert freed == 0
    assert blocks == before and pool.calls == []


def test_prefix_cache_hits_stay_shared():
    pool = FakePool(20)
    blocks = allocate(pool, 6)
    hits = blocks[:2]
    compaction, freed = swap_in_fresh_blocks(pool, blocks, report(3, 6 * BLOCK, cached_tokens=2 * BLOCK))
    assert blocks[:2] == hits  # the same objects, not copies
    assert all(b.ref_cnt == 1 for b in hits)
    assert len(compaction.block_ids) == 1  # keep_blocks counts the hits
    assert [b.block_id for b in blocks[2:3]] == list(compaction.block_ids)
    assert freed == 3


def test_null_blocks_pad_the_list_to_its_length():
    pool = FakePool(20)
    blocks = allocate(pool, 5)
    decode_block = pool.get_new_blocks(1)[0]
    blocks.append(decode_block)  # a block past the prompt (decode) is kept
    compaction, _ = swap_in_fresh_blocks(pool, blocks, report(2, 5 * BLOCK))
    assert len(blocks) == 6
    assert [b.block_id for b in blocks[:2]] == list(compaction.block_ids)
    assert all(b is pool.null_block for b in blocks[2:5])
    assert blocks[5] is decode_block


def test_free_count_change_counts_only_blocks_no_one_else_holds():
    pool = FakePool(20)
    blocks = allocate(pool, 4)
    blocks[3].ref_cnt += 1  # shared with another running request
    before = pool.get_num_free_blocks()
    _, freed = swap_in_fresh_blocks(pool, blocks, report(1, 4 * BLOCK))
    assert freed == pool.get_num_free_blocks() - before == 2


def test_apply_reports_swaps_records_and_counts():
    pool = FakePool(20)
    lists = {"a": allocate(pool, 4), "b": allocate(pool, 4)}
    state = EngineCompaction()
    skipped = CompressionReport("c", 4 * BLOCK, "rc", 4, skipped_reason="method none", block_size=BLOCK)
    finished = report(1, 4 * BLOCK, req_id="gone")
    state.apply_reports(pool, [report(2, 4 * BLOCK, req_id="a"), skipped, finished], lists.get)
    assert [c.req_id for c in queued(state)] == ["a"]
    assert state.compacted == {"a": queued(state)[0].block_ids}
    assert state.compacted_blocks == set(queued(state)[0].block_ids)
    assert state.stats.requests_compressed == 0 and state.stats.requests_skipped == 1  # granted, not copied yet
    state.take_outgoing(lambda req_id: True)
    copied(state, "a")
    assert state.stats.requests_compressed == 1 and state.stats.blocks_freed == 2
    copied(state, "a")  # (a copy is counted once)
    assert state.stats.requests_compressed == 1


def test_apply_reports_counts_a_refusal_as_skipped():
    pool = FakePool(5)
    blocks = allocate(pool, 4)
    for block in blocks:
        block.ref_cnt += 1
    state = EngineCompaction()
    state.apply_reports(pool, [report(2, 4 * BLOCK, req_id="a")], {"a": blocks}.get)
    assert queued(state)[0].cancelled_reason is not None
    assert state.compacted == {} and state.stats.requests_skipped == 1


def test_take_outgoing_drops_requests_no_longer_running():
    pool = FakePool(20)
    lists = {"a": allocate(pool, 4), "b": allocate(pool, 4)}
    state = EngineCompaction()
    state.apply_reports(pool, [report(1, 4 * BLOCK, req_id="a"), report(1, 4 * BLOCK, req_id="b")], lists.get)
    assert [c.req_id for c in state.take_outgoing(lambda req_id: req_id == "b")] == ["b"]
    assert queued(state) == [] and state.take_outgoing(lambda req_id: True) == []


def test_compacted_blocks_are_never_cached_and_a_hit_on_one_raises():
    pool = FakePool(20)
    blocks = allocate(pool, 4)
    state = EngineCompaction()
    assert state.may_cache("a")
    state.apply_reports(pool, [report(1, 4 * BLOCK, req_id="a")], {"a": blocks}.get)
    assert not state.may_cache("a")
    compacted = state.compacted["a"]
    state.check_hit("x", [99])  # other blocks: fine
    with pytest.raises(RuntimeError, match="compacted blocks"):
        state.check_hit("x", [compacted[0]])
    state.forget("a")  # vLLM freed the request
    assert state.may_cache("a") and not state.compacted_blocks
    state.check_hit("x", [compacted[0]])


def test_prefix_hit_stops_before_the_observation_window():
    state = EngineCompaction(config=RCStatConfig.from_dict({"method": "rc", "window": 8, "min_prompt_len": 1}))
    # 100 prompt tokens, 8-token window: at most (100 - 8) // 16 * 16 = 80 tokens from the cache.
    assert state.prefix_hit_limit("a", 96, 100, None, BLOCK) == 80
    assert state.prefix_hit_limit("b", 80, 100, None, BLOCK) is None  # already short enough
    assert state.prefix_hit_limit("c", 0, 100, None, BLOCK) is None
    assert state.prefix_hit_limit("d", 96, 100, {"rcstat": {"method": "none"}}, BLOCK) is None  # runs uncompressed
    # (without the flag the engine has no owner and the hook passes through: test_one_owner_per_block_pool_...)


def test_each_request_goes_through_its_phases_and_a_wrong_transition_names_it():
    """The request table: an eager plan is queued, then compacted when sent; a decode-time compaction queues it
    again; a refused copy goes back to where it came from; a lazy plan is parked first. A transition from the wrong
    phase raises, naming the request, its phase and the one expected; forget drops one record."""
    pool, full = FakePool(40), FakePool(5)
    lists = {"eager": allocate(pool, 4), "refused": allocate(full, 4), "lazy": allocate(pool, 6)}
    for block in lists["refused"]:
        block.ref_cnt += 1  # shared with another request: freeing them frees nothing
    state = EngineCompaction(config=RCStatConfig())
    phase = lambda req_id: state.requests.get(req_id).phase  # noqa: E731
    state.apply_reports(pool, [report(1, 4 * BLOCK, req_id="eager"), lazy_report(2, 96, "lazy")], lists.get)
    assert phase("eager") is Phase.AWAITING_COMPACTION and phase("lazy") is Phase.PLANNED
    state.apply_reports(full, [report(2, 4 * BLOCK, req_id="refused")], lists.get)
    assert phase("refused") is Phase.AWAITING_COMPACTION and state.may_cache("refused")
    with pytest.raises(RuntimeError, match="request eager is awaiting compaction, expected whole or compacted"):
        state._compact(
            pool, CompressionReport("eager", 5 * BLOCK, "rc", 1, block_size=BLOCK, decode=True), lists["eager"]
        )  # (a decode-time plan while the last one waits: nothing touched)
    assert [c.req_id for c in state.take_outgoing(lambda req_id: True)] == ["eager", "refused"]
    assert phase("eager") is Phase.COMPACTED and phase("refused") is Phase.WHOLE and phase("lazy") is Phase.PLANNED

    state._compact(pool, CompressionReport("eager", 4 * BLOCK, "rc", 1, block_size=BLOCK, decode=True), lists["eager"])
    assert phase("eager") is Phase.AWAITING_COMPACTION
    with pytest.raises(RuntimeError, match="request lazy is planned, expected whole"):
        state.apply_reports(pool, [lazy_report(2, 96, "lazy")], lists.get)
    with pytest.raises(RuntimeError, match="request lazy is planned, expected whole or compacted"):
        state._compact(
            pool, CompressionReport("lazy", 6 * BLOCK, "rc", 2, block_size=BLOCK, decode=True), lists["lazy"]
        )
    with pytest.raises(RuntimeError, match="request eager is awaiting compaction, expected planned"):
        state.requests.take_plan("eager")
    with pytest.raises(RuntimeError, match="request gone is not tracked, expected planned"):
        state.requests.take_plan("gone")
    assert relieve(state, pool, pool.get_num_free_blocks() + 1, lambda req_id: (lists[req_id], 96), "short") == 4
    assert [c.req_id for c in queued(state)] == ["eager", "lazy"]  # in the order queued
    state.forget("lazy")
    assert "lazy" not in state.requests and len(state.requests) == 2
    assert [c.req_id for c in state.take_outgoing(lambda req_id: True)] == ["eager"]
    assert phase("eager") is Phase.COMPACTED


@pytest.mark.parametrize("decode", [False, True], ids=["prompt", "decode_time"])
def test_an_eager_plan_arriving_a_step_late_carries_the_tokens_of_the_step_in_flight(decode):
    """Asynchronous scheduling: a plan (a prompt's, or a decode-time one's at its token count) arrives once the next
    step was scheduled (vLLM counts one more token), and that step writes its token into the request's old blocks: the
    copy carries the tokens up to vLLM's count over, as a lazy compaction carries the tokens generated before it (in
    the plan's last block, or in the block vLLM added for it: a tail block, for which a fresh one is taken).
    Synchronous scheduling counts the plan's tokens alone: its blocks are exchanged alone."""
    # (plan's tokens, blocks vLLM holds for the request, tokens vLLM scheduled) -> (tokens carried, tail blocks)
    cases = {(100, 7, 100): (0, 0), (100, 7, 101): (101, 0), (96, 7, 97): (97, 1)}  # (16-token blocks)
    for (tokens, held, scheduled), (carried, tails) in cases.items():
        pool = FakePool(20)
        blocks = allocate(pool, held)
        state = EngineCompaction()
        plan = CompressionReport("a", tokens, "rc", 2, block_size=BLOCK, decode=decode)
        state.apply_reports(pool, [plan], {"a": blocks}.get, {"a": scheduled}.get)
        (compaction,) = queued(state)
        assert compaction.num_tokens == carried and len(compaction.tail_block_ids) == tails
        assert len(compaction.block_ids) == 2 + tails  # the kept entries, and the tail copied whole


def test_one_owner_per_block_pool_gone_with_its_engine():
    """The scheduler's construction starts the engine's owner (with the flag); the hooks find it from the block pool
    they share, and it goes when the engine (its pool) does."""
    import gc
    import weakref

    from rcstat_vllm import owners

    pool, other = FakePool(2), FakePool(2)
    assert owners.engine_owner(pool) is None  # an engine without the flag: every hook passes through
    state = owners.start_engine_owner(pool, RCStatConfig(eviction="lazy"), 0)
    assert owners.engine_owner(pool) is state and owners.engine_owner(other) is None
    assert state.config.eviction == "lazy" and state.group == 0
    gone = weakref.ref(state)
    del pool, state
    gc.collect()
    assert gone() is None  # (the table held it weakly, through its pool)


def lazy_report(keep_blocks: int, prompt_tokens: int, req_id: str) -> CompressionReport:
    return CompressionReport(req_id, prompt_tokens, "rc", keep_blocks, block_size=BLOCK, lazy=True)


def test_lazy_plans_wait_until_the_scheduler_wants_more_blocks_than_are_free():
    """Lazy eviction: a plan is parked, nothing is swapped; with no shortfall nothing happens; with one, the parked
    requests freeing most go first, only as many as cover it, each with the tokens it holds now."""
    pool = FakePool(40)
    lists = {"small": allocate(pool, 4), "big": allocate(pool, 10), "mid": allocate(pool, 6)}
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    plans = [lazy_report(3, 64, "small"), lazy_report(2, 160, "big"), lazy_report(2, 96, "mid")]  # free 1, 8, 4
    state.apply_reports(pool, plans, lambda req_id: lists[req_id])
    assert parked(state) == {"small", "big", "mid"} and not queued(state)
    assert pool.get_num_free_blocks() == 19
    tokens = {"small": 64, "big": 160, "mid": 96}
    running = lambda req_id: (lists[req_id], tokens[req_id])  # noqa: E731

    assert relieve(state, pool, 19, running, "no shortfall") == 0 and not queued(state)
    gained = relieve(state, pool, 22, running, "3 short")  # the biggest gain alone covers it
    assert gained == 8 and [c.req_id for c in queued(state)] == ["big"]
    assert parked(state) == {"small", "mid"} and pool.get_num_free_blocks() == 27
    assert queued(state)[0].reason == "3 short" and queued(state)[0].num_tokens == 0  # compacted at its prompt
    gained = relieve(state, pool, 32, running, "5 short")  # mid (4) is not enough: small (1) too
    assert gained == 5 and [c.req_id for c in queued(state)[1:]] == ["mid", "small"] and not parked(state)


def test_a_parked_plan_is_ready_once_scored_at_prefill_or_ahead_and_a_new_plan_starts_unready():
    """A plan scored at its copy (deferred: its report names no kept counts) is not ready until the workers say they
    scored it ahead (StepCompactions.scored_ahead); a plan scored at prefill (kept counts known) is ready at once;
    readiness goes with the plan (compacted, or a request's next plan starts unready)."""
    pool = FakePool(40)
    lists = {"deferred": allocate(pool, 4), "scored": allocate(pool, 4)}
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    scored = CompressionReport("scored", 4 * BLOCK, "rc", 2, kept=[[BLOCK, 3 * BLOCK]], block_size=BLOCK, lazy=True)
    state.apply_reports(pool, [lazy_report(2, 64, "deferred"), scored], lambda req_id: lists[req_id])
    running = lambda req_id: (lists[req_id], 64)  # noqa: E731
    ready = lambda: {p.req_id: p.ready for p in state.parked(running)}  # noqa: E731
    assert ready() == {"deferred": False, "scored": True}
    state.observe_step(StepCompactions((CopyRun("deferred", "score_ahead", 0.01),), scored_ahead=("gone",)))
    assert ready() == {"deferred": False, "scored": True}  # a layer scored, not all: still unready
    state.observe_step(StepCompactions((CopyRun("deferred", "score_ahead", 0.01),), scored_ahead=("deferred",)))
    assert ready() == {"deferred": True, "scored": True}
    assert state.stats.requests_compressed == 0  # a score-ahead run is no copy
    assert relieve(state, pool, pool.get_num_free_blocks() + 1, running, "1 short") == 2
    assert [c.req_id for c in queued(state)] == ["deferred"]  # (equal gains: parked first)
    assert not state.requests.get("deferred").scored_ahead  # readiness went with its plan


def test_lazy_plans_are_counted_planned_compacted_or_never_compacted_and_ratios_only_where_known():
    """Metrics say what lazy eviction did: a parked plan is planned, not compressed; compacted under pressure it is
    compressed, but its ratio (scored at the copy) is unknown here, so the mean ratio is not dragged to 0 by it; a
    parked request that leaves uncompacted is counted apart; an eager plan's known ratio is averaged."""
    pool = FakePool(40)
    lists = {"small": allocate(pool, 4), "big": allocate(pool, 10), "eager": allocate(pool, 4)}
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(3, 64, "small"), lazy_report(2, 160, "big")], lambda req_id: lists[req_id])
    stats = state.stats
    assert (stats.requests_planned, stats.requests_compressed, stats.requests_skipped) == (2, 0, 0)
    running = lambda req_id: (lists[req_id], {"small": 64, "big": 160}[req_id])  # noqa: E731
    assert relieve(state, pool, pool.get_num_free_blocks() + 3, running, "3 short") == 8  # big alone covers it
    assert stats.requests_compressed == 0  # granted: counted when its copy runs
    state.take_outgoing(lambda req_id: True)
    copied(state, "big")
    assert stats.requests_compressed == 1 and stats.ratio_count == 0 and stats.mean_ratio == 0.0
    state.forget("small")  # finished before memory was short: its full cache was kept
    state.forget("big")  # compacted: not "never compacted"
    assert stats.requests_never_compacted == 1
    eager = CompressionReport("eager", 4 * BLOCK, "rc", 2, kept=[[BLOCK, 3 * BLOCK]], block_size=BLOCK)
    state.apply_reports(pool, [eager], lambda req_id: lists[req_id])
    copied(state, "eager")
    assert stats.requests_compressed == 2 and stats.ratio_count == 1
    assert stats.mean_ratio == pytest.approx(eager.compression_ratio) == pytest.approx(0.5)


def test_a_lazy_compaction_after_decoding_keeps_the_generated_tokens_and_frees_what_the_plan_said():
    """Compacted at 200 tokens, a 150-token prompt's plan (keep 4 of 10 blocks) needs cdiv(200, 16) - cdiv(150, 16)
    = 3 more fresh blocks for the 50 generated tokens, which every head keeps; the copy reads them from the
    prompt's last block and the 3 tail blocks, and the request still frees the plan's 6 blocks."""
    pool = FakePool(40)
    blocks = allocate(pool, 13)  # 200 tokens
    tail = tuple(b.block_id for b in blocks[10:13])
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(4, 150, "r")], lambda req_id: blocks)
    free = pool.get_num_free_blocks()
    assert relieve(state, pool, free + 1, lambda req_id: (blocks, 200), "short") == 6
    (compaction,) = queued(state)
    assert len(compaction.block_ids) == 7 and compaction.num_tokens == 200 and compaction.tail_block_ids == tail
    assert len(blocks) == 13 and [b.block_id for b in blocks[:7]] == list(compaction.block_ids)
    assert all(b.is_null for b in blocks[7:])


def test_tokens_generated_into_the_prompts_last_block_before_a_lazy_compaction_are_copied_too():
    """A 150-token prompt's last block (16 tokens) holds 10 more: compacted at 155 tokens, the 5 generated ones have
    no tail block, and the worker must still copy them (once, they were dropped: the request then decoded without
    its first generated tokens' KV and its answer went astray)."""
    pool = FakePool(40)
    blocks = allocate(pool, 10)  # 155 tokens
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(4, 150, "r")], lambda req_id: blocks)
    assert relieve(state, pool, pool.get_num_free_blocks() + 1, lambda req_id: (blocks, 155), "short") == 6
    (compaction,) = queued(state)
    assert compaction.num_tokens == 155 and compaction.tail_block_ids == () and len(compaction.block_ids) == 4


def test_a_parked_request_that_is_not_running_is_skipped_and_forgotten_with_its_blocks():
    pool = FakePool(20)
    blocks = allocate(pool, 6)
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(2, 96, "r")], lambda req_id: blocks)
    assert relieve(state, pool, 100, lambda req_id: None, "short") == 0 and parked(state)
    state.forget("r")  # vLLM freed its blocks (finished or preempted)
    assert not parked(state)


def test_blocks_wanted_counts_running_growth_and_the_first_waiting_prompt():
    """The pressure signal lazy eviction acts on (patches/scheduler.blocks_wanted): a decoding request whose next
    token starts a new block wants one, a prefill in chunks the rest of its prompt, the first waiting request its
    whole prompt; requests whose blocks cover their tokens want none."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from rcstat_vllm.patches.scheduler import blocks_wanted

    def request(req_id, num_tokens):
        return SimpleNamespace(request_id=req_id, num_tokens=num_tokens)

    lists = {"full": [0] * 4, "grows": [0] * 4, "chunked": [0] * 2}
    manager = SimpleNamespace(
        single_type_managers=[SimpleNamespace(block_size=BLOCK, req_to_blocks=lists)],
    )
    waiting = [request("next", 100)]
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(
            coordinator=manager, block_pool=type("Pool", (), {})()
        ),  # no engine state: group 0
        running=[request("full", 4 * BLOCK), request("grows", 4 * BLOCK + 1), request("chunked", 10 * BLOCK)],
        waiting=type("Queue", (), {"__len__": lambda self: len(waiting), "peek_request": lambda self: waiting[0]})(),
    )
    wanted, reason = blocks_wanted(scheduler)
    assert wanted == 0 + 1 + 8 + 7 and "9 blocks for running" in reason and "7 for the first waiting" in reason
    waiting.clear()
    assert blocks_wanted(scheduler)[0] == 9


def decode_report(keep_blocks: int, num_tokens: int, cached_tokens: int = 0) -> CompressionReport:
    return CompressionReport(
        "r",
        num_tokens,
        "rc",
        keep_blocks,
        block_size=BLOCK,
        num_cached_tokens=cached_tokens,
        decode=True,
        decode_tokens_evicted=96,
    )


def test_a_decode_time_compaction_replaces_every_own_block_and_the_compacted_set():
    """A compressed request (1 shared block, 3 compacted, 2 nulls, 2 blocks vLLM appended as it decoded) is compacted
    again at 8 blocks' worth of tokens into 4 fresh blocks: its shared block stays, every other block of its list
    goes back to the pool, the list keeps its length (nulls after the fresh ones), and only the fresh blocks are
    compacted (never prefix-cacheable) from then on."""
    pool = FakePool(30)
    state = EngineCompaction(config=RCStatConfig())
    shared = allocate(pool, 1)
    shared[0].ref_cnt += 1  # another request reads it too
    request = [*shared, *allocate(pool, 5)]
    state._compact(pool, report(4, 6 * BLOCK, cached_tokens=BLOCK), request)  # the prompt's compaction
    state.take_outgoing(lambda req_id: True)  # sent with the next step
    copied(state, "r")
    first = set(state.compacted["r"])
    request.extend(allocate(pool, 2))  # decode growth
    free_before = pool.get_num_free_blocks()

    freed = state._compact(pool, decode_report(5, 8 * BLOCK, cached_tokens=BLOCK), request)

    compaction = queued(state)[-1]
    assert compaction.cancelled_reason is None and len(compaction.block_ids) == 4
    assert request[0] is shared[0] and [b.block_id for b in request[1:5]] == list(compaction.block_ids)
    assert all(b.is_null for b in request[5:]) and len(request) == 8
    assert freed == pool.get_num_free_blocks() - free_before == 5 - 4  # 3 compacted + 2 appended back, 4 taken
    assert set(state.compacted["r"]) == set(compaction.block_ids) and not (first & state.compacted_blocks)
    copied(state, "r", kind="decode")
    assert state.stats.decode_compactions == 1 and state.stats.decode_tokens_evicted == 96
    assert state.stats.requests_compressed == 1  # the decode-time compaction is not a request compressed


def test_a_decode_time_compaction_under_pressure_reuses_the_requests_own_blocks_and_says_so():
    """When the fresh blocks exist only once the request's own are freed, the exchange hands some of those back and
    flags the compaction (the worker then reads every kept entry before writing: its sources are head pages anywhere
    in those blocks); when the pool has room it takes fresh ones first and says nothing."""
    pool = FakePool(8)
    state = EngineCompaction(config=RCStatConfig())
    request = allocate(pool, 6)
    own = {b.block_id for b in request}
    assert pool.get_num_free_blocks() == 1
    freed = state._compact(pool, decode_report(3, 6 * BLOCK), request)
    compaction = queued(state)[-1]
    assert compaction.cancelled_reason is None and compaction.reuses_own_blocks
    assert set(compaction.block_ids) & own and freed == 3 and pool.get_num_free_blocks() == 4
    copied(state, "r", kind="decode")
    assert state.stats.decode_compactions == 1
    state.take_outgoing(lambda req_id: True)

    roomy = FakePool(20)
    request = allocate(roomy, 6)
    state._compact(roomy, decode_report(3, 6 * BLOCK), request)
    assert not queued(state)[-1].reuses_own_blocks


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-pages", "per-layer-pages"])
def test_a_request_copying_into_blocks_another_freed_in_the_same_step_reads_back_both_exactly(pooled):
    """vLLM reuses a freed block first, so within one step request B's fresh blocks are request A's prompt blocks,
    A's copy sources. The worker runs the step's compactions one after another in the scheduler's order (A reads
    its prompt before B writes there), so on real cache tensors every (layer, head) of both requests reads back
    exactly the prompt entries its keep mask names, in order, and no block outside the two requests' fresh blocks
    is written. (Run B's copy first and A reads B's KV.)"""
    pytest.importorskip("vllm")
    import torch
    from fake_vllm import fake_vllm_config
    from worker_fixtures import awaiting_blocks

    from rcstat_vllm.paging.kv_layout import CPU_VEC
    from rcstat_vllm.paging.page_space import identity_pages
    from rcstat_vllm.worker.driver import WorkerCompression
    from rcstat_vllm.worker.jobs import PromptJob
    from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor
    from rcstat_vllm.worker.step import StepInfo

    layers, heads, dim, num_blocks = 3, 2, 8, 24
    g = torch.Generator().manual_seed(5)
    backing = torch.randn(layers * num_blocks, heads, BLOCK, 2 * dim, generator=g)
    original = backing.clone().view(layers, num_blocks, heads, BLOCK, 2 * dim)
    caches = list(backing.view(layers, num_blocks, heads, BLOCK, 2 * dim).unbind(0))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    settings = {"method": "rc", "target_ratio": 0.5, "window": 8, "eviction": "eager"}
    # An engine whose kernel blocks differ from the scheduler's cannot pool pages across layers: per-layer pages.
    worker = WorkerCompression(fake_vllm_config(settings, BLOCK if pooled else 2 * BLOCK))
    worker.attach_layers(names, num_kv_heads=heads, block_size=BLOCK, layout=CPU_VEC)
    worker.bind_kv_caches(dict(zip(names, caches)))
    assert worker.space.is_pooled == pooled
    worker.pages.layer_caches = list(caches)  # what each layer's forward records (after_attention) before a compaction

    pool = FakePool(num_blocks)
    lists = {"a": allocate(pool, 6), "b": allocate(pool, 5)}
    rows = {req_id: torch.tensor([b.block_id for b in blocks]) for req_id, blocks in lists.items()}
    masks, plans = {}, []
    for req_id, row in rows.items():
        n = row.numel() * BLOCK
        compressor = RequestCompressor(CompressionDecision(req_id, worker.config, n, 0, n), layers, row)
        compressor.scores = [torch.rand(heads, n, generator=g) for _ in range(layers)]
        compressor.keep_blocks = compressor.select(worker.space)
        masks[req_id] = [mask.clone() for mask in compressor.masks]
        awaiting_blocks(worker.requests, req_id, PromptJob(compressor, CPU_VEC))
        plans.append(compressor.report())

    state = EngineCompaction(config=worker.config)
    state.apply_reports(pool, plans, lists.get)  # the scheduler's part, in one step: a, then b
    a, b = queued(state)
    assert a.cancelled_reason is None and b.cancelled_reason is None
    reused = set(b.block_ids) & set(rows["a"].tolist())
    assert reused and reused.isdisjoint(a.block_ids)  # b writes where a's kept prompt KV is read from

    worker.begin_step(StepInfo(requests=[], compactions=state.take_outgoing(lambda req_id: True)))

    for req_id, row in rows.items():
        compacted = worker.requests.compressed_state(req_id)
        assert compacted is not None and compacted.keep_blocks == len(state.compacted[req_id])
        tokens = torch.arange(row.numel() * BLOCK)
        for layer in range(layers):
            cache = worker.space.cache(layer, caches[layer])
            for head in range(heads):
                kept = tokens[masks[req_id][layer][head]]
                slots = torch.arange(kept.numel())
                got = CPU_VEC.read(cache, compacted.tables[layer, head, slots // BLOCK], slots % BLOCK)
                want = CPU_VEC.read(original[layer], identity_pages(row, heads)[head, kept // BLOCK], kept % BLOCK)
                for got_part, want_part in zip(got, want):
                    for j in range(kept.numel()):  # token by token, so a failure names the token
                        assert torch.equal(got_part[j], want_part[j]), (req_id, layer, head, int(kept[j]))
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[list(a.block_ids + b.block_ids)] = False
    assert torch.equal(
        backing.view(layers, num_blocks, -1)[:, untouched], original.view(layers, num_blocks, -1)[:, untouched]
    )


# ---- issue 50: lifecycles the exchange must follow ----


def test_a_lazy_relief_never_takes_more_blocks_than_it_gives_back_once_its_prompt_is_shared():
    """FakePool(20), an 8-block request whose parked plan keeps 3 (5 freed when parked); then another request hits its
    prompt (every block touched once more, as ``BlockPool.touch`` does). Compacting it now would take 3 fresh blocks
    and release none (11 -> 8 free, on main): the relief sees what it frees now and passes it over, so free blocks
    never drop; with only half its blocks shared it frees what is left, no more than that."""
    pool = FakePool(20)
    blocks = allocate(pool, 8)
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(3, 8 * BLOCK, "r")], {"r": blocks}.get)
    assert parked(state) == {"r"} and pool.get_num_free_blocks() == 11
    for block in blocks:
        block.ref_cnt += 1  # a later request's prefix-cache hit
    running = lambda req_id: (blocks, 8 * BLOCK)  # noqa: E731
    assert state.parked(running)[0].blocks_freed == -3
    assert relieve(state, pool, 12, running, "1 short") == 0
    assert pool.get_num_free_blocks() == 11 and parked(state) == {"r"} and not queued(state)

    for block in blocks[4:]:
        block.ref_cnt -= 1  # the other request finished: half of the prompt is this request's alone again
    assert state.parked(running)[0].blocks_freed == 4 - 3
    assert relieve(state, pool, 12, running, "1 short") == 1 and pool.get_num_free_blocks() == 12


def test_a_relief_skips_a_chosen_plan_that_an_earlier_compaction_left_freeing_nothing():
    """The check is made again right before each swap: a plan the policy chose that frees nothing by then stays
    parked, and the relief goes on with the next plan."""
    pool = FakePool(30)
    lists = {"a": allocate(pool, 6), "b": allocate(pool, 6)}
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(pool, [lazy_report(2, 6 * BLOCK, "a"), lazy_report(2, 6 * BLOCK, "b")], lists.get)
    running = lambda req_id: (lists[req_id], 6 * BLOCK)  # noqa: E731
    plans = state.parked(running)
    for block in lists["a"]:
        block.ref_cnt += 1  # shared after the policy's snapshot
    free = pool.get_num_free_blocks()
    assert state.relieve_pressure(pool, cover(4, "4 short", plans), running) == 4
    assert parked(state) == {"a"} and [c.req_id for c in queued(state)] == ["b"]
    assert pool.get_num_free_blocks() == free + 4


def test_compactions_are_counted_when_their_copy_runs_never_when_vllm_preempts_first():
    """The exchange grants a compaction (fresh blocks swapped in) a step before the worker copies. vLLM often preempts
    ``running[-1]``, the request just compacted: its copy is then never sent, and neither requests_compressed nor
    kv_blocks_freed may count it (a lazy one is a plan never compacted); the one whose copy ran is counted once, so
    requests_compressed equals the prompt copies the worker timed."""
    pool = FakePool(40)
    lists = {"kept": allocate(pool, 4), "preempted": allocate(pool, 4), "lazy": allocate(pool, 6)}
    state = EngineCompaction(config=RCStatConfig(eviction="lazy"))
    state.apply_reports(
        pool,
        [
            report(1, 4 * BLOCK, req_id="kept"),
            report(1, 4 * BLOCK, req_id="preempted"),
            lazy_report(2, 6 * BLOCK, "lazy"),
        ],
        lists.get,
    )
    running = lambda req_id: (lists[req_id], 6 * BLOCK)  # noqa: E731
    assert relieve(state, pool, pool.get_num_free_blocks() + 1, running, "short") == 4
    assert state.stats.requests_compressed == 0 and state.stats.blocks_freed == 0
    state.forget("preempted")  # vLLM's schedule preempts it: its blocks go back, before the copy is sent
    state.forget("lazy")
    sent = state.take_outgoing(lambda req_id: req_id in lists)
    assert [c.req_id for c in sent] == ["kept"]
    copied(state, "kept")
    stats = state.stats
    assert (stats.requests_compressed, stats.blocks_freed, stats.requests_never_compacted) == (1, 3, 1)
    assert stats.requests_compressed == stats.prompt_copies == 1


def test_the_forecast_sums_every_kv_cache_group_as_vllm_allocates():
    """A hybrid model (one full-attention group, compressed, and one sliding-window group, both block size 16): a
    running request at 33 tokens (2 blocks in each group) and a waiting one of 100 tokens. vLLM's
    ``get_num_blocks_to_allocate`` sums the groups: 1 + 1 for the running one, 7 + 7 for the waiting one: 16 (the
    forecast said 8 on main, and relief did not fire while the waiting request stalled)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from rcstat_vllm.patches.scheduler import blocks_wanted, running_snapshot

    def manager(lists):
        return SimpleNamespace(block_size=BLOCK, req_to_blocks=lists)

    full, sliding = manager({"run": [0, 0]}), manager({"run": [0, 0]})
    waiting = [SimpleNamespace(request_id="next", num_tokens=100)]
    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[full, sliding]), block_pool=type("Pool", (), {})()
        ),  # no engine state: group 0
        running=[SimpleNamespace(request_id="run", num_tokens=33)],
        waiting=type("Queue", (), {"__len__": lambda self: len(waiting), "peek_request": lambda self: waiting[0]})(),
    )
    (snapshot,) = running_snapshot(scheduler)
    assert snapshot.blocks_held == 2 and snapshot.other_groups == ((BLOCK, 2),)
    wanted, reason = blocks_wanted(scheduler)
    assert wanted == 16 and "2 blocks for running" in reason and "14 for the first waiting" in reason
