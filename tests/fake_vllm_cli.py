"""A stand-in for ``python -m vllm.entrypoints.cli.main`` (``RCSTAT_VLLM_CLI``) for tools/gpu/check_serving.py's
non-dry path without CUDA: ``serve`` answers /health, /v1/completions and /metrics on the port it is given (and
records its arguments, working directory and VLLM_PLUGINS); ``bench serve`` writes the JSON ``vllm bench serve``
saves, its request rate 2.0 req/s at saturation (``inf``) and the rate asked for otherwise.

``FAKE_VLLM_FAIL_IF=TEXT``: ``serve`` exits 3 at once when TEXT is in its arguments (a server that does not start)."""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def arg(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def serve(argv: list[str]) -> int:
    fail = os.environ.get("FAKE_VLLM_FAIL_IF")
    record = {"argv": argv, "cwd": os.getcwd(), "vllm_plugins": os.environ.get("VLLM_PLUGINS")}
    with open(Path(os.environ["FAKE_VLLM_RECORD"]), "a") as f:
        f.write(json.dumps(record) + "\n")
    if fail and any(fail in a for a in argv):
        print(f"fake serve: failing on {fail!r}", flush=True)
        return 3
    calls = {"metrics": 0}

    class Handler(BaseHTTPRequestHandler):
        def reply(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/metrics":
                calls["metrics"] += 1
                count = calls["metrics"]
                text = f'# HELP x\nvllm:num_preemptions_total{{engine="0"}} {count}.0\n'
                self.reply(text.encode(), "text/plain")
            else:
                self.reply(b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.reply(json.dumps({"choices": [{"text": " fake"}]}).encode())

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(arg(argv, "--port"))), Handler).serve_forever()
    return 0


def bench(argv: list[str]) -> int:
    prompts = int(arg(argv, "--num-prompts"))
    rate = arg(argv, "--request-rate")
    throughput = 2.0 if rate == "inf" else float(rate)
    result = {
        "completed": prompts,
        "failed": 0,
        "request_rate": rate,
        "request_throughput": throughput,
        "output_throughput": throughput * int(arg(argv, "--random-output-len")),
        "p50_ttft_ms": 100.0,
        "p99_ttft_ms": 300.0 if rate == "inf" else 150.0,
        "p50_itl_ms": 20.0,
        "p99_itl_ms": 40.0,
        "errors": [""] * prompts,
        "tokenizer_id": arg(argv, "--tokenizer"),
        # (--save-detailed) two requests sent at 0 s; request 1's first token at 0.5 s, inside request 0's 0.4 s gap
        "start_times": [0.0, 0.0],
        "ttfts": [0.1, 0.5],
        "itls": [[0.02, 0.02, 0.4], [0.02]],
    }
    Path(arg(argv, "--result-dir"), arg(argv, "--result-filename")).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        sys.exit(serve(args[1:]))
    if args[:2] == ["bench", "serve"]:
        sys.exit(bench(args[2:]))
    sys.exit(f"fake vllm: unknown command {args}")
