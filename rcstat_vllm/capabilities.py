"""What the plugin's head pages cannot serve, found on the engine's config and its attention layers; each answer is
a reason (logged, compression turned off) or None."""

from __future__ import annotations

from rcstat_vllm.vllm_internals import (
    backend_invalid_reasons,
    forward_context,
    impl_sinks,
    kv_offloading_size,
    shares_kv_cache,
)


def engine_unsupported_reason(vllm_config) -> str | None:
    """Engine features under which the plugin compresses nothing (the engine still serves, uncompressed)."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        # Stages hold different layers but share one block table, and run different steps at a time:
        # an agreement per step would pair different batches.
        return "pipeline parallelism: stages cannot agree on the blocks a request keeps"
    if getattr(vllm_config, "speculative_config", None) is not None:
        # EAGLE/MTP/draft-model layers keep their KV in the same blocks as the target's: compaction would free
        # the drafter's prompt KV under it (head pages hold only the target's layers).
        return "speculative decoding: the drafter's KV lives in the blocks compaction would free"
    if getattr(parallel, "use_ubatching", False):
        # Metadata is built per micro-batch: a step's plan would see part of the batch the worker was handed.
        return "micro-batching (DBO / ubatching): each micro-batch plans only part of the step"
    return None


def cuda_backend_unsupported_reason(vllm_config, device_capability) -> str | None:
    """Why the plugin's CUDA backend (FlashAttention with head pages, ``rcstat_vllm/backend_cuda.py``) cannot serve
    this engine, from its config and the GPU's compute capability (None: not known), or None when it can.

    Asked by the platform hook before vLLM chooses a backend: with a reason the engine runs the backend vLLM would
    have chosen without the plugin, uncompressed, instead of refusing to start ("Selected backend ... is not valid")
    or running the plugin's backend with nothing to compress. FlashAttention's own limits are answered by vLLM's
    check of the plugin's backend class (a FlashAttention subclass), so they follow vLLM's.
    """
    reason = engine_unsupported_reason(vllm_config)
    if reason is not None:
        return reason
    # Imported here: the CUDA backend's module imports the worker, which imports this module.
    from rcstat_vllm.backend_cuda import RCStatFlashBackend, unsupported_reason

    reason = unsupported_reason(vllm_config, ())  # what the builder would refuse from the config alone
    if reason is not None:
        return reason
    model = vllm_config.model_config
    if model is None:
        return None
    if model.use_mla:
        return "MLA (multi-head latent attention) model: the plugin's FlashAttention backend serves no MLA"
    if not RCStatFlashBackend.supports_dtype(model.dtype):
        return f"model dtype {str(model.dtype).removeprefix('torch.')}: FlashAttention runs float16 and bfloat16 only"
    if device_capability is not None and not RCStatFlashBackend.supports_compute_capability(device_capability):
        return (
            f"GPU compute capability {device_capability.major}.{device_capability.minor}: FlashAttention needs "
            "8.0 or newer"
        )
    if not RCStatFlashBackend.supports_head_size(model.get_head_size()):
        return f"head size {model.get_head_size()}: not one FlashAttention supports"
    if model_has_attention_sinks(model):
        # Head-as-sequence passes no sinks to FlashAttention (and FlashAttention has them only from FA3, sm90).
        return "attention sinks in the model's attention layers: the plugin's FlashAttention backend cannot serve them"
    if device_capability is None:
        return None
    invalid = backend_invalid_reasons(RCStatFlashBackend, vllm_config, device_capability, has_sink=False)
    if invalid:
        return f"vLLM's FlashAttention backend cannot serve this engine ({'; '.join(invalid)})"
    return None


#: HF config ``model_type`` of the models whose every attention layer has sinks in vLLM 0.32 (gpt-oss)
SINK_MODEL_TYPES = ("gpt_oss",)
#: HF config flags with which vLLM 0.32's model code gives (some of) a model's attention layers sinks
SINK_CONFIG_FLAGS = ("add_swa_attention_sink_bias", "swa_attention_sink_enabled")


def model_has_attention_sinks(model_config) -> bool:
    """Whether vLLM's model code will give the model's attention layers sinks, read from the HF config as that code
    reads it (vLLM learns it only when the model builds its layers, after the backend is chosen). A model missed
    here is still caught when the plugin's builder sees its layers (``unsupported_layer_reason``)."""
    config = getattr(model_config, "hf_text_config", None)
    if config is None:
        return False
    model_type = getattr(config, "model_type", None)
    if model_type in SINK_MODEL_TYPES:
        return True
    if model_type in ("granite", "granitemoe"):
        # vllm/model_executor/models/granite.py: sinks with layer types unless ``attention_sinks`` says otherwise
        return bool(getattr(config, "attention_sinks", getattr(config, "layer_types", None) is not None))
    return any(bool(getattr(config, flag, False)) for flag in SINK_CONFIG_FLAGS)


def unsupported_layer_reason(vllm_config, layer_names) -> str | None:
    """Attention features head-as-sequence does not reproduce (it passes no ALiBi slopes, sinks or window to
    the kernels), found on the layers' vLLM impls; None when there are none."""
    context = forward_context(vllm_config.compilation_config)
    for name in layer_names:
        impl = getattr(context.get(name), "impl", None)
        if impl is None:
            continue
        if getattr(impl, "alibi_slopes", None) is not None:
            return "ALiBi attention layers are not supported"
        if impl_sinks(impl) is not None:
            return "attention sinks are not supported"
        if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
            return "sliding-window attention layers are not supported"
    return None


def engine_not_pooled_reason(vllm_config, kernel_block_size: int) -> str | None:
    """Engine features under which a request's blocks are not simply L * H head pages it alone owns."""
    if vllm_config.cache_config.block_size != kernel_block_size:
        return (
            f"vLLM splits each {vllm_config.cache_config.block_size}-token block into kernel blocks of "
            f"{kernel_block_size} tokens"
        )
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector moves blocks between engines"
    if kv_offloading_size(vllm_config.cache_config):
        return "KV offloading copies blocks to another tier"
    context = forward_context(vllm_config.compilation_config)
    if any(shares_kv_cache(layer) for layer in context.values()):
        return "some layers share another layer's KV cache"
    return None
