"""Request lifecycles vLLM 0.32 has besides "prefill, decode, finish", in a real vLLM-CPU engine on the embedded model:
preemption and recomputation with prefix caching on, streaming-input sessions. Each test leaves the pool as it found
it and the worker's table empty.

One in-process engine (float32: tokens are compared across runs), block size 32, eager eviction server-wide (lazy per
request where a test says so), prefix caching on (vLLM's default).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 32  # (vLLM-CPU attention takes multiples of 32)
WINDOW = 8
PROMPT = 512  # a multiple of the block size: a resumed request's prefix hit could reach past it


@pytest.fixture(scope="module")
def driver():
    from engine_driver import EngineDriver

    d = EngineDriver(
        additional_config={"rcstat": {"method": "rc", "window": WINDOW, "target_ratio": 0.5, "eviction": "eager"}},
        dtype="float32",
        block_size=BLOCK,
        max_model_len=2048,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=200 << 20,
    )
    d.initial_free = d.free_blocks()
    yield d


@pytest.fixture
def clean(driver):
    """Each test starts with an empty prefix cache and must give every block back."""
    driver.engine.reset_prefix_cache()
    yield driver
    finish(driver)
    assert driver.free_blocks() == driver.initial_free
    assert driver.compression.idle, f"worker table not empty: {len(driver.compression.requests)} records"


def greedy(max_tokens: int, **rcstat) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"rcstat": rcstat} if rcstat else None)


def engine_id(driver, request_id: str) -> str:
    """vLLM's engine-side id of a request added as ``request_id`` (it may carry a suffix)."""
    return next(rid for rid in driver.scheduler.requests if rid == request_id or rid.startswith(f"{request_id}-"))


def step_until(driver, done, max_steps: int = 500) -> dict[str, list[int]]:
    finished = {}
    for _ in range(max_steps):
        if done():
            return finished
        for output in driver.engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    raise AssertionError("the condition was never met")


def finish(driver) -> dict[str, list[int]]:
    """Step until every request finished, then once more with a short request: the step that tells the worker who
    finished (their results are recorded then)."""
    outputs = step_until(driver, lambda: not driver.engine.has_unfinished_requests())
    driver.run([("flush", driver.prompt(8), greedy(1))])
    return outputs


def preempt(driver, request_id: str) -> None:
    """What vLLM's scheduler does to the request it preempts when the pool runs short (recompute): out of the running
    queue, blocks freed, back to the front of the waiting queue."""
    request = driver.scheduler.requests[engine_id(driver, request_id)]
    driver.scheduler.running.remove(request)
    driver.scheduler._preempt_request(request, time.monotonic())


def generated(driver, request_id: str) -> int:
    request = driver.scheduler.requests.get(engine_id(driver, request_id))
    return 0 if request is None else request.num_output_tokens


@pytest.mark.parametrize("eviction", ["eager", "lazy"])
def test_a_preempted_request_is_compressed_again_when_recomputed(clean, eviction):
    """Preempted after 48 generated tokens (more than a window and a block: its prompt and generated blocks are
    prefix-cache entries under lazy eviction), the request is recomputed from a prefix hit that stops before its
    prompt's window, so the step that finishes its prefill comes again and compresses it again (eager: compacted;
    lazy: its plan parked again); its result holds both passes."""
    driver = clean
    driver.engine.add_request("pre", driver.prompt(PROMPT), greedy(64, eviction=eviction))
    step_until(driver, lambda: generated(driver, "pre") >= 48)
    first = driver.result("pre")
    if eviction == "eager":
        assert first is not None and first["skipped_reason"] is None and first["blocks_freed"] > 0
    compressed_before = driver.stats.requests_compressed
    preempt(driver, "pre")
    rid = engine_id(driver, "pre")
    # the resumed prefill: the prefix hit stops before the prompt's window
    step_until(driver, lambda: driver.scheduler.requests[rid].num_computed_tokens > PROMPT)
    record = driver.compression.requests.get(rid)
    if eviction == "lazy":
        from rcstat_vllm.worker.requests import Phase

        assert record is not None and record.phase is Phase.AWAITING_BLOCKS and record.job.kind == "prompt"
    outputs = finish(driver)
    assert len(outputs["pre"]) == 64
    result = driver.result("pre")
    assert result["passes"] == 2, result
    (earlier,) = result["earlier_passes"]
    assert earlier["ended"] == "preempted"
    assert result["ended"] is None
    assert result["num_prompt_tokens"] > PROMPT  # recomputed with its generated tokens
    if eviction == "eager":
        assert earlier["blocks_freed"] > 0 and earlier["skipped_reason"] is None
        assert result["skipped_reason"] is None and result["blocks_freed"] > 0
        assert driver.stats.requests_compressed == compressed_before + 1
    else:
        assert result["skipped_reason"] is not None, (result["compaction_reason"], result["compacted_at_tokens"], result["lazy"], result["earlier_passes"][0]["skipped_reason"])  # never compacted: the pool was never short
