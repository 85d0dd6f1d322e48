"""The worker's results log: each request's outcome for the Python API, and this step's reports for the scheduler.

Two audiences, two lifetimes: the scheduler reads the plans and skipped requests of one step (:meth:`pop_outgoing`,
carried back with the step's output by ``patches/model_runner.py``); the Python API (``rcstat_vllm/api.py``) reads the
outcomes of finished requests, the last :data:`MAX_RESULTS` of them.
"""

from __future__ import annotations

from collections import OrderedDict

from rcstat_vllm.log import logger
from rcstat_vllm.reports import CompressionReport

#: How many finished requests' results the worker keeps for the Python API.
MAX_RESULTS = 100_000


class ResultsLog:
    def __init__(self, max_results: int = MAX_RESULTS):
        self.max_results = max_results
        self.results: OrderedDict[str, CompressionReport] = OrderedDict()
        self._outgoing: list[CompressionReport] = []

    def record(self, report: CompressionReport) -> None:
        """A request's outcome: compressed (after the copy) or not, and why; logged. A request whose earlier pass
        ended (:meth:`end_pass`) keeps it in ``earlier_passes``: a preempted request is compressed again when it is
        recomputed, and its result says what happened on each pass."""
        earlier = self.results.pop(report.req_id, None)
        if earlier is not None and earlier.ended is not None:
            report.earlier_passes = [*earlier.earlier_passes, {**earlier.to_dict(), "earlier_passes": []}]
        elif earlier is not None:  # (the same pass reported again: the last outcome stands)
            report.earlier_passes = earlier.earlier_passes
        self.results[report.req_id] = report
        while len(self.results) > self.max_results:
            self.results.popitem(last=False)
        logger.debug(
            "rcstat: request %s (%d prompt tokens, %d from the prefix cache, %s): compression ratio %.3f, "
            "global eviction ratio %.3f, %d blocks freed%s",
            report.req_id,
            report.num_prompt_tokens,
            report.num_cached_tokens,
            report.method,
            report.compression_ratio,
            report.global_eviction_ratio,
            report.blocks_freed,
            f" (skipped: {report.skipped_reason})" if report.skipped_reason else "",
        )

    def end_pass(self, req_id: str, why: str) -> None:
        """The request's current pass ended before it finished (``why``: "preempted", "session continued"); the
        request's next outcome starts a new pass."""
        result = self.results.get(req_id)
        if result is not None and result.ended is None:
            result.ended = why

    def send(self, report: CompressionReport) -> None:
        """A report for the scheduler with this step's output (a plan to allocate for, or a skipped request)."""
        self._outgoing.append(report)

    def pop_outgoing(self) -> list[CompressionReport]:
        outgoing, self._outgoing = self._outgoing, []
        return outgoing

    def decode_compacted(self, req_id: str, compactions: int, tokens_evicted: int) -> None:
        """A decode-time compaction ran: the request's result counts it."""
        result = self.results.get(req_id)
        if result is not None:
            result.decode_compactions, result.decode_tokens_evicted = compactions, tokens_evicted

    def as_dicts(self) -> dict[str, dict]:
        return {req_id: report.to_dict() for req_id, report in self.results.items()}
