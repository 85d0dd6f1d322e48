"""Head-as-sequence attention: the plan shared by both backends, and its run on vLLM-CPU's kernels.

Each (request, KV head) is presented to vLLM's paged CPU attention as a sequence of its own, with one KV
head, its G query heads, its own page table (head pages, see :mod:`rcstat_vllm.head_pages`) and its own
length. Compressed and uncompressed requests mix freely in one batch: an uncompressed request's head h
simply uses the identity pages ``row[j] * H + h``. No new attention kernel is needed.

:func:`make_head_plan` does all per-step work once for every layer (index maps, page tables, lengths,
write slots); :func:`add_cpu_scheduler_metadata` adds the CPU kernel's work split. The per-layer calls only
index into it. The CUDA backend runs the same plan through FlashAttention (``rcstat_vllm/backend_cuda.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs

from rcstat_vllm.head_pages import CompactedRequest, cdiv
from rcstat_vllm.page_space import PageSpace, identity_pages


@dataclass
class HeadSequencePlan:
    #: [T*H] token and KV-head index of each head-sequence query row
    token_index: torch.Tensor
    head_index: torch.Tensor
    #: [R*H + 1] int32 query offsets of the head sequences
    query_start_loc: torch.Tensor
    #: [L, R*H, P] int32 page tables, [L, R*H] int32 lengths, [L, T*H] int64 write slots (-1 = padding)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    #: longest query of a head sequence; per layer, longest head sequence (FlashAttention's bounds)
    max_query_len: int = 0
    max_seq_lens: list[int] | None = None
    #: per layer, the CPU kernel's work split for these lengths (add_cpu_scheduler_metadata)
    scheduler_metadata: list[torch.Tensor] | None = None


def make_head_plan(
    query_start: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    compressed: dict[int, CompactedRequest],
    space: PageSpace,
) -> HeadSequencePlan:
    """Plan one step: rows in ``compressed`` read and write their own head pages, the others the identity.

    Page ids are those of ``space``: with pooled pages every layer reads the all-layers view, so layer l's
    identity pages are offset by its base page.
    """
    num_layers, num_heads, block_size = space.num_layers, space.num_heads, space.block_size
    num_reqs = len(seq_lens)
    num_tokens = query_start[-1]
    device = block_table.device
    query_lens = [query_start[r + 1] - query_start[r] for r in range(num_reqs)]

    token_index, head_index, starts = [], [], [0]
    for row in range(num_reqs):
        tokens = torch.arange(query_start[row], query_start[row + 1], device=device)
        for head in range(num_heads):
            token_index.append(tokens)
            head_index.append(torch.full_like(tokens, head))
            starts.append(starts[-1] + query_lens[row])

    width = max(
        [cdiv(seq_lens[r], block_size) for r in range(num_reqs) if r not in compressed]
        + [state.tables.shape[2] for state in compressed.values()]
        + [1]
    )
    tables = torch.zeros((num_layers, num_reqs, num_heads, width), dtype=torch.int64, device=device)
    # Lengths are assembled on the host (from host-side numbers) and copied once: no device sync for the maxima.
    lengths = torch.zeros((num_layers, num_reqs, num_heads), dtype=torch.int64)
    # Uncompressed rows: vLLM's slot s = block * N + offset becomes (base_l + block * H + h) * N + offset.
    slots = slot_mapping[:num_tokens].to(torch.int64)
    heads = torch.arange(num_heads, device=device)
    local = ((slots // block_size).unsqueeze(1) * num_heads + heads) * block_size + (slots % block_size).unsqueeze(1)
    bases = torch.tensor(space.layer_base, dtype=torch.int64, device=device)
    head_slots = torch.where(slots.view(1, -1, 1) < 0, -1, local + (bases * block_size).view(-1, 1, 1))  # [L, T, H]
    for row in range(num_reqs):
        state = compressed.get(row)
        if state is None:
            n_blocks = cdiv(seq_lens[row], block_size)
            tables[:, row, :, :n_blocks] = identity_pages(block_table[row, :n_blocks], num_heads) + bases.view(-1, 1, 1)
            lengths[:, row] = seq_lens[row]
            continue
        tables[:, row, :, : state.tables.shape[2]] = state.tables.clamp(min=0)
        lengths[:, row] = state.lengths(seq_lens[row])
        start, end = query_start[row], query_start[row + 1]
        # The request's bookkeeping lives on the host (see CompactedRequest); its slots are copied over.
        positions = torch.arange(seq_lens[row] - query_lens[row], seq_lens[row])
        head_slots[:, start:end] = state.slots(positions)
    lengths = lengths.reshape(num_layers, -1)
    seq_lens_hs = lengths.to(device=device, dtype=torch.int32)
    return HeadSequencePlan(
        token_index=torch.cat(token_index) if token_index else torch.zeros(0, dtype=torch.int64),
        head_index=torch.cat(head_index) if head_index else torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        block_tables=tables.reshape(num_layers, num_reqs * num_heads, width).to(torch.int32),
        seq_lens=seq_lens_hs,
        slots=head_slots.reshape(num_layers, -1),
        num_heads=num_heads,
        max_query_len=max(query_lens, default=0),
        max_seq_lens=lengths.amax(dim=1).tolist(),
    )


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
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        )
        for layer in range(plan.seq_lens.shape[0])
    ]


def write_head_sequence_kv(key, value, key_pages, value_pages, plan: HeadSequencePlan, layer: int, isa: str, **scales):
    """Write this step's K/V ``[T, H, D]`` of one layer into the head pages."""
    num_tokens, num_heads, head_dim = key.shape
    ops.cpu_attn_reshape_and_cache(
        key.reshape(num_tokens * num_heads, 1, head_dim),
        value.reshape(num_tokens * num_heads, 1, -1),
        key_pages,
        value_pages,
        plan.slots[layer],
        isa,
        **scales,
    )


def head_sequence_attention(
    query, key_pages, value_pages, output, plan: HeadSequencePlan, layer: int, *, scale, isa,
    softcap=0.0, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
):
    """Causal paged attention of one layer with each (request, KV head) as its own sequence.

    Args:
        query: [T, H*G, D]; output: [T, H*G, D] written in place.
        key_pages, value_pages: head-page caches [num_blocks * H, 1, N, D] (``head_page_caches``).
    """
    num_tokens, num_query_heads, head_dim = query.shape
    by_head = (num_tokens, plan.num_heads, num_query_heads // plan.num_heads, head_dim)
    head_queries = query.view(by_head)[plan.token_index, plan.head_index]  # [T*H, G, D]
    head_output = torch.empty_like(head_queries)
    ops.cpu_attention_with_kv_cache(
        query=head_queries,
        key_cache=key_pages,
        value_cache=value_pages,
        output=head_output,
        query_start_loc=plan.query_start_loc,
        seq_lens=plan.seq_lens[layer],
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=plan.block_tables[layer],
        softcap=softcap,
        scheduler_metadata=plan.scheduler_metadata[layer],
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    output.view(by_head)[plan.token_index, plan.head_index] = head_output
