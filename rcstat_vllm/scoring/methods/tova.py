"""TOVA (Oren et al. 2024): the last prompt token's attention, averaged over all heads of the layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Scorer, group_queries, mark_window_kept, ragged_padding


@dataclass(eq=False)
class TOVAScorer(Scorer):
    """TOVA: the last prompt token's attention to each token.

    As kvpress's TOVAPress and the TOVA paper, the mean is over *all* Hq query heads, not per group, so every
    KV head gets the same scores. The last token itself gets +inf.
    """

    name = "tova"

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        if self.window_size < 1:
            raise ValueError("TOVA needs the last prompt query (window_size >= 1)")
        num_kv_heads, n = keys.shape[:2]
        last_query = group_queries(q_window[:, -1:], num_kv_heads)  # [Hkv, G, 1, d]
        # The last prompt token sees every key, so no causal mask is needed.
        logits = torch.einsum("hgjd,hnd->hgjn", last_query.float(), keys.float()) * scale
        attention = torch.softmax(logits, dim=-1)[:, :, 0, : n - 1]  # [Hkv, G, n - 1]
        layer_scores = attention.reshape(1, -1, n - 1).mean(dim=1)  # [1, n - 1]: all Hq heads
        return mark_window_kept(layer_scores.expand(num_kv_heads, n - 1), 1)

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """Every head at once, each over its own entries as :meth:`score` of that head alone (its last query's
        attention averaged over the head's own G query heads): the padding masked out of the softmax, then -inf."""
        if self.window_size < 1:
            raise ValueError("TOVA needs the last prompt query (window_size >= 1)")
        num_kv_heads, n = keys.shape[:2]
        padding = ragged_padding(lengths, n, keys.device)
        last_query = group_queries(q_window[:, -1:], num_kv_heads)  # [Hkv, G, 1, d]
        logits = torch.einsum("hgjd,hnd->hgjn", last_query.float(), keys.float()) * scale
        attention = torch.softmax(logits.masked_fill(padding[:, None, None, :], float("-inf")), dim=-1)
        per_head = attention[:, :, 0, : n - 1].mean(dim=1)  # [Hkv, n - 1]: each head's own G query heads
        return mark_window_kept(per_head, 1).masked_fill(padding, float("-inf"))
