"""Block-sparse attention backward, dK/dV, and the work plan that balances it.

One program per (work item, key tile) loops over the G q heads and over a range of the
key block's query blocks (the transposed table), so the GQA sum happens in registers.
Key blocks kept by many query blocks (every document's first block is kept by all its
query blocks) are split into items of similar work (`plan_dkdv`), launched heaviest
first; split blocks write fp32 partials that `_dkdv_reduce_kernel` sums in a fixed
order, so the backward stays deterministic and atomic-free. Its reference is
attn_bwd_dkdv_naive.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attn_common import SCAN, Prepared, col_docs, col_keep, iter_bounds, strides3
from .attn_tiles import REDUCE_TILE, attn_tiles, bounds_mask, tile_table
from .common import LOG2E, dot_in_fp32, launch_opts


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
    BOUNDS_MASK: tl.constexpr,
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
    end_base = DOC_END + b64 * stride_db
    col_doc = col_docs(doc_base, end_base, offs_n, col_ok, BOUNDS_MASK)
    first_doc_end = tl.load(end_base + tl.minimum(start_n, seq_len - 1))
    last_doc_end = tl.load(end_base + tl.minimum(start_n + BLOCK_N, seq_len) - 1)
    idx_base = Q_INDEX + lo
    # dead prefix: query sub-tiles ending before this key tile; dead suffix: those
    # starting past the end of the key tile's last document
    it_lo, it_hi = iter_bounds(
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
                keep = col_keep(doc_base, rows, row_ok, offs_n, col_doc, BOUNDS_MASK)
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


# --------------------------------------------------------------------------- work plan


class DkdvPlan(NamedTuple):
    """dK/dV work items, heaviest first, and the split key blocks they reduce into."""

    items: torch.Tensor  # [n, 4] int64: (flat key block, q_index lo, hi, partial slot | -1)
    splits: torch.Tensor  # [S, 3] int64: (flat key block, first partial slot, partials)
    num_partials: int
    cap: int  # query blocks per item at most


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


def attn_bwd_dkdv(p: Prepared, do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """dK, dV over the transposed table (key block -> the query blocks that kept it),
    cut into balanced work items (`plan_dkdv`)."""
    q, k, v = p.q, p.k, p.v
    B, H, L, D = q.shape
    Hkv, bs, nb = k.shape[1], p.block_size, p.q_ptr.shape[-1] - 1
    table = tile_table(q.device)
    t = attn_tiles(q.dtype, D, bs, table).dkdv
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    plan = plan_dkdv(p.q_ptr, p.q_index.numel())
    parts = [torch.empty((max(plan.num_partials, 1), bs, D), device=q.device, dtype=torch.float32)]
    parts.append(torch.empty_like(parts[0]))
    dk_strides, dv_strides = strides3(dk), strides3(dv)
    _bwd_dkdv_kernel[(plan.items.shape[0] * (bs // t.block_n),)](
        q, k, v, p.doc_id, p.doc_end, p.q_index, plan.items, do, lse, delta, dk, dv, *parts,
        *strides3(q), *strides3(k), *strides3(v), *strides3(do), *dk_strides,
        *dv_strides, p.doc_id.stride(0),
        L, nb, Hkv, H // Hkv, p.scale * LOG2E, p.scale,
        HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        DOT_F32=dot_in_fp32(q.dtype), SCAN=SCAN,
        BOUNDS_MASK=bounds_mask(table, "dkdv", D, bs), **launch_opts(t),
    )  # fmt: skip
    if plan.splits.shape[0]:
        _dkdv_reduce_kernel[(plan.splits.shape[0] * (bs // t.block_n),)](
            *parts, plan.splits, dk, dv, *dk_strides, *dv_strides, L, nb, Hkv, p.scale,
            HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_N=t.block_n, **launch_opts(REDUCE_TILE),
        )  # fmt: skip
    return dk, dv
