"""Uniform random scores: a floor for every other method."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..base import Scorer


@dataclass(eq=False)
class RandomScorer(Scorer):
    """Uniform random scores in [0, 1).

    Drawn on the CPU from a generator seeded once at construction, so a given sequence of calls is reproducible
    on any device (each call draws fresh scores).

    Attributes:
        seed: the generator's seed.
    """

    name = "random"
    needs_keys = False

    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        scores = torch.rand(keys.shape[:2], generator=self._generator, dtype=torch.float32)
        return scores.to(keys.device)
