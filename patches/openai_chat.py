"""OpenAI chat endpoint: add the attribution field to a finished chat completion, streaming or not.

``vllm serve`` builds chat responses in ``OpenAIServingChat.chat_completion_full_generator``; the wrapper
(``rcstat_vllm.attribution.server.wrap_full_generator``) tees the result stream, lets vLLM build the response,
then asks the workers for the request's attribution and sets ``response.rcstat_attribution``. Streaming
responses come from ``chat_completion_stream_generator`` (an async generator of SSE lines); its wrapper
(``wrap_stream_generator``) gathers the streamed token ids and yields one more chunk carrying the field just
before ``data: [DONE]``. Requests that did not ask pass straight through. Installed in the API-server process
(:func:`maybe_install`, which ``install_all`` hands to the platform's config hook) when the engine was started
with the attribution logits processor.
"""

from __future__ import annotations

from rcstat_vllm.log import logger

from ._contract import Contract, VLLMContractError, wrap_method

CONTRACTS = (
    Contract(
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator",
        ("self", "request", "result_generator", "request_id", "model_name", "conversation", "tokenizer"),
    ),
    Contract(
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator",
        ("self", "request", "result_generator", "request_id", "model_name", "conversation", "tokenizer"),
    ),
)


def install() -> bool:
    """Wrap the chat completion handler of this process (idempotent). False when vLLM's API differs."""
    try:
        for contract in CONTRACTS:
            contract.check()
    except VLLMContractError as exc:
        logger.warning("rcstat: attribution response field unavailable (%s)", exc)
        return False
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from rcstat_vllm.attribution.server import wrap_full_generator, wrap_stream_generator

    wrap_method(OpenAIServingChat, "chat_completion_full_generator", wrap_full_generator)
    wrap_method(OpenAIServingChat, "chat_completion_stream_generator", wrap_stream_generator)
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
    """:func:`install` when the engine uses the attribution processor (run by the platform's config hook, in the
    process that builds the engine's config: the front end)."""
    return install() if processor_configured(vllm_config) else False
