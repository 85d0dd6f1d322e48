"""Selection: Eq. 9 thresholds per head and the per-layer budget across heads, with exact expected masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcstat_vllm.scoring import KeepSet, budget_keep_count, select_budget, select_threshold
from rcstat_vllm.scoring.selection import first_in_order, forced_keep_mask

INF = float("inf")


def mask_of(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_threshold_evicts_at_most_c_times_head_mean():
    scores = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 9.0, 9.0],  # non-window mean 16/6 = 2.67
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0],  # mean 5: every token is <= 1 * mean
        ]
    )
    keep = select_threshold(scores, window=2, c=1.0)
    assert keep.mask.tolist() == [
        [False, False, False, True, True, True, True, True],
        [False, False, False, False, False, False, True, True],  # window kept though it scores 0
    ]
    assert keep.counts.tolist() == [5, 2]
    assert keep.counts.dtype == torch.int64
    half = select_threshold(scores, window=2, c=0.5)  # thresholds 1.33 and 2.5
    assert half.mask[0].tolist() == [False, False, True, True, True, True, True, True]
    assert half.mask[1].tolist() == [True] * 8


def test_threshold_boundary_is_inclusive():
    # mean of [1, 3] is 2; c = 0.5 gives threshold exactly 1: the token scoring 1 goes (score <= c * mean).
    keep = select_threshold(torch.tensor([[1.0, 3.0, 0.0]]), window=1, c=0.5)
    assert keep.mask.tolist() == [[False, True, True]]
    keep = select_threshold(torch.tensor([[1.0, 3.0, 0.0]]), window=1, c=0.4999)
    assert keep.mask.tolist() == [[True, True, True]]


def test_threshold_c_zero_still_evicts_zero_scores():
    scores = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.5, 0.0, 0.0]])
    keep = select_threshold(scores, window=2, c=0.0)
    assert keep.mask.tolist() == [[False, False, True, True, True, True, True]]


def test_threshold_infinite_scores_kept_and_out_of_the_mean():
    # Finite non-window scores [1, 3, 5]: mean 3 (inf would make it inf and evict everything finite).
    scores = torch.tensor([[INF, 1.0, 3.0, 5.0, INF, 0.0]])
    keep = select_threshold(scores, window=1, c=1.0)
    assert keep.mask.tolist() == [[True, False, False, True, True, True]]


def test_threshold_head_without_candidates_evicts_nothing():
    scores = torch.tensor([[INF, INF, 0.0], [1.0, 2.0, 0.0]])
    keep = select_threshold(scores, window=1, c=1.0)
    assert keep.mask.tolist() == [[True, True, True], [False, True, True]]


def test_threshold_sinks_kept_but_counted_in_mean():
    # Non-window [8, 1, 2, 1]: mean 3 (sink's 8 counts); sink kept; 1, 2, 1 <= 3 evicted.
    scores = torch.tensor([[8.0, 1.0, 2.0, 1.0, 0.0]])
    keep = select_threshold(scores, window=1, c=1.0, sink_tokens=1)
    assert keep.mask.tolist() == [[True, False, False, False, True]]
    # Sink scoring low is kept all the same.
    keep = select_threshold(torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.0]]), window=1, c=1.0, sink_tokens=1)
    assert keep.mask.tolist() == [[True, False, False, True, True]]


def test_threshold_window_larger_than_prompt_keeps_all():
    keep = select_threshold(torch.tensor([[1.0, 0.0, 2.0]]), window=5, c=1.0)
    assert keep.mask.tolist() == [[True, True, True]]


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.lists(st.integers(0, 6), min_size=6, max_size=6), min_size=1, max_size=4),
    window=st.integers(0, 3),
    c=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]),
)
def test_threshold_matches_rule_on_small_integer_scores(data, window, c):
    scores = torch.tensor(data, dtype=torch.float32)
    keep = select_threshold(scores, window=window, c=c)
    n = scores.shape[1]
    for head, row in enumerate(data):
        candidates = row[: n - window]
        mean = sum(candidates) / len(candidates) if candidates else math.nan
        expected = [i >= n - window or not (v <= c * mean) for i, v in enumerate(row)]
        assert keep.mask[head].tolist() == expected
        assert keep.counts[head].item() == sum(expected)


def test_budget_takes_top_scores_across_heads():
    scores = torch.tensor([[10.0, 9.0, 8.0, 7.0, 0.0], [1.0, 2.0, 3.0, 4.0, 0.0]])
    keep = select_budget(scores, window=1, ratio=0.5)  # 10 entries: evict 5, keep 5 = 2 windows + 3 best
    assert keep.mask.tolist() == [[True, True, True, False, True], [False, False, False, False, True]]
    assert keep.counts.tolist() == [4, 1]


def test_budget_raw_scores_not_normalised_per_head():
    # Head 1's scores are all larger than head 0's: a global top-k keeps head 1's tokens first even though
    # head 0's ordering is the same relative pattern.
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4], [10.0, 20.0, 30.0, 40.0]])
    keep = select_budget(scores, window=0, ratio=0.5)
    assert keep.counts.tolist() == [0, 4]


@pytest.mark.parametrize(
    "heads, n, ratio, expected_keep",
    [
        (2, 5, 0.25, 7),  # 2.5 rounds half up to 3 evicted (Python's round would give 2)
        (2, 5, 0.15, 8),  # 1.5 -> 2
        (3, 7, 0.5, 10),  # 10.5 -> 11
        (4, 16, 0.0, 64),
        (1, 9, 0.3, 6),  # 2.7 -> 3
    ],
)
def test_budget_hits_exact_target_count(heads, n, ratio, expected_keep):
    gen = torch.Generator().manual_seed(heads * n)
    scores = torch.rand(heads, n, generator=gen)
    keep = select_budget(scores, window=0, ratio=ratio)
    assert keep.num_kept == expected_keep
    assert budget_keep_count(heads * n, ratio) == expected_keep


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    n=st.integers(1, 30),
    ratio=st.floats(0, 1),
    window=st.integers(0, 4),
    seed=st.integers(0, 1000),
)
def test_budget_count_and_forced_tokens(heads, n, ratio, window, seed):
    scores = torch.rand(heads, n, generator=torch.Generator().manual_seed(seed))
    keep = select_budget(scores, window=window, ratio=ratio, sink_tokens=1)
    forced_per_head = len(set(range(max(n - window, 0), n)) | {0})
    # ratio times the entry count, as budget_keep_count ((0.3 * 3) * 25 rounds to another count than 0.3 * 75)
    target = heads * n - math.floor(ratio * (heads * n) + 0.5)
    assert keep.num_kept == max(target, heads * forced_per_head)
    assert keep.mask[:, max(n - window, 0) :].all()
    assert keep.mask[:, 0].all()
    # Every kept non-forced entry scores at least as high as every evicted entry.
    free = keep.mask.clone()
    free[:, max(n - window, 0) :] = False
    free[:, 0] = False
    if free.any() and (~keep.mask).any():
        assert scores[free].min() >= scores[~keep.mask].max()


def test_budget_never_below_forced_tokens():
    scores = torch.tensor([[1.0, INF, 2.0, 3.0, 0.0, 0.0], [4.0, 5.0, 6.0, 7.0, 0.0, 0.0]])
    keep = select_budget(scores, window=2, ratio=1.0, sink_tokens=1)
    assert keep.mask.tolist() == [[True, True, False, False, True, True], [True, False, False, False, True, True]]
    assert keep.counts.tolist() == [4, 3]


def test_budget_ties_go_to_lower_head_then_token():
    scores = torch.ones(2, 4)
    keep = select_budget(scores, window=0, ratio=0.5)  # keep 4 of 8 equal scores
    assert keep.mask.tolist() == [[True, True, True, True], [False, False, False, False]]


def _first_by_stable_sort(priority: torch.Tensor, keep: int) -> torch.Tensor:
    """What the device path computes: the first ``keep`` of a stable descending sort."""
    order = torch.sort(priority, descending=True, stable=True).indices
    return torch.zeros(priority.numel(), dtype=torch.bool).index_fill_(0, order[:keep], True)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 1.0, 3.0, INF]), min_size=1, max_size=40),
    keep_share=st.floats(0.0, 1.0),
)
def test_cpu_selection_keeps_what_the_stable_sort_keeps(values, keep_share):
    # Few distinct values: most cuts fall inside a run of ties, which must go to the lower indices.
    priority = torch.tensor(values, dtype=torch.float64)
    keep = round(keep_share * len(values))
    assert first_in_order(priority, keep).tolist() == _first_by_stable_sort(priority, keep).tolist()


@pytest.mark.parametrize("seed", range(3))
def test_budget_on_cpu_equals_the_sorted_selection_at_model_size(seed):
    # 30 layers x 3 heads x 2000 tokens, scores rounded so that ties are common, window and sinks forced.
    gen = torch.Generator().manual_seed(seed)
    scores = (torch.rand(90, 2000, generator=gen) * 50).round()
    keep = select_budget(scores, window=32, ratio=0.4, sink_tokens=4)
    priority = scores.double().masked_fill(forced_keep_mask(scores, 32, 4), INF).flatten()
    count = budget_keep_count(scores.numel(), 0.4, int(forced_keep_mask(scores, 32, 4).sum()))
    assert keep.mask.flatten().tolist() == _first_by_stable_sort(priority, count).tolist()


def test_keepset_indices_ascending_per_head():
    keep = KeepSet.from_mask(mask_of([[True, False, True, True], [False, False, False, True]]))
    assert [ix.tolist() for ix in keep.indices()] == [[0, 2, 3], [3]]
    assert all(ix.dtype == torch.int64 for ix in keep.indices())
    assert keep.counts.tolist() == [3, 1]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="c must be"):
        select_threshold(torch.zeros(1, 3), window=1, c=-1.0)
    with pytest.raises(ValueError, match="ratio"):
        select_budget(torch.zeros(1, 3), window=1, ratio=1.5)
    with pytest.raises(ValueError, match=r"\[Hkv, n\]"):
        select_budget(torch.zeros(3), window=1, ratio=0.5)


def test_depthkv_allocation_keeps_layer_zero_meets_the_mean_and_caps_each_layer():
    from benchmarks.layer_budgets import DEPTHKV_MAX_RATIO, depthkv_layer_ratios, select_across_layers

    g = torch.Generator().manual_seed(7)
    # Layer k's scores grow more peaked with k: more of their mass sits on their top entries (more robust).
    scores = [torch.rand(2, 300, generator=g) ** (1 + 3 * k) for k in range(12)]
    ratios = depthkv_layer_ratios(scores, window=8, ratio=0.5)
    assert ratios[0] == 0.0
    assert abs(sum(ratios) / len(ratios) - 0.5) < 1e-9
    assert max(ratios) <= DEPTHKV_MAX_RATIO + 1e-12
    assert ratios[-1] > ratios[1]  # the most peaked layer is pruned most
    # At a high ratio the cap binds and what it cuts goes to the other layers.
    high = depthkv_layer_ratios(scores, window=8, ratio=0.85)
    assert abs(sum(high) / len(high) - 0.85) < 1e-9 and max(high) == pytest.approx(DEPTHKV_MAX_RATIO)
    masks = select_across_layers(scores, 8, 0.5, comparable="depthkv")
    assert bool(masks[0].all())  # layer 0 keeps everything
    evicted = sum(int((~m).sum()) for m in masks)
    assert abs(evicted / (12 * 2 * 300) - 0.5) < 0.01


def test_layer_floor_interpolates_between_model_wide_and_per_layer_budgets():
    from rcstat_vllm.scoring.selection import layer_floor_ratio, select_budget_across_layers

    g = torch.Generator().manual_seed(11)
    heads, n, window, ratio = 2, 240, 8, 0.6
    # Layer 0's mass sits on 6 tokens: relative to its layer mean few entries stand out, so a purely model-wide
    # budget starves it; layers 1-2 are spread.
    peaked = torch.zeros(heads, n)
    peaked[:, torch.randperm(n - window, generator=g)[:6]] = 50.0
    scores = [peaked, torch.rand(heads, n, generator=g) + 0.5, torch.rand(heads, n, generator=g) + 0.5]
    total_keep = len(scores) * heads * n - math.floor(ratio * len(scores) * heads * n + 0.5)

    def kept(floor):
        masks = select_budget_across_layers(scores, window, ratio, layer_floor=floor)
        assert sum(int(m.sum()) for m in masks) == total_keep  # the budget is the same at every floor
        assert all(bool(m[:, -window:].all()) for m in masks)
        return masks

    model_wide = kept(0.0)
    assert torch.equal(torch.stack(model_wide), torch.stack(select_budget_across_layers(scores, window, ratio)))
    per_layer = kept(1.0)  # the floor takes the whole budget: exactly the per-layer selection
    for m, s in zip(per_layer, scores):
        assert torch.equal(m, select_budget(s, window, ratio).mask)
    half = kept(0.5)
    floor_keep = heads * n - math.floor(layer_floor_ratio(ratio, 0.5) * heads * n + 0.5)
    assert int(model_wide[0].sum()) < floor_keep  # without a floor the peaked layer is starved ...
    assert int(half[0].sum()) >= floor_keep  # ... with one it keeps at least its floor
    # ... and the floor entries are the layer's own top entries.
    assert bool(half[0][select_budget(scores[0], window, layer_floor_ratio(ratio, 0.5)).mask].all())
    with pytest.raises(ValueError, match="layer_floor"):
        select_budget_across_layers(scores, window, ratio, layer_floor=1.5)


@pytest.mark.parametrize("floor", [0.0, 0.5])
@pytest.mark.parametrize("normalise", ["layer", "head"])
def test_model_wide_selection_normalises_each_layer_on_its_own(floor, normalise):
    """All layers normalised at once equal each layer normalised alone, then stacked (the selection's reference)."""
    from rcstat_vllm.scoring.selection import (
        relative_to_head_mean,
        relative_to_layer_mean,
        select_budget_across_layers,
    )

    rule = relative_to_layer_mean if normalise == "layer" else relative_to_head_mean
    g = torch.Generator().manual_seed(5)
    scores = [torch.rand(3, 200, generator=g) * (layer + 1) for layer in range(6)]
    scores[2][1, 17] = INF  # a scorer's forced keep
    each = []
    for s in scores:
        layer = torch.where(torch.isfinite(s), rule(s, 16), s.double())
        if floor:
            layer = layer.masked_fill(select_budget(s, 16, 1 - floor * 0.3, 4).mask, INF)
        each.append(layer)
    reference = select_budget(torch.cat(each), 16, 0.7, 4).mask.view(6, 3, 200)
    masks = select_budget_across_layers(scores, 16, 0.7, 4, layer_floor=floor, normalise=rule)
    assert torch.equal(torch.stack(masks), reference)


# ------------------------------------------------------------------------------------- coverage floor (issue 56)


def _naive_budget(scores: torch.Tensor, window: int, ratio: float, sink_tokens: int) -> torch.Tensor:
    """Today's budget rule written out: forced entries, then the highest scores, ties to the lower flat index."""
    heads, n = scores.shape
    positions = torch.arange(n)
    forced = ((positions >= n - window) | (positions < sink_tokens)).expand(heads, n) | ~torch.isfinite(scores)
    keep = max(heads * n - math.floor(ratio * (heads * n) + 0.5), int(forced.sum()))
    flat = [(INF if f else float(s), i) for i, (s, f) in enumerate(zip(scores.flatten(), forced.flatten()))]
    chosen = sorted(flat, key=lambda entry: (-entry[0], entry[1]))[:keep]
    mask = torch.zeros(heads * n, dtype=torch.bool)
    mask[[i for _, i in chosen]] = True
    return mask.view(heads, n)


def _ranked_high(scores: torch.Tensor, window: int, ratio: float, sink_tokens: int, floor: float) -> torch.Tensor:
    """[H, n]: the tokens each head ranks in its top floor * (1 - ratio) * n, outside the forced ones."""
    heads, n = scores.shape
    high = math.floor(floor * (1 - ratio) * n + 0.5)
    forced = forced_keep_mask(scores, window, sink_tokens)
    open_scores = scores.to(torch.float64).masked_fill(forced, -INF)
    out = torch.zeros(heads, n, dtype=torch.bool)
    out.scatter_(1, torch.topk(open_scores, high, dim=1).indices, True)
    return out & ~forced


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    heads=st.integers(1, 4),
    n=st.integers(8, 60),
    ratio=st.sampled_from([0.4, 0.8, 0.9, 0.95]),
    floor=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 10_000),
)
def test_coverage_floor_keeps_the_budget_exact_and_every_high_token_covered(layers, heads, n, ratio, floor, seed):
    from rcstat_vllm.scoring.selection import select_budget_across_layers

    gen = torch.Generator().manual_seed(seed)
    # Integer scores: ties are common, so tie handling is exercised too.
    scores = [torch.randint(0, 6, (heads, n), generator=gen).float() for _ in range(layers)]
    window, sinks = 2, 1
    plain = select_budget_across_layers(scores, window, ratio, sinks)
    masks = select_budget_across_layers(scores, window, ratio, sinks, coverage_floor=floor)
    assert sum(int(m.sum()) for m in masks) == sum(int(m.sum()) for m in plain)  # the pooled budget, exact
    high = [_ranked_high(s, window, ratio, sinks, floor).any(dim=0) for s in scores]
    room = sum(int(m.sum()) for m in plain) - layers * heads * min(window + sinks, n)
    for layer, mask in enumerate(masks):
        assert bool(mask[:, n - window :].all()) and bool(mask[:, :sinks].all())
        if floor == 0:
            assert torch.equal(mask, plain[layer])
        elif sum(int(h.sum()) for h in high) <= room:  # (else the floor is capped to the budget)
            assert bool(mask.any(dim=0)[high[layer]].all()), "a token a head ranks high lost every copy in its layer"
    # Per-layer budgets: the count per layer is the budget's.
    for s in scores:
        keep = select_budget(s, window, ratio, sinks, coverage_floor=floor)
        assert keep.num_kept == select_budget(s, window, ratio, sinks).num_kept


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 4),
    n=st.integers(4, 40),
    ratio=st.sampled_from([0.0, 0.3, 0.5, 0.8, 0.9]),
    seed=st.integers(0, 10_000),
)
def test_coverage_floor_off_is_todays_budget(heads, n, ratio, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (heads, n), generator=gen).float()
    expected = _naive_budget(scores, 3, ratio, 1)
    assert torch.equal(select_budget(scores, 3, ratio, 1, coverage_floor=0.0).mask, expected)
    assert torch.equal(select_budget(scores, 3, ratio, 1).mask, expected)


def test_coverage_floor_pays_from_the_heads_that_agree_and_lowers_global_eviction():
    from rcstat_vllm.scoring.selection import head_consensus

    # One layer, 3 heads, 12 tokens, window 2. Every head scores tokens 0-3 highest (they agree); heads 0 and 1 keep
    # one token each of their own (4, 5); head 2 ranks token 7 fifth, below the agreed tokens, so the budget (20 of
    # 36 entries: the window's 6 and 14 more) spends it on the third copies of tokens 0-3 and token 7 loses every
    # copy. With the floor at 0.75 a head's top floor(0.75 * 20/36 * 12 + 0.5) = 5 tokens rank high.
    scores = torch.zeros(3, 12)
    scores[:, 0:4] = torch.tensor([10.0, 9.0, 8.0, 7.0])
    scores[0, 4], scores[1, 5] = 6.0, 6.0
    scores[2, 7] = 5.0
    ratio = 16 / 36
    plain = select_budget(scores, 2, ratio).mask
    assert plain.sum() == 20 and not bool(plain[:, 7].any())
    assert plain[:, 0:4].all()  # 3 copies of each agreed token
    covered = select_budget(scores, 2, ratio, coverage_floor=0.75).mask
    assert covered.sum() == 20
    assert bool(covered[2, 7])  # head 2's copy of token 7, the head that scores it highest
    # Paid for with the lowest-scored third copy of the agreed tokens (token 3 in head 2), not with tokens 4 or 5
    # (each kept by one head only, and scored lower than every agreed copy).
    assert not bool(covered[2, 3]) and covered[:2, 3].all()
    assert bool(covered[0, 4]) and bool(covered[1, 5])
    assert int((covered != plain).sum()) == 2
    evicted_everywhere = lambda m: int((~m.any(dim=0)).sum())  # noqa: E731
    assert evicted_everywhere(covered) == evicted_everywhere(plain) - 1
    assert float(head_consensus([covered], 2)) < float(head_consensus([plain], 2))


def test_head_consensus_is_the_mean_pairwise_overlap_of_kept_sets():
    from rcstat_vllm.scoring.selection import head_consensus

    same = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 0, 0, 1]], dtype=torch.bool)
    apart = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)  # the last token is the window
    half = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert float(head_consensus([same], window=1)) == 1.0
    assert float(head_consensus([apart], window=1)) == 0.0
    # pairs: (0, 1) 1/3, (0, 2) 0/2, (1, 2) 0/2
    assert float(head_consensus([half], window=1)) == pytest.approx(1 / 9)
    assert float(head_consensus([same, apart], window=1)) == 0.5
    # Sinks are left out like the window: heads agreeing on them only do not count.
    assert float(head_consensus([apart], window=1, sink_tokens=2)) == 0.0
    assert float(head_consensus([same[:1]], window=1)) == 1.0
