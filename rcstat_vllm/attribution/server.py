"""``vllm serve``: attribution as an extra field of the OpenAI chat completion response.

A request asks with ``"vllm_xargs": {"rcstat_attribution": "<JSON object>"}`` (vllm_xargs values must be
scalars, so the options travel as JSON text; ``1`` / ``"true"`` for the defaults), e.g.::

    {"model": "smollm2", "messages": [...], "max_tokens": 64,
     "vllm_xargs": {"rcstat_attribution": "{\\"spans\\": \\"chunks\\", \\"chunks\\": [\\"Doc one...\\"]}"}}

and the response carries ``"rcstat_attribution"``::

    {"index": 0,
     "prompt_spans": [{"start": .., "end": .., "token_start": .., "token_end": .., "text": ..}, ...],
     "generated": [{"span": {...}, "scores": [...], "top": [{"index", "score", "start", "end", "text"}]}, ...],
     "heads": [[layer, head], ...], "head_scores": [...], "estimator": "exact" | "upper",
     "span_score": "window" | "mean" | ..., "head_weights": [...], "calibrated": true | false,
     "token_weighting": "peak" | "uniform", "num_generated_tokens": n}

or, when attribution cannot be given, ``{"index": i, "error": "<why>"}`` (never a silent null).

* ``stream: false``: the field is on the response object.
* ``stream: true``: one more chunk before ``data: [DONE]``, with ``"choices": []`` and the field (as the usage
  chunk of ``stream_options.include_usage`` does); token ids are gathered from the streamed deltas.
* ``n > 1``: each choice is traced as its own engine request (vLLM's child ``<i>_<id>``); the field is then a
  list, one entry per choice, in choice order. ``n == 1`` keeps the single object.

Character offsets of prompt spans index the prompt as the model saw it (the rendered chat template, i.e.
the decoded prompt tokens); those of generated spans index that choice's raw content (the decoded
generation). Requests without the setting get the response unchanged (the hooks pass through before
touching anything).

The server needs: the rcstat backend (``--additional-config '{"rcstat": {"method": "none"}}'`` or any
method), ``--logits-processors rcstat_vllm.attribution.processor:RCStatAttributionProcessor``, and
the chat hooks installed in the API-server process: ``patches/openai_chat.py`` (``maybe_install``, from the platform's
``check_and_update_config`` hook, which runs in the front-end process) does it when the processor is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from rcstat_vllm.attribution.capture import REQUEST_KEY, parse_request_options, trace_id
from rcstat_vllm.attribution.report import assemble, plan_spans
from rcstat_vllm.attribution.vllm_api import WORKER_METHOD
from rcstat_vllm.config import ConfigError
from rcstat_vllm.log import logger
from rcstat_vllm.vllm_private.internals import every_workers_rpc

__all__ = ["RESPONSE_FIELD", "attribution_payload", "trace_id", "wrap_full_generator", "wrap_stream_generator"]

RESPONSE_FIELD = "rcstat_attribution"

_NO_TRACE = (
    "no worker holds an attribution trace of this request (evicted: more than the traces or bytes a worker "
    "keeps, or already read); see the server log"
)


def _setting(request) -> Any:
    xargs = getattr(request, "vllm_xargs", None)
    return xargs.get(REQUEST_KEY) if xargs else None


def _parsed(request):
    try:
        return parse_request_options(_setting(request))
    except ConfigError:
        return None  # rejected at admission already


async def attribution_payload(
    engine_client,
    request_id: str,
    prompt: str | None,
    prompt_token_ids,
    token_ids,
    tokenizer,
    presentation: dict[str, Any],
    index: int = 0,
    num_choices: int = 1,
) -> dict:
    """The response field of one finished choice: the attribution, or ``{"index", "error"}`` saying why not."""
    try:
        prompt_text, prompt_spans, gen_text, gen_spans = plan_spans(
            tokenizer,
            prompt,
            list(prompt_token_ids),
            list(token_ids),
            presentation.get("spans", "sentences"),
            presentation.get("chunks"),
            presentation.get("generated_spans", "sentences"),
        )
        args = (
            trace_id(request_id, index, num_choices),
            [[s.token_start, s.token_end] for s in prompt_spans],
            [[s.token_start, s.token_end] for s in gen_spans],
            True,
        )
        replies = await every_workers_rpc(engine_client, WORKER_METHOD, args)  # the trace is on one DP rank
        scored = next((r for r in replies if r is not None), None)
        if scored is None:
            return {"index": index, "error": _NO_TRACE}
        result = assemble(prompt_text, prompt_spans, gen_text, gen_spans, scored, presentation.get("top", 3))
        return {"index": index, **result.to_dict()}
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - never fail a finished completion over its attribution
        logger.warning("rcstat: attribution of %s (choice %d) failed: %s", request_id, index, exc)
        return {"index": index, "error": f"{type(exc).__name__}: {exc}"}


def _unavailable(request) -> str | None:
    if getattr(request, "use_beam_search", False):
        return "attribution is not available with beam search (its sequences are not traced)"
    return None


async def _field(engine_client, request, request_id, prompt, prompt_token_ids, outputs: dict, tokenizer, presentation):
    """The field for all choices: ``outputs`` maps choice index -> generated token ids."""
    num_choices = request.n or 1
    reason = _unavailable(request)
    if reason is None and prompt_token_ids is None:
        reason = "the generation produced no output (see the response's error)"
    payloads = []
    for index in range(num_choices):
        if reason is not None:
            payloads.append({"index": index, "error": reason})
        elif index not in outputs:
            payloads.append({"index": index, "error": "this choice produced no output"})
        else:
            payloads.append(
                await attribution_payload(
                    engine_client,
                    request_id,
                    prompt,
                    prompt_token_ids,
                    outputs[index],
                    tokenizer,
                    presentation,
                    index,
                    num_choices,
                )
            )
    return payloads[0] if num_choices == 1 else payloads


def wrap_full_generator(original):
    """The wrapper ``patches/openai_chat.py`` installs around vLLM's chat completion builder."""

    async def chat_completion_full_generator(
        self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs
    ):
        parsed = _parsed(request)
        if parsed is None:
            return await original(
                self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs
            )
        seen: dict[str, Any] = {}

        async def tee():
            async for res in result_generator:
                seen["final"] = res
                yield res

        response = await original(
            self, request, tee(), request_id, model_name, conversation, tokenizer, *args, **kwargs
        )
        final = seen.get("final")
        if final is None or not hasattr(response, "choices"):
            return response  # an error response
        outputs = {output.index: list(output.token_ids) for output in final.outputs}
        field = await _field(
            self.engine_client,
            request,
            final.request_id,
            final.prompt,
            final.prompt_token_ids,
            outputs,
            tokenizer,
            parsed[1],
        )
        setattr(response, RESPONSE_FIELD, field)
        return response

    return chat_completion_full_generator


_DONE = "data: [DONE]\n\n"


def wrap_stream_generator(original):
    """The wrapper ``patches/openai_chat.py`` installs around vLLM's streaming chat generator: the attribution
    goes in one more chunk (``"choices": []``) just before ``data: [DONE]``."""

    async def chat_completion_stream_generator(
        self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs
    ):
        parsed = _parsed(request)
        if parsed is None:
            async for item in original(
                self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs
            ):
                yield item
            return
        state: dict[str, Any] = {"prompt": None, "prompt_token_ids": None, "request_id": request_id}
        outputs: dict[int, list[int]] = {}

        async def tee():
            async for res in result_generator:  # streamed outputs are deltas: gather each choice's token ids
                state["request_id"] = res.request_id
                if res.prompt_token_ids is not None and state["prompt_token_ids"] is None:
                    state["prompt_token_ids"] = list(res.prompt_token_ids)
                if res.prompt is not None and state["prompt"] is None:
                    state["prompt"] = res.prompt
                for output in res.outputs:
                    outputs.setdefault(output.index, []).extend(output.token_ids)
                yield res

        last: dict[str, Any] = {}
        async for item in original(
            self, request, tee(), request_id, model_name, conversation, tokenizer, *args, **kwargs
        ):
            if item == _DONE:
                field = await _field(
                    self.engine_client,
                    request,
                    state["request_id"],
                    state["prompt"],
                    state["prompt_token_ids"],
                    outputs,
                    tokenizer,
                    parsed[1],
                )
                chunk = {
                    "id": last.get("id", request_id),
                    "object": "chat.completion.chunk",
                    "created": last.get("created", int(time.time())),
                    "model": last.get("model", model_name),
                    "choices": [],
                    RESPONSE_FIELD: field,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            elif not last and item.startswith("data: {"):  # id, created and model of the stream
                with contextlib.suppress(ValueError):
                    last = json.loads(item[len("data: ") :])
            yield item

    return chat_completion_stream_generator
