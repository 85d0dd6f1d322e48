"""Head pages: the per-KV-head paged layout that lets heads keep different numbers of tokens.

vLLM's KV cache for one layer is ``[num_blocks, H, N, 2D]``: a block holds all H KV heads of N tokens
(``2 N D`` values per head: N keys, then N values). Viewed as ``[num_blocks * H, 2N, D]``,
the same memory is ``num_blocks * H`` *head pages* of N single-head tokens each; page ``b * H + h`` is head
``h``'s slice of block ``b``. An uncompressed request's head ``h`` uses pages ``row[j] * H + h`` (the
identity map). After compaction every (layer, head) owns its own page list, filled densely, so a head
keeping k tokens needs ``ceil(k / N)`` pages and a request needs ``keep_blocks`` blocks; the rest go back to
vLLM.

Everything here is plain torch on whatever device the cache lives on; it does not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def identity_pages(block_row: Tensor, num_heads: int) -> Tensor:
    """``[H, num_blocks_in_row]``: head h's pages of an uncompressed request, ``row[j] * H + h``."""
    heads = torch.arange(num_heads, device=block_row.device, dtype=torch.int64)
    return block_row.to(torch.int64).unsqueeze(0) * num_heads + heads.unsqueeze(1)


def gather_prompt(
    kv_cache: Tensor, block_row: Tensor, num_tokens: int, layout: CacheLayout = CPU_VEC
) -> tuple[Tensor, Tensor]:
    """Keys and values ``[H, n, D]`` of an uncompressed request's first ``n`` tokens."""
    _, num_heads, block_size = layout.shape(kv_cache)
    tokens = torch.arange(num_tokens, device=kv_cache.device)
    pages = identity_pages(block_row[: cdiv(num_tokens, block_size)], num_heads)[:, tokens // block_size]
    return layout.read(kv_cache, pages, (tokens % block_size).expand_as(pages))


def compact_layer(kv_cache: Tensor, block_row: Tensor, keep_mask: Tensor, layout: CacheLayout = CPU_VEC) -> Tensor:
    """Move each head's kept tokens (in order) to the front of fresh head pages of the request's blocks.

    Pages are handed out in order ``row[0]*H + 0, row[0]*H + 1, ..., row[1]*H + 0, ...``: head 0 takes the
    first ``ceil(k_0 / N)``, head 1 the next, and so on, so this layer needs only the request's first
    ``ceil(sum_h ceil(k_h / N) / H)`` blocks. Everything kept is gathered before anything is written, which
    makes the in-place move safe although sources and destinations share blocks.

    Args:
        kv_cache: the layer's cache (``[num_blocks, H, N, 2D]`` in the default CPU layout).
        block_row: the request's block ids (at least ``cdiv(n, N)`` valid entries).
        keep_mask: ``[H, n]`` bool, the tokens each head keeps.
        layout: where head pages live in ``kv_cache``.

    Returns:
        ``[H, max_pages]`` int64 page table of the compacted layer (-1 where a head has no page).
    """
    _, num_heads, block_size = layout.shape(kv_cache)
    num_tokens = keep_mask.shape[1]
    device = kv_cache.device
    counts = keep_mask.sum(dim=1)
    pages_per_head = (counts + block_size - 1) // block_size
    first_page = torch.cumsum(pages_per_head, 0) - pages_per_head
    num_pages = int(pages_per_head.sum())
    pool = identity_pages(block_row[: cdiv(num_pages, num_heads)], num_heads).t().reshape(-1)[:num_pages]

    # Sources: (head, token) of every kept entry, in head-major then token order.
    head_idx, token_idx = torch.nonzero(keep_mask, as_tuple=True)
    source_pages = identity_pages(block_row[: cdiv(num_tokens, block_size)], num_heads)[
        head_idx, token_idx // block_size
    ]
    # Destinations: the j-th kept token of head h goes to slot j of head h's page run.
    rank = torch.arange(head_idx.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[head_idx]
    dest_pages = pool[first_page[head_idx] + rank // block_size]

    keys, values = layout.read(kv_cache, source_pages, token_idx % block_size)  # copies: sources may be overwritten
    layout.write(kv_cache, dest_pages, rank % block_size, keys, values)

    max_pages = int(pages_per_head.max()) if num_heads else 0
    table = torch.full((num_heads, max(max_pages, 1)), -1, dtype=torch.int64, device=device)
    slot = torch.arange(max(max_pages, 1), device=device).unsqueeze(0)
    valid = slot < pages_per_head.unsqueeze(1)
    table[valid] = pool[(first_page.unsqueeze(1) + slot)[valid]]
    return table


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

    Its tensors live on the host whatever the cache's device (``LayerCompressor.compacted``): they are read
    with ``tolist()`` every step, which would otherwise synchronise with the GPU.

    A head's length is ``kept[l, h] + (num_tokens - num_compacted_tokens)``: every token written after
    compaction is appended to every head. New pages come from per-layer pools of unused head pages in the
    blocks the request still holds (see :meth:`finalize`), refilled as vLLM appends blocks to the row.
    """

    num_compacted_tokens: int
    block_size: int
    num_heads: int
    #: [L, H] kept prompt tokens per (layer, head)
    kept: Tensor
    #: [L, H, P] int64 page table per (layer, head), -1 = no page; grows along P as heads need pages
    tables: Tensor
    keep_blocks: int = 0
    #: block-row entries already turned into pool pages
    absorbed_blocks: int = 0
    pools: list[list[int]] = field(default_factory=list)
    #: [L, H] pages each (layer, head) holds
    page_counts: Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.tables.shape[0]

    def blocks_needed(self) -> int:
        """The fewest blocks this rank's heads can keep (see :meth:`finalize`)."""
        n_blocks = cdiv(self.num_compacted_tokens, self.block_size)
        to_boundary = -self.num_compacted_tokens % self.block_size
        pages_then = (self.kept + to_boundary + self.block_size - 1) // self.block_size  # [L, H]
        return min(cdiv(int(pages_then.sum(dim=1).max()), self.num_heads), n_blocks)

    def finalize(self, block_row: Tensor, keep_blocks: int | None = None) -> None:
        """Decide how many blocks the request keeps and build the per-layer pools of unused pages.

        The request keeps its first ``keep_blocks`` blocks and frees the rest of its prompt blocks. Until vLLM
        appends the request's next block (at the next multiple of N tokens), the ``m = (-n) % N`` tokens still
        to come must fit in pages it already holds: head h then needs ``cdiv(k_h + m, N) - cdiv(k_h, N)`` new
        pages. From there on every block vLLM appends brings H pages per layer before the N tokens that need
        exactly one new page per head. So the request needs max over layers of ``cdiv(pages used + pages
        needed before the next block, H)`` blocks (:meth:`blocks_needed`): at most one block more than the
        kept pages themselves need, often none (never when n is a multiple of N).

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
        candidates = identity_pages(block_row[: self.keep_blocks], self.num_heads).t().reshape(-1).tolist()
        self.pools = []
        for table in self.tables:
            taken = set(table[table >= 0].tolist())
            self.pools.append([p for p in candidates if p not in taken])
        self.absorbed_blocks = n_blocks

    @property
    def blocks_held(self) -> int:
        """Prompt blocks the request holds after compaction (later blocks come from vLLM as it grows)."""
        return self.keep_blocks

    def reserve(self, num_tokens: int, block_row: Tensor) -> None:
        """Make sure every head has pages for ``num_tokens`` logical tokens (the length after this step)."""
        n_row = cdiv(num_tokens, self.block_size)
        if n_row > self.absorbed_blocks:
            fresh = identity_pages(block_row[self.absorbed_blocks : n_row], self.num_heads)
            fresh_pages = fresh.t().reshape(-1).tolist()
            for pool in self.pools:
                pool.extend(fresh_pages)
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
            pool = self.pools[layer]
            for slot in range(int(self.page_counts[layer, head]), int(needed[layer, head])):
                if not pool:
                    raise RuntimeError("rcstat: head-page pool exhausted (block accounting bug)")
                self.tables[layer, head, slot] = pool.pop(0)
            self.page_counts[layer, head] = needed[layer, head]

    def lengths(self, num_tokens: int) -> Tensor:
        """[L, H] tokens each (layer, head) attends over when the request holds ``num_tokens`` tokens."""
        return self.kept + (num_tokens - self.num_compacted_tokens)

    def slots(self, positions: Tensor) -> Tensor:
        """[L, T, H] head-page slots (page * N + offset) of tokens at logical ``positions`` (>= compaction)."""
        index = self.kept.unsqueeze(1) + (positions.view(1, -1, 1) - self.num_compacted_tokens)
        pages = torch.gather(self.tables, 2, (index // self.block_size).transpose(1, 2)).transpose(1, 2)
        return pages * self.block_size + index % self.block_size
