"""The plugin's attention backend for CUDA: vLLM's FlashAttention backend plus head pages.

Registered as vLLM's ``CUSTOM`` attention backend and selected by the platform hook when the flag is on
(``patches/platform.py``). It shares everything with the CPU backend (:mod:`rcstat_vllm.worker.driver`: planning,
scoring, compaction, page bookkeeping, reports) except the kernels:

- it asks vLLM for head-major KV blocks (layout ``LBHNC``), so each (block, KV head) slice is one contiguous
  head page and ``[num_blocks * H, N, 1, D]`` is a view FlashAttention's paged kernels accept
  (:func:`rcstat_vllm.paging.kv_layout.flash_head_page_caches`);
- a batch without compressed requests runs FlashAttention exactly as vLLM does;
- a batch with compressed requests runs its other rows as a sub-batch through vLLM's FlashAttention path
  (metadata built by vLLM's builder for those rows), and the compressed rows head-as-sequence
  (:mod:`rcstat_vllm.attention.flash_head_attention`): vLLM's ``reshape_and_cache_flash`` writes each (token, KV head)
  into its head page and ``flash_attn_varlen_func`` attends with every (request, KV head) as a sequence of one KV head
  and its G query heads.

Verified on CPU tensors against torch references (tests/test_backend_cuda.py); vLLM's CUDA build cannot run on
the machines this was written on, so nothing here has run inside a CUDA vLLM (see docs/design.md, "CUDA").
"""

from __future__ import annotations

from dataclasses import dataclass

from rcstat_vllm.attention.decode_graph import DecodeGraphBuffers, DecodeGraphPlan, flash_decode_graph_forward
from rcstat_vllm.attention.flash_head_attention import HeadPageKernels, flash_head_sequence_forward
from rcstat_vllm.attention.head_plan import plan_step_for_builder
from rcstat_vllm.attribution.capture import record_layer
from rcstat_vllm.capabilities import engine_unsupported_reason, model_has_attention_sinks
from rcstat_vllm.config import server_config
from rcstat_vllm.paging.kv_layout import FLASH
from rcstat_vllm.vllm_private.flash_attention import (
    AttentionCGSupport,
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
    KVCacheLayout,
    flash_attn_varlen_func,
    get_flash_attn_version,
    reshape_and_cache_flash,
)
from rcstat_vllm.vllm_private.internals import backend_invalid_reasons, kv_scales
from rcstat_vllm.worker.driver import worker_compression
from rcstat_vllm.worker.step_plan import StepCompression, rows_match

#: The KV cache layout head pages need on the GPU: a block's heads one after another, each [N, 2D].
HEAD_MAJOR_LAYOUT = KVCacheLayout.LBHNC


class RCStatFlashBackend(FlashAttentionBackend):
    # The backend writes new K/V itself: compressed heads append to their own pages, not to the slot vLLM
    # computed from the (now stale) logical block table.
    forward_includes_kv_cache_update: bool = True

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (HEAD_MAJOR_LAYOUT,)

    @staticmethod
    def get_impl_cls():
        return RCStatFlashImpl

    @staticmethod
    def get_builder_cls():
        return RCStatFlashMetadataBuilder


@dataclass
class RCStatFlashMetadata(FlashAttentionMetadata):
    rcstat: StepCompression | None = None
    #: a single-token decode step under ``cuda_graphs: full_decode``: every row head-as-sequence (None: today's path)
    decode_graph: DecodeGraphPlan | None = None


def full_decode_graphs(vllm_config) -> bool:
    """Whether the flag asks for full CUDA graphs of decode steps (``cuda_graphs: full_decode``)."""
    config = server_config(getattr(vllm_config, "additional_config", None))
    return config is not None and config.cuda_graphs == "full_decode"


class RCStatFlashMetadataBuilder(FlashAttentionMetadataBuilder):
    # cuda_graphs "piecewise" (the default): head-as-sequence batches change shape with every compressed request's
    # kept counts, and a graph captured over vLLM's logical block table would read a compressed request's freed
    # prompt blocks: attention runs eager. vLLM then turns its default FULL_AND_PIECEWISE into PIECEWISE (graphs
    # for everything but attention), for every batch, method "none" included; an explicit FULL mode fails at
    # start-up (vLLM's own check). cuda_graphs "full_decode": get_cudagraph_support says
    # UNIFORM_SINGLE_TOKEN_DECODE and single-token decode batches run every row head-as-sequence over persistent
    # buffers (rcstat_vllm/attention/decode_graph.py). See docs/design.md, "CUDA graphs".
    _cudagraph_support = AttentionCGSupport.NEVER
    # Metadata must be built per KV-cache group from the step's plan, never copied with a new block table.
    supports_update_block_table = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # Single-token decodes only: the plugin turns compression off under speculative decoding (the one case
        # UNIFORM_BATCH adds), and wider uniform batches (prefill chunks) take today's path, which no graph holds.
        if full_decode_graphs(vllm_config):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.rcstat = worker_compression(vllm_config)
        #: whether this builder's layers are the ones compressed (False: a hybrid model's sliding-window group)
        self.compresses = self.rcstat.attach_layers(
            layer_names, num_kv_heads=kv_cache_spec.num_kv_heads, block_size=kv_cache_spec.block_size, layout=FLASH
        )
        #: the persistent head-sequence buffers of full-graph decode steps (None: cuda_graphs piecewise)
        self.decode_graph: DecodeGraphBuffers | None = None
        if not self.compresses:
            return
        reason = unsupported_reason(vllm_config, layer_names, kv_cache_spec)
        if reason is not None:
            self.rcstat.disable(reason)
        elif full_decode_graphs(vllm_config):
            self.decode_graph = DecodeGraphBuffers.for_engine(
                vllm_config, self.rcstat.num_layers, kv_cache_spec.num_kv_heads, kv_cache_spec.block_size, device
            )

    def _graph_layout(self, common_attn_metadata) -> bool:
        """Whether this batch runs every row head-as-sequence over the graph buffers: single-token decodes under
        ``cuda_graphs: full_decode``, compression on (an engine running uncompressed keeps vLLM's own graphs)."""
        return (
            self.decode_graph is not None
            and self.rcstat.disabled_reason is None
            and common_attn_metadata.max_query_len == 1
        )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.compresses:
            return base  # FlashAttention's own metadata: the impl runs vLLM's path for these layers
        if self._graph_layout(common_attn_metadata):
            return self._build_decode_graph(base, common_attn_metadata)
        parent_build = super().build
        plan = plan_step_for_builder(self.rcstat, common_attn_metadata, lambda rows: parent_build(0, rows, fast_build))
        return RCStatFlashMetadata(**vars(base), rcstat=plan)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """vLLM's capture of a decode batch (dummy rows, no step): the graph layout, every row plain."""
        if not self.compresses or not self._graph_layout(common_attn_metadata):
            return super().build_for_cudagraph_capture(common_attn_metadata)
        assert self.decode_graph is not None
        base = super().build(0, common_attn_metadata)
        graph = self.decode_graph.fill(common_attn_metadata, common_attn_metadata.num_reqs, self._layer_base())
        return RCStatFlashMetadata(**vars(base), rcstat=StepCompression(owner=self.rcstat), decode_graph=graph)

    def _layer_base(self) -> tuple[int, ...] | None:
        space = self.rcstat.space
        return None if space is None else space.layer_base

    def _build_decode_graph(self, base, common_attn_metadata):
        """A single-token decode step: the step's plan (compressed rows grow their head pages, decode compaction
        watched), then every row into the graph buffers. Steps with host work in attention (queries kept, a job
        scored, attribution) were dispatched piecewise (``patches/model_runner.py``): the impl's forward runs."""
        assert self.decode_graph is not None
        plan = self.rcstat.plan_step(common_attn_metadata)
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        real = len(plan.seq_lens) if plan.seq_lens else real_rows(query_start)
        assert rows_match(real, common_attn_metadata.num_reqs, query_start)
        self.rcstat.check_graph_step(plan)
        graph = self.decode_graph.fill(common_attn_metadata, real, self._layer_base(), plan.compressed, plan.seq_lens)
        return RCStatFlashMetadata(**vars(base), rcstat=plan, decode_graph=graph)


def real_rows(query_start: list[int]) -> int:
    """Rows with a query, at the front of a batch whose padding rows have none."""
    return sum(1 for row in range(len(query_start) - 1) if query_start[row + 1] > query_start[row])


#: FlashAttention versions whose paged varlen kernel head-as-sequence calls (``block_table`` + ``seqused_k``, one KV
#: head per sequence, any block size FlashAttention's backend accepts).
SUPPORTED_FA_VERSIONS = (2, 3)


def unsupported_reason(vllm_config, layer_names, kv_cache_spec=None) -> str | None:
    """Why head-as-sequence FlashAttention cannot serve this engine, or None. Checked when vLLM builds the metadata
    builder (start-up), so an unsupported engine runs uncompressed with the reason logged once, never failing
    mid-forward. The layers' attention features are checked for both backends by ``WorkerCompression.attach_layers``
    and the cache tensors' strides when they are bound (``FlashLayout.unsupported_reason``)."""
    layout = vllm_config.cache_config.kv_cache_layout
    if layout is not None and layout != HEAD_MAJOR_LAYOUT.name:
        return f"KV cache layout {layout} is not head-major ({HEAD_MAJOR_LAYOUT.name})"
    if vllm_config.cache_config.cache_dtype not in ("auto", "float16", "bfloat16"):
        return f"quantized KV cache ({vllm_config.cache_config.cache_dtype}): scores would read scaled values"
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        return "decode context parallelism shards each request's KV across ranks"
    if kv_cache_spec is None:
        return None
    scheduler_block_size = vllm_config.cache_config.block_size
    if kv_cache_spec.block_size != scheduler_block_size:
        # vLLM splits blocks into smaller kernel blocks for some FlashAttention versions and head sizes; head pages
        # are (block, KV head) slices of the scheduler's blocks, whose ids the page tables hold.
        return (
            f"the attention kernel's block size ({kv_cache_spec.block_size} tokens) differs from the scheduler's "
            f"({scheduler_block_size}): vLLM splits blocks for this FlashAttention version and head size"
        )
    version = flash_attn_version(kv_cache_spec)
    if version not in SUPPORTED_FA_VERSIONS:
        return (
            f"FlashAttention version {version} (head size {kv_cache_spec.head_size}): head-as-sequence is written for "
            f"the paged varlen kernel of versions {', '.join(map(str, SUPPORTED_FA_VERSIONS))}"
        )
    return None


def cuda_backend_unsupported_reason(vllm_config, device_capability) -> str | None:
    """Why the plugin's CUDA backend (FlashAttention with head pages, ``rcstat_vllm/attention/cuda_backend.py``) cannot
    serve this engine, from its config and the GPU's compute capability (None: not known), or None when it can.

    Asked by the platform hook before vLLM chooses a backend: with a reason the engine runs the backend vLLM would
    have chosen without the plugin, uncompressed, instead of refusing to start ("Selected backend ... is not valid")
    or running the plugin's backend with nothing to compress. FlashAttention's own limits are answered by vLLM's
    check of the plugin's backend class (a FlashAttention subclass), so they follow vLLM's.
    """
    reason = engine_unsupported_reason(vllm_config)
    if reason is not None:
        return reason
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
        # FlashAttention takes one sink per head of a call, the same for every sequence (and only from FA3, sm90): the
        # CPU backend's answer, one call per KV head with that head's sinks, is not written for FlashAttention.
        return (
            "attention sinks in the model's attention layers: the plugin's FlashAttention head-as-sequence does "
            "not pass them (the CPU backend does)"
        )
    if device_capability is None:
        return None
    invalid = backend_invalid_reasons(RCStatFlashBackend, vllm_config, device_capability, has_sink=False)
    if invalid:
        return f"vLLM's FlashAttention backend cannot serve this engine ({'; '.join(invalid)})"
    return None


def flash_attn_version(kv_cache_spec) -> int | None:
    """The FlashAttention version vLLM's builder picks for this spec (as ``FlashAttentionMetadataBuilder``)."""
    return get_flash_attn_version(
        head_size=kv_cache_spec.head_size,
        head_size_v=getattr(kv_cache_spec, "head_size_v", None),
        kv_cache_block_size=kv_cache_spec.block_size,
        supports_fa4_hd256=True,
    )


class FlashAttentionHeadPageKernels(HeadPageKernels):
    """vLLM's own FlashAttention cache-write and varlen attention, over head pages (one KV head each)."""

    def __init__(self, impl: FlashAttentionImpl):
        self.impl = impl

    def write(self, keys, values, key_pages, value_pages, slots, layer):
        reshape_and_cache_flash(
            keys, values, key_pages, value_pages, slots, self.impl.kv_cache_dtype, *kv_scales(layer)
        )

    def attend(self, queries, key_pages, value_pages, out, plan, layer_index, *, scale, softcap, layer):
        flash_attn_varlen_func(
            q=queries,
            k=key_pages,
            v=value_pages,
            out=out,
            cu_seqlens_q=plan.query_start_loc,
            max_seqlen_q=plan.max_query_len,
            seqused_k=plan.seq_lens[layer_index],
            max_seqlen_k=plan.max_seq_lens[layer_index],
            softmax_scale=scale,
            causal=True,
            block_table=plan.block_tables[layer_index],
            softcap=softcap,
            fa_version=self.impl.vllm_flash_attn_version,
        )


class RCStatFlashImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_page_kernels = FlashAttentionHeadPageKernels(self)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if attn_metadata is None or not isinstance(attn_metadata, RCStatFlashMetadata):
            # Profiling run (None) or a batch this backend did not plan: vLLM's path.
            if attn_metadata is not None and key is not None and value is not None:
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        plan = attn_metadata.rcstat
        owner = plan.owner
        layer_index = owner.tracked_layer(layer.layer_name)
        if layer_index is not None:
            record_layer(plan.attribution, layer_index, query, key)
        num_tokens = attn_metadata.num_actual_tokens
        if layer_index is not None and attn_metadata.decode_graph is not None:
            flash_decode_graph_forward(
                self.head_page_kernels,
                query,
                key,
                value,
                owner.page_cache(layer_index, kv_cache),
                output,
                attn_metadata.decode_graph,
                layer_index,
                scale=self.scale,
                softcap=self.logits_soft_cap,
                layer=layer,
            )
        elif layer_index is None or plan.head_plan is None:
            # A layer the plugin does not compress (a drafter's), or no compressed request in the batch: vLLM's
            # own path, unchanged.
            if key is not None and value is not None:
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        else:
            if plan.plain is not None:
                self._vllm_forward_rows(layer, query, key, value, kv_cache, plan.plain, output)
            flash_head_sequence_forward(
                self.head_page_kernels,
                query[:num_tokens],
                None if key is None else key[:num_tokens],
                None if value is None else value[:num_tokens],
                owner.page_cache(layer_index, kv_cache),
                output[:num_tokens],
                plan.head_plan,
                layer_index,
                scale=self.scale,
                softcap=self.logits_soft_cap,
                layer=layer,
            )
        if layer_index is not None:
            owner.after_attention(plan, layer_index, query, kv_cache, self.scale)
        return output

    def _vllm_forward_rows(self, layer, query, key, value, kv_cache, rows, output):
        """vLLM's FlashAttention path over the uncompressed rows of a batch that holds compressed ones."""
        tokens = rows.token_index
        rows_query = query[tokens]
        rows_key = None if key is None else key[tokens]
        rows_value = None if value is None else value[tokens]
        rows_output = output.new_empty((tokens.numel(), *output.shape[1:]))
        if rows_key is not None and rows_value is not None:
            self.do_kv_cache_update(layer, rows_key, rows_value, kv_cache, rows.metadata.slot_mapping)
        super().forward(layer, rows_query, rows_key, rows_value, kv_cache, rows.metadata, rows_output)
        output[tokens] = rows_output
