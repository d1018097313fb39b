"""Naive PyTorch reference of the dK/dV backward (attn_bwd_dkdv.py), written out by hand.

From P (attn_fwd_naive.py, fp64), per q head: dV = Pᵀ·dO and dK = dSᵀ·Q·scale with
dS = P·(dO·Vᵀ − rowsum(dO·O)); the G q heads of a kv head are summed. No work plan and
no partials: the kernel's split and reduce must give the same sums.
"""

from __future__ import annotations

import math

import torch

from .attn_bwd_dq_naive import attention_delta_ref
from .attn_common import BlockTable, check_inputs
from .attn_fwd_naive import attention_probs_ref


def attention_dkdv_ref(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dK, dV) [B, Hkv, L, D] in k's and v's dtypes (fp64 inside)."""
    check_inputs(q, k, v, doc_id)
    B, Hkv, L, D = k.shape
    G = q.shape[1] // Hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = attention_probs_ref(q, k, doc_id, table, scale)
    vc = v.double().repeat_interleave(G, dim=1)
    dp = do.double() @ vc.transpose(-1, -2)
    ds = p * (dp - attention_delta_ref(do, p @ vc)[..., None])
    dv = p.transpose(-1, -2) @ do.double()  # per q head, [B, Hq, L, D]
    dk = ds.transpose(-1, -2) @ q.double() * scale
    dk, dv = (t.view(B, Hkv, G, L, D).sum(2) for t in (dk, dv))
    return dk.to(k.dtype), dv.to(v.dtype)
