"""Triton building blocks shared by the scoring kernels: load a KV head's window queries and a paged key tile.

Imported only when a Triton kernel is launched (``triton`` is an optional dependency on CPU machines).
"""

import triton
import triton.language as tl


@triton.jit
def load_group_queries(
    q_ptr,
    stride_qh,
    stride_qw,
    stride_qd,
    kv_head,
    row_start,
    G: tl.constexpr,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Rows row_start .. row_start+ROWS-1 of the KV head's G*W window queries; row r is query head
    kv_head*G + r // W at window position r % W. Returns ([ROWS, D_PAD] queries, [ROWS] row ids, valid)."""
    rows = row_start + tl.arange(0, ROWS)
    rows_valid = rows < G * W
    q_head = kv_head * G + rows // W
    q_pos = rows % W
    dims = tl.arange(0, D_PAD)
    ptrs = q_ptr + q_head[:, None] * stride_qh + q_pos[:, None] * stride_qw + dims[None, :] * stride_qd
    q = tl.load(ptrs, mask=rows_valid[:, None] & (dims[None, :] < D), other=0.0)
    return q, rows, rows_valid


@triton.jit
def load_paged_key_tile(
    kc_ptr,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    block_table_ptr,
    kv_head,
    tile_start,
    num_valid,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Keys of tokens tile_start .. tile_start+BLOCK_N-1 (< num_valid) through the block table.

    Returns ([BLOCK_N, D_PAD] keys, zero where invalid; [BLOCK_N] token indices; [BLOCK_N] valid mask).
    """
    tokens = tile_start + tl.arange(0, BLOCK_N)
    valid = tokens < num_valid
    block = tl.load(block_table_ptr + tokens // PAGE, mask=valid, other=0).to(tl.int64)
    slot = tokens % PAGE
    dims = tl.arange(0, D_PAD)
    ptrs = (
        kc_ptr
        + block[:, None] * stride_kb
        + kv_head * stride_kh
        + slot[:, None] * stride_ks
        + dims[None, :] * stride_kd
    )
    keys = tl.load(ptrs, mask=valid[:, None] & (dims[None, :] < D), other=0.0)
    return keys, tokens, valid


@triton.jit
def load_head_page_key_tile(
    kc_ptr,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    pages_ptr,
    first,
    tile_start,
    num_valid,
    num_kv_heads,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Keys of one KV head's entries first+tile_start .. first+tile_start+BLOCK_N-1 (tile entries < num_valid)
    through that head's own page list (decode-time compression's head pages): entry i sits in page
    ``pages[i // PAGE]`` at slot ``i % PAGE``, and page p is head ``p % num_kv_heads``'s slice of block
    ``p // num_kv_heads``.

    Returns ([BLOCK_N, D_PAD] keys, zero where invalid; [BLOCK_N] entries from tile_start; [BLOCK_N] valid mask).
    """
    entries = tile_start + tl.arange(0, BLOCK_N)
    valid = entries < num_valid
    index = first + entries
    page = tl.load(pages_ptr + index // PAGE, mask=valid, other=0).to(tl.int64)
    block = page // num_kv_heads
    head = page % num_kv_heads
    dims = tl.arange(0, D_PAD)
    ptrs = (
        kc_ptr
        + block[:, None] * stride_kb
        + head[:, None] * stride_kh
        + (index % PAGE)[:, None] * stride_ks
        + dims[None, :] * stride_kd
    )
    keys = tl.load(ptrs, mask=valid[:, None] & (dims[None, :] < D), other=0.0)
    return keys, entries, valid
