"""Block-sparse flash attention (forward + backward) over a compressed block table.

Layout: q [B, Hq, L, D], k/v [B, Hkv, L, D], doc_id [B, L] int32, Hq = G * Hkv. The table
(CSR: kv_ptr/kv_index and the transpose q_ptr/q_index) says which key blocks of size Bs
each query block computes, per kv head; inside a computed pair the token mask is
`key pos <= query pos and doc_id[key] == doc_id[query]`.

Kernels (fp32 accumulation, exp2 softmax):
- forward: per (q head, query tile), loop over the query block's kept key blocks;
  writes out and the log2-domain log-sum-exp. Heaviest query blocks first, the G q heads
  of a kv head adjacent in launch order (they share K/V tiles through L2).
- backward preprocess: delta = rowsum(dO * O).
- dQ: same walk and order as forward.
- dK/dV: per (work item, key tile), loop over the G q heads and over a range of the key
  block's query blocks (transposed table). Key blocks kept by many query blocks (every
  document's first block is kept by all its query blocks) are split into items of
  similar work (`plan_dkdv`), heaviest first; split blocks sum their fp32 partials in
  `_dkdv_reduce_kernel` in a fixed order, so the backward stays deterministic and
  atomic-free. The GQA sum over the G heads happens in registers.
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
#: the dK/dV partial sum: a streaming add over BLOCK_N x D tiles (BLOCK_N is dK/dV's)
REDUCE_TILE = Tile(0, 0, 8, 1)
_BY_SHAPE: dict[tuple[int, int], AttnTiles] = {
    (64, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 3), dkdv=Tile(64, 32, 4, 3)
    ),
    (64, 128): AttnTiles(
        fwd=Tile(128, 128, 8, 3), preprocess=_PRE, dq=Tile(128, 64, 8, 3), dkdv=Tile(32, 128, 8, 3)
    ),
    (128, 64): AttnTiles(
        fwd=Tile(64, 64, 4, 3), preprocess=_PRE, dq=Tile(64, 64, 4, 3), dkdv=Tile(64, 32, 8, 3)
    ),
    (128, 128): AttnTiles(
        fwd=Tile(128, 64, 8, 3), preprocess=_PRE, dq=Tile(128, 32, 8, 3), dkdv=Tile(64, 32, 8, 3)
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
    """CSR block table (sb_titan.attention.selection.BlockTable): offsets are global over
    the flat index arrays; each row's ids are ascending."""

    kv_ptr: torch.Tensor  # [B, Hkv, NB + 1] int64: query block i's kept keys at [ptr[i], ptr[i+1])
    kv_index: torch.Tensor  # [nnz] int32
    q_ptr: torch.Tensor  # [B, Hkv, NB + 1] int64: the transpose, per key block
    q_index: torch.Tensor  # [nnz] int32


class Prepared(NamedTuple):
    """Kernel-ready operands of one call: checked, contiguous, int32 doc bounds."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    doc_id: torch.Tensor  # [B, L] int32
    doc_start: torch.Tensor  # [B, L] int32: first position of each token's document
    doc_end: torch.Tensor  # [B, L] int32: one past its last position
    kv_ptr: torch.Tensor
    kv_index: torch.Tensor
    q_ptr: torch.Tensor
    q_index: torch.Tensor
    block_size: int
    scale: float


# --------------------------------------------------------------------------- kernels
#
# Work order. Forward and dQ run one program per (q head, query tile), decoded from a
# 1-D grid as (tile order, query sub-tile, q head within its GQA group), fastest last:
# the G heads of one kv head are adjacent in launch order and walk the same kept key
# blocks (the table is per kv head), so each K/V tile is fetched from HBM about once
# per group and then hit in L2. Query blocks run heaviest first (`ORDER`, by kept count).
#
# Masks. Each tile pair is classified with the document bounds of a few positions:
# sub-tiles entirely before the first row's document or entirely after the last row
# are skipped (the iteration range is cut, computed by one vector pass over the kept
# list); interior pairs (keys all <= rows, all in one document) run without the mask;
# only the rest evaluate the causal and document mask.


@triton.jit
def _iter_bounds(
    idx_base, count, dead_before, live_before,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NSUB: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    """Over the kept blocks' sub-tiles (ascending positions, TILE wide): how many end at or
    before `dead_before` (a dead prefix) and how many start before `live_before` (the
    rest is a dead suffix)."""
    it_lo = 0
    it_hi = 0
    for c0 in range(0, count, SCAN):
        offs = c0 + tl.arange(0, SCAN)
        ok = offs < count
        start = tl.load(idx_base + offs, mask=ok, other=0) * BLOCK_SIZE
        dead = tl.minimum(tl.maximum(dead_before - start, 0) // TILE, NSUB)
        live = tl.minimum((tl.maximum(live_before - start, 0) + TILE - 1) // TILE, NSUB)
        it_lo += tl.sum(tl.where(ok, dead, 0))
        it_hi += tl.sum(tl.where(ok, live, 0))
    return it_lo, it_hi


@triton.jit
def _query_tile(
    ORDER, KV_PTR, DOC_START, stride_db, seq_len, num_blocks, num_kv_heads, group,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Decode this program's (b, kv head, q head, first row, table row) and doc bounds."""
    MSUB: tl.constexpr = BLOCK_SIZE // BLOCK_M
    pid = tl.program_id(0)
    g = pid % group
    rest = pid // group
    item = rest // MSUB
    row = tl.load(ORDER + item)  # flat (b, kv head, query block)
    i = row % num_blocks
    bhk = row // num_blocks
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    h = hk * group + g
    start_m = i * BLOCK_SIZE + (rest % MSUB) * BLOCK_M
    last_row = tl.minimum(start_m + BLOCK_M, seq_len) - 1
    doc_base = DOC_START + b.to(tl.int64) * stride_db
    first_doc_start = tl.load(doc_base + tl.minimum(start_m, seq_len - 1))
    last_doc_start = tl.load(doc_base + tl.maximum(last_row, 0))
    ptr = KV_PTR + bhk.to(tl.int64) * (num_blocks + 1) + i
    lo = tl.load(ptr)
    count = (tl.load(ptr + 1) - lo).to(tl.int32)
    return b, hk, h, start_m, last_row, first_doc_start, last_doc_start, lo, count


@triton.jit
def _row_keep(doc_base, cols, col_ok, offs_m, doc_q):
    """[BLOCK_M, BLOCK_N] document-causal mask of query rows x key columns (forward, dQ)."""
    doc_k = tl.load(doc_base + cols, mask=col_ok, other=-2)
    return (cols[None, :] <= offs_m[:, None]) & (doc_k[None, :] == doc_q[:, None]) & col_ok[None, :]


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
):  # fmt: skip
    b, hk, h, start_m, last_row, first_ds, last_ds, lo, count = _query_tile(
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
    doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-1)
    idx_base = KV_INDEX + lo
    it_lo, it_hi = _iter_bounds(
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
            qk = tl.where(_row_keep(doc_base, cols, col_ok, offs_m, doc_q), qk, float("-inf"))
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
):  # fmt: skip
    b, hk, h, start_m, last_row, first_ds, last_ds, lo, count = _query_tile(
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
    doc_q = tl.load(doc_base + offs_m, mask=row_ok, other=-1)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    idx_base = KV_INDEX + lo
    it_lo, it_hi = _iter_bounds(
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
            p = tl.where(_row_keep(doc_base, cols, col_ok, offs_m, doc_q), p, 0.0)
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
def _store_kv_grads(
    DK, DV, dk, dv, b64, hk64, col0, col_ok,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK and dV rows [col0, col0 + BLOCK_N) of one (row, kv head), cast to their dtype."""
    local_n = tl.arange(0, BLOCK_N)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    tl.store(
        DK + b64 * stride_dkb + hk64 * stride_dkh + col0 * stride_dkn + local_n * stride_dkn
        + offs_d, dk.to(DK.dtype.element_ty), mask=col_ok[:, None],
    )  # fmt: skip
    tl.store(
        DV + b64 * stride_dvb + hk64 * stride_dvh + col0 * stride_dvn + local_n * stride_dvn
        + offs_d, dv.to(DV.dtype.element_ty), mask=col_ok[:, None],
    )  # fmt: skip


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DOC, DOC_END, Q_INDEX, ITEMS, DO, LSE, DELTA, DK, DV, DK_PART, DV_PART,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_db,
    seq_len, num_blocks, num_kv_heads, group, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    """One program per (work item, key sub-tile). A work item is a key block and a range
    of its transposed list: heavy key blocks (the sink, kept by every query block of its
    document) are split over several items, which write fp32 partials that
    `_dkdv_reduce_kernel` sums in a fixed order (deterministic)."""
    NSUBN: tl.constexpr = BLOCK_SIZE // BLOCK_N
    NSUB: tl.constexpr = BLOCK_SIZE // BLOCK_M
    DOT_T: tl.constexpr = tl.float32 if DOT_F32 else Q.dtype.element_ty
    PREC: tl.constexpr = "ieee" if DOT_F32 else "tf32"
    pid = tl.program_id(0)
    item = ITEMS + (pid // NSUBN).to(tl.int64) * 4
    tile = tl.load(item)  # flat (b, kv head, key block)
    lo = tl.load(item + 1)
    count = (tl.load(item + 2) - lo).to(tl.int32)
    slot = tl.load(item + 3)  # -1: the only item of its block, writes dK/dV itself
    j = tile % num_blocks
    bhk = tile // num_blocks
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    start_n = (j * BLOCK_SIZE + (pid % NSUBN) * BLOCK_N).to(tl.int32)

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
    end_base = DOC_END + b64 * stride_db
    first_doc_end = tl.load(end_base + tl.minimum(start_n, seq_len - 1))
    last_doc_end = tl.load(end_base + tl.minimum(start_n + BLOCK_N, seq_len) - 1)
    idx_base = Q_INDEX + lo
    # dead prefix: query sub-tiles ending before this key tile; dead suffix: those
    # starting past the end of the key tile's last document
    it_lo, it_hi = _iter_bounds(
        idx_base, count, start_n, last_doc_end, BLOCK_SIZE, BLOCK_M, NSUB, SCAN
    )

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, group):
        h64 = hk64 * group + g
        bh = b64 * num_kv_heads * group + h64
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        for it in range(it_lo, it_hi):
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
            qkt = tl.dot(k, qt, input_precision=PREC) * qk_scale
            pt = tl.exp2(qkt - lse[None, :])
            # interior: keys all <= rows, rows (so keys) all in the first key's document
            needs_mask = (start_n + BLOCK_N > start_m + 1) | (start_m + BLOCK_M > first_doc_end)
            if needs_mask:
                doc_q = tl.load(doc_base + rows, mask=row_ok, other=-1)
                keep = (
                    (offs_n[:, None] <= rows[None, :])
                    & (doc_k[:, None] == doc_q[None, :])
                    & row_ok[None, :]
                )
                pt = tl.where(keep, pt, 0.0)
            dv = tl.dot(pt.to(DOT_T), do, dv, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk = tl.dot(dst.to(DOT_T), tl.trans(qt), dk, input_precision=PREC)

    if slot < 0:
        _store_kv_grads(
            DK, DV, dk * sm_scale, dv, b64, hk64, col0, col_ok,
            stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
            HEAD_DIM, BLOCK_N,
        )  # fmt: skip
    else:
        part = (slot * BLOCK_SIZE + (pid % NSUBN) * BLOCK_N) * HEAD_DIM
        part_ptrs = part + local_n * HEAD_DIM + offs_d[None, :]
        tl.store(DK_PART + part_ptrs, dk)
        tl.store(DV_PART + part_ptrs, dv)


@triton.jit
def _dkdv_reduce_kernel(
    DK_PART, DV_PART, SPLITS, DK, DV,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    seq_len, num_blocks, num_kv_heads, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK/dV of split key blocks: the sum of their items' partials, in item order."""
    NSUBN: tl.constexpr = BLOCK_SIZE // BLOCK_N
    pid = tl.program_id(0)
    split = SPLITS + (pid // NSUBN).to(tl.int64) * 3
    tile = tl.load(split)
    first = tl.load(split + 1)
    n = tl.load(split + 2)
    j = tile % num_blocks
    bhk = tile // num_blocks
    b64 = (bhk // num_kv_heads).to(tl.int64)
    hk64 = (bhk % num_kv_heads).to(tl.int64)
    sub = pid % NSUBN
    start_n = j * BLOCK_SIZE + sub * BLOCK_N
    local_n = tl.arange(0, BLOCK_N)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = (start_n + tl.arange(0, BLOCK_N)) < seq_len
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for p in range(first, first + n):
        part_ptrs = (
            (p * BLOCK_SIZE + sub * BLOCK_N) * HEAD_DIM + local_n * HEAD_DIM + offs_d[None, :]
        )
        dk += tl.load(DK_PART + part_ptrs)
        dv += tl.load(DV_PART + part_ptrs)
    _store_kv_grads(
        DK, DV, dk * sm_scale, dv, b64, hk64, start_n.to(tl.int64), col_ok,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        HEAD_DIM, BLOCK_N,
    )  # fmt: skip


# --------------------------------------------------------------------------- work plans

#: kept-list entries scanned per vector step when cutting a program's iteration range
SCAN = 64


class DkdvPlan(NamedTuple):
    """dK/dV work items, heaviest first, and the split key blocks they reduce into."""

    items: torch.Tensor  # [n, 4] int64: (flat key block, q_index lo, hi, partial slot | -1)
    splits: torch.Tensor  # [S, 3] int64: (flat key block, first partial slot, partials)
    num_partials: int
    cap: int  # query blocks per item at most


def query_order(kv_ptr: torch.Tensor) -> torch.Tensor:
    """[B*Hkv*NB] int32: table rows (b, kv head, query block) by kept count, heaviest
    first (stable), the launch order of the forward and dQ programs."""
    count = kv_ptr.diff(dim=-1).flatten()
    return torch.argsort(count, descending=True, stable=True).to(torch.int32)


def plan_dkdv(q_ptr: torch.Tensor, nnz: int) -> DkdvPlan:
    """Cut the transposed table into work items of at most `cap` query blocks.

    `cap` is the mean number of query blocks per key block, rounded up (a host number:
    nnz is the flat table's length, so no device sync is needed for it). Every key
    block gets ceil(count / cap) items (at least one, so empty blocks still write their
    zero gradient): items then differ by at most cap in work, and the kept pairs bound
    how many there are (<= 2 x the key blocks). One host sync reads the item counts.
    """
    count = q_ptr.diff(dim=-1).flatten()
    tiles = count.numel()
    cap = max(1, -(-nnz // max(tiles, 1)))
    pieces = ((count + cap - 1) // cap).clamp(min=1)
    split = pieces > 1
    split_pieces = torch.where(split, pieces, 0)
    n_items, n_parts, n_split = torch.stack(
        [pieces.sum(), split_pieces.sum(), split.sum()]
    ).tolist()
    dev = q_ptr.device
    tile = torch.repeat_interleave(torch.arange(tiles, device=dev), pieces, output_size=n_items)
    k = torch.arange(n_items, device=dev) - (torch.cumsum(pieces, 0) - pieces)[tile]
    lo = q_ptr[..., :-1].flatten()[tile] + k * cap
    hi = torch.minimum(lo + cap, q_ptr[..., 1:].flatten()[tile])
    first_slot = torch.cumsum(split_pieces, 0) - split_pieces
    slot = torch.where(split[tile], first_slot[tile] + k, -1)
    order = torch.argsort(hi - lo, descending=True, stable=True)
    items = torch.stack([tile, lo, hi, slot], 1)[order].contiguous()
    split_tiles = torch.argsort((~split).to(torch.int8), stable=True)[:n_split]
    splits = torch.stack([split_tiles, first_slot[split_tiles], pieces[split_tiles]], 1)
    return DkdvPlan(items, splits.contiguous(), int(n_parts), cap)


def doc_bounds(doc_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] first position, [B, L] one past the last position) of each token's
    document, int32; doc_id is non-decreasing along each row."""
    B, L = doc_id.shape
    pos = torch.arange(L, device=doc_id.device).expand(B, L)
    starts = torch.ones_like(doc_id, dtype=torch.bool)
    starts[:, 1:] = doc_id[:, 1:] != doc_id[:, :-1]
    start = torch.cummax(torch.where(starts, pos, 0), dim=1).values
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    end = torch.cummin(torch.where(ends, pos + 1, L).flip(1), dim=1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


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
    nb = table.kv_ptr.shape[-1] - 1
    given = getattr(table, "block_size", None)
    candidates = (int(given),) if given is not None else (64, 128)
    for bs in candidates:
        if triton.cdiv(seq_len, bs) == nb:
            return bs
    raise ValueError(f"block size {candidates} does not match L={seq_len} and NB={nb}")


def _fwd(p: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = p.q, p.k
    B, H, L, D = q.shape
    t = attn_tiles(q.dtype, D, p.block_size).fwd
    out = torch.empty_like(q)
    lse = torch.empty((B, H, L), device=q.device, dtype=torch.float32)
    order = query_order(p.kv_ptr)
    grid = (order.numel() * (p.block_size // t.block_m) * (H // k.shape[1]),)
    _fwd_kernel[grid](
        q, k, p.v, p.doc_id, p.doc_start, p.kv_ptr, p.kv_index, order, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(p.v), *_strides3(out), p.doc_id.stride(0),
        L, p.kv_ptr.shape[-1] - 1, k.shape[1], H // k.shape[1], p.scale * LOG2E,
        HEAD_DIM=D, BLOCK_SIZE=p.block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN, **launch_opts(t),
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


def _bwd_dq(p: Prepared, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """dQ over the kv table (query block -> its kept key blocks)."""
    q, k = p.q, p.k
    B, H, L, D = q.shape
    t = attn_tiles(q.dtype, D, p.block_size).dq
    dq = torch.empty_like(q)
    order = query_order(p.kv_ptr)
    grid = (order.numel() * (p.block_size // t.block_m) * (H // k.shape[1]),)
    _bwd_dq_kernel[grid](
        q, k, p.v, p.doc_id, p.doc_start, p.kv_ptr, p.kv_index, order, do, lse, delta, dq,
        *_strides3(q), *_strides3(k), *_strides3(p.v), *_strides3(do), *_strides3(dq),
        p.doc_id.stride(0),
        L, p.kv_ptr.shape[-1] - 1, k.shape[1], H // k.shape[1], p.scale * LOG2E, p.scale,
        HEAD_DIM=D, BLOCK_SIZE=p.block_size, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN, **launch_opts(t),
    )  # fmt: skip
    return dq


def _bwd_dkdv(p: Prepared, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """dK, dV over the transposed table (key block -> the query blocks that kept it),
    cut into balanced work items (`plan_dkdv`)."""
    q, k, v = p.q, p.k, p.v
    B, H, L, D = q.shape
    Hkv, bs, nb = k.shape[1], p.block_size, p.q_ptr.shape[-1] - 1
    t = attn_tiles(q.dtype, D, bs).dkdv
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    plan = plan_dkdv(p.q_ptr, p.q_index.numel())
    parts = [torch.empty((max(plan.num_partials, 1), bs, D), device=q.device, dtype=torch.float32)]
    parts.append(torch.empty_like(parts[0]))
    dk_strides, dv_strides = _strides3(dk), _strides3(dv)
    _bwd_dkdv_kernel[(plan.items.shape[0] * (bs // t.block_n),)](
        q, k, v, p.doc_id, p.doc_end, p.q_index, plan.items, do, lse, delta, dk, dv, *parts,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *dk_strides,
        *dv_strides, p.doc_id.stride(0),
        L, nb, Hkv, H // Hkv, p.scale * LOG2E, p.scale,
        HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN, **launch_opts(t),
    )  # fmt: skip
    if plan.splits.shape[0]:
        _dkdv_reduce_kernel[(plan.splits.shape[0] * (bs // t.block_n),)](
            *parts, plan.splits, dk, dv, *dk_strides, *dv_strides, L, nb, Hkv, p.scale,
            HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_N=t.block_n, **launch_opts(REDUCE_TILE),
        )  # fmt: skip
    return dk, dv


def _bwd(p: Prepared, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    do = _last_dim_contiguous(do)
    delta = _bwd_preprocess(out, do, p.block_size)
    dq = _bwd_dq(p, do, lse, delta)
    dk, dv = _bwd_dkdv(p, do, lse, delta)
    return dq, dk, dv


class BlockSparseAttnFn(torch.autograd.Function):
    """Thin autograd wrapper: kernels do the work, this only saves and routes tensors."""

    @staticmethod
    def forward(ctx, q, k, v, doc_id, table: BlockTable, scale: float | None) -> torch.Tensor:
        p = _prepare(q, k, v, doc_id, table, scale)
        out, lse = _fwd(p)
        ctx.save_for_backward(out, lse, *p[:-2])  # every tensor of the prepared call
        ctx.block_size, ctx.scale = p.block_size, p.scale
        return out

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        out, lse, *tensors = ctx.saved_tensors
        dq, dk, dv = _bwd(Prepared(*tensors, ctx.block_size, ctx.scale), do, out, lse)
        return dq, dk, dv, None, None, None


def _prepare_table(table: BlockTable, batch: int, kv_heads: int, seq_len: int, block_size: int):
    """CSR tensors, contiguous; shapes checked on metadata only (no device sync), since a
    wrong shape would make the kernels read out of bounds. Contents are trusted."""
    kv_ptr, q_ptr = (getattr(table, n).to(torch.int64).contiguous() for n in ("kv_ptr", "q_ptr"))
    kv_index, q_index = (
        getattr(table, n).to(torch.int32).contiguous() for n in ("kv_index", "q_index")
    )
    head = (batch, kv_heads, triton.cdiv(seq_len, block_size) + 1)
    ok = tuple(kv_ptr.shape) == head and tuple(q_ptr.shape) == head
    if not ok or kv_index.dim() != 1 or q_index.shape != kv_index.shape:
        shapes = [tuple(t.shape) for t in (kv_ptr, kv_index, q_ptr, q_index)]
        raise ValueError(f"block table shapes {shapes} do not match ptr {head}, flat [nnz] x2")
    return kv_ptr, kv_index, q_ptr, q_index


def _prepare(q, k, v, doc_id, table: BlockTable, scale: float | None) -> Prepared:
    """Checked, kernel-ready operands: last dims contiguous, int32 doc ids and bounds."""
    _check_inputs(q, k, v, doc_id)
    block_size = table_block_size(table, q.shape[2])
    tensors = _prepare_table(table, q.shape[0], k.shape[1], q.shape[2], block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    doc_id = doc_id.to(torch.int32).contiguous()
    return Prepared(q, k, v, doc_id, *doc_bounds(doc_id), *tensors, block_size, scale)


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
    return _fwd(_prepare(q, k, v, doc_id, table, scale))


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
    return _bwd(_prepare(q, k, v, doc_id, table, scale), do, out, lse)


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
    [B, L]; table: CSR kv_ptr/kv_index and their transpose q_ptr/q_index, block size
    from the table or inferred from NB = ceil(L / Bs). Returns out [B, Hq, L, D] in q's
    dtype.
    """
    return BlockSparseAttnFn.apply(q, k, v, doc_id, table, scale)


# --------------------------------------------------------------------------- reference


def table_token_mask(doc_id: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """[B, Hkv, L, L] bool: the kv table's block pairs AND the causal document mask."""
    kv_ptr, kv_index = table.kv_ptr, table.kv_index
    B, Hkv, NB = kv_ptr.shape[0], kv_ptr.shape[1], kv_ptr.shape[2] - 1
    L = doc_id.shape[1]
    bs = table_block_size(table, L)
    count = kv_ptr.diff(dim=-1).flatten()
    row = torch.repeat_interleave(torch.arange(count.numel(), device=count.device), count)
    blocks = torch.zeros(B * Hkv * NB, NB, dtype=torch.bool, device=kv_ptr.device)
    blocks[row, kv_index.long()] = True
    blocks = blocks.view(B, Hkv, NB, NB)
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
    """Explicit masked softmax from the kv table (reads only kv_ptr/kv_index).

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
