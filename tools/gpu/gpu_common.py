"""What the GPU checks share: where results go, the machine's description, the dummy Llama-3.1-8B model, engine
arguments, running one engine per subprocess, and turning any failure into JSON instead of a crash.

Stdlib only at import time: the checks import this before they know whether torch or vLLM import at all.

Results: every check writes one JSON file into ``$RCSTAT_RESULTS`` (default ``/tmp/rcstat-results``, kept while the
device machine is held) and copies it into ``$OUT`` (the folder a device call sends back, emptied before each call).
Logs of engine subprocesses go to ``$RCSTAT_RESULTS/logs/``; ``run_on_gpu.sh`` packs them into ``$OUT/logs.tar.gz``.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("RCSTAT_RESULTS", "/tmp/rcstat-results"))
LOGS = RESULTS / "logs"

#: Llama-3.1-8B's config.json (shapes only: the weights are vLLM's dummy initialisation).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

#: The settings compared (name -> (extra environment, rcstat section or None = flag absent)).
#: ``vanilla``: the plugin is not even loaded (VLLM_PLUGINS names no plugin); ``noflag``: loaded, flag absent.
SETTINGS = {
    "vanilla": ({"VLLM_PLUGINS": "__none__"}, None),
    # vanilla with what the plugin changes at vLLM's defaults, isolated: async scheduling off, PIECEWISE graphs
    # (ENGINE_EXTRA; only with graphs: eager has neither)
    "vanilla-piecewise": ({"VLLM_PLUGINS": "__none__"}, None),
    "noflag": ({}, None),
    "bare": ({}, {}),
    "none": ({}, {"method": "none"}),
    "rc0.8": ({}, {"method": "rc", "target_ratio": 0.8}),
    "tova0.8": ({}, {"method": "tova", "target_ratio": 0.8}),
    "snapkv0.8": ({}, {"method": "snapkv", "target_ratio": 0.8}),
    # vLLM's asynchronous scheduling kept (issue 53: measured against "bare", which turns it off)
    "bare-async": ({}, {"async_scheduling": "keep"}),
    "rc0.8-async": ({}, {"method": "rc", "target_ratio": 0.8, "async_scheduling": "keep"}),
    # full CUDA graphs for single-token decode steps (issue 53: measured against "rc0.8" and "none", piecewise)
    "rc0.8-graphs": ({}, {"method": "rc", "target_ratio": 0.8, "cuda_graphs": "full_decode"}),
    "none-graphs": ({}, {"method": "none", "cuda_graphs": "full_decode"}),
}

#: Engine arguments a setting adds to ``engine_kwargs`` (with graphs only).
ENGINE_EXTRA = {
    "vanilla-piecewise": {"async_scheduling": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
}

#: Offline, quiet, reproducible: set in every engine subprocess.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # FlashInfer is not carried: vLLM's sampler imports it unless this is 0 (it then samples natively)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}

#: Engine subprocesses run here, not in the repository: vLLM's model inspection runs ``python -m`` in the engine's
#: working directory, which puts that directory first on ``sys.path``; in the repository root it finds the source
#: tree's ``rcstat_vllm`` (without ``patches``/``kernels``, which only the installed plugin maps into it) before the
#: installed plugin, and the plugin's registration fails there (first H200 run: "No module named
#: 'rcstat_vllm.patches'", then "LlamaForCausalLM failed to be inspected").
ENGINE_CWD = RESULTS


def kv_bytes_per_token(config: dict = LLAMA_31_8B, dtype_bytes: int = 2) -> int:
    """K and V of every layer and KV head for one token."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def dummy_model_dir(config: dict = LLAMA_31_8B, name: str = "llama-3.1-8b-shape") -> Path:
    """A model folder with only config.json (vLLM's ``load_format="dummy"`` makes the weights)."""
    folder = Path(os.environ.get("RCSTAT_MODEL_ROOT", "/tmp/rcstat-models")) / name
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=1)
    path = folder / "config.json"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return folder


def engine_kwargs(
    model_dir: Path | str,
    rcstat: dict | None,
    *,
    eager: bool = True,
    max_model_len: int = 8192,
    kv_bytes: int = 4 << 30,
    block_size: int | None = None,
    **extra,
) -> dict:
    """``LLM(...)`` arguments for the dummy-weight model: bf16, no tokenizer (token ids as prompts), no prefix caching,
    a KV pool of exactly ``kv_bytes``; ``eager`` = no CUDA graphs and no torch.compile, else vLLM's defaults."""
    kwargs = dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        kv_cache_memory_bytes=int(kv_bytes),
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=True,
    )
    if eager:
        kwargs.update(enforce_eager=True, compilation_config={"mode": 0})
    if block_size:
        kwargs["block_size"] = block_size
    if rcstat is not None:
        kwargs["additional_config"] = {"rcstat": rcstat}
    kwargs.update(extra)
    return kwargs


def random_prompts(
    n: int, min_len: int, max_len: int, seed: int, vocab: int = 128000, low: int = 1000
) -> list[list[int]]:
    """``n`` prompts of uniform random length in [min_len, max_len], uniform random token ids in [low, vocab)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(low, vocab) for _ in range(length)])
    return prompts


def environment() -> dict:
    """The machine and library versions; never raises."""
    env = {
        "python": platform.python_version(),
        "host": platform.node(),
        "machine": platform.machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": os.environ.get("RCSTAT_COMMIT") or git_head(),
        "carry_manifest_sha256": manifest_sha(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["device"] = torch.cuda.get_device_name(0)
            env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
            env["capability"] = f"{props.major}.{props.minor}"
            env["multiprocessors"] = props.multi_processor_count
        else:
            env["device"] = "no CUDA device visible to torch"
    except Exception as exc:  # noqa: BLE001 - recorded
        env["torch_error"] = repr(exc)
    for name in ("triton", "transformers", "vllm"):
        try:
            import importlib.metadata as metadata

            env[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 - absent
            env[name] = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        env["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except Exception as exc:  # noqa: BLE001
        env["nvidia_smi"] = repr(exc)
    return env


def git_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - the copy on the device machine may have no .git
        return None


def manifest_sha() -> str | None:
    path = Path(os.environ.get("RCSTAT_CARRY_DIR", "/tmp/rcstat-carry")) / "manifest.json"
    try:
        import hashlib

        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def failure(exc: BaseException) -> dict:
    """A JSON-able description of an exception; names the missing module of an import failure."""
    info = {
        "ok": False,
        "error_type": type(exc).__name__,
        "error": str(exc)[:2000],
        "traceback_tail": traceback.format_exc()[-4000:],
    }
    if isinstance(exc, ModuleNotFoundError):
        info["missing_module"] = exc.name
    elif isinstance(exc, ImportError):
        info["import_error"] = {"name": getattr(exc, "name", None), "path": getattr(exc, "path", None)}
    return info


def write_result(name: str, result: dict) -> Path:
    """Write ``name``.json into the results folder and into $OUT (when set); returns the results path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1, default=str)
    path = RESULTS / f"{name}.json"
    path.write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(out) / f"{name}.json")
    print(f"[{name}] wrote {path}" + (f" and $OUT/{name}.json" if out else ""), file=sys.stderr, flush=True)
    return path


def read_result(name: str) -> dict | None:
    try:
        return json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def run_worker(script: Path, spec: dict, env_extra: dict, log_name: str, timeout_s: float) -> dict:
    """Run ``script --worker SPEC`` in a fresh Python (one engine per process); its last ``RESULT {json}`` line is
    the result. stdout and stderr go to ``logs/<log_name>.log``; a failure returns the log's tail."""
    if os.environ.get("RCSTAT_DRY_RUN"):  # tools/gpu/window.sh dry: no CUDA here, so no engine; say so
        return {
            "ok": False,
            "dry_run": True,
            "error": "dry run: no engine started (it needs CUDA)",
            "process_wall_s": 0.0,
            "spec": spec,
            "env_extra": env_extra,
            "timeout_s": timeout_s,
        }
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{log_name}.log"
    env = dict(os.environ)
    env.update(BASE_ENV)
    env.update(env_extra)
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s, cwd=str(ENGINE_CWD)
            )
            stdout, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            code = "timeout"
    wall = time.perf_counter() - t0
    with open(log_path, "a") as log:
        log.write("\n--- stdout ---\n" + stdout)
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result.setdefault("process_wall_s", wall)
            return result
    return {
        "ok": False,
        "error": f"worker exited with {code} after {wall:.0f} s",
        "process_wall_s": wall,
        "log": str(log_path),
        "log_tail": tail(log_path, 80),
    }


def worker_main(fn) -> int:
    """Body of ``--worker``: run ``fn(spec)``, print its result (or the failure) as the ``RESULT`` line."""
    spec = json.loads(sys.argv[sys.argv.index("--worker") + 1])
    try:
        result = fn(spec)
    except BaseException as exc:  # noqa: BLE001 - reported as JSON, then a non-zero exit
        traceback.print_exc()
        print("RESULT " + json.dumps(failure(exc), default=str), flush=True)
        return 1
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0


def run_main(main, name: str, *, worker: bool = True) -> None:
    """A check's ``if __name__ == "__main__"``: exit with ``main()``'s code. Whatever else ends it (an exception, a
    non-zero ``SystemExit`` such as argparse's) first writes ``name``.json saying what, then goes on up unchanged.
    ``worker``: the script has a ``--worker`` mode; a ``--worker`` process writes no JSON of its own (``run_worker``,
    in the parent, reads its ``RESULT`` line or reports its exit)."""
    try:
        code = main()
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        if worker and "--worker" in sys.argv:
            raise
        write_result(name, {"check": name, **failure(exc)})
        raise
    sys.exit(code)


def engine_core(llm):
    """The in-process engine core of an ``LLM`` (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


def engine_facts(llm) -> dict:
    """What vLLM chose: blocks, block size, runner and attention backend classes, CUDA-graph mode. Never raises."""
    facts = {}
    try:
        config = llm.llm_engine.vllm_config
        facts["num_gpu_blocks"] = config.cache_config.num_gpu_blocks
        facts["block_size"] = config.cache_config.block_size
        facts["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)
        facts["compilation_mode"] = str(config.compilation_config.mode)
        facts["additional_config"] = config.additional_config
    except Exception as exc:  # noqa: BLE001
        facts["config_error"] = repr(exc)
    try:
        core = engine_core(llm)
        facts["free_blocks"] = core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        worker = core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        runner = worker.model_runner
        facts["worker_class"] = f"{type(worker).__module__}.{type(worker).__qualname__}"
        facts["model_runner_class"] = f"{type(runner).__module__}.{type(runner).__qualname__}"
        backends = set()
        for groups in getattr(runner, "attn_groups", []) or []:
            for group in groups:
                backends.add(f"{group.backend.__module__}.{group.backend.__qualname__}")
        facts["attention_backends"] = sorted(backends)
    except Exception as exc:  # noqa: BLE001
        facts["runner_error"] = repr(exc)
    return facts
