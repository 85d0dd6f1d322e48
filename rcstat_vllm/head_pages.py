"""Head pages: the per-KV-head paged layout that lets heads keep different numbers of tokens.

vLLM's KV cache for one layer is ``[num_blocks, H, N, 2D]``: a block holds all H KV heads of N tokens
(``2 N D`` values per head: N keys, then N values). Viewed as ``[num_blocks * H, 2N, D]``,
the same memory is ``num_blocks * H`` *head pages* of N single-head tokens each; page ``b * H + h`` is head
``h``'s slice of block ``b``. An uncompressed request's head ``h`` uses pages ``row[j] * H + h`` (the
identity map). Compaction copies every (layer, head)'s kept tokens into its own page list in ``keep_blocks``
blocks the scheduler allocated (:func:`compact_request`), filled densely, so a head keeping k tokens needs
``ceil(k / N)`` pages; the prompt's blocks go back to vLLM untouched (they may be prefix-cache entries). Which pages a request may use, and which tensor a page id indexes, is its :class:`PageSpace` (one pool
across all layers, or one per layer: :mod:`rcstat_vllm.page_space`).

Everything here is plain torch on whatever device the cache lives on; it does not import vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from rcstat_vllm.page_space import PageSpace, cdiv, identity_pages



def key_value_pages(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of a CPU cache as head pages: keys ``[num_pages, D, N]`` and values ``[num_pages, N, D]``.

    vLLM's CPU kernels (ISAs ``vec``/``vec16``) store a page's keys transposed, channel-major (``[D, N]``),
    and its values token-major (``[N, D]``); ``rcstat_vllm/cpu_kv_layout.py`` checks this on the installed
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

    def unsupported_reason(self, kv_cache: Tensor) -> str | None:
        """Why the backend's attention kernels cannot run head-as-sequence over this cache tensor (checked once when
        the caches are bound: the engine then runs uncompressed, never failing mid-forward), or None."""
        return None

    #: Whether the prompt is scored by the Triton paged kernels (:mod:`rcstat_vllm.kernels`) when the cache is on
    #: a CUDA device; layouts without them score in torch (see ``compression.triton_scoring``).
    paged_kernels = False

    def key_value_caches(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values as ``[num_blocks, H, N, D]`` views (strided, no copy): what the paged scoring kernels
        and :func:`rcstat_vllm.kernels.paged.gather_paged_tokens` take, so a scorer reads only what it needs."""
        raise NotImplementedError


class CPUVecLayout(CacheLayout):
    """vLLM-CPU (``vec``/``vec16``): one tensor ``[num_blocks, H, N, 2D]``, see :func:`key_value_pages`."""

    def key_value_caches(self, kv_cache):
        num_blocks, num_heads, block_size, two_d = kv_cache.shape
        keys, values = key_value_pages(kv_cache)  # keys channel-major [pages, D, N]: transposed back
        keys = keys.view(num_blocks, num_heads, two_d // 2, block_size).transpose(2, 3)
        return keys, values.view(num_blocks, num_heads, block_size, two_d // 2)

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

    paged_kernels = True

    def key_value_caches(self, kv_cache):
        return kv_cache.split(kv_cache.shape[-1] // 2, dim=-1)  # each row: key then value

    def unsupported_reason(self, kv_cache):
        try:
            flash_head_page_caches(kv_cache)
        except ValueError as exc:
            return str(exc)
        return None

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
    if kv_cache.stride(3) != 1:
        raise ValueError(f"KV cache strides {kv_cache.stride()}: FlashAttention needs each head's row contiguous")
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


def compaction_order(pages_per_head: Tensor, space: PageSpace, reused: Tensor) -> list[int]:
    """The order :func:`compact_request` moves layers in: index order, or, when pooled pages land in blocks that
    still hold prompt KV (``reused``, the scheduler handed back the request's own blocks), the layers keeping fewest
    pages first. Then, with each layer's own slice of a reused block free once that layer is read, every layer finds
    enough free pages without reading ahead: after ``j`` of ``L`` layers, at most ``j / L`` of the pages are needed
    and at least ``j / L`` of every block are free (see :func:`assign_pages`)."""
    num_layers = pages_per_head.shape[0]
    if not (space.is_pooled and bool(reused.any())):
        return list(range(num_layers))
    return torch.sort(pages_per_head.sum(dim=1), stable=True).indices.tolist()


def assign_pages(
    kept: Tensor, dest_blocks: Tensor, space: PageSpace, reused: Tensor | None = None, order: Sequence[int] | None = None
) -> tuple[Tensor, list[Tensor]]:
    """Hand the pages of ``dest_blocks`` to the (layer, head)s: each takes ``ceil(kept / N)`` consecutive pages of
    its pool, the layers in ``order`` (default: index order), heads in order. A pool's pages are ordered block by
    block (:meth:`PageSpace.pool_pages`); where ``reused[i]`` (``dest_blocks[i]`` still holds prompt KV), a page of
    that block's slice of layer ``l`` only becomes free once ``l`` has been moved, so such pages go after the free
    ones, by when they free up, and a layer is never given a page whose prompt KV is still to be read.

    Returns:
        ``[L, H, max_pages]`` int64 page tables (-1 where a head has no page) and, per pool, its unused pages.
    """
    num_layers, num_heads = kept.shape
    order = list(range(num_layers)) if order is None else list(order)
    step = torch.empty(num_layers, dtype=torch.int64)
    step[order] = torch.arange(num_layers)  # when each layer is moved
    reused = torch.zeros(dest_blocks.numel(), dtype=torch.bool) if reused is None else reused.cpu()
    pages_per_head = (kept.to(torch.int64) + space.block_size - 1) // space.block_size
    # Host-side tables: the per-step bookkeeping (reserve, slots, pools) then never waits on the accelerator;
    # the worker's HeadPageTables (rcstat_vllm.page_tables) commits them to the cache's device once, then appends.
    tables = torch.full((num_layers, num_heads, max(int(pages_per_head.max()), 1)), -1, dtype=torch.int64)
    slot = torch.arange(tables.shape[2]).unsqueeze(0)
    unused = []
    for pool_index, layers in enumerate(space.pools):
        layers = sorted(layers, key=lambda layer: int(step[layer]))
        pool = space.pool_pages(pool_index, dest_blocks.cpu())  # [blocks, pool layers, H] flattened
        # Step from which each page may be written: 0, or (reused block) when its layer slice has been read.
        slice_step = step[list(space.pools[pool_index])].view(1, -1, 1)
        free_from = torch.where(reused.view(-1, 1, 1), slice_step, 0).expand(-1, -1, num_heads).reshape(-1)
        free_from, by_free = torch.sort(free_from, stable=True)
        pool = pool[by_free]
        counts = pages_per_head[layers].reshape(-1)  # in moving order, then head
        if int(counts.sum()) > pool.numel():
            raise ValueError(f"{int(counts.sum())} pages needed, {dest_blocks.numel()} blocks bring {pool.numel()}")
        first = torch.cumsum(counts, 0) - counts
        valid = slot < counts.unsqueeze(1)
        taken = (first.unsqueeze(1) + slot)[valid]
        takers = step[layers].repeat_interleave(num_heads).unsqueeze(1).expand_as(valid)[valid]
        if bool((free_from[taken] > takers).any()):
            raise RuntimeError("rcstat: compaction would overwrite prompt KV not yet moved (page order bug)")
        group = torch.full((counts.numel(), tables.shape[2]), -1, dtype=torch.int64)
        group[valid] = pool[taken]
        tables[layers] = group.view(len(layers), num_heads, -1)
        unused.append(pool[int(counts.sum()) :].clone())  # not a view: the pool's used part is freed
    return tables, unused


def compact_request(
    caches: Sequence[Tensor],
    source_row: Tensor,
    keep_masks: Sequence[Tensor],
    dest_blocks: Tensor,
    space: PageSpace,
    layout: CacheLayout = CPU_VEC,
    shared_blocks: int = 0,
) -> "CompactedRequest":
    """Copy each (layer, head)'s kept tokens (in order) from the request's uncompressed blocks into head pages of
    ``dest_blocks``, densely (copy on compact: the source blocks are never written, so blocks the prefix cache
    or another request still reads stay intact).

    One layer at a time: the extra memory is one layer's kept keys and values (and their indices). The destination
    blocks are fresh, except when the scheduler had to reuse blocks the request just gave back (memory was short):
    then sources and destinations may share blocks. Within one layer's own pages that is safe (the layer reads all
    its kept entries before writing); across layers (pooled pages) the layers move in :func:`compaction_order` and
    take only pages whose prompt KV has been moved (:func:`assign_pages`).

    Args:
        caches: per layer, its cache (``[num_blocks, H, N, 2D]``); a pooled space indexes its all-layers view.
        source_row: the request's block ids, uncompressed (at least ``cdiv(n, N)`` valid entries).
        keep_masks: per layer, ``[H, n]`` bool, the tokens each head keeps.
        dest_blocks: the fresh blocks the request keeps from now on (the scheduler's allocation).
        shared_blocks: the request's first blocks (prefix-cache hits) stay as they are, shared, every head keeping
            all their tokens (their masks must be all True): each head's pages start with them.

    Returns:
        The request's state from there on: it holds its shared blocks and ``dest_blocks``; its page tables
        (host, -1 = no page) and the pools of its unused pages.
    """
    block_size = space.block_size
    device = keep_masks[0].device
    num_tokens = keep_masks[0].shape[1]
    shared_tokens = shared_blocks * block_size
    if not all(bool(mask[:, :shared_tokens].all()) for mask in keep_masks):
        raise ValueError("rcstat: a shared (prefix-cache) block's tokens must be kept by every head")
    kept_all = torch.stack([mask.sum(dim=1) for mask in keep_masks]).cpu()
    keep_masks = [mask[:, shared_tokens:] for mask in keep_masks]
    shared = source_row[:shared_blocks].cpu()
    source_row = source_row[shared_blocks:]
    source_blocks = source_row[: cdiv(keep_masks[0].shape[1], block_size)].to(device=device, dtype=torch.int64)
    dest = dest_blocks.to(device=device, dtype=torch.int64)
    reused = torch.isin(dest, source_blocks).cpu()
    own_kept = kept_all - shared_tokens
    order = compaction_order((own_kept + block_size - 1) // block_size, space, reused)
    tables, unused = assign_pages(own_kept, dest_blocks, space, reused, order)
    if shared_blocks:
        prefix = torch.stack([space.identity(layer, shared) for layer in range(len(keep_masks))])  # [L, H, S]
        tables = torch.cat([prefix, tables], dim=2)
    device_tables = tables.to(device)
    for layer in order:
        _move_layer(space.cache(layer, caches[layer]), keep_masks[layer], space.identity(layer, source_blocks),
                    device_tables[layer, :, shared_blocks:], block_size, layout)
    return CompactedRequest.from_compaction(
        num_tokens, space, kept_all, tables, unused, shared_blocks + dest_blocks.numel()
    )


def _move_layer(cache: Tensor, mask: Tensor, source: Tensor, dest: Tensor, block_size: int, layout: CacheLayout) -> None:
    """Copy one layer's kept tokens (``mask`` ``[H, n]``) from its source pages ``[H, blocks]`` to slots ``0..k-1``
    of each head's destination pages ``[H, P]``: all are read before any is written, and every index tensor is
    dropped as soon as it has served, so the peak is the kept keys and values plus a few int64s per entry."""
    head_idx, token_idx = torch.nonzero(mask, as_tuple=True)
    keys, values = layout.read(cache, source[head_idx, token_idx // block_size], token_idx % block_size)  # copies
    del token_idx
    # The j-th kept token of head h goes to slot j of head h's own pages.
    counts = mask.sum(dim=1)
    rank = torch.arange(head_idx.numel(), device=mask.device) - (torch.cumsum(counts, 0) - counts)[head_idx]
    dest_pages = dest[head_idx, rank // block_size]
    del head_idx
    layout.write(cache, dest_pages, rank % block_size, keys, values)


def compact_layer(
    kv_cache: Tensor, source_row: Tensor, keep_mask: Tensor, dest_blocks: Tensor, layout: CacheLayout = CPU_VEC
) -> Tensor:
    """:func:`compact_request` of one layer on its own pages: ``[H, max_pages]`` page table."""
    _, num_heads, block_size = layout.shape(kv_cache)
    space = PageSpace.per_layer(1, num_heads, block_size)
    return compact_request([kv_cache], source_row, [keep_mask], dest_blocks, space, layout).tables[0]


def blocks_needed(kept: Tensor, num_tokens: int, space: PageSpace, shared_blocks: int = 0) -> int:
    """The fewest blocks a request can hold after compaction (see :class:`CompactedRequest`): its shared blocks,
    then the pages of its other kept tokens plus those the tokens still to come before vLLM appends its next block
    need, over each pool."""
    to_boundary = -num_tokens % space.block_size
    own = kept - shared_blocks * space.block_size
    pages_then = (own + to_boundary + space.block_size - 1) // space.block_size  # [L, H]
    return shared_blocks + min(space.blocks_for(pages_then), cdiv(num_tokens, space.block_size) - shared_blocks)


class PageTable(Protocol):
    """A compressed request's page table ``[L, H, P]``: its own on the host (:class:`HostPageTable`) until the worker
    attaches it to its resident tables, then a slot there (:class:`rcstat_vllm.page_tables.ResidentTable`)."""

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
    host until the worker attaches it to its :class:`~rcstat_vllm.page_tables.HeadPageTables`
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
        cls, num_tokens: int, space: PageSpace, kept: Tensor, tables: Tensor, unused: list[Tensor], keep_blocks: int
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
            absorbed_blocks=cdiv(num_tokens, space.block_size),
        )
        state._count_pages((tables >= 0).sum(dim=2))
        return state

    @property
    def tables(self) -> Tensor:
        """``[L, H, width]`` int64 page table (-1 = no page), on the host."""
        return self.table.pages(self.width)

    @property
    def length_base(self) -> Tensor:
        """``[L, H]``: a head attends over ``length_base + n`` tokens when the request holds ``n``."""
        return self.kept - self.num_compacted_tokens

    def attach_to(self, resident) -> None:
        """Hand the page table to the worker's :class:`~rcstat_vllm.page_tables.HeadPageTables`: from now on it is a
        slot there (given back by the table's ``release``)."""
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
            return  # the common case: every head still has room in its last page
        needed = (self.lengths(num_tokens) + self.block_size - 1) // self.block_size
        layers, heads = torch.nonzero(needed > self.page_counts, as_tuple=True)
        have = self.page_counts[layers, heads]
        counts = needed[layers, heads] - have
        pages = []
        for layer, count in zip(layers.tolist(), counts.tolist()):  # pools hand pages out in (layer, head) order
            pool = self.pools[self.space.pool_of(layer)]
            if len(pool) < count:
                raise RuntimeError("rcstat: head-page pool exhausted (block accounting bug)")
            pages.extend(pool.popleft() for _ in range(count))
        self._write_pages(
            layers.repeat_interleave(counts), heads.repeat_interleave(counts), ranges(have, counts), torch.tensor(pages)
        )
        self._count_pages(torch.maximum(self.page_counts, needed))

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
        pages = torch.gather(self.tables, 2, (index // self.block_size).transpose(1, 2)).transpose(1, 2)
        return pages * self.block_size + index % self.block_size


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
