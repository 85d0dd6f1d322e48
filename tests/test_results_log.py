"""The worker's results log: what the Python API reads back is exactly what was recorded, per pass, and the log stays
small and bounded on a server that runs for weeks (nobody reads it over HTTP)."""

import logging
import random
import tracemalloc

from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.worker.results import ResultsLog


def _report(i: int, layers: int = 30, heads: int = 3, **fields) -> CompressionReport:
    rng = random.Random(i)
    return CompressionReport(
        req_id=f"chatcmpl-{i:032x}",
        num_prompt_tokens=1200,
        method="rc",
        keep_blocks=10,
        block_size=32,
        kept=[[rng.randint(100, 1200) for _ in range(heads)] for _ in range(layers)],
        layer_global_eviction=[rng.random() for _ in range(layers)],
        global_eviction_ratio=rng.random(),
        **fields,
    )


def test_a_recorded_result_reads_back_exactly():
    log = ResultsLog()
    reports = [_report(i) for i in range(3)] + [
        CompressionReport("skipped", 7, "rc", keep_blocks=1, skipped_reason="prompt shorter than the window")
    ]
    for report in reports:
        log.record(report)
    assert log.as_dicts() == {r.req_id: r.to_dict() for r in reports}
    assert log.results["skipped"].kept == [] and log.results[reports[1].req_id] == reports[1]
    log.decode_compacted(reports[0].req_id, 2, 96)
    assert (
        log.results[reports[0].req_id].decode_compactions,
        log.as_dicts()[reports[0].req_id]["decode_tokens_evicted"],
    ) == (2, 96)


def test_each_pass_of_a_request_is_kept_in_order():
    log = ResultsLog()
    first = _report(1)
    log.record(first)
    log.end_pass(first.req_id, "preempted")
    second = _report(2)
    second.req_id = first.req_id
    log.record(second)
    log.record(second)  # the same pass reported again: the last outcome stands, the earlier pass stays
    result = log.as_dicts()[first.req_id]
    assert result["passes"] == 2 and result["kept"] == second.kept and result["ended"] is None
    (earlier,) = result["earlier_passes"]
    assert earlier == {**first.to_dict(), "ended": "preempted", "earlier_passes": []}


def test_the_log_keeps_the_last_results_and_says_once_that_it_drops_older_ones(caplog):
    log = ResultsLog(max_results=3)
    with caplog.at_level(logging.WARNING, logger="vllm.rcstat"):
        for i in range(6):
            log.record(_report(i))
    assert list(log.results) == [_report(i).req_id for i in (3, 4, 5)] and len(log) == 3
    assert sum("older ones are dropped" in r.getMessage() for r in caplog.records) == 1


def test_a_result_costs_a_fraction_of_its_report_as_python_lists():
    """SmolLM2-135M's shape (30 layers x 3 KV heads): a report's lists as Python objects cost ~6 KB; a served
    engine keeps MAX_RESULTS of them, so the log packs them (the soak measured the lists growing with requests)."""
    reports = [_report(i) for i in range(500)]
    tracemalloc.start()
    plain = [_report(i) for i in range(500)]
    plain_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    log = ResultsLog()
    tracemalloc.start()
    for report in reports:
        log.record(report)
    packed_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(plain) == len(log) == 500
    assert packed_bytes < plain_bytes / 3, (packed_bytes / 500, plain_bytes / 500)
