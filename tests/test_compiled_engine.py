"""The plugin under vLLM's default compilation. Every other engine test (and every benchmark) runs vLLM with
``compilation_config={"mode": 0}``; a user's ``vllm serve`` does not: on vLLM-CPU the default becomes one Dynamo
trace of the model compiled by Inductor (the attention op opaque inside it), on a GPU piecewise graphs around it.
Here, on vLLM-CPU: the compiled engine with the flag compacts a request as the eager one does and generates the
same tokens (tests/compiled_engine_runner.py, one engine per subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).parent


def _run(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "compiled_engine_runner.py"), mode], capture_output=True, text=True, timeout=900
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{mode} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.vllm
@pytest.mark.long
def test_the_flag_under_vllms_default_compilation_compacts_and_generates_as_eager():
    eager, compiled = _run("eager"), _run("default")
    assert eager["compilation_mode"] == 0 and compiled["compilation_mode"] != 0  # (vLLM-CPU: 2, DYNAMO_TRACE_ONCE)
    for result in (eager, compiled):
        assert result["skipped_reason"] is None and result["blocks_freed"] > 0
        # the bare flag's 0.4 of the 900 tokens' entries, less what page alignment keeps: each head within a page
        assert 0.4 - result["block_size"] / 900 < result["compression_ratio"] <= 0.4 + 1e-9
    assert compiled["blocks_freed"] == eager["blocks_freed"]
    assert compiled["tokens"] == eager["tokens"]
