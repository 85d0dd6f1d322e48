"""Decode-time compression (``decode_budget``): a request's heads evict generated tokens too.

Long outputs (reasoning, long answers) put most of a request's KV in the tokens it generates. With
``decode_budget`` set, once a request's KV heads hold on average ``decode_budget + decode_interval`` generated
entries, the step that writes that token scores every layer's heads over their generated entries as the layer's
attention finishes, with the request's method and the queries of its last ``window`` generated tokens (kept from
the steps that computed them, as the prompt path keeps its window's), and selects ``decode_budget`` entries per head
on average, different numbers per head (a layer's budget over all its heads, as ``select_budget`` does for prompts),
each head's count then on a page boundary (:func:`~rcstat_vllm.paging.compaction.page_aligned_counts`);
the window itself is always kept, the prompt's kept entries are never rescored. The plan goes to the scheduler as a
prompt's does; the next step copies the kept entries into the blocks it gives
(:func:`~rcstat_vllm.paging.compaction.recompact_request`; staged when they include the request's own, under pressure)
and the request's old blocks go back to the pool. A request whose prompt stayed whole is compacted the same way, the
first time from its own blocks (:meth:`~rcstat_vllm.paging.head_pages.CompactedRequest.uncompressed`). When the pool is
about to run short the scheduler brings a compaction forward (:mod:`rcstat_vllm.engine.decode_pressure`,
:meth:`DecodeCompressor.hurry`): due once a window of queries is saved, evicting what then exceeds the budget.

One :class:`DecodeCompressor` per request with ``decode_budget`` on the worker, owned by its record
(:mod:`rcstat_vllm.worker.requests`); the worker (:mod:`rcstat_vllm.worker.driver`) drives it. Torch, and on CUDA RC's
Triton kernel over the head pages (:mod:`rcstat_vllm.kernels.decode_scoring`); no vLLM. A due step reads nothing back
from the device until its selection's end (:func:`kept_on_host`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcstat_vllm.config import OBSERVING_METHODS, RCStatConfig
from rcstat_vllm.kernels.paged import host_to_device
from rcstat_vllm.paging.compaction import blocks_needed, own_slots, page_aligned_counts, top_per_row
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.paging.page_space import cdiv
from rcstat_vllm.scoring import forced_keep_mask, get_scorer, relative_to_head_mean, select_budget
from rcstat_vllm.settings import decode_queries, scorer_options
from rcstat_vllm.worker.prompt_compression import triton_scoring


def kept_on_host(kept: Tensor) -> Tensor:
    """The decode-time compaction's one host synchronisation, at the end of its due step's selection: each (layer,
    head)'s kept entries ``[L, H]``, which the blocks it needs and the plan the scheduler receives are counted in."""
    return kept.cpu()


def with_carried_entries(masks: list[Tensor], lengths: Tensor, carried: int) -> list[Tensor]:
    """A plan's per-layer ``[H, m]`` masks over each head's entries (``lengths`` ``[L, H]`` of them when it was made)
    with the ``carried`` entries every head stored since kept: head h's entries ``lengths[h]`` to ``lengths[h] +
    carried - 1`` (the tokens of a step that ran between the plan and its copy, under asynchronous scheduling)."""
    extended = []
    for mask, ends in zip(masks, lengths):
        width = int(ends.max()) + carried
        entry = torch.arange(width).unsqueeze(0)
        ends = ends.unsqueeze(1)
        new = host_to_device((entry >= ends) & (entry < ends + carried), mask.device)
        # (a plan's mask is False past each head's entries: cut or padded to the new width)
        old = torch.nn.functional.pad(mask[:, :width], (0, max(width - mask.shape[1], 0)))
        extended.append(old | new)
    return extended


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
        #: per layer, this step's generated-entry scores ``[H, width]``, right-aligned, -inf before each head's first
        #: entry (:meth:`~rcstat_vllm.scoring.Scorer.score_ragged`), on the cache's device (while a step scores it)
        self.scores: list[Tensor | None] = [None] * self.num_layers
        #: the plan sent to the scheduler, until its compaction runs (or is cancelled)
        self.pending: DecodePlan | None = None
        self.compactions = 0
        self.tokens_evicted = 0
        #: tokens in the cache at which the next decode-time compaction is due: once the heads hold ``budget +
        #: interval`` generated entries on average, then every ``interval`` tokens (after a compaction each head holds
        #: ``budget`` on average). Counted in tokens, not per head, so every tensor-parallel rank is due in the same
        #: step (their heads differ). A window of queries is saved first.
        self.next_due = num_tokens + max(self.budget + self.interval - generated, self.num_queries)
        #: the heads held ``held`` generated entries on average when the request had ``since`` tokens
        self.held, self.since = generated, num_tokens
        #: the scheduler asked for the next compaction (the pool is about to run short): it starts when due, never
        #: waits its turn behind others due in the same step (:class:`~rcstat_vllm.worker.step_plan.DueCompactions`)
        self.hurried = False

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
            self.hurried = True

    def overdue(self, num_tokens: int) -> int:
        """Tokens since the compaction fell due (0 in its due step; it may wait a few steps for its turn)."""
        return num_tokens - self.next_due

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
        once this step's queries are saved). Each head is scored over its own entries: heads hold different ones.

        Read in place from the head pages by the scorer's Triton kernel where :func:`triton_scoring` allows and the
        scorer has one (RC: :meth:`~rcstat_vllm.scoring.Scorer.score_head_pages`), else gathered through the layout
        in torch (:meth:`~rcstat_vllm.scoring.Scorer.score_ragged`, the reference). What each head holds is the
        worker's host bookkeeping: the scores stay on the cache's device and nothing is read back."""
        queries = self.queries[layer]
        if queries is None:  # (fewer than num_queries, when decode_interval is shorter: the scorer uses them)
            raise RuntimeError("rcstat: decode-time scoring without the window's queries")
        starts = self.prompt_entries[layer]  # each head's first generated entry
        counts = state.lengths(num_tokens)[layer] - starts  # (host tensors)
        width = int(counts.max())
        cache = state.space.cache(layer, kv_cache)
        q_window = queries.transpose(0, 1)  # [Hq, num_queries, D]
        if triton_scoring(layout, kv_cache):
            keys_view, _ = layout.key_value_caches(cache)
            if self.scorer.head_pages_kernel_applies(keys_view, q_window.shape[1], counts):
                self.scores[layer] = self.scorer.score_head_pages(
                    q_window, keys_view, state.tables[layer], starts, counts, scale
                )
                return
        # Right-aligned [H, width] entry indices (a head's latest entries last, as the window's queries see them);
        # the padding before a head's first generated entry repeats it and is never scored (score_ragged).
        columns = torch.arange(width) - width + counts.unsqueeze(1)
        entries = host_to_device(starts.unsqueeze(1) + columns.clamp_min(0), kv_cache.device)
        tables = host_to_device(state.tables[layer], kv_cache.device)
        pages = torch.gather(tables, 1, entries // state.block_size)
        offsets = entries % state.block_size
        if self.scorer.reads_values:
            keys, values = layout.read(cache, pages, offsets)
            values = values.float()
        else:  # (most scorers: the values' gather would be as large as the keys' and unread)
            keys, values = layout.read_keys(cache, pages, offsets), None
        # right-aligned [H, width], -inf before each head's first entry: the layout select reads
        self.scores[layer] = self.scorer.score_ragged(q_window.float(), keys.float(), values, counts.tolist(), scale)

    def _comparable(self, scores: Tensor) -> Tensor:
        """A layer's right-aligned ``[H, width]`` generated-entry scores (non-finite before each head's first entry),
        made comparable across its heads, float64. RC: each head's relative to its own mean (non-window, finite)
        score, i.e. Eq. 9's threshold rule with one ``c`` per layer that meets the budget; on generated text, raw RC
        scores let one head keep up to 45x another's share and starve heads down to the window
        (benchmarks/decode_quality.py: value error 0.054 head-relative vs 0.063 raw at budget 512 of 2048, SnapKV
        0.060). Other methods' scores are compared as they are, as their prompt budgets do."""
        if self.config.method == "rc":
            return relative_to_head_mean(scores, self.window)
        return scores.to(torch.float64)

    def _budget(self, layer: int, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer ``layer``'s choice over each head's generated entries: ``[H, width]`` priorities (right-aligned,
        the window and non-finite scores at +inf, the columns before a head's first generated entry lowest), the
        entries each head keeps by the budget (``decode_budget`` per head on average over the layer) and those it
        must keep, ``[H]`` each, on the scores' device. Tensor ops over host-known shapes: nothing is read back."""
        scores = self.scores[layer]
        assert scores is not None  # (every layer is scored before the due step selects)
        device, width = scores.device, scores.shape[1]
        counts = lengths - self.prompt_entries[layer]
        # Right-aligned so that every head's last `window` columns are its latest tokens (the window, always kept);
        # columns before a head's first generated entry score lowest and are never chosen (the budget is below the
        # entries there are).
        generated = host_to_device(torch.arange(width) >= width - counts.unsqueeze(1), device)
        padded = self._comparable(scores).masked_fill(~generated, torch.finfo(torch.float64).min)
        ratio = max(0.0, 1.0 - self.budget / width)  # (the widest head holds more than the budget when due)
        chosen = select_budget(padded, self.window, ratio).counts
        forced = forced_keep_mask(padded, self.window)
        return padded.masked_fill(forced, float("inf")), chosen, forced.sum(dim=1)

    def _keep_mask(self, layer: int, lengths: Tensor, priority: Tensor, keep: Tensor) -> Tensor:
        """Layer ``layer``'s ``[H, max(lengths)]`` keep mask over each head's entries: its prompt's first, all kept;
        then of its generated ones the ``keep[h]`` first in ``priority`` (:meth:`_budget`). On the scores' device."""
        device, width = priority.device, priority.shape[1]
        starts = self.prompt_entries[layer]
        kept = top_per_row(priority, keep)  # [H, width]
        # Entry j of head h: its prompt's when j < starts[h] (kept), else generated entry j, at keep's column
        # j - lengths[h] + width, while j < lengths[h].
        entry = torch.arange(int(lengths.max()))
        prompt = host_to_device(entry < starts.unsqueeze(1), device)
        in_generated = host_to_device((entry >= starts.unsqueeze(1)) & (entry < lengths.unsqueeze(1)), device)
        column = host_to_device((entry - lengths.unsqueeze(1) + width).clamp(0, width - 1), device)
        return prompt | (in_generated & torch.gather(kept, 1, column))

    def select(self, state: CompactedRequest, num_tokens: int) -> DecodePlan:
        """After the due step's last layer: what each head keeps, and the blocks that takes.

        The masks are made on the device without reading it; the step's one host synchronisation is at the end
        (:func:`kept_on_host`): the heads' kept counts, which the block count and the plan sent to the scheduler
        need as host ints."""
        lengths = state.lengths(num_tokens)
        budgets = [self._budget(layer, lengths[layer]) for layer in range(self.num_layers)]
        device = budgets[0][0].device
        # Each head's count moved to a page boundary, over each page pool's heads at once (all layers' when pooled):
        # the pages the budget's counts fill packed together, where uneven heads would each leave a partial page.
        held = host_to_device(own_slots(self.prompt_entries, num_tokens, state.block_size, state.shared_blocks), device)
        generated = lengths - self.prompt_entries  # (host tensors)
        has = host_to_device(generated, device)
        chosen = torch.stack([counts for _, counts, _ in budgets])  # [L, H]
        forced = torch.stack([must for _, _, must in budgets])
        keep = chosen.clone()
        max_pages = cdiv(int(generated.max()), state.block_size) + 1
        for layers in state.space.pools:
            pool = list(layers)
            keep[pool] = page_aligned_counts(
                chosen[pool].flatten(),
                held[pool].flatten(),
                state.block_size,
                forced[pool].flatten(),
                has[pool].flatten(),
                max_pages=max_pages,
            ).view(len(pool), -1)
        masks = [
            self._keep_mask(layer, lengths[layer], priority, keep[layer])
            for layer, (priority, _, _) in enumerate(budgets)
        ]
        self.scores = [None] * self.num_layers
        self.queries = [None] * self.num_layers
        kept = kept_on_host(torch.stack([mask.sum(dim=1) for mask in masks]))
        evicted = int((lengths - kept).sum())  # generated entries dropped (the prompt's are all kept)
        keep_blocks = blocks_needed(kept, num_tokens, state.space, state.shared_blocks)
        self.pending = DecodePlan(num_tokens, masks, kept, evicted, keep_blocks, state.shared_blocks)
        return self.pending

    def compacted(self) -> None:
        """The pending plan's compaction ran."""
        assert self.pending is not None  # (a plan was sent)
        self.compactions += 1
        self.tokens_evicted += self.pending.evicted
        self.next_due = self.pending.num_tokens + self.interval
        self.held, self.since = self.budget, self.pending.num_tokens
        self.pending, self.hurried = None, False

    def cancelled(self) -> None:
        """The scheduler had no free blocks for the plan's copy: the request goes on as it was and is due again once
        a new window of queries is saved."""
        assert self.pending is not None  # (a plan was sent)
        self.next_due = self.pending.num_tokens + self.num_queries
        self.pending, self.hurried = None, False
