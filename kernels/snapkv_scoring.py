"""Paged SnapKV attention (Triton, two passes) with its torch reference.

What SnapKV scores a non-window token by, before pooling: the causal softmax attention of the w window queries
over the prompt, averaged over the window queries and the G query heads of each KV head. The pooling along tokens
(and the scorer around it) is :class:`rcstat_vllm.scoring.methods.snapkv.SnapKVScorer`'s; this module holds only
what reads the key cache, so it imports nothing from scoring.

The softmax needs each window query's normaliser over *all* n keys before any weight is known, so the
kernel is two passes over the keys, like attention without values:
1. per tile, each query's log-sum-exp over the tile's non-window tokens (written, [Hkv, tiles, G*w]);
   torch merges the tiles with the window part (w x w causal logits, tiny) into one log-sum-exp per query;
2. per tile, exp(logit - lse) summed over the G*w queries, written per token.
The [G*w, n] weights never hit memory; the price is reading the keys twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import cdiv, check_paged_inputs, gather_paged_tokens, next_power_of_2, row_blocking

__all__ = ["snapkv_attention_paged", "snapkv_attention_paged_reference", "window_attention"]


def window_attention(queries: Tensor, keys: Tensor, scale: float, key_padding: Tensor | None = None) -> Tensor:
    """Causal softmax attention of the w window queries over all n keys, float32 (dense; the scorer's torch path).

    Args:
        queries: [Hkv, G, w, d], the queries of positions n-w..n-1; keys: [Hkv, n, d].
        key_padding: [Hkv, n] bool, keys no query sees (a head's padding when heads hold different numbers of
            entries, right-aligned): attention 0.
    Returns:
        [Hkv, G, w, n]: window query j (absolute position n-w+j) sees keys 0..n-w+j.
    """
    w, n = queries.shape[2], keys.shape[1]
    logits = torch.einsum("hgjd,hnd->hgjn", queries.float(), keys.float()) * scale
    # Key i is in query j's future when i > n - w + j.
    hidden = torch.ones(w, n, dtype=torch.bool, device=keys.device).triu(diagonal=n - w + 1)
    if key_padding is not None:
        hidden = hidden | key_padding[:, None, None, :]
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)


def snapkv_attention_paged_reference(
    q_window: Tensor, key_cache: Tensor, block_table: Tensor, num_tokens: int, scale: float
) -> Tensor:
    """Torch reference: gather the keys via the block table, :func:`window_attention`, the mean over the window
    queries and the G query heads. Returns float32 [Hkv, n - w]."""
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    keys = gather_paged_tokens(key_cache, block_table, 0, num_tokens)
    queries = q_window.reshape(keys.shape[0], group, w, -1)
    return window_attention(queries, keys, scale)[..., : num_tokens - w].mean(dim=(1, 2))


def snapkv_attention_paged(
    q_window: Tensor,
    key_cache: Tensor,
    block_table: Tensor,
    num_tokens: int,
    scale: float,
    block_n: int = 32,
) -> Tensor:
    """Triton version of :func:`snapkv_attention_paged_reference` (same arguments): float32 [Hkv, n - w]."""
    group, w = check_paged_inputs(q_window, key_cache, block_table, num_tokens)
    from ._snapkv_triton import snapkv_mean_attention_kernel, snapkv_partial_logsumexp_kernel

    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    num_scored = num_tokens - w
    if num_scored == 0:
        return torch.empty(num_kv_heads, 0, dtype=torch.float32, device=key_cache.device)
    blocking = row_blocking(group * w)
    rows = blocking["ROW_BLOCK"] * blocking["NUM_ROW_BLOCKS"]  # padded; padded rows are masked in pass 2
    queries = q_window.to(key_cache.dtype)
    table = block_table.to(device=key_cache.device, dtype=torch.int32)
    num_tiles = cdiv(num_scored, block_n)
    meta = dict(
        G=group,
        W=w,
        **blocking,
        D=head_dim,
        D_PAD=next_power_of_2(head_dim),
        BLOCK_N=block_n,
        PAGE=block_size,
        IEEE=key_cache.dtype == torch.float32,
    )
    common = (queries, *queries.stride(), key_cache, *key_cache.stride(), table)

    partial = torch.empty(num_kv_heads, num_tiles, rows, dtype=torch.float32, device=key_cache.device)
    snapkv_partial_logsumexp_kernel[(num_tiles, num_kv_heads)](*common, partial, num_scored, num_tiles, scale, **meta)

    # Window part of each query's normaliser: query j (position n-w+j) sees window keys 0..j.
    window_keys = gather_paged_tokens(key_cache, block_table, num_scored, num_tokens).float()
    grouped = queries.float().reshape(num_kv_heads, group * w, head_dim)
    window_logits = torch.matmul(grouped, window_keys.transpose(1, 2)) * scale  # [Hkv, G*w, w]
    future = torch.ones(w, w, dtype=torch.bool, device=key_cache.device).triu(diagonal=1).repeat(group, 1)
    window_lse = torch.logsumexp(window_logits.masked_fill(future, float("-inf")), dim=-1)  # [Hkv, G*w]
    lse = torch.logsumexp(torch.cat([partial[..., : group * w], window_lse.unsqueeze(1)], dim=1), dim=1)
    lse = torch.nn.functional.pad(lse, (0, rows - group * w)).contiguous()  # padded rows are masked anyway

    mean_attention = torch.empty(num_kv_heads, num_scored, dtype=torch.float32, device=key_cache.device)
    snapkv_mean_attention_kernel[(num_tiles, num_kv_heads)](
        *common, lse, mean_attention, mean_attention.stride(0), num_scored, scale, **meta
    )
    return mean_attention
