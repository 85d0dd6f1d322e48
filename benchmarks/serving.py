"""Serving under load, measured as ``vllm serve`` users measure it: ``rcstat-vllm serve`` driven by vLLM 0.32's own
serving benchmark (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``), side by side.

Settings, each its own server (``rcstat-vllm serve``, ``--enforce-eager``, block size 32, vLLM's defaults otherwise:
prefix caching on, chunked prefill):
  vanilla         VLLM_PLUGINS=__none__ (the plugin is not loaded)
  default         the bare flag ({"rcstat": {}}: lazy eviction, compacted when the pool is short)
  rc_0.8          {"method": "rc", "target_ratio": 0.8}
  tova_0.8        {"method": "tova", "target_ratio": 0.8}
  default_decode  the bare flag with decode_budget (generated KV compacted too)
  vanilla_3x_pool vanilla with three times the KV pool (about what RC 0.8 frees here): as many requests at once
                  (a control, run only when --settings names it)
  rc_0.8_eager    RC 0.8 compacting every prompt after its prefill (eviction eager; only when named)

Workload (KV-bound on purpose): vLLM's ``random`` dataset (random token ids, no download, the tokenizer is the local
model folder), ``--num-prompts`` prompts of ``input_len`` tokens (+-``range_ratio``), ``output_len`` output tokens
each (``ignore_eos``, greedy), Poisson arrivals at each request rate of the preset (fractions of vanilla's saturation
throughput, probed once) and all at once (``inf``: saturation), through a KV pool that holds a quarter of the prompts
(``pool_requests`` requests of ``input_len + output_len`` tokens): at saturation vanilla runs a quarter of them at a
time. A run at rate r takes num_prompts / r seconds at least, so on a 2-core CPU (vLLM binds the engine to one core;
vanilla saturates near 0.2-0.4 req/s here) the default keeps to 6 short requests per run (320 +- 20% prompt tokens,
72 output tokens; a pool of 1.5 of them) and two rates, 0.5x saturation and inf: about 10-12 minutes; p99 over 6
requests' TTFT is their slowest, ITL percentiles are over ~400 gaps. 72 output tokens: decode_budget's smallest
setting (32, interval 32: the window) compacts once 64 tokens were generated. ``--quick`` (~4 min): one round at
saturation only.

Every setting's server starts once, all together (vLLM binds each engine to a core; an idle engine waits), and
answers one warm-up request. Rounds are interleaved: each round runs every setting, in an order rotated by one per
round, at every rate; numbers are medians over rounds, and each setting's ratio to
vanilla is taken within a round, then the median. Per run: request throughput, output tokens/s, TTFT and ITL
p50/p90/p99 (vLLM's benchmark), and from the server's ``/metrics`` over the run: preemptions (``vllm:num_preemptions``),
the plugin's compactions, their time per step (``rcstat:step_compaction_seconds``), copies per step, requests
compressed / planned / never compacted, and blocks freed; and the slowest 1% of the inter-token gaps with what they
waited for (``itl_tail``, benchmarks/latency_tail.py: a gap that ends as another request's first token comes waited
for that prompt's prefill step). ``--max-num-batched-tokens N`` gives every server vLLM's cap on the tokens a step
computes (chunked prefill: shorter prefill steps beside the decodes).

    python benchmarks/serving.py                  # default: writes benchmarks/results/serving_cpu.json (+ .png)
    python benchmarks/serving.py --quick          # ~4 min: one round at saturation, *_quick.json
    python benchmarks/serving.py --soak [MINUTES] # the HTTP soak (tests/test_serving_soak.py), 45 minutes by default

``--soak [MINUTES]``: the OpenAI server with the bare flag and ``decode_budget`` (float32, attribution processor on)
under bounded concurrent clients (:func:`soak`): mixed prompt and output lengths over shared prefixes, streaming and
not, ~10% disconnecting mid-stream, invalid ``vllm_xargs`` overrides (400 naming the field), ``n > 1``, attribution,
method ``none`` replayed on a vanilla server for token identity; the checks (:func:`soak_checks`) written to
``benchmarks/results/serving_soak_cpu.json``. Memory: once a minute (``samples``), each process of the plugin
server's tree by name (API server, ``VLLM::EngineCore``, ``VLLM::Worker``: :func:`server_processes`) with its RSS and
anonymous RSS, the plugin's tables that ``/metrics`` exports (:data:`TABLE_SERIES`; those it does not are named in
``tables_not_exported``) and the counters; per process (``memory``) RSS at warm-up's end and at the end and the
least-squares slope after warm-up in percent per 10 minutes, against :data:`RSS_SLOPE_TARGET` (reported, not a
failure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, environment, load_avg, resolved_config, write_report
from latency_tail import itl_tail
from server_process import PERCENTILES, ServerProcess, bench_fields, bench_serve_args, free_port
from throughput import BLOCK_SIZE, KV_BYTES_PER_TOKEN_SMOLLM2

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Rates: "inf" (all at once: saturation) or "<f>x", a fraction of vanilla's request throughput at saturation measured
#: once on the warm vanilla server before the rounds (a probe run at "inf", recorded): what "below saturation" means
#: on whatever machine runs it. ``pool_requests``: requests of input_len + output_len tokens the KV pool holds.
PRESETS = {
    "quick": dict(
        num_prompts=6,
        input_len=320,
        range_ratio=0.2,
        output_len=72,
        pool_requests=1.5,
        rates=("inf",),
        rounds=1,
        decode_budget=32,
        decode_interval=32,
    ),
    "default": dict(
        num_prompts=6,
        input_len=320,
        range_ratio=0.2,
        output_len=72,
        pool_requests=1.5,
        rates=("0.5x", "inf"),
        rounds=2,
        decode_budget=32,
        decode_interval=32,
    ),
}

#: name, extra environment, the rcstat flag (None: absent); decode_budget filled from the preset
SETTINGS = (
    ("vanilla", {"VLLM_PLUGINS": "__none__"}, None),
    ("default", {}, {}),
    ("rc_0.8", {}, {"method": "rc", "target_ratio": 0.8}),
    ("tova_0.8", {}, {"method": "tova", "target_ratio": 0.8}),
    ("default_decode", {}, {"decode_budget": None, "decode_interval": None}),
    ("vanilla_3x_pool", {"VLLM_PLUGINS": "__none__"}, None),
    ("rc_0.8_eager", {}, {"method": "rc", "target_ratio": 0.8, "eviction": "eager"}),
)
#: settings whose KV pool is this many times the preset's: vanilla with about the memory RC 0.8 frees on these
#: requests (0.8 of 320 prompt tokens: 136 of 392 tokens held), the control for what running more requests at once
#: does to latency by itself (each prompt's prefill step delays every request decoding beside it)
POOL_SCALE = {"vanilla_3x_pool": 3.0}
#: run only when ``--settings`` names them (controls, not the comparison itself)
NAMED_ONLY = ("vanilla_3x_pool", "rc_0.8_eager")
#: Prometheus series summed over their labels, read before and after each run (the run's deltas are reported)
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "rcstat:requests_compressed_total",
    "rcstat:requests_uncompressed_total",
    "rcstat:requests_planned_total",
    "rcstat:requests_never_compacted_total",
    "rcstat:kv_blocks_freed_total",
    "rcstat:decode_compactions_total",
    "rcstat:decode_compactions_skipped_total",
    "rcstat:step_compaction_seconds_sum",
    "rcstat:step_compaction_seconds_count",
    "rcstat:compactions_per_step_sum",
    "rcstat:compactions_per_step_count",
    "rcstat:compaction_seconds_sum",
    "rcstat:compaction_seconds_count",
    "rcstat:compaction_seconds_sum:score_ahead",
    "rcstat:compaction_seconds_count:score_ahead",
)
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "rcstat:worker_requests",
    "rcstat:scheduler_requests",
    "rcstat:worker_results",
)


# ---- one server ----


def server_kwargs(
    model: str, rcstat: dict | None, kv_tokens: int, max_model_len: int, dtype: str | None = None
) -> dict:
    """The engine's options, sized in tokens: a bf16 budget (``with_embedded_dtype`` doubles it in float32)."""
    from rcstat_vllm.model import with_embedded_dtype

    kwargs = dict(
        model=model,
        enforce_eager=True,
        compilation_config={"mode": 0},
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_tokens * KV_BYTES_PER_TOKEN_SMOLLM2,
        block_size=BLOCK_SIZE,
        seed=0,
    )
    if rcstat is not None:
        kwargs["additional_config"] = {"rcstat": rcstat}
    if dtype is not None:
        kwargs["dtype"] = dtype
        if dtype == "float32":
            kwargs["kv_cache_memory_bytes"] *= 2
    return with_embedded_dtype(kwargs)


class Server(ServerProcess):
    """``rcstat-vllm serve`` of :func:`server_kwargs` on the loopback address, its output in ``log_path``."""

    def __init__(self, kwargs: dict, env: dict, log_path: Path, extra_args: tuple[str, ...] = ()):
        port = free_port()
        self.kwargs, self.port, self.model = kwargs, port, kwargs["model"]
        cmd = [
            sys.executable,
            "-m",
            "rcstat_vllm.cli",
            "serve",
            kwargs["model"],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--compilation-config",
            json.dumps(kwargs["compilation_config"]),
            "--max-model-len",
            str(kwargs["max_model_len"]),
            "--kv-cache-memory-bytes",
            str(kwargs["kv_cache_memory_bytes"]),
            "--block-size",
            str(kwargs["block_size"]),
            "--seed",
            str(kwargs["seed"]),
            *extra_args,
        ]
        if "dtype" in kwargs:
            cmd += ["--dtype", kwargs["dtype"]]
        if "additional_config" in kwargs:
            cmd += ["--additional-config", json.dumps(kwargs["additional_config"])]
        full_env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        full_env["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
        full_env.update(env)
        super().__init__(cmd, full_env, log_path, port)

    def wait_healthy(self, timeout: float = 600) -> None:
        """As :meth:`ServerProcess.wait_healthy`, the server's last output in the error."""
        try:
            super().wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{err}\n{self.log_tail()}") from err

    def rss_bytes(self) -> int:
        """Resident memory of the server's process tree (API server, engine core)."""
        pids, total = _process_tree(self.proc.pid), 0
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total


def process_name(cmdline: str, root: bool = False) -> str:
    """A server process's name from its command line (``/proc/PID/cmdline``, NULs as spaces): vLLM's process title
    when it set one (``VLLM::EngineCore``, ``VLLM::Worker_TP0``: setproctitle rewrites the command line), else
    ``api_server`` for the server's root process (``python -m rcstat_vllm.cli serve``: the API server), else
    ``resource_tracker`` for multiprocessing's, else the program's file name (with ``-m MODULE`` when run so)."""
    words = cmdline.replace("\0", " ").split()
    if words and words[0].startswith("VLLM::"):
        return words[0]
    if root:
        return "api_server"
    if any("resource_tracker" in w for w in words):
        return "resource_tracker"
    if not words:
        return "?"
    name = Path(words[0]).name
    if "-m" in words[1:-1]:
        name += " -m " + words[words.index("-m", 1) + 1]
    return name


def name_processes(processes: list[tuple[int, str]], root: int) -> dict[int, str]:
    """pid -> :func:`process_name` for a process tree ((pid, command line) pairs); a name that repeats gets ``#2``,
    ``#3``, ... in pid order (the first keeps it bare)."""
    names: dict[int, str] = {}
    seen: dict[str, int] = {}
    for pid, cmdline in sorted(processes):
        name = process_name(cmdline, root=pid == root)
        seen[name] = seen.get(name, 0) + 1
        names[pid] = name if seen[name] == 1 else f"{name}#{seen[name]}"
    return names


def process_memory(pid: int) -> dict[str, int] | None:
    """``VmRSS`` and ``RssAnon`` (the anonymous part: heap, arenas, tensors) of one process in bytes; None if gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = {"VmRSS:": "rss", "RssAnon:": "rss_anon"}.get(line.split(":", 1)[0] + ":")
            if key:
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        return None
    return out if "rss" in out else None


def server_processes(root: int) -> dict[str, dict]:
    """The server's process tree by name (:func:`name_processes`): pid, command line, RSS and anonymous RSS."""
    found = []
    for pid in _process_tree(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
        except OSError:
            continue
        found.append((pid, cmdline))
    names = name_processes(found, root)
    out = {}
    for pid, cmdline in found:
        memory = process_memory(pid)
        if memory is not None:
            out[names[pid]] = {"pid": pid, "cmdline": cmdline[:200], **memory}
    return out


def _process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


# ---- vLLM's serving benchmark against one server ----


def bench_serve(server: Server, cfg: dict, rate, seed: int) -> dict:
    """One ``vllm bench serve`` run (in this process, vLLM's own code) at ``rate``; its summary."""
    from vllm.benchmarks.serve import add_cli_args, main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # pragma: no cover - older layouts
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        bench_serve_args(
            server.url,
            server.model,
            server.model,
            num_prompts=cfg["num_prompts"],
            input_len=cfg["input_len"],
            output_len=cfg["output_len"],
            range_ratio=cfg["range_ratio"],
            rate=rate,
            seed=seed,
        )
    )
    result = main(args)
    out = bench_fields(result)
    out["itl_tail"] = itl_tail(result.get("start_times") or [], result.get("ttfts") or [], result.get("itls") or [])
    return out


def counter_deltas(before: dict, after: dict) -> dict:
    out = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
    steps = out["rcstat:step_compaction_seconds_count"]
    out["compaction_ms_per_step"] = 1e3 * out["rcstat:step_compaction_seconds_sum"] / steps if steps else 0.0
    out["copies_per_step"] = out["rcstat:compactions_per_step_sum"] / steps if steps else 0.0
    # Copies apart from the runs scoring parked plans ahead of their copy (lazy eviction; kind "score_ahead")
    ahead, ahead_s = (
        out["rcstat:compaction_seconds_count:score_ahead"],
        out["rcstat:compaction_seconds_sum:score_ahead"],
    )
    copies = out["rcstat:compaction_seconds_count"] - ahead
    out["ms_per_copy"] = 1e3 * (out["rcstat:compaction_seconds_sum"] - ahead_s) / copies if copies else 0.0
    out["ms_per_score_ahead"] = 1e3 * ahead_s / ahead if ahead else 0.0
    return out


def selected_settings(asked: list[str] | None) -> list[tuple]:
    """The settings ``--settings`` names, in :data:`SETTINGS`' order; all but the controls when it names none."""
    return [setting for setting in SETTINGS if (setting[0] in asked if asked else setting[0] not in NAMED_ONLY)]


def start_setting(name: str, env: dict, rcstat: dict | None, cfg: dict, model: str, log_dir: Path) -> Server:
    kv_tokens = int(POOL_SCALE.get(name, 1.0) * cfg["pool_requests"] * (cfg["input_len"] + cfg["output_len"]))
    max_model_len = -(-int(cfg["input_len"] * (1 + cfg["range_ratio"]) + cfg["output_len"] + 32) // 128) * 128
    # vLLM refuses a pool that cannot hold one max_model_len request (with its own rounding: a little slack)
    kv_tokens = max(kv_tokens, max_model_len + 2 * BLOCK_SIZE)
    # (every setting alike: vLLM's cap on the tokens one step computes, chunking prefills: the latency trade it offers)
    batched = cfg.get("max_num_batched_tokens")
    extra = ("--max-num-batched-tokens", str(batched)) if batched else ()
    server = Server(server_kwargs(model, rcstat, kv_tokens, max_model_len), env, log_dir / f"{name}.log", extra)
    server.kv_tokens, server.started = kv_tokens, time.monotonic()
    return server


def measure_setting(name: str, server: Server, cfg: dict, round_index: int) -> dict:
    """Every rate of the preset against one warm server; the benchmark's summary and ``/metrics`` deltas per rate."""
    runs = {}
    for rate in cfg["rates"]:
        before = server.metrics()
        t0, load0 = time.monotonic(), load_avg()
        summary = bench_serve(server, cfg, rate, seed=cfg.get("seed", 0))
        after = server.metrics()
        runs[str(rate)] = {
            **summary,
            "metrics": counter_deltas(before, after),
            "gauges_after": {g: after.get(g) for g in GAUGES},
            "wall_s": round(time.monotonic() - t0, 1),
            "load_avg_before": load0,
            "load_avg_after": load_avg(),
        }
        m, tail = runs[str(rate)]["metrics"], summary["itl_tail"]
        print(
            f"[{name} r{round_index}] rate {rate}: {summary['request_throughput']:.3f} req/s, "
            f"{summary['output_throughput']:.1f} tok/s, TTFT p99 {summary['p99_ttft_ms']:.0f} ms, "
            f"ITL p99 {summary['p99_itl_ms']:.0f} ms, preemptions {m['vllm:num_preemptions_total']:.0f}, "
            f"compaction {m['compaction_ms_per_step']:.2f} ms/step, {tail.get('slowest_beside_a_prefill', 0)} of the "
            f"{len(tail.get('slowest', []))} slowest gaps beside a prompt's first token",
            file=sys.stderr,
            flush=True,
        )
    return {"runs": runs, "rss_bytes": server.rss_bytes()}


def warm_up_completion(server: Server) -> None:
    status, reply = server.post(
        "/v1/completions", {"model": server.model, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}
    )
    if status != 200:
        raise RuntimeError(f"warm-up failed: {status} {reply}")


REPORTED = (
    "request_throughput",
    "output_throughput",
    *(f"p{p}_{m}_ms" for m in ("ttft", "itl") for p in PERCENTILES),
    "mean_ttft_ms",
    "mean_itl_ms",
)
REPORTED_METRICS = (
    "vllm:num_preemptions_total",
    "compaction_ms_per_step",
    "copies_per_step",
    "ms_per_copy",
    "ms_per_score_ahead",
    "rcstat:step_compaction_seconds_count",
    "rcstat:requests_compressed_total",
    "rcstat:requests_planned_total",
    "rcstat:requests_never_compacted_total",
    "rcstat:decode_compactions_total",
    "rcstat:kv_blocks_freed_total",
)


def summarise(rounds: list[dict], names: list[str], rates: list[str]) -> dict:
    """Medians over rounds per setting and rate, and each setting's ratio to vanilla's within a round (then the
    median): throughput ratios > 1 and latency ratios < 1 favour the setting."""
    out = {}
    for name in names:
        per_rate = {}
        for rate in rates:
            runs = [r[name]["runs"][rate] for r in rounds if name in r]
            med = {k: statistics.median(run[k] for run in runs) for k in REPORTED}
            med.update({k: statistics.median(run["metrics"][k] for run in runs) for k in REPORTED_METRICS})
            if name != "vanilla":
                ratios = {}
                for k in (
                    "request_throughput",
                    "output_throughput",
                    "p50_ttft_ms",
                    "p99_ttft_ms",
                    "p50_itl_ms",
                    "p99_itl_ms",
                ):
                    vals = [
                        r[name]["runs"][rate][k] / r["vanilla"]["runs"][rate][k]
                        for r in rounds
                        if name in r and "vanilla" in r and r["vanilla"]["runs"][rate][k]
                    ]
                    ratios[k] = statistics.median(vals) if vals else None
                med["vs_vanilla"] = ratios
            per_rate[rate] = med
        out[name] = per_rate
    return out


def plot(summary: dict, rates: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, per_rate in summary.items():
        xs = [per_rate[r]["request_throughput"] for r in rates]
        for ax, key in zip(axes, ("p99_ttft_ms", "p99_itl_ms")):
            ax.plot(xs, [per_rate[r][key] for r in rates], marker="o", label=name)
    for ax, label in zip(axes, ("TTFT p99 (ms)", "ITL p99 (ms)")):
        ax.set_xlabel("request throughput (req/s; points: request rates " + ", ".join(rates) + ")")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(report: dict) -> None:
    for name, per_rate in report["summary"].items():
        for rate, row in per_rate.items():
            ratio = row.get("vs_vanilla") or {}
            extra = (
                ""
                if not ratio
                else (
                    f"  vs vanilla: req/s x{ratio['request_throughput']:.3f}, TTFT p99 "
                    f"x{ratio['p99_ttft_ms']:.3f}, ITL p99 x{ratio['p99_itl_ms']:.3f}"
                )
            )
            print(
                f"{name:15s} rate {rate:>4s}: {row['request_throughput']:.3f} req/s {row['output_throughput']:7.1f} "
                f"tok/s TTFT p50/p90/p99 {row['p50_ttft_ms']:.0f}/{row['p90_ttft_ms']:.0f}/{row['p99_ttft_ms']:.0f} "
                f"ITL p50/p90/p99 {row['p50_itl_ms']:.0f}/{row['p90_itl_ms']:.0f}/{row['p99_itl_ms']:.0f} ms "
                f"preempt {row['vllm:num_preemptions_total']:.0f} compaction {row['compaction_ms_per_step']:.2f} "
                f"ms/step{extra}"
            )


def serving_benchmark(args) -> int:
    preset = "quick" if args.quick else "default"
    cfg = dict(PRESETS[preset])
    if args.rounds is not None:
        cfg["rounds"] = args.rounds
    if args.num_prompts is not None:
        cfg["num_prompts"] = args.num_prompts
    if args.max_num_batched_tokens is not None:
        cfg["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.rates:
        cfg["rates"] = tuple(r if r == "inf" or r.endswith("x") else float(r) for r in args.rates)
    from rcstat_vllm.model import default_model_dir

    model = str(args.model or default_model_dir())
    settings = [
        (
            n,
            e,
            dict(r, decode_budget=cfg["decode_budget"], decode_interval=cfg["decode_interval"])
            if r is not None and "decode_budget" in r
            else r,
        )
        for n, e, r in selected_settings(args.settings)
    ]
    names = [n for n, _, _ in settings]
    requested_rates = list(cfg["rates"])
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rounds, servers, startup, probe = [], {}, {}, None
    suffix = "_quick" if args.quick else ""
    path = Path(args.json) if args.json else RESULTS_DIR / f"serving_cpu{suffix}.json"

    def write(final: bool) -> None:
        """The report so far: rewritten after every round (a run cut short keeps its complete rounds)."""
        rates = [str(r) for r in cfg["rates"]]
        summary = summarise(rounds, names, rates)
        report = {
            "benchmark": "serving",
            "preset": preset,
            "complete": final,
            "workload": {k: v for k, v in cfg.items()} | {"rates": rates, "rates_requested": requested_rates},
            "saturation_probe": probe,
            "settings": {
                n: {"env": e, "rcstat": r, "resolved": None if r is None else resolved_config(r)}
                for n, e, r in settings
            },
            "summary": summary,
            "rounds": rounds,
            "startup_s": startup,
            "wall_s": round(time.monotonic() - t0, 1),
            "servers": {
                n: {"kv_tokens": s.kv_tokens, **{k: v for k, v in s.kwargs.items() if k != "model"}}
                for n, s in servers.items()
            },
            "environment": environment(),
            "note": "medians over rounds; vs_vanilla: ratio within a round, then median",
        }
        write_report(report, path, print_table)
        env = report["environment"]
        title = (
            f"vllm bench serve, random {cfg['input_len']}+{cfg['output_len']} tok, pool = {cfg['pool_requests']} "
            f"of {cfg['num_prompts']} requests, {len(rounds)} rounds; {env['machine'].get('cpu')} x{env['cores']}, "
            f"commit {(env['git'].get('commit') or '')[:10]}"
        )
        plot(summary, rates, path.with_suffix(".png"), title)
        print(f"wrote {path.with_suffix('.png')}", file=sys.stderr)

    try:
        # Every setting's server starts once, all at once (each engine runs on the core vLLM binds it to, idle while
        # another is measured), then warms up; rounds run every setting in an order rotated by one per round.
        for name, env, rcstat in settings:
            servers[name] = start_setting(name, env, rcstat, cfg, model, log_dir)
        for name, server in servers.items():
            server.wait_healthy()
            startup[name] = round(time.monotonic() - server.started, 1)
            warm_up_completion(server)
        if any(str(r).endswith("x") for r in cfg["rates"]):
            probe = bench_serve(servers["vanilla"], cfg, "inf", seed=1)
            saturation = probe["request_throughput"]
            cfg["rates"] = tuple(
                r if not str(r).endswith("x") else round(float(r[:-1]) * saturation, 3) for r in cfg["rates"]
            )
            print(f"vanilla saturates at {saturation:.3f} req/s: rates {cfg['rates']}", file=sys.stderr, flush=True)
        for i in range(cfg["rounds"]):
            order = names[i % len(names) :] + names[: i % len(names)]
            rounds.append({name: measure_setting(name, servers[name], cfg, i) for name in order})
            rounds[-1]["order"] = order
            write(final=i == cfg["rounds"] - 1)
    finally:
        for server in servers.values():
            server.close()
    return 0


# ---- the HTTP soak ----

#: ``--soak`` without MINUTES
SOAK_MINUTES = 45.0
SOAK_PREFIXES = 3
#: the clients' mix, one kind per request in turn (every kind within the first 20 requests): 10% disconnecting
#: mid-stream, 5% invalid overrides, 10% n = 2, 5% attribution, 10% method none (greedy), 30% streaming, 30% plain
SOAK_KINDS = (
    "plain",
    "stream",
    "disconnect",
    "none_greedy",
    "n2",
    "plain",
    "stream",
    "invalid",
    "plain",
    "stream",
    "attribution",
    "plain",
    "stream",
    "disconnect",
    "none_greedy",
    "n2",
    "plain",
    "stream",
    "plain",
    "stream",
)
INVALID_OVERRIDES = (("method", {"method": "bogus"}), ("window", {"window": 0}), ("budget", {"budget": 3}))


def soak_server_kwargs(model: str, rcstat: dict | None) -> dict:
    """The soak's server: float32 (method none is compared token for token with a vanilla server), a pool of 1280
    tokens: about two of its longest requests (~440 prompt + 160 output tokens) of the six running at once, so lazy
    eviction, decode-time compaction and preemption run under pressure."""
    return server_kwargs(model, rcstat, kv_tokens=1280, max_model_len=1024, dtype="float32")


SOAK_RCSTAT = {"decode_budget": 32, "decode_interval": 32}  # compacts at 64 generated tokens (outputs of 64, 160)
ATTRIBUTION_ARGS = ("--logits-processors", "rcstat_vllm.attribution.processor:RCStatAttributionProcessor")


class SoakClients:
    """Bounded concurrent clients (threads, httpx) over one server, until ``duration_s`` has passed; one record per
    request: its kind, HTTP status, what came back (complete, cancelled by the client), and for method ``none``
    greedy requests the token ids (replayed later on a vanilla server)."""

    def __init__(self, server: Server, concurrency: int = 6, seed: int = 0):
        from rcstat_vllm.demo import ESSAY

        self.server, self.concurrency, self.rng = server, concurrency, random.Random(seed)
        words = ESSAY.split()
        self.prefixes = [" ".join(words[:n]) for n in (40, 160, 320)][:SOAK_PREFIXES]
        self.records: list[dict] = []
        self._lock = threading.Lock()
        self._count = 0

    def next_request(self) -> dict:
        with self._lock:
            i = self._count
            self._count += 1
            rng = random.Random(self.rng.random())
        prefix = rng.choice(self.prefixes)
        prompt = f"{prefix}\n(#{i}) Question {rng.randint(0, 10_000)}: what happened next?\nAnswer:"
        max_tokens = rng.choice([4, 8, 16, 32, 64, 160])
        kind = SOAK_KINDS[i % len(SOAK_KINDS)]
        body = {"model": self.server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        req = {"i": i, "kind": kind, "path": "/v1/completions", "body": body, "stream": False}
        if kind in ("stream", "disconnect"):
            req["stream"] = True
            body["stream"] = True
            if rng.random() < 0.5:  # half of them as chats
                req["path"] = "/v1/chat/completions"
                body.pop("prompt")
                body["messages"] = [{"role": "user", "content": prompt}]
        elif kind == "invalid":
            field, override = INVALID_OVERRIDES[i % len(INVALID_OVERRIDES)]
            body["vllm_xargs"] = {"rcstat": json.dumps(override)}
            req["field"] = field
        elif kind == "n2":
            body.update(n=2, temperature=0.8, seed=i)
        elif kind == "attribution":
            req["path"] = "/v1/chat/completions"
            body.pop("prompt")
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_tokens"] = min(max_tokens, 32)
            body["vllm_xargs"] = {"rcstat_attribution": "1"}
        elif kind == "none_greedy":
            body["max_tokens"] = min(max_tokens, 24)
            body["vllm_xargs"] = {"rcstat": json.dumps({"method": "none"})}
            body["return_token_ids"] = True
        return req

    def send(self, client, req: dict) -> dict:
        rec = {"i": req["i"], "kind": req["kind"], "status": None, "outcome": None}
        if "field" in req:
            rec["field"] = req["field"]
        url = self.server.url + req["path"]
        try:
            if req["stream"]:
                with client.stream("POST", url, json=req["body"]) as resp:
                    rec["status"] = resp.status_code
                    if resp.status_code != 200:
                        rec["error"] = resp.read().decode(errors="replace")[:500]
                        rec["outcome"] = "error"
                        return rec
                    chunks, finish = 0, None
                    for line in resp.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: ") :]
                        if data == "[DONE]":
                            rec["outcome"] = "completed" if finish else "no_finish_reason"
                            break
                        chunks += 1
                        for choice in json.loads(data).get("choices", []):
                            finish = choice.get("finish_reason") or finish
                        if req["kind"] == "disconnect" and chunks >= 2:
                            rec["outcome"] = "cancelled"  # the client goes away mid-stream
                            break
                    else:
                        rec["outcome"] = rec["outcome"] or "truncated"
                    rec["chunks"] = chunks
            else:
                resp = client.post(url, json=req["body"])
                rec["status"] = resp.status_code
                reply = resp.json() if resp.content else {}
                if resp.status_code != 200:
                    rec["error"] = json.dumps(reply)[:500]
                    rec["outcome"] = "error"
                    return rec
                choices = reply.get("choices", [])
                rec["outcome"] = (
                    "completed" if choices and all(c.get("finish_reason") for c in choices) else "incomplete"
                )
                rec["choices"] = len(choices)
                if req["kind"] == "attribution":
                    rec["attribution"] = "rcstat_attribution" in reply
                if req["kind"] == "none_greedy":
                    rec["prompt"] = req["body"]["prompt"]
                    rec["max_tokens"] = req["body"]["max_tokens"]
                    rec["token_ids"] = choices[0].get("token_ids") if choices else None
        except Exception as exc:  # noqa: BLE001 - a transport error is a finding, recorded
            rec["outcome"] = "transport_error"
            rec["error"] = repr(exc)[:500]
        return rec

    def run(self, duration_s: float, on_progress=None) -> list[dict]:
        import httpx

        deadline = time.monotonic() + duration_s

        def worker():
            with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
                while time.monotonic() < deadline:
                    rec = self.send(client, self.next_request())
                    with self._lock:
                        self.records.append(rec)
                    if on_progress is not None:
                        on_progress(len(self.records))

        with ThreadPoolExecutor(self.concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(self.concurrency)]:
                future.result()
        return self.records


def wait_idle(server: Server, timeout: float = 120) -> dict:
    """Poll ``/metrics`` until no request runs or waits (a cancelled stream is aborted within a step or two)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (
            m.get("vllm:num_requests_running", 1) == 0
            and m.get("vllm:num_requests_waiting", 1) == 0
            and m.get("rcstat:worker_requests", 0) == 0
            and m.get("rcstat:scheduler_requests", 0) == 0
        ) or time.monotonic() > deadline:
            return m
        time.sleep(1)


def replay_none(vanilla: Server, records: list[dict]) -> list[dict]:
    """The method-none greedy requests sent again to a vanilla server (plugin not loaded); mismatches listed."""
    mismatches = []
    for rec in records:
        if rec["kind"] != "none_greedy" or rec.get("outcome") != "completed":
            continue
        status, reply = vanilla.post(
            "/v1/completions",
            {
                "model": vanilla.model,
                "prompt": rec["prompt"],
                "max_tokens": rec["max_tokens"],
                "temperature": 0.0,
                "return_token_ids": True,
            },
        )
        want = reply["choices"][0].get("token_ids") if status == 200 else None
        if want != rec["token_ids"]:
            mismatches.append({"i": rec["i"], "status": status, "plugin": rec["token_ids"], "vanilla": want})
    return mismatches


def soak_checks(
    records: list[dict], final: dict, rss: list[tuple[int, int]], mismatches: list[dict], rss_tolerance: float
) -> dict:
    """What the soak asserts, as data: every failure listed (an empty ``failures`` list passes)."""
    failures = []
    by_kind: dict[str, int] = {}
    for rec in records:
        by_kind[rec["kind"]] = by_kind.get(rec["kind"], 0) + 1
        status = rec["status"]
        if status is not None and status >= 500:
            failures.append(f"request {rec['i']} ({rec['kind']}): HTTP {status} {rec.get('error', '')[:200]}")
        elif rec["outcome"] == "transport_error":
            failures.append(f"request {rec['i']} ({rec['kind']}): {rec['error'][:200]}")
        elif rec["kind"] == "invalid":
            if status != 400 or f"'{rec['field']}'" not in rec.get("error", ""):
                failures.append(
                    f"request {rec['i']}: invalid override {rec['field']!r} got {status}, {rec.get('error', '')[:200]}"
                )
        elif rec["kind"] == "disconnect":
            if rec["outcome"] not in ("cancelled", "completed"):
                failures.append(f"request {rec['i']} (disconnect): {rec['outcome']}")
        elif rec["outcome"] != "completed":
            failures.append(f"request {rec['i']} ({rec['kind']}): {rec['outcome']} {rec.get('error', '')[:200]}")
        elif rec["kind"] == "n2" and rec.get("choices") != 2:
            failures.append(f"request {rec['i']} (n=2): {rec.get('choices')} choices")
        elif rec["kind"] == "attribution" and not rec.get("attribution"):
            failures.append(f"request {rec['i']} (attribution): no rcstat_attribution in the reply")
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "rcstat:worker_requests",
        "rcstat:scheduler_requests",
    ):
        if final.get(gauge, 0.0) != 0.0:
            failures.append(f"at the end {gauge} = {final.get(gauge)} (expected 0)")
    for gauge in ("rcstat:worker_requests", "rcstat:scheduler_requests"):
        if gauge not in final:
            failures.append(f"{gauge} missing from /metrics")
    growth = None
    if len(rss) >= 2:
        after_warmup, last = rss[0][1], rss[-1][1]
        growth = (last - after_warmup) / after_warmup
        if growth > rss_tolerance:
            failures.append(
                f"server RSS grew {growth:.1%} after warm-up ({after_warmup >> 20} -> {last >> 20} MiB; "
                f"tolerance {rss_tolerance:.0%})"
            )
    if mismatches:
        failures.append(f"{len(mismatches)} method-none requests differ from vanilla: {mismatches[:2]}")
    completed_none = sum(1 for r in records if r["kind"] == "none_greedy" and r["outcome"] == "completed")
    return {
        "requests": len(records),
        "by_kind": by_kind,
        "none_compared": completed_none,
        "rss_mib": [(n, b >> 20) for n, b in rss],
        "rss_growth": growth,
        "failures": failures,
        "final_gauges": {g: final.get(g) for g in GAUGES},
        "final_counters": {c: final.get(c) for c in COUNTERS},
    }


#: The soak's warm-up: 40% of the run (every kind of request and the largest batches have run by then), at most 10
#: minutes. The server tree's RSS is checked from its end (``rss_tolerance``); the per-minute samples after it give
#: each process's slope (:func:`rss_slope`).
SOAK_WARMUP_MAX_S = 600.0
SOAK_SAMPLE_S = 60.0
#: the target for each process's RSS after warm-up: a least-squares slope below this, in percent per 10 minutes
RSS_SLOPE_TARGET = 1.0
#: the plugin's tables exported on ``/metrics`` (read once per sample), and those that are not (named in the results)
TABLE_SERIES = ("rcstat:worker_requests", "rcstat:worker_results", "rcstat:scheduler_requests")
TABLES_NOT_EXPORTED = {
    "scheduler: EngineRequests._compacted_blocks": "block ids of compacted requests' kept KV (their requests are in "
    "rcstat:scheduler_requests); no gauge",
    "worker: AttributionCapture.traces (rcstat_vllm/attribution/capture.py)": "attribution traces, popped when the "
    "server reads the result; capped at 256 traces / 1 GiB; no gauge",
    "worker: RCStatAttributionProcessor.asking": "batch index -> setting of rows that asked for attribution; no gauge",
}


def soak_warmup_s(duration_s: float) -> float:
    return min(0.4 * duration_s, SOAK_WARMUP_MAX_S)


def soak_sample_times(duration_s: float, warmup_s: float, every_s: float = SOAK_SAMPLE_S) -> list[float]:
    """When the soak samples each process's RSS and the plugin's tables (seconds from the clients' start): every
    ``every_s`` during the warm-up, at its end, then every ``every_s`` after it until ``duration_s``."""
    times = [every_s * k for k in range(1, int(warmup_s // every_s) + 1) if every_s * k < warmup_s]
    t = warmup_s
    while t <= duration_s + 1e-9:
        times.append(round(t, 3))
        t += every_s
    return times


def rss_slope(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of ``(seconds, bytes)`` samples, in percent of the first sample's bytes per 10 minutes
    (rounded to 4 decimals); None with fewer than two samples or no spread in time."""
    if len(samples) < 2 or not samples[0][1]:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in samples)
    if sxx == 0:
        return None
    per_s = sum((t - mean_t) * (y - mean_y) for t, y in samples) / sxx
    return round(per_s * 600 / samples[0][1] * 100, 4)


def memory_summary(samples: list[dict], end: dict | None, target: float = RSS_SLOPE_TARGET) -> dict:
    """Per process, from the per-minute samples (``{"t_s", "warm", "processes": {name: {"rss", "rss_anon"}}}``):
    RSS at the warm-up's end (the first warm sample), at the end (``end``, sampled once the server is idle; else
    the last sample), the growth between them, and the least-squares slopes (RSS and anonymous RSS) over the warm
    samples in percent per 10 minutes; ``holds``: every process's RSS slope below ``target``."""
    warm = [s for s in samples if s["warm"]]
    names = list(dict.fromkeys(name for s in samples for name in s["processes"]))
    out: dict = {"target_pct_per_10min": target, "warm_samples": len(warm), "processes": {}}
    last = end or (samples[-1] if samples else None)
    for name in names:
        series = [(s["t_s"], s["processes"][name]) for s in warm if name in s["processes"]]
        if not series:
            continue
        start, final = series[0][1], (last or {}).get("processes", {}).get(name, series[-1][1])
        slope = rss_slope([(t, m["rss"]) for t, m in series])
        out["processes"][name] = {
            "rss_mib_warm": round(start["rss"] / 2**20, 1),
            "rss_mib_end": round(final["rss"] / 2**20, 1),
            "growth_pct": round((final["rss"] - start["rss"]) / start["rss"] * 100, 2),
            "slope_pct_per_10min": slope,
            "anon_mib_warm": round(start.get("rss_anon", 0) / 2**20, 1),
            "anon_mib_end": round(final.get("rss_anon", 0) / 2**20, 1),
            "anon_slope_pct_per_10min": rss_slope([(t, m["rss_anon"]) for t, m in series if m.get("rss_anon")]),
            "samples": len(series),
        }
    slopes = [p["slope_pct_per_10min"] for p in out["processes"].values()]
    out["holds"] = bool(slopes) and all(v is not None and v < target for v in slopes)
    out["over_target"] = [
        n
        for n, p in out["processes"].items()
        if p["slope_pct_per_10min"] is not None and p["slope_pct_per_10min"] >= target
    ]
    return out


def soak(
    duration_s: float, log_dir: Path, model: str | None = None, concurrency: int = 6, rss_tolerance: float = 0.08
) -> dict:
    """The HTTP soak: a vanilla server and the plugin's (bare flag + decode_budget) start together; clients run
    against the plugin's for ``duration_s``; then the checks. The server tree's RSS is sampled once warm
    (:func:`soak_warmup_s`: every kind of request and the largest batches have run by then) and every 10 s after;
    a sampler thread records each process's RSS and the plugin's exported tables (:data:`TABLE_SERIES`) with the
    counters at :func:`soak_sample_times` (per minute), and once more when the server is idle at the end."""
    from rcstat_vllm.model import default_model_dir

    model = str(model or default_model_dir())
    log_dir.mkdir(parents=True, exist_ok=True)
    plugin = Server(soak_server_kwargs(model, SOAK_RCSTAT), {}, log_dir / "soak_plugin.log", ATTRIBUTION_ARGS)
    vanilla = Server(soak_server_kwargs(model, None), {"VLLM_PLUGINS": "__none__"}, log_dir / "soak_vanilla.log")
    try:
        plugin.wait_healthy()
        clients = SoakClients(plugin, concurrency)
        rss: list[tuple[int, int]] = []
        warmup_s = soak_warmup_s(duration_s)
        samples: list[dict] = []
        stop = threading.Event()
        start = time.monotonic()
        next_sample = [start + warmup_s]

        def progress(n):
            if time.monotonic() >= next_sample[0]:
                next_sample[0] = time.monotonic() + 10
                with clients._lock:
                    rss.append((n, plugin.rss_bytes()))

        def sample(t_s: float, warm: bool) -> dict:
            processes = server_processes(plugin.proc.pid)
            try:
                metrics = plugin.metrics()
            except Exception as exc:  # noqa: BLE001 - a sample without metrics says why
                metrics = {"error": repr(exc)[:200]}
            with clients._lock:
                kinds: dict[str, int] = {}
                for rec in clients.records:
                    kinds[rec["kind"]] = kinds.get(rec["kind"], 0) + 1
                n = len(clients.records)
            return {
                "t_s": round(t_s, 1),
                "warm": warm,
                "requests": n,
                "by_kind": kinds,
                "processes": {
                    name: {"rss": p["rss"], "rss_anon": p.get("rss_anon", 0)} for name, p in processes.items()
                },
                "tables": {k: metrics.get(k) for k in TABLE_SERIES},
                "gauges": {k: metrics.get(k) for k in GAUGES},
                "counters": {k: metrics.get(k) for k in COUNTERS},
                **({"metrics_error": metrics["error"]} if "error" in metrics else {}),
            }

        def sampler():
            for t in soak_sample_times(duration_s, warmup_s):
                if stop.wait(max(0.0, start + t - time.monotonic())):
                    return
                samples.append(sample(t, t >= warmup_s))
                print(
                    f"[soak] {t / 60:.1f} min: "
                    + ", ".join(f"{name} {p['rss'] >> 20} MiB" for name, p in samples[-1]["processes"].items())
                    + f"; {samples[-1]['requests']} requests; tables {samples[-1]['tables']}",
                    file=sys.stderr,
                    flush=True,
                )

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        try:
            records = clients.run(duration_s, progress)
        finally:
            stop.set()
            thread.join()
        final = wait_idle(plugin)
        rss.append((len(records), plugin.rss_bytes()))
        end_sample = sample(time.monotonic() - start, True)
        processes = {
            name: {"pid": p["pid"], "cmdline": p["cmdline"]} for name, p in server_processes(plugin.proc.pid).items()
        }
        vanilla.wait_healthy()
        mismatches = replay_none(vanilla, records)
        checks = soak_checks(records, final, rss, mismatches, rss_tolerance)
        checks["duration_s"] = round(time.monotonic() - start, 1)
        checks["warmup_s"] = warmup_s
        checks["memory"] = memory_summary(samples, end_sample)
        checks["memory"]["process_cmdlines"] = processes
        checks["tables_not_exported"] = TABLES_NOT_EXPORTED
        checks["samples"] = [
            {
                **s,
                "processes": {
                    name: {"rss_mib": round(m["rss"] / 2**20, 1), "anon_mib": round(m["rss_anon"] / 2**20, 1)}
                    for name, m in s["processes"].items()
                },
            }
            for s in [*samples, {**end_sample, "end": True}]
        ]
        checks["plugin_log_tail"] = plugin.log_tail(3000) if checks["failures"] else ""
        return checks
    finally:
        plugin.close()
        vanilla.close()


def soak_benchmark(args) -> int:
    t0 = time.monotonic()
    checks = soak(args.soak * 60, Path(args.log_dir), args.model, args.concurrency)
    path = Path(args.json) if args.json else RESULTS_DIR / "serving_soak_cpu.json"
    report = {
        "benchmark": "serving_soak",
        "minutes": args.soak,
        "concurrency": args.concurrency,
        "rcstat": SOAK_RCSTAT,
        "checks": checks,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    write_report(
        report,
        path,
        lambda r: print(
            json.dumps({k: v for k, v in r["checks"].items() if k not in ("plugin_log_tail", "samples")}, indent=1)
        ),
    )
    return 0 if not checks["failures"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round at saturation (~4 min)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: the preset's)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default: the preset's)")
    parser.add_argument(
        "--rates",
        nargs="*",
        default=None,
        help="request rates: req/s, 'inf' (all at once) or '<f>x' (f x vanilla's saturation)",
    )
    parser.add_argument(
        "--settings", nargs="*", default=None, help="a subset of: " + ", ".join(n for n, _, _ in SETTINGS)
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vLLM's cap on the tokens one step computes, for every server (default: vLLM's, 2048 served on a CPU); "
        "lower chunks prefills into shorter steps, the inter-token latency a decoding request waits behind them",
    )
    parser.add_argument(
        "--soak",
        type=float,
        nargs="?",
        const=SOAK_MINUTES,
        default=None,
        metavar="MINUTES",
        help=f"run the HTTP soak for MINUTES instead (default {SOAK_MINUTES:g}: the documented run)",
    )
    parser.add_argument("--concurrency", type=int, default=6, help="soak clients at once")
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", default="/tmp/rcstat-serving-logs")
    args = parser.parse_args(argv)
    if args.settings and "vanilla" not in args.settings:
        args.settings = ["vanilla", *args.settings]
    return soak_benchmark(args) if args.soak is not None else serving_benchmark(args)


if __name__ == "__main__":
    raise SystemExit(main())
