"""The scoring methods, one per module, each a :class:`~rcstat_vllm.scoring.base.Scorer` dataclass whose fields
are its knobs; :data:`SCORERS` registers them by the config's method name (``none``, the config's off switch, is
not a scorer: the caller skips scoring altogether)."""

from __future__ import annotations

from ..base import Scorer
from .knorm import KnormScorer
from .random import RandomScorer
from .rc import RCScorer
from .snapkv import SnapKVScorer
from .streaming import StreamingLLMScorer
from .tova import TOVAScorer

__all__ = [
    "SCORERS",
    "get_scorer",
    "RCScorer",
    "SnapKVScorer",
    "TOVAScorer",
    "KnormScorer",
    "StreamingLLMScorer",
    "RandomScorer",
]

SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (RCScorer, SnapKVScorer, TOVAScorer, KnormScorer, StreamingLLMScorer, RandomScorer)
}


def get_scorer(method: str, **options) -> Scorer:
    """Build the scorer registered under ``method`` with its knobs ``options``.

    Raises:
        ValueError: unknown method (the message lists the allowed ones), or an option the method does not have
            (the message lists its options).
    """
    try:
        scorer_cls = SCORERS[method]
    except KeyError:
        raise ValueError(
            f"unknown scoring method {method!r}; allowed: {', '.join(sorted(SCORERS))}"
        ) from None
    unknown = sorted(set(options) - set(scorer_cls.options()))
    if unknown:
        raise ValueError(
            f"scoring method {method!r} has no option {unknown[0]!r}; its options: {', '.join(scorer_cls.options())}"
        )
    return scorer_cls(**options)
