"""The plugin's attention backend for vLLM-CPU (selected in place of CPU_ATTN when the flag is on).

Per step:
- the metadata builder learns the batch's requests (``begin_step``, from patches/model_runner.py) and plans
  which requests finish their prefill now (to be compressed after this step's attention) and which are
  already compressed (their heads read and write their own head pages);
- a batch without compressed requests runs exactly vLLM's CPU path;
- a batch with compressed requests runs *head-as-sequence*: every (request, KV head) becomes its own
  sequence with one KV head and its G query heads, over the head-page view of the cache
  (see :mod:`rcstat_vllm.head_pages`), through vLLM's own CPU attention and cache-write kernels;
- after a layer's attention, requests finishing their prefill are scored, selected and compacted in that
  layer; after the forward, :meth:`RCStatCPUMetadataBuilder.pop_reports` decides how many blocks each
  request keeps and reports it to the scheduler (patches/scheduler.py frees the rest).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from rcstat_vllm.attribution.capture import attribution_capture
from rcstat_vllm.compression import LayerCompressor, plan_compression, request_config, window_queries
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.head_attention import HeadSequencePlan, head_sequence_attention, make_head_plan, write_head_sequence_kv
from rcstat_vllm.head_pages import CompactedRequest, head_page_caches
from rcstat_vllm.log import logger
from rcstat_vllm.patches.cpu_kv_layout import layout_matches
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.step import StepInfo

#: How many finished requests' results the worker keeps for the Python API.
MAX_RESULTS = 100_000


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
    head_plan: HeadSequencePlan | None = None
    #: batch row -> (request id, config, token range) of requests compressed after this step's attention
    to_compress: list = field(default_factory=list)
    #: (request id, query start, query end, how many) of non-final prefill chunks whose queries are kept
    to_save: list = field(default_factory=list)
    builder: "RCStatCPUMetadataBuilder | None" = None
    #: rows of requests that asked for attribution (rcstat_vllm.attribution.capture), None if none did
    attribution: list | None = None


class RCStatCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from rcstat_vllm.patches import model_runner

        model_runner.install()
        self.config: RCStatConfig = server_config(vllm_config.additional_config) or RCStatConfig()
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        self.disabled_reason = None
        if self.isa == "amx" and self.config.enabled:
            # AMX prepacks KV blocks; head pages need plain rows. The vec kernels read plain rows on any
            # x86 CPU. With method "none" server-wide, vLLM's own choice stays (bit-identical to vanilla).
            self.isa = "vec"
            self._set_isa_to_layers(layer_names)
            logger.info("rcstat: using the 'vec' CPU attention kernels (AMX prepacked blocks cannot be compacted)")
        if not layout_matches(self.isa, kv_cache_spec.dtype, self.block_size, self.head_dim):
            self.disabled_reason = f"KV cache layout of ISA {self.isa!r} is not the one head pages expect"
        elif self.window_size != -1:
            self.disabled_reason = "sliding-window attention layers are not supported"
        elif vllm_config.parallel_config.tensor_parallel_size > 1:
            # Each rank holds other KV heads but all share the scheduler's block table: the blocks a request
            # keeps must be the max over ranks (one all-reduce in CompactedRequest.finalize). Not built yet.
            self.disabled_reason = "tensor parallelism: ranks do not yet agree on the blocks a request keeps"
            logger.warning("rcstat: compression off for this engine: %s", self.disabled_reason)
        self._step: StepInfo | None = None
        self._states: dict[str, CompactedRequest] = {}
        self._pending: dict[str, LayerCompressor] = {}
        #: per request in chunked prefill, per layer: trailing queries of its chunks so far
        self._saved_queries: dict[str, list[torch.Tensor | None]] = {}
        self._reports: list[CompressionReport] = []
        self.results: OrderedDict[str, CompressionReport] = OrderedDict()
        logger.info("rcstat: attention backend active for %d layers", len(layer_names))

    # ---- step protocol (called by patches/model_runner.py) ----

    def begin_step(self, info: StepInfo) -> None:
        self._finalize_pending()
        for req_id in info.dropped_req_ids:
            self._states.pop(req_id, None)
            self._saved_queries.pop(req_id, None)
        self._step = info

    def pop_reports(self) -> list[CompressionReport]:
        self._finalize_pending()
        reports, self._reports = self._reports, []
        return reports

    def compression_results(self) -> dict[str, dict]:
        return {req_id: report.to_dict() for req_id, report in self.results.items()}

    def _record(self, report: CompressionReport) -> None:
        self._reports.append(report)
        self.results[report.req_id] = report
        while len(self.results) > MAX_RESULTS:
            self.results.popitem(last=False)
        logger.debug(
            "rcstat: request %s (%d prompt tokens, %s): compression ratio %.3f, %d blocks freed%s",
            report.req_id,
            report.num_prompt_tokens,
            report.method,
            report.compression_ratio,
            report.blocks_freed,
            f" (skipped: {report.skipped_reason})" if report.skipped_reason else "",
        )

    def _finalize_pending(self) -> None:
        for req_id, compressor in self._pending.items():
            self._saved_queries.pop(req_id, None)
            state = compressor.finish()
            self._states[req_id] = state
            self._record(compressor.report(state))
        self._pending.clear()

    # ---- metadata ----

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = RCStatCPUMetadata(**vars(base), builder=self)
        step = self._step
        if step is None or len(step.requests) != common_attn_metadata.num_reqs:
            if self._states:
                raise RuntimeError("rcstat: batch metadata without step info while requests are compressed")
            return metadata
        seq_lens = common_attn_metadata.seq_lens.tolist()
        block_table = common_attn_metadata.block_table_tensor
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        metadata.attribution = attribution_capture().plan(step.requests, query_start, self.num_layers)

        compressed: dict[int, CompactedRequest] = {}
        for row, request in enumerate(step.requests):
            state = self._states.get(request.req_id)
            if state is not None:
                state.reserve(seq_lens[row], block_table[row])
                compressed[row] = state
            elif request.finishes_prefill:
                saved = self._saved_queries.get(request.req_id)
                decision = plan_compression(
                    request,
                    self.config,
                    query_start[row],
                    query_start[row + 1],
                    self.disabled_reason,
                    saved_queries=0 if saved is None or saved[0] is None else saved[0].shape[0],
                )
                if decision.skipped_reason is not None:
                    self._saved_queries.pop(request.req_id, None)
                    self._record(decision.skipped_report(self.num_layers, self.num_kv_heads, self.block_size))
                else:
                    metadata.to_compress.append((row, decision))
            elif request.num_tokens_after_step < request.num_prompt_tokens:
                # A non-final prefill chunk: keep its trailing queries in case the last chunk is short.
                config, _ = request_config(request, self.config)
                if config.enabled and request.num_prompt_tokens >= config.min_prompt_len:
                    span = (query_start[row], query_start[row + 1], window_queries(config))
                    metadata.to_save.append((request.req_id, *span))
        if compressed:
            metadata.head_plan = make_head_plan(
                query_start,
                seq_lens,
                block_table,
                common_attn_metadata.slot_mapping,
                compressed,
                num_layers=self.num_layers,
                num_heads=self.num_kv_heads,
                group=self.num_heads // self.num_kv_heads,
                block_size=self.block_size,
                head_dim=self.head_dim,
                dtype=self.dtype,
                isa=self.isa,
            )
        return metadata

class RCStatCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is None:  # profiling / warm-up
            return output
        if not isinstance(attn_metadata, RCStatCPUMetadata):
            raise TypeError(f"rcstat backend got {type(attn_metadata).__name__} metadata")
        builder = attn_metadata.builder
        layer_index = builder.layer_index[layer.layer_name]
        if attn_metadata.attribution:
            attribution_capture().record(layer_index, attn_metadata.attribution, query, key)
        num_tokens = attn_metadata.num_actual_tokens
        plan = attn_metadata.head_plan
        if plan is None:
            # No compressed request in the batch: vLLM's own path, unchanged.
            if key is not None and value is not None:
                super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        else:
            key_pages, value_pages = head_page_caches(kv_cache)
            scales = dict(
                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype
            )
            if key is not None and value is not None:
                write_head_sequence_kv(
                    key[:num_tokens], value[:num_tokens], key_pages, value_pages, plan, layer_index,
                    layer.isa, **scales,
                )
            head_sequence_attention(
                query[:num_tokens], key_pages, value_pages, output[:num_tokens], plan, layer_index,
                scale=self.scale, isa=layer.isa, softcap=self.logits_soft_cap, **scales,
            )
        for req_id, start, end, count in attn_metadata.to_save:
            saved = builder._saved_queries.setdefault(req_id, [None] * builder.num_layers)
            recent = query[max(start, end - count) : end]
            previous = saved[layer_index]
            saved[layer_index] = (recent.clone() if previous is None else torch.cat([previous, recent]))[-count:]
        for row, decision in attn_metadata.to_compress:
            compressor = builder._pending.get(decision.req_id)
            if compressor is None:
                compressor = builder._pending[decision.req_id] = LayerCompressor(
                    decision, builder.num_layers, self.num_kv_heads, attn_metadata.block_table[row]
                )
            saved = builder._saved_queries.get(decision.req_id)
            compressor.compress_layer(
                layer_index, query, kv_cache, self.scale, None if saved is None else saved[layer_index]
            )
        return output
