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
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from rcstat_vllm.compression import LayerCompressor, plan_compression
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.head_pages import CompactedRequest, cdiv, head_page_caches, identity_pages
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
class HeadSequencePlan:
    """Index maps that present each (request, KV head) as a sequence of its own (same for all layers)."""

    #: [T*H] token and KV-head index of each head-sequence query row
    token_index: torch.Tensor
    head_index: torch.Tensor
    #: [R*H + 1] int32
    query_start_loc: torch.Tensor
    #: [T] logical position of each token
    positions: torch.Tensor
    #: [R, H, P] int64 pages and [R, H] lengths of uncompressed rows (compressed rows are filled per layer)
    base_tables: torch.Tensor
    base_lengths: torch.Tensor
    #: batch row -> compressed state
    compressed: dict[int, CompactedRequest]


@dataclass
class RCStatCPUMetadata(CPUAttentionMetadata):
    head_plan: HeadSequencePlan | None = None
    #: batch row -> (request id, config, token range) of requests compressed after this step's attention
    to_compress: list = field(default_factory=list)
    builder: "RCStatCPUMetadataBuilder | None" = None


def make_head_plan(
    query_start: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    num_heads: int,
    block_size: int,
    compressed: dict[int, CompactedRequest],
) -> HeadSequencePlan:
    """Index maps and the uncompressed rows' page tables for head-as-sequence attention of one step."""
    num_reqs = len(seq_lens)
    device = block_table.device
    query_lens = [query_start[r + 1] - query_start[r] for r in range(num_reqs)]
    token_index, head_index, starts = [], [], [0]
    for row in range(num_reqs):
        tokens = torch.arange(query_start[row], query_start[row + 1], device=device)
        for head in range(num_heads):
            token_index.append(tokens)
            head_index.append(torch.full_like(tokens, head))
            starts.append(starts[-1] + query_lens[row])
    positions = torch.cat(
        [torch.arange(seq_lens[r] - query_lens[r], seq_lens[r], device=device) for r in range(num_reqs)]
    )
    width = max((cdiv(seq_lens[r], block_size) for r in range(num_reqs) if r not in compressed), default=1)
    tables = torch.zeros((num_reqs, num_heads, max(width, 1)), dtype=torch.int64, device=device)
    lengths = torch.zeros((num_reqs, num_heads), dtype=torch.int64, device=device)
    for row in range(num_reqs):
        if row not in compressed:
            n_blocks = cdiv(seq_lens[row], block_size)
            tables[row, :, :n_blocks] = identity_pages(block_table[row, :n_blocks], num_heads)
            lengths[row] = seq_lens[row]
    return HeadSequencePlan(
        token_index=torch.cat(token_index),
        head_index=torch.cat(head_index),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        positions=positions,
        base_tables=tables,
        base_lengths=lengths,
        compressed=compressed,
    )


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
            logger.warning("rcstat: compression off for this engine: %s", self.disabled_reason)
        self._step: StepInfo | None = None
        self._states: dict[str, CompactedRequest] = {}
        self._pending: dict[str, LayerCompressor] = {}
        self._reports: list[CompressionReport] = []
        self.results: OrderedDict[str, CompressionReport] = OrderedDict()
        logger.info("rcstat: attention backend active for %d layers", len(layer_names))

    # ---- step protocol (called by patches/model_runner.py) ----

    def begin_step(self, info: StepInfo) -> None:
        self._finalize_pending()
        for req_id in info.dropped_req_ids:
            self._states.pop(req_id, None)
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

        compressed: dict[int, CompactedRequest] = {}
        for row, request in enumerate(step.requests):
            state = self._states.get(request.req_id)
            if state is not None:
                state.reserve(seq_lens[row], block_table[row])
                compressed[row] = state
            elif request.finishes_prefill:
                decision = plan_compression(
                    request, self.config, query_start[row], query_start[row + 1], self.disabled_reason
                )
                if decision.skipped_reason is not None:
                    self._record(decision.skipped_report(self.num_layers, self.num_kv_heads))
                else:
                    metadata.to_compress.append((row, decision))
        if compressed:
            metadata.head_plan = make_head_plan(
                query_start, seq_lens, block_table, self.num_kv_heads, self.block_size, compressed
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
        num_tokens = attn_metadata.num_actual_tokens
        plan = attn_metadata.head_plan
        if plan is None:
            # No compressed request in the batch: vLLM's own path, unchanged.
            if key is not None and value is not None:
                super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        else:
            self._head_sequence_forward(
                layer, layer_index, query[:num_tokens], key[:num_tokens], value[:num_tokens],
                kv_cache, attn_metadata, plan, output[:num_tokens],
            )
        for row, decision in attn_metadata.to_compress:
            compressor = builder._pending.get(decision.req_id)
            if compressor is None:
                compressor = builder._pending[decision.req_id] = LayerCompressor(
                    decision, builder.num_layers, self.num_kv_heads, attn_metadata.block_table[row]
                )
            compressor.compress_layer(layer_index, query, kv_cache, self.scale)
        return output

    def _head_sequence_forward(self, layer, layer_index, query, key, value, kv_cache, metadata, plan, output):
        num_heads, group = self.num_kv_heads, self.num_queries_per_kv
        num_tokens, _, head_dim = query.shape
        block_size = kv_cache.shape[2]
        key_pages, value_pages = head_page_caches(kv_cache)

        # Write this step's K/V: uncompressed rows map vLLM's slot into the head-page view, compressed
        # rows append to each head's own pages.
        slots = metadata.slot_mapping[:num_tokens].to(torch.int64)
        heads = torch.arange(num_heads, device=slots.device)
        head_slots = (slots // block_size).unsqueeze(1) * num_heads + heads
        head_slots = head_slots * block_size + (slots % block_size).unsqueeze(1)
        head_slots = torch.where(slots.unsqueeze(1) < 0, -1, head_slots)
        query_start = metadata.query_start_loc.tolist()
        tables = plan.base_tables.clone()
        lengths = plan.base_lengths.clone()
        for row, state in plan.compressed.items():
            start, end = query_start[row], query_start[row + 1]
            if end > start:
                head_slots[start:end] = state.slots(layer_index, plan.positions[start:end])
            num_after = int(metadata.seq_lens[row])
            table = state.tables[layer_index]
            if table.shape[1] > tables.shape[2]:
                grown = torch.zeros((tables.shape[0], num_heads, table.shape[1]), dtype=tables.dtype)
                grown[:, :, : tables.shape[2]] = tables
                tables = grown
            tables[row, :, : table.shape[1]] = table.clamp(min=0)
            lengths[row] = state.lengths(num_after)[layer_index]
        ops.cpu_attn_reshape_and_cache(
            key.reshape(num_tokens * num_heads, 1, head_dim),
            value.reshape(num_tokens * num_heads, 1, -1),
            key_pages,
            value_pages,
            head_slots.reshape(-1),
            layer.isa,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )

        # Attention: one sequence per (request, KV head), G query heads each.
        head_sequence_attention(
            query, key_pages, value_pages, output, plan, tables, lengths,
            scale=self.scale, isa=layer.isa, softcap=self.logits_soft_cap,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
        )


def head_sequence_attention(
    query, key_pages, value_pages, output, plan: HeadSequencePlan, tables, lengths, *, scale, isa,
    softcap=0.0, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
):
    """Causal paged attention with each (request, KV head) as its own sequence, via vLLM's CPU kernel.

    Args:
        query: [T, H*G, D]; output: [T, H*G, D] written in place.
        key_pages, value_pages: head-page caches [num_blocks * H, 1, N, D] (:func:`head_page_caches`).
        tables: [R, H, P] head pages per (request, head); lengths: [R, H] tokens per (request, head).
    """
    num_tokens, num_query_heads, head_dim = query.shape
    num_heads = tables.shape[1]
    group = num_query_heads // num_heads
    seq_lens = lengths.reshape(-1).to(torch.int32)
    block_table = tables.reshape(-1, tables.shape[2]).to(torch.int32)
    head_queries = query.view(num_tokens, num_heads, group, head_dim)[plan.token_index, plan.head_index]
    head_output = torch.empty_like(head_queries)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0],
        num_heads=group,
        num_kv_heads=1,
        head_dim=head_dim,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=plan.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=kv_cache_dtype,
    )
    ops.cpu_attention_with_kv_cache(
        query=head_queries,
        key_cache=key_pages,
        value_cache=value_pages,
        output=head_output,
        query_start_loc=plan.query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=softcap,
        scheduler_metadata=scheduler_metadata,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    output.view(num_tokens, num_heads, group, head_dim)[plan.token_index, plan.head_index] = head_output
