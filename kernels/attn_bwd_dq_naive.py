"""Naive PyTorch reference of the dQ backward (attn_bwd_dq.py), written out by hand.

From P (attn_fwd_naive.py, fp64): dP = dO·Vᵀ, delta = rowsum(dO·O) = rowsum(P·dP),
dS = P·(dP − delta), dQ = dS·K·scale. Not autograd, so it checks the kernel's algebra
independently of how the forward reference is differentiated.
"""

from __future__ import annotations

import math

import torch

from .attn_common import BlockTable, check_inputs
from .attn_fwd_naive import attention_probs_ref


def attention_delta_ref(do: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """delta [B, Hq, L] fp64: rowsum(dO * O), what the preprocess kernel writes."""
    return (do.double() * out.double()).sum(-1)


def attention_dq_ref(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> torch.Tensor:
    """dQ [B, Hq, L, D] in q's dtype (fp64 inside) for output gradient `do`."""
    check_inputs(q, k, v, doc_id)
    G = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = attention_probs_ref(q, k, doc_id, table, scale)
    kc, vc = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    dp = do.double() @ vc.transpose(-1, -2)
    ds = p * (dp - attention_delta_ref(do, p @ vc)[..., None])
    return (ds @ kc * scale).to(q.dtype)
