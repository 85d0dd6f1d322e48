"""The pressure policy (rcstat_vllm/engine/pressure_policy.py) on constructed snapshots: no engine, no vLLM, no torch.
Each case states the exact decision; most would fail with another choice order or an off-by-one in the shortfall."""

from dataclasses import replace

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.pressure_policy import (
    ParkedPlan,
    PoolSnapshot,
    RunningRequest,
    blocks_wanted,
    cover,
    decode_shortfall,
    expected_gain,
    relief,
    requests_to_hurry,
    score_ahead_shortfall,
    shortfall,
    to_score_ahead,
    urgent_shortfall,
)

BLOCK = 16
DECODE = RCStatConfig(window=8, decode_budget=64, decode_interval=64)  # lead: 8 queries + 2 steps = 10


def running(req_id, num_tokens, held=None, config=None, **decode) -> RunningRequest:
    """A running request holding the blocks its tokens fill (or ``held``)."""
    return RunningRequest(req_id, num_tokens, -(-num_tokens // BLOCK) if held is None else held, config, **decode)


def parked(**blocks_freed) -> tuple[ParkedPlan, ...]:
    return tuple(ParkedPlan(req_id, freed) for req_id, freed in blocks_freed.items())


# Lazy eviction: the shortfall before a schedule and the parked plans that cover it.


def test_blocks_wanted_counts_each_running_requests_next_block_and_the_first_waiting_prompt():
    requests = [
        running("at-boundary", 4 * BLOCK),  # its 4 blocks hold its next token's slot: 0
        running("crosses", 4 * BLOCK + 1, held=4),  # its next token starts a 5th block: 1
        running("chunked", 10 * BLOCK, held=2),  # the rest of its prompt: 8
    ]
    assert blocks_wanted(requests, 0, BLOCK)[0] == 9
    wanted, reason = blocks_wanted(requests, 100, BLOCK)  # a 100-token prompt waits: 7 blocks
    assert wanted == 16 and reason == "9 blocks for running requests' growth and 7 for the first waiting request"


def test_no_relief_while_the_free_blocks_hold_what_the_schedule_wants():
    snapshot = PoolSnapshot(free_blocks=7, block_size=BLOCK, first_waiting_tokens=7 * BLOCK, parked=parked(a=3))
    decision = relief(snapshot)
    assert decision.short == 0 and decision.compact == ()
    assert relief(PoolSnapshot(6, BLOCK, first_waiting_tokens=7 * BLOCK, parked=parked(a=3))).compact == ("a",)


def test_the_plans_scored_ahead_are_those_the_relief_would_compact_a_few_steps_later_less_those_compacted_now():
    """Two requests one token short of a new block each, and a prompt waiting for 2 blocks: now 1 block short (the
    waiting prompt's 2 blocks, 1 free); 3 steps later 3 short (both requests cross a block boundary too)."""
    requests = (running("a", 4 * BLOCK - 1, held=4), running("b", 2 * BLOCK - 1, held=2))
    plans = parked(a=1, b=2, c=4)
    snapshot = PoolSnapshot(1, BLOCK, requests, first_waiting_tokens=2 * BLOCK, parked=plans)
    assert shortfall(snapshot)[0] == 1 and shortfall(snapshot, steps_ahead=3)[0] == 3
    now = relief(snapshot)
    assert now.compact == ("c",)
    # 3 short ahead: c alone covers it, and it is compacted now: nothing to score ahead.
    assert to_score_ahead(shortfall(snapshot, steps_ahead=3)[0], plans, now.compact) == ()
    # 6 short ahead: c, then b; c is compacted now, b is scored ahead.
    assert to_score_ahead(6, plans, now.compact) == ("b",)
    assert to_score_ahead(6, plans, ()) == ("c", "b")
    assert to_score_ahead(0, plans, ()) == ()  # no pressure ahead: nothing scored before it is needed


def test_plans_are_scored_slowly_ahead_of_a_prompt_like_the_running_ones_and_fast_ahead_of_a_waiting_one():
    """Nothing waits and the running requests' next tokens fit: the plans are scored over ANTICIPATE_STEPS when a
    prompt as long as the longest running one would find the pool short, not at all when the pool would hold it; a
    real shortfall SCORE_AHEAD_STEPS later (a waiting prompt) is scored over SCORE_AHEAD_STEPS."""
    from rcstat_vllm.reports import ANTICIPATE_STEPS, SCORE_AHEAD_STEPS

    requests = (running("a", 4 * BLOCK - 8, held=4), running("b", 2 * BLOCK - 8, held=2))  # 8 tokens to spare each
    snapshot = PoolSnapshot(6, BLOCK, requests)
    assert score_ahead_shortfall(snapshot) == (-6, SCORE_AHEAD_STEPS)  # nothing anticipated, nothing short
    # 32 steps later a and b take 2 blocks each: a 3-block prompt would then be 1 short (4 + 3 wanted, 6 free)
    assert score_ahead_shortfall(snapshot, anticipated_tokens=3 * BLOCK) == (1, ANTICIPATE_STEPS)
    assert score_ahead_shortfall(snapshot, anticipated_tokens=BLOCK)[0] == -1  # a 1-block prompt fits: none scored
    # a 7-block prompt waits: 1 short 5 steps later (no growth by then): its copy is due within a few steps
    waiting = replace(snapshot, first_waiting_tokens=7 * BLOCK)
    assert score_ahead_shortfall(waiting, anticipated_tokens=3 * BLOCK) == (1, SCORE_AHEAD_STEPS)
    # a 1-block prompt waits and fits; a 3-block one like those running would not, 32 steps later
    small = replace(snapshot, first_waiting_tokens=BLOCK)
    assert score_ahead_shortfall(small, anticipated_tokens=3 * BLOCK) == (1, ANTICIPATE_STEPS)


def test_a_waiting_prompt_waits_for_plans_scored_ahead_while_the_running_requests_next_tokens_do_not():
    """What the running requests need for their next tokens is covered by any plan (vLLM would preempt one); what the
    first waiting prompt wants only by ready plans (scored at prefill or ahead): an unready plan's copy would score
    every layer in that step, stalling every running request, while the prompt can wait a few steps as in vLLM."""
    requests = (running("a", 4 * BLOCK + 1, held=4),)  # its next token needs a 5th block: 1 urgent
    snapshot = PoolSnapshot(0, BLOCK, requests, first_waiting_tokens=6 * BLOCK)  # a 6-block prompt waits
    assert shortfall(snapshot)[0] == 7 and urgent_shortfall(snapshot) == 1
    unready = (ParkedPlan("big", 8, ready=False), ParkedPlan("mid", 4, ready=True), ParkedPlan("small", 2, False))
    decision = cover(7, "why", unready, urgent=1)
    # the urgent block: big (any plan, most first); it covers the prompt too
    assert decision.compact == ("big",) and decision.scoring == ()
    decision = cover(7, "why", unready, urgent=0)
    # nothing urgent: only mid is ready (4 of 7); big and small are being scored ahead, the prompt waits for them
    assert decision.compact == ("mid",) and decision.scoring == ("big", "small") and decision.rest == ()
    assert cover(7, "why", unready).compact == ("big",)  # urgent None: the whole shortfall from any plan (as before)
    assert cover(7, "why", unready, urgent=7).compact == ("big",)
    assert cover(0, "why", unready, urgent=0).compact == () and cover(0, "why", unready, urgent=0).scoring == ()
    ready = tuple(ParkedPlan(p.req_id, p.blocks_freed) for p in unready)
    assert cover(7, "why", ready, urgent=0).compact == ("big",)  # all ready: freeing most first, as before
    assert relief(replace(snapshot, parked=unready)).compact == ("big",)  # relief() splits off the urgent part


def test_plans_freeing_most_go_first_until_their_blocks_cover_the_shortfall():
    plans = parked(small=1, big=8, mid=4)
    # 3 short: the biggest alone (ascending order would take small and mid, parked order small and big).
    decision = relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=3 * BLOCK, parked=plans))
    assert decision.short == 3 and decision.compact == ("big",) and decision.rest == parked(mid=4, small=1)
    assert (
        decision.reason == "3 blocks wanted, 0 free (0 blocks for running requests' growth and 3 for the first "
        "waiting request)"
    )
    # 9 short: big (8) is one short, mid covers it; small stays parked.
    assert relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=9 * BLOCK, parked=plans)).compact == ("big", "mid")
    # 8 short: big covers it exactly.
    assert relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=8 * BLOCK, parked=plans)).compact == ("big",)
    # More than all of them free: every one, most first.
    assert relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=20 * BLOCK, parked=plans)).compact == (
        "big",
        "mid",
        "small",
    )


def test_equal_plans_go_in_the_order_they_were_parked_and_plans_freeing_nothing_are_passed_over():
    """A plan that frees nothing now (its prompt blocks shared since it was parked: <= 0) is never chosen, even when
    the shortfall is not covered: it would take fresh blocks and give none back; the relief names it (logged)."""
    assert relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=BLOCK, parked=parked(x=4, y=4))).compact == ("x",)
    assert relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=BLOCK, parked=parked(y=4, x=4))).compact == ("y",)
    decision = relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=2 * BLOCK, parked=parked(z=0, w=1, v=-3)))
    assert decision.compact == ("w",) and decision.rest == () and decision.freeing_nothing == ("z", "v")
    assert decision.after(1).compact == ()
    assert relief(PoolSnapshot(9, BLOCK, first_waiting_tokens=BLOCK, parked=parked(z=0))).freeing_nothing == ()


def test_plans_that_freed_less_than_they_said_are_followed_by_more():
    """A chosen plan may free fewer blocks than its plan said (blocks became shared since, or the copy was refused):
    the rest of the shortfall is covered by the next plans in the same order."""
    decision = relief(PoolSnapshot(0, BLOCK, first_waiting_tokens=3 * BLOCK, parked=parked(small=1, big=8, mid=4)))
    assert decision.compact == ("big",)
    after = decision.after(2)  # big freed 2: 1 still short
    assert after.short == 1 and after.compact == ("mid",) and after.rest == parked(small=1)
    assert after.reason == decision.reason
    assert decision.after(3).compact == () and decision.after(8).compact == ()
    assert after.after(0).compact == ("small",)  # mid refused: small is all that is left
    assert after.after(0).after(0).compact == ()


def test_the_decode_time_forecast_calls_for_relief_when_it_is_the_larger_shortfall():
    plans = parked(a=2, b=5)
    snapshot = PoolSnapshot(4, BLOCK, first_waiting_tokens=5 * BLOCK, parked=plans)  # the schedule: 1 short
    decision = relief(snapshot, decode=(3, "7 blocks wanted within 10 steps, 4 free"))
    assert decision.short == 3 and decision.compact == ("b",)
    assert decision.reason == "decode-time compression: 7 blocks wanted within 10 steps, 4 free"
    decision = relief(snapshot, decode=(1, "equal"))  # not larger: the schedule's own reason
    assert decision.short == 1 and decision.reason.startswith("5 blocks wanted, 4 free")
    assert relief(PoolSnapshot(9, BLOCK, parked=plans), decode=(-2, "none")).compact == ()


# Decode-time compactions brought forward.


def test_the_decode_lead_is_the_largest_window_of_queries_plus_two_steps():
    wide = RCStatConfig(window=8, observation_window=20, decode_budget=64, decode_interval=64)
    requests = [running("a", 100, config=DECODE), running("b", 90, config=wide), running("plain", 250)]
    # Within 22 steps: a 100 -> 122 (7 held, 8 wanted), b 90 -> 112 (6 held, 7), plain 250 -> 272 (16 held, 17).
    assert decode_shortfall(requests, 1, BLOCK) == (2, 22, "3 blocks wanted within 22 steps, 1 free")
    assert decode_shortfall([running("a", 100, config=DECODE)], 0, BLOCK)[:2] == (0, 10)  # 110 fits in 7 blocks
    assert decode_shortfall([running("plain", 250)], 0, BLOCK) == (0, 0, "")


def test_expected_gain_counts_generated_entries_beyond_the_budget_from_the_start_or_the_last_compaction():
    # Started at 100, at 250: by the due step (+10) 160 generated, 96 beyond the budget: 6 whole blocks.
    assert expected_gain(running("a", 250, config=DECODE, started_at=100), 10, BLOCK) == 6
    assert expected_gain(running("a", 250, config=DECODE, started_at=107), 10, BLOCK) == 5  # 89 beyond
    assert expected_gain(running("a", 250, config=DECODE), 10, BLOCK) == 0  # first seen now: 10 generated
    # Compacted at 250: each head holds the budget, 60 more since and 10 by the due step: 70 beyond, 4 blocks.
    assert expected_gain(running("a", 310, config=DECODE, started_at=100, compacted_at=250), 10, BLOCK) == 4


def test_requests_with_most_to_free_are_asked_until_their_gains_cover_the_shortfall():
    requests = [
        running("b", 208, config=DECODE, started_at=100),  # 3 blocks
        running("a", 250, config=DECODE, started_at=100),  # 6 blocks
        running("c", 160, config=DECODE, started_at=100),  # 0 blocks: never asked
        running("d", 230, config=DECODE, started_at=100),  # 76 beyond: 4 blocks
        running("plain", 440, started_at=300),  # does not compress generated KV
    ]
    assert requests_to_hurry(requests, 0, 10, BLOCK, check=1).chosen == ()
    assert requests_to_hurry(requests, 6, 10, BLOCK, check=1).chosen == (("a", 6),)
    assert requests_to_hurry(requests, 7, 10, BLOCK, check=1).chosen == (("a", 6), ("d", 4))
    assert requests_to_hurry(requests, 11, 10, BLOCK, check=1).chosen == (("a", 6), ("d", 4), ("b", 3))
    assert requests_to_hurry(requests, 99, 10, BLOCK, check=1).chosen == (("a", 6), ("d", 4), ("b", 3))


def test_requests_asked_earlier_cover_the_shortfall_until_twice_the_lead_has_passed():
    a = running("a", 250, config=DECODE, started_at=100, hurried=(6, 1))
    b = running("b", 208, config=DECODE, started_at=100)
    assert requests_to_hurry([a, b], 6, 10, BLOCK, check=21) == requests_to_hurry([a, b], 6, 10, BLOCK, check=2)
    assert requests_to_hurry([a, b], 6, 10, BLOCK, check=21).chosen == ()  # 20 checks since: still counted on
    assert requests_to_hurry([a, b], 7, 10, BLOCK, check=21).chosen == (("b", 3),)  # a is not asked twice
    expired = requests_to_hurry([a, b], 6, 10, BLOCK, check=22)  # 21 checks since: asked again
    assert expired.expired == ("a",) and expired.chosen == (("a", 6),)
