"""What the plugin's CPU and CUDA attention backends share: everything but the attention kernels.

- :class:`CompressionPlanner` (a mixin for vLLM metadata builders): the step protocol with the model runner
  (``begin_step``/``pop_reports``, patches/model_runner.py), which rows of a batch are compressed, which finish
  their prefill now (compressed after this step's attention), which save queries for a later chunk, and the
  per-request results.
- :class:`StepCompression`: that plan for one step, carried to every layer in the backend's metadata.
- :func:`finish_layer`: after a layer's attention, score, select and compact the requests finishing their
  prefill in that layer (:class:`rcstat_vllm.compression.LayerCompressor`, on the backend's cache layout).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from rcstat_vllm.attribution.capture import attribution_capture
from rcstat_vllm.compression import LayerCompressor, plan_compression, request_config, window_queries
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.head_attention import HeadSequencePlan, make_head_plan
from rcstat_vllm.head_pages import CacheLayout, CompactedRequest
from rcstat_vllm.log import logger
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.step import StepInfo

#: How many finished requests' results the worker keeps for the Python API.
MAX_RESULTS = 100_000


@dataclass
class StepCompression:
    """One step's compression plan, shared by every layer (built once by the metadata builder)."""

    builder: "CompressionPlanner"
    #: batch row -> state of the requests already compressed (their heads read and write head pages)
    compressed: dict[int, CompactedRequest] = field(default_factory=dict)
    #: the head-as-sequence plan when ``compressed`` is not empty, else None (vLLM's own path)
    head_plan: HeadSequencePlan | None = None
    #: (batch row, CompressionDecision) of requests compressed after this step's attention
    to_compress: list = field(default_factory=list)
    #: (request id, query start, query end, how many) of non-final prefill chunks whose queries are kept
    to_save: list = field(default_factory=list)
    #: rows of requests that asked for attribution (rcstat_vllm.attribution.capture), None if none did
    attribution: list | None = None
    #: per row, tokens in the cache after this step (from the step info: no device synchronisation)
    seq_lens: list[int] = field(default_factory=list)


class CompressionPlanner:
    """Mixin for a vLLM ``AttentionMetadataBuilder``: per-request compression bookkeeping of one worker.

    The backend sets :attr:`layout` (where head pages live in its cache) and calls
    :meth:`init_compression` from ``__init__`` and :meth:`plan_step` from ``build``.
    """

    layout: CacheLayout

    def init_compression(self, vllm_config, layer_names, *, num_kv_heads: int, block_size: int) -> None:
        from rcstat_vllm.patches import model_runner

        model_runner.install()
        self.config: RCStatConfig = server_config(vllm_config.additional_config) or RCStatConfig()
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        self.rc_num_kv_heads = num_kv_heads
        self.rc_block_size = block_size
        self.disabled_reason: str | None = None
        layer_reason = unsupported_layer_reason(vllm_config, layer_names)
        if layer_reason is not None:
            self.disable(layer_reason)
        elif getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) > 1:
            # Stages hold different layers but share one block table, and run different steps at a time:
            # an agreement per step would pair different batches.
            self.disable("pipeline parallelism: stages cannot agree on the blocks a request keeps")
        #: tensor-parallel ranks hold different KV heads but share the scheduler's block table: every request
        #: keeps the max over ranks of the blocks its heads need (None: a single rank)
        self.block_agreement_group = None
        if vllm_config.parallel_config.tensor_parallel_size > 1 and self.disabled_reason is None:
            from rcstat_vllm.patches.tensor_parallel import tensor_parallel_cpu_group

            self.block_agreement_group = tensor_parallel_cpu_group()
        self._step: StepInfo | None = None
        self._states: dict[str, CompactedRequest] = {}
        self._pending: dict[str, LayerCompressor] = {}
        #: per request in chunked prefill, per layer: trailing queries of its chunks so far
        self._saved_queries: dict[str, list[torch.Tensor | None]] = {}
        self._reports: list[CompressionReport] = []
        self.results: OrderedDict[str, CompressionReport] = OrderedDict()
        logger.info("rcstat: attention backend active for %d layers (%s)", len(layer_names), type(self).__name__)

    def disable(self, reason: str) -> None:
        """Run every request uncompressed (each logs ``reason`` in its report)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.warning("rcstat: compression off for this engine: %s", reason)

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
        if not self._pending:  # the same on every TP rank: they run the same batch
            return
        states = [compressor.compacted() for compressor in self._pending.values()]
        agreed = max_over_ranks([state.blocks_needed() for state in states], self.block_agreement_group)
        for (req_id, compressor), state, keep_blocks in zip(self._pending.items(), states, agreed):
            self._saved_queries.pop(req_id, None)
            state.finalize(compressor.block_row, keep_blocks)
            self._states[req_id] = state
            self._record(compressor.report(state))
        self._pending.clear()

    # ---- per-step plan ----

    def plan_step(self, common_attn_metadata) -> StepCompression:
        """Decide what every row of this batch does; grow compressed requests' page tables for this step and,
        when the batch holds any, plan its head-as-sequence attention.

        Lengths come from the step info (computed + scheduled tokens), not from device tensors: on CUDA this
        costs no synchronisation.
        """
        plan = StepCompression(builder=self)
        step = self._step
        if step is None or len(step.requests) != common_attn_metadata.num_reqs:
            if self._states:
                raise RuntimeError("rcstat: batch metadata without step info while requests are compressed")
            return plan
        block_table = common_attn_metadata.block_table_tensor
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        plan.attribution = attribution_capture().plan(step.requests, query_start, self.num_layers)
        plan.seq_lens = [request.num_tokens_after_step for request in step.requests]
        for row, request in enumerate(step.requests):
            state = self._states.get(request.req_id)
            if state is not None:
                state.reserve(request.num_tokens_after_step, block_table[row])
                plan.compressed[row] = state
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
                    self._record(decision.skipped_report(self.num_layers, self.rc_num_kv_heads, self.rc_block_size))
                else:
                    plan.to_compress.append((row, decision))
            elif request.num_tokens_after_step < request.num_prompt_tokens:
                # A non-final prefill chunk: keep its trailing queries in case the last chunk is short.
                config, _ = request_config(request, self.config)
                if config.enabled and request.num_prompt_tokens >= config.min_prompt_len:
                    span = (query_start[row], query_start[row + 1], window_queries(config))
                    plan.to_save.append((request.req_id, *span))
        if plan.compressed:
            plan.head_plan = make_head_plan(
                query_start,
                plan.seq_lens,
                block_table,
                common_attn_metadata.slot_mapping,
                plan.compressed,
                num_layers=self.num_layers,
                num_heads=self.rc_num_kv_heads,
                block_size=self.rc_block_size,
            )
        return plan


def unsupported_layer_reason(vllm_config, layer_names) -> str | None:
    """Attention features head-as-sequence does not reproduce (it passes no ALiBi slopes, sinks or window to
    the kernels), found on the layers' vLLM impls; None when there are none."""
    context = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        impl = getattr(context.get(name), "impl", None)
        if impl is None:
            continue
        if getattr(impl, "alibi_slopes", None) is not None:
            return "ALiBi attention layers are not supported"
        if getattr(impl, "sinks", None) is not None:
            return "attention sinks are not supported"
        if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
            return "sliding-window attention layers are not supported"
    return None


def max_over_ranks(values: list[int], group) -> list[int]:
    """Element-wise max of ``values`` over the ranks of ``group`` (a torch.distributed process group; None:
    a single rank). Every rank must call it with as many values, in the same order."""
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
    return tensor.tolist()


def record_attribution(plan: StepCompression | None, layer_index: int, query, key) -> None:
    """Before a layer's attention: hand its queries/keys to the attribution capture when a request asked."""
    if plan is not None and plan.attribution:
        attribution_capture().record(layer_index, plan.attribution, query, key)


def finish_layer(
    plan: StepCompression | None,
    layer_index: int,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> None:
    """After a layer's attention: save queries of non-final chunks, compress requests finishing prefill."""
    if plan is None:
        return
    builder = plan.builder
    for req_id, start, end, count in plan.to_save:
        saved = builder._saved_queries.setdefault(req_id, [None] * builder.num_layers)
        recent = query[max(start, end - count) : end]
        previous = saved[layer_index]
        saved[layer_index] = (recent.clone() if previous is None else torch.cat([previous, recent]))[-count:]
    for row, decision in plan.to_compress:
        compressor = builder._pending.get(decision.req_id)
        if compressor is None:
            compressor = builder._pending[decision.req_id] = LayerCompressor(
                decision, builder.num_layers, builder.rc_num_kv_heads, block_table[row], builder.layout
            )
        saved = builder._saved_queries.get(decision.req_id)
        compressor.compress_layer(layer_index, query, kv_cache, scale, None if saved is None else saved[layer_index])
