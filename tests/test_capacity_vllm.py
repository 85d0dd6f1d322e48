"""Capacity: the blocks compression frees let vLLM's scheduler run more requests at once.

One in-process engine whose KV pool holds exactly N = 8 of the workload's requests uncompressed (prompt and
output): 31 blocks of 32 tokens each, 8 * 31 blocks plus vLLM's null block. (Prompts of 960 tokens: 1920
before the suite had to fit a 2-core AVX2-only CPU.) A wave of N + 1 uncompressed
requests shows the pool's limit (N run at once); a wave of RC-compressed requests at an achieved ratio r must
run at least 80% of N / (1 - r) at once. vLLM admits a request only when its whole uncompressed prompt fits
(``scheduler_reserve_full_isl``), so the last request admitted always holds its full prompt until its last
prefill chunk: the bound is ``1 + (N * 31 - 31) / (blocks a compressed request holds)``.
"""

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams

from rcstat_vllm.paging.page_space import cdiv

pytestmark = [pytest.mark.vllm, pytest.mark.long]

BLOCK = 32
PROMPT = 960
OUTPUT = 32
N = 8
BLOCKS_PER_REQUEST = cdiv(PROMPT + OUTPUT, BLOCK)  # 31


@pytest.fixture(scope="module")
def driver():
    from engine_driver import EngineDriver

    d = EngineDriver(
        additional_config={"rcstat": {"method": "rc", "target_ratio": 0.5, "window": 8, "eviction": "eager"}},
        block_size=BLOCK,
        max_model_len=1024,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=N * BLOCKS_PER_REQUEST + 1,  # + vLLM's null block
        # A fixed KV budget (the override above sets the block count): without it vLLM-CPU asks for 92% of the
        # NUMA node's memory at start-up and refuses to start when the test process already holds ~1 GiB.
        kv_cache_memory_bytes=512 << 20,
    )
    d.count_preemptions()
    d.initial_free = d.free_blocks()
    assert d.initial_free == N * BLOCKS_PER_REQUEST
    yield d
    assert d.free_blocks() == d.initial_free


def wave(driver, name, count, **rcstat):
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, extra_args={"rcstat": rcstat})
    requests = [(f"{name}-{i}", driver.prompt(PROMPT, offset=17 * i), params) for i in range(count)]
    run = driver.run(requests)
    assert set(run.outputs) == {r[0] for r in requests}
    assert driver.free_blocks() == driver.initial_free
    return run


def test_uncompressed_requests_fill_the_pool_at_n(driver):
    run = wave(driver, "vanilla", N + 1, method="none")
    print(f"\nuncompressed: peak running {run.peak_running} (pool holds {N})")
    assert run.peak_running == N
    assert run.preemptions == 0


def test_compression_runs_at_least_80_percent_of_n_over_one_minus_r_at_once(driver):
    run = wave(driver, "rc", 2 * N + 4, method="rc", target_ratio=0.5)
    results = [driver.result(f"rc-{i}") for i in range(2 * N + 4)]
    ratio = sum(r["compression_ratio"] for r in results) / len(results)
    held = max(r["blocks_held"] for r in results) + cdiv(OUTPUT, BLOCK)
    ideal = N / (1 - ratio)
    bound = 1 + (N - 1) * BLOCKS_PER_REQUEST // held
    print(
        f"\nRC budget: achieved ratio {ratio:.3f}, peak running {run.peak_running} = "
        f"{run.peak_running / ideal:.0%} of N/(1-r) = {ideal:.1f}; blocks per compressed request {held} "
        f"(of {BLOCKS_PER_REQUEST}), scheduler bound {bound}, preemptions {run.preemptions}"
    )
    assert abs(ratio - 0.5) < 0.01
    assert run.peak_running >= 0.8 * ideal


def test_threshold_mode_frees_what_it_evicts_and_runs_85_percent_of_n_over_one_minus_r(driver):
    """RC's own adaptive rule (Eq. 9): layers keep very different amounts, but head pages are pooled across
    layers, so a request holds about the blocks its kept entries fill (fragmentation <= 1.10, where per-layer
    pools held ~1.9x) and the pool runs >= 85% of N / (1 - r) at once. c = 0.05 gives r ~ 0.07 here; at higher
    r the bound is vLLM's admission rule (a request is admitted with its whole uncompressed prompt), not the
    plugin's layout (see the module docstring)."""
    count = 2 * N + 4
    run = wave(driver, "rc-threshold", count, method="rc", c=0.05, target_ratio=None)  # the server runs budget mode
    results = [driver.result(f"rc-threshold-{i}") for i in range(count)]
    ratio = sum(r["compression_ratio"] for r in results) / len(results)
    ideal = N / (1 - ratio)
    worst = max(r["fragmentation"] for r in results)
    spread = [max(map(sum, r["kept"])) / max(min(map(sum, r["kept"])), 1) for r in results]
    print(
        f"\nRC threshold c=0.05: achieved ratio {ratio:.3f}, peak running {run.peak_running} = "
        f"{run.peak_running / ideal:.0%} of N/(1-r) = {ideal:.1f}; fragmentation <= {worst:.3f}; "
        f"fullest/emptiest layer kept {min(spread):.1f}-{max(spread):.1f}x; preemptions {run.preemptions}"
    )
    assert all(r["pooled_pages"] and r["skipped_reason"] is None for r in results)
    assert min(spread) > 1.5  # layers really keep different amounts
    assert worst <= 1.10
    assert run.peak_running >= 0.85 * ideal
