#!/usr/bin/env python3
"""Check 3: throughput on a KV-memory-bound workload, vanilla vLLM against the plugin, in interleaved rounds.

Workload (all parameters): ``--requests`` prompts of uniform random length in [``--min-len``, ``--max-len``] tokens of
random token ids (seeded: every setting gets the same prompts), all submitted at once, ``--max-tokens`` output tokens
each (``ignore_eos``: every run produces the same tokens), greedy. The KV pool holds ``--fit`` requests of the mean
length uncompressed (``kv_cache_memory_bytes``), so vanilla vLLM runs about that many at a time; prefix caching off.
Model: dummy-weight Llama-3.1-8B shapes, bf16. ``--mode graphs`` (default) is vLLM's default torch.compile + CUDA
graphs (the plugin's backend makes them PIECEWISE); ``--mode eager`` runs without either.

Settings (``--settings``, names of tools/gpu/gpu_common.py SETTINGS): vanilla (plugin not loaded), bare
(``{"rcstat": {}}``), rc0.8 (RC, 0.8 budget), tova0.8; also available: none (method none), snapkv0.8, noflag.
One engine per setting per process (a subprocess each). Rounds interleave the settings (vanilla, bare, rc0.8,
tova0.8, vanilla, ...); bare-async and rc0.8-async keep vLLM's asynchronous scheduling (``async_scheduling: keep``);
rc0.8-graphs and none-graphs capture full graphs of single-token decode steps (``cuda_graphs: full_decode``), to
compare with rc0.8 and none (``--settings none,none-graphs,rc0.8,rc0.8-graphs``); vanilla-piecewise is vanilla with
what the plugin changes at vLLM's defaults (async scheduling off, PIECEWISE graphs; ``--mode graphs`` only).
Results accumulate in ``$RCSTAT_RESULTS/throughput_<tag>_<device>.json`` across calls with
the same ``--tag``: each call runs the next runs of the interleaved plan not yet done, as many as fit in
``--budget-s``, so a plan longer than one device call (600 s) continues in the next call.

Per run: output, prompt and total tokens/s over the workload's wall time, requests/s, engine start time, steps,
peak and time-weighted mean running requests, peak waiting, fewest free KV blocks, preemptions; with the plugin the
mean compression ratio, blocks freed, and skipped reasons. Summary: per setting the median over rounds, and each
round's ratio to vanilla's in the same round, with their median.

    python tools/gpu/throughput.py --tag out2048 --max-tokens 2048
    python tools/gpu/throughput.py --tag out256 --max-tokens 256 --rounds 2
    python tools/gpu/throughput.py --tag smoke --requests 4 --min-len 2048 --max-len 4096 --max-tokens 64 --fit 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (also when imported by path: the tests)
import gpu_common

DEFAULT_SETTINGS = "vanilla,bare,rc0.8,tova0.8"


def worker(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(**spec["engine"])
    start_s = time.perf_counter() - t0
    facts = gpu_common.engine_facts(llm)
    try:
        facts["max_num_batched_tokens"] = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        facts["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    except Exception:  # noqa: BLE001
        pass
    core = gpu_common.engine_core(llm)
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    # Warm-up (kernel selection, first-call costs), not measured.
    warm = gpu_common.random_prompts(2, 1024, 1024, seed=12345)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], params(8), use_tqdm=False)
    if spec.get("rcstat") is not None:
        llm.collective_rpc("rcstat_clear_results")

    preemptions = [0]
    original_preempt = scheduler._preempt_request

    def counting_preempt(*args, **kwargs):
        preemptions[0] += 1
        return original_preempt(*args, **kwargs)

    scheduler._preempt_request = counting_preempt
    samples: list[tuple[float, int, int, int]] = []
    engine = llm.llm_engine
    original_step = engine.step

    def sampled_step():
        out = original_step()
        samples.append(
            (time.perf_counter(), len(scheduler.running), len(scheduler.waiting), pool.get_num_free_blocks())
        )
        return out

    engine.step = sampled_step
    prompts = gpu_common.random_prompts(spec["requests"], spec["min_len"], spec["max_len"], seed=spec["seed"])
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params(spec["max_tokens"]), use_tqdm=False
    )
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_start
    engine.step = original_step
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(map(len, prompts))
    times = [t_start] + [s[0] for s in samples]
    durations = [b - a for a, b in itertools.pairwise(times)]
    total = sum(durations) or 1.0
    running = [s[1] for s in samples]
    result = {
        "ok": out_tokens == spec["requests"] * spec["max_tokens"],
        "engine_start_s": round(start_s, 1),
        "engine": facts,
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_per_s": out_tokens / wall,
        "prompt_tok_per_s": prompt_tokens / wall,
        "total_tok_per_s": (out_tokens + prompt_tokens) / wall,
        "requests_per_s": len(prompts) / wall,
        "steps": len(samples),
        "peak_running": max(running, default=0),
        "mean_running": sum(r * d for r, d in zip(running, durations)) / total,
        "peak_waiting": max((s[2] for s in samples), default=0),
        "min_free_blocks": min((s[3] for s in samples), default=None),
        "preemptions": preemptions[0],
        "running_trace": running[:: max(1, len(running) // 100)],
    }
    if spec.get("rcstat") is not None:
        from rcstat_vllm.api import compression_results, match_outputs

        matched = match_outputs(outputs, compression_results(llm))
        ratios = [m["compression_ratio"] if m and not m.get("skipped_reason") else 0.0 for m in matched]
        result["mean_ratio"] = statistics.fmean(ratios) if ratios else 0.0
        result["ratios"] = [round(r, 4) for r in ratios]
        result["blocks_freed"] = sum((m or {}).get("blocks_freed") or 0 for m in matched)
        reasons: dict[str, int] = {}
        for m in matched:
            reason = "no result" if m is None else m.get("skipped_reason")
            if reason:
                reasons[reason] = reasons.get(reason, 0) + 1
        result["skipped"] = reasons
    return result


def summarize(report: dict) -> dict:
    """Per setting: rounds, median output tok/s, per-round ratio to vanilla (same round) and its median."""
    by_setting: dict[str, dict[int, dict]] = {}
    for run in report["runs"]:
        if run.get("ok"):
            by_setting.setdefault(run["setting"], {})[run["round"]] = run
    vanilla = by_setting.get("vanilla", {})
    summary = {}
    for setting, rounds in by_setting.items():
        speeds = [r["output_tok_per_s"] for _, r in sorted(rounds.items())]
        entry = {
            "rounds": sorted(rounds),
            "output_tok_per_s": speeds,
            "median_output_tok_per_s": statistics.median(speeds),
            "median_peak_running": statistics.median(r["peak_running"] for r in rounds.values()),
            "median_mean_running": statistics.median(r["mean_running"] for r in rounds.values()),
        }
        if any("mean_ratio" in r for r in rounds.values()):
            entry["mean_ratio"] = statistics.fmean(r.get("mean_ratio", 0.0) for r in rounds.values())
        paired = [
            rounds[k]["output_tok_per_s"] / vanilla[k]["output_tok_per_s"] for k in sorted(rounds) if k in vanilla
        ]
        if paired:
            entry["vs_vanilla_by_round"] = paired
            entry["median_vs_vanilla"] = statistics.median(paired)
        summary[setting] = entry
    return summary


def engine_for(setting: str, mode: str, model, max_model_len: int, kv_bytes: int, requests: int) -> dict:
    """``LLM(...)`` arguments of one run: ``setting``'s (gpu_common.SETTINGS, ENGINE_EXTRA) in ``mode``."""
    _, rcstat = gpu_common.SETTINGS[setting]
    extra = dict(gpu_common.ENGINE_EXTRA.get(setting, {}))
    if mode == "graphs":
        # The workload never runs more than ``requests`` at once, so capping vLLM's max_num_seqs there changes no
        # step; it caps CUDA-graph capture at 2 x requests tokens (1, 2, 4, 8, 16, 24, 32 for 16 requests, instead of
        # 51 sizes up to 512): every decode-only batch pads to the same size as at the default, and engines start
        # sooner; a mixed step of 33-512 tokens (a prompt's short last chunk beside decodes) runs without a graph.
        extra = {"max_num_seqs": requests, **extra}
    return gpu_common.engine_kwargs(
        model, rcstat, eager=(mode == "eager"), max_model_len=max_model_len, kv_bytes=kv_bytes, **extra
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="out2048", help="names the results file; calls with one tag accumulate")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--rounds", type=int, default=2, help="rounds in the whole plan (over as many calls)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=8192)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--fit", type=float, default=8.0, help="requests of mean length the KV pool holds")
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no run that would end after this")
    parser.add_argument("--run-timeout", type=float, default=480.0, help="seconds per engine subprocess at most")
    parser.add_argument("--fresh", action="store_true", help="discard earlier runs of this tag")
    args = parser.parse_args(argv)
    if args.worker:
        return gpu_common.worker_main(worker)

    t_start = time.perf_counter()
    env_info = gpu_common.environment()
    device = env_info.get("device") or "cuda"
    tag_device = next((t.lower() for t in ("H100", "H200", "A100", "B200") if t in device.upper()), "cuda")
    if os.environ.get("RCSTAT_DRY_RUN") and os.environ.get("RCSTAT_DEVICE_TAG"):
        tag_device = os.environ["RCSTAT_DEVICE_TAG"]  # window.sh dry: the device its plan was decided for
    name = f"throughput_{args.tag}_{tag_device}"
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in gpu_common.SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {list(gpu_common.SETTINGS)}")
    graphs_only = [s for s in settings if s in gpu_common.ENGINE_EXTRA]
    if graphs_only and args.mode == "eager":
        parser.error(f"{graphs_only} set vLLM's graph options: --mode graphs only")
    mean_tokens = (args.min_len + args.max_len) / 2 + args.max_tokens
    kv_bytes = int(args.fit * mean_tokens * gpu_common.kv_bytes_per_token())
    max_model_len = -(-(args.max_len + args.max_tokens) // 1024) * 1024
    workload = {
        "requests": args.requests,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "max_tokens": args.max_tokens,
        "fit": args.fit,
        "kv_bytes": kv_bytes,
        "kv_tokens": kv_bytes // gpu_common.kv_bytes_per_token(),
        "max_model_len": max_model_len,
        "mode": args.mode,
        "seed": args.seed,
        "prompts": "uniform random token ids in [1000, 128000)",
    }
    if args.mode == "graphs":
        workload["max_num_seqs"] = args.requests  # (engine_for: graphs captured up to the requests run at once)
    report = None if args.fresh else gpu_common.read_result(name)
    if report is not None and report.get("workload") != workload:
        print(f"[throughput] {name}: earlier runs had another workload; starting afresh", file=sys.stderr)
        report = None
    if report is None:
        report = {
            "check": "throughput",
            "benchmark": "throughput_gpu",
            "tag": args.tag,
            "workload": workload,
            "model": "dummy-weight Llama-3.1-8B shapes (tools/gpu/gpu_common.py LLAMA_31_8B), bf16",
            "runs": [],
            "calls": [],
        }
    report["environment"] = env_info
    # Runs of one tag may come from several windows (tools/gpu/window.sh seeds the committed file): each run names its
    # call, each call its commit and device.
    report["calls"].append(
        {
            "started_utc": env_info.get("time_utc"),
            "settings": settings,
            "rounds": args.rounds,
            "commit": env_info.get("commit"),
            "device": env_info.get("device"),
        }
    )
    done = {(r["setting"], r["round"]) for r in report["runs"] if r.get("ok")}
    plan = [(k, s) for k in range(1, args.rounds + 1) for s in settings if (s, k) not in done]
    model = gpu_common.dummy_model_dir()
    durations: list[float] = [r.get("process_wall_s", 0) for r in report["runs"] if r.get("process_wall_s")]
    ran = 0
    for round_index, setting in plan:
        elapsed = time.perf_counter() - t_start
        estimate = max(durations) if durations else 120.0
        if elapsed + estimate > args.budget_s:
            print(
                f"[throughput] stopping: {elapsed:.0f} s used, next run takes ~{estimate:.0f} s "
                f"(budget {args.budget_s:.0f} s); rerun with the same --tag to continue",
                file=sys.stderr,
            )
            break
        env, rcstat = gpu_common.SETTINGS[setting]
        engine = engine_for(setting, args.mode, model, max_model_len, kv_bytes, args.requests)
        spec = {
            "engine": engine,
            "rcstat": rcstat,
            "requests": args.requests,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        }
        print(f"[throughput] round {round_index} {setting} ...", file=sys.stderr, flush=True)
        timeout = max(60.0, min(args.run_timeout, args.budget_s - elapsed + 30))
        result = gpu_common.run_worker(Path(__file__).resolve(), spec, env, f"{name}_{setting}_r{round_index}", timeout)
        result.update(setting=setting, round=round_index, rcstat=rcstat, env=env, call=len(report["calls"]) - 1)
        report["runs"] = [r for r in report["runs"] if (r["setting"], r["round"]) != (setting, round_index)] + [result]
        durations.append(result.get("process_wall_s", 0))
        ran += 1
        print(
            f"[throughput] round {round_index} {setting}: "
            + (
                f"{result['output_tok_per_s']:.0f} out tok/s, peak running {result['peak_running']}, "
                f"ratio {result.get('mean_ratio', 0):.2f}"
                if result.get("ok")
                else f"FAILED {str(result.get('error'))[:300]}"
            ),
            file=sys.stderr,
            flush=True,
        )
        report["summary"] = summarize(report)
        gpu_common.write_result(name, report)
    report["summary"] = summarize(report)
    remaining = [
        (k, s)
        for k in range(1, args.rounds + 1)
        for s in settings
        if (s, k) not in {(r["setting"], r["round"]) for r in report["runs"] if r.get("ok")}
    ]
    report["remaining"] = [f"r{k}:{s}" for k, s in remaining]
    report["ok"] = not remaining and all(r.get("ok") for r in report["runs"])
    parts = [
        f"{s} {e['median_output_tok_per_s']:.0f} tok/s"
        + (f" ({e['median_vs_vanilla']:.2f}x)" if "median_vs_vanilla" in e and s != "vanilla" else "")
        + (f" r={e['mean_ratio']:.2f}" if "mean_ratio" in e else "")
        for s, e in report["summary"].items()
    ]
    failed = [f"r{r['round']}:{r['setting']}" for r in report["runs"] if not r.get("ok")]
    report["headline"] = (
        f"{args.tag}: "
        + "; ".join(parts)
        + f" | ran {ran} this call, remaining {report['remaining']}"
        + (f", failed {failed}" if failed else "")
    )
    missing = sorted({r.get("missing_module") for r in report["runs"] if r.get("missing_module")})
    if missing:
        report["missing_modules"] = missing
    gpu_common.write_result(name, report)
    # run_on_gpu.sh's summary looks for throughput.json: a pointer to the tagged file.
    gpu_common.write_result(
        "throughput",
        {
            "ok": report["ok"],
            "headline": report["headline"],
            "file": f"{name}.json",
            "missing_modules": missing or None,
        },
    )
    print(report["headline"])
    print(json.dumps(report["summary"], indent=None)[:3000])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "throughput")
