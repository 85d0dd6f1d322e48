"""Triton decode attention over head pages (see head_attention.py for the layout and the torch reference).

Imported only when the kernel is launched (``triton`` is optional on CPU machines).
"""

import triton
import triton.language as tl


@triton.jit
def head_page_decode_kernel(
    q_ptr, stride_qr, stride_qh, stride_qg, stride_qd,
    k_ptr, v_ptr, stride_cb, stride_cs, stride_ch, stride_cd,
    table_ptr, stride_tr, stride_th, stride_tp,
    len_ptr, stride_lr, stride_lh,
    o_ptr, stride_or, stride_oh, stride_og, stride_od,
    scale,
    H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one (request, KV head): its G queries attend over its own pages, online softmax."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < G
    dim_ok = dims < D
    q = tl.load(
        q_ptr + request * stride_qr + head * stride_qh + rows[:, None] * stride_qg + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    ).to(tl.float32) * scale
    length = tl.load(len_ptr + request * stride_lr + head * stride_lh)

    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max per query row
    l = tl.zeros([G_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = table_ptr + request * stride_tr + head * stride_th
    for start in range(0, length, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < length
        # Head page p = block * H + kv head: the same page ids as the CPU path (head_pages.py).
        page = tl.load(table + (tokens // PAGE) * stride_tp, mask=valid, other=0).to(tl.int64)
        base = (page // H) * stride_cb + (page % H) * stride_ch + (tokens % PAGE) * stride_cs
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + dims[None, :] * stride_cd, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base[:, None] + dims[None, :] * stride_cd, mask=kv_mask, other=0.0).to(tl.float32)
        # [G_PAD, BLOCK_N] logits by broadcast-multiply-sum: G is small at decode (a few query heads).
        logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        correction = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        l = l * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        o_ptr + request * stride_or + head * stride_oh + rows[:, None] * stride_og + dims[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )
