"""The decode-time eviction reference (benchmarks/decode_reference.py): it must be exact where nothing is evicted,
and evict on the schedule and to the budget it claims, or the decode quality study measures the wrong thing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_reference as dr

P, N = 40, 150  # prompt and "generated" tokens
HKV = 2


@pytest.fixture(scope="module")
def tiny():
    """A random 3-layer Llama with 4 query heads on 2 KV heads (GQA, as SmolLM2). One thread: these are ~1000
    tiny forward passes, which two threads on a busy 2-core machine make 20x slower."""
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=HKV,
        max_position_embeddings=512,
    )
    yield dr.DecodeReference(model=LlamaForCausalLM(config))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def span():
    ids = torch.randint(3, 96, (P + N,), generator=torch.Generator().manual_seed(1)).tolist()
    return ids[:P], ids[P:]


def _methods(budget: int, interval: int) -> list[dr.DecodeMethod]:
    # Small windows so that budgets below the span's length evict in a 150-token span.
    rc = {"window_size": 8, "smoothing": 3, "carry_forward": 2}
    return [
        dr.DecodeMethod("rc", "rc", budget, interval, options=rc, keep_window=8),
        dr.DecodeMethod("rc_c1", "rc", budget, interval, selection="threshold", options=rc, keep_window=8),
        dr.DecodeMethod("rc_hm", "rc", budget, interval, selection="head_mean", options=rc, keep_window=8),
        dr.DecodeMethod("snapkv", "snapkv", budget, interval, options={"window_size": 16}, keep_window=8),
        dr.DecodeMethod("tova", "tova", budget, interval, selection="head", keep_window=8),
        dr.DecodeMethod("knorm", "knorm", budget, interval, keep_window=8),
        dr.DecodeMethod("recent", "recent", budget, interval, keep_window=8),
    ]


def test_full_cache_replay_equals_one_plain_forward_in_any_chunking(tiny, span):
    prompt, tokens = span
    plain = tiny.plain_logits(prompt + tokens)[P:]
    for interval in (1, 7, 64, N):
        replay = tiny.replay(prompt, tokens, dr.DecodeMethod("full", "none", interval=interval), return_logits=True)
        assert replay.first_eviction is None and replay.evictions == []
        torch.testing.assert_close(replay.logits, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(replay.argmax, plain.argmax(-1))


def test_a_budget_covering_the_span_changes_nothing(tiny, span):
    prompt, tokens = span
    full = tiny.replay(
        prompt, tokens, dr.DecodeMethod("full", "none", interval=32), return_logits=True, all_layers=True
    )
    for method in _methods(budget=N, interval=32):
        replay = tiny.replay(prompt, tokens, method, return_logits=True, all_layers=True)
        assert replay.evictions == [], method.label
        assert torch.equal(replay.logits, full.logits), method.label
        assert torch.equal(replay.attn, full.attn), method.label


def test_recent_keeps_exactly_the_last_budget_tokens(tiny, span):
    prompt, tokens = span
    budget, interval = 24, 16
    method = dr.DecodeMethod("recent", "recent", budget, interval, keep_window=8)
    cache, _ = tiny._prefill(prompt, P + N)
    for s in range(0, 64, interval):
        tiny._forward(cache, tokens[s : s + interval], P + s)
        tiny._evict(cache, method, None)
        expected = torch.zeros(s + interval, dtype=torch.bool)
        expected[max(0, s + interval - budget) :] = True
        for layer in range(tiny.num_layers):
            keep = cache.keep[layer][:, P : cache.length[layer]]
            assert torch.equal(keep, expected.expand(HKV, -1)), (s, layer)
            assert bool(cache.keep[layer][:, :P].all())  # the prompt is never evicted


@pytest.mark.parametrize("selection", ["layer", "head_mean"])
def test_rc_keeps_the_budget_on_average_with_uneven_heads_and_the_window(tiny, span, selection):
    prompt, tokens = span
    budget, interval = 40, 20
    method = next(m for m in _methods(budget, interval) if m.method == "rc" and m.selection == selection)
    scorer = method.scorer()
    cache, _ = tiny._prefill(prompt, P + N)
    uneven = False
    for s in range(0, N - interval + 1, interval):
        tiny._forward(cache, tokens[s : s + interval], P + s)
        kept = tiny._evict(cache, method, scorer)
        generated = s + interval
        if generated <= budget:
            assert kept is None  # within budget: nothing evicted
            continue
        assert kept.sum(dim=1).tolist() == [HKV * budget] * tiny.num_layers  # budget per head on average
        uneven |= bool((kept[:, 0] != kept[:, 1]).any())
        for layer in range(tiny.num_layers):
            keep = cache.keep[layer][:, P : P + generated]
            assert bool(keep[:, -method.keep_window :].all())  # the newest tokens are always kept
    assert uneven  # heads keep different numbers somewhere


def test_evictions_only_at_interval_boundaries_and_never_readmit(tiny, span):
    prompt, tokens = span
    for method in _methods(budget=30, interval=25):
        scorer = method.scorer()
        cache, _ = tiny._prefill(prompt, P + N)
        before = None
        for i, token in enumerate(tokens):
            tiny._forward(cache, [token], P + i)
            now = torch.stack([cache.keep[layer][:, P : P + i + 1] for layer in range(tiny.num_layers)])
            if before is not None:
                # Between evictions a step only adds its own (kept) token; nothing earlier changes.
                assert torch.equal(now[..., :-1], before), (method.label, i)
            assert bool(now[..., -1].all())
            if (i + 1) % method.interval == 0:
                tiny._evict(cache, method, scorer)  # raises if a mask re-admits an evicted token
            after = torch.stack([cache.keep[layer][:, P : P + i + 1] for layer in range(tiny.num_layers)])
            assert not bool((after & ~now).any()), method.label
            before = after
        assert int(before.sum()) < before.numel(), method.label  # it did evict


def test_replay_and_generate_follow_the_same_schedule(tiny, span):
    prompt, _ = span
    method = _methods(budget=30, interval=25)[0]
    generated = tiny.generate(prompt, 100, method)
    replay = tiny.replay(prompt, generated, method)
    # Greedy tokens are the replay's own argmax (the same KV at every step), and evictions began after 50 tokens.
    assert replay.argmax[:-1].tolist() == generated[1:]
    assert replay.first_eviction == 50
    assert replay.kept_after_evictions() == pytest.approx(30.0)
    # Visible generated tokens: 1..50 before the first eviction, then 30 + 1..25 per 25-token chunk.
    assert replay.mean_visible == pytest.approx((sum(range(1, 51)) + 2 * sum(range(31, 56))) / 100)
