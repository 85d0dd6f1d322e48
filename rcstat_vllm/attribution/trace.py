"""Attribution by relative contextualization (RCStat, Section 4.2): the streaming per-request trace.

Options live in :mod:`rcstat_vllm.attribution.options`, the estimators in :mod:`rcstat_vllm.attribution.estimators`.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rcstat_vllm.attribution.estimators import (
    head_relative_contextualization,
    normalize_span_scores,
    query_token_relative_contextualization,
    select_span_tokens,
    selected_span_scores,
    span_attention,
    span_relative_contextualization,
    token_relative_contextualization,
    token_weights,
    top_heads,
    weighted_token_relative_contextualization,
)
from rcstat_vllm.attribution.options import AttributionOptions, num_top_heads

if TYPE_CHECKING:
    from rcstat_vllm.attribution.head_weights import HeadWeights


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

    def __init__(
        self,
        num_prompt_tokens: int,
        num_layers: int,
        options: AttributionOptions | None = None,
        calibration: HeadWeights | None = None,
    ):
        if num_prompt_tokens < 1 or num_layers < 1:
            raise ValueError(f"need at least one prompt token and one layer, got {num_prompt_tokens}, {num_layers}")
        self.num_prompt_tokens = num_prompt_tokens
        self.num_layers = num_layers
        self.options = options or AttributionOptions()
        #: the model's calibrated heads (rcstat_vllm.attribution.calibration), used when ``options.heads`` is auto
        self.calibration = calibration if self.options.heads == "auto" else None
        #: weight of each head of ``top`` (1 each for the RC ranking)
        self.top_weights: list[float] = []
        #: whether ``top`` came from the calibration (set at finalize)
        self.calibrated = False
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
        keep = top_heads(scores, count)
        for head in self._calibrated_heads():
            if head not in keep:
                keep.append(head)
        self._keep(keep)

    def _calibrated_heads(self) -> list[tuple[int, int]]:
        """The calibration's heads when it fits this model's shape (else none: the RC ranking is used)."""
        if self.calibration is None or not self.num_q_heads:
            return []
        if not self.calibration.fits(self.num_layers, self.num_q_heads):
            return []
        return list(self.calibration.heads)

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
        return [(layer, int(h)) for layer, s in enumerate(self._layers) if s is not None for h in s.q_heads]

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
            calibrated = self._calibrated_heads()
            stored = set(self.stored_heads())
            if calibrated and all(head in stored for head in calibrated):
                assert self.calibration is not None
                self.top, self.top_weights, self.calibrated = calibrated, list(self.calibration.weights), True
            else:
                self.top = top_heads(self.head_scores, self.k)
                self.top_weights = [1.0] * len(self.top)
            if prune:
                self._keep(self.top)
            self.finalized = True
        return self.top

    # ---- Steps 2-3 ----

    def _clipped(self, generated_span: tuple[int, int]) -> tuple[int, int]:
        """The generated span [a, b) clipped to the tokens generated so far."""
        return max(0, generated_span[0]), min(self.num_generated, generated_span[1])

    def span_scores(
        self,
        prompt_spans: Sequence[tuple[int, int]],
        generated_span: tuple[int, int],
        heads: Sequence[tuple[int, int]] | None = None,
        span_score: str | None = None,
        head_weights: Sequence[float] | None = None,
        token_weighting: str | None = None,
        token_mask: Sequence[bool] | Tensor | None = None,
    ) -> SpanScores:
        """Eq. 10 for the generated tokens [a, b) (indices into the generation) over ``prompt_spans``.

        ``heads`` default: the finalized top heads with their weights (calibrated, or 1 each). ``span_score``
        (default ``options.span_score``): ``mean`` is the paper's form; otherwise each span is scored on the tokens
        :func:`select_span_tokens` chooses on the RC summed over ``heads`` (weighted), each head's term being its
        mean (or sum) over those tokens, times its weight, then Eq. 10's normalization over heads and spans. The
        answer's tokens are weighted by ``token_weighting`` (default ``options.token_weighting``; exact only).
        ``token_mask`` (one bool per generated token of [a, b), exact only): the tokens marked False are left out of
        the weighting (e.g. the answer's words echoed from the question: :func:`echo_mask`); when it leaves none,
        it is ignored.
        """
        if heads is None:
            heads = self.finalize(prune=False) if not self.finalized else self.top
            if head_weights is None:
                head_weights = self.top_weights
        n = self.num_generated
        exact = self.options.use_exact(n)
        a, b = self._clipped(generated_span)
        method = self.options.span_score if span_score is None else span_score
        if b <= a or not heads:
            per_head = torch.zeros(len(heads), len(prompt_spans))
        else:
            weights = torch.ones(len(heads)) if head_weights is None else torch.as_tensor(head_weights).float()
            plain = (token_weighting or self.options.token_weighting) == "uniform" and token_mask is None
            if method == "mean" and plain:
                q, kp, kg = self.head_tensors(heads, b)
                per_head = span_relative_contextualization(q[:, a:b], kp, kg, a, prompt_spans, exact=exact).float()
            else:
                per_token = self.weighted_token_scores((a, b), heads, prompt_spans, token_weighting, token_mask)
                per_token = per_token * weights.unsqueeze(1)
                chosen = select_span_tokens(per_token.sum(dim=0), prompt_spans, method, self.options.span_window)
                per_head = selected_span_scores(per_token, chosen, method)
            if method == "mean" and plain:
                per_head = per_head * weights.unsqueeze(1)
        scores, degenerate = normalize_span_scores(per_head)
        return SpanScores(scores=scores, per_head=per_head, heads=list(heads), degenerate=degenerate, exact=exact)

    def weighted_token_scores(
        self,
        generated_span: tuple[int, int],
        heads: Sequence[tuple[int, int]],
        prompt_spans: Sequence[tuple[int, int]],
        token_weighting: str | None = None,
        token_mask: Sequence[bool] | Tensor | None = None,
    ) -> Tensor:
        """[len(heads), m]: every prompt token's RC per head, the answer's queries weighted by ``token_weighting``
        (default ``options.token_weighting``, the weights read off these heads' RC over ``prompt_spans``) and
        restricted to ``token_mask`` (one bool per token of ``generated_span`` before clipping; ignored when it
        keeps none); the upper-bound estimator (long generations) has no per-query split and stays uniform."""
        method = self.options.token_weighting if token_weighting is None else token_weighting
        n = self.num_generated
        exact = self.options.use_exact(n)
        a, b = self._clipped(generated_span)
        if b <= a or not heads:
            return torch.zeros(len(heads), self.num_prompt_tokens)
        q, kp, kg = self.head_tensors(heads, b)
        mask = None
        if token_mask is not None:
            full = torch.as_tensor(token_mask, dtype=torch.bool).flatten()
            mask = full[a - generated_span[0] : b - generated_span[0]]
            if mask.numel() != b - a or not bool(mask.any()):
                mask = None
        if (method == "uniform" and mask is None) or not exact:
            return token_relative_contextualization(q[:, a:b], kp, kg, a, exact=exact).float()
        per_query = query_token_relative_contextualization(q[:, a:b], kp, kg, a)
        weights = token_weights(per_query, prompt_spans, method, self.options.span_window)
        if mask is not None:
            masked = weights * mask.to(weights.dtype)
            weights = masked if bool((masked > 0).any()) else mask.to(weights.dtype)
        return weighted_token_relative_contextualization(per_query, weights).float()

    def token_scores(
        self, generated_span: tuple[int, int], heads: Sequence[tuple[int, int]], exact: bool | None = None
    ) -> Tensor:
        """E[Z_h({t}, g')] of every prompt token for each of ``heads``: [len(heads), m] (zeros if g' is empty)."""
        n = self.num_generated
        exact = self.options.use_exact(n) if exact is None else exact
        a, b = self._clipped(generated_span)
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
        a, b = self._clipped(generated_span)
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
        calibration: HeadWeights | None = None,
    ) -> AttributionTrace:
        """The reference (non-streaming) trace: every head kept, from per-layer q [T, Hq, D], k [T, Hkv, D]."""
        options = dataclasses.replace(options or AttributionOptions(), warmup_tokens=None)
        trace = cls(num_prompt_tokens, len(queries), options, calibration=calibration)
        for layer, (q, k) in enumerate(zip(queries, keys)):
            trace.record(layer, 0, q, k)
        return trace
