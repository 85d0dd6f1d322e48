"""vLLM-CPU's AMX cache layout (``CPUAmxLayout``, issue 52) against vLLM's own ops, no engine.

vLLM-CPU picks its ``amx`` ISA for bf16 caches on CPUs with AMX tiles; its cache write prepacks each (block, head)
tile for the AMX kernels. Here: the layout's index map is the one vLLM's op writes; the start-up probe accepts it;
prompts written through vLLM's op, compacted per head through the plugin's copy code into fresh pages and decoded
head-as-sequence on the AMX attention kernel match a dense reference. The layout's views alone (pure torch, any CPU)
are tested at the top; everything that runs vLLM's ops with ``amx`` is skipped where the CPU has no AMX.
"""

import pytest
import torch

from rcstat_vllm.paging.compaction import blocks_needed, compact_request, gather_prompt
from rcstat_vllm.paging.kv_layout import CPU_AMX, CPU_VEC, amx_unsupported_reason
from rcstat_vllm.paging.page_space import PageSpace, cdiv

HEADS, GROUP = 3, 3
SHAPES = [(32, 64), (128, 64), (64, 128)]  # (block size N, head size D)


def amx_offsets(block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where K[t, d] and V[t, d] sit in a head page's ``2 N D`` elements, ``[N, D]`` each: the map recovered from
    vLLM-CPU 0.32's binary (keys ``[N/16][D/2][16][2]``, values ``[D/16][N/2][16][2]``, after the keys)."""
    t, d = torch.arange(block_size).unsqueeze(1), torch.arange(head_dim).unsqueeze(0)
    keys = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
    values = block_size * head_dim + (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return keys, values


def all_entries(num_blocks: int, block_size: int):
    """Pages ``[H, slots]`` and offsets of every (head, slot) of a cache, slot = block * N + offset."""
    tokens = torch.arange(num_blocks * block_size)
    pages = (tokens // block_size).unsqueeze(0) * HEADS + torch.arange(HEADS).unsqueeze(1)
    return pages, (tokens % block_size).expand_as(pages)


# ---- the layout's views (pure torch) ----


@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_amx_layout_writes_where_the_map_says_and_reads_it_back(block_size, head_dim):
    g = torch.Generator().manual_seed(0)
    num_blocks = 3
    kv = torch.zeros(num_blocks, HEADS, block_size, 2 * head_dim, dtype=torch.bfloat16)
    pages, offsets = all_entries(num_blocks, block_size)
    keys = torch.randn(*pages.shape, head_dim, generator=g).bfloat16()
    values = torch.randn(*pages.shape, head_dim, generator=g).bfloat16()
    CPU_AMX.write(kv, pages, offsets, keys, values)
    key_at, value_at = amx_offsets(block_size, head_dim)
    flat = kv.view(num_blocks * HEADS, -1)  # head page p's 2 N D elements
    for page in range(num_blocks * HEADS):
        head, block = page % HEADS, page // HEADS
        tokens = slice(block * block_size, (block + 1) * block_size)
        assert torch.equal(flat[page][key_at], keys[head, tokens])
        assert torch.equal(flat[page][value_at], values[head, tokens])
    got_keys, got_values = CPU_AMX.read(kv, pages, offsets)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    # a subset, in another shape and order (what compaction passes)
    some = torch.randperm(pages.numel(), generator=g)[:50].view(5, 10)
    got_keys, got_values = CPU_AMX.read(kv, pages.flatten()[some], offsets.flatten()[some])
    assert torch.equal(got_keys, keys.flatten(0, 1)[some]) and torch.equal(got_values, values.flatten(0, 1)[some])


@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_amx_layout_key_value_caches_gather_what_read_reads(block_size, head_dim):
    """The tiled views the scorers gather from (``PagedPrompt`` over ``key_value_caches``) hold what ``read`` reads,
    also from the middle of a page to the middle of another."""
    from rcstat_vllm.kernels.paged import gather_paged_tokens
    from rcstat_vllm.scoring import PagedPrompt

    g = torch.Generator().manual_seed(1)
    kv = torch.randn(8, HEADS, block_size, 2 * head_dim, generator=g).bfloat16()
    row = torch.randperm(8, generator=g)[:5].to(torch.int32)
    n = 4 * block_size + 7
    keys, values = gather_prompt(kv, row, n, CPU_AMX)
    prompt = PagedPrompt(*CPU_AMX.key_value_caches(kv), row, n)
    assert prompt.block_size == block_size and prompt.num_kv_heads == HEADS
    assert torch.equal(prompt.gather_keys(), keys.float()) and torch.equal(prompt.gather_values(), values.float())
    start, stop = block_size // 2 + 1, 3 * block_size + 5
    assert torch.equal(gather_paged_tokens(prompt.keys, row, start, stop), keys[:, start:stop])


def as_plain_rows(amx_cache: torch.Tensor) -> torch.Tensor:
    """The same entries in the vec layout (``CPU_VEC``)."""
    num_pages, block_size = amx_cache.shape[0] * amx_cache.shape[1], amx_cache.shape[2]
    pages = torch.arange(num_pages).unsqueeze(1).expand(-1, block_size)
    offsets = torch.arange(block_size).expand_as(pages)
    vec = torch.empty_like(amx_cache)
    CPU_VEC.write(vec, pages, offsets, *CPU_AMX.read(amx_cache, pages, offsets))
    return vec


def test_decode_time_scoring_and_recompaction_over_amx_tiles_match_plain_rows():
    """A request compacted at 100 tokens (2 layers, heads keeping different subsets), then decoded with each new
    token's key and value written into its heads' pages, held once in AMX tiles and once in the vec layout's plain
    rows: decode-time scoring (which reads each head's entries through the layout) selects the same entries, and
    the recompaction moves them alike: every head reads back the same keys and values from its fresh pages."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.paging.compaction import recompact_request
    from rcstat_vllm.worker.decode_compression import DecodeCompressor

    g = torch.Generator().manual_seed(3)
    num_layers, num_blocks, block_size, head_dim, n = 2, 40, 32, 64, 100
    amx = [torch.randn(num_blocks, HEADS, block_size, 2 * head_dim, generator=g).bfloat16() for _ in range(num_layers)]
    copies = {CPU_AMX: amx, CPU_VEC: [as_plain_rows(cache) for cache in amx]}
    space = PageSpace.per_layer(num_layers, HEADS, block_size)
    blocks = torch.randperm(num_blocks, generator=g)
    row, dest, grown, fresh = blocks[:4], blocks[4:10], blocks[10:14], blocks[14:]
    masks = [torch.rand(HEADS, n, generator=g) < torch.tensor([[0.9], [0.5], [0.2]]) for _ in range(num_layers)]
    config = RCStatConfig(method="rc", window=8, decode_budget=24, decode_interval=16)
    states = {layout: compact_request(caches, row, masks, dest, space, layout) for layout, caches in copies.items()}
    decoders = {layout: DecodeCompressor(config, s.kept, s.num_compacted_tokens) for layout, s in states.items()}
    t = decoders[CPU_AMX].next_due
    new_keys = torch.randn(num_layers, t - n, HEADS, head_dim, generator=g).bfloat16()
    new_values = torch.randn(num_layers, t - n, HEADS, head_dim, generator=g).bfloat16()
    queries = torch.randn(num_layers, decoders[CPU_AMX].num_queries, HEADS * GROUP, head_dim, generator=g)
    plans = {}
    for layout, caches in copies.items():
        state, decode = states[layout], decoders[layout]
        state.reserve(t, torch.cat([row, grown]))
        slots = state.slots(torch.arange(n, t))  # [L, T, H]
        for layer, cache in enumerate(caches):
            layout.write(
                cache, slots[layer] // block_size, slots[layer] % block_size, new_keys[layer], new_values[layer]
            )
            decode.save_queries(layer, queries[layer].bfloat16())
            decode.score_layer(layer, state, cache, layout, head_dim**-0.5, t)
        plans[layout] = decode.select(state, t)
    assert [m.tolist() for m in plans[CPU_AMX].masks] == [m.tolist() for m in plans[CPU_VEC].masks]
    assert plans[CPU_AMX].evicted > 0
    entries = {}
    for layout, caches in copies.items():
        after = recompact_request(
            caches, states[layout], t, plans[layout].masks, fresh[: plans[layout].keep_blocks], layout
        )
        lengths = after.lengths(t)
        entries[layout] = [
            layout.read(caches[layer], after.tables[layer, h, slots // block_size], slots % block_size)
            for layer in range(num_layers)
            for h in range(HEADS)
            for slots in [torch.arange(int(lengths[layer, h]))]
        ]
    for (amx_keys, amx_values), (vec_keys, vec_values) in zip(entries[CPU_AMX], entries[CPU_VEC]):
        assert torch.equal(amx_keys, vec_keys) and torch.equal(amx_values, vec_values)


def test_amx_layout_only_for_bf16_tiles_of_multiples_of_32():
    assert amx_unsupported_reason(torch.bfloat16, 32, 64) is None
    assert amx_unsupported_reason(torch.bfloat16, 128, 128) is None
    assert "bf16" in amx_unsupported_reason(torch.float32, 32, 64)
    assert "multiples of 32" in amx_unsupported_reason(torch.bfloat16, 16, 64)
    assert "multiples of 32" in amx_unsupported_reason(torch.bfloat16, 32, 72)
    cache = torch.zeros(2, HEADS, 32, 128, dtype=torch.bfloat16)
    assert CPU_AMX.unsupported_reason(cache) is None
    assert "contiguous" in CPU_AMX.unsupported_reason(cache.transpose(0, 1))
    assert CPU_AMX.unsupported_reason(cache.float()) is not None


# ---- against vLLM's ops ----

try:
    from vllm import _custom_ops as ops
except ImportError:  # (the views' tests above still run)
    ops = None


def _has_cpu_attention_ops() -> bool:
    if ops is None:
        return False
    try:
        torch.ops._C.cpu_attn_reshape_and_cache  # noqa: B018 - resolving it is the check
        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


needs_amx = pytest.mark.skipif(
    not (_has_cpu_attention_ops() and torch.cpu._is_amx_tile_supported()),
    reason="needs vLLM-CPU's attention ops and a CPU with AMX tiles (vLLM picks the amx ISA only there)",
)


needs_cpu_ops = pytest.mark.skipif(not _has_cpu_attention_ops(), reason="needs vLLM-CPU's attention ops")

#: vLLM's ``amx`` write op stores only (no AMX instruction), but its binary is built for AVX-512: never call it on
#: an AVX2-only CPU (it would be an illegal instruction, not an exception).
needs_amx_write_op = pytest.mark.skipif(
    not (_has_cpu_attention_ops() and torch.backends.cpu.get_cpu_capability() == "AVX512"),
    reason="needs vLLM-CPU's attention ops on an AVX-512 CPU",
)


@needs_cpu_ops
@pytest.mark.parametrize(
    "isa,dtype,block_size", [("vec", torch.float32, 32), ("vec", torch.bfloat16, 32), ("vec16", torch.float32, 16)]
)
def test_vec_writes_through_vllms_op_store_the_bytes_the_torch_scatter_stores(isa, dtype, block_size):
    """``VllmWrittenVecLayout`` (what compaction writes with under ``vec``/``vec16``) against ``CPUVecLayout``'s torch
    scatter, from the same random cache: a random subset of slots in random order and shape."""
    from rcstat_vllm.paging.cpu_kv_layout import CPU_VEC_WRITTEN

    g = torch.Generator().manual_seed(block_size)
    head_dim, num_blocks = 64, 4
    start = torch.randn(num_blocks, HEADS, block_size, 2 * head_dim, generator=g).to(dtype)
    pages, offsets = all_entries(num_blocks, block_size)
    some = torch.randperm(pages.numel(), generator=g)[: pages.numel() // 2].view(4, -1)
    keys = torch.randn(*some.shape, head_dim, generator=g).to(dtype)
    values = torch.randn(*some.shape, head_dim, generator=g).to(dtype)
    by_torch, by_vllm = start.clone(), start.clone()
    CPU_VEC.write(by_torch, pages.flatten()[some], offsets.flatten()[some], keys, values)
    CPU_VEC_WRITTEN[isa].write(by_vllm, pages.flatten()[some], offsets.flatten()[some], keys, values)
    assert torch.equal(by_vllm, by_torch) and not torch.equal(by_vllm, start)


@needs_amx_write_op
@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_writes_through_vllms_op_store_the_bytes_the_torch_scatter_stores(block_size, head_dim):
    """``VllmPackedAmxLayout`` (what compaction writes with under ``amx``) against ``CPUAmxLayout``'s torch scatter,
    from the same random cache: a random subset of slots in random order and shape (what compaction passes), and the
    slots written nowhere else left as they were; then a whole compaction, pooled over layers, by each."""
    from rcstat_vllm.paging.cpu_kv_layout import CPU_AMX_PACKED

    g = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks = 4
    start = torch.randn(num_blocks, HEADS, block_size, 2 * head_dim, generator=g).bfloat16()
    pages, offsets = all_entries(num_blocks, block_size)
    some = torch.randperm(pages.numel(), generator=g)[: pages.numel() // 2].view(4, -1)
    keys = torch.randn(*some.shape, head_dim, generator=g).bfloat16()
    values = torch.randn(*some.shape, head_dim, generator=g)  # float32: both cast to the cache's dtype
    by_torch, by_vllm = start.clone(), start.clone()
    CPU_AMX.write(by_torch, pages.flatten()[some], offsets.flatten()[some], keys, values)
    CPU_AMX_PACKED.write(by_vllm, pages.flatten()[some], offsets.flatten()[some], keys, values)
    assert torch.equal(by_vllm, by_torch) and not torch.equal(by_vllm, start)

    layers, n = 3, 3 * block_size - 5
    backing = torch.randn(layers * 2 * num_blocks, HEADS, block_size, 2 * head_dim, generator=g).bfloat16()
    masks = [torch.rand(HEADS, n, generator=g) < 0.5 for _ in range(layers)]
    dest = torch.arange(num_blocks, 2 * num_blocks)
    results = []
    for layout in (CPU_AMX, CPU_AMX_PACKED):
        copy = backing.clone()
        caches = list(copy.view(layers, 2 * num_blocks, HEADS, block_size, 2 * head_dim).unbind(0))
        space = PageSpace.pooled(copy, [layer * 2 * num_blocks * HEADS for layer in range(layers)], HEADS, block_size)
        state = compact_request(caches, torch.arange(cdiv(n, block_size)), masks, dest, space, layout)
        results.append((copy, state.tables))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], backing)


@pytest.fixture(scope="module")
def amx_permission():
    """Linux lets a process run AMX instructions only once it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``): vLLM's
    amx attention kernel dies with SIGILL otherwise. In an engine the model's bf16 matmuls ask first; here, torch."""
    assert torch.cpu._init_amx()


def vllm_write(kv, keys, values, slots, isa="amx"):
    """vLLM's own cache write: tokens' ``[T, H, D]`` keys and values into their blocks (slot = block * N + offset)."""
    num_blocks, num_heads, block_size, two_d = kv.shape
    key_cache, value_cache = kv.view(num_blocks, num_heads, 2 * block_size, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


@needs_amx
@pytest.mark.parametrize("block_size,head_dim", SHAPES)
def test_the_layouts_index_map_is_the_one_vllms_op_writes(block_size, head_dim):
    """Each element's (block, head, token, dim) as vLLM's op writes it, read back from the cache: four writes whose
    values encode one coordinate each (small integers are exact in bf16), compared with the layout's writes."""
    num_blocks = 2
    pages, offsets = all_entries(num_blocks, block_size)
    slots = torch.arange(num_blocks * block_size)
    coordinates = [
        (slots // block_size).view(-1, 1, 1).expand(-1, HEADS, head_dim),  # block
        torch.arange(HEADS).view(1, -1, 1).expand(len(slots), -1, head_dim),  # head
        (slots % block_size).view(-1, 1, 1).expand(-1, HEADS, head_dim),  # token
        torch.arange(head_dim).view(1, 1, -1).expand(len(slots), HEADS, -1),  # dim
    ]
    for coordinate in coordinates:
        code = (coordinate + 1).bfloat16()  # [slots, H, D]; 0 = never written
        by_vllm = torch.zeros(num_blocks, HEADS, block_size, 2 * head_dim, dtype=torch.bfloat16)
        vllm_write(by_vllm, code, -code, slots)
        by_layout = torch.zeros_like(by_vllm)
        CPU_AMX.write(by_layout, pages, offsets, code.transpose(0, 1), -code.transpose(0, 1))
        assert torch.equal(by_vllm, by_layout)
        assert by_vllm.view(num_blocks * HEADS, -1)[:, : block_size * head_dim].gt(0).all()  # every key written


@needs_amx
def test_the_start_up_probe_takes_amx_through_its_own_layout():
    from rcstat_vllm.paging.cpu_kv_layout import CPU_AMX_PACKED, cpu_cache_layout, layout_matches

    for block_size, head_dim in SHAPES:
        assert cpu_cache_layout("amx", torch.bfloat16, block_size, head_dim) is CPU_AMX_PACKED
        assert layout_matches("amx", torch.bfloat16, block_size, head_dim)
    # the vec path: plain rows, written through vLLM's op for the ISA it picked
    for isa, dtype, block_size in (("vec", torch.bfloat16, 32), ("vec16", torch.float32, 16)):
        layout = cpu_cache_layout(isa, dtype, block_size, 64)
        assert isinstance(layout, type(CPU_VEC)) and layout.isa == isa
    assert layout_matches("vec", torch.bfloat16, 32, 64) and layout_matches("vec16", torch.float32, 16, 64)
    # never probed (vLLM's amx op aborts the process on some): off, as an ISA the plugin does not know
    assert cpu_cache_layout("amx", torch.float32, 32, 64) is None and not layout_matches("amx", torch.float32, 32, 64)
    assert not layout_matches("amx", torch.bfloat16, 16, 64)
    assert cpu_cache_layout("neon", torch.bfloat16, 32, 64) is None and not layout_matches(
        "neon", torch.bfloat16, 32, 64
    )


def dense_attention(q, keys, values, scale, sinks=None):
    """q ``[Q, G, D]`` (the last Q positions, causal), keys/values ``[n, D]`` -> ``[Q, G, D]`` float32."""
    num_queries, n = q.shape[0], keys.shape[0]
    logits = torch.einsum("qgd,nd->qgn", q.float(), keys.float()) * scale
    position = torch.arange(n - num_queries, n).view(-1, 1, 1)
    logits = logits.masked_fill(torch.arange(n).view(1, 1, -1) > position, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float().view(1, -1, 1).expand(num_queries, -1, 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :n] @ values.float()


@needs_amx
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_prompts_compacted_in_the_amx_layout_decode_like_a_dense_reference(amx_permission, block_size, sinks):
    """Three prompts written through vLLM's op (``amx``), two compacted through the plugin's copy code with a different
    kept subset per head (all, about half, the window only) into fresh shuffled blocks; then a step of 6 new tokens
    per request (G * 6 = 18 query rows: the AMX kernel's larger tile path) and decode steps across page boundaries,
    written and attended head-as-sequence on the AMX kernels. Every compressed row equals dense attention over its
    head's kept and new entries; the uncompressed request's blocks are left alone."""
    from rcstat_vllm.attention.cpu_head_attention import (
        add_cpu_scheduler_metadata,
        head_sequence_attention,
        write_head_sequence_kv,
    )
    from rcstat_vllm.attention.head_plan import make_head_plan
    from rcstat_vllm.paging.cpu_kv_layout import CPU_AMX_PACKED
    from rcstat_vllm.paging.kv_layout import head_page_caches
    from rcstat_vllm.paging.page_tables import HeadPageTables

    head_dim, num_blocks = 64, 64 if block_size == 32 else 24
    scale = head_dim**-0.5
    g = torch.Generator().manual_seed(block_size + sinks)
    sink_logits = (torch.randn(HEADS * GROUP, generator=g) * 2).float() if sinks else None
    # Every slot starts as poison: a slot read inside a head's length that nothing wrote shows in the output.
    kv = torch.full((num_blocks, HEADS, block_size, 2 * head_dim), -30.0, dtype=torch.bfloat16)
    blocks = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    lengths = [150, 300, 77]  # request 2 stays uncompressed
    new_tokens = [6] + [1] * (block_size + 5)  # crosses a page boundary for every head
    rows, prompts, used = [], [], 0
    for n in lengths:
        count = cdiv(n + sum(new_tokens), block_size)
        row = blocks[used : used + count]
        used += count
        keys = torch.randn(n, HEADS, head_dim, generator=g).bfloat16()
        values = torch.randn(n, HEADS, head_dim, generator=g).bfloat16()
        tokens = torch.arange(n)
        vllm_write(kv, keys, values, row[tokens // block_size].long() * block_size + tokens % block_size)
        rows.append(row)
        prompts.append((keys.transpose(0, 1), values.transpose(0, 1)))  # [H, n, D]: what was written
    fresh = blocks[used:]
    block_table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
    for i, row in enumerate(rows):
        block_table[i, : len(row)] = row

    space = PageSpace.per_layer(1, HEADS, block_size)
    states, masks = {}, {}
    for i in (0, 1):
        mask = torch.rand(HEADS, lengths[i], generator=g) < torch.tensor([[1.0], [0.5], [0.0]])
        mask[:, -8:] = True  # the window
        needed = blocks_needed(mask.sum(1).unsqueeze(0), lengths[i], space)
        states[i] = compact_request([kv], rows[i], [mask], fresh[:needed], space, CPU_AMX_PACKED)  # the engine's
        fresh, masks[i] = fresh[needed:], mask
        got_keys, got_values = gather_prompt(kv, rows[i], lengths[i], CPU_AMX)  # the prompt blocks: unchanged
        assert torch.equal(got_keys, prompts[i][0]) and torch.equal(got_values, prompts[i][1])
    resident = HeadPageTables(1, HEADS, kv.device)
    for state in states.values():
        state.attach_to(resident)

    history: dict[int, list] = {i: [] for i in states}
    seq_lens = list(lengths)
    for step, count in enumerate(new_tokens):
        seq_lens = [n + count for n in seq_lens]
        query_start = [i * count for i in range(len(lengths) + 1)]
        for i, state in states.items():
            state.reserve(seq_lens[i], block_table[i])
        plan = make_head_plan(query_start, seq_lens, states, space, kv.device)
        add_cpu_scheduler_metadata(plan, group=GROUP, head_dim=head_dim, dtype=torch.bfloat16, isa="amx")
        new_k = torch.randn(len(lengths) * count, HEADS, head_dim, generator=g).bfloat16()
        new_v = torch.randn(len(lengths) * count, HEADS, head_dim, generator=g).bfloat16()
        untouched = kv[rows[2].long()].clone()
        write_head_sequence_kv(new_k, new_v, *head_page_caches(kv), plan, 0, "amx")
        assert torch.equal(kv[rows[2].long()], untouched)  # the uncompressed row's blocks are vLLM's to write
        query = torch.randn(len(lengths) * count, HEADS * GROUP, head_dim, generator=g).bfloat16()
        output = torch.zeros_like(query)
        head_sequence_attention(
            query, *head_page_caches(kv), output, plan, 0, scale=scale, isa="amx", sinks=sink_logits
        )
        assert not output[2 * count :].any()  # the uncompressed row: vLLM's kernels fill it
        for i in states:
            tokens = slice(i * count, (i + 1) * count)
            history[i].append((new_k[tokens], new_v[tokens]))
            for h in range(HEADS):
                keys = torch.cat([prompts[i][0][h, masks[i][h]], *(k[:, h] for k, _ in history[i])])
                values = torch.cat([prompts[i][1][h, masks[i][h]], *(v[:, h] for _, v in history[i])])
                q = query[tokens].view(count, HEADS, GROUP, head_dim)[:, h]
                head_sinks = None if sink_logits is None else sink_logits.view(HEADS, GROUP)[h]
                expected = dense_attention(q, keys, values, scale, head_sinks)
                got = output[tokens].view(count, HEADS, GROUP, head_dim)[:, h].float()
                torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2, msg=f"step {step} request {i} head {h}")
    assert [int(k) for k in states[1].kept[0]][2] == 8  # the window-only head kept its window
