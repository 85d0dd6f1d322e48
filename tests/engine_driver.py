"""Drive a vLLM-CPU engine step by step in this process, with the scheduler and worker in reach.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and the (single) worker in the test process, so
tests can read the ``BlockPool``'s free block count and the plugin's worker state between steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rcstat_vllm.model import default_model_dir, with_embedded_dtype

FAST_START = dict(enforce_eager=True, compilation_config={"mode": 0})

#: Varied English text to cut prompts from (token ids), so the model sees natural language.
TEXT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the wind came from the north and the "
    "boats stayed in the harbour. On Tuesday a ship with red sails passed the cape at noon. The keeper's "
    "daughter counted forty-two gulls on the rocks. Her brother repaired the lamp with a brass screw. "
    "In the village, the baker sold bread shaped like stars, and the school bell rang twice. "
    "A traveller asked for the road to the old mill; the keeper pointed east, past the orchard. "
)


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    peak_running: int = 0
    steps: int = 0
    preemptions: int = 0
    free_trace: list[int] = field(default_factory=list)
    #: per finished request, its prompt tokens served from the prefix cache (RequestOutput.num_cached_tokens)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    #: per step, the tokens the scheduler gave each request (by the id it was added with): two runs with equal
    #: batches ran the same forwards, request for request
    batches: list[dict[str, int]] = field(default_factory=list)


class EngineDriver:
    def __init__(self, async_scheduling: bool = False, **engine_kwargs):
        """``async_scheduling``: run vLLM's asynchronous scheduling, as a GPU engine does by default (vLLM-CPU turns it
        off; its V1 runner serves it in process all the same): each step's output reaches the scheduler after the
        next step was scheduled and run, the AsyncScheduler's batch queue of two."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import EngineArgs, LLMEngine

        args = EngineArgs(**with_embedded_dtype(dict(model=str(default_model_dir()), **FAST_START, **engine_kwargs)))
        if async_scheduling:
            config = args.create_engine_config()
            config.scheduler_config.async_scheduling = True  # (after vLLM-CPU's platform hook turned it off)
            self.engine = LLMEngine.from_vllm_config(config)
        else:
            self.engine = LLMEngine.from_engine_args(args)
        # The worker runs on this thread. On a 2-core machine shared with other processes, OpenMP's spinning
        # barriers make 2 intra-op threads an order of magnitude slower than 1 (measured: 115 vs 8 ms for one
        # RMSNorm of 512 tokens); one thread keeps the tests' run time predictable.
        import torch

        torch.set_num_threads(1)
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.pool = self.scheduler.kv_cache_manager.block_pool
        worker = core.model_executor.driver_worker
        self.worker = getattr(worker, "worker", worker)
        self.tokenizer = self.engine.get_tokenizer()
        self._text_ids = self.tokenizer(TEXT * 80, add_special_tokens=False)["input_ids"]
        self._batches: list[dict[str, int]] | None = None
        schedule = self.scheduler.schedule

        def recording_schedule(*args, **kwargs):  # this instance only: RunResult.batches
            output = schedule(*args, **kwargs)
            if self._batches is not None and output.num_scheduled_tokens:
                # vLLM's engine-side id is the id the request was added with, a dash and a random suffix
                self._batches.append({rid.rsplit("-", 1)[0]: n for rid, n in output.num_scheduled_tokens.items()})
            return output

        self.scheduler.schedule = recording_schedule

    # ---- helpers ----

    @property
    def compression(self):
        """The worker's compression state (rcstat_vllm.worker.driver.WorkerCompression), None without the flag."""
        from rcstat_vllm.owners import runner_owner

        return runner_owner(self.worker.model_runner)

    @property
    def stats(self):
        """The scheduler's logged totals (rcstat_vllm.engine.metrics.CompressionStats)."""
        from rcstat_vllm.patches.scheduler import scheduler_stats

        return scheduler_stats(self.scheduler)

    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def poison_kv_cache(self, value: float) -> None:
        """Fill every layer's KV cache with ``value`` and empty the prefix cache, between runs (every block free): a
        run that reads a slot it never wrote then reads ``value``, so two runs of the same requests poisoned with
        different values decode alike only if neither reads what an earlier run left behind."""
        assert self.free_blocks() == self.pool.num_gpu_blocks - 1, "requests still hold blocks"
        for cache in self.worker.model_runner.kv_caches:
            cache.fill_(value)
        assert self.engine.reset_prefix_cache()

    def prompt(self, num_tokens: int, offset: int = 0) -> dict:
        return {"prompt_token_ids": self.token_ids(num_tokens, offset)}

    def token_ids(self, num_tokens: int, offset: int = 0) -> list[int]:
        ids = self._text_ids[offset : offset + num_tokens]
        assert len(ids) == num_tokens, "TEXT too short for this prompt"
        return ids

    def result(self, request_id: str) -> dict | None:
        results = self.compression.compression_results()
        return next((r for k, r in results.items() if k == request_id or k.startswith(f"{request_id}-")), None)

    def engine_id(self, request_id: str) -> str:
        """vLLM's engine-side id of a request added as ``request_id`` (it may carry a suffix)."""
        rid = self._find(request_id)
        assert rid is not None, f"{request_id} is not in the scheduler"
        return rid

    def _find(self, request_id: str) -> str | None:
        return next((r for r in self.scheduler.requests if r == request_id or r.startswith(f"{request_id}-")), None)

    def record(self, request_id: str):
        """The worker's record of a request added as ``request_id`` (None when it has none)."""
        rid = self._find(request_id)
        return None if rid is None else self.compression.requests.get(rid)

    def generated(self, request_id: str) -> int:
        """Output tokens the scheduler has of a request (0 once it finished)."""
        rid = self._find(request_id)
        return 0 if rid is None else self.scheduler.requests[rid].num_output_tokens

    def step(self) -> dict[str, list[int]]:
        """One engine step; the tokens of the requests it finished."""
        return {o.request_id: list(o.outputs[0].token_ids) for o in self.engine.step() if o.finished}

    def step_until(self, done, max_steps: int = 500) -> dict[str, list[int]]:
        """Step until ``done()``; the tokens of the requests that finished meanwhile."""
        finished = {}
        for _ in range(max_steps):
            if done():
                return finished
            finished |= self.step()
        raise AssertionError("the condition was never met")

    def abort(self, request_id: str) -> None:
        """Abort a request by the id it was added with (vLLM's engine-side id would abort nothing: the output processor
        takes the caller's ids), as a client does when it goes away."""
        self.engine.abort_request([request_id])
        assert self._find(request_id) is None, f"{request_id} was not aborted"

    # ---- streaming-input sessions (vLLM 0.32's resumable requests: AsyncLLM.generate with a StreamingInput) ----

    def send_chunk(self, session: str, token_ids: list[int] | None, params) -> None:
        """One input chunk of a streaming session, as ``AsyncLLM.generate`` sends it to the engine core (``None``: the
        input stream closed, the session finishes)."""
        from vllm.inputs import TokensPrompt

        request = self.engine.input_processor.process_inputs(
            request_id=session,
            prompt=TokensPrompt(prompt_token_ids=token_ids or [0]),
            params=params,
            supported_tasks=self.engine.get_supported_tasks(),
            resumable=token_ids is not None,
        )
        request.external_req_id = session
        self.engine.engine_core.add_request(request)

    def turn(self, session: str) -> list[int]:
        """Step until the session's turn ends (the request waits for its next chunk, its blocks kept); its tokens."""
        from vllm.v1.request import RequestStatus

        request = self.scheduler.requests[session]
        self.step_until(lambda: request.status == RequestStatus.WAITING_FOR_STREAMING_REQ)
        return list(request.output_token_ids)

    def end_session(self, session: str, params) -> None:
        self.send_chunk(session, None, params)
        self.step_until(lambda: session not in self.scheduler.requests)

    def preempt(self, request_id: str) -> None:
        """What vLLM's scheduler does to the request it preempts when the pool runs short (recompute): out of the
        running queue, blocks freed, back to the front of the waiting queue (under asynchronous scheduling the output
        of the step in flight marked stale, as vLLM's own preemption does)."""
        import time

        request = self.scheduler.requests[self.engine_id(request_id)]
        self.scheduler.running.remove(request)
        self.scheduler._preempt_request(request, time.monotonic())

    def run(self, requests, abort_after: dict[str, int] | None = None, max_steps: int = 100_000) -> RunResult:
        """Add ``(request_id, prompt, SamplingParams)`` requests, step until all finish."""
        abort_after = dict(abort_after or {})
        preempted_before = self._count_preemptions()
        for request_id, prompt, params in requests:
            self.engine.add_request(request_id, prompt, params)
        result = RunResult()
        self._batches = result.batches
        while self.engine.has_unfinished_requests() and result.steps < max_steps:
            for output in self.engine.step():
                if output.finished:
                    result.outputs[output.request_id] = list(output.outputs[0].token_ids)
                    result.cached_tokens[output.request_id] = output.num_cached_tokens or 0
            result.steps += 1
            result.peak_running = max(result.peak_running, len(self.scheduler.running))
            result.free_trace.append(self.free_blocks())
            due = [rid for rid, step in abort_after.items() if step <= result.steps]
            if due:
                self.engine.abort_request(due)
                for rid in due:
                    abort_after.pop(rid)
        result.preemptions = self._count_preemptions() - preempted_before
        self._batches = None
        return result

    def _count_preemptions(self) -> int:
        return getattr(self.scheduler, "_rcstat_test_preemptions", 0)

    def count_preemptions(self) -> None:
        """Wrap the scheduler's preemption (this instance only) to count preemptions."""
        original = self.scheduler._preempt_request

        def counting(*args, **kwargs):
            self.scheduler._rcstat_test_preemptions = self._count_preemptions() + 1
            return original(*args, **kwargs)

        self.scheduler._preempt_request = counting
