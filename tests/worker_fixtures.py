"""Worker request records in a given phase, reached through the request table's own transitions (as the driver
moves them), for tests that start from the middle of a request's life."""

from __future__ import annotations

from types import SimpleNamespace

from rcstat_vllm.worker.requests import WorkerRequest, WorkerRequests


def awaiting_blocks(table: WorkerRequests, req_id: str, job) -> WorkerRequest:
    """A prompt record whose plan is with the scheduler (PREFILL -> SCORING -> SELECTED -> AWAITING_BLOCKS)."""
    record = table.in_prefill(req_id)
    table.start_job(record, job)
    table.job_selected(record, 0)
    table.job_sent(record)
    return record


def compressed(table: WorkerRequests, req_id: str, pages) -> WorkerRequest:
    """A record compacted into ``pages`` (its attention reads them)."""
    record = awaiting_blocks(table, req_id, SimpleNamespace(kind="prompt"))
    table.job_compacted(record, pages)
    return record
