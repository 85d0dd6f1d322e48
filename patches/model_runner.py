"""Worker side: tell the plugin's metadata builder which requests are in the batch, and carry the
compaction reports back to the scheduler inside ``ModelRunnerOutput``.

vLLM's ``CommonAttentionMetadata`` has no request ids, settings or prompt lengths, which per-request
compression needs; the runner's persistent batch has them once ``_prepare_inputs`` has ordered it. These
hooks are installed only by the plugin's backend (so only when the flag is on) and act only on runners
whose attention groups use that backend.
"""

from __future__ import annotations

from rcstat_vllm.reports import REPORTS_ATTR
from rcstat_vllm.step import BatchRequest, StepInfo

from ._contract import Contract, wrap_method

CONTRACTS = (
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
        ("self", "scheduler_output", "num_scheduled_tokens"),
    ),
    Contract(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
        ("self", "scheduler_output"),
    ),
    Contract("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens", ("self", "grammar_output")),
    Contract("vllm.v1.outputs:ModelRunnerOutput"),
    Contract("vllm.v1.core.sched.output:SchedulerOutput"),
)


def _rcstat_builders(runner) -> list:
    from rcstat_vllm.backend_common import CompressionPlanner

    builders = []
    for groups in getattr(runner, "attn_groups", ()):
        for group in groups:
            for builder in getattr(group, "metadata_builders", ()):
                if isinstance(builder, CompressionPlanner):
                    builders.append(builder)
    return builders


def step_info(runner, scheduler_output) -> StepInfo:
    """The batch as the attention metadata will see it (rows in the runner's order)."""
    batch = runner.input_batch
    requests = []
    for index, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        requests.append(
            BatchRequest(
                req_id=req_id,
                num_prompt_tokens=int(batch.num_prompt_tokens[index]),
                num_computed_tokens=int(batch.num_computed_tokens_cpu[index]),
                num_scheduled_tokens=int(scheduler_output.num_scheduled_tokens[req_id]),
                extra_args=getattr(params, "extra_args", None),
            )
        )
    dropped = set(scheduler_output.finished_req_ids)
    dropped |= set(scheduler_output.preempted_req_ids or ())
    dropped |= set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ())
    return StepInfo(requests=requests, dropped_req_ids=dropped)


def _prepare_inputs(original):
    def wrapper(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        builders = _rcstat_builders(self)
        if builders:
            info = step_info(self, scheduler_output)
            for builder in builders:
                builder.begin_step(info)
        return result

    return wrapper


def _attach_reports(runner, output):
    from vllm.v1.outputs import ModelRunnerOutput

    if not isinstance(output, ModelRunnerOutput):
        return output
    reports = [r for b in _rcstat_builders(runner) for r in b.pop_reports()]
    if reports:
        # An attribute on the instance survives the pickling between worker and engine processes.
        setattr(output, REPORTS_ATTR, reports)
    return output


def _execute_model(original):
    def wrapper(self, *args, **kwargs):
        return _attach_reports(self, original(self, *args, **kwargs))

    return wrapper


def _sample_tokens(original):
    def wrapper(self, *args, **kwargs):
        return _attach_reports(self, original(self, *args, **kwargs))

    return wrapper


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_method(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    wrap_method(GPUModelRunner, "execute_model", _execute_model)
    wrap_method(GPUModelRunner, "sample_tokens", _sample_tokens)
