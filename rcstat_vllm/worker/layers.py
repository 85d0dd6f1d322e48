"""What a worker compresses: the layers its backend's metadata builders attach, their KV heads, block size and cache
layout, the page space (head pages pooled across layers or per layer, decided once the caches are bound), and
whether compression is off for this engine and why (said once, at start-up).

:class:`CompressedLayers` is the set-up half of the worker's owner
(:class:`~rcstat_vllm.worker.driver.WorkerCompression`): the builders' constructors call :meth:`attach_layers`, the
runner hook :meth:`bind_kv_caches`; the impls ask :meth:`tracked_layer` and :meth:`page_cache` in each forward.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from rcstat_vllm.capabilities import (
    GroupChoice,
    choose_compressed_group,
    engine_not_pooled_reason,
    engine_unsupported_reason,
    unsupported_layer_reason,
)
from rcstat_vllm.config import RCStatConfig, server_config
from rcstat_vllm.log import logger
from rcstat_vllm.paging.kv_layout import CacheLayout
from rcstat_vllm.paging.page_space import PageSpace, cdiv, pooled_space_or_reason
from rcstat_vllm.settings import window_queries
from rcstat_vllm.vllm_private.internals import forward_context
from rcstat_vllm.worker.page_store import PageStore
from rcstat_vllm.worker.prompt_compression import triton_scoring, warm_up_scoring


class CompressedLayers:
    def __init__(self, vllm_config, disabled_reason: str | None = None, kv_cache_groups=None):
        """``kv_cache_groups``: the engine's KV cache groups ``(layer names, spec, drafter's)``
        (:func:`~rcstat_vllm.vllm_private.internals.kv_cache_groups`), when the runner hook knows them: the plugin
        compresses one (:func:`~rcstat_vllm.capabilities.choose_compressed_group`). None: the first
        builder's layers are compressed (unit tests' fakes)."""
        self.vllm_config = vllm_config
        self.config: RCStatConfig = server_config(vllm_config.additional_config) or RCStatConfig()
        self.layer_names: list[str] = []
        self.layer_index: dict[str, int] = {}
        self.num_heads = 0
        self.block_size = 0
        self.layout: CacheLayout | None = None
        self.space: PageSpace | None = None
        #: the compressed requests' pages and the layers' caches (created when the layers attach)
        self.pages: PageStore | None = None
        self.disabled_reason: str | None = None
        #: the KV cache group compressed and those left to vLLM (None: not known, see above)
        self.group_choice: GroupChoice | None = None
        disabled_reason = disabled_reason or engine_unsupported_reason(vllm_config)
        if disabled_reason is not None:
            self.disable(disabled_reason)
        elif kv_cache_groups is not None:
            self.group_choice = choose_compressed_group(kv_cache_groups)
            if self.group_choice.index is None:
                self.disable(self.group_choice.reason or "no KV cache group the plugin can compress")
            elif self.group_choice.left_to_vllm:
                logger.info("rcstat: %s", self.group_choice.describe())

    def disable(self, reason: str, *, warn: bool = True) -> None:
        """Run every request uncompressed (each logs ``reason`` in its report); ``warn=False`` logs it as information
        (a warning with the cause was logged at start-up already)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.log(logging.WARNING if warn else logging.INFO, "rcstat: compression off for this engine: %s", reason)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def tracked_layer(self, layer_name: str) -> int | None:
        """The layer's index among those this owner compresses; None for a layer it does not track (a drafter's
        layers under speculative decoding, a second KV-cache group): the impls run vLLM's own path for it."""
        return self.layer_index.get(layer_name)

    def page_cache(self, layer_index: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """The tensor this layer's head-page ids index (the all-layers view when pages are pooled)."""
        assert self.space is not None  # (the builders ask only once the layers are bound to a page space)
        return self.space.cache(layer_index, kv_cache)

    def compresses_group(self, layer_names) -> bool:
        """Whether a builder's layers are the KV cache group this worker compresses (True when not known: the first
        builder's layers are taken). A group left to vLLM (a hybrid model's sliding-window layers) runs vLLM's path."""
        choice = self.group_choice
        return choice is None or choice.index is None or set(layer_names) == set(choice.layer_names)

    def attach_layers(
        self, layer_names: list[str], *, num_kv_heads: int, block_size: int, layout: CacheLayout, sinks: bool = False
    ) -> bool:
        """A metadata builder's layers (vLLM builds one builder per KV-cache group, sometimes several); whether
        they are the layers this worker compresses (False: the builder plans nothing, its layers run vLLM's path).
        ``sinks``: whether the backend's head-as-sequence attention takes attention sinks."""
        if not self.compresses_group(layer_names):
            return False
        if self.layer_names and list(layer_names) != self.layer_names:
            self.disable("several KV-cache groups use the plugin's backend (one block table per group)")
            return False
        if self.layer_names:
            return True
        self.layer_names = list(layer_names)
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_heads, self.block_size, self.layout = num_kv_heads, block_size, layout
        self.space = PageSpace.per_layer(len(layer_names), num_kv_heads, block_size)
        max_width = cdiv(self.vllm_config.model_config.max_model_len, block_size)
        self.pages = PageStore(
            len(layer_names), num_kv_heads, self.vllm_config.scheduler_config.max_num_seqs, max_width
        )
        layer_reason = unsupported_layer_reason(self.vllm_config, layer_names, sinks=sinks)
        if layer_reason is not None:
            self.disable(layer_reason)
        logger.info("rcstat: attention backend active for %d layers", len(layer_names))
        return True

    def bind_kv_caches(self, caches: Mapping[str, torch.Tensor]) -> None:
        """Decide the page space from the layers' cache tensors (layer name -> ``[B, H, N, 2D]``), once, and say
        which at start-up."""
        if not self.layer_names:
            # No builder of the plugin's backend: vLLM chose another for every layer (an explicit
            # --attention-backend, or the platform hook found the plugin's cannot serve this engine and said why).
            self.disable(f"vLLM's own attention backend serves every layer ({self._vllm_impls()})", warn=False)
            return
        if self.disabled_reason is not None:  # said once already; no page space to decide or describe
            return
        layout = self.layout
        assert layout is not None  # (set with the layer names, by attach_layers)
        for name in self.layer_names:
            unusable = None if name not in caches else layout.unsupported_reason(caches[name])
            if unusable is not None:
                self.disable(f"layer {name}'s KV cache: {unusable}")
                return
        space, reason = None, engine_not_pooled_reason(self.vllm_config, self.block_size)
        if reason is None:
            missing = [name for name in self.layer_names if name not in caches]
            if missing:
                reason = f"no KV cache tensor for layer {missing[0]}"
            else:
                layer_caches = [caches[name] for name in self.layer_names]
                space, reason = pooled_space_or_reason(layer_caches, self.num_heads, self.block_size)
        self._warm_up_scoring(caches.get(self.layer_names[0]))
        self._log_space(space, reason)
        if space is not None:
            self.space = space

    def _log_space(self, space: PageSpace | None, reason: str | None) -> None:
        store = self.pages
        assert store is not None  # (created when the layers attached)
        logger.info(
            "rcstat: compressed requests' head-page tables take at most %.1f MiB on the host and as much on the KV "
            "cache's device (%d requests x %d layers x %d KV heads x %d pages), allocated as compressed requests "
            "arrive, not counted in vLLM's memory profile",
            store.bound_bytes() / 2**20,
            store.max_slots,
            self.num_layers,
            self.num_heads,
            store.max_width,
        )
        if space is not None:
            logger.info(
                "rcstat: head pages pooled across all %d layers (%d pages per block): layers keep different "
                "amounts at no block cost",
                self.num_layers,
                self.num_layers * self.num_heads,
            )
        else:
            logger.warning(
                "rcstat: head pages per layer, not pooled across layers (%s): the layer keeping the most sets "
                "the blocks a request holds",
                reason,
            )

    def _vllm_impls(self) -> str:
        """The attention impl classes of the model's layers, by name."""
        layers = forward_context(self.vllm_config.compilation_config).values()
        names = sorted({type(layer.impl).__name__ for layer in layers if getattr(layer, "impl", None) is not None})
        return ", ".join(names) or "no attention layer"

    def _warm_up_scoring(self, cache: torch.Tensor | None) -> None:
        """Compile the server's scoring kernel now (on a GPU), not at the first compressed request."""
        layout = self.layout
        if cache is None or layout is None or self.disabled_reason is not None or not triton_scoring(layout, cache):
            return
        num_query_heads = self.vllm_config.model_config.get_num_attention_heads(self.vllm_config.parallel_config)
        if warm_up_scoring(self.config, layout, cache, num_query_heads):
            logger.info(
                "rcstat: %s scoring kernel compiled at start-up (window %d); a request overriding the method or "
                "window compiles its own at first use",
                self.config.method,
                window_queries(self.config),
            )
