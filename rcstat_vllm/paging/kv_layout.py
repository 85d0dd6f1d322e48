"""Where a token of one KV head lives in a layer's cache tensor: the layouts of vLLM's CPU and CUDA caches.

vLLM's KV cache for one layer is ``[num_blocks, H, N, 2D]``: a block holds all H KV heads of N tokens
(``2 N D`` values per head: N keys, then N values). Viewed as ``[num_blocks * H, 2N, D]``, the same memory is
``num_blocks * H`` *head pages* of N single-head tokens each; page ``b * H + h`` is head ``h``'s slice of block
``b``. A :class:`CacheLayout` reads and writes tokens at (page, offset) in that view, whatever the backend's
in-page layout; compaction (:mod:`rcstat_vllm.paging.compaction`) and the scorers use nothing else.

Plain torch on whatever device the cache lives on; it does not import vLLM.
"""

from __future__ import annotations

import torch
from torch import Tensor


def key_value_pages(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of a CPU cache as head pages: keys ``[num_pages, D, N]`` and values ``[num_pages, N, D]``.

    vLLM's CPU kernels (ISAs ``vec``/``vec16``) store a page's keys transposed, channel-major (``[D, N]``),
    and its values token-major (``[N, D]``); ``rcstat_vllm/paging/cpu_kv_layout.py`` checks this on the installed
    vLLM before compression is enabled.
    """
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    pages = kv_cache.view(num_blocks * num_heads, 2 * block_size * head_dim)
    keys = pages[:, : block_size * head_dim].view(-1, head_dim, block_size)
    values = pages[:, block_size * head_dim :].view(-1, block_size, head_dim)
    return keys, values


class CacheLayout:
    """Where head page ``p = block * H + h``, slot ``s`` of one layer's cache lives.

    Compaction, gathering and the page bookkeeping only use :meth:`shape`, :meth:`read` and :meth:`write`,
    so the CPU and GPU paths share them and differ only in the attention kernels.
    """

    def shape(self, kv_cache: Tensor) -> tuple[int, int, int]:
        """``(num_blocks, H, N)``"""
        raise NotImplementedError

    def read(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``[*pages.shape, D]`` stored at ``(page, offset)`` (copies)."""
        raise NotImplementedError

    def write(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor, keys: Tensor, values: Tensor) -> None:
        raise NotImplementedError

    def unsupported_reason(self, kv_cache: Tensor) -> str | None:
        """Why the backend's attention kernels cannot run head-as-sequence over this cache tensor (checked once when
        the caches are bound: the engine then runs uncompressed, never failing mid-forward), or None."""
        return None

    #: Whether the prompt is scored by the Triton paged kernels (:mod:`rcstat_vllm.kernels`) when the cache is on
    #: a CUDA device; layouts without them score in torch (see ``compression.triton_scoring``).
    paged_kernels = False

    def key_value_caches(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values as ``[num_blocks, H, N, D]`` views (strided, no copy): what the paged scoring kernels
        and :func:`rcstat_vllm.kernels.paged.gather_paged_tokens` take, so a scorer reads only what it needs."""
        raise NotImplementedError


class CPUVecLayout(CacheLayout):
    """vLLM-CPU (``vec``/``vec16``): one tensor ``[num_blocks, H, N, 2D]``, see :func:`key_value_pages`."""

    def key_value_caches(self, kv_cache):
        num_blocks, num_heads, block_size, two_d = kv_cache.shape
        keys, values = key_value_pages(kv_cache)  # keys channel-major [pages, D, N]: transposed back
        keys = keys.view(num_blocks, num_heads, two_d // 2, block_size).transpose(2, 3)
        return keys, values.view(num_blocks, num_heads, block_size, two_d // 2)

    def shape(self, kv_cache):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        return num_blocks, num_heads, block_size

    def read(self, kv_cache, pages, offsets):
        keys, values = key_value_pages(kv_cache)
        return keys[pages, :, offsets], values[pages, offsets]

    def write(self, kv_cache, pages, offsets, keys, values):
        key_pages, value_pages = key_value_pages(kv_cache)
        key_pages[pages, :, offsets] = keys
        value_pages[pages, offsets] = values


class FlashLayout(CacheLayout):
    """vLLM's CUDA caches (FlashAttention and the other GPU backends): the same logical ``[num_blocks, H, N, 2D]``
    as on CPU, each token row holding its key then its value (``kv_cache.transpose(1, 2).split(D, -1)`` is
    FlashAttention's ``[num_blocks, N, H, D]`` key and value view).

    Indexing is logical, so it is right for every physical layout vLLM may resolve (``KVCacheLayout``); the
    head-as-sequence view :func:`flash_head_page_caches` additionally needs head-major blocks (``LBHNC``,
    which the plugin's CUDA backend declares).
    """

    paged_kernels = True

    def key_value_caches(self, kv_cache):
        return kv_cache.split(kv_cache.shape[-1] // 2, dim=-1)  # each row: key then value

    def unsupported_reason(self, kv_cache):
        try:
            flash_head_page_caches(kv_cache)
        except ValueError as exc:
            return str(exc)
        return None

    def shape(self, kv_cache):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        return num_blocks, num_heads, block_size

    def read(self, kv_cache, pages, offsets):
        num_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3] // 2
        rows = kv_cache[pages // num_heads, pages % num_heads, offsets]
        return rows[..., :head_dim], rows[..., head_dim:]

    def write(self, kv_cache, pages, offsets, keys, values):
        num_heads = kv_cache.shape[1]
        kv_cache[pages // num_heads, pages % num_heads, offsets] = torch.cat([keys, values], dim=-1).to(kv_cache.dtype)


CPU_VEC = CPUVecLayout()
FLASH = FlashLayout()


def read_kv(kv_cache: Tensor, pages: Tensor, offsets: Tensor, layout: CacheLayout = CPU_VEC) -> tuple[Tensor, Tensor]:
    """Keys and values ``[*pages.shape, D]`` stored at ``(page, offset)`` (copies)."""
    return layout.read(kv_cache, pages, offsets)


def flash_head_page_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Key and value caches with one KV head per page, ``[num_blocks * H, N, 1, D]`` each (views): the paged
    cache shape vLLM's FlashAttention kernels take, over head pages instead of blocks.

    Needs head-major blocks (vLLM's ``LBHNC`` layout: a head's ``N`` token rows are contiguous); raises
    otherwise, since no view can then put a block's heads side by side as pages.
    """
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    if kv_cache.stride(0) != num_heads * kv_cache.stride(1):
        raise ValueError(
            f"KV cache strides {kv_cache.stride()} are not head-major (vLLM layout LBHNC): head pages need it"
        )
    if kv_cache.stride(3) != 1:
        raise ValueError(f"KV cache strides {kv_cache.stride()}: FlashAttention needs each head's row contiguous")
    pages = kv_cache.as_strided(
        (num_blocks * num_heads, block_size, 1, two_d),
        (kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(2), kv_cache.stride(3)),
    )
    keys, values = pages.split(two_d // 2, dim=-1)
    return keys, values


def head_page_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Key and value caches with one KV head per page: ``[num_blocks * H, 1, N, D]`` each (views), the
    shape vLLM's CPU kernels take (they apply their own in-page layout)."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(num_blocks * num_heads, 1, 2 * block_size, two_d // 2)
    keys, values = pages.chunk(2, dim=2)
    return keys, values
