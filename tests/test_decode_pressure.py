"""The scheduler's side of decode-time compression under memory pressure (rcstat_vllm.engine.decode_pressure over the
engine's request table): which running requests are asked to compact early, and when none are."""

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.decode_pressure import DecodePressure
from rcstat_vllm.engine.pressure_policy import expected_gain

BLOCK = 16
DECODE = RCStatConfig(window=8, decode_budget=64, decode_interval=64)  # lead: 8 queries + 2 steps


def _running(pressure, req_id, prompt, generated, config=DECODE, held=None):
    """A request seen from its start (``prompt`` tokens), now ``generated`` tokens further, holding its blocks:
    (request id, tokens, blocks held), read with its record at each check (:meth:`DecodePressure.running`)."""
    pressure.watch(req_id, prompt, lambda: config)
    num_tokens = prompt + generated
    return req_id, num_tokens, held if held is not None else -(-num_tokens // BLOCK)


def _hurry(pressure, requests, free_blocks):
    """One check as the scheduler makes it: the running requests read with their records, the shortfall within the
    lead, then the requests to ask."""
    running = [pressure.running(*request) for request in requests]
    short, lead, reason = pressure.shortfall(running, free_blocks, BLOCK)
    return pressure.requests_to_hurry(running, short, lead, BLOCK), reason if short > 0 else ""


def test_nothing_is_brought_forward_while_the_pool_holds_the_next_steps_growth():
    pressure = DecodePressure()
    running = [_running(pressure, f"r{i}", 100, 150) for i in range(4)]  # each crosses a block within 10 steps
    assert _hurry(pressure, running, 4) == ([], "")


def test_requests_with_most_generated_kv_beyond_their_budget_are_asked_until_the_shortfall_is_covered():
    pressure = DecodePressure()
    running = [
        _running(pressure, "a", 100, 150),  # at the due step (+10): 160 generated, 96 beyond 64: 6 blocks
        _running(pressure, "b", 100, 108),  # 118 generated: 54 beyond: 3 blocks
        _running(pressure, "c", 100, 60),  # 70 generated: 0 blocks
        _running(pressure, "plain", 300, 140, config=None),  # grows too, never asked
    ]
    # Within 10 steps each crosses into a new block (250 -> 260, 208 -> 218, 160 -> 170, 440 -> 450 tokens).
    chosen, reason = _hurry(pressure, running, 0)
    assert chosen == ["a"] and "4 blocks wanted within 10 steps, 0 free" in reason
    # Asked and not yet compacted: its expected 6 blocks cover the same shortfall next step.
    assert _hurry(pressure, running, 0)[0] == []
    chosen, _ = _hurry(pressure, running, -5)  # shorter still
    assert chosen == ["b"]
    # Nothing left to gain (c is within its budget), however short the pool.
    assert _hurry(pressure, running, -50)[0] == []


def test_after_a_compaction_the_gain_counts_from_it_and_a_refused_plan_may_be_asked_again():
    pressure = DecodePressure()
    a = _running(pressure, "a", 100, 150)
    assert _hurry(pressure, [a], 0)[0] == ["a"]
    pressure.requests.decode_compacted("a", None)  # refused (no free blocks): may be asked again
    assert _hurry(pressure, [a], 0)[0] == ["a"]
    _req_id, num_tokens, held = a
    pressure.requests.decode_compacted("a", num_tokens)  # copied: each head holds the budget, 10 more by the due step
    assert expected_gain(pressure.running(*a), lead=10, block_size=BLOCK) == 0
    assert _hurry(pressure, [a], 0)[0] == []
    later = pressure.running("a", num_tokens + 60, held + 4)
    assert expected_gain(later, lead=10, block_size=BLOCK) == 70 // BLOCK


def test_a_recomputed_request_counts_its_generated_kv_from_its_restart():
    """After a preemption the workers count generated KV from what the request recomputed, its new prompt."""
    pressure = DecodePressure()
    first = _running(pressure, "a", 100, 150)
    assert expected_gain(pressure.running(*first), lead=10, block_size=BLOCK) == 6
    pressure.requests.forget("a")  # preempted
    again = _running(pressure, "a", 250, 20)
    assert expected_gain(pressure.running(*again), lead=10, block_size=BLOCK) == 0


def test_a_request_whose_worker_declined_is_asked_again_after_twice_the_lead():
    pressure = DecodePressure()
    a = _running(pressure, "a", 100, 150)
    assert _hurry(pressure, [a], 0)[0] == ["a"]
    for _ in range(20):  # lead 10: its expected blocks count as coming for 20 checks
        assert _hurry(pressure, [a], 0)[0] == []
    assert _hurry(pressure, [a], 0)[0] == ["a"]
