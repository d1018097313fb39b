"""The cost model: predicted latency of a micro-batch from a profiled table, its inverse
(the budget that meets a target time), and what it learns online (density, recall).

    profile.py    the measured table and its file format
    analytic.py   a FLOP-based table for when nothing was measured (explicit opt-in)
    blocks.py     block-pair arithmetic shared by the models
    density.py    budget -> realised density (`mass` policy)
    recall.py     budget -> kept attention mass (DST's recall anchor)
    knot_means.py the windowed per-knot means density and recall tables share
    fingerprint.py whether a profile describes the run (shape refused, environment warns)
    model.py      CostModel: predict, invert, refit; the `[cost_model]` config
"""

from sb_titan.balance.cost_model.analytic import (
    ANALYTIC_DEVICES,
    AnalyticSpec,
    analytic_profile,
    analytic_spec,
    analytic_stage_spec,
)
from sb_titan.balance.cost_model.blocks import POLICIES, MicroBatch, Unit, block_pairs
from sb_titan.balance.cost_model.density import DensityModel
from sb_titan.balance.cost_model.model import (
    BudgetSolution,
    CostModel,
    CostModelConfig,
    LatencyObservation,
    UnitBatch,
    build_cost_model,
)
from sb_titan.balance.cost_model.profile import Profile, ProfileError, ProfileNotFoundError
from sb_titan.balance.cost_model.recall import RecallModel

__all__ = [
    "ANALYTIC_DEVICES",
    "POLICIES",
    "AnalyticSpec",
    "BudgetSolution",
    "CostModel",
    "CostModelConfig",
    "DensityModel",
    "LatencyObservation",
    "MicroBatch",
    "Profile",
    "ProfileError",
    "ProfileNotFoundError",
    "RecallModel",
    "Unit",
    "UnitBatch",
    "analytic_profile",
    "analytic_spec",
    "analytic_stage_spec",
    "block_pairs",
    "build_cost_model",
]
