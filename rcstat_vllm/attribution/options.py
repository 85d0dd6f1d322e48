"""Attribution options: how heads are ranked and what the streaming trace keeps (validated, with clear errors)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rcstat_vllm.attribution.estimators import SPAN_SCORES, TOKEN_WEIGHTINGS
from rcstat_vllm.config import ConfigError, is_int, is_number

ESTIMATORS = ("auto", "exact", "upper")
#: Which heads score the spans: ``auto`` = the model's calibrated heads when its calibration file is there
#: (rcstat_vllm.attribution.calibration), else the RC ranking; ``rc`` = always the RC ranking (Step 1).
HEAD_CHOICES = ("auto", "rc")


@dataclass(frozen=True)
class AttributionOptions:
    """How heads are ranked and what the streaming trace keeps.

    Attributes:
        k: number of top heads; None = ``top_fraction`` of all (layer, query head) pairs, at least 1.
        top_fraction: share of heads kept when ``k`` is None (paper: about 2%).
        estimator: ``exact`` (mean over all pairs, Eq. 6), ``upper`` (Algorithm 1) or ``auto`` (exact while
            the generation has at most ``exact_max_tokens`` tokens, the upper bound beyond).
        exact_max_tokens: the switch of ``auto``.
        sink_tokens: the first prompt tokens left out of X in head ranking (not of span scoring). 0 = the
            paper's definition (all prompt tokens).
        warmup_tokens: streaming: generated tokens recorded for every head before pruning to candidates;
            None = never prune (keeps every head: the reference computation).
        candidate_factor: streaming: candidates kept after the warm-up = this many times k.
        max_generated_tokens: streaming: generated tokens recorded at most (later ones are not attributed).
        span_score: how a prompt span's score is read from the RC of its tokens (:data:`SPAN_SCORES`):
            ``mean`` is Eq. 10 as the paper writes it; the others choose tokens of the span first. Default
            ``window``: Eq. 10 as written averages a long chunk's one relevant sentence over all its tokens
            (benchmarks/attribution.py, long chunks: top-1 chunk 0.57 with ``mean``, 0.97 with ``window``
            of 8 tokens, on the tuning set; docs/attribution.md, "How the default was chosen").
        span_window: tokens of the ``window`` / ``top`` selections (a shorter span uses all its tokens).
        token_weighting: how the answer's tokens are weighted (:data:`TOKEN_WEIGHTINGS`): ``uniform`` is Eq. 10 as
            written; ``peak`` weighs each token by how much its RC singles out one prompt span, so that the
            answer's template words (in the question and in every same-form source) do not outvote the value
            (exact estimator only; the upper bound stays uniform). Default ``uniform``: measured on the embedded
            model beside the calibrated heads, ``peak`` moved single prompts both ways (issue 55:
            docs/attribution.md, "Measured").
        heads: :data:`HEAD_CHOICES`: ``auto`` scores with the model's calibrated heads and weights when its
            calibration file is there (``fetch-model`` places the embedded model's), else with the RC top k;
            ``rc`` always with the RC top k. On four same-form sources (``debfaq:c``) the calibrated heads took
            document top-1 from 0.13 to 0.97 (docs/attribution.md, "Measured").
    """

    k: int | None = None
    top_fraction: float = 0.02
    estimator: str = "auto"
    exact_max_tokens: int = 128
    sink_tokens: int = 0
    warmup_tokens: int | None = 32
    candidate_factor: int = 4
    max_generated_tokens: int = 4096
    span_score: str = "window"
    span_window: int = 8
    token_weighting: str = "uniform"
    heads: str = "auto"

    def __post_init__(self) -> None:
        if self.k is not None and (not is_int(self.k) or self.k < 1):
            raise ConfigError("k", self.k, "null or an integer >= 1")
        if not is_number(self.top_fraction) or not 0 < self.top_fraction <= 1:
            raise ConfigError("top_fraction", self.top_fraction, "a number in (0, 1]")
        if self.estimator not in ESTIMATORS:
            raise ConfigError("estimator", self.estimator, " | ".join(ESTIMATORS))
        if not is_int(self.exact_max_tokens) or self.exact_max_tokens < 0:
            raise ConfigError("exact_max_tokens", self.exact_max_tokens, "an integer >= 0")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ConfigError("sink_tokens", self.sink_tokens, "an integer >= 0")
        if self.warmup_tokens is not None and (not is_int(self.warmup_tokens) or self.warmup_tokens < 1):
            raise ConfigError("warmup_tokens", self.warmup_tokens, "null or an integer >= 1")
        if not is_int(self.candidate_factor) or self.candidate_factor < 1:
            raise ConfigError("candidate_factor", self.candidate_factor, "an integer >= 1")
        if not is_int(self.max_generated_tokens) or self.max_generated_tokens < 1:
            raise ConfigError("max_generated_tokens", self.max_generated_tokens, "an integer >= 1")
        if self.span_score not in SPAN_SCORES:
            raise ConfigError("span_score", self.span_score, " | ".join(SPAN_SCORES))
        if not is_int(self.span_window) or self.span_window < 1:
            raise ConfigError("span_window", self.span_window, "an integer >= 1")
        if self.token_weighting not in TOKEN_WEIGHTINGS:
            raise ConfigError("token_weighting", self.token_weighting, " | ".join(TOKEN_WEIGHTINGS))
        if self.heads not in HEAD_CHOICES:
            raise ConfigError("heads", self.heads, " | ".join(HEAD_CHOICES))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> AttributionOptions:
        """Validated options from a dict; unknown keys are errors naming the key."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ConfigError("rcstat_attribution", values, "a JSON object of attribution options")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(key, values[key], "a known field: " + ", ".join(sorted(known)))
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def use_exact(self, num_generated: int) -> bool:
        if self.estimator == "auto":
            return num_generated <= self.exact_max_tokens
        return self.estimator == "exact"


def num_top_heads(options: AttributionOptions, total_heads: int) -> int:
    """k: ``options.k`` or ``round(top_fraction * total_heads)``, at least 1 and at most ``total_heads``."""
    k = options.k if options.k is not None else round(options.top_fraction * total_heads)
    return max(1, min(int(k), total_heads))
