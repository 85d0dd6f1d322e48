"""benchmarks/serving.py's arithmetic and the soak's verdicts, without a server."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving


def _run(req_s, ttft99, itl99, steps=0, seconds=0.0):
    run = {k: 1.0 for k in serving.REPORTED}
    run.update(
        request_throughput=req_s,
        p99_ttft_ms=ttft99,
        p99_itl_ms=itl99,
        p50_ttft_ms=1.0,
        p50_itl_ms=1.0,
        output_throughput=req_s * 10,
    )
    before = {name: 0.0 for name in serving.COUNTERS}
    after = dict(
        before,
        **{
            "rcstat:step_compaction_seconds_count": steps,
            "rcstat:step_compaction_seconds_sum": seconds,
            "rcstat:compactions_per_step_sum": 2 * steps,
        },
    )
    run["metrics"] = serving.counter_deltas(before, after)
    return run


def test_ratios_to_vanilla_are_taken_within_a_round_then_the_median():
    rounds = [
        {"vanilla": {"runs": {"inf": _run(1.0, 100, 10)}}, "default": {"runs": {"inf": _run(1.2, 90, 11, 4, 0.2)}}},
        {"vanilla": {"runs": {"inf": _run(0.5, 200, 20)}}, "default": {"runs": {"inf": _run(0.7, 220, 20, 2, 0.2)}}},
        {"vanilla": {"runs": {"inf": _run(2.0, 50, 5)}}, "default": {"runs": {"inf": _run(2.2, 50, 6, 0, 0.0)}}},
    ]
    out = serving.summarise(rounds, ["vanilla", "default"], ["inf"])
    ratio = out["default"]["inf"]["vs_vanilla"]
    assert ratio["request_throughput"] == 1.2  # median of 1.2, 1.4, 1.1 (not 1.2 / 1.0 of the medians' ratio)
    assert ratio["p99_ttft_ms"] == 1.0 and ratio["p99_itl_ms"] == 1.1
    assert out["default"]["inf"]["request_throughput"] == 1.2 and "vs_vanilla" not in out["vanilla"]["inf"]
    # compaction time per step: over the steps that compacted (50 ms, 100 ms, none), median 50
    assert out["default"]["inf"]["compaction_ms_per_step"] == 50.0
    assert out["default"]["inf"]["copies_per_step"] == 2.0


def test_settings_servers_get_their_pool_and_the_step_token_cap(monkeypatch, tmp_path):
    started = {}

    class Recorded:
        def __init__(self, kwargs, env, log_path, extra_args=()):
            started[log_path.stem] = (kwargs["kv_cache_memory_bytes"], tuple(extra_args), env)

    monkeypatch.setattr(serving, "Server", Recorded)
    cfg = dict(serving.PRESETS["default"], max_num_batched_tokens=256)
    for name, env, rcstat in serving.SETTINGS:
        if name in ("vanilla", "vanilla_3x_pool", "rc_0.8"):
            serving.start_setting(name, env, rcstat, cfg, "model", tmp_path)
    vanilla, big, rc = started["vanilla"], started["vanilla_3x_pool"], started["rc_0.8"]
    assert big[0] == 3 * vanilla[0] and rc[0] == vanilla[0]  # (the preset's pool, 588 tokens, above one request)
    assert big[2] == vanilla[2] == {"VLLM_PLUGINS": "__none__"}
    assert {vanilla[1], big[1], rc[1]} == {("--max-num-batched-tokens", "256")}
    started.clear()
    serving.start_setting("vanilla", {}, None, serving.PRESETS["default"], "model", tmp_path)
    assert started["vanilla"][1] == ()  # (vLLM's own cap unless asked)


def _record(i, kind, status=200, outcome="completed", **extra):
    return {"i": i, "kind": kind, "status": status, "outcome": outcome, **extra}


IDLE = {
    "vllm:num_requests_running": 0.0,
    "vllm:num_requests_waiting": 0.0,
    "vllm:kv_cache_usage_perc": 0.0,
    "rcstat:worker_requests": 0.0,
    "rcstat:scheduler_requests": 0.0,
}


def test_the_soak_fails_on_any_5xx_wrong_rejection_unfinished_request_leak_or_growth():
    good = [
        _record(0, "plain"),
        _record(1, "disconnect", outcome="cancelled"),
        _record(2, "invalid", status=400, field="window", error="... 'window' must be ..."),
        _record(3, "n2", choices=2),
        _record(4, "attribution", attribution=True),
    ]
    assert serving.soak_checks(good, IDLE, [(10, 1000), (20, 1050)], [], 0.08)["failures"] == []
    bad = [
        _record(5, "plain", status=500, outcome="error", error="boom"),
        _record(6, "invalid", status=400, field="method", error="'window'"),  # names another field
        _record(7, "stream", outcome="truncated"),
        _record(8, "n2", choices=1),
        _record(9, "attribution", attribution=False),
    ]
    failures = serving.soak_checks(
        good + bad,
        {**IDLE, "rcstat:worker_requests": 2.0, "rcstat:scheduler_requests": 1.0},
        [(10, 1000), (20, 1100)],
        [{"i": 3}],
        0.08,
    )["failures"]
    assert [f.split(":")[0].split(" (")[0] for f in failures] == [
        "request 5",
        "request 6",
        "request 7",
        "request 8",
        "request 9",
        "at the end rcstat",
        "at the end rcstat",
        "server RSS grew 10.0% after warm-up",
        "1 method-none requests differ from vanilla",
    ]
    assert failures[0].startswith("request 5 (plain): HTTP 500")  # a server error, named as one
    assert (
        "rcstat:worker_requests missing"
        in serving.soak_checks(good, {k: v for k, v in IDLE.items() if k != "rcstat:worker_requests"}, [], [], 0.08)[
            "failures"
        ][0]
    )


def test_controls_run_only_when_named():
    assert [n for n, _, _ in serving.selected_settings(None)] == [
        "vanilla",
        "default",
        "rc_0.8",
        "tova_0.8",
        "default_decode",
    ]
    chosen = serving.selected_settings(["vanilla", "rc_0.8", "vanilla_3x_pool"])
    assert [n for n, _, _ in chosen] == ["vanilla", "rc_0.8", "vanilla_3x_pool"]


def test_the_itl_tail_names_the_gaps_that_waited_for_another_prompts_first_token():
    # Request 0 starts at 0 s, first token at 1 s, then five 0.1 s gaps, one 0.5 s gap (1.5 .. 2.0 s: request 1's first
    # token comes at 1.9 s, inside it) and five more; request 1's gaps are 0.1 s each.
    tail = serving.itl_tail([0.0, 1.0], [1.0, 0.9], [[0.1] * 5 + [0.5] + [0.1] * 5, [0.1] * 6])
    assert tail["gaps"] == 17
    assert tail["slowest"][0] == [500.0, 2.0, -100.0]  # (request 1's first token 0.1 s before the gap's end)
    assert [gap[0] for gap in tail["slowest"]] == [500.0, 100.0, 100.0, 100.0, 100.0]  # (at least 5)
    assert tail["slowest_beside_a_prefill"] == 1
    # A first token just after a gap's end is that step's (the step's outputs reach the clients one after another):
    # within half a median gap (here 0.05 s) it counts, 0.2 s after it does not.
    for after, beside in ((0.01, 1), (0.2, 0)):
        tail = serving.itl_tail([0.0, 0.0], [1.0, 2.0 + after], [[0.1] * 5 + [0.5], []])
        assert tail["slowest"][0] == [500.0, 2.0, round(1000 * after, 1)]
        assert tail["slowest_beside_a_prefill"] == beside
    assert serving.itl_tail([], [], []) == {}
