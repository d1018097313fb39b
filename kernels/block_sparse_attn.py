"""Block-sparse attention: operand preparation, the launch sequence and autograd.

The kernel families live beside this file, each with its naive reference:
attn_fwd.py (forward), attn_bwd_dq.py (delta and dQ), attn_bwd_dkdv.py (dK/dV and its
work plan); attn_tiles.py holds their tiles and attn_common.py what they share. This
file checks and prepares the operands once per call and runs the families in order;
`BlockSparseAttnFn` is a thin autograd wrapper around them.
"""

from __future__ import annotations

import math

import torch
import triton

from .attn_bwd_dkdv import attn_bwd_dkdv
from .attn_bwd_dq import attn_bwd_dq, attn_bwd_preprocess
from .attn_common import (
    BlockTable,
    Prepared,
    check_inputs,
    doc_bounds,
    last_dim_contiguous,
    table_block_size,
)
from .attn_fwd import attn_fwd


def attn_bwd(p: Prepared, do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """(dq, dk, dv): delta, then dQ over the kv table, then dK/dV over its transpose."""
    do = last_dim_contiguous(do)
    delta = attn_bwd_preprocess(out, do, p.block_size)
    dq = attn_bwd_dq(p, do, lse, delta)
    dk, dv = attn_bwd_dkdv(p, do, lse, delta)
    return dq, dk, dv


class BlockSparseAttnFn(torch.autograd.Function):
    """Thin autograd wrapper: kernels do the work, this only saves and routes tensors."""

    @staticmethod
    def forward(ctx, q, k, v, doc_id, table: BlockTable, scale: float | None) -> torch.Tensor:
        p = prepare(q, k, v, doc_id, table, scale)
        out, lse = attn_fwd(p)
        ctx.save_for_backward(out, lse, *p[:-2])  # every tensor of the prepared call
        ctx.block_size, ctx.scale = p.block_size, p.scale
        return out

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        out, lse, *tensors = ctx.saved_tensors
        dq, dk, dv = attn_bwd(Prepared(*tensors, ctx.block_size, ctx.scale), do, out, lse)
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


def prepare(q, k, v, doc_id, table: BlockTable, scale: float | None) -> Prepared:
    """Checked, kernel-ready operands: last dims contiguous, int32 doc ids and bounds."""
    check_inputs(q, k, v, doc_id)
    block_size = table_block_size(table, q.shape[2])
    tensors = _prepare_table(table, q.shape[0], k.shape[1], q.shape[2], block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
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
    return attn_fwd(prepare(q, k, v, doc_id, table, scale))


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
    return attn_bwd(prepare(q, k, v, doc_id, table, scale), do, out, lse)


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
