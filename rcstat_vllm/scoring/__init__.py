"""Token scoring (RCStat and baselines) and the selection of what each KV head keeps.

``registry`` names the methods (no torch), ``base`` holds the scorer interface, ``methods`` one module per method
(:data:`SCORERS`, :func:`get_scorer`), ``rc`` the RC statistics, ``rc_knobs`` RC's defaults (no torch),
``selection`` the keep sets.

The names below are imported on first use (PEP 562), not here: the config and the scheduler's settings import
:mod:`rcstat_vllm.scoring.registry`, which runs this module, and must not pull torch in with it.
"""

from __future__ import annotations

import importlib

#: Public name -> the submodule that defines it.
_EXPORTS = {
    **dict.fromkeys(("SCORERS", "get_scorer"), ".methods"),
    **dict.fromkeys(("Scorer", "PagedPrompt"), ".base"),
    "RCScorer": ".methods.rc",
    "SnapKVScorer": ".methods.snapkv",
    "TOVAScorer": ".methods.tova",
    "KnormScorer": ".methods.knorm",
    "StreamingLLMScorer": ".methods.streaming",
    "RandomScorer": ".methods.random",
    **dict.fromkeys(
        (
            "expected_rc",
            "expected_rc_grouped",
            "expected_rc_samples",
            "rc_upper_bound",
        ),
        ".rc",
    ),
    **dict.fromkeys(
        (
            "KeepSet",
            "budget_keep_count",
            "forced_keep_mask",
            "layer_floor_ratio",
            "relative_to_head_mean",
            "relative_to_layer_mean",
            "select_budget",
            "select_budget_across_layers",
            "select_threshold",
        ),
        ".selection",
    ),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
