"""The CUDA backend (rcstat_vllm/attention/cuda_backend.py) on CPU tensors.

vLLM's CUDA build cannot run here, so its two FlashAttention kernels are replaced by torch references (the
kernels are the only thing the CUDA path does not share with the CPU path): vLLM's own ``forward`` and
``do_kv_cache_update`` for plain batches, and :class:`TorchHeadPageKernels` for head-as-sequence batches. All
the rest runs as on a GPU: the plugin's impl ``forward``, the shared planner, the head plan, compaction in
vLLM's GPU cache layout (head-major blocks) and the page bookkeeping.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from fake_vllm import fake_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_layout import KVCacheLayout

from rcstat_vllm.attention.cuda_backend import (
    RCStatFlashBackend,
    RCStatFlashImpl,
    RCStatFlashMetadata,
    RCStatFlashMetadataBuilder,
    unsupported_reason,
)
from rcstat_vllm.attention.flash_head_attention import TorchHeadPageKernels
from rcstat_vllm.attention.head_plan import plan_head_attention
from rcstat_vllm.capabilities import unsupported_layer_reason
from rcstat_vllm.paging.kv_layout import FLASH, flash_head_page_caches
from rcstat_vllm.paging.page_space import cdiv
from rcstat_vllm.reports import Compaction
from rcstat_vllm.worker.driver import WorkerCompression
from rcstat_vllm.worker.step import BatchRequest, StepInfo

BLOCK, HEADS, GROUP, DIM, LAYERS = 16, 2, 3, 32, 2
SCALE = DIM**-0.5


def _dense(q, keys, values, causal_offset=None):
    """q [Q, G, D] over keys/values [n, D]; causal with the last query seeing every key."""
    logits = torch.einsum("qgd,kd->gqk", q.float(), keys.float()) * SCALE
    n, num_q = keys.shape[0], q.shape[0]
    positions = n - num_q + torch.arange(num_q)
    logits = logits.masked_fill(torch.arange(n).view(1, 1, -1) > positions.view(1, -1, 1), float("-inf"))
    return torch.einsum("gqk,kd->qgd", logits.softmax(-1), values.float())


# ---- vLLM's FlashAttention kernels, as torch references (plain batches) ----


def _reference_kv_update(self, layer, key, value, kv_cache, slot_mapping):
    slots = slot_mapping.long()
    rows = kv_cache.transpose(1, 2)  # [B, N, H, 2D], FlashAttention's view
    rows[slots // BLOCK, slots % BLOCK] = torch.cat([key[: len(slots)], value[: len(slots)]], -1).to(kv_cache.dtype)


def _reference_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
    starts = attn_metadata.query_start_loc.tolist()
    for r, length in enumerate(attn_metadata.seq_lens.tolist()):
        tokens = torch.arange(length)
        blocks = attn_metadata.block_table[r, tokens // BLOCK].long()
        rows = kv_cache[blocks, :, tokens % BLOCK]  # [n, H, 2D]
        for h in range(HEADS):
            q = query[starts[r] : starts[r + 1], h * GROUP : (h + 1) * GROUP]
            out = _dense(q, rows[:, h, :DIM], rows[:, h, DIM:])
            output[starts[r] : starts[r + 1], h * GROUP : (h + 1) * GROUP] = out.to(output.dtype)
    return output


def _built(common: CommonAttentionMetadata):
    """What FlashAttention's builder makes of a CommonAttentionMetadata, for the fields the reference reads."""
    return SimpleNamespace(
        num_actual_tokens=common.num_actual_tokens,
        query_start_loc=common.query_start_loc,
        seq_lens=common.seq_lens,
        block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping,
    )


def _worker(rcstat: dict, layer_names, caches: dict) -> WorkerCompression:
    """The worker state as the model runner hook and the builders set it up (patches/model_runner.py)."""
    vllm_config = fake_vllm_config(rcstat, BLOCK)
    worker = WorkerCompression(vllm_config)
    worker.attach_layers(layer_names, num_kv_heads=HEADS, block_size=BLOCK, layout=FLASH)
    worker.bind_kv_caches(caches)
    return worker


def _planned(planner, common):
    """A step's plan as the CUDA builder builds it: the worker's rows, then the head plan."""
    plan = planner.plan_step(common)
    plan_head_attention(plan, common)
    return plan


def _layer_caches(num_blocks: int, pooled: bool) -> list[torch.Tensor]:
    """LAYERS caches [num_blocks, H, N, 2D]: views of one backing buffer (as vLLM allocates), or separate."""
    if pooled:
        backing = torch.zeros(LAYERS * num_blocks, HEADS, BLOCK, 2 * DIM)
        return list(backing.view(LAYERS, num_blocks, HEADS, BLOCK, 2 * DIM).unbind(0))
    return [torch.zeros(num_blocks, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]


def _recover_keep_mask(prompt_keys, compacted_keys):
    """Which prompt tokens a head kept: its compacted keys are an ordered subsequence of its prompt keys."""
    mask = torch.zeros(prompt_keys.shape[0], dtype=torch.bool)
    position = 0
    for key in compacted_keys:
        while not torch.equal(prompt_keys[position], key):
            position += 1
        mask[position] = True
        position += 1
    return mask


@pytest.mark.parametrize("lazy_steps", [0, 20], ids=["eager", "lazy-after-20-steps"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-pages", "per-layer-pages"])
def test_cuda_impl_compresses_then_decodes_equal_to_dense_attention_over_the_kept_tokens(
    monkeypatch, pooled, lazy_steps
):
    """Step 1: a 150-token prompt (compressed, RC budget 0.5) and a 20-token prompt (below min_prompt_len:
    uncompressed) prefill together. Then 20 decode steps in one batch (page growth included): every output
    equals dense attention over each head's kept prompt tokens plus the generated ones, and the short request
    equals plain causal attention. With pages pooled across layers (one backing buffer) and per layer. Lazy
    eviction: the compressed request first decodes ``lazy_steps`` steps over its full cache, then is compacted with
    those tokens kept by every head (read from the prompt's last block and the block after it)."""
    monkeypatch.setattr(FlashAttentionImpl, "do_kv_cache_update", _reference_kv_update)
    monkeypatch.setattr(FlashAttentionImpl, "forward", _reference_forward)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    num_blocks = 40
    caches = _layer_caches(num_blocks, pooled)
    eviction = "lazy" if lazy_steps else "eager"
    planner = _worker(
        {"method": "rc", "target_ratio": 0.5, "min_prompt_len": 64, "eviction": eviction},
        layer_names,
        dict(zip(layer_names, caches)),
    )
    assert planner.space.is_pooled == pooled
    impl = RCStatFlashImpl(
        num_heads=HEADS * GROUP,
        head_size=DIM,
        scale=SCALE,
        num_kv_heads=HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    impl.head_page_kernels = TorchHeadPageKernels()
    layers = [SimpleNamespace(layer_name=name) for name in layer_names]

    g = torch.Generator().manual_seed(0)
    prompt_lens = [150, 20]
    block_rows = [torch.arange(1, 1 + cdiv(150 + 40, BLOCK)), torch.arange(20, 20 + cdiv(20 + 40, BLOCK))]
    block_table = torch.zeros(2, max(len(r) for r in block_rows), dtype=torch.int32)
    for i, row in enumerate(block_rows):
        block_table[i, : len(row)] = row
    history = [[([], []) for _ in range(LAYERS)] for _ in prompt_lens]  # every token's K/V per request, layer

    def run_step(computed: list[int], scheduled: list[int]):
        info = StepInfo(
            requests=[
                BatchRequest(f"req{i}", prompt_lens[i], computed[i], scheduled[i]) for i in range(len(prompt_lens))
            ]
        )
        planner.begin_step(info)
        starts = [0]
        for count in scheduled:
            starts.append(starts[-1] + count)
        seq_lens = [c + s for c, s in zip(computed, scheduled)]
        positions = torch.cat([torch.arange(c, c + s) for c, s in zip(computed, scheduled)])
        rows = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(scheduled))
        slot_mapping = block_table[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            query_start_loc_cpu=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_reqs=len(scheduled),
            num_actual_tokens=starts[-1],
            max_query_len=max(scheduled),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
        )
        plan = planner.plan_step(common)  # as RCStatFlashMetadataBuilder.build does, head plan included
        plan_head_attention(plan, common)
        if plan.plain is not None:  # the builder builds vLLM's metadata for the uncompressed rows
            plan.plain.metadata = _built(plan.plain.metadata)
        metadata = RCStatFlashMetadata(
            num_actual_tokens=starts[-1],
            max_query_len=max(scheduled),
            query_start_loc=torch.tensor(starts),
            max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens),
            block_table=block_table,
            slot_mapping=slot_mapping,
            rcstat=plan,
        )
        outputs = []
        for layer_index, layer in enumerate(layers):
            num_tokens = starts[-1]
            query = torch.randn(num_tokens, HEADS * GROUP, DIM, generator=g)
            key = torch.randn(num_tokens, HEADS, DIM, generator=g)
            value = torch.randn(num_tokens, HEADS, DIM, generator=g)
            for i in range(len(scheduled)):
                history[i][layer_index][0].append(key[starts[i] : starts[i + 1]])
                history[i][layer_index][1].append(value[starts[i] : starts[i + 1]])
            output = torch.zeros_like(query)
            impl.forward(layer, query, key, value, caches[layer_index], metadata, output)
            outputs.append((query, output))
        return starts, outputs, planner.pop_reports()

    _, _, reports = run_step([0, 0], prompt_lens)
    by_id = {r.req_id: r for r in reports}
    assert by_id["req1"].skipped_reason.startswith("prompt of 20 tokens")
    plan = by_id["req0"]
    assert plan.skipped_reason is None and plan.lazy == bool(lazy_steps)
    assert plan.blocks_freed > 0 and plan.pooled_pages == pooled
    # Lazy over pooled pages: scoring waits for the compaction, the plan is the budget's bound (no kept counts yet).
    assert (plan.kept == []) == (lazy_steps > 0 and pooled)

    def check_decode(starts, outputs, keep=None):
        """Every output equals dense attention over each head's kept prompt tokens (all without ``keep``) and every
        generated token."""
        for layer_index, (query, output) in enumerate(outputs):
            for i in range(2):
                keys = torch.cat(history[i][layer_index][0])
                values = torch.cat(history[i][layer_index][1])
                for h in range(HEADS):
                    kept = torch.ones(lengths[i], dtype=torch.bool)
                    if i == 0 and keep is not None:
                        kept[: prompt_lens[0]] = keep[layer_index][h]
                    q = query[starts[i] : starts[i + 1], h * GROUP : (h + 1) * GROUP]
                    expected = _dense(q, keys[kept, h], values[kept, h])
                    got = output[starts[i] : starts[i + 1], h * GROUP : (h + 1) * GROUP]
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    lengths = list(prompt_lens)
    for _ in range(lazy_steps):  # lazy eviction: the scheduler has not needed the blocks yet
        starts, outputs, _ = run_step(lengths, [1, 1])
        lengths = [n + 1 for n in lengths]
        assert planner.num_compressed_requests == 0
        check_decode(starts, outputs)
    # The scheduler's part: fresh blocks for the kept entries, copied there before the next step's forward (under
    # lazy eviction, for the generated tokens too: the blocks their positions span past the prompt's).
    extra = cdiv(lengths[0], BLOCK) - cdiv(prompt_lens[0], BLOCK)
    fresh = tuple(range(30, 30 + plan.keep_blocks + extra))
    tail = tuple(block_rows[0][cdiv(prompt_lens[0], BLOCK) : cdiv(lengths[0], BLOCK)].tolist())
    compaction = Compaction("req0", fresh, num_tokens=lengths[0] if extra else 0, tail_block_ids=tail)
    assert len(tail) == extra == (1 if lazy_steps else 0)
    planner.begin_step(StepInfo(requests=[], compactions=[compaction]))
    compressed = planner.results["req0"]
    assert compressed.keep_blocks == plan.keep_blocks and compressed.compacted_at_tokens == lengths[0]
    # The budget's entries and, page alignment's, under a page more per page pool (the layers' or one for all).
    pools = 1 if pooled else LAYERS
    entries = LAYERS * HEADS * prompt_lens[0]
    assert 0.5 - pools * BLOCK / entries < compressed.compression_ratio <= 0.5

    # Which tokens each (layer, head) kept, read back from its pages.
    state = planner.requests.compressed_state("req0")
    keep = []
    for layer_index in range(LAYERS):
        prompt_k = torch.cat(history[0][layer_index][0])[: prompt_lens[0]]  # [150, H, D]
        per_head = []
        for h in range(HEADS):
            k_h = int(state.kept[layer_index, h])
            tokens = torch.arange(k_h)
            pages = state.tables[layer_index, h, tokens // BLOCK]
            compacted, _ = FLASH.read(planner.page_cache(layer_index, caches[layer_index]), pages, tokens % BLOCK)
            generated = torch.cat(history[0][layer_index][0])[prompt_lens[0] :, h]  # kept whole, after the prompt's
            assert torch.equal(compacted[k_h - lazy_steps :], generated)
            per_head.append(_recover_keep_mask(prompt_k[:, h], compacted[: k_h - lazy_steps]))
        keep.append(per_head)
        assert [int(m.sum()) for m in per_head] == compressed.kept[layer_index]

    for _ in range(20):
        starts, outputs, _ = run_step(lengths, [1, 1])
        lengths = [n + 1 for n in lengths]
        check_decode(starts, outputs, keep)


def test_head_page_view_is_the_flash_layout_and_needs_head_major_blocks():
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(5, HEADS, BLOCK, 2 * DIM, generator=g)
    key_pages, value_pages = flash_head_page_caches(kv)
    assert key_pages.shape == (5 * HEADS, BLOCK, 1, DIM) and key_pages.stride(-1) == 1
    pages, offsets = torch.tensor([0, 3, 9]), torch.tensor([0, 7, 15])
    keys, values = FLASH.read(kv, pages, offsets)
    assert torch.equal(key_pages[pages, offsets, 0], keys) and torch.equal(value_pages[pages, offsets, 0], values)
    # The same logical cache stored token-major (LBNHC) has no head-page view.
    token_major = torch.randn(5, BLOCK, HEADS, 2 * DIM).transpose(1, 2)
    with pytest.raises(ValueError, match="head-major"):
        flash_head_page_caches(token_major)


def test_backend_asks_vllm_for_head_major_blocks_and_no_cuda_graphs_for_attention():
    from vllm.v1.attention.backend import AttentionCGSupport

    assert RCStatFlashBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert get_supported_kv_cache_layouts([RCStatFlashBackend]) == [KVCacheLayout.LBHNC]
    assert RCStatFlashBackend.forward_includes_kv_cache_update
    assert RCStatFlashBackend.get_impl_cls() is RCStatFlashImpl
    assert RCStatFlashBackend.get_builder_cls() is RCStatFlashMetadataBuilder
    assert RCStatFlashMetadataBuilder._cudagraph_support == AttentionCGSupport.NEVER
    assert not RCStatFlashMetadataBuilder.supports_update_block_table


def _config(layout="LBHNC", cache_dtype="auto", dcp=1, impl=None):
    layer = SimpleNamespace(impl=impl or SimpleNamespace(alibi_slopes=None, sinks=None, sliding_window=(-1, -1)))
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=layout, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        compilation_config=SimpleNamespace(static_forward_context={"attn": layer}),
    )


def test_unsupported_configurations_are_named():
    assert unsupported_reason(_config(), ["attn"]) is None
    assert unsupported_layer_reason(_config(), ["attn"]) is None
    assert "LBNHC" in unsupported_reason(_config(layout="LBNHC"), ["attn"])
    assert "fp8" in unsupported_reason(_config(cache_dtype="fp8"), ["attn"])
    assert "context parallelism" in unsupported_reason(_config(dcp=2), ["attn"])
    # Layer features: checked for both backends when a builder attaches its layers (WorkerCompression.attach_layers).
    alibi = SimpleNamespace(alibi_slopes=torch.ones(2), sinks=None, sliding_window=(-1, -1))
    assert "ALiBi" in unsupported_layer_reason(_config(impl=alibi), ["attn"])
    windowed = SimpleNamespace(alibi_slopes=None, sinks=None, sliding_window=(4095, 0))
    assert "sliding-window" in unsupported_layer_reason(_config(impl=windowed), ["attn"])
    sinks = SimpleNamespace(alibi_slopes=None, sinks=torch.zeros(6), sliding_window=(-1, -1))
    assert "sinks" in unsupported_layer_reason(_config(impl=sinks), ["attn"])  # the FlashAttention path
    assert unsupported_layer_reason(_config(impl=sinks), ["attn"], sinks=True) is None  # the CPU path takes them
    # The CPU backend's impls use an int window (-1: none): the same check serves both backends.
    assert unsupported_layer_reason(_config(impl=SimpleNamespace(sliding_window=-1)), ["attn"]) is None
    assert "sliding-window" in unsupported_layer_reason(_config(impl=SimpleNamespace(sliding_window=512)), ["attn"])


def test_cuda_selection_registers_the_custom_backend_and_respects_an_explicit_choice():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rcstat_vllm.patches.platform import CUDA_BACKEND_PATH, register_cuda_backend, select_cuda_backend

    register_cuda_backend()
    register_cuda_backend()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == CUDA_BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is RCStatFlashBackend

    unset = SimpleNamespace(backend=None)
    assert select_cuda_backend(unset) and unset.backend is AttentionBackendEnum.CUSTOM
    assert select_cuda_backend(SimpleNamespace(backend=AttentionBackendEnum.CUSTOM))
    chosen = SimpleNamespace(backend=AttentionBackendEnum.FLASHINFER)
    assert not select_cuda_backend(chosen) and chosen.backend is AttentionBackendEnum.FLASHINFER


def test_a_drafters_layers_run_vllms_path_and_speculative_decoding_turns_compression_off(monkeypatch):
    """Speculative decoding: EAGLE/MTP drafters build a second attention group on the same backend. The engine runs
    uncompressed with the reason named at start-up, and a layer the owner does not track runs vLLM's own attention
    (here its torch reference) instead of failing on a missing layer index."""
    monkeypatch.setattr(FlashAttentionImpl, "do_kv_cache_update", _reference_kv_update)
    monkeypatch.setattr(FlashAttentionImpl, "forward", _reference_forward)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = _layer_caches(8, pooled=True)
    planner = _worker({"method": "rc"}, layer_names, dict(zip(layer_names, caches)))
    planner.vllm_config.speculative_config = SimpleNamespace(method="eagle")
    assert "speculative decoding" in WorkerCompression(planner.vllm_config).disabled_reason
    drafter = ["drafter.layers.0.self_attn.attn"]
    planner.attach_layers(drafter, num_kv_heads=HEADS, block_size=BLOCK, layout=FLASH)
    assert planner.disabled_reason is not None and planner.tracked_layer(drafter[0]) is None

    impl = RCStatFlashImpl(
        num_heads=HEADS * GROUP,
        head_size=DIM,
        scale=SCALE,
        num_kv_heads=HEADS,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    block_table = torch.tensor([[1, 2]], dtype=torch.int32)
    slot_mapping = torch.arange(BLOCK, BLOCK + 20)
    planner.begin_step(StepInfo(requests=[BatchRequest("draft-req", 20, 0, 20)]))
    common = SimpleNamespace(
        num_reqs=1, block_table_tensor=block_table, query_start_loc_cpu=torch.tensor([0, 20]), slot_mapping=slot_mapping
    )
    metadata = RCStatFlashMetadata(
        num_actual_tokens=20,
        max_query_len=20,
        query_start_loc=torch.tensor([0, 20]),
        max_seq_len=20,
        seq_lens=torch.tensor([20]),
        block_table=block_table,
        slot_mapping=slot_mapping,
        rcstat=_planned(planner, common),
    )
    g = torch.Generator().manual_seed(1)
    query = torch.randn(20, HEADS * GROUP, DIM, generator=g)
    key, value = torch.randn(20, HEADS, DIM, generator=g), torch.randn(20, HEADS, DIM, generator=g)
    drafter_cache = torch.zeros(8, HEADS, BLOCK, 2 * DIM)
    output = torch.zeros_like(query)
    impl.forward(SimpleNamespace(layer_name=drafter[0]), query, key, value, drafter_cache, metadata, output)
    expected = _reference_forward(None, None, query, key, value, drafter_cache, metadata, torch.zeros_like(query))
    torch.testing.assert_close(output, expected)
    assert not output.eq(0).all()
