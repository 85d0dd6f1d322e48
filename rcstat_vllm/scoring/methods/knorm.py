"""Knorm (Devoto et al. 2024): keys with a small L2 norm draw more attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Scorer


@dataclass(eq=False)
class KnormScorer(Scorer):
    """Knorm: score = -||k_i||_2 (no queries)."""

    name = "knorm"
    heads_independent = True

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        return -torch.linalg.vector_norm(keys.float(), dim=-1)
