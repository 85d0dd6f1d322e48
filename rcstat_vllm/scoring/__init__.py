"""Token scoring (RCStat and baselines) and the selection of what each KV head keeps."""

from .rc import (
    expected_rc,
    expected_rc_grouped,
    expected_rc_iot,
    expected_rc_iot_grouped,
    expected_rc_samples,
    rc_lower_bound,
    rc_upper_bound,
)
from .scorers import (
    SCORERS,
    KnormScorer,
    RandomScorer,
    RCScorer,
    Scorer,
    SnapKVScorer,
    StreamingLLMScorer,
    TOVAScorer,
    get_scorer,
)
from .selection import (
    LAYER_COMPARABLE_SCORES,
    KeepSet,
    budget_keep_count,
    select_budget,
    select_budget_across_layers,
    layer_floor_ratio,
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
    "layer_floor_ratio",
    "LAYER_COMPARABLE_SCORES",
    "select_threshold",
]
