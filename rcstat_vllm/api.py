"""Reading what the plugin did from the Python API.

The results live in the worker processes (where compression happens). The plugin adds
:class:`RCStatWorkerExtension` to vLLM's workers (``parallel_config.worker_extension_cls``) when the flag
is on, so ``LLM.collective_rpc`` can reach them::

    llm = LLM(model, additional_config={"rcstat": {"method": "rc"}})
    outputs = llm.generate(prompts, params)
    results = compression_results(llm)          # {request id: {"compression_ratio": ..., ...}}
"""

from __future__ import annotations

from typing import Any

from rcstat_vllm.attribution.capture import AttributionWorkerMixin
from rcstat_vllm.reports import CompressionReport

EXTENSION_PATH = "rcstat_vllm.api.RCStatWorkerExtension"


class RCStatWorkerExtension(AttributionWorkerMixin):
    """Mixed into vLLM's worker class: methods callable through ``collective_rpc``."""

    def _rcstat_worker(self):
        from rcstat_vllm.owners import runner_owner

        return runner_owner(self.model_runner)

    def rcstat_compression_results(self) -> dict[str, dict[str, Any]]:
        owner = self._rcstat_worker()
        return {} if owner is None else owner.compression_results()

    def rcstat_clear_results(self) -> None:
        owner = self._rcstat_worker()
        if owner is not None:
            owner.results_log.clear()

    def rcstat_num_compressed_requests(self) -> int:
        """Requests whose compacted KV the worker still tracks (0 once every request has finished)."""
        owner = self._rcstat_worker()
        return 0 if owner is None else owner.num_compressed_requests


def compression_results(llm) -> dict[str, dict[str, Any]]:
    """Per-request compression results (ratio, kept counts per layer and head, blocks freed), keyed by the
    engine's request id. Tensor-parallel ranks hold different heads: their kept counts are concatenated."""
    merged: dict[str, dict[str, Any]] = {}
    for rank_results in llm.collective_rpc("rcstat_compression_results"):
        for req_id, result in rank_results.items():
            if req_id not in merged:
                merged[req_id] = result
            else:  # another rank: more heads of the same layers; ratio and packing are over all of them
                report = CompressionReport.from_dict(merged[req_id])
                report.kept = [a + b for a, b in zip(report.kept, result["kept"])]
                merged[req_id] = report.to_dict()
    return merged


def match_outputs(outputs, results: dict[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The result of each ``RequestOutput`` (vLLM may suffix the engine-side request id)."""
    matched = []
    for output in outputs:
        found = results.get(output.request_id)
        if found is None:
            found = next((r for k, r in results.items() if k.startswith(f"{output.request_id}-")), None)
        matched.append(found)
    return matched
