"""What the plugin's head pages cannot serve, found on the engine's config and its attention layers; each answer is
a reason (logged, compression turned off) or None."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rcstat_vllm.vllm_private.internals import (
    forward_context,
    impl_sinks,
    kv_cache_spec_kind,
    kv_offloading_size,
    shares_kv_cache,
)

#: KV cache groups whose size vLLM bounds by itself (a window): left as vLLM manages them beside the compressed
#: full-attention group (their KV does not grow with the context, so evicting from it frees little)
BOUNDED_KINDS = ("sliding window", "chunked local attention")
#: why the plugin cannot compress a KV cache group of each kind it refuses (the engine then serves uncompressed)
REFUSED_KINDS = {
    "MLA": "one latent vector per token serves every head: there is no per-head KV to evict",
    "Mamba / linear attention state": "a fixed-size recurrent state, not a per-token KV cache",
    "cross-attention": "the encoder's KV is not a prompt the decoder's observation window scores",
    "encoder-only attention": "nothing is decoded: no KV cache outlives the forward",
    "static sink tokens": "vLLM's static sink-token cache (SinkFullAttentionSpec) is not paged per head",
}


@dataclass(frozen=True)
class GroupChoice:
    """Which of the engine's KV cache groups the plugin compresses, and which it leaves to vLLM."""

    #: the compressed group's index in ``KVCacheConfig.kv_cache_groups`` (None: nothing is compressed)
    index: int | None
    #: why nothing is compressed (None when ``index`` is set)
    reason: str | None = None
    #: the compressed group's layers
    layer_names: tuple[str, ...] = ()
    #: the groups left as vLLM manages them: (kind, number of layers)
    left_to_vllm: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        """The start-up line: which layers are compressed and which are not, and why."""
        if self.index is None:
            return f"no layer compressed: {self.reason}"
        text = f"compressing the {len(self.layer_names)} full-attention layers (KV cache group {self.index})"
        if self.left_to_vllm:
            left = ", ".join(f"{n} {kind} layers" for kind, n in self.left_to_vllm)
            text += f"; left to vLLM, uncompressed: {left} (their KV is bounded by their window)"
        return text


def choose_compressed_group(groups: Sequence[tuple[Sequence[str], Any, bool]]) -> GroupChoice:
    """The KV cache group to compress among an engine's groups ``(layer names, spec, drafter's group)``
    (:func:`~rcstat_vllm.vllm_private.internals.kv_cache_groups`): the one group of plain full-attention layers,
    with every other group bounded by a window (sliding-window and chunked local layers of hybrid models, which
    vLLM's hybrid allocator keeps in groups of their own). Any other kind of group turns compression off, by name.

    Engine and workers read the same ``KVCacheConfig``, so both sides choose the same group."""
    full, bounded = [], []
    for index, (layer_names, spec, drafter) in enumerate(groups):
        kind = kv_cache_spec_kind(spec)
        if drafter:
            return GroupChoice(None, "speculative decoding: a drafter's KV cache group")
        if kind == "full attention":
            full.append(index)
        elif kind in BOUNDED_KINDS:
            bounded.append((kind, len(layer_names)))
        else:
            why = REFUSED_KINDS.get(kind, "a KV cache the plugin does not know how to page per head")
            return GroupChoice(None, f"{kind} layers are not supported ({why})")
    if not full:
        return GroupChoice(None, "no full-attention layer: every layer's KV is bounded by a window")
    if len(full) > 1:
        return GroupChoice(
            None,
            f"the full-attention layers are split over {len(full)} KV cache groups (vLLM's hybrid allocator groups "
            "layers in equal numbers): one block table per request is compacted",
        )
    merged: dict[str, int] = {}
    for kind, count in bounded:
        merged[kind] = merged.get(kind, 0) + count
    index = full[0]
    return GroupChoice(index, None, tuple(groups[index][0]), tuple(merged.items()))


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


def unsupported_layer_reason(vllm_config, layer_names, *, sinks: bool = False) -> str | None:
    """Attention features head-as-sequence does not reproduce (it passes no ALiBi slopes or window to the kernels;
    sinks only where the backend says so, ``sinks``), found on the layers' vLLM impls; None when there are none."""
    context = forward_context(vllm_config.compilation_config)
    for name in layer_names:
        impl = getattr(context.get(name), "impl", None)
        if impl is None:
            continue
        if getattr(impl, "alibi_slopes", None) is not None:
            return "ALiBi attention layers are not supported"
        if impl_sinks(impl) is not None and not sinks:
            return "attention sinks are not supported by this backend's head-as-sequence attention"
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
