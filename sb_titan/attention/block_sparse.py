"""Block-sparse attention in plain PyTorch (CPU reference path; also runs on CUDA).

Work is linear in the kept block pairs. Rows of the block table (one per (b, kv head,
query block)) are sorted by their kept count c and cut into chunks of equal c; a chunk
gathers its c key blocks into one [n, c*Bs, D] tensor and runs one batched matmul for
all G query heads of the kv head at once ([n, G*Bs, D] x [n, D, c*Bs]). A chunk
normally holds complete softmax rows, so the forward needs no online rescaling (rows
longer than the chunk limit are cut into slices and merged flash-style). Like flash
attention the forward returns out and the log-sum-exp (lse), and the backward
recomputes probabilities from the lse in one pass over the same chunks, 5 matmuls per
pair (7 with the forward): dQ rows are complete within a chunk, and the chunk's dK/dV
tiles are summed into their key blocks with `index_add_` (serial in index order on
CPU, so deterministic for a given thread count).

CPU details that matter for speed (measured, see docs/attention.md):
  - chunks run whole on single-threaded workers, one per torch thread (`run_split`), instead
    of splitting each chunk's ~12 small ops over threads;
  - everything per chunk (sorted rows, key rows, mask flags) is planned once per call
    (`_plan`); q, out and lse live in plan order, so chunks read and write contiguous
    slices, and one index_select per tensor restores row order;
  - scores are kept in base 2 (q is pre-scaled by scale * log2(e)) because exp2 is ~3x
    faster than exp on CPU;
  - chunks of `_CHUNK_ELEMS` score elements reuse preallocated buffers via `out=`:
    fresh multi-MB allocations page-fault and cost more than the math;
  - masks are only added where needed. Inside a pair (query block i, key block j < i)
    the document-causal mask is separable: query token t sees key s iff t is in
    first_doc(i) (a row mask, only non-trivial when a document starts inside block i)
    and s >= doc_start(first_doc(i)) (a column mask, only non-trivial on the sink
    block). Only the diagonal pair needs a full [Bs, Bs] mask, precomputed per block;
    chunks whose rows all lie in one document add one causal [Bs, Bs] bias.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sb_titan.attention.estimator import num_blocks, token_doc_start
from sb_titan.attention.selection import BlockTable
from sb_titan.attention.workers import run_split

_CHUNK_ELEMS = 1 << 19  # score elements per chunk (2 MiB fp32): the fastest of 2^17..2^21
_LOG2E = 1.0 / math.log(2.0)


class _Masks(NamedTuple):
    """Per-block mask pieces of one batch (all O(L * Bs) or smaller)."""

    diag: torch.Tensor  # [B*NB, Bs, Bs] 0/-inf bias of the diagonal pair (query, key)
    row: torch.Tensor  # [B*NB, Bs] 0/-inf: query token is in first_doc(block)
    mixed: torch.Tensor  # [B*NB] bool: a document starts strictly inside the block
    first_start: torch.Tensor  # [B*NB] int64: doc start of the block's first token
    causal: torch.Tensor  # [Bs, Bs] 0/-inf: the diagonal bias of every block not mixed


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
    causal = _bias(ar[None, :] <= ar[:, None], dtype)
    return _Masks(_bias(ok_diag, dtype), _bias(in_first, dtype), ~in_first.all(1), first, causal)


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


def _chunk_pairs(per_pair: int, device: torch.device) -> int:
    """Block pairs per batched matmul: _CHUNK_ELEMS scores on CPU, where one thread runs
    a chunk (`run_split`) and its share should stay cache-sized; much larger on GPUs, where
    the per-chunk launch and sync overhead dominates."""
    return max(1, _CHUNK_ELEMS * (1 if device.type == "cpu" else 64) // per_pair)


class _Chunk(NamedTuple):
    """Rows [lo, hi) of the count-sorted order: they keep c key blocks each."""

    lo: int
    hi: int
    c: int
    krows: torch.Tensor  # [n, c] flat key-block rows (b*Hkv*NB + h*NB + j), contiguous
    idx: torch.Tensor  # [n, c] key block ids j, ascending, the last is the diagonal
    bi: torch.Tensor  # [n] flat (b, i) query block ids (rows of _Masks)
    plain: bool  # every row needs only the causal bias on its diagonal pair


class _Plan(NamedTuple):
    order: torch.Tensor  # [R] flat rows (b, h, i) sorted by kept count
    chunks: list[_Chunk]
    width: int  # kept pairs per slice: longer rows are cut along their kept list


def _plan(table: BlockTable, masks: _Masks, per_pair: int, device: torch.device) -> _Plan:
    """Rows of equal kept count c, `width // c` rows per chunk, in count-sorted order.

    Everything per chunk is computed here at once (one host sync for all mask flags), so
    the loops only slice views. Rows whose c alone exceeds `width` come one at a time and
    are cut along their kept list (`_slices`), so every score buffer stays within limit.
    """
    width = _chunk_pairs(per_pair, device)
    B, hkv, nb = table.kv_count.shape
    bs = table.block_size
    count = table.kv_count.flatten().long()
    order = torch.argsort(count, stable=True)
    counts, sizes = torch.unique_consecutive(count[order], return_counts=True)
    index = table.kv_index.flatten(0, 2).long()[order]  # [R, MAXK]
    i = order % nb
    krows = (order - i)[:, None] + index
    bi = order // (hkv * nb) * nb + i
    # Beyond the causal diagonal a row needs masks when a document starts inside its
    # query block, or when a kept key block starts before the block's first document.
    slot = torch.arange(index.shape[1], device=index.device)
    early = (masks.first_start[bi][:, None] > index * bs) & (slot < count[order][:, None])
    special = (masks.mixed[bi] | early.any(1)).tolist()
    chunks, lo = [], 0
    for c, size in zip(counts.tolist(), sizes.tolist(), strict=True):
        kr, ix = krows[lo : lo + size, :c].contiguous(), index[lo : lo + size, :c].contiguous()
        step = max(1, width // c)
        for a in range(0, size, step):
            z = min(size, a + step)
            plain = not any(special[lo + a : lo + z])
            chunks.append(_Chunk(lo + a, lo + z, c, kr[a:z], ix[a:z], bi[lo + a : lo + z], plain))
        lo += size
    return _Plan(order, chunks, width)


def _rows_in_order(x: torch.Tensor, hkv: int, bs: int, dtype, order, scale: float = 1.0):
    """(scale * x as [R, G*Bs, E] rows in `order`, a spare tensor of that shape).

    Fresh multi-MB tensors cost page faults at first touch (~2.6 GB/s), comparable to
    the copies themselves, so callers reuse the spare (the blocked copy) for outputs.
    """
    blk = _to_q_blocks(x, hkv, bs, dtype, scale)
    blk = blk.view(blk.shape[0], -1, blk.shape[-1])
    return blk.index_select(0, order), blk


def _unsort(x: torch.Tensor, order: torch.Tensor, out: torch.Tensor | None = None):
    """Rows of x (in `order`) back to row order: one index_select."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return torch.index_select(x, 0, inverse, out=out)


def _slices(c: int, width: int) -> list[tuple[int, int]]:
    """Slot ranges [s0, s1) of a kept list of length c, each at most `width` long."""
    return [(s0, min(c, s0 + width)) for s0 in range(0, c, width)]


class _Buffers:
    """Flat scratch tensors reused across chunks (views are handed out with `out=`).

    pair_elems[k]: elements per kept pair in one slice of buffer k.
    """

    def __init__(self, chunks: list[_Chunk], width: int, pair_elems, dtype, device):
        most = max(((ch.hi - ch.lo) * min(ch.c, width) for ch in chunks), default=0)
        self.flat = [torch.empty(most * e, dtype=dtype, device=device) for e in pair_elems]

    def __call__(self, k: int, *shape: int) -> torch.Tensor:
        return self.flat[k][: math.prod(shape)].view(shape)


def _gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """src[index] for a flat row index, written into `out` (shape [*index.shape, ...])."""
    flat = out.view(index.numel(), *src.shape[1:])
    torch.index_select(src, 0, index.flatten(), out=flat)
    return out


def _mask_slice(s, ch: _Chunk, s0: int, s1: int, masks: _Masks, bs: int) -> None:
    """Add the document-causal mask to the scores s [n, G*Bs, w*Bs] of slots [s0, s1)."""
    if not ch.plain:
        _mask_kv_chunk(s, ch.bi, ch.idx[:, s0:s1], masks, bs, diag=s1 == ch.c)
    elif s1 == ch.c:  # one document around every row: only the diagonal is masked
        s.view(s.shape[0], -1, bs, s1 - s0, bs)[:, :, :, -1].add_(masks.causal)


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
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)  # [R, Bs, D]
    masks = _masks(doc_id, nb, bs, wd)
    gb = G * bs
    plan = _plan(table, masks, gb * bs, q.device)
    width = plan.width
    # R = B*Hkv*NB rows [G*Bs, D], in plan order like out, m and denom
    qs, out = _rows_in_order(q, hkv, bs, wd, plan.order, scale * _LOG2E)
    m_all = torch.empty(*qs.shape[:2], 1, dtype=wd, device=q.device)  # base 2
    denom_all = torch.empty_like(m_all)

    def scratch() -> _Buffers:
        return _Buffers(plan.chunks, width, [gb * bs, bs * D, bs * D, gb * D], wd, q.device)

    def work(chunks: list[_Chunk], buf: _Buffers) -> None:
        for ch in chunks:
            n, c = ch.hi - ch.lo, ch.c
            qb, o = qs[ch.lo : ch.hi], out[ch.lo : ch.hi]
            m, denom = m_all[ch.lo : ch.hi], denom_all[ch.lo : ch.hi]
            slices = _slices(c, width)  # one slice unless a row alone is too long
            for s0, s1 in slices:
                krows = ch.krows[:, s0:s1]
                w = s1 - s0
                kb = _gather(kblk, krows, buf(1, n, w * bs, D))
                vb = _gather(vblk, krows, buf(2, n, w * bs, D))
                s = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, gb, w * bs))
                _mask_slice(s, ch, s0, s1, masks, bs)
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
                    o.mul_(alpha).add_(torch.bmm(p, vb, out=buf(3, n, gb, D)))
                m.copy_(m_new)
            o.div_(denom)

    run_split(work, plan.chunks, q.device, scratch, parts_per_worker=8)
    lse = _unsort(m_all.add_(denom_all.log2_()), plan.order).view(-1, G, bs, 1)
    lse = _from_q_blocks(lse, (B, Hq, L, 1), hkv, wd, math.log(2.0))[..., 0]
    out = _unsort(out, plan.order, out=qs).view(-1, G, bs, D)  # qs is free now
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

    One pass over rows of the kv table (query block -> kept key blocks), 5 matmuls per
    pair as in flash attention's backward. dQ rows are complete within a chunk; the
    chunk's dK/dV tiles ([Bs, D] per pair) are summed into their key blocks with
    `index_add_`, which on CPU adds rows serially in index order (deterministic).
    """
    B, Hq, L, D = q.shape
    hkv, bs = k.shape[1], table.block_size
    nb, G = num_blocks(L, bs), Hq // hkv
    wd = _work_dtype(q.dtype)
    gb = G * bs
    masks = _masks(doc_id, nb, bs, wd)
    plan = _plan(table, masks, gb * bs, q.device)
    width = plan.width

    def rows(x: torch.Tensor, s: float = 1.0):  # [B, Hq, L, E] -> plan order, spare
        return _rows_in_order(x, hkv, bs, wd, plan.order, s)

    delta = torch.linalg.vecdot(grad_out.to(wd), out.to(wd))[..., None]  # rowsum(dO * O)
    (qs, dq), (dos, _) = rows(q, scale * _LOG2E), rows(grad_out)  # [R, G*Bs, D]; dq: plan order
    deltas, lses = rows(delta)[0], rows(lse[..., None], _LOG2E)[0]  # [R, G*Bs, 1], lse base 2
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)

    def scratch() -> _Buffers:
        sizes = [gb * bs, gb * bs, bs * D, bs * D, gb * D, bs * D, bs * D]
        return _Buffers(plan.chunks, width, sizes, wd, q.device)

    def work(chunks: list[_Chunk], buf: _Buffers) -> tuple[torch.Tensor, torch.Tensor]:
        """dQ rows of `chunks`, and their dK, dV contributions (summed by the caller)."""
        dk, dv = torch.zeros_like(kblk), torch.zeros_like(vblk)
        for ch in chunks:
            n, c = ch.hi - ch.lo, ch.c
            qb, dob, dq_r = qs[ch.lo : ch.hi], dos[ch.lo : ch.hi], dq[ch.lo : ch.hi]
            lse_r, delta_r = lses[ch.lo : ch.hi], deltas[ch.lo : ch.hi]
            for s0, s1 in _slices(c, width):
                krows = ch.krows[:, s0:s1].flatten()
                w = s1 - s0
                kb = _gather(kblk, krows, buf(2, n, w * bs, D))
                vb = _gather(vblk, krows, buf(3, n, w * bs, D))
                p = torch.bmm(qb, kb.transpose(1, 2), out=buf(0, n, gb, w * bs))
                _mask_slice(p, ch, s0, s1, masks, bs)
                p.sub_(lse_r).exp2_()
                ds = torch.bmm(dob, vb.transpose(1, 2), out=buf(1, n, gb, w * bs))
                ds.sub_(delta_r).mul_(p)
                if s0 == 0:
                    torch.bmm(ds, kb, out=dq_r)
                else:
                    dq_r.add_(torch.bmm(ds, kb, out=buf(4, n, gb, D)))
                dv_t = torch.bmm(p.transpose(1, 2), dob, out=buf(5, n, w * bs, D))
                dk_t = torch.bmm(ds.transpose(1, 2), qb, out=buf(6, n, w * bs, D))
                dv.index_add_(0, krows, dv_t.view(n * w, bs, D))
                dk.index_add_(0, krows, dk_t.view(n * w, bs, D))
        return dk, dv

    # 2 parts per worker: some balancing under load, 2*T dK/dV-sized accumulators.
    parts = run_split(work, plan.chunks, q.device, scratch, parts_per_worker=2)
    dk, dv = parts[0]
    for dk_w, dv_w in parts[1:]:  # fixed order: deterministic for a given thread count
        dk.add_(dk_w)
        dv.add_(dv_w)
    dq = _unsort(dq, plan.order, out=dos).view(-1, G, bs, D)  # dos is free now
    dq = _from_q_blocks(dq, q.shape, hkv, q.dtype, scale)
    # qs carries scale * log2(e), so dk picks up a factor log2(e) too much.
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
