"""Worker side: the model runner creates the plugin's worker state, hands it each step's batch, and carries
its compaction reports back to the scheduler.

- ``initialize_kv_cache``: before vLLM builds the attention backends' metadata builders, start the worker's
  :class:`~rcstat_vllm.worker.driver.WorkerCompression` (the builders report to it); after vLLM allocated the KV
  cache, bind the layers' cache tensors (it decides whether head pages pool across layers).
- ``_prepare_inputs``: vLLM's ``CommonAttentionMetadata`` has no request ids, settings or prompt lengths, which
  per-request compression needs; the runner's persistent batch has them once ``_prepare_inputs`` has ordered
  it.
- ``_determine_batch_execution_and_padding`` (``cuda_graphs: full_decode``): a step whose attention does host work
  (queries kept, a compaction job scored, attribution) is dispatched as not a uniform decode, so it runs piecewise,
  never replayed from a full CUDA graph, which would skip the forward's Python.
- ``execute_model`` / ``sample_tokens``: the step's reports (and the time its copies took) travel to the scheduler in
  :class:`RCStatModelRunnerOutput`, a ``ModelRunnerOutput`` with two more fields (it pickles between processes
  like its base; ``patches/scheduler.py`` reads it). A step that schedules no tokens never reaches
  ``_prepare_inputs``: ``execute_model`` hands the worker what it ends (:func:`idle_step_info`).

Every hook passes straight through when the engine runs without the plugin flag (no worker state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from rcstat_vllm.owners import building_backends, runner_owner, start_runner_owner
from rcstat_vllm.reports import CompressionReport, ScoreAhead, StepCompactions
from rcstat_vllm.vllm_private.internals import forward_context, kv_cache_groups
from rcstat_vllm.worker.step import BatchRequest, StepInfo

from ._contract import Contract, wrap_method

CONTRACTS = (
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache",
        ("self", "kv_cache_config"),
    ),
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
        ("self", "scheduler_output", "num_scheduled_tokens"),
    ),
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
        (
            "self",
            "num_tokens",
            "num_reqs",
            "num_scheduled_tokens_np",
            "max_num_scheduled_tokens",
            "use_cascade_attn",
            "allow_microbatching",
            "force_eager",
            "force_uniform_decode",
        ),
    ),
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
        ("self", "scheduler_output"),
    ),
    Contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", ("self", "grammar_output")),
    Contract("vllm.v1.outputs:ModelRunnerOutput"),
    Contract("vllm.v1.outputs:AsyncModelRunnerOutput.get_output", ("self",)),
    Contract(
        "vllm.v1.core.sched.output:SchedulerOutput",
        attrs=(
            "total_num_scheduled_tokens",
            "num_scheduled_tokens",
            "finished_req_ids",
            "preempted_req_ids",
            "scheduled_cached_reqs",
            "scheduled_new_reqs",
        ),
    ),
    Contract("vllm.v1.core.sched.output:NewRequestData", attrs=("req_id",)),
)


@dataclass
class RCStatModelRunnerOutput(ModelRunnerOutput):
    """vLLM's step output plus the compression reports of the requests compacted in that step."""

    rcstat_reports: list[CompressionReport] = field(default_factory=list)
    #: the copies the worker ran before this step's forward and their time (None: none ran)
    rcstat_step: StepCompactions | None = None


class RCStatAsyncModelRunnerOutput(AsyncModelRunnerOutput):
    """Under asynchronous scheduling the runner returns its step output as an ``AsyncModelRunnerOutput`` the engine
    resolves later (``get_output``, after the next step was scheduled): the reports travel inside it, so they reach
    the scheduler with the step that made them, one step late as the tokens do."""

    def __init__(self, inner: AsyncModelRunnerOutput, reports: list[CompressionReport], step: StepCompactions | None):
        self.inner, self.reports, self.step = inner, reports, step

    def get_output(self) -> ModelRunnerOutput:
        return _with_reports(self.inner.get_output(), self.reports, self.step)


def _with_reports(output: ModelRunnerOutput, reports: list[CompressionReport], step: StepCompactions | None):
    return RCStatModelRunnerOutput(
        **{f.name: getattr(output, f.name) for f in fields(output)}, rcstat_reports=reports, rcstat_step=step
    )


def kv_cache_tensors(runner) -> dict:
    """Layer name -> the layer's KV cache tensor, as vLLM bound it to the attention layers."""
    caches = {}
    for name, layer in forward_context(runner.compilation_config).items():
        kv_cache = getattr(layer, "kv_cache", None)
        if isinstance(kv_cache, (list, tuple)):  # one per virtual engine in some versions
            kv_cache = kv_cache[0] if kv_cache else None
        if kv_cache is not None and hasattr(kv_cache, "untyped_storage"):
            caches[name] = kv_cache
    return caches


def step_info(runner, scheduler_output) -> StepInfo:
    """The batch as the attention metadata will see it (rows in the runner's order).

    Each row carries its block ids from vLLM's host block table (``InputBatch.block_table``, rows in batch order
    once ``_prepare_inputs`` ran), a read-only view: a compressed request growing into a new block takes its pages
    from there instead of reading the device table: the table of the KV-cache group the plugin compresses (the only
    one, or a hybrid model's full-attention group). Where the group is not known, none are carried and the worker
    falls back to the device table (``StepPlanner._host_block_ids``).
    """
    batch = runner.input_batch
    group_tables: Sequence[Any] = getattr(batch.block_table, "block_tables", ())
    owner = runner_owner(runner)
    choice = owner.group_choice if owner is not None else None
    if choice is not None and choice.index is not None and choice.index < len(group_tables):
        host_table = group_tables[choice.index]
    else:
        host_table = group_tables[0] if len(group_tables) == 1 else None
    requests = []
    for index, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        block_ids = None
        if host_table is not None:
            block_ids = host_table.block_table.np[index, : host_table.num_blocks_per_row[index]]
            block_ids.flags.writeable = False
        requests.append(
            BatchRequest(
                req_id=req_id,
                num_prompt_tokens=int(batch.num_prompt_tokens[index]),
                num_computed_tokens=int(batch.num_computed_tokens_cpu[index]),
                num_scheduled_tokens=int(scheduler_output.num_scheduled_tokens[req_id]),
                extra_args=getattr(params, "extra_args", None),
                block_ids=block_ids,
            )
        )
    return StepInfo(
        requests=requests,
        dropped_req_ids=_dropped_req_ids(scheduler_output),
        preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()),
        resumed_req_ids=_resumed_req_ids(scheduler_output),
        new_req_ids=frozenset(request.req_id for request in scheduler_output.scheduled_new_reqs),
        compactions=_compactions(scheduler_output),
        block_size=None if host_table is None else host_table.block_size,
        decode_soon=frozenset(getattr(scheduler_output, "rcstat_decode_soon", None) or ()),
        score_ahead=getattr(scheduler_output, "rcstat_score_ahead", None) or ScoreAhead(),
    )


def idle_step_info(scheduler_output) -> StepInfo:
    """A step that schedules no tokens (vLLM's runner returns before ``_prepare_inputs``, no forward): only the
    requests it ends. The engine core runs such a step when the last requests finished and it has nothing else
    to run (``Scheduler.has_finished_requests``): the one that names them finished, before it idles."""
    return StepInfo(
        requests=[],
        dropped_req_ids=_dropped_req_ids(scheduler_output),
        preempted_req_ids=frozenset(scheduler_output.preempted_req_ids or ()),
        compactions=_compactions(scheduler_output),
    )


def _resumed_req_ids(scheduler_output) -> frozenset[str]:
    return frozenset(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ())


def _dropped_req_ids(scheduler_output) -> set[str]:
    dropped = set(scheduler_output.finished_req_ids)
    dropped |= set(scheduler_output.preempted_req_ids or ())
    dropped |= _resumed_req_ids(scheduler_output)
    return dropped


def _compactions(scheduler_output) -> list:
    # An RCStatSchedulerOutput (patches/scheduler.py) when the scheduler sends compactions.
    return list(getattr(scheduler_output, "rcstat_compactions", None) or [])


def _initialize_kv_cache(original):
    def wrapper(self, kv_cache_config, *args, **kwargs):
        owner = start_runner_owner(self, kv_cache_groups(kv_cache_config))
        with building_backends(owner):  # (the metadata builders vLLM creates in there report to it)
            result = original(self, kv_cache_config, *args, **kwargs)
        if owner is not None:
            owner.bind_kv_caches(kv_cache_tensors(self))
        return result

    return wrapper


def _prepare_inputs(original):
    def wrapper(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        owner = runner_owner(self)
        if owner is not None:
            owner.begin_step(step_info(self, scheduler_output))
        return result

    return wrapper


def _determine_batch_execution_and_padding(original):
    def wrapper(self, *args, **kwargs):
        owner = runner_owner(self)
        if (
            owner is not None
            and kwargs.get("force_uniform_decode") is None
            and owner.config.cuda_graphs == "full_decode"
            and owner.dispatch_eager_attention()
        ):
            # Attention does host work in this step (queries kept, a job scored, attribution): not a uniform decode
            # for the graph dispatcher, so it runs the piecewise graphs with attention eager, never a full graph.
            kwargs["force_uniform_decode"] = False
        return original(self, *args, **kwargs)

    return wrapper


def attach_reports(runner, output):
    """The output with the worker's pending reports, when it is a step's output, plain or asynchronous (others, e.g.
    ``None`` from an ``execute_model`` whose tokens ``sample_tokens`` returns, keep them)."""
    owner = runner_owner(runner)
    if owner is None or not (type(output) is ModelRunnerOutput or isinstance(output, AsyncModelRunnerOutput)):
        return output
    reports, step = owner.pop_reports(), owner.pop_step_compactions()
    if not reports and step is None:
        return output
    if isinstance(output, AsyncModelRunnerOutput):
        return RCStatAsyncModelRunnerOutput(output, reports, step)
    return _with_reports(output, reports, step)


def _execute_model(original):
    def wrapper(self, scheduler_output, *args, **kwargs):
        output = original(self, scheduler_output, *args, **kwargs)
        if not scheduler_output.total_num_scheduled_tokens:
            owner = runner_owner(self)
            if owner is not None:
                owner.begin_step(idle_step_info(scheduler_output))
        return attach_reports(self, output)

    return wrapper


def _sample_tokens(original):
    def wrapper(self, *args, **kwargs):
        return attach_reports(self, original(self, *args, **kwargs))

    return wrapper


#: V1 ``GPUModelRunner`` method -> its hook (vLLM-CPU's V1 runner subclasses it); a runner built by a worker must
#: resolve every one of these names to the hooked method (``patches/runner_choice.py`` checks at start-up).
HOOKS = {
    "initialize_kv_cache": _initialize_kv_cache,
    "_prepare_inputs": _prepare_inputs,
    "_determine_batch_execution_and_padding": _determine_batch_execution_and_padding,
    "execute_model": _execute_model,
    "sample_tokens": _sample_tokens,
}


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name, hook in HOOKS.items():
        wrap_method(GPUModelRunner, name, hook)
