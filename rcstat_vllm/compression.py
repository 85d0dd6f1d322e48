"""Per-request compression: decide whether a request is compressed, then score it layer by layer during the
forward of its last prefill chunk and select and compact all layers after the last one.

Backend-agnostic: works on cache tensors ``[num_blocks, H, N, 2D]`` through a :class:`CacheLayout` and the
request's block row, so the CPU and CUDA backends share it (only the attention kernels differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rcstat_vllm.config import ConfigError, RCStatConfig, request_overrides
from rcstat_vllm.head_pages import CacheLayout, CompactedRequest, cdiv, compact, gather_prompt
from rcstat_vllm.page_space import PageSpace
from rcstat_vllm.reports import CompressionReport
from rcstat_vllm.scoring import SCORERS, get_scorer, select_budget, select_budget_across_layers, select_threshold
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


def scorer_options(config: RCStatConfig) -> dict:
    """The scorer's constructor options: RC's observation window and smoothing are the config's; the baselines
    keep their published defaults."""
    if config.method != "rc":
        return {}
    return {"window_size": window_queries(config), "smoothing": config.smoothing}


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


#: How a model-wide budget makes layers' scores comparable (measured against the others: README, "Which mode").
MODEL_BUDGET_COMPARABLE = "layer_mean"


def select_keep_masks(scores: list[torch.Tensor], config: RCStatConfig, comparable: str | None = None) -> list[torch.Tensor]:
    """Per layer, the ``[H, n]`` keep mask from the layers' scores: threshold mode (Eq. 9, per head) or budget
    mode, per layer or across the whole model (``config.budget_scope``)."""
    if config.budget_mode and config.budget_scope == "model":
        return select_budget_across_layers(
            scores, config.window, config.target_ratio, config.sink_tokens, comparable or MODEL_BUDGET_COMPARABLE
        )
    if config.budget_mode:
        return [select_budget(s, config.window, config.target_ratio, config.sink_tokens).mask for s in scores]
    return [select_threshold(s, config.window, config.c, config.sink_tokens).mask for s in scores]


class RequestCompressor:
    """Compresses one request during the forward of its last prefill chunk: each layer is scored as it runs
    (:meth:`score_layer`); once every layer is scored, :meth:`compact` selects what each (layer, head) keeps
    and moves it into head pages in one pass over all layers.

    Why not compact each layer as it runs: with pages pooled across layers, layer l's kept entries may move
    into pages of a later layer's slice of the request's blocks, which still holds that layer's uncompressed
    prompt KV (its attention and scoring in this very forward read it). Compacting after the last layer's
    attention, when no layer reads prompt KV any more, is safe for any page assignment; and a model-wide budget
    needs every layer's scores before it can select anyway. Between layers only the scores (``[H, n]`` floats
    per layer) are held, no KV copies.
    """

    def __init__(self, decision: CompressionDecision, num_layers: int, block_row: torch.Tensor):
        self.decision = decision
        self.config = decision.config
        self.block_row = block_row.clone()
        self.scores: list[torch.Tensor | None] = [None] * num_layers
        self.kept: torch.Tensor | None = None
        #: [L, n] bool: prompt token kept by at least one KV head of the layer (OR-ed over TP ranks by the worker)
        self.visible: torch.Tensor | None = None
        self.scorer = get_scorer(self.config.method, **scorer_options(self.config))

    @property
    def fully_scored(self) -> bool:
        return all(scores is not None for scores in self.scores)

    def score_layer(
        self,
        layer: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        layout: CacheLayout,
        saved_queries: torch.Tensor | None = None,
    ) -> None:
        """Score one layer's prompt tokens per KV head. ``query`` is the step's [T, Hq, D] (RoPE applied: vLLM
        passes rotated queries); ``saved_queries`` the trailing queries of earlier prefill chunks."""
        d = self.decision
        queries = query[d.query_start : d.query_end]
        if saved_queries is not None:
            queries = torch.cat([saved_queries, queries])
        width = min(window_queries(self.config), queries.shape[0])
        q_window = queries[-width:].transpose(0, 1).float()  # [Hq, w, D]
        keys, values = gather_prompt(kv_cache, self.block_row, d.num_tokens, layout)
        self.scores[layer] = self.scorer.score(q_window, keys.float(), values.float(), scale)

    def compact(self, caches: list[torch.Tensor], space: PageSpace, layout: CacheLayout) -> CompactedRequest:
        """Select and compact every layer; the state is not finalized yet: the worker decides the blocks it
        keeps (agreed across tensor-parallel ranks) and calls ``finalize``."""
        masks = select_keep_masks(self.scores, self.config)
        tables = compact(caches, self.block_row, masks, space, layout)
        self.kept = torch.stack([mask.sum(dim=1) for mask in masks]).cpu()
        self.visible = torch.stack([mask.any(dim=0) for mask in masks]).cpu()
        self.scores = [None] * len(self.scores)
        # Host-side page tables: the per-step bookkeeping (reserve, slots, pools) then never waits on the
        # accelerator; make_head_plan copies what a step needs to the cache's device.
        return CompactedRequest(self.decision.num_tokens, space, self.kept, tables.cpu())

    def report(self, state: CompactedRequest) -> CompressionReport:
        return CompressionReport(
            req_id=self.decision.req_id,
            num_prompt_tokens=self.decision.num_tokens,
            method=self.config.method,
            keep_blocks=state.keep_blocks,
            kept=self.kept.tolist(),
            block_size=state.block_size,
            pooled_pages=state.space.is_pooled,
            layer_global_eviction=(~self.visible).float().mean(dim=1).tolist(),
            global_eviction_ratio=float((~self.visible.any(dim=0)).float().mean()),
        )
