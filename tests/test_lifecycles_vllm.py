"""Request lifecycles vLLM 0.32 has besides "prefill, decode, finish", in a real vLLM-CPU engine on the embedded model:
preemption and recomputation with prefix caching on, streaming-input sessions. Each test leaves the pool as it found
it and the worker's table empty.

One in-process engine (float32: tokens are compared across runs), block size 32, eager eviction server-wide (lazy per
request where a test says so), prefix caching on (vLLM's default).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams

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
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={"rcstat": rcstat} if rcstat else None
    )


def finish(driver) -> dict[str, list[int]]:
    """Step until every request finished, then once more with a short request: the step that tells the worker who
    finished (their results are recorded then)."""
    outputs = driver.step_until(lambda: not driver.engine.has_unfinished_requests())
    driver.run([("flush", driver.prompt(8), greedy(1))])
    return outputs


@pytest.mark.parametrize("eviction", ["eager", "lazy"])
def test_a_preempted_request_is_compressed_again_when_recomputed(clean, eviction):
    """Preempted after 48 generated tokens (more than a window and a block: its prompt and generated blocks are
    prefix-cache entries under lazy eviction), the request is recomputed from a prefix hit that stops before its
    prompt's window, so the step that finishes its prefill comes again and compresses it again (eager: compacted;
    lazy: its plan parked again); its result holds both passes."""
    driver = clean
    name = f"preempted-{eviction}"
    driver.engine.add_request(name, driver.prompt(PROMPT), greedy(64, eviction=eviction))
    driver.step_until(lambda: driver.generated(name) >= 48)
    first = driver.result(name)
    if eviction == "eager":
        assert first is not None and first["skipped_reason"] is None and first["blocks_freed"] > 0
    compressed_before = driver.stats.requests_compressed
    driver.preempt(name)
    rid = driver.engine_id(name)
    # the resumed prefill: the prefix hit stops before the prompt's window
    driver.step_until(lambda: driver.scheduler.requests[rid].num_computed_tokens > PROMPT)
    record = driver.compression.requests.get(rid)
    if eviction == "lazy":
        from rcstat_vllm.worker.requests import Phase

        assert record is not None and record.phase is Phase.AWAITING_BLOCKS and record.job.kind == "prompt"
    outputs = finish(driver)
    assert len(outputs[name]) == 64
    result = driver.result(name)
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
        assert result["skipped_reason"] is not None, result  # never compacted: the pool was never short


# ---- streaming-input sessions (vLLM 0.32's resumable requests: AsyncLLM.generate with a StreamingInput) ----


def run_session(driver, session: str, first_tokens: int, second_chunk: int, **rcstat) -> tuple[list[int], list[int]]:
    """A session of two chunks (300 tokens, then ``second_chunk``), ``first_tokens`` then 8 generated; each turn's
    tokens. Starts from an empty prefix cache, so two sessions run the same forwards."""
    assert driver.engine.reset_prefix_cache()
    driver.send_chunk(session, driver.token_ids(300), greedy(first_tokens, **rcstat))
    tokens_1 = driver.turn(session)
    driver.send_chunk(session, driver.token_ids(second_chunk, offset=400), greedy(8, **rcstat))
    tokens_2 = driver.turn(session)
    return tokens_1, tokens_2


@pytest.mark.parametrize(
    "eviction, first_tokens, second_chunk",
    [
        ("lazy", 6, 100),  # a parked plan when the turn ends
        ("lazy", 6, WINDOW // 2),  # the next chunk shorter than the window
        ("eager", 1, 100),  # the turn ends in its prefill step: the plan still waits for blocks
        ("eager", 6, 100),  # compacted in turn 1: the next chunk grows its head pages
        ("eager", 6, WINDOW // 2),
    ],
)
def test_a_streaming_input_session_survives_its_next_chunk(clean, eviction, first_tokens, second_chunk):
    """Two chunks of one session: the engine never dies (on main: "is awaiting blocks, expected prefill" in the
    worker, or the scheduler's parked plan meeting a dropped record: "which has no plan"); when nothing was compacted
    (lazy, the pool never short) both turns' tokens equal those of the same session run as vLLM runs it (method
    ``none``: the plugin leaves the request alone; same chunks, same forwards); the session's result has a pass per
    turn not compacted (a compacted one keeps its head pages and its result: the chunk grows them)."""
    driver = clean
    session = f"session-{eviction}-{first_tokens}-{second_chunk}"
    tokens_1, tokens_2 = run_session(driver, session, first_tokens, second_chunk, eviction=eviction)
    assert (len(tokens_1), len(tokens_2)) == (first_tokens, 8)
    driver.end_session(session, greedy(1))
    finish(driver)
    result = driver.result(session)
    compacted_in_turn_1 = eviction == "eager" and first_tokens > 1
    if compacted_in_turn_1:
        assert result["passes"] == 1 and result["skipped_reason"] is None and result["blocks_freed"] > 0
    else:
        assert result["passes"] == 2, result
        (earlier,) = result["earlier_passes"]
        assert earlier["ended"] == "session continued" and "next chunk arrived" in earlier["skipped_reason"]
        # the second chunk compressed as a prompt over the first turn (eager; lazy: never short, never compacted)
        assert (result["skipped_reason"] is None) == (eviction == "eager" and second_chunk > WINDOW)
    if eviction == "lazy":
        reference = run_session(driver, "reference", first_tokens, second_chunk, method="none")
        driver.end_session("reference", greedy(1))
        assert reference == (tokens_1, tokens_2)


# ---- aborts at any point, n > 1 ----


def test_a_request_aborted_while_its_lazy_plan_is_parked_gives_everything_back(clean):
    """Aborted with its plan parked (the worker waiting for blocks, the scheduler holding the plan): both forget it,
    its blocks return, it counts as never compacted, and its result says why it kept its full cache."""
    from rcstat_vllm.worker.requests import Phase

    driver = clean
    never_before = driver.stats.requests_never_compacted
    driver.engine.add_request("parked", driver.prompt(PROMPT), greedy(64, eviction="lazy"))
    driver.step_until(lambda: (r := driver.record("parked")) is not None and r.phase is Phase.AWAITING_BLOCKS)
    driver.step_until(lambda: driver.generated("parked") >= 4)
    driver.abort("parked")
    finish(driver)
    assert driver.stats.requests_never_compacted == never_before + 1
    assert "lazy eviction" in driver.result("parked")["skipped_reason"]


def test_a_request_aborted_with_its_decode_time_compaction_in_flight_gives_everything_back(clean):
    """Aborted while its decode-time compaction waits for blocks (the worker scored it, the scheduler has not answered,
    or has and the copy is due next step): nothing is copied for it, every block returns, the table empties."""
    driver = clean
    driver.engine.add_request(
        "decoding", driver.prompt(PROMPT), greedy(200, decode_budget=WINDOW, decode_interval=WINDOW)
    )
    driver.step_until(
        lambda: (r := driver.record("decoding")) is not None and r.job is not None and r.job.kind == "decode",
    )
    driver.abort("decoding")
    finish(driver)
    assert driver.result("decoding")["skipped_reason"] is None  # its prompt was compacted before


def test_n_samples_of_a_lazy_request_share_their_prompt_and_leak_nothing(clean):
    """``n = 2``: vLLM runs two requests over one prompt, the second hitting the first's prompt blocks (shared); each
    parks its own plan over the blocks it computed, both decode to the end, nothing leaks."""
    driver = clean
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=0,
        max_tokens=16,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"rcstat": {"eviction": "lazy"}},
    )
    driver.engine.add_request("twins", driver.prompt(PROMPT), params)
    outputs = {}
    for _ in range(500):
        if not driver.engine.has_unfinished_requests():
            break
        for output in driver.engine.step():
            if output.finished:
                outputs[output.request_id] = [list(o.token_ids) for o in output.outputs]
    (samples,) = outputs.values()
    assert [len(sample) for sample in samples] == [16, 16]


def test_lazy_relief_never_leaves_fewer_free_blocks_with_a_shared_system_prompt(clean):
    """A lazy soak in small: 12 requests behind one 1k-token system prompt (prefix-cache hits on its 32 blocks), more
    than the pool holds, so relief runs again and again. The first request's plan covers the shared blocks (it
    computed them), which every later request holds too: on main relief still took it first (it freed most when
    parked) and took fresh blocks for nothing. Every relief here leaves at least as many free blocks as it found."""
    from rcstat_vllm.owners import engine_owner

    driver = clean
    state = engine_owner(driver.pool)
    reliefs = []
    relieve = state.relieve_pressure

    def recording(pool, relief, running):
        before = pool.get_num_free_blocks()
        gained = relieve(pool, relief, running)
        reliefs.append((before, pool.get_num_free_blocks(), gained, relief.freeing_nothing))
        return gained

    state.relieve_pressure = recording  # this engine's state only
    try:
        system = driver.token_ids(1024)
        requests = [
            (
                f"shared-{i}",
                {"prompt_token_ids": system + driver.token_ids(200, offset=1100 + 37 * i)},
                greedy(128, eviction="lazy"),
            )
            for i in range(12)
        ]
        run = driver.run(requests)
    finally:
        del state.relieve_pressure
    assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {r[0]: 128 for r in requests}
    assert reliefs, "the pool was meant to run short"
    print(
        f"\n[shared prompt] {len(reliefs)} reliefs, gains {[g for _, _, g, _ in reliefs]}, "
        f"plans passed over {sum(len(p) for *_, p in reliefs)}"
    )
    assert all(after >= before and gained >= 0 for before, after, gained, _ in reliefs), reliefs
    assert sum(gained for _, _, gained, _ in reliefs) > 0
