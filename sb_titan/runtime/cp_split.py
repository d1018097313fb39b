"""The CP split of a micro-batch's rows, decided where its budget is known."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from sb_titan.balance.cost_model import CostModel
from sb_titan.context_parallel.split import (
    CPSplit,
    allowed_blocks,
    document_split,
    imbalance,
    layer_block_costs,
    rank_loads,
    zigzag_split,
)
from sb_titan.models.qwen2_5 import dense_layer_set, model_dims


def cp_split(
    config: Any, cost_model: CostModel | None, doc_id: torch.Tensor, budget: float
) -> tuple[CPSplit, float]:
    """Which query blocks of each row every CP rank owns, from the rows' document layout
    (doc_id [B, L] of the full rows) and the micro-batch's budget, and the predicted
    CP-rank imbalance of that split (max / mean kept pairs, mean over rows). The cost
    model is refit identically on every rank, so all CP ranks (and all PP stages, which
    must pass the same shards along) cut the same split."""
    sa = config.sparse_attention
    cp = config.parallelism.context_parallel_degree
    n_layers = model_dims(config).n_layers
    dense = len(dense_layer_set(sa.dense_layers, n_layers)) if sa.enabled else n_layers
    density = None
    if n_layers > dense:
        if cost_model is not None:
            density = functools.partial(cost_model.densities, budget, policy=sa.policy)
        else:  # no cost model: price sparse blocks as dense ones (causal work)
            density = functools.partial(np.full_like, fill_value=1.0)
    allowed = allowed_blocks(doc_id, sa.block_size)
    cost = layer_block_costs(allowed, density, sa.block_size, n_layers - dense, dense)
    if config.parallelism.context_parallel_load_balancer == "headtail":
        split = zigzag_split(doc_id.shape[0], doc_id.shape[1], cp, sa.block_size)
    else:
        documents = doc_id[:, :: sa.block_size].cpu().numpy()  # each block's first token's
        split = document_split(cost, documents, cp, sa.block_size)
    predicted = float(np.mean([imbalance(row) for row in rank_loads(cost, split)]))
    return split, predicted
