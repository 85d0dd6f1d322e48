"""The per-request switch: a vLLM V1 logits processor that never changes logits.

Enable it with ``LLM(..., logits_processors=[RCStatAttributionProcessor])`` or
``--logits-processors rcstat_vllm.attribution.processor:RCStatAttributionProcessor``; then a request asks with
``SamplingParams(extra_args={"rcstat_attribution": True | {...}})`` (``vllm_xargs`` over HTTP; options in
:func:`rcstat_vllm.attribution.capture.parse_request_options`).

What it does: ``validate_params`` rejects a bad setting at admission (HTTP 400, naming the field) and makes a
request that asks skip reading the prefix cache (its prompt keys must all be computed to be traced);
constructing it (in the worker) activates this process's :class:`AttributionCapture`, so the attention backend
records q/k for the requests that asked; ``update_state`` tracks which batch rows asked; ``apply`` returns
the logits untouched (argmax invariant: sampling is exactly as without it). A processor sees logits only,
so the q/k come from the backend (``capture.py``); the rcstat backend must be active, i.e. the server runs
with ``additional_config={"rcstat": {...}}`` (``{"method": "none"}`` for attribution without compression).
"""

from __future__ import annotations

from typing import Any

import torch

from rcstat_vllm.attribution.capture import REQUEST_KEY, attribution_capture, parse_request_options
from rcstat_vllm.config import ConfigError
from rcstat_vllm.vllm_private.logits_processors import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    VLLMValidationError,
)

__all__ = ["PROCESSOR_PATH", "RCStatAttributionProcessor"]

PROCESSOR_PATH = "rcstat_vllm.attribution.processor:RCStatAttributionProcessor"


def _setting(params) -> Any:
    extra = getattr(params, "extra_args", None)
    return extra.get(REQUEST_KEY) if extra else None


class RCStatAttributionProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        try:
            parsed = parse_request_options(_setting(sampling_params))
        except ConfigError as exc:
            if VLLMValidationError is None:  # pragma: no cover - older vLLM
                raise ValueError(str(exc)) from exc
            raise VLLMValidationError(str(exc), parameter=f"vllm_xargs.{REQUEST_KEY}") from exc
        if parsed is not None:
            # Attribution needs every prompt key as the model computes it: a prefix-cache hit would skip
            # those tokens' forward (their keys never reach the trace). vLLM reads this public field when it
            # builds the engine request, after the processors validated the params (as for prompt logprobs).
            sampling_params.skip_reading_prefix_cache = True

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.capture = attribution_capture()
        model_config = getattr(vllm_config, "model_config", None)
        self.capture.activate(getattr(model_config, "model", None))
        #: batch index -> the request's raw setting, for the rows that asked
        self.asking: dict[int, Any] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.asking.pop(index, None)
        for index, params, _prompt_ids, _output_ids in batch_update.added:
            setting = _setting(params)
            try:
                on = parse_request_options(setting) is not None
            except ConfigError:
                on = False
            if on:
                self.asking[index] = setting
            else:
                self.asking.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.asking.pop(a, None), self.asking.pop(b, None)
            if first is not None:
                self.asking[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.asking[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
