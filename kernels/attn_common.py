"""What every block-sparse attention kernel family shares: the table and operand
types, document bounds, launch order, input checks and the Triton helpers of the walk
over a kept list.

Layout: q [B, Hq, L, D], k/v [B, Hkv, L, D], doc_id [B, L] int32, Hq = G * Hkv. The table
(CSR: kv_ptr/kv_index and the transpose q_ptr/q_index) says which key blocks of size Bs
each query block computes, per kv head; inside a computed pair the token mask is
`key pos <= query pos and doc_id[key] == doc_id[query]`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

#: kept-list entries scanned per vector step when cutting a program's iteration range
SCAN = 64


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
# only the rest evaluate the causal and document mask, by document bounds (`BOUNDS_MASK`:
# a key c is in row r's document iff doc_start[r] <= c <= r, bounds loaded once per
# program) or by comparing doc ids (the key or query tile's ids loaded per masked tile);
# attn_tiles says which per config.


@triton.jit
def iter_bounds(
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
def query_tile(
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
def row_docs(doc_base, start_base, offs_m, row_ok, BOUNDS_MASK: tl.constexpr):
    """What the forward and dQ keep per query row for the mask, loaded once before the
    loop: the row's document start (BOUNDS_MASK) or its document id. Padding rows get a
    value that keeps no key in either mask."""
    if BOUNDS_MASK:
        return tl.load(start_base + offs_m, mask=row_ok, other=2147483647)
    return tl.load(doc_base + offs_m, mask=row_ok, other=-1)


@triton.jit
def row_keep(doc_base, cols, col_ok, offs_m, row_doc, BOUNDS_MASK: tl.constexpr):
    """[BLOCK_M, BLOCK_N] document-causal mask of query rows x key columns (forward, dQ).

    Documents are contiguous, so with `key <= row` the key is in the row's document iff
    `key >= doc_start[row]`: BOUNDS_MASK compares with the bounds `row_docs` loaded, no
    load here. Otherwise the key tile's doc ids are loaded and compared with the rows'
    (a load per masked tile). Both give the same mask (key columns past L fail either)."""
    causal = cols[None, :] <= offs_m[:, None]
    if BOUNDS_MASK:
        return causal & (cols[None, :] >= row_doc[:, None])
    doc_k = tl.load(doc_base + cols, mask=col_ok, other=-2)
    return causal & (doc_k[None, :] == row_doc[:, None]) & col_ok[None, :]


@triton.jit
def col_docs(doc_base, end_base, offs_n, col_ok, BOUNDS_MASK: tl.constexpr):
    """dK/dV's per key column value, loaded once: one past the end of the key's document
    (BOUNDS_MASK) or its document id. Padding columns keep no row in either mask."""
    if BOUNDS_MASK:
        return tl.load(end_base + offs_n, mask=col_ok, other=0)
    return tl.load(doc_base + offs_n, mask=col_ok, other=-2)


@triton.jit
def col_keep(doc_base, rows, row_ok, offs_n, col_doc, BOUNDS_MASK: tl.constexpr):
    """[BLOCK_N, BLOCK_M] mask of key columns x query rows (dK/dV): query row r sees key c
    iff `c <= r < doc_end[c]` (BOUNDS_MASK, no load; rows past L fail it since
    doc_end <= L), else by the query tile's doc ids (a load per masked tile)."""
    causal = offs_n[:, None] <= rows[None, :]
    if BOUNDS_MASK:
        return causal & (rows[None, :] < col_doc[:, None])
    doc_q = tl.load(doc_base + rows, mask=row_ok, other=-1)
    return causal & (col_doc[:, None] == doc_q[None, :]) & row_ok[None, :]


def query_order(kv_ptr: torch.Tensor) -> torch.Tensor:
    """[B*Hkv*NB] int32: table rows (b, kv head, query block) by kept count, heaviest
    first (stable), the launch order of the forward and dQ programs."""
    count = kv_ptr.diff(dim=-1).flatten()
    return torch.argsort(count, descending=True, stable=True).to(torch.int32)


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


def strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_id: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if tuple(doc_id.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc_id {tuple(doc_id.shape)} does not match q {tuple(q.shape)}")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
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
