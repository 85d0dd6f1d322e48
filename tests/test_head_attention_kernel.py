"""The GPU path's decode attention over head pages: Triton kernel (under TRITON_INTERPRET=1 on CPU) equals the
torch reference, and the reference equals plain attention over each head's own token sequence."""

import pytest
import torch

from rcstat_vllm.kernels.head_attention import (
    head_page_decode_attention,
    head_page_decode_attention_reference,
)

pytest.importorskip("triton")

BLOCK = 16
HEADS = 3
DIM = 64


def _layout(lengths: list[list[int]], group: int, dtype, seed: int = 0):
    """A vLLM-CUDA-style cache [num_blocks, N, H, D] (K and V halves of one tensor) holding, for every
    (request, head), its own random token sequence on its own shuffled head pages."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(lengths)
    pages_needed = [[-(-n // BLOCK) for n in row] for row in lengths]
    total = sum(map(sum, pages_needed))
    num_blocks = -(-total // HEADS) + 4
    kv = torch.zeros(2, num_blocks, BLOCK, HEADS, DIM, dtype=dtype)
    free_pages = torch.randperm(num_blocks * HEADS, generator=g).tolist()
    width = max(map(max, pages_needed))
    tables = torch.zeros(num_reqs, HEADS, width, dtype=torch.int32)
    sequences = {}
    for r in range(num_reqs):
        for h in range(HEADS):
            n = lengths[r][h]
            keys = torch.randn(n, DIM, generator=g).to(dtype)
            values = torch.randn(n, DIM, generator=g).to(dtype)
            sequences[r, h] = (keys, values)
            pages = [free_pages.pop() for _ in range(pages_needed[r][h])]
            tables[r, h, : len(pages)] = torch.tensor(pages)
            for t in range(n):
                page = pages[t // BLOCK]
                kv[0, page // HEADS, t % BLOCK, page % HEADS] = keys[t]
                kv[1, page // HEADS, t % BLOCK, page % HEADS] = values[t]
    query = torch.randn(num_reqs, HEADS, group, DIM, generator=g).to(dtype)
    return query, kv[0], kv[1], tables, torch.tensor(lengths, dtype=torch.int32), sequences


LENGTHS = [[1, 37, 200], [16, 17, 5], [130, 64, 33]]  # a head with only the new token, page-exact and ragged


@pytest.mark.parametrize("group", [1, 3, 4])
def test_reference_is_attention_over_each_heads_own_tokens(group):
    query, k, v, tables, lengths, sequences = _layout(LENGTHS, group, torch.float32)
    out = head_page_decode_attention_reference(query, k, v, tables, lengths, scale=0.125)
    for (r, h), (keys, values) in sequences.items():
        expected = torch.softmax(query[r, h] @ keys.T * 0.125, dim=-1) @ values
        torch.testing.assert_close(out[r, h], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_kernel_matches_reference(group, dtype, atol):
    query, k, v, tables, lengths, _ = _layout(LENGTHS, group, dtype, seed=group)
    expected = head_page_decode_attention_reference(query, k, v, tables, lengths, scale=DIM**-0.5)
    got = head_page_decode_attention(query, k, v, tables, lengths, scale=DIM**-0.5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=atol)


def test_bad_shapes_are_named():
    query, k, v, tables, lengths, _ = _layout([[4, 4, 4]], 2, torch.float32)
    with pytest.raises(ValueError, match="page table"):
        head_page_decode_attention_reference(query, k, v, tables, lengths * 100, scale=1.0)
    with pytest.raises(ValueError, match="same shape and strides"):
        head_page_decode_attention_reference(query, k, v.contiguous().transpose(1, 2).contiguous().transpose(1, 2),
                                             tables, lengths, scale=1.0)


def test_compaction_in_the_cuda_layout_then_the_kernel_equals_attention_over_the_kept_tokens():
    """The GPU path end to end on CPU tensors: the same compaction code as the CPU path (FlashLayout) moves each
    head's kept tokens into its own pages; the kernel over those pages equals dense attention over the kept set."""
    from rcstat_vllm.head_pages import CPU_VEC, FLASH, compact_layer, identity_pages

    g = torch.Generator().manual_seed(5)
    n, group, num_blocks = 150, 3, 30
    row = (torch.randperm(num_blocks - 1, generator=g)[: -(-n // BLOCK)] + 1).to(torch.int32)
    keys, values = torch.randn(HEADS, n, DIM, generator=g), torch.randn(HEADS, n, DIM, generator=g)
    tokens = torch.arange(n)
    pages = identity_pages(row, HEADS)[:, tokens // BLOCK]
    offsets = (tokens % BLOCK).expand_as(pages)
    flash = torch.zeros(num_blocks, HEADS, BLOCK, 2 * DIM)  # vLLM 0.32 CUDA: [B, H, N, 2D], K | V per token row
    cpu = torch.zeros(num_blocks, HEADS, BLOCK, 2 * DIM)
    FLASH.write(flash, pages, offsets, keys, values)
    CPU_VEC.write(cpu, pages, offsets, keys, values)

    keep = torch.rand(HEADS, n, generator=g) < torch.tensor([[0.9], [0.3], [0.0]])
    keep[:, -8:] = True  # head 2 keeps only the window
    used = set(row.tolist())
    fresh = torch.tensor([b for b in range(1, num_blocks) if b not in used][: -(-int(((keep.sum(1) + BLOCK - 1) // BLOCK).sum()) // HEADS)])
    table = compact_layer(flash, row, keep, fresh, layout=FLASH)
    assert torch.equal(table, compact_layer(cpu, row, keep, fresh))  # same pages whatever the layout

    query = torch.randn(1, HEADS, group, DIM, generator=g)
    lengths = keep.sum(1).view(1, HEADS).to(torch.int32)
    key_cache, value_cache = flash.transpose(1, 2).split(DIM, dim=-1)  # FlashAttention's [B, N, H, D] views
    got = head_page_decode_attention(query, key_cache, value_cache, table.unsqueeze(0).clamp(min=0), lengths, 0.125)
    for h in range(HEADS):
        k, v = keys[h, keep[h]], values[h, keep[h]]
        expected = torch.softmax(query[0, h] @ k.T * 0.125, dim=-1) @ v
        torch.testing.assert_close(got[0, h], expected, rtol=1e-5, atol=1e-5)
