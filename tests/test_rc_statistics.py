"""Expected RC (Eq. 6), its IOT variant and the bounds of Theorem 3.6 against brute force and hand-worked values."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.rc_variants import expected_rc_iot, expected_rc_iot_grouped, rc_lower_bound
from rcstat_vllm.scoring import (
    expected_rc,
    expected_rc_grouped,
    expected_rc_samples,
    rc_upper_bound,
)


def brute_force_rc(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Eq. 6 as written: 2 / (w^2 (w+1)) * sum_j sum_{k <= l} max(<q_j, k_i> - <q_l, k_k>, 0)."""
    num_heads, w, _ = q_window.shape
    n = keys.shape[1]
    window_keys = keys[:, n - w :]
    out = torch.zeros(num_heads, n - w, dtype=torch.float64)
    for h, i in itertools.product(range(num_heads), range(n - w)):
        total = 0.0
        for j in range(w):
            x = float(q_window[h, j] @ keys[h, i])
            for ell in range(w):
                for k in range(ell + 1):
                    total += max(x - float(q_window[h, ell] @ window_keys[h, k]), 0.0)
        out[h, i] = 2 * total / (w * w * (w + 1))
    return out


def brute_force_rc_iot(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """IOT: mean_j mean_{k <= j} max(<q_j, k_i> - <q_j, k_k>, 0)."""
    num_heads, w, _ = q_window.shape
    n = keys.shape[1]
    window_keys = keys[:, n - w :]
    out = torch.zeros(num_heads, n - w, dtype=torch.float64)
    for h, i in itertools.product(range(num_heads), range(n - w)):
        per_query = []
        for j in range(w):
            x = float(q_window[h, j] @ keys[h, i])
            gaps = [max(x - float(q_window[h, j] @ window_keys[h, k]), 0.0) for k in range(j + 1)]
            per_query.append(sum(gaps) / len(gaps))
        out[h, i] = sum(per_query) / w
    return out


SHAPES = [  # (heads, w, n, d)
    (1, 1, 5, 3),  # w = 1: Y is the single value <q_0, k_last>
    (2, 1, 2, 1),
    (2, 2, 9, 4),
    (3, 3, 3, 2),  # n == w: nothing to score
    (2, 4, 13, 5),
    (1, 5, 6, 1),
    (2, 8, 21, 8),
]


def random_inputs(shape, seed, dtype=torch.float64):
    heads, w, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, w, d, generator=gen, dtype=torch.float64)
    k = torch.randn(heads, n, d, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_rc_matches_brute_force(shape, seed):
    q, k = random_inputs(shape, seed)
    got = expected_rc(q, k)
    assert got.dtype == torch.float64
    assert got.shape == (shape[0], shape[2] - shape[1])
    torch.testing.assert_close(got, brute_force_rc(q, k), rtol=1e-12, atol=1e-12)


def brute_force_rc_max(q_window: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """query_reduction "max", as written: max over window queries j of the mean over the window's m = w(w+1)/2
    causal self logits y of max(<q_j, k_i> - y, 0)."""
    num_heads, w, _ = q_window.shape
    n = keys.shape[1]
    window_keys = keys[:, n - w :]
    out = torch.zeros(num_heads, n - w, dtype=torch.float64)
    for h, i in itertools.product(range(num_heads), range(n - w)):
        ys = [float(q_window[h, ell] @ window_keys[h, k]) for ell in range(w) for k in range(ell + 1)]
        per_query = [sum(max(float(q_window[h, j] @ keys[h, i]) - y, 0.0) for y in ys) / len(ys) for j in range(w)]
        out[h, i] = max(per_query)
    return out


# w = 20: m = 210 self logits, past the direct sum's limit: the counts come from the sorted Y (binned or searchsorted).
@pytest.mark.parametrize("shape", [*SHAPES, (2, 20, 45, 6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_rc_max_over_queries_matches_brute_force(shape, seed):
    q, k = random_inputs(shape, seed)
    heads = q.shape[0]
    got = expected_rc_grouped(q.reshape(heads, 1, *q.shape[1:]), k, "max")[:, 0]
    assert got.shape == (heads, shape[2] - shape[1])
    torch.testing.assert_close(got, brute_force_rc_max(q, k), rtol=1e-12, atol=1e-12)
    # Each token's best query scores it at least as high as their mean (Eq. 6): max >= mean, equal for w = 1.
    mean = expected_rc(q, k)
    assert bool((got >= mean - 1e-12).all())
    if shape[1] == 1:
        torch.testing.assert_close(got, mean, rtol=1e-12, atol=1e-12)


def test_unknown_query_reduction_is_an_error():
    q, k = random_inputs((1, 2, 5, 3), 0)
    with pytest.raises(ValueError, match="query_reduction"):
        expected_rc_grouped(q.reshape(1, 1, 2, 3), k, "sum")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_rc_iot_matches_brute_force(shape, seed):
    q, k = random_inputs(shape, seed)
    got = expected_rc_iot(q, k)
    assert got.shape == (shape[0], shape[2] - shape[1])
    torch.testing.assert_close(got, brute_force_rc_iot(q, k), rtol=1e-12, atol=1e-12)


def test_expected_rc_with_ties_and_integer_logits():
    # Integer-valued logits give many exact ties between x and y, where the count of "y below x" matters.
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-2, 3, (2, 4, 3), generator=gen).double()
    k = torch.randint(-2, 3, (2, 12, 3), generator=gen).double()
    torch.testing.assert_close(expected_rc(q, k), brute_force_rc(q, k), rtol=0, atol=1e-12)
    torch.testing.assert_close(expected_rc_iot(q, k), brute_force_rc_iot(q, k), rtol=0, atol=1e-12)


def test_expected_rc_hand_worked():
    # d = 1, keys [3, 0 | 1, 2] (window = last two), window queries [1, 2].
    # Y = {k <= l}: l=0: 1*1 = 1; l=1: 2*1 = 2, 2*2 = 4  ->  {1, 2, 4}.
    # token 0: X = {1*3, 2*3} = {3, 6}; gaps: (2 + 1 + 0) + (5 + 4 + 2) = 14; 2/(4*3) * 14 = 7/3.
    # token 1: X = {0, 0}: below every y -> 0.
    q = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    k = torch.tensor([[[3.0], [0.0], [1.0], [2.0]]], dtype=torch.float64)
    assert expected_rc(q, k)[0].tolist() == pytest.approx([7 / 3, 0.0], abs=1e-15)
    # IOT: j=0 compares 3 with {1} -> 2; j=1 compares 6 with {2, 4} -> (4 + 2)/2 = 3; mean 2.5.
    assert expected_rc_iot(q, k)[0].tolist() == pytest.approx([2.5, 0.0], abs=1e-15)


def test_w1_single_self_logit():
    # w = 1: score_i = max(<q, k_i> - <q, k_last>, 0) exactly (both variants coincide).
    q = torch.tensor([[[2.0]]], dtype=torch.float64)
    k = torch.tensor([[[1.0], [3.0], [-1.0], [2.0]]], dtype=torch.float64)  # Y = {4}
    assert expected_rc(q, k).tolist() == [[0.0, 2.0, 0.0]]
    assert expected_rc_iot(q, k).tolist() == [[0.0, 2.0, 0.0]]


def test_grouped_equals_per_query_head():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64)  # [Hkv, G, w, d]
    k = torch.randn(2, 15, 6, generator=gen, dtype=torch.float64)
    grouped = expected_rc_grouped(q, k)
    grouped_iot = expected_rc_iot_grouped(q, k)
    for g in range(3):
        torch.testing.assert_close(grouped[:, g], brute_force_rc(q[:, g], k), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grouped_iot[:, g], brute_force_rc_iot(q[:, g], k), rtol=1e-12, atol=1e-12)


def test_token_chunking_matches_single_pass(monkeypatch):
    import rcstat_vllm.scoring.rc as rc

    q, k = random_inputs((2, 4, 40, 5), seed=7)
    whole = expected_rc(q, k)
    whole_iot = expected_rc_iot(q, k)
    monkeypatch.setattr(rc, "_TOKEN_CHUNK", 7)  # 36 scored tokens: 5 full chunks and a partial one
    torch.testing.assert_close(expected_rc(q, k), whole, rtol=0, atol=1e-13)
    torch.testing.assert_close(expected_rc_iot(q, k), whole_iot, rtol=0, atol=1e-13)
    monkeypatch.setattr(rc, "_TOKEN_CHUNK", 8192)
    monkeypatch.setattr(rc, "_CPU_CHUNK_ELEMENTS", 2 * 4 * 20)  # the CPU's chunks, by elements: 20 tokens of 8 logits
    assert rc._token_chunk(k, 2 * 4) == 20
    torch.testing.assert_close(expected_rc(q, k), whole, rtol=0, atol=1e-13)
    torch.testing.assert_close(expected_rc_iot(q, k), whole_iot, rtol=0, atol=1e-13)


def test_max_reduction_chunks_by_its_own_bound(monkeypatch):
    """``max`` counts a chunk by its cross logits (:data:`_CPU_MAX_CHUNK_ELEMENTS`), ``mean`` by
    :data:`_CPU_CHUNK_ELEMENTS`: each bound alone sets its reduction's chunks, and the scores are a single pass's."""
    import rcstat_vllm.scoring.rc as rc

    q = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    k = torch.randn(2, 40, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    whole = {reduction: expected_rc_grouped(q, k, reduction) for reduction in ("max", "mean")}
    seen: list[int] = []
    chunk = rc._token_chunk
    monkeypatch.setattr(rc, "_token_chunk", lambda *args: seen.append(chunk(*args)) or seen[-1])
    monkeypatch.setattr(rc, "_CPU_MAX_CHUNK_ELEMENTS", 2 * 3 * 4 * 17)  # 17 tokens of 24 cross logits
    monkeypatch.setattr(rc, "_CPU_CHUNK_ELEMENTS", 1)  # (16 tokens, the floor)
    for reduction, tokens in (("max", 17), ("mean", 16)):
        torch.testing.assert_close(expected_rc_grouped(q, k, reduction), whole[reduction], rtol=0, atol=1e-13)
        assert seen.pop() == tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sort_last_is_torch_sort(dtype):
    """RC's tables sort by NumPy on the CPU (float32 / float64; torch's sort otherwise): the same values as
    ``torch.sort``, NaN and infinities and ties included, from a non-contiguous view too."""
    from rcstat_vllm.scoring.rc import sort_last

    values = torch.randn(6, 40, generator=torch.Generator().manual_seed(5)).round(decimals=1).to(dtype)
    values[0, 3], values[1, 7], values[2, 9], values[3, 1] = float("nan"), float("inf"), float("-inf"), -0.0
    view = values.t().contiguous().t()[:, 1::2]  # (strided)
    for x in (values, view):
        got = sort_last(x)
        assert got.is_contiguous() and got.dtype == dtype
        assert torch.equal(got.nan_to_num(nan=99.0), torch.sort(x, dim=-1).values.nan_to_num(nan=99.0))


def test_dtypes_accumulate_in_float32():
    q64, k64 = random_inputs((2, 8, 50, 16), seed=11)
    exact = expected_rc(q64, k64)
    got32 = expected_rc(q64.float(), k64.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), exact, rtol=1e-5, atol=1e-5)
    q16, k16 = q64.bfloat16(), k64.bfloat16()
    got16 = expected_rc(q16, k16)
    assert got16.dtype == torch.float32
    # Compared with the exact value on the bf16-rounded inputs: only the float32 accumulation differs.
    torch.testing.assert_close(got16.double(), expected_rc(q16.double(), k16.double()), rtol=1e-5, atol=1e-5)


def test_float32_with_large_common_logit_offset():
    # All logits share an offset of ~1000 (first key component 1000, first query component 1) while the
    # scores are O(1): float32 must still be accurate to well below the scores' scale.
    gen = torch.Generator().manual_seed(2)
    q = torch.cat([torch.ones(1, 8, 1), torch.randn(1, 8, 3, generator=gen)], dim=-1).double()
    k = torch.cat([torch.full((1, 60, 1), 1000.0), torch.randn(1, 60, 3, generator=gen)], dim=-1).double()
    exact = expected_rc(q, k)
    assert exact.max() > 1.0
    torch.testing.assert_close(expected_rc(q.float(), k.float()).double(), exact, rtol=0, atol=1e-4)


def test_shape_errors():
    with pytest.raises(ValueError, match="window"):
        expected_rc(torch.zeros(1, 5, 2), torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="mismatch"):
        expected_rc(torch.zeros(2, 2, 2), torch.zeros(1, 4, 2))


# ------------------------------------------------------------------------------------------------------
# 1-D samples: exact mean and the bounds of Theorem 3.6
# ------------------------------------------------------------------------------------------------------


def brute_force_pair_mean(x: list[float], y: list[float]) -> float:
    return sum(max(a - b, 0.0) for a in x for b in y) / (len(x) * len(y))


def t(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    "x, y, lower, exact, upper",
    [
        ([3.0], [1.0], 2.0, 2.0, 2.0),  # single samples: every bound is the one gap
        ([1.0], [3.0], 0.0, 0.0, 0.0),
        ([0.0, 1.0, 2.0], [5.0, 6.0], 0.0, 0.0, 0.0),  # x entirely below y
        ([5.0, 7.0], [1.0, 2.0], 4.5, 4.5, 4.5),  # x entirely above y: E = mean(x) - mean(y)
        ([0.0, 2.0], [1.0], 0.5, 0.5, 0.5),  # one y: every coupling is the same
        # x = y = {0, 2}: comonotone pairs (0,0),(2,2) give 0; all pairs give 2/4; antitone (0,2),(2,0) give 1.
        ([0.0, 2.0], [0.0, 2.0], 0.0, 0.5, 1.0),
    ],
)
def test_bounds_hand_worked(x, y, lower, exact, upper):
    assert rc_lower_bound(t(x), t(y)).item() == pytest.approx(lower, abs=1e-15)
    assert expected_rc_samples(t(x), t(y)).item() == pytest.approx(exact, abs=1e-15)
    assert rc_upper_bound(t(x), t(y)).item() == pytest.approx(upper, abs=1e-15)


samples = st.lists(
    st.floats(min_value=-50, max_value=50, allow_nan=False, allow_infinity=False), min_size=1, max_size=25
)


@settings(max_examples=300, deadline=None)
@given(x=samples, y=samples)
def test_bounds_sandwich_the_pair_mean(x, y):
    exact = brute_force_pair_mean(x, y)
    lower = rc_lower_bound(t(x), t(y)).item()
    upper = rc_upper_bound(t(x), t(y)).item()
    assert lower <= exact + 1e-9
    assert exact <= upper + 1e-9
    assert expected_rc_samples(t(x), t(y)).item() == pytest.approx(exact, rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(x=samples, shift=st.floats(min_value=0, max_value=10))
def test_bounds_tight_when_x_dominates_y(x, shift):
    # y = x shifted down and beyond x's range: every pair has x > y, all couplings agree, so a = E = A.
    y = [v - shift - 101.0 for v in x]
    exact = brute_force_pair_mean(x, y)
    assert rc_lower_bound(t(x), t(y)).item() == pytest.approx(exact, rel=1e-9)
    assert rc_upper_bound(t(x), t(y)).item() == pytest.approx(exact, rel=1e-9)


def test_bounds_batched_rows_match_single_rows():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    upper, lower = rc_upper_bound(x, y), rc_lower_bound(x, y)
    assert upper.shape == lower.shape == (3,)
    for row in range(3):
        assert upper[row].item() == pytest.approx(rc_upper_bound(x[row], y[row]).item(), abs=1e-14)
        assert lower[row].item() == pytest.approx(rc_lower_bound(x[row], y[row]).item(), abs=1e-14)
        assert lower[row] <= brute_force_pair_mean(x[row].tolist(), y[row].tolist()) + 1e-12 <= upper[row] + 2e-12


@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_direct_sum_and_sorted_prefix_sums_agree(monkeypatch, query_reduction):
    """Small windows sum max(x - y, 0) directly, larger ones count with searchsorted: both are Eq. 6 (and its max
    over queries)."""
    import rcstat_vllm.scoring.rc as rc

    g = torch.Generator().manual_seed(11)
    for w in (1, 8, 16):
        q = torch.randn(2, 3, w, 16, generator=g, dtype=torch.float64)
        keys = torch.randn(2, 300, 16, generator=g, dtype=torch.float64) * 3
        direct = rc.expected_rc_grouped(q, keys, query_reduction)
        monkeypatch.setattr(rc, "DIRECT_SUM_MAX_M", 0)
        sorted_path = rc.expected_rc_grouped(q, keys, query_reduction)
        monkeypatch.undo()
        torch.testing.assert_close(direct, sorted_path, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------ the binned search behind count_below


def _rows(kind: str, generator: torch.Generator) -> torch.Tensor:
    """[2, 3, m] sorted rows of window self logits as they come: spread, with an outlier, or full of ties."""
    m = 528  # w = 32
    y = torch.randn(2, 3, m, generator=generator)
    if kind == "outlier":
        y[..., 0] = 400.0  # one huge self logit squeezes the rest into few bins
    if kind == "ties":
        y = torch.randint(-3, 4, (2, 3, m), generator=generator).float()
    if kind == "constant":
        y = torch.zeros(2, 3, m)
    return torch.sort(y, dim=-1).values


@pytest.mark.parametrize("kind", ["normal", "outlier", "ties", "constant"])
def test_count_below_equals_searchsorted_whatever_the_spread(kind):
    """Random x, x equal to y values (a tie counts nothing: side="left"), beyond both ends, infinite and NaN x."""
    from rcstat_vllm.scoring.binned_search import BinnedSearch as _BinnedSearch
    from rcstat_vllm.scoring.rc import WindowSelfLogits

    g = torch.Generator().manual_seed(1)
    sorted_y = _rows(kind, g)
    table = WindowSelfLogits(torch.zeros(2, 3), sorted_y, torch.zeros(2, 3, sorted_y.shape[-1] + 1))
    picks = torch.randint(0, sorted_y.shape[-1], (2, 3, 500), generator=g)
    x = torch.cat(
        [
            3 * torch.randn(2, 3, 4000, generator=g),
            torch.gather(sorted_y, -1, picks),  # exactly on a y
            torch.nextafter(torch.gather(sorted_y, -1, picks), torch.tensor(float("inf"))),  # just above one
            torch.tensor([-1e30, 1e30, float("inf"), float("-inf")]).expand(2, 3, 4),
        ],
        dim=-1,
    )
    expected = torch.searchsorted(sorted_y, x.contiguous(), side="left")
    assert torch.equal(table.count_below(x), expected)
    binned = _BinnedSearch.build(sorted_y)
    assert binned.usable == (kind in ("normal", "outlier"))  # ties and constants crowd bins: searchsorted
    if binned.usable:
        assert torch.equal(binned.count_below(x), expected)
    with_nan = x.clone()
    with_nan[..., :7] = float("nan")
    counts = table.count_below(with_nan)  # must not fail; a NaN x's score is NaN whatever its count
    assert torch.equal(counts[..., 7:], expected[..., 7:])
