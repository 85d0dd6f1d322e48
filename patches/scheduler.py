"""Scheduler side of the worker-to-scheduler report: return the blocks compaction freed to the pool.

After a request's last prefill chunk the worker compacts each head's kept KV into the request's first
``keep_blocks`` blocks and reports that in the ``ModelRunnerOutput``. Here, before vLLM processes that
output (so before it appends any block for decode), the request's other prompt blocks go back to the
``BlockPool`` and are replaced by the null block in the request's block list, exactly as vLLM's own
sliding-window manager does: the list keeps its length, so later allocation by position is unchanged.
"""

from __future__ import annotations

import weakref

from rcstat_vllm.log import logger
from rcstat_vllm.metrics import CompressionStats
from rcstat_vllm.reports import CompressionReport

from ._contract import Contract, wrap_method
from .model_runner import RCStatModelRunnerOutput

CONTRACTS = (
    Contract(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    Contract(
        "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager._remove_blocks_in_range",
        ("self", "request_id", "first_block", "last_block"),
    ),
    Contract("vllm.v1.core.block_pool:BlockPool.get_num_free_blocks", ("self",)),
)


#: per scheduler, the totals it logs and exports (kept beside vLLM's objects, not on them)
_STATS: "weakref.WeakKeyDictionary[object, CompressionStats]" = weakref.WeakKeyDictionary()


def scheduler_stats(scheduler) -> CompressionStats:
    stats = _STATS.get(scheduler)
    if stats is None:
        stats = _STATS[scheduler] = CompressionStats()
    return stats


def release_blocks(kv_cache_manager, report: CompressionReport) -> int:
    """Free the blocks ``[keep_blocks, prompt_blocks)`` of the request; returns how many were freed."""
    pool = kv_cache_manager.block_pool
    before = pool.get_num_free_blocks()
    for manager in kv_cache_manager.coordinator.single_type_managers:
        if report.req_id in manager.req_to_blocks:
            manager._remove_blocks_in_range(report.req_id, report.keep_blocks, report.prompt_blocks)
    return pool.get_num_free_blocks() - before


def _update_from_output(original):
    def wrapper(self, scheduler_output, model_runner_output, *args, **kwargs):
        reports = model_runner_output.rcstat_reports if isinstance(model_runner_output, RCStatModelRunnerOutput) else None
        if reports:
            stats = scheduler_stats(self)
            pool = self.kv_cache_manager.block_pool
            for report in reports:
                freed = release_blocks(self.kv_cache_manager, report) if report.blocks_freed else 0
                stats.observe(report, freed)
                logger.debug(
                    "rcstat: request %s: compression ratio %.3f, global eviction ratio %.3f, %d blocks freed "
                    "(predicted %d), %d free now",
                    report.req_id,
                    report.compression_ratio,
                    report.global_eviction_ratio,
                    freed,
                    report.blocks_freed,
                    pool.get_num_free_blocks(),
                )
            stats.maybe_log(pool.get_num_free_blocks())
        return original(self, scheduler_output, model_runner_output, *args, **kwargs)

    return wrapper


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    wrap_method(Scheduler, "update_from_output", _update_from_output)
