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

``coverage_floor`` (budget modes) keeps every route open at high compression: a token that one of the heads ranks high
keeps at least one copy, paid for from the heads that agree most (:func:`keep_routes_open`); :func:`head_consensus`
measures how much the heads of a layer agree on what they keep.

Both always keep the observation window (last ``window`` tokens), the first ``sink_tokens`` tokens and every
token whose score is not finite (scorers mark tokens they always keep with +inf).

Selection runs once per compressed request inside the engine's forward, so it queues device work only: no
``int(tensor)``, ``.item()`` or ``.tolist()`` on the scores (each would wait for the GPU). Counts that depend on
the scores (the forced entries of a budget) stay tensors; the caller copies what the host needs at the end. On a
CPU, where there is no device to wait for, a budget reads its count and selects instead of sorting
(:func:`first_in_order`).
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
    "first_in_order",
    "forced_keep_mask",
    "head_consensus",
    "keep_routes_open",
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


def select_budget(
    scores: Tensor,
    window: int,
    ratio: float,
    sink_tokens: int = 0,
    coverage_floor: float = 0.0,
    route_groups: int = 1,
) -> KeepSet:
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
        coverage_floor: 0 = off; else :func:`keep_routes_open` with it over ``route_groups`` groups of rows.
        route_groups: the rows split into this many groups of consecutive rows (the layers of a model-wide
            selection), each kept open on its own.
    Returns:
        KeepSet.
    """
    forced = forced_keep_mask(scores, window, sink_tokens)
    num_heads, n = scores.shape
    keep = budget_keep_count(num_heads * n, ratio, forced.sum())  # a device tensor: no host sync
    priority = scores.to(torch.float64).masked_fill(forced, float("inf"))
    if coverage_floor <= 0 and priority.device.type == "cpu":
        return KeepSet.from_mask(first_in_order(priority.flatten(), int(keep)).view(num_heads, n))
    # Stable descending sort: equal scores keep their flat order, so lower (head, token) wins ties.
    order = torch.sort(priority.flatten(), descending=True, stable=True).indices
    # The first `keep` entries of the order, by comparing ranks with the count (slicing would need it on the host).
    in_budget = torch.arange(num_heads * n, device=scores.device) < keep
    mask = torch.empty(num_heads * n, dtype=torch.bool, device=scores.device).scatter_(0, order, in_budget)
    mask = mask.view(num_heads, n)
    if coverage_floor > 0:
        mask = keep_routes_open(priority, forced, mask, order, keep, ratio, coverage_floor, route_groups)
    return KeepSet.from_mask(mask)


def first_in_order(priority: Tensor, keep: int) -> Tensor:
    """The first ``keep`` entries of ``priority`` ``[T]`` (no NaN) in its stable descending order, as a ``[T]`` mask:
    the entries above the ``keep``-th largest value, then of those equal to it the lowest indices.

    What :func:`select_budget` takes on a CPU, where reading ``keep`` costs no wait: a selection (``kthvalue``,
    linear) instead of sorting every entry of the model (a lazy copy's step waited ~8 ms for that sort at 2000
    tokens, 180k entries). The device path sorts, so that the count can stay on the device."""
    total = priority.numel()
    if keep <= 0 or keep >= total:
        return torch.full((total,), keep > 0, dtype=torch.bool, device=priority.device)
    threshold = torch.kthvalue(priority, total - keep + 1).values  # the keep-th largest
    above = priority > threshold
    ties = priority == threshold
    # (ties in index order: the first `keep - above` of them complete the count, as the stable sort orders them)
    return above | (ties & (torch.cumsum(ties, 0) <= keep - above.sum()))


def keep_routes_open(
    priority: Tensor,
    forced: Tensor,
    mask: Tensor,
    order: Tensor,
    keep: int | Tensor,
    ratio: float,
    coverage_floor: float,
    groups: int = 1,
) -> Tensor:
    """A budget's keep mask with every route kept open: the KV-compression-physics paper's erasure failure (a token
    evicted from every head at once has no route left, its Proposition 2) prevented for the tokens that matter.

    A token *ranks high* for a head when it is among that head's top ``coverage_floor * (1 - ratio) * n`` tokens
    (a ``coverage_floor`` share of the head's equal part of the budget). Each group of rows (``groups``: a layer's
    KV heads in a model-wide selection, one group per layer) keeps every token that ranks high for one of its heads
    in at least one head: where the budget kept no copy of it in the group, its copy in the group's head that
    scores it highest is added. The entries given up for them come from the heads that agree most: the copies of
    tokens the group keeps in the most heads go first (a token's copies dropped from its lowest-scored up, so
    no token loses its last copy this way; the paper's Proposition 1: with k heads keeping a token its route
    survives with probability 1 - (1 - p)^k, so a k-th copy adds least), then, if those run out, the lowest
    scores. The count kept is exactly the budget's; if the floor's copies outnumber what the budget leaves after
    the forced entries, the highest-scored of them are kept.

    Args:
        priority: [R, n] float64, the selection's priorities (+inf on forced entries).
        forced: [R, n] bool, the forced entries. mask: [R, n] bool, the budget's selection (the first ``keep``
            entries of ``order``, the flat descending sort of ``priority``).
        keep: the entries kept (a tensor: no host sync). ratio: the budget's eviction ratio.
        coverage_floor: in (0, 1]. groups: R is split into this many groups of consecutive rows.
    Returns:
        [R, n] bool keep mask with exactly as many entries as ``mask``.
    """
    rows, n = priority.shape
    if rows % groups:
        raise ValueError(f"{rows} rows do not split into {groups} groups")
    per_group = rows // groups
    device = priority.device
    high = min(math.floor(coverage_floor * (1 - ratio) * n + 0.5), n)
    if high == 0:
        return mask
    open_priority = priority.masked_fill(forced, float("-inf"))
    top = torch.topk(open_priority, high, dim=1).indices
    ranks_high = torch.zeros_like(forced).scatter_(1, top, True) & ~forced
    grouped = priority.view(groups, per_group, n)
    best = grouped.argmax(dim=1, keepdim=True)  # [G, 1, n], ties towards the lower head
    need = ranks_high.view(groups, per_group, n).any(dim=1) & ~forced.view(groups, per_group, n).any(dim=1)
    # The floor may take at most what the budget leaves after the forced entries: its highest-scored copies.
    best_priority = grouped.gather(1, best).squeeze(1).masked_fill(~need, float("-inf")).flatten()
    room = (keep - forced.sum()).clamp_min(0)  # (a tensor either way: forced.sum() is one)
    by_priority = torch.sort(best_priority, descending=True, stable=True).indices
    within = torch.arange(groups * n, device=device) < room
    need = need.flatten() & torch.empty_like(within).scatter_(0, by_priority, within)
    floor = torch.zeros(groups, per_group, n, dtype=torch.bool, device=device)
    floor = floor.scatter_(1, best, need.view(groups, 1, n)).view(rows, n)
    extra = (floor & ~mask).sum()
    # Pay for them: copy rank within the group (0 = the group's highest-scored copy of the token), then the global
    # rank (later = lower priority); the largest key is dropped first.
    row_order = torch.sort(grouped, dim=1, descending=True, stable=True).indices
    copy_rank = torch.empty_like(row_order).scatter_(
        1, row_order, torch.arange(per_group, device=device).view(1, per_group, 1).expand(groups, per_group, n)
    )
    size = rows * n
    global_rank = torch.empty_like(order).scatter_(0, order, torch.arange(size, device=device))
    droppable = (mask & ~forced & ~floor).flatten()
    drop_key = torch.where(droppable, copy_rank.flatten() * size + global_rank, -1)
    drop_order = torch.sort(drop_key, descending=True).indices
    dropped = torch.empty_like(droppable).scatter_(0, drop_order, torch.arange(size, device=device) < extra)
    return (mask & ~dropped.view(rows, n)) | floor


def head_consensus(masks: list[Tensor], window: int, sink_tokens: int = 0) -> Tensor:
    """How much the KV heads of a layer agree on what they keep: per layer the mean, over pairs of its heads, of the
    overlap (Jaccard: shared / either) of their kept tokens outside the window and sinks (the tokens selection
    decides on), averaged over the layers. 1 = every head keeps the same tokens (the KV-compression-physics paper's
    rigid routing: many heads read one focal set), lower = heads route to different tokens. A pair that keeps none
    of those tokens agrees fully; a layer with one head counts 1. A 0-dim float64 tensor (no host sync).

    The paper's own consensus (its Section 5.1: distinct top-attended tokens / heads, from the compressed model's
    attention) needs the attention of generated tokens; this is its selection-side counterpart, from the keep
    masks alone, and moves with the selection rule."""
    stacked = torch.stack(masks)  # [L, H, n] (every layer's masks have one shape)
    _, heads, n = stacked.shape
    if heads < 2:
        return torch.ones((), dtype=torch.float64, device=stacked.device)
    decided = stacked[..., min(sink_tokens, n) : max(n - window, min(sink_tokens, n))].to(torch.float64)
    shared = decided @ decided.transpose(1, 2)  # [L, H, H]: the layers at once
    sizes = decided.sum(dim=2)
    either = sizes[:, :, None] + sizes[:, None, :] - shared
    overlap = torch.where(either > 0, shared / either.clamp_min(1), torch.ones_like(shared))
    pairs = torch.triu(torch.ones(heads, heads, dtype=torch.bool, device=stacked.device), diagonal=1)
    return overlap[:, pairs].mean(dim=1).mean()  # per layer over its pairs, then over the layers


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
    coverage_floor: float = 0.0,
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

    ``coverage_floor``: :func:`keep_routes_open` over the model's selection, each layer's heads one group (a token
    that ranks high for a head of a layer keeps a copy in that layer); the total kept is the same.

    Returns:
        per layer, the ``[Hkv, n]`` keep mask.
    """
    floor_ratio = layer_floor_ratio(ratio, layer_floor)
    # Non-finite scores stay non-finite (forced keeps) whatever the normalisation; a layer's floor entries are
    # made +inf, so the model-wide selection keeps them and gives out only the rest of the budget.
    raw = torch.stack(scores)  # [L, Hkv, n]: normalised per layer, all layers at once (``normalise`` keeps dims)
    comparable_scores = torch.where(torch.isfinite(raw), normalise(raw, window), raw.to(torch.float64))
    if layer_floor > 0:
        floors = torch.stack([select_budget(s, window, floor_ratio, sink_tokens).mask for s in scores])
        comparable_scores = comparable_scores.masked_fill(floors, float("inf"))
    num_layers, num_heads, n = comparable_scores.shape
    keep = select_budget(
        comparable_scores.view(num_layers * num_heads, n),
        window,
        ratio,
        sink_tokens,
        coverage_floor=coverage_floor,
        route_groups=num_layers,
    )
    return list(keep.mask.view(num_layers, num_heads, n).unbind(0))


def select_keep_masks(scores: list[Tensor], config: RCStatConfig) -> list[Tensor]:
    """Per layer, the ``[H, n]`` keep mask from the layers' scores: threshold mode (Eq. 9, per head) or budget
    mode, per layer or across the whole model (``config.budget_scope``)."""
    ratio = config.target_ratio
    if ratio is not None and config.budget_scope == "model":
        return select_budget_across_layers(
            scores,
            config.window,
            ratio,
            config.sink_tokens,
            layer_floor=config.layer_floor,
            coverage_floor=config.coverage_floor,
        )
    if ratio is not None:
        return [
            select_budget(s, config.window, ratio, config.sink_tokens, coverage_floor=config.coverage_floor).mask
            for s in scores
        ]
    return [select_threshold(s, config.window, config.c, config.sink_tokens).mask for s in scores]
