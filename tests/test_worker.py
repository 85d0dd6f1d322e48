"""The worker's compression owner: created by the model runner hook, found by the builders, never silent when a
runner class the plugin does not hook builds the plugin's backend."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from fake_vllm import fake_vllm_config

from rcstat_vllm import owners
from rcstat_vllm.capabilities import engine_not_pooled_reason
from rcstat_vllm.paging.kv_layout import CPU_VEC
from rcstat_vllm.worker.driver import (
    WorkerCompression,
    building_backends,
    new_worker_compression,
    worker_compression,
)

_config = fake_vllm_config


class _Runner:  # a model runner: the hooks find its owner from it
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config


def test_the_runner_hook_creates_the_owner_the_builders_find():
    runner = _Runner(_config({"method": "rc"}))
    owner = owners.start_runner_owner(runner)
    assert owner is not None and owner.disabled_reason is None
    assert owners.runner_owner(runner) is owner
    with building_backends(owner):  # vLLM builds the runner's attention backends: each builder gets its owner
        assert worker_compression(runner.vllm_config) is owner
    assert worker_compression(runner.vllm_config) is not owner  # (outside: see the next test)
    # A second set-up (vLLM's profiling one, then the real one) starts anew; without the flag there is no owner.
    assert owners.start_runner_owner(runner) is not owner
    flagless = _Runner(_config())
    assert owners.start_runner_owner(flagless) is None and owners.runner_owner(flagless) is None


def test_a_builder_outside_a_hooked_runner_gets_a_disabled_owner_naming_why(caplog):
    config = _config({"method": "rc"})
    owner = worker_compression(config)  # e.g. vLLM's Model Runner V2, which the plugin does not hook
    assert "does not carry the plugin's hooks" in owner.disabled_reason
    owner.attach_layers(["a", "b"], num_kv_heads=2, block_size=16, layout=CPU_VEC)
    assert owner.space.is_pooled is False


def test_pooling_preconditions_of_the_engine_are_named():
    assert engine_not_pooled_reason(_config({}), 16) is None
    assert "kernel blocks" in engine_not_pooled_reason(_config({}, block_size=32), 16)
    assert "KV connector" in engine_not_pooled_reason(_config({}, kv_transfer=object()), 16)
    assert "offloading" in engine_not_pooled_reason(_config({}, offloading=4.0), 16)
    shared = {"l1": SimpleNamespace(kv_sharing_target_layer_name="l0")}
    assert "share another layer" in engine_not_pooled_reason(_config({}, context=shared), 16)


def test_bind_chooses_pooled_pages_for_one_backing_buffer_and_per_layer_otherwise():
    names = ["l0", "l1"]
    backing = torch.zeros(2 * 8, 2, 16, 8)
    pooled = WorkerCompression(_config({"method": "rc"}))
    pooled.attach_layers(names, num_kv_heads=2, block_size=16, layout=CPU_VEC)
    pooled.bind_kv_caches(dict(zip(names, backing.view(2, 8, 2, 16, 8).unbind(0))))
    assert pooled.space.is_pooled and pooled.space.layer_base == (0, 16)

    separate = WorkerCompression(_config({"method": "rc"}, block_size=32))
    separate.attach_layers(names, num_kv_heads=2, block_size=16, layout=CPU_VEC)
    separate.bind_kv_caches(dict(zip(names, backing.view(2, 8, 2, 16, 8).unbind(0))))
    assert not separate.space.is_pooled  # the engine splits blocks: per-layer pools, logged


def test_a_second_kv_cache_group_turns_compression_off_with_a_reason():
    owner = WorkerCompression(_config({"method": "rc"}))
    owner.attach_layers(["l0"], num_kv_heads=2, block_size=16, layout=CPU_VEC)
    owner.attach_layers(["l0"], num_kv_heads=2, block_size=16, layout=CPU_VEC)  # same group again: fine
    assert owner.disabled_reason is None
    owner.attach_layers(["m0"], num_kv_heads=2, block_size=16, layout=CPU_VEC)
    assert "several KV-cache groups" in owner.disabled_reason


def test_report_counts_tokens_evicted_from_every_head_of_every_layer():
    """The global eviction ratio: tokens no (layer, head) kept; per layer: tokens no head of that layer kept."""
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.paging.page_space import PageSpace
    from rcstat_vllm.scoring.selection import select_keep_masks
    from rcstat_vllm.worker.prompt_compression import CompressionDecision, RequestCompressor, page_aligned_masks

    n, heads, block = 64, 2, 16
    config = RCStatConfig(method="rc", target_ratio=0.6, window=4)
    compressor = RequestCompressor(CompressionDecision("r", config, n, 0, n), 2, torch.arange(1, 5))
    # Layer 0: both heads prefer the first half; layer 1: head 0 the first half, head 1 the second half.
    first, second = torch.zeros(n), torch.zeros(n)
    first[: n // 2], second[n // 2 :] = 1.0, 1.0
    compressor.scores = [torch.stack([first, first]), torch.stack([first, second])]
    caches = [torch.zeros(12, heads, block, 8), torch.zeros(12, heads, block, 8)]
    space = PageSpace.per_layer(2, heads, block)
    # the selection select() makes: the budget's, each head's count then on a page boundary
    masks = page_aligned_masks(
        select_keep_masks(compressor.scores, config), compressor.scores, config, n, block, space.pools
    )
    compressor.keep_blocks = compressor.select(space)
    compressor.compact(caches, torch.arange(6, 6 + compressor.keep_blocks), space, CPU_VEC)
    report = compressor.report()
    evicted_everywhere_per_layer = [int((~m.any(dim=0)).sum()) for m in masks]
    assert evicted_everywhere_per_layer[0] > evicted_everywhere_per_layer[1]  # layer 1's heads cover both halves
    assert report.layer_global_eviction == [e / n for e in evicted_everywhere_per_layer]
    assert report.global_eviction_ratio == int((~(masks[0].any(0) | masks[1].any(0))).sum()) / n
    assert report.global_eviction_ratio <= min(report.layer_global_eviction)
    assert report.to_dict()["global_eviction_ratio"] == report.global_eviction_ratio
    # Head consensus beside it, from the same masks: the mean of the layers' (layer 1's heads made to agree: 1).
    from rcstat_vllm.scoring.selection import head_consensus

    assert report.head_consensus == pytest.approx(float(head_consensus(masks, config.window, 4)), abs=1e-6)
    masks[1][1] = masks[1][0]
    layer_0 = float(head_consensus(masks[:1], config.window, 4))
    assert float(head_consensus(masks, config.window, 4)) == pytest.approx((layer_0 + 1) / 2)
    assert report.head_consensus < (layer_0 + 1) / 2  # (layer 1's heads kept different halves)
    assert report.to_dict()["head_consensus"] == report.head_consensus


def test_a_prefix_cache_hit_stops_before_the_observation_window_of_requests_that_will_be_compressed():
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.settings import RequestSettings, max_cached_prompt_tokens

    server = RCStatConfig()  # window 32
    assert max_cached_prompt_tokens(1200, RequestSettings.resolve(None, server), 32) == (1200 - 32) // 32 * 32 == 1152
    assert max_cached_prompt_tokens(1200, RequestSettings.resolve({"rcstat": {"window": 100}}, server), 32) == 1088
    # SnapKV scores with its own 64-query window (the larger of the two)
    assert max_cached_prompt_tokens(1200, RequestSettings.resolve({"rcstat": {"method": "snapkv"}}, server), 32) == 1120
    # Requests that will not be compressed hit as far as vLLM allows.
    assert max_cached_prompt_tokens(1200, RequestSettings.resolve({"rcstat": {"method": "none"}}, server), 32) is None
    assert (
        max_cached_prompt_tokens(40, RequestSettings.resolve(None, server), 32) is None
    )  # shorter than min_prompt_len
    assert max_cached_prompt_tokens(1200, RequestSettings.resolve({"rcstat": {"method": "bogus"}}, server), 32) is None


@pytest.mark.parametrize(
    "feature,words",
    [
        (
            dict(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)),
            "pipeline parallelism",
        ),
        (dict(parallel_config=SimpleNamespace(tensor_parallel_size=1, use_ubatching=True)), "micro-batching"),
        (dict(speculative_config=SimpleNamespace(method="eagle")), "speculative decoding"),
    ],
    ids=["pipeline-parallel", "dbo", "speculative-decoding"],
)
def test_engine_features_the_plugin_cannot_serve_run_uncompressed_naming_why(feature, words, caplog):
    config = _config({"method": "rc"})
    for name, value in feature.items():
        setattr(config, name, value)
    owner = new_worker_compression(config)
    assert owner is not None and words in owner.disabled_reason
    assert words in caplog.text
    assert WorkerCompression(_config({"method": "rc"})).disabled_reason is None


def test_a_prefix_hit_never_reaches_past_the_prompt_of_a_request_resumed_after_preemption():
    """vLLM recomputes a preempted request from its prompt and generated tokens; a hit capped from all its tokens
    reached past the prompt (a 512-token prompt resumed at 712 tokens: 672 on main), so the step that finishes its
    prefill never came and it ran uncompressed. The scheduler hook caps the hit from the prompt only."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.owners import start_engine_owner
    from rcstat_vllm.patches.scheduler import _get_computed_blocks

    class Blocks:  # vLLM's KVCacheBlocks: one block list per KV cache group
        def __init__(self, blocks):
            self.blocks = blocks

        def get_block_ids(self):
            return tuple(list(group) for group in self.blocks)

    pool = type("Pool", (), {})()
    start_engine_owner(pool, RCStatConfig(), 0)
    manager = SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=16)])
    )
    lookup = _get_computed_blocks(lambda self, request: (Blocks((list(range(1, 45)),)), 704))  # 44 cached blocks
    resumed = SimpleNamespace(request_id="r", num_tokens=712, num_prompt_tokens=512, sampling_params=None)
    blocks, num_hit = lookup(manager, resumed)[:2]
    assert num_hit == 480 == (512 - 32) // 16 * 16 and len(blocks.blocks[0]) == 30


def test_decode_budget_holds_under_asynchronous_scheduling_on_both_sides():
    """A decode-time copy carries the tokens of the step in flight (tests/test_async_scheduling_vllm.py), so under
    asynchronous scheduling both sides resolve ``decode_budget`` as given (server flag or request override)."""
    from rcstat_vllm.engine.block_exchange import EngineCompaction

    config = _config({"method": "rc", "decode_budget": 64})
    config.scheduler_config.async_scheduling = True
    owner = WorkerCompression(config)
    engine = EngineCompaction(config=owner.config)
    override = {"rcstat": {"decode_budget": 128}}
    for table in (owner.request_settings, engine._settings):
        assert table.of("a", None).config.decode_budget == 64
        assert table.of("b", override).config.decode_budget == 128
