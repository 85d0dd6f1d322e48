"""The scoring methods by name, without importing them: one :class:`Method` line per method.

Plain Python (no torch), because the scheduler's process and the config read it: the config validates a method
name against :data:`REGISTRY`, and :mod:`rcstat_vllm.settings` reads how many queries a method observes. A scorer
class is imported only when :meth:`Method.load` asks for it (:data:`rcstat_vllm.scoring.SCORERS`,
:func:`rcstat_vllm.scoring.get_scorer`).

Adding a method: its scorer module in :mod:`rcstat_vllm.scoring.methods` (a :class:`~rcstat_vllm.scoring.base.Scorer`
dataclass whose ``name`` is the line's), and its line below. The scorer takes its published window from the line. A
knob of its own is a :class:`~rcstat_vllm.knobs.Knob` on the line (``option``: the scorer's field it sets): the config
gets the field, its check and its default, the scorer its check, and the README's settings table its row, from that
one declaration (SnapKV's ``kernel_size`` below is the example).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from rcstat_vllm.knobs import Knob

__all__ = [
    "RC_KNOBS",
    "REGISTRY",
    "SINK_TOKENS",
    "Method",
    "knob_default",
    "method",
    "method_knobs",
    "observing_methods",
]


@dataclass(frozen=True)
class Method:
    """One scoring method.

    Attributes:
        name: the config's ``method`` value.
        scorer: where its scorer class lives, ``"module:Class"`` (imported by :meth:`load` only).
        window: the trailing prompt queries it reads by default (its published observation window; 0 = none).
        observes: whether ``observation_window`` applies: it scores with the attention of an observation window
            whose length is a knob (TOVA reads the last query only, by definition, so it does not).
        knobs: its own settings (config fields that only it reads; each sets the scorer field ``option``).
        shared: general settings it reads too, as (scorer field, the setting's knob): StreamingLLM's sinks are the
            config's ``sink_tokens``.
    """

    name: str
    scorer: str
    window: int
    observes: bool = False
    knobs: tuple[Knob, ...] = ()
    shared: tuple[tuple[str, Knob], ...] = ()

    def load(self) -> type:
        """The scorer class (imports its module, and torch)."""
        module, _, attribute = self.scorer.partition(":")
        return getattr(importlib.import_module(module), attribute)


_METHODS = "rcstat_vllm.scoring.methods"

#: RC's knobs: the plugin's defaults, chosen by measurement (docs/defaults.md): 3-token smoothing, 5 from a budget of
#: 0.9 on (issue 56: a value's digits kept or lost together, "Knobs by ratio"); each score carried 8
#: tokens forward, so a value is kept with the key the window's queries find ("Carrying scores forward"); each raw
#: score divided by the square root of its neighbourhood's mean (radius 256), against RC's drift towards the prompt's
#: end ("Local contrast"); the max over the window's queries, so a fact one copy head's query reads is not averaged
#: away; from a budget of 0.9 on, the max over a KV head's query heads too, below it their mean (issue 56, "Past the
#: cliff": evicting a KV head's entry closes every one of its query heads' routes to the token). The paper's own
#: values: ``rc_knobs.RC_PAPER``.
RC_KNOBS = (
    Knob(
        "smoothing",
        3,
        "RC: scores averaged over this many neighbouring tokens (1 = RCStat's scores)",
        minimum=1,
        odd=True,
        option="smoothing",
        by_ratio=((0.9, 5),),
    ),
    Knob(
        "carry_forward",
        8,
        "RC: each score raised to the highest of the `carry_forward` tokens before it (0 = RCStat's)",
        minimum=0,
        option="carry_forward",
    ),
    Knob(
        "query_reduction",
        "max",
        "RC: `max` = the window query that reads a token most; `mean` = Eq. 6 (RCStat's)",
        kind="choice",
        choices=("max", "mean"),
        option="query_reduction",
    ),
    Knob(
        "group_reduction",
        "mean",
        "RC: `max` = a KV head scores a token by the query head of its GQA group that reads it most; `mean` = "
        "RCStat's GQA mean",
        kind="choice",
        choices=("max", "mean"),
        option="group_reduction",
        by_ratio=((0.9, "max"),),
    ),
    Knob(
        "local_contrast",
        0.5,
        "RC, budget mode: each score divided by its neighbourhood's mean to this power (0 = RCStat's)",
        kind="number",
        minimum=0,
        maximum=1,
        option="local_contrast",
    ),
    Knob(
        "contrast_radius", 256, "RC: tokens on either side in that neighbourhood", minimum=1, option="contrast_radius"
    ),
    Knob(
        "value_weight",
        0.0,
        "RC, budget mode: each score times its token's value norm (in that KV head) to this power (0 = RCStat's)",
        kind="number",
        minimum=0,
        maximum=2,
        option="value_weight",
    ),
    Knob(
        "chunk",
        1,
        "RC, budget mode: each score the mean over its chunk of this many tokens (1 = RCStat's)",
        minimum=1,
        option="chunk",
    ),
)

#: A general setting a method reads too: StreamingLLM's attention sinks are the tokens every head keeps (the config
#: lists it with its general settings).
SINK_TOKENS = Knob(
    "sink_tokens", 4, "the first prompt tokens every head keeps (StreamingLLM's attention sinks too)", minimum=0
)

#: Every scoring method, by name. ``none`` (the config's off switch) is not one: the caller skips scoring.
REGISTRY: dict[str, Method] = {
    line.name: line
    for line in (
        # RC's window is the config's default window (the paper observes the kept window; its own was 8: RC_PAPER).
        Method("rc", f"{_METHODS}.rc:RCScorer", window=32, observes=True, knobs=RC_KNOBS),
        Method(
            "snapkv",
            f"{_METHODS}.snapkv:SnapKVScorer",
            window=64,
            observes=True,  # kvpress's SnapKVPress
            knobs=(
                Knob(
                    "kernel_size",
                    5,
                    "SnapKV: the width of the average pooling along tokens (5 as published)",
                    minimum=1,
                    odd=True,
                    option="kernel_size",
                ),
            ),
        ),
        Method("tova", f"{_METHODS}.tova:TOVAScorer", window=1),  # the last prompt token's attention
        Method("knorm", f"{_METHODS}.knorm:KnormScorer", window=0),
        Method("streaming", f"{_METHODS}.streaming:StreamingLLMScorer", window=0, shared=(("n_sink", SINK_TOKENS),)),
        Method("random", f"{_METHODS}.random:RandomScorer", window=0),
    )
}


def method(name: str) -> Method:
    """The line of method ``name``; a ValueError listing the allowed names when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scoring method {name!r}; allowed: {', '.join(sorted(REGISTRY))}") from None


def observing_methods() -> tuple[str, ...]:
    """The methods whose observation window is a knob (``observation_window``)."""
    return tuple(name for name, line in REGISTRY.items() if line.observes)


def method_knobs() -> tuple[Knob, ...]:
    """Every method's own knobs, in registry order."""
    return tuple(knob for line in REGISTRY.values() for knob in line.knobs)


def knob_default(method_name: str, knob_name: str):
    """The default of a method's own knob (a scorer's field default reads it here: declared once)."""
    return next(knob.default for knob in REGISTRY[method_name].knobs if knob.name == knob_name)
