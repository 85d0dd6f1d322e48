"""Ways to split a model-wide budget over layers that the served path does not use, kept to measure them against the
one it does (docs/defaults.md, "Which mode"; ``benchmarks/methods.budget_scope_settings``):

- ``head_mean``: each score relative to its head's mean (Eq. 9's yardstick: RCStat's threshold rule with one
  model-wide c);
- ``layer_rank``: each layer's scores as ranks in [0, 1];
- ``depthkv``: DepthKV's per-layer budgets (metric-guided allocation) instead of one model-wide selection;
- ``layer_mean``: the package's own (:func:`rcstat_vllm.scoring.selection.relative_to_layer_mean`), for comparison.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.scoring.selection import (
    relative_to_head_mean,
    relative_to_layer_mean,
    select_budget,
    select_budget_across_layers,
    select_keep_masks,
)


def layer_rank(scores: Tensor, window: int) -> Tensor:
    """Rank within the layer, as a fraction in [0, 1] (ties share the lower rank): each layer's scores on one
    uniform scale, whatever their magnitudes."""
    flat = scores.to(torch.float64).reshape(-1)
    ranks = torch.empty_like(flat)
    order = torch.argsort(flat, stable=True)
    # Ties share the lowest rank of their run.
    sorted_values = flat[order]
    first_of_run = torch.ones_like(sorted_values, dtype=torch.bool)
    first_of_run[1:] = sorted_values[1:] != sorted_values[:-1]
    run_start = torch.cummax(torch.where(first_of_run, torch.arange(flat.numel(), device=flat.device), 0), 0).values
    ranks[order] = run_start.to(torch.float64)
    return (ranks / max(flat.numel() - 1, 1)).view_as(scores)


#: How to put different layers' scores on one scale for a model-wide budget; ``depthkv`` allocates per-layer
#: budgets instead (:func:`depthkv_layer_ratios`). The served path uses ``layer_mean`` (the package's default).
LAYER_COMPARABLE_SCORES = {
    "head_mean": relative_to_head_mean,
    "layer_mean": relative_to_layer_mean,
    "layer_rank": layer_rank,
    "depthkv": None,
}

#: DepthKV's cap on any one layer's pruning ratio (their ``r_max``), so no layer is pruned to nothing.
DEPTHKV_MAX_RATIO = 0.95


def depthkv_layer_ratios(
    scores: list[Tensor], window: int, ratio: float, max_ratio: float = DEPTHKV_MAX_RATIO
) -> list[float]:
    """Per-layer pruning ratios with mean ``ratio``, DepthKV's metric-guided allocation (MGA, Sec. 5) with an
    RC-derived robustness metric in place of their offline InfoNCE profile.

    DepthKV keeps the first layer whole, assigns the other layers ratios proportional to a robustness score
    normalised over them, caps each at ``max_ratio`` and redistributes what the caps cut among unsaturated
    layers until the mean is met. Robustness here: the share of a layer's (non-window) score mass held by its
    top ``1 - ratio`` entries; a layer whose importance sits on few tokens loses little when the rest go.
    """
    num_layers = len(scores)
    if num_layers == 1 or ratio == 0:
        return [ratio] * num_layers
    # The allocation below is a handful of floats per layer, done on the host: one transfer of the robustness.
    weights = _top_share(torch.stack(scores[1:]), window, 1 - ratio).cpu()
    weights = weights / weights.sum() if float(weights.sum()) > 0 else torch.full_like(weights, 1 / len(weights))
    # Layer 0 is not pruned: the others carry the whole model's budget.
    budget = min(ratio * num_layers, max_ratio * (num_layers - 1))
    ratios = torch.zeros(num_layers - 1, dtype=torch.float64)
    free = torch.ones(num_layers - 1, dtype=torch.bool)
    for _ in range(num_layers):  # each pass saturates at least one layer or ends
        remaining = budget - float(ratios[~free].sum())
        share = weights * free
        ratios[free] = remaining * share[free] / float(share.sum())
        over = free & (ratios > max_ratio)
        if not bool(over.any()):
            break
        ratios[over] = max_ratio
        free &= ~over
    return [0.0, *ratios.tolist()]


def _top_share(scores: Tensor, window: int, keep_fraction: float) -> Tensor:
    """[L, Hkv, n] -> float64 [L]: per layer, the share of its positive finite non-window score mass held by its top
    ``keep_fraction`` entries (1 for a layer without any), computed for all layers at once on their device."""
    n = scores.shape[-1]
    values = scores[..., : max(n - window, 0)].to(torch.float64).flatten(1)
    positive = torch.where(torch.isfinite(values), values, torch.zeros((), dtype=torch.float64)).clamp_min(0)
    total = positive.sum(dim=1)
    if positive.shape[1] == 0:
        return torch.ones_like(total)
    keep = min(max(round(keep_fraction * positive.shape[1]), 1), positive.shape[1])
    top = torch.topk(positive, keep, dim=1).values.sum(dim=1)
    return torch.where(total > 0, top / total, torch.ones_like(total))


def select_across_layers(
    scores: list[Tensor],
    window: int,
    ratio: float,
    sink_tokens: int = 0,
    comparable: str = "layer_mean",
    layer_floor: float = 0.0,
) -> list[Tensor]:
    """:func:`~rcstat_vllm.scoring.selection.select_budget_across_layers` with layers' scores made comparable by
    ``comparable`` (a key of :data:`LAYER_COMPARABLE_SCORES`); ``depthkv`` selects per layer at its own ratios."""
    if comparable not in LAYER_COMPARABLE_SCORES:
        raise ValueError(f"comparable must be one of {sorted(LAYER_COMPARABLE_SCORES)}, got {comparable!r}")
    normalise = LAYER_COMPARABLE_SCORES[comparable]
    if normalise is None:  # depthkv: its own per-layer allocation, no floor on top
        ratios = depthkv_layer_ratios(scores, window, ratio)
        return [select_budget(s, window, r, sink_tokens).mask for s, r in zip(scores, ratios)]
    return select_budget_across_layers(scores, window, ratio, sink_tokens, layer_floor, normalise=normalise)


def keep_masks(scores: list[Tensor], config: RCStatConfig, comparable: str | None = None) -> list[Tensor]:
    """The plugin's selection (:func:`~rcstat_vllm.scoring.selection.select_keep_masks`), or, for a model-wide budget
    and a ``comparable`` named, the model-wide selection with that way of comparing layers."""
    if comparable is None or config.target_ratio is None or config.budget_scope != "model":
        return select_keep_masks(scores, config)
    return select_across_layers(
        scores, config.window, config.target_ratio, config.sink_tokens, comparable, config.layer_floor
    )
