"""Per-request compression: decide whether a request is compressed, then score, select and compact it
layer by layer during the forward of its last prefill chunk.

Backend-agnostic: works on one layer's cache tensor ``[num_blocks, H, N, 2D]`` and the request's block
row, so the CPU backend and a CUDA backend can share it (only the attention kernels differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rcstat_vllm.config import ConfigError, RCStatConfig, request_overrides
from rcstat_vllm.head_pages import (
    CPU_VEC,
    CacheLayout,
    CompactedRequest,
    cdiv,
    compact_layer,
    gather_prompt,
    stack_tables,
)
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.scoring import SCORERS, get_scorer, select_budget, select_threshold
from rcstat_vllm.step import BatchRequest


@dataclass(frozen=True)
class CompressionDecision:
    req_id: str
    config: RCStatConfig
    #: tokens in the cache after this step (prompt, plus recomputed output after a preemption)
    num_tokens: int
    #: this request's rows in the step's query tensor
    query_start: int
    query_end: int
    skipped_reason: str | None = None

    def skipped_report(self, num_layers: int, num_heads: int, block_size: int) -> CompressionReport:
        return CompressionReport(
            req_id=self.req_id,
            num_prompt_tokens=self.num_tokens,
            method=self.config.method,
            keep_blocks=cdiv(self.num_tokens, block_size),  # every prompt block: the scheduler frees nothing
            kept=[[self.num_tokens] * num_heads for _ in range(num_layers)],
            skipped_reason=self.skipped_reason,
            block_size=block_size,
        )


def request_config(request: BatchRequest, server: RCStatConfig) -> tuple[RCStatConfig, str | None]:
    """The server config with the request's overrides, or the server config and why the overrides failed."""
    try:
        return server.merged(request_overrides(request.extra_args)), None
    except ConfigError as exc:  # validated at admission already; never crash the batch over it
        return server, f"invalid override: {exc}"


def window_queries(config: RCStatConfig) -> int:
    """How many trailing prompt queries scoring needs: the method's own window and the kept window."""
    if config.method == "rc":
        return config.window
    return max(SCORERS[config.method].default_window_size, config.window)


def plan_compression(
    request: BatchRequest,
    server: RCStatConfig,
    query_start: int,
    query_end: int,
    disabled_reason: str | None = None,
    saved_queries: int = 0,
) -> CompressionDecision:
    """Whether (and how) a request finishing its prefill this step is compressed; the reason if not.

    ``saved_queries``: trailing queries kept from earlier prefill chunks (chunked prefill).
    """
    config, reason = request_config(request, server)
    reason = disabled_reason or reason
    n = request.num_tokens_after_step
    if reason is None:
        if not config.enabled:
            reason = "method none"
        elif n < config.min_prompt_len:
            reason = f"prompt of {n} tokens is shorter than min_prompt_len={config.min_prompt_len}"
        elif query_end - query_start + saved_queries < config.window:
            reason = "fewer prompt queries than the observation window"
        elif n <= config.window + config.sink_tokens:
            reason = "nothing outside the window and sink tokens"
    return CompressionDecision(request.req_id, config, n, query_start, query_end, reason)


class LayerCompressor:
    """Compresses one request, one layer at a time, then hands over its :class:`CompactedRequest`."""

    def __init__(
        self,
        decision: CompressionDecision,
        num_layers: int,
        num_heads: int,
        block_row: torch.Tensor,
        layout: CacheLayout = CPU_VEC,
    ):
        self.decision = decision
        self.layout = layout
        self.config = decision.config
        self.block_row = block_row.clone()
        self.num_heads = num_heads
        self.kept = torch.zeros((num_layers, num_heads), dtype=torch.int64)
        self.tables: list[torch.Tensor | None] = [None] * num_layers
        self.block_size = 0
        self.scorer = get_scorer(self.config.method, **self._scorer_options())

    def _scorer_options(self) -> dict:
        # RC's observation window is the config's; the baselines keep their published defaults.
        return {"window_size": window_queries(self.config)} if self.config.method == "rc" else {}

    def compress_layer(
        self,
        layer: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        saved_queries: torch.Tensor | None = None,
    ) -> None:
        """Score, select and compact one layer. ``query`` is the step's [T, Hq, D] (RoPE applied: vLLM
        passes rotated queries); ``saved_queries`` the trailing queries of earlier prefill chunks."""
        d = self.decision
        n = d.num_tokens
        self.block_size = self.layout.shape(kv_cache)[2]
        queries = query[d.query_start : d.query_end]
        if saved_queries is not None:
            queries = torch.cat([saved_queries, queries])
        width = min(window_queries(self.config), queries.shape[0])
        q_window = queries[-width:].transpose(0, 1).float()  # [Hq, w, D]
        keys, values = gather_prompt(kv_cache, self.block_row, n, self.layout)
        scores = self.scorer.score(q_window, keys.float(), values.float(), scale)
        if self.config.budget_mode:
            keep = select_budget(scores, self.config.window, self.config.target_ratio, self.config.sink_tokens)
        else:
            keep = select_threshold(scores, self.config.window, self.config.c, self.config.sink_tokens)
        self.tables[layer] = compact_layer(kv_cache, self.block_row, keep.mask, self.layout)
        self.kept[layer] = keep.counts.cpu()

    def compacted(self) -> CompactedRequest:
        """The request's compacted state, not yet finalized: the planner decides the blocks it keeps (agreed
        across tensor-parallel ranks) and calls ``finalize``."""
        missing = [i for i, t in enumerate(self.tables) if t is None]
        if missing:
            raise RuntimeError(f"rcstat: layers {missing} were not compressed for {self.decision.req_id}")
        return CompactedRequest(
            num_compacted_tokens=self.decision.num_tokens,
            block_size=self.block_size,
            num_heads=self.num_heads,
            kept=self.kept,
            # Host-side page tables: the per-step bookkeeping (reserve, slots, pools) then never waits on the
            # accelerator; make_head_plan copies what a step needs to the cache's device.
            tables=stack_tables(self.tables).cpu(),
        )

    def report(self, state: CompactedRequest) -> CompressionReport:
        return CompressionReport(
            req_id=self.decision.req_id,
            num_prompt_tokens=self.decision.num_tokens,
            method=self.config.method,
            keep_blocks=state.keep_blocks,
            kept=self.kept.tolist(),
            block_size=self.block_size,
        )

