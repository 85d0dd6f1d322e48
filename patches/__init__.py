"""Every hook into vLLM, one module per concern, each with the ``CONTRACTS`` of the private APIs it touches;
:func:`install_all` installs them all. What the package reads of vLLM's internals itself goes through
:mod:`rcstat_vllm.vllm_private` (its ``internals`` and the backend classes of ``attention_contracts``), whose contracts
are checked here too.

- ``platform``: validate the flag at start-up, choose the plugin's attention backend (CPU and CUDA).
- ``request_validation``: reject a bad per-request override (``vllm_xargs``) for that request only.
- ``scheduler``: hand the scheduler's objects to :mod:`rcstat_vllm.engine.block_exchange` (fresh blocks in, prompt
  blocks back to the ``BlockPool``, compacted blocks out of the prefix cache).
- ``model_runner``: give the backend the batch's request ids and settings; carry reports back.
- ``runner_choice``: with the flag, workers build the V1 model runner (the hooked one); refuse to start otherwise.
- ``openai_chat``: add the attribution field to chat completions (API-server process, processor configured).

Patches import the package; the package never imports ``patches`` (only ``rcstat_vllm/plugin.py``, the entry
point, calls :func:`install_all`).
"""

from __future__ import annotations

from rcstat_vllm.vllm_private import attention_contracts
from rcstat_vllm.vllm_private import internals as vllm_internals

from . import (
    model_runner,
    openai_chat,
    platform,
    request_validation,
    runner_choice,
    scheduler,
)
from ._contract import Contract, VLLMContractError

MODULES = (
    platform,
    request_validation,
    scheduler,
    model_runner,
    runner_choice,
    openai_chat,
    vllm_internals,
    attention_contracts,
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
    """Install every hook, in every process vLLM starts (idempotent; each passes through unless the engine runs
    with the flag)."""
    check_contracts()
    from vllm.platforms import current_platform

    # Start-up: validate the flag and choose the backend when the engine's config is built.
    if current_platform.is_cpu():
        platform.install_cpu()  # CpuPlatform.check_and_update_config, get_attn_backend_cls
    elif current_platform.is_cuda():
        platform.register_cuda_backend()  # vLLM's CUSTOM attention backend -> rcstat's FlashAttention backend
        platform.install_cuda()  # CudaPlatformBase.check_and_update_config
    else:
        platform.log_inert()
    # The chat response field needs the engine's config (the attribution processor configured): installed by the
    # config hook above, in the process that builds the config (the API server).
    platform.install_at_configure(openai_chat.maybe_install)
    request_validation.install()  # InputProcessor._validate_params
    scheduler.install()  # Scheduler.update_from_output, schedule; the KV cache managers' prefix-cache methods
    model_runner.install()  # GPUModelRunner.initialize_kv_cache, _prepare_inputs, execute_model, sample_tokens
    runner_choice.install_runner_property()  # VllmConfig.use_v2_model_runner (a property, replaced)
    runner_choice.install()  # Worker.init_device, CPUWorker.init_device


__all__ = ["Contract", "VLLMContractError", "all_contracts", "check_contracts", "install_all"]
