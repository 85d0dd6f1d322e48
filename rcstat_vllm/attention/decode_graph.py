"""Full CUDA graphs for decode steps (``cuda_graphs: full_decode``): every row of a single-token decode batch runs
head-as-sequence over persistent buffers, so a step's attention has the shapes of its padded batch only.

Today's path (``cuda_graphs: piecewise``) splits a batch holding compressed requests into a sub-batch for vLLM's
FlashAttention and head sequences of the compressed rows, with shapes that follow the compressed rows' slots and
widths: it cannot be captured. Here every row of the padded batch, compressed or not, is H sequences (one per KV
head, its G query heads one query), sequence ``r * H + h`` = row r, KV head h:

- a plain row's head h reads head pages ``block * H + h`` of its vLLM blocks (head-major blocks, see
  :func:`rcstat_vllm.paging.kv_layout.flash_head_page_caches`), its length and write slot are vLLM's own (its
  ``seq_lens``, its ``slot_mapping`` turned into head-page slots);
- a compressed row's head h reads its resident page table and length (as today's head plan);
- a padding row (vLLM pads a batch to the captured size) has length 0 and writes nothing (slot -1).

The query of sequence ``r * H + h`` is token r's query heads ``h * G .. h * G + G - 1``: a reshape of the step's
queries, no gather. :class:`DecodeGraphBuffers` holds the block tables ``[L, R * H, P]``, lengths ``[L, R * H]``,
write slots ``[L, R * H]`` and query offsets ``[R * H + 1]`` for ``R = max_num_seqs``, ``P`` pages of
``max_model_len`` tokens, allocated once; a step fills them in place from what the host knows (row counts, the
compressed rows' resident slots and lengths), without reading the device, and a graph captured over a padded batch
of R' rows reads their first ``R' * H`` sequences at the same addresses every replay.

With no compressed request the same batch costs H times the sequences of vLLM's FlashAttention call (each with G
query heads instead of one sequence with H * G) and a block table L * H times vLLM's (one per layer, one row per
head): see docs/design.md, "CUDA graphs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from rcstat_vllm.attention.flash_head_attention import HeadPageKernels
from rcstat_vllm.attention.head_plan import compressed_write_slots, resident_tables
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import flash_head_page_caches
from rcstat_vllm.paging.page_space import cdiv
from rcstat_vllm.paging.page_tables import ResidentTable, to_device


@dataclass
class DecodeGraphPlan:
    """One decode step's head sequences over the persistent buffers (views: the same addresses every step of the
    same padded size). Read by :meth:`HeadPageKernels.attend` like a :class:`~rcstat_vllm.attention.head_plan.
    HeadSequencePlan`."""

    #: rows of the padded batch (the captured batch size) and KV heads: ``num_rows * num_heads`` sequences
    num_rows: int
    num_heads: int
    #: [num_rows * H + 1] int32: one query per sequence of a real row, none for padding rows
    query_start_loc: Tensor
    #: [L, num_rows * H, P] int32 head-page tables; [L, num_rows * H] int32 lengths (0: padding)
    block_tables: Tensor
    seq_lens: Tensor
    #: [L, num_rows * H] int64 head-page slot each sequence's new token is written to (-1: none)
    slots: Tensor
    max_query_len: int = 1
    #: per layer, the bound on a sequence's length (the same at capture and replay: P * block size)
    max_seq_lens: list[int] | None = None


class DecodeGraphBuffers:
    """The persistent head-sequence buffers of one metadata builder (see the module docstring)."""

    def __init__(
        self, num_layers: int, num_heads: int, max_rows: int, max_pages: int, block_size: int, device: torch.device
    ):
        self.num_layers, self.num_heads, self.max_rows = num_layers, num_heads, max_rows
        self.max_pages, self.block_size = max_pages, block_size
        sequences = max_rows * num_heads
        self.block_tables = torch.zeros((num_layers, sequences, max_pages), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros((num_layers, sequences), dtype=torch.int32, device=device)
        self.slots = torch.full((num_layers, sequences), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
        self._sequence = torch.arange(sequences + 1, dtype=torch.int32, device=device)
        self._heads = torch.arange(num_heads, dtype=torch.int64, device=device)
        self._base_key: tuple[int, ...] | None = None
        self._base = torch.zeros((num_layers, 1), dtype=torch.int64, device=device)

    @classmethod
    def for_engine(cls, vllm_config, num_layers: int, num_heads: int, block_size: int, device) -> DecodeGraphBuffers:
        """Sized from the engine: ``max_num_seqs`` rows, ``max_model_len`` tokens a sequence."""
        max_rows = vllm_config.scheduler_config.max_num_seqs
        max_pages = cdiv(vllm_config.model_config.max_model_len, block_size)
        return cls(num_layers, num_heads, max_rows, max_pages, block_size, device)

    @staticmethod
    def bytes_for(num_layers: int, num_heads: int, max_rows: int, max_pages: int) -> int:
        """Device memory of the buffers (block tables, lengths, slots, offsets)."""
        sequences = max_rows * num_heads
        return 4 * num_layers * sequences * max_pages + 12 * num_layers * sequences + 8 * (sequences + 1)

    @property
    def max_seq_len(self) -> int:
        return self.max_pages * self.block_size

    def fill(
        self,
        common_attn_metadata,
        num_real_rows: int,
        layer_base: tuple[int, ...] | None = None,
        compressed: dict[int, CompactedRequest] | None = None,
        seq_lens: list[int] | None = None,
    ) -> DecodeGraphPlan:
        """Fill the buffers for a single-token decode batch of ``common_attn_metadata.num_reqs`` rows (the padded
        batch), the first ``num_real_rows`` of them real; ``layer_base``: per layer, the page id of its (block 0,
        head 0) (:class:`~rcstat_vllm.paging.page_space.PageSpace`; None: every layer's pages its own, base 0);
        ``compressed``: batch row -> its head pages, with ``seq_lens`` (host, per real row) its tokens after the
        step. Plain rows take vLLM's block table, lengths and slots (device tensors, never read on the host)."""
        common = common_attn_metadata
        rows, heads, layers = common.num_reqs, self.num_heads, self.num_layers
        if rows > self.max_rows:
            raise ValueError(f"rcstat: a decode batch of {rows} rows; the graph buffers hold {self.max_rows}")
        if common.max_query_len > 1:
            raise ValueError("rcstat: full-graph decode metadata for a batch with more than one query a row")
        sequences, real = rows * heads, num_real_rows * heads
        # Every row as a plain one first: vLLM's blocks as head pages, its lengths, its slots.
        block_table = common.block_table_tensor
        width = max(1, min(self.max_pages, block_table.shape[1], cdiv(common.max_seq_len, self.block_size)))
        blocks = block_table[:rows, :width].to(torch.int64)
        pages = blocks.unsqueeze(1) * heads + self._heads.view(1, -1, 1)  # [rows, H, width]
        base = self._layer_base(layer_base)  # [L, 1]
        self.block_tables[:, :sequences, :width].copy_(base.view(-1, 1, 1) + pages.view(1, sequences, width))
        lengths = common.seq_lens[:rows].view(-1, 1).expand(rows, heads).reshape(1, sequences)
        self.seq_lens[:, :sequences].copy_(lengths.expand(layers, -1))
        slot = common.slot_mapping[:rows].to(torch.int64).view(-1, 1)
        offset = torch.remainder(slot, self.block_size)
        head_slots = (slot - offset) * heads + self._heads.view(1, -1) * self.block_size + offset
        head_slots = base * self.block_size + head_slots.view(1, sequences)  # [L, rows * H]
        self.slots[:, :sequences].copy_(
            torch.where(slot.view(1, -1, 1) >= 0, head_slots.view(layers, rows, heads), -1).view(layers, -1)
        )  # vLLM's padding tokens carry slot -1
        # Padding rows: no query, no key, no write.
        self.seq_lens[:, real:sequences].zero_()
        self.slots[:, real:sequences].fill_(-1)
        torch.clamp(self._sequence[: sequences + 1], max=real, out=self.query_start_loc[: sequences + 1])
        if compressed:
            assert seq_lens is not None, "compressed rows need their lengths"
            self._fill_compressed(compressed, seq_lens, num_real_rows)  # (their page ids: the space's own)
        return DecodeGraphPlan(
            num_rows=rows,
            num_heads=heads,
            query_start_loc=self.query_start_loc[: sequences + 1],
            block_tables=self.block_tables[:, :sequences],
            seq_lens=self.seq_lens[:, :sequences],
            slots=self.slots[:, :sequences],
            max_seq_lens=[self.max_seq_len] * layers,
        )

    def _layer_base(self, layer_base: tuple[int, ...] | None) -> Tensor:
        """``[L, 1]`` int64 on the buffers' device: each layer's first page id (made once per page space)."""
        key = layer_base or (0,) * self.num_layers
        if self._base_key != key:
            self._base = torch.tensor(key, dtype=torch.int64).view(-1, 1).to(self.block_tables.device)
            self._base_key = key
        return self._base

    def _fill_compressed(self, compressed: dict[int, CompactedRequest], seq_lens: list[int], num_real_rows: int):
        """The compressed rows' sequences: their resident page tables, lengths and write slots (as today's head plan,
        :func:`~rcstat_vllm.attention.head_plan.make_head_plan`, for one query a row)."""
        resident = resident_tables(compressed)
        resident.commit()
        batch_rows = sorted(compressed)
        if batch_rows[-1] >= num_real_rows:
            raise ValueError(f"rcstat: compressed row {batch_rows[-1]} beyond the batch's {num_real_rows} real rows")
        heads, layers = self.num_heads, self.num_layers
        host = np.concatenate(
            [
                np.asarray(batch_rows, dtype=np.int64),
                np.fromiter(
                    (cast(ResidentTable, compressed[r].table).slot for r in batch_rows),
                    dtype=np.int64,
                    count=len(batch_rows),
                ),
                np.asarray([seq_lens[r] for r in batch_rows], dtype=np.int64),
            ]
        )
        device = self.block_tables.device
        row_index, slot_index, lengths = to_device(torch.from_numpy(host), device).split(len(batch_rows))
        sequence = (row_index.view(-1, 1) * heads + self._heads.view(1, -1)).view(-1)  # [Nc * H]
        base = resident.length_base.on_device.index_select(1, slot_index)  # [L, Nc, H]
        self.seq_lens[:, sequence] = (base + lengths.view(1, -1, 1)).view(layers, -1).to(torch.int32)
        width = min(resident.width, self.max_pages)
        tables = resident.pages.on_device.index_select(1, slot_index)[..., :width]  # [L, Nc, H, width]
        self.block_tables[:, sequence, :width] = tables.reshape(layers, -1, width).to(torch.int32)
        slots = compressed_write_slots(resident, slot_index, lengths - 1, self.block_size)  # [L, Nc, H]
        self.slots[:, sequence] = slots.reshape(layers, -1)


def flash_decode_graph_forward(
    kernels: HeadPageKernels,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    kv_cache: Tensor,
    output: Tensor,
    plan: DecodeGraphPlan,
    layer_index: int,
    *,
    scale: float,
    softcap: float = 0.0,
    layer=None,
) -> None:
    """One layer of a full-graph decode step: every (row, KV head) writes its token into its head page and attends
    head-as-sequence, in one cache write and one varlen call of fixed shapes.

    Args:
        query, output: ``[T, H*G, D]`` with ``T >= plan.num_rows`` (row r's token is token r);
            key, value: ``[T, H, D]`` or None (no write).
        kv_cache: the cache the page ids index, logical ``[num_blocks, H, N, 2D]`` in head-major blocks.
    """
    key_pages, value_pages = flash_head_page_caches(kv_cache)
    rows, heads = plan.num_rows, plan.num_heads
    num_query_heads, head_dim = query.shape[1], query.shape[2]
    group = num_query_heads // heads
    if key is not None and value is not None:
        kernels.write(
            key[:rows].reshape(rows * heads, 1, head_dim),
            value[:rows].reshape(rows * heads, 1, value.shape[-1]),
            key_pages,
            value_pages,
            plan.slots[layer_index],
            layer,
        )
    queries = query[:rows].reshape(rows * heads, group, head_dim)
    out = output[:rows]
    head_out = out.view(rows * heads, group, out.shape[-1]) if out.is_contiguous() else torch.empty_like(queries)
    kernels.attend(
        queries, key_pages, value_pages, head_out, plan, layer_index, scale=scale, softcap=softcap, layer=layer
    )
    if not out.is_contiguous():
        out.copy_(head_out.view(rows, num_query_heads, -1))
