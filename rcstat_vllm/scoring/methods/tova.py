"""TOVA (Oren et al. 2024): the last prompt token's attention, averaged over all heads of the layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Scorer, group_queries, mark_window_kept


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
