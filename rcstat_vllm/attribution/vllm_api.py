"""Attribution results from the vLLM Python API.

    from vllm import LLM, SamplingParams
    from rcstat_vllm.attribution import results
    from rcstat_vllm.attribution.processor import RCStatAttributionProcessor

    llm = LLM(model, additional_config={"rcstat": {"method": "none"}},       # the rcstat backend records q/k
              logits_processors=[RCStatAttributionProcessor], enforce_eager=True)
    params = SamplingParams(max_tokens=64, extra_args={"rcstat_attribution": {"spans": "sentences"}})
    out = llm.generate([prompt], params)[0]
    result = results(llm, out)               # AttributionResult: per generated sentence, the top prompt spans

The client side (this module) splits prompt and generation into spans with the tokenizer's offsets and sends
the token ranges to the worker (``collective_rpc("rcstat_attribution_results", ...)``), which scores them on
the request's trace (Eq. 10 with the top-k RC heads), frees the trace and returns plain lists.

``vllm serve``: the same worker method fills the ``rcstat_attribution`` field of chat completion responses
(:mod:`rcstat_vllm.attribution.server`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rcstat_vllm.attribution.capture import trace_id
from rcstat_vllm.attribution.report import AttributionResult, assemble, plan_spans

__all__ = ["WORKER_METHOD", "results"]

WORKER_METHOD = "rcstat_attribution_results"


def _call_worker(llm, req_id: str, prompt_ranges, generated_ranges, pop: bool) -> list[Any]:
    args = (req_id, prompt_ranges, generated_ranges, pop)
    try:
        return llm.collective_rpc(WORKER_METHOD, args=args)
    except Exception as first:  # noqa: BLE001 - the worker extension may lack the method
        from rcstat_vllm.attribution.capture import worker_results

        def call(worker, *a):  # in-process engines accept callables without serialization
            return worker_results(*a)

        try:
            return llm.collective_rpc(call, args=args)
        except Exception as second:
            raise RuntimeError(
                f"attribution results unreachable: the worker has no {WORKER_METHOD!r} ({first}) and a callable "
                f"RPC failed too ({second}); the worker extension rcstat_vllm.api.RCStatWorkerExtension must "
                "include rcstat_vllm.attribution.capture.AttributionWorkerMixin"
            ) from second


def results(
    llm,
    request_output,
    *,
    spans: str = "sentences",
    chunks: Sequence | None = None,
    generated_spans: str | Sequence = "sentences",
    top: int = 3,
    index: int = 0,
    pop: bool = True,
) -> AttributionResult | None:
    """The attribution of a finished request (None when no worker traced it: it did not ask, or the trace
    was already read with ``pop=True``, or evicted).

    Args:
        llm: the ``vllm.LLM`` that ran it (the processor and ``additional_config={"rcstat": ...}`` enabled).
        request_output: its ``RequestOutput``.
        spans / chunks / generated_spans / top: as in :func:`rcstat_vllm.attribution.hf.attribute`.
        index: which completion of the request (with ``n > 1`` each is traced as its own engine request).
        pop: free the worker's trace (default).
    """
    tokenizer = llm.get_tokenizer()
    output = next((o for o in request_output.outputs if o.index == index), None)
    if output is None:
        raise IndexError(f"request {request_output.request_id} has no completion {index}")
    prompt_text, prompt_spans, gen_text, gen_spans = plan_spans(
        tokenizer,
        request_output.prompt,
        list(request_output.prompt_token_ids),
        list(output.token_ids),
        spans,
        chunks,
        generated_spans,
    )
    prompt_ranges = [[s.token_start, s.token_end] for s in prompt_spans]
    generated_ranges = [[s.token_start, s.token_end] for s in gen_spans]
    lookup = trace_id(str(request_output.request_id), output.index, len(request_output.outputs))
    replies = _call_worker(llm, lookup, prompt_ranges, generated_ranges, pop)
    scored = next((r for r in replies if r is not None), None)
    if scored is None:
        return None
    return assemble(prompt_text, prompt_spans, gen_text, gen_spans, scored, top)
