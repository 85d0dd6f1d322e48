"""A prompt's compression: decide whether a request is compressed, score it layer by layer during the forward of
its last prefill chunk (or, lazily, at its compaction), select after the last layer, and copy the kept entries into
the scheduler's blocks before a later step's forward (driven by :class:`~rcstat_vllm.worker.jobs.PromptJob`).

Backend-agnostic: works on cache tensors ``[num_blocks, H, N, 2D]`` through a :class:`CacheLayout` and the
request's block row, so the CPU and CUDA backends share it (only the attention kernels differ). Scoring reads
the keys in place: on CUDA through the Triton paged kernels where the method has one (:func:`triton_scoring`),
otherwise by gathering the keys the scorer reads (never the values of a scorer that does not read them).

Scoring and selection only queue device work: no host synchronisation per layer. The one device-to-host
transfer is at the end of :meth:`RequestCompressor.select` (the kept counts the page bookkeeping needs; on a CPU,
where reading costs no wait, the page alignment also reads how far the heads' counts move).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.kernels.rc_scoring import triton_available
from rcstat_vllm.log import logger
from rcstat_vllm.paging.compaction import blocks_needed, compact_request, page_aligned_counts, resize_rows
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.paging.page_space import PageSpace, cdiv
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.scoring import PagedPrompt, get_scorer
from rcstat_vllm.scoring.selection import forced_keep_mask, head_consensus, select_keep_masks
from rcstat_vllm.settings import RequestSettings, scorer_options, window_queries
from rcstat_vllm.worker.step import BatchRequest

#: a deferred scoring's working set: the layers scored in one call hold at most this many bytes of float32 keys.
#: Stacking saves dispatches, not arithmetic: it pays at short prompts (SmolLM2, 320 tokens: 17 layers a call, copy
#: step 75 vs 83 ms) and not beyond a cache-sized working set (64 MiB at 2000 tokens: 300 vs 250 ms;
#: ``benchmarks/compaction_step.py``), so at 2000 tokens and more it scores about a layer a call.
DEFERRED_LAYERS_BYTES = 4 << 20


@dataclass(frozen=True)
class CompressionDecision:
    req_id: str
    config: RCStatConfig
    #: tokens in the cache after this step (prompt, plus recomputed output after a preemption)
    num_tokens: int
    #: this request's rows in the step's query tensor
    query_start: int
    query_end: int
    skipped_reason: str | None = None

    def skipped_report(self, num_layers: int, num_heads: int, block_size: int) -> CompressionReport:
        return CompressionReport(
            req_id=self.req_id,
            num_prompt_tokens=self.num_tokens,
            method=self.config.method,
            keep_blocks=cdiv(self.num_tokens, block_size),  # every prompt block: the scheduler frees nothing
            kept=[[self.num_tokens] * num_heads for _ in range(num_layers)],
            skipped_reason=self.skipped_reason,
            block_size=block_size,
        )


def plan_compression(
    request: BatchRequest,
    settings: RequestSettings,
    query_start: int,
    query_end: int,
    disabled_reason: str | None = None,
    saved_queries: int = 0,
) -> CompressionDecision:
    """Whether (and how) a request finishing its prefill this step is compressed; the reason if not.

    ``saved_queries``: trailing queries kept from earlier prefill chunks (chunked prefill).
    """
    config = settings.config
    reason = disabled_reason or settings.invalid
    n = request.num_tokens_after_step
    if reason is None:
        if not config.enabled:
            reason = "method none"
        elif n < config.min_prompt_len:
            reason = f"prompt of {n} tokens is shorter than min_prompt_len={config.min_prompt_len}"
        elif query_end - query_start + saved_queries < config.window:
            reason = "fewer prompt queries than the observation window"
        elif n <= config.window + config.sink_tokens:
            reason = "nothing outside the window and sink tokens"
    return CompressionDecision(request.req_id, config, n, query_start, query_end, reason)


def triton_device(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run where ``tensor`` lives: a CUDA device, with Triton installed. (On CPU Triton
    has only its interpreter, far slower than torch; tests fake this check to run the kernels under it.)"""
    return tensor.is_cuda and triton_available()


def triton_scoring(layout: CacheLayout, kv_cache: torch.Tensor) -> bool:
    """Whether a layer's prompt may be scored by the Triton paged kernels: a GPU layout (``FLASH``) on a device they
    run on. The CPU layouts (``CPU_VEC``, ``CPU_AMX``) always score in torch: vLLM-CPU runs no Triton. The scorer
    then takes its kernel only where it has one (``Scorer.scores_in_triton``)."""
    return layout.paged_kernels and triton_device(kv_cache)


def warm_up_scoring(config: RCStatConfig, layout: CacheLayout, kv_cache: torch.Tensor, num_query_heads: int) -> bool:
    """Compile the server's scoring kernel before the first request: Triton compiles a kernel at its first launch
    for each set of compile-time sizes (query heads per KV head, window, head size, page size, dtype), a
    multi-second stall in a live server. Scores a prompt of two windows read from block 0 of ``kv_cache`` (the
    result is discarded; nothing is written). True when a kernel ran (the server's method has one and the cache is
    on a device it runs on)."""
    if not config.enabled or not triton_scoring(layout, kv_cache):
        return False
    scorer = get_scorer(config.method, **scorer_options(config))
    keys, values = layout.key_value_caches(kv_cache)
    width = window_queries(config)  # what observe_layer hands the scorer for a prompt longer than the window
    num_tokens = 2 * width
    block_row = torch.zeros(cdiv(num_tokens, keys.shape[2]), dtype=torch.int32, device=keys.device)
    prompt = PagedPrompt(keys, values, block_row, num_tokens)
    if not scorer.scores_in_triton(prompt, True):
        return False
    queries = torch.zeros(num_query_heads, width, keys.shape[3], dtype=keys.dtype, device=keys.device)
    scorer.score_paged(queries, prompt, 1.0, use_triton=True)
    return True


def host_copies(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of small device tensors in one transfer (one synchronisation instead of one per tensor)."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu()
    copies = flat.split([t.numel() for t in tensors])
    return [c.view(t.shape).to(t.dtype) for c, t in zip(copies, tensors)]


def deferred_keep_blocks(
    config: RCStatConfig, num_tokens: int, num_layers: int, space: PageSpace, shared_blocks: int = 0
) -> int | None:
    """Lazy eviction in budget mode over pooled pages: the most blocks a request's kept KV can need, known before
    scoring, so its scoring can wait until the scheduler needs its blocks (a request that never meets pressure is
    never scored). The budget fixes how many entries are kept (:func:`select_budget`: ``T - round(ratio * T)`` of the
    ``T`` entries the request computed, or the window and sinks if more, give or take one per layer of rounding);
    only their spread over the heads is unknown: selection packs the entries of the heads above their minimum
    (:func:`page_aligned_masks`), and the bound takes as many heads held at their minimum as the budget allows.
    None where nothing bounds it before scoring: threshold mode, eager eviction, pages per layer."""
    if config.eviction != "lazy" or not config.budget_mode or not space.is_pooled:
        return None
    block_size = space.block_size
    heads = num_layers * space.num_heads
    own = num_tokens - shared_blocks * block_size
    total = heads * own
    forced = min(own, config.window + max(config.sink_tokens - shared_blocks * block_size, 0))  # per head
    kept = min(max(total - round(config.target_ratio * total) + num_layers, heads * forced), total)  # type: ignore[operator]
    # Selection moves the heads' counts to page boundaries (page_aligned_counts): a head held at its minimum keeps
    # its fewest pages (those of its window and sinks and its slots to vLLM's next block), the others' entries and
    # slots are packed. The pages grow with the heads held at their minimum (each holds fewer entries than its
    # pages could), so the bound takes as many as the budget allows: each holding all its pages can without a
    # whole one more (``held_most``), the others every token; counted as holding the minimum.
    to_boundary = -num_tokens % block_size
    fewest = cdiv(forced + to_boundary, block_size)
    held_most = fewest * block_size - to_boundary - 1
    held_up = heads if own <= held_most else min(heads, (total - kept) // (own - held_most))
    rest = max(kept - held_up * forced, 0) + (heads - held_up) * to_boundary
    pages = held_up * fewest + cdiv(rest, block_size)
    return shared_blocks + min(cdiv(pages, heads), cdiv(num_tokens, block_size) - shared_blocks)


def page_aligned_masks(
    masks: list[torch.Tensor],
    scores: list[torch.Tensor],
    config: RCStatConfig,
    num_tokens: int,
    page_size: int,
    pools: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """A selection's per-layer ``[H, n]`` masks with each head's count moved to a page boundary over each page pool's
    heads (``pools``: lists of layers, every layer in one when pooled: :func:`page_aligned_counts`), each head giving
    up its lowest-scored kept entries or taking its best others (:func:`resize_rows`): uneven counts would each
    leave a partial page, about half a block a request. ``scores`` are the selection's, ``config`` its window and
    sinks (of the request's own tokens, after any shared blocks); ``num_tokens`` the request's, whose last page
    keeps room for the tokens to vLLM's next block."""
    stacked = torch.stack(masks)  # [L, H, n]
    num_layers, num_heads, width = stacked.shape
    flat_scores = torch.stack(scores).view(num_layers * num_heads, width)
    forced = forced_keep_mask(flat_scores, config.window, config.sink_tokens)
    priority = flat_scores.masked_fill(forced, float("inf"))  # (a head's order: its scores' own dtype suffices)
    chosen = torch.count_nonzero(stacked, dim=2)
    low = torch.count_nonzero(forced, dim=1).view(num_layers, num_heads)
    held = torch.full_like(chosen, -num_tokens % page_size)
    high = torch.full_like(chosen, width)
    keep = chosen.clone()
    for layers in pools:
        pool = list(layers)
        keep[pool] = page_aligned_counts(
            chosen[pool].flatten(),
            held[pool].flatten(),
            page_size,
            low[pool].flatten(),
            high[pool].flatten(),
            max_pages=cdiv(width, page_size) + 1,
        ).view(len(pool), num_heads)
    aligned = resize_rows(stacked.view(num_layers * num_heads, width), priority, keep.flatten())
    return list(aligned.view(num_layers, num_heads, width).unbind(0))


class RequestCompressor:
    """Compresses one request: each layer is scored as it runs during the forward of the request's last prefill
    chunk (:meth:`observe_layer`); once every layer is scored, :meth:`select` decides what each (layer, head) keeps
    (a model-wide budget needs every layer's scores) and how many blocks that takes; :meth:`compact` copies the
    kept entries into the blocks the scheduler then allocated for them, at the start of the next step.

    Why copy into fresh blocks instead of compacting in place: the request's prompt blocks may be prefix-cache
    entries, or blocks other requests hit and still read; they must stay as they are (they go back to the pool
    as evictable cache entries). Between layers only the scores (``[H, n]`` floats per layer) are held; between
    the steps only the keep masks (``[L, H, n]`` bools).
    """

    def __init__(self, decision: CompressionDecision, num_layers: int, block_row: torch.Tensor):
        self.decision = decision
        self.config = decision.config
        self.block_row = block_row.clone()
        self.scores: list[torch.Tensor | None] = [None] * num_layers
        self.masks: list[torch.Tensor] | None = None
        self.kept: torch.Tensor | None = None
        #: [L, n] bool: prompt token kept by at least one KV head of the layer (OR-ed over TP ranks by the worker)
        self.visible: torch.Tensor | None = None
        #: this rank's heads' agreement on what they keep (selection.head_consensus), known once selected
        self.head_consensus = 0.0
        #: blocks the request keeps (set by the worker: the max over tensor-parallel ranks of blocks_needed)
        self.keep_blocks = 0
        #: prompt tokens served from the prefix cache (computed by an earlier request)
        self.num_cached_tokens = 0
        self.block_size, self.pooled_pages = 0, False
        #: KV heads of this rank (known once selected or planned)
        self.num_kv_heads = 0
        self.scorer = get_scorer(self.config.method, **scorer_options(self.config))
        #: lazy eviction with scoring deferred to the compaction (:func:`deferred_keep_blocks`): per layer, the
        #: observation window's queries and the attention scale, kept until then; None: scored during the prefill
        self.windows: list[tuple[torch.Tensor, float] | None] | None = None

    @property
    def deferred(self) -> bool:
        """Scored at compaction time, from the queries kept at prefill (lazy eviction)."""
        return self.windows is not None

    @property
    def fully_scored(self) -> bool:
        """Every layer seen by the prefill: scored, or its window kept for a deferred scoring."""
        if self.windows is not None:
            return all(window is not None for window in self.windows)
        return all(scores is not None for scores in self.scores)

    def defer_scoring(self) -> None:
        self.windows = [None] * len(self.scores)

    def observe_layer(
        self,
        layer: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        layout: CacheLayout,
        saved_queries: torch.Tensor | None = None,
    ) -> None:
        """During the prefill's last chunk: score the layer now, or (deferred) keep its window's queries."""
        q_window = self.window_of(query, saved_queries)
        if self.windows is not None:
            self.windows[layer] = (q_window.clone(), scale)
        else:
            self.score_window(layer, q_window, kv_cache, scale, layout)

    def window_of(self, query: torch.Tensor, saved_queries: torch.Tensor | None = None) -> torch.Tensor:
        """The observation window's queries ``[Hq, w, D]`` of this request, from the step's ``[T, Hq, D]`` and the
        trailing queries of earlier chunks."""
        d = self.decision
        queries = query[d.query_start : d.query_end]
        if saved_queries is not None:
            queries = torch.cat([saved_queries, queries])
        width = min(window_queries(self.config), queries.shape[0])
        return queries[-width:].transpose(0, 1)  # the model's dtype (the torch path casts to float32)

    def score_deferred(self, caches: list[torch.Tensor], layout: CacheLayout, max_layers: int | None = None) -> int:
        """Score the layers not scored yet from the kept windows (the prompt's keys are still in its blocks: not
        compacted yet); at most ``max_layers`` of them, the first ones, when scoring ahead of the copy
        (:meth:`PromptJob.score_ahead`). Returns the layers scored.

        At the copy this runs inside the step that compacts the request, so its time is that step's stall. On the
        torch path the layers are scored :data:`DEFERRED_LAYERS_BYTES` of gathered keys at a time in one call each
        (:meth:`Scorer.score_layers`: the same scores, a fraction of the dispatches); the Triton kernels (CUDA)
        score layer by layer."""
        windows: list[tuple[torch.Tensor, float]] = self.windows  # type: ignore[assignment]
        # (every layer's window is kept by the time the scheduler asks for the copy or names it to score ahead)
        todo = [layer for layer, scores in enumerate(self.scores) if scores is None][:max_layers]
        scales = {windows[layer][1] for layer in todo}
        if triton_scoring(layout, caches[0]) or len(scales) > 1:
            for layer in todo:
                self.score_window(layer, windows[layer][0], caches[layer], windows[layer][1], layout)
        else:
            step = self._layers_per_call(caches[0], layout)
            for group in (todo[start : start + step] for start in range(0, len(todo), step)):
                prompts, skipped = zip(
                    *(self._prompt_to_score(caches[layer], layout, windows[layer][0].shape[1]) for layer in group)
                )
                scores = self.scorer.score_layers([windows[layer][0] for layer in group], list(prompts), *scales)
                for layer, layer_scores, first_token in zip(group, scores, skipped, strict=True):
                    self.scores[layer] = self._padded(layer_scores, first_token)
        if max_layers is None:
            self.windows = None
        return len(todo)

    def _layers_per_call(self, kv_cache: torch.Tensor, layout: CacheLayout) -> int:
        """Layers whose gathered float32 keys (and values, for a scorer that reads them) fit
        :data:`DEFERRED_LAYERS_BYTES` (at least one)."""
        num_blocks, num_heads, block_size = layout.shape(kv_cache)
        head_dim = kv_cache.numel() // (num_blocks * num_heads * block_size * 2)  # (a key and a value per slot)
        per_layer = num_heads * self.decision.num_tokens * head_dim * 4 * (2 if self.scorer.needs_values else 1)
        return max(1, DEFERRED_LAYERS_BYTES // max(per_layer, 1))

    def _prompt_to_score(
        self, kv_cache: torch.Tensor, layout: CacheLayout, num_queries: int
    ) -> tuple[PagedPrompt, int]:
        """The part of the prompt a scorer reads with ``num_queries`` window queries, and the tokens it skips.

        Blocks served from the prefix cache are kept whole (select): their tokens' scores are never read, so a
        scorer whose scores are local reads the prompt only from the block its first own token's score needs."""
        d = self.decision
        keys, values = layout.key_value_caches(kv_cache)
        prompt = PagedPrompt(keys, values, self.block_row, d.num_tokens)
        shared = self.num_cached_tokens // prompt.block_size * prompt.block_size
        first_block = self.scorer.scored_from(shared, d.num_tokens, num_queries) // prompt.block_size
        return prompt.tail(first_block), first_block * prompt.block_size

    @staticmethod
    def _padded(scores: torch.Tensor, skipped: int) -> torch.Tensor:
        """[H, n]: the skipped tokens score 0 (select reads from the first shared-block boundary on)."""
        return torch.nn.functional.pad(scores, (skipped, 0)) if skipped else scores

    def score_window(self, layer: int, q_window: torch.Tensor, kv_cache: torch.Tensor, scale: float, layout) -> None:
        """Score one layer's prompt tokens per KV head from its window's queries ``[Hq, w, D]``.

        The prompt is read in place from the paged cache (no dense copy of every head's keys and values): by the
        Triton kernels when :func:`triton_scoring` allows and the method has one, else by gathering what the
        scorer reads. The scores stay on the cache's device (no host synchronisation)."""
        prompt, skipped = self._prompt_to_score(kv_cache, layout, q_window.shape[1])
        use_triton = triton_scoring(layout, kv_cache)
        self.scores[layer] = self._padded(
            self.scorer.score_paged(q_window, prompt, scale, use_triton=use_triton), skipped
        )

    @property
    def shared_blocks(self) -> int:
        """Blocks of the prompt served from the prefix cache: they stay shared and uncompressed."""
        return self.num_cached_tokens // self.block_size if self.block_size else 0

    def select(self, space: PageSpace) -> int:
        """Decide what every (layer, head) keeps; returns the blocks this rank's heads need for it.

        Tokens in blocks served from the prefix cache are all kept: those blocks stay shared (other requests may
        be reading them, and copying them into this request's own pages would hold the prefix once per request
        instead of once for all); the budget or threshold applies to the tokens this request computed."""
        self.block_size, self.pooled_pages = space.block_size, space.is_pooled
        shared = self.shared_blocks * space.block_size
        config = dataclasses.replace(self.config, sink_tokens=max(self.config.sink_tokens - shared, 0))
        own_scores = [scores[:, shared:] for scores in self.scores]  # type: ignore[index]
        own = page_aligned_masks(
            select_keep_masks(own_scores, config),
            own_scores,
            config,
            self.decision.num_tokens,
            space.block_size,
            space.pools,
        )
        self.masks = [torch.nn.functional.pad(mask, (shared, 0), value=True) for mask in own]
        kept = torch.stack([mask.sum(dim=1) for mask in self.masks])  # [L, H]
        self.num_kv_heads = kept.shape[1]
        visible = torch.stack([mask.any(dim=0) for mask in self.masks])  # [L, n]
        # (as parts per million, so it travels with the integer copies below)
        consensus = (head_consensus(own, config.window, config.sink_tokens) * 1e6).round()
        # Selection's one device-to-host transfer: the page bookkeeping (blocks_needed, the scheduler's plan, the
        # report) runs on the host; the masks stay on the device for the copy.
        self.kept, self.visible, consensus = host_copies(kept, visible, consensus)
        self.head_consensus = float(consensus) / 1e6
        self.scores = [None] * len(self.scores)
        return blocks_needed(self.kept, self.decision.num_tokens, space, self.shared_blocks)

    def compact(
        self,
        caches: list[torch.Tensor],
        dest_blocks: torch.Tensor,
        space: PageSpace,
        layout: CacheLayout,
        num_tokens: int = 0,
        tail_block_ids: tuple[int, ...] = (),
    ) -> CompactedRequest:
        """Copy the kept entries into ``dest_blocks`` (the scheduler's fresh blocks: ``keep_blocks`` less the shared).

        Lazy eviction compacts later, at ``num_tokens`` tokens: the tokens generated after the prompt are kept by
        every head (they were never scored), read from the prompt's last block and ``tail_block_ids``; each head's
        pages grow by the blocks they span, and so does the allocation."""
        if self.deferred:
            self._score_and_select_within(caches, space, layout, self.keep_blocks)
        n = self.decision.num_tokens
        masks, source_row = self.masks, self.block_row  # (masks: set by select, or by the deferred scoring above)
        extra_blocks = 0
        if num_tokens > n:
            generated = num_tokens - n
            masks = [torch.cat([mask, mask.new_ones(mask.shape[0], generated)], dim=1) for mask in masks]  # type: ignore[union-attr]
            prompt_blocks = cdiv(n, self.block_size)
            tail = torch.tensor(tail_block_ids, dtype=source_row.dtype, device=source_row.device)
            source_row = torch.cat([source_row[:prompt_blocks], tail])
            extra_blocks = cdiv(num_tokens, self.block_size) - prompt_blocks
            if len(tail_block_ids) != extra_blocks:
                raise ValueError(f"rcstat: {len(tail_block_ids)} tail blocks sent for {generated} generated tokens")
        needed = self.keep_blocks + extra_blocks - self.shared_blocks
        if dest_blocks.numel() != needed:
            raise ValueError(f"rcstat: {dest_blocks.numel()} fresh blocks allocated, {needed} needed")
        state = compact_request(caches, source_row, masks, dest_blocks, space, layout, self.shared_blocks)  # type: ignore[arg-type]
        self.masks = None
        return state

    def plan_deferred(self, space: PageSpace, keep_blocks: int) -> int:
        """Deferred scoring: the plan is the budget's bound (:func:`deferred_keep_blocks`), nothing selected yet."""
        self.block_size, self.pooled_pages = space.block_size, space.is_pooled
        self.num_kv_heads = space.num_heads
        return keep_blocks

    @property
    def scored_deferred(self) -> bool:
        """A deferred plan whose every layer is scored: only its selection is left before the copy."""
        return self.deferred and all(scores is not None for scores in self.scores)

    def select_deferred(self, caches: list[torch.Tensor], space: PageSpace, layout: CacheLayout) -> None:
        """Select a deferred plan ahead of its copy, once :attr:`scored_deferred` (the scheduler expects its copy
        soon): what each head keeps, within the blocks allocated for the plan, as :meth:`compact` would select it
        (the prompt's scores, the shared blocks and the bound do not change while it waits); its copy then only
        copies."""
        assert self.scored_deferred
        self._score_and_select_within(caches, space, layout, self.keep_blocks)

    def _score_and_select_within(self, caches, space: PageSpace, layout: CacheLayout, allocated: int) -> None:
        """Deferred scoring at compaction time: score, select, and check the selection fits the blocks the scheduler
        allocated from the bound. Only non-finite scores (forced keeps) can exceed it; then the budget tightens
        until the kept entries fit, logged."""
        self.score_deferred(caches, layout)
        scores = list(self.scores)
        needed = self.select(space)
        while needed > allocated:
            ratio = self.config.target_ratio
            assert ratio is not None  # (deferred scoring is budget mode only)
            if ratio >= 0.99:
                raise RuntimeError(
                    f"rcstat: request {self.decision.req_id}: its forced keeps need {needed} blocks, "
                    f"{allocated} were allocated"
                )
            self.config = dataclasses.replace(self.config, target_ratio=min(0.99, ratio + 0.05))
            logger.warning(
                "rcstat: request %s: %d blocks needed, %d allocated: evicting %.2f instead",
                self.decision.req_id,
                needed,
                allocated,
                self.config.target_ratio,
            )
            self.scores = list(scores)
            needed = self.select(space)

    def report(self, skipped_reason: str | None = None) -> CompressionReport:
        """The outcome (or the plan, before the copy); with ``skipped_reason`` the request stays uncompressed."""
        if skipped_reason is None and self.kept is None:  # a deferred plan: the bound, nothing scored yet
            return CompressionReport(
                req_id=self.decision.req_id,
                num_prompt_tokens=self.decision.num_tokens,
                method=self.config.method,
                keep_blocks=self.keep_blocks,
                block_size=self.block_size,
                pooled_pages=self.pooled_pages,
                num_cached_tokens=self.num_cached_tokens,
                lazy=True,
            )
        if skipped_reason is not None:
            n = self.decision.num_tokens
            return CompressionReport(
                req_id=self.decision.req_id,
                num_prompt_tokens=n,
                method=self.config.method,
                keep_blocks=cdiv(n, self.block_size),
                kept=[[n] * self.num_kv_heads for _ in range(len(self.scores))],
                skipped_reason=skipped_reason,
                block_size=self.block_size,
                num_cached_tokens=self.num_cached_tokens,
            )
        assert self.kept is not None and self.visible is not None  # (selected)
        return CompressionReport(
            req_id=self.decision.req_id,
            num_prompt_tokens=self.decision.num_tokens,
            method=self.config.method,
            keep_blocks=self.keep_blocks,
            kept=self.kept.tolist(),
            block_size=self.block_size,
            pooled_pages=self.pooled_pages,
            layer_global_eviction=(~self.visible).float().mean(dim=1).tolist(),
            global_eviction_ratio=float((~self.visible.any(dim=0)).float().mean()),
            head_consensus=self.head_consensus,
            num_cached_tokens=self.num_cached_tokens,
            lazy=self.config.eviction == "lazy",
            budget_tightened_to=(
                self.config.target_ratio if self.config.target_ratio != self.decision.config.target_ratio else None
            ),
        )
