"""RCStatConfig: every bad field fails with a ConfigError naming it; good configs and overrides work."""

from __future__ import annotations

import json
import math

import pytest

from rcstat_vllm.config import (
    CONFIG_KEY,
    METHODS,
    ConfigError,
    RCStatConfig,
    request_overrides,
    server_config,
)

BAD_FIELDS = [
    ({"method": "bogus"}, "method"),
    ({"method": ""}, "method"),
    ({"method": None}, "method"),
    ({"c": -0.5}, "c"),
    ({"c": math.nan}, "c"),
    ({"c": math.inf}, "c"),
    ({"c": "1.0"}, "c"),
    ({"c": True}, "c"),
    ({"window": 0}, "window"),
    ({"window": -3}, "window"),
    ({"window": 1.5}, "window"),
    ({"window": "8"}, "window"),
    ({"target_ratio": 1.0}, "target_ratio"),
    ({"target_ratio": 1.5}, "target_ratio"),
    ({"target_ratio": -0.1}, "target_ratio"),
    ({"target_ratio": "0.5"}, "target_ratio"),
    ({"sink_tokens": -1}, "sink_tokens"),
    ({"sink_tokens": 2.5}, "sink_tokens"),
    ({"min_prompt_len": 0}, "min_prompt_len"),
    ({"budget_scope": "global"}, "budget_scope"),
    ({"eviction": "later"}, "eviction"),
    ({"eviction": None}, "eviction"),
    ({"smoothing": 4}, "smoothing"),
    ({"layer_floor": 1.5}, "layer_floor"),
    ({"observation_window": 0}, "observation_window"),
    ({"observation_window": 8.0}, "observation_window"),
    ({"method": "tova", "observation_window": 8}, "observation_window"),
    ({"method": "knorm", "observation_window": 8}, "observation_window"),
    ({"layer_floor": -0.1}, "layer_floor"),
    ({"layer_floor": "0.5"}, "layer_floor"),
    ({"coverage_floor": 1.5}, "coverage_floor"),
    ({"coverage_floor": -0.1}, "coverage_floor"),
    ({"smoothing": 0}, "smoothing"),
    ({"carry_forward": -1}, "carry_forward"),
    ({"carry_forward": 2.5}, "carry_forward"),
    ({"local_contrast": -0.5}, "local_contrast"),
    ({"local_contrast": 2}, "local_contrast"),
    ({"local_contrast": "0.5"}, "local_contrast"),
    ({"contrast_radius": 0}, "contrast_radius"),
    ({"contrast_radius": 64.5}, "contrast_radius"),
    ({"query_reduction": "sum"}, "query_reduction"),
    ({"query_reduction": None}, "query_reduction"),
    ({"group_reduction": "sum"}, "group_reduction"),
    ({"decode_budget": 16}, "decode_budget"),  # below the window (32)
    ({"decode_budget": "512"}, "decode_budget"),
    ({"decode_interval": 31}, "decode_interval"),
    ({"decode_interval": None}, "decode_interval"),
    ({"budget_scope": None}, "budget_scope"),
    ({"budget": 0.5}, "budget"),  # unknown key
    ({"Method": "rc"}, "Method"),  # keys are case-sensitive
]


@pytest.mark.parametrize("values, field", BAD_FIELDS, ids=[f"{f}={v[f]!r}" for v, f in BAD_FIELDS])
def test_bad_field_is_named(values, field):
    with pytest.raises(ConfigError) as info:
        RCStatConfig.from_dict(values)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)
    assert "allowed" in str(info.value)


def test_unknown_method_lists_the_allowed_methods():
    with pytest.raises(ConfigError) as info:
        RCStatConfig.from_dict({"method": "h2o"})
    for method in METHODS:
        assert method in str(info.value)


def test_bad_field_from_the_constructor_too():
    with pytest.raises(ConfigError, match="'window'"):
        RCStatConfig(window=0)


@pytest.mark.parametrize("values", [[], ["rc"], 3, "not json", '["rc"]', "{bad json"])
def test_non_dict_is_rejected(values):
    with pytest.raises(ConfigError) as info:
        RCStatConfig.from_dict(values)
    assert info.value.field == CONFIG_KEY


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_defaults():
    config = RCStatConfig.from_dict({})
    assert config == RCStatConfig()
    # The measured default (README, "Defaults"): RC, a model-wide budget of 40% of the prompt KV, 4 sink tokens.
    assert config.method == "rc" and config.enabled and config.budget_mode
    assert (config.target_ratio, config.budget_scope, config.window, config.smoothing) == (0.4, "model", 32, 3)
    assert (config.sink_tokens, config.layer_floor, config.observation_window) == (4, 0.0, None)


def test_giving_c_selects_threshold_mode_unless_a_ratio_is_given_too():
    assert RCStatConfig.from_dict({"c": 2.0}).target_ratio is None
    assert RCStatConfig.from_dict({"c": 2.0, "target_ratio": 0.3}).target_ratio == 0.3
    server = RCStatConfig.from_dict({"target_ratio": 0.7})
    assert not server.merged({"c": 0.5}).budget_mode  # a request override asking for Eq. 9
    assert server.merged({"window": 8}).target_ratio == 0.7


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_accepted(method):
    config = RCStatConfig.from_dict({"method": method})
    assert config.method == method
    assert config.enabled == (method != "none")


def test_good_config_round_trips():
    values = {
        "method": "snapkv",
        "c": 0,
        "window": 1,
        "target_ratio": 0.0,
        "sink_tokens": 4,
        "min_prompt_len": 1,
        "budget_scope": "model",
        "layer_floor": 0.25,
        "coverage_floor": 0.5,
        "smoothing": 3,
        "carry_forward": 8,
        "local_contrast": 0.25,
        "contrast_radius": 128,
        "query_reduction": "mean",
        "group_reduction": "max",
        "value_weight": 0.5,
        "chunk": 4,
        "observation_window": None,
        "eviction": "lazy",
        "kernel_size": 7,
        "decode_budget": 64,
        "decode_interval": 32,
        "async_scheduling": "keep",
        "cuda_graphs": "full_decode",
    }
    config = RCStatConfig.from_dict(values)
    assert config.to_dict() == values
    assert config.budget_mode
    assert RCStatConfig.from_dict(config.to_dict()) == config
    assert RCStatConfig.from_dict(json.dumps(values)) == config  # JSON text is accepted too


def test_boundaries():
    assert RCStatConfig.from_dict({"target_ratio": 0.999}).target_ratio == 0.999
    assert RCStatConfig.from_dict({"c": 0.0}).c == 0.0
    assert RCStatConfig.from_dict({"c": 3}).c == 3  # ints are numbers
    assert RCStatConfig.from_dict({"target_ratio": None}).target_ratio is None


def test_merged_applies_overrides_and_keeps_the_rest():
    base = RCStatConfig.from_dict({"method": "rc", "c": 2.0, "window": 16})
    merged = base.merged({"c": 0.5, "target_ratio": 0.25})
    assert (merged.method, merged.c, merged.window, merged.target_ratio) == ("rc", 0.5, 16, 0.25)
    assert base.c == 2.0  # the server config is not changed
    assert base.merged(None) is base
    assert base.merged({}) == base
    assert base.merged('{"method": "none"}').method == "none"  # the vllm_xargs form: JSON text


@pytest.mark.parametrize(
    "overrides, field",
    [({"c": -1}, "c"), ({"method": "x"}, "method"), ({"window": 0}, "window"), ({"nope": 1}, "nope")],
)
def test_merged_validates_overrides(overrides, field):
    with pytest.raises(ConfigError) as info:
        RCStatConfig().merged(overrides)
    assert info.value.field == field


def test_server_config():
    assert server_config(None) is None
    assert server_config({}) is None
    assert server_config({"other_plugin": {"x": 1}}) is None
    assert server_config({CONFIG_KEY: {}}) == RCStatConfig()
    assert server_config({CONFIG_KEY: {"method": "tova"}}).method == "tova"
    with pytest.raises(ConfigError, match="'c'"):
        server_config({CONFIG_KEY: {"c": -1}})


def test_request_overrides():
    assert request_overrides(None) is None
    assert request_overrides({}) is None
    assert request_overrides({"other": 1}) is None
    assert request_overrides({CONFIG_KEY: {"c": 2}}) == {"c": 2}


def test_observation_window_sets_what_rc_and_snapkv_observe_and_nothing_else():
    from rcstat_vllm.scoring import get_scorer
    from rcstat_vllm.settings import scorer_options, window_queries

    def observed(**values):
        config = RCStatConfig.from_dict(values)
        return get_scorer(config.method, **scorer_options(config)).window_size, window_queries(config)

    assert observed() == (32, 32)  # RC: the kept window is the observation window (the paper)
    assert observed(window=32, observation_window=8) == (8, 32)  # 8 queries score; 32 tokens kept
    assert observed(window=8, observation_window=48) == (48, 48)
    assert observed(method="snapkv") == (64, 64)  # kvpress's window
    assert observed(method="snapkv", observation_window=32) == (32, 32)
    assert observed(method="snapkv", window=4, observation_window=16) == (16, 16)
    assert observed(method="tova") == (1, 32)
    assert get_scorer("snapkv", **scorer_options(RCStatConfig(method="snapkv", observation_window=32))).kernel_size == 5


def test_local_contrast_reaches_rcs_scorer_in_budget_mode_only():
    """Threshold mode is RCStat's own rule on RC's own scores (Eq. 9); the contrast is a budget's ranking."""
    from rcstat_vllm.scoring import get_scorer
    from rcstat_vllm.settings import scorer_options

    def contrast(**values):
        scorer = get_scorer("rc", **scorer_options(RCStatConfig.from_dict(values)))
        return scorer.local_contrast, scorer.contrast_radius

    assert contrast() == (RCStatConfig().local_contrast, RCStatConfig().contrast_radius)
    assert contrast(target_ratio=0.8, local_contrast=0.25, contrast_radius=64) == (0.25, 64)
    assert contrast(local_contrast=0) == (0.0, RCStatConfig().contrast_radius)
    assert contrast(c=1.0, target_ratio=None)[0] == 0.0
    chunk = get_scorer("rc", **scorer_options(RCStatConfig.from_dict({"chunk": 4}))).chunk
    threshold_chunk = get_scorer("rc", **scorer_options(RCStatConfig.from_dict({"chunk": 4, "c": 1.0}))).chunk
    assert (chunk, threshold_chunk) == (4, 1)


def test_start_up_says_whether_generated_kv_is_compressed_and_when_lazy_eviction_defers_it(caplog):
    pytest.importorskip("vllm")
    import logging

    from patches.platform import announce

    def lines(config, off=False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.rcstat"):
            announce(config, off)
        return [r.getMessage() for r in caplog.records if "rcstat" in r.getMessage()]

    assert not any("decode-time" in line for line in lines(RCStatConfig()))
    assert any(
        "lazy eviction: a request is compacted only when the KV pool runs short" in line
        for line in lines(RCStatConfig())
    )  # the default
    assert not any("lazy eviction:" in line for line in lines(RCStatConfig(eviction="eager")))
    on = lines(RCStatConfig(decode_budget=512, eviction="eager"))
    assert any(
        "decode-time compression on: generated KV compacted to 512 tokens per KV head on average every 128 "
        "tokens, earlier when the KV pool is about to run short"
        in line
        and "lazy" not in line
        for line in on
    )
    assert any(
        "requests that never meet memory pressure keep their generated KV whole" in line
        for line in lines(RCStatConfig(decode_budget=512, eviction="lazy"))
    )
    assert not any("decode-time" in line for line in lines(RCStatConfig(decode_budget=512), off=True))
    assert any("keep their generated KV whole" in line for line in lines(RCStatConfig(decode_budget=512)))  # default
    threshold = "local_contrast does not apply (Eq. 9 compares RC's own scores with c)"
    assert any(threshold in line for line in lines(RCStatConfig(c=0.5, target_ratio=None)))
    assert not any(threshold in line for line in lines(RCStatConfig()))
    assert not any(threshold in line for line in lines(RCStatConfig(c=0.5, target_ratio=None, local_contrast=0)))


def test_query_reductions_are_the_scorers():
    """The config (no torch) allows RC's query reductions from their declaration: the same as the scorers take."""
    from rcstat_vllm.config import KNOBS
    from rcstat_vllm.scoring.rc import GROUP_REDUCTIONS
    from rcstat_vllm.scoring.rc import QUERY_REDUCTIONS as SCORER_REDUCTIONS

    assert KNOBS["query_reduction"].choices == SCORER_REDUCTIONS
    assert KNOBS["group_reduction"].choices == GROUP_REDUCTIONS


def test_config_and_settings_import_no_torch():
    """The scheduler's process reads methods, windows and RC's defaults through the torch-free registry: importing the
    config and the settings, and asking what a baseline observes, leaves torch unimported (a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, rcstat_vllm.settings, rcstat_vllm.config; from rcstat_vllm.settings import observed_queries; "
        "from rcstat_vllm.config import RCStatConfig; "
        "assert [observed_queries(RCStatConfig(method=m)) for m in ('rc', 'snapkv', 'tova')] == [32, 64, 1]; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_server_setting_is_refused_as_a_request_override():
    """``async_scheduling`` is the engine's (how its scheduler runs): the flag sets it, a request cannot."""
    assert RCStatConfig.from_dict({"async_scheduling": "keep"}).async_scheduling == "keep"
    with pytest.raises(ConfigError, match=r"'async_scheduling'.*a server setting") as error:
        RCStatConfig().merged({"async_scheduling": "keep"})
    assert error.value.field == "async_scheduling"


def test_cuda_graphs_is_a_server_setting_with_two_values():
    """``cuda_graphs`` decides what vLLM captures at start-up (the backend's graph support): the flag sets it, a
    request cannot, and an unknown mode is refused naming the field."""
    assert RCStatConfig().cuda_graphs == "piecewise"
    assert RCStatConfig.from_dict({"cuda_graphs": "full_decode"}).cuda_graphs == "full_decode"
    with pytest.raises(ConfigError, match=r"'cuda_graphs'.*a server setting") as error:
        RCStatConfig().merged({"cuda_graphs": "full_decode"})
    assert error.value.field == "cuda_graphs"
    with pytest.raises(ConfigError, match=r"'cuda_graphs'.*piecewise \| full_decode") as error:
        RCStatConfig.from_dict({"cuda_graphs": "full"})
    assert error.value.field == "cuda_graphs"
