"""Naive PyTorch reference of the block-sparse attention forward (attn_fwd.py).

The token mask is built explicitly ([B, Hkv, L, L]) from the kv table and the causal
document rule, and the softmax runs over it in fp64: quadratic in L, for tests only.
Reads only kv_ptr/kv_index, so a wrong transpose cannot hide in it.
"""

from __future__ import annotations

import math

import torch

from .attn_common import BlockTable, check_inputs, table_block_size


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


def attention_probs_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """P [B, Hq, L, L] in `compute_dtype`: the masked softmax of q·kᵀ·scale, k repeated
    over the G q heads of its kv head; rows with no allowed key are 0, not NaN."""
    G = q.shape[1] // k.shape[1]
    mask = table_token_mask(doc_id, table).repeat_interleave(G, dim=1)
    has_key = mask.any(dim=-1, keepdim=True)
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(G, dim=1)
    s = (qc @ kc.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0.0)
    return torch.softmax(s, dim=-1) * has_key


def block_sparse_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Explicit masked softmax from the kv table. Differentiable; rows with no allowed
    key give 0. Returns q's dtype."""
    check_inputs(q, k, v, doc_id)
    G = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = attention_probs_ref(q, k, doc_id, table, scale, compute_dtype)
    vc = v.to(compute_dtype).repeat_interleave(G, dim=1)
    return (p @ vc).to(q.dtype)
