"""The worker's results log: each request's outcome for the Python API, and this step's reports for the scheduler.

Two audiences, two lifetimes: the scheduler reads the plans and skipped requests of one step (:meth:`pop_outgoing`,
carried back with the step's output by ``patches/model_runner.py``); the Python API (``rcstat_vllm/api.py``) reads the
outcomes of finished requests, the last :data:`MAX_RESULTS` of them.

A served engine keeps these outcomes for as long as it runs and the HTTP API never reads them, so the log stores
each one packed (:class:`PackedReport`): a report's per-layer lists as Python lists of ints cost ~5.7 KB a request
for SmolLM2's 30 layers x 3 KV heads, packed ~1 KB, and at most :data:`MAX_RESULTS` of them (~10 MB).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator, Mapping

import numpy as np

from rcstat_vllm.log import logger
from rcstat_vllm.reports import CompressionReport

#: How many requests' results the worker keeps for the Python API (the oldest are dropped first, with a warning).
MAX_RESULTS = 10_000


class PackedReport:
    """A :class:`CompressionReport` as the log keeps it: the report without its per-layer lists, which are held as
    numpy arrays (kept counts [layer, kv head] as int32, per-layer global eviction as float64: read back exactly)."""

    __slots__ = ("kept", "layer_global_eviction", "report")

    def __init__(self, report: CompressionReport):
        self.report = dataclasses.replace(report, kept=[], layer_global_eviction=[])
        self.kept = np.asarray(report.kept, dtype=np.int32) if report.kept else None
        self.layer_global_eviction = np.asarray(report.layer_global_eviction, dtype=np.float64)

    def unpacked(self) -> CompressionReport:
        return dataclasses.replace(
            self.report,
            kept=[] if self.kept is None else self.kept.tolist(),
            layer_global_eviction=self.layer_global_eviction.tolist(),
        )


class ResultsView(Mapping):
    """Read-only ``{request id: CompressionReport}`` over the log (each report unpacked when read)."""

    def __init__(self, packed: Mapping[str, PackedReport]):
        self._packed = packed

    def __getitem__(self, req_id: str) -> CompressionReport:
        return self._packed[req_id].unpacked()

    def __contains__(self, req_id) -> bool:
        return req_id in self._packed

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


class ResultsLog:
    def __init__(self, max_results: int = MAX_RESULTS):
        self.max_results = max_results
        self._results: OrderedDict[str, PackedReport] = OrderedDict()
        self._outgoing: list[CompressionReport] = []
        self._warned_full = False

    @property
    def results(self) -> ResultsView:
        return ResultsView(self._results)

    def __len__(self) -> int:
        return len(self._results)

    def clear(self) -> None:
        self._results.clear()

    def record(self, report: CompressionReport) -> None:
        """A request's outcome: compressed (after the copy) or not, and why; logged. A request whose earlier pass
        ended (:meth:`end_pass`) keeps it in ``earlier_passes``: a preempted request is compressed again when it is
        recomputed, and its result says what happened on each pass."""
        earlier = self._results.pop(report.req_id, None)
        stored = PackedReport(report)
        if earlier is not None and earlier.report.ended is not None:
            earlier_report = earlier.unpacked()
            stored.report.earlier_passes = [
                *earlier_report.earlier_passes,
                {**earlier_report.to_dict(), "earlier_passes": []},
            ]
        elif earlier is not None:  # (the same pass reported again: the last outcome stands)
            stored.report.earlier_passes = earlier.report.earlier_passes
        self._results[report.req_id] = stored
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)
            if not self._warned_full:
                self._warned_full = True
                logger.warning(
                    "rcstat: the worker keeps the compression results of the last %d requests; older ones are "
                    "dropped (read them with rcstat_vllm.api.compression_results and clear them sooner to keep "
                    "them all)",
                    self.max_results,
                )
        logger.debug(
            "rcstat: request %s (%d prompt tokens, %d from the prefix cache, %s): compression ratio %.3f, "
            "global eviction ratio %.3f, head consensus %.3f, %d blocks freed%s",
            report.req_id,
            report.num_prompt_tokens,
            report.num_cached_tokens,
            report.method,
            report.compression_ratio,
            report.global_eviction_ratio,
            report.head_consensus,
            report.blocks_freed,
            f" (skipped: {report.skipped_reason})" if report.skipped_reason else "",
        )

    def end_pass(self, req_id: str, why: str) -> None:
        """The request's current pass ended before it finished (``why``: "preempted", "session continued"); the
        request's next outcome starts a new pass."""
        stored = self._results.get(req_id)
        if stored is not None and stored.report.ended is None:
            stored.report.ended = why

    def send(self, report: CompressionReport) -> None:
        """A report for the scheduler with this step's output (a plan to allocate for, or a skipped request)."""
        self._outgoing.append(report)

    def pop_outgoing(self) -> list[CompressionReport]:
        outgoing, self._outgoing = self._outgoing, []
        return outgoing

    def decode_compacted(self, req_id: str, compactions: int, tokens_evicted: int) -> None:
        """A decode-time compaction ran: the request's result counts it."""
        stored = self._results.get(req_id)
        if stored is not None:
            stored.report.decode_compactions, stored.report.decode_tokens_evicted = compactions, tokens_evicted

    def as_dicts(self) -> dict[str, dict]:
        return {req_id: stored.unpacked().to_dict() for req_id, stored in self._results.items()}
