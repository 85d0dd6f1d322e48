"""The plugin's attention backend for vLLM-CPU (selected in place of CPU_ATTN when the flag is on).

Per step:
- the metadata builder asks the worker's :class:`~rcstat_vllm.worker.driver.WorkerCompression` for the step's plan:
  which requests finish their prefill now (to be compressed after this step's attention) and which are
  already compressed (their heads read and write their own head pages);
- a batch without compressed requests runs exactly vLLM's CPU path;
- a batch with compressed requests runs in two parts: its other rows as a sub-batch through vLLM's CPU path
  (metadata built by vLLM's builder for those rows), and the compressed rows *head-as-sequence*: every
  (request, KV head) becomes its own sequence with one KV head and its G query heads, over the head-page view
  of the cache (see :mod:`rcstat_vllm.paging.head_pages`), through vLLM's own CPU attention and cache-write kernels,
  on the ISA vLLM chose (``amx`` included: each head page is one of its prepacked tiles,
  :class:`~rcstat_vllm.paging.kv_layout.CPUAmxLayout`);
- after each layer's attention, the step's compaction jobs are scored (or, deferred, keep their window's
  queries); after the last layer's each selects what its heads keep and the worker reports the blocks that takes
  to the scheduler (rcstat_vllm/engine/block_exchange.py swaps in fresh blocks and frees the rest); the kept
  entries are copied before a later step's forward.

The planning and compaction are shared with the CUDA backend (:mod:`rcstat_vllm.worker.driver`); only the kernels
and the cache layout differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from rcstat_vllm.attention.cpu_head_attention import (
    add_cpu_scheduler_metadata,
    head_sequence_attention,
    write_head_sequence_kv,
)
from rcstat_vllm.attention.head_plan import plan_step_for_builder
from rcstat_vllm.attribution.capture import record_layer
from rcstat_vllm.log import logger
from rcstat_vllm.paging.cpu_kv_layout import cpu_cache_layout, layout_matches
from rcstat_vllm.paging.kv_layout import CPU_VEC, amx_unsupported_reason, head_page_caches
from rcstat_vllm.vllm_private.cpu_attention import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from rcstat_vllm.vllm_private.internals import impl_sinks, kv_scales_float, set_cpu_layers_isa
from rcstat_vllm.worker.driver import worker_compression
from rcstat_vllm.worker.step_plan import StepCompression


class RCStatCPUBackend(CPUAttentionBackend):
    # The backend writes new K/V itself: compressed heads append to their own pages, not to the slot vLLM
    # computed from the (now stale) logical block table.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return RCStatCPUImpl

    @staticmethod
    def get_builder_cls():
        return RCStatCPUMetadataBuilder


@dataclass
class RCStatCPUMetadata(CPUAttentionMetadata):
    rcstat: StepCompression | None = None


class RCStatCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.rcstat = worker_compression(vllm_config)
        dtype = kv_cache_spec.dtype
        # The ISA vLLM chose stays, AMX included (each head page is one of its prepacked tiles), except an AMX tiling
        # head pages do not know: then the vec kernels, which store plain rows on any x86 CPU.
        layout = cpu_cache_layout(self.isa, dtype, self.block_size, self.head_dim)
        #: whether this builder's layers are the ones compressed (False: a hybrid model's sliding-window group, whose
        #: layers run vLLM's CPU path untouched, AMX included)
        self.compresses = self.rcstat.attach_layers(
            layer_names,
            num_kv_heads=self.num_kv_heads,
            block_size=self.block_size,
            layout=layout or CPU_VEC,  # (None: the vec kernels below, or compression off)
            sinks=True,
        )
        if not self.compresses or self.rcstat.disabled_reason is not None:
            return  # nothing compressed: vLLM's own ISA whatever it is (bit-identical to vanilla)
        if layout is None and self.isa == "amx" and self.rcstat.config.enabled:
            # (not with method "none" server-wide: vLLM's choice stays, compression goes off below)
            reason = amx_unsupported_reason(dtype, self.block_size, self.head_dim)
            self.isa = "vec"
            set_cpu_layers_isa(self, layer_names)
            logger.info("rcstat: using the 'vec' CPU attention kernels: %s", reason)
        elif layout is None:
            self.rcstat.disable(f"KV cache layout of ISA {self.isa!r} is not one head pages know")
            return
        if not layout_matches(self.isa, dtype, self.block_size, self.head_dim):
            self.rcstat.disable(f"KV cache layout of ISA {self.isa!r} is not the one head pages expect")
        else:
            logger.info(
                "rcstat: compressed layers run vLLM-CPU's %r attention kernels (%d layers; head pages checked against "
                "its cache write at start-up)",
                self.isa,
                len(layer_names),
            )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.compresses:
            return RCStatCPUMetadata(**vars(base), rcstat=None)
        parent_build = super().build
        plan = plan_step_for_builder(self.rcstat, common_attn_metadata, lambda rows: parent_build(0, rows, fast_build))
        if plan.head_plan is not None:
            add_cpu_scheduler_metadata(
                plan.head_plan,
                group=self.num_heads // self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                isa=self.isa,
            )
        return RCStatCPUMetadata(**vars(base), rcstat=plan)


class RCStatCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is None:  # profiling / warm-up
            return output
        if not isinstance(attn_metadata, RCStatCPUMetadata):
            raise TypeError(f"rcstat backend got {type(attn_metadata).__name__} metadata")
        plan = attn_metadata.rcstat
        owner = None if plan is None else plan.owner
        layer_index = None if owner is None else owner.tracked_layer(layer.layer_name)
        if layer_index is None:  # not a layer the plugin compresses (sliding-window, a drafter's): vLLM's path
            return self._vllm_forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        record_layer(plan.attribution, layer_index, query, key)
        num_tokens = attn_metadata.num_actual_tokens
        head_plan = plan.head_plan
        if head_plan is None:  # no compressed request in the batch: vLLM's own path, unchanged
            self._vllm_forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        else:
            if plan.plain is not None:
                self._vllm_forward_rows(layer, query, key, value, kv_cache, plan.plain, output)
            key_pages, value_pages = head_page_caches(owner.page_cache(layer_index, kv_cache))
            k_scale, v_scale = kv_scales_float(layer)
            scales = dict(k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=self.kv_cache_dtype)
            if key is not None and value is not None:
                write_head_sequence_kv(
                    key[:num_tokens],
                    value[:num_tokens],
                    key_pages,
                    value_pages,
                    head_plan,
                    layer_index,
                    layer.isa,
                    **scales,
                )
            head_sequence_attention(
                query[:num_tokens],
                key_pages,
                value_pages,
                output[:num_tokens],
                head_plan,
                layer_index,
                scale=self.scale,
                isa=layer.isa,
                softcap=self.logits_soft_cap,
                sinks=impl_sinks(self),
                **scales,
            )
        owner.after_attention(plan, layer_index, query, kv_cache, self.scale)
        return output

    def _vllm_forward_rows(self, layer, query, key, value, kv_cache, rows, output):
        """vLLM's CPU path over the uncompressed rows of a batch that holds compressed ones."""
        tokens = rows.token_index
        rows_output = output.new_empty((tokens.numel(), *output.shape[1:]))
        self._vllm_forward(
            layer,
            query[tokens],
            None if key is None else key[tokens],
            None if value is None else value[tokens],
            kv_cache,
            rows.metadata,
            rows_output,
        )
        output[tokens] = rows_output

    def _vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        """vLLM's CPU attention, unchanged: the KV write (this backend includes it in forward), then attention."""
        if key is not None and value is not None:
            super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
