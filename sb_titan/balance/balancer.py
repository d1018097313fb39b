"""The SparseBalance control loop in one object: plan a step, budget it, learn from it.

    next_step()          SAB packs the next global step, DST budgets it: a ScheduledStep
    observe(plan, m)     the step's measurements refit the cost model, its density and
                         recall models and SAB's density store, and publish the model
                         that plans step + plan_lag

The trainer's loader thread calls `next_step` ahead of training and only packs what it
decided; the trainer calls `observe` once per step; `sb-simulate` and `sb-plan` drive
the same object. It is the only place in the recipe that builds a planner or runs DST,
so a change of balancing policy is a change here (tests/test_architecture.py).

Plans and budgets are pure functions of the shared plan state and of a cost model every
rank holds bit for bit, so every rank decides the same; planning ahead uses the lagged
snapshots of balance/snapshots.py, so plans never depend on thread timing.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from sb_titan.balance.cost_model import CostModel, Unit
from sb_titan.balance.doc_dst import DocDecision, step_doc_budgets
from sb_titan.balance.dst import DSTConfig, DSTDecision, tune_budgets
from sb_titan.balance.measurements import StepMeasurements
from sb_titan.balance.sab import CostFn, DensityPrior, Planner, SABConfig, StepPlan
from sb_titan.balance.snapshots import CostModelSnapshots, PlanningCancelled
from sb_titan.balance.step_shape import StepShape


class ScheduledStep(NamedTuple):
    """A step plan with the budgets decided for it (ahead of time, by the balancer)."""

    plan: StepPlan
    budgets: list[list[float]]  # [dp_rank][microbatch]
    decision: DSTDecision | None  # None without a cost model: every budget is beta0
    snapshot: str = ""  # "<trained step>:<digest>" of the cost-model snapshot that planned it
    planning_s: float = 0.0  # measured CPU seconds of packing (this host, not deterministic)
    dst_s: float = 0.0  # measured CPU seconds of DST deciding the budgets
    doc_budgets: DocDecision | None = None  # per document ([dst] per_document), else None

    def row_budgets(self, dp: int, mb: int, n_rows: int) -> list[list[float]]:
        """Micro-batch (dp, mb)'s budget of each row's documents ([b][d]), as
        attention.layout.block_budgets takes them: its DST budget row-wide, or with
        per-document budgets each document's own."""
        if self.doc_budgets is None:
            return [[self.budgets[dp][mb]]] * n_rows
        rows = self.doc_budgets.rows(self.plan, dp, mb)
        if len(rows) != n_rows:
            raise ValueError(f"micro-batch ({dp}, {mb}) has {len(rows)} rows, not {n_rows}")
        return rows


def step_units(plan: StepPlan, pipelined: bool) -> list[Unit]:
    """DST's work units. Without pipeline parallelism a DP rank's micro-batches meet at
    the gradient reduction, so their summed time is a unit; under PP every micro-batch
    crosses the slowest stage on its own, so each micro-batch is a unit."""
    if pipelined:
        return [[mb.doc_lens] for rank in plan.microbatches for mb in rank]
    return [[mb.doc_lens for mb in rank] for rank in plan.microbatches]


def step_budgets(
    plan: StepPlan, cost_model: CostModel | None, cfg: DSTConfig, policy: str, pipelined: bool
) -> tuple[list[list[float]], DSTDecision | None]:
    """Budget of every (DP rank, micro-batch): a pure function of the shared plan and
    the (identically refit) cost model, so every rank agrees (cfg.enabled False, or no
    cost model: beta0). `policy`: the selection policy the budgets feed."""
    if cost_model is None:
        return [[cfg.beta0] * len(rank) for rank in plan.microbatches], None
    decision = tune_budgets(step_units(plan, pipelined), cost_model, cfg, policy)
    flat = iter(decision.budgets)
    shape = [len(rank) for rank in plan.microbatches]
    if pipelined:
        return [[next(flat) for _ in range(n)] for n in shape], decision
    return [[b] * n for b, n in zip(flat, shape, strict=True)], decision


class _PieceCost:
    """cost_model.predict, memoised for single documents (the planner prices every
    piece alone). A priced model is never refit (a snapshot, or a fixed model), so that
    price is a pure function."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self._memo: dict[tuple[int, float], float] = {}

    def __call__(self, doc_lens: Sequence[int], densities: Sequence[float]) -> float:
        if len(doc_lens) != 1:
            return self.cost_model.predict(doc_lens, densities)
        key = (int(doc_lens[0]), float(densities[0]))
        if key not in self._memo:
            self._memo[key] = self.cost_model.predict(doc_lens, densities)
        return self._memo[key]


def token_count_cost(doc_lens: Sequence[int]) -> float:
    """Stand-in 'latency' when no cost model is configured (only the `sequential` and
    `tokens` policies run without one): tokens plus the quadratic attention term."""
    return float(sum(doc_lens)) + float(sum(n * n for n in doc_lens)) / 4096.0


class Balancer:
    """Plans, budgets and learns for one run (or one simulated variant).

    `cost_model`: prices pieces for SAB and decides DST's budgets; None prices by
    `cost_fn` (default: token counts) and gives every micro-batch dst.beta0.
    `plan_lag`: step t is planned with the model as refit after step t - plan_lag
    (the trainer: it plans ahead in another thread while it refits); None plans with
    the model as given, which then never changes (sb-simulate, sb-plan).
    `pipelined`: under PP every micro-batch is its own DST unit.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        shape: StepShape,
        sab: SABConfig,
        cost_model: CostModel | None = None,
        dst: DSTConfig | None = None,
        *,
        selection: str = "mass",
        pipelined: bool = False,
        plan_lag: int | None = None,
        refit: bool = True,
        cost_fn: CostFn | Callable[[Sequence[int]], float] = token_count_cost,
    ) -> None:
        self.shape = shape
        self.cost_model = cost_model
        self.dst = dst or DSTConfig()
        self.selection = selection
        self.pipelined = pipelined
        self.refit = refit
        self._cost_fn = cost_fn
        self._snapshots = None
        if cost_model is not None and plan_lag is not None:
            self._snapshots = CostModelSnapshots(cost_model, plan_lag)
        self._priced = self._planning_model(0)
        self.planner = Planner(
            lengths,
            seq_len=shape.seq_len,
            dp=shape.dp,
            microbatches=shape.microbatches,
            rows_per_microbatch=shape.rows,
            config=sab,
            **self._pricing(self._priced),
        )
        # The plan state before any step (snapshots leave the density store out: the
        # loader checkpoints it live).
        self._fresh = self.planner.state_dict(observations=False)
        self._lock = threading.Lock()  # between planning and a reset of the plan state

    # -- planning ------------------------------------------------------------------------
    def _planning_model(
        self, step: int, cancelled: Callable[[], bool] = lambda: False
    ) -> CostModel | None:
        """The model that plans `step` (waits for the trainer to publish it)."""
        if self._snapshots is None:
            return self.cost_model
        return self._snapshots.model_for(step, cancelled)

    def _pricing(self, model: CostModel | None) -> dict[str, Any]:
        """SAB's cost function and density prior (at beta0) from one cost model."""
        if model is None:
            return {"cost_fn": self._cost_fn, "density_prior": None}
        beta0, selection = self.dst.beta0, self.selection
        prior: DensityPrior = functools.cache(
            lambda n: model.density_for_budget(beta0, n, selection)
        )
        return {"cost_fn": _PieceCost(model), "density_prior": prior}

    def next_step(self, cancelled: Callable[[], bool] = lambda: False) -> ScheduledStep:
        """The next global step: its plan and the budget of every (DP rank, micro-batch).
        Raises PlanningCancelled when `cancelled()` turns true (or the balancer is
        closed) while it waits for the cost model that plans this step."""
        step = self.planner.state.step
        model = self._planning_model(step, cancelled)
        start = time.perf_counter()
        with self._lock:
            if cancelled():
                raise PlanningCancelled(f"planning step {step}: the plan state was reset")
            if model is not self._priced:
                self.planner.price_with(**self._pricing(model))
                self._priced = model
            plan = self.planner.next_step()
        planned = time.perf_counter()
        budgets, decision = step_budgets(plan, model, self.dst, self.selection, self.pipelined)
        per_doc = self._doc_budgets(plan, budgets, decision, model)
        done = time.perf_counter()
        snapshot = ""
        if self._snapshots is not None:
            snapshot = f"{self._snapshots.source_step(plan.step)}:{model.digest()}"
        return ScheduledStep(
            plan, budgets, decision, snapshot, planned - start, done - planned, per_doc
        )

    def _doc_budgets(
        self,
        plan: StepPlan,
        budgets: list[list[float]],
        decision: DSTDecision | None,
        model: CostModel | None,
    ) -> DocDecision | None:
        """Per-document budgets within the micro-batch budgets ([dst] per_document;
        None without it or without a cost model)."""
        if not self.dst.per_document or model is None:
            return None
        return step_doc_budgets(plan, budgets, decision, model, self.dst, self.selection)

    def verify(self, scheduled: ScheduledStep) -> None:
        """Debug (dst.verify_ranks): the budgets decided ahead equal budgets decided now
        from the serialized snapshot that planned the step (what a resumed run uses)."""
        plan = scheduled.plan
        model = self.cost_model
        if self._snapshots is not None:
            model = self._snapshots.rebuild(plan.step)
        budgets, decision = step_budgets(plan, model, self.dst, self.selection, self.pipelined)
        per_doc = self._doc_budgets(plan, budgets, decision, model)
        if budgets != scheduled.budgets or per_doc != scheduled.doc_budgets:
            raise RuntimeError(
                f"step {plan.step}: budgets decided ahead {scheduled.budgets} "
                f"({scheduled.doc_budgets}) differ from budgets decided in place {budgets} "
                f"({per_doc})"
            )

    # -- learning --------------------------------------------------------------------------
    def observe(
        self, plan: StepPlan, m: StepMeasurements, *, fit_latency: bool = True
    ) -> dict[tuple[int, int], float] | None:
        """Learn from a trained step (the same gathered measurements on every rank):
        refit the cost model's latency (unless `fit_latency` is False: a step whose
        times carry one-off work), its density and recall models, feed SAB the
        densities of the step's samples, and publish the model that plans step
        plan.step + plan_lag. Returns what the model predicted for each measured
        (DP rank, micro-batch) before this refit (its honest error); None without one."""
        model, predicted = self.cost_model, None
        if model is not None:
            if self._snapshots is None:
                raise RuntimeError("a balancer without plan_lag plans with a fixed cost model")
            predicted = {
                (dp, mb): model.predict_budget(
                    plan.microbatches[dp][mb].doc_lens, m.budgets[dp][mb], self.selection
                )
                for dp, mb in m.seconds
            }
            observations = m.observations(plan)
            if self.refit and observations and fit_latency:
                model.refit(observations)
            model.density_model.update(m.density_observations(plan))
            recall = model.recall_model
            recall.update(m.recall_observations(plan, recall.block_size, recall.measure))
        ids, densities = m.sample_densities(plan)
        self.planner.observe(ids, densities, step=plan.step)
        if model is not None and self.dst.learns_doc_history and m.doc_sums:
            measure, half = model.recall_model.measure, self.dst.doc_history_blocks
            ids, rows = m.document_recalls(plan, model.block_size, measure, half)
            self.planner.observe_recalls(ids, rows, step=plan.step)
        if self._snapshots is not None:
            self._snapshots.publish(plan.step, model)
        return predicted

    def close(self) -> None:
        """Wake a planner waiting for a snapshot with PlanningCancelled (shutdown)."""
        if self._snapshots is not None:
            self._snapshots.close()

    # -- state ---------------------------------------------------------------------------
    def plan_state(self) -> dict:
        """Where planning stands (per DP rank's loader checkpoint), without observations."""
        return self.planner.state_dict(observations=False)

    def load_plan_state(self, state: dict | None) -> None:
        """Plan from `state` on (None: from the first step)."""
        with self._lock:
            self.planner.load_state_dict(self._fresh if state is None else state)

    def observation_state(self) -> dict:
        return self.planner.observation_state()

    def load_observation_state(self, state: dict) -> None:
        self.planner.load_observation_state(state)

    def state_dict(self) -> dict[str, str]:
        """The learnt cost model and the snapshots pending steps are planned with (the
        trainer's checkpoint; resume re-plans with exactly the same models)."""
        if self.cost_model is None:
            return {}
        out = {"cost_model": json.dumps(self.cost_model.state_dict())}
        if self._snapshots is not None:
            out["cost_model_snapshots"] = json.dumps(self._snapshots.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any], trained_step: int) -> bool:
        """Restore `state_dict()`'s keys; `trained_step` is the last step the checkpoint
        trained. Returns False when the checkpoint has no snapshots (written before
        planning ahead): its model then plans every step still pending."""
        if self.cost_model is None or "cost_model" not in state:
            return True
        self.cost_model.load_state_dict(json.loads(state["cost_model"]))
        if self._snapshots is None:
            return True
        if "cost_model_snapshots" in state:
            self._snapshots.load_state_dict(json.loads(state["cost_model_snapshots"]))
            return True
        self._snapshots.adopt(self.cost_model, trained_step)
        return False
