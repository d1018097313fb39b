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

_CHUNK_ELEMS = 1 << 20  # score elements per chunk, all buffers (4 MiB fp32); fastest measured
_ROW_ELEMS = 1 << 21  # score elements of one row before it is cut into slices
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


def _tokens6(x: torch.Tensor, hkv: int, bs: int) -> torch.Tensor:
    """[B, H, L, E] -> view [B, Hkv, NB, G, Bs, E]: [b, h, i] is a GQA group's block i.

    Works for any strides; only when Bs does not divide L is a zero-padded copy made.
    """
    pad = num_blocks(x.shape[2], bs) * bs - x.shape[2]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.unflatten(2, (-1, bs)).unflatten(1, (hkv, -1)).permute(0, 1, 3, 2, 4, 5)


def _trim(x: torch.Tensor, L: int) -> torch.Tensor:
    """x [B, H, NB*Bs, ...] -> its first L tokens, contiguous."""
    return x if x.shape[2] == L else x[:, :, :L].contiguous()


def _chunk_pairs(per_pair: int, device: torch.device) -> tuple[int, int]:
    """(block pairs per chunk of rows, most pairs of one row before it is cut).

    On CPU one thread runs a chunk (`run_split`): _CHUNK_ELEMS scores keep its share
    cache-sized, while a single row may use up to _ROW_ELEMS because cutting it costs an
    online-softmax merge per slice. Much larger on GPUs, where the per-chunk launch and
    sync overhead dominates.
    """
    scale = 1 if device.type == "cpu" else 64
    chunk = max(1, _CHUNK_ELEMS * scale // per_pair)
    return chunk, max(chunk, _ROW_ELEMS * scale // per_pair)


class _Chunk(NamedTuple):
    """Query blocks of one (b, kv head h) that keep c key blocks each."""

    b: int
    h: int
    c: int
    i: torch.Tensor  # [n] query block ids, ascending
    runs: tuple[tuple[int, int, int], ...]  # (r, i0, i1): rows r.. are blocks i0..i1-1
    krows: torch.Tensor  # [n, c] flat key-block rows (b*Hkv*NB + h*NB + j), contiguous
    idx: torch.Tensor  # [n, c] key block ids j, ascending, the last is the diagonal
    bi: torch.Tensor  # [n] flat (b, i) query block ids (rows of _Masks)
    plain: bool  # every row needs only the causal bias on its diagonal pair


class _Plan(NamedTuple):
    chunks: list[_Chunk]
    width: int  # kept pairs per slice: longer rows are cut along their kept list


def _plan(table: BlockTable, masks: _Masks, per_pair: int, device: torch.device) -> _Plan:
    """Per (b, h), query blocks of equal kept count c, `chunk // c` blocks per chunk.

    Everything per chunk is computed here at once (one host sync for all mask flags), so
    the loops only slice views. Rows whose c alone exceeds `width` come one at a time and
    are cut along their kept list (`_slices`), so every score buffer stays within limit.
    """
    chunk, width = _chunk_pairs(per_pair, device)
    kv_count, kv_index = table.padded_kv()
    B, hkv, nb = kv_count.shape
    bs = table.block_size
    count = kv_count.flatten().long()
    key = torch.arange(count.numel(), device=count.device) // nb * (count.max() + 1) + count
    order = torch.argsort(key, stable=True)  # (b, h) first, then count, then i
    _, sizes = torch.unique_consecutive(key[order], return_counts=True)
    index = kv_index.flatten(0, 2).long()[order]  # [R, MAXK]
    i = order % nb
    krows = (order - i)[:, None] + index
    bi = order // (hkv * nb) * nb + i
    # Beyond the causal diagonal a row needs masks when a document starts inside its
    # query block, or when a kept key block starts before the block's first document.
    slot = torch.arange(index.shape[1], device=index.device)
    early = (masks.first_start[bi][:, None] > index * bs) & (slot < count[order][:, None])
    special = (masks.mixed[bi] | early.any(1)).tolist()
    rows, blocks, counts = order.tolist(), i.tolist(), count[order[sizes.cumsum(0) - 1]]
    chunks, lo = [], 0
    for c, size in zip(counts.tolist(), sizes.tolist(), strict=True):
        kr, ix = krows[lo : lo + size, :c].contiguous(), index[lo : lo + size, :c].contiguous()
        b, h = divmod(rows[lo] // nb, hkv)
        for a in range(lo, lo + size, max(1, chunk // c)):
            z = min(lo + size, a + max(1, chunk // c))
            runs = []
            for r, blk in enumerate(blocks[a:z]):  # maximal runs of consecutive blocks
                if runs and runs[-1][2] == blk:
                    runs[-1][2] += 1
                else:
                    runs.append([r, blk, blk + 1])
            plain = not any(special[a:z])
            ch = _Chunk(
                b,
                h,
                c,
                i[a:z],
                tuple(map(tuple, runs)),
                kr[a - lo : z - lo],
                ix[a - lo : z - lo],
                bi[a:z],
                plain,
            )
            chunks.append(ch)
        lo += size
    return _Plan(chunks, width)


def _read(src6: torch.Tensor, ch: _Chunk, out: torch.Tensor, scale: float = 1.0):
    """scale * the chunk's blocks of src6 [B, Hkv, NB, G, Bs, E] into out [n, G*Bs, E]."""
    src, dst = src6[ch.b, ch.h], out.view(len(ch.i), *src6.shape[3:])
    for r, i0, i1 in ch.runs:
        d, x = dst[r : r + i1 - i0], src[i0:i1]
        if scale == 1.0:
            d.copy_(x)
        elif x.dtype == d.dtype:
            torch.mul(x, scale, out=d)
        else:  # upcast first, then scale in the work dtype
            d.copy_(x).mul_(scale)
    return out


def _write(dst6: torch.Tensor, ch: _Chunk, x: torch.Tensor, scale: float = 1.0, div=None):
    """x * scale (or x / div) [n, G*Bs, E] into the chunk's blocks of dst6
    [B, Hkv, NB, G, Bs, E]; fused into one op per run when the dtypes match."""
    dst, src = dst6[ch.b, ch.h], x.view(len(ch.i), *dst6.shape[3:])
    if div is not None:
        div = div.view(len(ch.i), *dst6.shape[3:-1], 1)
    for r, i0, i1 in ch.runs:
        d, y = dst[i0:i1], src[r : r + i1 - i0]
        if div is None and scale == 1.0:
            d.copy_(y)
        elif d.dtype != y.dtype:
            d.copy_(y.div_(div[r : r + i1 - i0]) if div is not None else y.mul_(scale))
        elif div is not None:
            torch.div(y, div[r : r + i1 - i0], out=d)
        else:
            torch.mul(y, scale, out=d)


def _slices(c: int, width: int) -> list[tuple[int, int]]:
    """Slot ranges [s0, s1) of a kept list of length c, each at most `width` long."""
    return [(s0, min(c, s0 + width)) for s0 in range(0, c, width)]


class _Buffers:
    """Flat scratch tensors reused across chunks (views are handed out with `out=`).

    pair_elems[k]: elements per kept pair in one slice of buffer k.
    """

    def __init__(self, chunks: list[_Chunk], width: int, pair_elems, dtype, device):
        most = max((len(ch.i) * min(ch.c, width) for ch in chunks), default=0)
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
    want = (batch, num_kv_heads, nb + 1)
    for name in ("kv_ptr", "q_ptr"):
        if tuple(getattr(table, name).shape) != want:
            raise ValueError(
                f"table.{name} must be {want}, got {tuple(getattr(table, name).shape)}"
            )
    nnz = table.kv_index.numel()
    for ptr, name in ((table.kv_ptr, "kv"), (table.q_ptr, "q")):
        starts_ok = int(ptr[0, 0, 0]) == 0 if ptr.numel() else True
        if not starts_ok or int(ptr[-1, -1, -1]) != nnz or bool((ptr.diff(dim=-1) < 0).any()):
            raise ValueError(f"table.{name}_ptr is not a CSR offset array over {nnz} pairs")
        flat = ptr.flatten(0, 1)
        if not bool((flat[1:, 0] == flat[:-1, -1]).all()):
            raise ValueError(f"table.{name}_ptr rows are not contiguous")
    count = table.kv_ptr.diff(dim=-1)
    if count.numel() == 0:
        return
    if int(count.min()) < 1:
        raise ValueError("every query block must keep at least its diagonal block")
    # on the flat arrays (no padded copy): each row ascending and ending with its own block
    index = table.kv_index.long()
    row_start = torch.zeros(nnz, dtype=torch.bool, device=index.device)
    row_start[table.kv_ptr[..., :-1].flatten()] = True
    rising = (index[1:] > index[:-1]) | row_start[1:]
    blocks = torch.arange(nb, device=index.device)
    if not bool((index[table.kv_ptr[..., 1:] - 1] == blocks).all() and rising.all()):
        raise ValueError("kv_index rows must be ascending and end with the diagonal block")
    # the transpose: as many pairs, and each key block's column starts at its own block
    if table.q_index.numel() != nnz:
        raise ValueError("q_ptr/q_index are not the transpose of kv_ptr/kv_index")
    first = table.q_index.long()[table.q_ptr[..., :-1].clamp(max=nnz - 1)]
    if not bool((first == blocks).all()):
        raise ValueError("q_ptr/q_index are not the transpose of kv_ptr/kv_index")


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
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)  # [B*Hkv*NB, Bs, D]
    masks = _masks(doc_id, nb, bs, wd)
    gb = G * bs
    plan = _plan(table, masks, gb * bs, q.device)
    width = plan.width
    q6 = _tokens6(q, hkv, bs)
    out = torch.empty(B, Hq, nb * bs, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, nb * bs, 1, dtype=wd, device=q.device)
    out6, lse6 = _tokens6(out, hkv, bs), _tokens6(lse, hkv, bs)

    def scratch() -> _Buffers:
        sizes = [gb * bs, bs * D, bs * D, gb * D, gb * D, gb * D, gb, gb]
        return _Buffers(plan.chunks, width, sizes, wd, q.device)

    def work(chunks: list[_Chunk], buf: _Buffers) -> None:
        for ch in chunks:
            n, c = len(ch.i), ch.c
            qb = _read(q6, ch, buf(3, n, gb, D), scale * _LOG2E)
            o, m, denom = buf(4, n, gb, D), buf(6, n, gb, 1), buf(7, n, gb, 1)
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
                _online_softmax_step(s, vb, o, m, denom, s0, buf(5, n, gb, D))
            _write(out6, ch, o, div=denom)
            _write(lse6, ch, m.add_(denom.log2_()), scale=math.log(2.0))

    run_split(work, plan.chunks, q.device, scratch, parts_per_worker=8)
    return _trim(out, L), _trim(lse, L)[..., 0]


def _online_softmax_step(s, vb, o, m, denom, s0: int, tmp) -> None:
    """Fold slice scores s (base 2) into the running max m, denominator and output o, as
    in flash attention. A row may see nothing in the first slices (m = -inf); it is
    stabilised with 0 until it does."""
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
        o.mul_(alpha).add_(torch.bmm(p, vb, out=tmp))
    m.copy_(m_new)


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
    plan = _plan(table, masks, 2 * gb * bs, q.device)  # two score buffers: p and ds
    width = plan.width
    delta = torch.linalg.vecdot(grad_out.to(wd), out.to(wd))[..., None]  # rowsum(dO * O)
    q6, do6 = _tokens6(q, hkv, bs), _tokens6(grad_out, hkv, bs)
    delta6, lse6 = _tokens6(delta, hkv, bs), _tokens6(lse[..., None], hkv, bs)
    kblk, vblk = _to_blocks(k, bs, wd), _to_blocks(v, bs, wd)
    dq = torch.empty(B, Hq, nb * bs, D, dtype=q.dtype, device=q.device)
    dq6 = _tokens6(dq, hkv, bs)

    def scratch() -> _Buffers:
        sizes = [gb * bs, gb * bs, bs * D, bs * D, gb * D, gb * D, gb, gb, gb * D, gb * D]
        return _Buffers(plan.chunks, width, sizes + [bs * D, bs * D], wd, q.device)

    def work(chunks: list[_Chunk], buf: _Buffers) -> tuple[torch.Tensor, torch.Tensor]:
        """dQ rows of `chunks`, and their dK, dV contributions (summed by the caller)."""
        dk, dv = torch.zeros_like(kblk), torch.zeros_like(vblk)
        for ch in chunks:
            n, c = len(ch.i), ch.c
            qb = _read(q6, ch, buf(4, n, gb, D), scale * _LOG2E)
            dob = _read(do6, ch, buf(5, n, gb, D))
            lse_r = _read(lse6, ch, buf(6, n, gb, 1), _LOG2E)  # base 2
            delta_r = _read(delta6, ch, buf(7, n, gb, 1))
            dq_r = buf(8, n, gb, D)
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
                    dq_r.add_(torch.bmm(ds, kb, out=buf(9, n, gb, D)))
                dv_t = torch.bmm(p.transpose(1, 2), dob, out=buf(10, n, w * bs, D))
                dk_t = torch.bmm(ds.transpose(1, 2), qb, out=buf(11, n, w * bs, D))
                dv.index_add_(0, krows, dv_t.view(n * w, bs, D))
                dk.index_add_(0, krows, dk_t.view(n * w, bs, D))
            _write(dq6, ch, dq_r, scale=scale)
        return dk, dv

    # 2 parts per worker: some balancing under load, 2*T dK/dV-sized accumulators.
    parts = run_split(work, plan.chunks, q.device, scratch, parts_per_worker=2)
    dk, dv = parts[0]
    for dk_w, dv_w in parts[1:]:  # fixed order: deterministic for a given thread count
        dk.add_(dk_w)
        dv.add_(dv_w)
    # qb carries scale * log2(e), so dk picks up a factor log2(e) too much.
    dk, dv = dk.mul_(math.log(2.0)).view(B, hkv, -1, D), dv.view(B, hkv, -1, D)
    return _trim(dq, L), _trim(dk, L).to(k.dtype), _trim(dv, L).to(v.dtype)
