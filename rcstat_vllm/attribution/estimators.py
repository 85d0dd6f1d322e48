"""Attribution estimators (RCStat, Section 4.2): head ranking, span RC and span selection, pure torch.

The notation and the cost are in :mod:`rcstat_vllm.attribution.trace`'s docstring (Steps 1-3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from rcstat_vllm.scoring.rc import WindowSelfLogits, accumulation_dtype, expected_rc_samples, rc_upper_bound

#: Upper limit on the elements of one transient logits tensor (per head chunk), ~64 MiB in float32.
_MAX_ELEMENTS = 1 << 24

#: How a prompt span's score is read from its tokens' RC (see :func:`select_span_tokens`).
#: ``mean``: the paper's Eq. 10 as written (E[Z_h(p_i, g')] over all tokens of the span);
#: ``window``: the span's best run of ``span_window`` consecutive tokens; ``top``: its ``span_window`` best
#: tokens; ``max``: its best token; ``sum``: the sum over its tokens (mass-like, grows with length).
SPAN_SCORES = ("mean", "window", "top", "max", "sum")


def _causal_self_logits(q: Tensor, k_gen: Tensor, offset: int) -> Tensor:
    """Y' per head: {<q_l, k_k> : k <= offset + l} for the queries q of generated tokens offset.. offset+s-1.

    Args:
        q: [H, s, D] queries (float); k_gen: [H, >= offset + s, D] generated keys from generated index 0.
    Returns:
        [H, |Y'|] with |Y'| = sum_l (offset + l + 1).
    """
    s = q.shape[1]
    keys = k_gen[:, : offset + s]
    logits = torch.matmul(q, keys.transpose(1, 2))  # [H, s, offset + s]
    rows = torch.arange(s, device=q.device).unsqueeze(1) + offset
    cols = torch.arange(offset + s, device=q.device).unsqueeze(0)
    return logits[:, cols.expand(s, -1) <= rows.expand(-1, offset + s)]


def _head_chunks(num_heads: int, per_head: int) -> Iterable[tuple[int, int]]:
    step = max(1, _MAX_ELEMENTS // max(per_head, 1))
    for start in range(0, num_heads, step):
        yield start, min(num_heads, start + step)


def head_relative_contextualization(
    q_gen: Tensor,
    k_prompt: Tensor,
    k_gen: Tensor,
    exact: bool = True,
    prompt_mask: Tensor | None = None,
) -> Tensor:
    """Step 1 score of each head: E[max(X - Y, 0)] (exact) or its upper bound A (Algorithm 1).

    Args:
        q_gen: [H, n, D] queries of the generated tokens; k_prompt: [H, m, D] prompt keys (of each row's
            KV head); k_gen: [H, n, D] generated keys.
        exact: the mean over all (x, y) pairs; False = the upper bound A of Theorem 3.6.
        prompt_mask: [m] bool, the prompt tokens that count in X (None = all).
    Returns:
        [H] float32 (float64 for float64 inputs).
    """
    acc = accumulation_dtype(q_gen.dtype)
    num_heads, n, _ = q_gen.shape
    if prompt_mask is not None:
        k_prompt = k_prompt[:, prompt_mask]
    m = k_prompt.shape[1]
    out = torch.zeros(num_heads, dtype=acc, device=q_gen.device)
    if n == 0 or m == 0:
        return out
    for start, stop in _head_chunks(num_heads, n * m + n * n):
        q = q_gen[start:stop].to(acc)
        x = torch.matmul(q, k_prompt[start:stop].to(acc).transpose(1, 2)).reshape(stop - start, n * m)
        y = _causal_self_logits(q, k_gen[start:stop].to(acc), 0)
        out[start:stop] = expected_rc_samples(x, y) if exact else rc_upper_bound(x, y)
    return out


def _as_ranges(spans: Sequence[tuple[int, int]] | Tensor, m: int, device) -> Tensor:
    ranges = torch.as_tensor(spans, dtype=torch.int64, device=device).reshape(-1, 2)
    if ranges.numel() and (ranges[:, 0].min() < 0 or ranges[:, 1].max() > m or (ranges[:, 1] < ranges[:, 0]).any()):
        raise ValueError(f"prompt spans must be ranges [start, end) within 0..{m}, got {ranges.tolist()}")
    return ranges


def span_relative_contextualization(
    q_span: Tensor,
    k_prompt: Tensor,
    k_gen: Tensor,
    offset: int,
    spans: Sequence[tuple[int, int]] | Tensor,
    exact: bool = True,
) -> Tensor:
    """Step 2: E[Z_h(p_i, g')] for every head row h and prompt span p_i.

    Args:
        q_span: [H, s, D] queries of the generated span g' = generated tokens offset .. offset + s - 1.
        k_prompt: [H, m, D] prompt keys; k_gen: [H, >= offset + s, D] generated keys from generated index 0.
        spans: [S, 2] prompt token ranges [start, end) (may overlap; an empty range scores 0).
        exact: mean over all pairs; False = the upper bound A (Algorithm 1) per span.
    Returns:
        [H, S] float32 (float64 for float64 inputs).
    """
    acc = accumulation_dtype(q_span.dtype)
    num_heads, s, _ = q_span.shape
    m = k_prompt.shape[1]
    ranges = _as_ranges(spans, m, q_span.device)
    num_spans = ranges.shape[0]
    out = torch.zeros(num_heads, num_spans, dtype=acc, device=q_span.device)
    if s == 0 or num_spans == 0:
        return out
    lengths = ranges[:, 1] - ranges[:, 0]
    for h0, h1 in _head_chunks(num_heads, s * m + s * (offset + s)):
        q = q_span[h0:h1].to(acc)
        cross = torch.matmul(q, k_prompt[h0:h1].to(acc).transpose(1, 2))  # [h, s, m]
        y = _causal_self_logits(q, k_gen[h0:h1].to(acc), offset)  # [h, |Y'|]
        if exact:
            table = WindowSelfLogits.of(y)
            gaps = table.sum_positive_gaps(cross.reshape(h1 - h0, s * m)).reshape(h1 - h0, s, m).sum(dim=1)
            cumulative = torch.nn.functional.pad(torch.cumsum(gaps, dim=-1), (1, 0))  # [h, m + 1]
            totals = cumulative[:, ranges[:, 1]] - cumulative[:, ranges[:, 0]]
            pairs = (lengths * s * y.shape[-1]).to(acc)
            out[h0:h1] = torch.where(lengths > 0, totals / pairs.clamp_min(1), torch.zeros_like(totals))
        else:
            for length in torch.unique(lengths).tolist():
                if length == 0:
                    continue
                index = torch.nonzero(lengths == length).squeeze(1)
                per_span = (h1 - h0) * (s * length + y.shape[-1])
                step = max(1, _MAX_ELEMENTS // per_span)
                for c0 in range(0, index.numel(), step):
                    chosen = index[c0 : c0 + step]
                    columns = ranges[chosen, 0].unsqueeze(1) + torch.arange(length, device=q.device)  # [c, L]
                    x = cross[:, :, columns]  # [h, s, c, L]
                    x = x.permute(0, 2, 1, 3).reshape(h1 - h0, chosen.numel(), s * length)
                    yy = y.unsqueeze(1).expand(-1, chosen.numel(), -1)
                    out[h0:h1, chosen] = rc_upper_bound(x, yy)
    return out


def token_relative_contextualization(
    q_span: Tensor, k_prompt: Tensor, k_gen: Tensor, offset: int, exact: bool = True
) -> Tensor:
    """E[Z_h({t}, g')] of every prompt token t (Step 2 with singleton spans): [H, m].

    With the exact estimator every token has the same number of pairs (|g'| |Y'|), so the mean of these over a
    span's tokens is exactly the span's E[Z_h(p_i, g')] (Eq. 10's term); the upper bound is per token.
    """
    m = k_prompt.shape[1]
    singles = torch.stack([torch.arange(m), torch.arange(1, m + 1)], dim=1)
    return span_relative_contextualization(q_span, k_prompt, k_gen, offset, singles, exact=exact)


def select_span_tokens(
    profile: Tensor, spans: Sequence[tuple[int, int]] | Tensor, method: str, window: int = 16
) -> list[Tensor]:
    """The tokens each span is scored on, chosen on ``profile`` [m] (token scores summed over the heads).

    ``mean`` / ``sum``: all tokens of the span; ``window``: the run of ``min(window, len)`` consecutive tokens
    with the highest sum (the first such run on ties); ``top``: the ``min(window, len)`` highest tokens;
    ``max``: the highest token. Returns one int64 index tensor per span (empty for an empty span).
    """
    if method not in SPAN_SCORES:
        raise ValueError(f"unknown span score {method!r}: {' | '.join(SPAN_SCORES)}")
    ranges = _as_ranges(spans, profile.shape[0], profile.device).tolist()
    cumulative = torch.nn.functional.pad(torch.cumsum(profile.double(), dim=0), (1, 0))
    chosen = []
    for start, end in ranges:
        length = end - start
        if length <= 0 or method in ("mean", "sum"):
            chosen.append(torch.arange(start, max(start, end), device=profile.device))
            continue
        if method == "window":
            w = min(window, length)
            sums = cumulative[start + w : end + 1] - cumulative[start : end - w + 1]
            first = start + int(torch.argmax(sums))
            chosen.append(torch.arange(first, first + w, device=profile.device))
        else:
            count = 1 if method == "max" else min(window, length)
            best = torch.topk(profile[start:end], count, sorted=False).indices + start
            chosen.append(torch.sort(best).values)
    return chosen


def selected_span_scores(per_token: Tensor, chosen: Sequence[Tensor], method: str) -> Tensor:
    """Per head row, each span's score on its chosen tokens: [H, m] -> [H, S] (sum for ``sum``, else mean)."""
    out = per_token.new_zeros(per_token.shape[0], len(chosen))
    for index, tokens in enumerate(chosen):
        if tokens.numel():
            values = per_token[:, tokens]
            out[:, index] = values.sum(dim=1) if method == "sum" else values.mean(dim=1)
    return out


def span_attention(
    q_span: Tensor,
    k_prompt: Tensor,
    k_gen: Tensor,
    offset: int,
    spans: Sequence[tuple[int, int]] | Tensor,
    scale: float | None = None,
) -> Tensor:
    """Baseline: softmax attention mass each prompt span receives from the queries of g', per head row.

    The softmax runs over every key a query sees (all prompt keys, then generated keys up to itself), as the
    model's attention does; the mass of a span is summed over its tokens and averaged over the queries of g'.

    Returns:
        [H, S] float32.
    """
    acc = accumulation_dtype(q_span.dtype)
    _num_heads, s, d = q_span.shape
    m = k_prompt.shape[1]
    scale = d**-0.5 if scale is None else scale
    ranges = _as_ranges(spans, m, q_span.device)
    q = q_span.to(acc)
    cross = torch.matmul(q, k_prompt.to(acc).transpose(1, 2)) * scale  # [H, s, m]
    own = torch.matmul(q, k_gen[:, : offset + s].to(acc).transpose(1, 2)) * scale  # [H, s, offset + s]
    future = torch.arange(offset + s, device=q.device).unsqueeze(0) > (
        torch.arange(s, device=q.device) + offset
    ).unsqueeze(1)
    own = own.masked_fill(future, float("-inf"))
    weights = torch.softmax(torch.cat([cross, own], dim=-1), dim=-1)[..., :m].mean(dim=1)  # [H, m]
    cumulative = torch.nn.functional.pad(torch.cumsum(weights, dim=-1), (1, 0))
    return cumulative[:, ranges[:, 1]] - cumulative[:, ranges[:, 0]]


def normalize_span_scores(per_head: Tensor) -> tuple[Tensor, bool]:
    """Eq. 10: sum over heads, divide by the total over spans and heads. [H, S] -> ([S], degenerate).

    ``degenerate`` is True when the total is 0 (or not finite): the scores are then uniform, 1 / S.
    """
    totals = per_head.sum(dim=0)
    denominator = totals.sum()
    num_spans = totals.shape[0]
    if num_spans == 0:
        return totals, True
    if not torch.isfinite(denominator) or denominator <= 0:
        return torch.full_like(totals, 1.0 / num_spans), True
    return totals / denominator, False


def top_heads(scores: Tensor, k: int) -> list[tuple[int, int]]:
    """The k (layer, head) pairs with the highest finite scores of ``scores`` [L, H], best first."""
    flat = scores.flatten().clone()
    flat[~torch.isfinite(flat)] = float("-inf")
    k = min(k, int(torch.isfinite(flat).sum()))
    order = torch.argsort(flat, descending=True, stable=True)[:k]
    width = scores.shape[1]
    return [(int(i) // width, int(i) % width) for i in order]


def bottom_heads(scores: Tensor, k: int) -> list[tuple[int, int]]:
    """The k (layer, head) pairs with the lowest finite scores, lowest first (ties in index order, as top_heads)."""
    return top_heads(-scores, k)


#: How the answer's tokens are weighted before span scoring (:func:`token_weights`): ``uniform`` is Eq. 10 as
#: written (every generated token's query counts alike); ``peak``: each token by how much its RC singles out one
#: prompt span (the template words of an answer, also in the question and in every same-form source, spread over
#: all of them; the value that carries the provenance does not).
TOKEN_WEIGHTINGS = ("uniform", "peak")


def query_token_relative_contextualization(q_span: Tensor, k_prompt: Tensor, k_gen: Tensor, offset: int) -> Tensor:
    """Exact E[Z_h({t}, g')] split by the query of g' it comes from: [H, s, m], whose mean over s is
    :func:`token_relative_contextualization` (exact): the pairs (x, y) of one query j are x = f(t, j) against
    every y of Y' (the conditional SC of the whole g'), so each query's share is its gaps over |Y'|."""
    acc = accumulation_dtype(q_span.dtype)
    num_heads, s, _ = q_span.shape
    m = k_prompt.shape[1]
    out = torch.zeros(num_heads, s, m, dtype=acc, device=q_span.device)
    if s == 0 or m == 0:
        return out
    for h0, h1 in _head_chunks(num_heads, s * m + s * (offset + s)):
        q = q_span[h0:h1].to(acc)
        cross = torch.matmul(q, k_prompt[h0:h1].to(acc).transpose(1, 2))  # [h, s, m]
        y = _causal_self_logits(q, k_gen[h0:h1].to(acc), offset)
        table = WindowSelfLogits.of(y)
        gaps = table.sum_positive_gaps(cross.reshape(h1 - h0, s * m)).reshape(h1 - h0, s, m)
        out[h0:h1] = gaps / y.shape[-1]
    return out


def span_window_maxima(profiles: Tensor, spans: Sequence[tuple[int, int]] | Tensor, window: int) -> Tensor:
    """[s, m] token profiles -> [s, S]: each span's best run of ``min(window, len)`` consecutive tokens (its sum
    over the run's length; 0 for an empty span), per row."""
    ranges = _as_ranges(spans, profiles.shape[1], profiles.device).tolist()
    cumulative = torch.nn.functional.pad(torch.cumsum(profiles.double(), dim=1), (1, 0))
    out = torch.zeros(profiles.shape[0], len(ranges), dtype=torch.float64, device=profiles.device)
    for index, (start, end) in enumerate(ranges):
        w = min(window, end - start)
        if w <= 0:
            continue
        sums = cumulative[:, start + w : end + 1] - cumulative[:, start : end - w + 1]
        out[:, index] = sums.max(dim=1).values / w
    return out


def token_weights(
    per_query: Tensor, spans: Sequence[tuple[int, int]] | Tensor, method: str = "peak", window: int = 8
) -> Tensor:
    """Weights [s] of the answer's tokens from their RC ``per_query`` [H, s, m] (summed over the heads).

    ``uniform``: all 1. ``peak``: with v_j the spans' best-window RC for query j (:func:`span_window_maxima`) and
    p_j = v_j / sum v_j, w_j = max p_j - mean p_j (0 when v_j is all 0; all 1 when every w_j is 0, i.e. no token
    singles out a span, which gives Eq. 10 as written). Sums to nothing in particular: callers normalise.
    """
    if method not in TOKEN_WEIGHTINGS:
        raise ValueError(f"unknown token weighting {method!r}: {' | '.join(TOKEN_WEIGHTINGS)}")
    s = per_query.shape[1]
    ones = torch.ones(s, dtype=torch.float64, device=per_query.device)
    if method == "uniform" or s == 0:
        return ones
    values = span_window_maxima(per_query.sum(dim=0), spans, window)  # [s, S]
    if values.shape[1] == 0:
        return ones
    totals = values.sum(dim=1, keepdim=True)
    shares = torch.where(totals > 0, values / totals.clamp_min(1e-300), torch.zeros_like(values))
    weights = shares.max(dim=1).values - shares.mean(dim=1)
    weights = torch.where(totals.squeeze(1) > 0, weights, torch.zeros_like(weights)).clamp_min(0)
    if not bool((weights > 0).any()):
        return ones
    return weights


def weighted_token_relative_contextualization(per_query: Tensor, weights: Tensor) -> Tensor:
    """[H, s, m] and [s] -> [H, m]: the weighted mean over the answer's queries (uniform weights give
    :func:`token_relative_contextualization`, exact)."""
    w = weights.to(per_query.dtype)
    return torch.einsum("hsm,s->hm", per_query, w) / w.sum().clamp_min(1e-300)
