"""Fused RC scoring straight from vLLM's paged key cache (Triton), with its torch reference.

For one request and one layer, both compute Eq. 6's expected RC of every non-window prompt token, per query head,
averaged over the G query heads of each KV head, given the window's sorted self logits Y (the table, per query
head: its centre, the centred values sorted, their prefix sums). The table is small (w(w+1)/2 values per query
head) and made in torch by the caller (:func:`rcstat_vllm.scoring.methods.rc.rc_scores_paged`, with the RC
statistics of :mod:`rcstat_vllm.scoring.rc`); this module holds only what reads the key cache, so it imports
nothing from scoring. Scale-free: raw logits <q, k>.

The kernel never materialises the [G*w, n] cross-logit matrix in global memory. Each program takes BLOCK_N tokens
of one KV head, gathers their keys through the block table, computes the G*w logits per token in registers (one
``tl.dot``), counts per logit how many sorted self logits lie below it (a binary search over the m = w(w+1)/2
sorted values: ceil(log2(m + 1)) gathers per logit, 10 at w = 32 where a linear scan took 528 compares) and reads
the prefix sum at that count; with ``max_over_queries`` it searches once per query head, at the head's highest
logit of the token (the same number: see the kernel). Reads of the key cache: each key once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import cdiv, check_paged_inputs, gather_paged_tokens, next_power_of_2, row_blocking

__all__ = ["over_query_heads", "rc_table_scores_paged", "rc_table_scores_paged_reference", "triton_available"]


def triton_available() -> bool:
    """Whether Triton imports (it may be absent; on CPU it only runs under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rc_table_scores_paged_reference(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    y_sorted: Tensor,
    prefix: Tensor,
    center: Tensor,
    max_over_queries: bool = False,
    max_over_heads: bool = False,
) -> Tensor:
    """Torch reference of :func:`rc_table_scores_paged`: Eq. 6 by its definition, every gap max(x - y, 0) summed
    (``prefix`` is unused: the kernel's shortcut). Materialises [Hkv, G, w, n - w, m]: for tiny shapes (tests).

    Args:
        q_window:    [Hq, w, d] queries of the last w prompt positions.
        key_cache:   [num_blocks, Hkv, block_size, d] (strided views fine).
        block_table: [pages] int32 block ids of this request, in token order.
        num_tokens:  n, prompt length.
        y_sorted, prefix, center: [Hq, m], [Hq, m + 1], [Hq]: each query head's window self logits Y minus
            ``center``, sorted ascending, and their prefix sums (``prefix[:, c]`` = the c smallest summed).
        max_over_queries: the highest of the w queries' expected RC per query head instead of their mean.
        max_over_heads: the highest of a KV head's G query heads' RC instead of their mean.
    Returns:
        float32 [Hkv, n - w].
    """
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    keys = gather_paged_tokens(key_cache, block_table, 0, num_tokens - w).float()  # [Hkv, n - w, d]
    num_kv_heads, m = keys.shape[0], y_sorted.shape[-1]
    queries = q_window.to(key_cache.dtype).float().reshape(num_kv_heads, group, w, -1)
    cross = torch.einsum("hgjd,hnd->hgjn", queries, keys)  # [Hkv, G, w, n - w]
    if max_over_queries:
        cross = cross.amax(dim=2, keepdim=True)
    x = cross - center.float().reshape(num_kv_heads, group, 1, 1)
    gaps = (x.unsqueeze(-1) - y_sorted.float().reshape(num_kv_heads, group, 1, 1, m)).clamp_min(0).sum(-1)
    return over_query_heads(gaps.mean(dim=2) / m, max_over_heads)


def rc_table_scores_paged(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    y_sorted: Tensor,
    prefix: Tensor,
    center: Tensor,
    max_over_queries: bool = False,
    max_over_heads: bool = False,
    block_n: int = 64,
) -> Tensor:
    """Triton version of :func:`rc_table_scores_paged_reference`: same arguments, float32 [Hkv, n - w].

    The queries are cast to the cache's dtype for the tensor-core dot (products accumulate in float32);
    a float32 cache uses IEEE products (no TF32), so fp32 inputs match the reference to float32 rounding.
    """
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    from ._rc_triton import rc_scores_paged_kernel  # Triton only when launching

    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_scored = num_tokens - w
    out = torch.empty(num_kv_heads, num_scored, dtype=torch.float32, device=key_cache.device)
    if num_scored == 0:
        return out
    queries = q_window.to(key_cache.dtype)
    m = w * (w + 1) // 2
    grid = (cdiv(num_scored, block_n), num_kv_heads)
    rc_scores_paged_kernel[grid](
        queries,
        *queries.stride(),
        key_cache,
        *key_cache.stride(),
        block_table.to(device=key_cache.device, dtype=torch.int32),
        y_sorted.reshape(-1, m).float().contiguous(),
        prefix.reshape(-1, m + 1).float().contiguous(),
        center.reshape(-1).float().contiguous(),
        out,
        out.stride(0),
        num_scored,
        m,
        **rc_table_launch(
            group, w, m, head_dim, block_size, block_n, key_cache.dtype, max_over_queries, max_over_heads
        ),
    )
    return out


def over_query_heads(per_head: Tensor, max_over_heads: bool) -> Tensor:
    """[Hkv, G, n] each query head's RC -> [Hkv, n]: the G query heads' mean, or their max (the references')."""
    return per_head.amax(dim=1) if max_over_heads else per_head.mean(dim=1)


def rc_table_launch(
    group: int,
    w: int,
    m: int,
    head_dim: int,
    block_size: int,
    block_n: int,
    dtype: torch.dtype,
    max_over_queries: bool,
    max_over_heads: bool = False,
) -> dict:
    """The launch arguments the RC table kernels share (the prompt's :func:`rc_table_scores_paged` and decode time's
    ``decode_scoring.rc_head_table_scores``): the score's norm and the compile-time constants."""
    return dict(
        # mean: over the W*m (x, y) pairs of Eq. 6, then over the G query heads; max: over the m self logits of each
        # query's best row, then over the G query heads (unless the kernel takes their max: no 1 / G).
        norm=(1.0 / m if max_over_queries else 1.0 / (w * m)) / (1 if max_over_heads else group),
        G=group,
        G_PAD=next_power_of_2(group),
        MAX_OVER_QUERIES=bool(max_over_queries),
        MAX_OVER_HEADS=bool(max_over_heads),
        W=w,
        **row_blocking(group * w),
        D=head_dim,
        D_PAD=next_power_of_2(head_dim),
        BLOCK_N=block_n,
        PAGE=block_size,
        IEEE=dtype == torch.float32,
        SEARCH_STEPS=max(1, m.bit_length()),  # 2**steps > m: every count 0..m is reachable
    )
