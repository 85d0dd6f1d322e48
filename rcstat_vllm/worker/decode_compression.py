"""Decode-time compression (``decode_budget``): a request's heads evict generated tokens too.

Long outputs (reasoning, long answers) put most of a request's KV in the tokens it generates. With
``decode_budget`` set, once a request's KV heads hold on average ``decode_budget + decode_interval`` generated
entries, the step that writes that token scores every layer's heads over their generated entries as the layer's
attention finishes, with the request's method and the queries of its last ``window`` generated tokens (kept from
the steps that computed them, as the prompt path keeps its window's), and selects ``decode_budget`` entries per head
on average, different numbers per head (a layer's budget over all its heads, as ``select_budget`` does for prompts);
the window itself is always kept, the prompt's kept entries are never rescored. The plan goes to the scheduler as a
prompt's does; the next step copies the kept entries into the blocks it gives
(:func:`~rcstat_vllm.paging.compaction.recompact_request`; staged when they include the request's own, under pressure)
and the request's old blocks go back to the pool. A request whose prompt stayed whole is compacted the same way, the
first time from its own blocks (:meth:`~rcstat_vllm.paging.head_pages.CompactedRequest.uncompressed`). When the pool is
about to run short the scheduler brings a compaction forward (:mod:`rcstat_vllm.engine.decode_pressure`,
:meth:`DecodeCompressor.hurry`): due once a window of queries is saved, evicting what then exceeds the budget.

One :class:`DecodeCompressor` per request with ``decode_budget`` on the worker, owned by its record
(:mod:`rcstat_vllm.worker.requests`); the worker (:mod:`rcstat_vllm.worker.driver`) drives it. Plain torch; no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcstat_vllm.config import OBSERVING_METHODS, RCStatConfig
from rcstat_vllm.paging.compaction import blocks_needed
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.scoring import get_scorer, relative_to_head_mean, select_budget
from rcstat_vllm.settings import decode_queries, scorer_options


@dataclass
class DecodePlan:
    """A decode-time compaction chosen in one step: what each head keeps, at how many tokens, in how many blocks."""

    #: tokens in the cache when scored (the compaction copies their kept entries)
    num_tokens: int
    #: per layer, ``[H, m]`` bool over each head's entries (its kept prompt first, then its generated tokens)
    masks: list[Tensor]
    #: [L, H] entries each head keeps (host)
    kept: Tensor
    #: generated entries evicted over all layers and heads
    evicted: int
    #: blocks the request holds afterwards (this rank's; the worker agrees on the max over ranks)
    keep_blocks: int
    #: its first blocks, prefix-cache hits kept as they are (shared)
    shared_blocks: int = 0


class DecodeCompressor:
    """One request's decode-time compression (see the module docstring)."""

    def __init__(self, config: RCStatConfig, prompt_entries: Tensor, num_tokens: int, generated: int = 0):
        """For a request holding ``num_tokens`` tokens, each head's first ``prompt_entries`` ``[L, H]`` entries its
        prompt's (all of it, or what its compaction kept), then its last ``generated`` tokens, every head all of them
        (a prompt compacted lazily, after the request decoded over its full cache)."""
        if config.decode_budget is None:
            raise ValueError("rcstat: decode-time compression without decode_budget")
        self.config = config
        self.budget, self.interval, self.window = config.decode_budget, config.decode_interval, config.window
        #: [L, H] entries of each head that belong to the prompt (never rescored here)
        self.prompt_entries = prompt_entries.clone()
        # The method's scorer as the prompt's is built, over generated entries; a method that observes queries
        # observes the kept window's (``observation_window`` when set): SnapKV's published 64 would be as many as
        # the entries it chooses among.
        observed = config.observation_window or config.window
        options = scorer_options(config)
        if config.method in OBSERVING_METHODS:
            options["window_size"] = observed
        self.scorer = get_scorer(config.method, **options)
        #: queries kept per layer: the observed ones, and at least the always-kept window
        self.num_queries = decode_queries(config)
        #: per layer, the last generated tokens' queries ``[num_queries, Hq, D]`` (None until saved)
        self.queries: list[Tensor | None] = [None] * self.num_layers
        #: per layer, this step's generated-entry scores per head (while a step scores the request)
        self.scores: list[list[Tensor] | None] = [None] * self.num_layers
        #: the plan sent to the scheduler, until its compaction runs (or is cancelled)
        self.pending: DecodePlan | None = None
        #: where the scores and masks live (the KV cache's device), set by :meth:`score_layer`
        self.scores_device = torch.device("cpu")
        self.compactions = 0
        self.tokens_evicted = 0
        #: tokens in the cache at which the next decode-time compaction is due: once the heads hold ``budget +
        #: interval`` generated entries on average, then every ``interval`` tokens (after a compaction each head holds
        #: ``budget`` on average). Counted in tokens, not per head, so every tensor-parallel rank is due in the same
        #: step (their heads differ). A window of queries is saved first.
        self.next_due = num_tokens + max(self.budget + self.interval - generated, self.num_queries)
        #: the heads held ``held`` generated entries on average when the request had ``since`` tokens
        self.held, self.since = generated, num_tokens

    @property
    def num_layers(self) -> int:
        return self.prompt_entries.shape[0]

    def due(self, num_tokens: int) -> bool:
        """Whether the step that brings the request to ``num_tokens`` tokens scores and selects it."""
        return self.pending is None and num_tokens >= self.next_due

    def hurry(self, num_tokens: int) -> None:
        """The pool is about to run short (the scheduler says so, :mod:`rcstat_vllm.engine.decode_pressure`): due once a
        window of queries is saved from this step on (the step that brings the request to ``num_tokens``), unless
        due sooner, a plan is pending, or its heads would then hold too few generated entries to evict a window's
        worth beyond the budget (the scheduler's estimate counts tokens, the heads know)."""
        due_at = num_tokens + self.num_queries - 1
        if self.pending is None and self.held + due_at - self.since >= self.budget + self.window:
            self.next_due = min(self.next_due, due_at)

    def observing(self, num_tokens: int) -> bool:
        """Whether this step's queries may be in the window of a coming decode compaction (saved only then)."""
        return self.pending is None and num_tokens > self.next_due - self.num_queries

    def save_queries(self, layer: int, queries: Tensor) -> None:
        """This step's queries ``[T, Hq, D]`` of the request at ``layer``; the last ``window`` are kept."""
        previous = self.queries[layer]
        joined = queries if previous is None else torch.cat([previous, queries])
        self.queries[layer] = joined[-self.num_queries :].clone()

    def score_layer(
        self, layer: int, state: CompactedRequest, kv_cache: Tensor, layout: CacheLayout, scale: float, num_tokens: int
    ) -> None:
        """Score each head of ``layer`` over its generated entries (run after the layer's attention in the due step,
        once this step's queries are saved). Each head is scored over its own entries: heads hold different ones."""
        queries = self.queries[layer]
        if queries is None:  # (fewer than num_queries, when decode_interval is shorter: the scorer uses them)
            raise RuntimeError("rcstat: decode-time scoring without the window's queries")
        starts = self.prompt_entries[layer]  # each head's first generated entry
        counts = state.lengths(num_tokens)[layer] - starts
        width = int(counts.max())
        # Right-aligned [H, width] entry indices (a head's latest entries last, as the window's queries see them);
        # the padding before a head's first generated entry repeats it and is never scored (score_ragged).
        columns = torch.arange(width) - width + counts.unsqueeze(1)
        entries = (starts.unsqueeze(1) + columns.clamp_min(0)).to(kv_cache.device)
        tables = state.tables[layer].to(kv_cache.device)
        block_size = state.block_size
        pages = torch.gather(tables, 1, entries // block_size)
        keys, values = layout.read(state.space.cache(layer, kv_cache), pages, entries % block_size)
        per_head = self.scorer.score_ragged(
            queries.transpose(0, 1).float(), keys.float(), values.float(), counts.tolist(), scale
        )
        self.scores[layer] = per_head
        self.scores_device = kv_cache.device

    def _comparable(self, scores: Tensor) -> Tensor:
        """One head's generated-entry scores, made comparable with its layer's other heads. RC: relative to the head's
        own mean (non-window) score, i.e. Eq. 9's threshold rule with one ``c`` per layer that meets the budget; on
        generated text, raw RC scores let one head keep up to 45x another's share and starve heads down to the window
        (benchmarks/decode_quality.py: value error 0.054 head-relative vs 0.063 raw at budget 512 of 2048, SnapKV
        0.060). Other methods' scores are compared as they are, as their prompt budgets do."""
        if self.config.method == "rc":
            return relative_to_head_mean(scores.unsqueeze(0), self.window)[0]
        return scores.to(torch.float64)

    def select(self, state: CompactedRequest, num_tokens: int) -> DecodePlan:
        """After the due step's last layer: what each head keeps, and the blocks that takes."""
        lengths = state.lengths(num_tokens)
        masks, evicted = [], 0
        device = self.scores_device
        for layer, per_head in enumerate(self.scores):
            assert per_head is not None  # (every layer is scored before the due step selects)
            generated = torch.tensor([s.numel() for s in per_head])
            width = int(generated.max())
            # Right-aligned so that every head's last `window` columns are its latest tokens (the window, always
            # kept); columns before a head's first generated entry score lowest and are never chosen (the budget
            # is below the entries there are).
            padded = torch.full(
                (len(per_head), width), torch.finfo(torch.float64).min, device=per_head[0].device, dtype=torch.float64
            )
            for head, scores in enumerate(per_head):
                padded[head, width - scores.numel() :] = self._comparable(scores)
            ratio = max(0.0, 1.0 - self.budget / width)  # (the widest head holds more than the budget when due)
            keep = select_budget(padded, self.window, ratio).mask.cpu()
            mask = torch.zeros(len(per_head), int(lengths[layer].max()), dtype=torch.bool)
            for head in range(len(per_head)):
                start, end = int(self.prompt_entries[layer, head]), int(lengths[layer, head])
                mask[head, :start] = True
                mask[head, start:end] = keep[head, width - (end - start) :]
            evicted += int(generated.sum()) - int(mask.sum()) + int(self.prompt_entries[layer].sum())
            masks.append(mask)
        self.scores = [None] * self.num_layers
        self.queries = [None] * self.num_layers
        kept = torch.stack([mask.sum(dim=1) for mask in masks])
        keep_blocks = blocks_needed(kept, num_tokens, state.space, state.shared_blocks)
        self.pending = DecodePlan(
            num_tokens, [m.to(device) for m in masks], kept, evicted, keep_blocks, state.shared_blocks
        )
        return self.pending

    def compacted(self) -> None:
        """The pending plan's compaction ran."""
        assert self.pending is not None  # (a plan was sent)
        self.compactions += 1
        self.tokens_evicted += self.pending.evicted
        self.next_due = self.pending.num_tokens + self.interval
        self.held, self.since = self.budget, self.pending.num_tokens
        self.pending = None

    def cancelled(self) -> None:
        """The scheduler had no free blocks for the plan's copy: the request goes on as it was and is due again once
        a new window of queries is saved."""
        assert self.pending is not None  # (a plan was sent)
        self.next_due = self.pending.num_tokens + self.num_queries
        self.pending = None
