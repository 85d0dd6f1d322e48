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

from rcstat_vllm.paging.page_space import div_mod


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

    def read_keys(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor) -> Tensor:
        """:meth:`read`'s keys alone, the values not copied (for scorers that never read them)."""
        return self.read(kv_cache, pages, offsets)[0]

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
        and :func:`rcstat_vllm.kernels.paged.gather_paged_tokens` take, so a scorer reads only what it needs. (A
        layout without :attr:`paged_kernels` may return tiled views instead, which only that gather reads.)"""
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
        # (indices side by side: torch gathers [E, D] directly, up to 2.7x faster than keys[pages, :, offsets])
        return keys.transpose(1, 2)[pages, offsets], values[pages, offsets]

    def read_keys(self, kv_cache, pages, offsets):
        return key_value_pages(kv_cache)[0].transpose(1, 2)[pages, offsets]

    def write(self, kv_cache, pages, offsets, keys, values):
        key_pages, value_pages = key_value_pages(kv_cache)
        key_pages[pages, :, offsets] = keys
        value_pages[pages, offsets] = values


def amx_key_value_tiles(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of a bf16 cache vLLM-CPU's ``amx`` ISA wrote, by head page and in-tile position: keys
    ``[num_pages, N/16, 16, D/2]`` as int32 (each a pair of adjacent bf16 dims) and values
    ``[num_pages, N/2, 2, D/16, 16]`` bf16; key ``(p, t)`` is ``keys[p, t // 16, t % 16]`` (viewed back as D bf16),
    value ``(p, t)`` is ``values[p, t // 2, t % 2]`` (flattened).

    ``cpu_attn_reshape_and_cache`` prepacks each (block, head) tile for the AMX tile multiplies: keys
    ``[N/16][D/2][16 tokens][2 dims]`` (K[t, d] at ``(t//16)*16D + (d//2)*32 + (t%16)*2 + d%2``), values
    ``[D/16][N/2][16 dims][2 tokens]`` (V[t, d] at ``(d//16)*16N + (t//2)*32 + (d%16)*2 + t%2``): a token's key is
    D/2 quadwords 16 apart, its value D elements at no uniform stride. Keys are indexed as int32 quadwords, one
    element per dim pair: 3x faster to gather and scatter than pairs of bf16. ``cpu_kv_layout.layout_matches``
    checks this map on the installed vLLM.
    """
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    pages = kv_cache.view(num_blocks * num_heads, 2, block_size * head_dim)
    keys = pages[:, 0].view(torch.int32).unflatten(1, (block_size // 16, head_dim // 2, 16)).transpose(2, 3)
    values = pages[:, 1].unflatten(1, (head_dim // 16, block_size // 2, 16, 2)).permute(0, 2, 4, 1, 3)
    return keys, values


class CPUAmxLayout(CacheLayout):
    """vLLM-CPU (``amx``, bf16 only): the same ``[num_blocks, H, N, 2D]`` tensor, each (block, head) tile prepacked
    for the AMX kernels, see :func:`amx_key_value_tiles`. Each tile is still one head page's own contiguous
    ``2 N D`` elements, so head-as-sequence attention runs on the AMX kernels over head pages unchanged."""

    def key_value_caches(self, kv_cache):
        """Keys ``[num_blocks, H, N/16, 16, D/2, 2]`` and values ``[num_blocks, H, N/2, 2, D/16, 16]`` (views):
        a token's entry is not at a uniform stride, so not ``[num_blocks, H, N, D]``; the torch gather
        (:func:`rcstat_vllm.kernels.paged.gather_paged_tokens`) reads these tiled views, token ``t = i * a + j``
        at ``[i, j]`` and dim ``d = k * b + l`` at ``[k, l]``."""
        num_blocks, num_heads, block_size, two_d = kv_cache.shape
        head_dim = two_d // 2
        halves = kv_cache.view(num_blocks, num_heads, 2, block_size * head_dim)
        keys = halves[:, :, 0].unflatten(-1, (block_size // 16, head_dim // 2, 16, 2)).permute(0, 1, 2, 4, 3, 5)
        values = halves[:, :, 1].unflatten(-1, (head_dim // 16, block_size // 2, 16, 2)).permute(0, 1, 3, 5, 2, 4)
        return keys, values

    def shape(self, kv_cache):
        num_blocks, num_heads, block_size, _ = kv_cache.shape
        return num_blocks, num_heads, block_size

    def read(self, kv_cache, pages, offsets):
        keys, values = amx_key_value_tiles(kv_cache)
        (key_row, key_col), (value_row, value_col) = div_mod(offsets, 16), div_mod(offsets, 2)
        return keys[pages, key_row, key_col].view(kv_cache.dtype), values[pages, value_row, value_col].flatten(-2)

    def read_keys(self, kv_cache, pages, offsets):
        keys, _ = amx_key_value_tiles(kv_cache)
        key_row, key_col = div_mod(offsets, 16)
        return keys[pages, key_row, key_col].view(kv_cache.dtype)

    def write(self, kv_cache, pages, offsets, keys, values):
        key_tiles, value_tiles = amx_key_value_tiles(kv_cache)
        (key_row, key_col), (value_row, value_col) = div_mod(offsets, 16), div_mod(offsets, 2)
        key_tiles[pages, key_row, key_col] = keys.to(kv_cache.dtype).contiguous().view(torch.int32)
        value_tiles[pages, value_row, value_col] = values.to(kv_cache.dtype).unflatten(-1, (-1, 16))

    def unsupported_reason(self, kv_cache):
        reason = amx_unsupported_reason(kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[3] // 2)
        if reason is None and not kv_cache.is_contiguous():
            reason = f"KV cache strides {kv_cache.stride()}: head pages need each (block, head) tile contiguous"
        return reason


def amx_unsupported_reason(dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why :class:`CPUAmxLayout` does not describe vLLM's ``amx`` caches of this dtype and shape, or None.

    vLLM-CPU picks ``amx`` only for bf16 and N % 32 == 0 (given anything else, its write op or its attention kernel
    aborts the process: never probe those); it also picks it for head sizes that are not multiples of 16, whose
    tiles :func:`amx_key_value_tiles` does not describe (its D/16 and D/2 groups do not fit)."""
    if dtype != torch.bfloat16:
        return f"the AMX kernels take bf16 caches only, not {dtype}"
    if block_size % 32 or head_dim % 32:
        return f"AMX tiles of block size {block_size} and head size {head_dim} (need multiples of 32)"
    return None


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

    def read_keys(self, kv_cache, pages, offsets):
        num_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3] // 2
        return kv_cache[pages // num_heads, pages % num_heads, offsets, :head_dim]  # (a row's first half only)

    def write(self, kv_cache, pages, offsets, keys, values):
        num_heads = kv_cache.shape[1]
        kv_cache[pages // num_heads, pages % num_heads, offsets] = torch.cat([keys, values], dim=-1).to(kv_cache.dtype)


CPU_VEC = CPUVecLayout()
CPU_AMX = CPUAmxLayout()
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
