"""Block-sparse attention in plain PyTorch (CPU reference path; also runs on CUDA).

Work is linear in the kept block pairs. Rows of the block table (one per (b, kv head,
query block)) are grouped by their kept count c; a group gathers its c key blocks into
one [n, c*Bs, D] tensor and runs one batched matmul for all G query heads of the kv
head at once ([n, G*Bs, D] x [n, D, c*Bs]). A group holds complete softmax rows, so the
forward needs no online rescaling; like flash attention it returns out and the
log-sum-exp (lse), and the backward recomputes probabilities from the lse.

The backward makes one pass over the kv table: dQ rows are written once, and the
[Bs, D] dK/dV tiles of every pair are summed with `index_add_`. On CPU that scatter is
sequential and deterministic and costs 1/G of the score work, whereas a second pass
over the transposed table (what the Triton kernels do, to avoid atomics) recomputes
two more matmuls per pair: measured 6.7x vs 5.0x over dense at 10% density.

CPU details that matter for speed (measured, see docs/attention.md):
  - scores are kept in base 2 (q is pre-scaled by scale * log2(e)) because exp2 is ~3x
    faster than exp on CPU;
  - chunks of at most `_CHUNK_ELEMS` score elements reuse preallocated buffers via
    `out=`: fresh multi-MB allocations page-fault and cost more than the math;
  - masks are only added where needed. Inside a pair (query block i, key block j < i)
    the document-causal mask is separable: query token t sees key s iff t is in
    first_doc(i) (a row mask, only non-trivial when a document starts inside block i)
    and s >= doc_start(first_doc(i)) (a column mask, only non-trivial on the sink
    block). Only the diagonal pair needs a full [Bs, Bs] mask, precomputed per block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sb_titan.attention.estimator import num_blocks, token_doc_start
from sb_titan.attention.selection import BlockTable

_CHUNK_ELEMS = 1 << 20  # score elements per batched matmul (4 MiB in fp32)
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
        torch.mul(src, scale, out=dst) if scale != 1.0 else dst.copy_(src)
    return out


def _from_q_blocks(x: torch.Tensor, shape, hkv: int, dtype: torch.dtype, scale: float = 1.0):
    """Inverse of _to_q_blocks into a new [B, Hq, L, E] = `shape` tensor of `dtype`."""
    out = torch.empty(shape, dtype=dtype, device=x.device)
    for dst, src in _q_views(out, x, hkv, x.shape[2]):
        torch.mul(src, scale, out=dst) if scale != 1.0 else dst.copy_(src)
    return out


def _plan(count: torch.Tensor, per_pair: int) -> list[tuple[int, torch.Tensor]]:
    """(c, flat row ids) for rows with equal count c, cut to at most _CHUNK_ELEMS."""
    flat = count.flatten()
    order = torch.argsort(flat, stable=True)
    values, sizes = torch.unique_consecutive(flat[order], return_counts=True)
    plan = []
    for c, rows in zip(values.tolist(), order.split(sizes.tolist()), strict=True):
        if c > 0:
            plan.extend((c, r) for r in rows.split(max(1, _CHUNK_ELEMS // (per_pair * c))))
    return plan


class _Buffers:
    """Flat scratch tensors reused across chunks (views are handed out with `out=`).

    sizes[k] = (elements per row, elements per kept pair) of buffer k.
    """

    def __init__(self, plan, sizes, dtype: torch.dtype, device: torch.device):
        self.flat = [
            torch.empty(
                max((len(r) * (row + c * pair) for c, r in plan), default=0),
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


def _mask_kv_chunk(s: torch.Tensor, bi: torch.Tensor, idx: torch.Tensor, masks: _Masks, bs: int):
    """Add the document-causal mask to scores s [n, G*Bs, c*Bs] of query blocks bi [n]
    against key blocks idx [n, c] (ascending, the last one the diagonal)."""
    n, c = idx.shape
    s5 = s.view(n, -1, bs, c, bs)  # [n, G, Bs_q, c, Bs_k]
    s5[:, :, :, c - 1].add_(masks.diag[bi][:, None])
    if c == 1:
        return
    if bool(masks.mixed[bi].any()):
        s5[:, :, :, : c - 1].add_(masks.row[bi][:, None, :, None, None])
    start = masks.first_start[bi][:, None]
    cut = start > idx[:, : c - 1] * bs  # key block starts before first_doc(i)
    if bool(cut[:, 1:].any()):  # only tables not made by select_blocks get here
        kpos = idx[:, : c - 1, None] * bs + torch.arange(bs, device=s.device)
        s5[:, :, :, : c - 1].add_(_bias(kpos >= start[:, :, None], s.dtype)[:, None, None])
    elif bool(cut[:, 0].any()):  # sink block of a document that starts mid-block
        kpos = idx[:, :1] * bs + torch.arange(bs, device=s.device)
        s5[:, :, :, 0].add_(_bias(kpos >= start, s.dtype)[:, None, None])


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
    if not bool((last == torch.arange(nb, device=index.device)).all() and rising.all()):
        raise ValueError("kv_index rows must be ascending and end with the diagonal block")


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
    plan = _plan(table.kv_count, G * bs * bs)
    gbd = G * bs * D
    buf = _Buffers(plan, [(0, G * bs * bs), (0, bs * D), (gbd, 0), (gbd, 0)], wd, q.device)
    for c, rows in plan:
        n = len(rows)
        base, bi = _blocks_of(rows, nb, hkv)
        idx = kv_index[rows, :c]
        krows = base[:, None] + idx
        kb = _gather(kblk, krows, buf(1, n, c * bs, D))
        qb = _gather(qblk, rows, buf(2, n, G * bs, D))
        s = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, G * bs, c * bs))
        _mask_kv_chunk(s, bi, idx, masks, bs)
        m = s.amax(dim=-1, keepdim=True)
        p = s.sub_(m).exp2_()
        denom = p.sum(dim=-1, keepdim=True)
        vb = _gather(vblk, krows, buf(1, n, c * bs, D))
        o = torch.bmm(p, vb, out=buf(3, n, G * bs, D)).div_(denom)
        out.index_copy_(0, rows, o.view(n, G, bs, D))
        lse.index_copy_(0, rows, m.add_(denom.log2_()).view(n, G, bs, 1))
    lse = _from_q_blocks(lse, (B, Hq, L, 1), hkv, wd, math.log(2.0))[..., 0]
    return _from_q_blocks(out, q.shape, hkv, q.dtype), lse


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

    One pass over the kv table; see the module docstring for why dK/dV are summed with
    index_add_ here rather than by a second pass over the transposed table.
    """
    B, Hq, L, D = q.shape
    hkv, bs = k.shape[1], table.block_size
    nb, G = num_blocks(L, bs), Hq // hkv
    wd = _work_dtype(q.dtype)
    qblk = _to_q_blocks(q, hkv, bs, wd, scale * _LOG2E)
    doblk = _to_q_blocks(grad_out, hkv, bs, wd)
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)
    delta = torch.linalg.vecdot(grad_out.to(wd), out.to(wd))[..., None]  # rowsum(dO * O)
    deltablk = _to_q_blocks(delta, hkv, bs, wd)  # [R, G, Bs, 1]
    lseblk = _to_q_blocks(lse[..., None], hkv, bs, wd, _LOG2E)
    masks = _masks(doc_id, nb, bs, wd)
    gbb, gbd, bd = G * bs * bs, G * bs * D, bs * D

    dq = torch.empty_like(qblk)
    dk, dv = torch.zeros_like(kblk), torch.zeros_like(vblk)
    kv_index = table.kv_index.long().flatten(0, 2)
    plan = _plan(table.kv_count, gbb)
    sizes = [(0, gbb), (0, gbb), (0, bd), (0, bd), (gbd, 0), (gbd, 0), (0, bd)]
    buf = _Buffers(plan, sizes, wd, q.device)
    for c, rows in plan:
        n = len(rows)
        base, bi = _blocks_of(rows, nb, hkv)
        idx = kv_index[rows, :c]
        krows = (base[:, None] + idx).flatten()
        kb = _gather(kblk, krows, buf(2, n, c * bs, D))
        vb = _gather(vblk, krows, buf(3, n, c * bs, D))
        qb = _gather(qblk, rows, buf(4, n, G * bs, D))
        dob = _gather(doblk, rows, buf(5, n, G * bs, D))
        p = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, G * bs, c * bs))
        _mask_kv_chunk(p, bi, idx, masks, bs)
        p.sub_(lseblk[rows].view(n, G * bs, 1)).exp2_()
        dp = torch.bmm(dob, vb.transpose(1, 2), out=buf(1, n, G * bs, c * bs))
        dv_pairs = torch.bmm(p.transpose(1, 2), dob, out=buf(6, n, c * bs, D))
        dv.index_add_(0, krows, dv_pairs.view(n * c, bs, D))
        ds = dp.sub_(deltablk[rows].view(n, G * bs, 1)).mul_(p)
        dq_rows = torch.bmm(ds, kb, out=buf(5, n, G * bs, D))  # dob is no longer needed
        dq.index_copy_(0, rows, dq_rows.view(n, G, bs, D))
        dk_pairs = torch.bmm(ds.transpose(1, 2), qb, out=buf(6, n, c * bs, D))
        dk.index_add_(0, krows, dk_pairs.view(n * c, bs, D))

    dq = _from_q_blocks(dq, q.shape, hkv, q.dtype, scale)
    # qblk carries scale * log2(e), so dk picks up a factor log2(e) too much.
    dk = dk.mul_(math.log(2.0)).view(B, hkv, nb * bs, D)[:, :, :L]
    return dq, dk.to(k.dtype), dv.view(B, hkv, nb * bs, D)[:, :, :L].to(v.dtype)


class BlockSparseAttention(torch.autograd.Function):
    """Thin autograd wrapper: saves out and lse, recomputes the rest in backward."""

    @staticmethod
    def forward(ctx, q, k, v, doc_id, table: BlockTable, scale: float):
        out, lse = block_sparse_forward(q, k, v, doc_id, table, scale)
        ctx.save_for_backward(q, k, v, out, lse, doc_id, *table[:4])
        ctx.block_size, ctx.scale = table.block_size, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, doc_id, *tensors = ctx.saved_tensors
        table = BlockTable(*tensors, ctx.block_size)
        dq, dk, dv = block_sparse_backward(grad_out, q, k, v, out, lse, doc_id, table, ctx.scale)
        return dq, dk, dv, None, None, None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]; attends only the block pairs in `table`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return BlockSparseAttention.apply(q, k, v, doc_id, table, scale)
