"""A deferred scoring (lazy eviction: every layer scored in the step that compacts the request) stacks the layers.

The step that compacts a lazily evicted request scores all its layers first, and on a CPU a layer's few dozen small
ops cost more in dispatch than in arithmetic (about 100 ms a copy in ``serving_cpu.json``). Scorers whose KV heads
score alone (:attr:`Scorer.heads_independent`) score several layers in one call (:meth:`Scorer.score_layers`); here
that gives exactly the scores of scoring one layer at a time, in every layout the torch path reads, with a prefix
served from the cache, and whatever the layer groups.
"""

from __future__ import annotations

import pytest
import torch

import rcstat_vllm.worker.prompt_compression as compression
from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.paging.kv_layout import CPU_AMX, CPU_VEC
from rcstat_vllm.scoring import PagedPrompt, get_scorer
from rcstat_vllm.settings import scorer_options
from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor

KV_HEADS, GROUP, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 3, 3, 64, 32, 24, 5
SCALE = HEAD_DIM**-0.5


def layer_caches(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]


def windows(num_queries, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(KV_HEADS * GROUP, num_queries, HEAD_DIM, generator=gen) for _ in range(LAYERS)]


@pytest.mark.parametrize(
    "method, knobs",
    [
        ("rc", {}),
        ("rc", {"value_weight": 1.0}),
        ("rc", {"chunk": 4}),
        ("snapkv", {}),
        ("knorm", {}),
        ("streaming", {}),
        ("tova", {}),
    ],
)
def test_score_layers_gives_each_layers_own_scores(method, knobs):
    config = RCStatConfig(method=method, **knobs)
    scorer = get_scorer(method, **scorer_options(config))
    caches = layer_caches(torch.float32)
    row = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))[:8]
    prompts = [PagedPrompt(*CPU_VEC.key_value_caches(cache), row, 230) for cache in caches]
    queries = windows(32)
    want = [scorer.score_paged(q, prompt, SCALE) for q, prompt in zip(queries, prompts)]
    got = scorer.score_layers(queries, prompts, SCALE)
    assert len(got) == LAYERS
    for layer_got, layer_want in zip(got, want):
        torch.testing.assert_close(layer_got, layer_want, rtol=1e-6, atol=1e-6)


def test_tova_is_not_stacked_its_scores_mix_a_layers_heads():
    """TOVA averages a layer's heads: stacked layers would mix them, so it scores layer by layer."""
    scorer = get_scorer("tova", **scorer_options(RCStatConfig(method="tova")))
    assert not scorer.heads_independent
    caches, row = layer_caches(torch.float32), torch.arange(8)
    prompts = [PagedPrompt(*CPU_VEC.key_value_caches(cache), row, 230) for cache in caches[:2]]
    queries = windows(32)[:2]
    stacked = scorer.score(torch.cat(queries), torch.cat([p.gather_keys() for p in prompts]), None, SCALE)
    per_layer = torch.cat(scorer.score_layers(queries, prompts, SCALE))
    assert not torch.allclose(stacked, per_layer)


def deferred_request(config, num_tokens, caches, layout, cached_tokens):
    row = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5))[: -(-num_tokens // BLOCK)]
    request = RequestCompressor(CompressionDecision("r", config, num_tokens, 0, num_tokens), LAYERS, row)
    request.num_cached_tokens = cached_tokens
    request.defer_scoring()
    step_queries = windows(num_tokens)  # each layer's [Hq, n, D]: the prefill's rows of this request
    for layer, queries in enumerate(step_queries):
        request.observe_layer(layer, queries.transpose(0, 1), caches[layer], SCALE, layout)
    return request


@pytest.mark.parametrize("layout, dtype", [(CPU_VEC, torch.float32), (CPU_AMX, torch.bfloat16)], ids=["vec", "amx"])
@pytest.mark.parametrize("layers_per_call", [1, 2, LAYERS])
@pytest.mark.parametrize("cached_tokens", [0, 320])
@pytest.mark.parametrize("value_weight", [0.0, 1.0])
def test_deferred_scoring_in_layer_groups_equals_layer_by_layer(
    monkeypatch, layout, dtype, layers_per_call, cached_tokens, value_weight
):
    # the bare flag: RC, lazy, budget over pooled pages (scoring deferred); weighted by values (they are read too)
    config = RCStatConfig.from_dict({"value_weight": value_weight})
    n, caches = 700, layer_caches(dtype)
    want = deferred_request(config, n, caches, layout, cached_tokens)
    for layer, (q_window, scale) in enumerate(want.windows):  # one layer at a time, as the Triton path does
        want.score_window(layer, q_window, caches[layer], scale, layout)

    got = deferred_request(config, n, caches, layout, cached_tokens)
    calls = []
    score = got.scorer.score
    monkeypatch.setattr(got.scorer, "score", lambda *args: calls.append(args[1].shape[0]) or score(*args))
    per_layer_bytes = KV_HEADS * n * HEAD_DIM * 4  # gathered keys (a value-weighted RC reads only the values' norms)
    monkeypatch.setattr(compression, "DEFERRED_LAYERS_BYTES", per_layer_bytes * layers_per_call)
    got.score_deferred(caches, layout)

    assert got.windows is None
    assert calls == [
        KV_HEADS * len(range(s, min(s + layers_per_call, LAYERS))) for s in range(0, LAYERS, layers_per_call)
    ]
    for layer in range(LAYERS):
        torch.testing.assert_close(got.scores[layer], want.scores[layer], rtol=1e-6, atol=1e-6)
        assert got.scores[layer].shape == (KV_HEADS, n)


def test_scoring_ahead_in_shares_then_the_rest_at_the_copy_gives_the_same_scores():
    """A parked plan named by the scheduler is scored a share of its layers per step (``max_layers``), the rest at
    its copy: every layer's scores as one scoring at the copy gives them."""
    config = RCStatConfig.from_dict({})
    n, caches = 500, layer_caches(torch.bfloat16)
    want = deferred_request(config, n, caches, CPU_AMX, 0)
    assert want.score_deferred(caches, CPU_AMX) == LAYERS and want.windows is None

    got = deferred_request(config, n, caches, CPU_AMX, 0)
    assert got.score_deferred(caches, CPU_AMX, max_layers=2) == 2
    assert [s is not None for s in got.scores] == [True, True, False, False, False]
    assert got.deferred  # still waiting for its copy: the windows of the layers left are kept
    assert got.score_deferred(caches, CPU_AMX, max_layers=2) == 2
    assert got.score_deferred(caches, CPU_AMX) == 1 and got.windows is None  # at the copy: the last layer
    for layer in range(LAYERS):
        torch.testing.assert_close(got.scores[layer], want.scores[layer], rtol=1e-6, atol=1e-6)


PLANNED_TOKENS = 500
PLANNED_BLOCKS = 2 * -(-PLANNED_TOKENS // BLOCK) + 2


def planned(backing):
    """A lazy plan (the bare flag: budget over pooled pages) of a ``PLANNED_TOKENS``-token prompt in ``backing``, a
    pooled all-layers cache: windows kept, nothing scored; with its layers' caches and page space."""
    from rcstat_vllm.paging.page_space import PageSpace
    from rcstat_vllm.worker.prompt_compression import deferred_keep_blocks

    config, n = RCStatConfig.from_dict({}), PLANNED_TOKENS
    caches = list(backing.view(LAYERS, PLANNED_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM).unbind(0))
    space = PageSpace.pooled(backing, [layer * PLANNED_BLOCKS * KV_HEADS for layer in range(LAYERS)], KV_HEADS, BLOCK)
    request = RequestCompressor(CompressionDecision("r", config, n, 0, n), LAYERS, torch.arange(-(-n // BLOCK)))
    request.defer_scoring()
    for layer, queries in enumerate(windows(n)):
        request.observe_layer(layer, queries.transpose(0, 1), caches[layer], SCALE, CPU_VEC)
    request.keep_blocks = request.plan_deferred(space, deferred_keep_blocks(config, n, LAYERS, space))
    return request, caches, space


def planned_backing():
    gen = torch.Generator().manual_seed(8)
    return torch.randn(LAYERS * PLANNED_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)


def test_selecting_ahead_of_the_copy_then_copying_equals_scoring_and_selecting_at_the_copy():
    """A parked plan scored ahead in shares, then selected in a step of its own (``select_deferred``): its copy
    writes the very entries a copy that scored and selected everything itself writes, and reports the same."""
    backing = planned_backing()
    want_backing, got_backing = backing.clone(), backing.clone()
    want, want_caches, want_space = planned(want_backing)
    got, got_caches, got_space = planned(got_backing)
    n = PLANNED_TOKENS
    dest = torch.arange(PLANNED_BLOCKS - want.keep_blocks, PLANNED_BLOCKS)
    want_pages = want.compact(want_caches, dest, want_space, CPU_VEC, n)

    assert got.score_deferred(got_caches, CPU_VEC, max_layers=3) == 3 and not got.scored_deferred
    assert got.score_deferred(got_caches, CPU_VEC, max_layers=3) == LAYERS - 3 and got.scored_deferred
    got.select_deferred(got_caches, got_space, CPU_VEC)
    assert not got.deferred and got.masks is not None  # the copy has nothing left to score or select
    got_pages = got.compact(got_caches, dest, got_space, CPU_VEC, n)

    assert torch.equal(got_backing, want_backing) and not torch.equal(want_backing, backing)  # (entries moved)
    assert [t.tolist() for t in got_pages.tables] == [t.tolist() for t in want_pages.tables]
    assert got.report().kept == want.report().kept and got.report().keep_blocks == want.report().keep_blocks


def test_a_plan_selected_ahead_whose_request_leaves_uncopied_reports_its_full_kv_kept():
    """Selected ahead, then never copied (its request finished or was preempted, or the scheduler refused blocks):
    the outcome is the uncompressed one with the reason, every head keeping every token; the selection made ahead
    is not reported as done, and the cache is untouched."""
    backing = planned_backing()
    request, caches, space = planned(backing.clone())
    request.score_deferred(caches, CPU_VEC, max_layers=LAYERS)  # (ahead: every layer in one share)
    request.select_deferred(caches, space, CPU_VEC)
    assert request.kept is not None and int(request.kept.sum()) < LAYERS * KV_HEADS * PLANNED_TOKENS
    report = request.report("preempted before its KV was compacted (vLLM recomputes it when it resumes)")
    assert report.skipped_reason.startswith("preempted") and report.kept == [[PLANNED_TOKENS] * KV_HEADS] * LAYERS
    assert report.keep_blocks == -(-PLANNED_TOKENS // BLOCK)
    assert torch.equal(torch.stack(caches), backing.view(LAYERS, PLANNED_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM))
