"""The scheduler side's table of requests: one record per request it holds anything for, with an explicit phase.

A request the scheduler side tracks is in one of these phases:

``WHOLE``
    running over its full cache: nothing compacted (yet). Every running request is tracked from the first schedule
    that runs it (the decode-time forecast reads its config), or from its first report.
``PLANNED``
    lazy eviction: its worker's plan is parked until the scheduler needs its blocks (:meth:`EngineRequests.park`).
``AWAITING_COMPACTION``
    fresh blocks are in its block list (or the copy was refused) and the compaction waits for the next scheduler
    output (:meth:`EngineRequests.queue`); from ``WHOLE``, or from ``COMPACTED`` for a decode-time compaction.
``COMPACTED``
    the compaction was sent: its kept KV's blocks hold head pages (never prefix-cache entries). A refused copy
    goes back to the phase it came from (``WHOLE``, or ``COMPACTED`` with its earlier blocks).

Beside its phase each record holds the decode-time forecast's data (its config, the tokens it started from, those
at its last decode-time compaction, whether it was asked to compact early). The table's methods are the only
way to change a phase; each checks the phase it starts from. :meth:`EngineRequests.forget` drops a request when
vLLM frees its blocks (finished, or preempted: a recomputed request starts afresh).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only)
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.reports import Compaction, CompressionReport


class Phase(enum.Enum):
    WHOLE = "whole"
    PLANNED = "planned"
    AWAITING_COMPACTION = "awaiting compaction"
    COMPACTED = "compacted"


@dataclass
class EngineRequest:
    req_id: str
    phase: Phase = Phase.WHOLE
    #: the table's sequence number when it entered its phase (plans are parked, compactions sent, in this order)
    since: int = 0
    #: PLANNED: the worker's plan
    plan: CompressionReport | None = None
    #: PLANNED: the workers scored and selected its deferred plan ahead of its copy (``StepCompactions.scored_ahead``)
    scored_ahead: bool = False
    #: AWAITING_COMPACTION: the compaction for the next scheduler output
    compaction: Compaction | None = None
    #: once a copy was granted: the blocks its kept KV goes to (None: never compacted)
    block_ids: tuple[int, ...] | None = None
    #: whether the decode-time forecast merged its config (``config`` None: it does not compress generated KV)
    watched: bool = False
    config: RCStatConfig | None = None
    #: tokens when it started running (its prompt; after a preemption, what it recomputes)
    started_at: int | None = None
    #: tokens in its cache at its last decode-time compaction
    compacted_at: int | None = None
    #: asked to compact early and not compacted yet: (the blocks it is expected to free, the check that asked)
    hurried: tuple[int, int] | None = None


class EngineRequests:
    """Every request the scheduler side holds something for, by id."""

    def __init__(self) -> None:
        self._records: dict[str, EngineRequest] = {}
        self._sequence = 0
        #: every compacted request's blocks (a prefix-cache hit must never return one), kept with the records
        self._compacted_blocks: set[int] = set()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._records

    def get(self, req_id: str) -> EngineRequest | None:
        return self._records.get(req_id)

    def in_phase(self, phase: Phase) -> list[EngineRequest]:
        """The records in ``phase``, in the order they entered it."""
        return sorted((r for r in self._records.values() if r.phase is phase), key=lambda r: r.since)

    def any_in_phase(self, phase: Phase) -> bool:
        return any(r.phase is phase for r in self._records.values())

    @property
    def compacted_blocks(self) -> set[int]:
        """Every compacted request's blocks (read only)."""
        return self._compacted_blocks

    def compacted(self) -> dict[str, tuple[int, ...]]:
        """Request id -> the blocks its kept KV went to, for the requests compacted."""
        return {r.req_id: r.block_ids for r in self._records.values() if r.block_ids is not None}

    def may_cache(self, req_id: str) -> bool:
        record = self._records.get(req_id)
        return record is None or record.block_ids is None

    def track(self, req_id: str) -> EngineRequest:
        """The request's record, created (``WHOLE``) at first sight."""
        record = self._records.get(req_id)
        if record is None:
            record = self._records[req_id] = EngineRequest(req_id)
        return record

    def forget(self, req_id: str) -> None:
        """vLLM freed the request's blocks: it left the running set, for good or until it is recomputed."""
        record = self._records.pop(req_id, None)
        if record is not None and record.block_ids:
            self._compacted_blocks.difference_update(record.block_ids)

    def park(self, req_id: str, plan: CompressionReport) -> None:
        """Lazy eviction: the plan waits until the scheduler needs the request's blocks."""
        record = self._enter(self.track(req_id), Phase.PLANNED, Phase.WHOLE)
        record.plan, record.scored_ahead = plan, False

    def take_plan(self, req_id: str) -> CompressionReport:
        """A parked plan the scheduler compacts now (the request is ``WHOLE`` until :meth:`queue`)."""
        record = self._enter(self._known(req_id, Phase.PLANNED), Phase.WHOLE, Phase.PLANNED)
        plan, record.plan, record.scored_ahead = record.plan, None, False
        return plan  # type: ignore[return-value]  # (PLANNED: a plan is parked)

    def mark_scored_ahead(self, req_ids) -> None:
        """The workers scored and selected these parked plans ahead of their copy (ids no longer parked are ignored:
        the plan was compacted or dropped since the workers were asked)."""
        for req_id in req_ids:
            record = self._records.get(req_id)
            if record is not None and record.phase is Phase.PLANNED:
                record.scored_ahead = True

    def continue_session(self, req_id: str) -> CompressionReport | None:
        """A streaming-input session's next chunk arrived: its parked plan (made for the earlier prompt) is dropped and
        returned, the request is ``WHOLE`` again (or stays ``COMPACTED``), and its config is merged again (the chunk
        brings its own sampling parameters)."""
        record = self._records.get(req_id)
        if record is None:
            return None
        plan = self.take_plan(req_id) if record.phase is Phase.PLANNED else None
        record.watched, record.config, record.hurried = False, None, None
        return plan

    def queue(self, compaction: Compaction) -> None:
        """The exchange gave the request fresh blocks (or refused): the compaction waits for the next output."""
        record = self._enter(self.track(compaction.req_id), Phase.AWAITING_COMPACTION, Phase.WHOLE, Phase.COMPACTED)
        record.compaction = compaction
        if compaction.cancelled_reason is None:
            # (compacted again, decode-time: its earlier blocks went back to the pool)
            self._compacted_blocks.difference_update(record.block_ids or ())
            record.block_ids = compaction.block_ids
            self._compacted_blocks.update(compaction.block_ids)

    def take_outgoing(self, is_running: Callable[[str], bool]) -> list[Compaction]:
        """The queued compactions, in the order queued, each request then ``COMPACTED`` (or back to ``WHOLE`` when
        its copy was refused and it was never compacted); those of requests not running are dropped."""
        sent = []
        for record in self.in_phase(Phase.AWAITING_COMPACTION):
            compaction, record.compaction = record.compaction, None
            after = Phase.WHOLE if record.block_ids is None else Phase.COMPACTED
            self._enter(record, after, Phase.AWAITING_COMPACTION)
            if is_running(record.req_id):
                sent.append(compaction)
        return sent  # type: ignore[return-value]  # (AWAITING_COMPACTION: a compaction is queued)

    def watch(self, req_id: str, num_tokens: int, make_config: Callable[[], RCStatConfig | None]):
        """The request's config when it compresses generated KV (``make_config()`` the first time it is seen)."""
        record = self.track(req_id)
        if not record.watched:
            record.watched, record.config, record.started_at = True, make_config(), num_tokens
        return record.config

    def decode_compacted(self, req_id: str, num_tokens: int | None) -> None:
        """A decode-time plan of the request came back: copied at ``num_tokens`` tokens, or refused (None)."""
        record = self.track(req_id)
        if num_tokens is not None:
            record.compacted_at = num_tokens
        record.hurried = None

    def hurry(self, req_id: str, expected_gain: int, check: int) -> None:
        self.track(req_id).hurried = (expected_gain, check)

    def stop_hurrying(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            if req_id in self._records:
                self._records[req_id].hurried = None

    def expect(self, req_id: str, *expected: Phase) -> None:
        """Raise unless the request is in one of the ``expected`` phases (untracked counts as ``WHOLE``): checked
        before the exchange touches its blocks."""
        record = self._records.get(req_id)
        phase = Phase.WHOLE if record is None else record.phase
        if phase not in expected:
            raise wrong_phase(req_id, phase, expected)

    def _known(self, req_id: str, expected: Phase) -> EngineRequest:
        record = self._records.get(req_id)
        if record is None:
            raise RuntimeError(f"rcstat: request {req_id} is not tracked, expected {expected.value}")
        return record

    def _enter(self, record: EngineRequest, phase: Phase, *expected: Phase) -> EngineRequest:
        """Move the record to ``phase`` from one of the ``expected`` phases; anything else is a bookkeeping bug."""
        if record.phase not in expected:
            raise wrong_phase(record.req_id, record.phase, expected)
        self._sequence += 1
        record.phase, record.since = phase, self._sequence
        return record


def wrong_phase(req_id: str, phase: Phase, expected: tuple[Phase, ...]) -> RuntimeError:
    """A transition from a phase it does not start from: a bookkeeping bug, named."""
    wanted = " or ".join(p.value for p in expected)
    return RuntimeError(f"rcstat: request {req_id} is {phase.value}, expected {wanted}")
