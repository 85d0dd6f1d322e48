"""Triton kernel of fused RC scoring (see :mod:`rcstat_vllm.kernels.rc_scoring` for the contract)."""

import triton
import triton.language as tl

from ._tiles_triton import load_group_queries, load_paged_key_tile


@triton.jit
def rc_scores_paged_kernel(
    q_ptr, stride_qh, stride_qw, stride_qd,
    kc_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
    block_table_ptr,
    y_sorted_ptr, prefix_ptr, center_ptr,  # [Hq, m], [Hq, m + 1], [Hq] float32, contiguous
    out_ptr, stride_oh,                     # [Hkv, n - w] float32
    num_scored, m, norm,
    G: tl.constexpr, G_PAD: tl.constexpr, MAX_OVER_QUERIES: tl.constexpr,
    W: tl.constexpr, ROW_BLOCK: tl.constexpr, NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(m + 1)): halvings of the binary search over the m sorted values
):
    """One program: BLOCK_N tokens of one KV head. The key tile is loaded once; the G*W query rows are
    processed ROW_BLOCK at a time (bounded registers for large G*W); logits never leave registers.
    MAX_OVER_QUERIES: each query head's rows (its W window queries) are reduced by max instead of summed; row blocks
    may split a head's rows, so a running max per query head is kept ([G_PAD, BLOCK_N]) and summed at the end."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys, tokens, tokens_valid = load_paged_key_tile(
        kc_ptr, stride_kb, stride_kh, stride_ks, stride_kd, block_table_ptr, kv_head, tile * BLOCK_N,
        num_scored, BLOCK_N, PAGE, D, D_PAD,
    )
    scores = tl.zeros([BLOCK_N], dtype=tl.float32)
    best = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)  # MAX_OVER_QUERIES: per query head (gaps are >= 0)
    heads = tl.arange(0, G_PAD)
    for row_block in tl.static_range(NUM_ROW_BLOCKS):
        q, rows, rows_valid = load_group_queries(
            q_ptr, stride_qh, stride_qw, stride_qd, kv_head, row_block * ROW_BLOCK, G, W, ROW_BLOCK, D, D_PAD
        )
        if IEEE:  # float32 caches: full-precision products (tf32 would round the logits to 10 mantissa bits)
            logits = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(keys))  # [ROW_BLOCK, BLOCK_N], float32 accumulation
        q_head = kv_head * G + rows // W
        center = tl.load(center_ptr + q_head, mask=rows_valid, other=0.0)
        x = logits - center[:, None]

        # count[r, t] = #{y in Y of query head(r) : y < x[r, t]}; Y is sorted, so its prefix sum at `count`
        # is the sum of exactly those y, and sum_y max(x - y, 0) = count * x - prefix[count].
        # Branchless binary search (m = w(w+1)/2 = 528 at w = 32: 10 gathers instead of 528 compares): `count`
        # is the largest c with y[c - 1] < x, found one bit at a time from the highest.
        count = tl.zeros([ROW_BLOCK, BLOCK_N], dtype=tl.int32)
        for bit in tl.static_range(SEARCH_STEPS):
            probe = count + (1 << (SEARCH_STEPS - 1 - bit))
            probe_ok = rows_valid[:, None] & (probe <= m)
            y = tl.load(y_sorted_ptr + q_head[:, None] * m + probe - 1, mask=probe_ok, other=float("inf"))
            count = tl.where(y < x, probe, count)
        below = tl.load(prefix_ptr + q_head[:, None] * (m + 1) + count, mask=rows_valid[:, None], other=0.0)
        gaps = tl.where(rows_valid[:, None], tl.maximum(count.to(tl.float32) * x - below, 0.0), 0.0)
        if MAX_OVER_QUERIES:
            for g in tl.static_range(G):
                head_best = tl.max(tl.where((rows // W == g)[:, None], gaps, 0.0), axis=0)
                best = tl.where(heads[:, None] == g, tl.maximum(best, head_best[None, :]), best)
        else:
            scores += tl.sum(gaps, axis=0)
    if MAX_OVER_QUERIES:
        scores = tl.sum(best, axis=0)
    # norm: 1 / (W * m * G) (mean over Eq. 6's W*m pairs, then the G query heads) or 1 / (m * G) (max over queries).
    tl.store(out_ptr + kv_head * stride_oh + tokens, scores * norm, mask=tokens_valid)
