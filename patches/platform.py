"""Platform hooks: validate the plugin flag at start-up and select the plugin's attention backend.

vLLM-CPU ignores ``--attention-backend`` (``CpuPlatform.get_attn_backend_cls`` always answers CPU_ATTN), so
the backend is chosen by wrapping that classmethod. Both hooks pass straight through when the server was
started without ``--additional-config '{"rcstat": ...}'``.
"""

from __future__ import annotations



from rcstat_vllm.api import EXTENSION_PATH
from rcstat_vllm.config import server_config

from ._contract import Contract, wrap_method

from rcstat_vllm.log import logger

CPU_BACKEND_PATH = "rcstat_vllm.backend.RCStatCPUBackend"

CONTRACTS = (
    Contract(
        "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
        ("cls", "selected_backend", "attn_selector_config"),
    ),
    Contract("vllm.platforms.cpu:CpuPlatform.check_and_update_config", ("cls", "vllm_config")),
    Contract("vllm.config:get_current_vllm_config_or_none", ()),
    Contract("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN"),
)


def _check_and_update_config(original):
    def wrapper(cls, vllm_config, *args, **kwargs):
        original(cls, vllm_config, *args, **kwargs)
        # Raises ConfigError naming the bad field: the server fails at start-up, not per request.
        config = server_config(vllm_config.additional_config)
        if config is None:
            return
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            # Compacted blocks hold other tokens than their prefix hash says: sharing them would corrupt
            # other requests' caches.
            logger.info("rcstat: prefix caching turned off (compacted KV blocks must never be shared)")
            cache.enable_prefix_caching = False
        parallel = vllm_config.parallel_config
        if not parallel.worker_extension_cls:
            # Lets LLM.collective_rpc read per-request results (rcstat_vllm.api).
            parallel.worker_extension_cls = EXTENSION_PATH
        elif parallel.worker_extension_cls != EXTENSION_PATH:
            logger.warning(
                "rcstat: worker_extension_cls is %s; rcstat_vllm.api results are unavailable",
                parallel.worker_extension_cls,
            )
        logger.info("rcstat: KV compression enabled with %s", config.to_dict())
        # The front end builds the config too: there the chat endpoint learns to return attribution.
        from rcstat_vllm.attribution.server import maybe_install

        maybe_install(vllm_config)

    return wrapper


def _get_attn_backend_cls(original):
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def wrapper(cls, selected_backend, attn_selector_config, *args, **kwargs):
        path = original(cls, selected_backend, attn_selector_config, *args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or server_config(vllm_config.additional_config) is None:
            return path
        if path != AttentionBackendEnum.CPU_ATTN.get_path():
            logger.warning("rcstat: backend %s is not supported; KV compression is off", path)
            return path
        return CPU_BACKEND_PATH

    return wrapper


def install() -> None:
    from vllm.platforms.cpu import CpuPlatform

    wrap_method(CpuPlatform, "check_and_update_config", _check_and_update_config)
    wrap_method(CpuPlatform, "get_attn_backend_cls", _get_attn_backend_cls)
