"""benchmarks/server_process.py, the serving benchmarks' server process (benchmarks/serving.py on the CPU,
tools/gpu/check_serving.py on a GPU): Prometheus text summed as the benchmarks read it, and a real subprocess
(a standard-library HTTP server, no engine) started, asked, and stopped with the processes it started."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import server_process as sp

METRICS = textwrap.dedent(
    """\
    # HELP rcstat:compaction_seconds a histogram
    # TYPE rcstat:compaction_seconds histogram
    rcstat:compaction_seconds_bucket{kind="prompt",le="0.1"} 2.0
    rcstat:compaction_seconds_count{kind="prompt",model_name="m"} 2.0
    rcstat:compaction_seconds_count{kind="score_ahead",model_name="m"} 5.0
    rcstat:compaction_seconds_sum{model_name="a b",kind="prompt"} 0.25
    vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
    vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
    vllm:label_with_quote{model_name="x\\"kind=\\"y",kind="decode"} 1.5
    rcstat:worker_requests 0.0
    not_a_number{kind="prompt"} NaNish
    """
)


def test_samples_are_summed_over_labels_and_by_kind():
    assert sp.parse_metrics(METRICS) == {
        "rcstat:compaction_seconds_count": 7.0,
        "rcstat:compaction_seconds_count:prompt": 2.0,
        "rcstat:compaction_seconds_count:score_ahead": 5.0,
        "rcstat:compaction_seconds_sum": 0.25,
        "rcstat:compaction_seconds_sum:prompt": 0.25,
        "vllm:num_preemptions_total": 3.0,
        "vllm:label_with_quote": 1.5,
        "vllm:label_with_quote:decode": 1.5,  # (an escaped quote in another label does not end the labels early)
        "rcstat:worker_requests": 0.0,
    }


# A server in the shape vLLM's has: /health, /metrics, a JSON POST, and a child process of its own (vLLM's engine
# core), which close() must stop too. It writes the child's pid and its own environment where the test reads them.
SERVER = textwrap.dedent(
    """\
    import http.server, json, os, subprocess, sys
    port, out = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(out, "w") as f:
        json.dump({"child": child.pid, "env": dict(os.environ), "cwd": os.getcwd()}, f)

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, code, body, kind="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.answer(200, b"")
            elif self.path == "/metrics":
                self.answer(200, b'rcstat:x_total{kind="prompt"} 2\\nrcstat:x_total{kind="decode"} 3\\n', "text/plain")
            else:
                self.answer(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/echo":
                self.answer(200, json.dumps({"got": body}).encode())
            else:
                self.answer(400, b"not json")

        def log_message(self, *args):
            print("request", *args, flush=True)

    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def test_a_free_port_is_below_the_ephemeral_range():
    """Processes started beside a server bind port 0 meanwhile, served from the ephemeral range only."""
    low = sp._ephemeral_low()
    ports = {sp.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # (a zombie has exited)


def test_a_server_is_asked_and_stopped_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "rcstat")  # (never inherited: each benchmark server chooses its plugins)
    script, info = tmp_path / "server.py", tmp_path / "info.json"
    script.write_text(SERVER)
    port = sp.free_port()
    server = sp.ServerProcess(
        [sys.executable, str(script), str(port), str(info)],
        {"MARK": "1"},
        tmp_path / "logs" / "server.log",
        port,
        cwd=tmp_path,
    )
    try:
        server.wait_healthy(60)
        assert server.post("/echo", {"a": [1, 2]}) == (200, {"got": {"a": [1, 2]}})
        assert server.post("/other", {}) == (400, {"raw": "not json"})
        assert server.metrics() == {"rcstat:x_total": 5.0, "rcstat:x_total:prompt": 2.0, "rcstat:x_total:decode": 3.0}
        started = json.loads(info.read_text())
        assert started["env"]["MARK"] == "1" and "VLLM_PLUGINS" not in started["env"]
        assert Path(started["cwd"]) == tmp_path
        assert "serving" in server.log_tail()
        assert alive(started["child"])
    finally:
        server.close()
    assert server.proc.poll() is not None
    deadline = time.monotonic() + 10
    while alive(started["child"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(started["child"]), "close() left the server's child running"
    with pytest.raises(OSError):
        server.metrics()


def test_a_server_that_exits_or_never_answers_is_reported(tmp_path):
    port = sp.free_port()
    exits = sp.ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "exits.log", port)
    try:
        with pytest.raises(RuntimeError, match="server exited with 3"):
            exits.wait_healthy(60)
    finally:
        exits.close()
    silent = sp.ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "silent.log", port)
    try:
        with pytest.raises(TimeoutError, match="not healthy after 2 s"):
            silent.wait_healthy(2)
    finally:
        silent.close()
    assert silent.proc.poll() is not None


def test_bench_arguments_parse_as_vllm_bench_serve_reads_them():
    """The arguments both serving benchmarks pass to ``vllm bench serve``, through vLLM's own parser."""
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    workload = dict(num_prompts=12, input_len=320, output_len=72, range_ratio=0.2)
    args = parser.parse_args(sp.bench_serve_args("http://127.0.0.1:1", "m", "tok", **workload, rate="inf", seed=7))
    assert (args.base_url, args.endpoint, args.model, args.tokenizer) == (
        "http://127.0.0.1:1",
        "/v1/completions",
        "m",
        "tok",
    )
    assert (args.dataset_name, args.num_prompts, args.random_input_len, args.random_output_len) == (
        "random",
        12,
        320,
        72,
    )
    assert float(args.random_range_ratio) == 0.2 and args.request_rate == float("inf") and args.seed == 7
    assert args.ignore_eos and args.temperature == 0 and args.num_warmups == 0 and args.save_detailed
    assert args.metric_percentiles == "50,90,99" and args.percentile_metrics == "ttft,tpot,itl,e2el"


def test_bench_fields_keep_the_latencies_and_the_first_errors():
    result = {name: 1.0 for name in sp.BENCH_FIELDS} | {"itls": [[0.1]], "errors": ["", "b" * 400, "a", "a", *"cdefg"]}
    kept = sp.bench_fields(result)
    assert set(kept) == {*sp.BENCH_FIELDS, "errors"} and "p99_itl_ms" in kept and "itls" not in kept
    assert kept["errors"] == ["a", "b" * 300, "c", "d", "e"]
