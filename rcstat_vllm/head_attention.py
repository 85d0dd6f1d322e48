"""Head-as-sequence attention: the plan shared by both backends, and its run on vLLM-CPU's kernels.

Each (request, KV head) is presented to vLLM's paged CPU attention as a sequence of its own, with one KV
head, its G query heads, its own page table (head pages, see :mod:`rcstat_vllm.head_pages`) and its own
length. Compressed and uncompressed requests mix freely in one batch: an uncompressed request's head h
simply uses the identity pages ``row[j] * H + h``. No new attention kernel is needed.

:func:`make_head_plan` does all per-step work once for every layer (index maps, page tables, lengths,
write slots); :func:`add_cpu_scheduler_metadata` adds the CPU kernel's work split. The per-layer calls only
index into it. The CUDA backend runs the same plan through FlashAttention (``rcstat_vllm/backend_cuda.py``).

The plan is built without reading the device back and without a Python loop over rows building tensors: the
host packs what it knows (query offsets, lengths, compressed rows' slots and positions) into one copy, and the
tables are assembled on the device, identity pages from vLLM's block table and compressed rows' pages from the
worker's resident tables (:mod:`rcstat_vllm.page_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm import envs

from rcstat_vllm.head_pages import CompactedRequest
from rcstat_vllm.page_space import PageSpace
from rcstat_vllm.page_tables import HeadPageTables, to_device
from rcstat_vllm.vllm_internals import custom_ops as ops


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
    identity pages are offset by its base page. The compressed requests' tables are read where they live, in the
    worker's :class:`~rcstat_vllm.page_tables.HeadPageTables` on the cache's device (committed here first): the
    host sends only per-row numbers, in one copy, and reads nothing back.
    """
    resident = resident_tables(compressed)
    if resident is not None:
        resident.commit()
    host = HostStepNumbers.of(query_start, seq_lens, compressed, resident, space)
    device = block_table.device
    numbers = host.on_device(device)
    token_index, head_index, query_start_loc = head_sequence_queries(numbers, space.num_heads, host.num_tokens)
    tables = identity_tables(numbers, block_table, space, host.width)
    lengths = numbers["seq_lens"].view(1, -1, 1).expand(space.num_layers, -1, space.num_heads).clone()
    slots = identity_slots(slot_mapping[: host.num_tokens], numbers["layer_base"], space)
    if resident is not None:
        add_compressed_rows(numbers, resident, tables, lengths, slots, space.block_size)
    num_layers = space.num_layers
    return HeadSequencePlan(
        token_index=token_index,
        head_index=head_index,
        query_start_loc=query_start_loc,
        block_tables=tables.reshape(num_layers, -1, host.width).to(torch.int32),
        seq_lens=lengths.reshape(num_layers, -1).to(torch.int32),
        slots=slots.reshape(num_layers, -1),
        num_heads=space.num_heads,
        max_query_len=host.max_query_len,
        max_seq_lens=host.max_seq_lens,
    )


def resident_tables(compressed: dict[int, CompactedRequest]) -> HeadPageTables | None:
    """The one :class:`HeadPageTables` holding every compressed row's page table (None without compressed rows)."""
    owners = {id(state.resident): state.resident for state in compressed.values()}
    if not owners:
        return None
    if len(owners) > 1 or None in owners.values():
        raise ValueError("rcstat: the compressed requests of a plan must all be attached to one HeadPageTables")
    return next(iter(owners.values()))


@dataclass
class HostStepNumbers:
    """What the host knows of a step, without reading the device: per row its query offsets and length, per
    compressed row and token its slot and position; and the plan's bounds (page-table width, longest sequences)."""

    #: name -> 1-D int64 host array, in the order they are packed for the device
    arrays: dict[str, np.ndarray]
    num_tokens: int
    width: int
    max_query_len: int
    max_seq_lens: list[int]

    @classmethod
    def of(cls, query_start, seq_lens, compressed, resident: HeadPageTables | None, space: PageSpace):
        starts = np.asarray(query_start, dtype=np.int64)
        lengths = np.asarray(seq_lens, dtype=np.int64)
        query_lens = np.diff(starts)
        rows = np.fromiter(sorted(compressed), dtype=np.int64, count=len(compressed))
        row_slots = np.fromiter((compressed[r].slot for r in rows.tolist()), dtype=np.int64, count=rows.size)
        plain = np.ones(lengths.size, dtype=bool)
        plain[rows] = False
        block_size = space.block_size
        width = max(
            int(((lengths[plain] + block_size - 1) // block_size).max(initial=1)),
            max((state.width for state in compressed.values()), default=1),
        )
        # Compressed rows' tokens (batch index, position, slot): spans of consecutive tokens, one per row.
        counts = query_lens[rows]
        first_token = np.repeat(starts[rows] - (np.cumsum(counts) - counts), counts)
        token_rows = np.arange(counts.sum(), dtype=np.int64) + first_token
        first_position = np.repeat(lengths[rows] - counts - starts[rows], counts)
        longest = np.full(space.num_layers, lengths[plain].max(initial=0), dtype=np.int64)
        if rows.size:
            longest_compressed = resident.longest_base[torch.from_numpy(row_slots)].numpy() + lengths[rows, None]
            longest = np.maximum(longest, longest_compressed.max(axis=0))
        arrays = {
            "query_start": starts,
            "seq_lens": lengths,
            "layer_base": np.asarray(space.layer_base, dtype=np.int64),
            "compressed_rows": rows,
            "compressed_slots": row_slots,
            "compressed_tokens": token_rows,
            "compressed_token_slots": np.repeat(row_slots, counts),
            "compressed_positions": token_rows + first_position,
        }
        return cls(arrays, int(starts[-1]), width, int(query_lens.max(initial=0)), longest.tolist())

    def on_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The arrays on ``device``, in one copy."""
        packed = torch.from_numpy(np.concatenate(list(self.arrays.values())))
        pieces = to_device(packed, device).split([a.size for a in self.arrays.values()])
        return dict(zip(self.arrays, pieces))


def head_sequence_queries(numbers, num_heads: int, num_tokens: int):
    """Every (row, head)'s queries, rows in order and heads within a row: the token and head index of each query
    row ``[T*H]`` and the head sequences' query offsets ``[R*H + 1]`` (int32)."""
    starts = numbers["query_start"]
    device = starts.device
    num_sequences = (starts.numel() - 1) * num_heads
    sequence_lens = (starts[1:] - starts[:-1]).repeat_interleave(num_heads, output_size=num_sequences)
    query_start_loc = torch.zeros(num_sequences + 1, dtype=torch.int64, device=device)
    torch.cumsum(sequence_lens, 0, out=query_start_loc[1:])
    total = num_tokens * num_heads
    sequence = torch.arange(num_sequences, device=device).repeat_interleave(sequence_lens, output_size=total)
    within = torch.arange(total, device=device) - query_start_loc[sequence]
    token_index = starts[sequence // num_heads] + within
    return token_index, sequence % num_heads, query_start_loc.to(torch.int32)


def identity_tables(numbers, block_table: torch.Tensor, space: PageSpace, width: int) -> torch.Tensor:
    """``[L, R, H, width]`` int64: every row's identity pages (``base_l + row[j] * H + h``) over its blocks, 0 past
    them, from vLLM's block table in one op (compressed rows are overwritten by :func:`add_compressed_rows`)."""
    seq_lens = numbers["seq_lens"]
    num_reqs, num_heads, block_size = seq_lens.numel(), space.num_heads, space.block_size
    blocks = block_table[:num_reqs, :width].to(torch.int64)
    if blocks.shape[1] < width:
        blocks = torch.nn.functional.pad(blocks, (0, width - blocks.shape[1]))
    heads = torch.arange(num_heads, device=blocks.device).view(1, 1, -1, 1)
    pages = blocks.view(1, num_reqs, 1, width) * num_heads + heads + numbers["layer_base"].view(-1, 1, 1, 1)
    in_row = torch.arange(width, device=blocks.device) < ((seq_lens + block_size - 1) // block_size).unsqueeze(1)
    return torch.where(in_row.view(1, num_reqs, 1, width), pages, 0)


def identity_slots(slot_mapping: torch.Tensor, layer_base: torch.Tensor, space: PageSpace) -> torch.Tensor:
    """``[L, T, H]`` head-page slots of uncompressed rows' tokens: vLLM's slot ``s = block * N + offset`` becomes
    ``(base_l + block * H + h) * N + offset``; padding (-1) stays -1."""
    num_heads, block_size = space.num_heads, space.block_size
    slots = slot_mapping.to(torch.int64)
    heads = torch.arange(num_heads, device=slots.device)
    local = ((slots // block_size).unsqueeze(1) * num_heads + heads) * block_size + (slots % block_size).unsqueeze(1)
    return torch.where(slots.view(1, -1, 1) < 0, -1, local + (layer_base * block_size).view(-1, 1, 1))


def add_compressed_rows(numbers, resident: HeadPageTables, tables, lengths, slots, block_size: int) -> None:
    """Overwrite the compressed rows' page tables ``[L, R, H, width]``, lengths ``[L, R, H]`` and write slots
    ``[L, T, H]`` with theirs, gathered on the device from the resident tables by slot."""
    rows, row_slots = numbers["compressed_rows"], numbers["compressed_slots"]
    base = resident.length_base.on_device
    tables[:, rows] = resident_page_tables(resident.pages.on_device, row_slots, tables.shape[3]).transpose(0, 1)
    lengths[:, rows] = (base[row_slots].to(torch.int64) + numbers["seq_lens"][rows].view(-1, 1, 1)).transpose(0, 1)
    token_slots = compressed_write_slots(
        resident, numbers["compressed_token_slots"], numbers["compressed_positions"], block_size
    )
    slots[:, numbers["compressed_tokens"]] = token_slots.transpose(0, 1)


def resident_page_tables(pages: torch.Tensor, row_slots: torch.Tensor, width: int) -> torch.Tensor:
    """``[Rc, L, H, width]`` int64: the slots' page tables cut or zero-padded to the plan's width (no page: 0, a page
    the kernels may name but never read past a head's length)."""
    gathered = torch.zeros((row_slots.numel(), *pages.shape[1:3], width), dtype=torch.int64, device=pages.device)
    shared = min(width, pages.shape[3])
    gathered[..., :shared] = pages[row_slots, :, :, :shared].clamp(min=0)
    return gathered


def compressed_write_slots(resident: HeadPageTables, token_slots, positions, block_size: int) -> torch.Tensor:
    """``[Tc, L, H]`` head-page slots of compressed rows' tokens: the token at position p of a head with length base
    b is entry ``b + p`` of its page list."""
    pages, base = resident.pages.on_device, resident.length_base.on_device
    index = base[token_slots].to(torch.int64) + positions.view(-1, 1, 1)
    layers = torch.arange(base.shape[1], device=index.device).view(1, -1, 1)
    heads = torch.arange(base.shape[2], device=index.device).view(1, 1, -1)
    token_pages = pages[token_slots.view(-1, 1, 1), layers, heads, index // block_size].to(torch.int64)
    return token_pages * block_size + index % block_size


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
