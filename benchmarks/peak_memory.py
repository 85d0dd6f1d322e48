"""Peak resident memory of one piece of work, on Linux, without a GPU: what the planner and compaction
benchmarks (and the compaction memory test) measure with.

Run the measured code in a process started with :data:`MEASURING_ENV`: glibc then serves every allocation of 64 KiB
or more with its own mapping and returns it on free, so resident memory follows what is alive (freed memory is not
kept for reuse, where a later peak would not show).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MEASURING_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start a new resident-memory high-water mark (Linux: writing 5 to clear_refs resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_extra_bytes(work) -> tuple[int, object]:
    """Run ``work()``; return how far the resident memory rose above what the process held before, and its result."""
    before = proc_status("VmRSS")
    reset_peak()
    result = work()
    return max(proc_status("VmHWM") - before, 0), result


def run_in_fresh_process(script: str, args: list[str], *, measuring: bool = True) -> dict:
    """Run ``script args`` in a new Python process (with :data:`MEASURING_ENV` when ``measuring``) and return the
    JSON object it printed last; raises with its stderr if it failed."""
    done = subprocess.run(
        [sys.executable, script, *args],
        check=False,
        capture_output=True,
        text=True,
        env=MEASURING_ENV if measuring else None,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])
