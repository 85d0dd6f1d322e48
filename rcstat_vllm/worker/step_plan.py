"""One step's compression plan: what every row of the batch does, decided once per step for every layer.

:class:`StepPlanner` (a part of the worker's :class:`~rcstat_vllm.worker.driver.WorkerCompression`) reads the step
info and the batch's common attention metadata and, per row: a compressed request grows its head pages for this step;
a prompt finishing its prefill starts its prompt job (or is reported skipped, and why); a non-final prefill chunk keeps
its trailing queries; a decoding request with ``decode_budget`` is watched, and starts a decode-time job when one is
due and its turn comes (:class:`DueCompactions`). Lengths come from the step info (computed + scheduled tokens), not
from device tensors: on CUDA this costs no synchronisation. The head-as-sequence attention of the compressed rows is
planned by the backends' builders from this plan (:mod:`rcstat_vllm.attention.head_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rcstat_vllm.attribution.capture import REQUEST_KEY as ATTRIBUTION_KEY
from rcstat_vllm.attribution.capture import attribution_capture
from rcstat_vllm.log import logger
from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.page_space import cdiv
from rcstat_vllm.settings import window_queries
from rcstat_vllm.worker.decode_compression import DecodeCompressor
from rcstat_vllm.worker.jobs import DecodeJob, PromptJob
from rcstat_vllm.worker.prompt_compression import deferred_keep_blocks, plan_compression
from rcstat_vllm.worker.requests import Phase, WorkerRequest
from rcstat_vllm.worker.step import StepInfo

if TYPE_CHECKING:  # (annotations only)
    from rcstat_vllm.paging.kv_layout import CacheLayout
    from rcstat_vllm.paging.page_space import PageSpace
    from rcstat_vllm.settings import RequestSettingsTable
    from rcstat_vllm.worker.layers import CompressedLayers
    from rcstat_vllm.worker.requests import WorkerRequests
    from rcstat_vllm.worker.results import ResultsLog


@dataclass
class StepCompression:
    """One step's compression plan, shared by every layer (built once per step by the metadata builder)."""

    owner: Any
    #: batch row -> head pages of the requests already compressed (their heads read and write head pages)
    compressed: dict[int, CompactedRequest] = field(default_factory=dict)
    #: the compressed rows' head-as-sequence plan (set by the builder when ``compressed`` is not empty), else None
    head_plan: Any = None
    #: the other rows as a sub-batch for vLLM's own kernels, when the batch holds compressed rows and others
    plain: Any = None
    #: records whose compaction job is scored in this step (a prompt's last chunk, a decode-time compaction due)
    scoring: list[WorkerRequest] = field(default_factory=list)
    #: (record, query start, query end, how many) of non-final prefill chunks whose queries are kept
    to_save: list = field(default_factory=list)
    #: rows of requests that asked for attribution (rcstat_vllm.attribution.capture), None if none did
    attribution: list | None = None
    #: per row, tokens in the cache after this step (from the step info: no device synchronisation)
    seq_lens: list[int] = field(default_factory=list)
    #: (DecodeCompressor, query start, query end) of rows whose queries a coming decode-time compaction observes
    decode_queries: list = field(default_factory=list)


def has_host_work(plan: StepCompression) -> bool:
    """Whether a step's plan gives its attention host work after a layer (queries kept, a job scored, attribution)."""
    return bool(plan.to_save or plan.decode_queries or plan.scoring or plan.attribution)


def rows_match(num_requests: int, num_rows: int, query_start: list[int]) -> bool:
    """Whether a batch's metadata of ``num_rows`` rows (``query_start``: its host query offsets) is the step's
    ``num_requests`` requests: the same rows, or those followed by padding rows without queries (vLLM pads a batch it
    replays in a full CUDA graph to the captured size)."""
    if num_requests > num_rows:
        return False
    return all(start == query_start[num_requests] for start in query_start[num_requests + 1 :])


def decode_jobs_allowed(rate: float) -> int:
    """How many decode-time compactions one step starts, besides those the scheduler asked for: twice the rate at
    which the batch's watched requests fall due (``rate``: the sum of their ``1 / decode_interval``), at least one.

    Requests that fall due in the same step (started together with equal prompts: a batch in lockstep) would each
    have every layer scored in that step, which delays every request's next token: on the AVX-512 CPU, 12 requests
    of 256 + 1024 tokens with ``decode_budget`` 512 in a pool for all fell due 8 and 4 at a time, the longest decode
    step 855-1246 ms against a median of 55-62; taking turns, 225-235 ms, the p99 step up from 85-107 to 161-199 ms
    (``throughput_long_output_lockstep_turns_ab_avx512_cpu.json``). Each waits a few steps at most (its window of
    queries keeps sliding; it holds a few more entries meanwhile), and twice the rate clears a backlog at least as
    fast as it forms. Those the scheduler asked for are not held back: its forecast counts on their blocks (making
    them wait too, with the lead lengthened to match, cut the longest steps under pressure but cost a preemption in
    an A/B, ``throughput_long_output_decode_turns_hurried_ab_avx512_cpu.json``)."""
    return max(1, math.ceil(2 * rate))


class DueCompactions:
    """One step's decode-time compactions that are due: those the scheduler asked for start (the pool is about to run
    short), then those due longest, up to :func:`decode_jobs_allowed`; the rest wait for a later step."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.due: list[tuple[bool, int, int, Callable[[int], None]]] = []

    def watched(self, decode: DecodeCompressor) -> None:
        """A request of this step's batch whose generated KV is compressed (due or not)."""
        self.rate += 1 / decode.interval

    def add(self, decode: DecodeCompressor, num_tokens: int, start: Callable[[int], None]) -> None:
        """A compaction due at ``num_tokens`` tokens; ``start(num_tokens)`` starts its job."""
        self.due.append((decode.hurried, decode.overdue(num_tokens), num_tokens, start))

    def start(self) -> int:
        """Start the jobs whose turn it is, in that order; how many wait."""
        if not self.due:
            return 0
        allowed = decode_jobs_allowed(self.rate)
        ordered = sorted(self.due, key=lambda due: (not due[0], -due[1]))  # (stable: the batch's order in ties)
        started = 0
        for hurried, _, num_tokens, start in ordered:
            if hurried or started < allowed:
                start(num_tokens)
                started += 1
        return len(ordered) - started


class StepPlanner:
    """Decides, once per step, what every row of the batch does (see the module docstring).

    A part of the worker's owner, built by it with what it reads: the layers (their count, KV heads, block size, cache
    layout and page space, set when they attach), the request table, each request's settings and the results log.
    """

    def __init__(
        self,
        layers: CompressedLayers,
        requests: WorkerRequests,
        request_settings: RequestSettingsTable,
        results_log: ResultsLog,
        block_agreement_group: Any = None,
    ):
        self.layers = layers
        self.requests = requests
        self.request_settings = request_settings
        self.results_log = results_log
        #: tensor-parallel ranks' group (None: one rank): a lazily evicted request's blocks are not bounded before
        #: scoring there (:meth:`_deferred_bound`)
        self.block_agreement_group = block_agreement_group
        #: reads of a row of the device block table because the step info carried no host block ids (see
        #: :meth:`_host_block_ids`; on CUDA each one synchronises)
        self.device_block_row_reads = 0

    # The layers' set-up, read when a step is planned (after the layers attached: ``layout`` and ``space`` are set).
    @property
    def num_layers(self) -> int:
        return self.layers.num_layers

    @property
    def num_heads(self) -> int:
        return self.layers.num_heads

    @property
    def block_size(self) -> int:
        return self.layers.block_size

    @property
    def layout(self) -> CacheLayout:
        assert self.layers.layout is not None, "a step planned before the layers attached"
        return self.layers.layout

    @property
    def space(self) -> PageSpace | None:
        return self.layers.space

    @property
    def disabled_reason(self) -> str | None:
        return self.layers.disabled_reason

    def plan_rows(self, owner, step: StepInfo | None, common_attn_metadata) -> StepCompression:
        """The step's plan for every row of the batch (``owner``: the worker owner the plan's impls report to)."""
        plan = StepCompression(owner=owner)
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        if step is None or not rows_match(len(step.requests), common_attn_metadata.num_reqs, query_start):
            if self.requests.num_compressed:
                raise RuntimeError("rcstat: batch metadata without step info while requests are compressed")
            return plan
        block_table = common_attn_metadata.block_table_tensor
        plan.attribution = attribution_capture().plan(step.requests, query_start, self.num_layers)
        plan.seq_lens = [request.num_tokens_after_step for request in step.requests]
        due = DueCompactions()
        for row, request in enumerate(step.requests):
            record = self.requests.get(request.req_id)
            rows = (query_start[row], query_start[row + 1])
            if record is not None and record.decode is not None:
                due.watched(record.decode)
            if record is not None and record.pages is not None:
                block_ids = self._host_block_ids(step, request, record.pages, block_table, row)
                record.pages.reserve(request.num_tokens_after_step, block_ids)
                plan.compressed[row] = record.pages
                if record.decode is not None and record.job is None:
                    num_tokens = request.num_tokens_after_step
                    if self._watch_decode(plan, step, record, num_tokens, *rows):
                        due.add(record.decode, num_tokens, partial(self._start_decode_job, plan, record, record.pages))
            elif request.finishes_prefill:
                self._plan_prompt(plan, record, request, *rows, block_table[row])
            elif request.num_computed_tokens >= request.num_prompt_tokens:
                self._plan_uncompressed_decode(plan, step, record, request, rows, block_table, row, due)
            elif request.num_tokens_after_step < request.num_prompt_tokens:
                # A non-final prefill chunk: keep its trailing queries in case the last chunk is short.
                config = self.request_settings.of(request.req_id, request.extra_args).config
                if config.enabled and request.num_prompt_tokens >= config.min_prompt_len:
                    plan.to_save.append((self.requests.in_prefill(request.req_id), *rows, window_queries(config)))
        waiting = due.start()
        if waiting:
            logger.debug("rcstat: %d decode-time compactions due wait their turn (a later step scores them)", waiting)
        return plan

    def attention_needs_host(self, step: StepInfo | None) -> bool:
        """Whether this step's attention may do host work after a layer (``WorkerCompression.after_attention``:
        queries kept, a compaction job scored; attribution recorded), decided before the step's plan from the step
        info alone. Conservative: every step that :meth:`plan_rows` gives such work answers True (the builder checks
        it, :func:`has_host_work`). Under ``cuda_graphs: full_decode`` such a step runs piecewise, never replayed
        from a full graph (which runs none of the forward's Python)."""
        if step is None:
            return False
        capture = attribution_capture()
        for request in step.requests:
            if capture.active and request.extra_args and ATTRIBUTION_KEY in request.extra_args:
                return True
            if request.num_computed_tokens < request.num_prompt_tokens:
                return True  # a prefill chunk: its queries kept, or its prompt's job scored
            record = self.requests.get(request.req_id)
            if record is None:
                if self._decode_watcher_wanted(request):
                    return True  # watched from this step on
                continue
            decode = record.decode
            if decode is None or record.job is not None:
                continue
            num_tokens = request.num_tokens_after_step
            if request.req_id in step.decode_soon or decode.observing(num_tokens) or decode.due(num_tokens):
                return True
        return False

    def _decode_watcher_wanted(self, request) -> bool:
        """Whether :meth:`_plan_uncompressed_decode` would start watching this request (no side effect)."""
        if self.disabled_reason is not None or self.space is None:
            return False
        settings = self.request_settings.of(request.req_id, request.extra_args)
        return settings.invalid is None and settings.config.decode_compression

    def _plan_prompt(self, plan: StepCompression, record, request, start: int, end: int, block_row) -> None:
        """A prompt finishing its prefill: its prompt job starts (PREFILL -> SCORING), or it is reported skipped."""
        saved = None if record is None else record.saved_for(0)
        settings = self.request_settings.of(request.req_id, request.extra_args)
        decision = plan_compression(
            request, settings, start, end, self.disabled_reason, saved_queries=0 if saved is None else saved.shape[0]
        )
        if decision.skipped_reason is not None:
            self.requests.drop(request.req_id)
            report = decision.skipped_report(self.num_layers, self.num_heads, self.block_size)
            report.num_cached_tokens = 0 if record is None else record.cached_tokens
            self.results_log.record(report)
            self.results_log.send(report)
            return
        record = self.requests.in_prefill(request.req_id)
        job = PromptJob.start(
            decision,
            self.num_layers,
            block_row,
            self.layout,
            cached_tokens=record.cached_tokens,
            saved_queries=record.saved_queries,
            deferred_bound=self._deferred_bound(decision, record.cached_tokens),
        )
        self.requests.start_job(record, job)
        plan.scoring.append(record)

    def _deferred_bound(self, decision, cached_tokens: int) -> int | None:
        """The blocks a lazily evicted request's kept KV needs at most, when it can be known before scoring (then
        scoring waits for the compaction); None otherwise. Single-rank only: under tensor parallelism the ranks'
        selections must agree in the step that selects."""
        if self.block_agreement_group is not None:
            return None
        shared_blocks = cached_tokens // self.block_size
        return deferred_keep_blocks(decision.config, decision.num_tokens, self.num_layers, self.space, shared_blocks)  # type: ignore[arg-type]

    def _plan_uncompressed_decode(
        self, plan: StepCompression, step: StepInfo, record, request, rows, block_table, row: int, due: DueCompactions
    ) -> None:
        """A decoding request whose prompt stayed uncompressed: with ``decode_budget`` (server or request) its
        generated KV is compressed too; it is watched from its first decode step (a record of its own) and, when due,
        scored over its own blocks seen as head pages."""
        space = self.space
        if self.disabled_reason is not None or space is None:
            return
        if record is None:
            decode = self._decode_watcher(request)
            if decode is None:
                return
            record = self.requests.watch_decode(request.req_id, decode)
        if record.phase is not Phase.UNCOMPRESSED_DECODE:
            return  # lazy eviction's parked plan (the prompt's compaction comes first), or a job in flight
        num_tokens = request.num_tokens_after_step
        if not self._watch_decode(plan, step, record, num_tokens, *rows):
            return

        def start(num_tokens: int) -> None:
            # Every head keeps the whole prompt: its full blocks stay as they are (prefix-cache hits stay shared with
            # the requests that hit them, its own prompt blocks stay cache entries), only the rest is copied.
            own_blocks = self._own_blocks(step, request, block_table, row)
            source = CompactedRequest.uncompressed(
                num_tokens, space, own_blocks, shared_blocks=request.num_prompt_tokens // self.block_size
            )
            self._start_decode_job(plan, record, source, num_tokens, own_blocks)

        due.add(record.decode, num_tokens, start)

    def _decode_watcher(self, request) -> DecodeCompressor | None:
        """Decode-time compression for a request whose prompt stayed whole, if it (or the server) asked for it."""
        settings = self.request_settings.of(request.req_id, request.extra_args)  # (resolved once: a lookup a step)
        if settings.invalid is not None or not settings.config.decode_compression:
            return None
        config = settings.config
        prompt = torch.full((self.num_layers, self.num_heads), request.num_prompt_tokens, dtype=torch.int64)
        # (a request recomputed after a preemption has generated tokens already)
        generated = request.num_computed_tokens - request.num_prompt_tokens
        return DecodeCompressor(config, prompt, request.num_computed_tokens, generated)

    def _watch_decode(
        self, plan: StepCompression, step: StepInfo, record, num_tokens: int, start: int, end: int
    ) -> bool:
        """Keep the row's queries when a decode-time compaction is near; whether one is due (its job starts when its
        turn comes: :class:`DueCompactions`). The scheduler brings a compaction forward when the pool is about to run
        short."""
        decode = record.decode
        if record.req_id in step.decode_soon:
            decode.hurry(num_tokens)
        if decode.observing(num_tokens):
            plan.decode_queries.append((decode, start, end))
        return decode.due(num_tokens)

    def _start_decode_job(
        self,
        plan: StepCompression,
        record,
        source: CompactedRequest,
        num_tokens: int,
        own_blocks: torch.Tensor | None = None,
    ) -> None:
        job = DecodeJob(record.req_id, record.decode, source, num_tokens, self.layout, own_blocks)
        self.requests.start_job(record, job)
        plan.scoring.append(record)

    def _own_blocks(self, step: StepInfo, request, block_table: torch.Tensor, row: int) -> torch.Tensor:
        """An uncompressed request's blocks holding its tokens after this step, on the host."""
        used = cdiv(request.num_tokens_after_step, self.block_size)
        if request.block_ids is not None and step.block_size == self.block_size:
            # A copy: the host row is a read-only view vLLM rewrites for the next step.
            return torch.from_numpy(np.array(request.block_ids[:used], dtype=np.int64))
        return block_table[row, :used].cpu()

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
