"""Fused RC scoring straight from vLLM's paged key cache (Triton), with its torch reference.

Both compute, for one request and one layer, the expected RC of Eq. 6 of every non-window prompt token,
per query head, averaged over the G query heads of each KV head (as :class:`rcstat_vllm.scoring.RCScorer`).
Scale-free: raw logits <q, k>.

The kernel never materialises the [G*w, n] cross-logit matrix in global memory. What is small is done in
torch first: the window's w keys are gathered, its w(w+1)/2 causal self logits per query head are sorted
and prefix-summed (:func:`rcstat_vllm.scoring.rc.window_self_logits`). Then each program takes BLOCK_N
tokens of one KV head, gathers their keys through the block table, computes the G*w logits per token in
registers (one ``tl.dot``), counts per logit how many sorted self logits lie below it (a binary search over
the m = w(w+1)/2 sorted values: ceil(log2(m + 1)) gathers per logit, 10 at the default w = 32 where a linear
scan took 528 compares) and reads the prefix sum at that count; with ``query_reduction="max"`` it searches once
per query head, at the head's highest logit of the token (the same number: see the kernel). Reads of the key
cache: each key once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcstat_vllm.scoring.rc import check_query_reduction, expected_rc_grouped, window_self_logits

from .paged import cdiv, check_paged_inputs, gather_paged_tokens, next_power_of_2, row_blocking

__all__ = ["rc_scores_paged", "rc_scores_paged_reference", "triton_available"]


def triton_available() -> bool:
    """Whether Triton imports (it may be absent; on CPU it only runs under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rc_scores_paged_reference(q_window: Tensor, key_cache: Tensor, block_table: Tensor, num_tokens: int,
                              query_reduction: str = "mean") -> Tensor:
    """Torch reference: gather the request's keys via the block table, then grouped expected_rc + GQA mean.

    Args:
        q_window:    [Hq, w, d] queries of the last w prompt positions.
        key_cache:   [num_blocks, Hkv, block_size, d] (strided views fine).
        block_table: [pages] int32 block ids of this request, in token order.
        num_tokens:  n, prompt length.
        query_reduction: ``mean`` (Eq. 6) or ``max`` over the window's queries (:func:`expected_rc_grouped`).
    Returns:
        float32 [Hkv, n - w] (float64 for float64 inputs).
    """
    group, _ = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    keys = gather_paged_tokens(key_cache, block_table, 0, num_tokens)
    queries = q_window.reshape(keys.shape[0], group, *q_window.shape[1:])
    return expected_rc_grouped(queries, keys, query_reduction).mean(dim=1)


def rc_scores_paged(
    q_window: Tensor, key_cache: Tensor, block_table: Tensor, num_tokens: int, block_n: int = 64,
    query_reduction: str = "mean",
) -> Tensor:
    """Triton version of :func:`rc_scores_paged_reference`: same arguments, float32 [Hkv, n - w].

    The queries are cast to the cache's dtype for the tensor-core dot (products accumulate in float32);
    a float32 cache uses IEEE products (no TF32), so fp32 inputs match the reference to float32 rounding.
    """
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    check_query_reduction(query_reduction)
    from ._rc_triton import rc_scores_paged_kernel  # Triton only when launching

    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_scored = num_tokens - w
    out = torch.empty(num_kv_heads, num_scored, dtype=torch.float32, device=key_cache.device)
    if num_scored == 0:
        return out

    queries = q_window.to(key_cache.dtype)
    window_keys = gather_paged_tokens(key_cache, block_table, num_scored, num_tokens)
    table = window_self_logits(queries.float().reshape(num_kv_heads, group, w, head_dim), window_keys.float())
    m = w * (w + 1) // 2
    y_sorted = table.sorted.reshape(-1, m).float().contiguous()
    prefix = table.prefix.reshape(-1, m + 1).float().contiguous()
    center = table.center.reshape(-1).float().contiguous()

    grid = (cdiv(num_scored, block_n), num_kv_heads)
    rc_scores_paged_kernel[grid](
        queries, *queries.stride(),
        key_cache, *key_cache.stride(),
        block_table.to(device=key_cache.device, dtype=torch.int32),
        y_sorted, prefix, center,
        out, out.stride(0),
        num_scored, m,
        # mean: over the W*m (x, y) pairs of Eq. 6, then over the G query heads; max: over the m self logits of each
        # query's best row, then over the G query heads.
        1.0 / (m * group) if query_reduction == "max" else 1.0 / (w * m * group),
        G=group, G_PAD=next_power_of_2(group), MAX_OVER_QUERIES=query_reduction == "max",
        W=w, **row_blocking(group * w), D=head_dim, D_PAD=next_power_of_2(head_dim),
        BLOCK_N=block_n, PAGE=block_size, IEEE=key_cache.dtype == torch.float32,
        SEARCH_STEPS=max(1, m.bit_length()),  # 2**steps > m: every count 0..m is reachable
    )
    return out
