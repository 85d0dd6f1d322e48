"""Scoring a request's prompt in place in the paged cache (the CUDA prefill path) against the torch path.

The CUDA backend scores through ``RequestCompressor.observe_layer`` -> ``Scorer.score_paged``: with a GPU layout
(``FLASH``) on a CUDA device, RC and SnapKV run the Triton paged kernels over the key half of the cache rows;
everything else gathers the keys and runs the torch scorer. Here the device check is faked so the kernels run
under the Triton interpreter on CPU tensors, with the cache layout the CUDA backend uses: ``[B, H, N, 2D]``, each
token row holding key then value, and a scrambled block table longer than the prompt needs.

The interpreter of Triton 3.9 multiplies bfloat16 tiles as their raw uint16 storage in ``tl.dot`` (numpy has no
bfloat16), so half precision is checked with float16 here; bfloat16 is checked compiled on a GPU by
``tests/test_kernels.py`` (``TRITON_INTERPRET=0``) and ``benchmarks/gpu_check.py`` (the whole default scorer too).
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot run")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip(
        "fakes the CUDA check on CPU tensors: needs the Triton interpreter (TRITON_INTERPRET=1)",
        allow_module_level=True,
    )

for _name in ("_tiles_triton", "_rc_triton", "_snapkv_triton"):  # compiled-mode copies are reloaded, see test_kernels
    _module = f"rcstat_vllm.kernels.{_name}"
    if _module in sys.modules:
        importlib.reload(sys.modules[_module])

from fake_vllm import fake_vllm_config  # noqa: E402

import rcstat_vllm.kernels.rc_scoring as rc_scoring  # noqa: E402
import rcstat_vllm.kernels.snapkv_scoring as snapkv_scoring  # noqa: E402
import rcstat_vllm.worker.prompt_compression as compression  # noqa: E402
from rcstat_vllm.config import RCStatConfig  # noqa: E402
from rcstat_vllm.paging.compaction import gather_prompt  # noqa: E402
from rcstat_vllm.paging.kv_layout import CPU_AMX, CPU_VEC, FLASH  # noqa: E402
from rcstat_vllm.scoring import SCORERS, PagedPrompt, RCScorer, SnapKVScorer, get_scorer  # noqa: E402
from rcstat_vllm.scoring.rc_knobs import RC_PAPER  # noqa: E402
from rcstat_vllm.scoring.selection import select_keep_masks  # noqa: E402
from rcstat_vllm.settings import scorer_options  # noqa: E402
from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor, triton_scoring  # noqa: E402

# SmolLM2's attention: 9 query heads over 3 KV heads (G = 3), head dim 64.
KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 3, 64, 16, 12
SCALE = HEAD_DIM**-0.5
EXTRA_QUERIES = 3  # another request's rows before this one's in the step's query tensor


def flash_request(num_tokens, group, seed, dtype=torch.float32, num_kv_heads=KV_HEADS):
    """A FLASH cache [B, H, N, 2D] (key then value in each row), a scrambled block table with a spare page, and the
    step's queries [T, Hq, D] whose last ``num_tokens`` rows are this request's (others' rows come first)."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(NUM_BLOCKS, num_kv_heads, BLOCK, 2 * HEAD_DIM, generator=gen).to(dtype)
    pages = -(-num_tokens // BLOCK) + 1
    block_row = torch.randperm(NUM_BLOCKS, generator=gen)[:pages].to(torch.int32)
    query = torch.randn(EXTRA_QUERIES + num_tokens, num_kv_heads * group, HEAD_DIM, generator=gen).to(dtype)
    return kv_cache, block_row, query


def compressor(config, num_tokens, block_row, num_layers=1):
    decision = CompressionDecision("r", config, num_tokens, EXTRA_QUERIES, EXTRA_QUERIES + num_tokens)
    return RequestCompressor(decision, num_layers, block_row)


@pytest.fixture
def spy_kernels(monkeypatch):
    """Counts the launches of the paged kernels (the scorers call them through these modules)."""
    calls = {"rc": 0, "snapkv": 0}

    def counting(name, kernel):
        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(rc_scoring, "rc_table_scores_paged", counting("rc", rc_scoring.rc_table_scores_paged))
    monkeypatch.setattr(
        snapkv_scoring, "snapkv_attention_paged", counting("snapkv", snapkv_scoring.snapkv_attention_paged)
    )
    return calls


def fake_cuda(monkeypatch):
    """Fake the device check of ``triton_scoring`` (not its result): CPU tensors then take the CUDA decision."""
    monkeypatch.setattr(compression, "triton_device", lambda tensor: True)


def score_layer(config, kv_cache, block_row, query, layout=FLASH):
    """One layer's scores by a fresh compressor (a fresh scorer: the random one draws the same scores each time)."""
    request = compressor(config, query.shape[0] - EXTRA_QUERIES, block_row)
    request.observe_layer(0, query, kv_cache, SCALE, layout)
    return request.scores[0]


def old_torch_path(config, kv_cache, block_row, query, num_tokens, layout):
    """What scoring computed before paged scoring: dense float32 copies of every head's keys and values."""
    keys, values = gather_prompt(kv_cache, block_row, num_tokens, layout)
    width = min(compression.window_queries(config), num_tokens)
    q_window = query[-width:].transpose(0, 1).float()
    scorer = get_scorer(config.method, **compression.scorer_options(config))
    return scorer.score(q_window, keys.float(), values.float(), SCALE)


CASES = [
    # (method, window, smoothing, G, prompt tokens); the prompt never fills its last page
    ("rc", 8, 1, 1, 61),
    ("rc", 8, 3, 3, 61),
    ("rc", 32, 1, 3, 75),
    ("rc", 32, 3, 1, 75),
    ("snapkv", 8, 1, 1, 90),  # SnapKV's own 64-query window
    ("snapkv", 8, 1, 3, 90),
]


@pytest.mark.parametrize("method, window, smoothing, group, num_tokens", CASES)
def test_triton_path_of_score_layer_equals_the_torch_path_fp32(
    monkeypatch, spy_kernels, method, window, smoothing, group, num_tokens
):
    config = RCStatConfig(method=method, window=window, smoothing=smoothing)
    kv_cache, block_row, query = flash_request(num_tokens, group, seed=window + group + smoothing)
    want = score_layer(config, kv_cache, block_row, query)  # on CPU: the torch path
    assert spy_kernels == {"rc": 0, "snapkv": 0}
    fake_cuda(monkeypatch)
    got = score_layer(config, kv_cache, block_row, query)
    assert spy_kernels[method] == 1
    assert got.shape == want.shape == (KV_HEADS, num_tokens) and got.dtype == torch.float32
    scored = min(compression.window_queries(config), num_tokens)
    assert torch.isinf(got[:, num_tokens - scored :]).all() and torch.isfinite(got[:, : num_tokens - scored]).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 if method == "snapkv" else 1e-5)


@pytest.mark.parametrize("layout", [FLASH, CPU_VEC], ids=["flash", "cpu_vec"])
@pytest.mark.parametrize("method", sorted(SCORERS))
def test_torch_path_equals_the_dense_gather_it_replaces(layout, method):
    """On CPU (and for methods without a kernel) observe_layer still computes exactly what it did."""
    config = RCStatConfig(method=method, window=8, smoothing=3)
    kv_cache, block_row, query = flash_request(70, 3, seed=1)
    got = score_layer(config, kv_cache, block_row, query, layout)
    want = old_torch_path(config, kv_cache, block_row, query, 70, layout)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "method, knobs", [(method, {}) for method in sorted(SCORERS)] + [("rc", {"value_weight": 1.0})]
)
def test_torch_path_over_amx_tiles_scores_what_plain_rows_of_the_same_tokens_score(method, knobs):
    """vLLM-CPU's AMX layout (bf16 tiles of 32 tokens): the scorer gathers the prompt from tiled views; it scores
    exactly what it scores from the same tokens in the vec layout's plain rows, and what the dense gather gives (RC
    weighted by values too: their norms from tiles, from plain rows page by page, and from the dense copy)."""
    config = RCStatConfig(method=method, window=8, smoothing=3, **knobs)
    gen = torch.Generator().manual_seed(2)
    amx = torch.randn(NUM_BLOCKS, KV_HEADS, 32, 2 * HEAD_DIM, generator=gen).bfloat16()
    num_tokens = 100  # the last page part-full
    block_row = torch.randperm(NUM_BLOCKS, generator=gen)[:5].to(torch.int32)
    query = torch.randn(EXTRA_QUERIES + num_tokens, KV_HEADS * 3, HEAD_DIM, generator=gen).bfloat16()
    pages = torch.arange(NUM_BLOCKS * KV_HEADS).unsqueeze(1).expand(-1, 32)
    offsets = torch.arange(32).expand_as(pages)
    vec = torch.empty_like(amx)
    CPU_VEC.write(vec, pages, offsets, *CPU_AMX.read(amx, pages, offsets))
    got = score_layer(config, amx, block_row, query, CPU_AMX)
    torch.testing.assert_close(got, score_layer(config, vec, block_row, query, CPU_VEC), rtol=0, atol=0)
    want = old_torch_path(config, amx, block_row, query, num_tokens, CPU_AMX)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "method, window, smoothing, group, num_tokens, knobs",
    [(*CASES[1], {}), (*CASES[2], {}), (*CASES[2], {"value_weight": 1.0}), (*CASES[5], {})],
)
def test_triton_path_on_half_caches_is_close_to_the_float32_reference(
    monkeypatch, method, window, smoothing, group, num_tokens, knobs
):
    """(RC weighted by values too: the norms summed in float32 from the half cache's values.)"""
    config = RCStatConfig(method=method, window=window, smoothing=smoothing, **knobs)
    kv_cache, block_row, query = flash_request(num_tokens, group, seed=7, dtype=torch.float16)
    # The reference: the torch path on float32 copies of the same (rounded) values.
    want = score_layer(config, kv_cache.float(), block_row, query.float())
    fake_cuda(monkeypatch)
    got = score_layer(config, kv_cache, block_row, query)
    # Measured under the interpreter: <= 4e-7 relative (products of half values are exact in float32, only the
    # summation order differs); 1e-3 leaves room for a GPU's tensor-core accumulation order.
    scale = want[torch.isfinite(want)].abs().mean().item()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * scale)


#: RC's knobs as the paper scores (RCScorer.paper()), the base the RC cases below vary from.
PAPER = RC_PAPER.scorer_options()

#: Every registered method with its defaults and with other values of its knobs (as kvpress's presses drive its
#: tests): the scorer contract below runs on each. A new method (or knob) needs a case here.
SCORER_CASES = [
    ("rc", {}),
    ("rc", PAPER),
    ("rc", {**PAPER, "window_size": 4, "smoothing": 3}),
    ("rc", {**PAPER, "window_size": 4, "smoothing": 3, "carry_forward": 5}),
    ("rc", {**PAPER, "window_size": 4, "smoothing": 3, "carry_forward": 5, "query_reduction": "max"}),
    ("rc", {"group_reduction": "max"}),
    (
        "rc",
        {**PAPER, "window_size": 4, "smoothing": 3, "group_reduction": "max"},
    ),  # the mean over queries, max over heads
    (
        "rc",
        {**PAPER, "window_size": 4, "smoothing": 3, "carry_forward": 5, "local_contrast": 0.5, "contrast_radius": 7},
    ),
    ("rc", {"value_weight": 1.0}),
    ("rc", {**PAPER, "window_size": 4, "smoothing": 3, "value_weight": 0.5}),
    ("rc", {"chunk": 4}),
    ("rc", {**PAPER, "window_size": 4, "smoothing": 3, "carry_forward": 5, "chunk": 3}),
    ("snapkv", {}),
    ("snapkv", {"window_size": 6, "kernel_size": 3}),
    ("tova", {}),
    ("knorm", {}),
    ("streaming", {}),
    ("streaming", {"n_sink": 1}),
    ("random", {}),
    ("random", {"seed": 5}),
]


def case_id(method: str, knobs: dict) -> str:
    """``rc-paper-window_size=4``: the method, the paper preset if the case starts from it, the knobs it sets."""
    base = PAPER if method == "rc" and PAPER.keys() <= knobs.keys() else {}
    return method + ("-paper" if base else "") + "".join(f"-{k}={v}" for k, v in knobs.items() if base.get(k) != v)


CASE_IDS = [case_id(method, knobs) for method, knobs in SCORER_CASES]


def test_scorer_cases_cover_every_registered_method_and_knob():
    assert {method for method, _ in SCORER_CASES} == set(SCORERS)
    for method, scorer_cls in SCORERS.items():
        varied = {knob for name, knobs in SCORER_CASES if name == method for knob in knobs}
        assert varied >= set(scorer_cls.options()) - {"window_size"}, f"{method}: add a case that sets its knobs"


def paged_prompt_case(num_tokens=61, given_queries=16, seed=6):
    """A FLASH cache with one request's prompt on a scrambled block table (last page part-full), its dense float32
    keys and values, and the trailing ``given_queries`` queries [Hq, w, d]."""
    kv_cache, block_row, query = flash_request(num_tokens, 3, seed=seed)
    prompt = PagedPrompt(*FLASH.key_value_caches(kv_cache), block_row, num_tokens)
    keys, values = gather_prompt(kv_cache, block_row, num_tokens, FLASH)
    return prompt, keys.float(), values.float(), query[-given_queries:].transpose(0, 1).float()


@pytest.mark.parametrize("method, knobs", SCORER_CASES, ids=CASE_IDS)
def test_every_scorer_keeps_the_scoring_contract(method, knobs):
    """float32 [Hkv, n]; +inf exactly on the tokens the method always keeps (its trailing window, its sinks), finite
    elsewhere; the inputs left as they were. A scorer is called again and again (one per request, for every layer,
    and for every decode-time round): used on another prompt first, it gives this prompt the numbers a fresh scorer
    with the same knobs gives (nothing carried from call to call), except the random scorer, which draws fresh
    scores at each call, the same sequence from the same seed."""
    num_tokens, given = 61, 16
    _, keys, values, q_window = paged_prompt_case(num_tokens, given)
    inputs = [tensor.clone() for tensor in (q_window, keys, values)]
    scorer = get_scorer(method, **knobs)
    assert all(getattr(scorer, knob) == value for knob, value in knobs.items())
    scores = scorer.score(q_window, keys, values, SCALE)
    assert all(torch.equal(given_, kept) for given_, kept in zip((q_window, keys, values), inputs))
    assert scores.shape == (KV_HEADS, num_tokens) and scores.dtype == torch.float32
    window = min(scorer.window_size, given)
    sinks = getattr(scorer, "n_sink", 0)
    always = torch.zeros(num_tokens, dtype=torch.bool)
    always[num_tokens - window :] = True
    always[:sinks] = True
    assert torch.isinf(scores[:, always]).all() and (scores[:, always] > 0).all()
    assert torch.isfinite(scores[:, ~always]).all()
    _, other_keys, other_values, other_window = paged_prompt_case(45, 12, seed=11)
    used = get_scorer(method, **knobs)
    used.score(other_window, other_keys, other_values, SCALE)  # another request, or another layer
    again = used.score(q_window, keys, values, SCALE)
    if method == "random":
        assert not torch.equal(again, scores)  # fresh draws
        first_two = get_scorer(method, **knobs)
        first_two.score(other_window, other_keys, other_values, SCALE)
        torch.testing.assert_close(first_two.score(q_window, keys, values, SCALE), again, rtol=0, atol=0)
    else:
        torch.testing.assert_close(again, scores, rtol=0, atol=0)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("method, knobs", SCORER_CASES, ids=CASE_IDS)
def test_every_scorer_scores_a_paged_prompt_as_its_dense_copy(spy_kernels, method, knobs, use_triton):
    """Scorer.score_paged on a small random paged cache equals Scorer.score on the dense keys and values: exactly on
    the torch path, to float32 rounding where a Triton kernel runs (RC and SnapKV, under the interpreter here)."""
    prompt, keys, values, q_window = paged_prompt_case()
    want = get_scorer(method, **knobs).score(q_window, keys, values, SCALE)
    scorer = get_scorer(method, **knobs)
    got = scorer.score_paged(q_window, prompt, SCALE, use_triton=use_triton)
    in_triton = scorer.scores_in_triton(prompt, use_triton)
    assert in_triton == (use_triton and method in ("rc", "snapkv"))
    assert spy_kernels.get(method, 0) == int(in_triton)
    tolerance = {"rtol": 1e-5, "atol": 1e-6 if method == "snapkv" else 1e-5} if in_triton else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize(
    "method, cached, first_block, contrast, chunk",
    [
        ("rc", 64, 3, 0.0, 1),  # reads from 64 - (8 + 3 // 2) = 55, in block 3 (48..63)
        ("rc", 96, 5, 0.0, 1),  # 96 - 9 = 87, in block 5 (80..95)
        ("rc", 120, 5, 0.0, 1),  # 112 shared; the window (the last 32 of 123) reaches back to 91, in block 5
        ("rc", 8, 0, 0.0, 1),  # less than a block cached: nothing shared, all read
        ("rc", 96, 4, 0.5, 1),  # contrasted over 20 tokens each side: 96 - 9 - 20 = 67, in block 4 (64..79)
        ("rc", 64, 2, 0.5, 1),  # 64 - 29 = 35, in block 2 (32..47)
        ("rc", 96, 5, 0.0, 8),  # chunks of 8: 96 - 9 - 7 = 80, in block 5 (80..95), chunks counted from there alike
        ("rc", 64, 2, 0.0, 16),  # chunks of 16 (the block size): 64 - 9 - 15 = 40, in block 2 (32..47)
        ("snapkv", 96, 0, 0.0, 1),  # a softmax over every key: all read
        ("tova", 96, 0, 0.0, 1),
    ],
)
def test_a_cached_prefix_is_not_scored_and_what_is_scored_is_unchanged(
    monkeypatch, spy_kernels, method, cached, first_block, contrast, chunk, use_triton
):
    """Prompt tokens served from the prefix cache are kept whole, so their scores are never read: RC (each token's
    score from its own key and the window's, then smoothing and carrying a few tokens) reads the prompt from the
    block its first own token's score needs; every score from the shared boundary on is the whole prompt's (to float
    rounding)."""
    if use_triton:
        fake_cuda(monkeypatch)
    num_tokens = 123
    config = RCStatConfig(
        method=method, smoothing=3, carry_forward=8, window=32, local_contrast=contrast, contrast_radius=20, chunk=chunk
    )
    kv_cache, block_row, query = flash_request(num_tokens, 3, seed=9)
    whole = score_layer(config, kv_cache, block_row, query)
    request = compressor(config, num_tokens, block_row)
    request.num_cached_tokens = cached
    read = []
    original = PagedPrompt.tail

    def spy_tail(prompt, first):
        read.append(first)
        return original(prompt, first)

    monkeypatch.setattr(PagedPrompt, "tail", spy_tail)
    request.observe_layer(0, query, kv_cache, SCALE, FLASH)
    assert read == [first_block]
    shared = cached // BLOCK * BLOCK
    got = request.scores[0]
    assert got.shape == whole.shape
    # float32 rounding: the logits' matmul is shaped by the tokens read (BLAS blocks them differently)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if method == "rc" else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got[:, shared:], whole[:, shared:], **tolerance)
    assert (got[:, : first_block * BLOCK] == 0).all()


@pytest.mark.parametrize("method", sorted(SCORERS))
def test_no_scorer_reads_values(monkeypatch, method):
    """A cache whose value half is NaN scores exactly as a clean one, on both paths: values are never read."""
    config = RCStatConfig(method=method, window=8, smoothing=3)
    kv_cache, block_row, query = flash_request(61, 3, seed=2)
    poisoned = kv_cache.clone()
    poisoned[..., HEAD_DIM:] = float("nan")
    for use_triton in (False, True):
        if use_triton:
            fake_cuda(monkeypatch)
        clean = score_layer(config, kv_cache, block_row, query)
        got = score_layer(config, poisoned, block_row, query)
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, clean, rtol=0, atol=0)
    assert not SCORERS[method]().needs_values and not SCORERS[method]().needs_value_norms


def test_rc_value_weighting_multiplies_each_finished_score_by_its_values_norm(monkeypatch):
    """value_weight A: RC's finished scores (window +inf) times ||v_t|| ** A in that KV head, on the dense path and
    both paged paths (the Triton kernel reads keys, the norms come from the value cache); a zero value keeps the
    window at +inf and a score at 0 (never NaN); poisoned values reach the scores (they are read); off in threshold
    mode, as the local contrast."""
    _, keys, values, q_window = paged_prompt_case(61, 16)
    values[1, 3] = 0.0
    plain = get_scorer("rc").score(q_window, keys, values, SCALE)
    for power in (0.5, 1.0, 2.0):
        weighted = get_scorer("rc", value_weight=power).score(q_window, keys, values, SCALE)
        want = plain * values.norm(dim=-1).clamp_min(1e-12) ** power
        torch.testing.assert_close(weighted, want, rtol=0, atol=0)
        assert not torch.isnan(weighted).any() and torch.isinf(weighted[:, -16:]).all()
    config = RCStatConfig(method="rc", window=8, target_ratio=0.9, value_weight=1.0)
    kv_cache, block_row, query = flash_request(61, 3, seed=2)
    _, dense_values = gather_prompt(kv_cache, block_row, 61, FLASH)
    torch_path = score_layer(config, kv_cache, block_row, query)
    unweighted = score_layer(config.merged({"value_weight": 0.0}), kv_cache, block_row, query)
    torch.testing.assert_close(torch_path, unweighted * dense_values.float().norm(dim=-1), rtol=1e-6, atol=0)
    fake_cuda(monkeypatch)
    torch.testing.assert_close(score_layer(config, kv_cache, block_row, query), torch_path, rtol=1e-5, atol=1e-5)
    poisoned = kv_cache.clone()
    poisoned[..., HEAD_DIM:] = float("nan")
    assert torch.isnan(score_layer(config, poisoned, block_row, query)).all(dim=0).any()
    threshold = RCStatConfig(method="rc", window=8, target_ratio=None, c=1.0, value_weight=1.0)
    assert not get_scorer("rc", **scorer_options(threshold)).needs_value_norms


def test_dispatch_picks_triton_for_flash_on_cuda_and_torch_for_cpu_vec(monkeypatch, spy_kernels):
    kv_cache, block_row, query = flash_request(61, 3, seed=3)
    # A CPU tensor: the real device check says no, whatever the layout.
    assert not triton_scoring(FLASH, kv_cache) and not triton_scoring(CPU_VEC, kv_cache)
    fake_cuda(monkeypatch)
    assert triton_scoring(FLASH, kv_cache)
    assert not triton_scoring(CPU_VEC, kv_cache) and not triton_scoring(CPU_AMX, kv_cache)  # vLLM-CPU runs no Triton
    config = RCStatConfig(method="rc", window=8)
    score_layer(config, kv_cache, block_row, query, CPU_VEC)
    assert spy_kernels["rc"] == 0
    score_layer(config, kv_cache, block_row, query, FLASH)
    assert spy_kernels["rc"] == 1


def test_each_scorer_takes_its_kernel_only_where_it_computes_the_same_scores():
    kv_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    prompt = PagedPrompt(*FLASH.key_value_caches(kv_cache), torch.arange(4), 50)
    assert RCScorer().scores_in_triton(prompt, use_triton=True)
    assert SnapKVScorer().scores_in_triton(prompt, use_triton=True)
    assert not RCScorer().scores_in_triton(prompt, use_triton=False)
    for name in ("tova", "knorm", "streaming", "random"):
        assert not get_scorer(name).scores_in_triton(prompt, use_triton=True)
    double = PagedPrompt(*FLASH.key_value_caches(kv_cache.double()), torch.arange(4), 50)
    assert not RCScorer().scores_in_triton(double, use_triton=True)  # float64 (and fp8) caches: torch


def test_scorers_fall_back_to_torch_where_no_kernel_applies(monkeypatch, spy_kernels):
    kv_cache, block_row, query = flash_request(61, 3, seed=4, dtype=torch.float64)  # no kernel takes float64
    prompt = PagedPrompt(*FLASH.key_value_caches(kv_cache), block_row, 61)
    q_window = query[-8:].transpose(0, 1).float()
    keys = gather_prompt(kv_cache, block_row, 61, FLASH)[0].float()
    for scorer in (RCScorer(), SnapKVScorer(), get_scorer("tova")):
        got = scorer.score_paged(q_window, prompt, SCALE, use_triton=True)
        torch.testing.assert_close(got, scorer.score(q_window, keys, None, SCALE), rtol=0, atol=0)
    assert spy_kernels == {"rc": 0, "snapkv": 0}


@pytest.mark.parametrize(
    "config",
    [
        RCStatConfig(),  # model-wide budget (layer_mean)
        RCStatConfig(budget_scope="layer"),
        RCStatConfig(target_ratio=None, c=1.0),  # threshold
        RCStatConfig(method="snapkv", budget_scope="layer"),
        RCStatConfig(method="tova"),
    ],
    ids=["model-budget", "layer-budget", "threshold", "snapkv", "tova"],
)
def test_scoring_and_selection_never_wait_for_the_device(config):
    """Meta tensors hold no data: any host synchronisation (``.item()``, ``int(t)``, ``.tolist()``, ``.cpu()``)
    in per-layer scoring or in the selection raises on them. Only ``select``'s final transfer may read data."""
    num_tokens, layers = 70, 3
    kv_cache, block_row, query = (t.to("meta") for t in flash_request(num_tokens, 3, seed=5))
    request = compressor(config, num_tokens, block_row, num_layers=layers)
    for layer in range(layers):
        request.observe_layer(layer, query, kv_cache, SCALE, FLASH)
    masks = select_keep_masks(request.scores, config)
    assert [m.shape for m in masks] == [(KV_HEADS, num_tokens)] * layers and masks[0].device.type == "meta"


def test_start_up_warm_up_launches_the_servers_scoring_kernel_once_and_only_where_it_runs(monkeypatch, spy_kernels):
    """The worker compiles the server's scoring kernel when the caches are bound (a GPU would otherwise stall on its
    first compressed request): one launch of RC's (or SnapKV's) kernel with the server's window, none for methods
    without a kernel, none on vLLM-CPU's layout, none when the engine runs uncompressed."""
    from rcstat_vllm.worker.prompt_compression import warm_up_scoring

    kv_cache, _, _ = flash_request(40, group=3, seed=0)
    assert not warm_up_scoring(RCStatConfig(window=8), FLASH, kv_cache, 9)  # CPU tensors: Triton does not run there
    fake_cuda(monkeypatch)
    assert not warm_up_scoring(RCStatConfig(window=8), CPU_VEC, kv_cache, 9)
    assert not warm_up_scoring(RCStatConfig(method="tova"), FLASH, kv_cache, 9)
    assert not warm_up_scoring(RCStatConfig(method="none"), FLASH, kv_cache, 9)
    assert spy_kernels == {"rc": 0, "snapkv": 0}
    assert warm_up_scoring(RCStatConfig(window=8), FLASH, kv_cache, 9)
    assert warm_up_scoring(RCStatConfig(method="snapkv", observation_window=8), FLASH, kv_cache, 9)
    assert spy_kernels == {"rc": 1, "snapkv": 1}


def test_worker_warms_the_kernel_up_when_the_caches_are_bound(monkeypatch, spy_kernels):
    from types import SimpleNamespace

    from rcstat_vllm.worker.driver import WorkerCompression

    fake_cuda(monkeypatch)
    vllm_config = fake_vllm_config(
        {"method": "rc", "window": 8},
        BLOCK,
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel: 3 * KV_HEADS),
    )
    worker = WorkerCompression(vllm_config)
    worker.attach_layers(["l0"], num_kv_heads=KV_HEADS, block_size=BLOCK, layout=FLASH)
    kv_cache, _, _ = flash_request(40, group=3, seed=0)
    worker.bind_kv_caches({"l0": kv_cache})
    assert spy_kernels["rc"] == 1
