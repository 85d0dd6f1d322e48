"""The worker's step driver, :class:`WorkerCompression`: one per worker (per model runner), the one owner of what
compression keeps between steps.

vLLM's metadata builders are per-step factories and its attention impls are stateless; what lives longer than a step
lives here, each piece with its owner:

- the layers, the page space, and whether compression is on (:class:`~rcstat_vllm.worker.layers.CompressedLayers`,
  which this class extends), with the page store (:mod:`rcstat_vllm.worker.page_store`);
- the request table (:mod:`rcstat_vllm.worker.requests`): one record per request, its phase and its compaction job
  (:mod:`rcstat_vllm.worker.jobs`: a prompt's, or a decode-time one's);
- the results log (:mod:`rcstat_vllm.worker.results`) and the tensor-parallel agreement
  (:mod:`rcstat_vllm.worker.rank_agreement`).

A step, as the hooks drive it:

1. ``patches/model_runner.py`` hands the step's batch to :meth:`WorkerCompression.begin_step`: the compactions the
   scheduler answered are copied before the forward (nothing writes a freed block in between: a later step's
   forward does; under asynchronous scheduling the copy also carries the token of the step that ran between the
   plan and the copy, ``EngineCompaction.apply_reports``), dropped requests are forgotten;
2. each backend's metadata builder asks :meth:`~WorkerCompression.plan_step` what every row does
   (:mod:`rcstat_vllm.worker.step_plan`; the builder plans head-as-sequence attention for the compressed rows itself,
   :mod:`rcstat_vllm.attention.head_plan`);
3. each impl calls :meth:`~WorkerCompression.after_attention` after a layer's attention: queries are saved, the step's
   jobs scored, and after the last layer each job selects what its heads keep;
4. the runner hook collects :meth:`~WorkerCompression.pop_reports`: plans (blocks needed, agreed over ranks) and
   skipped requests go to the scheduler, which allocates and answers in a later step
   (``rcstat_vllm/engine/block_exchange.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from rcstat_vllm.config import server_config
from rcstat_vllm.reports import Compaction, CopyRun, ScoreAhead, StepCompactions
from rcstat_vllm.settings import RequestSettingsTable
from rcstat_vllm.worker.layers import CompressedLayers
from rcstat_vllm.worker.prompt_compression import plan_compression
from rcstat_vllm.worker.rank_agreement import max_over_ranks, visible_on_any_rank
from rcstat_vllm.worker.requests import Phase, WorkerRequests
from rcstat_vllm.worker.results import MAX_RESULTS, ResultsLog  # noqa: F401  (MAX_RESULTS: the API's documented cap)
from rcstat_vllm.worker.step import StepInfo
from rcstat_vllm.worker.step_plan import StepCompression, StepPlanner, has_host_work


class WorkerCompression(CompressedLayers):
    """Per-request compression state of one worker (see the module docstring)."""

    def __init__(self, vllm_config, disabled_reason: str | None = None, kv_cache_groups=None):
        super().__init__(vllm_config, disabled_reason, kv_cache_groups)
        #: tensor-parallel ranks hold different KV heads but share the scheduler's block table: every request
        #: keeps the max over ranks of the blocks its heads need (None: a single rank)
        self.block_agreement_group = None
        if vllm_config.parallel_config.tensor_parallel_size > 1 and self.disabled_reason is None:
            from rcstat_vllm.vllm_private.internals import tensor_parallel_cpu_group

            self.block_agreement_group = tensor_parallel_cpu_group()
        self._step: StepInfo | None = None
        #: whether the runner dispatched this step piecewise for attention's host work (dispatch_eager_attention)
        self._eager_attention = False
        self.requests = WorkerRequests()
        self.results_log = ResultsLog()
        #: each request's settings, resolved the first time a step shows it, dropped when it leaves
        self.request_settings = RequestSettingsTable(self.config)
        #: decides each step what every row does (reads the layers, the table, the settings; logs skipped requests)
        self.planner = StepPlanner(
            self, self.requests, self.request_settings, self.results_log, self.block_agreement_group
        )
        #: this step's copies until the runner hook collects them (:meth:`pop_step_compactions`)
        self._copies: list[CopyRun] = []
        #: the request-table size last sent (sent again when it changes)
        self._tracked_sent = 0
        #: the results log's size last sent
        self._results_sent = 0
        #: this step's prompts scored at their copy: (compression ratio, global eviction ratio) each
        self._scored_at_copy: list[tuple[float, float, float]] = []
        #: parked plans whose scoring ahead finished in this step (sent with the step's compactions)
        self._scored_ahead: list[str] = []

    @property
    def results(self):
        """Requests' outcomes by request id, read-only (the Python API reads them with :meth:`compression_results`)."""
        return self.results_log.results

    # ---- step protocol (patches/model_runner.py) ----

    def begin_step(self, info: StepInfo) -> None:
        """Before the step's forward: run the scheduler's compactions, forget dropped requests, note prefix-cache
        hits of requests seen for the first time."""
        self._agree()
        self._release_pages(info.dropped_req_ids)  # first: their table slots serve this step's compactions
        for compaction in info.compactions:
            start = time.perf_counter()
            kind = self._run_compaction(compaction)
            if kind is not None:
                self._copies.append(CopyRun(compaction.req_id, kind, time.perf_counter() - start))
        self._release_pages(info.dropped_req_ids)  # a request compacted in this very step and gone with it
        self._score_ahead(info.score_ahead)
        for req_id in info.dropped_req_ids:
            self.request_settings.drop(req_id)  # (a resumed request is resolved again: it may run on new settings)
            record = self.requests.drop(req_id)
            job = None if record is None or record.phase is not Phase.AWAITING_BLOCKS else record.job
            if job is not None and job.kind == "prompt":
                reason = job.uncompacted_reason(req_id in info.preempted_req_ids)
                self.results_log.record(job.cancelled(reason))
        for req_id in info.preempted_req_ids:  # recomputed when resumed: compressed again, as a new pass
            self.results_log.end_pass(req_id, "preempted")
        for req_id in info.new_req_ids:
            if req_id in self.requests or req_id in self.results:
                self._continue_session(req_id)
        for request in info.requests:
            if request.num_computed_tokens < request.num_prompt_tokens:
                # (a request resumed after a preemption is first seen again in the step that resumes it)
                own_hits = request.req_id in info.resumed_req_ids
                self.requests.seen_in_prefill(request.req_id, request.num_computed_tokens, own_hits)
        if not self.layer_names and self.disabled_reason is not None:
            self._report_unserved(info)
        self._step = info
        self._eager_attention = False  # (until the runner asks, dispatch_eager_attention)

    def dispatch_eager_attention(self) -> bool:
        """Asked by the runner before it picks the step's CUDA graph (``patches/model_runner.py``): True when this
        step's attention may do host work, so it must run piecewise, not from a full graph (``cuda_graphs:
        full_decode``)."""
        self._eager_attention = self.planner.attention_needs_host(self._step)
        return self._eager_attention

    def check_graph_step(self, plan: StepCompression) -> None:
        """A full-graph decode step's plan must do no host work in attention unless the runner was told to run it
        piecewise (:meth:`dispatch_eager_attention`): a graph replay would skip that work silently."""
        if has_host_work(plan) and not self._eager_attention:
            raise RuntimeError(
                "rcstat: a decode step with host work in attention (queries kept, a job scored or attribution) was "
                "not dispatched piecewise: a full CUDA graph would skip it"
            )

    def plan_step(self, common_attn_metadata) -> StepCompression:
        """What every row of this batch does (:class:`~rcstat_vllm.worker.step_plan.StepPlanner`)."""
        return self.planner.plan_rows(self, self._step, common_attn_metadata)

    def after_attention(
        self, plan: StepCompression, layer_index: int, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> None:
        """After a layer's attention: save the queries later scoring reads, score this step's jobs and, once a job
        has seen every layer, select what its heads keep."""
        for record, start, end, count in plan.to_save:
            if record.saved_queries is None:
                record.saved_queries = [None] * self.num_layers
            recent = query[max(start, end - count) : end]
            previous = record.saved_queries[layer_index]
            joined = recent.clone() if previous is None else torch.cat([previous, recent])
            record.saved_queries[layer_index] = joined[-count:]
        for decode, start, end in plan.decode_queries:
            decode.save_queries(layer_index, query[start:end])
        if plan.scoring:
            # (a step scores only once the layers are attached: the page store and the page space exist)
            self.pages.remember(layer_index, kv_cache)  # type: ignore[union-attr]  # the cache a later copy reads
        for record in plan.scoring:
            job = record.job
            assert job is not None  # (a record scored holds its job)
            job.observe_layer(layer_index, query, kv_cache, scale)
            if job.fully_observed:
                self.requests.job_selected(record, job.select(self.space))  # type: ignore[arg-type]

    def pop_reports(self):
        """What the scheduler learns from this step: compression plans (blocks to allocate) and skipped requests."""
        self._agree()
        return self.results_log.pop_outgoing()

    def pop_step_compactions(self) -> StepCompactions | None:
        """The copies run since the last call (this step's) and the sizes of the request table and the results log
        when they changed, for the engine's metrics; None when there is none of these."""
        tracked, kept = len(self.requests), len(self.results_log)
        if not self._copies and tracked == self._tracked_sent and kept == self._results_sent:
            return None
        copies, self._copies = tuple(self._copies), []
        scored, self._scored_at_copy = tuple(self._scored_at_copy), []
        ahead, self._scored_ahead = tuple(self._scored_ahead), []
        step = StepCompactions(
            copies,
            worker_requests=tracked if tracked != self._tracked_sent else None,
            worker_results=kept if kept != self._results_sent else None,
            scored_at_copy=scored,
            scored_ahead=ahead,
        )
        self._tracked_sent, self._results_sent = tracked, kept
        return step

    # ---- the Python API (rcstat_vllm/api.py) and tests ----

    def compression_results(self) -> dict[str, dict]:
        return self.results_log.as_dicts()

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

    # ---- inside the step ----

    def _agree(self) -> None:
        """This step's selections as plans for the scheduler: the blocks each request keeps are the max over
        tensor-parallel ranks (they share one block table but hold different heads); a prompt's token counts as
        evicted only where every rank's heads evicted it. Prompts first, then decode-time jobs, each in the table's
        order (the same on every rank)."""
        # (SELECTED records hold their job; a prompt job's visibility mask is set once it selected)
        selected = self.requests.in_phase(Phase.SELECTED)
        for kind in ("prompt", "decode"):
            records = [record for record in selected if record.job.kind == kind]  # type: ignore[union-attr]
            if not records:
                continue
            agreed = max_over_ranks([record.blocks_needed for record in records], self.block_agreement_group)
            if kind == "prompt":
                masks = [r.job.visible for r in records]  # type: ignore[union-attr]
                visible = visible_on_any_rank(masks, self.block_agreement_group)  # type: ignore[arg-type]
                for record, mask in zip(records, visible):
                    record.job.visible = mask  # type: ignore[union-attr]
            for record, keep_blocks in zip(records, agreed):
                self.requests.job_sent(record)
                self.results_log.send(record.job.plan_report(keep_blocks))  # type: ignore[union-attr]

    def _run_compaction(self, compaction: Compaction) -> str | None:
        """The scheduler's answer to a plan: copy the kept entries into its fresh blocks, or go on without. Returns
        the kind of the copy run ("prompt" or "decode"), None for a refusal."""
        record = self.requests.get(compaction.req_id)
        if record is None or record.phase is not Phase.AWAITING_BLOCKS:
            raise RuntimeError(f"rcstat: the scheduler sent blocks for request {compaction.req_id}, which has no plan")
        job = record.job
        assert job is not None  # (AWAITING_BLOCKS: a job in flight)
        if compaction.cancelled_reason is not None:
            outcome = job.cancelled(compaction.cancelled_reason)
            self.requests.job_cancelled(record)
            if outcome is not None:
                self.results_log.record(outcome)
            return None
        # (a plan is made only once the layers are attached: the page store and the page space exist, and every
        # layer's cache was remembered by the step that scored the job)
        pages = job.compact(self.pages.layer_caches, compaction, self.space)  # type: ignore[union-attr, arg-type]
        if record.pages is not None:
            self.pages.release(record.pages)  # type: ignore[union-attr]
        self.pages.attach(pages)  # type: ignore[union-attr]
        self.requests.job_compacted(record, pages)
        if job.kind == "prompt":
            outcome = job.outcome(compaction)
            self.results_log.record(outcome)
            if getattr(job, "deferred_bound", None) is not None and outcome.kept:  # its plan carried no ratio
                self._scored_at_copy.append(
                    (outcome.compression_ratio, outcome.global_eviction_ratio, outcome.head_consensus)
                )
            watcher = job.decode_watcher(pages)
            if watcher is not None:
                self.requests.watch_decode(record.req_id, watcher)
        else:
            self.results_log.decode_compacted(record.req_id, job.decode.compactions, job.decode.tokens_evicted)
        return job.kind

    def _score_ahead(self, ahead: ScoreAhead) -> None:
        """Score parked plans the scheduler expects to compact within ``ahead.steps`` steps, in its order (those
        freeing most first), at most ``1 / (ahead.steps - 2)`` of the model's layers in this step, or select what a
        plan scored in earlier steps keeps (the step's whole share): the step that copies a plan then waits only for
        its copy, and no step waits for more than that share of a scoring. Timed as a ``score_ahead`` run of the
        step's compaction work."""
        budget = ahead.layers_per_step(len(self.layer_names))
        for req_id in ahead.req_ids:
            record = self.requests.get(req_id)
            if budget <= 0 or record is None or record.phase is not Phase.AWAITING_BLOCKS or record.job is None:
                continue
            assert self.pages is not None  # (a plan is made only once the layers are attached)
            start = time.perf_counter()
            scored = record.job.score_ahead(self.pages.layer_caches, budget, self.space)  # type: ignore[arg-type]
            if scored:
                budget -= scored
                self._copies.append(CopyRun(req_id, "score_ahead", time.perf_counter() - start))
                if record.job.scored_ahead:
                    self._scored_ahead.append(req_id)  # (the scheduler may now compact it for a waiting prompt)

    def _continue_session(self, req_id: str) -> None:
        """A streaming-input session's next chunk arrived (vLLM keeps the request's blocks and appends the chunk to its
        prompt). A request whose KV was compacted keeps its head pages, which the chunk grows like generated tokens
        (every head keeps it), and its result stands (a decode-time compaction waiting for blocks is stale: cancelled).
        Any other request starts afresh: a compaction still waiting for blocks is stale (the scheduler dropped its
        plan, ``patches/scheduler.py``) and cancelled, the earlier turns are the new prompt's prefix, kept as they are,
        the chunk's end compresses what is new, and its result starts a new pass."""
        self.request_settings.drop(req_id)  # the chunk brings its own sampling parameters
        record = self.requests.get(req_id)
        stale = "the streaming-input session's next chunk arrived before the compaction"
        if record is not None and record.job is not None:
            outcome = record.job.cancelled(stale)
            self.requests.job_cancelled(record)
            if outcome is not None:
                self.results_log.record(outcome)
        if record is not None and record.pages is not None:
            return
        self.requests.drop(req_id)
        self.results_log.end_pass(req_id, "session continued")

    def _release_pages(self, req_ids) -> None:
        for req_id in req_ids:
            record = self.requests.get(req_id)
            if record is not None and record.pages is not None:
                self.requests.drop(req_id)
                self.pages.release(record.pages)  # type: ignore[union-attr]  # (pages exist: the store does)

    def _report_unserved(self, info: StepInfo) -> None:
        """No layer runs the plugin's backend (no builder plans the steps): each request finishing its prefill is
        reported uncompressed, with the reason, as the builder's plan would report it."""
        block_size = self.vllm_config.cache_config.block_size
        for request in info.requests:
            if request.finishes_prefill:
                settings = self.request_settings.of(request.req_id, request.extra_args)
                decision = plan_compression(request, settings, 0, 0, self.disabled_reason)
                report = decision.skipped_report(0, 0, block_size)
                record = self.requests.drop(request.req_id)
                report.num_cached_tokens = 0 if record is None else record.cached_tokens
                self.results_log.record(report)
                self.results_log.send(report)


# ---- how the builders find their owner ----

#: the owner whose model runner is building its attention backends right now (set by the runner hook around vLLM's
#: ``initialize_kv_cache``, the way vLLM sets its current config around building a model)
_building: ContextVar[WorkerCompression | None] = ContextVar("rcstat_building", default=None)

#: a builder built outside a hooked model runner (a runner class the plugin does not hook) is served by this reason
UNHOOKED_RUNNER = "the model runner does not carry the plugin's hooks (unsupported runner)"


def new_worker_compression(vllm_config, kv_cache_groups=None) -> WorkerCompression | None:
    """A fresh owner for a model runner setting up its KV cache (``kv_cache_groups``: its KV cache groups, of which
    one is compressed); None when the flag is off."""
    if server_config(vllm_config.additional_config) is None:
        return None
    return WorkerCompression(vllm_config, kv_cache_groups=kv_cache_groups)


@contextmanager
def building_backends(owner: WorkerCompression | None) -> Iterator[None]:
    """While a model runner builds its attention backends: their metadata builders get ``owner``
    (:func:`worker_compression`)."""
    token = _building.set(owner)
    try:
        yield
    finally:
        _building.reset(token)


def worker_compression(vllm_config) -> WorkerCompression:
    """The owner a metadata builder reports to: its runner's, while the runner builds its backends. A builder built
    outside a hooked model runner gets a disabled owner whose reason says so."""
    owner = _building.get()
    if owner is not None and owner.vllm_config is vllm_config:
        return owner
    # (``patches/runner_choice.py`` refuses to start such an engine; this owner keeps a builder built some other way
    # harmless: every request runs uncompressed, its report naming the reason)
    return WorkerCompression(vllm_config, disabled_reason=UNHOOKED_RUNNER)
