"""One declaration per setting: :class:`Knob` (name, default, what values it allows, what it does).

The config (:mod:`rcstat_vllm.config`) declares the general settings; each scoring method declares its own beside its
registry line (:mod:`rcstat_vllm.scoring.registry`). From the declarations come the config's defaults and checks, the
scorers' checks, the options a scorer is built with (:func:`rcstat_vllm.settings.scorer_options`) and the README's
settings table (:func:`rcstat_vllm.config.settings_table`). Plain Python: the scheduler's process reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """An invalid rcstat setting; the message names the field and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field = field
        super().__init__(f"rcstat config field '{field}': got {value!r}, allowed: {allowed}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Knob:
    """One setting.

    Attributes:
        name: the config field (``--additional-config '{"rcstat": {name: ...}}'``, ``vllm_xargs``).
        default: its value when not given.
        doc: what it does, one line (the README's settings table).
        kind: ``int``, ``number`` (int or float, finite) or ``choice`` (one of ``choices``).
        minimum: the least allowed value, or the name of another field whose value is the least (``window``).
        maximum: the largest allowed value (``kind == "number"``); ``open_maximum``: the maximum itself excluded.
        odd: an odd integer (same-length pooling widths).
        nullable: null allowed (off, or "the method's own").
        option: the scorer's constructor argument it sets, when a scorer reads it (None: the scorer does not).
        server_only: set for the whole engine (``--additional-config``); a per-request override is an error.
        by_ratio: a default that depends on the budget: ``((ratio, value), ...)`` in rising order, each ``value``
            the default from ``target_ratio >= ratio`` on (below the first, and in threshold mode: ``default``). A
            config that leaves the field out follows its ``target_ratio``; a value given (server-wide or per
            request) wins (:class:`~rcstat_vllm.config.RCStatConfig`).
    """

    name: str
    default: Any
    doc: str
    kind: str = "int"
    minimum: float | str | None = None
    maximum: float | None = None
    open_maximum: bool = False
    odd: bool = False
    choices: tuple[str, ...] = ()
    nullable: bool = False
    option: str | None = None
    server_only: bool = False
    by_ratio: tuple[tuple[float, Any], ...] = ()

    def default_at(self, target_ratio: Any) -> Any:
        """The default under ``target_ratio`` (None: threshold mode, the plain ``default``)."""
        value = self.default
        if is_number(target_ratio):
            for ratio, scheduled in self.by_ratio:
                if target_ratio >= ratio:
                    value = scheduled
        return value

    def default_text(self) -> str:
        """The default in words for the settings table: ``3``, or ``3``; ``5`` from ``target_ratio`` 0.9."""
        text = f"`{json.dumps(self.default)}`"
        for ratio, scheduled in self.by_ratio:
            text += f"; `{json.dumps(scheduled)}` from `target_ratio` {ratio:g}"
        return text

    def allowed(self, values: Any = None) -> str:
        """The allowed values in words; ``values`` (a config) names a field minimum's current value."""
        if self.kind == "choice":
            text = " | ".join(self.choices)
        elif self.kind == "number" and self.maximum is not None:
            text = f"a number in [{self.minimum:g}, {self.maximum:g}{')' if self.open_maximum else ']'}"
        else:
            noun = "a finite number" if self.kind == "number" else "an odd integer" if self.odd else "an integer"
            text = noun if self.minimum is None else f"{noun} >= {self._minimum_text(values)}"
        return f"null or {text}" if self.nullable else text

    def check(self, value: Any, values: Any = None) -> None:
        """Raise :class:`ConfigError` naming this field unless ``value`` is allowed (``values``: the config, for a
        minimum named by another field)."""
        if value is None and self.nullable:
            return
        if not self._valid(value, values):
            raise ConfigError(self.name, value, self.allowed(values))

    def _valid(self, value: Any, values: Any) -> bool:
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if not (is_int(value) if self.kind == "int" else is_number(value) and math.isfinite(value)):
            return False
        if self.odd and value % 2 == 0:
            return False
        minimum = getattr(values, self.minimum) if isinstance(self.minimum, str) else self.minimum
        if minimum is not None and value < minimum:
            return False
        if self.maximum is not None:
            return value < self.maximum if self.open_maximum else value <= self.maximum
        return True

    def _minimum_text(self, values: Any) -> str:
        if isinstance(self.minimum, str):
            return self.minimum if values is None else f"{self.minimum} ({getattr(values, self.minimum)})"
        return f"{self.minimum:g}"
