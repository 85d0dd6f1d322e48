"""RC's knobs as one value: the plugin's defaults (:data:`RC_DEFAULTS`, from the declarations on RC's registry line)
and the paper's (:data:`RC_PAPER`).

Plain Python (no torch): :class:`~rcstat_vllm.config.RCStatConfig` takes its RC defaults from here, and so does
:class:`~rcstat_vllm.scoring.methods.rc.RCScorer`, so a scorer built directly (``RCScorer()``) scores as the
default config does. The paper's own scores are one explicit preset away: ``RCScorer.paper()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .registry import RC_KNOBS, REGISTRY

__all__ = ["GROUP_REDUCTIONS", "QUERY_REDUCTIONS", "RC_DEFAULTS", "RC_PAPER", "RCKnobs"]

#: How the observation window's queries combine into one score per token (``mean`` = Eq. 6, the paper's).
QUERY_REDUCTIONS = next(knob.choices for knob in RC_KNOBS if knob.name == "query_reduction")
#: How a KV head's query heads (its GQA group) combine into its score of a token (``mean`` = the paper's).
GROUP_REDUCTIONS = next(knob.choices for knob in RC_KNOBS if knob.name == "group_reduction")


@dataclass(frozen=True)
class RCKnobs:
    """One setting of RC's knobs (what each does: :class:`~rcstat_vllm.scoring.methods.rc.RCScorer`).

    Attributes:
        window: the observation window (the config's ``window``: RC observes the window it keeps).
        smoothing, carry_forward, local_contrast, contrast_radius, query_reduction, group_reduction, value_weight,
            chunk: the
            scorer's knobs, under the config's names.
    """

    window: int
    smoothing: int
    carry_forward: int
    local_contrast: float
    contrast_radius: int
    query_reduction: str
    group_reduction: str
    value_weight: float
    chunk: int

    def scorer_options(self) -> dict:
        """The scorer's constructor options (``window`` is its ``window_size``)."""
        options = asdict(self)
        options["window_size"] = options.pop("window")
        return options


#: The plugin's defaults, chosen by measurement (docs/defaults.md), declared with RC's registry line
#: (:data:`~rcstat_vllm.scoring.registry.RC_KNOBS`, why each there): a 32-token window (the question, not only the
#: chat template's tail) and RC's knobs.
RC_DEFAULTS = RCKnobs(window=REGISTRY["rc"].window, **{knob.name: knob.default for knob in RC_KNOBS})

#: The RCStat paper's scores: Eq. 6 (the mean over the window's queries) over an 8-query window, nothing after.
RC_PAPER = RCKnobs(
    window=8,
    smoothing=1,
    carry_forward=0,
    local_contrast=0.0,
    contrast_radius=256,
    query_reduction="mean",
    group_reduction="mean",
    value_weight=0.0,
    chunk=1,
)
