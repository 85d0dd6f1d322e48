"""The scoring methods, one per module, each a :class:`~rcstat_vllm.scoring.base.Scorer` dataclass whose fields
are its knobs. Which exist, and where: :data:`rcstat_vllm.scoring.registry.REGISTRY` (torch-free); here they are
loaded (``none``, the config's off switch, is not a scorer: the caller skips scoring altogether)."""

from __future__ import annotations

from ..base import Scorer
from ..registry import REGISTRY
from ..registry import method as registered

__all__ = ["SCORERS", "get_scorer"]

#: The scorer class of every registered method, by name.
SCORERS: dict[str, type[Scorer]] = {name: line.load() for name, line in REGISTRY.items()}


def get_scorer(method: str, **options) -> Scorer:
    """Build the scorer registered under ``method`` with its knobs ``options``.

    Raises:
        ValueError: unknown method (the message lists the allowed ones), or an option the method does not have
            (the message lists its options).
    """
    registered(method)  # the unknown-method error, listing the allowed names
    scorer_cls = SCORERS[method]
    unknown = sorted(set(options) - set(scorer_cls.options()))
    if unknown:
        raise ValueError(
            f"scoring method {method!r} has no option {unknown[0]!r}; its options: {', '.join(scorer_cls.options())}"
        )
    return scorer_cls(**options)
