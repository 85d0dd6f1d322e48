"""Decode-time compression's worker-side mechanics (rcstat_vllm.worker.decode_compression) on a pooled cache, no engine:
when a request is due, what its heads keep of their generated entries, and a second round over heads that hold
different numbers of entries; RC's Triton path (under the Triton interpreter, the CUDA check faked) against the torch
path; and no host synchronisation while a due step scores and selects (device tensors on the meta device)."""

import copy
import dataclasses
import importlib
import itertools
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before the kernels are decorated: see tests/test_kernels.py)

import pytest
import torch

import rcstat_vllm.kernels.decode_scoring as decode_scoring
import rcstat_vllm.worker.decode_compression as decode_compression
import rcstat_vllm.worker.prompt_compression as prompt_compression
from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.paging.compaction import blocks_needed, compact_request, recompact_request
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CPU_VEC, FLASH
from rcstat_vllm.paging.page_space import cdiv, identity_pages, pooled_space_or_reason
from rcstat_vllm.reports import Compaction
from rcstat_vllm.scoring import relative_to_head_mean, select_budget
from rcstat_vllm.scoring.rc_knobs import RC_PAPER
from rcstat_vllm.settings import scorer_options
from rcstat_vllm.worker.decode_compression import DecodeCompressor
from rcstat_vllm.worker.jobs import DecodeJob

for _name in ("_tiles_triton", "_rc_triton"):  # compiled-mode copies are reloaded, see tests/test_kernels.py
    if f"rcstat_vllm.kernels.{_name}" in sys.modules:
        importlib.reload(sys.modules[f"rcstat_vllm.kernels.{_name}"])

LAYERS, BLOCKS, HEADS, QUERY_HEADS, BLOCK, DIM = 3, 96, 2, 4, 16, 8


def _request(generator, n=100, keep_last=0, history=None):
    """A request compacted at ``n`` tokens, every head keeping its last ``keep_last`` (a lazy compaction's tokens
    generated before it). ``history``, when given (a dict), gets each (layer, head)'s stored entries as the cache
    held them before the compaction: ``[(key, value), ...]``, the tokens its mask kept, in order."""
    backing = torch.randn(LAYERS * BLOCKS, HEADS, BLOCK, 2 * DIM, generator=generator)
    caches = list(backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM).unbind(0))
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    blocks = (torch.randperm(BLOCKS - 1, generator=generator) + 1).tolist()
    row = torch.tensor([blocks.pop() for _ in range(cdiv(n, BLOCK))])
    masks = [torch.rand(HEADS, n, generator=generator) < 0.5 for _ in range(LAYERS)]
    for mask in masks:
        mask[:, n - keep_last :] = True
    if history is not None:
        tokens = torch.arange(n)
        for layer, mask in enumerate(masks):
            for head in range(HEADS):
                kept = tokens[mask[head]]
                keys, values = CPU_VEC.read(
                    caches[layer], identity_pages(row, HEADS)[head, kept // BLOCK], kept % BLOCK
                )
                history[layer, head] = list(zip(keys, values))
    keep = blocks_needed(torch.stack([m.sum(1) for m in masks]), n, space)
    state = compact_request(caches, row, masks, torch.tensor([blocks.pop() for _ in range(keep)]), space)
    return caches, space, state, row, blocks


def _grow(state, row, blocks, num_tokens):
    """vLLM appends blocks as the request decodes; the worker reserves head pages for every token."""
    appended = [blocks.pop() for _ in range(cdiv(num_tokens, BLOCK) - row.numel())]
    row = torch.cat([row, torch.tensor(appended, dtype=row.dtype)])
    state.reserve(num_tokens, row)
    return row


def _decode(state, row, blocks, caches, space, start, end, history, generator):
    """Tokens ``start..end-1`` decoded: pages reserved, and each token's new key and value written into every head's
    slot for it (as the backend's forward writes them), appended to ``history``."""
    row = _grow(state, row, blocks, end)
    slots = state.slots(torch.arange(start, end))  # [L, T, H]
    for layer in range(LAYERS):
        keys = torch.randn(end - start, HEADS, DIM, generator=generator)
        values = torch.randn(end - start, HEADS, DIM, generator=generator)
        CPU_VEC.write(space.cache(layer, caches[layer]), slots[layer] // BLOCK, slots[layer] % BLOCK, keys, values)
        for head in range(HEADS):
            history[layer, head] += list(zip(keys[:, head], values[:, head]))
    return row


def _assert_entries(space, state, caches, num_tokens, history):
    """Every (layer, head) reads back, through its page table, exactly its ``history`` entries, token by token."""
    lengths = state.lengths(num_tokens)
    for (layer, head), entries in history.items():
        assert int(lengths[layer, head]) == len(entries)
        slots = torch.arange(len(entries))
        keys, values = CPU_VEC.read(
            space.cache(layer, caches[layer]), state.tables[layer, head, slots // BLOCK], slots % BLOCK
        )
        for j, (key, value) in enumerate(entries):
            assert torch.equal(keys[j], key) and torch.equal(values[j], value), (layer, head, j)


def _score_and_select(decode, state, caches, num_tokens, generator):
    for layer in range(LAYERS):
        decode.save_queries(layer, torch.randn(decode.num_queries, QUERY_HEADS, DIM, generator=generator))
        decode.score_layer(layer, state, caches[layer], CPU_VEC, DIM**-0.5, num_tokens)
    return decode.select(state, num_tokens)


@pytest.mark.parametrize("method", ["rc", "snapkv", "streaming"])
def test_two_decode_compactions_keep_the_budget_the_window_and_the_prompt(method):
    """Two rounds of decode-time compaction over a compacted request whose generated tokens' KV is written as the
    forward writes it: each round keeps the layer's budget of generated entries (heads differently), the window and
    the prompt's kept entries; the copy moves exactly the entries the masks name (each head reads back its chosen
    keys and values, token by token, from the fresh blocks), into the fewest blocks that hold every head's pages
    up to vLLM's next block (one block fewer does not)."""
    g = torch.Generator().manual_seed(1)
    history = {}
    caches, space, state, row, blocks = _request(g, history=history)
    config = RCStatConfig(method=method, window=8, decode_budget=24, decode_interval=16)
    decode = DecodeCompressor(config, state.kept, state.num_compacted_tokens)
    n = state.num_compacted_tokens
    assert decode.next_due == n + 24 + 16
    assert not decode.due(n + 39) and decode.due(n + 40)
    assert not decode.observing(n + 40 - decode.num_queries) and decode.observing(n + 41 - decode.num_queries)

    prompt_entries = state.kept.clone()
    done, t, evicted = n, n + 40, 0
    for round_ in range(2):
        row = _decode(state, row, blocks, caches, space, done, t, history, g)
        _assert_entries(space, state, caches, t, history)
        lengths = state.lengths(t)
        plan = _score_and_select(decode, state, caches, t, g)
        generated = lengths - prompt_entries
        kept_generated = plan.kept - prompt_entries
        to_boundary = -t % BLOCK
        # The budget over every head (each layer's heads keep 24 each on average), each head's count then moved to a
        # page boundary: every head fills its pages (or keeps all it has); the heads take the pages the budget's
        # entries fill packed together, and a page more at most for each head held at the fewest its window needs
        # (_page_aligned_reference below is the exact rule); at least the budget is kept.
        pages = (plan.kept + to_boundary + BLOCK - 1) // BLOCK
        assert bool((((plan.kept + to_boundary) % BLOCK == 0) | (kept_generated == generated)).all())
        budget_pages = cdiv(int((prompt_entries + 24 + to_boundary).sum()), BLOCK)
        fewest = (prompt_entries + 8 + to_boundary + BLOCK - 1) // BLOCK
        assert budget_pages <= int(pages.sum()) <= budget_pages + int((pages == fewest).sum())
        assert int(kept_generated.sum()) >= LAYERS * HEADS * 24
        assert bool((kept_generated >= 8).all()) and bool((kept_generated <= generated).all())
        assert plan.evicted == int(generated.sum()) - int(kept_generated.sum())
        for layer, mask in enumerate(plan.masks):
            for head in range(HEADS):
                p, end = int(prompt_entries[layer, head]), int(lengths[layer, head])
                assert bool(mask[head, :p].all()) and bool(mask[head, end - 8 : end].all())  # prompt, window
                assert not bool(mask[head, end:].any())
                assert int(mask[head].sum()) == int(plan.kept[layer, head])
        # Pooled pages: L * H pages per block; each head needs its kept entries' pages plus room for the tokens still
        # to come before vLLM's next block.
        pages = (plan.kept + to_boundary + BLOCK - 1) // BLOCK
        assert plan.keep_blocks == cdiv(int(pages.sum()), LAYERS * HEADS)
        dest = torch.tensor([blocks.pop() for _ in range(plan.keep_blocks)])
        try:  # one block fewer: the kept entries do not fit, or the tokens to vLLM's next block do not
            short = recompact_request(caches, state, t, plan.masks, dest[1:])  # (writes only fresh blocks)
        except ValueError as error:
            assert "pages needed" in str(error)
        else:
            with pytest.raises(RuntimeError, match="pool exhausted"):
                short.reserve(t + to_boundary)
        state = recompact_request(caches, state, t, plan.masks, dest)
        decode.compacted()
        evicted += plan.evicted
        history = {
            (layer, head): [entry for entry, kept in zip(entries, plan.masks[layer][head].tolist()) if kept]
            for (layer, head), entries in history.items()
        }
        _assert_entries(space, state, caches, t, history)
        state.reserve(t + to_boundary)  # the kept blocks hold every head's pages up to vLLM's next block
        assert decode.compactions == round_ + 1 and decode.next_due == t + 16 and not decode.due(t + 15)
        row = torch.cat([torch.full((cdiv(t, BLOCK) - dest.numel(),), -1), dest])  # positions < t absorbed
        done, t = t, t + 16
    assert decode.tokens_evicted == evicted
    if method == "streaming":  # recency: every head keeps its latest generated tokens, 24 or a page boundary's
        assert bool(((state.kept - prompt_entries - 24).abs() < BLOCK).all())


def test_a_cancelled_plan_is_due_again_after_a_new_window_of_queries():
    g = torch.Generator().manual_seed(2)
    caches, _space, state, row, blocks = _request(g)
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=16), state.kept, state.num_compacted_tokens
    )
    t = decode.next_due
    _grow(state, row, blocks, t)
    _score_and_select(decode, state, caches, t, g)
    assert not decode.due(t + 100) and not decode.observing(t + 100)  # a plan is with the scheduler
    decode.cancelled()
    assert decode.next_due == t + decode.num_queries and decode.compactions == 0
    assert decode.observing(t + 1) and decode.due(t + decode.num_queries)


def test_a_compaction_brought_forward_is_due_once_a_window_of_queries_is_saved():
    """The scheduler brings a compaction forward (the pool is about to run short): the request observes from that step
    and is due a window of queries later; never later than it was due anyway, not while a plan is pending, and not
    when its heads would hold too few generated entries to evict a window's worth beyond the budget."""
    g = torch.Generator().manual_seed(4)
    caches, _space, state, row, blocks = _request(g)
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=64), state.kept, state.num_compacted_tokens
    )
    scheduled = decode.next_due  # 100 + 24 + 64
    decode.hurry(state.num_compacted_tokens + 10)  # declined: 17 generated entries by then, the budget is 24
    assert decode.next_due == scheduled
    now = state.num_compacted_tokens + 40
    assert not decode.observing(now)
    decode.hurry(now)
    assert decode.observing(now) and not decode.due(now + decode.num_queries - 2)
    assert decode.due(now + decode.num_queries - 1) and decode.next_due < scheduled
    decode.hurry(now + 5)  # asked again: still due when the first window is complete
    assert decode.next_due == now + decode.num_queries - 1
    late = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=64), state.kept, state.num_compacted_tokens
    )
    late.hurry(late.next_due - 2)  # due sooner anyway
    assert late.next_due == scheduled
    t = decode.next_due
    _grow(state, row, blocks, t)
    _score_and_select(decode, state, caches, t, g)
    decode.hurry(t + 1)  # a plan is with the scheduler
    assert decode.pending is not None and not decode.due(t + 100)


def test_tokens_generated_before_a_lazy_prompt_compaction_are_generated_kv():
    """A prompt of 60 tokens compacted lazily at 100 tokens (its 40 generated tokens kept whole by every head): they
    count as generated KV, due as soon as a window of queries is saved (40 >= budget + interval), and only they and
    the later tokens are evicted, down to the budget; the prompt's kept entries stay."""
    g = torch.Generator().manual_seed(6)
    caches, _space, state, row, blocks = _request(g, keep_last=40)
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=16),
        state.kept - 40,
        state.num_compacted_tokens,
        generated=40,
    )
    t = decode.next_due
    assert t == 100 + decode.num_queries
    _grow(state, row, blocks, t)
    plan = _score_and_select(decode, state, caches, t, g)
    generated = 40 + t - 100
    # down to the budget, each head's count on a page boundary (fewer than a page kept beyond it in all)
    assert 0 <= LAYERS * HEADS * (generated - 24) - plan.evicted < BLOCK
    for layer, mask in enumerate(plan.masks):
        for head in range(HEADS):
            assert mask[head, : int(state.kept[layer, head]) - 40].all()


def test_decode_budget_is_validated_against_the_window():
    with pytest.raises(Exception, match="decode_budget"):
        RCStatConfig(window=32, decode_budget=16)
    with pytest.raises(Exception, match="decode_interval"):
        RCStatConfig(window=32, decode_interval=8)
    assert not RCStatConfig(method="none", decode_budget=64).decode_compression


#: The scorer a decode-time compression builds from the shipped defaults (RCStatConfig(), its window 8 here): today
#: RC with the max over the window's queries and the local contrast (radius 256: every entry here), smoothed and
#: carried; the case after it sets max and the contrast explicitly, with a radius shorter than the heads.
SHIPPED = scorer_options(RCStatConfig(window=8))


@pytest.mark.parametrize(
    "method, options",
    [
        ("rc", SHIPPED),
        (
            "rc",
            {
                "window_size": 8,
                "smoothing": 3,
                "carry_forward": 8,
                "query_reduction": "max",
                "local_contrast": 0.5,
                "contrast_radius": 5,
            },
        ),
        ("rc", {**RC_PAPER.scorer_options(), "smoothing": 3, "carry_forward": 8}),
        ("rc", RC_PAPER.scorer_options()),
        ("rc", {"window_size": 8, "value_weight": 1.0}),
        ("rc", {"window_size": 8, "chunk": 4}),
        ("snapkv", {"window_size": 8}),
        ("tova", {}),
        ("streaming", {}),
        ("knorm", {}),
    ],
    ids=[
        "rc-shipped-defaults",
        "rc-max-contrast-radius5",
        "rc-smoothed-carried",
        "rc-eq6",
        "rc-value-weighted",
        "rc-chunked",
        "snapkv",
        "tova",
        "streaming",
        "knorm",
    ],
)
@pytest.mark.parametrize("lengths", [[40, 17, 33], [40, 8, 33]], ids=["uneven", "a-head-of-the-window-only"])
def test_ragged_scoring_equals_each_head_scored_alone(method, options, lengths):
    """score_ragged (heads holding different numbers of entries, right-aligned in one padded tensor) gives each
    head what score() gives it alone (to float rounding: RC scores all heads in one batched call, then contrasts,
    smooths and carries per head; the padding never reaches a head's scores), with the shipped defaults too."""
    from rcstat_vllm.scoring import get_scorer

    g = torch.Generator().manual_seed(3)
    scorer = get_scorer(method, **options)
    keys, values = torch.randn(3, 40, DIM, generator=g), torch.randn(3, 40, DIM, generator=g)
    keys[1, : 40 - lengths[1]] = 1e3  # padding: never read into head 1's scores
    q_window = torch.randn(3 * 2, 8, DIM, generator=g)
    ragged = scorer.score_ragged(q_window, keys, values, lengths, DIM**-0.5)
    for head, length in enumerate(lengths):
        alone = scorer.score(
            q_window[2 * head : 2 * head + 2],
            keys[head : head + 1, 40 - length :],
            values[head : head + 1, 40 - length :],
            DIM**-0.5,
        )[0]
        assert ragged.shape == (3, 40)  # right-aligned as the keys: -inf before the head's own entries
        assert bool((ragged[head, : 40 - length] == float("-inf")).all())
        own = ragged[head, 40 - length :]
        assert torch.equal(torch.isinf(own), torch.isinf(alone))
        assert torch.allclose(own, alone, rtol=1e-5, atol=1e-6)


def test_snapkv_scores_every_head_at_once_as_each_alone():
    """SnapKV's one pass over a layer's heads (a GPU's path; a CPU scores head by head): the padding masked out of the
    window softmax gives each head what scoring it alone gives, and -inf before its entries."""
    from rcstat_vllm.scoring import get_scorer

    g = torch.Generator().manual_seed(4)
    scorer = get_scorer("snapkv", window_size=8)
    keys = torch.randn(3, 40, DIM, generator=g)
    keys[1, :23] = 1e3  # padding: never read into head 1's scores
    q_window = torch.randn(3 * 2, 8, DIM, generator=g)
    lengths = [40, 17, 33]
    at_once = scorer.score_heads_at_once(q_window, keys, lengths, DIM**-0.5)
    head_by_head = scorer.score_ragged(q_window, keys, None, lengths, DIM**-0.5)  # (on a CPU)
    assert torch.equal(torch.isinf(at_once), torch.isinf(head_by_head))
    assert bool((at_once[1, :23] == float("-inf")).all())
    finite = torch.isfinite(head_by_head)
    assert torch.allclose(at_once[finite], head_by_head[finite], rtol=1e-5, atol=1e-7)


def test_an_uncompressed_request_is_compacted_from_its_own_blocks():
    """A request whose prompt stayed whole (too short to compress): its blocks seen as head pages
    (CompactedRequest.uncompressed) are the first decode-time compaction's sources; every head then reads back its
    prompt and the generated entries it chose, from fresh blocks."""
    g = torch.Generator().manual_seed(4)
    backing = torch.randn(LAYERS * BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g)
    caches = list(backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM).unbind(0))
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    prompt, t = 20, 20 + 40
    row = torch.randperm(BLOCKS - 1, generator=g)[: cdiv(t, BLOCK)] + 1
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=16), torch.full((LAYERS, HEADS), prompt), prompt
    )
    assert decode.next_due == t
    source = CompactedRequest.uncompressed(t, space, row)
    assert source.lengths(t).tolist() == [[t] * HEADS] * LAYERS and source.keep_blocks == row.numel()
    plan = _score_and_select(decode, source, caches, t, g)
    assert (plan.kept - prompt).sum(dim=1).tolist() == [HEADS * 24] * LAYERS
    free = torch.tensor(sorted(set(range(1, BLOCKS)) - set(row.tolist())))[: plan.keep_blocks]
    after = recompact_request(caches, source, t, plan.masks, free)
    tokens = torch.arange(t)
    for layer in range(LAYERS):
        for head in range(HEADS):
            chosen = tokens[plan.masks[layer][head]]
            assert chosen[:prompt].tolist() == list(range(prompt))  # the prompt is kept whole
            slots = torch.arange(chosen.numel())
            got = CPU_VEC.read(space.all_layers, after.tables[layer, head, slots // BLOCK], slots % BLOCK)
            want = CPU_VEC.read(space.all_layers, space.identity(layer, row)[head, chosen // BLOCK], chosen % BLOCK)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("prompt", [100, 104], ids=["in_its_block", "starting_a_block"])
def test_the_token_of_a_step_in_flight_is_carried_over_by_the_copy(prompt):
    """Asynchronous scheduling: the plan reaches the scheduler once the next step was scheduled, and that step writes
    its token into the request's head pages before the copy. The copy (``Compaction.num_tokens``) carries it over:
    every head reads back the entries the plan chose and then that token, from the fresh blocks, which the scheduler
    counted with a block more when the token started one (its tail block the copy's source there)."""
    g = torch.Generator().manual_seed(6)
    history = {}
    caches, space, state, row, blocks = _request(g, n=prompt, history=history)
    decode = DecodeCompressor(RCStatConfig(window=8, decode_budget=24, decode_interval=16), state.kept, prompt)
    t = prompt + 40  # due; 144 is a multiple of the block size: the step in flight starts a new block
    row = _decode(state, row, blocks, caches, space, prompt, t, history, g)
    plan = _score_and_select(decode, state, caches, t, g)
    job = DecodeJob("r", decode, state, t, CPU_VEC)
    lengths = state.lengths(t)
    appended = row.numel()
    row = _decode(state, row, blocks, caches, space, t, t + 1, history, g)  # the step in flight
    new_blocks = cdiv(t + 1, BLOCK) - cdiv(t, BLOCK)
    assert new_blocks == (t % BLOCK == 0)
    dest = tuple(blocks.pop() for _ in range(plan.keep_blocks + new_blocks))
    with pytest.raises(ValueError, match="needed"):  # (the plan's blocks alone)
        job.compact(caches, Compaction("r", dest[: plan.keep_blocks - 1], num_tokens=t + 1), space)
    compaction = Compaction("r", dest, num_tokens=t + 1, tail_block_ids=tuple(row[appended:].tolist()))
    after = job.compact(caches, compaction, space)
    assert after.lengths(t + 1).tolist() == (plan.kept + 1).tolist()
    history = {
        (layer, head): [e for e, kept in zip(entries, plan.masks[layer][head].tolist()) if kept]
        + entries[int(lengths[layer, head]) :]
        for (layer, head), entries in history.items()
    }
    _assert_entries(space, after, caches, t + 1, history)
    after.reserve(cdiv(t + 1, BLOCK) * BLOCK)  # pages up to vLLM's next block
    assert decode.compactions == 1 and decode.next_due == t + 16


def test_a_step_in_flight_over_an_uncompressed_request_is_carried_over_from_its_new_block():
    """The same over a request whose prompt stayed whole: the plan's source is its own blocks, and the token of the
    step in flight starts a new block (vLLM's own write, at its identity pages), which the copy reads as the tail."""
    g = torch.Generator().manual_seed(7)
    backing = torch.randn(LAYERS * BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g)
    caches = list(backing.view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * DIM).unbind(0))
    space, _ = pooled_space_or_reason(caches, HEADS, BLOCK)
    prompt, t = 24, 24 + 40
    free = (torch.randperm(BLOCKS - 1, generator=g) + 1).tolist()
    row = torch.tensor([free.pop() for _ in range(cdiv(t, BLOCK))])
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=16), torch.full((LAYERS, HEADS), prompt), prompt
    )
    source = CompactedRequest.uncompressed(t, space, row, shared_blocks=prompt // BLOCK)
    plan = _score_and_select(decode, source, caches, t, g)
    job = DecodeJob("r", decode, source, t, CPU_VEC, own_blocks=row)
    tail = free.pop()  # the step in flight: vLLM appends a block for token t and writes it there
    for layer in range(LAYERS):
        key, value = torch.randn(1, HEADS, DIM, generator=g), torch.randn(1, HEADS, DIM, generator=g)
        pages = space.identity(layer, torch.tensor([tail]))[:, 0].unsqueeze(0)  # [1, H]
        CPU_VEC.write(space.cache(layer, caches[layer]), pages, torch.zeros_like(pages), key, value)
    dest = tuple(free.pop() for _ in range(plan.keep_blocks - prompt // BLOCK + 1))
    after = job.compact(caches, Compaction("r", dest, num_tokens=t + 1, tail_block_ids=(tail,)), space)
    blocks = torch.cat([row, torch.tensor([tail])])
    tokens = torch.arange(t + 1)
    for layer in range(LAYERS):
        for head in range(HEADS):
            chosen = torch.cat([tokens[:t][plan.masks[layer][head][:t]], torch.tensor([t])])
            slots = torch.arange(chosen.numel())
            got = CPU_VEC.read(space.all_layers, after.tables[layer, head, slots // BLOCK], slots % BLOCK)
            want = CPU_VEC.read(space.all_layers, space.identity(layer, blocks)[head, chosen // BLOCK], chosen % BLOCK)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _page_aligned_reference(chosen, held, page, low, high):
    """page_aligned_counts, head by head: each head first takes the fewest pages holding what it must keep; a head
    whose counts fill no more keeps those, and the pages the other heads' counts fill packed together go out one at
    a time, each to the head whose next page the counts fill most (lower head first); every head fills its pages, up
    to the entries it has."""
    x = [c + h for c, h in zip(chosen, held)]
    pages = [-(-(lo + h) // page) for lo, h in zip(low, held)]
    most = [-(-(hi + h) // page) for hi, h in zip(high, held)]
    held_up = [p * page > v for p, v in zip(pages, x)]
    packed = -(-sum(v for v, up in zip(x, held_up) if not up) // page)
    for _ in range(packed - sum(p for p, up in zip(pages, held_up) if not up)):
        worth = [(x[i] / page - pages[i], -i) for i in range(len(x)) if pages[i] < most[i]]
        best = max(worth, default=None)
        if best is None or best[0] <= 0:
            break
        pages[-best[1]] += 1
    return [min(p * page - h, hi) for p, h, hi in zip(pages, held, high)]


def _select_reference(decode, scores, lengths, state, num_tokens):
    """What DecodeCompressor.select computed one head at a time (before it became tensor ops): per layer, each head's
    scores made comparable alone and right-aligned, the layer's budget; then each head's count moved to a page
    boundary over all layers' heads (the test's pages are pooled), each head keeping its best entries up to it."""
    chosen, held, low, high, orders = [], [], [], [], []
    to_boundary = -num_tokens % BLOCK
    for layer, per_head in enumerate(scores):
        counts = (lengths[layer] - decode.prompt_entries[layer]).tolist()
        width = max(counts)
        padded = torch.full((HEADS, width), torch.finfo(torch.float64).min, dtype=torch.float64)
        for head, count in enumerate(counts):
            own = per_head[head, width - count :]
            if decode.config.method == "rc":
                own = relative_to_head_mean(own.unsqueeze(0), decode.window)[0]
            padded[head, width - count :] = own.to(torch.float64)
        keep = select_budget(padded, decode.window, max(0.0, 1.0 - decode.budget / width)).mask
        for head, count in enumerate(counts):
            own = padded[head, width - count :].clone()
            own[-decode.window :] = float("inf")  # the window, always kept
            forced = int((~torch.isfinite(own)).sum())
            chosen.append(int(keep[head].sum()))
            held.append(int(decode.prompt_entries[layer, head]) - state.shared_blocks * BLOCK + to_boundary)
            low.append(forced)
            high.append(count)
            # the head's entries best first (ties: the earlier), as positions among its generated entries
            orders.append(sorted(range(count), key=lambda j, own=own: (-float(own[j]), j)))
    aligned = _page_aligned_reference(chosen, held, BLOCK, low, high)
    masks = []
    for layer in range(len(scores)):
        mask = torch.zeros(HEADS, int(lengths[layer].max()), dtype=torch.bool)
        for head in range(HEADS):
            i = layer * HEADS + head
            start = int(decode.prompt_entries[layer, head])
            mask[head, :start] = True
            for j in orders[i][: aligned[i]]:
                mask[head, start + j] = True
        masks.append(mask)
    return masks


def _uneven(state, generator, most=12):
    """Prompt entries that leave each (layer, head) a different number of generated ones: up to ``most`` of its kept
    prompt entries are read as generated (the heads' entries are what they are; only the split differs)."""
    return state.kept - torch.randint(0, most + 1, state.kept.shape, generator=generator)


@pytest.mark.parametrize("method", ["rc", "snapkv", "knorm"])
def test_selection_over_heads_with_uneven_generated_entries_is_the_per_head_rule(method):
    """The selection's tensor ops choose what the per-head rule chose (each head's scores made comparable alone,
    right-aligned, one budget per layer, then each head's count on a page boundary), over heads holding different
    numbers of generated entries."""
    g = torch.Generator().manual_seed(11)
    caches, _space, state, row, blocks = _request(g)
    t = state.num_compacted_tokens + 40
    _grow(state, row, blocks, t)
    decode = DecodeCompressor(
        RCStatConfig(method=method, window=8, decode_budget=24, decode_interval=16),
        _uneven(state, g),
        state.num_compacted_tokens,
    )
    for layer in range(LAYERS):
        decode.save_queries(layer, torch.randn(decode.num_queries, QUERY_HEADS, DIM, generator=g))
        decode.score_layer(layer, state, caches[layer], CPU_VEC, DIM**-0.5, t)
    counts = state.lengths(t) - decode.prompt_entries
    assert len({tuple(c.tolist()) for c in counts}) > 1 and all(len(set(c.tolist())) > 1 for c in counts)
    scores = [s.clone() for s in decode.scores]
    want = _select_reference(decode, scores, state.lengths(t), state, t)
    plan = decode.select(state, t)
    for got_mask, want_mask in zip(plan.masks, want):
        assert torch.equal(got_mask, want_mask)
    assert torch.equal(plan.kept, torch.stack([m.sum(dim=1) for m in want]))
    assert plan.evicted == int(counts.sum()) - int((plan.kept - decode.prompt_entries).sum())


def _interpreted_triton():
    """Skip unless the Triton kernels run here, under the interpreter."""
    pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot run")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fakes the CUDA check on CPU tensors: needs the Triton interpreter (TRITON_INTERPRET=1)")


@pytest.mark.parametrize(
    "config",
    [
        RCStatConfig(window=8, decode_budget=24, decode_interval=16),  # the shipped RC knobs
        RCStatConfig(
            window=8,
            decode_budget=24,
            decode_interval=16,
            smoothing=1,
            carry_forward=0,
            local_contrast=0.0,
            query_reduction="mean",
        ),  # the paper's Eq. 6
    ],
    ids=["rc-shipped", "rc-eq6"],
)
def test_triton_decode_path_scores_and_selects_as_the_torch_path(monkeypatch, config):
    """On CUDA (faked: CPU tensors under the Triton interpreter, vLLM's CUDA cache layout) RC scores each head's
    generated entries in place with the head-page kernel, one launch per layer; the scores equal the torch path's
    (gathered entries, score_ragged) to float32 rounding, over heads with uneven generated entries, and the plans
    are the same."""
    _interpreted_triton()
    launches = []
    kernel = decode_scoring.rc_head_table_scores
    monkeypatch.setattr(decode_scoring, "rc_head_table_scores", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(12)
    caches, _space, state, row, blocks = _request(g)
    t = state.num_compacted_tokens + 40
    _grow(state, row, blocks, t)
    prompt = _uneven(state, g)
    queries = [torch.randn(8, QUERY_HEADS, DIM, generator=g) for _ in range(LAYERS)]
    scores, plans = {}, {}
    for path in ("torch", "triton"):
        if path == "triton":
            monkeypatch.setattr(prompt_compression, "triton_device", lambda tensor: True)
        decode = DecodeCompressor(config, prompt, state.num_compacted_tokens)
        for layer in range(LAYERS):
            decode.save_queries(layer, queries[layer])
            decode.score_layer(layer, state, caches[layer], FLASH, DIM**-0.5, t)
        scores[path] = [s.clone() for s in decode.scores]
        plans[path] = decode.select(state, t)
    assert len(launches) == LAYERS
    for got, want in zip(scores["triton"], scores["torch"]):
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got_mask, want_mask in zip(plans["triton"].masks, plans["torch"].masks):
        assert torch.equal(got_mask, want_mask)
    assert torch.equal(plans["triton"].kept, plans["torch"].kept)
    assert plans["triton"].keep_blocks == plans["torch"].keep_blocks


#: Every way a tensor's data reaches the host (each waits for the device that computes it).
HOST_READS = ("item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__float__", "__index__")


@pytest.fixture
def device_reads_raise(monkeypatch):
    """Tensor.item / tolist / __bool__ / cpu (and numpy, int(), float(), use as an index) raise on a tensor that is not
    on the CPU: a GPU's would synchronise the host with the device there."""
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            if self.device.type != "cpu":
                raise AssertionError(f"host synchronisation: Tensor.{_name} of a {self.device.type} tensor")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)


@pytest.mark.parametrize("method", ["rc", "snapkv", "tova", "knorm", "streaming"])
def test_a_due_step_scores_and_selects_without_reading_the_device(monkeypatch, device_reads_raise, method):
    """The KV cache and the queries on the meta device (no data: a GPU's, as far as the host is concerned), the
    request's bookkeeping on the host as the worker keeps it: every layer scored (the torch path, what a GPU runs
    for the methods without a kernel) and the selection made with host reads patched to raise on device tensors.
    The step's one transfer, the kept counts at the end (``kept_on_host``), is made once; here it answers from the
    host."""
    g = torch.Generator().manual_seed(13)
    caches, space, state, row, blocks = _request(g)
    t = state.num_compacted_tokens + 40
    _grow(state, row, blocks, t)
    on_device = copy.copy(state)
    on_device.space = dataclasses.replace(space, all_layers=space.all_layers.to("meta"))
    config = RCStatConfig(method=method, window=8, decode_budget=24, decode_interval=16)
    decode = DecodeCompressor(config, _uneven(state, g), state.num_compacted_tokens)
    transfers = []

    def kept_on_host(kept):
        transfers.append(kept.device.type)
        return decode.prompt_entries + 24  # (what a budget of 24 per head would keep)

    monkeypatch.setattr(decode_compression, "kept_on_host", kept_on_host)
    for layer in range(LAYERS):
        decode.save_queries(layer, torch.randn(decode.num_queries, QUERY_HEADS, DIM, device="meta"))
        decode.score_layer(layer, on_device, caches[layer].to("meta"), FLASH, DIM**-0.5, t)
    plan = decode.select(on_device, t)
    assert transfers == ["meta"]
    lengths = state.lengths(t)
    assert [m.shape for m in plan.masks] == [(HEADS, int(lengths[layer].max())) for layer in range(LAYERS)]
    assert {m.device.type for m in plan.masks} == {"meta"}


@pytest.mark.parametrize("layout", ["CPU_VEC", "CPU_AMX", "FLASH"])
def test_read_keys_is_reads_keys(layout):
    """Each layout's ``read_keys`` gives ``read``'s keys (the AMX layout over its bf16 tiles), pages in any shape."""
    from rcstat_vllm.paging import kv_layout

    g = torch.Generator().manual_seed(5)
    cache_layout = getattr(kv_layout, layout)
    block, dim = (32, 32) if layout == "CPU_AMX" else (BLOCK, DIM)
    kv = torch.randn(6, HEADS, block, 2 * dim, generator=g).bfloat16()
    pages = torch.randint(0, 6 * HEADS, (3, 7), generator=g)
    offsets = torch.randint(0, block, (3, 7), generator=g)
    assert torch.equal(cache_layout.read_keys(kv, pages, offsets), cache_layout.read(kv, pages, offsets)[0])


@pytest.mark.parametrize("options", [{}, {"value_weight": 1.0}], ids=["keys-only", "value-weighted"])
def test_decode_scoring_reads_values_only_for_a_scorer_that_weighs_by_them(monkeypatch, options):
    """The torch path gathers the generated entries' values only when the scorer reads them (RC with value_weight),
    and scores what it would with both read."""
    g = torch.Generator().manual_seed(12)
    caches, _space, state, row, blocks = _request(g)
    t = state.num_compacted_tokens + 40
    _grow(state, row, blocks, t)
    decode = DecodeCompressor(
        RCStatConfig(window=8, decode_budget=24, decode_interval=16, **options),
        _uneven(state, g),
        state.num_compacted_tokens,
    )
    reads = []
    real_read = type(CPU_VEC).read
    monkeypatch.setattr(type(CPU_VEC), "read", lambda self, *a: reads.append(1) or real_read(self, *a))
    queries = torch.randn(decode.num_queries, QUERY_HEADS, DIM, generator=g)
    decode.save_queries(0, queries)
    decode.score_layer(0, state, caches[0], CPU_VEC, DIM**-0.5, t)
    assert bool(reads) == bool(options)
    # the same scores as with keys and values read, right-aligned per head
    starts, counts = decode.prompt_entries[0], state.lengths(t)[0] - decode.prompt_entries[0]
    width = int(counts.max())
    cache = state.space.cache(0, caches[0])
    for head in range(HEADS):
        entries = starts[head] + torch.arange(int(counts[head]))
        keys, values = real_read(CPU_VEC, cache, state.tables[0][head, entries // BLOCK], entries % BLOCK)
        want = decode.scorer.score(
            queries.transpose(0, 1)[head * 2 : head * 2 + 2].float(),
            keys[None].float(),
            values[None].float(),
            DIM**-0.5,
        )[0]
        got = decode.scores[0][head, width - int(counts[head]) :]
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _watcher(interval: int, num_tokens: int = 300) -> DecodeCompressor:
    config = RCStatConfig(window=8, decode_budget=64, decode_interval=interval)
    return DecodeCompressor(config, torch.full((2, 3), 256), num_tokens)


def test_a_request_asked_for_early_is_hurried_until_its_compaction():
    decode = _watcher(128)
    assert not decode.hurried and decode.overdue(decode.next_due) == 0 and decode.overdue(decode.next_due + 3) == 3
    decode.hurry(decode.next_due - 40)
    assert decode.hurried
    t = decode.next_due
    decode.pending = decode_compression.DecodePlan(t, [], torch.zeros(2, 3), 0, 0)
    decode.compacted()
    assert not decode.hurried and decode.next_due == t + 128
    decode.hurry(t + 100)
    decode.pending = decode_compression.DecodePlan(t + 120, [], torch.zeros(2, 3), 0, 0)
    decode.cancelled()
    assert not decode.hurried


def test_decode_time_compactions_due_together_are_spread_over_steps():
    """Twelve requests in lockstep (interval 128: one falls due every ~11 steps on average, so one job a step is
    allowed) all fall due in one step: one starts per step, the one due longest first, the last 11 steps late; a
    compaction the scheduler asked for starts when due whatever the count. One round later they fall due one a step:
    none waits."""
    from rcstat_vllm.worker.step_plan import DueCompactions, decode_jobs_allowed

    assert decode_jobs_allowed(12 / 128) == 1 and decode_jobs_allowed(128 / 128) == 2 and decode_jobs_allowed(0) == 1
    decodes = [_watcher(128) for _ in range(12)]
    due_at = decodes[0].next_due
    started_at: dict[int, list[int]] = {}
    for t in range(due_at, due_at + 2 * 128 + 12):
        step = DueCompactions()
        for i, decode in enumerate(decodes):
            step.watched(decode)
            if decode.due(t):
                step.add(decode, t, lambda n, i=i: started_at.setdefault(i, []).append(n))
        waiting = step.start()
        for i, decode in enumerate(decodes):  # each job's plan is made and copied at once
            if started_at.get(i, [None])[-1] == t:
                decode.pending = decode_compression.DecodePlan(t, [], torch.zeros(2, 3), 0, 0)
                decode.compacted()
        assert waiting == sum(decode.due(t) for decode in decodes)
    firsts = sorted(n for n, *_ in started_at.values())
    assert firsts == list(range(due_at, due_at + 12))  # one a step, in the batch's order
    gaps = [later - earlier for starts in started_at.values() for earlier, later in itertools.pairwise(starts)]
    assert gaps and set(gaps) == {128}

    def start_order(decodes, t):
        step, order = DueCompactions(), []
        for decode in decodes:
            step.watched(decode)
            step.add(decode, t, lambda n, d=decode: order.append(d))
        return step.start(), order

    waits = [_watcher(128) for _ in range(3)]
    t = waits[0].next_due + 5  # due 5 steps ago: they waited their turn
    waits[1].next_due -= 1  # due longest
    assert start_order(waits, t) == (2, [waits[1]])
    hurried = _watcher(128)
    hurried.hurry(t - hurried.num_queries + 1)  # due at t
    assert start_order([*waits, hurried], t) == (3, [hurried])  # (its work is this step's share)
