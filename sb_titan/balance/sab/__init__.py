"""SAB, sparsity-aware batching: every step planned globally from sample metadata so
that DP ranks and micro-batches get even predicted work (docs/data.md).

    plan.py           Piece, MicroBatchPlan, StepPlan: what a plan holds
    config.py         the `[sab]` section
    cost.py           how a micro-batch is priced
    density_store.py  observed densities, visible from the step they take effect
    planner.py        Planner: one deterministic global plan per step
    packing.py        the packing and dealing heuristics of one step
    stats.py          predicted balance of a plan
"""

from sb_titan.balance.sab.config import LONG_DOC_MODES, POLICIES, SABConfig
from sb_titan.balance.sab.cost import AnalyticCost, CostFn, DensityPrior, as_cost_fn
from sb_titan.balance.sab.density_store import DensityStore
from sb_titan.balance.sab.plan import MicroBatchPlan, Piece, StepPlan
from sb_titan.balance.sab.planner import Planner
from sb_titan.balance.sab.stats import PlanStats, plan_stats, summarize

__all__ = [
    "LONG_DOC_MODES",
    "POLICIES",
    "AnalyticCost",
    "CostFn",
    "DensityPrior",
    "DensityStore",
    "MicroBatchPlan",
    "Piece",
    "PlanStats",
    "Planner",
    "SABConfig",
    "StepPlan",
    "as_cost_fn",
    "plan_stats",
    "summarize",
]
