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

__all__ = [
    "expected_rc",
    "expected_rc_grouped",
    "expected_rc_iot",
    "expected_rc_iot_grouped",
    "expected_rc_samples",
    "rc_lower_bound",
    "rc_upper_bound",
]
