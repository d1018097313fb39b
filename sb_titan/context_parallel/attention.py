"""Attention of one CP rank's query blocks against the whole row's keys.

The scheme is Llama 3's: all-gather K and V (one collective for both), attend the local
query blocks, and reduce-scatter dK / dV in backward. Under GQA the gathered K/V are
Hkv / Hq of the queries' size (1/7 for Qwen2.5-3B), any split works (the kept blocks
of a query block can live anywhere), and the block table is selected exactly as on one
GPU, so a CP run attends the very pairs a single-process run does.

The local queries are placed at their row positions in an otherwise-zero query tensor,
and the table keeps only the diagonal of the other ranks' blocks: the single-GPU
kernels run unchanged on it, and a zero query with no output gradient adds nothing to
dK / dV. That costs one diagonal pair per foreign block; the full-row query, output and
log-sum-exp buffers live only inside forward and backward, so what a layer keeps for
backward is its own shard plus the gathered K/V (docs/context_parallel.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sb_titan.attention.ops import (
    attention_backward,
    attention_forward,
    full_table,
    measure_true_recall,
    select,
)
from sb_titan.attention.selection import AttnStats, BlockTable, block_pairs
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
    scorer: str = "mean",
    true_recall_rate: float = 0.0,
    per_block: bool = False,
) -> tuple[Tensor, AttnStats | None]:
    """q: [B, Hq, Lr, D], k, v: [B, Hkv, Lr, D] this rank's tokens in shard order;
    doc_id: [B, L] of the full row. budget None: dense (every allowed block).

    Returns (out [B, Hq, Lr, D], this shard's AttnStats or None when dense): its density,
    token-weighted recall and sampled true-recall sums (and with `per_block` its query
    blocks' kept and allowed key blocks) add up over the CP ranks of a row (each
    samples only its own query blocks)."""
    B, Hq, Lr, D = q.shape
    bs = split.block_size
    L = doc_id.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    kv = all_gather(torch.stack([k, v]), 3, group_name)  # [2, B, Hkv, L, D] rank-major
    order = split.gather_order().to(q.device)  # [B, L]: row position -> gathered index
    kv = kv.gather(3, order[None, :, None, :, None].expand(2, B, k.shape[1], L, D))
    k_row, v_row = kv.unbind(0)
    local = split.token_index(rank).to(q.device)  # [B, Lr]: shard token -> row position
    rows = torch.zeros(B, L // bs, dtype=torch.bool, device=q.device)
    rows.scatter_(1, split.local(rank).to(q.device), True)
    if budget is None:
        table, stats = full_table(doc_id, k.shape[1], bs, rows), None
    else:
        q_row = _to_row(q.detach(), local, L)
        table, stats = select(
            q_row, k_row, doc_id, budget, policy=policy, block_size=bs, scale=scale,
            estimator=estimator, rows=rows, scorer=scorer,
        )  # fmt: skip
    out, lse = _LocalQueries.apply(q, k_row, v_row, doc_id, local, table, scale, backend)
    if stats is not None and true_recall_rate > 0:
        sampled = measure_true_recall(
            q_row, k_row, doc_id, _to_row(lse, local, L), table, scale=scale,
            rate=true_recall_rate, lse_base2=backend == "triton", rows=rows,
        )  # fmt: skip
        blocks = block_pairs(table, doc_id, rows) if per_block else stats.blocks
        stats = stats._replace(
            true_recall=sampled[0], top_hit=sampled[1], samples=sampled[2], blocks=blocks
        )
    return out, stats


def _to_row(x: Tensor, local: Tensor, length: int) -> Tensor:
    """x [B, H, Lr, ...] of a shard -> [B, H, length, ...] at its row positions, 0 elsewhere."""
    at = local.view(*local.shape[:1], 1, local.shape[1], *[1] * (x.dim() - 3))
    at = at.expand(*x.shape)
    return x.new_zeros(*x.shape[:2], length, *x.shape[3:]).scatter_(2, at, x)


def _from_row(x: Tensor, local: Tensor) -> Tensor:
    """The shard's positions `local` [B, Lr] of x [B, H, L, ...]."""
    at = local.view(*local.shape[:1], 1, local.shape[1], *[1] * (x.dim() - 3))
    return x.gather(2, at.expand(*x.shape[:2], local.shape[1], *x.shape[3:]))


class _LocalQueries(torch.autograd.Function):
    """Block-sparse attention of a shard's queries against full-row K/V. Only the shard's
    q, out and lse are saved; the row-sized buffers are rebuilt in backward (rows of
    other ranks: zero query, output and gradient, lse 0, so they add nothing)."""

    @staticmethod
    def forward(ctx, q, k_row, v_row, doc_id, local, table: BlockTable, scale, backend):
        q_row = _to_row(q, local, k_row.shape[2])
        out, lse = attention_forward(q_row, k_row, v_row, doc_id, table, scale, backend)
        out, lse = _from_row(out, local), _from_row(lse, local)
        ctx.save_for_backward(q, k_row, v_row, out, lse, doc_id, local, *table[:4])
        ctx.block_size, ctx.scale, ctx.backend = table.block_size, scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        q, k_row, v_row, out, lse, doc_id, local, *csr = ctx.saved_tensors
        L = k_row.shape[2]
        row = [_to_row(t, local, L) for t in (grad, q, out, lse)]
        table = BlockTable(*csr, ctx.block_size)
        dq, dk, dv = attention_backward(
            row[0], row[1], k_row, v_row, row[2], row[3], doc_id, table, ctx.scale, ctx.backend
        )
        return _from_row(dq, local), dk, dv, None, None, None, None, None
