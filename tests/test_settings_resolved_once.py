"""A request's overrides are parsed once per process side, not once per prefill chunk, prefix lookup or decode step
(issue 54): the worker and the scheduler side each keep a request's settings from the first time they look until the
request leaves."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from fake_vllm import fake_vllm_config

from rcstat_vllm.config import RCStatConfig
from rcstat_vllm.engine.block_exchange import EngineCompaction
from rcstat_vllm.worker.step import BatchRequest, StepInfo

BLOCK = 16


@pytest.fixture
def parses(monkeypatch):
    """Counts the settings parsed (``RCStatConfig._merged`` with something to merge: a server flag, a request's
    overrides)."""
    seen = []
    original = RCStatConfig._merged

    def counting(self, overrides, server):
        if overrides is not None:
            seen.append(overrides)
        return original(self, overrides, server)

    monkeypatch.setattr(RCStatConfig, "_merged", counting)
    return seen


def _step(worker, request: BatchRequest, **info):
    worker.begin_step(StepInfo(requests=[request], **info))
    n = request.num_scheduled_tokens
    common = SimpleNamespace(
        num_reqs=1,
        block_table_tensor=torch.arange(64, dtype=torch.int32).view(1, -1),
        query_start_loc_cpu=torch.tensor([0, n]),
    )
    return worker.plan_step(common)


def test_the_worker_parses_a_requests_overrides_once_over_its_chunks_and_decode_steps(parses):
    from rcstat_vllm.paging.kv_layout import CPU_VEC
    from rcstat_vllm.worker.driver import WorkerCompression

    # The server compresses generated KV (decode_budget): every decode step asks whether this request does too.
    worker = WorkerCompression(fake_vllm_config({"method": "rc", "decode_budget": 64}, BLOCK))
    worker.attach_layers(["l0", "l1"], num_kv_heads=2, block_size=BLOCK, layout=CPU_VEC)
    extra_args = {"rcstat": json.dumps({"method": "none"})}  # as vllm_xargs brings it: JSON text
    prompt = 200
    for computed, scheduled in ((0, 64), (64, 64), (128, 72)):  # two non-final chunks, then the last
        _step(worker, BatchRequest("a", prompt, computed, scheduled, extra_args))
    for generated in range(1, 6):
        _step(worker, BatchRequest("a", prompt, prompt + generated - 1, 1, extra_args))
    assert parses.count(extra_args["rcstat"]) == 1  # once (on main: 3 chunks + 5 decode steps = 8)
    assert worker.results["a"].skipped_reason == "method none"
    # Finished: its settings go with it; a request that comes back under the id is resolved again.
    worker.begin_step(StepInfo(requests=[], dropped_req_ids={"a"}))
    assert len(worker.request_settings) == 0
    _step(worker, BatchRequest("a", prompt, 0, 64, extra_args))
    assert parses.count(extra_args["rcstat"]) == 2


def test_the_scheduler_side_parses_a_requests_overrides_once_over_its_prefix_lookups(parses):
    state = EngineCompaction(config=RCStatConfig.from_dict({"method": "rc", "window": 8, "min_prompt_len": 1}))
    extra_args = {"rcstat": json.dumps({"window": 16})}
    for _ in range(4):  # a waiting request is looked up again each schedule it does not fit
        assert state.prefix_hit_limit("a", 96, 100, extra_args, BLOCK) == 80  # (100 - 16) // 16 * 16
    assert parses.count(extra_args["rcstat"]) == 1
    decode_request = SimpleNamespace(request_id="a", sampling_params=SimpleNamespace(extra_args=extra_args))
    from rcstat_vllm.patches.scheduler import decode_config

    assert (
        decode_config(state, decode_request) is None and parses.count(extra_args["rcstat"]) == 1
    )  # the forecast reads the same settings
    state.forget("a")  # vLLM freed its blocks (finished or preempted): resolved again if it comes back
    assert state.prefix_hit_limit("a", 96, 100, extra_args, BLOCK) == 80 and parses.count(extra_args["rcstat"]) == 2


def test_the_server_flag_is_parsed_once_per_process(parses):
    from rcstat_vllm.config import _parsed_server_config, server_config

    _parsed_server_config.cache_clear()
    flag = {"rcstat": {"method": "snapkv", "target_ratio": 0.5}}
    configs = {id(server_config(flag)) for _ in range(5)}  # admission asks once per request
    assert len(configs) == 1 and server_config(flag).method == "snapkv"
    assert len(parses) == 1
    assert server_config({"rcstat": {"target_ratio": 0.5, "method": "snapkv"}}) is server_config(flag)  # key order
    with pytest.raises(Exception, match="'window'"):
        server_config({"rcstat": {"window": 0}})  # still rejected at start-up, naming the field


def test_a_budget_tightened_at_the_copy_is_in_the_result_not_only_the_log():
    """Lazy eviction scores at the copy, into the blocks the plan's bound allocated; when forced keeps (non-finite
    scores) do not fit, the budget tightens in 0.05 steps until they do: the result says what was evicted."""
    from rcstat_vllm.settings import RequestSettings
    from rcstat_vllm.worker.prompt_compression import RequestCompressor, plan_compression

    settings = RequestSettings.resolve({"rcstat": {"target_ratio": 0.4, "window": 8}}, RCStatConfig())
    decision = plan_compression(BatchRequest("a", 200, 0, 200), settings, 0, 200)
    compressor = RequestCompressor(decision, 2, torch.arange(13))
    ratios = []

    def select(space):  # the kept entries fit 5 blocks from a budget of 0.5 on
        ratios.append(compressor.config.target_ratio)
        compressor.kept = torch.full((2, 2), 100)
        compressor.visible = torch.ones(2, 200, dtype=torch.bool)
        return 4 if compressor.config.target_ratio >= 0.5 - 1e-9 else 9

    compressor.score_deferred = lambda caches, layout: None
    compressor.select = select
    compressor._score_and_select_within(None, None, None, allocated=5)
    assert [round(r, 2) for r in ratios] == [0.4, 0.45, 0.5]
    assert compressor.report().budget_tightened_to == pytest.approx(0.5)
    assert compressor.report().to_dict()["budget_tightened_to"] == pytest.approx(0.5)
    compressor.config = decision.config  # met as set: nothing to say
    assert compressor.report().budget_tightened_to is None
