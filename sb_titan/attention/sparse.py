"""Dynamic block-sparse attention: select blocks under a budget, then attend.

One entry point for the model: the pattern is chosen per call (so per micro-batch
budget changes cost nothing), selection is not differentiated, and the attention runs
on the Triton kernels for CUDA tensors or on the PyTorch path otherwise. Both steps are
custom ops (attention/ops.py), so a compiled block traces them as two graph nodes.
Which implementation runs on which device is decided in attention/backends.py.
`backend="flex"` attends over the same table with compiled FlexAttention instead
(attention/flex.py; forward only off CUDA).
"""

from __future__ import annotations

import torch

from sb_titan.attention.backends import estimator_for, resolve_backend
from sb_titan.attention.flex import flex_attention
from sb_titan.attention.ops import attention_forward, measure_true_recall, select
from sb_titan.attention.selection import AttnStats, block_pairs


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    budget: torch.Tensor | float,
    *,
    policy: str = "mass",
    block_size: int = 64,
    scale: float | None = None,
    backend: str = "auto",
    scorer: str = "mean",
    true_recall_rate: float = 0.0,
    per_block: bool = False,
) -> tuple[torch.Tensor, AttnStats]:
    """q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]; doc_id: [B, L]; budget in (0, 1]: [B, NB]
    per query block (layout.block_budgets), or a row-wide [B] or scalar.

    Returns (out [B, Hq, L, D], AttnStats with per-row density and estimated recall,
    and, when true_recall_rate > 0, true recall and top-key hits of sampled queries per
    query block, with each block's kept and allowed key blocks when `per_block`: what
    the trainer credits to documents, counted only where it does).
    scorer: the estimator family that ranks blocks (attention/block_scores.py).
    """
    backend = resolve_backend(backend, q.device.type)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    estimator = estimator_for(backend, q.device.type)
    table, stats = select(
        q, k, doc_id, budget, policy=policy, block_size=block_size, scale=scale,
        estimator=estimator, scorer=scorer,
    )  # fmt: skip
    if backend == "flex" and q.device.type != "cuda":  # Flex returns no lse on CPU
        out, lse = flex_attention(q, k, v, doc_id, table, scale), None
    elif backend == "flex":
        out, lse = flex_attention(q, k, v, doc_id, table, scale, return_lse=True)
    else:
        out, lse = attention_forward(q, k, v, doc_id, table, scale, backend)
    if true_recall_rate > 0:
        sampled = measure_true_recall(
            q, k, doc_id, lse, table, scale=scale, rate=true_recall_rate,
            lse_base2=backend == "triton",
        )  # fmt: skip
        blocks = block_pairs(table, doc_id) if per_block else stats.blocks
        stats = stats._replace(
            true_recall=sampled[0], top_hit=sampled[1], samples=sampled[2], blocks=blocks
        )
    return out, stats
