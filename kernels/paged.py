"""Reading one request's tokens out of a paged KV cache in torch (references and small precomputations).

Layout (vLLM's per-layer key cache, possibly a strided view of a fused K/V tensor):
``key_cache[num_blocks, Hkv, block_size, d]``; page j of the request (``block_table[j]``) holds tokens
j*block_size .. (j+1)*block_size - 1, and the last page may be partly filled. The torch gather also reads *tiled*
views ``[num_blocks, Hkv, block_size/a, a, d/b, b]`` (token ``i*a + j`` at ``[i, j]``, dim ``k*b + l`` at
``[k, l]``): caches whose tokens sit at no uniform stride, such as vLLM-CPU's AMX tiles
(``rcstat_vllm.paging.kv_layout.CPUAmxLayout``); the Triton kernels take only the first form.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "cdiv",
    "check_paged_inputs",
    "gather_paged_tokens",
    "host_to_device",
    "next_power_of_2",
    "paged_block_size",
    "paged_token_norms",
    "row_blocking",
]


def check_paged_inputs(q_window: Tensor, key_cache: Tensor, block_table: Tensor, num_tokens: int) -> tuple[int, int]:
    """Validate shapes; returns (group size G, window length w)."""
    if q_window.dim() != 3 or key_cache.dim() != 4 or block_table.dim() != 1:
        raise ValueError(
            "expected q_window [Hq, w, d], key_cache [num_blocks, Hkv, block_size, d], block_table [pages], got "
            f"{tuple(q_window.shape)}, {tuple(key_cache.shape)}, {tuple(block_table.shape)}"
        )
    num_q_heads, w, head_dim = q_window.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: queries {head_dim}, keys {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV-head groups")
    if not 1 <= w <= num_tokens:
        raise ValueError(f"window of {w} queries does not fit {num_tokens} tokens")
    pages_needed = -(-num_tokens // block_size)
    if block_table.shape[0] < pages_needed:
        raise ValueError(f"{num_tokens} tokens need {pages_needed} pages, block table has {block_table.shape[0]}")
    return num_q_heads // num_kv_heads, w


def paged_block_size(key_cache: Tensor) -> int:
    """Tokens per page of a plain or tiled cache view (see the module docstring)."""
    return key_cache.shape[2] * key_cache.shape[3] if key_cache.dim() == 6 else key_cache.shape[2]


def _page_span(
    block_table: Tensor, block_size: int, start: int, stop: int, device: torch.device
) -> tuple[Tensor, slice]:
    """The pages holding tokens start..stop-1 (long block ids on ``device``) and where those tokens lie in the pages
    laid end to end: the readers below copy whole pages, one index per page, then cut."""
    first, last = start // block_size, cdiv(stop, block_size)
    blocks = block_table[first:last].to(device=device, dtype=torch.long)
    return blocks, slice(start - first * block_size, stop - first * block_size)


def gather_paged_tokens(
    key_cache: Tensor, block_table: Tensor, start: int, stop: int, dtype: torch.dtype | None = None
) -> Tensor:
    """Tokens start..stop-1 of one request, contiguous: [Hkv, stop - start, d] in ``dtype`` (None: the cache's)."""
    if key_cache.dim() == 6:
        gathered = _gather_tiled_tokens(key_cache, block_table, start, stop)
        return gathered if dtype is None else gathered.to(dtype)
    blocks, tokens = _page_span(block_table, key_cache.shape[2], start, stop, key_cache.device)
    if key_cache.stride(-2) == 1 and key_cache.stride(-1) != 1:
        return _gather_dim_major_tokens(key_cache, blocks, tokens, dtype or key_cache.dtype)
    # Whole pages, head-major ([Hkv, pages, block_size, d]: one index per page, not per token: 1.8-2.9x faster on a
    # CPU at 0.7-4k tokens than indexing each token), then the tokens asked for (a copy only when they start or end
    # inside a page).
    gathered = key_cache.transpose(0, 1)[:, blocks].flatten(1, 2)[:, tokens].contiguous()
    return gathered if dtype is None else gathered.to(dtype)


def _gather_dim_major_tokens(key_cache: Tensor, blocks: Tensor, tokens: slice, dtype: torch.dtype) -> Tensor:
    """:func:`gather_paged_tokens` of a cache that stores each page dim-major (vLLM-CPU's ``vec`` keys, ``[d,
    block_size]`` per page): the pages copied whole as they lie, then put token-major straight into the result (the
    full pages in one copy, a last part-full page in another; the same values, in ``dtype``). Indexing the pages
    through the token-major view instead copied every element alone, then again to cut the tokens (SmolLM2's
    shapes, one thread: 2000 tokens 1.1 -> 0.38 ms, 8000 tokens 3.6 -> 1.8 ms)."""
    pages = key_cache.transpose(2, 3).index_select(0, blocks)  # [pages, Hkv, d, block_size]
    num_heads, head_dim, block_size = pages.shape[1:]
    if tokens.start:  # (the first page part-read: lay the pages out whole, then cut)
        whole = torch.empty(num_heads, len(blocks) * block_size, head_dim, dtype=dtype, device=key_cache.device)
        whole.view(num_heads, len(blocks), block_size, head_dim).copy_(pages.permute(1, 0, 3, 2))
        return whole[:, tokens].contiguous()
    count = tokens.stop
    out = torch.empty(num_heads, count, head_dim, dtype=dtype, device=key_cache.device)
    full = count // block_size
    out[:, : full * block_size].view(num_heads, full, block_size, head_dim).copy_(pages[:full].permute(1, 0, 3, 2))
    if count > full * block_size:
        out[:, full * block_size :].copy_(pages[full, :, :, : count - full * block_size].transpose(1, 2))
    return out


#: Bytes of whole pages a CPU norm pass copies at once: small enough for the copy to be in cache when the norm reads
#: it (16k tokens at Llama-3.1-8B shapes, float32: 4.3-4.6 ms in 2-8 MiB pieces against 25 ms in one piece, 29 ms
#: through :func:`gather_paged_tokens`).
NORM_CHUNK_BYTES = 4 << 20


def paged_token_norms(cache: Tensor, block_table: Tensor, start: int, stop: int) -> Tensor:
    """The norms of tokens start..stop-1 of one request over their last dim: float32 [Hkv, stop - start], what
    ``vector_norm(gather_paged_tokens(cache, ...), dim=-1)`` gives (the reference; the tiled views take that path)
    without gathering the tokens: the request's whole pages are copied and normed a few MiB at a time on a CPU (one
    piece on CUDA), then the norms, ``d`` times smaller, are put in token order."""
    if cache.dim() == 6:
        return torch.linalg.vector_norm(
            _gather_tiled_tokens(cache, block_table, start, stop), dim=-1, dtype=torch.float32
        )
    num_heads, block_size = cache.shape[1], cache.shape[2]
    blocks, tokens = _page_span(block_table, block_size, start, stop, cache.device)
    page_bytes = cache[0].numel() * cache.element_size()
    step = len(blocks) if cache.device.type == "cuda" else max(1, NORM_CHUNK_BYTES // max(page_bytes, 1))
    norms = torch.empty(len(blocks), num_heads, block_size, dtype=torch.float32, device=cache.device)
    for piece in range(0, len(blocks), step):
        pages = cache.index_select(0, blocks[piece : piece + step])
        torch.linalg.vector_norm(pages, dim=-1, dtype=torch.float32, out=norms[piece : piece + step])
    return norms.transpose(0, 1).flatten(1, 2)[:, tokens].contiguous()


def _gather_tiled_tokens(tiles: Tensor, block_table: Tensor, start: int, stop: int) -> Tensor:
    """:func:`gather_paged_tokens` of a tiled view: the pages' whole tiles copied, then untiled in one permuting
    copy (3x faster than indexing each token, whose entry is no contiguous row here)."""
    block_size = paged_block_size(tiles)
    blocks, tokens = _page_span(block_table, block_size, start, stop, tiles.device)
    pages = tiles[blocks].transpose(0, 1).reshape(tiles.shape[1], len(blocks) * block_size, -1)
    return pages[:, tokens].contiguous()


def host_to_device(tensor: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A small host tensor (indices the host's bookkeeping knows) on ``device``, without waiting for it: to a CUDA
    device through pinned memory, asynchronously (a copy from pageable memory synchronises the stream); elsewhere a
    plain copy."""
    tensor = tensor if dtype is None else tensor.to(dtype)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(value: int, minimum: int = 16) -> int:
    """Tile sizes for Triton: tl.arange needs powers of 2 and tl.dot needs every dim >= 16."""
    return max(minimum, 1 << (max(value, 1) - 1).bit_length())


#: Query rows a scoring program holds at once: enough for tensor cores, few enough for registers
#: (G*w reaches 256 for SnapKV's 64-query window with G = 4).
MAX_ROW_BLOCK = 32


def row_blocking(num_rows: int) -> dict[str, int]:
    """ROW_BLOCK and NUM_ROW_BLOCKS meta-parameters covering num_rows = G*w query rows."""
    row_block = min(next_power_of_2(num_rows), MAX_ROW_BLOCK)
    return {"ROW_BLOCK": row_block, "NUM_ROW_BLOCKS": cdiv(num_rows, row_block)}
