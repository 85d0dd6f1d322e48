"""One scorer per compression method behind one interface (in the spirit of kvpress's ScorerPress).

A scorer turns one layer's prompt (trailing queries, keys, values) into one importance score per
(KV head, prompt token); :mod:`rcstat_vllm.scoring.selection` then decides what to keep. Higher = more
important; tokens a method always keeps (its observation window, its sinks) score +inf.

GQA convention (vLLM / HF): Hq = G * Hkv query heads, query head h reads KV head h // G. Methods that score
with queries compute one score per query head and reduce the G heads of a group with ``gqa_reduce``:
"mean" (default; what kvpress/SnapKV do, see FasterDecoding/SnapKV#22) or "max" (keep a token if any
query head of the group needs it).

Inside the engine the prompt lives in a paged KV cache: :meth:`Scorer.score_paged` scores it there
(:class:`PagedPrompt`), with a Triton kernel that reads the keys in place where one computes the method
(RC and SnapKV with the GQA mean, :mod:`rcstat_vllm.kernels`), otherwise by gathering only the tensors the
method reads (:attr:`Scorer.needs_keys`, :attr:`Scorer.needs_values`) and calling :meth:`Scorer.score`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rcstat_vllm.kernels.paged import gather_paged_tokens

from .rc import expected_rc_grouped, expected_rc_iot_grouped

__all__ = [
    "Scorer",
    "PagedPrompt",
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


#: Cache dtypes the Triton scoring kernels take (tensor-core dots on 16-bit inputs, IEEE products on float32);
#: others (fp8 caches, float64 in tests) score in torch.
PAGED_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedPrompt:
    """One request's prompt in a paged KV cache, to be read in place.

    Attributes:
        keys, values: [num_blocks, Hkv, block_size, d] cache views (strided views are fine: e.g. the key and
            value halves of vLLM's fused ``[num_blocks, Hkv, block_size, 2d]`` rows).
        block_table:  [pages] the request's block ids in token order (may be longer than the prompt needs).
        num_tokens:   n, the prompt tokens to score.
    """

    keys: Tensor
    values: Tensor
    block_table: Tensor
    num_tokens: int

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def gather_keys(self) -> Tensor:
        """[Hkv, n, d] float32 copy of the prompt's keys (the torch path)."""
        return gather_paged_tokens(self.keys, self.block_table, 0, self.num_tokens).float()

    def gather_values(self) -> Tensor:
        """[Hkv, n, d_v] float32 copy of the prompt's values (only for scorers that read them)."""
        return gather_paged_tokens(self.values, self.block_table, 0, self.num_tokens).float()

    @property
    def kernel_dtype(self) -> bool:
        """Whether the Triton kernels take this cache's dtype."""
        return self.keys.dtype in PAGED_KERNEL_DTYPES


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
        needs_keys, needs_values: whether :meth:`score` reads the prompt's keys / values; :meth:`score_paged`
            gathers nothing else (no method here reads values: a value-aware one would set ``needs_values``).
    """

    name: ClassVar[str]
    default_window_size: ClassVar[int] = 0
    needs_keys: ClassVar[bool] = True
    needs_values: ClassVar[bool] = False

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
                      From :meth:`score_paged`: keys [Hkv, n, 0] if not ``needs_keys``, values None if not
                      ``needs_values``.
            scale:    the layer's softmax scale (1/sqrt(d) usually); used by softmax-based methods.
        Returns:
            float32 [Hkv, n], higher = more important, +inf = always kept.
        """

    def score_paged(self, q_window: Tensor, prompt: PagedPrompt, scale: float, use_triton: bool = False) -> Tensor:
        """:meth:`score` of a prompt read from a paged cache: same arguments and result, ``prompt`` for keys/values.

        ``use_triton`` is the caller's go-ahead for the Triton kernels (the cache is where they run: a CUDA device,
        or the interpreter in tests); the scorer then takes its kernel if it has one that computes exactly its
        scores (:meth:`scores_in_triton`). Otherwise it gathers the keys (and values only if it reads them) into
        float32 copies for :meth:`score`.
        """
        if self.scores_in_triton(prompt, use_triton):
            return self._score_paged_triton(q_window, prompt, scale)
        keys = prompt.gather_keys() if self.needs_keys else self._key_placeholder(prompt)
        values = prompt.gather_values() if self.needs_values else None
        return self.score(q_window.float(), keys, values, scale)

    def scores_in_triton(self, prompt: PagedPrompt, use_triton: bool) -> bool:
        """The path :meth:`score_paged` takes: True = the Triton kernel, False = gather + :meth:`score`."""
        return bool(use_triton) and self.triton_kernel_applies(prompt)

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        """Whether a Triton paged kernel computes this scorer's scores for ``prompt`` (none by default)."""
        return False

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        raise NotImplementedError(f"{self.name} has no Triton paged kernel")

    @staticmethod
    def _key_placeholder(prompt: PagedPrompt) -> Tensor:
        """[Hkv, n, 0]: the shape and device position-only scorers use, without reading the cache."""
        return prompt.keys.new_empty(prompt.num_kv_heads, prompt.num_tokens, 0, dtype=torch.float32)

    def _window_length(self, num_queries: int, num_tokens: int) -> int:
        """w' = min(w, window_size, n): the trailing queries a windowed method uses."""
        w = min(num_queries, self.window_size, num_tokens)
        if w < 1:
            raise ValueError(f"{self.name} scoring needs at least one window query")
        return w

    def _trailing_window(self, q_window: Tensor, keys: Tensor) -> Tensor:
        """The last min(w, window_size) queries, grouped per KV head: [Hkv, G, w', d]."""
        if keys.dim() != 3 or q_window.dim() != 3:
            raise ValueError(f"expected q_window [Hq, w, d] and keys [Hkv, n, d], got "
                             f"{tuple(q_window.shape)} and {tuple(keys.shape)}")
        w = self._window_length(q_window.shape[1], keys.shape[1])
        return group_queries(q_window[:, q_window.shape[1] - w :], keys.shape[0])

    def _paged_window(self, q_window: Tensor, prompt: PagedPrompt) -> Tensor:
        """The same trailing queries as :meth:`_trailing_window`, ungrouped [Hq, w', d] as the kernels take them."""
        if q_window.dim() != 3:
            raise ValueError(f"expected q_window [Hq, w, d], got {tuple(q_window.shape)}")
        w = self._window_length(q_window.shape[1], prompt.num_tokens)
        return q_window[:, q_window.shape[1] - w :]

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

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        # The kernel computes Eq. 6 reduced by the GQA mean: the IOT variant and the max reduction have none.
        return not self.iot and self.gqa_reduce == "mean" and prompt.kernel_dtype

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        from rcstat_vllm.kernels.rc_scoring import rc_scores_paged  # lazy: the kernels module imports scoring

        queries = self._paged_window(q_window, prompt)
        # [Hkv, n - w'] for the non-window tokens, already the GQA mean; RC is scale-free (no ``scale``).
        scores = rc_scores_paged(queries, prompt.keys, prompt.block_table, prompt.num_tokens)
        return _mark_window_kept(smooth_scores(scores, self.smoothing), queries.shape[1])


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

    def triton_kernel_applies(self, prompt: PagedPrompt) -> bool:
        # The kernel averages the G query heads before pooling: equal to pooling first for the (linear) mean,
        # not for the max.
        return self.gqa_reduce == "mean" and prompt.kernel_dtype

    def _score_paged_triton(self, q_window: Tensor, prompt: PagedPrompt, scale: float) -> Tensor:
        from rcstat_vllm.kernels.snapkv_scoring import snapkv_scores_paged  # lazy: it imports this module

        queries = self._paged_window(q_window, prompt)
        # Softmax of logits * scale (the kernel takes the layer's scale, as :meth:`score`), pooled: [Hkv, n - w'].
        scores = snapkv_scores_paged(
            queries, prompt.keys, prompt.block_table, prompt.num_tokens, scale, self.kernel_size
        )
        return _mark_window_kept(scores, queries.shape[1])


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
    needs_keys = False  # positions only

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
    needs_keys = False

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
