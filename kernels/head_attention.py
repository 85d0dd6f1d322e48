"""Decode attention over head pages, for the GPU path: a Triton kernel and its torch reference.

After compaction every (request, layer, KV head) owns its own list of *head pages* (``rcstat_vllm/head_pages.py``):
page ``p = block * H + h`` is KV head ``h``'s slice of vLLM block ``block``. On CPU the plugin runs vLLM's own
kernels over a head-page view of the cache, and the CUDA backend does the same with FlashAttention over
head-major blocks (vLLM's ``LBHNC`` layout). This kernel is the dedicated alternative: it reads head pages
through any strides of FlashAttention's ``[num_blocks, N, H, D]`` key/value views (token-major ``LBNHC``
blocks included, where no head-page view exists), given each (request, head)'s page table and length.

One decode token per request (``query [R, H, G, D]``: G query heads per KV head); the kernel runs one program
per (request, KV head) with an online softmax over ``BLOCK_N``-token tiles of that head's pages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import next_power_of_2

__all__ = ["head_page_decode_attention", "head_page_decode_attention_reference", "gather_head_pages"]


def _check(query: Tensor, key_cache: Tensor, value_cache: Tensor, page_tables: Tensor, lengths: Tensor) -> None:
    if query.dim() != 4 or key_cache.dim() != 4 or page_tables.dim() != 3 or lengths.dim() != 2:
        raise ValueError(
            "expected query [R, H, G, D], caches [num_blocks, N, H, D], page_tables [R, H, P], lengths [R, H]; "
            f"got {tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(page_tables.shape)}, {tuple(lengths.shape)}"
        )
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have the same shape and strides (the kernel shares them)")
    num_reqs, num_heads, _, head_dim = query.shape
    if key_cache.shape[2] != num_heads or key_cache.shape[3] != head_dim:
        raise ValueError(f"cache heads/dim {tuple(key_cache.shape[2:])} do not match the query's {(num_heads, head_dim)}")
    if page_tables.shape[:2] != (num_reqs, num_heads) or lengths.shape != (num_reqs, num_heads):
        raise ValueError("page_tables and lengths must be [R, H, ...] like the query")
    if int(lengths.max()) > page_tables.shape[2] * key_cache.shape[1]:
        raise ValueError("a head is longer than its page table can address")


def gather_head_pages(cache: Tensor, pages: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of one head's page list: ``[length, D]``."""
    block_size, num_heads = cache.shape[1], cache.shape[2]
    tokens = torch.arange(length, device=cache.device)
    page = pages.to(device=cache.device, dtype=torch.long)[tokens // block_size]
    return cache[page // num_heads, tokens % block_size, page % num_heads]


def head_page_decode_attention_reference(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, page_tables: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """Torch reference: gather each (request, head)'s tokens, softmax(q k^T * scale) v in float32."""
    _check(query, key_cache, value_cache, page_tables, lengths)
    out = torch.empty_like(query)
    for r in range(query.shape[0]):
        for h in range(query.shape[1]):
            n = int(lengths[r, h])
            keys = gather_head_pages(key_cache, page_tables[r, h], n).float()
            values = gather_head_pages(value_cache, page_tables[r, h], n).float()
            weights = torch.softmax(query[r, h].float() @ keys.T * scale, dim=-1)
            out[r, h] = (weights @ values).to(query.dtype)
    return out


def head_page_decode_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, page_tables: Tensor, lengths: Tensor, scale: float,
    block_n: int = 32,
) -> Tensor:
    """Triton kernel (GPU, or CPU under ``TRITON_INTERPRET=1``); same contract as the reference.

    Every head must hold at least one token (decode always has the new one).
    """
    from ._head_attention_triton import head_page_decode_kernel

    _check(query, key_cache, value_cache, page_tables, lengths)
    num_reqs, num_heads, group, head_dim = query.shape
    out = torch.empty_like(query)
    lengths = lengths.to(device=query.device, dtype=torch.int32)
    page_tables = page_tables.to(device=query.device, dtype=torch.int32)
    head_page_decode_kernel[(num_reqs, num_heads)](
        query, *query.stride(),
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        page_tables, *page_tables.stride(),
        lengths, *lengths.stride(),
        out, *out.stride(),
        scale,
        H=num_heads, G=group, G_PAD=next_power_of_2(group, minimum=2), D=head_dim,
        D_PAD=next_power_of_2(head_dim, minimum=16), PAGE=key_cache.shape[1],
        BLOCK_N=next_power_of_2(block_n),
    )
    return out
