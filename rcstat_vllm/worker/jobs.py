"""A compaction job: what the driver runs to compact a request, one interface for a prompt and for decode time.

A job is scored layer by layer in one step's forward (:meth:`CompactionJob.observe_layer`), selects what each head
keeps once every layer is seen (:meth:`~CompactionJob.select`: the blocks this rank needs), sends its plan after the
tensor-parallel ranks agree on the blocks (:meth:`~CompactionJob.plan_report`), and copies the kept entries into the
blocks the scheduler answers with, before the forward of a later step (:meth:`~CompactionJob.compact`), or is
cancelled (:meth:`~CompactionJob.cancelled`). :class:`PromptJob` does it for a prompt after its last prefill chunk
(:class:`~rcstat_vllm.worker.prompt_compression.RequestCompressor`), :class:`DecodeJob` for the generated tokens of
a decoding request (:class:`~rcstat_vllm.worker.decode_compression.DecodeCompressor`), the way kvpress's
DecodingPress runs its base press over a token range. The phases are the request table's
(:mod:`rcstat_vllm.worker.requests`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from torch import Tensor

from rcstat_vllm.log import logger
from rcstat_vllm.paging.compaction import recompact_request
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.paging.page_space import PageSpace, cdiv
from rcstat_vllm.reports import Compaction, CompressionReport
from rcstat_vllm.worker.decode_compression import DecodeCompressor, with_carried_entries
from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor


class CompactionJob(ABC):
    """One compaction of one request (see the module docstring)."""

    #: "prompt" or "decode"
    kind: ClassVar[str]
    #: [L, n] bool of tokens some head keeps (a prompt's, OR-ed over tensor-parallel ranks), None for decode jobs
    visible: Tensor | None = None

    @abstractmethod
    def observe_layer(self, layer: int, query: Tensor, kv_cache: Tensor, scale: float) -> None:
        """After ``layer``'s attention in the job's step: score it (``query``: the step's ``[T, Hq, D]``)."""

    @property
    @abstractmethod
    def fully_observed(self) -> bool:
        """Every layer is scored (or its queries kept, for a deferred scoring): time to select."""

    @abstractmethod
    def select(self, space: PageSpace) -> int:
        """Choose what each head keeps; the blocks this rank's heads need for it."""

    @abstractmethod
    def plan_report(self, keep_blocks: int) -> CompressionReport:
        """The plan the scheduler allocates for, with the blocks the ranks agreed on."""

    @abstractmethod
    def compact(self, caches: list[Tensor], compaction: Compaction, space: PageSpace) -> CompactedRequest:
        """Copy the kept entries into the scheduler's fresh blocks; the request's head pages from then on."""

    @abstractmethod
    def cancelled(self, reason: str) -> CompressionReport | None:
        """The scheduler sent no blocks: the outcome to record, if any."""

    def score_ahead(self, caches: list[Tensor], max_layers: int, space: PageSpace) -> int:
        """Work the job can do before its copy, named by the scheduler: none by default (0 layers scored)."""
        return 0

    @property
    def scored_ahead(self) -> bool:
        """Whether :meth:`score_ahead` left its copy nothing to score or select."""
        return False


class PromptJob(CompactionJob):
    """A prompt's compaction, scored during its last prefill chunk (or, lazily, at the compaction)."""

    kind: ClassVar[Literal["prompt"]] = "prompt"

    def __init__(
        self,
        compressor: RequestCompressor,
        layout: CacheLayout,
        *,
        saved_queries: list[Tensor | None] | None = None,
        deferred_bound: int | None = None,
    ):
        self.compressor, self.layout = compressor, layout
        #: per layer, the trailing queries of the prompt's earlier chunks (chunked prefill), or None
        self.saved_queries = saved_queries
        #: lazy eviction: the blocks the kept KV needs at most, planned before scoring (scoring waits for the
        #: compaction); None: scored now
        self.deferred_bound = deferred_bound
        if deferred_bound is not None:
            compressor.defer_scoring()

    @classmethod
    def start(
        cls,
        decision: CompressionDecision,
        num_layers: int,
        block_row: Tensor,
        layout: CacheLayout,
        *,
        cached_tokens: int,
        saved_queries: list[Tensor | None] | None,
        deferred_bound: int | None,
    ) -> PromptJob:
        """The job of a prompt finishing its prefill in this step (``block_row``: its row of vLLM's block table)."""
        compressor = RequestCompressor(decision, num_layers, block_row)
        compressor.num_cached_tokens = cached_tokens
        return cls(compressor, layout, saved_queries=saved_queries, deferred_bound=deferred_bound)

    @property
    def config(self):
        return self.compressor.config

    @property
    def visible(self) -> Tensor | None:
        return self.compressor.visible

    @visible.setter
    def visible(self, mask: Tensor | None) -> None:
        self.compressor.visible = mask

    def observe_layer(self, layer: int, query: Tensor, kv_cache: Tensor, scale: float) -> None:
        saved = None if self.saved_queries is None else self.saved_queries[layer]
        self.compressor.observe_layer(layer, query, kv_cache, scale, self.layout, saved)

    @property
    def fully_observed(self) -> bool:
        return self.compressor.fully_scored

    def select(self, space: PageSpace) -> int:
        if self.compressor.deferred:
            return self.compressor.plan_deferred(space, self.deferred_bound)  # type: ignore[arg-type]
        return self.compressor.select(space)

    def plan_report(self, keep_blocks: int) -> CompressionReport:
        self.compressor.keep_blocks = keep_blocks
        return self.compressor.report()

    def score_ahead(self, caches: list[Tensor], max_layers: int, space: PageSpace) -> int:
        """A parked plan whose copy the scheduler expects soon: score up to ``max_layers`` more of its layers now,
        and once every layer was scored in an earlier step, select what its heads keep (the step's whole share: the
        selection of a 2000-token prompt costs about as much as 2 of SmolLM2's 30 layers), so the step that copies
        it waits only for the copy. Returns the work done in layers (``max_layers`` for the selection; 0: nothing
        deferred is left)."""
        if not self.compressor.deferred:
            return 0
        if self.compressor.scored_deferred:
            self.compressor.select_deferred(caches, space, self.layout)
            return max_layers
        return self.compressor.score_deferred(caches, self.layout, max_layers)

    @property
    def scored_ahead(self) -> bool:
        """Selected ahead of the copy (a deferred plan no longer deferred, its masks set)."""
        return self.deferred_bound is not None and not self.compressor.deferred and self.compressor.masks is not None

    def compact(self, caches: list[Tensor], compaction: Compaction, space: PageSpace) -> CompactedRequest:
        dest = torch.tensor(compaction.block_ids, dtype=torch.int64)
        return self.compressor.compact(
            caches, dest, space, self.layout, compaction.num_tokens, compaction.tail_block_ids
        )

    def outcome(self, compaction: Compaction) -> CompressionReport:
        """The compacted request's report (what each head kept, blocks freed, when and why)."""
        report = self.compressor.report()
        report.compacted_at_tokens = compaction.num_tokens or self.compressor.decision.num_tokens
        report.compaction_reason = compaction.reason
        return report

    def decode_watcher(self, pages: CompactedRequest) -> DecodeCompressor | None:
        """With ``decode_budget``: the compacted request's decode-time compression (tokens generated before a lazy
        compaction were kept whole by every head: they are generated KV)."""
        config = self.compressor.config
        if not config.decode_compression:
            return None
        generated = pages.num_compacted_tokens - self.compressor.decision.num_tokens
        return DecodeCompressor(config, pages.kept - generated, pages.num_compacted_tokens, generated)

    def cancelled(self, reason: str) -> CompressionReport:
        return self.compressor.report(reason)

    def uncompacted_reason(self, preempted: bool) -> str:
        """Why the request left with this plan still waiting for blocks."""
        if preempted:
            return "preempted before its KV was compacted (vLLM recomputes it when it resumes)"
        if self.compressor.config.eviction == "lazy":
            return "lazy eviction: memory was not short while it ran, its full KV was kept"
        return "finished before its KV was compacted"


class DecodeJob(CompactionJob):
    """A decode-time compaction: the generated entries of ``source`` (its head pages, or its own blocks seen as head
    pages for a request whose prompt stayed whole: ``own_blocks``, its vLLM blocks then) scored at ``num_tokens``
    tokens, down to ``decode_budget``.

    Under asynchronous scheduling the plan reaches the scheduler once the next step was scheduled, and that step
    writes its token into the request's pages before the copy runs: the copy carries such tokens over, every head
    keeping them (``Compaction.num_tokens``, as a lazy prompt compaction carries the tokens generated before it)."""

    kind: ClassVar[Literal["decode"]] = "decode"

    def __init__(
        self,
        req_id: str,
        decode: DecodeCompressor,
        source: CompactedRequest,
        num_tokens: int,
        layout: CacheLayout,
        own_blocks: Tensor | None = None,
    ):
        self.req_id, self.decode, self.source, self.num_tokens, self.layout = req_id, decode, source, num_tokens, layout
        self.own_blocks = own_blocks
        self._layers_seen = 0

    def observe_layer(self, layer: int, query: Tensor, kv_cache: Tensor, scale: float) -> None:
        self.decode.score_layer(layer, self.source, kv_cache, self.layout, scale, self.num_tokens)
        self._layers_seen += 1

    @property
    def fully_observed(self) -> bool:
        return self._layers_seen == self.decode.num_layers

    def select(self, space: PageSpace) -> int:
        return self.decode.select(self.source, self.num_tokens).keep_blocks

    def plan_report(self, keep_blocks: int) -> CompressionReport:
        plan = self.decode.pending
        assert plan is not None  # (selected in this step)
        plan.keep_blocks = keep_blocks
        return CompressionReport(
            req_id=self.req_id,
            num_prompt_tokens=plan.num_tokens,
            method=self.decode.config.method,
            keep_blocks=keep_blocks,
            kept=plan.kept.tolist(),
            block_size=self.source.block_size,
            pooled_pages=self.source.space.is_pooled,
            num_cached_tokens=plan.shared_blocks * self.source.block_size,
            decode=True,
            decode_tokens_evicted=plan.evicted,
        )

    def compact(self, caches: list[Tensor], compaction: Compaction, space: PageSpace) -> CompactedRequest:
        plan = self.decode.pending
        assert plan is not None  # (the plan the scheduler answered)
        num_tokens = max(compaction.num_tokens, plan.num_tokens)
        # Tokens carried over start vLLM blocks of their own past the plan's: the scheduler gave a fresh one for each.
        block_size = self.source.block_size
        needed = (
            plan.keep_blocks
            - self.source.shared_blocks
            + cdiv(num_tokens, block_size)
            - cdiv(plan.num_tokens, block_size)
        )
        dest = torch.tensor(compaction.block_ids, dtype=torch.int64)
        if dest.numel() != needed:
            raise ValueError(f"rcstat: {dest.numel()} fresh blocks allocated, {needed} needed")
        source, masks = self.source, plan.masks
        if num_tokens > plan.num_tokens:
            if self.own_blocks is not None:  # (its own blocks, now with those the carried tokens started)
                blocks = torch.cat([self.own_blocks, torch.tensor(compaction.tail_block_ids, dtype=torch.int64)])
                source = CompactedRequest.uncompressed(num_tokens, space, blocks, self.source.shared_blocks)
            masks = with_carried_entries(masks, self.source.lengths(plan.num_tokens), num_tokens - plan.num_tokens)
        pages = recompact_request(
            caches, source, num_tokens, masks, dest, self.layout, staged=compaction.reuses_own_blocks
        )
        self.decode.compacted()
        logger.debug(
            "rcstat: request %s: decode-time compaction %d at %d tokens (%d carried over): %d generated entries "
            "evicted, %d blocks held",
            self.req_id,
            self.decode.compactions,
            plan.num_tokens,
            num_tokens - plan.num_tokens,
            plan.evicted,
            plan.keep_blocks,
        )
        return pages

    def cancelled(self, reason: str) -> None:
        assert self.decode.pending is not None  # (the plan the scheduler refused)
        logger.debug(
            "rcstat: request %s: decode-time compaction at %d tokens skipped: %s",
            self.req_id,
            self.decode.pending.num_tokens,
            reason,
        )
        self.decode.cancelled()
        return None
