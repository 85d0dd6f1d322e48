"""RC's knobs, defined once: the plugin's defaults (:data:`RC_DEFAULTS`) and the paper's (:data:`RC_PAPER`).

Plain Python (no torch): :class:`~rcstat_vllm.config.RCStatConfig` takes its RC defaults from here, and so does
:class:`~rcstat_vllm.scoring.methods.rc.RCScorer`, so a scorer built directly (``RCScorer()``) scores as the
default config does. The paper's own scores are one explicit preset away: ``RCScorer.paper()``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["RCKnobs", "RC_DEFAULTS", "RC_PAPER", "QUERY_REDUCTIONS"]

#: How the observation window's queries combine into one score per token (``mean`` = Eq. 6, the paper's).
QUERY_REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class RCKnobs:
    """One setting of RC's knobs (what each does: :class:`~rcstat_vllm.scoring.methods.rc.RCScorer`).

    Attributes:
        window: the observation window (the config's ``window``: RC observes the window it keeps).
        smoothing, carry_forward, local_contrast, contrast_radius, query_reduction: the scorer's knobs, under the
            config's names.
    """

    window: int
    smoothing: int
    carry_forward: int
    local_contrast: float
    contrast_radius: int
    query_reduction: str

    def scorer_options(self) -> dict:
        """The scorer's constructor options (``window`` is its ``window_size``)."""
        options = asdict(self)
        options["window_size"] = options.pop("window")
        return options


#: The plugin's defaults, chosen by measurement (docs/defaults.md): a 32-token window (the
#: question, not only the chat template's tail), 3-token smoothing; each score carried 8 tokens forward, so a value
#: is kept with the key the window's queries find ("Carrying scores forward"); each raw score divided by the square
#: root of its neighbourhood's mean (radius 256), against RC's drift towards the prompt's end ("Local contrast");
#: the max over the window's queries, so a fact one copy head's query reads is not averaged away.
RC_DEFAULTS = RCKnobs(window=32, smoothing=3, carry_forward=8, local_contrast=0.5, contrast_radius=256,
                      query_reduction="max")

#: The RCStat paper's scores: Eq. 6 (the mean over the window's queries) over an 8-query window, nothing after.
RC_PAPER = RCKnobs(window=8, smoothing=1, carry_forward=0, local_contrast=0.0, contrast_radius=256,
                   query_reduction="mean")
