"""Scheduler side of decode-time compression under memory pressure: bring compactions forward before vLLM preempts.

A request with ``decode_budget`` is compacted every ``decode_interval`` generated tokens, on a schedule the worker
keeps (:class:`~rcstat_vllm.worker.decode_compression.DecodeCompressor`). Requests that start together also grow together:
in a pool that fills before their first compaction is due, vLLM has to preempt some of them (and recompute them
later), although each holds generated KV its budget would evict. So after each schedule the scheduler looks
``lead`` steps ahead (a window of queries to save, plus the scoring step and the copy's): when the blocks the running
requests will want by then exceed the free ones, it asks the workers to compact the requests holding most generated
KV beyond their budget now (due once they have saved a window of queries), until what they are expected to free
covers the shortfall. The names travel in the scheduler output (``rcstat_decode_soon``); the workers' compactions
come back as any decode-time plan does.

Plain Python; the scheduler hook (``patches/scheduler.py``) hands it vLLM's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.settings import decode_queries



@dataclass
class RunningRequest:
    """What the pressure check reads of a running request."""

    req_id: str
    #: its tokens (in its cache, and the one it computes next)
    num_tokens: int
    #: entries of its block list (vLLM allocates by position: a compacted request's list keeps its length)
    blocks_held: int
    #: its config when its generated KV is compressed (``decode_budget``), else None (:meth:`DecodePressure.watch`)
    config: RCStatConfig | None


@dataclass
class DecodePressure:
    """One engine's decode-time compactions brought forward (owned by its ``EngineCompaction``)."""

    #: request id -> its config when it compresses generated KV, else None (merged once per request)
    configs: dict[str, RCStatConfig | None] = field(default_factory=dict)
    #: request id -> its tokens when it started running (its prompt; after a preemption, what it recomputes): the
    #: workers count its generated KV from there
    started_at: dict[str, int] = field(default_factory=dict)
    #: request id -> tokens in its cache at its last decode-time compaction
    compacted_at: dict[str, int] = field(default_factory=dict)
    #: request id -> (the blocks it is expected to free, the check that asked), for requests asked to compact and not
    #: compacted yet; forgotten after ``2 * lead`` checks (a worker declines when its heads hold too little to evict)
    hurried: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: checks so far (one per schedule)
    checks: int = 0

    def watch(self, req_id: str, num_tokens: int, make_config) -> RCStatConfig | None:
        """The request's config when it compresses generated KV (``make_config()`` the first time it is seen)."""
        if req_id not in self.configs:
            self.configs[req_id] = make_config()
            self.started_at[req_id] = num_tokens
        return self.configs[req_id]

    def compacted(self, req_id: str, num_tokens: int | None) -> None:
        """A decode-time plan of the request came back: copied at ``num_tokens`` tokens, or refused (None)."""
        if num_tokens is not None:
            self.compacted_at[req_id] = num_tokens
        self.hurried.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """The request left the running set, for good or until it is recomputed (its count starts afresh)."""
        for known in (self.configs, self.started_at, self.compacted_at, self.hurried):
            known.pop(req_id, None)

    def expected_gain(self, request: RunningRequest, lead: int, block_size: int) -> int:
        """Blocks a compaction ``lead`` tokens from now is expected to free: the generated entries per head beyond the
        budget then (after a compaction each head holds ``decode_budget`` on average), in whole blocks."""
        budget = request.config.decode_budget
        due_at = request.num_tokens + lead
        last = self.compacted_at.get(request.req_id)
        start = self.started_at.get(request.req_id, request.num_tokens)
        generated = due_at - start if last is None else budget + due_at - last
        return max(0, generated - budget) // block_size

    def shortfall(self, running: list[RunningRequest], free_blocks: int, block_size: int) -> tuple[int, int, str]:
        """The blocks the running requests will lack within ``lead`` steps (a window of queries to save, the scoring
        step and the copy's; <= 0: none), the lead, and why; ``(0, 0, "")`` when none compresses generated KV."""
        watched = [r.config for r in running if r.config is not None]
        if not watched:
            return 0, 0, ""
        lead = max(decode_queries(config) for config in watched) + 2
        wanted = sum(max(0, -(-(r.num_tokens + lead) // block_size) - r.blocks_held) for r in running)
        return wanted - free_blocks, lead, f"{wanted} blocks wanted within {lead} steps, {free_blocks} free"

    def requests_to_hurry(self, running: list[RunningRequest], short: int, lead: int, block_size: int) -> list[str]:
        """The requests to compact now, given the :meth:`shortfall` within ``lead`` steps (none when it is <= 0, or when
        the requests asked earlier are expected to cover it)."""
        self.checks += 1
        for req_id in [r for r, (_, asked) in self.hurried.items() if self.checks - asked > 2 * lead]:
            del self.hurried[req_id]
        watched = [r for r in running if r.config is not None]
        covered = sum(self.hurried[r.req_id][0] for r in watched if r.req_id in self.hurried)
        if short <= covered:
            return []
        chosen = []
        gains = [(self.expected_gain(r, lead, block_size), r.req_id) for r in watched if r.req_id not in self.hurried]
        for gain, req_id in sorted(gains, key=lambda g: -g[0]):
            if gain <= 0 or covered >= short:
                break
            self.hurried[req_id] = (gain, self.checks)
            covered += gain
            chosen.append(req_id)
        return chosen
