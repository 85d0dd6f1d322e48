"""What the worker tells the scheduler (and the user) about one request's compression."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Attribute of ``ModelRunnerOutput`` that carries this step's reports from worker to scheduler.
REPORTS_ATTR = "rcstat_reports"


@dataclass
class CompressionReport:
    """The outcome of compressing one request's prompt KV.

    ``keep_blocks`` and ``tail_block`` tell the scheduler which blocks the request still holds: the first
    ``keep_blocks`` and every block from ``tail_block`` on (the last prompt block, where decode goes on).
    """

    req_id: str
    num_prompt_tokens: int
    method: str
    keep_blocks: int
    tail_block: int
    #: kept tokens per [layer][kv head]
    kept: list[list[int]] = field(default_factory=list)
    skipped_reason: str | None = None

    @property
    def blocks_freed(self) -> int:
        return max(self.tail_block - self.keep_blocks, 0)

    @property
    def compression_ratio(self) -> float:
        """Evicted / total prompt KV entries over all layers and heads."""
        total = sum(len(row) for row in self.kept) * self.num_prompt_tokens
        if total == 0:
            return 0.0
        return 1.0 - sum(map(sum, self.kept)) / total

    def to_dict(self) -> dict:
        return {
            "req_id": self.req_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "method": self.method,
            "compression_ratio": self.compression_ratio,
            "blocks_freed": self.blocks_freed,
            "keep_blocks": self.keep_blocks,
            "tail_block": self.tail_block,
            "kept": self.kept,
            "skipped_reason": self.skipped_reason,
        }
