"""The in-page layout of vLLM-CPU's KV cache, which compaction reads and writes directly.

``ops.cpu_attn_reshape_and_cache`` decides how a block stores K and V; that layout is private and differs
by ISA (AMX prepacks). :func:`layout_matches` writes known vectors through vLLM's own op and reads them back
through :mod:`rcstat_vllm.paging.head_pages`: compression is enabled only when they agree, so a vLLM that changes
the layout turns compression off with a logged reason instead of corrupting caches. The ops' contracts are in
:mod:`rcstat_vllm.vllm_private.internals`.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def layout_matches(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """True when vLLM's cache writes land where kv_layout.read_kv expects them."""
    from rcstat_vllm.paging.kv_layout import head_page_caches, read_kv
    from rcstat_vllm.vllm_private.internals import custom_ops as ops

    num_blocks, num_heads = 2, 2
    kv_cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_dim, dtype=dtype)
    key_pages, value_pages = head_page_caches(kv_cache)
    num_pages = num_blocks * num_heads
    slots = torch.tensor([0, block_size - 1, block_size + 1, num_pages * block_size - 2])
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(len(slots), 1, head_dim, generator=generator).to(dtype)
    values = torch.randn(len(slots), 1, head_dim, generator=generator).to(dtype)
    try:
        ops.cpu_attn_reshape_and_cache(keys, values, key_pages, value_pages, slots, isa)
    except Exception:  # noqa: BLE001 - an ISA this build cannot run
        return False
    got_keys, got_values = read_kv(kv_cache, slots // block_size, slots % block_size)
    return torch.equal(got_keys, keys[:, 0]) and torch.equal(got_values, values[:, 0])
