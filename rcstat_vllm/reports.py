"""The messages the two sides exchange about a request's compaction: the worker's :class:`CompressionReport` (its plan,
or outcome, for the scheduler and the user) and the scheduler's answer, :class:`Compaction` (the blocks to copy into,
or why not). Plain dataclasses: no torch, no vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class CompressionReport:
    """The outcome of compressing one request's prompt KV.

    ``keep_blocks`` tells the scheduler how many blocks the request holds for its compacted prompt: its
    ``shared_blocks`` (prefix-cache hits, kept as they are) and fresh blocks for the rest; the scheduler allocates
    the fresh ones, the worker copies the kept entries there, and the request's other prompt blocks go back to the
    pool (blocks vLLM appends later, as it decodes, are kept).
    """

    req_id: str
    num_prompt_tokens: int
    method: str
    keep_blocks: int
    #: kept tokens per [layer][kv head]
    kept: list[list[int]] = field(default_factory=list)
    skipped_reason: str | None = None
    block_size: int = 0
    #: whether the request's head pages came from one pool across all layers (else one pool per layer)
    pooled_pages: bool = False
    #: share of prompt tokens evicted from every KV head of every layer: no layer can attend to them any more
    #: (the "global eviction ratio" of the KV-compression-physics paper, an early warning of the quality cliff)
    global_eviction_ratio: float = 0.0
    #: per layer, share of prompt tokens evicted from every KV head of that layer
    layer_global_eviction: list[float] = field(default_factory=list)
    #: how much a layer's KV heads agree on what they keep (mean pairwise overlap of their kept tokens outside the
    #: window and sinks, averaged over layers; 1 = every head keeps the same tokens): the paper's head consensus,
    #: its rigidity measure, on the selection's side (``rcstat_vllm.scoring.selection.head_consensus``)
    head_consensus: float = 0.0
    #: prompt tokens served from vLLM's prefix cache (shared with earlier requests, not recomputed)
    num_cached_tokens: int = 0
    #: lazy eviction: the scheduler compacts the request only when it needs the blocks
    lazy: bool = False
    #: tokens in the cache when the kept KV was compacted (0: right after the prefill, or not compacted)
    compacted_at_tokens: int = 0
    #: why the request was compacted then (lazy eviction's memory pressure), None for eager compaction
    compaction_reason: str | None = None
    #: a decode-time compaction's plan (``decode_budget``): ``num_prompt_tokens`` are then the tokens in the cache
    #: (prompt and generated), all of whose blocks it replaces
    decode: bool = False
    #: decode-time compactions the request went through, and the generated entries they evicted (all layers, heads)
    decode_compactions: int = 0
    decode_tokens_evicted: int = 0
    #: the share of prompt KV evicted instead of ``target_ratio`` when the kept entries did not fit the blocks the
    #: plan allocated (lazy eviction scores at the copy; only forced keeps, non-finite scores, can exceed the bound);
    #: None when the budget was met as set
    budget_tightened_to: float | None = None
    #: why this pass of the request ended before it finished ("preempted": vLLM recomputes it; "session continued": a
    #: streaming-input session's next chunk arrived), None while it is the request's current pass
    ended: str | None = None
    #: the request's earlier passes, oldest first (each one's :meth:`to_dict`, ``ended`` saying why it ended)
    earlier_passes: list[dict] = field(default_factory=list)

    @property
    def prompt_blocks(self) -> int:
        return -(-self.num_prompt_tokens // self.block_size) if self.block_size else 0

    @property
    def shared_blocks(self) -> int:
        """Prompt blocks served from the prefix cache: the request keeps them as they are (shared, uncompressed)."""
        return self.num_cached_tokens // self.block_size if self.block_size else 0

    @property
    def blocks_held(self) -> int:
        """vLLM blocks the request holds for its prompt after compaction."""
        return min(self.keep_blocks, self.prompt_blocks)

    @property
    def ideal_blocks(self) -> int:
        """Blocks the kept entries would fill if packed perfectly (no partial pages, layers balanced)."""
        if not self.block_size or not self.kept:
            return 0
        entries = sum(map(sum, self.kept))
        per_block = self.block_size * len(self.kept[0]) * len(self.kept)
        return max(-(-entries // per_block), 1)

    @property
    def fragmentation(self) -> float:
        """Blocks held / ideal blocks for the kept tokens (1.0 = no waste)."""
        return self.blocks_held / self.ideal_blocks if self.ideal_blocks else 1.0

    @property
    def blocks_freed(self) -> int:
        return max(self.prompt_blocks - self.keep_blocks, 0)

    @property
    def compression_ratio(self) -> float:
        """Evicted / total prompt KV entries over all layers and heads."""
        total = sum(len(row) for row in self.kept) * self.num_prompt_tokens
        if total == 0:
            return 0.0
        return 1.0 - sum(map(sum, self.kept)) / total

    def to_dict(self) -> dict:
        return {
            "req_id": self.req_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "method": self.method,
            "compression_ratio": self.compression_ratio,
            "blocks_freed": self.blocks_freed,
            "blocks_held": self.blocks_held,
            "ideal_blocks": self.ideal_blocks,
            "fragmentation": self.fragmentation,
            "keep_blocks": self.keep_blocks,
            "kept": self.kept,
            "skipped_reason": self.skipped_reason,
            "block_size": self.block_size,
            "pooled_pages": self.pooled_pages,
            "global_eviction_ratio": self.global_eviction_ratio,
            "layer_global_eviction": self.layer_global_eviction,
            "head_consensus": self.head_consensus,
            "num_cached_tokens": self.num_cached_tokens,
            "lazy": self.lazy,
            "compacted_at_tokens": self.compacted_at_tokens,
            "compaction_reason": self.compaction_reason,
            "decode_compactions": self.decode_compactions,
            "decode_tokens_evicted": self.decode_tokens_evicted,
            "budget_tightened_to": self.budget_tightened_to,
            "ended": self.ended,
            "passes": len(self.earlier_passes) + 1,
            "earlier_passes": self.earlier_passes,
        }

    @classmethod
    def from_dict(cls, result: dict) -> CompressionReport:
        """The report behind a :meth:`to_dict` result (derived fields are recomputed)."""
        return cls(**{name: result[name] for name in cls.__dataclass_fields__ if name in result})


@dataclass(frozen=True)
class Compaction:
    """The scheduler's answer to a worker's compression plan (``rcstat_vllm/engine/block_exchange.py``), carried to the
    workers in the next step's scheduler output: the blocks to copy the request's kept KV into, or why it stays
    uncompressed (its prompt blocks untouched)."""

    req_id: str
    block_ids: tuple[int, ...] = ()
    cancelled_reason: str | None = None
    #: tokens whose KV is compacted: 0 = the prompt's (compacted right after its prefill); more under lazy eviction,
    #: the generated tokens since being kept whole
    num_tokens: int = 0
    #: under lazy eviction, the request's blocks after its prompt's, up to ``num_tokens`` (the copy's sources there)
    tail_block_ids: tuple[int, ...] = ()
    #: why it was compacted now (lazy eviction: the memory pressure that called for it)
    reason: str | None = None
    #: some fresh blocks are blocks the request itself just gave back (the pool was short): the copy reads every
    #: kept entry before writing any
    reuses_own_blocks: bool = False


#: How far ahead, in steps, the lazy relief names the parked plans it expects to compact next
#: (``engine.pressure_policy.to_score_ahead``, sent as ``RCStatSchedulerOutput.rcstat_score_ahead``); the workers
#: score such a plan over the steps before its copy, ``1 / (SCORE_AHEAD_STEPS - 2)`` of its layers per step at most,
#: and select what its heads keep in a step of its own (``WorkerCompression.score_ahead``), so the step that copies it
#: waits only for the copy.
SCORE_AHEAD_STEPS = 5

#: The same, when no prompt waits and the running requests' next tokens fit, but a prompt as long as the longest
#: running one would find the pool short (``engine.pressure_policy.score_ahead_shortfall``): the plans its copy would
#: take are scored over this many steps, a layer or so per step, before any prompt asks; a prompt that arrives then
#: finds them selected and waits only for their copy, and no step stalls for a third of a scoring
ANTICIPATE_STEPS = 32


class ScoreAhead(NamedTuple):
    """Parked plans the workers score ahead of their copy, in the scheduler's order (those freeing most first), and
    over how many steps (``SCORE_AHEAD_STEPS`` or ``ANTICIPATE_STEPS``): ``1 / (steps - 2)`` of the model's layers
    per step at most."""

    req_ids: tuple[str, ...] = ()
    steps: int = SCORE_AHEAD_STEPS

    def layers_per_step(self, num_layers: int) -> int:
        """The most layers of a ``num_layers``-layer model one step scores (the last two of the steps are the
        selection's and the copy's)."""
        return -(-num_layers // (self.steps - 2))


class CopyRun(NamedTuple):
    """One copy the worker ran: whose, which kind ("prompt" or "decode"; "score_ahead": layers of a parked plan
    scored before its copy, no copy yet), and its host time in seconds."""

    req_id: str
    kind: str
    seconds: float


@dataclass(frozen=True)
class StepCompactions:
    """The worker's compaction work in one step and the sizes of its tables (the copies it ran before the forward,
    scheduler answers that were refusals not counted), carried to the scheduler with the step's output beside the
    reports; the engine's metrics (``rcstat:step_compaction_seconds``, ``rcstat:compactions_per_step``,
    ``rcstat:compaction_seconds``) read it.

    Host time: on CPU the copy is synchronous, on CUDA it measures the launches, not the kernels."""

    #: one per copy, in the order run (the scheduler counts a compaction when its copy ran, not when it was granted:
    #: vLLM may preempt the request first, and the copy is then never sent)
    copies: tuple[CopyRun, ...] = ()
    #: requests in the worker's table after the step began (sent when it changed; None: not sent): 0 once a server is
    #: idle, or a leak (``rcstat:worker_requests``)
    worker_requests: int | None = None
    #: requests' results the worker keeps for the Python API (sent when it changed; None: not sent), at most
    #: ``MAX_RESULTS`` (``rcstat:worker_results``)
    worker_results: int | None = None
    #: (compression ratio, global eviction ratio, head consensus) of each prompt compacted here whose plan was scored
    #: at its copy (lazy eviction, budget mode): the scheduler saw none of them in its plan
    scored_at_copy: tuple[tuple[float, float, float], ...] = ()
    #: parked plans (lazy eviction) this step finished scoring and selecting ahead of their copy: a relief for a
    #: waiting prompt may now compact them without stalling a step for their scoring or selection
    scored_ahead: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return sum(copy.seconds for copy in self.copies)

    def count(self, kind: str) -> int:
        return sum(1 for copy in self.copies if copy.kind == kind)
