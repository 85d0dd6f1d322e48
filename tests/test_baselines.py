"""Every scorer on tiny hand-computed examples (d = 1 so each logit is a product worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rcstat_vllm.scoring import (
    SCORERS,
    KnormScorer,
    RandomScorer,
    RCScorer,
    SnapKVScorer,
    StreamingLLMScorer,
    TOVAScorer,
    get_scorer,
    select_budget,
)
from rcstat_vllm.scoring.base import carry_forward, chunk_mean, local_contrast, smooth_scores

INF = float("inf")
LN2, LN3 = math.log(2), math.log(3)


def col(values, dtype=torch.float64):
    """[H][n] nested lists -> [H, n, 1] (d = 1)."""
    return torch.tensor(values, dtype=dtype).unsqueeze(-1)


def approx_row(row, expected):
    assert len(row) == len(expected)
    for got, want in zip(row, expected):
        if math.isinf(want):
            assert got == want
        else:
            assert got == pytest.approx(want, abs=1e-6)


def unused_values(keys):
    return torch.zeros_like(keys)


# ------------------------------------------------------------------------------------------------- RC


def test_rc_scorer_hand_worked_and_window_marked():
    # keys [3, 0 | 1, 2], window queries [1, 2]: Y = {1, 2, 4}; token 0: X = {3, 6} -> 14 * 2/(4*3) = 7/3.
    keys = col([[3.0, 0.0, 1.0, 2.0]])
    queries = col([[1.0, 2.0]])
    scores = RCScorer.paper(window_size=2).score(queries, keys, unused_values(keys), scale=0.125)
    assert scores.dtype == torch.float32
    approx_row(scores[0].tolist(), [7 / 3, 0.0, INF, INF])


def test_rc_scorer_uses_trailing_window_queries_only():
    keys = col([[3.0, 0.0, 1.0, 2.0]])
    # Three queries given, window_size 2: the first (99) is ignored; the same result as above.
    scores = RCScorer.paper(window_size=2).score(col([[99.0, 1.0, 2.0]]), keys, unused_values(keys), 1.0)
    approx_row(scores[0].tolist(), [7 / 3, 0.0, INF, INF])
    # Short prompt: window_size 8 but only 2 queries: uses those 2 (and marks 2 tokens).
    scores = RCScorer.paper().score(col([[1.0, 2.0]]), keys, unused_values(keys), 1.0)
    approx_row(scores[0].tolist(), [7 / 3, 0.0, INF, INF])


def test_rc_gqa_mean_follows_vllm_head_grouping():
    # Hq = 4, Hkv = 2, G = 2, w = 1: query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1.
    keys = col([[1.0, 3.0, 2.0], [5.0, 0.0, 1.0]])
    queries = col([[2.0], [1.0], [3.0], [4.0]])
    # KV 0: q=2: Y={4}, X=[2, 6] -> [0, 2];  q=1: Y={2}, X=[1, 3] -> [0, 1].
    # KV 1: q=3: Y={3}, X=[15, 0] -> [12, 0]; q=4: Y={4}, X=[20, 0] -> [16, 0].
    mean = RCScorer.paper(window_size=1).score(queries, keys, unused_values(keys), 1.0)
    approx_row(mean[0].tolist(), [0.0, 1.5, INF])
    approx_row(mean[1].tolist(), [14.0, 0.0, INF])


def test_carry_forward_is_a_one_sided_running_max():
    scores = torch.tensor([[[0.0, 5.0, 1.0, 0.0, 0.0, 2.0, -1.0]], [[3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    assert carry_forward(scores, 2).tolist() == [
        [[0.0, 5.0, 5.0, 5.0, 1.0, 2.0, 2.0]],
        [[3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0]],
    ]
    assert carry_forward(scores, 0) is scores
    # Against the definition on random rows, every width (wider than the row included).
    rows = torch.randn(3, 2, 11)
    for tokens in (1, 3, 10, 20):
        expect = torch.stack([rows[..., max(0, i - tokens) : i + 1].amax(-1) for i in range(11)], dim=-1)
        assert torch.equal(carry_forward(rows, tokens), expect)


def test_chunk_mean_averages_each_chunk_from_the_rows_first_token():
    """Chunks of ``size`` from the first token (a last, shorter one averaging what it has); right-aligned rows
    chunked from their own first column, the columns before left as they are (-inf padding stays -inf)."""
    scores = torch.tensor([[1.0, 3.0, 5.0, 7.0, 9.0], [0.0, 2.0, 4.0, 6.0, 8.0]])
    assert chunk_mean(scores, 2).tolist() == [[2.0, 2.0, 6.0, 6.0, 9.0], [1.0, 1.0, 5.0, 5.0, 8.0]]
    assert chunk_mean(scores, 1) is scores
    padded = torch.tensor([[float("-inf"), float("-inf"), 1.0, 3.0, 5.0], [0.0, 2.0, 4.0, 6.0, 8.0]])
    ragged = chunk_mean(padded, 2, first=torch.tensor([2, 0]))
    assert ragged.tolist() == [[float("-inf"), float("-inf"), 2.0, 2.0, 5.0], [1.0, 1.0, 5.0, 5.0, 8.0]]
    # Against the definition on random rows, every size (wider than the row included).
    rows = torch.randn(3, 2, 11)
    for size in (2, 3, 4, 11, 16):
        expect = torch.stack([rows[..., i // size * size : (i // size + 1) * size].mean(-1) for i in range(11)], -1)
        torch.testing.assert_close(chunk_mean(rows, size), expect)
        # the aligned path (a view's sums) and the per-row one (scatters) agree
        flat = rows.reshape(-1, 11)
        torch.testing.assert_close(chunk_mean(flat, size), chunk_mean(flat, size, first=torch.zeros(6)))


def test_rc_scorer_averages_by_chunk_after_carrying_and_before_the_window_is_marked():
    """RC with ``chunk``: its finished scores (carried, the window +inf) are its unchunked scores' chunk means over
    the prompt tokens, the window untouched."""
    gen = torch.Generator().manual_seed(3)
    q_window, keys = torch.randn(4, 8, 16, generator=gen), torch.randn(2, 70, 16, generator=gen)
    plain = RCScorer(window_size=8).score(q_window, keys, keys, 1.0)
    chunked = RCScorer(window_size=8, chunk=4).score(q_window, keys, keys, 1.0)
    assert torch.isinf(chunked[:, -8:]).all()
    torch.testing.assert_close(chunked[:, :-8], chunk_mean(plain[:, :-8], 4))


def test_local_contrast_divides_by_the_neighbourhood_mean_to_a_power():
    scores = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 6.0]])
    # radius 1: means [1.5, 2, 5/3, 1, 0, 2, 3]; strength 1 -> score / mean (a zero neighbourhood stays 0).
    approx_row(local_contrast(scores, 1.0, 1)[0].tolist(), [2 / 3, 1.0, 1.8, 0.0, 0.0, 0.0, 2.0])
    assert local_contrast(scores, 0.0, 1) is scores
    # Against the definition on random rows, several radii (wider than the row included) and strengths.
    rows = torch.rand(3, 2, 11)
    for radius in (1, 4, 30):
        for strength in (0.5, 1.0):
            mean = torch.stack([rows[..., max(0, i - radius) : i + radius + 1].mean(-1) for i in range(11)], dim=-1)
            torch.testing.assert_close(local_contrast(rows, strength, radius), rows / mean**strength)


def test_local_contrast_of_right_aligned_rows_is_each_row_alone():
    """``first``: rows of different lengths right-aligned (zeros before each), each contrasted over its own tokens
    only, as decode-time scoring finishes all heads at once."""
    g = torch.Generator().manual_seed(4)
    lengths, n = [30, 11, 1, 24], 30
    rows = torch.zeros(len(lengths), n)
    for row, length in enumerate(lengths):
        rows[row, n - length :] = torch.rand(length, generator=g) + 0.1
    first = torch.tensor([n - length for length in lengths])
    for radius in (3, 256):
        together = local_contrast(rows, 0.5, radius, first=first)
        for row, length in enumerate(lengths):
            alone = local_contrast(rows[row : row + 1, n - length :], 0.5, radius)[0]
            assert torch.allclose(together[row, n - length :], alone, rtol=1e-6, atol=0)


def test_local_contrast_lets_a_peak_early_in_the_prompt_outrank_the_trend_at_its_end():
    # RC's drift towards the prompt's end, as a ramp, with one token standing out early on: by raw score most of
    # the ramp outranks it; with the drift removed (strength 1) it comes first, with half of it (0.5, the
    # default) only the ramp's last sixth stays above it.
    ramp = torch.linspace(0.1, 4.0, 200)
    ramp[20] = 1.5
    assert int((ramp > ramp[20]).sum()) > 100
    assert int(local_contrast(ramp[None], 1.0, 32)[0].argmax()) == 20
    half = local_contrast(ramp[None], 0.5, 32)[0]
    assert 0 < int((half > half[20]).sum()) <= 200 // 6


def test_rc_scorer_contrasts_its_scores_before_smoothing_and_carrying():
    keys, queries = torch.randn(2, 40, 8), torch.randn(2, 4, 8)
    values = unused_values(keys)
    raw = RCScorer.paper(window_size=4).score(queries, keys, values, 1.0)[:, :-4]
    want = carry_forward(smooth_scores(local_contrast(raw, 0.5, 5), 3), 2)
    got = RCScorer.paper(window_size=4, smoothing=3, carry_forward=2, local_contrast=0.5, contrast_radius=5).score(
        queries, keys, values, 1.0
    )
    torch.testing.assert_close(got[:, :-4], want)
    assert torch.isinf(got[:, -4:]).all()
    with pytest.raises(ValueError, match="local_contrast"):
        RCScorer(local_contrast=1.5)


def test_rc_scorer_carries_scores_forward_before_the_window_is_marked():
    # The hand-worked case above: [7/3, 0 | window]. Carried one token forward, token 1 takes token 0's score;
    # the window tokens stay +inf and carry nothing back.
    keys = col([[3.0, 0.0, 1.0, 2.0]])
    queries = col([[1.0, 2.0]])
    scores = RCScorer.paper(window_size=2, carry_forward=1).score(queries, keys, unused_values(keys), 1.0)
    approx_row(scores[0].tolist(), [7 / 3, 7 / 3, INF, INF])
    with pytest.raises(ValueError, match="carry_forward"):
        RCScorer(carry_forward=-1)


def test_gqa_head_count_must_divide():
    keys = col([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="query heads"):
        RCScorer.paper(window_size=1).score(col([[1.0], [1.0], [1.0]]), keys, unused_values(keys), 1.0)


# --------------------------------------------------------------------------------------------- SnapKV


def snapkv_example():
    # n = 4, w = 2, scale 0.5, keys [0, 2 ln2, 0, 2 ln3] -> scaled logits of q=1: [0, ln2, 0, ln3].
    # Query at position 2 sees keys 0..2: exp [1, 2, 1] / 4.  Query at position 3 sees all: [1, 2, 1, 3] / 7.
    # Mean over the two window queries, tokens 0 and 1: (1/4 + 1/7)/2 = 11/56, (2/4 + 2/7)/2 = 11/28.
    keys = col([[0.0, 2 * LN2, 0.0, 2 * LN3]])
    queries = col([[1.0, 1.0]])
    return queries, keys


def test_snapkv_causal_window_attention_hand_worked():
    queries, keys = snapkv_example()
    scores = SnapKVScorer(window_size=2, kernel_size=1).score(queries, keys, unused_values(keys), scale=0.5)
    approx_row(scores[0].tolist(), [11 / 56, 11 / 28, INF, INF])


def test_snapkv_default_pooling_kernel_5():
    queries, keys = snapkv_example()
    scorer = SnapKVScorer(window_size=2)
    assert scorer.kernel_size == 5
    # Pooling of [11/56, 22/56] with kernel 5 and zero padding 2 (counted): each output sums both / 5.
    scores = scorer.score(queries, keys, unused_values(keys), scale=0.5)
    approx_row(scores[0].tolist(), [33 / 280, 33 / 280, INF, INF])


def test_snapkv_pooling_counts_padding_at_edges():
    pooled = smooth_scores(torch.tensor([[[0.0, 0.0, 5.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0, 0.0, 0.0]]]), 5)
    assert pooled.tolist() == [[[1.0, 1.0, 1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 0.0, 0.0, 0.0]]]


def test_snapkv_gqa_mean():
    # Second query head of the group has q = 0: uniform causal attention, rows [1/3]*3 and [1/4]*4,
    # so 7/24 for tokens 0 and 1. Group mean with the first head (11/56, 11/28).
    keys = col([[0.0, 2 * LN2, 0.0, 2 * LN3]])
    queries = col([[1.0, 1.0], [0.0, 0.0]])
    scores = SnapKVScorer(window_size=2, kernel_size=1).score(queries, keys, unused_values(keys), scale=0.5)
    approx_row(scores[0].tolist(), [(11 / 56 + 7 / 24) / 2, (11 / 28 + 7 / 24) / 2, INF, INF])


# ----------------------------------------------------------------------------------------------- TOVA


def test_tova_last_query_attention_averaged_over_all_heads():
    # Hkv = 2, G = 1. Only the last of the three window queries counts (the 50s are ignored).
    # KV 0, q=1: logits [ln2, 0, ln3] -> [2, 1, 3]/6.  KV 1, q=0: uniform 1/3.
    # Mean over both heads (TOVA averages all heads of the layer): [(1/3 + 1/3)/2, (1/6 + 1/3)/2].
    keys = col([[LN2, 0.0, LN3], [5.0, 7.0, 1.0]])
    queries = col([[50.0, 50.0, 1.0], [50.0, 50.0, 0.0]])
    scorer = TOVAScorer()
    assert scorer.window_size == 1
    scores = scorer.score(queries, keys, unused_values(keys), scale=1.0)
    approx_row(scores[0].tolist(), [1 / 3, 1 / 4, INF])
    approx_row(scores[1].tolist(), [1 / 3, 1 / 4, INF])


# ---------------------------------------------------------------------------------------------- Knorm


def test_knorm_negative_l2_norm():
    keys = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]], [[0.0, 2.0], [6.0, 8.0], [1.0, 1.0]]])
    scores = KnormScorer().score(torch.zeros(2, 1, 2), keys, unused_values(keys), 1.0)
    approx_row(scores[0].tolist(), [-5.0, -1.0, 0.0])
    approx_row(scores[1].tolist(), [-2.0, -10.0, -math.sqrt(2)])


# -------------------------------------------------------------------------------------- StreamingLLM


def test_streaming_sinks_and_positions():
    keys = torch.zeros(2, 7, 3)
    scores = StreamingLLMScorer().score(torch.zeros(2, 1, 3), keys, unused_values(keys), 1.0)
    assert scores.tolist() == [[INF] * 4 + [4.0, 5.0, 6.0]] * 2


def test_streaming_budget_keeps_sinks_plus_most_recent():
    keys = torch.zeros(2, 12, 3)
    scores = StreamingLLMScorer().score(torch.zeros(2, 1, 3), keys, unused_values(keys), 1.0)
    keep = select_budget(scores, window=0, ratio=0.5)  # keep 12 of 24: 8 sinks + tokens 10, 11 per head
    assert [ix.tolist() for ix in keep.indices()] == [[0, 1, 2, 3, 10, 11]] * 2


# --------------------------------------------------------------------------------------------- Random


def test_random_is_seeded_and_uniform():
    keys = torch.zeros(3, 5, 2)
    first = RandomScorer(seed=7).score(torch.zeros(3, 1, 2), keys, unused_values(keys), 1.0)
    again = RandomScorer(seed=7).score(torch.zeros(3, 1, 2), keys, unused_values(keys), 1.0)
    other = RandomScorer(seed=8).score(torch.zeros(3, 1, 2), keys, unused_values(keys), 1.0)
    assert first.shape == (3, 5) and first.dtype == torch.float32
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(first, torch.rand(3, 5, generator=torch.Generator().manual_seed(7)))
    assert ((first >= 0) & (first < 1)).all()


# ------------------------------------------------------------------------------------------- Registry


def test_registry_defaults_and_options():
    assert sorted(SCORERS) == ["knorm", "random", "rc", "snapkv", "streaming", "tova"]
    defaults = {name: get_scorer(name).window_size for name in SCORERS}
    # RC's is the plugin's window (RC_DEFAULTS); the paper's 8 is RCScorer.paper()'s.
    assert defaults == {"rc": 32, "snapkv": 64, "tova": 1, "knorm": 0, "streaming": 0, "random": 0}
    assert RCScorer.paper().window_size == 8
    snap = get_scorer("snapkv", window_size=16, kernel_size=3)
    assert (snap.name, snap.window_size, snap.kernel_size) == ("snapkv", 16, 3)
    assert get_scorer("streaming").n_sink == 4
    assert get_scorer("random", seed=3).seed == 3


def test_registry_unknown_method_names_allowed():
    with pytest.raises(ValueError, match="allowed: knorm, random, rc, snapkv, streaming, tova"):
        get_scorer("h2o")
    with pytest.raises(ValueError, match="gqa_reduce"):
        get_scorer("rc", gqa_reduce="median")  # a knob the method does not have (the message lists its own)


@pytest.mark.parametrize("method", sorted(SCORERS))
def test_every_scorer_returns_float32_per_kv_head_token(method):
    gen = torch.Generator().manual_seed(0)
    queries = torch.randn(6, 8, 4, generator=gen).bfloat16()
    keys = torch.randn(2, 20, 4, generator=gen).bfloat16()
    scores = get_scorer(method).score(queries, keys, keys, 0.5)
    assert scores.shape == (2, 20)
    assert scores.dtype == torch.float32
    assert not torch.isnan(scores).any()


def test_every_registry_line_loads_its_scorer_with_its_published_window():
    """The torch-free registry is the one list: its lines load the scorers SCORERS holds, each named as its line,
    each taking its published window from it; the config's methods are the lines and its off switch."""
    from rcstat_vllm.config import METHODS, OBSERVING_METHODS
    from rcstat_vllm.scoring.registry import REGISTRY

    assert {name: line.load() for name, line in REGISTRY.items()} == SCORERS
    for name, line in REGISTRY.items():
        assert SCORERS[name].name == name and SCORERS[name].default_window_size == line.window
    assert (*REGISTRY, "none") == METHODS and OBSERVING_METHODS == ("rc", "snapkv")


def test_rc_scorer_defaults_are_the_configs_and_the_paper_preset_the_papers():
    """RC's knobs are defined once (rc_knobs): RCScorer() is the scorer the default config builds, and
    RCScorer.paper() Eq. 6 as the paper scores it (mean over an 8-query window, nothing after)."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.settings import scorer_options

    knobs = ("window_size", "smoothing", "carry_forward", "local_contrast", "contrast_radius", "query_reduction")
    configured = get_scorer("rc", **scorer_options(RCStatConfig()))
    assert {k: getattr(RCScorer(), k) for k in knobs} == {k: getattr(configured, k) for k in knobs}
    assert {k: getattr(RCScorer.paper(), k) for k in knobs} == {
        "window_size": 8,
        "smoothing": 1,
        "carry_forward": 0,
        "local_contrast": 0.0,
        "contrast_radius": 256,
        "query_reduction": "mean",
    }
    assert RCScorer.paper(window_size=2).window_size == 2
