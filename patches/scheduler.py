"""Scheduler hooks: hand vLLM's scheduler and KV cache managers to the block exchange
(:mod:`rcstat_vllm.engine.block_exchange`, where the state, the block swap and the prefix-cache invariants live).

- ``Scheduler.__init__``: with the flag, the engine's state (:mod:`rcstat_vllm.owners` finds it from the block pool).
- ``Scheduler.update_from_output``: apply the worker's compaction reports (fresh blocks in, prompt blocks out).
- ``Scheduler._update_request_as_session``: a streaming-input session's next chunk makes a parked plan stale.
- ``Scheduler.schedule``: under lazy eviction, first compact parked requests if the blocks it is about to want (now,
  or within the decode-time lead) exceed the free ones (only before vLLM's schedule: see :func:`relieve_pressure`); then
  send the compactions in the scheduler output (:class:`RCStatSchedulerOutput`), with the
  requests whose decode-time compaction the workers bring forward (:mod:`rcstat_vllm.engine.decode_pressure`).
- ``FullAttentionManager.cache_blocks``: a compacted request's blocks never become prefix-cache entries.
- ``SingleTypeKVCacheManager.pop_blocks_for_free``: forget the request (its record) when vLLM frees its blocks.
- ``KVCacheManager.get_computed_blocks``: clip a hit before the observation window; no hit returns a compacted block.

Adapters only: they read vLLM's objects into the pressure policy's snapshot (:mod:`rcstat_vllm.engine.pressure_policy`,
where the decisions are made) and hand its decisions and vLLM's block lists to the engine's state (its request
table: :mod:`rcstat_vllm.engine.requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllm.v1.core.sched.output import SchedulerOutput

from rcstat_vllm.capabilities import choose_compressed_group
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.engine import pressure_policy
from rcstat_vllm.engine.block_exchange import EngineCompaction
from rcstat_vllm.engine.metrics import CompressionStats
from rcstat_vllm.engine.pressure_policy import RunningRequest
from rcstat_vllm.engine.requests import Phase
from rcstat_vllm.log import logger
from rcstat_vllm.owners import engine_owner, start_engine_owner
from rcstat_vllm.reports import Compaction, ScoreAhead
from rcstat_vllm.vllm_private.internals import kv_cache_groups

from ._contract import Contract, wrap_method
from .model_runner import RCStatModelRunnerOutput

CONTRACTS = (
    Contract(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    Contract("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self",)),
    Contract("vllm.v1.core.sched.scheduler:Scheduler.__init__", ("self", "vllm_config", "kv_cache_config")),
    Contract("vllm.v1.core.sched.scheduler:Scheduler._update_request_as_session", ("self", "session", "update")),
    Contract(
        "vllm.v1.core.sched.scheduler:Scheduler",
        attrs=("requests", "kv_cache_manager", "vllm_config", "running", "waiting"),
    ),
    Contract("vllm.v1.core.sched.request_queue:RequestQueue.peek_request", ("self",)),
    Contract(
        "vllm.v1.request:Request",
        attrs=("request_id", "status", "num_tokens", "num_prompt_tokens", "num_computed_tokens", "sampling_params"),
    ),
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
    Contract(
        "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
        attrs=("req_to_blocks", "block_pool", "block_size"),
    ),
    Contract("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks", ("self", "request")),
    Contract("vllm.v1.core.kv_cache_manager:KVCacheManager", attrs=("block_pool", "coordinator", "kv_cache_config")),
    Contract("vllm.v1.core.kv_cache_manager:KVCacheBlocks.get_block_ids", ("self",)),
    Contract("vllm.v1.core.kv_cache_manager:KVCacheBlocks", attrs=("blocks",)),
    Contract("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", attrs=("single_type_managers",)),
    Contract("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks")),
    Contract("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks")),
    Contract("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",)),
    Contract("vllm.v1.core.block_pool:BlockPool", attrs=("null_block",)),
    Contract("vllm.v1.core.kv_cache_utils:KVCacheBlock", attrs=("block_id", "ref_cnt", "is_null")),
)


@dataclass
class RCStatSchedulerOutput(SchedulerOutput):
    """vLLM's scheduler output plus the compactions the workers run before this step's forward."""

    rcstat_compactions: list[Compaction] = field(default_factory=list)
    #: requests whose decode-time compaction the workers bring forward (the pool is about to run short)
    rcstat_decode_soon: tuple[str, ...] = ()
    #: parked plans (lazy eviction) the workers should score ahead of their copy, a share of layers per step
    rcstat_score_ahead: ScoreAhead = field(default_factory=ScoreAhead)


def scheduler_stats(scheduler) -> CompressionStats | None:
    """The engine's compression counters (None: the engine runs without the flag)."""
    state = engine_owner(scheduler.kv_cache_manager.block_pool)
    return None if state is None else state.stats


def compressed_group(kv_cache_manager) -> int | None:
    """The KV cache group the plugin compresses: the only one, or a hybrid model's full-attention group, chosen from
    the same ``KVCacheConfig`` the workers choose from (None: none, the engine serves uncompressed)."""
    return choose_compressed_group(kv_cache_groups(kv_cache_manager.kv_cache_config)).index


def compressed_manager(kv_cache_manager):
    """The KV cache manager of the compressed group (its block lists are the ones compaction swaps)."""
    state = engine_owner(kv_cache_manager.block_pool)
    group = state.group if state is not None and state.group is not None else 0
    return kv_cache_manager.coordinator.single_type_managers[group]


def request_blocks(kv_cache_manager, req_id: str) -> list:
    """The request's block list in the compressed group (other groups, a hybrid model's sliding-window layers, stay
    as vLLM manages them)."""
    return compressed_manager(kv_cache_manager).req_to_blocks[req_id]


def is_running(scheduler, req_id: str) -> bool:
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(req_id)
    return request is not None and request.status == RequestStatus.RUNNING


def running_request_blocks(scheduler, req_id: str) -> list | None:
    """The block list of a request still running, None when it finished (vLLM freed its blocks)."""
    return request_blocks(scheduler.kv_cache_manager, req_id) if is_running(scheduler, req_id) else None


def running_request_tokens(scheduler, req_id: str) -> tuple[list, int]:
    """A running request's block list and the tokens in its cache (lazy eviction compacts them)."""
    return request_blocks(scheduler.kv_cache_manager, req_id), scheduler.requests[req_id].num_computed_tokens


def block_size(scheduler) -> int:
    return compressed_manager(scheduler.kv_cache_manager).block_size


def other_group_managers(kv_cache_manager) -> list:
    """The KV cache managers of the groups the plugin does not compress (a hybrid model's sliding-window layers):
    they allocate from the same block pool."""
    managers = kv_cache_manager.coordinator.single_type_managers
    compressed = compressed_manager(kv_cache_manager)
    return [manager for manager in managers if manager is not compressed]


def running_snapshot(scheduler, state: EngineCompaction | None = None) -> tuple[RunningRequest, ...]:
    """vLLM's running requests as the pressure policy reads them (with their records' decode-time data), their block
    lists in every KV cache group."""
    manager = scheduler.kv_cache_manager
    others = other_group_managers(manager)
    held = [
        (
            r.request_id,
            r.num_tokens,
            len(request_blocks(manager, r.request_id)),
            tuple((m.block_size, len(m.req_to_blocks.get(r.request_id, ()))) for m in others),
        )
        for r in scheduler.running
    ]
    if state is None:
        return tuple(RunningRequest(*request[:3], other_groups=request[3]) for request in held)
    return tuple(state.decode_pressure.running(*request) for request in held)


def other_block_sizes(scheduler) -> tuple[int, ...]:
    return tuple(m.block_size for m in other_group_managers(scheduler.kv_cache_manager))


def first_waiting_tokens(scheduler) -> int:
    return scheduler.waiting.peek_request().num_tokens if len(scheduler.waiting) else 0


def longest_running_prompt(scheduler) -> int:
    return max((r.num_prompt_tokens for r in scheduler.running), default=0)


def blocks_wanted(scheduler) -> tuple[int, str]:
    """The blocks the coming schedule is about to take (an upper bound), and what wants them
    (:func:`~rcstat_vllm.engine.pressure_policy.blocks_wanted`)."""
    return pressure_policy.blocks_wanted(
        running_snapshot(scheduler),
        first_waiting_tokens(scheduler),
        block_size(scheduler),
        other_block_sizes(scheduler),
    )


def decode_config(state: EngineCompaction, request) -> RCStatConfig | None:
    """The request's config when its generated KV is compressed (``decode_budget``), else None (also when its
    overrides are invalid: validated at admission; the worker runs such a request uncompressed)."""
    extra_args = request.sampling_params and request.sampling_params.extra_args
    settings = state.settings_of(request.request_id, extra_args)
    return settings.config if settings.invalid is None and settings.config.decode_compression else None


def relieve_pressure(scheduler, state: EngineCompaction) -> ScoreAhead:
    """Lazy eviction, before a schedule: compact parked requests when the blocks the schedule is about to want, or
    those the running requests will want within the decode-time lead, exceed the free ones
    (:func:`~rcstat_vllm.engine.pressure_policy.relief`). Returns the parked plans the workers should score ahead:
    those it would compact if the running requests were ``SCORE_AHEAD_STEPS`` tokens further, or, when none would,
    if a prompt like the longest running one arrived (:func:`~rcstat_vllm.engine.pressure_policy.score_ahead_shortfall`,
    :func:`~rcstat_vllm.engine.pressure_policy.to_score_ahead`).

    Only here, never after vLLM's schedule: until then a running request's ``num_computed_tokens`` counts only tokens
    whose KV is written. After it, it counts the step's in-flight token too, and ``allocate_slots`` has already made
    the block that token fills a prefix-cache entry: compacting then would hand that block back with its hash while
    the token's KV goes to head pages (a cache entry over a slot never written)."""
    pool = scheduler.kv_cache_manager.block_pool
    # (configs as the last schedule's check merged them: every request running now was running then)
    running = running_snapshot(scheduler, state)
    snapshot = pressure_policy.PoolSnapshot(
        pool.get_num_free_blocks(),
        block_size(scheduler),
        running,
        first_waiting_tokens(scheduler),
        other_block_sizes=other_block_sizes(scheduler),
    )
    decode = None
    if any(r.config is not None for r in running):
        short, _, reason = state.decode_pressure.shortfall(list(running), snapshot.free_blocks, snapshot.block_size)
        decode = short, reason
    short, reason = pressure_policy.shortfall(snapshot, decode)
    short_ahead, steps = pressure_policy.score_ahead_shortfall(snapshot, decode, longest_running_prompt(scheduler))
    if max(short, short_ahead) <= 0:  # (most steps: the parked plans' gains, read from their block lists, not needed)
        return ScoreAhead()
    parked = state.parked(
        lambda req_id: running_request_tokens(scheduler, req_id) if is_running(scheduler, req_id) else None
    )
    relief = pressure_policy.cover(short, reason, parked, pressure_policy.urgent_shortfall(snapshot, decode))
    if relief.scoring:
        logger.debug(
            "rcstat: lazy relief (%s): the waiting prompt waits for %d parked plans being scored ahead: %s",
            relief.reason,
            len(relief.scoring),
            ", ".join(relief.scoring),
        )
    if relief.compact:
        state.relieve_pressure(pool, relief, lambda req_id: running_request_tokens(scheduler, req_id))
    # (a ready plan has nothing left to score: naming it would only send the workers an output each step)
    to_score = {record.req_id for record in state.requests.in_phase(Phase.PLANNED)} - {
        p.req_id for p in parked if p.ready
    }
    ahead = pressure_policy.to_score_ahead(short_ahead, parked, relief.compact)
    return ScoreAhead(tuple(req_id for req_id in ahead if req_id in to_score), steps)


def bring_decode_compactions_forward(scheduler, state: EngineCompaction) -> list[str]:
    """After a schedule: the running requests whose decode-time compaction the workers should bring forward, the
    pool being about to run short (``rcstat_vllm/engine/decode_pressure.py``)."""
    pressure = state.decode_pressure
    watched = [
        pressure.watch(r.request_id, r.num_tokens, lambda r=r: decode_config(state, r)) is not None
        for r in scheduler.running
    ]  # (resolved once per request: one lookup per request, step)
    if not any(watched):
        return []
    running = list(running_snapshot(scheduler, state))
    size = block_size(scheduler)
    short, lead, reason = pressure.shortfall(running, scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), size)
    chosen = pressure.requests_to_hurry(running, short, lead, size)
    if chosen:
        logger.debug(
            "rcstat: decode-time compaction brought forward (%d requests; %s): %s",
            len(chosen),
            reason,
            ", ".join(chosen),
        )
    return chosen


def _init(original):
    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = server_config(self.vllm_config.additional_config)
        if config is not None:  # (without the flag, no state: every hook passes through)
            start_engine_owner(
                self.kv_cache_manager.block_pool,
                config,
                compressed_group(self.kv_cache_manager),
            )

    return wrapper


def _update_from_output(original):
    def wrapper(self, scheduler_output, model_runner_output, *args, **kwargs):
        result = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        if not isinstance(model_runner_output, RCStatModelRunnerOutput):
            return result
        pool = self.kv_cache_manager.block_pool
        state = engine_owner(pool)
        assert state is not None, "rcstat: compaction reports reached a scheduler started without the flag"
        if model_runner_output.rcstat_step is not None:
            state.observe_step(model_runner_output.rcstat_step)
        if model_runner_output.rcstat_reports:
            state.apply_reports(
                pool,
                model_runner_output.rcstat_reports,
                lambda req_id: running_request_blocks(self, req_id),
                lambda req_id: self.requests[req_id].num_computed_tokens,
            )
        return result

    return wrapper


def _schedule(original):
    def wrapper(self, *args, **kwargs):
        state = engine_owner(self.kv_cache_manager.block_pool)
        if state is None or state.group is None:  # no flag, or no group compressed (the workers said why at start-up)
            return original(self, *args, **kwargs)
        ahead = relieve_pressure(self, state) if state.requests.any_in_phase(Phase.PLANNED) else ScoreAhead()
        output = original(self, *args, **kwargs)
        decode_soon = bring_decode_compactions_forward(self, state)
        compactions = state.take_outgoing(lambda req_id: is_running(self, req_id))
        score_ahead = ahead._replace(req_ids=tuple(r for r in ahead.req_ids if is_running(self, r)))  # (not preempted)
        if not compactions and not decode_soon and not score_ahead.req_ids:
            return output
        return RCStatSchedulerOutput(
            **{f.name: getattr(output, f.name) for f in fields(output)},
            rcstat_compactions=compactions,
            rcstat_decode_soon=tuple(decode_soon),
            rcstat_score_ahead=score_ahead,
        )

    return wrapper


def _update_request_as_session(original):
    def wrapper(self, session, *args, **kwargs):
        result = original(self, session, *args, **kwargs)
        state = engine_owner(self.kv_cache_manager.block_pool)
        if state is not None:
            state.continue_session(session.request_id)
        return result

    return wrapper


def _cache_blocks(original):
    def wrapper(self, request, *args, **kwargs):
        state = engine_owner(self.block_pool)
        if state is not None and not state.may_cache(request.request_id):
            return None
        return original(self, request, *args, **kwargs)

    return wrapper


def _pop_blocks_for_free(original):
    def wrapper(self, request_id, *args, **kwargs):
        state = engine_owner(self.block_pool)
        if state is not None:
            state.forget(request_id)
        return original(self, request_id, *args, **kwargs)

    return wrapper


def _get_computed_blocks(original):
    def wrapper(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        state = engine_owner(self.block_pool)
        if state is None:
            return result
        blocks, num_hit = result[0], result[1]
        if num_hit and state.group is not None:
            block_size = compressed_manager(self).block_size
            extra_args = request.sampling_params and request.sampling_params.extra_args
            limit = state.prefix_hit_limit(
                request.request_id, num_hit, request.num_prompt_tokens, extra_args, block_size
            )
            if limit is not None and len(blocks.blocks) > 1:
                # A hybrid model's sliding-window group holds only its window's blocks of the hit (null blocks
                # before): a shorter hit would end without them. vLLM finds hits valid for every group; the plugin
                # cannot, so the request recomputes its prompt.
                limit = 0
            if limit is not None:
                blocks = type(blocks)(tuple(list(group[: limit // block_size]) for group in blocks.blocks))
                result = (blocks, limit, *result[2:])
        if state.requests.compacted_blocks:
            state.check_hit(request.request_id, (i for group in result[0].get_block_ids() for i in group))
        return result

    return wrapper


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

    wrap_method(Scheduler, "__init__", _init)
    wrap_method(Scheduler, "update_from_output", _update_from_output)
    wrap_method(Scheduler, "schedule", _schedule)
    wrap_method(Scheduler, "_update_request_as_session", _update_request_as_session)
    wrap_method(FullAttentionManager, "cache_blocks", _cache_blocks)
    wrap_method(SingleTypeKVCacheManager, "pop_blocks_for_free", _pop_blocks_for_free)
    wrap_method(KVCacheManager, "get_computed_blocks", _get_computed_blocks)
