"""One scorer per compression method behind one interface (in the spirit of kvpress's ScorerPress).

A scorer turns one layer's prompt (trailing queries, keys, values) into one importance score per
(KV head, prompt token); :mod:`rcstat_vllm.scoring.selection` then decides what to keep. Higher = more
important; tokens a method always keeps (its observation window, its sinks) score +inf.

GQA convention (vLLM / HF): Hq = G * Hkv query heads, query head h reads KV head h // G. Methods that score
with queries compute one score per query head and reduce the G heads of a group with ``gqa_reduce``:
"mean" (default; what kvpress/SnapKV do, see FasterDecoding/SnapKV#22) or "max" (keep a token if any
query head of the group needs it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .rc import expected_rc_grouped, expected_rc_iot_grouped

__all__ = [
    "Scorer",
    "RCScorer",
    "SnapKVScorer",
    "TOVAScorer",
    "KnormScorer",
    "StreamingLLMScorer",
    "RandomScorer",
    "SCORERS",
    "get_scorer",
    "group_queries",
    "reduce_query_heads",
]

GQA_REDUCTIONS = ("mean", "max")


def group_queries(q_window: Tensor, num_kv_heads: int) -> Tensor:
    """[Hq, w, d] -> [Hkv, G, w, d]: query head h goes to KV head h // G (a view, no copy)."""
    num_q_heads = q_window.shape[0]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV-head groups")
    return q_window.reshape(num_kv_heads, num_q_heads // num_kv_heads, *q_window.shape[1:])


def reduce_query_heads(scores: Tensor, how: str, dim: int = 1) -> Tensor:
    """Reduce the query-head dim of grouped scores, e.g. [Hkv, G, n] -> [Hkv, n]."""
    if how == "mean":
        return scores.mean(dim=dim)
    if how == "max":
        return scores.amax(dim=dim)
    raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, got {how!r}")


def _mark_window_kept(non_window_scores: Tensor, window: int) -> Tensor:
    """[Hkv, n - window] -> float32 [Hkv, n] with the window tokens at +inf."""
    kept = torch.full(
        (non_window_scores.shape[0], window), float("inf"), dtype=torch.float32, device=non_window_scores.device
    )
    return torch.cat([non_window_scores.to(torch.float32), kept], dim=1)


class Scorer(ABC):
    """Scores every prompt token of one layer, per KV head.

    Attributes:
        name: registry name (see :data:`SCORERS`).
        window_size: how many trailing prompt queries :meth:`score` needs (0 = none). Given fewer (short
            prompt), a scorer uses what it gets; given more, it uses the last ``window_size``.
        gqa_reduce: "mean" | "max", how the G query heads of a KV head are combined.
    """

    name: ClassVar[str]
    default_window_size: ClassVar[int] = 0

    def __init__(self, window_size: int | None = None, gqa_reduce: str = "mean"):
        self.window_size = self.default_window_size if window_size is None else int(window_size)
        if self.window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {window_size}")
        if gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, got {gqa_reduce!r}")
        self.gqa_reduce = gqa_reduce

    @abstractmethod
    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """Importance of every prompt token for every KV head.

        Args:
            q_window: [Hq, w, d] queries of the last w prompt positions (RoPE applied).
            keys:     [Hkv, n, d] prompt keys (RoPE applied). values: [Hkv, n, d_v].
            scale:    the layer's softmax scale (1/sqrt(d) usually); used by softmax-based methods.
        Returns:
            float32 [Hkv, n], higher = more important, +inf = always kept.
        """

    def _trailing_window(self, q_window: Tensor, keys: Tensor) -> Tensor:
        """The last min(w, window_size) queries, grouped per KV head: [Hkv, G, w', d]."""
        if keys.dim() != 3 or q_window.dim() != 3:
            raise ValueError(f"expected q_window [Hq, w, d] and keys [Hkv, n, d], got "
                             f"{tuple(q_window.shape)} and {tuple(keys.shape)}")
        w = min(q_window.shape[1], self.window_size, keys.shape[1])
        if w < 1:
            raise ValueError(f"{self.name} scoring needs at least one window query")
        return group_queries(q_window[:, q_window.shape[1] - w :], keys.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window_size={self.window_size}, gqa_reduce={self.gqa_reduce!r})"


class RCScorer(Scorer):
    """RCStat: expected relative contextualization (Eq. 6; ``iot=True``: the supplement's IOT variant).

    Scale-free (raw logits): the softmax scale multiplies all scores of a layer alike.
    """

    name = "rc"
    default_window_size = 8

    def __init__(self, window_size: int | None = None, gqa_reduce: str = "mean", iot: bool = False, smoothing: int = 1):
        super().__init__(window_size, gqa_reduce)
        self.iot = bool(iot)
        if smoothing < 1 or smoothing % 2 == 0:
            raise ValueError(f"smoothing must be an odd integer >= 1, got {smoothing}")
        self.smoothing = int(smoothing)

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        queries = self._trailing_window(q_window, keys)
        rc = expected_rc_iot_grouped if self.iot else expected_rc_grouped
        per_query_head = rc(queries, keys)  # [Hkv, G, n - w]
        # Optional SnapKV-style pooling along tokens (the config's ``smoothing``): neighbours share a score.
        scores = smooth_scores(reduce_query_heads(per_query_head, self.gqa_reduce), self.smoothing)
        return _mark_window_kept(scores, queries.shape[2])


def window_attention(queries: Tensor, keys: Tensor, scale: float) -> Tensor:
    """Causal softmax attention of the w window queries over all n keys, float32.

    Args:
        queries: [Hkv, G, w, d], the queries of positions n-w..n-1; keys: [Hkv, n, d].
    Returns:
        [Hkv, G, w, n]: window query j (absolute position n-w+j) sees keys 0..n-w+j.
    """
    w, n = queries.shape[2], keys.shape[1]
    logits = torch.einsum("hgjd,hnd->hgjn", queries.float(), keys.float()) * scale
    # Key i is in query j's future when i > n - w + j.
    future = torch.ones(w, n, dtype=torch.bool, device=keys.device).triu(diagonal=n - w + 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


class SnapKVScorer(Scorer):
    """SnapKV (Li et al. 2024): window attention to each token, averaged, then smoothed by average pooling.

    As kvpress's SnapKVPress: softmax(q k^T * scale) of the window queries with the causal mask, mean over
    the window queries, ``avg_pool1d(kernel_size, stride 1, padding kernel_size // 2)`` along tokens (zero
    padding counted at the edges, PyTorch's default), then the GQA reduction. Window tokens get +inf.
    Computed one KV head at a time so the [G, w, n] attention stays small at long prompts.
    """

    name = "snapkv"
    default_window_size = 64

    def __init__(self, window_size: int | None = None, gqa_reduce: str = "mean", kernel_size: int = 5):
        super().__init__(window_size, gqa_reduce)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1 (same-length pooling), got {kernel_size}")
        self.kernel_size = kernel_size

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        queries = self._trailing_window(q_window, keys)
        w, n = queries.shape[2], keys.shape[1]
        per_head = []
        for kv_head in range(keys.shape[0]):
            attention = window_attention(queries[kv_head : kv_head + 1], keys[kv_head : kv_head + 1], scale)
            per_head.append(attention[..., : n - w].mean(dim=2))  # [1, G, n - w]
        attention_to_token = torch.cat(per_head, dim=0)  # [Hkv, G, n - w]
        pooled = smooth_scores(attention_to_token, self.kernel_size)
        return _mark_window_kept(reduce_query_heads(pooled, self.gqa_reduce), w)


def smooth_scores(scores: Tensor, kernel_size: int) -> Tensor:
    """SnapKV's same-length average pooling along the last dim: [..., n] -> [..., n]."""
    if scores.shape[-1] == 0 or kernel_size == 1:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pooled = F.avg_pool1d(flat, kernel_size=kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(scores.shape)


class TOVAScorer(Scorer):
    """TOVA (Oren et al. 2024): the last prompt token's attention, averaged over all heads of the layer.

    As kvpress's TOVAPress and the TOVA paper, the reduction is over *all* Hq query heads, not per group,
    so every KV head gets the same scores (``gqa_reduce`` picks mean or max over those heads). The last
    token itself gets +inf.
    """

    name = "tova"
    default_window_size = 1

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        if self.window_size < 1:
            raise ValueError("TOVA needs the last prompt query (window_size >= 1)")
        num_kv_heads, n = keys.shape[:2]
        last_query = group_queries(q_window[:, -1:], num_kv_heads)  # [Hkv, G, 1, d]
        # The last prompt token sees every key, so no causal mask is needed.
        logits = torch.einsum("hgjd,hnd->hgjn", last_query.float(), keys.float()) * scale
        attention = torch.softmax(logits, dim=-1)[:, :, 0, : n - 1]  # [Hkv, G, n - 1]
        all_heads = attention.reshape(1, -1, n - 1)  # [1, Hq, n - 1]
        layer_scores = reduce_query_heads(all_heads, self.gqa_reduce)  # [1, n - 1]
        return _mark_window_kept(layer_scores.expand(num_kv_heads, n - 1), 1)


class KnormScorer(Scorer):
    """Knorm (Devoto et al. 2024): keys with a small L2 norm draw more attention; score = -||k_i||_2."""

    name = "knorm"
    default_window_size = 0

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        return -torch.linalg.vector_norm(keys.float(), dim=-1)


class StreamingLLMScorer(Scorer):
    """StreamingLLM (Xiao et al. 2024): keep the first ``n_sink`` tokens and the most recent ones.

    Sinks score +inf; every other token scores its position (as float32: exact up to 2^24 tokens), so
    keeping any top-k (budget mode) keeps the sinks plus the k - n_sink most recent tokens, and every head
    agrees. Under threshold mode the rule becomes "keep tokens after c * mean position".
    """

    name = "streaming"
    default_window_size = 0

    def __init__(self, window_size: int | None = None, gqa_reduce: str = "mean", n_sink: int = 4):
        super().__init__(window_size, gqa_reduce)
        if n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {n_sink}")
        self.n_sink = n_sink

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        num_kv_heads, n = keys.shape[:2]
        positions = torch.arange(n, dtype=torch.float32, device=keys.device)
        positions[: self.n_sink] = float("inf")
        return positions.unsqueeze(0).expand(num_kv_heads, n).clone()


class RandomScorer(Scorer):
    """Uniform random scores, a floor for every other method.

    Drawn on the CPU from a generator seeded once at construction, so a given sequence of calls is
    reproducible on any device (each call draws fresh scores).
    """

    name = "random"
    default_window_size = 0

    def __init__(self, window_size: int | None = None, gqa_reduce: str = "mean", seed: int = 0):
        super().__init__(window_size, gqa_reduce)
        self.seed = seed
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def score(self, q_window: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        scores = torch.rand(keys.shape[:2], generator=self._generator, dtype=torch.float32)
        return scores.to(keys.device)


SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (RCScorer, SnapKVScorer, TOVAScorer, KnormScorer, StreamingLLMScorer, RandomScorer)
}


def get_scorer(method: str, **options) -> Scorer:
    """Build the scorer registered under ``method`` with its constructor ``options``.

    Raises:
        ValueError: unknown method (the message lists the allowed ones). Note "none", the config's off
            switch, is not a scorer: the caller skips scoring altogether.
    """
    try:
        scorer_cls = SCORERS[method]
    except KeyError:
        raise ValueError(
            f"unknown scoring method {method!r}; allowed: {', '.join(sorted(SCORERS))}"
        ) from None
    return scorer_cls(**options)
