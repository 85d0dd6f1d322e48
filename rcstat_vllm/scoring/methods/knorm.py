"""Knorm (Devoto et al. 2024): keys with a small L2 norm draw more attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Scorer, ragged_padding


@dataclass(eq=False)
class KnormScorer(Scorer):
    """Knorm: score = -||k_i||_2 (no queries)."""

    name = "knorm"
    heads_independent = True

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        return -torch.linalg.vector_norm(keys.float(), dim=-1)

    def score_ragged(
        self, q_window: Tensor, keys: Tensor, values: Tensor | None, lengths: list[int], scale: float
    ) -> Tensor:
        """Each key's own norm: every head's entries at once, the padding set to -inf."""
        scores = self.score(q_window, keys, values, scale)  # type: ignore[arg-type]
        return scores.masked_fill(ragged_padding(lengths, keys.shape[1], keys.device), float("-inf"))
