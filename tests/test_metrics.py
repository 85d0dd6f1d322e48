"""The scheduler-side totals feed Prometheus counters named the way vLLM names its own (``rcstat:...``)."""

import pytest

from rcstat_vllm.engine.metrics import CompressionStats
from rcstat_vllm.reports import CompressionReport

prometheus_client = pytest.importorskip("prometheus_client")


def _value(name: str) -> float:
    """A sample's value by its exposition name, labels included (``metric{k="v"}``); 0 before the first sample."""
    metric, _, labels = name.partition("{")
    labels = dict(kv.split("=") for kv in labels.rstrip("}").split(",")) if labels else {}
    return prometheus_client.REGISTRY.get_sample_value(metric, {k: v.strip('"') for k, v in labels.items()}) or 0.0


def test_observed_reports_move_the_prometheus_counters():
    names = (
        "rcstat:requests_compressed_total",
        "rcstat:requests_uncompressed_total",
        "rcstat:kv_blocks_freed_total",
        "rcstat:compression_ratio_count",
        "rcstat:compression_ratio_sum",
        "rcstat:global_eviction_ratio_count",
        "rcstat:global_eviction_ratio_sum",
        "rcstat:head_consensus_count",
        "rcstat:head_consensus_sum",
    )
    before = {name: _value(name) for name in names}
    stats = CompressionStats()
    compressed = CompressionReport(
        "a", 640, "rc", keep_blocks=6, kept=[[160, 320]], block_size=32, global_eviction_ratio=0.25, head_consensus=0.5
    )
    skipped = CompressionReport(
        "b", 40, "rc", keep_blocks=2, kept=[[40, 40]], skipped_reason="too short", block_size=32
    )
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
        "rcstat:head_consensus_count": 1.0,  # the skipped request has none
        "rcstat:head_consensus_sum": pytest.approx(0.5),
    }
    assert stats.requests_compressed == 1 and stats.requests_skipped == 1 and stats.blocks_freed == 14
    # A second stats object (a second scheduler in the process) shares the registered metrics.
    CompressionStats().observe(compressed, blocks_freed=1)
    assert _value("rcstat:kv_blocks_freed_total") - before["rcstat:kv_blocks_freed_total"] == 15.0


def test_lazy_plans_and_compactions_have_counters_of_their_own():
    names = (
        "rcstat:requests_planned_total",
        "rcstat:requests_never_compacted_total",
        "rcstat:requests_compressed_total",
        "rcstat:compression_ratio_count",
        "rcstat:kv_blocks_freed_per_compaction_count",
        "rcstat:kv_blocks_freed_per_compaction_sum",
    )
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


def test_the_workers_copies_per_step_reach_time_and_count_histograms():
    from rcstat_vllm.reports import CopyRun, StepCompactions

    names = (
        'rcstat:compaction_seconds_count{kind="prompt"}',
        'rcstat:compaction_seconds_count{kind="decode"}',
        "rcstat:step_compaction_seconds_count",
        "rcstat:step_compaction_seconds_sum",
        "rcstat:compactions_per_step_count",
        "rcstat:compactions_per_step_sum",
        'rcstat:compactions_per_step_bucket{le="1.0"}',
        "rcstat:decode_compactions_skipped_total",
        "rcstat:compression_ratio_count",
        "rcstat:compression_ratio_sum",
        "rcstat:global_eviction_ratio_sum",
        "rcstat:head_consensus_sum",
    )

    before = {name: _value(name) for name in names}
    stats = CompressionStats()
    stats.observe_step(
        StepCompactions(
            (CopyRun("a", "prompt", 0.25), CopyRun("b", "prompt", 0.125), CopyRun("c", "decode", 0.5)),
            scored_at_copy=((0.75, 0.5, 0.375),),
        )
    )
    stats.observe_step(StepCompactions((CopyRun("c", "decode", 0.0625),)))
    stats.observe_step(StepCompactions())  # a step with no copy is not a compaction step
    stats.observe_decode(CompressionReport("d", 64, "rc", keep_blocks=2, decode=True), 0, ran=False)
    delta = {name: _value(name) - before[name] for name in names}
    # approx: the sums are differences of process-wide totals that earlier tests' engines added to (float rounding)
    assert delta == pytest.approx(
        {
            'rcstat:compaction_seconds_count{kind="prompt"}': 2.0,
            'rcstat:compaction_seconds_count{kind="decode"}': 2.0,
            "rcstat:step_compaction_seconds_count": 2.0,
            "rcstat:step_compaction_seconds_sum": 0.9375,
            "rcstat:compactions_per_step_count": 2.0,
            "rcstat:compactions_per_step_sum": 4.0,
            'rcstat:compactions_per_step_bucket{le="1.0"}': 1.0,  # one step ran one copy, the other three at once
            "rcstat:decode_compactions_skipped_total": 1.0,
            # a lazy plan's ratio, known after its copy, counted once there (its plan carried none)
            "rcstat:compression_ratio_count": 1.0,
            "rcstat:compression_ratio_sum": 0.75,
            "rcstat:global_eviction_ratio_sum": 0.5,
            "rcstat:head_consensus_sum": 0.375,
        }
    )
    assert (stats.prompt_copies, stats.decode_copies, stats.compaction_steps) == (2, 2, 2)
    assert stats.compaction_seconds == 0.9375 and stats.max_step_compaction_seconds == 0.875
    assert stats.decode_skipped == 1 and stats.decode_compactions == 0
    assert stats.ratio_count == 1 and stats.mean_ratio == 0.75
