"""OpenAI chat endpoint: add the attribution field to a finished chat completion, streaming or not.

``vllm serve`` builds chat responses in ``OpenAIServingChat.chat_completion_full_generator``; the wrapper
(``rcstat_vllm.attribution.server.wrap_full_generator``) tees the result stream, lets vLLM build the response,
then asks the workers for the request's attribution and sets ``response.rcstat_attribution``. Streaming
responses come from ``chat_completion_stream_generator`` (an async generator of SSE lines); its wrapper
(``wrap_stream_generator``) gathers the streamed token ids and yields one more chunk carrying the field just
before ``data: [DONE]``. Requests that did not ask pass straight through. Installed in the API-server process
by the platform hook when the engine was started with the attribution logits processor.
"""

from __future__ import annotations

from ._contract import Contract, wrap_method

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


def install() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from rcstat_vllm.attribution.server import wrap_full_generator, wrap_stream_generator

    wrap_method(OpenAIServingChat, "chat_completion_full_generator", wrap_full_generator)
    wrap_method(OpenAIServingChat, "chat_completion_stream_generator", wrap_stream_generator)
