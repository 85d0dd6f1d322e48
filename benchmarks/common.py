"""What every benchmark records beside its numbers: the machine, its load, and where the JSON went."""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable


def load_avg() -> float | None:
    """The 1-minute load average: a benchmark on a shared 2-core machine is only as good as its quiet."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def environment(**extra) -> dict:
    """Device, CPU model, cores and the versions of the libraries that shape the numbers."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = {"device": "cpu", "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        from rcstat_vllm.model import embedded_model_dtype

        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        # The dtype the benchmark engines ran the embedded model in (None: the model's own bf16).
        env["engine_dtype"] = embedded_model_dtype() or "bfloat16"
    except Exception:  # noqa: BLE001 - recorded where available
        pass
    for name in ("torch", "transformers", "vllm"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001 - a missing library is simply not recorded
            pass
    return {**env, **extra}


def write_report(report: dict, path: Path, print_table: Callable[[dict], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"wrote {path} ({report.get('wall_s')} s)", file=sys.stderr)
