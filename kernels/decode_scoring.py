"""Decode-time RC scoring straight from head pages (Triton), with its torch reference.

Decode-time compression (:mod:`rcstat_vllm.worker.decode_compression`) scores each KV head over its own generated
entries, which live in *head pages*: page ``p`` is head ``p % Hkv``'s slice of block ``p // Hkv`` of a
``[num_blocks, Hkv, block_size, d]`` key cache view, and each head has its own page list (``pages[h]``): its entry
``i`` sits in page ``pages[h, i // block_size]`` at slot ``i % block_size``. Head ``h`` is scored from its entry
``starts[h]`` on (its first generated one), over ``counts[h]`` entries, the last ``w`` of them its window.

Both functions compute, per KV head, Eq. 6's expected RC of each non-window entry (as
:func:`rcstat_vllm.kernels.rc_scoring.rc_table_scores_paged` does for a prompt: the GQA mean, the mean or the max over
the window's queries) given each query head's sorted window self logits (the table, made in torch by the caller:
:func:`rcstat_vllm.scoring.methods.rc.rc_head_scores_paged`). The result is *right-aligned* ``[Hkv, width - w]``
(``width = max(counts)``): head ``h``'s latest non-window entry in the last column, its first at column
``width - counts[h]``; the columns before it are 0. This is the layout the torch path's ragged scoring uses
(:meth:`rcstat_vllm.scoring.base.Scorer.score_ragged`), so every head's window follows the last column.

``starts`` and ``counts`` are host tensors (the worker's bookkeeping knows them): the width and the launch grid come
from them without reading the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged import cdiv, host_to_device
from .rc_scoring import over_query_heads, rc_table_launch

__all__ = ["check_head_inputs", "gather_head_entries", "rc_head_table_scores", "rc_head_table_scores_reference"]


def check_head_inputs(q_window: Tensor, key_cache: Tensor, pages: Tensor, starts: Tensor, counts: Tensor) -> int:
    """Validate shapes and that every head holds its window and has pages for its entries; returns G."""
    if q_window.dim() != 3 or key_cache.dim() != 4 or pages.dim() != 2:
        raise ValueError(
            "expected q_window [Hq, w, d], key_cache [num_blocks, Hkv, block_size, d], pages [Hkv, P], got "
            f"{tuple(q_window.shape)}, {tuple(key_cache.shape)}, {tuple(pages.shape)}"
        )
    if starts.device.type != "cpu" or counts.device.type != "cpu":
        raise ValueError("starts and counts are host tensors (reading device ones would synchronise)")
    num_q_heads, w, head_dim = q_window.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: queries {head_dim}, keys {key_cache.shape[3]}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV-head groups")
    if pages.shape[0] != num_kv_heads or starts.shape != (num_kv_heads,) or counts.shape != (num_kv_heads,):
        raise ValueError(f"pages, starts and counts need one row per KV head ({num_kv_heads})")
    if int(counts.min()) < w:
        raise ValueError(f"every head must hold its window of {w} entries, counts {counts.tolist()}")
    if int(cdiv(int((starts + counts).max()), block_size)) > pages.shape[1]:
        raise ValueError(f"entries up to {int((starts + counts).max())} need more than {pages.shape[1]} pages")
    return num_q_heads // num_kv_heads


def gather_head_entries(key_cache: Tensor, pages: Tensor, starts: Tensor, counts: Tensor, width: int) -> Tensor:
    """Each head's entries ``starts[h] .. starts[h] + counts[h] - 1`` right-aligned in ``[Hkv, width, d]`` (the
    cache's dtype); the columns before a head's first entry repeat it (never scored)."""
    block_size, num_kv_heads = key_cache.shape[2], key_cache.shape[1]
    columns = torch.arange(width) - width + counts.unsqueeze(1)  # entry offsets, negative = padding
    index = host_to_device(starts.unsqueeze(1) + columns.clamp_min(0), key_cache.device)
    page = torch.gather(host_to_device(pages, key_cache.device, torch.int64), 1, index // block_size)
    return key_cache[page // num_kv_heads, page % num_kv_heads, index % block_size]


def rc_head_table_scores_reference(
    q_window: Tensor,
    key_cache: Tensor,
    pages: Tensor,
    starts: Tensor,
    counts: Tensor,
    y_sorted: Tensor,
    prefix: Tensor,
    center: Tensor,
    max_over_queries: bool = False,
    max_over_heads: bool = False,
) -> Tensor:
    """Torch reference of :func:`rc_head_table_scores`: Eq. 6 by its definition, every gap max(x - y, 0) summed
    (``prefix`` unused). Materialises [Hkv, G, w, width - w, m]: for tiny shapes (tests).

    Args:
        q_window: [Hq, w, d] the window's queries (the last w generated tokens').
        key_cache: [num_blocks, Hkv, block_size, d] (strided views fine).
        pages: [Hkv, P] each head's page ids (see the module docstring); starts, counts: [Hkv] host ints.
        y_sorted, prefix, center: [Hq, m], [Hq, m + 1], [Hq]: each query head's window self logits (of its KV head's
            window entries) minus ``center``, sorted, and their prefix sums.
        max_over_queries: the highest of the w queries' expected RC per query head instead of their mean.
        max_over_heads: the highest of a KV head's G query heads' RC instead of their mean.
    Returns:
        float32 [Hkv, width - w], right-aligned, 0 before each head's first entry.
    """
    group = check_head_inputs(q_window, key_cache, pages, starts, counts)
    w, width = q_window.shape[1], int(counts.max())
    keys = gather_head_entries(key_cache, pages, starts, counts, width)[:, : width - w].float()
    num_kv_heads, m = keys.shape[0], y_sorted.shape[-1]
    queries = q_window.to(key_cache.dtype).float().reshape(num_kv_heads, group, w, -1)
    cross = torch.einsum("hgjd,hnd->hgjn", queries, keys)  # [Hkv, G, w, width - w]
    if max_over_queries:
        cross = cross.amax(dim=2, keepdim=True)
    x = cross - center.float().reshape(num_kv_heads, group, 1, 1)
    gaps = (x.unsqueeze(-1) - y_sorted.float().reshape(num_kv_heads, group, 1, 1, m)).clamp_min(0).sum(-1)
    scores = over_query_heads(gaps.mean(dim=2) / m, max_over_heads)
    scored = torch.arange(width - w, device=scores.device) >= (width - counts).to(scores.device).unsqueeze(1)
    return torch.where(scored, scores, torch.zeros((), device=scores.device))


def rc_head_table_scores(
    q_window: Tensor,
    key_cache: Tensor,
    pages: Tensor,
    starts: Tensor,
    counts: Tensor,
    y_sorted: Tensor,
    prefix: Tensor,
    center: Tensor,
    max_over_queries: bool = False,
    max_over_heads: bool = False,
    block_n: int = 64,
) -> Tensor:
    """Triton version of :func:`rc_head_table_scores_reference`: same arguments, float32 [Hkv, width - w].

    One launch for all KV heads of a layer: a program per (tile of ``block_n`` entries, KV head), over the widest
    head's entries (a narrower head's last tiles store nothing). The queries are cast to the cache's dtype; a
    float32 cache uses IEEE products. Reads nothing back from the device.
    """
    group = check_head_inputs(q_window, key_cache, pages, starts, counts)
    from ._rc_triton import rc_head_pages_kernel  # Triton only when launching

    w, width = q_window.shape[1], int(counts.max())
    num_kv_heads, block_size, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    out = torch.zeros(num_kv_heads, width - w, dtype=torch.float32, device=key_cache.device)
    if width == w:
        return out
    queries = q_window.to(key_cache.dtype)
    table = host_to_device(pages, key_cache.device, torch.int32).contiguous()
    m = w * (w + 1) // 2
    rc_head_pages_kernel[(cdiv(width - w, block_n), num_kv_heads)](
        queries,
        *queries.stride(),
        key_cache,
        *key_cache.stride(),
        table,
        table.stride(0),
        host_to_device(starts, key_cache.device, torch.int32),
        host_to_device(counts, key_cache.device, torch.int32),
        y_sorted.reshape(-1, m).float().contiguous(),
        prefix.reshape(-1, m + 1).float().contiguous(),
        center.reshape(-1).float().contiguous(),
        out,
        out.stride(0),
        width - w,
        num_kv_heads,
        m,
        **rc_table_launch(
            group, w, m, head_dim, block_size, block_n, key_cache.dtype, max_over_queries, max_over_heads
        ),
    )
    return out
