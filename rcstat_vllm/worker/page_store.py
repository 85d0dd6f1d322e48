"""Where compacted requests' KV is found: each layer's cache tensor as the forward last passed it (compactions copy
within them before the next forward) and the compressed requests' page tables, resident on the cache's device
(:class:`~rcstat_vllm.paging.page_tables.HeadPageTables`, created at the first compaction, one slot per request)."""

from __future__ import annotations

from torch import Tensor

from rcstat_vllm.paging.head_pages import CompactedRequest
from rcstat_vllm.paging.page_tables import HeadPageTables


class PageStore:
    def __init__(self, num_layers: int, num_heads: int, max_slots: int, max_width: int):
        self.num_layers, self.num_heads, self.max_slots, self.max_width = num_layers, num_heads, max_slots, max_width
        #: per layer, its cache tensor as the forward passed it
        self.layer_caches: list[Tensor | None] = [None] * num_layers
        #: the compressed requests' page tables on the cache's device (None until the first compaction)
        self.tables: HeadPageTables | None = None

    def remember(self, layer: int, kv_cache: Tensor) -> None:
        self.layer_caches[layer] = kv_cache

    def attach(self, pages: CompactedRequest) -> None:
        """A compaction's pages join the resident tables (a slot of their own)."""
        if self.tables is None:
            device = next(cache.device for cache in self.layer_caches if cache is not None)
            self.tables = HeadPageTables(
                self.num_layers, self.num_heads, device, max_slots=self.max_slots, max_width=self.max_width
            )
        pages.attach_to(self.tables)

    def release(self, pages: CompactedRequest) -> None:
        """The request is gone or compacted anew: its slot serves the next compaction."""
        # (attached pages: the tables exist and their table is a slot there)
        self.tables.release(pages.table)  # type: ignore[union-attr, arg-type]

    def bound_bytes(self) -> int:
        """The most the resident tables take (on the host, and as much on the device)."""
        return HeadPageTables.bound_bytes(self.num_layers, self.num_heads, self.max_slots, self.max_width)
