"""The plugin's typed configuration.

Server-wide settings come from ``--additional-config '{"rcstat": {...}}'`` (``VllmConfig.additional_config``);
per-request overrides come from ``SamplingParams.extra_args["rcstat"]`` (``vllm_xargs`` in OpenAI requests).
Both go through :meth:`RCStatConfig.from_dict`, so a bad value fails the same way in both places: with a
:class:`ConfigError` that names the field and the allowed values. A bad server config fails at start-up; a
bad request override fails that request only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

# Both torch-free (this module runs in the scheduler's process): the methods by name, and RC's knobs (its defaults
# and its QUERY_REDUCTIONS, how the window's queries combine into one score per token).
from rcstat_vllm.scoring.rc_knobs import QUERY_REDUCTIONS, RC_DEFAULTS
from rcstat_vllm.scoring.registry import REGISTRY, observing_methods

#: Key of the plugin's section in ``additional_config`` and in ``SamplingParams.extra_args``.
CONFIG_KEY = "rcstat"

#: Scoring methods (the registry's). ``none`` is the off switch: the plugin's backend runs but evicts nothing.
METHODS = (*REGISTRY, "none")

#: Methods that score the prompt with the attention of its trailing queries (an observation window).
OBSERVING_METHODS = observing_methods()

#: Where a budget (``target_ratio``) applies: to each layer alone, or to the whole model at once.
EVICTION_MODES = ("eager", "lazy")
BUDGET_SCOPES = ("layer", "model")


class ConfigError(ValueError):
    """An invalid rcstat setting; the message names the field and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        super().__init__(f"rcstat config field '{field}': got {value!r}, allowed: {allowed}")


@dataclass(frozen=True)
class RCStatConfig:
    """What to compress and how.

    Attributes:
        method: scoring method, one of :data:`METHODS`.
        c: threshold multiplier of Eq. 9 (RCStat): a head evicts token i when its score is at most
            ``c`` times the mean score of the head's non-window tokens. Used when ``target_ratio`` is None;
            giving ``c`` without ``target_ratio`` (server flag or request override) selects threshold mode.
        window: the last ``window`` prompt tokens are always kept; for RC (as in the paper) they are also the
            observation window whose queries score the prompt.
        observation_window: RC and SnapKV: how many trailing prompt queries score the prompt, when it should
            differ from the method's own: None = RC's ``window``, SnapKV's 64 (kvpress's SnapKVPress). Other
            methods observe no window (TOVA is defined by the last token's attention): setting it is an error.
        target_ratio: budget mode: evict this fraction of the prompt KV entries (of each layer or of the whole
            model, ``budget_scope``; heads keep different counts). None = threshold mode.
        sink_tokens: the first ``sink_tokens`` prompt tokens are always kept.
        min_prompt_len: prompts shorter than this run uncompressed (there is nothing worth evicting).
        budget_scope: budget mode only: ``layer`` evicts ``target_ratio`` of every layer; ``model`` evicts it
            from the model as a whole (top entries across all layers and heads, scores made comparable across
            layers), so layers keep different shares.
        layer_floor: model-wide budget only: each layer first keeps its own top ``layer_floor`` share of its
            equal part of the budget (``layer_floor * (1 - target_ratio)`` of its entries); the rest of the budget
            is given out across layers. 0 = purely model-wide, 1 = the same as ``budget_scope: layer``.
        smoothing: RC only: each score is averaged over this many neighbouring tokens (an odd window centred on
            the token, as SnapKV pools its scores) before selection, so a fact's span is kept or evicted whole;
            1 = no smoothing.
        carry_forward: RC only: after smoothing, each token's score is raised to the highest score among the
            ``carry_forward`` tokens before it, so what follows a contextualized token (a value after the key a
            question names) is kept with it: the window's queries find the key, the value is read only by queries
            generated later. 0 = the paper's scores.
        local_contrast: RC in budget mode only: before smoothing, each token's score is divided by the mean score
            of the tokens within ``contrast_radius`` of it, to this power: RC's scores drift towards the prompt's end
            (the window's self logits are all near it), and this keeps what stands out in its own part of the prompt
            instead; 0 = the paper's scores, 1 = the drift removed fully. Threshold mode (Eq. 9) compares the
            scores themselves with ``c`` and ignores it.
        contrast_radius: RC only, with ``local_contrast``: the tokens on either side whose mean divides a score.
        query_reduction: RC only: how the observation window's queries combine into a token's score: ``max`` = the
            token's expected RC under the one window query that reads it most (a fact read by a single copy head's
            query is not averaged away by the window's other queries); ``mean`` = Eq. 6 over all of them, the
            paper's scores.
        eviction: when the selected entries are compacted and the freed blocks returned: ``eager`` right after the
            prefill (every compressed request, pool short or not); ``lazy`` only when the scheduler needs blocks (a
            waiting request that does not fit, a running one that would be preempted), the requests freeing most
            first. Under ``lazy`` a request that never meets pressure decodes over its full cache.
        decode_budget: decode-time compression of generated KV (off when None): once a request's KV heads hold on
            average ``decode_budget + decode_interval`` generated tokens, every layer's heads are scored over their
            generated tokens by ``method`` (the last ``window`` generated tokens' queries observing, and always
            kept) and keep ``decode_budget`` of them on average, different numbers per head; the rest is compacted
            away and its blocks freed. The prompt's kept KV is not rescored.
        decode_interval: generated tokens per head between two decode-time compactions (at least ``window``).
    """

    method: str = "rc"
    c: float = 1.0
    # Defaults chosen by measurement (docs/defaults.md): a model-wide budget of 40% of the prompt KV, scored by
    # RC at its defaults (RC_DEFAULTS, defined once for the config and the scorer, with why each: a 32-token window,
    # smoothing, carrying forward, local contrast, the max over queries), with the first 4 tokens (attention sinks)
    # kept by every head. Lazy eviction: a pool never short loses nothing (no eviction, no scoring), and it ran at
    # least as fast as eager on every workload measured (docs/defaults.md, "Lazy eviction by default").
    window: int = RC_DEFAULTS.window
    observation_window: int | None = None
    target_ratio: float | None = 0.4
    sink_tokens: int = 4
    min_prompt_len: int = 64
    budget_scope: str = "model"
    layer_floor: float = 0.0
    smoothing: int = RC_DEFAULTS.smoothing
    carry_forward: int = RC_DEFAULTS.carry_forward
    local_contrast: float = RC_DEFAULTS.local_contrast
    contrast_radius: int = RC_DEFAULTS.contrast_radius
    query_reduction: str = RC_DEFAULTS.query_reduction
    eviction: str = "lazy"
    decode_budget: int | None = None
    decode_interval: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", self.method, " | ".join(METHODS))
        if not is_number(self.c) or not math.isfinite(self.c) or self.c < 0:
            raise ConfigError("c", self.c, "a finite number >= 0")
        if not is_int(self.window) or self.window < 1:
            raise ConfigError("window", self.window, "an integer >= 1")
        if self.observation_window is not None:
            if not is_int(self.observation_window) or self.observation_window < 1:
                raise ConfigError("observation_window", self.observation_window, "null or an integer >= 1")
            if self.method not in OBSERVING_METHODS and self.method != "none":
                observers = " and ".join(OBSERVING_METHODS)
                raise ConfigError("observation_window", self.observation_window,
                                  f"null for method {self.method!r} (only {observers} observe a window)")
        if self.target_ratio is not None and (
            not is_number(self.target_ratio) or not 0 <= self.target_ratio < 1
        ):
            raise ConfigError("target_ratio", self.target_ratio, "null or a number in [0, 1)")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ConfigError("sink_tokens", self.sink_tokens, "an integer >= 0")
        if not is_int(self.min_prompt_len) or self.min_prompt_len < 1:
            raise ConfigError("min_prompt_len", self.min_prompt_len, "an integer >= 1")
        if not is_int(self.smoothing) or self.smoothing < 1 or self.smoothing % 2 == 0:
            raise ConfigError("smoothing", self.smoothing, "an odd integer >= 1")
        if not is_int(self.carry_forward) or self.carry_forward < 0:
            raise ConfigError("carry_forward", self.carry_forward, "an integer >= 0")
        if not is_number(self.local_contrast) or not 0 <= self.local_contrast <= 1:
            raise ConfigError("local_contrast", self.local_contrast, "a number in [0, 1]")
        if not is_int(self.contrast_radius) or self.contrast_radius < 1:
            raise ConfigError("contrast_radius", self.contrast_radius, "an integer >= 1")
        if self.query_reduction not in QUERY_REDUCTIONS:
            raise ConfigError("query_reduction", self.query_reduction, " | ".join(QUERY_REDUCTIONS))
        if not is_number(self.layer_floor) or not 0 <= self.layer_floor <= 1:
            raise ConfigError("layer_floor", self.layer_floor, "a number in [0, 1]")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ConfigError("budget_scope", self.budget_scope, " | ".join(BUDGET_SCOPES))
        if self.eviction not in EVICTION_MODES:
            raise ConfigError("eviction", self.eviction, " | ".join(EVICTION_MODES))
        if not is_int(self.decode_interval) or self.decode_interval < self.window:
            raise ConfigError("decode_interval", self.decode_interval, f"an integer >= window ({self.window})")
        if self.decode_budget is not None and (not is_int(self.decode_budget) or self.decode_budget < self.window):
            raise ConfigError("decode_budget", self.decode_budget, f"null or an integer >= window ({self.window})")

    @property
    def decode_compression(self) -> bool:
        """Whether generated KV is compressed during decode."""
        return self.enabled and self.decode_budget is not None

    @property
    def enabled(self) -> bool:
        """Whether requests under this config have their KV cache compressed."""
        return self.method != "none"

    @property
    def budget_mode(self) -> bool:
        return self.target_ratio is not None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | str | None) -> "RCStatConfig":
        """Build and validate a config from a dict (or its JSON text); unknown keys are errors."""
        return cls().merged(values)

    def merged(self, overrides: Mapping[str, Any] | str | None) -> "RCStatConfig":
        """A copy of this config with ``overrides`` applied and validated (per-request settings)."""
        if overrides is None:
            return self
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides)
            except json.JSONDecodeError as exc:
                raise ConfigError(CONFIG_KEY, overrides, f"a JSON object ({exc})") from None
        if not isinstance(overrides, Mapping):
            raise ConfigError(CONFIG_KEY, overrides, "a JSON object of rcstat settings")
        known = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in known:
                raise ConfigError(key, overrides[key], "a known field: " + ", ".join(sorted(known)))
        overrides = dict(overrides)
        if "c" in overrides and "target_ratio" not in overrides:
            # Setting c asks for threshold mode (Eq. 9): it would be ignored under a budget.
            overrides["target_ratio"] = None
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def server_config(additional_config: Mapping[str, Any] | None) -> RCStatConfig | None:
    """The server-wide config from ``VllmConfig.additional_config``, or None when the flag is absent. Parsed once
    per process for each distinct flag (the admission check asks for every request): the config is immutable."""
    if not additional_config or CONFIG_KEY not in additional_config:
        return None
    section = additional_config[CONFIG_KEY]
    try:
        text = section if isinstance(section, str) else json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):  # not JSON-like: parsed (and rejected, naming the field) as it is
        return RCStatConfig.from_dict(section)
    return _parsed_server_config(text)


@functools.lru_cache(maxsize=8)
def _parsed_server_config(text: str) -> RCStatConfig:
    return RCStatConfig.from_dict(text)


def request_overrides(extra_args: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The per-request override dict from ``SamplingParams.extra_args`` (None when absent)."""
    if not extra_args:
        return None
    return extra_args.get(CONFIG_KEY)
