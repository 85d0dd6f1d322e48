"""Which prompt tokens each KV head keeps, given per-(head, token) scores: one step shared by all methods.

Two modes:

* :func:`select_threshold`: RCStat's adaptive rule (Eq. 9). Each head evicts the tokens scoring at most
  c times its own mean, so each head keeps a different number of tokens and the compression ratio is an
  outcome, not an input.
* :func:`select_budget`: a target compression ratio per layer, filled with the layer's top scores across
  all its heads (heads still keep different counts). This gives matched-ratio comparisons between methods
  and mild compression that Eq. 9 cannot offer (scores of exactly 0 are common and evicted for any c >= 0).
* :func:`select_budget_across_layers`: the same ratio over the whole model: the top entries across all layers
  and heads, by scores made comparable across layers (:data:`LAYER_COMPARABLE_SCORES`), so layers keep
  different shares (useful when the cache pools pages across layers: uneven layers then cost nothing).

Both always keep the observation window (last ``window`` tokens), the first ``sink_tokens`` tokens and every
token whose score is not finite (scorers mark tokens they always keep with +inf).

Selection runs once per compressed request inside the engine's forward, so it queues device work only: no
``int(tensor)``, ``.item()`` or ``.tolist()`` on the scores (each would wait for the GPU). Counts that depend on
the scores (the forced entries of a budget) stay tensors; the caller copies what the host needs at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # (annotations only)
    from rcstat_vllm.config import RCStatConfig

__all__ = [
    "KeepSet",
    "budget_keep_count",
    "forced_keep_mask",
    "layer_floor_ratio",
    "relative_to_head_mean",
    "relative_to_layer_mean",
    "select_budget",
    "select_budget_across_layers",
    "select_threshold",
]


@dataclass(frozen=True)
class KeepSet:
    """Tokens kept per KV head of one layer.

    Attributes:
        mask:   [Hkv, n] bool, True = keep.
        counts: [Hkv] int64, kept tokens per head (= mask.sum(1)).
    """

    mask: Tensor
    counts: Tensor

    @classmethod
    def from_mask(cls, mask: Tensor) -> KeepSet:
        return cls(mask=mask, counts=mask.sum(dim=1, dtype=torch.int64))

    def indices(self) -> list[Tensor]:
        """Per head, the kept token indices in ascending order (int64), as compaction needs them."""
        return [torch.nonzero(row, as_tuple=False).squeeze(1) for row in self.mask]

    @property
    def num_kept(self) -> int:
        return int(self.counts.sum())


def forced_keep_mask(scores: Tensor, window: int, sink_tokens: int = 0) -> Tensor:
    """[Hkv, n] bool: tokens kept whatever their score (window, sinks, non-finite scores)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, n], got {tuple(scores.shape)}")
    if window < 0 or sink_tokens < 0:
        raise ValueError(f"window and sink_tokens must be >= 0, got {window} and {sink_tokens}")
    n = scores.shape[1]
    positions = torch.arange(n, device=scores.device)
    structural = (positions >= n - window) | (positions < sink_tokens)
    return structural.unsqueeze(0) | ~torch.isfinite(scores)


def select_threshold(scores: Tensor, window: int, c: float, sink_tokens: int = 0) -> KeepSet:
    """Eq. 9: head h evicts non-window token i when scores[h, i] <= c * mean_h.

    mean_h is head h's own mean over its non-window tokens with finite scores (the paper's
    E[Z(p minus window, window)], so each head adapts to its own contextual load). Sink tokens count in
    the mean (they are part of the paper's prompt) but are never evicted. Non-finite scores (+inf: tokens
    a scorer always keeps) are excluded from the mean and kept. A head with no finite non-window score
    evicts nothing. The comparison is done in float64.

    Args:
        scores: [Hkv, n] higher = more important.
        window: the last ``window`` tokens are always kept.
        c: threshold multiplier, >= 0. Note c = 0 still evicts every token scoring exactly 0 (common for RC).
        sink_tokens: the first ``sink_tokens`` tokens are always kept.
    Returns:
        KeepSet.
    """
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"c must be a finite number >= 0, got {c}")
    forced = forced_keep_mask(scores, window, sink_tokens)
    n = scores.shape[1]
    in_window = (torch.arange(n, device=scores.device) >= n - window).unsqueeze(0)
    in_mean = torch.isfinite(scores) & ~in_window
    values = scores.to(torch.float64)
    count = in_mean.sum(dim=1)
    total = torch.where(in_mean, values, torch.zeros_like(values)).sum(dim=1)
    # 0 / 0 = nan for a head without candidates; nan compares False, so that head evicts nothing.
    mean = total / count
    evict = (values <= c * mean.unsqueeze(1)) & ~forced
    return KeepSet.from_mask(~evict)


def budget_keep_count(num_entries: int, ratio: float, num_forced: int | Tensor = 0) -> int | Tensor:
    """Entries a layer keeps in budget mode: num_entries - round(ratio * num_entries), at least num_forced.

    Rounding is half up (floor(x + 0.5)), not Python's half-to-even, so that anyone recomputing a budget
    (e.g. the scheduler side) gets the same number. A tensor ``num_forced`` (counted on the device) gives a
    tensor, without a host synchronisation.
    """
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    evicted = math.floor(ratio * num_entries + 0.5)
    if isinstance(num_forced, Tensor):
        return num_forced.clamp_min(num_entries - evicted)
    return max(num_entries - evicted, num_forced)


def select_budget(scores: Tensor, window: int, ratio: float, sink_tokens: int = 0) -> KeepSet:
    """Keep a layer's top-scoring entries across all its KV heads so that a fraction ``ratio`` is evicted.

    The layer keeps exactly ``budget_keep_count(Hkv * n, ratio, forced)`` entries: Hkv*n - round(ratio*Hkv*n),
    unless the forced entries (window, sinks and non-finite scores, see :func:`forced_keep_mask`) are more,
    in which case exactly the forced entries are kept (the ratio is then not reached). The rest are the
    highest raw scores over all heads of the layer (no per-head normalisation), so heads keep different
    counts. Ties are broken towards the lower (head, token) index, deterministically.

    Args:
        scores: [Hkv, n] higher = more important.
        window: the last ``window`` tokens are always kept.
        ratio:  target fraction of the layer's Hkv * n entries to evict, in [0, 1].
        sink_tokens: the first ``sink_tokens`` tokens are always kept.
    Returns:
        KeepSet.
    """
    forced = forced_keep_mask(scores, window, sink_tokens)
    num_heads, n = scores.shape
    keep = budget_keep_count(num_heads * n, ratio, forced.sum())  # a device tensor: no host sync
    priority = scores.to(torch.float64).masked_fill(forced, float("inf")).flatten()
    # Stable descending sort: equal scores keep their flat order, so lower (head, token) wins ties.
    order = torch.sort(priority, descending=True, stable=True).indices
    # The first `keep` entries of the order, by comparing ranks with the count (slicing would need it on the host).
    in_budget = torch.arange(num_heads * n, device=scores.device) < keep
    mask = torch.empty(num_heads * n, dtype=torch.bool, device=scores.device).scatter_(0, order, in_budget)
    return KeepSet.from_mask(mask.view(num_heads, n))


def _finite_non_window_mean(scores: Tensor, window: int, dim) -> Tensor:
    n = scores.shape[-1]
    in_mean = torch.isfinite(scores) & (torch.arange(n, device=scores.device) < n - window)
    values = torch.where(in_mean, scores.to(torch.float64), torch.zeros((), dtype=torch.float64))
    return values.sum(dim=dim, keepdim=True) / in_mean.sum(dim=dim, keepdim=True).clamp_min(1)


def relative_to_head_mean(scores: Tensor, window: int) -> Tensor:
    """Score / its head's mean non-window score: Eq. 9's own yardstick, so ranking by it is RCStat's threshold
    rule with one model-wide c chosen to meet the budget."""
    return scores.to(torch.float64) / _finite_non_window_mean(scores, window, dim=-1).clamp_min(1e-30)


def relative_to_layer_mean(scores: Tensor, window: int) -> Tensor:
    """Score / the mean non-window score of its whole layer (heads of one layer stay on one scale): how a model-wide
    budget makes layers' scores comparable (measured against the others, ``benchmarks/layer_budgets.py``:
    docs/defaults.md, "Which mode")."""
    return scores.to(torch.float64) / _finite_non_window_mean(scores, window, dim=(-2, -1)).clamp_min(1e-30)


def layer_floor_ratio(ratio: float, layer_floor: float) -> float:
    """The per-layer eviction ratio whose kept entries are ``layer_floor`` of a layer's equal share of a budget
    that evicts ``ratio``: the layer keeps ``layer_floor * (1 - ratio)`` of its entries."""
    if not 0 <= layer_floor <= 1:
        raise ValueError(f"layer_floor must be in [0, 1], got {layer_floor}")
    return 1 - layer_floor * (1 - ratio)


def select_budget_across_layers(
    scores: list[Tensor],
    window: int,
    ratio: float,
    sink_tokens: int = 0,
    layer_floor: float = 0.0,
    normalise: Callable[[Tensor, int], Tensor] = relative_to_layer_mean,
) -> list[Tensor]:
    """Keep the model's top entries across all layers and heads so that a fraction ``ratio`` is evicted.

    Scores are first made comparable across layers (``normalise``: each score relative to its layer's mean); then
    exactly :func:`select_budget` runs over all ``L * Hkv`` (layer, head) rows at once: the window, sinks and
    non-finite scores of every row are kept, and the rest of the model's budget goes to the highest comparable scores
    wherever they are. Layers therefore keep different shares.

    ``layer_floor`` reserves part of the budget per layer: each layer first keeps its own top
    ``layer_floor * (1 - ratio)`` entries (:func:`select_budget` at :func:`layer_floor_ratio`, as a per-layer
    budget would), and only the rest of the model's budget is given out across layers. 0 = a purely model-wide
    budget, 1 = exactly the per-layer budget (nothing is left to give out); in between, no layer can be starved
    below the floor while layers that need more still get it. The total kept is the same for every floor.

    Returns:
        per layer, the ``[Hkv, n]`` keep mask.
    """
    floor_ratio = layer_floor_ratio(ratio, layer_floor)
    # Non-finite scores stay non-finite (forced keeps) whatever the normalisation; a layer's floor entries are
    # made +inf, so the model-wide selection keeps them and gives out only the rest of the budget.
    layers = []
    for s in scores:
        layer = torch.where(torch.isfinite(s), normalise(s, window), s.to(torch.float64))
        if layer_floor > 0:
            layer = layer.masked_fill(select_budget(s, window, floor_ratio, sink_tokens).mask, float("inf"))
        layers.append(layer)
    comparable_scores = torch.stack(layers)
    num_layers, num_heads, n = comparable_scores.shape
    keep = select_budget(comparable_scores.view(num_layers * num_heads, n), window, ratio, sink_tokens)
    return list(keep.mask.view(num_layers, num_heads, n).unbind(0))


def select_keep_masks(scores: list[Tensor], config: RCStatConfig) -> list[Tensor]:
    """Per layer, the ``[H, n]`` keep mask from the layers' scores: threshold mode (Eq. 9, per head) or budget
    mode, per layer or across the whole model (``config.budget_scope``)."""
    ratio = config.target_ratio
    if ratio is not None and config.budget_scope == "model":
        return select_budget_across_layers(
            scores, config.window, ratio, config.sink_tokens, layer_floor=config.layer_floor
        )
    if ratio is not None:
        return [select_budget(s, config.window, ratio, config.sink_tokens).mask for s in scores]
    return [select_threshold(s, config.window, config.c, config.sink_tokens).mask for s in scores]
