"""Full CUDA graphs for decode steps (``cuda_graphs: full_decode``, rcstat_vllm/attention/decode_graph.py) on CPU
tensors: every row of a padded single-token decode batch head-as-sequence over persistent buffers, checked against
today's per-step path (vLLM's FlashAttention for plain rows, the head plan for compressed ones) with the torch
references of tests/test_backend_cuda.py for the kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import itertools

from test_backend_cuda import (
    BLOCK,
    DIM,
    GROUP,
    HEADS,
    LAYERS,
    SCALE,
    _built,
    _layer_caches,
    _reference_forward,
    _reference_kv_update,
    _worker,
)
from test_decode_compression import HOST_READS
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

from rcstat_vllm.attention.cuda_backend import RCStatFlashImpl, RCStatFlashMetadata, RCStatFlashMetadataBuilder
from rcstat_vllm.attention.decode_graph import DecodeGraphBuffers
from rcstat_vllm.attention.flash_head_attention import TorchHeadPageKernels
from rcstat_vllm.attention.head_plan import plan_head_attention
from rcstat_vllm.paging.page_space import cdiv
from rcstat_vllm.reports import Compaction
from rcstat_vllm.worker.step import BatchRequest, StepInfo
from rcstat_vllm.worker.step_plan import has_host_work

MAX_ROWS, MAX_PAGES = 8, 16


def _common(block_table, starts, seq_lens, slot_mapping, num_rows=None):
    """A CommonAttentionMetadata; ``num_rows`` > the real rows: vLLM's padding (rows without queries, length 0, the
    null block, padding tokens with slot -1)."""
    real = len(seq_lens)
    num_rows = num_rows or real
    pad = num_rows - real
    table = torch.cat([block_table, torch.zeros(pad, block_table.shape[1], dtype=block_table.dtype)])
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts + [starts[-1]] * pad, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(starts + [starts[-1]] * pad),
        seq_lens=torch.tensor(seq_lens + [0] * pad, dtype=torch.int32),
        num_reqs=num_rows,
        num_actual_tokens=starts[-1] + pad,
        max_query_len=max(b - a for a, b in itertools.pairwise(starts)),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.cat([slot_mapping, torch.full((pad,), -1, dtype=slot_mapping.dtype)]),
    )


def _impl():
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
    return impl


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled-pages", "per-layer-pages"])
def test_full_graph_decode_equals_todays_path_over_padded_batches_of_plain_and_compressed_rows(monkeypatch, pooled):
    """Three requests: a 150-token prompt compressed (RC, budget 0.5, eager), two short ones left plain. Decode
    steps before and after the compaction run twice from the same caches: today's per-step path (unpadded) and the
    graph layout (padded to 6 rows, random queries/keys in the padding tokens). Every real row's output and every
    cache byte are equal; the buffers' views keep their addresses and shapes in every step. With head pages pooled
    across layers (a plain row's pages offset by its layer's base) and per layer."""
    monkeypatch.setattr(FlashAttentionImpl, "do_kv_cache_update", _reference_kv_update)
    monkeypatch.setattr(FlashAttentionImpl, "forward", _reference_forward)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = _layer_caches(60, pooled)
    planner = _worker(
        {"method": "rc", "target_ratio": 0.5, "min_prompt_len": 64, "eviction": "eager"},
        layer_names,
        dict(zip(layer_names, caches)),
    )
    assert planner.space.is_pooled == pooled
    buffers = DecodeGraphBuffers(LAYERS, HEADS, MAX_ROWS, MAX_PAGES, BLOCK, torch.device("cpu"))
    impl, layers = _impl(), [SimpleNamespace(layer_name=name) for name in layer_names]
    g = torch.Generator().manual_seed(5)
    prompt_lens = [150, 20, 40]
    block_rows = [torch.arange(1, 1 + cdiv(170, BLOCK)), torch.arange(20, 24), torch.arange(24, 29)]
    block_table = torch.zeros(3, max(len(r) for r in block_rows), dtype=torch.int32)
    for i, row in enumerate(block_rows):
        block_table[i, : len(row)] = row
    padded_rows = 6
    views = set()

    def step_inputs(computed, scheduled):
        info = StepInfo(
            requests=[BatchRequest(f"req{i}", prompt_lens[i], computed[i], s) for i, s in enumerate(scheduled)]
        )
        starts = [0]
        for count in scheduled:
            starts.append(starts[-1] + count)
        seq_lens = [c + s for c, s in zip(computed, scheduled)]
        positions = torch.cat([torch.arange(c, c + s) for c, s in zip(computed, scheduled)])
        rows = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(scheduled))
        slots = block_table[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK
        return info, starts, seq_lens, slots

    def todays_metadata(common, plan):
        plan_head_attention(plan, common)
        if plan.plain is not None:
            plan.plain.metadata = _built(plan.plain.metadata)
        return RCStatFlashMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            max_seq_len=common.max_seq_len,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
            rcstat=plan,
        )

    def run(metadata, inputs):
        outputs = []
        for layer_index, layer in enumerate(layers):
            query, key, value = inputs[layer_index]
            output = torch.zeros_like(query)
            impl.forward(layer, query, key, value, caches[layer_index], metadata, output)
            outputs.append(output)
        return outputs

    def decode_step(lengths):
        info, starts, seq_lens, slots = step_inputs(lengths, [1, 1, 1])
        planner.begin_step(info)
        padded = _common(block_table, starts, seq_lens, slots, padded_rows)
        plan = planner.plan_step(padded)  # (the planner takes the padded batch: padding rows have no queries)
        assert not has_host_work(plan) and len(plan.seq_lens) == 3
        inputs = [
            (
                torch.randn(padded_rows, HEADS * GROUP, DIM, generator=g),
                torch.randn(padded_rows, HEADS, DIM, generator=g),
                torch.randn(padded_rows, HEADS, DIM, generator=g),
            )
            for _ in layers
        ]
        before = [cache.clone() for cache in caches]
        today = run(
            todays_metadata(_common(block_table, starts, seq_lens, slots), plan),
            [(q[:3], k[:3], v[:3]) for q, k, v in inputs],
        )
        after_today = [cache.clone() for cache in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        graph = buffers.fill(padded, 3, planner.space.layer_base, plan.compressed, plan.seq_lens)
        views.add(
            (
                *tuple((t.data_ptr(), tuple(t.shape)) for t in (graph.block_tables, graph.seq_lens, graph.slots)),
                (graph.query_start_loc.data_ptr(), tuple(graph.query_start_loc.shape)),
            )
        )
        metadata = RCStatFlashMetadata(
            num_actual_tokens=padded_rows,
            max_query_len=1,
            query_start_loc=padded.query_start_loc,
            max_seq_len=padded.max_seq_len,
            seq_lens=padded.seq_lens,
            block_table=padded.block_table_tensor,
            slot_mapping=padded.slot_mapping,
            rcstat=plan,
            decode_graph=graph,
        )
        full = run(metadata, inputs)
        for layer_index in range(LAYERS):
            torch.testing.assert_close(full[layer_index][:3], today[layer_index], rtol=1e-5, atol=1e-5)
            assert torch.equal(caches[layer_index], after_today[layer_index])  # padding rows wrote nothing
        return plan

    # Prefill (today's path: not a single-token batch).
    info, starts, seq_lens, slots = step_inputs([0, 0, 0], prompt_lens)
    planner.begin_step(info)
    common = _common(block_table, starts, seq_lens, slots)
    plan = planner.plan_step(common)
    run(
        todays_metadata(common, plan),
        [
            (
                torch.randn(sum(prompt_lens), HEADS * GROUP, DIM, generator=g),
                *tuple(torch.randn(sum(prompt_lens), HEADS, DIM, generator=g) for _ in range(2)),
            )
            for _ in layers
        ],
    )
    (report,) = [r for r in planner.pop_reports() if r.req_id == "req0"]
    assert report.skipped_reason is None and report.blocks_freed > 0
    lengths = list(prompt_lens)

    assert not decode_step(lengths).compressed  # no compressed request yet: every row plain
    lengths = [n + 1 for n in lengths]
    fresh = tuple(range(40, 40 + report.keep_blocks))
    planner.begin_step(StepInfo(requests=[], compactions=[Compaction("req0", fresh, num_tokens=0, tail_block_ids=())]))
    assert planner.num_compressed_requests == 1
    for _ in range(BLOCK + 2):  # page growth included
        assert list(decode_step(lengths).compressed) == [0]
        lengths = [n + 1 for n in lengths]
    assert len(views) == 1  # the same addresses and shapes in every step, compressed rows or not


def _buffers_and_batch(device, rows=3, padded=5):
    buffers = DecodeGraphBuffers(LAYERS, HEADS, MAX_ROWS, MAX_PAGES, BLOCK, torch.device(device))
    block_table = torch.arange(1, 1 + rows * 4, dtype=torch.int32).view(rows, 4)
    seq_lens = [17 + 9 * r for r in range(rows)]
    slots = torch.tensor(
        [int(block_table[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for r, n in enumerate(seq_lens)]
    )
    common = _common(block_table, list(range(rows + 1)), seq_lens, slots, padded)
    return buffers, common


def test_plain_rows_are_vllms_blocks_as_head_pages_and_padding_rows_are_empty():
    buffers, common = _buffers_and_batch("cpu")
    plan = buffers.fill(common, 3)
    assert plan.block_tables.shape == (LAYERS, 5 * HEADS, MAX_PAGES)
    assert plan.query_start_loc.tolist() == list(range(3 * HEADS + 1)) + [3 * HEADS] * (2 * HEADS)
    for row in range(3):
        length = int(common.seq_lens[row])
        used = cdiv(length, BLOCK)
        for h in range(HEADS):
            s = row * HEADS + h
            assert (
                plan.block_tables[:, s, :used].tolist()
                == [(common.block_table_tensor[row, :used] * HEADS + h).tolist()] * LAYERS
            )
            assert plan.seq_lens[:, s].tolist() == [length] * LAYERS
            block, offset = divmod(int(common.slot_mapping[row]), BLOCK)
            assert plan.slots[:, s].tolist() == [(block * HEADS + h) * BLOCK + offset] * LAYERS
    assert plan.seq_lens[:, 3 * HEADS :].eq(0).all() and plan.slots[:, 3 * HEADS :].eq(-1).all()


def test_batches_padded_to_one_size_share_addresses_and_shapes_and_stale_rows_are_cleared():
    buffers, five_of_three = _buffers_and_batch("cpu", rows=3, padded=5)
    first = buffers.fill(five_of_three, 3)
    _, five_of_five = _buffers_and_batch("cpu", rows=5, padded=5)
    second = buffers.fill(five_of_five, 5)
    again = buffers.fill(five_of_three, 3)  # fewer rows after more: rows 3, 4 are padding again
    for a, b, c in zip(
        (first.block_tables, first.seq_lens, first.slots, first.query_start_loc),
        (second.block_tables, second.seq_lens, second.slots, second.query_start_loc),
        (again.block_tables, again.seq_lens, again.slots, again.query_start_loc),
    ):
        assert a.data_ptr() == b.data_ptr() == c.data_ptr() and a.shape == b.shape == c.shape
    assert again.seq_lens[:, 3 * HEADS :].eq(0).all() and again.slots[:, 3 * HEADS :].eq(-1).all()
    assert again.query_start_loc[-1] == 3 * HEADS
    with pytest.raises(ValueError, match="graph buffers hold 8"):
        buffers.fill(_buffers_and_batch("cpu", rows=3, padded=9)[1], 3)


def test_the_fill_reads_nothing_from_the_device(monkeypatch):
    """Buffers and vLLM's metadata tensors on the meta device (a GPU's, as far as the host knows), every host read of
    a non-CPU tensor patched to raise: the per-step fill completes (the host tensors it reads are CPU ones)."""
    buffers, common = _buffers_and_batch("meta")
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping"):
        setattr(common, name, getattr(common, name).to("meta"))
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            if self.device.type != "cpu":
                raise AssertionError(f"host synchronisation: Tensor.{_name} of a {self.device.type} tensor")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    plan = buffers.fill(common, 3)
    assert plan.block_tables.device.type == "meta" and plan.seq_lens.shape == (LAYERS, 5 * HEADS)
    with pytest.raises(AssertionError, match="host synchronisation"):
        plan.seq_lens.tolist()  # (the guard is live)


def test_graph_support_follows_the_setting():
    spec = SimpleNamespace()
    piecewise = SimpleNamespace(additional_config={"rcstat": {}})
    full = SimpleNamespace(additional_config={"rcstat": {"cuda_graphs": "full_decode"}})
    assert RCStatFlashMetadataBuilder.get_cudagraph_support(piecewise, spec) == AttentionCGSupport.NEVER
    assert RCStatFlashMetadataBuilder.get_cudagraph_support(SimpleNamespace(additional_config=None), spec) == (
        AttentionCGSupport.NEVER
    )
    assert (
        RCStatFlashMetadataBuilder.get_cudagraph_support(full, spec) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def test_host_work_in_attention_is_dispatched_piecewise_or_refused():
    """A step whose plan keeps queries (a prefill chunk) is flagged before dispatch
    (``dispatch_eager_attention``); a plan with host work whose step was not flagged is refused by the builder's
    check instead of being replayed from a full graph that would skip it."""
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = _layer_caches(30, pooled=True)
    planner = _worker({"method": "rc", "min_prompt_len": 64}, layer_names, dict(zip(layer_names, caches)))
    block_table = torch.arange(1, 21, dtype=torch.int32).view(2, 10)
    decode = StepInfo(requests=[BatchRequest("short", 20, 20, 1)])
    planner.begin_step(decode)
    assert not planner.dispatch_eager_attention()  # a plain decode: a full graph may replay it
    chunk = StepInfo(requests=[BatchRequest("short", 20, 21, 1), BatchRequest("long", 300, 0, 1)])
    planner.begin_step(chunk)
    assert planner.dispatch_eager_attention()  # a (one-token) prefill chunk: its queries are kept
    common = _common(block_table, [0, 1, 2], [22, 1], torch.tensor([16 * 1 + 5, 16 * 11]), 4)
    plan = planner.plan_step(common)
    assert has_host_work(plan)
    planner.check_graph_step(plan)  # flagged: runs piecewise, the forward keeps the queries
    planner.begin_step(StepInfo(requests=[BatchRequest("short", 20, 22, 1), BatchRequest("long", 300, 1, 1)]))
    plan = planner.plan_step(common)
    with pytest.raises(RuntimeError, match="not dispatched piecewise"):
        planner.check_graph_step(plan)


def test_the_runner_hook_dispatches_a_step_with_host_work_as_not_uniform(monkeypatch):
    """``patches/model_runner.py``'s hook on ``_determine_batch_execution_and_padding``, as vLLM's ``execute_model``
    calls it (keywords, no ``force_uniform_decode``): under ``cuda_graphs: full_decode`` a step whose attention keeps
    queries is passed ``force_uniform_decode=False`` (vLLM then picks piecewise graphs), a plain decode goes through
    untouched (a full graph may replay it); vLLM's own choice (graph capture passes ``force_uniform_decode``) is
    never overridden; under ``piecewise`` and without the flag the hook passes everything through."""
    from rcstat_vllm.patches import model_runner as hooks

    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    caches = dict(zip(layer_names, _layer_caches(30, pooled=True)))
    owners = {
        "full": _worker({"method": "rc", "min_prompt_len": 64, "cuda_graphs": "full_decode"}, layer_names, caches),
        "piecewise": _worker({"method": "rc", "min_prompt_len": 64}, layer_names, caches),
    }
    runners = {name: SimpleNamespace(name=name) for name in (*owners, "no flag")}
    monkeypatch.setattr(hooks, "runner_owner", lambda runner: owners.get(runner.name))
    seen = []

    def vllm_dispatch(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, **kwargs):
        seen.append(kwargs.get("force_uniform_decode"))
        return "dispatched"

    hooked = hooks._determine_batch_execution_and_padding(vllm_dispatch)
    decode = StepInfo(requests=[BatchRequest("short", 20, 20, 1)])
    chunk = StepInfo(requests=[BatchRequest("short", 20, 21, 1), BatchRequest("long", 300, 0, 1)])
    args = dict(num_tokens=2, num_reqs=2, num_scheduled_tokens_np=None, max_num_scheduled_tokens=1)
    for step in (decode, chunk):
        for owner in owners.values():
            owner.begin_step(step)
        for runner in runners.values():
            assert hooked(runner, **args, use_cascade_attn=False, allow_microbatching=True) == "dispatched"
        assert hooked(runners["full"], **args, force_uniform_decode=True) == "dispatched"  # capture: vLLM decides
    assert seen == [None, None, None, True, False, None, None, True]
