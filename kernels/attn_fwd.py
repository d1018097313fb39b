"""Block-sparse attention forward: out and the log2-domain log-sum-exp.

One program per (q head, query tile) loops over the query block's kept key blocks
(fp32 accumulation, exp2 online softmax). Heaviest query blocks first, the G q heads of
a kv head adjacent in launch order (they share K/V tiles through L2). Its reference is
attn_fwd_naive.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attn_common import (
    SCAN,
    Prepared,
    iter_bounds,
    query_order,
    query_tile,
    row_docs,
    row_keep,
    strides3,
)
from .attn_tiles import attn_tiles, bounds_mask, tile_table
from .common import LOG2E, dot_in_fp32, launch_opts


@triton.jit
def _fwd_kernel(
    Q, K, V, DOC, DOC_START, KV_PTR, KV_INDEX, ORDER, OUT, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_db,
    seq_len, num_blocks, num_kv_heads, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SCAN: tl.constexpr,
    BOUNDS_MASK: tl.constexpr,
):  # fmt: skip
    b, hk, h, start_m, last_row, first_ds, last_ds, lo, count = query_tile(
        ORDER, KV_PTR, DOC_START, stride_db, seq_len, num_blocks, num_kv_heads, group,
        BLOCK_SIZE, BLOCK_M,
    )  # fmt: skip
    NSUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    DOT_T: tl.constexpr = tl.float32 if DOT_F32 else Q.dtype.element_ty
    PREC: tl.constexpr = "ieee" if DOT_F32 else "tf32"

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len

    # int64 bases: B*H*L*D and the table size overflow int32 at long L.
    b64 = b.to(tl.int64)
    q_ptrs = (
        Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + start_m.to(tl.int64) * stride_qm
        + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    )  # fmt: skip
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    doc_base = DOC + b64 * stride_db
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT_T)
    row_doc = row_docs(doc_base, DOC_START + b64 * stride_db, offs_m, row_ok, BOUNDS_MASK)
    idx_base = KV_INDEX + lo
    it_lo, it_hi = iter_bounds(
        idx_base, count, first_ds, last_row + 1, BLOCK_SIZE, BLOCK_N, NSUB, SCAN
    )

    # finite floor keeps exp2(m_old - m_new) defined when a whole tile is masked
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in range(it_lo, it_hi):
        kb = tl.load(idx_base + it // NSUB)
        start_n = kb * BLOCK_SIZE + (it % NSUB) * BLOCK_N
        cols = start_n + offs_n
        col_ok = cols < seq_len
        kt = tl.load(
            k_base + start_n.to(tl.int64) * stride_kn
            + offs_n[None, :] * stride_kn + offs_d[:, None],
            mask=col_ok[None, :], other=0.0,
        ).to(DOT_T)  # fmt: skip
        qk = tl.dot(q, kt, input_precision=PREC) * qk_scale
        # interior pairs (keys all <= the first row, all in the last row's document) skip it
        needs_mask = (start_n + BLOCK_N > start_m + 1) | (start_n < last_ds)
        if needs_mask:
            keep = row_keep(doc_base, cols, col_ok, offs_m, row_doc, BOUNDS_MASK)
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + start_n.to(tl.int64) * stride_vn
            + offs_n[:, None] * stride_vn + offs_d[None, :],
            mask=col_ok[:, None], other=0.0,
        ).to(DOT_T)  # fmt: skip
        acc = tl.dot(p.to(DOT_T), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new

    has_key = l_i > 0.0
    acc = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), 0.0)
    o_ptrs = (
        OUT + b64 * stride_ob + h.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_om
        + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    )  # fmt: skip
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    bh = b64 * num_kv_heads * group + h
    tl.store(LSE + bh * seq_len + offs_m, lse, mask=row_ok)


def attn_fwd(p: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """(out like q, lse [B, Hq, L] fp32 in log2 units) over the kv table."""
    q, k = p.q, p.k
    B, H, L, D = q.shape
    table = tile_table(q.device)
    t = attn_tiles(q.dtype, D, p.block_size, table).fwd
    out = torch.empty_like(q)
    lse = torch.empty((B, H, L), device=q.device, dtype=torch.float32)
    order = query_order(p.kv_ptr)
    grid = (order.numel() * (p.block_size // t.block_m) * (H // k.shape[1]),)
    _fwd_kernel[grid](
        q, k, p.v, p.doc_id, p.doc_start, p.kv_ptr, p.kv_index, order, out, lse,
        *strides3(q), *strides3(k), *strides3(p.v), *strides3(out), p.doc_id.stride(0),
        L, p.kv_ptr.shape[-1] - 1, k.shape[1], H // k.shape[1], p.scale * LOG2E,
        HEAD_DIM=D, BLOCK_SIZE=p.block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN,
        BOUNDS_MASK=bounds_mask(table, "fwd", D, p.block_size), **launch_opts(t),
    )  # fmt: skip
    return out, lse
