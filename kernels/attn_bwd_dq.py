"""Block-sparse attention backward, dQ: delta = rowsum(dO * O), then dQ.

The preprocess kernel writes delta [B, Hq, L] fp32, which dQ and dK/dV both read. The
dQ kernel walks the kv table exactly like the forward (same grid, order and tile-pair
classes) and recomputes P from the forward's log-sum-exp. Its reference is
attn_bwd_dq_naive.py.
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
def _bwd_preprocess_kernel(
    OUT, DO, DELTA,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    seq_len, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_heads).to(tl.int64)
    h = (pid_bh % num_heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    local = tl.arange(0, BLOCK_M)[:, None]
    o = tl.load(
        OUT + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_om
        + local * stride_om + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + start_m.to(tl.int64) * stride_dom
        + local * stride_dom + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * seq_len + offs_m, delta, mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DOC, DOC_START, KV_PTR, KV_INDEX, ORDER, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_db,
    seq_len, num_blocks, num_kv_heads, group, qk_scale, sm_scale,
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
    local_m = tl.arange(0, BLOCK_M)[:, None]
    row_ok = offs_m < seq_len

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    bh = b64 * num_kv_heads * group + h64
    row0 = start_m.to(tl.int64)
    q = tl.load(
        Q + b64 * stride_qb + h64 * stride_qh + row0 * stride_qm
        + local_m * stride_qm + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    ).to(DOT_T)  # fmt: skip
    do = tl.load(
        DO + b64 * stride_dob + h64 * stride_doh + row0 * stride_dom
        + local_m * stride_dom + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    ).to(DOT_T)  # fmt: skip
    lse = tl.load(LSE + bh * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * seq_len + offs_m, mask=row_ok, other=0.0)
    doc_base = DOC + b64 * stride_db
    row_doc = row_docs(doc_base, DOC_START + b64 * stride_db, offs_m, row_ok, BOUNDS_MASK)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    idx_base = KV_INDEX + lo
    it_lo, it_hi = iter_bounds(
        idx_base, count, first_ds, last_row + 1, BLOCK_SIZE, BLOCK_N, NSUB, SCAN
    )

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in range(it_lo, it_hi):
        kb = tl.load(idx_base + it // NSUB)
        start_n = kb * BLOCK_SIZE + (it % NSUB) * BLOCK_N
        cols = start_n + offs_n
        col_ok = cols < seq_len
        k = tl.load(
            k_base + start_n.to(tl.int64) * stride_kn
            + offs_n[:, None] * stride_kn + offs_d[None, :],
            mask=col_ok[:, None], other=0.0,
        ).to(DOT_T)  # fmt: skip
        vt = tl.load(
            v_base + start_n.to(tl.int64) * stride_vn
            + offs_n[None, :] * stride_vn + offs_d[:, None],
            mask=col_ok[None, :], other=0.0,
        ).to(DOT_T)  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.exp2(qk - lse[:, None])
        # interior pairs (keys all <= the first row, all in the last row's document) skip it
        needs_mask = (start_n + BLOCK_N > start_m + 1) | (start_n < last_ds)
        if needs_mask:
            keep = row_keep(doc_base, cols, col_ok, offs_m, row_doc, BOUNDS_MASK)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(DOT_T), k, dq, input_precision=PREC)

    dq = dq * sm_scale
    tl.store(
        DQ + b64 * stride_dqb + h64 * stride_dqh + row0 * stride_dqm
        + local_m * stride_dqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), mask=row_ok[:, None],
    )  # fmt: skip


def attn_bwd_preprocess(out: torch.Tensor, do: torch.Tensor, block_size: int) -> torch.Tensor:
    """delta = rowsum(dO * O), [B, H, L] fp32."""
    B, H, L, D = out.shape
    delta = torch.empty((B, H, L), device=out.device, dtype=torch.float32)
    t = attn_tiles(out.dtype, D, block_size, tile_table(out.device)).preprocess
    _bwd_preprocess_kernel[(triton.cdiv(L, t.block_m), B * H)](
        out, do, delta, *strides3(out), *strides3(do), L, H,
        HEAD_DIM=D, BLOCK_M=t.block_m, **launch_opts(t),
    )  # fmt: skip
    return delta


def attn_bwd_dq(p: Prepared, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """dQ over the kv table (query block -> its kept key blocks)."""
    q, k = p.q, p.k
    B, H, L, D = q.shape
    table = tile_table(q.device)
    t = attn_tiles(q.dtype, D, p.block_size, table).dq
    dq = torch.empty_like(q)
    order = query_order(p.kv_ptr)
    grid = (order.numel() * (p.block_size // t.block_m) * (H // k.shape[1]),)
    _bwd_dq_kernel[grid](
        q, k, p.v, p.doc_id, p.doc_start, p.kv_ptr, p.kv_index, order, do, lse, delta, dq,
        *strides3(q), *strides3(k), *strides3(p.v), *strides3(do), *strides3(dq),
        p.doc_id.stride(0),
        L, p.kv_ptr.shape[-1] - 1, k.shape[1], H // k.shape[1], p.scale * LOG2E, p.scale,
        HEAD_DIM=D, BLOCK_SIZE=p.block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN,
        BOUNDS_MASK=bounds_mask(table, "dq", D, p.block_size), **launch_opts(t),
    )  # fmt: skip
    return dq
