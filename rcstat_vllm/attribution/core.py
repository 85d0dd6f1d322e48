"""Attribution by relative contextualization (RCStat, Section 4.2): model-agnostic, pure torch.

Notation. A request is s = p ⊕ g: m prompt tokens, then n generated tokens. For one attention head, the
logit of key i under query j is f(i, j) = <q_j, k_i> (post-RoPE, raw: no 1/sqrt(d), as in
:mod:`rcstat_vllm.scoring.rc`). GQA: query head h reads KV head h // G, G = Hq / Hkv.

Step 1 (head ranking). For every (layer, query head):
    X = {f(i, j) : i in p, j in g}                      cross-contextualization, m * n samples (Def. 3.1)
    Y = {f(k, l) : k <= l, k, l in g}                    self-contextualization, n (n + 1) / 2 samples (Def. 3.3)
    score = E[max(X - Y, 0)] under the uniform joint over all (x, y) pairs (Eq. 6), or, for long generations,
            its upper bound A of Theorem 3.6 (Algorithm 1). Keep the top k heads (default 2% of all heads).
Step 2 (span RC). For a generated span g' (token range [a, b) of g) and prompt spans S = {p_1, ...}:
    X_i = {f(t, j) : t in p_i, j in g'}                   conditional CC (Def. 3.2)
    Y'  = {f(k, l) : l in g', k in g, k <= l}             conditional SC of g' against every earlier generated
                                                          token (Def. 3.4 with g1 = g, queries in g')
    E[Z_h(p_i, g')] = E[max(X_i - Y', 0)] per top head h (or the bound A for long generations).
Step 3 (Eq. 10). RC(p_i) = sum_h E[Z_h(p_i, g')] / sum_i' sum_h E[Z_h(p_i', g')]  (sums to 1 over spans; when
    every term is 0, i.e. no prompt logit beats any self logit, the scores are uniform and ``degenerate``).

Cost. Both estimators sort once and count: the exact mean over all pairs uses the sorted Y and its prefix
sums (sum_y max(x - y, 0) = cnt(y < x) x - sum(y < x)), O((|X| + |Y|) log |Y|), so it is never the O(|p| |g|^3)
of the naive Eq. 6; Algorithm 1 costs the same order. ``estimator="auto"`` follows the paper (exact for short
generations, the bound A for long ones, switch at ``exact_max_tokens``); ``exact`` is always affordable.

Streaming (:class:`AttributionTrace`). q/k arrive per layer and per step (prefill chunks, then one token per
decode step). What is kept, per request:
  * prompt keys only (queries of prompt tokens are never needed): [Hkv, m, D] per layer;
  * generated queries and keys of *all* heads for the first ``warmup_tokens`` generated tokens; then the heads
    are ranked on that prefix (same estimator as Step 1) and only ``candidate_factor * k`` candidate heads
    keep recording (their queries, the keys of their KV heads, and those KV heads' prompt keys);
  * at :meth:`AttributionTrace.finalize` the candidates are re-ranked over the whole generation, the top k
    kept and everything else dropped.
Memory bound (elements, D = head_dim, L layers, C = candidate heads, C_kv their KV heads, k top heads):
    before the warm-up ends:  L Hkv m D + W L (Hq + Hkv) D                 (W = warmup_tokens)
    after:                    C_kv m D + min(n, N) (C + C_kv) D           (N = max_generated_tokens)
    after finalize:           k m D + min(n, N) 2 k D
i.e. linear in the generation for ~4k heads instead of all L*Hq (SmolLM2: 20 of 270 heads; Llama-3.1-8B: 80 of
1024), and capped at N tokens. No logit is stored: X and Y are recomputed from q/k when needed.
Exactness: the final top k equal those of the full (non-streaming) computation whenever they are among the
candidates (always when n <= W or C >= L*Hq); all span scores of those heads are then identical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from rcstat_vllm.config import ConfigError
from rcstat_vllm.scoring.rc import WindowSelfLogits, accumulation_dtype, expected_rc_samples, rc_upper_bound

__all__ = [
    "ESTIMATORS",
    "SPAN_SCORES",
    "AttributionOptions",
    "AttributionTrace",
    "SpanScores",
    "head_relative_contextualization",
    "span_relative_contextualization",
    "span_attention",
    "token_relative_contextualization",
    "select_span_tokens",
    "selected_span_scores",
    "normalize_span_scores",
    "num_top_heads",
    "top_heads",
    "bottom_heads",
]

ESTIMATORS = ("auto", "exact", "upper")

#: How a prompt span's score is read from its tokens' RC (see :func:`select_span_tokens`).
#: ``mean``: the paper's Eq. 10 as written (E[Z_h(p_i, g')] over all tokens of the span);
#: ``window``: the span's best run of ``span_window`` consecutive tokens; ``top``: its ``span_window`` best
#: tokens; ``max``: its best token; ``sum``: the sum over its tokens (mass-like, grows with length).
SPAN_SCORES = ("mean", "window", "top", "max", "sum")

#: Upper limit on the elements of one transient logits tensor (per head chunk), ~64 MiB in float32.
_MAX_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttributionOptions:
    """How heads are ranked and what the streaming trace keeps.

    Attributes:
        k: number of top heads; None = ``top_fraction`` of all (layer, query head) pairs, at least 1.
        top_fraction: share of heads kept when ``k`` is None (paper: about 2%).
        estimator: ``exact`` (mean over all pairs, Eq. 6), ``upper`` (Algorithm 1) or ``auto`` (exact while
            the generation has at most ``exact_max_tokens`` tokens, the upper bound beyond).
        exact_max_tokens: the switch of ``auto``.
        sink_tokens: the first prompt tokens left out of X in head ranking (not of span scoring). 0 = the
            paper's definition (all prompt tokens).
        warmup_tokens: streaming: generated tokens recorded for every head before pruning to candidates;
            None = never prune (keeps every head: the reference computation).
        candidate_factor: streaming: candidates kept after the warm-up = this many times k.
        max_generated_tokens: streaming: generated tokens recorded at most (later ones are not attributed).
        span_score: how a prompt span's score is read from the RC of its tokens (:data:`SPAN_SCORES`):
            ``mean`` is Eq. 10 as the paper writes it; the others choose tokens of the span first. Default
            ``window``: Eq. 10 as written averages a long chunk's one relevant sentence over all its tokens
            (benchmarks/attribution.py, long chunks: top-1 chunk 0.57 with ``mean``, 0.97 with ``window``
            of 8 tokens, on the tuning set; README "Attribution").
        span_window: tokens of the ``window`` / ``top`` selections (a shorter span uses all its tokens).
    """

    k: int | None = None
    top_fraction: float = 0.02
    estimator: str = "auto"
    exact_max_tokens: int = 128
    sink_tokens: int = 0
    warmup_tokens: int | None = 32
    candidate_factor: int = 4
    max_generated_tokens: int = 4096
    span_score: str = "window"
    span_window: int = 8

    def __post_init__(self) -> None:
        if self.k is not None and (not _is_int(self.k) or self.k < 1):
            raise ConfigError("k", self.k, "null or an integer >= 1")
        if not _is_number(self.top_fraction) or not 0 < self.top_fraction <= 1:
            raise ConfigError("top_fraction", self.top_fraction, "a number in (0, 1]")
        if self.estimator not in ESTIMATORS:
            raise ConfigError("estimator", self.estimator, " | ".join(ESTIMATORS))
        if not _is_int(self.exact_max_tokens) or self.exact_max_tokens < 0:
            raise ConfigError("exact_max_tokens", self.exact_max_tokens, "an integer >= 0")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ConfigError("sink_tokens", self.sink_tokens, "an integer >= 0")
        if self.warmup_tokens is not None and (not _is_int(self.warmup_tokens) or self.warmup_tokens < 1):
            raise ConfigError("warmup_tokens", self.warmup_tokens, "null or an integer >= 1")
        if not _is_int(self.candidate_factor) or self.candidate_factor < 1:
            raise ConfigError("candidate_factor", self.candidate_factor, "an integer >= 1")
        if not _is_int(self.max_generated_tokens) or self.max_generated_tokens < 1:
            raise ConfigError("max_generated_tokens", self.max_generated_tokens, "an integer >= 1")
        if self.span_score not in SPAN_SCORES:
            raise ConfigError("span_score", self.span_score, " | ".join(SPAN_SCORES))
        if not _is_int(self.span_window) or self.span_window < 1:
            raise ConfigError("span_window", self.span_window, "an integer >= 1")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "AttributionOptions":
        """Validated options from a dict; unknown keys are errors naming the key."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ConfigError("rcstat_attribution", values, "a JSON object of attribution options")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(key, values[key], "a known field: " + ", ".join(sorted(known)))
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def use_exact(self, num_generated: int) -> bool:
        if self.estimator == "auto":
            return num_generated <= self.exact_max_tokens
        return self.estimator == "exact"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def num_top_heads(options: AttributionOptions, total_heads: int) -> int:
    """k: ``options.k`` or ``round(top_fraction * total_heads)``, at least 1 and at most ``total_heads``."""
    k = options.k if options.k is not None else round(options.top_fraction * total_heads)
    return max(1, min(int(k), total_heads))


# --------------------------------------------------------------------------------------------------------
# Statistics on batches of heads: inputs [H, ., D], one row per (layer, query head) being scored.
# --------------------------------------------------------------------------------------------------------


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
            center = y.mean(dim=-1)
            y_sorted = torch.sort(y - center.unsqueeze(-1), dim=-1).values.contiguous()
            prefix = torch.nn.functional.pad(torch.cumsum(y_sorted, dim=-1), (1, 0)).contiguous()
            table = WindowSelfLogits(center, y_sorted, prefix)
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
    num_heads, s, d = q_span.shape
    m = k_prompt.shape[1]
    scale = d**-0.5 if scale is None else scale
    ranges = _as_ranges(spans, m, q_span.device)
    q = q_span.to(acc)
    cross = torch.matmul(q, k_prompt.to(acc).transpose(1, 2)) * scale  # [H, s, m]
    own = torch.matmul(q, k_gen[:, : offset + s].to(acc).transpose(1, 2)) * scale  # [H, s, offset + s]
    future = torch.arange(offset + s, device=q.device).unsqueeze(0) > (torch.arange(s, device=q.device) + offset).unsqueeze(1)
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
    """The k (layer, head) pairs with the lowest finite scores, lowest first."""
    flat = scores.flatten().clone()
    flat[~torch.isfinite(flat)] = float("inf")
    k = min(k, int(torch.isfinite(flat).sum()))
    order = torch.argsort(flat, descending=False, stable=True)[:k]
    width = scores.shape[1]
    return [(int(i) // width, int(i) % width) for i in order]


# --------------------------------------------------------------------------------------------------------
# Streaming trace of one request
# --------------------------------------------------------------------------------------------------------


class _LayerStore:
    """What one layer keeps: prompt keys and generated q/k of a subset of its heads."""

    def __init__(self, num_prompt: int, q_heads: Tensor, kv_heads: Tensor, head_dim: int, dtype, device):
        self.q_heads = q_heads  # global query-head indices kept, ascending
        self.kv_heads = kv_heads  # global KV-head indices kept, ascending
        self.prompt_keys = torch.zeros(len(kv_heads), num_prompt, head_dim, dtype=dtype, device=device)
        self.gen_q = torch.zeros(len(q_heads), 0, head_dim, dtype=dtype, device=device)
        self.gen_k = torch.zeros(len(kv_heads), 0, head_dim, dtype=dtype, device=device)
        self.num_generated = 0

    def reserve(self, count: int) -> None:
        capacity = self.gen_q.shape[1]
        if count <= capacity:
            return
        new_capacity = max(count, 2 * capacity, 16)
        for name in ("gen_q", "gen_k"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], new_capacity, old.shape[2])
            grown[:, :capacity] = old
            setattr(self, name, grown)

    def select(self, q_heads: Tensor, group: int) -> None:
        """Keep only the query heads ``q_heads`` (global, a subset of the current ones) and their KV heads."""
        kv_heads = torch.unique(q_heads // group)
        q_local = torch.searchsorted(self.q_heads, q_heads)
        kv_local = torch.searchsorted(self.kv_heads, kv_heads)
        n = self.num_generated
        self.prompt_keys = self.prompt_keys[kv_local].clone()
        self.gen_q = self.gen_q[q_local, :n].clone()
        self.gen_k = self.gen_k[kv_local, :n].clone()
        self.q_heads, self.kv_heads = q_heads, kv_heads

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prompt_keys, self.gen_q, self.gen_k))


@dataclass
class SpanScores:
    """Eq. 10 for one generated span: ``scores`` [S] (sum to 1), ``per_head`` [k, S] raw E[Z_h(p_i, g')]."""

    scores: Tensor
    per_head: Tensor
    heads: list[tuple[int, int]]
    degenerate: bool
    exact: bool


class AttributionTrace:
    """q/k of one request, recorded as they pass through the layers; ranks heads and scores spans.

    ``record(layer, start, query, key)`` takes the rows of consecutive positions ``start .. start + t - 1``
    (prefill chunks, decode tokens, or a recomputation after preemption, which overwrites). Positions below
    ``num_prompt_tokens`` are prompt tokens (only their keys are kept), the others generated tokens.
    """

    def __init__(self, num_prompt_tokens: int, num_layers: int, options: AttributionOptions | None = None):
        if num_prompt_tokens < 1 or num_layers < 1:
            raise ValueError(f"need at least one prompt token and one layer, got {num_prompt_tokens}, {num_layers}")
        self.num_prompt_tokens = num_prompt_tokens
        self.num_layers = num_layers
        self.options = options or AttributionOptions()
        self._layers: list[_LayerStore | None] = [None] * num_layers
        self.num_q_heads = 0
        self.num_kv_heads = 0
        self.head_dim = 0
        self.pruned = False
        self.finalized = False
        #: [L, Hq] scores on the warm-up prefix (set when pruning happened)
        self.warmup_scores: Tensor | None = None
        #: [L, Hq] final scores (NaN where a head was not kept to the end)
        self.head_scores: Tensor | None = None
        self.top: list[tuple[int, int]] = []
        self.peak_bytes = 0
        #: prompt tokens whose keys were never recorded (e.g. a prefix-cache hit before the first traced step)
        self.missing_prompt_tokens = 0

    # ---- recording ----

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_total_heads(self) -> int:
        return self.num_layers * self.num_q_heads

    @property
    def k(self) -> int:
        return num_top_heads(self.options, self.num_total_heads)

    @property
    def num_generated(self) -> int:
        """Generated tokens recorded in every layer that keeps heads."""
        counts = [s.num_generated for s in self._layers if s is not None and len(s.q_heads)]
        if any(s is None for s in self._layers) or not counts:
            return 0
        return min(counts)

    def record(self, layer: int, start: int, query: Tensor, key: Tensor) -> None:
        """Rows of positions start .. start + t - 1 of one layer: query [t, Hq, D], key [t, Hkv, D]."""
        if self.finalized:
            return
        num_q, dim = query.shape[1], query.shape[2]
        store = self._layers[layer]
        if store is None:
            if self.num_q_heads == 0:
                self.num_q_heads, self.num_kv_heads, self.head_dim = num_q, key.shape[1], dim
                if num_q % self.num_kv_heads:
                    raise ValueError(f"{num_q} query heads are not a multiple of {self.num_kv_heads} KV heads")
            store = self._layers[layer] = _LayerStore(
                self.num_prompt_tokens,
                torch.arange(num_q, device=query.device),
                torch.arange(key.shape[1], device=query.device),
                dim,
                key.dtype,
                key.device,
            )
        if len(store.q_heads) > 0:
            self._store_rows(store, start, query, key)
        if layer == self.num_layers - 1:
            self.peak_bytes = max(self.peak_bytes, self.nbytes())
            warmup = self.options.warmup_tokens
            if not self.pruned and warmup is not None and self.num_generated >= warmup:
                self._prune_to_candidates()

    def _store_rows(self, store: _LayerStore, start: int, query: Tensor, key: Tensor) -> None:
        m = self.num_prompt_tokens
        end = start + query.shape[0]
        if start < m:  # prompt rows: keys only
            stop = min(end, m)
            store.prompt_keys[:, start:stop] = key[: stop - start, store.kv_heads].transpose(0, 1)
        g0 = max(start, m) - m
        g1 = min(end - m, self.options.max_generated_tokens)
        if g1 > g0:
            rows = slice(g0 + m - start, g1 + m - start)
            store.reserve(g1)
            store.gen_q[:, g0:g1] = query[rows, store.q_heads].transpose(0, 1)
            store.gen_k[:, g0:g1] = key[rows, store.kv_heads].transpose(0, 1)
            store.num_generated = max(store.num_generated, g1)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._layers if s is not None)

    def _prune_to_candidates(self) -> None:
        scores = self.rank_heads()
        self.warmup_scores = scores
        count = self.options.candidate_factor * self.k
        self.pruned = True
        if count >= self.num_total_heads:
            return
        self._keep(top_heads(scores, count))

    def _keep(self, heads: list[tuple[int, int]]) -> None:
        per_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            per_layer.setdefault(layer, []).append(head)
        for layer, store in enumerate(self._layers):
            if store is None:
                continue
            chosen = torch.tensor(sorted(per_layer.get(layer, [])), dtype=torch.int64, device=store.q_heads.device)
            store.select(chosen, self.group)

    # ---- access ----

    def stored_heads(self) -> list[tuple[int, int]]:
        return [(l, int(h)) for l, s in enumerate(self._layers) if s is not None for h in s.q_heads]

    def head_tensors(self, heads: Sequence[tuple[int, int]], n: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Gathered q_gen [H, n, D], k_prompt [H, m, D], k_gen [H, n, D] of (layer, query head) rows."""
        n = self.num_generated if n is None else n
        qs, kps, kgs = [], [], []
        for layer, head in heads:
            store = self._layers[layer]
            if store is None or head not in store.q_heads.tolist():
                raise KeyError(f"head ({layer}, {head}) is not kept by this trace")
            q_local = int(torch.searchsorted(store.q_heads, torch.tensor(head)))
            kv_local = int(torch.searchsorted(store.kv_heads, torch.tensor(head // self.group)))
            qs.append(store.gen_q[q_local, :n])
            kps.append(store.prompt_keys[kv_local])
            kgs.append(store.gen_k[kv_local, :n])
        return torch.stack(qs), torch.stack(kps), torch.stack(kgs)

    # ---- Step 1 ----

    def rank_heads(self, exact: bool | None = None) -> Tensor:
        """[L, Hq] Step 1 score of every kept head over all generated tokens recorded (NaN: not kept)."""
        n = self.num_generated
        exact = self.options.use_exact(n) if exact is None else exact
        scores = torch.full((self.num_layers, max(self.num_q_heads, 1)), float("nan"))
        mask = None
        if self.options.sink_tokens:
            mask = torch.arange(self.num_prompt_tokens) >= self.options.sink_tokens
        for layer, store in enumerate(self._layers):
            if store is None or len(store.q_heads) == 0 or n == 0:
                continue
            heads = [(layer, int(h)) for h in store.q_heads]
            q, kp, kg = self.head_tensors(heads, n)
            values = head_relative_contextualization(q, kp, kg, exact=exact, prompt_mask=mask)
            scores[layer, store.q_heads.cpu()] = values.float().cpu()
        return scores

    def finalize(self, prune: bool = True) -> list[tuple[int, int]]:
        """Rank the kept heads over the whole generation, choose the top k; ``prune`` drops all other data."""
        if not self.finalized:
            self.head_scores = self.rank_heads()
            self.top = top_heads(self.head_scores, self.k)
            if prune:
                self._keep(self.top)
            self.finalized = True
        return self.top

    # ---- Steps 2-3 ----

    def span_scores(
        self,
        prompt_spans: Sequence[tuple[int, int]],
        generated_span: tuple[int, int],
        heads: Sequence[tuple[int, int]] | None = None,
        span_score: str | None = None,
    ) -> SpanScores:
        """Eq. 10 for the generated tokens [a, b) (indices into the generation) over ``prompt_spans``.

        ``span_score`` (default ``options.span_score``): ``mean`` is the paper's form; otherwise each span is
        scored on the tokens :func:`select_span_tokens` chooses on the RC summed over ``heads``, each head's
        term being its mean (or sum) over those tokens, then Eq. 10's normalization over heads and spans.
        """
        if heads is None:
            heads = self.finalize(prune=False) if not self.finalized else self.top
        n = self.num_generated
        exact = self.options.use_exact(n)
        a, b = max(0, generated_span[0]), min(n, generated_span[1])
        method = self.options.span_score if span_score is None else span_score
        if b <= a or not heads:
            per_head = torch.zeros(len(heads), len(prompt_spans))
        else:
            q, kp, kg = self.head_tensors(heads, b)
            if method == "mean":  # Eq. 10 as written: the span's own estimator (exact or upper) per head
                per_head = span_relative_contextualization(q[:, a:b], kp, kg, a, prompt_spans, exact=exact).float()
            else:
                per_token = token_relative_contextualization(q[:, a:b], kp, kg, a, exact=exact).float()
                chosen = select_span_tokens(per_token.sum(dim=0), prompt_spans, method, self.options.span_window)
                per_head = selected_span_scores(per_token, chosen, method)
        scores, degenerate = normalize_span_scores(per_head)
        return SpanScores(scores=scores, per_head=per_head, heads=list(heads), degenerate=degenerate, exact=exact)

    def token_scores(
        self, generated_span: tuple[int, int], heads: Sequence[tuple[int, int]], exact: bool | None = None
    ) -> Tensor:
        """E[Z_h({t}, g')] of every prompt token for each of ``heads``: [len(heads), m] (zeros if g' is empty)."""
        n = self.num_generated
        exact = self.options.use_exact(n) if exact is None else exact
        a, b = max(0, generated_span[0]), min(n, generated_span[1])
        if b <= a or not heads:
            return torch.zeros(len(heads), self.num_prompt_tokens)
        q, kp, kg = self.head_tensors(heads, b)
        return token_relative_contextualization(q[:, a:b], kp, kg, a, exact=exact).float()

    def attention_scores(
        self,
        prompt_spans: Sequence[tuple[int, int]],
        generated_span: tuple[int, int],
        heads: Sequence[tuple[int, int]] | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """Baseline: attention mass per prompt span averaged over ``heads`` (default all kept) -> [S]."""
        heads = self.stored_heads() if heads is None else heads
        n = self.num_generated
        a, b = max(0, generated_span[0]), min(n, generated_span[1])
        if b <= a:
            return torch.zeros(len(prompt_spans))
        q, kp, kg = self.head_tensors(heads, b)
        return span_attention(q[:, a:b], kp, kg, a, prompt_spans, scale=scale).float().mean(dim=0)

    # ---- construction from complete tensors ----

    @classmethod
    def from_sequence(
        cls,
        queries: Sequence[Tensor],
        keys: Sequence[Tensor],
        num_prompt_tokens: int,
        options: AttributionOptions | None = None,
    ) -> "AttributionTrace":
        """The reference (non-streaming) trace: every head kept, from per-layer q [T, Hq, D], k [T, Hkv, D]."""
        options = dataclasses.replace(options or AttributionOptions(), warmup_tokens=None)
        trace = cls(num_prompt_tokens, len(queries), options)
        for layer, (q, k) in enumerate(zip(queries, keys)):
            trace.record(layer, 0, q, k)
        return trace
