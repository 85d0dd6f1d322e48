"""Attribution (RCStat, Section 4.2): which prompt spans a generated span relies on, from the RC-ranked heads.

* :mod:`.estimators`, :mod:`.trace`, :mod:`.options`: span RC estimators, head ranking, Eq. 10 and the streaming
  trace (pure torch), and the request's options;
* :mod:`.spans`, :mod:`.report`: sentences, chunks and tokens with character offsets; the result for a request;
* :mod:`.hf`: the transformers path (reference and evaluation);
* :mod:`.capture`, :mod:`.processor`, :mod:`.vllm_api`: the vLLM path (capture in the attention backend,
  switch per request with a logits processor, results through ``collective_rpc``); :mod:`.server`: the chat
  response's field.

``results(llm, request_output)`` is the Python API of the vLLM path (imported lazily: no vLLM import here).
"""

from __future__ import annotations

from rcstat_vllm.attribution.options import AttributionOptions
from rcstat_vllm.attribution.report import AttributionResult
from rcstat_vllm.attribution.trace import AttributionTrace, SpanScores

__all__ = ["AttributionOptions", "AttributionResult", "AttributionTrace", "SpanScores", "results"]


def results(llm, request_output, **kwargs) -> AttributionResult | None:
    """Attribution of one finished ``RequestOutput`` of ``llm`` (see :func:`.vllm_api.results`)."""
    from rcstat_vllm.attribution.vllm_api import results as _results

    return _results(llm, request_output, **kwargs)
