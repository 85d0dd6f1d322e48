"""The per-step view of the batch that the plugin's backend needs (filled by patches/model_runner.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rcstat_vllm.reports import Compaction, ScoreAhead


@dataclass(frozen=True)
class BatchRequest:
    """One row of the batch, in the order of the attention metadata's rows."""

    req_id: str
    num_prompt_tokens: int
    #: tokens already in the KV cache before this step
    num_computed_tokens: int
    num_scheduled_tokens: int
    extra_args: Mapping[str, Any] | None = None
    #: the row's vLLM block ids on the host (a read-only view of the runner's host block table: read it within this
    #: step, vLLM rewrites it for the next one), in blocks of ``StepInfo.block_size`` tokens; None when not carried
    block_ids: Any = field(default=None, compare=False, repr=False)

    @property
    def num_tokens_after_step(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def finishes_prefill(self) -> bool:
        """This step writes the last prompt token's KV: the moment to compress."""
        return self.num_computed_tokens < self.num_prompt_tokens <= self.num_tokens_after_step


@dataclass
class StepInfo:
    requests: list[BatchRequest]
    #: requests finished, preempted or resumed: their compressed state is gone
    dropped_req_ids: set[str] = field(default_factory=set)
    #: those of them preempted (vLLM recomputes them when they resume)
    preempted_req_ids: frozenset[str] = frozenset()
    #: those of them resumed after a preemption (recomputed from this step on: their prefix-cache hits are their own
    #: earlier blocks)
    resumed_req_ids: frozenset[str] = frozenset()
    #: requests vLLM sends as new in this step: a streaming-input session's next chunk comes this way too, under the id
    #: of a request the worker may know (``GPUModelRunner._update_streaming_request``)
    new_req_ids: frozenset[str] = frozenset()
    #: compactions to run before this step's forward (their prompt blocks are no longer the request's)
    compactions: list[Compaction] = field(default_factory=list)
    #: tokens per block of the requests' ``block_ids`` (vLLM's KV-manager block size), None when they carry none
    block_size: int | None = None
    #: requests whose decode-time compaction the scheduler brings forward (the pool is about to run short)
    decode_soon: frozenset[str] = frozenset()
    #: parked plans (lazy eviction) the scheduler expects to compact within a few steps: scored ahead of their copy
    score_ahead: ScoreAhead = field(default_factory=ScoreAhead)
