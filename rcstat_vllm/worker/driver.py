"""The worker's compression state and its one owner, :class:`WorkerCompression`.

vLLM's metadata builders are per-step factories and its attention impls are stateless; what lives longer than a
step lives here, one object per worker (per model runner):

- the page space (:mod:`rcstat_vllm.paging.page_space`): head pages pooled across all layers, or per layer, decided
  once when the KV cache is bound (:meth:`WorkerCompression.bind_kv_caches`);
- one record per request it holds anything for, with the request's phase (prefill, scoring, selected, awaiting
  blocks, compressed: :mod:`rcstat_vllm.worker.requests`), and the compressed requests' page tables, resident on
  the cache's device (:class:`~rcstat_vllm.paging.page_tables.HeadPageTables`);
- the tensor-parallel agreement, reports and results.

A request is compressed over two steps (copy on compact, so that its prompt blocks can stay prefix-cache
entries): in the forward of its last prefill chunk every layer is scored and, after the last layer, the kept
entries are selected; the plan (how many blocks they need) goes to the scheduler with the step's output. The
scheduler allocates those blocks, gives the prompt blocks back to the pool (cached ones stay cached) and sends the
block ids with the next step, before whose forward :meth:`WorkerCompression.begin_step` copies the kept entries
there. Nothing writes a block between the scheduler freeing it and that copy: vLLM-CPU schedules synchronously and
the plugin turns asynchronous scheduling off (``patches/platform.py``). With ``decode_budget`` a request is compacted
again as it decodes, the same way over two steps (:mod:`rcstat_vllm.worker.decode_compression`).

Who calls what:

- the model runner hooks (``patches/model_runner.py``) create it when the runner sets up its KV cache
  (:func:`start_worker_compression`), bind the caches, hand it each step's batch (:meth:`begin_step`) and
  collect its reports for the scheduler (:meth:`pop_reports`);
- the backends' metadata builders ask it for the step's plan (:meth:`plan_step`);
- the backends' impls call :meth:`after_attention` after each layer's attention.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from rcstat_vllm.attribution.capture import attribution_capture
from rcstat_vllm.attention.capabilities import engine_not_pooled_reason, engine_unsupported_reason, unsupported_layer_reason
from rcstat_vllm.worker.prompt_compression import (
    RequestCompressor,
    deferred_keep_blocks,
    plan_compression,
    triton_scoring,
    warm_up_scoring,
)
from rcstat_vllm.settings import request_config, window_queries
from rcstat_vllm.paging.compaction import recompact_request
from rcstat_vllm.config import RCStatConfig, request_overrides, server_config
from rcstat_vllm.worker.decode_compression import DecodeCompressor
from rcstat_vllm.attention.head_plan import HeadSequencePlan, PlainRows, make_head_plan, plain_rows
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.log import logger
from rcstat_vllm.paging.page_space import PageSpace, cdiv, pooled_space_or_reason
from rcstat_vllm.paging.page_tables import HeadPageTables
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.worker.step import Compaction, StepInfo
from rcstat_vllm.worker.rank_agreement import max_over_ranks, visible_on_any_rank
from rcstat_vllm.vllm_private.internals import forward_context
from rcstat_vllm.worker.requests import Phase, WorkerRequest, WorkerRequests

#: How many finished requests' results the worker keeps for the Python API.
MAX_RESULTS = 100_000


@dataclass
class StepCompression:
    """One step's compression plan, shared by every layer (built once per step by the metadata builder)."""

    owner: "WorkerCompression"
    #: batch row -> state of the requests already compressed (their heads read and write head pages)
    compressed: dict[int, CompactedRequest] = field(default_factory=dict)
    #: the compressed rows' head-as-sequence plan when ``compressed`` is not empty, else None (vLLM's own path)
    head_plan: HeadSequencePlan | None = None
    #: the other rows as a sub-batch for vLLM's own kernels, when the batch holds compressed rows and others
    plain: PlainRows | None = None
    #: (batch row, CompressionDecision) of requests compressed after this step's attention
    to_compress: list = field(default_factory=list)
    #: (request id, query start, query end, how many) of non-final prefill chunks whose queries are kept
    to_save: list = field(default_factory=list)
    #: rows of requests that asked for attribution (rcstat_vllm.attribution.capture), None if none did
    attribution: list | None = None
    #: per row, tokens in the cache after this step (from the step info: no device synchronisation)
    seq_lens: list[int] = field(default_factory=list)
    #: (DecodeCompressor, query start, query end) of compressed rows whose queries a coming decode-time compaction
    #: observes
    decode_queries: list = field(default_factory=list)
    #: (record, tokens after this step) of compressed requests scored for a decode-time compaction in this step
    decode_due: list = field(default_factory=list)


class WorkerCompression:
    """Per-request compression state of one worker (see the module docstring)."""

    def __init__(self, vllm_config, disabled_reason: str | None = None):
        self.vllm_config = vllm_config
        self.config: RCStatConfig = server_config(vllm_config.additional_config) or RCStatConfig()
        self.layer_names: list[str] = []
        self.layer_index: dict[str, int] = {}
        self.num_heads = 0
        self.block_size = 0
        self.layout: CacheLayout | None = None
        self.space: PageSpace | None = None
        self.disabled_reason: str | None = None
        disabled_reason = disabled_reason or engine_unsupported_reason(vllm_config)
        if disabled_reason is not None:
            self.disable(disabled_reason)
        #: tensor-parallel ranks hold different KV heads but share the scheduler's block table: every request
        #: keeps the max over ranks of the blocks its heads need (None: a single rank)
        self.block_agreement_group = None
        if vllm_config.parallel_config.tensor_parallel_size > 1 and self.disabled_reason is None:
            from rcstat_vllm.vllm_private.internals import tensor_parallel_cpu_group

            self.block_agreement_group = tensor_parallel_cpu_group()
        self._step: StepInfo | None = None
        #: every request this worker holds something for, with its phase (rcstat_vllm.worker.requests)
        self.requests = WorkerRequests()
        #: the compressed requests' page tables on the cache's device (created at the first compaction)
        self.page_tables: HeadPageTables | None = None
        #: reads of a row of the device block table because the step info carried no host block ids (see
        #: :meth:`_host_block_ids`; on CUDA each one synchronises)
        self.device_block_row_reads = 0
        #: per layer, its cache tensor as the forward passes it (compactions copy within them)
        self._layer_caches: list[torch.Tensor | None] = []
        self._reports: list[CompressionReport] = []
        #: records whose decode-time compaction was selected this step (their plans go to the scheduler)
        self._decode_selected: list = []
        self.results: OrderedDict[str, CompressionReport] = OrderedDict()

    def disable(self, reason: str, *, warn: bool = True) -> None:
        """Run every request uncompressed (each logs ``reason`` in its report); ``warn=False`` logs it as information
        (a warning with the cause was logged at start-up already)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.log(logging.WARNING if warn else logging.INFO, "rcstat: compression off for this engine: %s", reason)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def tracked_layer(self, layer_name: str) -> int | None:
        """The layer's index among those this owner compresses; None for a layer it does not track (a drafter's
        layers under speculative decoding, a second KV-cache group): the impls run vLLM's own path for it."""
        return self.layer_index.get(layer_name)

    # ---- set-up (builders' constructors, then the runner hook once the KV cache exists) ----

    def attach_layers(self, layer_names: list[str], *, num_kv_heads: int, block_size: int, layout: CacheLayout):
        """A metadata builder's layers (vLLM builds one builder per KV-cache group, sometimes several)."""
        if self.layer_names and list(layer_names) != self.layer_names:
            self.disable("several KV-cache groups use the plugin's backend (one block table per group)")
            return
        if not self.layer_names:
            self.layer_names = list(layer_names)
            self.layer_index = {name: i for i, name in enumerate(layer_names)}
            self.num_heads, self.block_size, self.layout = num_kv_heads, block_size, layout
            self.space = PageSpace.per_layer(len(layer_names), num_kv_heads, block_size)
            self._layer_caches = [None] * len(layer_names)
            layer_reason = unsupported_layer_reason(self.vllm_config, layer_names)
            if layer_reason is not None:
                self.disable(layer_reason)
            logger.info("rcstat: attention backend active for %d layers", len(layer_names))

    def bind_kv_caches(self, caches: Mapping[str, torch.Tensor]) -> None:
        """Decide the page space from the layers' cache tensors (layer name -> ``[B, H, N, 2D]``), once, and say
        which at start-up."""
        if not self.layer_names:
            # No builder of the plugin's backend: vLLM chose another for every layer (an explicit
            # --attention-backend, or the platform hook found the plugin's cannot serve this engine and said why).
            self.disable(f"vLLM's own attention backend serves every layer ({self._vllm_impls()})", warn=False)
            return
        for name in self.layer_names:
            unusable = None if name not in caches else self.layout.unsupported_reason(caches[name])
            if unusable is not None:
                self.disable(f"layer {name}'s KV cache: {unusable}")
                return
        space, reason = None, engine_not_pooled_reason(self.vllm_config, self.block_size)
        if reason is None:
            missing = [name for name in self.layer_names if name not in caches]
            if missing:
                reason = f"no KV cache tensor for layer {missing[0]}"
            else:
                layer_caches = [caches[name] for name in self.layer_names]
                space, reason = pooled_space_or_reason(layer_caches, self.num_heads, self.block_size)
        self._warm_up_scoring(caches[self.layer_names[0]] if self.layer_names[0] in caches else None)
        bound = HeadPageTables.bound_bytes(self.num_layers, self.num_heads, self._max_slots, self._max_width)
        logger.info(
            "rcstat: compressed requests' head-page tables take at most %.1f MiB on the host and as much on the KV "
            "cache's device (%d requests x %d layers x %d KV heads x %d pages), allocated as compressed requests "
            "arrive, not counted in vLLM's memory profile",
            bound / 2**20, self._max_slots, self.num_layers, self.num_heads, self._max_width,
        )
        if space is not None:
            self.space = space
            logger.info(
                "rcstat: head pages pooled across all %d layers (%d pages per block): layers keep different "
                "amounts at no block cost",
                self.num_layers,
                self.num_layers * self.num_heads,
            )
        else:
            logger.warning(
                "rcstat: head pages per layer, not pooled across layers (%s): the layer keeping the most sets "
                "the blocks a request holds",
                reason,
            )

    def _vllm_impls(self) -> str:
        """The attention impl classes of the model's layers, by name."""
        layers = forward_context(self.vllm_config.compilation_config).values()
        names = sorted({type(layer.impl).__name__ for layer in layers if getattr(layer, "impl", None) is not None})
        return ", ".join(names) or "no attention layer"

    def _warm_up_scoring(self, cache: torch.Tensor | None) -> None:
        """Compile the server's scoring kernel now (on a GPU), not at the first compressed request."""
        if cache is None or self.disabled_reason is not None or not triton_scoring(self.layout, cache):
            return
        num_query_heads = self.vllm_config.model_config.get_num_attention_heads(self.vllm_config.parallel_config)
        if warm_up_scoring(self.config, self.layout, cache, num_query_heads):
            logger.info(
                "rcstat: %s scoring kernel compiled at start-up (window %d); a request overriding the method or "
                "window compiles its own at first use",
                self.config.method,
                window_queries(self.config),
            )

    # ---- step protocol (patches/model_runner.py) ----

    def begin_step(self, info: StepInfo) -> None:
        """Before the step's forward: run the scheduler's compactions, forget dropped requests, note prefix-cache
        hits of requests seen for the first time."""
        self._agree_selected()
        self._release_states(info.dropped_req_ids)  # first: their table slots serve this step's compactions
        for compaction in info.compactions:
            record = self.requests.get(compaction.req_id)
            if record is not None and record.decode is not None and record.decode.pending is not None:
                self._run_decode_compaction(record, compaction)
            else:
                self._run_compaction(compaction)
        self._release_states(info.dropped_req_ids)  # a request compacted in this very step and gone with it
        for req_id in info.dropped_req_ids:
            record = self.requests.drop(req_id)
            if record is not None and record.phase is Phase.AWAITING_BLOCKS:
                self._record(record.compressor.report(self._uncompacted_reason(record, req_id in info.preempted_req_ids)))
        for request in info.requests:
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.requests.seen_in_prefill(request.req_id, request.num_computed_tokens)
        if not self.layer_names and self.disabled_reason is not None:
            self._report_unserved(info)
        self._step = info

    @staticmethod
    def _uncompacted_reason(record, preempted: bool) -> str:
        """Why a request left with its plan still waiting for blocks."""
        if preempted:
            return "preempted before its KV was compacted (vLLM recomputes it when it resumes)"
        if record.compressor.config.eviction == "lazy":
            return "lazy eviction: memory was not short while it ran, its full KV was kept"
        return "finished before its KV was compacted"

    def _release_states(self, req_ids) -> None:
        for req_id in req_ids:
            state = self.requests.compressed_state(req_id)
            if state is not None:
                self.requests.drop(req_id)
                self.page_tables.release(state.table)

    def _report_unserved(self, info: StepInfo) -> None:
        """No layer runs the plugin's backend (no builder plans the steps): each request finishing its prefill is
        reported uncompressed, with the reason, as the builder's plan would report it."""
        block_size = self.vllm_config.cache_config.block_size
        for request in info.requests:
            if request.finishes_prefill:
                decision = plan_compression(request, self.config, 0, 0, self.disabled_reason)
                report = decision.skipped_report(0, 0, block_size)
                record = self.requests.drop(request.req_id)
                report.num_cached_tokens = 0 if record is None else record.cached_tokens
                self._record(report)
                self._reports.append(report)

    def _run_compaction(self, compaction: Compaction) -> None:
        record = self.requests.get(compaction.req_id)
        if record is None or record.phase is not Phase.AWAITING_BLOCKS:
            raise RuntimeError(f"rcstat: the scheduler sent blocks for request {compaction.req_id}, which has no plan")
        compressor = record.compressor
        if compaction.cancelled_reason is not None:
            self.requests.drop(compaction.req_id)
            self._record(compressor.report(compaction.cancelled_reason))
            return
        dest = torch.tensor(compaction.block_ids, dtype=torch.int64)
        state = compressor.compact(
            self._layer_caches, dest, self.space, self.layout, compaction.num_tokens, compaction.tail_block_ids
        )
        state.attach_to(self._resident_tables())
        record.phase, record.state, record.compressor = Phase.COMPRESSED, state, None
        if compressor.config.decode_compression:  # (tokens generated before a lazy compaction: kept whole so far)
            generated = state.num_compacted_tokens - compressor.decision.num_tokens
            record.decode = DecodeCompressor(compressor.config, state.kept - generated, state.num_compacted_tokens,
                                             generated)
        report = compressor.report()
        report.compacted_at_tokens = compaction.num_tokens or compressor.decision.num_tokens
        report.compaction_reason = compaction.reason
        self._record(report)

    def _run_decode_compaction(self, record, compaction: Compaction) -> None:
        """A decode-time compaction (``decode_budget``): copy what each head keeps into the scheduler's fresh blocks,
        or go on as before when it had none."""
        decode, plan = record.decode, record.decode.pending
        if compaction.cancelled_reason is not None:
            decode.cancelled()
            logger.debug("rcstat: request %s: decode-time compaction at %d tokens skipped: %s", record.req_id,
                         plan.num_tokens, compaction.cancelled_reason)
            return
        old = record.state
        dest = torch.tensor(compaction.block_ids, dtype=torch.int64)
        if dest.numel() != plan.keep_blocks - old.shared_blocks:
            raise ValueError(f"rcstat: {dest.numel()} fresh blocks allocated, {plan.keep_blocks - old.shared_blocks} "
                             "needed")
        record.state = recompact_request(self._layer_caches, old, plan.num_tokens, plan.masks, dest, self.layout,
                                         staged=compaction.reuses_own_blocks)
        if record.phase is Phase.COMPRESSED:
            self.page_tables.release(old.table)
        record.phase = Phase.COMPRESSED  # an uncompressed request is compressed from now on
        record.state.attach_to(self._resident_tables())
        decode.compacted()
        result = self.results.get(record.req_id)
        if result is not None:
            result.decode_compactions, result.decode_tokens_evicted = decode.compactions, decode.tokens_evicted
        logger.debug("rcstat: request %s: decode-time compaction %d at %d tokens: %d generated entries evicted, "
                     "%d blocks held", record.req_id, decode.compactions, plan.num_tokens, plan.evicted,
                     plan.keep_blocks)

    @property
    def _max_slots(self) -> int:
        return self.vllm_config.scheduler_config.max_num_seqs

    @property
    def _max_width(self) -> int:
        return cdiv(self.vllm_config.model_config.max_model_len, self.block_size)

    def _resident_tables(self) -> HeadPageTables:
        """The compressed requests' page tables, on the device the KV cache is on."""
        if self.page_tables is None:
            device = next(cache.device for cache in self._layer_caches if cache is not None)
            self.page_tables = HeadPageTables(
                self.num_layers, self.num_heads, device, max_slots=self._max_slots, max_width=self._max_width
            )
        return self.page_tables

    def pop_reports(self) -> list[CompressionReport]:
        """What the scheduler learns from this step: compression plans (blocks to allocate) and skipped requests."""
        self._agree_selected()
        self._agree_decode()
        reports, self._reports = self._reports, []
        return reports

    def compression_results(self) -> dict[str, dict]:
        return {req_id: report.to_dict() for req_id, report in self.results.items()}

    @property
    def num_compressed_requests(self) -> int:
        return self.requests.num_compressed

    @property
    def requests_with_saved_queries(self) -> set[str]:
        """Requests in chunked prefill whose trailing queries are kept for their last chunk."""
        return self.requests.with_saved_queries

    @property
    def idle(self) -> bool:
        """Nothing tracked: no compressed request, no saved queries, nothing mid-compression."""
        return not len(self.requests)

    def _record(self, report: CompressionReport) -> None:
        """A request's outcome: compressed (after the copy) or not, and why."""
        self.results[report.req_id] = report
        while len(self.results) > MAX_RESULTS:
            self.results.popitem(last=False)
        logger.debug(
            "rcstat: request %s (%d prompt tokens, %d from the prefix cache, %s): compression ratio %.3f, "
            "global eviction ratio %.3f, %d blocks freed%s",
            report.req_id,
            report.num_prompt_tokens,
            report.num_cached_tokens,
            report.method,
            report.compression_ratio,
            report.global_eviction_ratio,
            report.blocks_freed,
            f" (skipped: {report.skipped_reason})" if report.skipped_reason else "",
        )

    def _agree_selected(self) -> None:
        """Turn this step's selections into plans for the scheduler: the blocks each request keeps are the max over
        tensor-parallel ranks (they share one block table but hold different heads)."""
        selected = self.requests.in_phase(Phase.SELECTED)  # the same, in the same order, on every TP rank
        if not selected:
            return
        agreed = max_over_ranks([record.blocks_needed for record in selected], self.block_agreement_group)
        visible = visible_on_any_rank([record.compressor.visible for record in selected], self.block_agreement_group)
        for record, mask in zip(selected, visible):
            record.compressor.visible = mask
        for record, keep_blocks in zip(selected, agreed):
            record.saved_queries = None
            record.compressor.keep_blocks = keep_blocks
            record.phase = Phase.AWAITING_BLOCKS
            self._reports.append(record.compressor.report())

    def _agree_decode(self) -> None:
        """This step's decode-time selections as plans for the scheduler (blocks: the max over tensor-parallel
        ranks; every rank is due in the same step, see ``DecodeCompressor.next_due``)."""
        if not self._decode_selected:
            return
        records, self._decode_selected = self._decode_selected, []
        agreed = max_over_ranks([record.decode.pending.keep_blocks for record in records], self.block_agreement_group)
        for record, keep_blocks in zip(records, agreed):
            plan = record.decode.pending
            plan.keep_blocks = keep_blocks
            self._reports.append(CompressionReport(
                req_id=record.req_id, num_prompt_tokens=plan.num_tokens, method=record.decode.config.method,
                keep_blocks=keep_blocks, kept=plan.kept.tolist(), block_size=self.block_size,
                pooled_pages=self.space.is_pooled, num_cached_tokens=plan.shared_blocks * self.block_size,
                decode=True, decode_tokens_evicted=plan.evicted,
            ))

    # ---- per-step plan (the metadata builders) ----

    def plan_step(self, common_attn_metadata) -> StepCompression:
        """Decide what every row of this batch does; grow compressed requests' page tables for this step and,
        when the batch holds any, plan its head-as-sequence attention.

        Lengths come from the step info (computed + scheduled tokens), not from device tensors: on CUDA this
        costs no synchronisation.
        """
        plan = StepCompression(owner=self)
        step = self._step
        if step is None or len(step.requests) != common_attn_metadata.num_reqs:
            if self.requests.num_compressed:
                raise RuntimeError("rcstat: batch metadata without step info while requests are compressed")
            return plan
        block_table = common_attn_metadata.block_table_tensor
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        plan.attribution = attribution_capture().plan(step.requests, query_start, self.num_layers)
        plan.seq_lens = [request.num_tokens_after_step for request in step.requests]
        for row, request in enumerate(step.requests):
            state = self.requests.compressed_state(request.req_id)
            if state is not None:
                block_ids = self._host_block_ids(step, request, state, block_table, row)
                state.reserve(request.num_tokens_after_step, block_ids)
                plan.compressed[row] = state
                self._plan_decode(plan, request, query_start[row], query_start[row + 1])
            elif request.finishes_prefill:
                record = self.requests.get(request.req_id)
                saved = None if record is None else record.saved_for(0)
                decision = plan_compression(
                    request,
                    self.config,
                    query_start[row],
                    query_start[row + 1],
                    self.disabled_reason,
                    saved_queries=0 if saved is None else saved.shape[0],
                )
                if decision.skipped_reason is not None:
                    self.requests.drop(request.req_id)
                    report = decision.skipped_report(self.num_layers, self.num_heads, self.block_size)
                    report.num_cached_tokens = 0 if record is None else record.cached_tokens
                    self._record(report)
                    self._reports.append(report)
                else:
                    plan.to_compress.append((row, decision))
            elif request.num_computed_tokens >= request.num_prompt_tokens:
                self._plan_uncompressed_decode(plan, request, block_table, row, query_start)
            elif request.num_tokens_after_step < request.num_prompt_tokens:
                # A non-final prefill chunk: keep its trailing queries in case the last chunk is short.
                config, _ = request_config(request, self.config)
                if config.enabled and request.num_prompt_tokens >= config.min_prompt_len:
                    span = (query_start[row], query_start[row + 1], window_queries(config))
                    plan.to_save.append((request.req_id, *span))
        if plan.compressed:
            plan.head_plan = make_head_plan(query_start, plan.seq_lens, plan.compressed, self.space, block_table.device)
            plan.plain = plain_rows(common_attn_metadata, plan.compressed, query_start, plan.seq_lens, self.block_size)
        return plan

    def _plan_decode(self, plan: StepCompression, request, query_start: int, query_end: int) -> None:
        """A compressed row: with decode-time compression, watch its generated KV."""
        record = self.requests.get(request.req_id)
        if record.decode is not None:
            self._watch_decode(plan, record, request.num_tokens_after_step, query_start, query_end)

    def _plan_uncompressed_decode(self, plan: StepCompression, request, block_table, row: int, query_start) -> None:
        """A decoding request whose prompt stayed uncompressed: with ``decode_budget`` (server or request) its
        generated KV is compressed too; it is watched from its first decode step (a record of its own) and, when due,
        scored over its own blocks seen as head pages."""
        if self.disabled_reason is not None or self.space is None:
            return
        record = self.requests.get(request.req_id)
        if record is None:
            overrides = request_overrides(request.extra_args)
            if self.config.decode_budget is None and (not overrides or "decode_budget" not in overrides):
                return  # nobody asked for it: decided every step without merging configs
            config, invalid = request_config(request, self.config)
            if invalid is not None or not config.decode_compression:
                return
            prompt = torch.full((self.num_layers, self.num_heads), request.num_prompt_tokens, dtype=torch.int64)
            # (a request recomputed after a preemption has generated tokens already)
            generated = request.num_computed_tokens - request.num_prompt_tokens
            decode = DecodeCompressor(config, prompt, request.num_computed_tokens, generated)
            record = self.requests.add(WorkerRequest(request.req_id, phase=Phase.UNCOMPRESSED_DECODE, decode=decode))
        if record.phase is not Phase.UNCOMPRESSED_DECODE:
            return  # lazy eviction's parked plan: the prompt's compaction comes first
        num_tokens = request.num_tokens_after_step
        if self._watch_decode(plan, record, num_tokens, query_start[row], query_start[row + 1]):
            host_ids = request.block_ids is not None and self._step.block_size == self.block_size
            used = cdiv(num_tokens, self.block_size)
            # A copy: the host row is a read-only view vLLM rewrites for the next step.
            block_ids = torch.from_numpy(np.array(request.block_ids[:used], dtype=np.int64)) if host_ids \
                else block_table[row, :used].cpu()
            # Every head keeps the whole prompt: its full blocks stay as they are (prefix-cache hits stay shared with
            # the requests that hit them, its own prompt blocks stay cache entries), only the rest is copied.
            record.state = CompactedRequest.uncompressed(num_tokens, self.space, block_ids,
                                                         shared_blocks=request.num_prompt_tokens // self.block_size)

    def _watch_decode(self, plan: StepCompression, record, num_tokens: int, query_start: int, query_end: int) -> bool:
        """Keep the row's queries when a decode-time compaction is near; schedule its scoring when one is due (True).
        The scheduler brings a compaction forward when the pool is about to run short."""
        if record.req_id in self._step.decode_soon:
            record.decode.hurry(num_tokens)
        if record.decode.observing(num_tokens):
            plan.decode_queries.append((record.decode, query_start, query_end))
        if not record.decode.due(num_tokens):
            return False
        plan.decode_due.append((record, num_tokens))
        return True

    def _host_block_ids(self, step: StepInfo, request, state: CompactedRequest, block_table: torch.Tensor, row: int):
        """The request's vLLM block ids on the host, for the blocks ``reserve`` turns into head pages.

        The runner hook carries them from vLLM's host block table (``patches/model_runner.step_info``): nothing is
        read from the device. Where it does not (a step info built without them, several KV-cache groups, vLLM
        splitting its blocks into smaller kernel blocks than the ids name), the device row is read instead, only in
        steps where the request grows into a new vLLM block: on CUDA that read synchronises (counted in
        ``device_block_row_reads``).
        """
        if request.block_ids is not None and step.block_size == self.block_size:
            return request.block_ids
        if not state.blocks_to_absorb(request.num_tokens_after_step):
            return None
        if self.device_block_row_reads == 0:
            logger.info("rcstat: no host block ids in the step info: reading the device block table as requests grow")
        self.device_block_row_reads += 1
        return block_table[row].cpu()

    # ---- inside the forward (the impls) ----

    def page_cache(self, layer_index: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """The tensor this layer's head-page ids index (the all-layers view when pages are pooled)."""
        return self.space.cache(layer_index, kv_cache)

    def after_attention(
        self,
        plan: StepCompression,
        layer_index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        scale: float,
    ) -> None:
        """After a layer's attention: save queries of non-final chunks, score requests finishing their prefill
        and, after the last layer, select and compact them (see ``RequestCompressor``)."""
        for req_id, start, end, count in plan.to_save:
            record = self.requests.in_prefill(req_id)
            if record.saved_queries is None:
                record.saved_queries = [None] * self.num_layers
            recent = query[max(start, end - count) : end]
            previous = record.saved_queries[layer_index]
            record.saved_queries[layer_index] = (recent.clone() if previous is None else torch.cat([previous, recent]))[
                -count:
            ]
        for decode, start, end in plan.decode_queries:
            decode.save_queries(layer_index, query[start:end])
        if plan.decode_due:
            self._score_decode(plan, layer_index, kv_cache, scale)
        if not plan.to_compress:
            return
        self._layer_caches[layer_index] = kv_cache
        scoring = []
        for row, decision in plan.to_compress:
            record = self.requests.in_prefill(decision.req_id)
            if record.phase is Phase.PREFILL:  # the step's first layer: PREFILL -> SCORING
                record.compressor = RequestCompressor(decision, self.num_layers, block_table[row])
                record.compressor.num_cached_tokens = record.cached_tokens
                record.phase = Phase.SCORING
                if self._deferred_bound(record.compressor) is not None:
                    record.compressor.defer_scoring()
            record.compressor.observe_layer(
                layer_index, query, kv_cache, scale, self.layout, record.saved_for(layer_index)
            )
            scoring.append(record)
        if all(record.compressor.fully_scored for record in scoring):
            # Every layer is scored: select (the kept entries are copied once the scheduler gave their blocks).
            # Deferred (lazy eviction): plan the budget's bound; scoring and selection wait for the compaction.
            for record in scoring:  # SCORING -> SELECTED
                compressor = record.compressor
                if compressor.deferred:
                    record.blocks_needed = compressor.plan_deferred(self.space, self._deferred_bound(compressor))
                else:
                    record.blocks_needed = compressor.select(self.space)
                record.phase = Phase.SELECTED

    def _score_decode(self, plan: StepCompression, layer_index: int, kv_cache: torch.Tensor, scale: float) -> None:
        """Decode-time compression: score this layer of the requests due, and select after the last layer."""
        self._layer_caches[layer_index] = kv_cache
        for record, num_tokens in plan.decode_due:
            record.decode.score_layer(layer_index, record.state, kv_cache, self.layout, scale, num_tokens)
            if layer_index == self.num_layers - 1:
                record.decode.select(record.state, num_tokens)
                self._decode_selected.append(record)

    def _deferred_bound(self, compressor: RequestCompressor) -> int | None:
        """The blocks a lazily evicted request's kept KV needs at most, when it can be known before scoring (then
        scoring waits for the compaction); None otherwise. Single-rank only: under tensor parallelism the ranks'
        selections must agree in the step that selects."""
        if self.block_agreement_group is not None:
            return None
        shared_blocks = compressor.num_cached_tokens // self.block_size
        d = compressor.decision
        return deferred_keep_blocks(d.config, d.num_tokens, self.num_layers, self.space, shared_blocks)


# ---- the worker's owner: one per process (a worker process runs one model runner) ----

_current: WorkerCompression | None = None


def start_worker_compression(vllm_config) -> WorkerCompression | None:
    """A fresh owner for a model runner setting up its KV cache (``patches/model_runner.py``); None when the
    flag is off. The builders vLLM creates next find it with :func:`worker_compression`."""
    global _current
    _current = WorkerCompression(vllm_config) if server_config(vllm_config.additional_config) is not None else None
    return _current


def worker_compression(vllm_config) -> WorkerCompression:
    """The owner a metadata builder reports to. A builder built outside a hooked model runner (a runner class
    the plugin does not hook) gets a disabled owner whose reason says so, logged once."""
    global _current
    if _current is None or _current.vllm_config is not vllm_config:
        _current = WorkerCompression(
            vllm_config, disabled_reason="the model runner does not carry the plugin's hooks (unsupported runner)"
        )
    return _current


def worker_compression_of(vllm_config) -> WorkerCompression | None:
    """The owner of the runner with this config, if there is one (runner hooks, the Python API)."""
    return _current if _current is not None and _current.vllm_config is vllm_config else None
