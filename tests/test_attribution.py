"""Attribution (RCStat Section 4.2): Eq. 10, span and head RC against brute force, planted heads and spans,
streaming equal to the full computation, sentence offsets, per-request options, capture. Fast, no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rcstat_vllm.attribution.capture import AttributionCapture, parse_request_options
from rcstat_vllm.attribution.estimators import (
    head_relative_contextualization,
    normalize_span_scores,
    span_attention,
    span_relative_contextualization,
    top_heads,
)
from rcstat_vllm.attribution.options import AttributionOptions, num_top_heads
from rcstat_vllm.attribution.spans import (
    assign_tokens,
    chunk_spans,
    decode_offsets,
    single_token_spans,
    split_sentences,
    token_spans,
)
from rcstat_vllm.attribution.trace import AttributionTrace
from rcstat_vllm.config import ConfigError

# --------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------


def brute_span_rc(q, kp, kg, a, b, spans):
    """E[max(X_i - Y', 0)] as written: X_i = <q_j, k_t> (j in [a, b), t in span), Y' = <q_l, k_k> (k <= l)."""
    y = [float(q[ell] @ kg[k]) for ell in range(a, b) for k in range(ell + 1)]
    out = []
    for s, e in spans:
        x = [float(q[j] @ kp[t]) for j in range(a, b) for t in range(s, e)]
        out.append(sum(max(xi - yi, 0.0) for xi in x for yi in y) / (len(x) * len(y)) if x else 0.0)
    return out


def random_sequence(layers=3, hq=4, hkv=2, m=10, n=6, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    queries = [torch.randn(m + n, hq, d, generator=g, dtype=dtype) for _ in range(layers)]
    keys = [torch.randn(m + n, hkv, d, generator=g, dtype=dtype) for _ in range(layers)]
    return queries, keys


# --------------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------------


def test_span_rc_exact_matches_brute_force_and_upper_bound_dominates():
    g = torch.Generator().manual_seed(1)
    q, kp, kg = (torch.randn(2, t, 5, generator=g, dtype=torch.float64) for t in (7, 9, 7))
    spans = [(0, 2), (2, 3), (3, 9), (1, 6), (4, 4)]
    for a, b in [(0, 7), (2, 5), (6, 7)]:
        exact = span_relative_contextualization(q[:, a:b], kp, kg, a, spans, exact=True)
        upper = span_relative_contextualization(q[:, a:b], kp, kg, a, spans, exact=False)
        for h in range(2):
            assert exact[h].tolist() == pytest.approx(brute_span_rc(q[h], kp[h], kg[h], a, b, spans), abs=1e-12)
        assert (upper >= exact - 1e-9).all()  # Theorem 3.6: E[Z] <= A
        assert upper[:, 4].eq(0).all() and exact[:, 4].eq(0).all()  # empty span


def test_head_rc_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    q, kp, kg = (torch.randn(3, t, 4, generator=g, dtype=torch.float64) for t in (5, 8, 5))
    exact = head_relative_contextualization(q, kp, kg, exact=True)
    upper = head_relative_contextualization(q, kp, kg, exact=False)
    for h in range(3):
        assert float(exact[h]) == pytest.approx(brute_span_rc(q[h], kp[h], kg[h], 0, 5, [(0, 8)])[0], abs=1e-12)
    assert (upper >= exact - 1e-9).all()
    masked = head_relative_contextualization(q, kp, kg, exact=True, prompt_mask=torch.arange(8) >= 2)
    assert float(masked[0]) == pytest.approx(brute_span_rc(q[0], kp[0], kg[0], 0, 5, [(2, 8)])[0], abs=1e-12)


@pytest.mark.parametrize("estimator", ["exact", "upper"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eq10_scores_sum_to_one(estimator, seed):
    queries, keys = random_sequence(seed=seed, m=12, n=7)
    trace = AttributionTrace.from_sequence(queries, keys, 12, AttributionOptions(k=3, estimator=estimator))
    for spans in ([(0, 4), (4, 8), (8, 12)], [(t, t + 1) for t in range(12)], [(0, 12)], [(0, 3), (5, 9)]):
        for gen in [(0, 7), (2, 4), (6, 7)]:
            result = trace.span_scores(spans, gen)
            assert result.scores.shape == (len(spans),)
            assert float(result.scores.sum()) == pytest.approx(1.0, abs=1e-6)
            assert (result.scores >= 0).all()
            assert result.per_head.shape == (3, len(spans))


def test_eq10_degenerate_is_uniform():
    scores, degenerate = normalize_span_scores(torch.zeros(2, 4))
    assert degenerate and scores.tolist() == [0.25] * 4
    scores, degenerate = normalize_span_scores(torch.tensor([[1.0, 3.0], [0.0, 4.0]]))
    assert not degenerate and scores.tolist() == pytest.approx([0.125, 0.875])


def test_attention_baseline_is_a_distribution_over_the_prompt():
    g = torch.Generator().manual_seed(3)
    q, kp, kg = (torch.randn(2, t, 4, generator=g) for t in (3, 6, 5))
    mass = span_attention(q, kp, kg, 2, [(0, 6)])
    assert (mass > 0).all() and (mass < 1).all()
    per_token = span_attention(q, kp, kg, 2, [(t, t + 1) for t in range(6)])
    assert per_token.sum(dim=1).tolist() == pytest.approx(mass[:, 0].tolist(), rel=1e-5)


# --------------------------------------------------------------------------------------------------------
# planted structure
# --------------------------------------------------------------------------------------------------------


def test_head_whose_keys_align_with_one_span_attributes_to_it():
    d, m, n = 16, 15, 6
    g = torch.Generator().manual_seed(4)
    direction = torch.zeros(d)
    direction[0] = 1.0
    prompt_keys = 0.3 * torch.randn(1, m, d, generator=g)
    prompt_keys[0, 5:10] += 4.0 * direction  # span 1 = tokens 5..9 align with the queries
    gen_queries = direction.expand(1, n, d) * 3.0 + 0.3 * torch.randn(1, n, d, generator=g)
    gen_keys = 0.3 * torch.randn(1, n, d, generator=g)
    spans = [(0, 5), (5, 10), (10, 15)]
    for exact in (True, False):
        per_head = span_relative_contextualization(gen_queries, prompt_keys, gen_keys, 0, spans, exact=exact)
        scores, degenerate = normalize_span_scores(per_head)
        assert not degenerate
        assert int(scores.argmax()) == 1 and float(scores[1]) > 0.9


def planted_sequence(planted, layers=4, hq=6, hkv=2, m=20, n=10, d=16, seed=5):
    """q/k where only the planted (layer, query head) pairs read the prompt: their generated queries align
    with their KV head's prompt keys; every other query head aligns with the generated keys."""
    g = torch.Generator().manual_seed(seed)
    queries, keys = [], []
    for layer in range(layers):
        q = 0.2 * torch.randn(m + n, hq, d, generator=g)
        k = 0.2 * torch.randn(m + n, hkv, d, generator=g)
        k[:m, :, 0] += 3.0  # prompt keys share direction 0
        k[m:, :, 1] += 3.0  # generated keys share direction 1
        for h in range(hq):
            strong = 3.0 if (layer, h) in planted else 0.0
            q[m:, h, 0] += strong
            q[m:, h, 1] += 3.0 - strong
        queries.append(q)
        keys.append(k)
    return queries, keys


def test_top_k_picks_planted_heads():
    planted = {(0, 4), (2, 1), (3, 5)}
    queries, keys = planted_sequence(planted)
    for estimator in ("exact", "upper"):
        trace = AttributionTrace.from_sequence(queries, keys, 20, AttributionOptions(k=3, estimator=estimator))
        assert set(trace.finalize(prune=False)) == planted
        scores = trace.head_scores
        assert scores.shape == (4, 6) and torch.isfinite(scores).all()


def test_default_k_is_two_percent_at_least_one():
    assert num_top_heads(AttributionOptions(), 270) == 5
    assert num_top_heads(AttributionOptions(), 10) == 1
    assert num_top_heads(AttributionOptions(k=7), 270) == 7
    assert num_top_heads(AttributionOptions(k=700), 270) == 270
    scores = torch.tensor([[0.1, float("nan"), 3.0], [2.0, 0.5, -1.0]])
    assert top_heads(scores, 2) == [(0, 2), (1, 0)]


# --------------------------------------------------------------------------------------------------------
# streaming == full computation
# --------------------------------------------------------------------------------------------------------


def stream(queries, keys, m, options, prefill_chunk=7):
    """Feed a trace as vLLM would: prefill in chunks (all layers per chunk), then one token per step."""
    trace = AttributionTrace(m, len(queries), options)
    total = queries[0].shape[0]
    steps = [(s, min(s + prefill_chunk, m)) for s in range(0, m, prefill_chunk)]
    steps += [(t, t + 1) for t in range(m, total)]
    for start, end in steps:
        for layer, (q, k) in enumerate(zip(queries, keys)):
            trace.record(layer, start, q[start:end], k[start:end])
    return trace


@pytest.mark.parametrize("warmup,estimator", [(3, "exact"), (100, "exact"), (3, "upper")])
def test_streaming_equals_full_computation(warmup, estimator):
    planted = {(0, 4), (2, 1), (3, 5), (1, 0)}
    queries, keys = planted_sequence(planted, m=20, n=12)
    options = AttributionOptions(k=4, estimator=estimator, warmup_tokens=warmup, candidate_factor=2)
    streamed = stream(queries, keys, 20, options)
    full = AttributionTrace.from_sequence(queries, keys, 20, options)
    assert streamed.pruned == (warmup == 3)
    assert streamed.num_generated == full.num_generated == 12
    top_streamed = streamed.finalize(prune=True)
    top_full = full.finalize(prune=False)
    assert top_streamed == top_full
    assert streamed.stored_heads() == sorted(top_full)  # finalize kept the top k only
    assert streamed.span_scores([(0, 20)], (0, 12)).exact == (estimator == "exact")
    for head in top_full:
        assert float(streamed.head_scores[head]) == pytest.approx(float(full.head_scores[head]), rel=1e-6)
    spans = [(0, 5), (5, 12), (12, 20)]
    for gen in [(0, 12), (3, 8)]:
        a, b = streamed.span_scores(spans, gen), full.span_scores(spans, gen)
        assert torch.allclose(a.per_head, b.per_head, rtol=1e-6, atol=1e-7)
        assert torch.allclose(a.scores, b.scores, rtol=1e-6, atol=1e-7)


def test_streaming_memory_is_bounded_by_candidates():
    queries, keys = random_sequence(layers=6, hq=8, hkv=2, m=30, n=40, d=8, dtype=torch.float32)
    options = AttributionOptions(k=2, warmup_tokens=4, candidate_factor=2)
    trace = stream(queries, keys, 30, options)
    assert trace.pruned
    assert len(trace.stored_heads()) == 4  # candidate_factor * k of 48 heads
    # candidates: at most 4 query heads and 4 KV heads, 30 prompt keys + 40 generated q/k each, float32
    assert trace.nbytes() <= 4 * 30 * 8 * 4 + 40 * (4 + 4) * 8 * 4 + 16 * (4 + 4) * 8 * 4 * 2
    full_bytes = 6 * (2 * 30 + 40 * (8 + 2)) * 8 * 4
    assert trace.nbytes() < full_bytes / 4
    trace.finalize(prune=True)
    assert len(trace.stored_heads()) == 2


def test_max_generated_tokens_caps_the_trace():
    queries, keys = random_sequence(m=10, n=9)
    options = AttributionOptions(k=1, warmup_tokens=None, max_generated_tokens=4)
    trace = stream(queries, keys, 10, options)
    assert trace.num_generated == 4


def test_recomputation_after_preemption_overwrites():
    queries, keys = random_sequence(m=10, n=6)
    options = AttributionOptions(k=2, warmup_tokens=None)
    trace = stream(queries, keys, 10, options)
    for layer, (q, k) in enumerate(zip(queries, keys)):  # preempted, then prompt + outputs recomputed at once
        trace.record(layer, 0, q, k)
    full = AttributionTrace.from_sequence(queries, keys, 10, options)
    assert trace.finalize(prune=False) == full.finalize(prune=False)
    assert torch.equal(trace.head_scores, full.head_scores)


# --------------------------------------------------------------------------------------------------------
# spans and offsets
# --------------------------------------------------------------------------------------------------------


def test_sentences_with_offsets():
    text = 'Dr. Smith lives in Oslo. He owns 3.5 cats!  Does he?\nYes, e.g. Bob said "no." Then J. R. left'
    sentences = [text[s:e] for s, e in split_sentences(text)]
    assert sentences == [
        "Dr. Smith lives in Oslo.",
        "He owns 3.5 cats!",
        "Does he?",
        'Yes, e.g. Bob said "no."',
        "Then J. R. left",
    ]


def test_chat_markup_is_not_a_sentence():
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there. Bye<|im_end|>\n<|im_start|>assistant\n"
    assert [text[s:e] for s, e in split_sentences(text)] == ["Be brief.", "Hi there.", "Bye"]


def test_token_spans_from_offsets():
    text = "One fish. Two fish. Red fish."
    words = [(0, 3), (3, 8), (8, 9), (9, 13), (13, 18), (18, 19), (19, 23), (23, 28), (28, 29)]
    spans = token_spans(text, words, split_sentences(text))
    assert [(s.token_start, s.token_end) for s in spans] == [(0, 3), (3, 6), (6, 9)]
    assert [s.text for s in spans] == ["One fish.", "Two fish.", "Red fish."]
    assert assign_tokens(text, [(9, 10)], [(0, 9), (10, 19)]) == [-1]  # a lone space belongs nowhere
    chunks = chunk_spans(text, ["Two fish.", [20, 29]])
    assert chunks == [(10, 19), (20, 29)]
    with pytest.raises(ValueError, match="not found"):
        chunk_spans(text, ["Blue fish."])
    tokens = single_token_spans(text, words)
    assert len(tokens) == 9 and tokens[1].text == " fish"


def test_offsets_with_the_real_tokenizer():
    tokenizers = pytest.importorskip("transformers")
    from rcstat_vllm.model import default_model_dir

    if not (default_model_dir() / "tokenizer.json").exists():
        pytest.skip("embedded model not converted")
    from rcstat_vllm.attribution.spans import prompt_offsets, spans_for

    tokenizer = tokenizers.AutoTokenizer.from_pretrained(default_model_dir())
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "The café opened in 1931. It sells rye bread!\nAsk Dr. Lee."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    same, offsets = prompt_offsets(tokenizer, text, ids)
    assert same == text and len(offsets) == len(ids)
    spans = spans_for(text, offsets, "sentences")
    user = [s for s in spans if "café" in s.text or "rye" in s.text or "Lee" in s.text]
    assert [s.text for s in user] == ["The café opened in 1931.", "It sells rye bread!", "Ask Dr. Lee."]
    for span in user:
        decoded = tokenizer.decode(ids[span.token_start : span.token_end])
        assert decoded.strip() == span.text
    generated = tokenizer("Paris is big. Café ☕ time.", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    gen_text, gen_offsets = decode_offsets(tokenizer, generated, skip_special_tokens=True)
    assert gen_text == "Paris is big. Café ☕ time."
    assert gen_offsets[-1][0] == gen_offsets[-1][1] == len(gen_text)  # EOS: no characters


# --------------------------------------------------------------------------------------------------------
# per-request options and the capture
# --------------------------------------------------------------------------------------------------------


def test_request_options():
    assert parse_request_options(None) is None and parse_request_options(False) is None
    options, presentation = parse_request_options(True)
    assert options == AttributionOptions() and presentation == {}
    options, presentation = parse_request_options({"k": 4, "spans": "chunks", "chunks": ["a"], "top": 2})
    assert options.k == 4 and presentation == {"spans": "chunks", "chunks": ["a"], "top": 2}
    assert parse_request_options({"enabled": False}) is None
    assert parse_request_options('{"k": 2, "top": 1}')[0].k == 2  # the vllm_xargs form: JSON text
    assert parse_request_options(1)[0] == AttributionOptions() and parse_request_options(0) is None
    assert parse_request_options("true")[0] == AttributionOptions() and parse_request_options("false") is None
    for bad, field in [
        ({"k": 0}, "k"),
        ({"estimator": "mean"}, "estimator"),
        ({"spans": "words"}, "spans"),
        ({"spans": "chunks"}, "chunks"),
        ({"top": 0}, "top"),
        ({"colour": 1}, "colour"),
        ("yes", "rcstat_attribution"),
        (7, "rcstat_attribution"),
    ]:
        with pytest.raises(ConfigError, match=f"'{field}'"):
            parse_request_options(bad)


def batch_request(req_id, prompt, computed, scheduled, extra):
    return SimpleNamespace(
        req_id=req_id,
        num_prompt_tokens=prompt,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
        extra_args=extra,
    )


def test_capture_records_only_requests_that_asked():
    queries, keys = random_sequence(layers=2, m=8, n=4, dtype=torch.float32)
    other_q, other_k = random_sequence(layers=2, m=5, n=4, seed=9, dtype=torch.float32)
    capture = AttributionCapture()
    asked = {"rcstat_attribution": {"k": 1, "warmup_tokens": None}}
    requests = [batch_request("a", 8, 0, 8, asked), batch_request("b", 5, 0, 5, {"other": 1})]
    assert capture.plan(requests, [0, 8, 13], 2) is None  # inactive until the processor exists
    capture.activate()
    assert capture.plan([requests[1]], [0, 5], 2) is None  # nobody asked: nothing to do
    # prefill of both, then three decode steps
    steps = [([requests[0], requests[1]], [0, 8, 13], [(queries, 0, 8), (other_q, 0, 5)])]
    for t in range(3):
        steps.append(
            (
                [batch_request("b", 5, 5 + t, 1, {}), batch_request("a", 8, 8 + t, 1, asked)],
                [0, 1, 2],
                [(other_q, 5 + t, 6 + t), (queries, 8 + t, 9 + t)],
            )
        )
    for reqs, starts, rows in steps:
        plan = capture.plan(reqs, starts, 2)
        assert [r.trace for r in plan] == [capture.traces["a"]]
        for layer in range(2):
            source_q = torch.cat([q[layer][s:e] for q, s, e in rows])
            source_k = torch.cat([(keys if q is queries else other_k)[layer][s:e] for q, s, e in rows])
            capture.record(layer, plan, source_q, source_k)
    assert list(capture.traces) == ["a"]
    trace = capture.traces["a"]
    assert trace.num_generated == 3
    reference = AttributionTrace.from_sequence([q[:11] for q in queries], [k[:11] for k in keys], 8, trace.options)
    assert trace.finalize(prune=False) == reference.finalize(prune=False)
    assert torch.equal(trace.head_scores, reference.head_scores)
    assert capture.find("a-suffix") is None and capture.find("a")[0] == "a"


def test_worker_results_pop_the_trace():
    from rcstat_vllm.attribution import capture as capture_module

    queries, keys = random_sequence(layers=2, m=8, n=4, dtype=torch.float32)
    capture = capture_module.attribution_capture()
    capture.clear()
    trace = capture._new_trace("7-abc", 8, 2, AttributionOptions(k=2))
    for layer in range(2):
        trace.record(layer, 0, queries[layer], keys[layer])
    reply = capture_module.worker_results("7", [[0, 4], [4, 8]], [[0, 4], [1, 3]])
    assert reply["req_id"] == "7-abc" and len(reply["scores"]) == 2
    assert all(sum(s) == pytest.approx(1.0) for s in reply["scores"])
    assert len(reply["heads"]) == 2 and reply["estimator"] == "exact"
    assert capture_module.worker_results("7", [[0, 8]], [[0, 4]]) is None


def test_capture_drops_least_recently_active_traces_over_budget():
    queries, keys = random_sequence(layers=2, m=8, n=4, dtype=torch.float32)
    capture = AttributionCapture(max_traces=2)
    capture.activate()
    asked = {"rcstat_attribution": True}
    for name in ("a", "b", "c"):
        capture.plan([batch_request(name, 8, 0, 8, asked)], [0, 8], 2)
    assert list(capture.traces) == ["b", "c"] and capture.evicted == 1
    capture.plan([batch_request("b", 8, 8, 1, asked)], [0, 1], 2)  # b active again: c is now the oldest
    assert list(capture.traces) == ["c", "b"]
    small = AttributionCapture(max_bytes=1)
    small.activate()
    for step in range(40):
        plan = small.plan([batch_request(f"r{step}", 8, 0, 8, asked)], [0, 8], 2)
        for layer in range(2):
            small.record(layer, plan, queries[layer][:8], keys[layer][:8])
    assert len(small.traces) < 40 and f"r{39}" in small.traces  # over budget: old ones dropped, not the active one
    late = small.plan([batch_request("late", 8, 4, 4, asked)], [0, 4], 2)
    assert late[0].trace.missing_prompt_tokens == 4  # a prefix it never saw is reported
