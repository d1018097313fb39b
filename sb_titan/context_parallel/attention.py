"""Attention of one CP rank's query blocks against the whole row's keys.

The scheme is Llama 3's: all-gather K and V (one collective for both), attend the local
query blocks, and reduce-scatter dK / dV in backward. Under GQA the gathered K/V are
Hkv / Hq of the queries' size (1/7 for Qwen2.5-3B), any split works (the kept blocks
of a query block can live anywhere), and the block table is selected exactly as on one
GPU, so a CP run attends the very pairs a single-process run does.

The local queries are placed at their row positions in an otherwise-zero query tensor,
and the table keeps only the diagonal of the other ranks' blocks: the single-GPU
kernels run unchanged on it, and a zero query with no output gradient adds nothing to
dK / dV. That costs one diagonal pair per foreign block and a full-row query buffer
(docs/context_parallel.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sb_titan.attention.ops import block_sparse_attention, full_table, select
from sb_titan.attention.selection import AttnStats
from sb_titan.context_parallel.collectives import all_gather
from sb_titan.context_parallel.split import CPSplit


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_id: Tensor,
    split: CPSplit,
    rank: int,
    group_name: str,
    *,
    budget: Tensor | None,
    policy: str = "mass",
    scale: float | None = None,
    backend: str = "torch",
    estimator: str = "torch",
) -> tuple[Tensor, AttnStats | None]:
    """q: [B, Hq, Lr, D], k, v: [B, Hkv, Lr, D] this rank's tokens in shard order;
    doc_id: [B, L] of the full row. budget None: dense (every allowed block).

    Returns (out [B, Hq, Lr, D], this shard's AttnStats or None when dense): its density
    and token-weighted recall add up over the CP ranks of a row."""
    B, Hq, Lr, D = q.shape
    bs = split.block_size
    L = doc_id.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    kv = all_gather(torch.stack([k, v]), 3, group_name)  # [2, B, Hkv, L, D] rank-major
    order = split.gather_order().to(q.device)  # [B, L]: row position -> gathered index
    kv = kv.gather(3, order[None, :, None, :, None].expand(2, B, k.shape[1], L, D))
    k_row, v_row = kv.unbind(0)
    local = split.token_index(rank).to(q.device)  # [B, Lr]: shard token -> row position
    at = local[:, None, :, None].expand(B, Hq, Lr, D)
    q_row = q.new_zeros(B, Hq, L, D).scatter(2, at, q)
    rows = torch.zeros(B, L // bs, dtype=torch.bool, device=q.device)
    rows.scatter_(1, split.local(rank).to(q.device), True)
    if budget is None:
        table, stats = full_table(doc_id, k.shape[1], bs, rows), None
    else:
        table, stats = select(
            q_row, k_row, doc_id, budget, policy=policy, block_size=bs, scale=scale,
            estimator=estimator, rows=rows,
        )  # fmt: skip
    out = block_sparse_attention(q_row, k_row, v_row, doc_id, table, scale, backend)
    return out.gather(2, at), stats
