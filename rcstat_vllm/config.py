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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Torch-free (this module runs in the scheduler's process): the methods by name, each with its own knobs.
from rcstat_vllm.knobs import ConfigError, Knob, is_int, is_number
from rcstat_vllm.scoring.registry import REGISTRY, SINK_TOKENS, method_knobs, observing_methods

__all__ = [
    "BY_RATIO",
    "CONFIG_KEY",
    "KNOBS",
    "METHODS",
    "RATIO_KNOBS",
    "ConfigError",
    "RCStatConfig",
    "is_int",
    "is_number",
    "request_overrides",
    "server_config",
    "settings_table",
]

#: Key of the plugin's section in ``additional_config`` and in ``SamplingParams.extra_args``.
CONFIG_KEY = "rcstat"

#: Scoring methods (the registry's). ``none`` is the off switch: the plugin's backend runs but evicts nothing.
METHODS = (*REGISTRY, "none")

#: Methods that score the prompt with the attention of its trailing queries (an observation window).
OBSERVING_METHODS = observing_methods()

#: Where a budget (``target_ratio``) applies: to each layer alone, or to the whole model at once.
EVICTION_MODES = ("eager", "lazy")
BUDGET_SCOPES = ("layer", "model")
#: ``off``: the plugin turns vLLM's asynchronous scheduling off; ``keep``: leaves it as vLLM sets it
ASYNC_SCHEDULING = ("off", "keep")
#: ``piecewise``: attention runs eagerly between vLLM's piecewise graphs; ``full_decode``: decode steps in full graphs
CUDA_GRAPHS = ("piecewise", "full_decode")

#: The general settings, in the README's order; each method's own follow (its registry line). Defaults chosen by
#: measurement (docs/defaults.md): a model-wide budget of 40% of the prompt KV, scored by RC at its defaults, with
#: the first 4 tokens (attention sinks) kept by every head; lazy eviction (a pool never short loses nothing, and it
#: ran at least as fast as eager on every workload measured: docs/defaults.md, "Lazy eviction by default").
GENERAL_KNOBS = (
    Knob(
        "method",
        "rc",
        "the scoring method: `rc` (RCStat) or a baseline; `none`: the plugin's backend on, nothing evicted",
        kind="choice",
        choices=METHODS,
    ),
    Knob(
        "target_ratio",
        0.4,
        "budget mode: evict this fraction of the prompt KV entries; `null` = threshold mode",
        kind="number",
        minimum=0,
        maximum=1,
        open_maximum=True,
        nullable=True,
    ),
    Knob(
        "c",
        1.0,
        "threshold mode (Eq. 9): evict a token scoring at most `c` x its head's mean; giving `c` without "
        "`target_ratio` selects it",
        kind="number",
        minimum=0,
    ),
    Knob(
        "budget_scope",
        "model",
        "`model`: the budget across all layers and heads; `layer`: `target_ratio` of every layer",
        kind="choice",
        choices=BUDGET_SCOPES,
    ),
    Knob(
        "layer_floor",
        0.0,
        "model-wide budget: the share of each layer's equal part it keeps first",
        kind="number",
        minimum=0,
        maximum=1,
    ),
    Knob(
        "coverage_floor",
        0.0,
        "budget mode: a token a head ranks in its top `coverage_floor` share of its part of the budget keeps a copy "
        "in that layer, paid for from the heads that agree most (0 = off)",
        kind="number",
        minimum=0,
        maximum=1,
    ),
    Knob(
        "window",
        REGISTRY["rc"].window,
        "the last `window` prompt tokens are always kept (RC: also the observation window)",
        minimum=1,
    ),
    Knob(
        "observation_window",
        None,
        "RC and SnapKV: trailing queries that score the prompt (`null`: RC's `window`, SnapKV's 64)",
        minimum=1,
        nullable=True,
    ),
    SINK_TOKENS,  # (declared with the registry: StreamingLLM's sinks)
    Knob("min_prompt_len", 64, "shorter prompts are not compressed", minimum=1),
    Knob(
        "eviction",
        "lazy",
        "`lazy`: compact only when the scheduler needs blocks; `eager`: right after the prefill",
        kind="choice",
        choices=EVICTION_MODES,
    ),
    Knob(
        "decode_budget",
        None,
        "compress generated KV too, keeping this many generated tokens per head on average",
        minimum="window",
        nullable=True,
    ),
    Knob("decode_interval", 128, "generated tokens between two decode-time compactions", minimum="window"),
    Knob(
        "async_scheduling",
        "off",
        "`off`: the plugin turns vLLM's asynchronous scheduling off; `keep`: as vLLM sets it (its GPU default), "
        "compactions follow its one-step-late outputs, each copy carrying the tokens of the step in flight; "
        "server only",
        kind="choice",
        choices=ASYNC_SCHEDULING,
        server_only=True,
    ),
    Knob(
        "cuda_graphs",
        "piecewise",
        "CUDA: `piecewise`: attention runs eagerly between vLLM's piecewise graphs; `full_decode`: single-token "
        "decode steps replay full graphs, every row head-as-sequence (docs/design.md, 'CUDA graphs'); server only",
        kind="choice",
        choices=CUDA_GRAPHS,
        server_only=True,
    ),
)

#: Every setting by name: the general ones, then each method's own (the config's fields, in this order).
KNOBS: dict[str, Knob] = {knob.name: knob for knob in (*GENERAL_KNOBS, *method_knobs())}

#: The settings whose default depends on ``target_ratio`` (``Knob.by_ratio``; docs/defaults.md, "Knobs by ratio").
RATIO_KNOBS = tuple(name for name, knob in KNOBS.items() if knob.by_ratio)


class _ByRatio:
    """A field's value until :class:`RCStatConfig` resolves it: the knob's default at the config's ``target_ratio``."""

    def __repr__(self) -> str:
        return "BY_RATIO"


#: The default of a :data:`RATIO_KNOBS` field: replaced in ``__post_init__`` by the value for ``target_ratio``.
BY_RATIO: Any = _ByRatio()


def _default(name: str) -> Any:
    return BY_RATIO if KNOBS[name].by_ratio else KNOBS[name].default


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
        coverage_floor: budget mode only (threshold mode ignores it): keeps every route open at high compression
            (the KV-compression-physics paper's global eviction). A token among a head's top ``coverage_floor *
            (1 - target_ratio) * n`` tokens keeps at least one copy among its layer's KV heads (the head scoring
            it highest), and the entries that pays for are the copies of the tokens its layer keeps in the most
            heads; exactly as many entries are kept as without it. 0 = off.
        smoothing: RC only: each score is averaged over this many neighbouring tokens (an odd window centred on
            the token, as SnapKV pools its scores) before selection, so a fact's span is kept or evicted whole;
            1 = no smoothing. Its default depends on the budget (``Knob.by_ratio``): 3, and 5 from ``target_ratio``
            0.9 on; left out, it follows the ratio of each merge (a request's own ``target_ratio`` too), given, it
            stays.
        carry_forward: RC only: after smoothing, each token's score is raised to the highest score among the
            ``carry_forward`` tokens before it, so what follows a contextualized token (a value after the key a
            question names) is kept with it: the window's queries find the key, the value is read only by queries
            generated later. 0 = the paper's scores.
        local_contrast: RC in budget mode only: before smoothing, each token's score is divided by the mean score
            of the tokens within ``contrast_radius`` of it, to this power: RC's scores drift towards the prompt's end
            (the window's self logits are all near it), and this keeps what stands out in its own part of the prompt
            instead; 0 = the paper's scores, 1 = the drift removed fully, and with it how strongly each head reads
            its part of the prompt, which the model-wide budget allocates by (SmolLM2 at 0.9 then loses every value:
            docs/defaults.md). Threshold mode (Eq. 9) compares the scores themselves with ``c`` and ignores it.
        contrast_radius: RC only, with ``local_contrast``: the tokens on either side whose mean divides a score.
        query_reduction: RC only: how the observation window's queries combine into a token's score: ``max`` = the
            token's expected RC under the one window query that reads it most (a fact read by a single copy head's
            query is not averaged away by the window's other queries); ``mean`` = Eq. 6 over all of them, the
            paper's scores.
        group_reduction: RC only: how a KV head's query heads (its GQA group) combine into its score of a token:
            ``max`` = the query head that reads the token most (evicting a KV head's entry closes every one of its
            query heads' routes to the token, so one copy head's read is not divided by the group's size); ``mean``
            = the group's mean, the paper's scores. The default is ``mean`` below a ``target_ratio`` of 0.9 (the
            bare flag's 0.4 included) and in threshold mode, ``max`` from 0.9 on (docs/defaults.md, "Past the
            cliff": from 0.8 on it lost values on a confirmation set).
        value_weight: RC in budget mode only: last, each score is multiplied by the norm of the token's value in
            that KV head to this power (attention's output is the attention-weighted sum of values, so a token's
            share of it is its weight times its value's norm); the prompt's values are then read at scoring time.
            0 = the paper's scores. Threshold mode compares the scores themselves with ``c`` and ignores it.
        chunk: RC in budget mode only: after carrying, each score is replaced by the mean over its chunk of this many
            tokens, counted from the first token scored (the prompt's first, or the first block boundary a prefix-cache
            hit leaves to score: a chunk that divides the block size chunks both alike), so a head keeps or drops a
            multi-token value together (ChunkKV's unit). 1 = the paper's scores, the default at every ratio
            (docs/defaults.md, "Past the cliff": why 4 is not the default at 0.8).
        kernel_size: SnapKV only: the width of its average pooling along tokens (odd; 5 as published).
        eviction: when the selected entries are compacted and the freed blocks returned: ``eager`` right after the
            prefill (every compressed request, pool short or not); ``lazy`` only when the scheduler needs blocks (a
            waiting request that does not fit, a running one that would be preempted), the requests freeing most
            first. Under ``lazy`` a request that never meets pressure decodes over its full cache.
        decode_budget: decode-time compression of generated KV (off when None): once a request's KV heads hold on
            average ``decode_budget + decode_interval`` generated tokens, every layer's heads are scored over their
            generated tokens by ``method`` (the last ``window`` generated tokens' queries observing, and always
            kept) and keep ``decode_budget`` of them on average, different numbers per head, each on a page boundary
            (under a page more in all); the rest is compacted away and its blocks freed. The prompt's kept KV is not
            rescored.
        decode_interval: generated tokens per head between two decode-time compactions (at least ``window``).
        async_scheduling: ``off``: the plugin turns vLLM's asynchronous scheduling off; ``keep``: leaves it on.
        cuda_graphs: the CUDA backend's graphs. ``piecewise`` (the default until a GPU window has measured the other):
            the backend declares no CUDA graph support for attention, so vLLM runs its piecewise graphs and attention
            eagerly every step. ``full_decode``: a batch of single-token decodes runs every row head-as-sequence over
            persistent buffers, and vLLM captures and replays full graphs for those batches; steps whose attention
            does host work (a prefill, a compaction scored, queries kept for one, attribution) still run piecewise.
    """

    method: str = _default("method")
    # Each field's default, allowed values and meaning are its Knob's (GENERAL_KNOBS above, a method's own on its
    # registry line); __post_init__ checks each against its Knob, then the relations between fields.
    c: float = _default("c")
    window: int = _default("window")
    observation_window: int | None = _default("observation_window")
    target_ratio: float | None = _default("target_ratio")
    sink_tokens: int = _default("sink_tokens")
    min_prompt_len: int = _default("min_prompt_len")
    budget_scope: str = _default("budget_scope")
    layer_floor: float = _default("layer_floor")
    coverage_floor: float = _default("coverage_floor")
    smoothing: int = _default("smoothing")
    carry_forward: int = _default("carry_forward")
    local_contrast: float = _default("local_contrast")
    contrast_radius: int = _default("contrast_radius")
    query_reduction: str = _default("query_reduction")
    group_reduction: str = _default("group_reduction")
    value_weight: float = _default("value_weight")
    chunk: int = _default("chunk")
    kernel_size: int = _default("kernel_size")
    eviction: str = _default("eviction")
    decode_budget: int | None = _default("decode_budget")
    decode_interval: int = _default("decode_interval")
    async_scheduling: str = _default("async_scheduling")
    cuda_graphs: str = _default("cuda_graphs")

    def __post_init__(self) -> None:
        # A field whose default depends on the budget and was left out takes the value for this target_ratio; which
        # fields follow the ratio is kept, so a later merge that changes the ratio moves them too (a value given wins).
        follows = frozenset(name for name in RATIO_KNOBS if getattr(self, name) is BY_RATIO)
        for name in follows:
            object.__setattr__(self, name, KNOBS[name].default_at(self.target_ratio))
        object.__setattr__(self, "_follows_ratio", follows)
        for knob in KNOBS.values():  # (declared order: a field named as another's minimum is checked first)
            knob.check(getattr(self, knob.name), self)
        if self.observation_window is not None and self.method not in (*OBSERVING_METHODS, "none"):
            observers = " and ".join(OBSERVING_METHODS)
            raise ConfigError(
                "observation_window",
                self.observation_window,
                f"null for method {self.method!r} (only {observers} observe a window)",
            )

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

    @property
    def follows_ratio(self) -> frozenset[str]:
        """The fields left at their ratio-dependent default (:data:`RATIO_KNOBS` not given): their values are the
        defaults for ``target_ratio``, and a merge that changes ``target_ratio`` resolves them again."""
        return getattr(self, "_follows_ratio", frozenset())

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | str | None) -> RCStatConfig:
        """Build and validate a config from a dict (or its JSON text); unknown keys are errors."""
        return cls()._merged(values, server=True)

    def merged(self, overrides: Mapping[str, Any] | str | None) -> RCStatConfig:
        """A copy of this config with ``overrides`` applied and validated (per-request settings: a server-only
        setting is an error)."""
        return self._merged(overrides, server=False)

    def _merged(self, overrides: Mapping[str, Any] | str | None, server: bool) -> RCStatConfig:
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
            if not server and key in KNOBS and KNOBS[key].server_only:
                raise ConfigError(key, overrides[key], "a server setting (--additional-config), not a request's")
        overrides = dict(overrides)
        if "c" in overrides and "target_ratio" not in overrides:
            # Setting c asks for threshold mode (Eq. 9): it would be ignored under a budget.
            overrides["target_ratio"] = None
        # Fields still at their ratio-dependent default are resolved again under the merged target_ratio.
        follow = {name: BY_RATIO for name in self.follows_ratio if name not in overrides}
        return dataclasses.replace(self, **{**follow, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def settings_table() -> str:
    """The README's settings table (Markdown), generated from the declarations: a test holds the README to it."""
    rows = ["| field | default | meaning | allowed |", "|---|---|---|---|"]
    for knob in KNOBS.values():
        allowed = ", ".join(f"`{choice}`" for choice in knob.choices) if knob.choices else knob.allowed()
        rows.append(f"| `{knob.name}` | {knob.default_text()} | {knob.doc} | {allowed} |")
    return "\n".join(rows)
