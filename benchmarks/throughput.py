"""Throughput and memory on a KV-memory-bound workload: vanilla vLLM vs the plugin, side by side in one run.

Workload: ``--requests`` distinct long prompts (``--min-len``..``--max-len`` tokens of essay text, seeded) all
submitted at once, ``--max-tokens`` greedy output tokens each (``ignore_eos``, so every run produces the same
number of tokens), through a KV pool set explicitly (``--kv-tokens`` tokens' worth of bytes) so that vanilla
vLLM holds only a few of these requests at a time. Prefix caching is off in every run (the prompts share nothing
to reuse), block size 32 everywhere, unless ``--prefix-caching-study``.

Runs, each its own subprocess and engine, one after another:
  vanilla            VLLM_PLUGINS=__none__ (the plugin is not loaded at all)
  none               the plugin on with method none (no eviction; the plugin's attention backend)
  default            the bare flag ({"rcstat": {}}: the plugin's defaults; lazy eviction: compacted when the pool
                     is short)
  eager              the bare flag's settings with eager eviction (every request compacted after its prefill)
  rc_r0.8            the bare flag at a 0.8 budget ({"target_ratio": 0.8}; lazy eviction, as served)
  rc_c0.5/1/1.5      RC threshold mode
  rc_budget_r0.5     RC budget mode at 0.5, the plugin's defaults otherwise
  snapkv/tova@rc_c1  SnapKV and TOVA in budget mode, each request at the ratio RC (c=1) achieved on it

Per run: output tokens/s and requests/s over the workload's wall time, peak and time-weighted mean of
running requests, peak KV-cache usage (blocks in use), waiting requests and preemptions, all read from
vLLM's own metrics (``disable_log_stats=False``; ``LLM.get_metrics()`` gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and counter ``vllm:num_preemptions``) sampled
after every engine step (the engine runs in-process, so a step's gauges are that step's scheduler state).
The plugin's compression results give the achieved ratio and blocks freed per request.

``--prefix-caching-study``: every prompt starts with the same ``--shared-prefix`` tokens (1024 by default; a
shared document or system prompt), and the runs are vanilla, the plugin's bare flag and its settings with eager
eviction, each with vLLM's prefix caching on (its default) and off: ``vanilla+pc``, ``vanilla``, ``default+pc``,
``default``, ``eager+pc``, ``eager``.

``--long-output-study`` (writes ``throughput_long_output_cpu.json``): long outputs from short prompts, where the
generated KV fills the pool (reasoning, long answers): 256-token prompts, 2048 output tokens each (``ignore_eos``),
a pool that holds 4 requests uncompressed. Runs: ``vanilla``, ``default`` (the bare flag: prompts compressed),
``decode_rc`` (the bare flag with ``decode_budget`` 512, ``decode_interval`` 128 and eager eviction: generated KV
compressed too) and
the same decode budget with ``streaming`` (recent window and sinks) and ``snapkv`` scoring.

``--prefill-study`` (writes ``throughput_prefill_cpu.json``): prefill alone, side by side. 16 distinct prompts of
2000 tokens, 1 output token each, a KV pool that holds all of them at once (it never limits), prefix caching off,
two interleaved rounds (``--repeat``) of: ``vanilla`` (plugin not loaded), ``none`` (plugin, method none),
``default`` (the bare flag: lazy eviction, scoring deferred), ``eager`` (its settings with eager eviction: every
request scored in its prefill) and ``rc_layer_r0.5``
(RC at a 0.5 per-layer budget, eager, defaults otherwise). Reported:
prompt tokens/s per run and round, each run's ratio to vanilla's in the same round, and the median over rounds.
The plugin scores and selects in the forward of a prompt's last chunk and copies the kept entries one step later;
with one output token the request is finished by then, so the study times scoring and selection, not the copy
(such a request has no compression ratio: it is reported as not compacted, ``not_compacted``, or not at all
when no step follows; ``mean_ratio`` is then 0).

Prefill overhead: in the vanilla run and in the rc_c1 run, batches of ``--overhead-prompts`` prompts with
one output token (prefill only) are timed; in the rc_c1 engine the same prompts run round-robin with
per-request methods none / rc / snapkv / tova, so the difference is scoring + compaction alone (all on the
plugin's kernels); vanilla's number is vLLM's own prefill.

``--compiled yes|both``: engines at vLLM's default compilation instead of eager (on vLLM-CPU one Dynamo trace
compiled by Inductor, what ``vllm serve`` runs); ``both`` runs each setting eager and compiled side by side, each
compared with the vanilla of its own kind (``default+compiled`` against ``vanilla+compiled``).

    python benchmarks/throughput.py                     # default, writes benchmarks/results/throughput_cpu.json
    python benchmarks/throughput.py --quick --json /tmp/t.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import engine_options, environment, load_avg, resolved_config, write_report
from latency_tail import tail_count

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCH_DIR = Path(__file__).resolve().parent
KV_BYTES_PER_TOKEN_SMOLLM2 = 30 * 3 * 64 * 2 * 2  # layers * KV heads * head_dim * (K, V) * bf16
BLOCK_SIZE = 32

# Decode-heavy on purpose: the KV pool (not compute) must be what limits concurrency, and output tokens must
# dominate the work, or freed blocks cannot show up as throughput. ``kv_tokens`` holds about 4 requests.
PRESETS = {
    "quick": dict(
        requests=6,
        min_len=1024,
        max_len=1536,
        max_tokens=64,
        kv_tokens=4096,
        overhead_prompts=1,
        overhead_rounds=1,
        c_values=(1.0,),
        budget_ratios=(),
    ),
    "default": dict(
        requests=16,
        min_len=1536,
        max_len=2048,
        max_tokens=256,
        kv_tokens=8192,
        overhead_prompts=2,
        overhead_rounds=3,
        c_values=(0.5, 1.0, 1.5),
        budget_ratios=(0.5,),
    ),
}
#: --prefill-study: prompt lengths fixed, one output token, a pool for every request at once (kv_tokens = 0:
#: sized from the workload by prefill_workload), rounds = the default --repeat.
PREFILL_PRESETS = {
    "quick": dict(requests=4, min_len=1000, max_len=1000, max_tokens=1, kv_tokens=0, rounds=2),
    "default": dict(requests=16, min_len=2000, max_len=2000, max_tokens=1, kv_tokens=0, rounds=2),
}
#: --long-output-study: short prompts, long outputs; the pool holds 4 requests uncompressed.
LONG_OUTPUT_PRESETS = {
    "quick": dict(
        requests=6,
        min_len=256,
        max_len=256,
        max_tokens=512,
        kv_tokens=4 * (256 + 512),
        decode_budget=128,
        decode_interval=64,
    ),
    "default": dict(
        requests=12,
        min_len=256,
        max_len=256,
        max_tokens=2048,
        kv_tokens=4 * (256 + 2048),
        decode_budget=512,
        decode_interval=128,
    ),
}


def long_output_plan(cfg: dict) -> list[tuple[str, dict, dict]]:
    """The long-output study's runs: vanilla, the bare flag, and the decode budget with RC, StreamingLLM and SnapKV."""
    # The methods compared eagerly (every prompt compacted after its prefill, as the baselines do wherever they run);
    # decode_rc_lazy is the bare flag with decode_budget: a prompt is compacted when the pool runs short, its
    # decode-time compactions follow (the tokens it generated before counted as generated KV).
    budget = {"decode_budget": cfg["decode_budget"], "decode_interval": cfg["decode_interval"]}
    decode = {**budget, "eviction": "eager"}
    runs = [
        ("vanilla", {"VLLM_PLUGINS": "__none__"}, None),
        ("default", {}, {}),
        ("decode_rc", {}, decode),
        ("decode_rc_lazy", {}, budget),
        ("decode_streaming", {}, {"method": "streaming", **decode}),
        ("decode_snapkv", {}, {"method": "snapkv", **decode}),
    ]
    return [(name, env, {"rcstat": rcstat}) for name, env, rcstat in runs]


#: --prefill-study runs: name, extra environment, the rcstat flag (None = flag absent).
PREFILL_RUNS = (
    ("vanilla", {"VLLM_PLUGINS": "__none__"}, None),
    ("none", {}, {"method": "none"}),
    ("default", {}, {}),
    ("eager", {}, {"eviction": "eager"}),
    ("rc_layer_r0.5", {}, {"method": "rc", "target_ratio": 0.5, "budget_scope": "layer", "eviction": "eager"}),
)


def prefill_workload(cfg: dict) -> dict:
    """The prefill study's workload with its KV pool: every request's prompt and output tokens at once, rounded up
    to whole blocks per request, plus one request's worth of slack, so the pool never limits the batch."""
    per_request = -(-(cfg["max_len"] + cfg["max_tokens"]) // BLOCK_SIZE) * BLOCK_SIZE
    return {**cfg, "kv_tokens": cfg["kv_tokens"] or (cfg["requests"] + 1) * per_request}


def prefill_plan(runs=None) -> list[tuple[str, dict, dict]]:
    """(name, env, extra spec) of the prefill study's runs (``runs``: only these names), no overhead batches."""
    return [
        (name, dict(env), {"rcstat": None if rcstat is None else dict(rcstat), "prefix_caching": False})
        for name, env, rcstat in PREFILL_RUNS
        if not runs or name in runs
    ]


def prefill_summary(repeats: dict[str, list[dict]]) -> dict:
    """Per run: prompt tokens/s per round, the ratio to vanilla's in the same round, and their medians. A run's
    rounds are paired with vanilla's by position (rounds interleave every run, so round k ran at the same time)."""
    vanilla = [r["prompt_tok_per_s"] for r in repeats.get("vanilla", [])]
    out = {}
    for name, rounds in repeats.items():
        speeds = [r["prompt_tok_per_s"] for r in rounds]
        reasons: dict[str, int] = {}
        for r in rounds:
            for reason in r.get("skipped", []):
                reasons[reason] = reasons.get(reason, 0) + 1
        entry = {
            "rounds_prompt_tok_per_s": speeds,
            "median_prompt_tok_per_s": statistics.median(speeds),
            "mean_ratio": statistics.fmean(r.get("mean_ratio", 0.0) for r in rounds),
            # With one output token a request finishes before its compaction (the next step): scored and
            # selected, then reported "finished ... before its KV was compacted".
            "not_compacted": reasons,
        }
        paired = [s / v for s, v in zip(speeds, vanilla)]
        if paired:
            entry["vs_vanilla_by_round"] = paired
            entry["median_vs_vanilla"] = statistics.median(paired)
        out[name] = entry
    return out


# ----------------------------------------------------------------------------------------------- workload


def build_prompts(
    tokenizer, n: int, min_len: int, max_len: int, seed: int, tag: str, shared_prefix: int = 0
) -> list[list[int]]:
    """n distinct needle prompts of uniform random length in [min_len, max_len] (token ids); with
    ``shared_prefix``, each starts with the same that many tokens of essay text (then its own needle prompt)."""
    import data

    prefix = []
    if shared_prefix:
        sentences, _, _ = data.Haystack(tokenizer, random.Random(f"{seed}-shared-prefix")).take(shared_prefix + 64)
        prefix = data.encode(tokenizer, " ".join(sentences))[:shared_prefix]
    prompts = []
    for i in range(n):
        rng = random.Random(f"{seed}-{tag}-{i}")
        length = rng.randint(min_len, max_len) - len(prefix)
        sample = data.needle_sample(tokenizer, rng, data.Haystack(tokenizer, rng), length, rng.random())
        prompts.append(prefix + sample.prompt_ids)
    return prompts


def step_percentiles(durations: list[float], prefix: str = "step_ms") -> dict:
    """The steps' durations in ms: median, p90, p99, p99.9 and the longest (nearest-rank percentiles)."""
    if not durations:
        return {}
    ordered = sorted(durations)

    def rank(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 2)

    quantiles = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999, "max": 1.0}
    return {f"{prefix}_{name}": rank(q) for name, q in quantiles.items()}


def slowest_steps(durations: list[float], prompt_tokens: list[int], running: list[float], share: float = 0.01) -> list:
    """The slowest ``share`` of the steps (at least 5), slowest first, as ``[ms, prompt tokens computed, requests
    running]``: what the inter-token tail is made of (a step that prefills several prompts beside the decodes, or
    one that compacts)."""
    order = sorted(range(len(durations)), key=lambda i: -durations[i])[: tail_count(len(durations), share)]
    return [[round(1000 * durations[i], 1), prompt_tokens[i], int(running[i])] for i in order]


class StepSampler:
    """Wraps ``llm.llm_engine.step`` to read vLLM's gauges after every step."""

    NAMES = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
    )

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.llm_engine
        self.samples: list[tuple[float, dict]] = []
        self._original = self.engine.step
        self.engine.step = self._step

    def _read(self) -> dict:
        values = {}
        for metric in self.llm.get_metrics():
            if metric.name in self.NAMES and hasattr(metric, "value"):
                values[metric.name] = values.get(metric.name, 0) + metric.value
        return values

    def _step(self):
        out = self._original()
        self.samples.append((time.perf_counter(), self._read()))
        return out

    def reset(self):
        self.samples.clear()
        self.base = self._read()

    def summary(self, t_start: float, num_blocks: int | None) -> dict:
        if not self.samples:
            return {}
        times = [t_start] + [t for t, _ in self.samples]
        running = [v.get("vllm:num_requests_running", 0) for _, v in self.samples]
        waiting = [v.get("vllm:num_requests_waiting", 0) for _, v in self.samples]
        usage = [v.get("vllm:kv_cache_usage_perc", 0.0) for _, v in self.samples]
        durations = [b - a for a, b in itertools.pairwise(times)]
        total = sum(durations) or 1.0
        preempt = self.samples[-1][1].get("vllm:num_preemptions", 0) - self.base.get("vllm:num_preemptions", 0)
        prompt_tokens = [self.base.get("vllm:prompt_tokens", 0)] + [
            v.get("vllm:prompt_tokens", 0) for _, v in self.samples
        ]
        step_prompt_tokens = [int(b - a) for a, b in itertools.pairwise(prompt_tokens)]
        decode_only = [d for d, new in zip(durations, step_prompt_tokens) if new == 0]
        return {
            "steps": len(self.samples),
            "peak_running": max(running),
            "mean_running": sum(r * d for r, d in zip(running, durations)) / total,
            "peak_waiting": max(waiting),
            "peak_kv_usage": max(usage),
            "mean_kv_usage": sum(u * d for u, d in zip(usage, durations)) / total,
            "peak_kv_blocks_used": round(max(usage) * num_blocks) if num_blocks else None,
            "preemptions": preempt,
            # Each step gives every decoding request its next token: the steps' durations are the inter-token gaps
            # (a compacting step's own cost shows in the tail); those that computed no prompt token are decode's alone.
            **step_percentiles(durations),
            **step_percentiles(decode_only, "decode_step_ms"),
            "slowest_steps": slowest_steps(durations, step_prompt_tokens, running),
            "running_trace": running[:: max(1, len(running) // 200)],
        }


# ----------------------------------------------------------------------------------------------- worker


def worker(spec: dict) -> dict:
    """One engine: warm-up, the workload, optionally the prefill-overhead batches. Runs in a subprocess."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import data
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = data.load_tokenizer(spec["model"])
    prompts = build_prompts(
        tokenizer,
        spec["requests"],
        spec["min_len"],
        spec["max_len"],
        spec["seed"],
        "workload",
        spec.get("shared_prefix", 0),
    )
    # Eager unless the run asks for vLLM's own default compilation (``--compiled``: on vLLM-CPU one Dynamo trace
    # compiled by Inductor, what a user's ``vllm serve`` runs).
    eager = {} if spec.get("compiled") else dict(enforce_eager=True, compilation_config={"mode": 0})
    kwargs = dict(
        model=spec["model"],
        **eager,
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_bytes"],
        block_size=BLOCK_SIZE,
        enable_prefix_caching=spec.get("prefix_caching", False),
        disable_log_stats=False,
        seed=0,
    )
    if spec.get("rcstat") is not None:
        kwargs["additional_config"] = {"rcstat": spec["rcstat"]}
    from rcstat_vllm.model import with_embedded_dtype

    kwargs = with_embedded_dtype(kwargs)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {
        "name": spec["name"],
        "engine_start_s": time.perf_counter() - t0,
        # How this run was made: its engine's options, its flag as given and as the plugin resolves it (None:
        # the plugin not loaded or the flag absent), per-request overrides where the run has them.
        "engine": engine_options(kwargs),
        "compilation_mode_resolved": int(llm.llm_engine.vllm_config.compilation_config.mode),
        "rcstat": spec.get("rcstat"),
        "resolved": None if spec.get("rcstat") is None else resolved_config(spec["rcstat"]),
        "per_request": spec.get("per_request"),
    }
    num_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    result["num_kv_blocks"] = num_blocks
    plugin = spec.get("rcstat") is not None
    if plugin:
        from rcstat_vllm.api import compression_results, match_outputs

    def params(max_tokens: int, override: dict | None = None) -> SamplingParams:
        extra = {"rcstat": override} if override is not None else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)

    # Warm-up (oneDNN kernel creation, first-call costs): one short prompt, not measured.
    warm = build_prompts(tokenizer, 1, 512, 512, spec["seed"], "warmup")
    llm.generate([TokensPrompt(prompt_token_ids=warm[0])], params(4), use_tqdm=False)

    sampler = StepSampler(llm)
    sampler.reset()
    overrides = spec.get("per_request") or [None] * len(prompts)
    from tqdm import tqdm

    def progress(*args, **kw):
        kw["desc"] = f"{spec['name']}: {kw.get('desc', '')}".rstrip(": ")
        return tqdm(*args, **kw)

    t_start = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [params(spec["max_tokens"], o) for o in overrides],
        use_tqdm=progress,
    )
    wall = time.perf_counter() - t_start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result.update(
        {
            "requests": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": out_tokens,
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "wall_s": wall,
            "output_tok_per_s": out_tokens / wall,
            "requests_per_s": len(prompts) / wall,
            "prompt_tok_per_s": sum(map(len, prompts)) / wall,
            "total_tok_per_s": (out_tokens + sum(map(len, prompts))) / wall,
            **sampler.summary(t_start, num_blocks),
        }
    )
    if plugin:
        matched = match_outputs(outputs, compression_results(llm))
        ratios = [m["compression_ratio"] if m and not m.get("skipped_reason") else 0.0 for m in matched]
        result["ratios"] = ratios
        result["mean_ratio"] = statistics.fmean(ratios)
        result["blocks_freed"] = sum((m or {}).get("blocks_freed") or 0 for m in matched)
        result["decode_compactions"] = sum((m or {}).get("decode_compactions") or 0 for m in matched)
        result["decode_tokens_evicted"] = sum((m or {}).get("decode_tokens_evicted") or 0 for m in matched)
        frag = [m["fragmentation"] for m in matched if m and not m.get("skipped_reason")]
        result["mean_fragmentation"] = statistics.fmean(frag) if frag else None
        result["skipped"] = [m.get("skipped_reason") for m in matched if m and m.get("skipped_reason")]
        llm.collective_rpc("rcstat_clear_results")

    if spec.get("overhead"):
        ov = spec["overhead"]
        batch = build_prompts(tokenizer, ov["prompts"], spec["min_len"], spec["max_len"], spec["seed"], "overhead")
        times: dict[str, list[float]] = {m: [] for m in ov["methods"]}
        for _ in tqdm(range(ov["rounds"]), desc="prefill overhead", unit="round"):
            for method, override in ov["methods"].items():
                t = time.perf_counter()
                llm.generate(
                    [TokensPrompt(prompt_token_ids=p) for p in batch],
                    [params(1, override) for _ in batch],
                    use_tqdm=False,
                )
                times[method].append(time.perf_counter() - t)
        tokens = sum(map(len, batch))
        result["prefill_overhead"] = {
            m: {
                "median_s": statistics.median(v),
                "min_s": min(v),
                "runs": v,
                "prompt_tokens": tokens,
                "tok_per_s": tokens / statistics.median(v),
            }
            for m, v in times.items()
        }
    return result


def run_worker(spec: dict, env_extra: dict) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"name": spec["name"], "error": f"worker exited with {proc.returncode}", "stdout_tail": proc.stdout[-4000:]}


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a ~3-minute smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--min-len", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens of SmolLM2")
    parser.add_argument("--c", type=float, nargs="*", default=None, help="RC threshold runs")
    parser.add_argument("--matched-c", type=float, default=1.0, help="SnapKV/TOVA run at this RC run's ratios")
    parser.add_argument("--runs", nargs="*", default=None, help="only these runs (names as in the docstring)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="rounds of the whole plan, interleaved; median reported (default 1; --prefill-study 2)",
    )
    parser.add_argument("--no-prefill-overhead", action="store_true", help="skip the prefill-overhead batches")
    parser.add_argument(
        "--prefix-caching-study",
        action="store_true",
        help="shared-prefix workload; vanilla and the bare flag, prefix caching on and off",
    )
    parser.add_argument("--shared-prefix", type=int, default=None, help="tokens every prompt starts with")
    parser.add_argument(
        "--long-output-study",
        action="store_true",
        help="256-token prompts, 2048 output tokens, decode-time compression vs vanilla (default "
        "output benchmarks/results/throughput_long_output_cpu.json)",
    )
    parser.add_argument(
        "--prefill-study",
        action="store_true",
        help="prefill only (1 output token, pool not limiting): vanilla, method none, the bare flag, "
        "RC 0.5 per layer, interleaved rounds; writes benchmarks/results/throughput_prefill_cpu.json",
    )
    parser.add_argument(
        "--compiled",
        choices=("no", "yes", "both"),
        default="no",
        help="engines at vLLM's default compilation (yes: every run; both: each run eager and again compiled, "
        "named NAME+compiled and compared with vanilla+compiled); no (default): eager, compilation mode 0",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    preset = "quick" if args.quick else "default"
    cfg = dict(
        PREFILL_PRESETS[preset]
        if args.prefill_study
        else LONG_OUTPUT_PRESETS[preset]
        if args.long_output_study
        else PRESETS[preset]
    )
    if args.repeat is None:
        args.repeat = cfg.pop("rounds", 1)
    cfg.pop("rounds", None)
    for key in ("requests", "min_len", "max_len", "max_tokens", "kv_tokens"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.c is not None:
        cfg["c_values"] = tuple(args.c)
    if args.prefill_study:
        cfg = prefill_workload(cfg)
    from rcstat_vllm.model import default_model_dir

    model_dir = str(args.model or default_model_dir())
    kv_bytes = cfg["kv_tokens"] * KV_BYTES_PER_TOKEN_SMOLLM2
    max_model_len = -(-(cfg["max_len"] + cfg["max_tokens"]) // 1024) * 1024
    if cfg["kv_tokens"] < max_model_len:
        raise SystemExit(f"--kv-tokens {cfg['kv_tokens']} cannot hold one request of {max_model_len} tokens")
    base = dict(
        model=model_dir,
        requests=cfg["requests"],
        min_len=cfg["min_len"],
        max_len=cfg["max_len"],
        max_tokens=cfg["max_tokens"],
        seed=args.seed,
        kv_bytes=kv_bytes,
        max_model_len=max_model_len,
    )
    overhead_methods = {
        "none": {"method": "none"},
        "rc": {"method": "rc", "c": 1.0},
        "snapkv": {"method": "snapkv", "target_ratio": 0.8},
        "tova": {"method": "tova", "target_ratio": 0.8},
    }
    ov = dict(prompts=cfg.get("overhead_prompts", 0), rounds=cfg.get("overhead_rounds", 0))
    rc_name = lambda c: f"rc_c{c:g}"  # noqa: E731
    plan = [
        ("vanilla", {"VLLM_PLUGINS": "__none__"}, dict(rcstat=None, overhead={**ov, "methods": {"vanilla": None}})),
        ("none", {}, dict(rcstat={"method": "none"})),
        ("default", {}, dict(rcstat={})),  # the bare flag, whatever RCStatConfig() says
        ("eager", {}, dict(rcstat={"eviction": "eager"})),  # the bare flag's settings, every request compacted
        ("rc_r0.8", {}, dict(rcstat={"target_ratio": 0.8})),  # the bare flag at 0.8 (lazy, as served)
    ]
    # The methods compared as they compact every request (eager), as SnapKV and TOVA do wherever they run; their
    # matched ratios come from every request's compaction.
    for c in cfg.get("c_values", ()):
        extra = {"overhead": {**ov, "methods": overhead_methods}} if c == args.matched_c else {}
        plan.append((rc_name(c), {}, dict(rcstat={"method": "rc", "c": c, "eviction": "eager"}, **extra)))
    matched_source = rc_name(args.matched_c) if args.matched_c in cfg.get("c_values", ()) else None
    for r in cfg.get("budget_ratios", ()):
        plan.append((f"rc_budget_r{r:g}", {}, dict(rcstat={"method": "rc", "target_ratio": r, "eviction": "eager"})))
    if matched_source:
        plan += [
            (
                f"{method}@{matched_source}",
                {},
                dict(rcstat={"method": method, "target_ratio": 0.5, "eviction": "eager"}),
            )
            for method in ("snapkv", "tova")
        ]
    if args.prefill_study:
        plan = prefill_plan()
    elif args.long_output_study:
        plan = long_output_plan(cfg)
    elif args.prefix_caching_study:
        base["shared_prefix"] = 1024 if args.shared_prefix is None else args.shared_prefix
        plan = [
            (f"{name}{'+pc' if pc else ''}", env, dict(rcstat=rcstat, prefix_caching=pc))
            for name, env, rcstat in (
                ("vanilla", {"VLLM_PLUGINS": "__none__"}, None),
                ("default", {}, {}),
                ("eager", {}, {"eviction": "eager"}),
            )
            for pc in (True, False)
        ]
    elif args.shared_prefix:
        base["shared_prefix"] = args.shared_prefix
    if args.runs:
        plan = [p for p in plan if p[0] in args.runs]
    if args.no_prefill_overhead:
        plan = [(name, env, {k: v for k, v in extra.items() if k != "overhead"}) for name, env, extra in plan]
    plan = with_compilation(plan, args.compiled)

    t_start = time.time()
    load_start = load_avg()
    results: dict[str, dict] = {}
    repeats: dict[str, list[dict]] = {}
    # Rounds interleave the runs (vanilla, none, ..., vanilla, none, ...) so slow drifts of a shared machine hit
    # every run alike; each run's reported result is its median round by output tokens/s.
    for round_index in range(args.repeat):
        for name, env, extra in plan:
            spec = {**base, "name": name, **extra}
            if "@" in name:
                source = results.get(name.split("@", 1)[1], {})
                if "ratios" not in source:
                    results[name] = {"name": name, "error": f"no ratios from {name.split('@', 1)[1]}"}
                    continue
                method = name.split("@", 1)[0]
                spec["per_request"] = [{"method": method, "target_ratio": min(r, 0.999)} for r in source["ratios"]]
            print(f"[throughput] run {name} (round {round_index + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            r = run_worker(spec, env)
            r["load_avg_after"] = load_avg()
            if "error" in r:
                print(f"[throughput] {name} FAILED: {r['error']}\n{r.get('stdout_tail', '')}", file=sys.stderr)
                results.setdefault(name, r)
                continue
            print(
                f"[throughput] {name}: {r['output_tok_per_s']:.1f} out tok/s, {r['requests_per_s']:.3f} req/s, "
                f"peak running {r.get('peak_running')}, ratio {r.get('mean_ratio', 0):.3f}",
                file=sys.stderr,
            )
            repeats.setdefault(name, []).append(r)
            ordered = sorted(repeats[name], key=lambda x: x["output_tok_per_s"])
            results[name] = {
                **ordered[(len(ordered) - 1) // 2],
                "rounds_output_tok_per_s": [x["output_tok_per_s"] for x in repeats[name]],
                "rounds_step_ms_p99": [x.get("step_ms_p99") for x in repeats[name]],
                "rounds_decode_step_ms_max": [x.get("decode_step_ms_max") for x in repeats[name]],
            }

    for name, r in results.items():
        vanilla = results.get(vanilla_for(name), {})
        if "error" in r or "error" in vanilla or not vanilla:
            continue
        r["vs_vanilla"] = {
            k: r[k] / vanilla[k]
            for k in ("output_tok_per_s", "requests_per_s", "peak_running", "mean_running")
            if vanilla.get(k)
        }
        r.update(round_ratios(r, vanilla))
    report = {
        "benchmark": "throughput",
        "preset": preset,
        "seed": args.seed,
        "model": model_dir,
        "repeat": args.repeat,
        "workload": {
            **{k: v for k, v in cfg.items() if k not in ("c_values", "budget_ratios")},
            "kv_bytes": kv_bytes,
            "block_size": BLOCK_SIZE,
            "max_model_len": max_model_len,
            "vanilla_requests_that_fit": cfg["kv_tokens"] / ((cfg["min_len"] + cfg["max_len"]) / 2 + cfg["max_tokens"]),
        },
        "metrics_source": "LLM.get_metrics() gauges after every engine step (in-process engine core)",
        "runs": results,
        "wall_s": round(time.time() - t_start, 1),
        "load_avg": [load_start, load_avg()],
    }
    if args.prefill_study:
        report["study"] = "prefill"
        report["prefill"] = prefill_summary(repeats)
    report["environment"] = environment()
    name = (
        "throughput_prefill_cpu"
        if args.prefill_study
        else "throughput_long_output_cpu"
        if args.long_output_study
        else "throughput_cpu"
    )
    out = Path(args.json) if args.json else RESULTS_DIR / (f"{name}_quick.json" if args.quick else f"{name}.json")
    write_report(report, out, print_prefill_table if args.prefill_study else print_table)
    return 0


def with_compilation(plan: list, compiled: str) -> list:
    """``--compiled``: ``no``, the plan as it is (eager engines); ``yes``, every run at vLLM's default compilation,
    named ``NAME+compiled``; ``both``, each run eager and then compiled, next to each other in every round."""
    if compiled == "no":
        return plan
    at_defaults = [(f"{name}+compiled", env, {**extra, "compiled": True}) for name, env, extra in plan]
    return at_defaults if compiled == "yes" else [run for pair in zip(plan, at_defaults) for run in pair]


def vanilla_for(name: str) -> str:
    """The vanilla run a run is compared with: the one with the same prefix caching and compilation (``default+pc``
    against ``vanilla+pc``, ``rc_r0.8+compiled`` against ``vanilla+compiled``; ``snapkv@rc_c1`` against ``vanilla``)."""
    return "vanilla" + name[len(name.split("+", 1)[0]) :]


def round_ratios(run: dict, vanilla: dict) -> dict:
    """Side by side: a run's output tokens/s over its vanilla's within each round (``--repeat``), and their median;
    nothing for one round or unequal rounds."""
    rounds, vanilla_rounds = run.get("rounds_output_tok_per_s", []), vanilla.get("rounds_output_tok_per_s", [])
    if len(rounds) < 2 or len(rounds) != len(vanilla_rounds):
        return {}
    by_round = [x / v for x, v in zip(rounds, vanilla_rounds)]
    return {"vs_vanilla_by_round": by_round, "vs_vanilla_median_of_rounds": statistics.median(by_round)}


def print_prefill_table(report: dict) -> None:
    print(f"{'run':16s} {'prompt tok/s per round':>28s} {'x vanilla per round':>22s} {'median x':>8s}")
    for name, e in report["prefill"].items():
        speeds = " ".join(f"{x:.0f}" for x in e["rounds_prompt_tok_per_s"])
        ratios = " ".join(f"{x:.3f}" for x in e.get("vs_vanilla_by_round", []))
        print(f"{name:16s} {speeds:>28s} {ratios:>22s} {e.get('median_vs_vanilla', float('nan')):8.3f}")


def print_table(report: dict) -> None:
    print(
        f"{'run':20s} {'ratio':>6s} {'out tok/s':>9s} {'req/s':>7s} {'peak run':>8s} {'mean run':>8s} "
        f"{'peak KV':>7s} {'preempt':>7s} {'cached':>7s} {'x vanilla':>9s} {'step p50':>8s} {'step p99':>8s}"
    )
    for name, r in report["runs"].items():
        if "error" in r:
            print(f"{name:20s} ERROR {r['error']}")
            continue
        print(
            f"{name:20s} {r.get('mean_ratio', 0.0):6.3f} {r['output_tok_per_s']:9.2f} {r['requests_per_s']:7.3f} "
            f"{r.get('peak_running', 0):8.0f} {r.get('mean_running', 0):8.2f} {r.get('peak_kv_usage', 0):7.2f} "
            f"{r.get('preemptions', 0):7.0f} {r.get('cached_prompt_tokens', 0):7d} "
            f"{r.get('vs_vanilla', {}).get('output_tok_per_s', float('nan')):9.2f} "
            f"{r.get('step_ms_p50', float('nan')):8.1f} {r.get('step_ms_p99', float('nan')):8.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
