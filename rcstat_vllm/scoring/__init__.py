"""Token scoring (RCStat and baselines) and the selection of what each KV head keeps.

``base`` holds the scorer interface, ``methods`` one module per method and the registry (:data:`SCORERS`),
``rc`` the RC statistics, ``selection`` the keep sets."""

from .base import PagedPrompt, Scorer
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
from .rc import (
    expected_rc,
    expected_rc_grouped,
    expected_rc_iot,
    expected_rc_iot_grouped,
    expected_rc_samples,
    rc_lower_bound,
    rc_upper_bound,
)
from .selection import (
    LAYER_COMPARABLE_SCORES,
    KeepSet,
    budget_keep_count,
    layer_floor_ratio,
    relative_to_head_mean,
    select_budget,
    select_budget_across_layers,
    select_threshold,
)

__all__ = [
    "expected_rc",
    "expected_rc_grouped",
    "expected_rc_iot",
    "expected_rc_iot_grouped",
    "expected_rc_samples",
    "rc_lower_bound",
    "rc_upper_bound",
    "SCORERS",
    "Scorer",
    "PagedPrompt",
    "RCScorer",
    "SnapKVScorer",
    "TOVAScorer",
    "KnormScorer",
    "StreamingLLMScorer",
    "RandomScorer",
    "get_scorer",
    "KeepSet",
    "budget_keep_count",
    "select_budget",
    "select_budget_across_layers",
    "relative_to_head_mean",
    "layer_floor_ratio",
    "LAYER_COMPARABLE_SCORES",
    "select_threshold",
]
