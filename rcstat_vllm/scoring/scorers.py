"""Former home of the scorers, kept as an import path: the interface is in :mod:`rcstat_vllm.scoring.base`, the
methods in :mod:`rcstat_vllm.scoring.methods` (one module each). Import from ``rcstat_vllm.scoring`` instead."""

from .base import PagedPrompt, Scorer, group_queries, smooth_scores
from .methods import (
    SCORERS,
    KnormScorer,
    RandomScorer,
    RCScorer,
    SnapKVScorer,
    StreamingLLMScorer,
    TOVAScorer,
    get_scorer,
)

__all__ = [
    "Scorer",
    "PagedPrompt",
    "RCScorer",
    "SnapKVScorer",
    "TOVAScorer",
    "KnormScorer",
    "StreamingLLMScorer",
    "RandomScorer",
    "SCORERS",
    "get_scorer",
    "group_queries",
    "smooth_scores",
]
