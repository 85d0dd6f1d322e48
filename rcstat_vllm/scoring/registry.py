"""The scoring methods by name, without importing them: one :class:`Method` line per method.

Plain Python (no torch), because the scheduler's process and the config read it: the config validates a method
name against :data:`REGISTRY`, and :mod:`rcstat_vllm.settings` reads how many queries a method observes. A scorer
class is imported only when :meth:`Method.load` asks for it (:data:`rcstat_vllm.scoring.SCORERS`,
:func:`rcstat_vllm.scoring.get_scorer`).

Adding a method: its scorer module in :mod:`rcstat_vllm.scoring.methods` (a :class:`~rcstat_vllm.scoring.base.Scorer`
dataclass whose ``name`` is the line's), and its line below. The scorer takes its published window from the line.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .rc_knobs import RC_DEFAULTS

__all__ = ["Method", "REGISTRY", "method", "observing_methods"]


@dataclass(frozen=True)
class Method:
    """One scoring method.

    Attributes:
        name: the config's ``method`` value.
        scorer: where its scorer class lives, ``"module:Class"`` (imported by :meth:`load` only).
        window: the trailing prompt queries it reads by default (its published observation window; 0 = none).
        observes: whether ``observation_window`` applies: it scores with the attention of an observation window
            whose length is a knob (TOVA reads the last query only, by definition, so it does not).
    """

    name: str
    scorer: str
    window: int
    observes: bool = False

    def load(self) -> type:
        """The scorer class (imports its module, and torch)."""
        module, _, attribute = self.scorer.partition(":")
        return getattr(importlib.import_module(module), attribute)


_METHODS = "rcstat_vllm.scoring.methods"

#: Every scoring method, by name. ``none`` (the config's off switch) is not one: the caller skips scoring.
REGISTRY: dict[str, Method] = {line.name: line for line in (
    # RC's window is the plugin's default window (the paper observes the kept window; its own was 8: RC_PAPER).
    Method("rc", f"{_METHODS}.rc:RCScorer", window=RC_DEFAULTS.window, observes=True),
    Method("snapkv", f"{_METHODS}.snapkv:SnapKVScorer", window=64, observes=True),  # kvpress's SnapKVPress
    Method("tova", f"{_METHODS}.tova:TOVAScorer", window=1),  # the last prompt token's attention
    Method("knorm", f"{_METHODS}.knorm:KnormScorer", window=0),
    Method("streaming", f"{_METHODS}.streaming:StreamingLLMScorer", window=0),
    Method("random", f"{_METHODS}.random:RandomScorer", window=0),
)}


def method(name: str) -> Method:
    """The line of method ``name``; a ValueError listing the allowed names when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scoring method {name!r}; allowed: {', '.join(sorted(REGISTRY))}") from None


def observing_methods() -> tuple[str, ...]:
    """The methods whose observation window is a knob (``observation_window``)."""
    return tuple(name for name, line in REGISTRY.items() if line.observes)
