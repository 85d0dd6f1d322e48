"""Triton scoring kernels against their torch references (tiny shapes): under the Triton interpreter on CPU tensors
(the default), or compiled on a GPU with ``TRITON_INTERPRET=0 pytest tests/test_kernels.py``.

TRITON_INTERPRET must be set before the kernels are decorated; if another test module imported them
first (compiled mode, unusable without a GPU), they are reloaded here.

The interpreter of Triton 3.9 multiplies bfloat16 tiles as their raw uint16 storage in ``tl.dot``
(numpy has no bfloat16), so the bfloat16 case runs compiled on a GPU only; float16 runs everywhere.
Real model sizes on a GPU: ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot run")
INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 runs the kernels compiled, which needs a GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"

_JIT_MODULES = ("_tiles_triton", "_rc_triton", "_snapkv_triton")  # reloaded in dependency order
for _name in _JIT_MODULES:
    _module = f"rcstat_vllm.kernels.{_name}"
    if _module in sys.modules:
        importlib.reload(sys.modules[_module])

import rcstat_vllm.kernels.paged as paged  # noqa: E402
from rcstat_vllm.kernels.decode_scoring import (  # noqa: E402
    gather_head_entries,
    rc_head_table_scores,
    rc_head_table_scores_reference,
)
from rcstat_vllm.kernels.paged import gather_paged_tokens  # noqa: E402
from rcstat_vllm.kernels.rc_scoring import rc_table_scores_paged, rc_table_scores_paged_reference  # noqa: E402
from rcstat_vllm.kernels.snapkv_scoring import snapkv_attention_paged, snapkv_attention_paged_reference  # noqa: E402
from rcstat_vllm.scoring import RCScorer, expected_rc  # noqa: E402
from rcstat_vllm.scoring.methods.rc import (  # noqa: E402
    rc_head_scores_paged,
    rc_head_scores_paged_reference,
    rc_scores_paged,
    rc_scores_paged_reference,
)
from rcstat_vllm.scoring.methods.snapkv import snapkv_scores_paged, snapkv_scores_paged_reference  # noqa: E402
from rcstat_vllm.scoring.rc import expected_rc_grouped, window_self_logits  # noqa: E402


def paged_request(num_kv_heads, head_dim, num_tokens, block_size, seed, dtype=torch.float32, num_blocks=12):
    """A key cache that is a strided view (the K half of a fused [blocks, 2, Hkv, page, d] tensor), and a
    shuffled block table with a spare page at the end (tables are often longer than the prompt needs)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    key_cache = fused[:, 0]
    pages = -(-num_tokens // block_size) + 1
    block_table = torch.randperm(num_blocks, generator=gen)[:pages].to(torch.int32)
    return key_cache.to(DEVICE), block_table.to(DEVICE), gen


def test_gather_paged_tokens_follows_block_table():
    key_cache = torch.arange(4 * 1 * 3 * 1, dtype=torch.float32).reshape(4, 1, 3, 1)  # block b slot s = 3b + s
    block_table = torch.tensor([2, 0, 3], dtype=torch.int32)
    tokens = gather_paged_tokens(key_cache, block_table, 1, 8)  # pages 2, 0, 3 -> values 6..8, 0..2, 9..11
    assert tokens.squeeze(-1).tolist() == [[7.0, 8.0, 0.0, 1.0, 2.0, 9.0, 10.0]]


@pytest.mark.parametrize("start, stop", [(0, 45), (0, 48), (5, 45), (16, 48), (17, 18), (0, 3), (0, 0)])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_gather_from_dim_major_pages_equals_the_token_major_gather(start, stop, dtype):
    """vLLM-CPU's vec keys lie dim-major in each page (``[d, block_size]``): gathered page by page and put
    token-major, they are exactly what the same tokens gathered from a token-major cache give (first page
    part-read, last page part-full, whole pages, nothing), contiguous, in ``dtype`` (None: the cache's, bf16)."""
    gen = torch.Generator().manual_seed(6)
    pages = torch.randn(7, 3, 2, 8, 16, generator=gen).bfloat16()  # [blocks, Hkv, (key, value), d, page]
    dim_major = pages[:, :, 0].transpose(2, 3)  # [blocks, Hkv, page, d] view, the page's dims outermost
    token_major = dim_major.contiguous()
    block_table = torch.tensor([5, 1, 6, 0], dtype=torch.int32)
    got = gather_paged_tokens(dim_major, block_table, start, stop, dtype)
    want = gather_paged_tokens(token_major, block_table, start, stop)
    assert got.is_contiguous() and got.dtype == (dtype or torch.bfloat16)
    assert torch.equal(got, want.to(got.dtype)) and got.shape == (3, stop - start, 8)


@pytest.mark.parametrize("start, stop", [(0, 45), (5, 45), (16, 48), (17, 18), (0, 0)])
@pytest.mark.parametrize("chunk_pages", [1, 2, 100])
def test_paged_token_norms_equal_the_norms_of_the_gathered_tokens(monkeypatch, start, stop, chunk_pages):
    """paged_token_norms (whole pages normed a piece at a time, then put in token order) == the norms of
    gather_paged_tokens, on the value half of a fused cache (a strided view), with pieces of 1, 2 and all pages."""
    gen = torch.Generator().manual_seed(4)
    fused = torch.randn(7, 2, 3, 16, 2 * 8, generator=gen).bfloat16()[:, 0]  # [blocks, Hkv, page, 2d]
    values = fused[..., 8:]
    block_table = torch.tensor([5, 1, 6, 0], dtype=torch.int32)
    page_bytes = values[0].numel() * values.element_size()
    monkeypatch.setattr(paged, "NORM_CHUNK_BYTES", chunk_pages * page_bytes)
    got = paged.paged_token_norms(values, block_table, start, stop)
    want = torch.linalg.vector_norm(gather_paged_tokens(values, block_table, start, stop).float(), dim=-1)
    assert got.shape == (3, stop - start) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "window, group, num_tokens, block_size",
    [
        (8, 1, 8, 16),  # nothing to score
        (8, 1, 9, 16),  # one token
        (8, 1, 45, 16),  # partial last page
        (8, 3, 64, 16),  # exact pages
        (16, 1, 37, 8),
        (16, 3, 53, 8),
    ],
)
@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_rc_kernel_matches_reference(window, group, num_tokens, block_size, query_reduction):
    num_kv_heads, head_dim = 2, 24  # head_dim not a power of 2: padded lanes must not count
    key_cache, block_table, gen = paged_request(num_kv_heads, head_dim, num_tokens, block_size, seed=num_tokens)
    q_window = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(DEVICE)
    got = rc_scores_paged(q_window, key_cache, block_table, num_tokens, block_n=16, query_reduction=query_reduction)
    want = rc_scores_paged_reference(q_window, key_cache, block_table, num_tokens, query_reduction)
    assert got.shape == want.shape == (num_kv_heads, num_tokens - window)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 8, 32])
@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_rc_kernel_binary_search_counts_ties_like_the_reference(window, query_reduction):
    """Small integer keys and queries make exact logits: many equal to self logits, others below or above all of
    them, so the kernel's binary search over the sorted self logits is checked at every boundary (0 and all m
    counted; a tie adds x - y = 0 either way), exactly (integers are exact in float32)."""
    num_kv_heads, group, head_dim, block_size = 2, 3, 16, 16
    num_tokens = window + 40
    gen = torch.Generator().manual_seed(window)
    blocks = -(-num_tokens // block_size)
    key_cache = torch.randint(-2, 3, (blocks, num_kv_heads, block_size, head_dim), generator=gen).float().to(DEVICE)
    block_table = torch.arange(blocks, dtype=torch.int32).flip(0).to(DEVICE)
    q_window = torch.randint(-1, 2, (num_kv_heads * group, window, head_dim), generator=gen).float().to(DEVICE)
    got = rc_scores_paged(q_window, key_cache, block_table, num_tokens, block_n=16, query_reduction=query_reduction)
    want = rc_scores_paged_reference(q_window, key_cache, block_table, num_tokens, query_reduction)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rc_reference_equals_scorer_on_gathered_keys():
    # Ties the paged path to the scorer the engine uses (exact, float64): same grouping, mean, and order.
    key_cache, block_table, gen = paged_request(2, 8, 21, 4, seed=3, dtype=torch.float64)
    q_window = torch.randn(6, 8, 8, generator=gen, dtype=torch.float64).to(DEVICE)
    keys = gather_paged_tokens(key_cache, block_table, 0, 21)
    scorer_scores = RCScorer.paper(window_size=8).score(q_window, keys, keys, 1.0)
    paged = rc_scores_paged_reference(q_window, key_cache, block_table, 21)
    torch.testing.assert_close(paged.float(), scorer_scores[:, :13], rtol=1e-6, atol=1e-6)
    # And for G = 1 the paged reference is plain expected_rc on the gathered keys.
    single = rc_scores_paged_reference(q_window[::3], key_cache, block_table, 21)
    torch.testing.assert_close(single, expected_rc(q_window[::3], keys), rtol=0, atol=1e-12)


@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_rc_group_max_is_the_strongest_query_heads_rc(query_reduction):
    """group_reduction max: the paged reference scores each KV head's token by the max over its query heads of
    expected_rc_grouped (float64, exact), the mean is RCStat's; the max is never below the mean, and the paged
    kernel agrees with the reference."""
    key_cache, block_table, gen = paged_request(2, 8, 29, 4, seed=4, dtype=torch.float64)
    q_window = torch.randn(6, 8, 8, generator=gen, dtype=torch.float64).to(DEVICE)
    keys = gather_paged_tokens(key_cache, block_table, 0, 29)
    per_head = expected_rc_grouped(q_window.reshape(2, 3, 8, 8), keys, query_reduction)  # [Hkv, G, n - w]
    got = rc_scores_paged_reference(q_window, key_cache, block_table, 29, query_reduction, "max")
    torch.testing.assert_close(got, per_head.amax(dim=1), rtol=0, atol=0)
    mean = rc_scores_paged_reference(q_window, key_cache, block_table, 29, query_reduction, "mean")
    torch.testing.assert_close(mean, per_head.mean(dim=1), rtol=0, atol=0)
    assert bool((got >= mean).all()) and not torch.equal(got, mean)
    kernel = rc_scores_paged(
        q_window.float(),
        key_cache.float(),
        block_table,
        29,
        block_n=16,
        query_reduction=query_reduction,
        group_reduction="max",
    )
    torch.testing.assert_close(kernel, got.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="group_reduction"):
        rc_scores_paged_reference(q_window, key_cache, block_table, 29, query_reduction, "sum")


@pytest.mark.parametrize("max_over_heads", [False, True])
@pytest.mark.parametrize("max_over_queries", [False, True])
def test_rc_kernel_matches_its_own_torch_reference(max_over_queries, max_over_heads):
    """The kernel module's contract alone (a given table of sorted window self logits), against the reference beside
    it, which sums every gap max(x - y, 0) by the definition."""
    num_kv_heads, group, window, head_dim, num_tokens = 2, 3, 4, 24, 37
    key_cache, block_table, gen = paged_request(num_kv_heads, head_dim, num_tokens, 8, seed=2)
    q_window = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(DEVICE)
    window_keys = gather_paged_tokens(key_cache, block_table, num_tokens - window, num_tokens)
    table = window_self_logits(q_window.reshape(num_kv_heads, group, window, head_dim), window_keys)
    args = (q_window, key_cache, block_table, num_tokens, table.sorted, table.prefix, table.center, max_over_queries)
    args += (max_over_heads,)
    got = rc_table_scores_paged(*args, block_n=16)
    want = rc_table_scores_paged_reference(*args)
    assert got.shape == want.shape == (num_kv_heads, num_tokens - window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # And the scorer's wrapper is that table and that kernel (Eq. 6, or its max over queries; over the query heads the
    # mean, or their max).
    reduction, over_heads = ("max" if max_over_queries else "mean"), ("max" if max_over_heads else "mean")
    torch.testing.assert_close(
        rc_scores_paged(
            q_window, key_cache, block_table, num_tokens, query_reduction=reduction, group_reduction=over_heads
        ),
        want,
        rtol=1e-5,
        atol=1e-5,
    )


def test_snapkv_kernel_matches_its_own_torch_reference():
    """The mean window attention the kernel writes (before the scorer's pooling), against the reference beside it."""
    key_cache, block_table, gen = paged_request(2, 24, 45, 16, seed=4)
    q_window = torch.randn(6, 8, 24, generator=gen).to(DEVICE)
    got = snapkv_attention_paged(q_window, key_cache, block_table, 45, scale=0.4, block_n=16)
    want = snapkv_attention_paged_reference(q_window, key_cache, block_table, 45, scale=0.4)
    assert got.shape == want.shape == (2, 45 - 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


HALF = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(
            INTERPRETED,
            reason="the Triton interpreter multiplies bf16 tiles as raw uint16; TRITON_INTERPRET=0 on a GPU",
        ),
    ),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_rc_kernel_half_cache(dtype, query_reduction):
    """16-bit caches: products of 16-bit values are exact in float32, so only the summation order differs from the
    reference (which computes in float32 on the same rounded values)."""
    key_cache, block_table, gen = paged_request(2, 16, 40, 16, seed=5, dtype=dtype)
    q_window = torch.randn(6, 8, 16, generator=gen).to(DEVICE, dtype)
    got = rc_scores_paged(q_window, key_cache, block_table, 40, block_n=16, query_reduction=query_reduction)
    want = rc_scores_paged_reference(q_window, key_cache, block_table, 40, query_reduction)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "window, group, num_tokens, block_size",
    [(8, 1, 30, 16), (8, 3, 45, 16), (16, 3, 37, 8), (16, 1, 17, 8), (64, 2, 75, 16)],  # last: SnapKV default w
)
def test_snapkv_kernel_matches_reference(window, group, num_tokens, block_size):
    num_kv_heads, head_dim = 2, 24
    key_cache, block_table, gen = paged_request(num_kv_heads, head_dim, num_tokens, block_size, seed=num_tokens)
    q_window = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(DEVICE)
    got = snapkv_scores_paged(q_window, key_cache, block_table, num_tokens, scale=0.4, block_n=16)
    want = snapkv_scores_paged_reference(q_window, key_cache, block_table, num_tokens, scale=0.4)
    assert got.shape == want.shape == (num_kv_heads, num_tokens - window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", HALF)
def test_snapkv_kernel_half_cache(dtype):
    key_cache, block_table, gen = paged_request(2, 16, 45, 16, seed=8, dtype=dtype)
    q_window = torch.randn(6, 8, 16, generator=gen).to(DEVICE, dtype)
    got = snapkv_scores_paged(q_window, key_cache, block_table, 45, scale=0.25, block_n=16)
    want = snapkv_scores_paged_reference(q_window, key_cache, block_table, 45, scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)


# --- Decode time: each KV head's own generated entries, read through its own head pages --------------------------


def head_pages_request(num_kv_heads, head_dim, block_size, starts, counts, seed, dtype=torch.float32, num_blocks=16):
    """A key cache that is the K half of a fused [blocks, Hkv, page, 2d] cache (vLLM's CUDA layout), and per KV head
    a page list of distinct pages drawn from every block and head slot (a pooled space lends any page to any head)
    with a spare page at the end and -1 after it (no page)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_dim, generator=gen).to(dtype)
    starts, counts = torch.tensor(starts), torch.tensor(counts)
    needed = -(-int((starts + counts).max()) // block_size) + 1
    pages = torch.full((num_kv_heads, needed + 1), -1, dtype=torch.int64)
    pages[:, :needed] = torch.randperm(num_blocks * num_kv_heads, generator=gen)[: num_kv_heads * needed].view(
        num_kv_heads, needed
    )
    return fused[..., :head_dim].to(DEVICE), pages.to(DEVICE), starts, counts, gen


def test_gather_head_entries_follows_each_heads_pages_right_aligned():
    key_cache = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4, 1)  # page p = b*2 + h, slot s: 4p + s
    pages = torch.tensor([[5, 0], [2, 3]])  # head 0: pages 5, 0; head 1: pages 2, 3
    got = gather_head_entries(key_cache, pages, torch.tensor([2, 1]), torch.tensor([4, 3]), 5).squeeze(-1)
    # head 0: entries 2..5 = page 5 slots 2, 3, then page 0 slots 0, 1; head 1: entries 1..3 = page 2 slots 1..3;
    # the padding before a head's first entry repeats it
    assert got.tolist() == [[22.0, 22.0, 23.0, 0.0, 1.0], [9.0, 9.0, 9.0, 10.0, 11.0]]


DECODE_CASES = [
    # (window, G, block size, starts, counts): uneven per-head lengths (right-aligned padding), GQA, page boundaries
    (4, 1, 8, [0, 5], [20, 20]),  # equal lengths, one head starting mid-page
    (4, 3, 8, [3, 0, 17], [13, 27, 9]),  # ragged: head 2 has 5 entries to score, head 1 23
    (8, 2, 16, [30, 1], [8, 41]),  # a head holding only its window (nothing to score)
    (16, 4, 16, [0, 7, 2, 40], [70, 16, 33, 52]),  # 4 KV heads, more tiles than a narrow head fills
    (1, 3, 8, [2, 9], [6, 12]),  # a window of one query
]


@pytest.mark.parametrize("window, group, block_size, starts, counts", DECODE_CASES)
@pytest.mark.parametrize(
    "max_over_queries, max_over_heads", [(False, False), (True, False), (False, True), (True, True)]
)
def test_decode_kernel_matches_its_own_torch_reference(
    window, group, block_size, starts, counts, max_over_queries, max_over_heads
):
    """The head-page kernel against the reference beside it, given each query head's window table: every
    right-aligned column of every head, and exact zeros before a head's first entry."""
    num_kv_heads, head_dim = len(starts), 24  # head_dim not a power of 2: padded lanes must not count
    key_cache, pages, starts, counts, gen = head_pages_request(num_kv_heads, head_dim, block_size, starts, counts, 7)
    q_window = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(DEVICE)
    width = int(counts.max())
    window_keys = gather_head_entries(key_cache, pages, starts, counts, width)[:, width - window :]
    table = window_self_logits(q_window.reshape(num_kv_heads, group, window, head_dim), window_keys)
    args = (q_window, key_cache, pages, starts, counts, table.sorted, table.prefix, table.center, max_over_queries)
    args += (max_over_heads,)
    got = rc_head_table_scores(*args, block_n=16)
    want = rc_head_table_scores_reference(*args)
    assert got.shape == want.shape == (num_kv_heads, width - window) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    padding = torch.arange(width - window) < (width - counts).unsqueeze(1)
    assert not got.cpu()[padding].any()


@pytest.mark.parametrize("window, group, block_size, starts, counts", DECODE_CASES)
@pytest.mark.parametrize("query_reduction, group_reduction", [("mean", "mean"), ("max", "mean"), ("max", "max")])
def test_decode_rc_scores_match_the_torch_reference(
    window, group, block_size, starts, counts, query_reduction, group_reduction
):
    """rc_head_scores_paged (the window table in torch, then the kernel) against RC's torch statistics over each head's
    gathered entries (what the scorer's ragged torch path computes)."""
    num_kv_heads, head_dim = len(starts), 24
    key_cache, pages, starts, counts, gen = head_pages_request(num_kv_heads, head_dim, block_size, starts, counts, 8)
    q_window = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(DEVICE)
    got = rc_head_scores_paged(
        q_window, key_cache, pages, starts, counts, query_reduction, block_n=16, group_reduction=group_reduction
    )
    want = rc_head_scores_paged_reference(q_window, key_cache, pages, starts, counts, query_reduction, group_reduction)
    assert got.shape == want.shape == (num_kv_heads, int(counts.max()) - window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_rc_reference_is_each_head_scored_alone():
    """The decode reference of one head is the prompt reference of that head's entries alone (float64): right-aligned
    padding never reaches a head's scores, and each head is scored against its own window."""
    key_cache, pages, starts, counts, gen = head_pages_request(2, 8, 4, [3, 0], [11, 19], seed=9, dtype=torch.float64)
    q_window = torch.randn(2 * 3, 5, 8, generator=gen, dtype=torch.float64).to(DEVICE)
    got = rc_head_scores_paged_reference(q_window, key_cache, pages, starts, counts)
    for head in range(2):
        keys = gather_head_entries(key_cache, pages, starts, counts, int(counts[head]))[head : head + 1]
        alone = RCScorer.paper(window_size=5).score(q_window[3 * head : 3 * head + 3], keys, keys, 1.0)[0]
        n = int(counts[head])
        torch.testing.assert_close(got[head, got.shape[1] - (n - 5) :].float(), alone[: n - 5], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("query_reduction", ["mean", "max"])
def test_decode_kernel_half_cache(dtype, query_reduction):
    key_cache, pages, starts, counts, gen = head_pages_request(2, 16, 16, [5, 0], [30, 47], seed=10, dtype=dtype)
    q_window = torch.randn(6, 8, 16, generator=gen).to(DEVICE, dtype)
    got = rc_head_scores_paged(q_window, key_cache, pages, starts, counts, query_reduction, block_n=16)
    want = rc_head_scores_paged_reference(q_window, key_cache, pages, starts, counts, query_reduction)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_speed_times_the_head_page_kernel_and_the_torch_path():
    """benchmarks/gpu_check.py's part decode_speed (tools/gpu/check_kernels.py runs it on the GPU): both paths of the
    default RC scorer at decode time run on the same head pages and are timed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    dtype = "fp16" if INTERPRETED else "bf16"  # (the interpreter cannot multiply bf16 tiles)
    (row,) = gpu_check.decode_speed(torch.device(DEVICE), [48], 16, lambda what: None, dtype)
    # 8 KV heads of 48, 45, ..., 27 entries (gpu_check.head_pages: the last head about half the first)
    assert row["n"] == 48 and row["dtype"] == dtype and row["entries"] == sum(48 - 3 * h for h in range(8))
    assert row["kernel_ms_median"] > 0 and row["torch_ms_median"] > 0
