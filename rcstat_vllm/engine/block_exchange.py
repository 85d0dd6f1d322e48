"""Scheduler side of compaction: give a compressed request fresh blocks for its kept KV, return its prompt blocks
to the pool, and keep compacted blocks out of the prefix cache.

Written against :class:`BlockPool`, the few members of vLLM's ``BlockPool`` it uses, and a request's block list
(``req_to_blocks[req_id]`` of its KV cache manager), so it runs without an engine (``tests/test_block_exchange.py``);
the scheduler hooks in ``patches/scheduler.py`` hand it vLLM's objects.

The exchange (copy on compact; the worker side is ``rcstat_vllm/worker/driver.py``):

1. The step that runs a request's last prefill chunk reports a plan: ``keep_blocks`` blocks hold the kept KV.
2. Here, after vLLM processed that step's output (so only requests still running): the request's prefix-cache
   hits stay in its block list as they are (shared: compressing them privately would hold the prefix once per
   request instead of once for all); allocate fresh blocks for the rest of ``keep_blocks``, free the prompt blocks
   the request computed and put the fresh ones in their place, followed by null blocks (as vLLM's sliding-window
   manager does: the list keeps its length, so later allocation by position is unchanged). Freed blocks that are
   prefix-cache entries stay cached (evictable), and blocks other requests hit keep their other references:
   nothing compaction writes was ever a cache entry or another request's block.
3. The next scheduler output carries the block ids (``RCStatSchedulerOutput``); the worker copies the kept
   entries there before that step's forward, so before any other request can write a freed prompt block.

Lazy eviction (``eviction: lazy``): step 2 waits. The plan is parked (phase ``PLANNED`` of the request table,
:mod:`rcstat_vllm.engine.requests`) while the request decodes over its full cache; before each schedule, when the
blocks the scheduler is about to want exceed the free ones, parked requests are compacted, those freeing most
first, until the shortfall is covered (the choice: :func:`rcstat_vllm.engine.pressure_policy.relief`; applied by
:meth:`EngineCompaction.relieve_pressure`). The tokens generated meanwhile are kept whole: a request compacted at
``t`` tokens needs ``cdiv(t, N) - cdiv(n, N)`` more blocks than its plan at ``n`` prompt tokens said (every head
keeps them, so each head's page count grows by exactly that), and frees as many blocks as the plan did.

Invariants, enforced here: a compacted request's blocks are never cached (:meth:`EngineCompaction.may_cache`), a
prefix-cache hit never returns a compacted block (:meth:`EngineCompaction.check_hit`, on every lookup), and every
block returns to the pool with its request (vLLM frees the request's list, which now holds the fresh blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.decode_pressure import DecodePressure
from rcstat_vllm.engine.metrics import CompressionStats
from rcstat_vllm.engine.pressure_policy import ParkedPlan, Relief
from rcstat_vllm.engine.requests import EngineRequests, Phase
from rcstat_vllm.log import logger
from rcstat_vllm.reports import Compaction, CompressionReport, StepCompactions
from rcstat_vllm.settings import RequestSettings, RequestSettingsTable, max_cached_prompt_tokens


class Block(Protocol):
    """What the exchange reads of vLLM's ``KVCacheBlock``."""

    block_id: int
    ref_cnt: int
    is_null: bool


class BlockPool(Protocol):
    """What the exchange uses of vLLM's ``BlockPool`` (contracts in ``patches/scheduler.py``)."""

    null_block: Block

    def get_new_blocks(self, num_blocks: int) -> list: ...

    def free_blocks(self, ordered_blocks: Iterable) -> None: ...

    def get_num_free_blocks(self) -> int: ...


@dataclass(frozen=True)
class Exchange:
    """The sizes of one exchange over a request's block list: the blocks it computed (``blocks[shared:end]``), those
    of them only it holds (freed for good when it lets them go), and the fresh blocks its kept KV takes."""

    shared: int
    end: int
    released: int
    num_fresh: int

    @property
    def gain(self) -> int:
        """Free blocks after the exchange minus before (< 0: it takes more than it gives back)."""
        return self.released - self.num_fresh


def exchange_sizes(blocks: Sequence[Block], report: CompressionReport, num_tokens: int = 0) -> Exchange:
    """What exchanging the request's blocks for ``report``'s kept KV takes and gives back now: computed from its
    block list as it is (a block another request hit since the plan was made is not released, only its reference)."""
    shared, prompt_end = report.shared_blocks, report.prompt_blocks
    end = max(prompt_end, -(-num_tokens // report.block_size)) if report.block_size else prompt_end
    released = sum(1 for block in blocks[shared:end] if not block.is_null and block.ref_cnt == 1)
    return Exchange(shared, end, released, report.keep_blocks + (end - prompt_end) - shared)


def swap_in_fresh_blocks(
    pool: BlockPool,
    blocks: MutableSequence[Block],
    report: CompressionReport,
    num_tokens: int = 0,
    reason: str | None = None,
) -> tuple[Compaction, int]:
    """Give the request fresh blocks in place of the blocks it computed (its prefix-cache hits stay, shared);
    ``blocks`` is the request's block list, rewritten in place. Returns the compaction to send and the change in
    free blocks. Fresh blocks are taken before the computed blocks are freed when the pool has room (then no block
    is both a copy's source and its destination); otherwise after (the worker then reads every kept entry before
    writing). Refused (request left uncompressed) when even that is short, which needs prompt blocks shared with
    running requests.

    ``num_tokens`` (lazy eviction): the tokens in the cache now, more than the prompt's when the request decoded
    before being compacted; its blocks up to them are replaced, the generated tokens kept whole.

    A decode-time compaction (``report.decode``) is the same exchange over all the request's own blocks; when it
    reuses them (``Compaction.reuses_own_blocks``) the worker stages its copy."""
    sizes = exchange_sizes(blocks, report, num_tokens)
    shared, end, num_fresh = sizes.shared, sizes.end, sizes.num_fresh
    computed = blocks[shared:end]  # the blocks this request computed (its prefix-cache hits stay as they are)
    tail = tuple(block.block_id for block in blocks[report.prompt_blocks : end])
    before = pool.get_num_free_blocks()
    if num_fresh > before + sizes.released:
        return Compaction(report.req_id, cancelled_reason="no free blocks to copy the kept KV into"), 0
    fresh = pool.get_new_blocks(num_fresh) if num_fresh <= before else None
    pool.free_blocks(reversed(computed))  # tail first: evicted first, as vLLM frees a request
    if fresh is None:
        fresh = pool.get_new_blocks(num_fresh)
    blocks[shared:end] = fresh + [pool.null_block] * (end - shared - num_fresh)
    # Tokens generated before a lazy compaction are copied too, those still in the prompt's last block included
    # (no tail block then).
    generated = num_tokens > report.num_prompt_tokens
    compaction = Compaction(
        report.req_id,
        tuple(block.block_id for block in fresh),
        num_tokens=num_tokens if generated else 0,
        tail_block_ids=tail,
        reason=reason,
        reuses_own_blocks=num_fresh > before,
    )
    return compaction, pool.get_num_free_blocks() - before


@dataclass
class EngineCompaction:
    """Scheduler-side state of one engine, created with its scheduler when the flag is on (``patches/owners.py`` finds
    it from the block pool the scheduler and its KV cache managers share): what it logs and exports, and its request
    table (plans parked, compactions to send, compacted blocks)."""

    #: the server's flag
    config: RCStatConfig = field(default_factory=RCStatConfig)
    #: the KV cache group whose block lists compaction swaps (a hybrid model's full-attention group; None: no group
    #: is compressed and the hooks pass through)
    group: int | None = 0
    stats: CompressionStats = field(default_factory=CompressionStats)
    requests: EngineRequests = field(default_factory=EngineRequests)
    #: decode-time compactions brought forward when the pool is about to run short (over the same table)
    decode_pressure: DecodePressure = field(init=False)
    #: compactions granted (fresh blocks swapped in) whose copy the worker has not reported yet: (request id, kind)
    #: -> the plan and the blocks it freed, counted when the copy runs (:meth:`observe_step`)
    _uncounted: dict[tuple[str, str], tuple[CompressionReport, int]] = field(default_factory=dict)

    #: each request's settings, resolved once (:meth:`settings_of`), dropped with the request (:meth:`forget`)
    _settings: RequestSettingsTable = field(init=False)

    def __post_init__(self) -> None:
        self.decode_pressure = DecodePressure(self.requests)
        self._settings = RequestSettingsTable(self.config)

    def settings_of(self, req_id: str, extra_args) -> RequestSettings:
        """The request's settings over the server's flag, parsed the first time the scheduler side asks (a prefix
        lookup, the decode-time forecast) and kept until vLLM frees the request."""
        return self._settings.of(req_id, extra_args)

    @property
    def compacted(self) -> dict[str, tuple[int, ...]]:
        """Request id -> the blocks its kept KV went to (a read-only view of the table)."""
        return self.requests.compacted()

    @property
    def compacted_blocks(self) -> set[int]:
        """Every compacted request's blocks (a read-only view of the table)."""
        return self.requests.compacted_blocks

    def forget(self, req_id: str) -> None:
        """The request's blocks go back to the pool (vLLM frees them); a parked plan, or a lazy compaction whose copy
        was never sent, is counted as never compacted (an eager one is compressed again when it is recomputed)."""
        record = self.requests.get(req_id)
        if record is not None and record.phase is Phase.PLANNED:
            self.stats.observe_never_compacted()
        if record is not None and record.phase is Phase.AWAITING_COMPACTION:
            self._never_copied(req_id)
        self.requests.forget(req_id)
        self._settings.drop(req_id)
        self.stats.observe_tracked(len(self.requests))

    def continue_session(self, req_id: str) -> None:
        """A streaming-input session's next chunk arrived: a plan parked for its earlier prompt is dropped (the
        worker cancels it too; the chunk's end plans again), counted as never compacted."""
        self._settings.drop(req_id)  # (the chunk brings its own sampling parameters)
        if self.requests.continue_session(req_id) is not None:
            self.stats.observe_never_compacted()
            logger.debug("rcstat: request %s: streaming-input session continued: its parked plan is dropped", req_id)

    def _never_copied(self, req_id: str) -> None:
        """A granted compaction whose copy will never run (its request left before the copy was sent)."""
        for kind in ("prompt", "decode"):
            uncounted = self._uncounted.pop((req_id, kind), None)
            if uncounted is not None and kind == "prompt" and uncounted[0].lazy:
                self.stats.observe_never_compacted()

    def observe_step(self, step: StepCompactions) -> None:
        """The worker's copies in one step: each granted compaction is counted now that its copy ran; the parked plans
        it finished scoring ahead of their copy are ready."""
        self.requests.mark_scored_ahead(step.scored_ahead)
        for copy in step.copies:
            uncounted = self._uncounted.pop((copy.req_id, copy.kind), None)
            if uncounted is None:
                continue
            report, freed = uncounted
            if report.decode:
                self.stats.observe_decode(report, freed, True)
            else:
                self.stats.observe(report, freed)
        self.stats.observe_step(step)

    def apply_reports(
        self,
        pool: BlockPool,
        reports: Iterable[CompressionReport],
        running_blocks: Callable[[str], MutableSequence[Block] | None],
        running_tokens: Callable[[str], int] | None = None,
    ) -> None:
        """Apply one step's reports: swap fresh blocks into each running request's block list
        (``running_blocks(req_id)``, None when the request finished with this step: vLLM freed its blocks and the
        worker drops the plan), queue the compactions to send, count and log.

        ``running_tokens(req_id)``: the tokens vLLM has scheduled for the request so far. Under asynchronous
        scheduling a step scheduled before this report arrived is in flight: it writes its tokens into the request's
        old blocks, and the copy (sent with the next schedule, run before its forward) carries them over, as a lazy
        compaction carries the tokens generated before it; a decode-time plan's too. Without it (or when it counts
        only the plan's tokens) the plan's blocks are exchanged alone."""
        for report in reports:
            if report.skipped_reason is None:
                blocks = running_blocks(report.req_id)
                if blocks is None:
                    continue
                if report.lazy:
                    self.requests.park(report.req_id, report)
                    self.stats.observe_planned()
                    continue
                num_tokens = 0 if running_tokens is None else running_tokens(report.req_id)
                self._compact(pool, report, blocks, num_tokens)
            else:
                self.stats.observe(report, 0)
        self.stats.maybe_log(pool.get_num_free_blocks())

    def parked(
        self,
        running: Callable[[str], tuple[Sequence[Block], int] | None],
    ) -> tuple[ParkedPlan, ...]:
        """The parked plans of running requests, in the order parked, each with what compacting it frees now
        (``running(req_id)``: its block list and tokens in the cache; None: not running, a request waiting,
        preempted, is skipped: vLLM frees its blocks and :meth:`forget` drops its plan)."""
        plans = []
        for record in self.requests.in_phase(Phase.PLANNED):
            held = running(record.req_id)
            if held is not None:
                gain = exchange_sizes(held[0], record.plan, held[1]).gain  # type: ignore[arg-type]  # (PLANNED)
                # ready: its copy only copies (scored at prefill: the plan names each head's keeps; or selected ahead)
                ready = bool(record.plan.kept) or record.scored_ahead  # type: ignore[union-attr]
                plans.append(ParkedPlan(record.req_id, gain, ready))
        return tuple(plans)

    def relieve_pressure(
        self,
        pool: BlockPool,
        relief: Relief,
        running: Callable[[str], tuple[MutableSequence[Block], int]],
    ) -> int:
        """Lazy eviction, before a schedule: compact the parked requests the policy chose (``running(req_id)``: their
        block list and tokens in the cache), and more when they freed less than their plans said, until the
        shortfall is covered or none is left. A plan that would free nothing now stays parked (checked again right
        before its swap: an earlier compaction of this relief may have changed what it holds alone). Never takes
        more blocks than it gives back. Returns the blocks freed."""
        if relief.freeing_nothing:
            logger.debug(
                "rcstat: lazy relief (%s) passes over %d parked plans that free nothing now (their prompt "
                "blocks are shared with requests that hit them since): %s",
                relief.reason,
                len(relief.freeing_nothing),
                ", ".join(relief.freeing_nothing),
            )
        short, gained = relief.short, 0
        while relief.compact:
            freed = 0
            for req_id in relief.compact:
                blocks, num_tokens = running(req_id)
                plan = self.requests.get(req_id).plan  # type: ignore[union-attr]  # (the policy chose parked plans)
                if exchange_sizes(blocks, plan, num_tokens).gain <= 0:  # type: ignore[arg-type]
                    logger.debug("rcstat: request %s: lazy compaction passed over: it frees nothing now", req_id)
                    continue
                freed += self._compact(pool, self.requests.take_plan(req_id), blocks, num_tokens, relief.reason)
            gained += freed
            relief = relief.after(freed)
        if short > 0:
            logger.debug(
                "rcstat: lazy relief for %d blocks short: %d blocks freed, %d free now",
                short,
                gained,
                pool.get_num_free_blocks(),
            )
        if gained:
            self.stats.maybe_log(pool.get_num_free_blocks())
        return gained

    def _compact(self, pool: BlockPool, report: CompressionReport, blocks, num_tokens: int = 0, reason=None) -> int:
        """Swap fresh blocks into the request's list, queue the copy, count and log; the blocks freed."""
        self.requests.expect(report.req_id, Phase.WHOLE, Phase.COMPACTED)
        compaction, freed = swap_in_fresh_blocks(pool, blocks, report, num_tokens, reason)
        self.requests.queue(compaction)
        granted = compaction.cancelled_reason is None
        if granted:
            self._uncounted[(report.req_id, "decode" if report.decode else "prompt")] = (report, freed)
        if report.decode:
            if not granted:
                self.stats.observe_decode(report, freed, False)
            self.requests.decode_compacted(report.req_id, report.num_prompt_tokens if granted else None)
            logger.debug(
                "rcstat: request %s: decode-time compaction at %d tokens: %d generated entries evicted, "
                "%d blocks freed, %d free now%s",
                report.req_id,
                report.num_prompt_tokens,
                report.decode_tokens_evicted,
                freed,
                pool.get_num_free_blocks(),
                f" (skipped: {compaction.cancelled_reason})" if compaction.cancelled_reason else "",
            )
            return freed
        if compaction.cancelled_reason is not None:
            report = CompressionReport(
                report.req_id,
                report.num_prompt_tokens,
                report.method,
                report.prompt_blocks,
                skipped_reason=compaction.cancelled_reason,
                block_size=report.block_size,
            )
            self.stats.observe(report, freed)
        # A deferred plan (lazy eviction, budget mode) is scored by the worker's copy: its ratio is logged there.
        ratios = (
            f"compression ratio {report.compression_ratio:.3f}, global eviction ratio "
            f"{report.global_eviction_ratio:.3f}"
            if report.kept
            else "scored at the copy"
        )
        logger.debug(
            "rcstat: request %s: %s, %d blocks freed (predicted %d), %d prompt tokens from the prefix cache, "
            "%d free now%s",
            report.req_id,
            ratios,
            freed,
            report.blocks_freed,
            report.num_cached_tokens,
            pool.get_num_free_blocks(),
            f" (lazy: {reason}, at {num_tokens} tokens)" if reason else "",
        )
        return freed

    def take_outgoing(self, is_running: Callable[[str], bool]) -> list[Compaction]:
        """The compactions for the next scheduler output, in the order queued (a copy may write blocks an earlier
        one read); a request preempted by this very schedule gave its fresh blocks back, so its copy must not run
        (``is_running`` False) and is never counted."""
        queued = [r.req_id for r in self.requests.in_phase(Phase.AWAITING_COMPACTION)]
        sent = self.requests.take_outgoing(is_running)
        for req_id in set(queued) - {c.req_id for c in sent}:
            self._never_copied(req_id)
        self.stats.observe_tracked(len(self.requests))
        return sent

    def may_cache(self, req_id: str) -> bool:
        """Whether the request's blocks may become prefix-cache entries: never once compacted (its blocks hold head
        pages, not the tokens their position's hash names)."""
        return self.requests.may_cache(req_id)

    def prefix_hit_limit(
        self, req_id: str, num_hit: int, num_prompt_tokens: int, extra_args, block_size: int
    ) -> int | None:
        """The tokens a prefix-cache hit of ``num_hit`` may keep, when fewer (else None): a hit stops before the
        prompt's observation window of a request that will be compressed (whose queries exist only if computed;
        :func:`~rcstat_vllm.settings.max_cached_prompt_tokens`)."""
        if not num_hit:
            return None
        limit = max_cached_prompt_tokens(num_prompt_tokens, self.settings_of(req_id, extra_args), block_size)
        return limit if limit is not None and num_hit > limit else None

    def check_hit(self, req_id: str, hit_block_ids: Iterable[int]) -> None:
        """Raise when a prefix-cache hit returned a compacted block (its KV is another request's head pages)."""
        compacted = self.requests.compacted_blocks
        if not compacted:
            return
        hits = set(hit_block_ids) & compacted
        if hits:
            raise RuntimeError(
                f"rcstat: a prefix-cache hit of request {req_id} returned compacted blocks "
                f"{sorted(hits)}: their KV is another request's head pages"
            )
