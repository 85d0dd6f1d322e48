"""The scheduler-side totals feed Prometheus counters named the way vLLM names its own (``rcstat:...``)."""

import pytest

from rcstat_vllm.engine.metrics import CompressionStats
from rcstat_vllm.reports import CompressionReport

prometheus_client = pytest.importorskip("prometheus_client")


def _value(name: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name) or 0.0


def test_observed_reports_move_the_prometheus_counters():
    names = ("rcstat:requests_compressed_total", "rcstat:requests_uncompressed_total",
             "rcstat:kv_blocks_freed_total", "rcstat:compression_ratio_count", "rcstat:compression_ratio_sum",
             "rcstat:global_eviction_ratio_count", "rcstat:global_eviction_ratio_sum")
    before = {name: _value(name) for name in names}
    stats = CompressionStats()
    compressed = CompressionReport("a", 640, "rc", keep_blocks=6, kept=[[160, 320]], block_size=32,
                                   global_eviction_ratio=0.25)
    skipped = CompressionReport("b", 40, "rc", keep_blocks=2, kept=[[40, 40]], skipped_reason="too short",
                                block_size=32)
    stats.observe(compressed, blocks_freed=14)
    stats.observe(skipped, blocks_freed=0)
    delta = {name: _value(name) - before[name] for name in names}
    assert delta == {
        "rcstat:requests_compressed_total": 1.0,
        "rcstat:requests_uncompressed_total": 1.0,
        "rcstat:kv_blocks_freed_total": 14.0,
        "rcstat:compression_ratio_count": 1.0,
        "rcstat:compression_ratio_sum": pytest.approx(1 - 480 / 1280),
        "rcstat:global_eviction_ratio_count": 1.0,
        "rcstat:global_eviction_ratio_sum": pytest.approx(0.25),
    }
    assert stats.requests_compressed == 1 and stats.requests_skipped == 1 and stats.blocks_freed == 14
    # A second stats object (a second scheduler in the process) shares the registered metrics.
    CompressionStats().observe(compressed, blocks_freed=1)
    assert _value("rcstat:kv_blocks_freed_total") - before["rcstat:kv_blocks_freed_total"] == 15.0


def test_lazy_plans_and_compactions_have_counters_of_their_own():
    names = ("rcstat:requests_planned_total", "rcstat:requests_never_compacted_total",
             "rcstat:requests_compressed_total", "rcstat:compression_ratio_count",
             "rcstat:kv_blocks_freed_per_compaction_count", "rcstat:kv_blocks_freed_per_compaction_sum")
    before = {name: _value(name) for name in names}
    stats = CompressionStats()
    stats.observe_planned()
    stats.observe_planned()
    stats.observe_never_compacted()
    deferred = CompressionReport("a", 640, "rc", keep_blocks=6, block_size=32, lazy=True)  # scored at its copy
    stats.observe(deferred, blocks_freed=14)
    delta = {name: _value(name) - before[name] for name in names}
    assert delta == {
        "rcstat:requests_planned_total": 2.0,
        "rcstat:requests_never_compacted_total": 1.0,
        "rcstat:requests_compressed_total": 1.0,
        "rcstat:compression_ratio_count": 0.0,  # its ratio is not known on the scheduler side: not observed as 0
        "rcstat:kv_blocks_freed_per_compaction_count": 1.0,
        "rcstat:kv_blocks_freed_per_compaction_sum": 14.0,
    }
