"""RCStat: expected relative contextualization (Eq. 6 of the paper)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcstat_vllm.kernels import decode_scoring as decode_kernel
from rcstat_vllm.kernels import rc_scoring as rc_kernel
from rcstat_vllm.kernels.decode_scoring import check_head_inputs, gather_head_entries
from rcstat_vllm.kernels.paged import check_paged_inputs, gather_paged_tokens, host_to_device

from ..base import (
    PAGED_KERNEL_DTYPES,
    PagedPrompt,
    Scorer,
    carry_forward,
    chunk_mean,
    local_contrast,
    mark_window_kept,
    smooth_scores,
    value_weighted,
)
from ..rc import check_group_reduction, check_query_reduction, expected_rc_grouped, over_group, window_self_logits
from ..rc_knobs import RC_DEFAULTS, RC_PAPER

__all__ = [
    "RCScorer",
    "rc_head_scores_paged",
    "rc_head_scores_paged_reference",
    "rc_scores_paged",
    "rc_scores_paged_reference",
]


@dataclass(eq=False)
class RCScorer(Scorer):
    """RCStat: Eq. 6 per query head over the trailing ``window_size`` queries, averaged over each KV head's G
    query heads (or their max: ``group_reduction``); the window tokens get +inf.

    Scale-free (raw logits): the softmax scale multiplies all scores of a layer alike.

    Attributes:
        smoothing: SnapKV-style average pooling along tokens (the config's ``smoothing``): each score is averaged
            over this many neighbours, an odd integer >= 1 (1 = the paper's scores as they are).
        carry_forward: after smoothing, each score is raised to the highest of the ``carry_forward`` scores
            before it (:func:`~rcstat_vllm.scoring.base.carry_forward`; the config's ``carry_forward``), so the
            tokens after a contextualized one are kept with it; 0 = the paper's scores.
        local_contrast: before smoothing, each score is divided by the mean score of the tokens within
            ``contrast_radius`` of it to this power (:func:`~rcstat_vllm.scoring.base.local_contrast`; the config's
            ``local_contrast``), which removes RC's trend towards the prompt's end; 0 = the paper's scores.
        contrast_radius: the tokens on either side whose mean divides a score (the config's ``contrast_radius``).
        query_reduction: how the window's queries combine (the config's ``query_reduction``): ``mean`` = Eq. 6 over
            all of them (the paper's scores), ``max`` = the highest expected RC of the token under any one window
            query (:func:`~rcstat_vllm.scoring.rc.expected_rc_grouped`).
        group_reduction: how a KV head's G query heads combine (the config's ``group_reduction``): ``mean`` =
            RCStat's GQA mean, ``max`` = the query head that reads the token most. Evicting a KV head's entry closes
            the route of every query head of its group, the one that reads the token most included (docs/defaults.md
            "Past the cliff": a copy head's read of a value's digits is not divided by G).
        value_weight: last, each finished score is multiplied by the norm of the token's value in that KV head to
            this power (:func:`~rcstat_vllm.scoring.base.value_weighted`; the config's ``value_weight``): RC says how
            much the window reads a token, the norm how much reading it moves the head's output; 0 = the paper's
            scores (and the values are not read).
        chunk: after carrying, each score is the mean over its chunk of this many tokens, counted from the first
            token scored (:func:`~rcstat_vllm.scoring.base.chunk_mean`; the config's ``chunk``): a head keeps or
            drops a multi-token value together; 1 = the paper's scores.
    """

    name = "rc"
    heads_independent = True

    # The plugin's defaults (RC_DEFAULTS, the config's too), so RCScorer() scores as RCStatConfig() does; the
    # paper's scores: RCScorer.paper().
    smoothing: int = RC_DEFAULTS.smoothing
    carry_forward: int = RC_DEFAULTS.carry_forward
    local_contrast: float = RC_DEFAULTS.local_contrast
    contrast_radius: int = RC_DEFAULTS.contrast_radius
    query_reduction: str = RC_DEFAULTS.query_reduction
    group_reduction: str = RC_DEFAULTS.group_reduction
    value_weight: float = RC_DEFAULTS.value_weight
    chunk: int = RC_DEFAULTS.chunk

    @property
    def needs_value_norms(self) -> bool:
        """Weighted by values, RC reads their norms (and nothing else of them)."""
        return self.value_weight != 0

    @classmethod
    def paper(cls, **knobs) -> RCScorer:
        """The RCStat paper's scorer (:data:`~rcstat_vllm.scoring.rc_knobs.RC_PAPER`: Eq. 6 over an 8-query window,
        no contrast, smoothing or carrying), with ``knobs`` changed."""
        return cls(**{**RC_PAPER.scorer_options(), **knobs})

    def _finish(self, scores: Tensor, window: int, value_norms: Tensor | None) -> Tensor:
        """[Hkv, n - w] per-token RC (already the GQA mean) -> [Hkv, n]: contrasted with its neighbourhood, smoothed,
        carried forward, averaged by chunk, window kept, weighted by ``value_norms`` ``[Hkv, n]`` (None when
        ``value_weight`` is 0)."""
        scores = local_contrast(scores, self.local_contrast, self.contrast_radius)
        scores = carry_forward(smooth_scores(scores, self.smoothing), self.carry_forward)
        scores = chunk_mean(scores, self.chunk)
        return self._weighted(mark_window_kept(scores, window), value_norms)

    def _weighted(self, scores: Tensor, value_norms: Tensor | None) -> Tensor:
        """Finished ``[Hkv, n]`` scores weighted by ``value_norms`` when ``value_weight`` asks (the last step of
        :meth:`_finish` and :meth:`_finish_ragged`)."""
        if not self.needs_value_norms:
            return scores
        if value_norms is None:
            raise ValueError("RC with value_weight needs the prompt's values")
        return value_weighted(scores, value_norms, self.value_weight)

    def _value_norms(self, values: Tensor | None) -> Tensor | None:
        """[Hkv, n] norms of ``values`` ``[Hkv, n, d_v]`` when the scores are weighted by them (else None, unread)."""
        return values.float().norm(dim=-1) if self.needs_value_norms and values is not None else None

    def scored_from(self, first_token: int, num_tokens: int, num_queries: int) -> int:
        """Eq. 6 of a token reads only its own key and the window's; the contrast reads ``contrast_radius`` tokens on
        either side, smoothing ``smoothing // 2`` and carrying the ``carry_forward`` before, a chunk its other
        tokens, so scoring from ``first_token - reach`` gives the whole prompt's scores from ``first_token`` on (the
        window, the last tokens, always read; chunks are counted from where scoring starts, a block boundary)."""
        reach = self.carry_forward + self.smoothing // 2 + (self.contrast_radius if self.local_contrast else 0)
        reach += self.chunk - 1
        window = min(num_queries, self.window_size, num_tokens)
        return max(0, min(first_token - reach, num_tokens - window))

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        queries = self._trailing_window(q_window, keys)
        per_query_head = expected_rc_grouped(queries, keys, self.query_reduction)  # [Hkv, G, n - w]
        return self._finish(self._over_heads(per_query_head), queries.shape[2], self._value_norms(values))

    def _over_heads(self, per_query_head: Tensor) -> Tensor:
        """[Hkv, G, n] each query head's RC -> [Hkv, n] as ``group_reduction`` asks."""
        return over_group(per_query_head, self.group_reduction)

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """Eq. 6 of a token depends only on its key and the window (the last entries, real in every head when each
        holds at least the window): one call for all heads, then each head's own smoothing and carrying over its
        entries alone: :meth:`score` of each head alone, to float rounding (a batched matmul)."""
        queries = self._trailing_window(q_window, keys)
        w = queries.shape[2]
        if min(lengths) < w:
            return super().score_ragged(q_window, keys, values, lengths, scale)
        per_token = self._over_heads(expected_rc_grouped(queries, keys, self.query_reduction))  # [Hkv, n - w]
        return self._finish_ragged(per_token, lengths, w, self._value_norms(values))

    def _finish_ragged(
        self, per_token: Tensor, lengths: list[int], window: int, value_norms: Tensor | None = None
    ) -> Tensor:
        """Right-aligned ``[Hkv, n - w]`` per-entry RC (head ``h``'s last ``lengths[h] - w`` columns its own) ->
        right-aligned ``[Hkv, n]`` scores (-inf before each head's entries), each head finished over its own entries
        alone (contrast, smoothing, carrying, window, weighting by the right-aligned ``[Hkv, n]`` ``value_norms``):
        :meth:`_finish` of each head alone, to float rounding, in one pass over all heads. Why one pass: a decode-time
        compaction finishes every layer's heads in its due step, and head by head that was ~25 small ops per head (on
        an H200, 6 ms a layer at any length).
        The columns before a head's first entry are set to what :meth:`_finish` pads with at that step (0 before
        the contrast and the smoothing, -inf before the carrying), so they never reach its scores; carried, they stay
        -inf (each is the max of -inf columns), as the returned layout wants, and weighting keeps them so."""
        m = per_token.shape[1]
        first = host_to_device(torch.tensor([m - (length - window) for length in lengths]), per_token.device)
        padding = torch.arange(m, device=per_token.device) < first.unsqueeze(1)  # [Hkv, n - w]
        scores = per_token.masked_fill(padding, 0.0)
        scores = local_contrast(scores, self.local_contrast, self.contrast_radius, first=first)
        scores = smooth_scores(scores.masked_fill(padding, 0.0), self.smoothing)
        scores = carry_forward(scores.masked_fill(padding, float("-inf")), self.carry_forward)
        scores = chunk_mean(scores, self.chunk, first=first)  # (the padding stays -inf)
        return self._weighted(mark_window_kept(scores, window), value_norms)

    def head_pages_kernel_applies(self, key_cache: Tensor, num_queries: int, counts: Tensor) -> bool:
        """The decode-time kernel computes :meth:`score_ragged` when the cache's dtype is one it takes and every
        head holds the window (``counts`` host ints; else :meth:`score_ragged` scores each head alone). Weighted by
        values, the worker gathers keys and values and :meth:`score_ragged` scores (the kernel reads keys only)."""
        return (
            not self.needs_value_norms
            and key_cache.dtype in PAGED_KERNEL_DTYPES
            and int(counts.min()) >= min(num_queries, self.window_size)
        )

    def score_head_pages(
        self, q_window: Tensor, key_cache: Tensor, pages: Tensor, starts: Tensor, counts: Tensor, scale: float
    ) -> Tensor:
        """:meth:`score_ragged` of each KV head's entries read in place from its head pages by the Triton kernel
        (:func:`rc_head_scores_paged`; arguments as :func:`rcstat_vllm.kernels.decode_scoring.rc_head_table_scores`,
        ``scale`` unused: RC is scale-free); then each head finished alone, as :meth:`score_ragged` does."""
        w = self._window_length(q_window.shape[1], int(counts.min()))
        queries = q_window[:, q_window.shape[1] - w :]
        per_token = rc_head_scores_paged(
            queries, key_cache, pages, starts, counts, self.query_reduction, group_reduction=self.group_reduction
        )
        return self._finish_ragged(per_token, counts.tolist(), w)

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        return prompt.kernel_dtype

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        queries = self._paged_window(q_window, prompt)
        # [Hkv, n - w'] for the non-window tokens, already over the GQA group; RC is scale-free (no ``scale``).
        scores = rc_scores_paged(
            queries,
            prompt.keys,
            prompt.block_table,
            prompt.num_tokens,
            query_reduction=self.query_reduction,
            group_reduction=self.group_reduction,
        )
        return self._finish(scores, queries.shape[1], prompt.value_norms() if self.needs_value_norms else None)


def rc_scores_paged_reference(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    query_reduction: str = "mean",
    group_reduction: str = "mean",
) -> Tensor:
    """Torch reference of :func:`rc_scores_paged`: gather the request's keys via the block table, then
    :func:`~rcstat_vllm.scoring.rc.expected_rc_grouped` and the GQA mean (or max).

    Args:
        q_window:    [Hq, w, d] queries of the last w prompt positions.
        key_cache:   [num_blocks, Hkv, block_size, d] (strided views fine).
        block_table: [pages] int32 block ids of this request, in token order.
        num_tokens:  n, prompt length.
        query_reduction: ``mean`` (Eq. 6) or ``max`` over the window's queries.
        group_reduction: ``mean`` (RCStat's) or ``max`` over each KV head's query heads.
    Returns:
        float32 [Hkv, n - w] (float64 for float64 inputs).
    """
    group, _ = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    keys = gather_paged_tokens(key_cache, block_table, 0, num_tokens)
    queries = q_window.reshape(keys.shape[0], group, *q_window.shape[1:])
    return over_group(expected_rc_grouped(queries, keys, query_reduction), group_reduction)


def rc_scores_paged(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    block_n: int = 64,
    query_reduction: str = "mean",
    group_reduction: str = "mean",
) -> Tensor:
    """RC's scores of the non-window tokens read in place (same arguments as the reference): float32 [Hkv, n - w].

    What is small is done here in torch: the window's w keys are gathered, its w(w+1)/2 causal self logits per query
    head sorted and prefix-summed (:func:`~rcstat_vllm.scoring.rc.window_self_logits`); the paged kernel
    (:func:`rcstat_vllm.kernels.rc_scoring.rc_table_scores_paged`) then scores every token against that table. The
    queries are cast to the cache's dtype first, the table made from the cast ones: the kernel's logits are too.
    """
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    check_query_reduction(query_reduction)
    num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
    num_scored = num_tokens - w
    if num_scored == 0:
        return torch.empty(num_kv_heads, 0, dtype=torch.float32, device=key_cache.device)
    queries = q_window.to(key_cache.dtype)
    window_keys = gather_paged_tokens(key_cache, block_table, num_scored, num_tokens)
    table = window_self_logits(queries.float().reshape(num_kv_heads, group, w, head_dim), window_keys.float())
    # Through the module, so a test's or a GPU check's spy on the launcher sees each launch.
    return rc_kernel.rc_table_scores_paged(
        queries,
        key_cache,
        block_table,
        num_tokens,
        table.sorted,
        table.prefix,
        table.center,
        max_over_queries=query_reduction == "max",
        max_over_heads=check_group_reduction(group_reduction) == "max",
        block_n=block_n,
    )


def rc_head_scores_paged_reference(
    q_window: Tensor,
    key_cache: Tensor,
    pages: Tensor,
    starts: Tensor,
    counts: Tensor,
    query_reduction: str = "mean",
    group_reduction: str = "mean",
) -> Tensor:
    """Torch reference of :func:`rc_head_scores_paged`: each head's entries gathered through its page list,
    right-aligned (:func:`~rcstat_vllm.kernels.decode_scoring.gather_head_entries`), then
    :func:`~rcstat_vllm.scoring.rc.expected_rc_grouped` and the GQA mean (or max), as :meth:`RCScorer.score_ragged`
    computes them. Arguments as :func:`rcstat_vllm.kernels.decode_scoring.rc_head_table_scores`; float32
    ``[Hkv, width - w]`` (float64 for float64 inputs), 0 before each head's first entry."""
    group = check_head_inputs(q_window, key_cache, pages, starts, counts)
    w, width = q_window.shape[1], int(counts.max())
    keys = gather_head_entries(key_cache, pages, starts, counts, width)
    queries = q_window.reshape(keys.shape[0], group, w, -1)
    per_token = over_group(expected_rc_grouped(queries, keys, query_reduction), group_reduction)
    scored = torch.arange(width - w, device=keys.device) >= (width - counts).to(keys.device).unsqueeze(1)
    return torch.where(scored, per_token, torch.zeros((), dtype=per_token.dtype, device=keys.device))


def rc_head_scores_paged(
    q_window: Tensor,
    key_cache: Tensor,
    pages: Tensor,
    starts: Tensor,
    counts: Tensor,
    query_reduction: str = "mean",
    block_n: int = 64,
    group_reduction: str = "mean",
) -> Tensor:
    """Decode-time RC of each KV head's non-window entries read in place from its head pages (same arguments as the
    reference): float32 ``[Hkv, width - w]``, right-aligned. Each head's w window keys are gathered and its query
    heads' w(w+1)/2 self logits sorted in torch (:func:`~rcstat_vllm.scoring.rc.window_self_logits`, small); the
    kernel (:func:`rcstat_vllm.kernels.decode_scoring.rc_head_table_scores`) scores every entry against that table.
    The queries are cast to the cache's dtype first, the table made from the cast ones. No host synchronisation:
    ``starts`` and ``counts`` are host tensors."""
    group = check_head_inputs(q_window, key_cache, pages, starts, counts)
    check_query_reduction(query_reduction)
    num_kv_heads, w, head_dim = key_cache.shape[1], q_window.shape[1], key_cache.shape[3]
    queries = q_window.to(key_cache.dtype)
    window_keys = gather_head_entries(key_cache, pages, starts + counts - w, torch.full_like(counts, w), w)
    table = window_self_logits(queries.float().reshape(num_kv_heads, group, w, head_dim), window_keys.float())
    # Through the module, so a test's or a GPU check's spy on the launcher sees each launch.
    return decode_kernel.rc_head_table_scores(
        queries,
        key_cache,
        pages,
        starts,
        counts,
        table.sorted,
        table.prefix,
        table.center,
        max_over_queries=query_reduction == "max",
        max_over_heads=check_group_reduction(group_reduction) == "max",
        block_n=block_n,
    )
