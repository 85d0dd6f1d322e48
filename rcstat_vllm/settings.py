"""Settings arithmetic both sides need (the scheduler's engine process and the workers): a request's settings
(resolved once per process: :class:`RequestSettingsTable`), how many queries its scoring observes and keeps, its
scorer's options, how far a prefix-cache hit may reach. Plain Python on :class:`~rcstat_vllm.config.RCStatConfig`:
no torch, no scorer, no vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from rcstat_vllm.config import ConfigError, RCStatConfig, request_overrides
from rcstat_vllm.scoring.registry import REGISTRY


@dataclass(frozen=True)
class RequestSettings:
    """A request's settings: the server config with its overrides, or the server config and why the overrides
    failed (``invalid``: the request then runs uncompressed; admission rejects such requests already)."""

    config: RCStatConfig
    invalid: str | None = None

    @classmethod
    def resolve(cls, extra_args, server: RCStatConfig) -> RequestSettings:
        """Parse and validate the request's overrides (``SamplingParams.extra_args``) over the server config."""
        try:
            return cls(server.merged(request_overrides(extra_args)))
        except ConfigError as exc:  # validated at admission already; never crash the batch over it
            return cls(server, f"invalid override: {exc}")


class RequestSettingsTable:
    """Each request's :class:`RequestSettings`, resolved the first time a process side looks (the scheduler's, a
    worker's) and kept until the request leaves it: a request's overrides are parsed once per process, not once per
    prefill chunk, prefix lookup or decode step. The owner drops a request when vLLM does (finished, preempted: a
    resumed request is resolved again) and when a streaming-input session's next chunk brings new parameters.
    """

    def __init__(self, server: RCStatConfig):
        self.server = server
        self._by_request: dict[str, RequestSettings] = {}

    def of(self, req_id: str, extra_args) -> RequestSettings:
        settings = self._by_request.get(req_id)
        if settings is None:
            settings = RequestSettings.resolve(extra_args, self.server)
            self._by_request[req_id] = settings
        return settings

    def drop(self, req_id: str) -> None:
        self._by_request.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._by_request)


def observed_queries(config: RCStatConfig) -> int:
    """How many trailing prompt queries the scorer reads: ``observation_window`` when set, else RC's ``window``
    (the paper's observation window is the kept window) or the baseline's published window."""
    if config.observation_window is not None:
        return config.observation_window
    if config.method == "rc":
        return config.window
    return REGISTRY[config.method].window  # the method's published window (its registry line: no torch)


def window_queries(config: RCStatConfig) -> int:
    """How many trailing prompt queries a compressed request keeps until scoring: the observed ones, and at
    least the kept window (so a short prompt's saved queries cover it)."""
    return max(observed_queries(config), config.window)


def scorer_options(config: RCStatConfig) -> dict:
    """The scorer's constructor options, from its registry line: the observed queries (:func:`observed_queries`,
    when the method observes a window), each of its own knobs (``Knob.option``) and the general settings it shares
    (StreamingLLM's sinks). One rule on top: RC's local contrast, value weighting and chunks apply in budget mode only.
    Threshold mode is RCStat's own rule (Eq. 9: each head evicts what scores below ``c`` times its mean, so heads and
    layers keep what their scores say); the contrast flattens the differences it adapts to (the capacity test's
    layers kept 1.4-5.5x more in the fullest than the emptiest with it, 1.5-5.8x without) and was measured in budget
    mode only, where it changes the ranking and not the share (value weighting likewise: measured in budget mode
    only)."""
    line = REGISTRY[config.method]
    options = {knob.option: getattr(config, knob.name) for knob in line.knobs if knob.option is not None}
    options.update({option: getattr(config, knob.name) for option, knob in line.shared})
    if line.observes and (config.method == "rc" or config.observation_window is not None):
        options["window_size"] = observed_queries(config)
    if config.method == "rc" and not config.budget_mode:
        options["local_contrast"] = 0.0
        options["value_weight"] = 0.0
        options["chunk"] = 1
    return options


def max_cached_prompt_tokens(num_prompt_tokens: int, settings: RequestSettings, block_size: int) -> int | None:
    """The most prompt tokens a prefix-cache hit may cover for a request that will be compressed, None for no
    limit: its observation window's queries exist only if those tokens are computed, so a hit stops at the last
    whole block before the prompt's window (as vLLM itself always recomputes the last prompt token).

    Counted from the prompt, never from the request's tokens: a request resumed after a preemption has generated
    tokens too, and a hit reaching past its prompt would skip the step that finishes its prefill, where it is
    compressed again (it would run with its full KV under the very pressure that preempted it)."""
    if settings.invalid is not None:
        return None  # runs uncompressed (rejected at admission, or reported by the worker)
    config = settings.config
    if not config.enabled or num_prompt_tokens < config.min_prompt_len:
        return None
    return max(num_prompt_tokens - window_queries(config), 0) // block_size * block_size


def decode_queries(config: RCStatConfig) -> int:
    """Generated tokens' queries a decode-time compaction observes (and saves before it is due): the kept window, or
    ``observation_window`` when larger."""
    return max(config.observation_window or config.window, config.window)
