"""Every setting is declared once (a Knob): the config's fields, defaults and checks, the scorers' checks and options,
and the README's settings table all come from the declarations (issue 54)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rcstat_vllm.config import BY_RATIO, KNOBS, RATIO_KNOBS, ConfigError, RCStatConfig, settings_table
from rcstat_vllm.knobs import Knob
from rcstat_vllm.scoring.registry import REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_settings_table_is_the_declarations():
    assert settings_table() in README.read_text(), "README's settings table: paste rcstat_vllm.config.settings_table()"


def test_every_config_field_is_a_declared_knob_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(RCStatConfig)}
    assert list(fields) == [*KNOBS][:1] + [n for n in fields if n != "method"]  # (method first, as declared)
    assert set(fields) == set(KNOBS)
    # A default that depends on the budget is resolved at construction (BY_RATIO until then): the bare flag's is the
    # knob's default.
    assert fields == {name: BY_RATIO if knob.by_ratio else knob.default for name, knob in KNOBS.items()}
    assert RCStatConfig().to_dict() == {name: knob.default for name, knob in KNOBS.items()}


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_each_knob_rejects_what_it_does_not_allow_naming_the_field(name):
    knob = KNOBS[name]
    bad = ["x", 1.5] if knob.kind == "int" else [True, float("nan")] if knob.kind == "number" else ["bogus", 3]
    if knob.odd:
        bad.append(4)
    for value in bad:
        with pytest.raises(ConfigError, match=f"'{name}'"):
            RCStatConfig.from_dict({name: value})


def test_a_scorer_allows_what_the_config_allows():
    """The same declaration checks both (contrast_radius: >= 1 in the config and the scorer alike)."""
    from rcstat_vllm.scoring import get_scorer

    for method, line in REGISTRY.items():
        for knob in line.knobs:
            bad = 0 if knob.minimum == 1 else -1
            with pytest.raises(ConfigError, match=f"'{knob.name}'"):
                RCStatConfig.from_dict({"method": method, knob.name: bad})
            with pytest.raises(ConfigError, match=f"'{knob.name}'"):
                get_scorer(method, **{knob.option: bad})
    with pytest.raises(ConfigError, match="'sink_tokens'"):  # StreamingLLM's sinks are the shared sink_tokens
        get_scorer("streaming", n_sink=-1)


def test_every_methods_own_knobs_reach_its_scorer_from_the_config():
    from rcstat_vllm.scoring import get_scorer
    from rcstat_vllm.settings import scorer_options

    snapkv = get_scorer("snapkv", **scorer_options(RCStatConfig.from_dict({"method": "snapkv", "kernel_size": 9})))
    assert snapkv.kernel_size == 9 and snapkv.window_size == 64
    streaming = get_scorer(
        "streaming", **scorer_options(RCStatConfig.from_dict({"method": "streaming", "sink_tokens": 8}))
    )
    assert streaming.n_sink == 8
    rc = get_scorer("rc", **scorer_options(RCStatConfig.from_dict({"contrast_radius": 64, "smoothing": 5})))
    assert (rc.contrast_radius, rc.smoothing, rc.window_size) == (64, 5, 32)


def test_a_new_methods_knob_is_one_declaration():
    """The docs' example: a knob on a registry line is a config field's check (its field is added to RCStatConfig
    with the declaration's default), a scorer's check, and a README row."""
    knob = Knob("kernel_size", 5, "SnapKV: ...", minimum=1, odd=True, option="kernel_size")
    assert knob.allowed() == "an odd integer >= 1"
    knob.check(7)
    with pytest.raises(ConfigError, match="'kernel_size': got 4, allowed: an odd integer >= 1"):
        knob.check(4)
    assert KNOBS["decode_budget"].allowed(RCStatConfig(window=16)) == "null or an integer >= window (16)"


# ---------------------------------------------------------------------------------------------- defaults by ratio
# Issue 56 (docs/defaults.md, "Knobs by ratio"): RC smooths over 5 tokens from a budget of 0.9 on, over 3 below it;
# a KV head's query heads combine by their max from 0.9 on ("Past the cliff"), by their mean below it.


def test_smoothing_and_group_reduction_are_the_knobs_whose_defaults_follow_the_ratio():
    assert RATIO_KNOBS == ("smoothing", "group_reduction")
    assert KNOBS["smoothing"].default == 3 and KNOBS["smoothing"].by_ratio == ((0.9, 5),)
    assert KNOBS["group_reduction"].default == "mean" and KNOBS["group_reduction"].by_ratio == ((0.9, "max"),)


@pytest.mark.parametrize(
    ("target_ratio", "group_reduction"),
    [(0.4, "mean"), (0.5, "mean"), (0.8, "mean"), (0.89, "mean"), (0.9, "max"), (0.95, "max"), (None, "mean")],
)
def test_group_reduction_resolves_by_target_ratio(target_ratio, group_reduction):
    assert RCStatConfig.from_dict({"target_ratio": target_ratio}).group_reduction == group_reduction
    assert RCStatConfig().merged({"target_ratio": target_ratio}).group_reduction == group_reduction
    assert RCStatConfig.from_dict({"target_ratio": 0.9, "group_reduction": "mean"}).group_reduction == "mean"


@pytest.mark.parametrize(
    ("target_ratio", "smoothing"), [(0.4, 3), (0.5, 3), (0.8, 3), (0.89, 3), (0.9, 5), (0.95, 5), (None, 3)]
)
def test_smoothing_resolves_by_target_ratio(target_ratio, smoothing):
    assert RCStatConfig.from_dict({"target_ratio": target_ratio}).smoothing == smoothing
    assert RCStatConfig(target_ratio=target_ratio).smoothing == smoothing  # built directly: the same rule
    assert RCStatConfig().merged({"target_ratio": target_ratio}).smoothing == smoothing  # a request's override


def test_the_bare_flag_is_unchanged():
    """{} (RC at 0.4) resolves every knob to the values it had before the schedule: smoothing 3."""
    bare = RCStatConfig.from_dict({})
    assert bare.target_ratio == 0.4 and bare.smoothing == 3 and bare.carry_forward == 8
    assert bare.local_contrast == 0.5 and bare.window == 32 and bare.observation_window is None
    assert bare.group_reduction == "mean"
    assert bare == RCStatConfig() and bare.follows_ratio == frozenset({"smoothing", "group_reduction"})
    assert RCStatConfig.from_dict({"c": 1.0}).smoothing == 3  # threshold mode: the plain default


def test_a_given_value_wins_over_the_ratio_server_wide_and_per_request():
    assert RCStatConfig.from_dict({"target_ratio": 0.9, "smoothing": 3}).smoothing == 3
    assert RCStatConfig(target_ratio=0.9, smoothing=3).smoothing == 3
    assert RCStatConfig.from_dict({"target_ratio": 0.9}).merged({"smoothing": 1}).smoothing == 1
    # a server that gives smoothing keeps it under every request's ratio
    server = RCStatConfig.from_dict({"smoothing": 7})
    assert server.follows_ratio == frozenset({"group_reduction"})
    assert server.merged({"target_ratio": 0.9}).smoothing == 7
    assert server.merged({"target_ratio": 0.4}).smoothing == 7
    # a request that gives smoothing keeps it when a later merge changes the ratio
    assert RCStatConfig().merged({"smoothing": 3, "target_ratio": 0.9}).merged({"target_ratio": 0.95}).smoothing == 3


def test_a_left_out_value_follows_each_merges_ratio():
    """The server's 0.9 smooths over 5; a request asking 0.4 of it gets 0.4's 3, and back; threshold mode 3."""
    server = RCStatConfig.from_dict({"target_ratio": 0.9})
    assert server.smoothing == 5
    assert server.merged({"target_ratio": 0.4}).smoothing == 3
    assert server.merged({"target_ratio": 0.4}).merged({"target_ratio": 0.9}).smoothing == 5
    assert server.merged({"c": 2.0}).smoothing == 3
    assert server.merged({"carry_forward": 12}).smoothing == 5  # another field's override leaves it as resolved


def test_the_resolved_value_is_what_the_scorer_and_the_record_see():
    import pickle

    from rcstat_vllm.settings import RequestSettings, scorer_options

    server = RCStatConfig.from_dict({})
    request = RequestSettings.resolve({"rcstat": {"target_ratio": 0.9}}, server).config
    assert scorer_options(request)["smoothing"] == 5
    assert scorer_options(server)["smoothing"] == 3
    assert request.to_dict()["smoothing"] == 5  # results and benchmark JSON record the value that ran
    again = pickle.loads(pickle.dumps(request))  # (a config crosses processes pickled)
    assert again == request and again.follows_ratio == request.follows_ratio
    assert again.merged({"target_ratio": 0.5}).smoothing == 3


def test_the_settings_table_gives_the_schedule():
    assert "| `smoothing` | `3`; `5` from `target_ratio` 0.9 |" in settings_table()
    assert Knob("x", 3, "x", by_ratio=((0.7, 5), (0.9, 7))).default_at(0.8) == 5
    assert Knob("x", 3, "x", by_ratio=((0.7, 5), (0.9, 7))).default_at(0.9) == 7
    assert Knob("x", 3, "x", by_ratio=((0.7, 5),)).default_at(None) == 3
