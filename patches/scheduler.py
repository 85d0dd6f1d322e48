"""Scheduler side of compaction: give a compressed request fresh blocks for its kept KV, return its prompt blocks
to the pool, and keep compacted blocks out of the prefix cache.

The exchange (copy on compact; the worker side is ``rcstat_vllm/worker.py``):

1. The step that runs a request's last prefill chunk reports a plan: ``keep_blocks`` blocks hold the kept KV.
2. Here, after vLLM processed that step's output (so only requests still running): the request's prefix-cache
   hits stay in its block list as they are (shared: compressing them privately would hold the prefix once per
   request instead of once for all); allocate fresh blocks for the rest of ``keep_blocks``, free the prompt blocks
   the request computed and put the fresh ones in their place, followed by null blocks (as vLLM's sliding-window
   manager does: the list keeps its length, so later allocation by position is unchanged). Freed blocks that are
   prefix-cache entries stay cached (evictable), and blocks other requests hit keep their other references:
   nothing compaction writes was ever a cache entry or another request's block.
3. The next scheduler output carries the block ids (:class:`RCStatSchedulerOutput`); the worker copies the kept
   entries there before that step's forward, so before any other request can write a freed prompt block.

Invariants, enforced here: a compacted request's blocks are never cached (``cache_blocks`` skips it), a prefix-
cache hit never returns a compacted block (checked on every lookup), and every block returns to the pool with its
request (vLLM frees the request's list, which now holds the fresh blocks).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields

from vllm.v1.core.sched.output import SchedulerOutput

from rcstat_vllm.compression import max_cached_prompt_tokens
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.log import logger
from rcstat_vllm.metrics import CompressionStats
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.step import Compaction

from ._contract import Contract, wrap_method
from .model_runner import RCStatModelRunnerOutput

CONTRACTS = (
    Contract(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    Contract("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self",)),
    Contract("vllm.v1.core.sched.output:SchedulerOutput"),
    Contract("vllm.v1.request:RequestStatus.RUNNING"),
    Contract(
        "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.cache_blocks",
        ("self", "request", "num_tokens"),
    ),
    Contract(
        "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.pop_blocks_for_free",
        ("self", "request_id"),
    ),
    Contract("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks", ("self", "request")),
    Contract("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks")),
    Contract("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks")),
    Contract("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",)),
)


@dataclass
class RCStatSchedulerOutput(SchedulerOutput):
    """vLLM's scheduler output plus the compactions the workers run before this step's forward."""

    rcstat_compactions: list[Compaction] = field(default_factory=list)


@dataclass
class EngineCompaction:
    """Scheduler-side state of one engine (keyed by its block pool, which the scheduler and the KV cache managers
    share): what it logs and exports, the compacted requests' blocks, the compactions to send."""

    #: the server's flag (set by the first schedule)
    config: RCStatConfig | None = None
    stats: CompressionStats = field(default_factory=CompressionStats)
    #: request id -> the blocks its kept KV was copied into (never prefix-cacheable)
    compacted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    compacted_blocks: set[int] = field(default_factory=set)
    outgoing: list[Compaction] = field(default_factory=list)

    def forget(self, req_id: str) -> None:
        self.compacted_blocks.difference_update(self.compacted.pop(req_id, ()))


_ENGINES: "weakref.WeakKeyDictionary[object, EngineCompaction]" = weakref.WeakKeyDictionary()


def engine_compaction(block_pool) -> EngineCompaction:
    state = _ENGINES.get(block_pool)
    if state is None:
        state = _ENGINES[block_pool] = EngineCompaction()
    return state


def scheduler_stats(scheduler) -> CompressionStats:
    return engine_compaction(scheduler.kv_cache_manager.block_pool).stats


def request_manager(kv_cache_manager, req_id: str):
    """The KV cache manager holding the request's blocks (the plugin's backend serves one KV-cache group)."""
    holders = [m for m in kv_cache_manager.coordinator.single_type_managers if req_id in m.req_to_blocks]
    if len(holders) != 1:
        raise RuntimeError(f"rcstat: request {req_id} has blocks in {len(holders)} KV-cache groups, expected 1")
    return holders[0]


def swap_in_fresh_blocks(kv_cache_manager, report: CompressionReport) -> tuple[Compaction, int]:
    """Give the request fresh blocks in place of the prompt blocks it computed (its prefix-cache hits stay, shared);
    returns the compaction to send and the change in free blocks. Fresh blocks are taken before the prompt blocks are freed when the
    pool has room (then no block is both a copy's source and its destination); otherwise after (the worker then
    reads every kept entry before writing). Refused (request left uncompressed) when even that is short, which
    needs prompt blocks shared with running requests."""
    pool = kv_cache_manager.block_pool
    blocks = request_manager(kv_cache_manager, report.req_id).req_to_blocks[report.req_id]
    shared, end = report.shared_blocks, report.prompt_blocks
    computed = blocks[shared:end]  # the blocks this request computed (its prefix-cache hits stay as they are)
    num_fresh = report.keep_blocks - shared
    before = pool.get_num_free_blocks()
    released = sum(1 for block in computed if not block.is_null and block.ref_cnt == 1)
    if num_fresh > before + released:
        return Compaction(report.req_id, cancelled_reason="no free blocks to copy the kept KV into"), 0
    fresh = pool.get_new_blocks(num_fresh) if num_fresh <= before else None
    pool.free_blocks(reversed(computed))  # tail first: evicted first, as vLLM frees a request
    if fresh is None:
        fresh = pool.get_new_blocks(num_fresh)
    blocks[shared:end] = fresh + [pool.null_block] * (end - shared - num_fresh)
    return Compaction(report.req_id, tuple(block.block_id for block in fresh)), pool.get_num_free_blocks() - before


def _update_from_output(original):
    from vllm.v1.request import RequestStatus

    def wrapper(self, scheduler_output, model_runner_output, *args, **kwargs):
        result = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        reports = model_runner_output.rcstat_reports if isinstance(model_runner_output, RCStatModelRunnerOutput) else None
        if reports:
            state = engine_compaction(self.kv_cache_manager.block_pool)
            pool = self.kv_cache_manager.block_pool
            for report in reports:
                freed = 0
                if report.skipped_reason is None:
                    request = self.requests.get(report.req_id)
                    if request is None or request.status != RequestStatus.RUNNING:
                        # Finished with this step: vLLM freed its blocks; the worker drops the plan.
                        continue
                    compaction, freed = swap_in_fresh_blocks(self.kv_cache_manager, report)
                    state.outgoing.append(compaction)
                    if compaction.cancelled_reason is None:
                        state.compacted[report.req_id] = compaction.block_ids
                        state.compacted_blocks.update(compaction.block_ids)
                    else:
                        report = CompressionReport(
                            report.req_id, report.num_prompt_tokens, report.method, report.prompt_blocks,
                            skipped_reason=compaction.cancelled_reason, block_size=report.block_size,
                        )
                state.stats.observe(report, freed)
                logger.debug(
                    "rcstat: request %s: compression ratio %.3f, global eviction ratio %.3f, %d blocks freed "
                    "(predicted %d), %d prompt tokens from the prefix cache, %d free now",
                    report.req_id,
                    report.compression_ratio,
                    report.global_eviction_ratio,
                    freed,
                    report.blocks_freed,
                    report.num_cached_tokens,
                    pool.get_num_free_blocks(),
                )
            state.stats.maybe_log(pool.get_num_free_blocks())
        return result

    return wrapper


def _schedule(original):
    from vllm.v1.request import RequestStatus

    def wrapper(self, *args, **kwargs):
        state = _ENGINES.get(self.kv_cache_manager.block_pool)
        if state is None or state.config is None:
            config = server_config(self.vllm_config.additional_config)
            if config is None:  # the engine runs without the flag
                return original(self, *args, **kwargs)
            state = engine_compaction(self.kv_cache_manager.block_pool)
            state.config = config
        output = original(self, *args, **kwargs)
        if not state.outgoing:
            return output
        # A request preempted by this very schedule gave its fresh blocks back: its copy must not run.
        compactions = [
            c for c in state.outgoing
            if (request := self.requests.get(c.req_id)) is not None and request.status == RequestStatus.RUNNING
        ]
        state.outgoing.clear()
        if not compactions:
            return output
        return RCStatSchedulerOutput(**{f.name: getattr(output, f.name) for f in fields(output)},
                                     rcstat_compactions=compactions)

    return wrapper


def _cache_blocks(original):
    def wrapper(self, request, *args, **kwargs):
        state = _ENGINES.get(self.block_pool)
        if state is not None and request.request_id in state.compacted:
            return None  # its blocks hold head pages, not the tokens their position's hash names
        return original(self, request, *args, **kwargs)

    return wrapper


def _pop_blocks_for_free(original):
    def wrapper(self, request_id, *args, **kwargs):
        state = _ENGINES.get(self.block_pool)
        if state is not None:
            state.forget(request_id)
        return original(self, request_id, *args, **kwargs)

    return wrapper


def _get_computed_blocks(original):
    """Prefix-cache lookups: stop a hit before the observation window of a request that will be compressed, and
    check that no hit returns a compacted block."""

    def wrapper(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        state = _ENGINES.get(self.block_pool)
        if state is None or state.config is None:
            return result
        blocks, num_hit = result[0], result[1]
        if num_hit and len(blocks.blocks) == 1:
            block_size = self.coordinator.single_type_managers[0].block_size
            limit = max_cached_prompt_tokens(
                request.num_tokens, request.sampling_params and request.sampling_params.extra_args, state.config,
                block_size,
            )
            if limit is not None and num_hit > limit:
                blocks = type(blocks)((list(blocks.blocks[0][: limit // block_size]),))
                result = (blocks, limit, *result[2:])
        if state.compacted_blocks:
            hits = {block_id for group in result[0].get_block_ids() for block_id in group}
            if hits & state.compacted_blocks:
                raise RuntimeError(
                    f"rcstat: a prefix-cache hit of request {request.request_id} returned compacted blocks "
                    f"{sorted(hits & state.compacted_blocks)}: their KV is another request's head pages"
                )
        return result

    return wrapper


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    wrap_method(Scheduler, "update_from_output", _update_from_output)
    wrap_method(Scheduler, "schedule", _schedule)
    wrap_method(FullAttentionManager, "cache_blocks", _cache_blocks)
    wrap_method(SingleTypeKVCacheManager, "pop_blocks_for_free", _pop_blocks_for_free)
    wrap_method(KVCacheManager, "get_computed_blocks", _get_computed_blocks)
