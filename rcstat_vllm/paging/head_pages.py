"""Head pages of one compressed request: every (layer, KV head)'s page list and length, grown as it decodes.

A head page is one KV head's slice of one block of one layer (:mod:`rcstat_vllm.paging.kv_layout`); after compaction
(:mod:`rcstat_vllm.paging.compaction`) each (layer, head) of a request reads its kept tokens, then the tokens generated
since, from its own page list, so heads keep different numbers of tokens. :class:`CompactedRequest` keeps that
bookkeeping on the host; its page table is a :class:`PageTable` (the worker's resident tables once attached).

Plain torch; it does not import vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from rcstat_vllm.paging.page_space import PageSpace, cdiv, div_mod


class PageTable(Protocol):
    """A compressed request's page table ``[L, H, P]``: its own on the host (:class:`HostPageTable`) until the worker
    attaches it to its resident tables, then a slot there (:class:`rcstat_vllm.paging.page_tables.ResidentTable`)."""

    def pages(self, width: int) -> Tensor:
        """``[L, H, width]`` int64 page ids (-1 = no page), a host tensor."""

    def append(self, layers: Tensor, heads: Tensor, columns: Tensor, page_ids: Tensor) -> None:
        """Pages the (layer, head)s took, at these columns of their page lists (1-D, equal lengths)."""


class HostPageTable:
    """A page table the request holds itself (a compaction outside a worker, or before the worker attaches it)."""

    def __init__(self, tables: Tensor):
        self.tables = tables

    def pages(self, width: int) -> Tensor:
        return self.tables[:, :, :width]

    def append(self, layers: Tensor, heads: Tensor, columns: Tensor, page_ids: Tensor) -> None:
        width = int(columns.max()) + 1
        if width > self.tables.shape[2]:
            grown = torch.full((*self.tables.shape[:2], width), -1, dtype=self.tables.dtype)
            grown[:, :, : self.tables.shape[2]] = self.tables
            self.tables = grown
        self.tables[layers, heads, columns] = page_ids


@dataclass
class CompactedRequest:
    """Worker-side state of one compressed request: every (layer, head)'s page list and length.

    Everything here lives on the host whatever the cache's device, and ``reserve`` reads nothing from the device, so
    the bookkeeping of a decode step never waits on the GPU. Its page table (``table``) is one object: its own on the
    host until the worker attaches it to its :class:`~rcstat_vllm.paging.page_tables.HeadPageTables`
    (:meth:`attach_to`), then a slot there, whose host mirror is committed to the device incrementally.

    A head's length is ``kept[l, h] + (num_tokens - num_compacted_tokens)``: every token written after
    compaction is appended to every head. The request holds ``keep_blocks`` blocks given by the scheduler for its
    compacted prompt (:func:`compact_request`); until vLLM appends its next block (at the next multiple of N
    tokens), the ``m = (-n) % N`` tokens still to come must fit in pages of those blocks: (layer, head) then
    needs ``cdiv(k + m, N) - cdiv(k, N)`` new pages (:func:`blocks_needed` counts them). From there on every
    block vLLM appends brings ``H`` pages per layer into the pools before the N tokens that need exactly one new
    page per (layer, head). New pages come from the pools of unused head pages (one pool for all layers, or one
    per layer: ``space``); with one pool for all layers, a layer keeping little lends its pages to one keeping
    much.
    """

    num_compacted_tokens: int
    space: PageSpace
    #: [L, H] kept prompt tokens per (layer, head)
    kept: Tensor
    #: its page table: on the host, or a slot of the worker's resident tables
    table: PageTable
    #: per pool of ``space``, its unused pages (handed out from the left)
    pools: list[deque]
    keep_blocks: int = 0
    #: its first blocks, prefix-cache hits kept whole by every head and shared with other requests (the first
    #: columns of every head's page list)
    shared_blocks: int = 0
    #: block-row entries (vLLM's positions) already turned into pool pages, or never to be (the prompt's own)
    absorbed_blocks: int = 0
    #: [L, H] pages each (layer, head) holds
    page_counts: Tensor | None = None
    #: pages of the head holding the most (the width of its page table)
    width: int = 0
    #: tokens after compaction every head has room for in the pages it holds (``reserve``'s fast path)
    room: int = 0

    @classmethod
    def from_compaction(
        cls,
        num_tokens: int,
        space: PageSpace,
        kept: Tensor,
        tables: Tensor,
        unused: list[Tensor],
        keep_blocks: int,
        shared_blocks: int = 0,
    ) -> CompactedRequest:
        """The state after :func:`compact_request` moved ``num_tokens`` tokens' kept entries into ``keep_blocks``
        blocks: vLLM's row positions of the prompt blocks are absorbed (the scheduler gave them back)."""
        state = cls(
            num_compacted_tokens=num_tokens,
            space=space,
            kept=kept,
            table=HostPageTable(tables),
            pools=[deque(pages.tolist()) for pages in unused],
            keep_blocks=keep_blocks,
            shared_blocks=shared_blocks,
            absorbed_blocks=cdiv(num_tokens, space.block_size),
        )
        state._count_pages((tables >= 0).sum(dim=2))
        return state

    @classmethod
    def uncompressed(
        cls, num_tokens: int, space: PageSpace, block_ids: Tensor, shared_blocks: int = 0
    ) -> CompactedRequest:
        """An uncompressed request's tokens seen as head pages (every head holds all of them in the identity pages of
        its blocks): the source of its first decode-time compaction, which keeps its first ``shared_blocks`` blocks as
        they are. Not for decoding: it owns no pool pages."""
        blocks = block_ids[: cdiv(num_tokens, space.block_size)].to(torch.int64).cpu()
        tables = torch.stack([space.identity(layer, blocks) for layer in range(space.num_layers)])
        kept = torch.full(tables.shape[:2], num_tokens, dtype=torch.int64)
        unused = [torch.empty(0, dtype=torch.int64) for _ in space.pools]
        return cls.from_compaction(num_tokens, space, kept, tables, unused, blocks.numel(), shared_blocks)

    @property
    def tables(self) -> Tensor:
        """``[L, H, width]`` int64 page table (-1 = no page), on the host."""
        return self.table.pages(self.width)

    @property
    def length_base(self) -> Tensor:
        """``[L, H]``: a head attends over ``length_base + n`` tokens when the request holds ``n``."""
        return self.kept - self.num_compacted_tokens

    def attach_to(self, resident) -> None:
        """Hand the page table to the worker's :class:`~rcstat_vllm.paging.page_tables.HeadPageTables`: from now on it
        is a slot there (given back by the table's ``release``)."""
        self.table = resident.attach(self.tables, self.length_base)

    @property
    def num_layers(self) -> int:
        return self.kept.shape[0]

    @property
    def block_size(self) -> int:
        return self.space.block_size

    @property
    def num_heads(self) -> int:
        return self.space.num_heads

    @property
    def blocks_held(self) -> int:
        """Prompt blocks the request holds after compaction (later blocks come from vLLM as it grows)."""
        return self.keep_blocks

    def blocks_to_absorb(self, num_tokens: int) -> range:
        """Positions of vLLM's block row that :meth:`reserve` for ``num_tokens`` turns into pool pages (often none)."""
        return range(self.absorbed_blocks, max(self.absorbed_blocks, cdiv(num_tokens, self.block_size)))

    def reserve(self, num_tokens: int, block_ids=None) -> None:
        """Make sure every head has pages for ``num_tokens`` logical tokens (the length after this step).

        Args:
            block_ids: the request's vLLM block ids on the host (a numpy array, list or CPU tensor: at least the
                positions :meth:`blocks_to_absorb` names); may be None when it names none. Device tensors are
                refused: reading them would synchronise with the GPU (the worker decides when that is acceptable).
        """
        fresh_positions = self.blocks_to_absorb(num_tokens)
        if fresh_positions:
            self._absorb(_host_ids(block_ids, fresh_positions))
        if num_tokens - self.num_compacted_tokens <= self.room:
            return  # the common case: every head has room in the pages it holds
        # Pages up to the end of the block ``num_tokens`` falls in, for every head at once: the tokens of one block
        # need exactly one new page per (layer, head), which that block brought (or, before the first boundary after
        # compaction, ``blocks_needed`` counted), so handing them all out at the first step of the block where a head
        # needs one, instead of each at its own boundary, takes no page the pools would lack, and the block's other
        # steps take the fast path. Heads keeping different numbers of tokens cross page boundaries at different
        # steps: one page at a time, this slow path ran nearly every step of every such request.
        horizon = cdiv(num_tokens, self.block_size) * self.block_size
        needed = (self.lengths(horizon) + self.block_size - 1) // self.block_size
        page_counts = self.page_counts
        assert page_counts is not None  # (counted at compaction)
        layers, heads = torch.nonzero(needed > page_counts, as_tuple=True)
        have = page_counts[layers, heads]
        counts = needed[layers, heads] - have
        pages: list[int] = []
        for layer, count in zip(layers.tolist(), counts.tolist()):  # pools hand pages out in (layer, head) order
            pool = self.pools[self.space.pool_of(layer)]
            if len(pool) < count:
                raise RuntimeError("rcstat: head-page pool exhausted (block accounting bug)")
            pages.extend(pool.popleft() for _ in range(count))
        self._write_pages(
            layers.repeat_interleave(counts), heads.repeat_interleave(counts), ranges(have, counts), torch.tensor(pages)
        )
        self._count_pages(torch.maximum(page_counts, needed))

    def _absorb(self, fresh: Tensor) -> None:
        """vLLM's newly appended blocks bring their pages into the pools."""
        for pool_index, pool in enumerate(self.pools):
            pool.extend(self.space.pool_pages(pool_index, fresh).tolist())
        self.absorbed_blocks += fresh.numel()

    def _write_pages(self, layers: Tensor, heads: Tensor, columns: Tensor, pages: Tensor) -> None:
        """Record pages the (layer, head)s took, at these columns of their page lists."""
        self.table.append(layers, heads, columns, pages)

    def _count_pages(self, page_counts: Tensor) -> None:
        """New page counts, and what follows from them on the host: the table's width and every head's room."""
        self.page_counts = page_counts
        self.width = int(page_counts.max())
        self.room = int((page_counts * self.block_size - self.kept).min())

    def lengths(self, num_tokens: int) -> Tensor:
        """[L, H] tokens each (layer, head) attends over when the request holds ``num_tokens`` tokens."""
        return self.kept + (num_tokens - self.num_compacted_tokens)

    def slots(self, positions: Tensor) -> Tensor:
        """[L, T, H] head-page slots (page * N + offset) of tokens at logical ``positions`` (>= compaction)."""
        index = self.kept.unsqueeze(1) + (positions.view(1, -1, 1) - self.num_compacted_tokens)
        page_index, offsets = div_mod(index, self.block_size)
        pages = torch.gather(self.tables, 2, page_index.transpose(1, 2)).transpose(1, 2)
        return pages * self.block_size + offsets


def ranges(starts: Tensor, counts: Tensor) -> Tensor:
    """``cat([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    total = int(counts.sum())
    offsets = torch.cumsum(counts, 0) - counts
    return torch.arange(total) + torch.repeat_interleave(starts - offsets, counts, output_size=total)


def _host_ids(block_ids, positions: range) -> Tensor:
    """int64 CPU tensor of ``block_ids[positions]``; refuses device tensors (no hidden synchronisation)."""
    if block_ids is None:
        raise ValueError(f"rcstat: block row positions {positions.start}..{positions.stop - 1} are needed on the host")
    if isinstance(block_ids, Tensor) and block_ids.device.type != "cpu":
        raise ValueError("rcstat: reserve takes host block ids; reading a device block table would synchronise")
    window = block_ids[positions.start : positions.stop]
    if isinstance(window, Tensor):
        ids = window.to(torch.int64, copy=True)
    else:  # vLLM's host block table row (numpy) or a list
        ids = torch.from_numpy(np.array(window, dtype=np.int64))  # a copy
    if ids.numel() != len(positions):
        raise ValueError(f"rcstat: block row has {positions.start + ids.numel()} entries, {positions.stop} needed")
    return ids
