"""The contracts of the vLLM attention-backend classes the plugin's backends extend, and of the kernels they call
(imported through :mod:`rcstat_vllm.vllm_private.cpu_attention` and :mod:`rcstat_vllm.vllm_private.flash_attention`;
strings only here, so that every platform can check them without importing either backend).

``rcstat_vllm/attention/cpu_backend.py`` (CPU) and ``rcstat_vllm/attention/cuda_backend.py`` (CUDA) subclass vLLM's CPU
and FlashAttention backend, metadata builder and impl: they call the parent ``forward``/``build``/
``do_kv_cache_update`` unchanged for batches without compressed requests and wrap their results otherwise.
The CUDA backend also asks for head-major KV blocks and calls FlashAttention's kernels directly over head
pages. vLLM's CPU wheel imports the FlashAttention backend module (not its kernels), so those class contracts
are checked here too; the kernels only on CUDA builds.
"""

from __future__ import annotations

from rcstat_vllm.vllm_private.contract import Contract

_LAYER_FORWARD = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")
_KV_UPDATE = ("self", "layer", "key", "value", "kv_cache", "slot_mapping")
_BUILDER_INIT = ("self", "kv_cache_spec", "layer_names", "vllm_config", "device")
_BUILD = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")
_CPU = "vllm.v1.attention.backends.cpu_attn"
_FLASH = "vllm.v1.attention.backends.flash_attn"

CONTRACTS = (
    Contract("vllm.v1.attention.backend:AttentionBackend.forward_includes_kv_cache_update"),
    Contract("vllm.v1.attention.backend:AttentionBackend.supported_kv_cache_layouts", ("cls",)),
    # CPU backend
    Contract(f"{_CPU}:CPUAttentionBackendImpl.forward", _LAYER_FORWARD, platform="cpu"),
    Contract(f"{_CPU}:CPUAttentionBackendImpl.do_kv_cache_update", _KV_UPDATE, platform="cpu"),
    Contract(f"{_CPU}:CPUAttentionMetadataBuilder.__init__", _BUILDER_INIT, platform="cpu"),
    Contract(f"{_CPU}:CPUAttentionMetadataBuilder.build", _BUILD, platform="cpu"),
    # CUDA backend (FlashAttention)
    Contract(f"{_FLASH}:FlashAttentionImpl.forward", (*_LAYER_FORWARD, "output_scale", "output_block_scale")),
    Contract(f"{_FLASH}:FlashAttentionImpl.do_kv_cache_update", _KV_UPDATE),
    Contract(f"{_FLASH}:FlashAttentionMetadataBuilder.__init__", _BUILDER_INIT),
    Contract(f"{_FLASH}:FlashAttentionMetadataBuilder.build", _BUILD),
    Contract(f"{_FLASH}:FlashAttentionMetadataBuilder.supports_update_block_table"),
    Contract("vllm.v1.attention.backend:AttentionCGSupport.NEVER"),
    Contract("vllm.v1.kv_cache_layout:KVCacheLayout.LBHNC"),
    Contract(
        "vllm.v1.attention.backends.fa_utils:get_flash_attn_version",
        (
            "requires_alibi",
            "head_size",
            "head_size_v",
            "has_sinks",
            "requires_softcap",
            "kv_cache_block_size",
            "supports_fa4_hd256",
        ),
    ),
    Contract("vllm.v1.attention.backends.fa_utils:flash_attn_varlen_func", platform="cuda"),
    Contract("vllm.v1.attention.backends.fa_utils:reshape_and_cache_flash", platform="cuda"),
)
