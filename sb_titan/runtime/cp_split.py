"""The CP split of a micro-batch's rows, decided where its budget is known."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchtitan.models.qwen3.model import Qwen3Model

from sb_titan.attention.layout import block_budgets
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


@dataclass(frozen=True, slots=True)
class CPSplitter:
    """Which query blocks of each row every CP rank owns, decided per micro-batch from
    the rows' document layout and budget. Built once per run: what it needs of the
    config and of the model built (its sparse and dense layers) is fixed."""

    degree: int
    block_size: int
    policy: str
    headtail: bool
    sparse_layers: int
    dense_layers: int

    @classmethod
    def from_config(cls, config: Any, model: Qwen3Model.Config) -> CPSplitter:
        """`model`: the run's model spec's, as the trainer derived it from `config`."""
        sa, p = config.sparse_attention, config.parallelism
        sparse = sum(layer.attention.inner_attention.sparse for layer in model.layers)
        return cls(
            p.context_parallel_degree, sa.block_size, sa.policy,
            p.context_parallel_load_balancer == "headtail", sparse, len(model.layers) - sparse,
        )  # fmt: skip

    def __call__(
        self,
        cost_model: CostModel | None,
        doc_id: torch.Tensor,
        doc_budgets: Sequence[Sequence[float]],
    ) -> tuple[CPSplit, float]:
        """(the split of the rows doc_id [B, L] (full rows) with doc_budgets[b][d] the
        beta of row b's document d (layout.block_budgets: each query block is priced at
        its own), its predicted CP-rank imbalance: max / mean kept pairs, mean over
        rows). The cost model is refit identically on every rank, so all CP ranks (and
        all PP stages, which must pass the same shards along) cut the same split."""
        bs = self.block_size
        doc_id = doc_id.cpu()  # the split is host work: one copy, not one per use
        budget = block_budgets(doc_id, doc_budgets, bs, torch.float64).numpy()
        density_at = None
        if self.sparse_layers:
            if cost_model is not None:
                density_at = functools.partial(_densities, cost_model, self.policy)
            else:
                density_at = _as_dense
        allowed = allowed_blocks(doc_id, bs)
        cost = layer_block_costs(
            allowed, budget, density_at, bs, self.sparse_layers, self.dense_layers
        )
        if self.headtail:
            split = zigzag_split(doc_id.shape[0], doc_id.shape[1], self.degree, bs)
        else:
            documents = doc_id[:, ::bs].numpy()  # each block's first token's
            split = document_split(cost, documents, self.degree, bs)
        predicted = float(np.mean([imbalance(row) for row in rank_loads(cost, split)]))
        return split, predicted


def _densities(cost_model: CostModel, policy: str, beta: float):
    """lengths -> the cost model's densities at budget beta."""
    return functools.partial(cost_model.densities, beta, policy=policy)


def _as_dense(_beta: float):
    """No cost model: sparse blocks are priced as dense ones (causal work)."""
    return functools.partial(np.full_like, fill_value=1.0)
