"""Aggregate compression statistics on the scheduler side: logged periodically at INFO, exported to Prometheus.

Per request the worker logs at DEBUG (ratio, kept counts, predicted blocks freed) and the scheduler at DEBUG
(blocks actually returned to the pool). These running totals give operators the picture at a glance.

Prometheus (vLLM's naming: ``<namespace>:<name>``, counters with ``_total``)::

    rcstat:requests_compressed_total      prompt compactions whose copy ran (eagerly, or lazily under pressure; a
                                          request preempted and compressed again when recomputed counts once per copy)
    rcstat:requests_uncompressed_total    requests the plugin ran uncompressed (method none, too short, ...)
    rcstat:requests_planned_total         lazy eviction: plans parked until the scheduler needs their blocks
    rcstat:requests_never_compacted_total lazy eviction: parked plans whose request left before memory was short
                                          (it kept its full cache: neither compressed nor skipped)
    rcstat:kv_blocks_freed_total          KV blocks returned to vLLM's pool by compactions whose copy ran
    rcstat:kv_blocks_freed_per_compaction histogram of the blocks one compaction (prompt or decode-time) returned
    rcstat:compression_ratio              histogram of evicted / prompt KV entries per compressed request (compacted
                                          ones only: from its plan, or, for a plan scored at its copy under lazy
                                          eviction, from the worker's step output after the copy)
    rcstat:global_eviction_ratio          histogram of the share of prompt tokens evicted from every head of
                                          every layer per compressed request (the quality cliff's early warning)
    rcstat:head_consensus                 histogram of the mean pairwise overlap of a layer's heads' kept sets per
                                          compressed request (1: every head keeps the same tokens, rigid routing)
    rcstat:decode_compactions_total       decode-time compactions (``decode_budget``) whose copy ran
    rcstat:decode_compactions_skipped_total decode-time compactions planned but not run (no free blocks for the copy)
    rcstat:decode_tokens_evicted_total    generated KV entries (layer x KV head x token) they evicted
    rcstat:compaction_seconds{kind}       histogram of the worker's host time for one copy (kind: prompt, decode; and
                                          score_ahead: a parked plan's layers scored, or its selection, before its
                                          copy); its
                                          _count is the compactions the worker ran, by kind (equal to
                                          requests_compressed_total, decode_compactions_total). A plan scored at its
                                          copy (lazy eviction: the bare flag) is scored and selected there too: the
                                          time includes its scoring. On CUDA it times the kernel launches, not the
                                          kernels (the copy is not synchronised)
    rcstat:step_compaction_seconds        histogram of the worker's time compacting in one step (steps with a copy)
    rcstat:compactions_per_step           histogram of the copies one step ran (1: spread out; more: bunched)
    rcstat:worker_requests                gauge: requests in the worker's table (0 when the server is idle: else a leak)
    rcstat:worker_results                 gauge: requests' results the worker keeps for the Python API (at most
                                          MAX_RESULTS, rcstat_vllm/worker/results.py; packed, ~1 KB each)
    rcstat:scheduler_requests             gauge: requests the scheduler side tracks (running, parked plans, copies in
                                          flight; 0 when the server is idle: else a leak)

Each pass of a request is counted once in one of: compressed (its prompt's copy ran), uncompressed (skipped, with a
reason), or, under lazy eviction, planned and then either compressed when memory ran short or never compacted (its
request left first, or was preempted before its copy was sent). The scheduler grants a compaction (fresh blocks
swapped in) a step before the worker copies; it counts the compaction when the worker reports the copy
(:meth:`CompressionStats.observe_step`, by request id), so a grant whose request vLLM preempts first is never
counted as compressed. The times come from
the worker (rank 0) with the step's output (``StepCompactions``), host time: synchronous copies on CPU, the launches on
CUDA.

The scheduler runs in vLLM's engine-core process; ``vllm serve``'s ``/metrics`` (API-server process) shows these
only in prometheus_client's multiprocess mode, which ``rcstat-vllm serve`` turns on
(``PROMETHEUS_MULTIPROC_DIR``, as vLLM itself does for several API servers).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from rcstat_vllm.log import logger
from rcstat_vllm.reports import CompressionReport, StepCompactions

LOG_INTERVAL_S = 10.0


RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class PrometheusMetrics:
    requests_compressed: Any
    requests_uncompressed: Any
    requests_planned: Any
    requests_never_compacted: Any
    kv_blocks_freed: Any
    kv_blocks_freed_per_compaction: Any
    compression_ratio: Any
    global_eviction_ratio: Any
    head_consensus: Any
    decode_compactions: Any
    decode_compactions_skipped: Any
    decode_tokens_evicted: Any
    compaction_seconds: Any
    step_compaction_seconds: Any
    compactions_per_step: Any
    worker_requests: Any
    worker_results: Any
    scheduler_requests: Any


@functools.cache
def prometheus_metrics() -> PrometheusMetrics | None:
    """The plugin's metrics in prometheus_client's registry of this process, created once (the registry is
    process-wide and rejects a second registration of a name); None without prometheus_client."""
    try:
        from prometheus_client import Counter, Gauge, Histogram
    except ImportError:
        return None
    return PrometheusMetrics(
        Counter("rcstat:requests_compressed", "Requests whose prompt KV cache rcstat compressed."),
        Counter("rcstat:requests_uncompressed", "Requests rcstat ran uncompressed (method none, too short, ...)."),
        Counter("rcstat:requests_planned", "Lazy eviction: compression plans parked until memory is short."),
        Counter(
            "rcstat:requests_never_compacted",
            "Lazy eviction: parked plans whose request left before memory was short (full cache kept).",
        ),
        Counter("rcstat:kv_blocks_freed", "KV cache blocks rcstat returned to vLLM's block pool."),
        Histogram(
            "rcstat:kv_blocks_freed_per_compaction",
            "KV cache blocks one rcstat compaction returned.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        ),
        Histogram(
            "rcstat:compression_ratio", "Evicted / prompt KV entries per compressed request.", buckets=RATIO_BUCKETS
        ),
        Histogram(
            "rcstat:global_eviction_ratio",
            "Share of prompt tokens evicted from every KV head of every layer, per compressed request.",
            buckets=(0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
        ),
        Histogram(
            "rcstat:head_consensus",
            "Mean pairwise overlap of a layer's KV heads' kept token sets, per compressed request (1: all alike).",
            buckets=RATIO_BUCKETS,
        ),
        Counter("rcstat:decode_compactions", "Decode-time compactions of generated KV that rcstat ran."),
        Counter("rcstat:decode_compactions_skipped", "Decode-time compactions planned but not run (no free blocks)."),
        Counter(
            "rcstat:decode_tokens_evicted",
            "Generated KV entries (layer x KV head x token) decode-time compactions evicted.",
        ),
        Histogram(
            "rcstat:compaction_seconds",
            "Worker time of one rcstat KV copy (compaction), by kind.",
            ["kind"],
            buckets=SECONDS_BUCKETS,
        ),
        Histogram(
            "rcstat:step_compaction_seconds",
            "Worker time rcstat spent compacting in one step (steps with at least one compaction).",
            buckets=SECONDS_BUCKETS,
        ),
        Histogram(
            "rcstat:compactions_per_step",
            "rcstat compactions one step ran (steps with at least one).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
        ),
        Gauge(
            "rcstat:worker_requests",
            "Requests in the rcstat worker's table (rank 0; 0 when idle).",
            multiprocess_mode="livemostrecent",
        ),
        Gauge(
            "rcstat:worker_results",
            "Requests' results the rcstat worker keeps for the Python API (rank 0, bounded).",
            multiprocess_mode="livemostrecent",
        ),
        Gauge(
            "rcstat:scheduler_requests",
            "Requests rcstat's scheduler side tracks (0 when idle).",
            multiprocess_mode="livemostrecent",
        ),
    )


@dataclass
class CompressionStats:
    requests_compressed: int = 0
    requests_skipped: int = 0
    #: lazy eviction: plans parked, and parked plans whose request left uncompacted (neither compressed nor skipped)
    requests_planned: int = 0
    requests_never_compacted: int = 0
    blocks_freed: int = 0
    #: compressed requests whose ratio is known: from the plan, or from the worker after the copy (scored there)
    ratio_count: int = 0
    ratio_sum: float = 0.0
    global_eviction_sum: float = 0.0
    head_consensus_sum: float = 0.0
    #: prompt tokens of compressed requests served from the prefix cache
    cached_tokens: int = 0
    #: decode-time compactions run, skipped (no free blocks for the copy), and generated entries evicted
    decode_compactions: int = 0
    decode_skipped: int = 0
    decode_tokens_evicted: int = 0
    #: the worker's copies (by kind), the steps that ran any, their total and the longest step's time (seconds)
    prompt_copies: int = 0
    decode_copies: int = 0
    compaction_steps: int = 0
    compaction_seconds: float = 0.0
    max_step_compaction_seconds: float = 0.0
    #: requests in the worker's table, as last sent
    worker_requests: int = 0
    #: results the worker keeps, as last sent
    worker_results: int = 0
    #: requests the scheduler side tracks, as last set
    scheduler_requests: int = 0
    _last_log: float = field(default_factory=time.monotonic)
    _dirty: bool = False

    prometheus: PrometheusMetrics | None = field(default_factory=prometheus_metrics)

    def observe(self, report: CompressionReport, blocks_freed: int) -> None:
        """A prompt's compaction ran (``blocks_freed`` returned to the pool), or the request runs uncompressed."""
        if report.skipped_reason is not None:
            self.requests_skipped += 1
        else:
            self.requests_compressed += 1
            self.cached_tokens += report.num_cached_tokens
            if report.kept:  # (a deferred plan is scored at the copy: its ratio is not known here)
                self.ratio_count += 1
                self.ratio_sum += report.compression_ratio
                self.global_eviction_sum += report.global_eviction_ratio
                self.head_consensus_sum += report.head_consensus
        self.blocks_freed += blocks_freed
        self._dirty = True
        if self.prometheus is not None:
            if report.skipped_reason is not None:
                self.prometheus.requests_uncompressed.inc()
            else:
                self.prometheus.requests_compressed.inc()
                self._count_freed(blocks_freed)
                if report.kept:
                    self.prometheus.compression_ratio.observe(report.compression_ratio)
                    self.prometheus.global_eviction_ratio.observe(report.global_eviction_ratio)
                    self.prometheus.head_consensus.observe(report.head_consensus)

    def observe_planned(self) -> None:
        """Lazy eviction parked a plan."""
        self._count_lazy("requests_planned")

    def observe_never_compacted(self) -> None:
        """A parked plan's request left (finished, aborted or preempted) before memory was short."""
        self._count_lazy("requests_never_compacted")

    def _count_lazy(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)
        self._dirty = True
        if self.prometheus is not None:
            getattr(self.prometheus, name).inc()

    def _count_freed(self, blocks_freed: int) -> None:
        # Negative when the request's prompt blocks stay held by other running requests that share them (its fresh
        # blocks are then extra until those requests finish): a counter only counts gains.
        assert self.prometheus is not None  # (called when it is there)
        self.prometheus.kv_blocks_freed.inc(max(blocks_freed, 0))
        self.prometheus.kv_blocks_freed_per_compaction.observe(max(blocks_freed, 0))

    def observe_decode(self, report: CompressionReport, blocks_freed: int, ran: bool) -> None:
        """A decode-time compaction planned (``ran``: its blocks were swapped in) or skipped."""
        if not ran:
            self.decode_skipped += 1
            self._dirty = True
            if self.prometheus is not None:
                self.prometheus.decode_compactions_skipped.inc()
            return
        self.decode_compactions += 1
        self.decode_tokens_evicted += report.decode_tokens_evicted
        self.blocks_freed += blocks_freed
        self._dirty = True
        if self.prometheus is not None:
            self.prometheus.decode_compactions.inc()
            self.prometheus.decode_tokens_evicted.inc(report.decode_tokens_evicted)
            self._count_freed(blocks_freed)

    def observe_tracked(self, scheduler_requests: int) -> None:
        """The scheduler side's request table size, once per schedule (set when it changed)."""
        if scheduler_requests != self.scheduler_requests:
            self.scheduler_requests = scheduler_requests
            if self.prometheus is not None:
                self.prometheus.scheduler_requests.set(scheduler_requests)

    def observe_step(self, step: StepCompactions) -> None:
        """The copies the worker ran in one step, their time, and the worker's table size when it changed."""
        if step.worker_requests is not None:
            self.worker_requests = step.worker_requests
            if self.prometheus is not None:
                self.prometheus.worker_requests.set(step.worker_requests)
        if step.worker_results is not None:
            self.worker_results = step.worker_results
            if self.prometheus is not None:
                self.prometheus.worker_results.set(step.worker_results)
        if not step.copies:
            return
        for ratio, global_eviction, consensus in step.scored_at_copy:
            self.ratio_count += 1
            self.ratio_sum += ratio
            self.global_eviction_sum += global_eviction
            self.head_consensus_sum += consensus
            if self.prometheus is not None:
                self.prometheus.compression_ratio.observe(ratio)
                self.prometheus.global_eviction_ratio.observe(global_eviction)
                self.prometheus.head_consensus.observe(consensus)
        seconds = step.seconds
        self.prompt_copies += step.count("prompt")
        self.decode_copies += step.count("decode")
        self.compaction_steps += 1
        self.compaction_seconds += seconds
        self.max_step_compaction_seconds = max(self.max_step_compaction_seconds, seconds)
        self._dirty = True
        if self.prometheus is not None:
            for copy in step.copies:
                self.prometheus.compaction_seconds.labels(kind=copy.kind).observe(copy.seconds)
            self.prometheus.step_compaction_seconds.observe(seconds)
            self.prometheus.compactions_per_step.observe(step.count("prompt") + step.count("decode"))

    @property
    def mean_ratio(self) -> float:
        """Over the compressed requests whose ratio is known here."""
        return self.ratio_sum / self.ratio_count if self.ratio_count else 0.0

    def maybe_log(self, free_blocks: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self._dirty or (not force and now - self._last_log < LOG_INTERVAL_S):
            return
        logger.info(
            "rcstat: %d requests compressed (mean compression ratio %.3f, mean global eviction ratio %.3f, mean head "
            "consensus %.3f over the %d whose ratio is known, %d of their prompt tokens from the prefix cache), %d run "
            "uncompressed%s; %d KV "
            "blocks freed in total; %d blocks free now%s%s",
            self.requests_compressed,
            self.mean_ratio,
            self.global_eviction_sum / self.ratio_count if self.ratio_count else 0.0,
            self.head_consensus_sum / self.ratio_count if self.ratio_count else 0.0,
            self.ratio_count,
            self.cached_tokens,
            self.requests_skipped,
            f"; lazy eviction: {self.requests_planned} plans parked, {self.requests_never_compacted} left with their "
            "full cache"
            if self.requests_planned
            else "",
            self.blocks_freed,
            free_blocks,
            f"; {self.decode_compactions} decode-time compactions ({self.decode_tokens_evicted} generated entries "
            f"evicted, {self.decode_skipped} skipped for want of free blocks)"
            if self.decode_compactions or self.decode_skipped
            else "",
            f"; worker copies: {self.prompt_copies} prompt, {self.decode_copies} decode in {self.compaction_steps} "
            f"steps, {self.compaction_seconds * 1e3:.1f} ms in all, "
            f"longest step {self.max_step_compaction_seconds * 1e3:.1f} ms"
            if self.compaction_steps
            else "",
        )
        self._last_log, self._dirty = now, False
