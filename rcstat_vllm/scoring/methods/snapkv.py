"""SnapKV (Li et al. 2024): the observation window's attention to each token, averaged, then pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcstat_vllm.kernels import snapkv_scoring as snapkv_kernel
from rcstat_vllm.kernels.paged import check_paged_inputs, gather_paged_tokens
from rcstat_vllm.kernels.snapkv_scoring import window_attention

from ..base import PagedPrompt, Scorer, mark_window_kept, ragged_padding, smooth_scores
from ..registry import knob_default

__all__ = ["SnapKVScorer", "snapkv_scores_paged", "snapkv_scores_paged_reference"]


@dataclass(eq=False)
class SnapKVScorer(Scorer):
    """SnapKV: window attention to each token, averaged, then smoothed by average pooling.

    As kvpress's SnapKVPress: softmax(q k^T * scale) of the window queries with the causal mask, mean over
    the window queries, ``avg_pool1d(kernel_size, stride 1, padding kernel_size // 2)`` along tokens (zero
    padding counted at the edges, PyTorch's default), then the mean over each KV head's G query heads. Window
    tokens get +inf. Computed one KV head at a time so the [G, w, n] attention stays small at long prompts.

    Attributes:
        kernel_size: the pooling width, odd (same-length pooling); 5 as published.
    """

    name = "snapkv"
    heads_independent = True

    kernel_size: int = knob_default("snapkv", "kernel_size")  # (declared on its registry line, as its check)

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        queries = self._trailing_window(q_window, keys)
        w, n = queries.shape[2], keys.shape[1]
        per_head = []
        for kv_head in range(keys.shape[0]):
            attention = window_attention(queries[kv_head : kv_head + 1], keys[kv_head : kv_head + 1], scale)
            per_head.append(attention[..., : n - w].mean(dim=2))  # [1, G, n - w]
        attention_to_token = torch.cat(per_head, dim=0)  # [Hkv, G, n - w]
        pooled = smooth_scores(attention_to_token, self.kernel_size)
        return mark_window_kept(pooled.mean(dim=1), w)

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """Every head at once over its own entries on a GPU: the padding before them masked out of the softmax
        (attention 0, which is also what the pooling's zero padding adds at a head's first entry), then set to -inf.
        On a CPU head by head, as :meth:`score` scores a prompt: all heads' ``[G, w, n]`` attention at once leaves the
        cache (8 heads x 2048 entries, one thread: 15.6 ms against 11.1 head by head). Heads holding fewer entries
        than the window score alone too (:meth:`score` would take fewer queries for them)."""
        w = self._window_length(q_window.shape[1], keys.shape[1])
        if min(lengths) < w or keys.device.type == "cpu":
            return super().score_ragged(q_window, keys, values, lengths, scale)
        return self.score_heads_at_once(q_window, keys, lengths, scale)

    def score_heads_at_once(self, q_window: Tensor, keys: Tensor, lengths: list[int], scale: float) -> Tensor:
        """:meth:`score_ragged`'s one pass over every head (each holding at least the window's entries)."""
        queries = self._trailing_window(q_window, keys)
        w, n = queries.shape[2], keys.shape[1]
        padding = ragged_padding(lengths, n, keys.device)
        attention = window_attention(queries, keys, scale, key_padding=padding)  # [Hkv, G, w, n]
        pooled = smooth_scores(attention[..., : n - w].mean(dim=2), self.kernel_size)
        return mark_window_kept(pooled.mean(dim=1), w).masked_fill(padding, float("-inf"))

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        # The kernel averages the G query heads before pooling: equal to pooling first, the mean being linear.
        return prompt.kernel_dtype

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        queries = self._paged_window(q_window, prompt)
        # Softmax of logits * scale (the kernel takes the layer's scale, as :meth:`score`), pooled: [Hkv, n - w'].
        scores = snapkv_scores_paged(
            queries, prompt.keys, prompt.block_table, prompt.num_tokens, scale, self.kernel_size
        )
        return mark_window_kept(scores, queries.shape[1])


def snapkv_scores_paged_reference(
    q_window: Tensor, key_cache: Tensor, block_table: Tensor, num_tokens: int, scale: float, kernel_size: int = 5
) -> Tensor:
    """Torch reference of :func:`snapkv_scores_paged`: gather keys via the block table and run SnapKVScorer.
    Returns float32 [Hkv, n - w]."""
    _, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    keys = gather_paged_tokens(key_cache, block_table, 0, num_tokens)
    scorer = SnapKVScorer(window_size=w, kernel_size=kernel_size)
    return scorer.score(q_window, keys, keys, scale)[:, : num_tokens - w]


def snapkv_scores_paged(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    scale: float,
    kernel_size: int = 5,
    block_n: int = 32,
) -> Tensor:
    """SnapKV's scores of the non-window tokens read in place: the paged kernel's mean window attention
    (:func:`rcstat_vllm.kernels.snapkv_scoring.snapkv_attention_paged`), pooled along tokens in torch (a
    ``kernel_size``-wide moving average over n floats). Same arguments as the reference: float32 [Hkv, n - w]."""
    # Through the module, so a test's or a GPU check's spy on the launcher sees each launch.
    mean_attention = snapkv_kernel.snapkv_attention_paged(
        q_window, key_cache, block_table, num_tokens, scale, block_n=block_n
    )
    return smooth_scores(mean_attention, kernel_size)
