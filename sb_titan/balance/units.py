"""Plan -> DST work units -> budgets per (DP rank, micro-batch): the one rule the
trainer and the simulator share.

Without pipeline parallelism a DP rank's micro-batches meet at the gradient reduction,
so their summed time is the unit DST balances; under PP every micro-batch crosses the
slowest stage on its own, so each micro-batch is a unit.
"""

from __future__ import annotations

from typing import NamedTuple

from sb_titan.balance.cost_model import CostModel, Unit
from sb_titan.balance.dst import DSTConfig, DSTDecision, tune_budgets
from sb_titan.balance.sab import StepPlan


def step_units(plan: StepPlan, pipelined: bool) -> list[Unit]:
    """DST's work units: each micro-batch under PP, each DP rank's micro-batches without."""
    if pipelined:
        return [[mb.doc_lens] for rank in plan.microbatches for mb in rank]
    return [[mb.doc_lens for mb in rank] for rank in plan.microbatches]


def step_budgets(
    plan: StepPlan, cost_model: CostModel, cfg: DSTConfig, policy: str, pipelined: bool
) -> tuple[list[list[float]], DSTDecision]:
    """Budget of every (DP rank, micro-batch): a pure function of the shared plan and
    the (identically refit) cost model, so every rank agrees (cfg.enabled False: beta0).
    `policy`: the selection policy the budgets feed."""
    decision = tune_budgets(step_units(plan, pipelined), cost_model, cfg, policy)
    flat = iter(decision.budgets)
    shape = [len(rank) for rank in plan.microbatches]
    if pipelined:
        return [[next(flat) for _ in range(n)] for n in shape], decision
    return [[b] * n for b, n in zip(flat, shape, strict=True)], decision


class ScheduledStep(NamedTuple):
    """A step plan with the budgets decided for it (ahead of time, in the loader)."""

    plan: StepPlan
    budgets: list[list[float]]  # [dp_rank][microbatch]
    decision: DSTDecision | None  # None without a cost model: every budget is beta0
    snapshot: str = ""  # "<trained step>:<digest>" of the cost model that planned it


def schedule_step(
    plan: StepPlan, cost_model: CostModel | None, cfg: DSTConfig, policy: str, pipelined: bool
) -> ScheduledStep:
    """`step_budgets`, or beta0 everywhere when the run has no cost model."""
    if cost_model is None:
        return ScheduledStep(plan, [[cfg.beta0] * len(r) for r in plan.microbatches], None)
    return ScheduledStep(plan, *step_budgets(plan, cost_model, cfg, policy, pipelined))
