"""The paper's RC statistics that the served path does not use, kept to compare with it and checked against brute
force (tests/test_rc_statistics.py): the IOT variant of expected RC (RCStat supplement, Section 2.1; paper Section
3.3) and the lower bound a of Theorem 3.6 (Eq. 5).

The IOT variant assumes independent output tokens: each window query j is compared only with its own causal self
logits {f(k, j) : k <= j}:
    score_i = mean_j mean_{k<=j} max(f(i, j) - f(k, j), 0).
The bounds hold for any joint of X and Y with the given marginals, so they sandwich the mean over all pairs:
a (Eq. 5) <= E[max(X - Y, 0)] <= A (Eq. 4, :func:`rcstat_vllm.scoring.rc.rc_upper_bound`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcstat_vllm.scoring.rc import (
    WindowSelfLogits,
    _check_window_shapes,
    _token_chunk,
    accumulation_dtype,
    cdfs_at_midpoints,
)

__all__ = ["expected_rc_iot", "expected_rc_iot_grouped", "rc_lower_bound"]


def expected_rc_iot_grouped(q_window: Tensor, keys: Tensor) -> Tensor:
    """IOT variant (independent output tokens) of :func:`expected_rc_grouped`.

    score_i = mean_j mean_{k <= j} max(<q_j, k_i> - <q_j, k_k>, 0): query j's cross logit is compared only
    with its own causal self logits (j + 1 values, window-relative positions).

    Args:
        q_window: [Hkv, G, w, d]; keys: [Hkv, n, d].
    Returns:
        [Hkv, G, n - w], float32 (float64 for float64 inputs).
    """
    w, n = _check_window_shapes(q_window, keys, grouped=True)
    acc = accumulation_dtype(q_window.dtype)
    num_kv_heads, group = q_window.shape[:2]
    queries = q_window.to(acc)
    # self_logits[h, g, j, k] = <q_j, k_k>; entries with k > j are not part of query j's sample.
    self_logits = torch.einsum("hgjd,hkd->hgjk", queries, keys[:, n - w :].to(acc))
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(diagonal=1)
    valid_count = torch.arange(1, w + 1, device=keys.device, dtype=acc)  # query j sees j + 1 keys
    center = self_logits.masked_fill(future, 0).sum(dim=-1) / valid_count  # [Hkv, G, w]
    # +inf pads each row to w values: it sorts last and is never below a finite x, so the count of values
    # below x never reaches the padding and the prefix sums it indexes stay finite.
    centered = (self_logits - center.unsqueeze(-1)).masked_fill(future, float("inf"))
    y_sorted = torch.sort(centered, dim=-1).values
    prefix = torch.nn.functional.pad(torch.cumsum(y_sorted, dim=-1), (1, 0))
    table = WindowSelfLogits(center, y_sorted.contiguous(), prefix.contiguous())  # leading dims [Hkv, G, w]

    scores = torch.empty(num_kv_heads, group, n - w, dtype=acc, device=keys.device)
    chunk = _token_chunk(keys, num_kv_heads * group * w)
    for start in range(0, n - w, chunk):
        stop = min(start + chunk, n - w)
        cross = torch.einsum("hgjd,hnd->hgjn", queries, keys[:, start:stop].to(acc))  # [Hkv, G, w, chunk]
        gaps = table.sum_positive_gaps(cross) / valid_count.unsqueeze(-1)
        scores[..., start:stop] = gaps.mean(dim=2)
    return scores


def expected_rc_iot(q_window: Tensor, keys: Tensor) -> Tensor:
    """IOT variant of :func:`expected_rc` (supplement Sec. 2.1): [H, w, d], [H, n, d] -> [H, n - w]."""
    if q_window.dim() != 3:
        raise ValueError(f"q_window must be [H, w, d], got {tuple(q_window.shape)}")
    return expected_rc_iot_grouped(q_window.unsqueeze(1), keys).squeeze(1)


def rc_lower_bound(x: Tensor, y: Tensor) -> Tensor:
    """Lower bound a of E[max(X - Y, 0)] (Theorem 3.6 Eq. 5): area where F_Y exceeds F_X.

    Args:
        x: [..., nx] samples of X; y: [..., ny] samples of Y.
    Returns:
        [...] the area of max(F_Y - F_X, 0).
    """
    cdf_x, cdf_y, widths = cdfs_at_midpoints(x, y)
    return ((cdf_y - cdf_x).clamp_min(0) * widths).sum(dim=-1)
