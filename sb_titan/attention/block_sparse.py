"""Block-sparse attention in plain PyTorch (CPU reference path; also runs on CUDA).

Work is linear in the kept block pairs. Rows of the block table (one per (b, kv head,
query block)) are grouped by their kept count c; a group gathers its c key blocks into
one [n, c*Bs, D] tensor and runs one batched matmul for all G query heads of the kv
head at once ([n, G*Bs, D] x [n, D, c*Bs]). A group normally holds complete softmax
rows, so the forward needs no online rescaling (rows longer than the chunk limit are
cut into slices and merged flash-style). Like flash attention the forward returns out
and the log-sum-exp (lse), and the backward recomputes probabilities from the lse:
  - dQ over rows of the kv table (query block -> its kept key blocks);
  - dK, dV over rows of the transposed table (key block -> the query blocks that kept
    it), batched the same way.
Every gradient block is written exactly once, so nothing is scattered: deterministic,
and no `index_add_` (whose multi-threaded CPU path is slow). The price is recomputing
the scores twice in the backward, 9 matmuls per pair in all instead of 7.

CPU details that matter for speed (measured, see docs/attention.md):
  - scores are kept in base 2 (q is pre-scaled by scale * log2(e)) because exp2 is ~3x
    faster than exp on CPU;
  - chunks of `_CHUNK_ELEMS` score elements per thread reuse preallocated buffers via
    `out=`: fresh multi-MB allocations page-fault and cost more than the math;
  - masks are only added where needed. Inside a pair (query block i, key block j < i)
    the document-causal mask is separable: query token t sees key s iff t is in
    first_doc(i) (a row mask, only non-trivial when a document starts inside block i)
    and s >= doc_start(first_doc(i)) (a column mask, only non-trivial on the sink
    block). Only the diagonal pair needs a full [Bs, Bs] mask, precomputed per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sb_titan.attention.estimator import num_blocks, token_doc_start
from sb_titan.attention.selection import BlockTable

_CHUNK_ELEMS = 1 << 18  # score elements per chunk and CPU thread (1 MiB fp32, fits L2)
_LOG2E = 1.0 / math.log(2.0)


class _Masks(NamedTuple):
    """Per-block mask pieces of one batch (all O(L * Bs) or smaller)."""

    diag: torch.Tensor  # [B*NB, Bs, Bs] 0/-inf bias of the diagonal pair (query, key)
    row: torch.Tensor  # [B*NB, Bs] 0/-inf: query token is in first_doc(block)
    mixed: torch.Tensor  # [B*NB] bool: a document starts strictly inside the block
    first_start: torch.Tensor  # [B*NB] int64: doc start of the block's first token


def _masks(doc_id: torch.Tensor, nb: int, bs: int, dtype: torch.dtype) -> _Masks:
    B, L = doc_id.shape
    lo = token_doc_start(doc_id)
    if nb * bs > L:  # pad tokens join the row's last document (their output is dropped)
        lo = torch.cat([lo, lo[:, -1:].expand(B, nb * bs - L)], dim=1)
    lo = lo.view(B * nb, bs)
    first = lo[:, 0]
    ar = torch.arange(bs, device=doc_id.device)
    pos = torch.arange(B * nb, device=doc_id.device)[:, None] % nb * bs + ar  # token pos
    ok_diag = (ar[None, None, :] <= ar[None, :, None]) & (pos[:, None, :] >= lo[:, :, None])
    in_first = lo == first[:, None]
    return _Masks(_bias(ok_diag, dtype), _bias(in_first, dtype), ~in_first.all(1), first)


def _bias(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, -math.inf)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (tests); everything else computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_blocks(x: torch.Tensor, bs: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, L, D] -> [B*H*NB, Bs, D], zero padded, contiguous, in `dtype` (one copy)."""
    B, H, L, D = x.shape
    nb = num_blocks(L, bs)
    out = torch.empty(B * H * nb, bs, D, dtype=dtype, device=x.device)
    tok = out.view(B, H, nb * bs, D)
    tok[:, :, :L].copy_(x)
    tok[:, :, L:].zero_()
    return out


def _q_views(tok: torch.Tensor, blk: torch.Tensor, hkv: int, bs: int):
    """Matching views of tok [B, Hq, L, E] and blk [B*Hkv*NB, G, Bs, E]: full blocks, tail."""
    B, Hq, L, E = tok.shape
    G, nfull, rem = Hq // hkv, L // bs, L % bs
    blk6 = blk.view(B, hkv, -1, G, bs, E).permute(0, 1, 3, 2, 4, 5)  # [B, Hkv, G, NB, Bs, E]
    tok5 = tok.unflatten(1, (hkv, G))
    views = [(tok5[:, :, :, : nfull * bs].unflatten(3, (nfull, bs)), blk6[:, :, :, :nfull])]
    if rem:
        views.append((tok5[:, :, :, nfull * bs :], blk6[:, :, :, nfull, :rem]))
    return views


def _to_q_blocks(
    x: torch.Tensor, hkv: int, bs: int, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """scale * x, [B, Hq, L, E] -> [B*Hkv*NB, G, Bs, E]: a row holds a GQA group's block."""
    B, Hq, L, E = x.shape
    nb = num_blocks(L, bs)
    out = torch.empty(B * hkv * nb, Hq // hkv, bs, E, dtype=dtype, device=x.device)
    if L % bs:
        out[nb - 1 :: nb].zero_()
    for src, dst in _q_views(x, out, hkv, bs):
        dst.copy_(src)
    return out.mul_(scale) if scale != 1.0 else out


def _from_q_blocks(x: torch.Tensor, shape, hkv: int, dtype: torch.dtype, scale: float = 1.0):
    """Inverse of _to_q_blocks into a new [B, Hq, L, E] = `shape` tensor of `dtype`."""
    out = torch.empty(shape, dtype=dtype, device=x.device)
    for dst, src in _q_views(out, x, hkv, x.shape[2]):
        torch.mul(src, scale, out=dst) if scale != 1.0 else dst.copy_(src)
    return out


def _chunk_pairs(per_pair: int, device: torch.device) -> int:
    """Block pairs per batched matmul: _CHUNK_ELEMS scores per CPU thread (so each
    thread's share stays cache-sized while Python overhead shrinks as threads are added);
    much larger on GPUs, where the per-chunk launch and sync overhead dominates."""
    threads = torch.get_num_threads() if device.type == "cpu" else 64
    return max(1, _CHUNK_ELEMS * threads // per_pair)


def _plan(count: torch.Tensor, width: int) -> list[tuple[int, torch.Tensor]]:
    """(c, flat row ids) for rows with equal count c, at most `width` pairs per chunk.

    Rows whose c alone exceeds `width` come one at a time and are split along their
    kept list (`_slices`), so every score buffer stays within the limit.
    """
    flat = count.flatten()
    order = torch.argsort(flat, stable=True)
    values, sizes = torch.unique_consecutive(flat[order], return_counts=True)
    plan = []
    for c, rows in zip(values.tolist(), order.split(sizes.tolist()), strict=True):
        if c > 0:
            plan.extend((c, r) for r in rows.split(max(1, width // c)))
    return plan


def _slices(c: int, width: int) -> list[tuple[int, int]]:
    """Slot ranges [s0, s1) of a kept list of length c, each at most `width` long."""
    return [(s0, min(c, s0 + width)) for s0 in range(0, c, width)]


class _Buffers:
    """Flat scratch tensors reused across chunks (views are handed out with `out=`).

    sizes[k] = (elements per row, elements per kept pair in one slice) of buffer k.
    """

    def __init__(self, plan, width: int, sizes, dtype: torch.dtype, device: torch.device):
        self.flat = [
            torch.empty(
                max((len(r) * (row + min(c, width) * pair) for c, r in plan), default=0),
                dtype=dtype,
                device=device,
            )
            for row, pair in sizes
        ]

    def __call__(self, k: int, *shape: int) -> torch.Tensor:
        return self.flat[k][: math.prod(shape)].view(shape)


def _gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """src[index] for a flat row index, written into `out` (shape [*index.shape, ...])."""
    flat = out.view(index.numel(), *src.shape[1:])
    torch.index_select(src, 0, index.flatten(), out=flat)
    return out


def _mask_kv_chunk(s, bi: torch.Tensor, idx: torch.Tensor, masks: _Masks, bs: int, diag: bool):
    """Add the document-causal mask to scores s [n, G*Bs, c*Bs] of query blocks bi [n]
    against key blocks idx [n, c] (ascending; if `diag`, the last one is the diagonal)."""
    n, c = idx.shape
    s5 = s.view(n, -1, bs, c, bs)  # [n, G, Bs_q, c, Bs_k]
    off = c - 1 if diag else c  # off-diagonal slots are [0, off)
    if diag:
        s5[:, :, :, off].add_(masks.diag[bi][:, None])
    if off == 0:
        return
    if bool(masks.mixed[bi].any()):
        s5[:, :, :, :off].add_(masks.row[bi][:, None, :, None, None])
    start = masks.first_start[bi][:, None]
    cut = start > idx[:, :off] * bs  # key block starts before first_doc(i)
    if bool(cut[:, 1:].any()):  # only tables not made by select_blocks get here
        kpos = idx[:, :off, None] * bs + torch.arange(bs, device=s.device)
        s5[:, :, :, :off].add_(_bias(kpos >= start[:, :, None], s.dtype)[:, None, None])
    elif bool(cut[:, 0].any()):  # sink block of a document that starts mid-block
        kpos = idx[:, :1] * bs + torch.arange(bs, device=s.device)
        s5[:, :, :, 0].add_(_bias(kpos >= start, s.dtype)[:, None, None])


def _mask_q_chunk(
    s, bj: torch.Tensor, j: torch.Tensor, bi: torch.Tensor, masks: _Masks, bs: int, diag: bool
):
    """Add the mask to scores s [n, c*G*Bs_q, Bs_k] of query blocks bi [n, c] (ascending;
    if `diag`, the first one is the diagonal) against key blocks bj [n] (j within the row)."""
    n, c = bi.shape
    s5 = s.view(n, c, -1, bs, bs)  # [n, c, G, Bs_q, Bs_k]
    first = 1 if diag else 0  # off-diagonal slots are [first, c)
    if diag:
        s5[:, 0].add_(masks.diag[bj][:, None])
    if first == c:
        return
    off = bi[:, first:]
    if bool(masks.mixed[off].any()):
        s5[:, first:].add_(masks.row[off][:, :, None, :, None])
    start = masks.first_start[off]  # [n, c - first]
    if bool((start > j[:, None] * bs).any()):
        kpos = j[:, None, None] * bs + torch.arange(bs, device=s.device)  # [n, 1, Bs_k]
        s5[:, first:].add_(_bias(kpos >= start[:, :, None], s.dtype)[:, :, None, None])


def check_table(table: BlockTable, batch: int, num_kv_heads: int, seq_len: int) -> None:
    """Raise ValueError unless `table` fits the shapes and keeps every diagonal block.

    The kernels rely on each query block's kept list being ascending and ending with its
    own block (select_blocks always keeps the diagonal); pairs below the document's
    start are allowed and simply masked out.
    """
    nb = num_blocks(seq_len, table.block_size)
    want = (batch, num_kv_heads, nb)
    for name in ("kv_count", "q_count"):
        if tuple(getattr(table, name).shape) != want:
            raise ValueError(
                f"table.{name} must be {want}, got {tuple(getattr(table, name).shape)}"
            )
    count, index = table.kv_count.long(), table.kv_index.long()
    if count.numel() == 0:
        return
    if index.dim() != 4 or index.shape[:3] != want or int(count.max()) > index.shape[-1]:
        raise ValueError(f"table.kv_index {tuple(index.shape)} does not fit kv_count {want}")
    if int(count.min()) < 1:
        raise ValueError("every query block must keep at least its diagonal block")
    last = torch.gather(index, -1, (count - 1)[..., None])[..., 0]
    slot = torch.arange(index.shape[-1], device=index.device)
    rising = (index[..., 1:] > index[..., :-1]) | (slot[1:] >= count[..., None])
    blocks = torch.arange(nb, device=index.device)
    if not bool((last == blocks).all() and rising.all()):
        raise ValueError("kv_index rows must be ascending and end with the diagonal block")
    q_count, q_index = table.q_count.long(), table.q_index.long()
    if int(q_count.sum()) != int(count.sum()) or not bool((q_index[..., 0] == blocks).all()):
        raise ValueError("q_count/q_index are not the transpose of kv_count/kv_index")


def _blocks_of(rows: torch.Tensor, nb: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (b, h, i) row -> (row base b*Hkv*NB + h*NB, flat (b, i) block id)."""
    i = rows % nb
    return rows - i, rows // (hkv * nb) * nb + i


def block_sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, L, D] in q.dtype, lse [B, Hq, L] natural log; fp32, fp64 for fp64)."""
    B, Hq, L, D = q.shape
    hkv, bs = k.shape[1], table.block_size
    nb, G = num_blocks(L, bs), Hq // hkv
    check_table(table, B, hkv, L)
    wd = _work_dtype(q.dtype)
    qblk = _to_q_blocks(q, hkv, bs, wd, scale * _LOG2E)  # [R, G, Bs, D], R = B*Hkv*NB
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)  # [R, Bs, D]
    masks = _masks(doc_id, nb, bs, wd)
    out = torch.empty_like(qblk)
    lse = torch.empty(*qblk.shape[:3], 1, dtype=wd, device=q.device)  # base 2
    kv_index = table.kv_index.long().flatten(0, 2)
    gbb, gbd, bd, gb = G * bs * bs, G * bs * D, bs * D, G * bs
    width = _chunk_pairs(gbb, q.device)
    plan = _plan(table.kv_count, width)
    sizes = [(0, gbb), (0, bd), (0, bd), (gbd, 0), (gbd, 0), (gbd, 0), (gb, 0), (gb, 0), (gb, 0)]
    buf = _Buffers(plan, width, sizes, wd, q.device)
    for c, rows in plan:
        n = len(rows)
        base, bi = _blocks_of(rows, nb, hkv)
        qb = _gather(qblk, rows, buf(3, n, gb, D))
        o, m, denom = buf(4, n, gb, D), buf(6, n, gb, 1), buf(7, n, gb, 1)
        slices = _slices(c, width)  # one slice unless a row alone is too long
        for s0, s1 in slices:
            idx = kv_index[rows, s0:s1]
            krows = base[:, None] + idx
            w = s1 - s0
            kb = _gather(kblk, krows, buf(1, n, w * bs, D))
            vb = _gather(vblk, krows, buf(2, n, w * bs, D))
            s = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, gb, w * bs))
            _mask_kv_chunk(s, bi, idx, masks, bs, diag=s1 == c)
            if len(slices) == 1:
                torch.amax(s, dim=-1, keepdim=True, out=m)
                p = s.sub_(m).exp2_()
                torch.sum(p, dim=-1, keepdim=True, out=denom)
                torch.bmm(p, vb, out=o)
                continue
            # Online softmax across slices, as in flash attention. A row may see nothing
            # in the first slices (m = -inf); it is stabilised with 0 until it does.
            m_new = s.amax(dim=-1, keepdim=True)
            if s0 > 0:
                m_new = torch.maximum(m, m_new)
            m_use = m_new.nan_to_num(neginf=0.0)
            p = s.sub_(m_use).exp2_()
            if s0 == 0:
                torch.sum(p, dim=-1, keepdim=True, out=denom)
                torch.bmm(p, vb, out=o)
            else:
                alpha = (m - m_use).exp2_()
                denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                o.mul_(alpha).add_(torch.bmm(p, vb, out=buf(5, n, gb, D)))
            m.copy_(m_new)
        out.index_copy_(0, rows, o.div_(denom).view(n, G, bs, D))
        lse.index_copy_(0, rows, m.add_(denom.log2_()).view(n, G, bs, 1))
    lse = _from_q_blocks(lse, (B, Hq, L, 1), hkv, wd, math.log(2.0))[..., 0]
    return _from_q_blocks(out, q.shape, hkv, q.dtype), lse


@dataclass
class _BackwardBlocks:
    """The backward's operands, cut into blocks once and shared by dQ and dK/dV."""

    qblk: torch.Tensor  # [R, G, Bs, D] q * scale * log2(e)
    doblk: torch.Tensor  # [R, G, Bs, D]
    kblk: torch.Tensor  # [R, Bs, D]
    vblk: torch.Tensor
    deltablk: torch.Tensor  # [R, G, Bs, 1] rowsum(dO * O)
    lseblk: torch.Tensor  # [R, G, Bs, 1] base 2
    masks: Any
    nb: int
    hkv: int
    bs: int
    G: int
    D: int
    width: int


def block_sparse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the saved out and lse; recomputes probabilities per block pair.

    dQ over rows of the kv table, dK/dV over rows of the transposed table: every
    gradient block is written exactly once, so nothing is scattered or accumulated
    across chunks (no index_add_, whose multi-threaded CPU path is very slow).
    """
    B, Hq, L, D = q.shape
    hkv, bs = k.shape[1], table.block_size
    nb, G = num_blocks(L, bs), Hq // hkv
    wd = _work_dtype(q.dtype)
    delta = torch.linalg.vecdot(grad_out.to(wd), out.to(wd))[..., None]  # rowsum(dO * O)
    blocks = _BackwardBlocks(
        qblk=_to_q_blocks(q, hkv, bs, wd, scale * _LOG2E),
        doblk=_to_q_blocks(grad_out, hkv, bs, wd),
        kblk=_to_blocks(k, bs, wd),
        vblk=_to_blocks(v, bs, wd),
        deltablk=_to_q_blocks(delta, hkv, bs, wd),
        lseblk=_to_q_blocks(lse[..., None], hkv, bs, wd, _LOG2E),
        masks=_masks(doc_id, nb, bs, wd),
        nb=nb,
        hkv=hkv,
        bs=bs,
        G=G,
        D=D,
        width=_chunk_pairs(G * bs * bs, q.device),
    )
    dq = _from_q_blocks(_backward_dq(blocks, table, wd, q.device), q.shape, hkv, q.dtype, scale)
    dk, dv = _backward_dkdv(blocks, table, wd, q.device)
    # qblk carries scale * log2(e), so dk picks up a factor log2(e) too much.
    dk = dk.mul_(math.log(2.0)).view(B, hkv, nb * bs, D)[:, :, :L]
    return dq, dk.to(k.dtype), dv.view(B, hkv, nb * bs, D)[:, :, :L].to(v.dtype)


def _backward_dq(x: _BackwardBlocks, table: BlockTable, wd, device) -> torch.Tensor:
    """dQ over rows of the kv table (query block -> kept key blocks)."""
    nb, hkv, bs, G, D, width = x.nb, x.hkv, x.bs, x.G, x.D, x.width
    gbb, gbd, bd, gb = G * bs * bs, G * bs * D, bs * D, G * bs
    dq = torch.empty_like(x.qblk)
    kv_index = table.kv_index.long().flatten(0, 2)
    plan = _plan(table.kv_count, width)
    sizes = [(0, gbb), (0, gbb), (0, bd), (0, bd), (gbd, 0), (gbd, 0), (gb, 0), (gb, 0)]
    sizes += [(gbd, 0), (gbd, 0)]
    buf = _Buffers(plan, width, sizes, wd, device)
    for c, rows in plan:
        n = len(rows)
        base, bi = _blocks_of(rows, nb, hkv)
        qb = _gather(x.qblk, rows, buf(4, n, gb, D))
        dob = _gather(x.doblk, rows, buf(5, n, gb, D))
        lse_r = _gather(x.lseblk, rows, buf(6, n, gb, 1))
        delta_r = _gather(x.deltablk, rows, buf(7, n, gb, 1))
        dq_r = buf(8, n, gb, D)
        for s0, s1 in _slices(c, width):
            idx = kv_index[rows, s0:s1]
            krows = base[:, None] + idx
            w = s1 - s0
            kb = _gather(x.kblk, krows, buf(2, n, w * bs, D))
            vb = _gather(x.vblk, krows, buf(3, n, w * bs, D))
            p = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, gb, w * bs))
            _mask_kv_chunk(p, bi, idx, x.masks, bs, diag=s1 == c)
            p.sub_(lse_r).exp2_()
            ds = torch.bmm(dob, vb.transpose(1, 2), out=buf(1, n, gb, w * bs))
            ds.sub_(delta_r).mul_(p)
            if s0 == 0:
                torch.bmm(ds, kb, out=dq_r)
            else:
                dq_r.add_(torch.bmm(ds, kb, out=buf(9, n, gb, D)))
        dq.index_copy_(0, rows, dq_r.view(n, G, bs, D))
    return dq


def _backward_dkdv(
    x: _BackwardBlocks, table: BlockTable, wd, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV over rows of the transposed table (key block -> query blocks that kept it)."""
    nb, hkv, bs, G, D, width = x.nb, x.hkv, x.bs, x.G, x.D, x.width
    gbb, gbd, bd, gb = G * bs * bs, G * bs * D, bs * D, G * bs
    dk, dv = torch.empty_like(x.kblk), torch.empty_like(x.vblk)
    q_index = table.q_index.long().flatten(0, 2)
    plan = _plan(table.q_count, width)
    sizes = [(0, gbb), (0, gbb), (0, gbd), (0, gbd), (bd, 0), (bd, 0), (0, gb), (0, gb)]
    sizes += [(bd, 0), (bd, 0), (bd, 0)]
    buf = _Buffers(plan, width, sizes, wd, device)
    for c, rows in plan:
        n = len(rows)
        base, bj = _blocks_of(rows, nb, hkv)
        j = rows - base
        kb = _gather(x.kblk, rows, buf(4, n, bs, D))
        vb = _gather(x.vblk, rows, buf(5, n, bs, D))
        dk_r, dv_r = buf(8, n, bs, D), buf(9, n, bs, D)
        for s0, s1 in _slices(c, width):
            idx = q_index[rows, s0:s1]  # ascending; q_index[:, 0] == j (the diagonal)
            qrows = base[:, None] + idx
            w = s1 - s0
            qg = _gather(x.qblk, qrows, buf(2, n, w * gb, D))
            dog = _gather(x.doblk, qrows, buf(3, n, w * gb, D))
            p = torch.bmm(qg, kb.transpose(1, 2), out=buf(0, n, w * gb, bs))
            _mask_q_chunk(p, bj, j, bj[:, None] - j[:, None] + idx, x.masks, bs, diag=s0 == 0)
            p.sub_(_gather(x.lseblk, qrows, buf(6, n, w * gb, 1))).exp2_()
            ds = torch.bmm(dog, vb.transpose(1, 2), out=buf(1, n, w * gb, bs))
            ds.sub_(_gather(x.deltablk, qrows, buf(7, n, w * gb, 1))).mul_(p)
            if s0 == 0:
                torch.bmm(p.transpose(1, 2), dog, out=dv_r)
                torch.bmm(ds.transpose(1, 2), qg, out=dk_r)
            else:
                dv_r.add_(torch.bmm(p.transpose(1, 2), dog, out=buf(10, n, bs, D)))
                dk_r.add_(torch.bmm(ds.transpose(1, 2), qg, out=buf(10, n, bs, D)))
        dv.index_copy_(0, rows, dv_r)
        dk.index_copy_(0, rows, dk_r)
    return dk, dv
