"""Lazy eviction and the prefix cache: a compacted request's freed blocks stay prefix-cache entries, so every slot
they name must hold the KV its hash promises (issue 39's stale-KV case).

vLLM's ``allocate_slots`` caches a block as soon as the step's scheduled tokens fill it, before the forward writes
them. A lazy compaction run after that schedule would free such a block (its hash kept, an evictable entry) while
the in-flight token's KV went to head pages instead: a later prefix-cache hit would read a slot never written.

The engine runs in float32 with its whole KV pool poisoned before the first request, so a slot never written holds
an absurd key and value rather than plausible zeros: a hit on it cannot go unnoticed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 600
GENERATED = 48
#: each in-flight token that fills a block (its position + 1 a multiple of BLOCK) after this many generated tokens
#: calls for a lazy compaction
FIRST_BOUNDARY = PROMPT + 8
POISON = 30.0


@pytest.fixture(scope="module")
def driver():
    from engine_driver import EngineDriver

    d = EngineDriver(
        additional_config={"rcstat": {"eviction": "lazy", "target_ratio": 0.5}},
        dtype="float32",
        block_size=BLOCK,
        max_model_len=2048,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=256 << 20,
    )
    for cache in d.worker.model_runner.kv_caches:
        cache.fill_(POISON)
    d.initial_free = d.free_blocks()
    yield d
    assert d.free_blocks() == d.initial_free


def greedy(max_tokens: int, **rcstat) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={"rcstat": rcstat} if rcstat else None
    )


def test_a_lazy_compaction_at_a_block_boundary_leaves_no_stale_prefix_cache_entry(driver, monkeypatch):
    """A request with ``decode_budget`` is compacted by lazy eviction (called for, here, at the step whose in-flight
    token fills a block); a follow-up whose prompt is that request's prompt and answer hits its freed blocks in the
    prefix cache, the last of them the one that token filled. The follow-up decodes exactly what it decodes with
    nothing cached (same engine, alone in its batch, float32)."""
    from rcstat_vllm.engine.decode_pressure import DecodePressure

    original = DecodePressure.shortfall
    asked = []

    def short_at_block_boundaries(self, running, free_blocks, block_size):
        short, lead, reason = original(self, running, free_blocks, block_size)
        boundary = [
            r.req_id
            for r in running
            if r.req_id.startswith("stale-a-") and r.num_tokens >= FIRST_BOUNDARY and r.num_tokens % block_size == 0
        ]
        if boundary:
            asked.append(boundary)
            return max(short, 1), lead, "the test's pressure at a block boundary"
        return short, lead, reason

    monkeypatch.setattr(DecodePressure, "shortfall", short_at_block_boundaries)
    prompt = driver.token_ids(PROMPT, offset=5)
    first = driver.run([("stale-a", {"prompt_token_ids": prompt}, greedy(GENERATED, decode_budget=256))])
    monkeypatch.setattr(DecodePressure, "shortfall", original)
    result = driver.result("stale-a")
    assert asked and result["skipped_reason"] is None and result["lazy"], result
    compacted_at = result["compacted_at_tokens"]
    answer = first.outputs["stale-a"]

    # The follow-up: the first request's prompt and answer, then a question (so its hit is not clipped before an
    # observation window of its own).
    follow_up = {"prompt_token_ids": prompt + answer + driver.token_ids(64, offset=900)}
    hit = driver.run([("stale-b", follow_up, greedy(16))])
    assert hit.cached_tokens["stale-b"] >= compacted_at // BLOCK * BLOCK, (hit.cached_tokens, compacted_at)
    driver.engine.reset_prefix_cache()
    fresh = driver.run([("stale-b-fresh", follow_up, greedy(16))])
    assert fresh.cached_tokens["stale-b-fresh"] == 0
    assert hit.outputs["stale-b"] == fresh.outputs["stale-b-fresh"]
    driver.engine.reset_prefix_cache()


def test_a_whole_prompt_keeps_its_full_blocks_shared_through_decode_time_compaction(driver):
    """Two requests with one 600-token prompt, kept whole (``min_prompt_len`` above it) and compressed as they decode
    (``decode_budget``): the second hits the first's prompt blocks in the prefix cache. Their decode-time compactions
    copy only what follows the prompt's full blocks: those stay in both block lists, shared (the prefix held once),
    and the pool gets back every block when they finish."""
    from rcstat_vllm.patches.scheduler import request_blocks

    settings = dict(decode_budget=64, decode_interval=64, min_prompt_len=1024)
    prompt = {"prompt_token_ids": driver.token_ids(PROMPT, offset=300)}
    driver.engine.reset_prefix_cache()
    ids = ["whole-1", "whole-2"]
    for req_id in ids:
        driver.engine.add_request(req_id, prompt, greedy(160, **settings))
    seen = {}
    while driver.engine.has_unfinished_requests():
        driver.engine.step()
        results = [driver.result(req_id) for req_id in ids]
        running = {r.request_id.rsplit("-", 1)[0]: r.request_id for r in driver.scheduler.running}
        if len(running) == 2 and all(r is not None and r["decode_compactions"] >= 1 for r in results):
            manager = driver.scheduler.kv_cache_manager
            seen = {req_id: [b.block_id for b in request_blocks(manager, running[req_id])] for req_id in ids}
            break
    assert seen, "both requests were meant to be compacted while both still ran"
    full = PROMPT // BLOCK
    assert seen["whole-1"][:full] == seen["whole-2"][:full]
    assert not set(seen["whole-1"][full:]) & set(seen["whole-2"][full:]) - {0}
    while driver.engine.has_unfinished_requests():
        driver.engine.step()
    driver.run([("whole-flush", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free
    driver.engine.reset_prefix_cache()
