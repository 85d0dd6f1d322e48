"""Relative contextualization (RCStat, Sections 3-4.1): expected RC per prompt token and its bounds.

Notation (paper, Eq. 1 and Definitions 3.1-3.4). For one attention head, the logit of key i under query j is
f(i, j) = <q_j, k_i> (pre-softmax, RoPE applied, *no* 1/sqrt(d) scale: the paper works on raw logits, and a
common positive scale multiplies every score of a head by the same factor, which changes no eviction
decision of Eq. 9 or of budget mode inside one layer).

KV compression uses an observation window g^ = the last w prompt tokens as a proxy for the generation:

* X_i = {f(i, j) : j in g^}                    the w cross logits of prompt token i (Eq. 2 with p1 = {t_i});
* Y   = {f(k, l) : k <= l, k, l in g^}         the w(w+1)/2 causal self logits of the window (Eq. 3);
* score_i = E[max(X_i - Y, 0)] under the uniform joint over all (x, y) pairs (Eq. 6 with |p1| = 1):
            2 / (w^2 (w+1)) * sum_j sum_{k<=l} max(f(i, j) - f(k, l), 0).

The triple sum is O(w^3) per token. Since Y does not depend on i, we sort Y once per head and use
sum_y max(x - y, 0) = cnt(y < x) * x - sum(y < x), where both terms come from the sorted Y and its prefix
sums via a binary search: O(w log w) per token, and the per-token work is one matmul plus a searchsorted.

The upper bound A of Theorem 3.6 (Eq. 4, computed by Algorithm 1) holds for any joint of X and Y with the given
marginals; attribution uses it where the exact mean costs too much. The paper's other statistics (the IOT variant,
the lower bound of Eq. 5) are not on the served path: ``benchmarks/rc_variants.py`` keeps them, checked against brute
force.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .binned_search import BinnedSearch
from .rc_knobs import GROUP_REDUCTIONS, QUERY_REDUCTIONS

__all__ = [
    "GROUP_REDUCTIONS",
    "QUERY_REDUCTIONS",
    "WindowSelfLogits",
    "accumulation_dtype",
    "cdfs_at_midpoints",
    "check_group_reduction",
    "check_query_reduction",
    "expected_rc",
    "expected_rc_grouped",
    "expected_rc_samples",
    "over_group",
    "rc_upper_bound",
    "window_self_logits",
]

#: Up to this many window self logits per query head (m = w(w+1)/2; w <= 16), summing max(x - y, 0) over Y
#: directly is faster than searchsorted + prefix sums (one CPU thread, SmolLM2 shapes, 1800 tokens, per layer:
#: w = 8: 2.1 vs 3.5 ms; w = 16: 6.6 vs 9.2 ms; w = 32: 44 vs 25 ms).
DIRECT_SUM_MAX_M = 136
#: Elements of the transient [..., k, m] difference tensor of the direct sum (16 MiB in float32).
_DIRECT_SUM_ELEMENTS = 1 << 22

# Tokens per chunk when computing cross logits: bounds the transient [.., w, chunk] tensors (and the int64
# searchsorted output) to a few MiB per head at 64k-token prompts instead of materialising [.., w, n] at once.
_TOKEN_CHUNK = 8192
#: On the CPU, cross logits per chunk (all heads): the chunk's transient float and int64 tensors then stay in a core's
#: L2 cache instead of streaming through memory between the ~10 passes over them. SmolLM2 shapes (3 KV heads x 3
#: queries x window 32), one layer, 2 threads: 640 tokens 4.1 -> 3.1 ms, 2000 tokens 7.4 -> 5.6, 8000 tokens 53 -> 23.
_CPU_CHUNK_ELEMENTS = 1 << 16
#: The same bound for ``query_reduction`` ``max`` (the default), where a chunk's cross logits meet one matmul and one
#: max over the window's queries and the ~10 passes after run over the w-times smaller maxima: counted as cross
#: logits (4 MiB in float32), its chunks are 16x longer. Stacked layers (a deferred scoring: 10 layers x 3 KV heads
#: x 3 queries x window 32) had chunks of 22 tokens under :data:`_CPU_CHUNK_ELEMENTS`, and dispatch cost more than
#: arithmetic; one thread: 320 tokens 13.7 -> 7.1 ms, 2000 tokens 64 -> 27, 8000 tokens 325 -> 94; one layer (3 KV
#: heads): 2000 tokens 4.3 -> 2.2 ms, 8000 tokens 13.3 -> 11.0.
_CPU_MAX_CHUNK_ELEMENTS = 1 << 20


def _token_chunk(keys: Tensor, queries_per_token: int, elements: int | None = None) -> int:
    """Tokens scored per chunk: :data:`_TOKEN_CHUNK`, or on the CPU as many as fill ``elements`` cross logits
    (:data:`_CPU_CHUNK_ELEMENTS` when None)."""
    if keys.device.type != "cpu":
        return _TOKEN_CHUNK
    elements = _CPU_CHUNK_ELEMENTS if elements is None else elements
    return min(_TOKEN_CHUNK, max(16, elements // max(queries_per_token, 1)))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (tests, exact checks); everything else (fp32, bf16, fp16) works in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sort_last(values: Tensor) -> Tensor:
    """``torch.sort(values, dim=-1).values``, contiguous. On the CPU by NumPy's sort: a SIMD quicksort, where torch's
    sorts row by row (RC's window tables, 90 rows of 528 float32 values: 0.17 against 2.4 ms on one AVX2 thread).
    The same values: a sort's output does not depend on its algorithm (NaNs last in both)."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and not values.requires_grad:
        return torch.from_numpy(np.sort(values.contiguous().numpy(), axis=-1))
    return torch.sort(values, dim=-1).values.contiguous()


# --------------------------------------------------------------------------------------------------------
# Window self logits: the sorted sample Y and its prefix sums, computed once per query head.
# --------------------------------------------------------------------------------------------------------


class WindowSelfLogits:
    """The sorted causal self logits Y of one observation window, per query head, ready for counting.

    Attributes (leading dims ``...`` = the query-head dims, e.g. ``[Hkv, G]``):
        center:  [...]         mean of Y. Every value below is stored relative to it: max(x - y, 0) is
                               shift invariant, and centring keeps the terms of cnt * x - sum(y < x) (and
                               the prefix sums) small when all logits of a head share a large offset.
        sorted:  [..., m]      Y - center in ascending order, m = w(w+1)/2.
        prefix:  [..., m + 1]  prefix[..., c] = sum of the c smallest centred values (prefix[..., 0] = 0).
    """

    def __init__(self, center: Tensor, sorted_values: Tensor, prefix: Tensor):
        self.center = center
        self.sorted = sorted_values
        self.prefix = prefix
        self._bins: BinnedSearch | None = None

    @classmethod
    def of(cls, y: Tensor) -> WindowSelfLogits:
        """The table of the values ``y`` ``[..., m]`` (in the dtype they come in): centred, sorted, summed."""
        center = y.mean(dim=-1)
        y_sorted = sort_last(y - center.unsqueeze(-1))
        prefix = torch.nn.functional.pad(torch.cumsum(y_sorted, dim=-1), (1, 0))
        return cls(center, y_sorted, prefix.contiguous())

    def count_below(self, x_centered: Tensor) -> Tensor:
        """``[..., k]`` int64: how many values of ``sorted`` are strictly below each (centred) x. Equal to
        ``torch.searchsorted(sorted, x, side="left")``; through :class:`BinnedSearch` when Y spreads evenly enough
        (about 3x faster on the CPU), else searchsorted itself. On an accelerator always searchsorted: choosing
        would read a value back (a synchronisation), and there the Triton kernels score anyway."""
        if self.sorted.device.type != "cpu":
            return torch.searchsorted(self.sorted, x_centered.contiguous(), side="left")
        if self._bins is None:
            self._bins = BinnedSearch.build(self.sorted)
        if self._bins.usable:
            return self._bins.count_below(x_centered)
        return torch.searchsorted(self.sorted, x_centered.contiguous(), side="left")

    def sum_positive_gaps(self, x: Tensor) -> Tensor:
        """sum over y in Y of max(x - y, 0), for every x.

        Args:
            x: [..., k] raw logits (not centred), same leading dims as ``sorted`` minus the last.
        Returns:
            [..., k] in the dtype of ``sorted``.
        """
        x_centered = x - self.center.unsqueeze(-1)
        m = self.sorted.shape[-1]
        if m <= DIRECT_SUM_MAX_M:
            # The definition itself, chunked along x: cheaper than a batched searchsorted for small windows.
            gaps = torch.empty_like(x_centered)
            step = max(1, _DIRECT_SUM_ELEMENTS // (m * max(self.sorted[..., 0].numel(), 1)))
            for start in range(0, x_centered.shape[-1], step):
                chunk = x_centered[..., start : start + step]
                gaps[..., start : start + step] = (
                    (chunk.unsqueeze(-1) - self.sorted.unsqueeze(-2)).clamp_min_(0).sum(-1)
                )
            return gaps
        # side="left": number of y strictly below x; y == x contributes max(0, 0) = 0 either way.
        count_below = self.count_below(x_centered)
        sum_below = torch.gather(self.prefix, -1, count_below)
        gaps = count_below.to(x_centered.dtype) * x_centered - sum_below
        # Mathematically >= 0; rounding can leave a tiny negative when x barely exceeds a y.
        return gaps.clamp_min_(0)


def window_self_logits(q_window: Tensor, window_keys: Tensor) -> WindowSelfLogits:
    """Sorted causal self logits of the window, Y = {<q_l, k_k> : k <= l}, per query head.

    Args:
        q_window:    [Hkv, G, w, d] window queries, G query heads per KV head.
        window_keys: [Hkv, w, d]    keys of the same w window tokens.
    Returns:
        WindowSelfLogits with leading dims [Hkv, G] and m = w(w+1)/2 values per query head.
    """
    acc = accumulation_dtype(q_window.dtype)
    w = q_window.shape[-2]
    # self_logits[h, g, l, k] = <q_l, k_k>: query position l (row), key position k (column).
    self_logits = torch.einsum("hgld,hkd->hglk", q_window.to(acc), window_keys.to(acc))
    rows, cols = torch.tril_indices(w, w, device=q_window.device)  # col <= row: key at or before query
    y = self_logits[..., rows, cols]  # [Hkv, G, m]
    return WindowSelfLogits.of(y)


def _check_window_shapes(q_window: Tensor, keys: Tensor, grouped: bool) -> tuple[int, int]:
    expected_q_dims = 4 if grouped else 3
    if q_window.dim() != expected_q_dims or keys.dim() != 3:
        raise ValueError(
            f"expected q_window with {expected_q_dims} dims and keys [H, n, d], got "
            f"{tuple(q_window.shape)} and {tuple(keys.shape)}"
        )
    w, n = q_window.shape[-2], keys.shape[1]
    if q_window.shape[0] != keys.shape[0] or q_window.shape[-1] != keys.shape[-1]:
        raise ValueError(f"head count or head_dim mismatch: {tuple(q_window.shape)} vs {tuple(keys.shape)}")
    if w < 1:
        raise ValueError("the observation window needs at least one query")
    if n < w:
        raise ValueError(f"{n} keys cannot contain a window of {w} tokens (the window is keys[:, n-w:])")
    return w, n


# --------------------------------------------------------------------------------------------------------
# Expected RC per prompt token (Eq. 6, non-IOT).
# --------------------------------------------------------------------------------------------------------


def check_query_reduction(query_reduction: str) -> str:
    """One of :data:`QUERY_REDUCTIONS`, else a ValueError naming it (the scorer, the torch path and the kernel)."""
    if query_reduction not in QUERY_REDUCTIONS:
        raise ValueError(f"query_reduction must be one of {QUERY_REDUCTIONS}, got {query_reduction!r}")
    return query_reduction


def check_group_reduction(group_reduction: str) -> str:
    """One of :data:`GROUP_REDUCTIONS`, else a ValueError naming it (the scorer, the torch paths and the kernels)."""
    if group_reduction not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduction must be one of {GROUP_REDUCTIONS}, got {group_reduction!r}")
    return group_reduction


def over_group(per_query_head: Tensor, group_reduction: str) -> Tensor:
    """[Hkv, G, n] each query head's RC -> [Hkv, n]: a KV head's G query heads combined as ``group_reduction`` says
    (``mean``, RCStat's per-head scores averaged; ``max``, the query head that reads the token most)."""
    if check_group_reduction(group_reduction) == "max":
        return per_query_head.amax(dim=1)
    return per_query_head.mean(dim=1)


def expected_rc_grouped(q_window: Tensor, keys: Tensor, query_reduction: str = "mean") -> Tensor:
    """Expected RC (Eq. 6) of every non-window token, for G query heads sharing each KV head (GQA).

    Grouped so that GQA never repeats the keys: the G*w queries of a KV head meet its keys in one matmul.

    ``query_reduction``: ``mean`` is Eq. 6, the mean of max(x - y, 0) over all w * m pairs of a cross logit x of
    the token and a window self logit y. ``max`` takes, per window query j, the mean over the m self logits
    (the expected RC of the token against that one query, Eq. 6 with a window of queries {j}) and keeps the
    highest over j: a token only one window query reads strongly (the next word of a fact the question names,
    read by one copy head's query) is not averaged away by the w - 1 queries that do not read it. Same pairs;
    ``max`` costs less, since that highest mean is the one at the token's highest cross logit (below).

    Args:
        q_window: [Hkv, G, w, d] queries of the last w prompt positions.
        keys:     [Hkv, n, d] all prompt keys; the window is keys[:, n-w:].
        query_reduction: one of :data:`QUERY_REDUCTIONS`.
    Returns:
        [Hkv, G, n - w] scores, float32 (float64 for float64 inputs).
    """
    check_query_reduction(query_reduction)
    w, n = _check_window_shapes(q_window, keys, grouped=True)
    acc = accumulation_dtype(q_window.dtype)
    num_kv_heads, group = q_window.shape[:2]
    table = window_self_logits(q_window, keys[:, n - w :])
    m = w * (w + 1) // 2
    # Eq. 6 for one token: 2 / (w^2 (w+1)) = 1 / (w * m): the mean over all w * m (x, y) pairs.
    pair_count = w * m
    queries = q_window.to(acc).reshape(num_kv_heads, group * w, -1)
    scores = torch.empty(num_kv_heads, group, n - w, dtype=acc, device=keys.device)
    elements = _CPU_MAX_CHUNK_ELEMENTS if query_reduction == "max" else _CPU_CHUNK_ELEMENTS
    chunk = _token_chunk(keys, num_kv_heads * group * w, elements)
    for start in range(0, n - w, chunk):
        stop = min(start + chunk, n - w)
        cross = torch.matmul(queries, keys[:, start:stop].to(acc).transpose(1, 2))  # [Hkv, G*w, chunk]
        if query_reduction == "max":
            # sum_y max(x - y, 0) does not decrease as x grows, and a query head's w queries all meet the same Y: the
            # highest of their w sums is the sum at their highest cross logit. One count per token and query head
            # instead of w (the same numbers as reducing the w sums).
            best = cross.reshape(num_kv_heads, group, w, stop - start).amax(dim=2)
            scores[..., start:stop] = table.sum_positive_gaps(best) / m
        else:
            cross = cross.reshape(num_kv_heads, group, w * (stop - start))
            gaps = table.sum_positive_gaps(cross).reshape(num_kv_heads, group, w, stop - start)
            scores[..., start:stop] = gaps.sum(dim=2) / pair_count
    return scores


def expected_rc(q_window: Tensor, keys: Tensor) -> Tensor:
    """Expected relative contextualization (Eq. 6, non-IOT) of every non-window prompt token.

    score_i = 2 / (w^2 (w+1)) * sum_{j in window} sum_{k <= l in window} max(<q_j, k_i> - <q_l, k_k>, 0)

    Args:
        q_window: [H, w, d] queries of the last w prompt positions (RoPE applied).
        keys:     [H, n, d] all prompt keys (RoPE applied); the window is keys[:, n-w:].
    Returns:
        [H, n - w] scores of tokens 0..n-w-1, float32 (float64 for float64 inputs). Logits are computed in
        that dtype too (bf16/fp16 inputs are upcast chunk by chunk).
    """
    if q_window.dim() != 3:
        raise ValueError(f"q_window must be [H, w, d], got {tuple(q_window.shape)}")
    return expected_rc_grouped(q_window.unsqueeze(1), keys).squeeze(1)


# --------------------------------------------------------------------------------------------------------
# 1-D samples: exact mean over all pairs and the upper bound of Theorem 3.6.
# --------------------------------------------------------------------------------------------------------


def expected_rc_samples(x: Tensor, y: Tensor) -> Tensor:
    """E[max(X - Y, 0)] under the uniform joint over all (x, y) pairs, by sorting y once.

    Args:
        x: [..., nx] samples of X; y: [..., ny] samples of Y (same leading dims).
    Returns:
        [...] in x's accumulation dtype.
    """
    acc = accumulation_dtype(x.dtype)
    x, y = x.to(acc), y.to(acc)
    return WindowSelfLogits.of(y).sum_positive_gaps(x).mean(dim=-1) / y.shape[-1]


def cdfs_at_midpoints(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Algorithm 1, lines 1-8: empirical CDFs of X and Y at the midpoints between consecutive breakpoints.

    Breakpoints are all samples sorted; duplicates are not removed (the "unique" of line 2) because a
    repeated breakpoint only adds an interval of width 0, which contributes nothing to the area.

    Returns:
        F_X(mid) [..., nx+ny-1], F_Y(mid) [..., nx+ny-1], widths [..., nx+ny-1].
    """
    if x.shape[-1] == 0 or y.shape[-1] == 0:
        raise ValueError("both samples need at least one value")
    acc = accumulation_dtype(x.dtype)
    x, y = x.to(acc), y.to(acc)
    x_sorted = torch.sort(x, dim=-1).values.contiguous()
    y_sorted = torch.sort(y, dim=-1).values.contiguous()
    breakpoints = torch.sort(torch.cat([x_sorted, y_sorted], dim=-1), dim=-1).values
    left, right = breakpoints[..., :-1], breakpoints[..., 1:]
    midpoints = ((left + right) / 2).contiguous()
    widths = right - left
    # F(m) = fraction of samples <= m: side="right" counts ties as below-or-equal.
    cdf_x = torch.searchsorted(x_sorted, midpoints, side="right").to(acc) / x.shape[-1]
    cdf_y = torch.searchsorted(y_sorted, midpoints, side="right").to(acc) / y.shape[-1]
    return cdf_x, cdf_y, widths


def rc_upper_bound(x: Tensor, y: Tensor) -> Tensor:
    """Upper bound A of E[max(X - Y, 0)] (Theorem 3.6 Eq. 4, Algorithm 1): area under min(F_Y, 1 - F_X).

    Args:
        x: [..., nx] samples of X (cross logits); y: [..., ny] samples of Y (self logits).
    Returns:
        [...] the overlap area.
    """
    cdf_x, cdf_y, widths = cdfs_at_midpoints(x, y)
    return (torch.minimum(cdf_y, 1 - cdf_x) * widths).sum(dim=-1)
