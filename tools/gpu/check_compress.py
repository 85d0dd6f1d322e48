#!/usr/bin/env python3
"""Check 2: the plugin compresses on the GPU, and vLLM's free-block count moves as the head-page layout predicts.

One engine (dummy Llama-3.1-8B shapes, bf16, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0, so the scheduler's
block pool and the worker's compression state are in reach, as in tests/engine_driver.py), the bare flag
``{"rcstat": {}}`` server-wide, and requests run one at a time with per-request overrides
(``SamplingParams.extra_args["rcstat"]``): RC, TOVA and SnapKV at a 0.8 budget, RC threshold mode (c = 1), the bare
flag's defaults, method none, and RC 0.8 on a 32k-token prompt. Per request:

* the plugin's result (rcstat_vllm.owners.runner_owner(...).compression_results(): ratio, blocks freed,
  kept counts per layer and head, pooled pages, skipped reason);
* free blocks before, after the step that compacted it, and after it finished; ``measured`` = after - (before -
  prompt blocks) against ``predicted`` from the kept counts (the formula of tests/test_compression_vllm.py);
* launches of the Triton paged scoring kernels (RC, SnapKV) while it ran: on CUDA they must be the live path;
* for the first RC request, host synchronisations during 8 decode steps after its compaction
  (``torch.cuda.set_sync_debug_mode("warn")``; vLLM's own syncs show up too: look at the file names).

    python tools/gpu/check_compress.py                 # writes compress.json
    python tools/gpu/check_compress.py --graphs        # the same with vLLM's default CUDA graphs
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import gpu_common

# Every compressing case asks for eager eviction: a lone request under the lazy default never meets pressure, so it
# is never scored or compacted (the second H200 window, 2026-11-28: "no compression result before the request
# finished", no kernel launch). Eager compacts it right after its prefill: what this check measures.
EAGER = {"eviction": "eager"}
CASES = [
    # name, prompt tokens, per-request override
    ("rc0.8", 8192, {"method": "rc", "target_ratio": 0.8, **EAGER}),
    ("tova0.8", 8192, {"method": "tova", "target_ratio": 0.8, **EAGER}),
    ("snapkv0.8", 8192, {"method": "snapkv", "target_ratio": 0.8, **EAGER}),
    ("rc_c1", 8192, {"method": "rc", "c": 1.0, **EAGER}),
    ("bare", 8192, dict(EAGER)),  # the bare flag's settings, compacted after the prefill
    ("none", 8192, {"method": "none"}),
    ("rc0.8_32k", 32000, {"method": "rc", "target_ratio": 0.8, **EAGER}),
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def predicted_blocks_freed(kept: list[list[int]], num_tokens: int, block: int, pooled: bool) -> int:
    """tests/test_compression_vllm.py's prediction: the pages of the kept tokens plus those still to come before
    vLLM's next block, L*H pages per block when pooled across layers, else H pages per block of the fullest layer."""
    to_boundary = -num_tokens % block
    pages = [[cdiv(k + to_boundary, block) for k in layer] for layer in kept]
    if pooled:
        keep_blocks = cdiv(sum(map(sum, pages)), len(kept) * len(kept[0]))
    else:
        keep_blocks = max(cdiv(sum(layer), len(layer)) for layer in pages)
    return max(cdiv(num_tokens, block) - keep_blocks, 0)


def free_after_compaction(trace: list[int], prompt_done: list[bool], now: int) -> int:
    """Free blocks right after the compaction: the fullest point among the steps that ended with the prompt computed
    (compaction frees more than later decode tokens take; an earlier prefill chunk's count is not comparable), ``now``
    when no step did."""
    done = [free for free, complete in zip(trace, prompt_done) if complete]
    return max(done) if done else now


def worker(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    import rcstat_vllm.kernels.rc_scoring as rc_scoring
    import rcstat_vllm.kernels.snapkv_scoring as snapkv_scoring
    from rcstat_vllm.owners import runner_owner

    t0 = time.perf_counter()
    llm = LLM(**spec["engine"])
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    facts = gpu_common.engine_facts(llm)
    core = gpu_common.engine_core(llm)
    pool = core.scheduler.kv_cache_manager.block_pool
    block = engine.vllm_config.cache_config.block_size
    worker_obj = core.model_executor.driver_worker
    runner = getattr(worker_obj, "worker", worker_obj).model_runner

    calls = {"rc": 0, "snapkv": 0}

    def counting(name, kernel):
        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return run

    # The scorers call the kernel launchers through these modules (as tests/test_paged_scoring.py's spy).
    rc_scoring.rc_table_scores_paged = counting("rc", rc_scoring.rc_table_scores_paged)
    snapkv_scoring.snapkv_attention_paged = counting("snapkv", snapkv_scoring.snapkv_attention_paged)

    def result_of(request_id: str):
        owner = runner_owner(runner)
        if owner is None:
            return None
        results = owner.compression_results()
        return next((r for k, r in results.items() if k == request_id or k.startswith(f"{request_id}-")), None)

    initial = pool.get_num_free_blocks()
    out = {
        "ok": True,
        "engine_start_s": round(start_s, 1),
        "engine": facts,
        "block_size": block,
        "initial_free_blocks": initial,
        "cases": {},
    }
    if runner_owner(runner) is None:
        out.update(ok=False, error="the plugin's worker state is absent: the flag did not reach the worker")
        return out
    sync_done = False
    for index, (name, num_tokens, override) in enumerate(spec["cases"]):
        request_id = f"c{index}-{name}"
        prompt = gpu_common.random_prompts(1, num_tokens, num_tokens, seed=index)[0]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            extra_args={"rcstat": override} if override is not None else None,
        )
        before = pool.get_num_free_blocks()
        calls_before = dict(calls)
        case = {"prompt_tokens": num_tokens, "override": override, "free_before": before}
        t = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        steps, trace, prompt_done = 0, [], []
        while result_of(request_id) is None and engine.has_unfinished_requests() and steps < 200:
            engine.step()
            steps += 1
            trace.append(pool.get_num_free_blocks())
            # vLLM suffixes request ids; a finished request is gone from the scheduler (its prompt was computed).
            live = next((r for k, r in core.scheduler.requests.items() if k.startswith(f"{request_id}-")), None)
            prompt_done.append(live is None or live.num_computed_tokens >= num_tokens)
        torch.cuda.synchronize()
        case["seconds_to_result"] = round(time.perf_counter() - t, 3)
        case["steps_to_result"] = steps
        case["free_trace"] = trace
        result = result_of(request_id)
        # The pool right after the compaction: the first step whose free count rose. The result is read a step later,
        # when the next decode token may already hold a fresh block (the third H200 window: 3991 then 3990 free,
        # measured 407 against the 408 the plugin freed and predicted).
        after = free_after_compaction(trace, prompt_done, pool.get_num_free_blocks())
        case["free_after_compaction"] = after
        is_none = override is not None and override.get("method") == "none"
        if result is None:
            # Method none evicts nothing: no result, or one with nothing freed, are both right.
            case.update(ok=is_none, error=None if is_none else "no compression result before the request finished")
        else:
            kept = result.get("kept") or []
            summary = {k: v for k, v in result.items() if k not in ("kept", "layer_global_eviction")}
            case["result"] = summary
            case["kept_first_last_layer"] = [kept[0], kept[-1]] if kept else None
            measured = after - (before - cdiv(num_tokens, block))
            case["measured_blocks_freed"] = measured
            if kept and result.get("skipped_reason") is None:
                predicted = predicted_blocks_freed(kept, num_tokens, block, bool(result.get("pooled_pages")))
                case["predicted_blocks_freed"] = predicted
                case["ok"] = measured == predicted == result.get("blocks_freed")
                if is_none:
                    case["ok"] = not result.get("blocks_freed")
            else:
                case["ok"] = is_none
        case["kernel_launches"] = {k: calls[k] - calls_before[k] for k in calls}
        method = (override or {}).get("method", "rc")
        if method in ("rc", "snapkv") and case.get("result", {}).get("skipped_reason") is None and result is not None:
            case["triton_live_path"] = case["kernel_launches"][method] > 0
            case["ok"] = case.get("ok", False) and case["triton_live_path"]
        if not sync_done and result is not None and method == "rc" and engine.has_unfinished_requests():
            sync_done = True
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(8):
                        if engine.has_unfinished_requests():
                            engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            sites: dict[str, int] = {}
            for w in caught:
                key = f"{w.filename}:{w.lineno}"
                sites[key] = sites.get(key, 0) + 1
            out["decode_sync_debug"] = {
                "request": request_id,
                "warnings": len(caught),
                "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:25]),
                "in_rcstat_vllm": sum(n for s, n in sites.items() if "rcstat_vllm" in s),
            }
        while engine.has_unfinished_requests():
            engine.step()
        case["free_after_finish"] = pool.get_num_free_blocks()
        case["blocks_returned"] = case["free_after_finish"] == before
        case["ok"] = bool(case.get("ok")) and case["blocks_returned"]
        out["cases"][name] = case
        out["ok"] = out["ok"] and case["ok"]
    out["final_free_blocks"] = pool.get_num_free_blocks()
    out["no_leak"] = out["final_free_blocks"] == initial
    out["ok"] = out["ok"] and out["no_leak"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--graphs", action="store_true", help="vLLM's default torch.compile + CUDA graphs")
    parser.add_argument("--server", default="{}", help="the server-wide rcstat section, JSON (default: bare flag)")
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES), help="which cases, by name")
    parser.add_argument("--kv-gib", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=280.0)
    args = parser.parse_args(argv)
    if args.worker:
        return gpu_common.worker_main(worker)

    import json

    t0 = time.perf_counter()
    wanted = set(args.cases.split(","))
    cases = [c for c in CASES if c[0] in wanted]
    max_len = max(c[1] for c in cases) + args.max_tokens + 64
    engine = gpu_common.engine_kwargs(
        gpu_common.dummy_model_dir(),
        json.loads(args.server),
        eager=not args.graphs,
        max_model_len=-(-max_len // 1024) * 1024,
        kv_bytes=int(args.kv_gib * 2**30),
    )
    spec = {"engine": engine, "cases": cases, "max_tokens": args.max_tokens}
    result = gpu_common.run_worker(
        Path(__file__).resolve(), spec, {}, "compress" + ("_graphs" if args.graphs else ""), args.timeout
    )
    report = {"check": "compress", "environment": gpu_common.environment(), "graphs": args.graphs, **result}
    parts = []
    for name, case in (result.get("cases") or {}).items():
        r = case.get("result") or {}
        parts.append(
            f"{name}: {'ok' if case.get('ok') else 'FAIL'} ratio {r.get('compression_ratio', 0):.2f} "
            f"freed {case.get('measured_blocks_freed')}/{case.get('predicted_blocks_freed')} "
            f"triton {case.get('kernel_launches')}"
        )
    report["headline"] = "; ".join(parts) or result.get("error", "no cases ran")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if result.get("missing_module"):
        report["missing_modules"] = [result["missing_module"]]
    gpu_common.write_result("compress", report)
    print(report["headline"])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "compress")
