"""Aggregate compression statistics on the scheduler side, logged periodically at INFO.

Per request the worker logs at DEBUG (ratio, kept counts, predicted blocks freed) and the scheduler at DEBUG
(blocks actually returned to the pool). These running totals give operators the picture at a glance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rcstat_vllm.log import logger
from rcstat_vllm.reports import CompressionReport

LOG_INTERVAL_S = 10.0


@dataclass
class CompressionStats:
    requests_compressed: int = 0
    requests_skipped: int = 0
    blocks_freed: int = 0
    ratio_sum: float = 0.0
    _last_log: float = field(default_factory=time.monotonic)
    _dirty: bool = False

    def observe(self, report: CompressionReport, blocks_freed: int) -> None:
        if report.skipped_reason is not None:
            self.requests_skipped += 1
        else:
            self.requests_compressed += 1
            self.ratio_sum += report.compression_ratio
        self.blocks_freed += blocks_freed
        self._dirty = True

    @property
    def mean_ratio(self) -> float:
        return self.ratio_sum / self.requests_compressed if self.requests_compressed else 0.0

    def maybe_log(self, free_blocks: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self._dirty or (not force and now - self._last_log < LOG_INTERVAL_S):
            return
        logger.info(
            "rcstat: %d requests compressed (mean compression ratio %.3f), %d run uncompressed; "
            "%d KV blocks freed in total; %d blocks free now",
            self.requests_compressed,
            self.mean_ratio,
            self.requests_skipped,
            self.blocks_freed,
            free_blocks,
        )
        self._last_log, self._dirty = now, False
