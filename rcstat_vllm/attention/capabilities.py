"""What the plugin's head pages cannot serve, found on the engine's config and its attention layers; each answer is
a reason (logged, compression turned off) or None."""

from __future__ import annotations

from rcstat_vllm.vllm_private.internals import (
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
