"""tools/gpu/check_serving.py's measuring path (issue 51, the serving plan) without CUDA: vLLM's CLI replaced by
tests/fake_vllm_cli.py (``RCSTAT_VLLM_CLI``), so the servers really start, answer their health check and warm-up, are
measured by a bench subprocess whose JSON is read back, and are stopped; the rows, the half rate taken from vanilla's
saturation, the ratios, a server that fails, the budget and the resume are the script's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_tools import GPU, REPO, load

plan = load("window_plan")
serving = load("check_serving")


def run_check(tmp_path: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    results = tmp_path / "results"
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RCSTAT_DRY_RUN", "TRITON_INTERPRET")}
    env.update(
        RCSTAT_RESULTS=str(results),
        RCSTAT_MODEL_ROOT=str(tmp_path / "models"),
        OUT=str(tmp_path / "out"),
        RCSTAT_VLLM_CLI=f"{sys.executable} {REPO / 'tests' / 'fake_vllm_cli.py'}",
        FAKE_VLLM_RECORD=str(tmp_path / "servers.jsonl"),
        **env_extra,
    )
    return subprocess.run(
        [sys.executable, str(GPU / "check_serving.py"), "--tokenizer", str(tokenizer), "--mode", "eager", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def report_of(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "serving_eager_cuda.json").read_text())


def servers(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "servers.jsonl").read_text().splitlines()]


def test_rows_measured_one_server_at_a_time_half_rate_from_vanilla(tmp_path):
    rows = "sat:vanilla,sat:bare,long:vanilla,long:decode1024"
    proc = run_check(tmp_path, "--rows", rows, FAKE_VLLM_FAIL_IF="decode_budget")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = report_of(tmp_path)
    by_row = {r["row"]: r for r in report["runs"]}
    assert list(by_row) == rows.split(",")
    assert [r for r in by_row if by_row[r]["ok"]] == ["sat:vanilla", "sat:bare", "long:vanilla"]
    # saturation at inf; half of vanilla's saturation req/s (the fake's 2.0) for vanilla and for the bare flag
    for row in ("sat:vanilla", "sat:bare"):
        assert by_row[row]["sat"]["rate"] == "inf" and by_row[row]["half"]["rate"] == 1.0
        bench = by_row[row]["bench_commands"]["half"]
        assert bench[bench.index("--request-rate") + 1] == "1.0"
        assert by_row[row]["sat"]["metrics"]["vllm:num_preemptions_total"] == 1.0  # /metrics read around the run
        # the slowest gaps from the saved per-request times (benchmarks/latency_tail.py): the 0.4 s one waited for
        # the other request's prefill
        tail = by_row[row]["sat"]["itl_tail"]
        assert (
            tail["gaps"] == 4 and tail["slowest"][0] == [400.0, 0.54, -40.0] and tail["slowest_beside_a_prefill"] == 1
        )
    assert by_row["long:vanilla"]["long"]["completed"] == 8 and "half" not in by_row["long:vanilla"]
    # the plan reader counts exactly the rows measured (content, not names)
    assert [r for r in plan.SERVING_ROWS if plan.serving_row_done(by_row.get(r, {}))] == [
        "sat:vanilla",
        "sat:bare",
        "long:vanilla",
    ]
    failed = by_row["long:decode1024"]
    assert "exited with 3" in failed["error"] and "failing on 'decode_budget'" in failed["server_log_tail"]
    assert report["remaining"] == ["long:decode1024"] and not report["ok"]
    ratios = report["summary"]["sat:bare"]["half"]["vs_vanilla"]
    assert ratios["request_throughput"] == 1.0 and ratios["p99_ttft_ms"] == 1.0
    # each server: in the results folder, vanilla without the plugin, the flag as --additional-config
    started = servers(tmp_path)
    assert len(started) == 4 and all(Path(s["cwd"]) == tmp_path / "results" for s in started)
    assert [s["vllm_plugins"] for s in started] == ["__none__", None, "__none__", None]
    flags = [json.loads(s["argv"][s["argv"].index("--additional-config") + 1]) for s in started[1::2]]
    assert flags == [{"rcstat": {}}, {"rcstat": {"decode_budget": 1024}}]
    assert all("--enforce-eager" in s["argv"] for s in started)
    pointer = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert pointer["file"] == "serving_eager_cuda.json" and "sat:bare sat" in pointer["headline"]


def test_a_later_call_runs_only_the_rows_owed_while_its_budget_lasts(tmp_path):
    assert run_check(tmp_path, "--rows", "sat:vanilla").returncode == 0
    first = report_of(tmp_path)
    assert first["ok"] and first["remaining"] == []
    # a budget too short for a row of the kind measured: nothing starts, the rows are owed
    proc = run_check(tmp_path, "--rows", "sat:vanilla,sat:rc0.8", "--budget-s", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping before sat:rc0.8" in proc.stderr
    short = report_of(tmp_path)
    assert short["remaining"] == ["sat:rc0.8"] and len(short["calls"]) == 2 and len(servers(tmp_path)) == 1
    proc = run_check(tmp_path, "--rows", "sat:vanilla,sat:rc0.8")
    report = report_of(tmp_path)
    assert report["ok"] and [r["row"] for r in report["runs"]] == ["sat:vanilla", "sat:rc0.8"]
    assert [r["call"] for r in report["runs"]] == [0, 2] and len(servers(tmp_path)) == 2  # vanilla not rerun
    assert report["runs"][1]["half"]["rate"] == 1.0  # half of vanilla's saturation, from the earlier call
    # another workload: the earlier rows do not count
    assert run_check(tmp_path, "--rows", "sat:vanilla", "--sat-prompts", "12").returncode == 0
    assert [r["call"] for r in report_of(tmp_path)["runs"]] == [0]


def test_unknown_rows_are_refused_with_json(tmp_path):
    proc = run_check(tmp_path, "--rows", "sat:vanilla,sat:nope")
    assert proc.returncode == 2 and "unknown rows ['sat:nope']" in proc.stderr
    written = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert written["check"] == "serving" and not written["ok"] and written["error_type"] == "SystemExit"
    assert not (tmp_path / "servers.jsonl").exists()


def test_the_model_has_the_tokenizers_vocabulary_unless_llama_vocab(tmp_path):
    common = load("gpu_common")
    assert run_check(tmp_path, "--rows", "sat:vanilla").returncode == 0
    assert run_check(tmp_path / "b", "--rows", "sat:vanilla", "--llama-vocab").returncode == 0
    cut, full = (servers(path)[0]["argv"][0] for path in (tmp_path, tmp_path / "b"))
    assert Path(cut).name == "llama-3.1-8b-shape-vocab49152" and Path(full).name == "llama-3.1-8b-shape"
    assert json.loads((Path(cut) / "config.json").read_text())["vocab_size"] == 49152
    assert json.loads((Path(full) / "config.json").read_text()) == common.LLAMA_31_8B
    assert [report_of(p)["workload"]["model_vocab"] for p in (tmp_path, tmp_path / "b")] == [49152, 128256]
