"""The worker's table of the requests it compresses: one record per request, whose phase only the table changes.

Two things make a request's phase: where its KV lives (vLLM's blocks until its first compaction, then head pages,
``record.pages``, which its attention reads) and what its compaction job is doing (:mod:`rcstat_vllm.worker.jobs`:
a prompt's, or a decode-time one's; at most one at a time). The phases:

``PREFILL``
    its prompt is still arriving: the prompt tokens that were prefix-cache hits are noted at first sight, and the
    trailing queries of each non-final chunk are kept (the last chunk may be shorter than the observation window);
``SCORING``
    a job's step: every layer is scored as its attention finishes (the prompt's last prefill chunk, or the decode
    step a decode-time compaction is due in);
``SELECTED``
    every layer is scored and the keep set chosen (under lazy eviction in budget mode: its bound planned, scoring
    deferred to the compaction); the blocks this rank needs wait for the other tensor-parallel ranks' (max kept);
``AWAITING_BLOCKS``
    the plan is with the scheduler, which answers in a later step with the blocks to copy into (or why not);
``COMPRESSED``
    no job in flight; its heads read and write head pages (:class:`~rcstat_vllm.paging.head_pages.CompactedRequest`);
``UNCOMPRESSED_DECODE``
    no job in flight; its prompt stayed whole (too short, nothing to evict) and, with ``decode_budget`` set, its
    generated KV is watched for a decode-time compaction.

A job runs SCORING -> SELECTED -> AWAITING_BLOCKS, then COMPRESSED (compacted) or, cancelled, back where it started
(a prompt's record is dropped: the request runs uncompressed). A prompt job starts from PREFILL, a decode-time one
from COMPRESSED or UNCOMPRESSED_DECODE; while a decode-time job is in flight the request keeps decoding over its
pages. Any other transition raises, naming the request, its phase and the phases expected.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # (annotations only)
    from rcstat_vllm.paging.head_pages import CompactedRequest
    from rcstat_vllm.worker.decode_compression import DecodeCompressor
    from rcstat_vllm.worker.jobs import DecodeJob, PromptJob


class Phase(enum.Enum):
    PREFILL = "prefill"
    SCORING = "scoring"
    SELECTED = "selected"
    AWAITING_BLOCKS = "awaiting blocks"
    COMPRESSED = "compressed"
    UNCOMPRESSED_DECODE = "decoding uncompressed"


@dataclass
class WorkerRequest:
    req_id: str
    #: prompt tokens that were prefix-cache hits (its computed tokens when first seen in prefill)
    cached_tokens: int = 0
    #: PREFILL: per layer, the trailing queries of its non-final chunks so far (None until a chunk saved some)
    saved_queries: list[Tensor | None] | None = None
    #: after its first compaction: its head pages (what its attention reads)
    pages: CompactedRequest | None = None
    #: with ``decode_budget`` set, once it decodes: when its next decode-time compaction is due, its queries
    decode: DecodeCompressor | None = None
    #: the compaction in flight, and its phase (SCORING, SELECTED or AWAITING_BLOCKS)
    job: PromptJob | DecodeJob | None = None
    job_phase: Phase | None = None
    #: SELECTED: the blocks this rank's heads need (before the agreement across ranks)
    blocks_needed: int = 0

    @property
    def phase(self) -> Phase:
        if self.job is not None:
            return self.job_phase  # type: ignore[return-value]  # (set with the job)
        if self.pages is not None:
            return Phase.COMPRESSED
        return Phase.UNCOMPRESSED_DECODE if self.decode is not None else Phase.PREFILL

    def saved_for(self, layer: int) -> Tensor | None:
        return None if self.saved_queries is None else self.saved_queries[layer]


class WorkerRequests:
    """Every request the worker holds something for, by id, in the order it first saw them (the same on every
    tensor-parallel rank: they see the same steps)."""

    def __init__(self) -> None:
        self._records: dict[str, WorkerRequest] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._records

    def get(self, req_id: str) -> WorkerRequest | None:
        return self._records.get(req_id)

    def in_phase(self, phase: Phase) -> list[WorkerRequest]:
        return [record for record in self._records.values() if record.phase is phase]

    def compressed_state(self, req_id: str) -> CompactedRequest | None:
        """The head pages its attention reads, if compacted (a decode-time job may be in flight)."""
        record = self._records.get(req_id)
        return None if record is None else record.pages

    @property
    def num_compressed(self) -> int:
        return sum(record.pages is not None for record in self._records.values())

    @property
    def with_saved_queries(self) -> set[str]:
        return {req_id for req_id, record in self._records.items() if record.saved_queries is not None}

    # ---- transitions ----

    def seen_in_prefill(self, req_id: str, computed_tokens: int, own_hits: bool = False) -> None:
        """A request in prefill: at first sight its computed tokens are its prefix-cache hits, kept as they are
        (shared with the requests that hit them), unless ``own_hits``: a request recomputed after a preemption hits
        its own earlier blocks, and is compressed over them too (else it would keep its whole prompt under the very
        pressure that preempted it)."""
        if req_id not in self._records:
            self._records[req_id] = WorkerRequest(req_id, cached_tokens=0 if own_hits else computed_tokens)

    def in_prefill(self, req_id: str) -> WorkerRequest:
        """The record of a request in prefill (created if the runner's step info never showed it in prefill)."""
        record = self._records.get(req_id) or self._add(WorkerRequest(req_id))
        expect(record, Phase.PREFILL)
        return record

    def watch_decode(self, req_id: str, decode: DecodeCompressor) -> WorkerRequest:
        """A request starts decoding with decode-time compression: a new record (its prompt stayed whole), or its
        compacted record gets its watcher."""
        record = self._records.get(req_id) or self._add(WorkerRequest(req_id))
        expect(record, Phase.PREFILL, Phase.COMPRESSED)
        record.decode = decode
        return record

    def start_job(self, record: WorkerRequest, job: PromptJob | DecodeJob) -> None:
        """PREFILL -> SCORING (a prompt job); COMPRESSED or UNCOMPRESSED_DECODE -> SCORING (a decode-time job)."""
        expect(record, *((Phase.PREFILL,) if job.kind == "prompt" else (Phase.COMPRESSED, Phase.UNCOMPRESSED_DECODE)))
        record.job, record.job_phase = job, Phase.SCORING

    def job_selected(self, record: WorkerRequest, blocks_needed: int) -> None:
        expect(record, Phase.SCORING)
        record.job_phase, record.blocks_needed = Phase.SELECTED, blocks_needed

    def job_sent(self, record: WorkerRequest) -> None:
        expect(record, Phase.SELECTED)
        record.job_phase, record.saved_queries = Phase.AWAITING_BLOCKS, None

    def job_compacted(self, record: WorkerRequest, pages: CompactedRequest) -> None:
        """AWAITING_BLOCKS -> COMPRESSED: its attention reads ``pages`` from this step on."""
        expect(record, Phase.AWAITING_BLOCKS)
        record.pages, record.job, record.job_phase = pages, None, None

    def job_cancelled(self, record: WorkerRequest) -> None:
        """AWAITING_BLOCKS -> where it started: a prompt's record is dropped (the request runs uncompressed)."""
        expect(record, Phase.AWAITING_BLOCKS)
        if record.job.kind == "prompt":  # type: ignore[union-attr]  # (AWAITING_BLOCKS: a job in flight)
            self.drop(record.req_id)
        record.job, record.job_phase = None, None

    def drop(self, req_id: str) -> WorkerRequest | None:
        return self._records.pop(req_id, None)

    def _add(self, record: WorkerRequest) -> WorkerRequest:
        self._records[record.req_id] = record
        return record


def expect(record: WorkerRequest, *phases: Phase) -> None:
    """The phase a transition starts from; anything else is a bookkeeping bug, named."""
    if record.phase not in phases:
        wanted = " or ".join(phase.value for phase in phases)
        raise RuntimeError(f"rcstat: request {record.req_id} is {record.phase.value}, expected {wanted}")
