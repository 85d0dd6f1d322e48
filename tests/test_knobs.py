"""Every setting is declared once (a Knob): the config's fields, defaults and checks, the scorers' checks and options,
and the README's settings table all come from the declarations (issue 54)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rcstat_vllm.config import KNOBS, ConfigError, RCStatConfig, settings_table
from rcstat_vllm.knobs import Knob
from rcstat_vllm.scoring.registry import REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readmes_settings_table_is_the_declarations():
    assert settings_table() in README.read_text(), "README's settings table: paste rcstat_vllm.config.settings_table()"


def test_every_config_field_is_a_declared_knob_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(RCStatConfig)}
    assert list(fields) == [*KNOBS][:1] + [n for n in fields if n != "method"]  # (method first, as declared)
    assert set(fields) == set(KNOBS)
    assert fields == {name: knob.default for name, knob in KNOBS.items()}


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
