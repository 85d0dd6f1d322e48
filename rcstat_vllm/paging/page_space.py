"""Page spaces: which head pages a compressed request's (layer, KV head) pairs may use, and where they live.

A head page is one KV head's slice of one vLLM block of one layer: ``N`` tokens of a single head. Two spaces:

* **pooled** (the default when vLLM's allocation allows it): vLLM 0.32 views every layer's cache over one
  backing buffer (``allocate_kv_cache``, ``create_kv_cache_views``); in the head-major ``LBHNC`` layout layer
  ``l`` / block ``b`` / head ``h`` is then one contiguous page of a single all-layers tensor, page id
  ``base[l] + b * H + h``. All ``L * H`` pages of every block a request holds form *one* pool, so a layer that
  keeps little lends its pages to a layer that keeps much: a request holds
  ``ceil(pages over all (layer, head) / (L * H))`` blocks, not the fullest layer's count.
* **per layer** (the fallback): each layer's pages come from its own slice of the request's blocks, page id
  ``b * H + h`` in that layer's own cache; the fullest layer sets the block count.

The same compaction, bookkeeping and head-as-sequence plan serve both: a space is a list of page pools, each
a group of layers (one group of all layers, or one group per layer), and a base page per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def div_mod(index: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """``(index // size, index % size)``: which page (or tile row) and where in it. By shift and mask when ``size``
    is a power of two, as block sizes and tile sides are: 8-10x faster than integer division on a CPU, where a
    compaction's copy divides every kept entry's index several times (about 3 of its 38 ms at 2000 prompt tokens).
    The same values for negative indices (an arithmetic shift floors, the mask gives the non-negative remainder)."""
    if size > 0 and size & (size - 1) == 0:
        return index >> (size.bit_length() - 1), index & (size - 1)
    return index // size, index % size


def identity_pages(block_row: Tensor, num_heads: int) -> Tensor:
    """``[H, num_blocks_in_row]``: head h's pages of an uncompressed request, ``row[j] * H + h``."""
    heads = torch.arange(num_heads, device=block_row.device, dtype=torch.int64)
    return block_row.to(torch.int64).unsqueeze(0) * num_heads + heads.unsqueeze(1)


@dataclass(frozen=True)
class PageSpace:
    num_heads: int
    block_size: int
    #: per layer, the id of its page (block 0, head 0) in the tensor its page ids index
    layer_base: tuple[int, ...]
    #: groups of layers whose pages form one pool (one group of all layers when pooled)
    pools: tuple[tuple[int, ...], ...]
    #: all layers' pages as one ``[num_pages / H, H, N, 2D]`` tensor when pooled, else None (each layer's own)
    all_layers: Tensor | None = None

    @classmethod
    def per_layer(cls, num_layers: int, num_heads: int, block_size: int) -> PageSpace:
        return cls(num_heads, block_size, (0,) * num_layers, tuple((layer,) for layer in range(num_layers)))

    @classmethod
    def pooled(cls, all_layers: Tensor, layer_base: Sequence[int], num_heads: int, block_size: int) -> PageSpace:
        return cls(num_heads, block_size, tuple(layer_base), (tuple(range(len(layer_base))),), all_layers)

    @property
    def num_layers(self) -> int:
        return len(self.layer_base)

    @property
    def is_pooled(self) -> bool:
        return self.all_layers is not None

    def pool_of(self, layer: int) -> int:
        return 0 if self.is_pooled else layer

    def cache(self, layer: int, layer_cache: Tensor) -> Tensor:
        """The tensor layer ``layer``'s page ids index: the all-layers view, or the layer's own cache."""
        return layer_cache if self.all_layers is None else self.all_layers

    def identity(self, layer: int, block_ids: Tensor) -> Tensor:
        """``[H, len(block_ids)]``: layer ``layer``'s head pages of these blocks (an uncompressed request's)."""
        return self.layer_base[layer] + identity_pages(block_ids, self.num_heads)

    def pool_pages(self, pool: int, block_ids: Tensor) -> Tensor:
        """All pages the blocks bring into pool ``pool``, block by block (so a request filling its pool in this
        order uses its first blocks), then layer, then head. 1-D int64."""
        per_layer = torch.stack([self.identity(layer, block_ids).t() for layer in self.pools[pool]], dim=1)
        return per_layer.reshape(-1)  # [blocks, layers, H] flattened

    def pages_per_block(self, pool: int) -> int:
        return len(self.pools[pool]) * self.num_heads

    def blocks_for(self, pages: Tensor) -> int:
        """Blocks a request needs for ``pages`` ``[L, H]`` pages per (layer, head): the max over pools."""
        per_layer = pages.sum(dim=1).tolist()
        return max(
            (
                cdiv(sum(per_layer[layer] for layer in group), self.pages_per_block(i))
                for i, group in enumerate(self.pools)
            ),
            default=0,
        )


def pooled_space_or_reason(
    caches: Sequence[Tensor], num_heads: int, block_size: int
) -> tuple[PageSpace | None, str | None]:
    """The pooled page space over these layer caches (``[B, H, N, 2D]`` each, in layer order), or why not.

    Checks what the all-layers view relies on: every cache a contiguous view (no page padding) of the same
    backing storage, all of one shape and dtype, each starting at a whole block, no two layers on the same
    memory (KV sharing), and all of them inside one view that the storage holds.
    """
    if not caches:
        return None, "no attention layers"
    first = caches[0]
    if first.dim() != 4 or first.shape[1] != num_heads or first.shape[2] != block_size:
        return None, f"KV cache shape {tuple(first.shape)} is not [blocks, {num_heads} heads, {block_size} tokens, 2D]"
    storage = first.untyped_storage().data_ptr()
    block_elems = first[0].numel()
    offsets = []
    for cache in caches:
        if cache.untyped_storage().data_ptr() != storage:
            return None, "the layers' KV caches are not views of one backing buffer"
        if cache.shape != first.shape or cache.dtype != first.dtype:
            return None, "the layers' KV caches differ in shape or dtype"
        if not cache.is_contiguous():
            return None, f"a layer's KV cache is padded or not head-major (strides {cache.stride()})"
        offsets.append(cache.storage_offset())
    if len(set(offsets)) != len(offsets):
        return None, "layers share KV cache memory (KV sharing)"
    start = min(offsets)
    if any((offset - start) % block_elems for offset in offsets):
        return None, "a layer's KV cache does not start at a whole block of the backing buffer"
    layer_blocks = [(offset - start) // block_elems for offset in offsets]
    total_blocks = max(layer_blocks) + first.shape[0]
    if any(abs(a - b) < first.shape[0] for i, a in enumerate(layer_blocks) for b in layer_blocks[i + 1 :]):
        return None, "the layers' KV caches overlap"
    if (start + total_blocks * block_elems) * first.element_size() > first.untyped_storage().nbytes():
        return None, "the all-layers view would run past the backing buffer"
    all_layers = torch.as_strided(first, (total_blocks, *first.shape[1:]), first.stride(), start)
    return PageSpace.pooled(all_layers, [b * num_heads for b in layer_blocks], num_heads, block_size), None
