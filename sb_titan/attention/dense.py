"""Dense causal attention with document masking (the exact baseline).

Used for `dense_layers`, as the accuracy reference, and as the dense baseline in
benchmarks. Materialises an [L, L] mask, so it is meant for CPU and moderate L.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sb_titan.attention.layout import document_causal_mask


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]; doc_id: [B, L] -> [B, Hq, L, D]."""
    mask = document_causal_mask(doc_id)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
