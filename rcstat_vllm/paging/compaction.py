"""Compaction: copy each (layer, KV head)'s kept tokens into its own head pages, and the blocks that takes.

An uncompressed request's head ``h`` uses pages ``row[j] * H + h`` of its blocks (the identity map,
:mod:`rcstat_vllm.paging.kv_layout`). Compaction copies every (layer, head)'s kept tokens into its own page list in
``keep_blocks`` blocks the scheduler allocated (:func:`compact_request`), filled densely, so a head keeping k tokens
needs ``ceil(k / N)`` pages; the prompt's blocks go back to vLLM untouched (they may be prefix-cache entries). Which
pages a request may use, and which tensor a page id indexes, is its :class:`PageSpace` (one pool across all layers,
or one per layer: :mod:`rcstat_vllm.paging.page_space`). The result is the request's page bookkeeping,
:class:`~rcstat_vllm.paging.head_pages.CompactedRequest`.

Plain torch on whatever device the cache lives on; it does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CPU_VEC, CacheLayout
from rcstat_vllm.paging.page_space import PageSpace, cdiv, div_mod, identity_pages

#: Kept entries (keys, values and their int64 indices) copied in one gather and one scatter, across the layers of a
#: pooled space (they all index one all-layers tensor). A layer's copy is a dozen small tensor ops whatever its size,
#: so a short prompt's copy is mostly per-op overhead times the layer count; grouping layers up to this size pays it
#: once per group, while the extra memory stays at most this or one layer's kept entries, whichever is larger.
COPY_GROUP_BYTES = 4 << 20
#: int64 indices held per kept entry while it is copied (head, token, page, offset and the rank of the write)
_INDEX_BYTES_PER_ENTRY = 5 * 8


def gather_prompt(
    kv_cache: Tensor, block_row: Tensor, num_tokens: int, layout: CacheLayout = CPU_VEC
) -> tuple[Tensor, Tensor]:
    """Keys and values ``[H, n, D]`` of an uncompressed request's first ``n`` tokens."""
    _, num_heads, block_size = layout.shape(kv_cache)
    blocks, offsets = div_mod(torch.arange(num_tokens, device=kv_cache.device), block_size)
    pages = identity_pages(block_row[: cdiv(num_tokens, block_size)], num_heads)[:, blocks]
    return layout.read(kv_cache, pages, offsets.expand_as(pages))


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
    kept: Tensor,
    dest_blocks: Tensor,
    space: PageSpace,
    reused: Tensor | None = None,
    order: Sequence[int] | None = None,
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
    # the worker's HeadPageTables (rcstat_vllm.paging.page_tables) commits them to the cache's device once, then
    # appends.
    tables = torch.full((num_layers, num_heads, max(int(pages_per_head.max()), 1)), -1, dtype=torch.int64)
    slot = torch.arange(tables.shape[2]).unsqueeze(0)
    unused = []
    for pool_index, pool_layers in enumerate(space.pools):
        layers = sorted(pool_layers, key=lambda layer: int(step[layer]))
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
) -> CompactedRequest:
    """Copy each (layer, head)'s kept tokens (in order) from the request's uncompressed blocks into head pages of
    ``dest_blocks``, densely (copy on compact: the source blocks are never written, so blocks the prefix cache
    or another request still reads stay intact).

    A run of layers at a time (:func:`copy_groups`): the extra memory is :data:`COPY_GROUP_BYTES` or one layer's kept
    keys and values (and their indices), whichever is larger. The destination
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
    _check_shared_kept(keep_masks, shared_tokens)
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
    for group in copy_groups(order, own_kept.sum(dim=1).tolist(), space, caches[0]):
        _move_layer(
            space.cache(group[0], caches[group[0]]),
            _stack_heads([keep_masks[layer] for layer in group]),
            torch.cat([space.identity(layer, source_blocks) for layer in group]),
            torch.cat([device_tables[layer, :, shared_blocks:] for layer in group]),
            block_size,
            layout,
        )
    return CompactedRequest.from_compaction(
        num_tokens, space, kept_all, tables, unused, shared_blocks + dest_blocks.numel(), shared_blocks
    )


def recompact_request(
    caches: Sequence[Tensor],
    state: CompactedRequest,
    num_tokens: int,
    keep_masks: Sequence[Tensor],
    dest_blocks: Tensor,
    layout: CacheLayout = CPU_VEC,
    staged: bool = False,
) -> CompactedRequest:
    """Compact a request that is compacted already (decode-time compression: its heads evict generated tokens
    too): each (layer, head) keeps the entries of its own page list that ``keep_masks`` name, copied densely, in
    order, into head pages of ``dest_blocks``, as :func:`compact_request` does for an uncompressed request.

    The sources are the request's head pages (``state``'s page table), not a block row: a head's entry ``j`` is its
    ``j``-th stored token (its kept prompt first, then everything stored since), so heads may hold different tokens.

    Args:
        state: the request's pages, reserved for ``num_tokens`` tokens (every head has a page for each of its
            ``state.lengths(num_tokens)`` entries).
        keep_masks: per layer, ``[H, m]`` bool over each head's entries, ``m`` at least the longest head's length,
            False past a head's length; the entries of its shared (prefix-cache) blocks must be kept (they stay
            where they are, shared).
        dest_blocks: the blocks the request holds afterwards (besides its shared ones).
        staged: some of ``dest_blocks`` are the request's own (the pool was short and the scheduler handed them
            back): every layer's kept entries are read before any is written (the extra memory is the request's kept
            entries, its prompt's and ``decode_budget`` per head). Otherwise they are fresh and each layer moves as it
            is read, one layer's entries at a time.

    Returns:
        The request's state from there on: its shared blocks and ``dest_blocks``.
    """
    space, block_size, shared_blocks = state.space, state.block_size, state.shared_blocks
    shared_tokens = shared_blocks * block_size
    lengths = state.lengths(num_tokens)
    for layer, mask in enumerate(keep_masks):
        beyond = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= lengths[layer].to(
            mask.device
        ).unsqueeze(1)
        if mask.shape[1] < int(lengths[layer].max()) or bool((mask & beyond).any()):
            raise ValueError(f"rcstat: layer {layer}'s keep mask must cover each head's entries and nothing past them")
    _check_shared_kept(keep_masks, shared_tokens)
    kept_all = torch.stack([mask.sum(dim=1) for mask in keep_masks]).cpu()
    tables, unused = assign_pages(kept_all - shared_tokens, dest_blocks, space)
    old_tables = state.tables
    if shared_blocks:
        tables = torch.cat([old_tables[:, :, :shared_blocks], tables], dim=2)
    device = keep_masks[0].device
    sources, dests = old_tables.to(device), tables.to(device)
    groups = copy_groups(range(len(keep_masks)), (kept_all - shared_tokens).sum(dim=1).tolist(), space, caches[0])
    moves = [
        (
            space.cache(group[0], caches[group[0]]),
            _stack_heads([keep_masks[layer][:, shared_tokens:] for layer in group]),
            torch.cat([sources[layer, :, shared_blocks:] for layer in group]),
            torch.cat([dests[layer, :, shared_blocks:] for layer in group]),
        )
        for group in groups
    ]
    if staged:
        read = [_read_kept(cache, mask, source, block_size, layout) for cache, mask, source, _ in moves]
        for (cache, mask, _, dest), entries in zip(moves, read):
            _write_kept(cache, mask, dest, entries, block_size, layout)
    else:
        for cache, mask, source, dest in moves:
            _move_layer(cache, mask, source, dest, block_size, layout)
    return CompactedRequest.from_compaction(
        num_tokens, space, kept_all, tables, unused, shared_blocks + dest_blocks.numel(), shared_blocks
    )


def copy_groups(order: Sequence[int], kept_entries: Sequence[int], space: PageSpace, cache: Tensor) -> list[list[int]]:
    """The layers of ``order`` in runs that are copied together (one gather, one scatter each): consecutive layers
    whose kept entries (``kept_entries[layer]``, over its heads) fit :data:`COPY_GROUP_BYTES`, a layer alone when it
    does not; each layer alone when the space is not pooled (then every layer's pages index its own tensor).

    Copying a run in one go is safe wherever copying its layers one by one in ``order`` is: the run reads all its
    entries before writing any, so a page a layer of the run frees is read before any layer writes it."""
    order = list(order)
    if not space.is_pooled:
        return [[layer] for layer in order]
    entry_bytes = cache.shape[-1] * cache.element_size() + _INDEX_BYTES_PER_ENTRY  # a key and a value: 2D elements
    groups: list[list[int]] = []
    group_bytes = 0
    for layer in order:
        layer_bytes = int(kept_entries[layer]) * entry_bytes
        if groups and group_bytes + layer_bytes <= COPY_GROUP_BYTES:
            groups[-1].append(layer)
            group_bytes += layer_bytes
        else:
            groups.append([layer])
            group_bytes = layer_bytes
    return groups


def _stack_heads(masks: Sequence[Tensor]) -> Tensor:
    """Keep masks of several layers as one of ``sum H`` heads (a layer's heads after the previous layer's), the
    narrower ones padded with False: the copy then treats a run of layers as one layer with more heads."""
    if len(masks) == 1:
        return masks[0]
    width = max(mask.shape[1] for mask in masks)
    return torch.cat([torch.nn.functional.pad(mask, (0, width - mask.shape[1])) for mask in masks])


def _check_shared_kept(keep_masks: Sequence[Tensor], shared_tokens: int) -> None:
    """A request's shared (prefix-cache) blocks stay as they are: every head must keep all their tokens."""
    if not all(bool(mask[:, :shared_tokens].all()) for mask in keep_masks):
        raise ValueError("rcstat: a shared (prefix-cache) block's tokens must be kept by every head")


def _move_layer(
    cache: Tensor, mask: Tensor, source: Tensor, dest: Tensor, block_size: int, layout: CacheLayout
) -> None:
    """Copy one layer's kept tokens (``mask`` ``[H, n]``) from its source pages ``[H, blocks]`` to slots ``0..k-1``
    of each head's destination pages ``[H, P]``: all are read before any is written, and every index tensor is
    dropped as soon as it has served, so the peak is the kept keys and values plus a few int64s per entry."""
    _write_kept(cache, mask, dest, _read_kept(cache, mask, source, block_size, layout), block_size, layout)


def _read_kept(cache: Tensor, mask: Tensor, source: Tensor, block_size: int, layout: CacheLayout):
    """One layer's kept entries (``mask`` ``[H, n]`` over the pages ``source`` ``[H, blocks]``): (keys, values)
    copies, heads in order, each head's entries in order."""
    head_idx, token_idx = torch.nonzero(mask, as_tuple=True)
    blocks, offsets = div_mod(token_idx, block_size)
    return layout.read(cache, source[head_idx, blocks], offsets)


def _write_kept(cache: Tensor, mask: Tensor, dest: Tensor, entries, block_size: int, layout: CacheLayout) -> None:
    """Write what :func:`_read_kept` read: the j-th kept token of head h to slot j of head h's pages ``dest``."""
    counts = mask.sum(dim=1)
    head_idx = torch.repeat_interleave(torch.arange(mask.shape[0], device=mask.device), counts)
    rank = torch.arange(head_idx.numel(), device=mask.device) - (torch.cumsum(counts, 0) - counts)[head_idx]
    page_index, offsets = div_mod(rank, block_size)
    dest_pages = dest[head_idx, page_index]
    del head_idx, page_index
    layout.write(cache, dest_pages, offsets, *entries)


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
    pages_then = (
        own_slots(kept, num_tokens, space.block_size, shared_blocks) + space.block_size - 1
    ) // space.block_size
    return shared_blocks + min(space.blocks_for(pages_then), cdiv(num_tokens, space.block_size) - shared_blocks)


def own_slots(kept: Tensor, num_tokens: int, block_size: int, shared_blocks: int = 0) -> Tensor:
    """The slots each head needs in its own pages when it keeps ``kept`` entries (``[L, H]``, the tokens of its first
    ``shared_blocks`` blocks included: they stay in those blocks) at ``num_tokens`` tokens: those entries, and room for
    the tokens still to come before vLLM appends the request's next block."""
    return kept - shared_blocks * block_size + (-num_tokens % block_size)


def page_aligned_counts(
    chosen: Tensor, held: Tensor, page_size: int, low: Tensor, high: Tensor, max_pages: int
) -> Tensor:
    """The counts ``chosen`` ``[H]`` (the entries a selection gave each head of a page pool: a layer's, or every
    layer's when pooled) moved to page boundaries, so that the heads take no more pages than their entries fill
    packed together.

    A head keeping ``c`` entries besides ``held`` others on its pages (``[H]``: what it keeps whatever its count, and
    the slots of the tokens still to come before vLLM's next block: :func:`own_slots` of what it keeps) takes
    ``ceil((c + held) / page_size)`` pages: heads keeping uneven counts each leave a partial page, half a page per head
    on average, about half a block per request over every layer's heads (SmolLM2: 90 pages a block). Here each head
    first takes the fewest pages that hold the ``low`` entries it must keep; a head whose selection fills no more
    than those keeps them, and the other heads take the pages their entries fill packed together,
    ``ceil(sum(c + held) / page_size)`` over them, given out one at a time, each to the head whose next page its
    selection fills most (``(c + held) / page_size`` minus the pages it has; ties: the lower head). So every page a
    selection filled whole is kept, the fullest partial pages are filled with their heads' next best entries and the
    others given up, and every head fills the pages it takes (up to ``high``): the heads keep at least ``chosen`` and,
    over the heads not held at their minimum, under a page more. ``low <= count <= high`` per head (the entries it
    must keep, those it has); ``max_pages`` (a host int, so that nothing is read back: ``cdiv(max(high), page_size) +
    1`` or more) bounds the pages a head takes beyond its fewest. Tensor ops on the counts' device: no host
    synchronisation."""
    device = chosen.device
    filled = chosen + held
    fewest = torch.div(low + held + page_size - 1, page_size, rounding_mode="floor")
    most = torch.div(high + held + page_size - 1, page_size, rounding_mode="floor")
    # A head whose minimum takes more pages than its selection fills keeps those pages (and fills them); the others'
    # entries are packed. (Packing them into the minimum heads' spare slots instead takes pages from the heads the
    # selection chose entries for, for entries it did not choose: RC at 0.9 then found 39 needle values of 80
    # instead of 52, accuracy_prompt_page_aligned_ab_seed62_cpu.json.gz.)
    held_up = fewest * page_size > filled
    packed = torch.div(filled.masked_fill(held_up, 0).sum() + page_size - 1, page_size, rounding_mode="floor")
    to_give = packed + fewest.masked_fill(~held_up, 0).sum() - fewest.sum()
    # Page fewest[h] + 1 + j of head h is worth what the selection put on it: filled / page - (fewest + j), > 0 where
    # the selection put entries on it (>= 1 when a whole page); per head it falls with j, so the best pages of the
    # pool are each head's first ones.
    extra = torch.arange(max_pages, device=device)
    worth = filled.unsqueeze(1).to(torch.float64) / page_size - (fewest.unsqueeze(1) + extra)
    usable = (worth > 0) & (fewest.unsqueeze(1) + extra < most.unsqueeze(1))
    worth = worth.masked_fill(~usable, float("-inf")).flatten()
    order = torch.sort(worth, descending=True, stable=True).indices
    given = (
        torch.empty_like(usable.flatten()).scatter_(0, order, torch.arange(worth.numel(), device=device) < to_give)
        & usable.flatten()
    )
    taken = fewest + given.view_as(usable).sum(dim=1)
    return torch.minimum(taken * page_size - held, high)


def top_per_row(priority: Tensor, counts: Tensor) -> Tensor:
    """``[H, n]`` mask of each row's ``counts[h]`` highest ``priority`` entries (ties: the lower index), the order
    :func:`~rcstat_vllm.scoring.select_budget` breaks ties in, so the rows' top counts of its own mask are its mask."""
    order = torch.sort(priority, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(priority.shape[1], device=order.device).expand_as(order)
    )
    return ranks < counts.unsqueeze(1)


def resize_rows(mask: Tensor, priority: Tensor, counts: Tensor, read_back: bool | None = None) -> Tensor:
    """``mask`` ``[H, n]`` with row h holding ``counts[h]`` entries: a row with more gives up its lowest-``priority``
    entries (ties: the later first), one with fewer takes its best others (ties: the earlier first), as
    :func:`top_per_row` breaks ties, so a mask that is each row's top entries stays so. The counts must be within
    what each row can give or take (the page alignment's ``low`` and ``high``: forced entries at +inf priority
    are never given up).

    Each side is cut at its row's ``counts``-th value from a ``topk`` as wide as the largest change: where
    ``read_back`` (default: on a CPU, where reading costs no wait) that width is read back, else it is the row (one
    sort's work, no synchronisation: the path a GPU takes, which the tests run on CPU tensors)."""
    if read_back is None:
        read_back = mask.device.type == "cpu"
    have = torch.count_nonzero(mask, dim=1)
    take, give = (counts - have).clamp_min(0), (have - counts).clamp_min(0)
    width = mask.shape[1]
    most_taken, most_given = (int(take.max()), int(give.max())) if read_back and width else (width, width)
    taken = _first_per_row(priority.masked_fill(mask, float("-inf")), take, most_taken, True, read_back)
    given = _first_per_row(priority.masked_fill(~mask, float("inf")), give, most_given, False, read_back)
    return (mask & ~given) | taken


def _first_per_row(priority: Tensor, counts: Tensor, most: int, largest: bool, read_back: bool) -> Tensor:
    """``[H, n]`` mask of each row's ``counts[h]`` highest (``largest``; ties: the lower index) or lowest (ties: the
    higher index) ``priority`` entries; the entries at -inf (+inf for the lowest) are never chosen, and ``counts``
    are no more than a row's others nor than ``most``. ``read_back``: see :func:`resize_rows`."""
    if most == 0:
        return torch.zeros_like(priority, dtype=torch.bool)
    cut = torch.topk(priority, min(most, priority.shape[1]), dim=1, largest=largest).values
    threshold = cut.gather(1, (counts - 1).clamp_min(0).unsqueeze(1))
    beyond = priority > threshold if largest else priority < threshold
    ties = priority == threshold
    room = (counts - torch.count_nonzero(beyond, dim=1)).unsqueeze(1)
    tied = torch.count_nonzero(ties, dim=1).unsqueeze(1)
    chosen = (counts > 0).unsqueeze(1)
    # (reading back, the ties are counted only where a row has more than it takes)
    if not read_back or bool(((tied > room) & chosen).any()):
        seen = torch.cumsum(ties, dim=1) if largest else tied - torch.cumsum(ties, dim=1) + ties
        ties = ties & (seen <= room)
    return (beyond | ties) & chosen
