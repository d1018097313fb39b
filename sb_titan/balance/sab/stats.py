"""Predicted balance of a plan: imbalance across ranks and micro-batches, padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sb_titan.balance.sab.cost import CostFn, as_cost_fn
from sb_titan.balance.sab.plan import StepPlan


# -- statistics -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlanStats:
    """How balanced one step's plan is under the planner's cost model (predicted)."""

    rank_imbalance: float  # max / mean of ranks' summed micro-batch latency
    microbatch_imbalance: float  # max / mean over all micro-batches of the step
    microbatch_bound: float  # max(heaviest single piece, mean) / mean: packing's floor
    padding: float  # share of the step's row tokens left empty
    pieces: int
    tokens: int


def plan_stats(plan: StepPlan, seq_len: int, cost_fn: CostFn) -> PlanStats:
    """Predicted imbalance of a plan; the bound is what no placement can beat."""
    cost_fn = as_cost_fn(cost_fn)
    mbs = [mb for rank in plan.microbatches for mb in rank]
    loads = np.array([[mb.predicted_s for mb in rank] for rank in plan.microbatches])
    base = float(cost_fn([], []))
    heaviest = (
        max(
            (
                cost_fn([n], [r]) - base
                for mb in mbs
                for n, r in zip(mb.doc_lens, mb.densities or [1.0] * len(mb.doc_lens), strict=True)
            ),
            default=0.0,
        )
        + base
    )
    mean_mb = float(loads.mean())
    ranks = loads.sum(axis=1)
    tokens = sum(mb.num_tokens for mb in mbs)
    row_tokens = sum(len(mb.rows) for mb in mbs) * seq_len
    safe = mean_mb if mean_mb > 0 else 1.0
    return PlanStats(
        rank_imbalance=float(ranks.max() / ranks.mean()) if ranks.mean() > 0 else 1.0,
        microbatch_imbalance=float(loads.max()) / safe,
        microbatch_bound=max(heaviest, mean_mb) / safe,
        padding=1.0 - tokens / row_tokens,
        pieces=sum(len(mb.doc_lens) for mb in mbs),
        tokens=tokens,
    )


def summarize(stats: Sequence[PlanStats]) -> dict[str, float]:
    """Mean of each ratio over steps (the figures sb-plan and the packing bench report)."""
    keys = ("rank_imbalance", "microbatch_imbalance", "microbatch_bound", "padding")
    out = {k: float(np.mean([getattr(s, k) for s in stats])) for k in keys}
    out["pieces_per_step"] = float(np.mean([s.pieces for s in stats]))
    return out
