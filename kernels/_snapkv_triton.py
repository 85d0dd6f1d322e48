"""Triton kernels of paged SnapKV scoring (see :mod:`rcstat_vllm.kernels.snapkv_scoring` for the contract)."""

import triton
import triton.language as tl

from ._tiles_triton import load_group_queries, load_paged_key_tile


@triton.jit
def _scaled_logits(q, keys, tokens_valid, scale, IEEE: tl.constexpr):
    if IEEE:
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(keys))
    return tl.where(tokens_valid[None, :], logits * scale, float("-inf"))


@triton.jit
def snapkv_partial_logsumexp_kernel(
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
    partial_ptr,  # [Hkv, num_tiles, NUM_ROW_BLOCKS * ROW_BLOCK] float32: row log-sum-exp over the tile
    num_scored,
    num_tiles,
    scale,
    G: tl.constexpr,
    W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Pass 1: per (KV head, tile), each window query's log-sum-exp over the tile's non-window tokens."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys, _tokens, tokens_valid = load_paged_key_tile(
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
    out_row_ptr = partial_ptr + (kv_head * num_tiles + tile) * (NUM_ROW_BLOCKS * ROW_BLOCK)
    for row_block in tl.static_range(NUM_ROW_BLOCKS):
        q, rows, _rows_valid = load_group_queries(
            q_ptr, stride_qh, stride_qw, stride_qd, kv_head, row_block * ROW_BLOCK, G, W, ROW_BLOCK, D, D_PAD
        )
        logits = _scaled_logits(q, keys, tokens_valid, scale, IEEE)
        row_max = tl.max(logits, axis=1)  # finite: every tile has at least one valid token
        row_lse = row_max + tl.log(tl.sum(tl.exp(logits - row_max[:, None]), axis=1))
        tl.store(out_row_ptr + rows, row_lse)


@triton.jit
def snapkv_mean_attention_kernel(
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
    lse_ptr,  # [Hkv, NUM_ROW_BLOCKS * ROW_BLOCK] float32: each window query's log-sum-exp over its keys
    out_ptr,
    stride_oh,  # [Hkv, n - w] float32
    num_scored,
    scale,
    G: tl.constexpr,
    W: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    NUM_ROW_BLOCKS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Pass 2: softmax weight of each token under each window query, averaged over the G*W queries."""
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
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_block in tl.static_range(NUM_ROW_BLOCKS):
        q, rows, rows_valid = load_group_queries(
            q_ptr, stride_qh, stride_qw, stride_qd, kv_head, row_block * ROW_BLOCK, G, W, ROW_BLOCK, D, D_PAD
        )
        logits = _scaled_logits(q, keys, tokens_valid, scale, IEEE)
        lse = tl.load(lse_ptr + kv_head * (NUM_ROW_BLOCKS * ROW_BLOCK) + rows)
        weights = tl.where(rows_valid[:, None], tl.exp(logits - lse[:, None]), 0.0)
        total += tl.sum(weights, axis=0)
    tl.store(out_ptr + kv_head * stride_oh + tokens, total * (1.0 / (G * W)), mask=tokens_valid)
