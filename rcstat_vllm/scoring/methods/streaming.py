"""StreamingLLM (Xiao et al. 2024): keep the first tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rcstat_vllm.kernels.paged import host_to_device

from ..base import Scorer


@dataclass(eq=False)
class StreamingLLMScorer(Scorer):
    """StreamingLLM: the first ``n_sink`` tokens score +inf, every other token its position.

    Positions are float32 (exact up to 2^24 tokens), so keeping any top-k (budget mode) keeps the sinks plus the
    k - n_sink most recent tokens, and every head agrees. Under threshold mode the rule becomes "keep tokens after
    c * mean position".

    Attributes:
        n_sink: attention-sink tokens always kept; 4 as published (the config's ``sink_tokens``: the registry line
            shares it, and its check).
    """

    name = "streaming"
    heads_independent = True
    needs_keys = False  # positions only

    n_sink: int = 4

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        num_kv_heads, n = keys.shape[:2]
        positions = torch.arange(n, dtype=torch.float32, device=keys.device)
        positions[: self.n_sink] = float("inf")
        return positions.unsqueeze(0).expand(num_kv_heads, n).clone()

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """Each head's own positions (0 at its first entry, its first ``n_sink`` entries +inf), all heads at once,
        the padding set to -inf."""
        n = keys.shape[1]
        first = torch.tensor([n - length for length in lengths], dtype=torch.float32).unsqueeze(1)
        positions = host_to_device(torch.arange(n, dtype=torch.float32) - first, keys.device)  # [Hkv, n]
        positions = positions.masked_fill((positions >= 0) & (positions < self.n_sink), float("inf"))
        return positions.masked_fill(positions < 0, float("-inf"))
