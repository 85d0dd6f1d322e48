"""Head-as-sequence attention's step plan, shared by both backends (the CPU run:
:mod:`rcstat_vllm.attention.cpu_head_attention`; the CUDA run: :mod:`rcstat_vllm.attention.flash_head_attention`).

A batch mixing compressed and uncompressed requests runs in two parts. The uncompressed rows are a sub-batch
vLLM's own backend runs unchanged (:func:`plain_rows`: their tokens and a ``CommonAttentionMetadata`` of their
rows, from which the backend's own builder makes its metadata). The compressed rows run *head-as-sequence*: each
(request, KV head) is a sequence of its own with one KV head, its G query heads, its own page table (head pages,
see :mod:`rcstat_vllm.paging.head_pages`) and its own length, through vLLM's paged attention kernels. No new attention
kernel is needed.

The head sequences are the slots of the worker's resident page tables (:mod:`rcstat_vllm.paging.page_tables`), in
(slot, head) order: sequence ``s * H + h`` reads row ``s * H + h`` of layer l's table ``[S * H, P]``, which *is*
the resident tensor, viewed, not copied. A slot whose request is not in this batch (or a free slot) is a sequence
of no queries and length 0: the kernels skip it. So a step's plan holds only per-slot numbers (lengths
``[L, S * H]``) and per-token numbers of the compressed rows (their query rows and write slots): its memory and
time follow the compressed rows' tokens and the slots, never batch x layers x heads x widest row.

:func:`make_head_plan` does all per-step work once for every layer;
:func:`~rcstat_vllm.attention.cpu_head_attention.add_cpu_scheduler_metadata` adds the CPU kernel's work split. The
per-layer calls only index into it. The CUDA backend runs the same plan through FlashAttention
(``rcstat_vllm/attention/cuda_backend.py``). The host packs what it knows (query counts, lengths, slots, positions) into
one copy; nothing is read back from the device.

Step-plan memory, per step (``S`` resident slots, ``Tc`` compressed rows' tokens, ``L`` layers, ``H`` KV heads):
``4 * L * S * H`` bytes of lengths, ``8 * L * Tc * H`` of write slots, ``16 * Tc * H`` of query indices, plus the
plain rows' sub-batch (their rows of vLLM's block table, cut to the longest plain row). At Llama-3.1-8B shapes
(32 layers, 8 KV heads) and 256 decoding requests, half compressed: under 5 MB (``benchmarks/planner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.page_space import PageSpace
from rcstat_vllm.paging.page_tables import HeadPageTables, to_device


class HeadSequences(Protocol):
    """What the head-page attention kernels read of a plan (``HeadPageKernels.attend``): a step's
    :class:`HeadSequencePlan`, or a full-decode-graph step's ``DecodeGraphPlan`` over persistent buffers."""

    #: [sequences + 1] int32 query offsets; the most queries of one sequence
    query_start_loc: torch.Tensor
    max_query_len: int
    #: per layer: [L, sequences, P] int32 head-page tables, [L, sequences] int32 lengths and their bound
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_lens: list[int] | None


@dataclass
class HeadSequencePlan:
    """One step's head-as-sequence attention of the compressed rows; sequences are the resident slots' heads."""

    #: [Tc*H] batch token and KV-head index of each head-sequence query row, in sequence order
    token_index: torch.Tensor
    head_index: torch.Tensor
    #: [S*H + 1] int32 query offsets of the head sequences (slots not in the batch: no queries)
    query_start_loc: torch.Tensor
    #: [L, S*H, P] int32 page tables (a view of the resident tables), [L, S*H] int32 lengths (0: not in the batch)
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    #: [Tc] batch index of the compressed rows' tokens; [L, Tc*H] int64 their (token, head) write slots
    write_tokens: torch.Tensor
    slots: torch.Tensor
    num_heads: int
    #: longest query of a head sequence; per layer, longest head sequence (FlashAttention's bounds)
    max_query_len: int = 0
    max_seq_lens: list[int] | None = None
    #: per layer, the CPU kernel's work split for these lengths (add_cpu_scheduler_metadata)
    scheduler_metadata: list[torch.Tensor] | None = None
    #: per KV head, its sequences' query rows and offsets (models with attention sinks run one call per KV head;
    #: computed at the first such layer, ``cpu_head_attention.kv_head_subsets``)
    kv_head_subsets: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class PlainRows:
    """The batch's uncompressed rows, as a sub-batch for vLLM's own kernels."""

    #: [Tp] their tokens' batch indices (on the device)
    token_index: torch.Tensor
    #: vLLM's CommonAttentionMetadata of these rows; the backend replaces it by its own metadata built from it
    metadata: object


def make_head_plan(
    query_start: list[int],
    seq_lens: list[int],
    compressed: dict[int, CompactedRequest],
    space: PageSpace,
    device: torch.device,
) -> HeadSequencePlan:
    """Plan one step of the compressed rows (``compressed``: batch row -> its state, not empty).

    Their page tables are read where they live, in the worker's :class:`~rcstat_vllm.paging.page_tables.HeadPageTables`
    on the cache's device (committed here first): the host sends only per-slot and per-token numbers, in one copy.
    """
    resident = resident_tables(compressed)
    resident.commit()
    host = HostStepNumbers.of(query_start, seq_lens, compressed, resident, space)
    numbers = host.on_device(device)
    num_layers, num_heads = space.num_layers, space.num_heads
    present = numbers["slot_lengths"] > 0
    lengths = torch.where(
        present.view(1, -1, 1), resident.length_base.on_device + numbers["slot_lengths"].view(1, -1, 1).int(), 0
    )
    return HeadSequencePlan(
        token_index=numbers["query_tokens"],
        head_index=numbers["query_heads"],
        query_start_loc=numbers["query_start_loc"].to(torch.int32),
        block_tables=resident.pages.on_device.view(num_layers, -1, resident.width),
        seq_lens=lengths.view(num_layers, -1).to(torch.int32),
        write_tokens=numbers["write_tokens"],
        slots=compressed_write_slots(
            resident, numbers["write_token_slots"], numbers["write_positions"], space.block_size
        ).view(num_layers, -1),
        num_heads=num_heads,
        max_query_len=host.max_query_len,
        max_seq_lens=host.max_seq_lens,
    )


def resident_tables(compressed: dict[int, CompactedRequest]) -> HeadPageTables:
    """The one :class:`HeadPageTables` holding every compressed row's page table."""
    owners = {id(owner): owner for owner in (getattr(state.table, "owner", None) for state in compressed.values())}
    if len(owners) != 1 or None in owners.values():
        raise ValueError("rcstat: the compressed requests of a plan must all be attached to one HeadPageTables")
    return next(iter(owners.values()))  # type: ignore[return-value]  # (None refused above)


@dataclass
class HostStepNumbers:
    """What the host knows of a step's compressed rows, without reading the device: per slot its query count and
    length, per query row of a head sequence its token and head, per token its write slot and position; and the
    plan's bounds."""

    #: name -> 1-D int64 host array, in the order they are packed for the device
    arrays: dict[str, np.ndarray]
    max_query_len: int
    max_seq_lens: list[int]

    @classmethod
    def of(cls, query_start, seq_lens, compressed, resident: HeadPageTables, space: PageSpace):
        starts = np.asarray(query_start, dtype=np.int64)
        lengths = np.asarray(seq_lens, dtype=np.int64)
        num_heads, num_slots = space.num_heads, resident.num_slots
        rows = np.fromiter(sorted(compressed), dtype=np.int64, count=len(compressed))
        row_slots = np.fromiter((compressed[r].table.slot for r in rows.tolist()), dtype=np.int64, count=rows.size)
        counts = starts[rows + 1] - starts[rows]
        # Per slot: this step's queries and tokens after the step (0 for slots whose request is not in the batch).
        slot_queries = np.zeros(num_slots, dtype=np.int64)
        slot_queries[row_slots] = counts
        slot_lengths = np.zeros(num_slots, dtype=np.int64)
        slot_lengths[row_slots] = lengths[rows]
        query_start_loc = np.zeros(num_slots * num_heads + 1, dtype=np.int64)
        np.cumsum(np.repeat(slot_queries, num_heads), out=query_start_loc[1:])
        # Query rows in sequence order: slots ascending, then heads, then the row's tokens.
        by_slot = np.argsort(row_slots, kind="stable")
        sequence_counts = np.repeat(counts[by_slot], num_heads)
        sequence_first = np.repeat(starts[rows[by_slot]], num_heads)
        within = np.arange(sequence_counts.sum(), dtype=np.int64) - np.repeat(
            np.cumsum(sequence_counts) - sequence_counts, sequence_counts
        )
        query_tokens = np.repeat(sequence_first, sequence_counts) + within
        query_heads = np.repeat(np.tile(np.arange(num_heads, dtype=np.int64), rows.size), sequence_counts)
        # Tokens to write, in batch order (batch index, resident slot, position).
        write_tokens = (
            np.repeat(starts[rows], counts)
            + np.arange(counts.sum(), dtype=np.int64)
            - np.repeat(np.cumsum(counts) - counts, counts)
        )
        first_position = np.repeat(lengths[rows] - counts - starts[rows], counts)
        longest = np.zeros(space.num_layers, dtype=np.int64)
        if rows.size:
            longest = (resident.longest_base[torch.from_numpy(row_slots)].numpy() + lengths[rows, None]).max(axis=0)
        arrays = {
            "slot_lengths": slot_lengths,
            "query_start_loc": query_start_loc,
            "query_tokens": query_tokens,
            "query_heads": query_heads,
            "write_tokens": write_tokens,
            "write_token_slots": np.repeat(row_slots, counts),
            "write_positions": write_tokens + first_position,
        }
        return cls(arrays, int(counts.max(initial=0)), longest.tolist())

    def on_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The arrays on ``device``, in one copy."""
        packed = torch.from_numpy(np.concatenate(list(self.arrays.values())))
        pieces = to_device(packed, device).split([a.size for a in self.arrays.values()])
        return dict(zip(self.arrays, pieces))


def compressed_write_slots(resident: HeadPageTables, token_slots, positions, block_size: int) -> torch.Tensor:
    """``[L, Tc, H]`` head-page slots of compressed rows' tokens: the token at position p of a head with length base
    b is entry ``b + p`` of its page list.

    Each token's page is gathered from the page lists (``[L, S, H, P]`` is contiguous: one flat index), a read of
    ``L * Tc * H`` scattered entries of the largest table; a head's last page is not always the one it writes
    (``reserve`` hands every head its page of a block at the block's first step). Few ops, int32 where it
    suffices: on the CPU this runs on the step's critical path."""
    pages, base = resident.pages.on_device, resident.length_base.on_device  # [L, S, H, P], [L, S, H]
    num_layers, num_slots, num_heads, width = pages.shape
    index = base.index_select(1, token_slots) + positions.view(1, -1, 1).to(base.dtype)  # [L, Tc, H]
    column = torch.div(index, block_size, rounding_mode="floor")
    # Flat offset of (layer, slot, head, column) in [L, S, H, P]: ((l * S + s) * H + h) * P + column.
    layers = torch.arange(num_layers, device=base.device).view(-1, 1, 1) * (num_slots * num_heads * width)
    heads = torch.arange(num_heads, device=base.device).view(1, 1, -1) * width
    flat = layers + heads + (token_slots * (num_heads * width)).view(1, -1, 1) + column
    token_pages = pages.view(-1).take(flat)
    return token_pages.to(torch.int64) * block_size + (index - column * block_size)


#: ``CommonAttentionMetadata`` fields of features the plugin turns off or never meets on the rows it splits (decode
#: context parallelism, encoder / cross attention, fast prefill under KV sharing, chunked local attention): the
#: plain rows' metadata leaves them unset
UNSPLIT_FIELDS = (
    "logits_indices_padded",
    "num_logits_indices",
    "max_logits_per_req",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound",
    "rswa_prefix_lens",
)


def plain_rows(common_attn_metadata, compressed_rows, query_start: list[int], seq_lens: list[int], block_size: int):
    """The uncompressed rows of a batch holding compressed ones, as vLLM's ``CommonAttentionMetadata`` of their own
    (their rows of the block table cut to the longest of them, their slots, offsets and lengths); None if every row
    is compressed. vLLM's own builder turns it into its metadata, and its impl runs them unchanged."""
    rows = [row for row in range(len(seq_lens)) if row not in compressed_rows]
    if not rows:
        return None
    common = common_attn_metadata
    device = common.block_table_tensor.device
    starts = np.asarray(query_start, dtype=np.int64)
    row_array = np.asarray(rows, dtype=np.int64)
    counts = starts[row_array + 1] - starts[row_array]
    tokens = np.repeat(starts[row_array] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    lengths = np.asarray([seq_lens[r] for r in rows], dtype=np.int32)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    width = min(common.block_table_tensor.shape[1], -(-int(lengths.max()) // block_size))
    host_index = torch.from_numpy(np.concatenate([tokens, row_array]))
    token_index, row_index = to_device(host_index, device).split([tokens.size, len(rows)])
    host_tokens, host_rows = host_index.split([tokens.size, len(rows)])

    def take(tensor, index, host):
        # vLLM keeps some per-row fields on the host (is_prefilling, on the GPU runner): index each on its own device
        return tensor.index_select(0, index if tensor.device == index.device else host.to(tensor.device))

    offsets_cpu, lengths_cpu = torch.from_numpy(offsets), torch.from_numpy(lengths)
    split = dict(
        query_start_loc=to_device(offsets_cpu, device),
        query_start_loc_cpu=offsets_cpu,
        seq_lens=to_device(lengths_cpu, device),
        num_reqs=len(rows),
        num_actual_tokens=int(tokens.size),
        max_query_len=int(counts.max()),
        max_seq_len=int(lengths.max()),
        block_table_tensor=take(common.block_table_tensor, row_index, host_rows)[:, :width],
        slot_mapping=take(common.slot_mapping, token_index, host_tokens),
        seq_lens_cpu_upper_bound=lengths_cpu,
    )
    if getattr(common, "positions", None) is not None:
        split["positions"] = take(common.positions, token_index, host_tokens)
    if getattr(common, "is_prefilling", None) is not None:
        split["is_prefilling"] = take(common.is_prefilling, row_index, host_rows)
    if getattr(common, "req_idx", None) is not None:
        split["req_idx"] = common.req_idx[row_array]
    if getattr(common, "mm_req_doc_ranges", None) is not None:
        new_row = {row: i for i, row in enumerate(rows)}
        split["mm_req_doc_ranges"] = {new_row[r]: v for r, v in common.mm_req_doc_ranges.items() if r in new_row}
    split.update({name: None for name in UNSPLIT_FIELDS if hasattr(common, name)})
    return PlainRows(token_index, replace(common, **split))


def plan_head_attention(step_plan, common_attn_metadata) -> None:
    """The builders' part of a step's plan (:class:`~rcstat_vllm.worker.step_plan.StepCompression`): when the batch
    holds compressed rows, their head-as-sequence plan and the other rows' sub-batch for vLLM's own kernels."""
    if not step_plan.compressed:
        return
    owner = step_plan.owner
    query_start = common_attn_metadata.query_start_loc_cpu.tolist()
    device = common_attn_metadata.block_table_tensor.device
    step_plan.head_plan = make_head_plan(query_start, step_plan.seq_lens, step_plan.compressed, owner.space, device)
    step_plan.plain = plain_rows(
        common_attn_metadata, step_plan.compressed, query_start, step_plan.seq_lens, owner.block_size
    )


def plan_step_for_builder(owner, common_attn_metadata, build_plain):
    """A metadata builder's step plan: the worker's rows (``owner.plan_step``), the compressed rows' head-as-sequence
    plan, and vLLM's own metadata for the other rows (``build_plain``: the parent builder's ``build`` of a
    ``CommonAttentionMetadata``), shared by both backends' builders."""
    plan = owner.plan_step(common_attn_metadata)
    plan_head_attention(plan, common_attn_metadata)
    if plan.plain is not None:
        plan.plain.metadata = build_plain(plan.plain.metadata)
    return plan
