"""Naive PyTorch reference of the block-mass estimator (estimator.py), in fp64.

Pooling as padded block sums over each block's real tokens; probabilities as a dense
[NB, NB] score matrix with the allowed-block rule written out and one softmax.
"""

from __future__ import annotations

import math

import torch


def pool_blocks_ref(
    q: torch.Tensor, k: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of pool_blocks_triton, in fp64: means over each block's valid tokens."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    nb = -(-L // block_size)
    pad = nb * block_size - L
    count = torch.full((nb,), float(block_size), dtype=torch.float64, device=q.device)
    count[-1] = L - (nb - 1) * block_size

    def block_mean(x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B, H, NB, D]
        x = torch.nn.functional.pad(x.double(), (0, 0, 0, pad))
        return x.reshape(*x.shape[:2], nb, block_size, D).sum(3) / count[:, None]

    return block_mean(q).reshape(B, Hkv, Hq // Hkv, nb, D).mean(2), block_mean(k)


def block_probs_ref(
    qp: torch.Tensor,
    kp: torch.Tensor,
    doc_id: torch.Tensor,
    block_size: int,
    i0: int = 0,
    i1: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference of block_probs_triton, in fp64, returned as fp32."""
    nb, D = qp.shape[-2:]
    L = doc_id.shape[1]
    i1 = nb if i1 is None else i1
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    s = qp.double() @ kp.double().transpose(-1, -2) * scale  # [B, Hkv, NB, NB]
    starts = torch.arange(nb, device=qp.device) * block_size
    ends = torch.clamp(starts + block_size, max=L) - 1
    first_doc, last_doc = doc_id[:, starts], doc_id[:, ends]  # [B, NB]
    i = torch.arange(nb, device=qp.device)
    allowed = (i[None, :] == i[:, None])[None] | (
        (i[None, :] < i[:, None])[None] & (last_doc[:, None, :] == first_doc[:, :, None])
    )
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, dim=-1)[:, :, i0:i1].float()


def estimate_block_mass_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_id: torch.Tensor,
    block_size: int,
    i0: int = 0,
    i1: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """PyTorch reference of estimate_block_mass_triton (fp64 inside, fp32 out)."""
    qp, kp = pool_blocks_ref(q, k, block_size)
    return block_probs_ref(qp, kp, doc_id, block_size, i0, i1, scale)
