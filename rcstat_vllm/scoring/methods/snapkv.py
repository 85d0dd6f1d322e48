"""SnapKV (Li et al. 2024): the observation window's attention to each token, averaged, then pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import PagedPrompt, Scorer, check_odd, mark_window_kept, smooth_scores


def window_attention(queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Causal softmax attention of the w window queries over all n keys, float32.

    Args:
        queries: [Hkv, G, w, d], the queries of positions n-w..n-1; keys: [Hkv, n, d].
    Returns:
        [Hkv, G, w, n]: window query j (absolute position n-w+j) sees keys 0..n-w+j.
    """
    w, n = queries.shape[2], keys.shape[1]
    logits = torch.einsum("hgjd,hnd->hgjn", queries.float(), keys.float()) * scale
    # Key i is in query j's future when i > n - w + j.
    future = torch.ones(w, n, dtype=torch.bool, device=keys.device).triu(diagonal=n - w + 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


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
    default_window_size = 64

    kernel_size: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kernel_size = check_odd("kernel_size", self.kernel_size)

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

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        # The kernel averages the G query heads before pooling: equal to pooling first, the mean being linear.
        return prompt.kernel_dtype

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        # lazy: it imports this module
        from rcstat_vllm.kernels.snapkv_scoring import snapkv_scores_paged

        queries = self._paged_window(q_window, prompt)
        # Softmax of logits * scale (the kernel takes the layer's scale, as :meth:`score`), pooled: [Hkv, n - w'].
        scores = snapkv_scores_paged(
            queries, prompt.keys, prompt.block_table, prompt.num_tokens, scale, self.kernel_size
        )
        return mark_window_kept(scores, queries.shape[1])
