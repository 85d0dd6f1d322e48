"""The worker's table of the requests it compresses: one record per request, with an explicit phase.

A request the plugin compresses goes through these phases on every worker, in this order (any of them may end
early: the request finishes, is preempted, or turns out not to be compressed):

``PREFILL``
    its prompt is still arriving: the prompt tokens that were prefix-cache hits are noted at first sight, and the
    trailing queries of each non-final chunk are kept (the last chunk may be shorter than the observation window);
``SCORING``
    its last prefill chunk is in this step's forward: every layer is scored as its attention finishes;
``SELECTED``
    every layer is scored and the keep set chosen (or, under lazy eviction in budget mode, its bound planned): the
    blocks this rank needs wait for the other tensor-parallel ranks' (the max is kept);
``AWAITING_BLOCKS``
    the plan is with the scheduler, which answers in a later step with the blocks to copy into (or why not);
``COMPRESSED``
    compacted: its heads read and write head pages (:class:`~rcstat_vllm.paging.head_pages.CompactedRequest`). With
    ``decode_budget`` set it may be compacted again as it decodes (:mod:`rcstat_vllm.worker.decode_compression`): it stays
    in this phase, decoding, while that plan is with the scheduler.
``UNCOMPRESSED_DECODE``
    (outside the order above) a request whose prompt was not compressed (too short, nothing to evict) decoding with
    ``decode_budget`` set: its generated KV is watched; its first decode-time compaction makes it ``COMPRESSED``.

:class:`WorkerRequests` owns the records; :class:`~rcstat_vllm.worker.driver.WorkerCompression` moves them from phase to
phase through its methods, each of which checks the phase it starts from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import Tensor

from rcstat_vllm.worker.prompt_compression import RequestCompressor
from rcstat_vllm.worker.decode_compression import DecodeCompressor
from rcstat_vllm.paging.head_pages import CompactedRequest


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
    phase: Phase = Phase.PREFILL
    #: prompt tokens that were prefix-cache hits (its computed tokens when first seen in prefill)
    cached_tokens: int = 0
    #: PREFILL: per layer, the trailing queries of its non-final chunks so far (None until a chunk saved some)
    saved_queries: list[Tensor | None] | None = None
    #: SCORING to AWAITING_BLOCKS: its scores, keep set and plan
    compressor: RequestCompressor | None = None
    #: SELECTED: the blocks this rank's heads need (before the agreement across ranks)
    blocks_needed: int = 0
    #: COMPRESSED: its head pages; UNCOMPRESSED_DECODE, from the step it is due until its compaction: its blocks seen
    #: as head pages (the copy's sources, :meth:`CompactedRequest.uncompressed`)
    state: CompactedRequest | None = None
    #: COMPRESSED or UNCOMPRESSED_DECODE, with ``decode_budget`` set: its decode-time compression (a plan may be
    #: with the scheduler)
    decode: DecodeCompressor | None = None

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
        record = self._records.get(req_id)
        return record.state if record is not None and record.phase is Phase.COMPRESSED else None

    @property
    def num_compressed(self) -> int:
        return sum(record.phase is Phase.COMPRESSED for record in self._records.values())

    @property
    def with_saved_queries(self) -> set[str]:
        return {req_id for req_id, record in self._records.items() if record.saved_queries is not None}

    def add(self, record: WorkerRequest) -> WorkerRequest:
        if record.req_id in self._records:
            raise RuntimeError(f"rcstat: request {record.req_id} is already tracked ({self._records[record.req_id].phase})")
        self._records[record.req_id] = record
        return record

    def seen_in_prefill(self, req_id: str, computed_tokens: int) -> None:
        """A request in prefill: at first sight its computed tokens are its prefix-cache hits."""
        if req_id not in self._records:
            self._records[req_id] = WorkerRequest(req_id, cached_tokens=computed_tokens)

    def in_prefill(self, req_id: str) -> WorkerRequest:
        """The record of a request in prefill (created if the runner's step info never showed it in prefill)."""
        record = self._records.get(req_id)
        if record is None:
            return self.add(WorkerRequest(req_id))
        expect(record, Phase.PREFILL, Phase.SCORING)
        return record

    def drop(self, req_id: str) -> WorkerRequest | None:
        return self._records.pop(req_id, None)


def expect(record: WorkerRequest, *phases: Phase) -> None:
    """The phase a transition starts from; anything else is a bookkeeping bug, named."""
    if record.phase not in phases:
        wanted = " or ".join(phase.value for phase in phases)
        raise RuntimeError(f"rcstat: request {record.req_id} is {record.phase.value}, expected {wanted}")
