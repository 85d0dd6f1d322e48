"""Platform hooks: validate the plugin flag at start-up and select the plugin's attention backend.

- CPU: vLLM-CPU ignores ``--attention-backend`` (``CpuPlatform.get_attn_backend_cls`` always answers CPU_ATTN),
  so the backend is chosen by wrapping that classmethod.
- CUDA: the plugin registers its backend as vLLM's ``CUSTOM`` attention backend and, when the flag is on and
  no backend was asked for, sets ``attention_config.backend`` to it; vLLM's own selector then validates it. An
  engine the plugin's backend cannot serve (``rcstat_vllm.attention.cuda_backend.cuda_backend_unsupported_reason``: MLA,
  float32, a GPU below sm80, sinks, ...) keeps the backend unset, so vLLM chooses as without the plugin, and runs
  uncompressed.

Both hooks pass straight through when the server was started without ``--additional-config '{"rcstat": ...}'``.
"""

from __future__ import annotations

from rcstat_vllm.api import EXTENSION_PATH
from rcstat_vllm.config import server_config
from rcstat_vllm.log import logger

from ._contract import Contract, wrap_method

CPU_BACKEND_PATH = "rcstat_vllm.attention.cpu_backend.RCStatCPUBackend"
CUDA_BACKEND_PATH = "rcstat_vllm.attention.cuda_backend.RCStatFlashBackend"

CONTRACTS = (
    Contract(
        "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
        ("cls", "selected_backend", "attn_selector_config"),
        platform="cpu",
    ),
    Contract("vllm.platforms.cpu:CpuPlatform.check_and_update_config", ("cls", "vllm_config"), platform="cpu"),
    Contract("vllm.platforms.cuda:CudaPlatformBase.check_and_update_config", ("cls", "vllm_config"), platform="cuda"),
    Contract("vllm.config:get_current_vllm_config_or_none", ()),
    Contract("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN"),
    Contract("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM"),
    Contract("vllm.v1.attention.backends.registry:register_backend", ("backend", "class_path")),
    Contract("vllm.v1.attention.backends.registry:_ATTN_OVERRIDES"),
    Contract("vllm.config.attention:AttentionConfig"),
    Contract("vllm.v1.attention.selector:_cached_get_attn_backend.cache_clear"),
    Contract("vllm.platforms.interface:Platform.get_device_capability", ("cls", "device_id")),
)


def announce(config, compression_off: bool = False) -> None:
    """The start-up lines saying what the flag does in this engine (a decode-time caveat included: never silent)."""
    if compression_off:
        logger.info("rcstat: plugin flag on with %s; KV compression is off (reason above)", config.to_dict())
        return
    logger.info("rcstat: KV compression enabled with %s", config.to_dict())
    if config.eviction == "lazy" and config.method != "none":
        logger.info(
            "rcstat: lazy eviction: a request is compacted only when the KV pool runs short (those freeing "
            'most blocks first); until then it keeps its full cache. "eviction": "eager" compacts every '
            "request after its prefill"
        )
    if config.method == "rc" and not config.budget_mode and config.local_contrast:
        logger.info(
            "rcstat: threshold mode (c = %g): local_contrast does not apply (Eq. 9 compares RC's own scores "
            "with c); it applies to budgets (target_ratio)",
            config.c,
        )
    if config.decode_compression:
        logger.info(
            "rcstat: decode-time compression on: generated KV compacted to %d tokens per KV head on average every "
            "%d tokens, earlier when the KV pool is about to run short (instead of preempting)%s",
            config.decode_budget,
            config.decode_interval,
            " (lazy eviction: only once a request's prompt was compacted; requests that never meet memory pressure "
            "keep their generated KV whole)"
            if config.eviction == "lazy"
            else "",
        )


def _configure_engine(vllm_config, config, compression_off: bool = False) -> None:
    """What the flag changes in vLLM's config, on every platform (``compression_off``: the platform hook found the
    plugin's backend cannot serve this engine and said why; the engine runs uncompressed)."""
    # Prefix caching stays as the user set it: compaction copies kept KV into fresh blocks and never caches them
    # (rcstat_vllm/engine/block_exchange.py).
    from .runner_choice import check_runner_choice

    check_runner_choice(vllm_config)
    scheduler = vllm_config.scheduler_config
    if getattr(scheduler, "async_scheduling", False) is not False:
        if config.async_scheduling == "off":
            logger.info(
                "rcstat: asynchronous scheduling turned off (async_scheduling: off, the default until a GPU window "
                "has measured 'keep')"
            )
            scheduler.async_scheduling = False
        else:
            # A compaction's plan then reaches the scheduler a step late, while the next step is in flight over the
            # request's old blocks: its copy carries that step's tokens over (EngineCompaction.apply_reports).
            logger.info("rcstat: asynchronous scheduling kept (async_scheduling: keep)")
    if config.cuda_graphs == "full_decode" and not compression_off:
        # Read by the CUDA backend's builder (RCStatFlashMetadataBuilder.get_cudagraph_support); others ignore it.
        logger.info(
            "rcstat: full CUDA graphs for single-token decode steps (cuda_graphs: full_decode): every row runs "
            "head-as-sequence in those steps; steps with host work in attention run piecewise"
        )
    parallel = vllm_config.parallel_config
    if not parallel.worker_extension_cls:
        # Lets LLM.collective_rpc read per-request results (rcstat_vllm.api).
        parallel.worker_extension_cls = EXTENSION_PATH
    elif parallel.worker_extension_cls != EXTENSION_PATH:
        logger.warning(
            "rcstat: worker_extension_cls is %s; rcstat_vllm.api results are unavailable",
            parallel.worker_extension_cls,
        )
    announce(config, compression_off)
    # The front end builds the config too: there the chat endpoint learns to return attribution.
    for installer in _AT_CONFIGURE:
        installer(vllm_config)


#: hooks that need the engine's config (``install_all`` names them): run by the config hook, with the flag, in the
#: process that builds the config
_AT_CONFIGURE: list = []


def install_at_configure(installer) -> None:
    """Run ``installer(vllm_config)`` whenever an engine with the flag is configured in this process (idempotent)."""
    if installer not in _AT_CONFIGURE:
        _AT_CONFIGURE.append(installer)


def select_cuda_backend(attention_config, unsupported_reason: str | None = None) -> bool:
    """Point an unset ``attention_config.backend`` at the plugin's CUDA backend; False (logged once) when the
    user asked for another backend, which then runs without compression, or when ``unsupported_reason`` says why
    the plugin's backend cannot serve this engine: the backend then stays unset (vLLM chooses as it would without
    the plugin) and requests run uncompressed."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    if attention_config.backend is None:
        if unsupported_reason is not None:
            logger.warning(
                "rcstat: %s; KV compression is off, requests run uncompressed on the attention backend vLLM chooses",
                unsupported_reason,
            )
            return False
        attention_config.backend = custom
        logger.info("rcstat: attention backend %s (FlashAttention with head pages)", CUDA_BACKEND_PATH)
        return True
    if attention_config.backend == custom:
        return True
    logger.warning(
        "rcstat: --attention-backend %s was asked for; KV compression needs the plugin's backend (CUSTOM), "
        "so requests run uncompressed",
        attention_config.backend.name,
    )
    return False


def _check_and_update_config(original, *, select_backend: bool = False):
    """``select_backend``: point an unset attention backend at the plugin's (CUDA; CPU ignores the setting)."""

    def wrapper(cls, vllm_config, *args, **kwargs):
        config = server_config(vllm_config.additional_config)  # ConfigError naming the bad field, at start-up
        # vLLM memoizes its backend choice per process, keyed without the flag: an engine built after another
        # one in the same process (with the flag or without) must choose again.
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
        compression_off = False
        if config is not None and select_backend:
            # Before vLLM's own checks, which size blocks and graphs for the chosen backend.
            attention_config = vllm_config.attention_config
            reason = None
            if attention_config.backend is None:  # an explicit choice stands, whatever it is
                from rcstat_vllm.attention.cuda_backend import cuda_backend_unsupported_reason  # imports FlashAttention

                reason = cuda_backend_unsupported_reason(vllm_config, cls.get_device_capability())
            compression_off = not select_cuda_backend(attention_config, reason)
        original(cls, vllm_config, *args, **kwargs)
        if config is not None:
            _configure_engine(vllm_config, config, compression_off)

    return wrapper


def _check_and_update_config_selecting_backend(original):
    return _check_and_update_config(original, select_backend=True)


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


def register_cuda_backend() -> None:
    """Register the CUDA backend as vLLM's CUSTOM backend, unless another plugin already did."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

    current = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if current not in (None, CUDA_BACKEND_PATH):
        logger.warning("rcstat: the CUSTOM attention backend is already %s; not registering rcstat's", current)
        return
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)


def install_cpu() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    wrap_method(platform_cls, "check_and_update_config", _check_and_update_config)
    wrap_method(platform_cls, "get_attn_backend_cls", _get_attn_backend_cls)


def install_cuda() -> None:
    from vllm.platforms import current_platform

    wrap_method(type(current_platform), "check_and_update_config", _check_and_update_config_selecting_backend)


def log_inert() -> None:
    from vllm.platforms import current_platform

    logger.info(
        "rcstat: no KV-compression backend for platform %s; the plugin stays inert", type(current_platform).__name__
    )
