"""Every touch of a private vLLM API, one module per concern, each with its ``CONTRACTS``.

- ``platform``: validate the flag at start-up, choose the plugin's attention backend (CPU and CUDA).
- ``attention_backends``: the vLLM backend classes the plugin's backends extend, and the kernels they call.
- ``request_validation``: reject a bad per-request override (``vllm_xargs``) for that request only.
- ``scheduler``: apply the worker's compaction reports, returning freed blocks to the ``BlockPool``.
- ``model_runner``: give the backend the batch's request ids and settings; carry reports back.
- ``runner_choice``: with the flag, workers build the V1 model runner (the hooked one); refuse to start otherwise.
- ``cpu_kv_layout``: check the CPU kernels' in-page K/V layout that compaction reads and writes.
- ``tensor_parallel``: the process group on which TP ranks agree how many blocks a compressed request keeps.
- ``openai_chat``: add the attribution field to chat completions (API-server process, processor configured).
"""

from __future__ import annotations

from . import (
    attention_backends,
    cpu_kv_layout,
    model_runner,
    openai_chat,
    platform,
    request_validation,
    runner_choice,
    scheduler,
    tensor_parallel,
)
from ._contract import Contract, VLLMContractError

MODULES = (
    platform,
    request_validation,
    scheduler,
    model_runner,
    runner_choice,
    attention_backends,
    cpu_kv_layout,
    openai_chat,
    tensor_parallel,
)


def all_contracts() -> list[Contract]:
    return [c for module in MODULES for c in module.CONTRACTS]


def check_contracts() -> None:
    """Raise :class:`VLLMContractError` naming the first private API that does not match (among those that
    concern this platform)."""
    for contract in all_contracts():
        if contract.applies():
            contract.check()


def install_all() -> None:
    """Install the process-wide hooks (idempotent; each passes through unless the engine runs with the flag).
    ``openai_chat`` is installed by the platform hook, only when the attribution processor is configured."""
    check_contracts()
    for module in (platform, request_validation, scheduler, model_runner, runner_choice):
        module.install()


__all__ = ["Contract", "VLLMContractError", "all_contracts", "check_contracts", "install_all"]
