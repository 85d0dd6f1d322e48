#!/usr/bin/env python3
"""Check 1: vLLM starts and generates on a dummy Llama-3.1-8B-shaped model, without and with the plugin.

One engine per subprocess, in this order (``--modes``, ``--settings``):
  eager  (enforce_eager=True, no torch.compile):  vanilla (plugin not loaded), noflag (loaded, flag absent), bare
  graphs (vLLM's defaults: torch.compile + CUDA graphs, PIECEWISE with the plugin's backend): vanilla, bare
Each engine: bf16, ``load_format="dummy"``, no tokenizer, a 4 GiB KV pool, then a batch of token-id prompts (one
shorter than the plugin's min_prompt_len, which stays uncompressed) with 16 greedy ``ignore_eos`` tokens each.
Recorded per engine: start time, generation time, what vLLM chose (blocks, runner class, attention backend
classes, CUDA-graph mode), the first output tokens, and with the flag the plugin's per-request compression results.
Dummy weights give near-uniform logits, so output tokens are recorded but not expected to match across settings.

    python tools/gpu/check_engine.py                              # all of the above, writes engine.json
    python tools/gpu/check_engine.py --modes eager --settings bare
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gpu_common

DEFAULT_RUNS = "eager:vanilla,eager:noflag,eager:bare,graphs:vanilla,graphs:bare"


def worker(spec: dict) -> dict:
    if spec.get("inprocess", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(**spec["engine"])
    start_s = time.perf_counter() - t0
    facts = gpu_common.engine_facts(llm) if spec.get("inprocess", True) else {}
    prompts = [p for n, lo, hi in spec["batches"] for p in gpu_common.random_prompts(n, lo, hi, seed=lo + hi)]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    result = {
        "ok": all(len(o.outputs[0].token_ids) == spec["max_tokens"] for o in outputs),
        "import_s": round(import_s, 1),
        "engine_start_s": round(start_s, 1),
        "generate_s": round(gen_s, 2),
        "prompt_lens": [len(p) for p in prompts],
        "output_lens": [len(o.outputs[0].token_ids) for o in outputs],
        "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outputs],
        "engine": facts,
    }
    if spec["engine"].get("additional_config"):
        from rcstat_vllm.api import compression_results, match_outputs

        matched = match_outputs(outputs, compression_results(llm))
        result["compression"] = [
            None
            if m is None
            else {
                k: m.get(k)
                for k in (
                    "num_prompt_tokens",
                    "method",
                    "compression_ratio",
                    "blocks_freed",
                    "skipped_reason",
                    "pooled_pages",
                )
            }
            for m in matched
        ]
    if spec.get("inprocess", True):
        try:
            pool = gpu_common.engine_core(llm).scheduler.kv_cache_manager.block_pool
            result["free_blocks_after"] = pool.get_num_free_blocks()
            result["free_blocks_restored"] = result["free_blocks_after"] == facts.get("free_blocks")
        except Exception as exc:  # noqa: BLE001
            result["free_blocks_after"] = repr(exc)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--runs",
        default=DEFAULT_RUNS,
        help=f"mode:setting,... (default {DEFAULT_RUNS}); modes "
        f"eager|graphs; settings {', '.join(gpu_common.SETTINGS)}",
    )
    parser.add_argument(
        "--multiprocessing",
        action="store_true",
        help="also run eager:bare with vLLM's engine-core process (the default LLM set-up)",
    )
    parser.add_argument("--kv-gib", type=float, default=4.0)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine-timeout", type=float, default=240.0, help="seconds per engine subprocess")
    parser.add_argument("--budget-s", type=float, default=520.0, help="start no engine after this many seconds")
    args = parser.parse_args(argv)
    if args.worker:
        return gpu_common.worker_main(worker)

    t_start = time.perf_counter()
    model = gpu_common.dummy_model_dir()
    runs = [tuple(r.split(":")) for r in args.runs.split(",") if r]
    plan = [(mode, setting, True) for mode, setting in runs]
    if args.multiprocessing:
        plan.append(("eager", "bare", False))
    # 40 tokens: under min_prompt_len (64), uncompressed; 1-3k tokens: compressed by the bare flag's defaults.
    batches = [(1, 40, 40), (3, 1000, 3000)]
    report = {
        "check": "engine",
        "environment": gpu_common.environment(),
        "model": gpu_common.LLAMA_31_8B,
        "runs": {},
        "skipped": [],
    }
    for mode, setting, inprocess in plan:
        name = f"{mode}:{setting}" + ("" if inprocess else ":mp")
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            report["skipped"].append(f"{name} (budget: {elapsed:.0f} s used)")
            continue
        env, rcstat = gpu_common.SETTINGS[setting]
        engine = gpu_common.engine_kwargs(
            model, rcstat, eager=(mode == "eager"), max_model_len=args.max_model_len, kv_bytes=int(args.kv_gib * 2**30)
        )
        spec = {"engine": engine, "batches": batches, "max_tokens": args.max_tokens, "inprocess": inprocess}
        print(f"[engine] {name} ...", file=sys.stderr, flush=True)
        result = gpu_common.run_worker(
            Path(__file__).resolve(),
            spec,
            env,
            f"engine_{mode}_{setting}" + ("" if inprocess else "_mp"),
            args.engine_timeout,
        )
        result["setting"] = {"mode": mode, "name": setting, "env": env, "rcstat": rcstat, "inprocess": inprocess}
        report["runs"][name] = result
        print(
            f"[engine] {name}: ok={result.get('ok')} start={result.get('engine_start_s')} s "
            f"error={str(result.get('error', ''))[:200]}",
            file=sys.stderr,
            flush=True,
        )
        gpu_common.write_result("engine", report)  # partial results survive a timeout
    report["ok"] = bool(report["runs"]) and all(r.get("ok") for r in report["runs"].values()) and not report["skipped"]
    parts = []
    for name, r in report["runs"].items():
        ratios = [c["compression_ratio"] for c in r.get("compression") or [] if c and c.get("compression_ratio")]
        parts.append(
            f"{name} {'ok' if r.get('ok') else 'FAIL'}"
            + (f" start {r['engine_start_s']}s" if "engine_start_s" in r else "")
            + (f" ratios {[round(x, 2) for x in ratios]}" if ratios else "")
        )
    report["headline"] = "; ".join(parts) + (f"; skipped {report['skipped']}" if report["skipped"] else "")
    missing = sorted({r.get("missing_module") for r in report["runs"].values() if r.get("missing_module")})
    if missing:
        report["missing_modules"] = missing
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    gpu_common.write_result("engine", report)
    print(report["headline"])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "engine")
