"""Scheduler side of decode-time compression under memory pressure: bring compactions forward before vLLM preempts.

A request with ``decode_budget`` is compacted every ``decode_interval`` generated tokens, on a schedule the worker
keeps (:class:`~rcstat_vllm.worker.decode_compression.DecodeCompressor`). After each schedule the scheduler asks
:class:`DecodePressure` which running requests to compact early (the policy: :mod:`rcstat_vllm.engine.pressure_policy`);
the names travel in the scheduler output (``rcstat_decode_soon``) and the workers' compactions come back as any
decode-time plan does. Each request's data (its config, the tokens it started from and was last compacted at, whether
it was asked) lives in its record of the engine's request table (:mod:`rcstat_vllm.engine.requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine import pressure_policy
from rcstat_vllm.engine.pressure_policy import RunningRequest
from rcstat_vllm.engine.requests import EngineRequests


@dataclass
class DecodePressure:
    """One engine's decode-time forecast (owned by its ``EngineCompaction``, sharing its request table); the
    scheduler hooks call :meth:`shortfall` and :meth:`requests_to_hurry` (tests replace them to force or mute
    pressure)."""

    requests: EngineRequests = field(default_factory=EngineRequests)
    #: checks so far (one per schedule): how long ago a request was asked
    checks: int = 0

    def watch(self, req_id: str, num_tokens: int, make_config) -> RCStatConfig | None:
        """The request's config when it compresses generated KV (``make_config()`` the first time it is seen)."""
        return self.requests.watch(req_id, num_tokens, make_config)

    def running(
        self, req_id: str, num_tokens: int, blocks_held: int, other_groups: tuple[tuple[int, int], ...] = ()
    ) -> RunningRequest:
        """A running request as the policy reads it (its config None until watched)."""
        record = self.requests.get(req_id)
        if record is None:
            return RunningRequest(req_id, num_tokens, blocks_held, other_groups=other_groups)
        return RunningRequest(
            req_id,
            num_tokens,
            blocks_held,
            record.config,
            record.started_at,
            record.compacted_at,
            record.hurried,
            other_groups,
        )

    def shortfall(self, running: list[RunningRequest], free_blocks: int, block_size: int) -> tuple[int, int, str]:
        """The blocks the running requests will lack within the lead, the lead, and why
        (:func:`~rcstat_vllm.engine.pressure_policy.decode_shortfall`)."""
        return pressure_policy.decode_shortfall(running, free_blocks, block_size)

    def requests_to_hurry(self, running: list[RunningRequest], short: int, lead: int, block_size: int) -> list[str]:
        """One check: the requests to compact now (:func:`~rcstat_vllm.engine.pressure_policy.requests_to_hurry`),
        noted as asked."""
        self.checks += 1
        hurry = pressure_policy.requests_to_hurry(running, short, lead, block_size, self.checks)
        self.requests.stop_hurrying(hurry.expired)
        for req_id, gain in hurry.chosen:
            self.requests.hurry(req_id, gain, self.checks)
        return [req_id for req_id, _ in hurry.chosen]
