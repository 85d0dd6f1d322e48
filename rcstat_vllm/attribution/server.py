"""``vllm serve``: attribution as an extra field of the OpenAI chat completion response.

A request asks with ``"vllm_xargs": {"rcstat_attribution": "<JSON object>"}`` (vllm_xargs values must be
scalars, so the options travel as JSON text; ``1`` / ``"true"`` for the defaults), e.g.::

    {"model": "smollm2", "messages": [...], "max_tokens": 64,
     "vllm_xargs": {"rcstat_attribution": "{\\"spans\\": \\"chunks\\", \\"chunks\\": [\\"Doc one...\\"]}"}}

and the (non-streaming) response carries ``"rcstat_attribution"``::

    {"prompt_spans": [{"start": .., "end": .., "token_start": .., "token_end": .., "text": ..}, ...],
     "generated": [{"span": {...}, "scores": [...], "top": [{"index", "score", "start", "end", "text"}]}, ...],
     "heads": [[layer, head], ...], "head_scores": [...], "estimator": "exact" | "upper",
     "num_generated_tokens": n}

Character offsets of prompt spans index the prompt as the model saw it (the rendered chat template, i.e.
the decoded prompt tokens); those of generated spans index ``choices[0].message.content``'s raw text (the
decoded generation). Requests without the setting get the response unchanged (the hook passes through
before touching anything). Streaming responses are not annotated (``stream: true`` ignores the setting).

The server needs: the rcstat backend (``--additional-config '{"rcstat": {"method": "none"}}'`` or any
method), ``--logits-processors rcstat_vllm.attribution.processor:RCStatAttributionProcessor``, and
:func:`install` called in the API-server process: :func:`maybe_install` (from the platform's
``check_and_update_config`` hook, which runs in the front-end process) does it when the processor is configured.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rcstat_vllm.attribution.capture import REQUEST_KEY, parse_request_options
from rcstat_vllm.attribution.report import assemble, plan_spans
from rcstat_vllm.attribution.vllm_api import WORKER_METHOD
from rcstat_vllm.config import ConfigError
from rcstat_vllm.log import logger

__all__ = ["install", "maybe_install", "processor_configured", "RESPONSE_FIELD", "attribution_payload",
           "wrap_full_generator"]

RESPONSE_FIELD = "rcstat_attribution"


def _setting(request) -> Any:
    xargs = getattr(request, "vllm_xargs", None)
    return xargs.get(REQUEST_KEY) if xargs else None


async def attribution_payload(engine_client, final_res, tokenizer, presentation: dict[str, Any]) -> dict | None:
    """The response field for one finished request (None when no worker traced it)."""
    output = final_res.outputs[0]
    prompt_text, prompt_spans, gen_text, gen_spans = plan_spans(
        tokenizer,
        final_res.prompt,
        list(final_res.prompt_token_ids),
        list(output.token_ids),
        presentation.get("spans", "sentences"),
        presentation.get("chunks"),
        presentation.get("generated_spans", "sentences"),
    )
    args = (
        str(final_res.request_id),
        [[s.token_start, s.token_end] for s in prompt_spans],
        [[s.token_start, s.token_end] for s in gen_spans],
        True,
    )
    replies = await engine_client.collective_rpc(WORKER_METHOD, args=args)
    scored = next((r for r in replies if r is not None), None)
    if scored is None:
        return None
    return assemble(prompt_text, prompt_spans, gen_text, gen_spans, scored, presentation.get("top", 3)).to_dict()


def wrap_full_generator(original):
    """The wrapper ``patches/openai_chat.py`` installs around vLLM's chat completion builder."""
    async def chat_completion_full_generator(self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs):
        try:
            parsed = parse_request_options(_setting(request))
        except ConfigError:
            parsed = None  # rejected at admission already
        if parsed is None:
            return await original(
                self, request, result_generator, request_id, model_name, conversation, tokenizer, *args, **kwargs
            )
        seen: dict[str, Any] = {}

        async def tee():
            async for res in result_generator:
                seen["final"] = res
                yield res

        response = await original(self, request, tee(), request_id, model_name, conversation, tokenizer, *args, **kwargs)
        final = seen.get("final")
        if final is None or not hasattr(response, "choices"):
            return response  # an error response
        try:
            payload = await attribution_payload(self.engine_client, final, tokenizer, parsed[1])
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - never fail a finished completion over its attribution
            logger.warning("rcstat: attribution of %s failed: %s", request_id, exc)
            payload = {"error": f"{type(exc).__name__}: {exc}"}
        setattr(response, RESPONSE_FIELD, payload)
        return response

    return chat_completion_full_generator


def install() -> bool:
    """Wrap the chat completion handler of this process (idempotent). False when vLLM's API differs."""
    from rcstat_vllm.patches import openai_chat
    from rcstat_vllm.patches._contract import VLLMContractError

    try:
        for contract in openai_chat.CONTRACTS:
            contract.check()
    except VLLMContractError as exc:
        logger.warning("rcstat: attribution response field unavailable (%s)", exc)
        return False
    openai_chat.install()
    return True


def processor_configured(vllm_config) -> bool:
    """Whether the engine was started with the attribution logits processor (class or its import path)."""
    from rcstat_vllm.attribution.processor import PROCESSOR_PATH

    model_config = getattr(vllm_config, "model_config", None)
    for entry in getattr(model_config, "logits_processors", None) or ():
        if isinstance(entry, str):
            if entry.replace(":", ".") == PROCESSOR_PATH.replace(":", "."):
                return True
        elif getattr(entry, "__name__", "") == "RCStatAttributionProcessor":
            return True
    return False


def maybe_install(vllm_config) -> bool:
    """:func:`install` when the engine uses the attribution processor (call it in the front-end process)."""
    return install() if processor_configured(vllm_config) else False
