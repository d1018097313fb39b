"""Block-sparse flash attention (forward + backward) over a compressed block table.

Layout: q [B, Hq, L, D], k/v [B, Hkv, L, D], doc_id [B, L] int32, Hq = G * Hkv. The table
(any object with kv_count, kv_index, q_count, q_index) says which key blocks of size Bs each
query block computes, per kv head; inside a computed pair the token mask is
`key pos <= query pos and doc_id[key] == doc_id[query]`.

Kernels (one program per tile, fp32 accumulation, exp2 softmax):
- forward: per (q head, query tile), loop over the query block's kept key blocks;
  writes out and the log2-domain log-sum-exp.
- backward preprocess: delta = rowsum(dO * O).
- dQ: same walk as forward, over the kv table.
- dK/dV: per (kv head, key tile), loop over the G q heads and over the query blocks of
  the transposed table; each program owns its dK/dV rows, so no atomics are needed and
  the GQA sum over the G heads happens in registers.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from .common import LOG2E, Tile, config_dtype, dot_in_fp32, fp32_variant, launch_opts


class AttnTiles(NamedTuple):
    """Tile configs of the four attention kernels for one (dtype, head_dim, Bs)."""

    fwd: Tile
    preprocess: Tile
    dq: Tile
    dkdv: Tile


# One table for runtime and AOT: (dtype name, head_dim, block size Bs) -> tiles. Tiles
# divide Bs so every tile lies inside one sparse block. Picked by the AOT sweep
# `python bench/kernels_report.py --sweep` (bf16, sm_80 and sm_90a, see docs/kernels.md):
# among tiles with no spills, shared memory within the limit and no duplicated MMA work
# (mma_ratio 1: with 8 warps on a 64-row tile of chained dots, Triton lays the warps
# along M only and two warp groups issue the same MMAs) on both arches, the largest
# tile area, then the larger resident dimension, then fewer warps, then more stages.
_PRE = Tile(64, 0, 4, 1)
_BY_SHAPE: dict[tuple[int, int], AttnTiles] = {
    (64, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 3), dkdv=Tile(32, 64, 4, 3)
    ),
    (64, 128): AttnTiles(
        fwd=Tile(128, 128, 8, 3), preprocess=_PRE, dq=Tile(128, 64, 8, 3), dkdv=Tile(32, 128, 8, 3)
    ),
    (128, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 32, 4, 3), dkdv=Tile(64, 32, 4, 3)
    ),
    (128, 128): AttnTiles(
        fwd=Tile(128, 32, 8, 3), preprocess=_PRE, dq=Tile(128, 32, 8, 3), dkdv=Tile(128, 32, 8, 3)
    ),
}
ATTN_CONFIGS: dict[tuple[str, int, int], AttnTiles] = {
    (dt, d, bs): tiles for dt in ("bf16", "fp16") for (d, bs), tiles in _BY_SHAPE.items()
}


def attn_tiles(dtype: torch.dtype, head_dim: int, block_size: int) -> AttnTiles:
    """Tiles for a launch; fp32 (checking only) reuses the bf16 tiles with one stage."""
    name = config_dtype(dtype)
    key = (name, head_dim, block_size)
    if name is None or key not in ATTN_CONFIGS:
        raise ValueError(f"no tile config for dtype={dtype} head_dim={head_dim} Bs={block_size}")
    tiles = ATTN_CONFIGS[key]
    for t in (tiles.fwd, tiles.dq, tiles.dkdv):
        assert block_size % t.block_m == 0 and block_size % t.block_n == 0, (key, t)
    if dtype == torch.float32:
        tiles = AttnTiles(*(fp32_variant(t) for t in tiles))
    return tiles


class BlockTable(Protocol):
    kv_count: torch.Tensor  # [B, Hkv, NB] int32
    kv_index: torch.Tensor  # [B, Hkv, NB, MAXK] int32
    q_count: torch.Tensor  # [B, Hkv, NB] int32
    q_index: torch.Tensor  # [B, Hkv, NB, MAXQ] int32


# --------------------------------------------------------------------------- kernels


@triton.jit
def _fwd_kernel(
    Q, K, V, DOC, KV_COUNT, KV_INDEX, OUT, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_db,
    seq_len, num_blocks, max_k, num_heads, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    start_m = pid_m * BLOCK_M
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
    doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-1)

    tbl = (b64 * (num_heads // group) + hk) * num_blocks + start_m // BLOCK_SIZE
    count = tl.load(KV_COUNT + tbl)
    idx_base = KV_INDEX + tbl * max_k

    # finite floor keeps exp2(m_old - m_new) defined when a whole tile is masked
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in range(0, count * NSUB):
        kb = tl.load(idx_base + it // NSUB)
        start_n = kb * BLOCK_SIZE + (it % NSUB) * BLOCK_N
        cols = start_n + offs_n
        col_ok = cols < seq_len
        kt = tl.load(
            k_base + start_n.to(tl.int64) * stride_kn
            + offs_n[None, :] * stride_kn + offs_d[:, None],
            mask=col_ok[None, :], other=0.0,
        ).to(DOT_T)  # fmt: skip
        doc_k = tl.load(doc_base + cols, mask=col_ok, other=-2)
        qk = tl.dot(q, kt, input_precision=PREC) * qk_scale
        keep = (
            (cols[None, :] <= offs_m[:, None])
            & (doc_k[None, :] == doc_q[:, None])
            & col_ok[None, :]
        )
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
    tl.store(LSE + pid_bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_ok)


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
    Q, K, V, DOC, KV_COUNT, KV_INDEX, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_db,
    seq_len, num_blocks, max_k, num_heads, group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    start_m = pid_m * BLOCK_M
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
    lse = tl.load(LSE + pid_bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    doc_base = DOC + b64 * stride_db
    doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-1)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    tbl = (b64 * (num_heads // group) + hk) * num_blocks + start_m // BLOCK_SIZE
    count = tl.load(KV_COUNT + tbl)
    idx_base = KV_INDEX + tbl * max_k

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in range(0, count * NSUB):
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
        doc_k = tl.load(doc_base + cols, mask=col_ok, other=-2)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = (
            (cols[None, :] <= offs_m[:, None])
            & (doc_k[None, :] == doc_q[:, None])
            & col_ok[None, :]
        )
        p = tl.where(keep, tl.exp2(qk - lse[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(DOT_T), k, dq, input_precision=PREC)

    dq = dq * sm_scale
    tl.store(
        DQ + b64 * stride_dqb + h64 * stride_dqh + row0 * stride_dqm
        + local_m * stride_dqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), mask=row_ok[:, None],
    )  # fmt: skip


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOC, Q_COUNT, Q_INDEX, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_db,
    seq_len, num_blocks, max_q, num_kv_heads, group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    start_n = pid_n * BLOCK_N
    NSUB: tl.constexpr = BLOCK_SIZE // BLOCK_M
    DOT_T: tl.constexpr = tl.float32 if DOT_F32 else Q.dtype.element_ty
    PREC: tl.constexpr = "ieee" if DOT_F32 else "tf32"

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    local_n = tl.arange(0, BLOCK_N)[:, None]
    col_ok = offs_n < seq_len

    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    col0 = start_n.to(tl.int64)
    k = tl.load(
        K + b64 * stride_kb + hk64 * stride_kh + col0 * stride_kn
        + local_n * stride_kn + offs_d[None, :],
        mask=col_ok[:, None], other=0.0,
    ).to(DOT_T)  # fmt: skip
    v = tl.load(
        V + b64 * stride_vb + hk64 * stride_vh + col0 * stride_vn
        + local_n * stride_vn + offs_d[None, :],
        mask=col_ok[:, None], other=0.0,
    ).to(DOT_T)  # fmt: skip
    doc_base = DOC + b64 * stride_db
    doc_k = tl.load(doc_base + offs_n, mask=col_ok, other=-2)

    tbl = (b64 * num_kv_heads + hk) * num_blocks + start_n // BLOCK_SIZE
    count = tl.load(Q_COUNT + tbl)
    idx_base = Q_INDEX + tbl * max_q

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, group):
        h64 = hk64 * group + g
        bh = b64 * num_kv_heads * group + h64
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        for it in range(0, count * NSUB):
            qb = tl.load(idx_base + it // NSUB)
            start_m = qb * BLOCK_SIZE + (it % NSUB) * BLOCK_M
            rows = start_m + offs_m
            row_ok = rows < seq_len
            qt = tl.load(
                q_base + start_m.to(tl.int64) * stride_qm
                + offs_m[None, :] * stride_qm + offs_d[:, None],
                mask=row_ok[None, :], other=0.0,
            ).to(DOT_T)  # fmt: skip
            do = tl.load(
                do_base + start_m.to(tl.int64) * stride_dom
                + offs_m[:, None] * stride_dom + offs_d[None, :],
                mask=row_ok[:, None], other=0.0,
            ).to(DOT_T)  # fmt: skip
            lse = tl.load(LSE + bh * seq_len + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + bh * seq_len + rows, mask=row_ok, other=0.0)
            doc_q = tl.load(doc_base + rows, mask=row_ok, other=-1)
            qkt = tl.dot(k, qt, input_precision=PREC) * qk_scale
            keep = (
                (offs_n[:, None] <= rows[None, :])
                & (doc_k[:, None] == doc_q[None, :])
                & row_ok[None, :]
            )
            pt = tl.where(keep, tl.exp2(qkt - lse[None, :]), 0.0)
            dv = tl.dot(pt.to(DOT_T), do, dv, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk = tl.dot(dst.to(DOT_T), tl.trans(qt), dk, input_precision=PREC)

    dk = dk * sm_scale
    tl.store(
        DK + b64 * stride_dkb + hk64 * stride_dkh + col0 * stride_dkn
        + local_n * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty), mask=col_ok[:, None],
    )  # fmt: skip
    tl.store(
        DV + b64 * stride_dvb + hk64 * stride_dvh + col0 * stride_dvn
        + local_n * stride_dvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=col_ok[:, None],
    )  # fmt: skip


# --------------------------------------------------------------------------- launchers


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_id: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if tuple(doc_id.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc_id {tuple(doc_id.shape)} does not match q {tuple(q.shape)}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def table_block_size(table: BlockTable, seq_len: int) -> int:
    """The table's `block_size` attribute if it has one, else inferred from NB = ceil(L/Bs).

    Only 64 and 128 have tiles; when both give the same NB there is a single block, and
    the two readings compute the same thing.
    """
    nb = table.kv_count.shape[-1]
    given = getattr(table, "block_size", None)
    candidates = (int(given),) if given is not None else (64, 128)
    for bs in candidates:
        if triton.cdiv(seq_len, bs) == nb:
            return bs
    raise ValueError(f"block size {candidates} does not match L={seq_len} and NB={nb}")


def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    kv_count: torch.Tensor,
    kv_index: torch.Tensor,
    block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, D = q.shape
    tiles = attn_tiles(q.dtype, D, block_size)
    t = tiles.fwd
    out = torch.empty_like(q)
    lse = torch.empty((B, H, L), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(L, t.block_m), B * H)
    _fwd_kernel[grid](
        q, k, v, doc_id, kv_count, kv_index, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out), doc_id.stride(0),
        L, kv_count.shape[-1], kv_index.shape[-1], H, H // k.shape[1], scale * LOG2E,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), **launch_opts(t),
    )  # fmt: skip
    return out, lse


def _bwd_preprocess(out: torch.Tensor, do: torch.Tensor, block_size: int) -> torch.Tensor:
    """delta = rowsum(dO * O), [B, H, L] fp32."""
    B, H, L, D = out.shape
    delta = torch.empty((B, H, L), device=out.device, dtype=torch.float32)
    t = attn_tiles(out.dtype, D, block_size).preprocess
    _bwd_preprocess_kernel[(triton.cdiv(L, t.block_m), B * H)](
        out, do, delta, *_strides3(out), *_strides3(do), L, H,
        HEAD_DIM=D, BLOCK_M=t.block_m, **launch_opts(t),
    )  # fmt: skip
    return delta


def _bwd_dq(q, k, v, doc_id, kv_count, kv_index, do, lse, delta, block_size, scale):
    """dQ over the kv table (query block -> its kept key blocks)."""
    B, H, L, D = q.shape
    t = attn_tiles(q.dtype, D, block_size).dq
    dq = torch.empty_like(q)
    _bwd_dq_kernel[(triton.cdiv(L, t.block_m), B * H)](
        q, k, v, doc_id, kv_count, kv_index, do, lse, delta, dq,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dq),
        doc_id.stride(0),
        L, kv_count.shape[-1], kv_index.shape[-1], H, H // k.shape[1], scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), **launch_opts(t),
    )  # fmt: skip
    return dq


def _bwd_dkdv(q, k, v, doc_id, q_count, q_index, do, lse, delta, block_size, scale):
    """dK, dV over the transposed table (key block -> the query blocks that kept it)."""
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    t = attn_tiles(q.dtype, D, block_size).dkdv
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _bwd_dkdv_kernel[(triton.cdiv(L, t.block_n), B * Hkv)](
        q, k, v, doc_id, q_count, q_index, do, lse, delta, dk, dv,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dk),
        *_strides3(dv), doc_id.stride(0),
        L, q_count.shape[-1], q_index.shape[-1], Hkv, H // Hkv, scale * LOG2E, scale,
        HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), **launch_opts(t),
    )  # fmt: skip
    return dk, dv


def _bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_id: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_count, kv_index, q_count, q_index = table
    do = _last_dim_contiguous(do)
    delta = _bwd_preprocess(out, do, block_size)
    dq = _bwd_dq(q, k, v, doc_id, kv_count, kv_index, do, lse, delta, block_size, scale)
    dk, dv = _bwd_dkdv(q, k, v, doc_id, q_count, q_index, do, lse, delta, block_size, scale)
    return dq, dk, dv


class BlockSparseAttnFn(torch.autograd.Function):
    """Thin autograd wrapper: kernels do the work, this only saves and routes tensors."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_id: torch.Tensor,
        kv_count: torch.Tensor,
        kv_index: torch.Tensor,
        q_count: torch.Tensor,
        q_index: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        out, lse = _fwd(q, k, v, doc_id, kv_count, kv_index, block_size, scale)
        ctx.save_for_backward(q, k, v, out, lse, doc_id, kv_count, kv_index, q_count, q_index)
        ctx.block_size = block_size
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, out, lse, doc_id, *table = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, out, lse, doc_id, tuple(table), ctx.block_size, ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None


def _prepare_table(
    table: BlockTable, batch: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32, contiguous; shapes checked on metadata only (no device sync), since a wrong
    shape would make the kernels read out of bounds. Contents are trusted."""
    kv_count, kv_index, q_count, q_index = (
        getattr(table, name).to(torch.int32).contiguous()
        for name in ("kv_count", "kv_index", "q_count", "q_index")
    )
    head = (batch, kv_heads, kv_count.shape[-1])
    ok = tuple(kv_count.shape) == head and tuple(q_count.shape) == head
    ok = ok and tuple(kv_index.shape[:3]) == head and tuple(q_index.shape[:3]) == head
    if not ok or kv_index.dim() != 4 or q_index.dim() != 4:
        shapes = [tuple(t.shape) for t in (kv_count, kv_index, q_count, q_index)]
        raise ValueError(f"block table shapes {shapes} do not match [B, Hkv, NB(, MAX)] = {head}")
    return kv_count, kv_index, q_count, q_index


def _prepare(q, k, v, doc_id, table: BlockTable, scale: float | None):
    """Checked, kernel-ready operands: last dims contiguous, int32 tables and doc ids."""
    _check_inputs(q, k, v, doc_id)
    tensors = _prepare_table(table, q.shape[0], k.shape[1])
    block_size = table_block_size(table, q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return q, k, v, doc_id.to(torch.int32).contiguous(), tensors, block_size, scale


def block_sparse_forward_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel alone: (out like q, lse [B, Hq, L] fp32), for callers that own the
    autograd (the recipe's custom ops)."""
    q, k, v, doc_id, tensors, block_size, scale = _prepare(q, k, v, doc_id, table, scale)
    return _fwd(q, k, v, doc_id, tensors[0], tensors[1], block_size, scale)


def block_sparse_backward_triton(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernels alone: (dq, dk, dv) from the forward's out and lse."""
    q, k, v, doc_id, tensors, block_size, scale = _prepare(q, k, v, doc_id, table, scale)
    return _bwd(do, q, k, v, out, lse, doc_id, tensors, block_size, scale)


def block_sparse_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-sparse causal document attention on the GPU (or TRITON_INTERPRET=1).

    q [B, Hq, L, D], k/v [B, Hkv, L, D] (any strides; last dim made contiguous), doc_id
    [B, L]; table: kv_count/kv_index and their transpose q_count/q_index, block size
    inferred from NB = ceil(L / Bs). Returns out [B, Hq, L, D] in q's dtype.
    """
    q, k, v, doc_id, tensors, block_size, scale = _prepare(q, k, v, doc_id, table, scale)
    return BlockSparseAttnFn.apply(q, k, v, doc_id, *tensors, block_size, scale)


# --------------------------------------------------------------------------- reference


def table_token_mask(doc_id: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """[B, Hkv, L, L] bool: the kv table's block pairs AND the causal document mask."""
    kv_count, kv_index = table.kv_count, table.kv_index
    B, Hkv, NB = kv_count.shape
    L = doc_id.shape[1]
    bs = table_block_size(table, L)
    slots = torch.arange(kv_index.shape[-1], device=kv_count.device)
    live = slots < kv_count[..., None].long()
    blocks = torch.zeros(B, Hkv, NB, NB + 1, dtype=torch.bool, device=kv_count.device)
    idx = torch.where(live, kv_index.long(), NB)  # dead slots land in the spare column
    blocks.scatter_(-1, idx, True)
    blocks = blocks[..., :NB]
    tok = blocks.repeat_interleave(bs, dim=2).repeat_interleave(bs, dim=3)[..., :L, :L]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_id.device).tril()
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]
    return tok & (causal & same_doc)[:, None]


def block_sparse_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Explicit masked softmax from the kv table (reads only kv_count/kv_index).

    Differentiable; rows with no allowed key give 0. Returns q's dtype.
    """
    _check_inputs(q, k, v, doc_id)
    G = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mask = table_token_mask(doc_id, table).repeat_interleave(G, dim=1)
    has_key = mask.any(dim=-1, keepdim=True)
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc, vc = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)
    s = (qc @ kc.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key  # rows without a key give 0, not NaN
    return (p @ vc).to(q.dtype)
