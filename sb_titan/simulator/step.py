"""One simulated step of one variant: plan, budget, time every stage, replay, reduce."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from sb_titan.balance.balancer import Balancer, ScheduledStep
from sb_titan.balance.cost_model import CostModel
from sb_titan.balance.doc_dst import DocDecision
from sb_titan.balance.dst import DSTConfig
from sb_titan.balance.sab import SABConfig, StepPlan
from sb_titan.balance.step_shape import StepShape
from sb_titan.models.dims import ModelDims
from sb_titan.simulator.cluster import Cluster, Network
from sb_titan.simulator.heldout import RecallCurves
from sb_titan.simulator.replay import Timeline, replay
from sb_titan.simulator.schedules import schedule_orders
from sb_titan.simulator.stages import CostModels

VARIANTS = ("baseline", "sab", "dst", "sab_dst")
DOC_VARIANT = "sab_dst_doc"  # SAB + DST with per-document budgets ([dst] per_document)


def variants(dst: DSTConfig) -> tuple[str, ...]:
    """The variants a run simulates: the per-document one beside them where asked."""
    return (*VARIANTS, DOC_VARIANT) if dst.per_document else VARIANTS


BASELINE_POLICIES = ("sequential", "tokens")  # what the baseline and DST-only pack with


_DST_ON = {"baseline": False, "sab": False, "dst": True, "sab_dst": True, DOC_VARIANT: True}


def make_balancer(
    lengths: np.ndarray,
    cluster: Cluster,
    sab: SABConfig,
    policy: str,
    cost_model: CostModel,
    dst: DSTConfig,
    selection: str = "mass",
) -> Balancer:
    """The trainer's balancer for one simulated variant, with a fixed cost model (the
    simulator never refits): cost = cost_model.predict, density prior at dst.beta0."""
    shape = StepShape(cluster.seq_len, cluster.dp, cluster.microbatches, cluster.rows)
    sab = dataclasses.replace(sab, policy=policy)
    pipelined = cluster.pp > 1
    return Balancer(lengths, shape, sab, cost_model, dst, selection=selection, pipelined=pipelined)


@dataclass
class StepResult:
    step_s: float
    pipeline_s: float  # slowest DP rank's pipeline, before the reduction
    reduction_s: float
    ideal_s: float  # every micro-batch at the step's mean work, same schedule
    bubble_share: float
    rank_imbalance: float  # DP ranks' compute, max / mean
    microbatch_imbalance: float  # micro-batches' fwd+bwd over all stages, max / mean
    mean_budget: float
    recall_proxy: float  # predicted_recall (DSTDecision, or DocDecision per document)
    clamped: int
    tokens: int  # trained this step (padding excluded)
    budgets_digest: str  # DSTDecision.digest(): what a trainer rank would log
    padding: float  # share of the step's row capacity left empty
    planning_s: float = 0.0  # measured CPU seconds of SAB planning this step's plan
    dst_s: float = 0.0  # measured CPU seconds of DST deciding its budgets (both: the balancer's)
    control_s: float = 0.0  # what of both the step waits for (see Simulator.run_step)
    heldout: dict[str, float] | None = None  # recall scored by held-out curves (heldout.py)
    timeline: Timeline | None = None


@dataclass
class Simulator:
    """Everything fixed across steps: the cluster, the models, the schedule orders."""

    cluster: Cluster
    dims: ModelDims
    models: CostModels
    dst: DSTConfig
    selection: str = "mass"  # the budget's selection policy
    network: Network = field(default_factory=Network)
    bwd_over_fwd: float = 2.0
    curves: RecallCurves | None = None  # held-out recall curves to score steps with

    def __post_init__(self) -> None:
        c = self.cluster
        self.orders = schedule_orders(c.schedule, c.pp, c.microbatches, c.virtual_stages)
        self.reduction_s = max(self.network.allreduce_seconds(p, c.dp) for p in self.models.params)

    def dst_config(self, variant: str) -> DSTConfig:
        """The run's [dst] config, switched off for the variants without DST, and
        per-document budgets for the per-document variant only."""
        return dataclasses.replace(
            self.dst,
            enabled=self.dst.enabled and _DST_ON[variant],
            per_document=variant == DOC_VARIANT,
        )

    def stage_seconds(
        self, plan: StepPlan, budgets: np.ndarray, per_doc: DocDecision | None = None
    ) -> np.ndarray:
        """[n_stages, microbatches, dp] fwd+bwd seconds from each stage's cost model;
        with per-document budgets, each document's attention at its own budget in place
        of its micro-batch's (only attention depends on budgets)."""
        c = self.cluster
        units = [[mb.doc_lens] for rank in plan.microbatches for mb in rank]
        beta = budgets.reshape(-1)
        by_model: dict[int, np.ndarray] = {}
        out = np.empty((c.n_stages, c.microbatches, c.dp))
        for s, cm in enumerate(self.models.stages):
            if id(cm) not in by_model:
                seconds = cm.predict_units(units, beta, self.selection)
                if per_doc is not None:
                    seconds = seconds + self._doc_shift(cm, units, beta, per_doc)
                seconds = seconds * self.models.scale
                by_model[id(cm)] = seconds.reshape(c.dp, c.microbatches).T
            out[s] = by_model[id(cm)]
        return out

    def _doc_shift(
        self, cm: CostModel, units: list[list[list[int]]], beta: np.ndarray, per_doc: DocDecision
    ) -> np.ndarray:
        """[units] attention seconds at the documents' budgets minus at the micro-batch's."""
        counts = [len(unit[0]) for unit in units]
        lengths = np.array([n for unit in units for n in unit[0]], dtype=np.float64)
        own = np.array([b for rank in per_doc.budgets for mb in rank for b in mb])
        mb_of = np.repeat(np.arange(len(units)), counts)
        shift = cm.document_seconds(lengths, own, self.selection) - cm.document_seconds(
            lengths, beta[mb_of], self.selection
        )
        return np.bincount(mb_of, shift, len(units))

    def heldout_recall(
        self, plan: StepPlan, budgets: np.ndarray, per_doc: DocDecision | None
    ) -> dict[str, float] | None:
        """The step's recall scored by the held-out curves: every document at the budget
        it trains with (its own, or its micro-batch's)."""
        if self.curves is None:
            return None
        lengths, betas = [], []
        for dp, rank in enumerate(plan.microbatches):
            for mb, unit in enumerate(rank):
                lengths += unit.doc_lens
                own = None if per_doc is None else per_doc.budgets[dp][mb]
                betas += own if own is not None else [float(budgets[dp][mb])] * len(unit.doc_lens)
        return self.curves.score(lengths, betas)

    def run_step(
        self, scheduled: ScheduledStep, variant: str, keep_timeline: bool = False
    ) -> StepResult:
        """One variant of one step, as its balancer scheduled it: time every stage,
        replay, reduce.

        The trainer plans and budgets step t+1 in the loader's thread while step t runs
        (cost_model.plan_lag >= 2), so only what planning and DST take beyond the step
        delays training: control_s = max(0, planning_s + dst_s - step_s), both measured
        by the balancer on this host's CPU."""
        c = self.cluster
        plan, decision = scheduled.plan, scheduled.decision
        planning_s, dst_s = scheduled.planning_s, scheduled.dst_s
        budgets = np.asarray(scheduled.budgets)
        total = self.stage_seconds(plan, budgets, scheduled.doc_budgets)
        fwd = total / (1.0 + self.bwd_over_fwd)
        tokens = np.array([[mb.num_tokens for mb in rank] for rank in plan.microbatches]).T
        send = self.network.send_seconds(tokens.astype(np.float64), self.dims.dim)
        tl = replay(self.orders, fwd, total - fwd, send)
        ideal = replay(
            self.orders,
            fwd.mean(axis=(1, 2), keepdims=True).repeat(c.microbatches, 1),
            (total - fwd).mean(axis=(1, 2), keepdims=True).repeat(c.microbatches, 1),
            np.full((c.microbatches, 1), send.mean()),
        )
        pipeline = float(tl.makespan.max())
        rank_compute = tl.busy.sum(axis=0)
        mb_work = total.sum(axis=0).reshape(-1)
        capacity = c.dp * c.microbatches * c.rows * c.seq_len
        step_s = pipeline + self.reduction_s
        return StepResult(
            step_s=step_s,
            pipeline_s=pipeline,
            reduction_s=self.reduction_s,
            ideal_s=float(ideal.makespan[0]) + self.reduction_s,
            bubble_share=1.0 - float(tl.busy.sum()) / (c.pp * c.dp * pipeline),
            rank_imbalance=float(rank_compute.max() / rank_compute.mean()),
            microbatch_imbalance=float(mb_work.max() / mb_work.mean()),
            mean_budget=float(budgets.mean()),
            recall_proxy=(
                decision if scheduled.doc_budgets is None else scheduled.doc_budgets
            ).predicted_recall,
            clamped=decision.n_clamped if self.dst_config(variant).enabled else 0,
            tokens=int(tokens.sum()),
            budgets_digest=decision.digest(),
            padding=1.0 - float(tokens.sum()) / capacity,
            planning_s=planning_s,
            dst_s=dst_s,
            control_s=max(0.0, planning_s + dst_s - step_s),
            heldout=self.heldout_recall(plan, budgets, scheduled.doc_budgets),
            timeline=tl if keep_timeline else None,
        )
