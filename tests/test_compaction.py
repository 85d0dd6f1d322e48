"""Compaction (rcstat_vllm.paging.compaction.compact_request, recompact_request): exact contents whatever blocks the
scheduler hands back, whether the layers are copied one by one or in runs, and the peak extra memory of compacting a
long prompt (no engine, no vLLM kernels)."""

import sys
from pathlib import Path

import pytest
import torch

import rcstat_vllm.paging.compaction as compaction
from rcstat_vllm.paging.compaction import (
    assign_pages,
    blocks_needed,
    compact_request,
    compaction_order,
    copy_groups,
    page_aligned_counts,
    recompact_request,
    resize_rows,
    top_per_row,
)
from rcstat_vllm.paging.kv_layout import CPU_VEC
from rcstat_vllm.paging.page_space import PageSpace, cdiv, div_mod, pooled_space_or_reason
from rcstat_vllm.scoring import forced_keep_mask, select_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.compaction_memory import measure_in_fresh_process

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 5, 64, 2, 16, 8


@pytest.fixture(params=["layer_by_layer", "runs", "all_layers"])
def copy_runs(request, monkeypatch):
    """The copy one layer at a time, in runs of layers (the default size), or every layer in one run."""
    size = {"layer_by_layer": 0, "runs": compaction.COPY_GROUP_BYTES, "all_layers": 1 << 40}[request.param]
    monkeypatch.setattr(compaction, "COPY_GROUP_BYTES", size)
    return request.param


def _pooled(generator):
    backing = torch.randn(LAYERS * BLOCKS, HEADS, BLOCK, 2 * DIM, generator=generator)
    caches = list(backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM).unbind(0))
    space, reason = pooled_space_or_reason(caches, HEADS, BLOCK)
    assert reason is None
    return backing, caches, space


@pytest.mark.parametrize("seed", range(12))
def test_pooled_compaction_into_its_own_blocks_moves_every_kept_token_exactly(seed, copy_runs):
    """Layers keep very different shares (one may keep all, one almost nothing); the destinations are a random mix
    of the request's own prompt blocks (each still holding every layer's prompt KV) and fresh ones. Every head reads
    back exactly its kept tokens, in order, and no block outside the destinations is written."""
    g = torch.Generator().manual_seed(seed)
    backing, caches, space = _pooled(g)
    original = backing.clone()
    n = int(torch.randint(5 * BLOCK, 24 * BLOCK, (1,), generator=g))
    shares = torch.rand(LAYERS, 1, generator=g) ** 2
    shares[int(torch.randint(LAYERS, (1,), generator=g))] = 1.0
    masks = [torch.rand(HEADS, n, generator=g) < shares[layer] for layer in range(LAYERS)]
    blocks = torch.randperm(BLOCKS - 1, generator=g) + 1
    row, free = blocks[: cdiv(n, BLOCK)], blocks[cdiv(n, BLOCK) :]
    keep_blocks = blocks_needed(torch.stack([m.sum(1) for m in masks]), n, space)
    reused = int(torch.randint(1, keep_blocks + 1, (1,), generator=g))
    dest = torch.cat([row[torch.randperm(row.numel(), generator=g)[:reused]], free[: keep_blocks - reused]])
    dest = dest[torch.randperm(dest.numel(), generator=g)]

    state = compact_request(caches, row, masks, dest, space)

    tokens = torch.arange(n)
    for layer, mask in enumerate(masks):
        for h in range(HEADS):
            kept = tokens[mask[h]]
            slots = torch.arange(kept.numel())
            got = CPU_VEC.read(space.all_layers, state.tables[layer, h, slots // BLOCK], slots % BLOCK)
            want = CPU_VEC.read(original, space.identity(layer, row)[h, kept // BLOCK], kept % BLOCK)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    untouched = torch.ones(BLOCKS, dtype=torch.bool)
    untouched[dest] = False
    assert torch.equal(backing.view(LAYERS, BLOCKS, -1)[:, untouched], original.view(LAYERS, BLOCKS, -1)[:, untouched])


def _entries(space, state, layer, head, count):
    """A head's first ``count`` stored entries (keys, values), read through its page table."""
    slots = torch.arange(count)
    return CPU_VEC.read(space.all_layers, state.tables[layer, head, slots // BLOCK], slots % BLOCK)


@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("seed", range(6))
def test_recompaction_keeps_each_heads_chosen_entries_from_its_own_pages(seed, shared, copy_runs):
    """Decode-time compaction of a request compacted already: its heads hold different numbers of entries (their
    kept prompt, then the tokens stored since, some in blocks vLLM appended). After recompaction every head reads
    back exactly the entries its new mask names, in order; the shared (prefix-cache) blocks stay its first pages;
    nothing outside the fresh blocks is written; it holds exactly the blocks ``blocks_needed`` predicts."""
    g = torch.Generator().manual_seed(seed)
    backing, caches, space = _pooled(g)
    n = int(torch.randint(5 * BLOCK, 12 * BLOCK, (1,), generator=g))
    blocks = torch.randperm(BLOCKS - 1, generator=g) + 1
    row, free = blocks[: cdiv(n, BLOCK)], blocks[cdiv(n, BLOCK) :]
    masks = [torch.rand(HEADS, n, generator=g) < 0.5 for _ in range(LAYERS)]
    for mask in masks:
        mask[:, : shared * BLOCK] = True
    keep = blocks_needed(torch.stack([m.sum(1) for m in masks]), n, space, shared)
    state = compact_request(caches, row, masks, free[: keep - shared], space, shared_blocks=shared)
    free = free[keep - shared :]
    t = n + int(torch.randint(1, 3 * BLOCK, (1,), generator=g))  # generated since, in blocks vLLM appended
    appended = free[: cdiv(t, BLOCK) - cdiv(n, BLOCK)]
    free = free[appended.numel() :]
    state.reserve(t, torch.cat([row, appended]))
    lengths = state.lengths(t)
    before = {
        (layer, h): _entries(space, state, layer, h, int(lengths[layer, h]))
        for layer in range(LAYERS)
        for h in range(HEADS)
    }
    width = int(lengths.max())
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(2)  # [L, H, width]
    new_masks = [(torch.rand(HEADS, width, generator=g) < 0.4) & within[layer] for layer in range(LAYERS)]
    for mask in new_masks:
        mask[:, : shared * BLOCK] = True
    kept = torch.stack([m.sum(1) for m in new_masks])
    keep2 = blocks_needed(kept, t, space, shared)
    dest = free[: keep2 - shared]
    original = backing.clone()

    after = recompact_request(caches, state, t, new_masks, dest)

    assert after.keep_blocks == keep2 and torch.equal(after.kept, kept) and after.shared_blocks == shared
    assert torch.equal(after.tables[:, :, :shared], state.tables[:, :, :shared])
    for (layer, head), (keys, values) in before.items():
        chosen = new_masks[layer][head, : keys.shape[0]]
        got_keys, got_values = _entries(space, after, layer, head, int(kept[layer, head]))
        assert torch.equal(got_keys, keys[chosen]) and torch.equal(got_values, values[chosen])
    untouched = torch.ones(BLOCKS, dtype=torch.bool)
    untouched[dest] = False
    assert torch.equal(backing.view(LAYERS, BLOCKS, -1)[:, untouched], original.view(LAYERS, BLOCKS, -1)[:, untouched])
    after.reserve(t + BLOCK, torch.cat([row, appended, free[keep2 - shared : keep2 - shared + 2]]))  # grows on


@pytest.mark.parametrize("seed", range(4))
def test_staged_recompaction_into_the_requests_own_blocks_is_exact(seed, copy_runs):
    """Under pressure the scheduler hands a decode-time compaction the request's own blocks back: staged, every head
    still reads back exactly the entries its mask names (all are read before any is written)."""
    g = torch.Generator().manual_seed(seed)
    _backing, caches, space = _pooled(g)
    n = int(torch.randint(6 * BLOCK, 12 * BLOCK, (1,), generator=g))
    blocks = torch.randperm(BLOCKS - 1, generator=g) + 1
    row = blocks[: cdiv(n, BLOCK)]
    masks = [torch.rand(HEADS, n, generator=g) < 0.7 for _ in range(LAYERS)]
    keep = blocks_needed(torch.stack([m.sum(1) for m in masks]), n, space)
    own = blocks[cdiv(n, BLOCK) : cdiv(n, BLOCK) + keep]
    state = compact_request(caches, row, masks, own, space)
    lengths = state.lengths(n)
    before = {
        (layer, h): _entries(space, state, layer, h, int(lengths[layer, h]))
        for layer in range(LAYERS)
        for h in range(HEADS)
    }
    width = int(lengths.max())
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(2)
    new_masks = [(torch.rand(HEADS, width, generator=g) < 0.5) & within[layer] for layer in range(LAYERS)]
    kept = torch.stack([m.sum(1) for m in new_masks])
    dest = own[torch.randperm(own.numel(), generator=g)][: blocks_needed(kept, n, space)]  # its own blocks, shuffled
    after = recompact_request(caches, state, n, new_masks, dest, staged=True)
    for (layer, head), (keys, values) in before.items():
        chosen = new_masks[layer][head, : keys.shape[0]]
        got_keys, got_values = _entries(space, after, layer, head, int(kept[layer, head]))
        assert torch.equal(got_keys, keys[chosen]) and torch.equal(got_values, values[chosen])


def test_recompaction_refuses_masks_past_a_heads_entries_or_dropping_shared_tokens():
    g = torch.Generator().manual_seed(0)
    _, caches, space = _pooled(g)
    n = 4 * BLOCK
    masks = [torch.ones(HEADS, n, dtype=torch.bool) for _ in range(LAYERS)]
    masks[0][1, 3 * BLOCK :] = False  # head 1 of layer 0 keeps fewer entries than the others
    state = compact_request(caches, torch.arange(1, 5), masks, torch.arange(10, 14), space, shared_blocks=1)
    full = [torch.ones(HEADS, n, dtype=torch.bool) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="nothing past them"):
        recompact_request(caches, state, n, full, torch.arange(20, 24))
    ok = [m.clone() for m in masks]
    ok[2][0, 0] = False  # a shared token
    with pytest.raises(ValueError, match="shared"):
        recompact_request(caches, state, n, ok, torch.arange(20, 24))


def test_a_layer_never_takes_a_page_whose_prompt_kv_is_still_to_be_moved():
    """The order and the page assignment themselves: every destination block is one of the request's own, layer 0
    keeps everything and the others little. In index order layer 0 would need pages of later layers' slices (the old
    code read every layer first to allow that); the fewest-first order never does."""
    space = PageSpace.pooled(torch.empty(0), [layer * BLOCKS * HEADS for layer in range(3)], HEADS, BLOCK)
    kept = torch.tensor([[160, 160], [16, 16], [32, 16]])  # pages [[10, 10], [1, 1], [2, 1]]: 25 of 4 blocks' 24+
    pages = (kept + BLOCK - 1) // BLOCK
    dest = torch.tensor([7, 3, 9, 5, 2])
    reused = torch.ones(dest.numel(), dtype=torch.bool)
    order = compaction_order(pages, space, reused)
    assert order == [1, 2, 0]
    tables, _ = assign_pages(kept, dest, space, reused, order)
    step = {layer: i for i, layer in enumerate(order)}
    for layer in range(3):
        for page in tables[layer][tables[layer] >= 0].tolist():
            slice_layer = page // (BLOCKS * HEADS)
            assert step[slice_layer] <= step[layer]  # that slice's prompt KV was moved before (or is this layer's)
    with pytest.raises(RuntimeError, match="not yet moved"):
        assign_pages(kept, dest, space, reused, [0, 1, 2])


def test_per_layer_pages_keep_index_order_and_fresh_destinations_change_nothing():
    """Without pooling, or with fresh destinations, the layers move in index order and take pages as before."""
    space = PageSpace.pooled(torch.empty(0), [0, BLOCKS * HEADS], HEADS, BLOCK)
    pages = torch.tensor([[3, 3], [1, 1]])
    assert compaction_order(pages, space, torch.zeros(3, dtype=torch.bool)) == [0, 1]
    assert compaction_order(pages, PageSpace.per_layer(2, HEADS, BLOCK), torch.ones(3, dtype=torch.bool)) == [0, 1]
    tables, _ = assign_pages(pages * BLOCK, torch.tensor([4, 6]), space)
    assert tables[0, 0, :3].tolist() == [8, 9, BLOCKS * HEADS + 8]  # block 4's pages of layer 0, then of layer 1


@pytest.mark.parametrize("destination", ["fresh", "reused"])
def test_compacting_a_long_prompt_needs_at_most_one_layer_of_kept_kv_extra(destination):
    """8k tokens at 30 layers, per-layer kept shares between 0.3 and 0.9, measured in a fresh process (resident
    memory high-water mark): the peak above the cache stays within 1.3x the largest layer's kept keys and values,
    whether the destinations are fresh or the request's own blocks (before: every layer's, 24x). The benchmark's
    target is 1.2x; the same measurement repeated on a busy machine spread over 1.15-1.21x, hence the margin. (Runs
    of layers copied together stay within ``COPY_GROUP_BYTES``, below the largest of these layers' kept entries.)"""
    row = measure_in_fresh_process(
        tokens=8192, layers=30, heads=2, head_dim=64, dtype="float32", destination=destination
    )
    assert row["blocks_kept"] < cdiv(8192, 16)
    assert row["largest_layer_kept_kv_bytes"] >= compaction.COPY_GROUP_BYTES
    assert row["peak_extra_bytes"] <= 1.3 * row["largest_layer_kept_kv_bytes"], row
    assert row["peak_extra_bytes"] < 0.1 * row["all_layers_kept_kv_bytes"], row


def test_copy_runs_follow_the_order_and_stay_within_their_size(monkeypatch):
    """Consecutive layers of the copy order, each run's kept entries within ``COPY_GROUP_BYTES`` unless a layer alone
    exceeds it; without pooling every layer is its own run (its pages index its own tensor)."""
    cache = torch.empty(1, HEADS, BLOCK, 2 * DIM)  # an entry: 2 * DIM floats + its int64 indices
    entry = 2 * DIM * 4 + compaction._INDEX_BYTES_PER_ENTRY
    monkeypatch.setattr(compaction, "COPY_GROUP_BYTES", 100 * entry)
    pooled = PageSpace.pooled(torch.empty(0), [layer * BLOCKS * HEADS for layer in range(6)], HEADS, BLOCK)
    kept = [40, 50, 10, 250, 30, 60]
    assert copy_groups([2, 0, 1, 3, 4, 5], kept, pooled, cache) == [[2, 0, 1], [3], [4, 5]]
    assert copy_groups(range(6), kept, PageSpace.per_layer(6, HEADS, BLOCK), cache) == [[i] for i in range(6)]
    monkeypatch.setattr(compaction, "COPY_GROUP_BYTES", 0)
    assert copy_groups(range(6), kept, pooled, cache) == [[i] for i in range(6)]


def test_cpu_layout_reads_what_it_writes():
    cache = torch.zeros(4, HEADS, BLOCK, 2 * DIM)
    keys, values = torch.randn(3, DIM), torch.randn(3, DIM)
    pages, offsets = torch.tensor([1, 5, 7]), torch.tensor([0, 15, 3])
    CPU_VEC.write(cache, pages, offsets, keys, values)
    got_keys, got_values = CPU_VEC.read(cache, pages, offsets)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


@pytest.mark.parametrize("size", [1, 2, 16, 32, 48, 528])
def test_div_mod_is_floor_division_and_remainder_for_every_size(size):
    """Shift and mask for powers of two, division otherwise: the same pages and offsets as ``//`` and ``%``,
    negative indices included, in the index dtype."""
    index = torch.arange(-3 * size - 5, 5 * size + 7)
    quotient, remainder = div_mod(index, size)
    assert torch.equal(quotient, index // size) and torch.equal(remainder, index % size)
    assert quotient.dtype == remainder.dtype == index.dtype


def test_page_aligned_counts_take_the_fewest_pages_the_entries_fill():
    """Heads with uneven counts each leave a partial page; moved to page boundaries (the fullest partial pages filled,
    the others given up) they take ceil(entries / page) pages, fill every page they take, keep fewer than a page more
    in all, and stay in their bounds (a head that must keep more than its partial page gives up fills it instead)."""
    page = 16
    chosen = torch.tensor([20, 33, 7, 16, 45, 30])
    held = torch.full((6,), 3)
    low, high = torch.full((6,), 4), torch.full((6,), 100)

    def pages(counts):
        return int(((counts + held + page - 1) // page).sum())

    got = page_aligned_counts(chosen, held, page, low, high, max_pages=8)
    # Entries with held: 23, 36, 10, 19, 48, 33 (partial pages of 7, 4, 10, 3, 0, 1 entries; 9 full pages): 169
    # entries fill 11 pages, so the two fullest partial pages (heads 2 and 0) fill, the others give theirs up.
    assert got.tolist() == [29, 29, 13, 13, 45, 29]
    assert pages(chosen) == 14 and pages(got) == 11 == -(-int((chosen + held).sum()) // page)
    assert 0 <= int(got.sum()) - int(chosen.sum()) < page
    # Head 3 must keep 14: with its 3 held slots that is two pages, more than its 16 entries fill: it keeps and fills
    # them; the other heads' 150 entries fill 10 pages, as before. Head 0 can fill at most 24 entries: where it
    # fills its page (the next case), it keeps them all.
    got = page_aligned_counts(chosen, held, page, torch.tensor([4, 4, 8, 14, 4, 4]), high, max_pages=8)
    assert got.tolist() == [29, 29, 13, 29, 45, 29] and pages(got) == 12
    got = page_aligned_counts(chosen, held, page, low, torch.tensor([24] + [100] * 5), max_pages=8)
    assert got.tolist() == [24, 29, 13, 13, 45, 29] and pages(got) == 11
    # Nothing to move: every head on a boundary already.
    aligned = torch.tensor([13, 29, 13])
    assert torch.equal(page_aligned_counts(aligned, held[:3], page, low[:3], high[:3], max_pages=8), aligned)
    # Heads held at their minimum: three heads must keep 18 entries, two pages each, which they fill; the fourth head
    # keeps its four pages (it gives none of them to the others' spare slots).
    chosen, held = torch.tensor([18, 18, 18, 64]), torch.zeros(4, dtype=torch.int64)
    got = page_aligned_counts(chosen, held, page, torch.tensor([18, 18, 18, 4]), torch.full((4,), 100), max_pages=8)
    assert got.tolist() == [32, 32, 32, 64]


@pytest.mark.parametrize("read_back", [True, False], ids=["cpu_path", "device_path"])
def test_resize_rows_gives_up_the_lowest_and_takes_the_best(read_back):
    """A row with fewer entries to keep gives up its lowest-priority ones (of equal ones the later), one with more
    takes its best others (of equal ones the earlier); forced entries (+inf) stay; a row's top entries stay its top
    entries at the new count (resize_rows of top_per_row is top_per_row). Both paths: the CPU's (the cut width read
    back) and a GPU's (the whole row, no synchronisation), on CPU tensors."""
    priority = torch.tensor(
        [[5.0, 1.0, 3.0, 3.0, float("inf"), 0.0], [2.0, 2.0, 2.0, 9.0, 1.0, float("inf")]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 1]], dtype=torch.bool)
    got = resize_rows(mask, priority, torch.tensor([2, 5]), read_back=read_back)
    assert got.int().tolist() == [[1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    got = resize_rows(mask, priority, torch.tensor([3, 3]), read_back=read_back)
    assert got.int().tolist() == [[1, 0, 1, 0, 1, 0], [0, 0, 1, 1, 0, 1]]
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (6, 50), generator=g).to(torch.float64)  # many ties
    counts = torch.randint(0, 51, (6,), generator=g)
    for new in (torch.randint(0, 51, (6,), generator=g), counts):
        got = resize_rows(top_per_row(scores, counts), scores, new, read_back=read_back)
        assert torch.equal(got, top_per_row(scores, new))


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("ratio", [0.4, 0.8, 0.95, None])
def test_a_prompts_page_aligned_masks_fill_every_page_with_each_heads_best(pooled, ratio):
    """The prompt's selection moved to page boundaries (what RequestCompressor.select keeps): every head fills the
    pages it takes (with its slots to vLLM's next block), the heads of a pool take the pages the selection's entries
    fill packed together (or, where more, each head's fewest for its window and sinks), keep at least the selection's
    entries (under a page more over a pool's heads not held at their minimum: those keep and fill their fewest
    pages), every forced entry, and each head's best entries at its count."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.scoring.selection import select_keep_masks
    from rcstat_vllm.worker.prompt_compression import page_aligned_masks

    g = torch.Generator().manual_seed(11)
    layers, heads, n, page = 6, 3, 203, 16
    held = -n % page
    config = RCStatConfig(target_ratio=ratio, eviction="eager") if ratio is not None else RCStatConfig(c=1.0)
    scores = [torch.rand(heads, n, generator=g) ** 4 for _ in range(layers)]
    scores[2][1, 50] = float("inf")  # a scorer's forced keep
    chosen = select_keep_masks(scores, config)
    pools = [list(range(layers))] if pooled else [[layer] for layer in range(layers)]
    got = torch.stack(page_aligned_masks(chosen, scores, config, n, page, pools))
    counts, before = got.sum(dim=2), torch.stack(chosen).sum(dim=2)
    assert ((counts + held) % page == 0).all()  # every page full
    forced = torch.stack([forced_keep_mask(s, config.window, config.sink_tokens) for s in scores])
    assert (got | ~forced).all()
    fewest = (forced.sum(dim=2) + held + page - 1) // page
    held_up = fewest * page > before + held  # heads whose window and sinks take more pages than their selection
    for pool in pools:
        pages = int((counts[pool] + held).sum()) // page
        packed = -(-int((before[pool] + held)[~held_up[pool]].sum()) // page)
        assert pages == packed + int(fewest[pool][held_up[pool]].sum())
        assert torch.equal(counts[pool][held_up[pool]], (fewest * page - held)[pool][held_up[pool]])
        kept_more = counts[pool][~held_up[pool]].sum() - before[pool][~held_up[pool]].sum()
        assert 0 <= int(kept_more) < page
    priority = torch.stack(scores).to(torch.float64).masked_fill(forced, float("inf")).view(layers * heads, n)
    assert torch.equal(got.view(layers * heads, n), top_per_row(priority, counts.flatten()))


def test_top_per_row_is_the_budgets_own_mask_at_its_counts():
    """Each row's top counts in the stable descending order (ties: the lower index) are the mask select_budget chose,
    when given the counts it chose: a count moved by page alignment changes only that row's tail."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 5, (3, 40), generator=g).to(torch.float64)  # many ties
    mask = select_budget(scores, 4, 0.6).mask
    priority = scores.masked_fill(forced_keep_mask(scores, 4), float("inf"))
    assert torch.equal(top_per_row(priority, mask.sum(dim=1)), mask)
