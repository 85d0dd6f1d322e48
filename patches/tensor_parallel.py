"""Tensor parallelism: the process group on which ranks agree how many blocks a compressed request keeps.

TP ranks hold different KV heads but share the scheduler's block table, so each request keeps the max over
ranks of the blocks its heads need (``rcstat_vllm.worker.WorkerCompression``). The reduction runs on
vLLM's TP group's CPU (gloo) group: a handful of integers per step that compresses a request.
"""

from __future__ import annotations

from ._contract import Contract

CONTRACTS = (
    Contract("vllm.distributed.parallel_state:get_tp_group", ()),
    # ``cpu_group`` is an instance attribute (annotated on the class): checked where it is read.
    Contract("vllm.distributed.parallel_state:GroupCoordinator"),
)


def tensor_parallel_cpu_group():
    """vLLM's tensor-parallel CPU process group (call only when tensor_parallel_size > 1)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = getattr(get_tp_group(), "cpu_group", None)
    if group is None:
        raise RuntimeError("rcstat: vLLM's TP GroupCoordinator has no cpu_group (vLLM changed?)")
    return group
