"""The worker's request table (rcstat_vllm.worker.requests): phases, first-sight prefix-cache hits, order, and
transitions refused from the wrong phase."""

from types import SimpleNamespace

import pytest

from fake_vllm import fake_vllm_config
from rcstat_vllm.worker.step import Compaction, StepInfo
from rcstat_vllm.worker.driver import WorkerCompression
from rcstat_vllm.worker.requests import Phase, WorkerRequest, WorkerRequests


def test_prefix_cache_hits_are_the_computed_tokens_at_first_sight_only():
    table = WorkerRequests()
    table.seen_in_prefill("a", 64)
    table.seen_in_prefill("a", 128)  # a later chunk: computed tokens grew by the chunk, not by cache hits
    assert table.get("a").cached_tokens == 64 and table.get("a").phase is Phase.PREFILL
    assert len(table) == 1 and "a" in table and table.with_saved_queries == set()


def test_records_keep_first_seen_order_and_phases_filter_them():
    table = WorkerRequests()
    for req_id in ("c", "a", "b"):
        table.seen_in_prefill(req_id, 0)
    table.get("a").phase = Phase.SELECTED
    table.get("b").phase = Phase.SELECTED
    assert [r.req_id for r in table.in_phase(Phase.SELECTED)] == ["a", "b"]
    assert [r.req_id for r in table.in_phase(Phase.PREFILL)] == ["c"]
    assert table.compressed_state("a") is None and table.num_compressed == 0


def test_transitions_from_the_wrong_phase_are_refused_naming_both():
    table = WorkerRequests()
    state = SimpleNamespace()
    table.add(WorkerRequest("a", Phase.COMPRESSED, state=state))
    assert table.compressed_state("a") is state and table.num_compressed == 1
    with pytest.raises(RuntimeError, match="request a is compressed, expected prefill or scoring"):
        table.in_prefill("a")  # a compressed request cannot save queries or start scoring again
    with pytest.raises(RuntimeError, match="already tracked"):
        table.add(WorkerRequest("a"))
    assert table.in_prefill("new").phase is Phase.PREFILL  # never seen in prefill (e.g. one-step prompt): created


def test_the_worker_refuses_blocks_for_a_request_without_a_plan_and_reports_one_dropped_while_waiting():
    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))
    worker.requests.seen_in_prefill("a", 0)
    with pytest.raises(RuntimeError, match="request a, which has no plan"):
        worker.begin_step(StepInfo(requests=[], compactions=[Compaction("a", (1, 2))]))
    recorded = []
    worker._record = recorded.append
    for req_id, eviction in (("a", "eager"), ("b", "lazy"), ("c", "lazy")):
        worker.requests.seen_in_prefill(req_id, 0)
        compressor = SimpleNamespace(config=SimpleNamespace(eviction=eviction), report=lambda reason=None: reason)
        worker.requests.get(req_id).phase, worker.requests.get(req_id).compressor = Phase.AWAITING_BLOCKS, compressor
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a", "b", "c"}, preempted_req_ids=frozenset({"c"})))
    assert sorted(recorded) == [
        "finished before its KV was compacted",
        "lazy eviction: memory was not short while it ran, its full KV was kept",
        "preempted before its KV was compacted (vLLM recomputes it when it resumes)",
    ] and worker.idle
