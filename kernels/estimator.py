"""Block-mass estimator: softmax over allowed key blocks of pooled-Q · pooled-K scores.

Per kv head h: qp[i] = mean of q over block i's valid tokens and over the G q heads of h,
kp[j] = mean of k over block j's valid tokens (a partial last block averages only its
tokens below L). score[i, j] = qp[i] · kp[j] * scale, allowed[i, j] = (j == i) or
(j < i and last_doc(j) == first_doc(i)), prob = softmax over allowed j, 0 elsewhere.

Two kernels: pooling (one pass over q/k, fp32 sums) and the probabilities for a range
of query blocks [i0, i1) (two passes over key-block chunks: online max/sum, then write),
so the [NB, NB] matrix can be produced in slices at long L.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import LOG2E, Tile, config_dtype, launch_opts


class EstimatorTiles(NamedTuple):
    """pool: block_m = rows per load chunk; probs: block_m/block_n = query/key blocks."""

    pool: Tile
    probs: Tile


# (dtype name, head_dim, block size Bs) -> tiles; the probs kernel reads fp32 pooled
# vectors, so only its head_dim matters.
EST_CONFIGS: dict[tuple[str, int, int], EstimatorTiles] = {
    (dt, d, bs): EstimatorTiles(pool=Tile(32, 0, 4, 1), probs=Tile(32, 64, 8, 2))
    for dt in ("bf16", "fp16")
    for d in (64, 128)
    for bs in (64, 128)
}


def est_tiles(dtype: torch.dtype, head_dim: int, block_size: int) -> EstimatorTiles:
    """Tiles for a launch; fp32 inputs (checking only) reuse the bf16 entry."""
    name = config_dtype(dtype)
    key = (name, head_dim, block_size)
    if key not in EST_CONFIGS:
        raise ValueError(f"no estimator config for dtype={dtype} D={head_dim} Bs={block_size}")
    return EST_CONFIGS[key]


@triton.jit
def _pool_kernel(
    Q, K, QP, KP,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    seq_len, num_blocks, num_kv_heads, group,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // num_kv_heads).to(tl.int64)
    hk64 = (pid_bh % num_kv_heads).to(tl.int64)
    start = blk * BLOCK_SIZE
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = tl.minimum(seq_len - start, BLOCK_SIZE)

    # sum chunks elementwise, reduce once at the end
    k_base = K + b64 * stride_kb + hk64 * stride_kh + start.to(tl.int64) * stride_kn
    k_acc = tl.zeros([CHUNK, HEAD_DIM], tl.float32)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        ok = (c + offs_c) < n_valid
        x = tl.load(
            k_base + (c + offs_c)[:, None] * stride_kn + offs_d[None, :],
            mask=ok[:, None], other=0.0,
        )  # fmt: skip
        k_acc += x.to(tl.float32)
    k_sum = tl.sum(k_acc, axis=0)

    q_acc = tl.zeros([CHUNK, HEAD_DIM], tl.float32)
    for g in range(0, group):
        q_base = Q + b64 * stride_qb + (hk64 * group + g) * stride_qh
        q_base += start.to(tl.int64) * stride_qm
        for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
            ok = (c + offs_c) < n_valid
            x = tl.load(
                q_base + (c + offs_c)[:, None] * stride_qm + offs_d[None, :],
                mask=ok[:, None], other=0.0,
            )  # fmt: skip
            q_acc += x.to(tl.float32)
    q_sum = tl.sum(q_acc, axis=0)

    row = (pid_bh.to(tl.int64) * num_blocks + blk) * HEAD_DIM
    tl.store(KP + row + offs_d, k_sum / n_valid.to(tl.float32))
    tl.store(QP + row + offs_d, q_sum / (n_valid * group).to(tl.float32))


@triton.jit
def _probs_kernel(
    QP, KP, DOC, PROB,
    stride_db,
    seq_len, num_blocks, num_kv_heads, i0, i1, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    pid_i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b64 = (pid_bh // num_kv_heads).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_j = tl.arange(0, BLOCK_J)
    rows = i0 + pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows < i1
    head = pid_bh.to(tl.int64) * num_blocks * HEAD_DIM
    qp = tl.load(
        QP + head + rows[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    doc_base = DOC + b64 * stride_db
    first_doc = tl.load(doc_base + rows * BLOCK_SIZE, mask=row_ok, other=-1)
    # key blocks past the tile's last row are never allowed
    j_end = tl.minimum(i0 + (pid_i + 1) * BLOCK_I, i1)

    m_i = tl.full([BLOCK_I], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_I], tl.float32)
    for j0 in range(0, j_end, BLOCK_J):
        s = _scores(qp, KP + head, doc_base, rows, first_doc, j0 + offs_j, offs_d,
                    seq_len, j_end, qk_scale, HEAD_DIM, BLOCK_SIZE)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new

    inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    out = PROB + (pid_bh.to(tl.int64) * (i1 - i0) + (rows - i0)[:, None]) * num_blocks
    for j0 in range(0, j_end, BLOCK_J):
        cols = j0 + offs_j
        s = _scores(qp, KP + head, doc_base, rows, first_doc, cols, offs_d,
                    seq_len, j_end, qk_scale, HEAD_DIM, BLOCK_SIZE)  # fmt: skip
        p = tl.exp2(s - m_i[:, None]) * inv_l[:, None]
        tl.store(out + cols[None, :], p, mask=row_ok[:, None] & (cols < num_blocks)[None, :])
    zero = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    for j0 in range(tl.cdiv(j_end, BLOCK_J) * BLOCK_J, num_blocks, BLOCK_J):
        cols = j0 + offs_j
        tl.store(out + cols[None, :], zero, mask=row_ok[:, None] & (cols < num_blocks)[None, :])


@triton.jit
def _scores(
    qp, kp_head, doc_base, rows, first_doc, cols, offs_d,
    seq_len, j_end, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """log2-domain scores of one [BLOCK_I, BLOCK_J] tile, -inf where not allowed."""
    col_ok = cols < j_end
    kpt = tl.load(
        kp_head + cols[None, :].to(tl.int64) * HEAD_DIM + offs_d[:, None],
        mask=col_ok[None, :], other=0.0,
    )  # fmt: skip
    last_tok = tl.minimum((cols + 1) * BLOCK_SIZE, seq_len) - 1
    last_doc = tl.load(doc_base + last_tok, mask=col_ok, other=-2)
    # 3xTF32 keeps fp32 accuracy on tensor cores; an IEEE (FMA) dot of this size spills
    s = tl.dot(qp, kpt, input_precision="tf32x3") * qk_scale
    allowed = (cols[None, :] == rows[:, None]) | (
        (cols[None, :] < rows[:, None]) & (last_doc[None, :] == first_doc[:, None])
    )
    return tl.where(allowed & col_ok[None, :], s, float("-inf"))


def pool_blocks_triton(
    q: torch.Tensor, k: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """qp, kp: [B, Hkv, NB, D] fp32 block means (qp also averages the G q heads)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (B, Hkv, L, D) or Hq % Hkv:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    nb = triton.cdiv(L, block_size)
    qp = torch.empty((B, Hkv, nb, D), device=q.device, dtype=torch.float32)
    kp = torch.empty_like(qp)
    t = est_tiles(q.dtype, D, block_size).pool
    _pool_kernel[(nb, B * Hkv)](
        q, k, qp, kp, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), L, nb, Hkv, Hq // Hkv,
        HEAD_DIM=D, BLOCK_SIZE=block_size, CHUNK=t.block_m,
        **launch_opts(t),
    )  # fmt: skip
    return qp, kp


def block_probs_triton(
    qp: torch.Tensor,
    kp: torch.Tensor,
    doc_id: torch.Tensor,
    block_size: int,
    i0: int = 0,
    i1: int | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """prob [B, Hkv, i1 - i0, NB] fp32 from pooled blocks; rows sum to 1 over allowed j.

    `dtype` only picks the tile-table entry (the input dtype of q/k).
    """
    B, Hkv, nb, D = qp.shape
    i1 = nb if i1 is None else i1
    if not 0 <= i0 < i1 <= nb:
        raise ValueError(f"need 0 <= i0 < i1 <= NB, got i0={i0} i1={i1} NB={nb}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    doc_id = doc_id.to(torch.int32).contiguous()
    prob = torch.empty((B, Hkv, i1 - i0, nb), device=qp.device, dtype=torch.float32)
    t = est_tiles(dtype, D, block_size).probs
    _probs_kernel[(triton.cdiv(i1 - i0, t.block_m), B * Hkv)](
        qp.contiguous(), kp.contiguous(), doc_id, prob, doc_id.stride(0),
        doc_id.shape[1], nb, Hkv, i0, i1, scale * LOG2E,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_I=t.block_m, BLOCK_J=t.block_n,
        **launch_opts(t),
    )  # fmt: skip
    return prob


def estimate_block_mass_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    block_size: int,
    i0: int = 0,
    i1: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Estimated attention mass per block pair: [B, Hkv, i1 - i0, NB] fp32."""
    qp, kp = pool_blocks_triton(q, k, block_size)
    return block_probs_triton(qp, kp, doc_id, block_size, i0, i1, scale, dtype=q.dtype)
