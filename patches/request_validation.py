"""Per-request validation of ``SamplingParams.extra_args["rcstat"]`` at admission, in the API process.

A bad override is rejected for that request only (HTTP 400 through ``vllm serve``), before it reaches the
engine; other requests are not affected. Passes through when the server runs without the plugin flag.
"""

from __future__ import annotations

from rcstat_vllm.config import ConfigError, request_overrides, server_config

from ._contract import Contract, wrap_method

CONTRACTS = (
    Contract(
        "vllm.v1.engine.input_processor:InputProcessor._validate_params",
        ("self", "params", "supported_tasks"),
    ),
    Contract("vllm.exceptions:VLLMValidationError"),
    Contract("vllm.sampling_params:SamplingParams"),
)


def _validate_params(original):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    def wrapper(self, params, supported_tasks, *args, **kwargs):
        result = original(self, params, supported_tasks, *args, **kwargs)
        if isinstance(params, SamplingParams):
            config = server_config(self.vllm_config.additional_config)
            if config is not None:
                try:
                    config.merged(request_overrides(params.extra_args))
                except ConfigError as exc:
                    raise VLLMValidationError(str(exc), parameter="vllm_xargs.rcstat") from exc
        return result

    return wrapper


def install() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    wrap_method(InputProcessor, "_validate_params", _validate_params)
