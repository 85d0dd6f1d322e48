"""Issue 55: the answer's tokens weighted by how much they single out a source, and per-model calibrated heads
(the file, its fallback, the served path's use of it), with no extra forward pass."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rcstat_vllm.attribution import calibration, head_weights
from rcstat_vllm.attribution.calibration import fit_head_weights
from rcstat_vllm.attribution.capture import AttributionCapture
from rcstat_vllm.attribution.estimators import (
    query_token_relative_contextualization,
    span_window_maxima,
    token_relative_contextualization,
    token_weights,
    weighted_token_relative_contextualization,
)
from rcstat_vllm.attribution.head_weights import (
    CALIBRATION_FILE,
    HeadWeights,
    load_head_weights,
    save_head_weights,
)
from rcstat_vllm.attribution.options import AttributionOptions
from rcstat_vllm.attribution.report import echo_mask
from rcstat_vllm.attribution.trace import AttributionTrace
from rcstat_vllm.config import ConfigError
from tests.test_attribution import planted_sequence, random_sequence, stream

# --------------------------------------------------------------------------------------------------------
# token weighting
# --------------------------------------------------------------------------------------------------------


def test_per_query_rc_averages_to_the_token_rc():
    g = torch.Generator().manual_seed(3)
    q, kp, kg = (torch.randn(3, t, 6, generator=g, dtype=torch.float64) for t in (5, 11, 8))
    for offset, s in ((0, 5), (3, 5)):
        per_query = query_token_relative_contextualization(q[:, :s], kp, kg, offset)
        assert per_query.shape == (3, s, 11)
        reference = token_relative_contextualization(q[:, :s], kp, kg, offset, exact=True)
        assert torch.allclose(per_query.mean(dim=1), reference, rtol=1e-12, atol=1e-12)
        # one query's share, brute force: sum_y max(x - y, 0) / |Y'|
        y = [float(q[h, ell] @ kg[h, k]) for h in (1,) for ell in range(s) for k in range(offset + ell + 1)]
        x = float(q[1, 2] @ kp[1, 7])
        assert float(per_query[1, 2, 7]) == pytest.approx(sum(max(x - v, 0.0) for v in y) / len(y), rel=1e-12)


def test_span_window_maxima_exact():
    profiles = torch.tensor([[1.0, 2.0, 3.0, 0.0, 5.0, 1.0], [0.0, 0.0, 0.0, 4.0, 0.0, 0.0]])
    out = span_window_maxima(profiles, [(0, 3), (3, 6), (2, 2)], window=2)
    assert out[0].tolist() == [2.5, 3.0, 0.0]  # best runs (2, 3) and (5, 1); the empty span scores 0
    assert out[1].tolist() == [0.0, 2.0, 0.0]


def test_peak_weights_exact_values():
    # one head, three queries, two spans of 4 tokens each
    per_query = torch.zeros(1, 3, 8, dtype=torch.float64)
    per_query[0, 0] = 1.0  # the same RC on both spans: a template token
    per_query[0, 1, :4] = 2.0  # only span 0: the value token
    per_query[0, 2, :4] = 3.0  # 3 : 1
    per_query[0, 2, 4:] = 1.0
    spans = [(0, 4), (4, 8)]
    assert token_weights(per_query, spans, "peak", window=4).tolist() == [0.0, 0.5, 0.25]
    assert token_weights(per_query, spans, "uniform").tolist() == [1.0, 1.0, 1.0]
    flat = torch.ones(2, 3, 8, dtype=torch.float64)  # no token singles out a span: Eq. 10 as written
    assert token_weights(flat, spans, "peak", window=4).tolist() == [1.0, 1.0, 1.0]
    assert token_weights(torch.zeros(1, 2, 8), spans, "peak").tolist() == [1.0, 1.0]
    weighted = weighted_token_relative_contextualization(per_query, torch.tensor([0.0, 0.5, 0.25]))
    expected = (0.5 * per_query[0, 1] + 0.25 * per_query[0, 2]) / 0.75
    assert torch.allclose(weighted[0], expected)
    with pytest.raises(ValueError, match="unknown token weighting"):
        token_weights(per_query, spans, "entropy")


def test_peak_weighting_lets_the_value_token_decide():
    """Three template queries read spans 0 and 1 alike (more span 0); one value query reads span 1: Eq. 10 as
    written (uniform) picks span 0, the weighted one span 1."""
    per_query = torch.zeros(1, 4, 8, dtype=torch.float64)
    per_query[0, :3, 0:4] = 1.5
    per_query[0, :3, 4:8] = 1.0
    per_query[0, 3, 4:8] = 1.0
    spans = [(0, 4), (4, 8)]
    uniform = weighted_token_relative_contextualization(per_query, token_weights(per_query, spans, "uniform"))
    peak = weighted_token_relative_contextualization(per_query, token_weights(per_query, spans, "peak", window=4))
    assert float(uniform[0, :4].sum()) > float(uniform[0, 4:].sum())
    assert float(peak[0, 4:].sum()) > float(peak[0, :4].sum())


def test_trace_uniform_weighting_is_today_s_scores():
    queries, keys = random_sequence(m=12, n=6)
    spans = [(0, 4), (4, 12)]
    today = AttributionTrace.from_sequence(queries, keys, 12, AttributionOptions(k=3, token_weighting="uniform"))
    heads = today.finalize(prune=False)
    per_token = today.token_scores((0, 6), heads)
    assert torch.allclose(today.weighted_token_scores((0, 6), heads, spans), per_token)
    assert AttributionOptions().token_weighting == "uniform"  # today's scores unless a request asks
    peak = AttributionTrace.from_sequence(queries, keys, 12, AttributionOptions(k=3, token_weighting="peak"))
    assert peak.span_scores(spans, (0, 6)).scores.sum() == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        AttributionOptions(token_weighting="nope")
    with pytest.raises(ConfigError):
        AttributionOptions(heads="best")


def test_echo_mask_exact():
    # prompt tokens 1..4 are the two scored spans; 1, 9, 5, 3 occur outside them (position 0 and 5..7)
    prompt_ids = [1, 5, 6, 7, 8, 9, 5, 3]
    ranges = [(1, 3), (3, 5)]
    assert echo_mask(prompt_ids, ranges, [5, 6, 9, 12, 3], (0, 5)) == [False, True, False, True, False]
    assert echo_mask(prompt_ids, ranges, [5, 6, 9, 12, 3], (1, 4)) == [True, False, True]
    # spans covering the whole prompt: nothing is echoed
    assert echo_mask(prompt_ids, [(0, 8)], [5, 6, 9], (0, 3)) == [True, True, True]


def test_token_mask_keeps_only_the_marked_queries():
    queries, keys = random_sequence(m=12, n=6)
    spans = [(0, 4), (4, 12)]
    trace = AttributionTrace.from_sequence(queries, keys, 12, AttributionOptions(k=3))
    heads = trace.finalize(prune=False)
    q, kp, kg = trace.head_tensors(heads, 6)
    per_query = query_token_relative_contextualization(q[:, 1:5], kp, kg, 1).float()  # queries 1..4
    mask = [False, True, False, True]  # queries 2 and 4
    got = trace.weighted_token_scores((1, 5), heads, spans, "uniform", mask)
    assert torch.allclose(got, per_query[:, [1, 3]].mean(dim=1), rtol=1e-6, atol=1e-9)
    # nothing marked: the mask is ignored; all marked: the unmasked scores
    unmasked = trace.weighted_token_scores((1, 5), heads, spans, "uniform")
    assert torch.equal(trace.weighted_token_scores((1, 5), heads, spans, "uniform", [False] * 4), unmasked)
    assert torch.allclose(trace.weighted_token_scores((1, 5), heads, spans, "uniform", [True] * 4), unmasked)
    # peak weights restricted to the marked queries (the unmarked ones weigh 0)
    peak = token_weights(per_query.double(), spans, "peak", trace.options.span_window)
    masked = peak * torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    assert bool((masked > 0).any())
    expected = weighted_token_relative_contextualization(per_query.double(), masked).float()
    assert torch.allclose(trace.weighted_token_scores((1, 5), heads, spans, "peak", mask), expected, atol=1e-6)
    # span_scores with a mask: Eq. 10 of the masked per-token RC (window of 8 over the summed RC)
    scored = trace.span_scores(spans, (1, 5), token_mask=mask)
    assert scored.scores.sum() == pytest.approx(1.0)
    assert torch.allclose(
        trace.span_scores(spans, (1, 5), token_mask=[True] * 4).scores,
        trace.span_scores(spans, (1, 5)).scores,
        atol=1e-6,
    )


# --------------------------------------------------------------------------------------------------------
# the calibration file
# --------------------------------------------------------------------------------------------------------


def test_fit_head_weights_exact():
    # 2 layers x 2 heads, 2 spans; the source is span 0 in every sample
    a = torch.tensor([[[2.0, 1.0], [1.0, 1.0]], [[0.0, 3.0], [4.0, 0.0]]])  # hits: (0,0) 1, (0,1) tie 0.5, (1,1) 1
    b = torch.tensor([[[2.0, 1.0], [0.0, 1.0]], [[0.0, 3.0], [1.0, 3.0]]])  # hits: (0,0) 1, (0,1) 0, (1,1) 0
    weights, hits = fit_head_weights([(a, 0), (b, 0)], k=3)
    assert hits.tolist() == [[1.0, 0.25], [0.0, 0.5]]
    # above chance (0.5): (0, 0) only; its mean span score is (1.5 + 1.5) / 2 = 1.5
    assert weights.heads == [(0, 0)] and weights.weights == [1.0]
    assert weights.meta["hit_rates"] == [1.0] and weights.meta["shape"] == [2, 2]
    weights, _ = fit_head_weights([(a, 0), (b, 0)], k=2, chance=0.2)
    # (0,0): (1 - 0.2) / 1.5; (1,1): (0.5 - 0.2) / 2.0 (mean of 2, 2), normalised to sum 1
    raw = [0.8 / 1.5, 0.3 / 2.0]
    assert weights.heads == [(0, 0), (1, 1)]
    assert weights.weights == pytest.approx([r / sum(raw) for r in raw])
    with pytest.raises(ValueError):
        fit_head_weights([], k=1)


def test_file_round_trip_and_fallback(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RCSTAT_VLLM_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "MyModel"
    model_dir.mkdir()
    assert load_head_weights(model_dir) is None and load_head_weights(None) is None
    weights = HeadWeights([(1, 2), (0, 0)], [0.75, 0.25], {"shape": [2, 3]})
    path = save_head_weights(weights, model_dir)
    assert path == model_dir / CALIBRATION_FILE
    loaded = load_head_weights(model_dir)
    assert loaded.heads == [(1, 2), (0, 0)] and loaded.weights == [0.75, 0.25]
    assert loaded.fits(2, 3) and not loaded.fits(2, 4) and not loaded.fits(1, 3)
    # the cache dir when nothing is next to the model
    path.unlink()
    cached = tmp_path / "cache" / "attribution" / "MyModel" / CALIBRATION_FILE
    save_head_weights(weights, model_dir, cached)
    assert load_head_weights(model_dir).heads == [(1, 2), (0, 0)]
    # an unreadable file: logged, the RC ranking (None)
    cached.write_text(json.dumps({"format": 99, "heads": [], "weights": []}))
    assert load_head_weights(model_dir) is None
    with pytest.raises(ValueError):
        HeadWeights([(0, 0)], [0.0])
    with pytest.raises(ValueError):
        HeadWeights([(0, 0), (0, 1)], [1.0])


# --------------------------------------------------------------------------------------------------------
# the served path uses the calibration when present, the RC ranking when not
# --------------------------------------------------------------------------------------------------------

PLANTED = {(0, 4), (2, 1), (3, 5)}


def test_trace_scores_with_calibrated_heads_when_present():
    queries, keys = planted_sequence(PLANTED)
    options = AttributionOptions(k=3)
    rc = AttributionTrace.from_sequence(queries, keys, 20, options)
    assert set(rc.finalize(prune=False)) == PLANTED and rc.top_weights == [1.0] * 3 and not rc.calibrated
    chosen = HeadWeights([(1, 0), (0, 4)], [0.25, 0.75], {"shape": [4, 6]})
    cal = AttributionTrace.from_sequence(queries, keys, 20, options, calibration=chosen)
    assert cal.finalize(prune=False) == [(1, 0), (0, 4)] and cal.top_weights == [0.25, 0.75] and cal.calibrated
    spans = [(0, 10), (10, 20)]
    got = cal.span_scores(spans, (0, 10))
    assert got.heads == [(1, 0), (0, 4)]
    per_token = cal.weighted_token_scores((0, 10), [(1, 0), (0, 4)], spans) * torch.tensor([[0.25], [0.75]])
    assert torch.allclose(got.per_head.sum(dim=0) / got.per_head.sum(), got.scores)
    assert got.per_head.shape == (2, 2) and float(per_token.sum()) > 0
    # a calibration of another model's shape, or heads="rc": the RC ranking
    other = HeadWeights([(9, 0)], [1.0], {"shape": [10, 6]})
    assert set(AttributionTrace.from_sequence(queries, keys, 20, options, calibration=other).finalize()) == PLANTED
    forced = AttributionTrace.from_sequence(queries, keys, 20, AttributionOptions(k=3, heads="rc"), calibration=chosen)
    assert set(forced.finalize()) == PLANTED and not forced.calibrated


def test_streaming_keeps_the_calibrated_heads_through_pruning():
    queries, keys = planted_sequence(PLANTED, m=20, n=12)
    chosen = HeadWeights([(1, 0)], [1.0], {"shape": [4, 6]})
    options = AttributionOptions(k=3, warmup_tokens=3, candidate_factor=1)
    streamed = stream(queries, keys, 20, options)  # today: (1, 0) is pruned away
    assert (1, 0) not in streamed.stored_heads()
    trace = stream_with(queries, keys, 20, options, chosen)
    assert trace.pruned and (1, 0) in trace.stored_heads()
    assert trace.finalize(prune=True) == [(1, 0)] and trace.stored_heads() == [(1, 0)]
    full = AttributionTrace.from_sequence(queries, keys, 20, options, calibration=chosen)
    spans = [(0, 10), (10, 20)]
    assert torch.allclose(trace.span_scores(spans, (0, 12)).scores, full.span_scores(spans, (0, 12)).scores)


def stream_with(queries, keys, m, options, chosen, prefill_chunk=7):
    trace = AttributionTrace(m, len(queries), options, calibration=chosen)
    total = queries[0].shape[0]
    steps = [(s, min(s + prefill_chunk, m)) for s in range(0, m, prefill_chunk)]
    steps += [(t, t + 1) for t in range(m, total)]
    for start, end in steps:
        for layer, (q, k) in enumerate(zip(queries, keys)):
            trace.record(layer, start, q[start:end], k[start:end])
    return trace


def _request(req_id, prompt, computed, extra):
    return SimpleNamespace(req_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=computed, extra_args=extra)


@pytest.mark.parametrize("present", [True, False])
def test_capture_loads_the_model_s_calibration(tmp_path, monkeypatch, present):
    from rcstat_vllm.attribution import capture as capture_module
    from rcstat_vllm.attribution.report import score_spans

    monkeypatch.setenv("RCSTAT_VLLM_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    if present:
        save_head_weights(HeadWeights([(1, 0)], [1.0], {"shape": [4, 6]}), model_dir)
    capture = AttributionCapture()
    capture.activate(str(model_dir))
    assert (capture.calibration is not None) == present
    queries, keys = planted_sequence(PLANTED)
    plan = capture.plan([_request("r", 20, 0, {"rcstat_attribution": {"k": 3}})], [0, 30], 4)
    for layer in range(4):
        capture.record(layer, plan, queries[layer], keys[layer])
    reply = score_spans(capture.traces["r"], [[0, 10], [10, 20]], [[0, 10]])
    assert reply["calibrated"] == present
    if present:
        assert reply["heads"] == [[1, 0]] and reply["head_weights"] == [1.0]
    else:
        assert {tuple(h) for h in reply["heads"]} == PLANTED and reply["head_weights"] == [1.0] * 3
    assert capture_module.parse_request_options({"heads": "rc"})[0].heads == "rc"


# --------------------------------------------------------------------------------------------------------
# no extra forward pass
# --------------------------------------------------------------------------------------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class _Tokenizer:
    """Characters as tokens (ids 32..95 folded into 0..63)."""

    is_fast = False

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + (i - 32) % 64) if i >= 32 else chr(64 + i) for i in ids)


@pytest.mark.parametrize("present", [True, False])
def test_scoring_runs_no_extra_forward(tmp_path, monkeypatch, present):
    """One forward over prompt + answer (the q/k capture, the vLLM request's own forward) with or without the
    calibration and the token weighting; the served path itself (score_spans on the worker) runs none."""
    from rcstat_vllm.attribution import hf

    monkeypatch.setenv("RCSTAT_VLLM_CACHE", str(tmp_path / "cache"))
    model = tiny_llama()
    model.name_or_path = str(tmp_path / "tiny")
    (tmp_path / "tiny").mkdir()
    if present:
        save_head_weights(HeadWeights([(1, 3), (0, 1)], [0.5, 0.5], {"shape": [2, 4]}), tmp_path / "tiny")
    forwards = []
    model.model.register_forward_hook(lambda *_: forwards.append(1))
    prompt = "Document 1: abc. Document 2: xyz."
    result = hf.attribute(model, _Tokenizer(), prompt, generated_ids=[40, 41, 42, 43], generated_spans="all")
    assert len(forwards) == 1
    assert (result.heads == [(1, 3), (0, 1)]) == present
    assert result.generated and sum(result.generated[0].scores) == pytest.approx(1.0)


def test_calibration_prompts_are_seeded_and_not_the_benchmarks():
    pytest.importorskip("transformers")
    if not calibration.LICENCE_DIR.exists():
        pytest.skip("no licence texts here")
    tokenizer = _Tokenizer()
    first = calibration.make_prompts(tokenizer, 4, seed=0)
    assert first == calibration.make_prompts(tokenizer, 4, seed=0)
    assert [e["multi"] for e in first] == [True, False, True, False]
    for example in first:
        assert len(example["docs"]) == 4 and example["fact"] in example["docs"][example["target"]]
        assert "Document" not in example["docs"][0]


# --------------------------------------------------------------------------------------------------------
# the embedded model's shipped calibration
# --------------------------------------------------------------------------------------------------------


def test_fetch_model_places_the_shipped_calibration_once(tmp_path, monkeypatch):
    from rcstat_vllm import model as model_module
    from rcstat_vllm.attribution.embedded_calibration import EMBEDDED_CALIBRATION

    monkeypatch.setenv("RCSTAT_VLLM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    monkeypatch.setattr(model_module, "is_converted", lambda _: True)  # converted already: only the placement runs
    assert model_module.fetch_model(folder) == folder
    written = json.loads((folder / CALIBRATION_FILE).read_text())
    assert written["heads"] == EMBEDDED_CALIBRATION["heads"] and written["weights"] == EMBEDDED_CALIBRATION["weights"]
    loaded = load_head_weights(folder)
    assert loaded is not None and loaded.fits(30, 9) and not loaded.fits(30, 8)  # SmolLM2-135M: 30 layers x 9 heads
    # a calibration the user made is never replaced, next to the model or in the cache dir
    own = HeadWeights([(0, 0)], [1.0], {"shape": [30, 9]})
    save_head_weights(own, folder)
    model_module.fetch_model(folder)
    assert load_head_weights(folder).heads == [(0, 0)]
    other = tmp_path / "Other"
    other.mkdir()
    cached = tmp_path / "cache" / "attribution" / "Other" / CALIBRATION_FILE
    save_head_weights(own, other, cached)
    assert head_weights.place_embedded_calibration(other) is None and not (other / CALIBRATION_FILE).exists()


def test_issue55_variants_score_copies_of_one_trace():
    """benchmarks/attribution_issue55.py: each variant is score_spans on a copy of the served trace with its options;
    the trace itself is left as served (not finalized), ``before`` is the RC ranking with uniform tokens."""
    import sys
    from pathlib import Path

    from rcstat_vllm.attribution.report import score_spans

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import attribution_issue55 as variants

    queries, keys = planted_sequence(PLANTED)
    trace = AttributionTrace.from_sequence(queries, keys, 20, AttributionOptions(k=3))
    chosen = HeadWeights([(1, 0), (0, 4)], [0.25, 0.75], {"shape": [4, 6]})
    ranges = {"document": [[0, 10], [10, 20]]}
    generated = {"document": [[0, 10]]}
    prompt_ids, answer_ids = list(range(20)), list(range(100, 110))
    before = variants.score_variant(trace, chosen, "before", ranges, generated, prompt_ids, answer_ids)["document"]
    calibrated = variants.score_variant(trace, chosen, "calibrated_uniform", ranges, generated, prompt_ids, answer_ids)[
        "document"
    ]
    assert not trace.finalized and trace.calibration is None
    reference = AttributionTrace.from_sequence(queries, keys, 20, AttributionOptions(k=3, heads="rc"))
    expected = score_spans(reference, ranges["document"], generated["document"], prune=False)
    assert before["scores"] == [round(v, 6) for v in expected["scores"][0]] and not before["calibrated"]
    assert set(map(tuple, before["heads"])) == PLANTED
    assert calibrated["calibrated"] and calibrated["heads"] == [[1, 0], [0, 4]]
    with_file = AttributionTrace.from_sequence(queries, keys, 20, AttributionOptions(k=3), calibration=chosen)
    expected = score_spans(with_file, ranges["document"], generated["document"], prune=False)
    assert calibrated["scores"] == [round(v, 6) for v in expected["scores"][0]]
    # no answer token occurs outside the spans: the echo variant is the plain one
    echo = variants.score_variant(trace, chosen, "rc_echo", ranges, generated, prompt_ids, answer_ids)["document"]
    assert echo["scores"] == before["scores"]
