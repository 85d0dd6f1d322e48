"""Head-as-sequence attention in vLLM's GPU cache layout (the CUDA backend's path), with torch reference kernels.

The plan is the CPU path's (:func:`rcstat_vllm.attention.head_plan.make_head_plan`): every compressed (request, KV head)
is a sequence of its own with one KV head, its G query heads, its page table and its length. On the GPU the pages
are FlashAttention's paged cache shape, ``[num_blocks * H, N, 1, D]`` (:func:`flash_head_page_caches`, a view
of head-major blocks), so vLLM's own cache-write and varlen attention kernels run it unchanged
(``rcstat_vllm/attention/cuda_backend.py`` binds them). :class:`TorchHeadPageKernels` is the same contract in plain
torch: the reference the tests check the path against on CPU tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rcstat_vllm.attention.head_plan import HeadSequencePlan, HeadSequences
from rcstat_vllm.paging.kv_layout import flash_head_page_caches


class HeadPageKernels:
    """The two kernels head-as-sequence needs over head-page caches ``[num_pages, N, 1, D]``."""

    def write(self, keys: Tensor, values: Tensor, key_pages: Tensor, value_pages: Tensor, slots: Tensor, layer) -> None:
        """Store ``keys``/``values`` ``[S, 1, D]`` at head-page slots ``page * N + offset`` (-1: skip)."""
        raise NotImplementedError

    def attend(
        self,
        queries: Tensor,
        key_pages: Tensor,
        value_pages: Tensor,
        out: Tensor,
        plan: HeadSequences,
        layer_index: int,
        *,
        scale: float,
        softcap: float,
        layer,
    ) -> None:
        """Causal paged attention: ``queries``/``out`` ``[S_q, G, D]``, sequences per ``plan`` (one KV head)."""
        raise NotImplementedError


class TorchHeadPageKernels(HeadPageKernels):
    """Plain-torch reference (any device): gathers each head sequence's pages, float32 softmax."""

    def write(self, keys, values, key_pages, value_pages, slots, layer=None):
        valid = slots >= 0
        slots = slots[valid]
        block_size = key_pages.shape[1]
        key_pages[slots // block_size, slots % block_size] = keys[valid].to(key_pages.dtype)
        value_pages[slots // block_size, slots % block_size] = values[valid].to(value_pages.dtype)

    def attend(self, queries, key_pages, value_pages, out, plan, layer_index, *, scale, softcap=0.0, layer=None):
        block_size = key_pages.shape[1]
        starts = plan.query_start_loc.tolist()
        lengths = plan.seq_lens[layer_index].tolist()
        tables = plan.block_tables[layer_index]
        for seq, length in enumerate(lengths):
            q = queries[starts[seq] : starts[seq + 1]].float()  # [q, G, D]
            if q.shape[0] == 0:
                continue
            tokens = torch.arange(length, device=queries.device)
            pages = tables[seq, tokens // block_size].long()
            keys = key_pages[pages, tokens % block_size, 0].float()  # [length, D]
            values = value_pages[pages, tokens % block_size, 0].float()
            logits = torch.einsum("qgd,kd->gqk", q, keys) * scale
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            # Bottom-right causal alignment: the last query sees all `length` keys.
            positions = length - q.shape[0] + torch.arange(q.shape[0], device=queries.device)
            logits = logits.masked_fill(tokens.view(1, 1, -1) > positions.view(1, -1, 1), float("-inf"))
            out[starts[seq] : starts[seq + 1]] = torch.einsum("gqk,kd->qgd", logits.softmax(-1), values).to(out.dtype)


def flash_head_sequence_forward(
    kernels: HeadPageKernels,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    kv_cache: Tensor,
    output: Tensor,
    plan: HeadSequencePlan,
    layer_index: int,
    *,
    scale: float,
    softcap: float = 0.0,
    layer=None,
) -> None:
    """Write the compressed rows' K/V of this step into head pages and attend head-as-sequence, for one layer.

    Args:
        query, output: ``[T, H*G, D]`` (the step's actual tokens; the compressed rows' tokens of ``output`` are
            written); key, value: ``[T, H, D]`` or None (no write).
        kv_cache: the cache the plan's page ids index (the layer's, or all layers' when pages are pooled),
            logical ``[num_blocks, H, N, 2D]`` in head-major blocks (LBHNC).
    """
    key_pages, value_pages = flash_head_page_caches(kv_cache)
    num_tokens, num_query_heads, head_dim = query.shape
    num_heads = plan.num_heads
    if key is not None and value is not None:
        keys, values = key[plan.write_tokens], value[plan.write_tokens]
        num_written = keys.shape[0]
        kernels.write(
            keys.reshape(num_written * num_heads, 1, head_dim),
            values.reshape(num_written * num_heads, 1, -1),
            key_pages,
            value_pages,
            plan.slots[layer_index],
            layer,
        )
    by_head = (num_tokens, num_heads, num_query_heads // num_heads, head_dim)
    head_queries = query.view(by_head)[plan.token_index, plan.head_index]  # [T*H, G, D]
    head_output = torch.empty_like(head_queries)
    kernels.attend(
        head_queries, key_pages, value_pages, head_output, plan, layer_index, scale=scale, softcap=softcap, layer=layer
    )
    output.view(by_head)[plan.token_index, plan.head_index] = head_output
