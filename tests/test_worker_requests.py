"""The worker's request table (rcstat_vllm.worker.requests): phases, first-sight prefix-cache hits, order, the
transitions a prompt job and a decode-time job go through, and transitions refused from the wrong phase."""

from types import SimpleNamespace

import pytest
from fake_vllm import fake_vllm_config
from worker_fixtures import awaiting_blocks, compressed

from rcstat_vllm.reports import Compaction
from rcstat_vllm.worker.driver import WorkerCompression
from rcstat_vllm.worker.requests import Phase, WorkerRequests
from rcstat_vllm.worker.step import StepInfo

PROMPT, DECODE = SimpleNamespace(kind="prompt"), SimpleNamespace(kind="decode")


def test_prefix_cache_hits_are_the_computed_tokens_at_first_sight_only():
    table = WorkerRequests()
    table.seen_in_prefill("a", 64)
    table.seen_in_prefill("a", 128)  # a later chunk: computed tokens grew by the chunk, not by cache hits
    assert table.get("a").cached_tokens == 64 and table.get("a").phase is Phase.PREFILL
    assert len(table) == 1 and "a" in table and table.with_saved_queries == set()


def test_a_prompt_job_goes_scoring_selected_awaiting_compressed_and_the_order_is_first_seen():
    table = WorkerRequests()
    for req_id in ("c", "a", "b"):
        table.seen_in_prefill(req_id, 0)
    for req_id in ("b", "a"):
        table.start_job(table.in_prefill(req_id), PROMPT)
    assert [r.req_id for r in table.in_phase(Phase.SCORING)] == ["a", "b"]  # the table's order, not the calls'
    assert [r.req_id for r in table.in_phase(Phase.PREFILL)] == ["c"]
    record = table.get("a")
    table.job_selected(record, 3)
    assert record.phase is Phase.SELECTED and record.blocks_needed == 3
    record.saved_queries = [None]
    table.job_sent(record)
    assert record.phase is Phase.AWAITING_BLOCKS and record.saved_queries is None  # sent: the window is spent
    assert table.compressed_state("a") is None and table.num_compressed == 0
    pages = SimpleNamespace()
    table.job_compacted(record, pages)
    assert record.phase is Phase.COMPRESSED and record.job is None
    assert table.compressed_state("a") is pages and table.num_compressed == 1


def test_a_decode_job_keeps_the_pages_readable_and_a_cancelled_one_goes_back_to_decoding():
    table = WorkerRequests()
    pages = SimpleNamespace()
    record = compressed(table, "a", pages)
    table.watch_decode("a", SimpleNamespace())
    table.start_job(record, DECODE)
    assert record.phase is Phase.SCORING and table.compressed_state("a") is pages  # still decodes over its pages
    table.job_selected(record, 2)
    table.job_sent(record)
    table.job_cancelled(record)
    assert record.phase is Phase.COMPRESSED and "a" in table
    uncompressed = table.watch_decode("b", SimpleNamespace())  # its prompt stayed whole
    assert uncompressed.phase is Phase.UNCOMPRESSED_DECODE
    table.start_job(uncompressed, DECODE)
    table.job_selected(uncompressed, 1)
    table.job_sent(uncompressed)
    table.job_compacted(uncompressed, pages)
    assert uncompressed.phase is Phase.COMPRESSED and table.num_compressed == 2


def test_a_cancelled_prompt_job_drops_the_record():
    table = WorkerRequests()
    record = awaiting_blocks(table, "a", PROMPT)
    table.job_cancelled(record)
    assert "a" not in table and record.job is None


def test_transitions_from_the_wrong_phase_are_refused_naming_both():
    table = WorkerRequests()
    record = compressed(table, "a", SimpleNamespace())
    with pytest.raises(RuntimeError, match="request a is compressed, expected prefill"):
        table.in_prefill("a")  # a compressed request cannot save queries or start its prompt job again
    with pytest.raises(RuntimeError, match="request a is compressed, expected prefill"):
        table.start_job(record, PROMPT)
    with pytest.raises(RuntimeError, match="request a is compressed, expected awaiting blocks"):
        table.job_compacted(record, SimpleNamespace())
    prefill = table.in_prefill("new")  # never seen in prefill (e.g. one-step prompt): created
    assert prefill.phase is Phase.PREFILL
    with pytest.raises(RuntimeError, match="request new is prefill, expected compressed or decoding uncompressed"):
        table.start_job(prefill, DECODE)
    with pytest.raises(RuntimeError, match="request new is prefill, expected scoring"):
        table.job_selected(prefill, 1)
    table.start_job(prefill, PROMPT)
    with pytest.raises(RuntimeError, match="request new is scoring, expected selected"):
        table.job_sent(prefill)
    with pytest.raises(RuntimeError, match="request new is scoring, expected prefill or compressed"):
        table.watch_decode("new", SimpleNamespace())


def test_the_worker_refuses_blocks_for_a_request_without_a_plan_and_reports_one_dropped_while_waiting():
    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))
    worker.requests.seen_in_prefill("a", 0)
    with pytest.raises(RuntimeError, match="request a, which has no plan"):
        worker.begin_step(StepInfo(requests=[], compactions=[Compaction("a", (1, 2))]))
    from rcstat_vllm.worker.jobs import PromptJob

    for req_id, eviction in (("a", "eager"), ("b", "lazy"), ("c", "lazy")):
        job = PromptJob.__new__(PromptJob)  # only its reasons are read: a compressor that reports them
        job.compressor = SimpleNamespace(
            config=SimpleNamespace(eviction=eviction),
            report=lambda reason=None, r=req_id: SimpleNamespace(req_id=r, reason=reason),
        )
        awaiting_blocks(worker.requests, req_id, job)
    recorded = []
    worker.results_log.record = recorded.append
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a", "b", "c"}, preempted_req_ids=frozenset({"c"})))
    assert (
        sorted((report.req_id, report.reason) for report in recorded)
        == [
            ("a", "finished before its KV was compacted"),
            ("b", "lazy eviction: memory was not short while it ran, its full KV was kept"),
            ("c", "preempted before its KV was compacted (vLLM recomputes it when it resumes)"),
        ]
        and worker.idle
    )


def test_the_worker_times_each_copy_it_runs_and_hands_them_over_once_per_step():
    import time

    from rcstat_vllm.reports import CompressionReport, StepCompactions

    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))
    attached = []
    released = []
    worker.pages = SimpleNamespace(layer_caches=[], attach=attached.append, release=released.append)

    def job(req_id, seconds, deferred_bound):
        def compact(caches, compaction, space):
            time.sleep(seconds)
            return SimpleNamespace(req_id=req_id)

        outcome = CompressionReport(
            req_id, 64, "rc", keep_blocks=1, kept=[[16, 32]], global_eviction_ratio=0.25, head_consensus=0.125
        )
        return SimpleNamespace(
            kind="prompt",
            compact=compact,
            decode_watcher=lambda pages: None,
            outcome=lambda compaction: outcome,
            cancelled=lambda reason: None,
            deferred_bound=deferred_bound,
        )

    # a: a lazy plan (scored at its copy: its ratio goes with the step), c: scored at its plan (the scheduler has it)
    for req_id, seconds, deferred in (("a", 0.02, 2), ("b", 0.0, 2), ("c", 0.0, None)):
        awaiting_blocks(worker.requests, req_id, job(req_id, seconds, deferred))
    assert worker.pop_step_compactions() == StepCompactions((), worker_requests=3)  # the table grew: no copy yet
    assert worker.pop_step_compactions() is None
    worker.begin_step(
        StepInfo(
            requests=[],
            compactions=[
                Compaction("a", (1, 2)),
                Compaction("b", cancelled_reason="no free blocks"),
                Compaction("c", (3,)),
            ],
        )
    )
    step = worker.pop_step_compactions()
    assert [(c.req_id, c.kind) for c in step.copies] == [("a", "prompt"), ("c", "prompt")]  # the refusal is no copy
    assert step.count("prompt") == 2 and step.count("decode") == 0
    assert step.copies[0].seconds >= 0.02 and step.seconds >= 0.02
    assert [pages.req_id for pages in attached] == ["a", "c"]
    assert step.scored_at_copy == ((1 - 48 / 128, 0.25, 0.125),)  # a's only (b was refused, c's ratio was in its plan)
    assert step.worker_requests == 2  # b, refused, left the table; a and c are compressed
    assert step.worker_results == 2  # a's and c's outcomes, kept for the Python API (rcstat:worker_results)
    assert worker.pop_step_compactions() is None  # handed over once
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a", "b", "c"}))
    assert worker.pop_step_compactions() == StepCompactions((), worker_requests=0)  # idle: the table is empty
    assert sorted(pages.req_id for pages in released) == ["a", "c"]  # dropped ids come as a set: any order


def test_parked_plans_named_to_score_ahead_are_scored_a_bounded_share_of_layers_per_step_in_the_schedulers_order():
    """Lazy eviction: the scheduler names the parked plans it expects to compact within SCORE_AHEAD_STEPS steps; each
    step the worker scores at most 1 / (SCORE_AHEAD_STEPS - 2) of the model's layers of them (6 layers: 2), the
    first named first, and a plan scored in earlier steps is selected in a step of its own (the step's whole share);
    each run timed as a ``score_ahead`` run of the step's compaction work (no copy). The scheduler learns a plan is
    ready once it is selected. Plans named to score over ANTICIPATE_STEPS (no prompt waits yet) get a layer a step."""
    from rcstat_vllm.reports import ANTICIPATE_STEPS, SCORE_AHEAD_STEPS, ScoreAhead

    assert (SCORE_AHEAD_STEPS, ANTICIPATE_STEPS) == (5, 32)
    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))
    worker.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    worker.pages = SimpleNamespace(layer_caches=["caches"])
    worker.space = "space"
    calls = []

    def job(req_id, layers_left):
        fake = SimpleNamespace(kind="prompt", scored_ahead=False)

        def score_ahead(caches, max_layers, space):
            nonlocal layers_left
            assert (caches, space) == (["caches"], "space")
            if fake.scored_ahead:
                calls.append((req_id, max_layers, 0))
                return 0
            if layers_left == 0:  # scored in earlier steps: selected now
                fake.scored_ahead = True
                calls.append((req_id, max_layers, "selected"))
                return max_layers
            scored = min(max_layers, layers_left)
            layers_left -= scored
            calls.append((req_id, max_layers, scored))
            return scored

        fake.score_ahead = score_ahead
        return fake

    awaiting_blocks(worker.requests, "a", job("a", 3))
    awaiting_blocks(worker.requests, "b", job("b", 6))
    worker.requests.in_prefill("p")  # not waiting for blocks: never scored ahead
    worker.pop_step_compactions()

    done = []

    def step(*names, steps=SCORE_AHEAD_STEPS):
        calls.clear()
        worker.begin_step(StepInfo(requests=[], score_ahead=ScoreAhead(names, steps)))
        copies = worker.pop_step_compactions()
        done.append(() if copies is None else copies.scored_ahead)
        return calls[:], [] if copies is None else [(c.req_id, c.kind) for c in copies.copies]

    assert step("b", "a", "p", "gone") == ([("b", 2, 2)], [("b", "score_ahead")])  # b is named first
    assert step("a", "b") == ([("a", 2, 2)], [("a", "score_ahead")])
    # a has 1 layer left: the step's other layer goes to b
    assert step("a", "b") == ([("a", 2, 1), ("b", 1, 1)], [("a", "score_ahead"), ("b", "score_ahead")])
    assert step("a", "b") == ([("a", 2, "selected")], [("a", "score_ahead")])  # a's selection: the whole share
    assert step("a", "b") == ([("a", 2, 0), ("b", 2, 2)], [("b", "score_ahead")])  # a, selected, is no run
    assert step() == ([], [])  # nothing named: nothing scored
    # anticipated (30 steps for 6 layers): one layer a step, then the selection as one step's whole share
    assert step("a", "b", steps=ANTICIPATE_STEPS) == ([("a", 1, 0), ("b", 1, 1)], [("b", "score_ahead")])
    assert step("b", steps=ANTICIPATE_STEPS) == ([("b", 1, "selected")], [("b", "score_ahead")])
    # the scheduler learns when a plan's copy has nothing left to score or select: a in the 4th step, b in the 8th
    assert done == [(), (), (), ("a",), (), (), (), ("b",)]


def test_a_steps_copies_travel_with_its_output_to_the_schedulers_stats_even_without_reports(monkeypatch):
    """The one worker -> scheduler channel (``RCStatModelRunnerOutput``) carries the copies' time; a step whose
    output has no report still carries it, and the scheduler's update hook counts it once."""
    import prometheus_client
    from vllm.v1.outputs import ModelRunnerOutput

    from rcstat_vllm import owners
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.patches.model_runner import RCStatModelRunnerOutput, attach_reports
    from rcstat_vllm.patches.scheduler import _update_from_output
    from rcstat_vllm.reports import CopyRun, StepCompactions

    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))

    class Runner:  # a model runner: the worker's owner is found from it (weakly)
        vllm_config = worker.vllm_config

    runner = Runner()
    monkeypatch.setitem(owners._RUNNER_OWNERS, runner, worker)
    plain = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    assert attach_reports(runner, plain) is plain  # nothing to carry
    worker._copies.extend([CopyRun("a", "prompt", 0.5), CopyRun("b", "decode", 0.25)])
    worker.requests.seen_in_prefill("a", 0)
    output = attach_reports(runner, plain)
    assert isinstance(output, RCStatModelRunnerOutput) and output.rcstat_reports == []
    assert output.rcstat_step == StepCompactions(
        (CopyRun("a", "prompt", 0.5), CopyRun("b", "decode", 0.25)), worker_requests=1
    )

    class Pool:  # a block pool: the engine state is keyed by it (weakly)
        pass

    pool = Pool()
    owners.start_engine_owner(pool, RCStatConfig(), 0)  # (the scheduler's construction, with the flag)
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool))
    update = _update_from_output(lambda self, scheduler_output, model_runner_output: "vllm's result")
    assert update(scheduler, None, output) == "vllm's result"
    update(scheduler, None, plain)
    stats = owners.engine_owner(pool).stats
    assert (stats.prompt_copies, stats.decode_copies, stats.compaction_steps, stats.compaction_seconds) == (
        1,
        1,
        1,
        0.75,
    )
    assert stats.worker_requests == 1
    assert prometheus_client.REGISTRY.get_sample_value("rcstat:worker_requests") == 1.0


def test_reports_ride_in_an_asynchronous_step_output(monkeypatch):
    """Under asynchronous scheduling the runner returns an ``AsyncModelRunnerOutput`` the engine resolves after the
    next step was scheduled: the step's reports travel inside it and come out of ``get_output`` with its tokens."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from rcstat_vllm import owners
    from rcstat_vllm.patches.model_runner import RCStatModelRunnerOutput, attach_reports
    from rcstat_vllm.reports import CompressionReport, CopyRun

    worker = WorkerCompression(fake_vllm_config({"method": "rc"}))

    class Runner:
        vllm_config = worker.vllm_config

    runner = Runner()
    monkeypatch.setitem(owners._RUNNER_OWNERS, runner, worker)
    tokens = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})

    class Pending(AsyncModelRunnerOutput):  # vLLM's, resolved later (its device-to-host copy)
        def get_output(self):
            return tokens

    assert attach_reports(runner, None) is None  # execute_model's None: sample_tokens returns the step's output
    pending = Pending()
    assert attach_reports(runner, pending) is pending  # nothing to carry
    report = CompressionReport("a", 100, "rc", 2, block_size=16)
    worker.results_log.send(report)
    worker._copies.append(CopyRun("b", "prompt", 0.5))
    wrapped = attach_reports(runner, Pending())
    assert isinstance(wrapped, AsyncModelRunnerOutput)
    output = wrapped.get_output()
    assert isinstance(output, RCStatModelRunnerOutput) and output.req_ids == ["a"]
    assert output.rcstat_reports == [report] and output.rcstat_step.copies == (CopyRun("b", "prompt", 0.5),)
