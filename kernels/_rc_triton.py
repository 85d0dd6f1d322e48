"""Triton kernels of fused RC scoring: a prompt through its block table (see :mod:`rcstat_vllm.kernels.rc_scoring`
for the contract) and, at decode time, each KV head's generated entries through its own head pages (see
:mod:`rcstat_vllm.kernels.decode_scoring`)."""

import triton
import triton.language as tl

from ._tiles_triton import load_group_queries, load_head_page_key_tile, load_paged_key_tile


@triton.jit
def sum_positive_gaps(x, q_head, valid, y_sorted_ptr, prefix_ptr, m, SEARCH_STEPS: tl.constexpr):
    """sum over y in Y(q_head) of max(x - y, 0), elementwise over a tile of centred logits x (rows = query heads or
    query rows, q_head per row). Y is sorted, so its prefix sum at count = #{y < x} is the sum of exactly those y,
    and the result is count * x - prefix[count]. ``count`` comes from a branchless binary search (10 gathers at
    m = w(w+1)/2 = 528, w = 32, instead of 528 compares): the largest c with y[c - 1] < x, one bit at a time
    from the highest. Rows that are not ``valid`` give 0."""
    count = tl.zeros(x.shape, dtype=tl.int32)
    for bit in tl.static_range(SEARCH_STEPS):
        probe = count + (1 << (SEARCH_STEPS - 1 - bit))
        probe_ok = valid[:, None] & (probe <= m)
        y = tl.load(y_sorted_ptr + q_head[:, None] * m + probe - 1, mask=probe_ok, other=float("inf"))
        count = tl.where(y < x, probe, count)
    below = tl.load(prefix_ptr + q_head[:, None] * (m + 1) + count, mask=valid[:, None], other=0.0)
    return tl.where(valid[:, None], tl.maximum(count.to(tl.float32) * x - below, 0.0), 0.0)


@triton.jit
def rc_tile_scores(
    q_ptr,
    stride_qh,
    stride_qw,
    stride_qd,
    keys,
    kv_head,
    y_sorted_ptr,
    prefix_ptr,
    center_ptr,
    m,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    MAX_OVER_QUERIES: tl.constexpr,
    MAX_OVER_HEADS: tl.constexpr,
    W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Eq. 6's sums of gaps for a tile of keys [BLOCK_N, D_PAD] of one KV head, against its G*W window queries
    (unnormalised, [BLOCK_N]). The G*W query rows are processed ROW_BLOCK at a time (bounded registers for large
    G*W); logits never leave registers.
    Mean (Eq. 6): every row's gaps are summed. MAX_OVER_QUERIES: the sum of gaps does not decrease as x grows and a
    query head's W rows all meet the same Y, so the best row's sum is the sum at the row's highest logit: a running
    max logit per query head ([G_PAD, BLOCK_N]; row blocks may split a head's rows) and one search per query head at
    the end, instead of one per row.
    MAX_OVER_HEADS: the highest of the G query heads' sums instead of their total (gaps are >= 0, so a padding
    head's 0 never wins); with the mean over queries each head's rows are summed apart ([G_PAD, BLOCK_N])."""
    scores = tl.zeros([BLOCK_N], dtype=tl.float32)
    heads = tl.arange(0, G_PAD)
    best = tl.full([G_PAD, BLOCK_N], float("-inf"), dtype=tl.float32)  # MAX_OVER_QUERIES: highest logit per head
    per_head = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)  # MAX_OVER_HEADS with the mean: each head's sum
    for row_block in tl.static_range(NUM_ROW_BLOCKS):
        q, rows, rows_valid = load_group_queries(
            q_ptr, stride_qh, stride_qw, stride_qd, kv_head, row_block * ROW_BLOCK, G, W, ROW_BLOCK, D, D_PAD
        )
        if IEEE:  # float32 caches: full-precision products (tf32 would round the logits to 10 mantissa bits)
            logits = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(keys))  # [ROW_BLOCK, BLOCK_N], float32 accumulation
        if MAX_OVER_QUERIES:
            for g in tl.static_range(G):
                in_head = rows_valid & (rows // W == g)
                head_best = tl.max(tl.where(in_head[:, None], logits, float("-inf")), axis=0)
                best = tl.where(heads[:, None] == g, tl.maximum(best, head_best[None, :]), best)
        else:
            q_head = kv_head * G + rows // W
            center = tl.load(center_ptr + q_head, mask=rows_valid, other=0.0)
            gaps = sum_positive_gaps(
                logits - center[:, None], q_head, rows_valid, y_sorted_ptr, prefix_ptr, m, SEARCH_STEPS
            )
            if MAX_OVER_HEADS:
                for g in tl.static_range(G):
                    head_sum = tl.sum(tl.where((rows // W == g)[:, None], gaps, 0.0), axis=0)
                    per_head = tl.where(heads[:, None] == g, per_head + head_sum[None, :], per_head)
            else:
                scores += tl.sum(gaps, axis=0)
    if MAX_OVER_QUERIES:
        heads_valid = heads < G
        q_head = kv_head * G + heads
        center = tl.load(center_ptr + q_head, mask=heads_valid, other=0.0)
        # Padding heads (>= G) hold -inf: masked out in the search, their gaps 0.
        x = tl.where(heads_valid[:, None], best - center[:, None], 0.0)
        gaps = sum_positive_gaps(x, q_head, heads_valid, y_sorted_ptr, prefix_ptr, m, SEARCH_STEPS)
        if MAX_OVER_HEADS:
            scores = tl.max(gaps, axis=0)
        else:
            scores = tl.sum(gaps, axis=0)
    elif MAX_OVER_HEADS:
        scores = tl.max(per_head, axis=0)
    return scores


@triton.jit
def rc_scores_paged_kernel(
    q_ptr,
    stride_qh,
    stride_qw,
    stride_qd,
    kc_ptr,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    block_table_ptr,
    y_sorted_ptr,
    prefix_ptr,
    center_ptr,  # [Hq, m], [Hq, m + 1], [Hq] float32, contiguous
    out_ptr,
    stride_oh,  # [Hkv, n - w] float32
    num_scored,
    m,
    norm,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    MAX_OVER_QUERIES: tl.constexpr,
    MAX_OVER_HEADS: tl.constexpr,
    W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(m + 1)): halvings of the binary search over the m sorted values
):
    """One program: BLOCK_N prompt tokens of one KV head, read through the request's block table. The key tile is
    loaded once (:func:`rc_tile_scores` then meets it with every window query)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys, tokens, tokens_valid = load_paged_key_tile(
        kc_ptr,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kd,
        block_table_ptr,
        kv_head,
        tile * BLOCK_N,
        num_scored,
        BLOCK_N,
        PAGE,
        D,
        D_PAD,
    )
    scores = rc_tile_scores(
        q_ptr,
        stride_qh,
        stride_qw,
        stride_qd,
        keys,
        kv_head,
        y_sorted_ptr,
        prefix_ptr,
        center_ptr,
        m,
        G,
        G_PAD,
        MAX_OVER_QUERIES,
        MAX_OVER_HEADS,
        W,
        ROW_BLOCK,
        NUM_ROW_BLOCKS,
        D,
        D_PAD,
        BLOCK_N,
        IEEE,
        SEARCH_STEPS,
    )
    # norm: 1 / (W * m) (mean over Eq. 6's W*m pairs) or 1 / m (max over queries), times 1 / G unless MAX_OVER_HEADS.
    tl.store(out_ptr + kv_head * stride_oh + tokens, scores * norm, mask=tokens_valid)


@triton.jit
def rc_head_pages_kernel(
    q_ptr,
    stride_qh,
    stride_qw,
    stride_qd,
    kc_ptr,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    pages_ptr,
    stride_ph,  # [Hkv, P] each KV head's own page list (decode-time compression's head pages)
    starts_ptr,
    counts_ptr,  # [Hkv] int32: each head's first scored entry, and its entries from there (its window last)
    y_sorted_ptr,
    prefix_ptr,
    center_ptr,  # [Hq, m], [Hq, m + 1], [Hq] float32, contiguous: each query head's table of its KV head's window
    out_ptr,
    stride_oh,  # [Hkv, width - W] float32, right-aligned: a head's latest entry in the last column
    num_columns,
    num_kv_heads,
    m,
    norm,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    MAX_OVER_QUERIES: tl.constexpr,
    MAX_OVER_HEADS: tl.constexpr,
    W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Decode time: one program scores BLOCK_N of one KV head's non-window entries, read through the head's own
    page list from its first entry on (heads hold different entries, and different numbers of them). The same
    Eq. 6 as the prompt kernel; the output is right-aligned, so every head's window follows its last column."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(starts_ptr + kv_head)
    num_scored = tl.load(counts_ptr + kv_head) - W  # this head's non-window entries (tiles past them store nothing)
    keys, entries, valid = load_head_page_key_tile(
        kc_ptr,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kd,
        pages_ptr + kv_head * stride_ph,
        first,
        tile * BLOCK_N,
        num_scored,
        num_kv_heads,
        BLOCK_N,
        PAGE,
        D,
        D_PAD,
    )
    scores = rc_tile_scores(
        q_ptr,
        stride_qh,
        stride_qw,
        stride_qd,
        keys,
        kv_head,
        y_sorted_ptr,
        prefix_ptr,
        center_ptr,
        m,
        G,
        G_PAD,
        MAX_OVER_QUERIES,
        MAX_OVER_HEADS,
        W,
        ROW_BLOCK,
        NUM_ROW_BLOCKS,
        D,
        D_PAD,
        BLOCK_N,
        IEEE,
        SEARCH_STEPS,
    )
    column = num_columns - num_scored + entries
    tl.store(out_ptr + kv_head * stride_oh + column, scores * norm, mask=valid)
