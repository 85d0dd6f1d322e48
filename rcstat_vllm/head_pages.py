"""Head pages: the per-KV-head paged layout that lets heads keep different numbers of tokens.

vLLM's KV cache for one layer is ``[num_blocks, H, N, 2D]``: a block holds all H KV heads of N tokens
(``2 N D`` values per head: N keys, then N values). Viewed as ``[num_blocks * H, 2N, D]``,
the same memory is ``num_blocks * H`` *head pages* of N single-head tokens each; page ``b * H + h`` is head
``h``'s slice of block ``b``. An uncompressed request's head ``h`` uses pages ``row[j] * H + h`` (the
identity map). After compaction every (layer, head) owns its own page list, filled densely, so a head
keeping k tokens needs ``ceil(k / N)`` pages and a request needs ``keep_blocks`` blocks; the rest go back to
vLLM. Which pages a request may use, and which tensor a page id indexes, is its :class:`PageSpace` (one pool
across all layers, or one per layer: :mod:`rcstat_vllm.page_space`).

Everything here is plain torch on whatever device the cache lives on; it does not import vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from rcstat_vllm.page_space import PageSpace, cdiv, identity_pages


def key_value_pages(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of a CPU cache as head pages: keys ``[num_pages, D, N]`` and values ``[num_pages, N, D]``.

    vLLM's CPU kernels (ISAs ``vec``/``vec16``) store a page's keys transposed, channel-major (``[D, N]``),
    and its values token-major (``[N, D]``); ``patches/cpu_kv_layout.py`` checks this on the installed
    vLLM before compression is enabled.
    """
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    pages = kv_cache.view(num_blocks * num_heads, 2 * block_size * head_dim)
    keys = pages[:, : block_size * head_dim].view(-1, head_dim, block_size)
    values = pages[:, block_size * head_dim :].view(-1, block_size, head_dim)
    return keys, values


class CacheLayout:
    """Where head page ``p = block * H + h``, slot ``s`` of one layer's cache lives.

    Compaction, gathering and the page bookkeeping only use :meth:`shape`, :meth:`read` and :meth:`write`,
    so the CPU and GPU paths share them and differ only in the attention kernels.
    """

    def shape(self, kv_cache: Tensor) -> tuple[int, int, int]:
        """``(num_blocks, H, N)``"""
        raise NotImplementedError

    def read(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[*pages.shape, D]`` stored at ``(page, offset)`` (copies)."""
        raise NotImplementedError

    def write(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor, keys: Tensor, values: Tensor) -> None:
        raise NotImplementedError


class CPUVecLayout(CacheLayout):
    """vLLM-CPU (``vec``/``vec16``): one tensor ``[num_blocks, H, N, 2D]``, see :func:`key_value_pages`."""

    def shape(self, kv_cache):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        return num_blocks, num_heads, block_size

    def read(self, kv_cache, pages, offsets):
        keys, values = key_value_pages(kv_cache)
        return keys[pages, :, offsets], values[pages, offsets]

    def write(self, kv_cache, pages, offsets, keys, values):
        key_pages, value_pages = key_value_pages(kv_cache)
        key_pages[pages, :, offsets] = keys
        value_pages[pages, offsets] = values


class FlashLayout(CacheLayout):
    """vLLM's CUDA caches (FlashAttention and the other GPU backends): the same logical ``[num_blocks, H, N, 2D]``
    as on CPU, each token row holding its key then its value (``kv_cache.transpose(1, 2).split(D, -1)`` is
    FlashAttention's ``[num_blocks, N, H, D]`` key and value view).

    Indexing is logical, so it is right for every physical layout vLLM may resolve (``KVCacheLayout``); the
    head-as-sequence view :func:`flash_head_page_caches` additionally needs head-major blocks (``LBHNC``,
    which the plugin's CUDA backend declares).
    """

    def shape(self, kv_cache):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        return num_blocks, num_heads, block_size

    def read(self, kv_cache, pages, offsets):
        num_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3] // 2
        rows = kv_cache[pages // num_heads, pages % num_heads, offsets]
        return rows[..., :head_dim], rows[..., head_dim:]

    def write(self, kv_cache, pages, offsets, keys, values):
        num_heads = kv_cache.shape[1]
        kv_cache[pages // num_heads, pages % num_heads, offsets] = torch.cat([keys, values], dim=-1).to(kv_cache.dtype)


CPU_VEC = CPUVecLayout()
FLASH = FlashLayout()


def read_kv(kv_cache: Tensor, pages: Tensor, offsets: Tensor, layout: CacheLayout = CPU_VEC) -> tuple[Tensor, Tensor]:
    """Keys and values ``[*pages.shape, D]`` stored at ``(page, offset)`` (copies)."""
    return layout.read(kv_cache, pages, offsets)


def write_kv(
    kv_cache: Tensor, pages: Tensor, offsets: Tensor, keys: Tensor, values: Tensor, layout: CacheLayout = CPU_VEC
) -> None:
    layout.write(kv_cache, pages, offsets, keys, values)


def flash_head_page_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Key and value caches with one KV head per page, ``[num_blocks * H, N, 1, D]`` each (views): the paged
    cache shape vLLM's FlashAttention kernels take, over head pages instead of blocks.

    Needs head-major blocks (vLLM's ``LBHNC`` layout: a head's ``N`` token rows are contiguous); raises
    otherwise, since no view can then put a block's heads side by side as pages.
    """
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    if kv_cache.stride(0) != num_heads * kv_cache.stride(1):
        raise ValueError(
            f"KV cache strides {kv_cache.stride()} are not head-major (vLLM layout LBHNC): head pages need it"
        )
    pages = kv_cache.as_strided(
        (num_blocks * num_heads, block_size, 1, two_d),
        (kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(2), kv_cache.stride(3)),
    )
    keys, values = pages.split(two_d // 2, dim=-1)
    return keys, values


def head_page_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Key and value caches with one KV head per page: ``[num_blocks * H, 1, N, D]`` each (views), the
    shape vLLM's CPU kernels take (they apply their own in-page layout)."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(num_blocks * num_heads, 1, 2 * block_size, two_d // 2)
    keys, values = pages.chunk(2, dim=2)
    return keys, values


def gather_prompt(
    kv_cache: Tensor, block_row: Tensor, num_tokens: int, layout: CacheLayout = CPU_VEC
) -> tuple[Tensor, Tensor]:
    """Keys and values ``[H, n, D]`` of an uncompressed request's first ``n`` tokens."""
    _, num_heads, block_size = layout.shape(kv_cache)
    tokens = torch.arange(num_tokens, device=kv_cache.device)
    pages = identity_pages(block_row[: cdiv(num_tokens, block_size)], num_heads)[:, tokens // block_size]
    return layout.read(kv_cache, pages, (tokens % block_size).expand_as(pages))


def _compact_in_own_pages(
    cache: Tensor, layer_pages: Tensor, keep_mask: Tensor, block_size: int, layout: CacheLayout
) -> tuple[Tensor, Tensor]:
    """Compact one layer within its own pages ``layer_pages`` ``[H, prompt blocks]`` (page ids of ``cache``).

    The layer's pages are handed out block by block (``row[0]`` heads 0..H-1, then ``row[1]`` ...): head 0 takes
    the first ``ceil(k_0 / N)``, head 1 the next, and so on. The layer's kept entries are gathered before any is
    written, which makes the in-place move safe although sources and destinations share pages.

    Returns:
        ``[H, max_pages]`` page table (-1 where a head has no page) and the ``[H]`` pages per head.
    """
    num_heads = keep_mask.shape[0]
    device = keep_mask.device
    counts = keep_mask.sum(dim=1)
    pages_per_head = (counts + block_size - 1) // block_size
    first_page = torch.cumsum(pages_per_head, 0) - pages_per_head
    pool = layer_pages.t().reshape(-1)[: int(pages_per_head.sum())]
    # Sources: (head, token) of every kept entry, in head-major then token order.
    head_idx, token_idx = torch.nonzero(keep_mask, as_tuple=True)
    source_pages = layer_pages[head_idx, token_idx // block_size]
    # Destinations: the j-th kept token of head h goes to slot j of head h's page run.
    rank = torch.arange(head_idx.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[head_idx]
    dest_pages = pool[first_page[head_idx] + rank // block_size]
    keys, values = layout.read(cache, source_pages, token_idx % block_size)  # copies: sources may be overwritten
    layout.write(cache, dest_pages, rank % block_size, keys, values)

    width = max(int(pages_per_head.max()) if num_heads else 0, 1)
    table = torch.full((num_heads, width), -1, dtype=torch.int64, device=device)
    slot = torch.arange(width, device=device).unsqueeze(0)
    valid = slot < pages_per_head.unsqueeze(1)
    table[valid] = pool[(first_page.unsqueeze(1) + slot)[valid]]
    return table, pages_per_head


#: Pages moved per copy when overflow pages spill into other layers' vacated pages (bounds the transient copy).
SPILL_CHUNK_PAGES = 1024


def compact(
    caches: Sequence[Tensor],
    block_row: Tensor,
    keep_masks: Sequence[Tensor],
    space: PageSpace,
    layout: CacheLayout = CPU_VEC,
) -> Tensor:
    """Move each (layer, head)'s kept tokens (in order) to the front of head pages in the request's first blocks.

    1. Each layer compacts within its own pages of the request's blocks (:func:`_compact_in_own_pages`): a layer
       needs ``ceil(sum_h ceil(k_h / N) / H)`` blocks of its own slice.
    2. With pages pooled across layers (one pool of all layers, ``space``), the request keeps only
       ``ceil(pages of all (layer, head) / (L * H))`` blocks: pages a full layer placed beyond them *spill*, whole,
       into pages other layers left vacant within them. A spill never writes a page that holds kept KV or reads
       one that was written, so it runs in chunks of :data:`SPILL_CHUNK_PAGES` pages in any order.

    Memory beyond the cache: one layer's kept entries (step 1), one chunk of pages (step 2). Run it only once no
    layer still has to read its uncompressed prompt KV: pooled, a spill writes into other layers' slices.

    Args:
        caches: per layer, its cache (``[num_blocks, H, N, 2D]``); a pooled space indexes its all-layers view.
        block_row: the request's block ids (at least ``cdiv(n, N)`` valid entries).
        keep_masks: per layer, ``[H, n]`` bool, the tokens each head keeps.
        space: where pages come from.
        layout: where head pages live in a cache tensor.

    Returns:
        ``[L, H, max_pages]`` int64 page tables (-1 where a head has no page).
    """
    num_heads, block_size = space.num_heads, space.block_size
    num_tokens = keep_masks[0].shape[1]
    prompt_blocks = block_row[: cdiv(num_tokens, block_size)].to(keep_masks[0].device)
    tables, pages = [], []
    for layer, mask in enumerate(keep_masks):
        cache = space.cache(layer, caches[layer])
        table, pages_per_head = _compact_in_own_pages(
            cache, space.identity(layer, prompt_blocks), mask, block_size, layout
        )
        tables.append(table)
        pages.append(pages_per_head)
    tables = stack_tables(tables)
    if space.is_pooled:
        keep_blocks = cdiv(int(torch.stack(pages).sum()), space.pages_per_block(0))
        _spill_into_vacated_pages(space, tables, torch.stack(pages), prompt_blocks, keep_blocks, layout)
    return tables


def _spill_into_vacated_pages(
    space: PageSpace, tables: Tensor, pages: Tensor, prompt_blocks: Tensor, keep_blocks: int, layout: CacheLayout
) -> None:
    """Move every page of ``tables`` that lies beyond the request's first ``keep_blocks`` blocks into a page of
    those blocks that no (layer, head) uses; rewrite ``tables`` in place."""
    num_heads, block_size = space.num_heads, space.block_size
    device = tables.device
    # Layer l's heads took the first pages[l].sum() of its own pages in block-by-block order, head after head:
    # slot j of head h is page number first_page[l, h] + j of that order, which lies in block (that) // H.
    first_page = torch.cumsum(pages, dim=1) - pages  # [L, H]
    position = first_page.unsqueeze(2) + torch.arange(tables.shape[2], device=device)
    kept_pages_per_layer = keep_blocks * num_heads
    overflow = (tables >= 0) & (position >= kept_pages_per_layer)
    if not bool(overflow.any()):
        return
    used = pages.sum(dim=1)  # [L]
    vacant = torch.cat(
        [
            space.identity(layer, prompt_blocks[:keep_blocks]).t().reshape(-1)[int(used[layer]) :]
            for layer in range(tables.shape[0])
            if int(used[layer]) < kept_pages_per_layer
        ]
    )
    sources = tables[overflow]
    if vacant.numel() < sources.numel():
        raise RuntimeError("rcstat: not enough vacant pages to spill into (page accounting bug)")
    destinations = vacant[: sources.numel()]
    cache = space.all_layers
    offsets = torch.arange(block_size, device=device)
    for start in range(0, sources.numel(), SPILL_CHUNK_PAGES):
        src = sources[start : start + SPILL_CHUNK_PAGES].unsqueeze(1).expand(-1, block_size)
        dst = destinations[start : start + SPILL_CHUNK_PAGES].unsqueeze(1).expand(-1, block_size)
        keys, values = layout.read(cache, src, offsets.expand_as(src))
        layout.write(cache, dst, offsets.expand_as(dst), keys, values)
    tables[overflow] = destinations


def compact_layer(kv_cache: Tensor, block_row: Tensor, keep_mask: Tensor, layout: CacheLayout = CPU_VEC) -> Tensor:
    """:func:`compact` of one layer on its own pages: ``[H, max_pages]`` page table."""
    _, num_heads, block_size = layout.shape(kv_cache)
    return compact([kv_cache], block_row, [keep_mask], PageSpace.per_layer(1, num_heads, block_size), layout)[0]


def stack_tables(tables: list[Tensor]) -> Tensor:
    """Per-layer ``[H, P_l]`` page tables -> one ``[L, H, max P_l]`` tensor padded with -1."""
    width = max(t.shape[1] for t in tables)
    stacked = torch.full((len(tables), tables[0].shape[0], width), -1, dtype=torch.int64, device=tables[0].device)
    for layer, table in enumerate(tables):
        stacked[layer, :, : table.shape[1]] = table
    return stacked


@dataclass
class CompactedRequest:
    """Worker-side state of one compressed request: every (layer, head)'s page list and length.

    Its tensors live on the host whatever the cache's device: they are read with ``tolist()`` every step,
    which would otherwise synchronise with the GPU.

    A head's length is ``kept[l, h] + (num_tokens - num_compacted_tokens)``: every token written after
    compaction is appended to every head. New pages come from the pools of unused head pages in the blocks
    the request still holds (one pool for all layers, or one per layer: ``space``, see :meth:`finalize`),
    refilled as vLLM appends blocks to the row.
    """

    num_compacted_tokens: int
    space: PageSpace
    #: [L, H] kept prompt tokens per (layer, head)
    kept: Tensor
    #: [L, H, P] int64 page table per (layer, head), -1 = no page; grows along P as heads need pages
    tables: Tensor
    keep_blocks: int = 0
    #: block-row entries already turned into pool pages
    absorbed_blocks: int = 0
    #: per pool of ``space``, its unused pages (handed out from the left)
    pools: list[deque] = field(default_factory=list)
    #: [L, H] pages each (layer, head) holds
    page_counts: Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.tables.shape[0]

    @property
    def block_size(self) -> int:
        return self.space.block_size

    @property
    def num_heads(self) -> int:
        return self.space.num_heads

    def blocks_needed(self) -> int:
        """The fewest blocks this rank's heads can keep (see :meth:`finalize`)."""
        n_blocks = cdiv(self.num_compacted_tokens, self.block_size)
        to_boundary = -self.num_compacted_tokens % self.block_size
        pages_then = (self.kept + to_boundary + self.block_size - 1) // self.block_size  # [L, H]
        return min(self.space.blocks_for(pages_then), n_blocks)

    def finalize(self, block_row: Tensor, keep_blocks: int | None = None) -> None:
        """Decide how many blocks the request keeps and fill the pools with the unused pages of those blocks.

        The request keeps its first ``keep_blocks`` blocks and frees the rest of its prompt blocks. Until vLLM
        appends the request's next block (at the next multiple of N tokens), the ``m = (-n) % N`` tokens still
        to come must fit in pages it already holds: (layer, head) then needs ``cdiv(k + m, N) - cdiv(k, N)``
        new pages. From there on every block vLLM appends brings ``H`` pages per layer into the pools before
        the N tokens that need exactly one new page per (layer, head). So the request needs, over each pool,
        ``cdiv(pages used + pages needed before the next block, pages per block)`` blocks, the max over pools
        (:meth:`blocks_needed`): with one pool for all layers, a layer keeping little lends its pages to one
        keeping much.

        ``keep_blocks``: the count agreed by all tensor-parallel ranks (the max of their ``blocks_needed``:
        they share one block table but hold different heads); None on a single rank.
        """
        n_blocks = cdiv(self.num_compacted_tokens, self.block_size)
        needed = self.blocks_needed()
        if keep_blocks is None:
            keep_blocks = needed
        elif not needed <= keep_blocks <= n_blocks:
            raise ValueError(f"keep_blocks={keep_blocks} outside [{needed}, {n_blocks}] (ranks disagree?)")
        self.keep_blocks = keep_blocks
        self.page_counts = (self.tables >= 0).sum(dim=2)
        kept_blocks = block_row[: self.keep_blocks].cpu()
        self.pools = []
        for pool_index, layers in enumerate(self.space.pools):
            taken = set(self.tables[list(layers)].flatten().tolist())
            candidates = self.space.pool_pages(pool_index, kept_blocks).tolist()
            self.pools.append(deque(p for p in candidates if p not in taken))
        self.absorbed_blocks = n_blocks

    @property
    def blocks_held(self) -> int:
        """Prompt blocks the request holds after compaction (later blocks come from vLLM as it grows)."""
        return self.keep_blocks

    def reserve(self, num_tokens: int, block_row: Tensor) -> None:
        """Make sure every head has pages for ``num_tokens`` logical tokens (the length after this step)."""
        n_row = cdiv(num_tokens, self.block_size)
        if n_row > self.absorbed_blocks:
            fresh = block_row[self.absorbed_blocks : n_row].cpu()
            for pool_index, pool in enumerate(self.pools):
                pool.extend(self.space.pool_pages(pool_index, fresh).tolist())
            self.absorbed_blocks = n_row
        needed = (self.lengths(num_tokens) + self.block_size - 1) // self.block_size
        short = needed > self.page_counts
        if not bool(short.any()):  # the common case: every head still has room in its last page
            return
        width = int(needed.max())
        if width > self.tables.shape[2]:
            grown = torch.full(
                (self.num_layers, self.num_heads, width), -1, dtype=self.tables.dtype, device=self.tables.device
            )
            grown[:, :, : self.tables.shape[2]] = self.tables
            self.tables = grown
        for layer, head in torch.nonzero(short).tolist():
            pool = self.pools[self.space.pool_of(layer)]
            for slot in range(int(self.page_counts[layer, head]), int(needed[layer, head])):
                if not pool:
                    raise RuntimeError("rcstat: head-page pool exhausted (block accounting bug)")
                self.tables[layer, head, slot] = pool.popleft()
            self.page_counts[layer, head] = needed[layer, head]

    def lengths(self, num_tokens: int) -> Tensor:
        """[L, H] tokens each (layer, head) attends over when the request holds ``num_tokens`` tokens."""
        return self.kept + (num_tokens - self.num_compacted_tokens)

    def slots(self, positions: Tensor) -> Tensor:
        """[L, T, H] head-page slots (page * N + offset) of tokens at logical ``positions`` (>= compaction)."""
        index = self.kept.unsqueeze(1) + (positions.view(1, -1, 1) - self.num_compacted_tokens)
        pages = torch.gather(self.tables, 2, (index // self.block_size).transpose(1, 2)).transpose(1, 2)
        return pages * self.block_size + index % self.block_size
