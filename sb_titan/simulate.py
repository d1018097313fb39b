"""`sb-simulate`: SAB and DST at 8-1024 GPUs, replayed on a CPU.

Per step: documents come from a length distribution (longtail-v1 or an indexed
dataset's lengths), the project's own `sab.Planner` packs them (policy `sequential`,
or `tokens`, for the baseline and DST-only, `sab` for SAB and SAB+DST), the project's own
`dst.tune_budgets` gives every work unit its budget (DST off: beta0 everywhere), the
project's own `CostModel` times every micro-batch on every pipeline stage, and the
pipeline schedule is replayed event by event in the order torch.distributed.pipelining
runs it (1F1B, Interleaved1F1B, GPipe). DP ranks wait for the slowest at the
gradient reduction. Nothing here re-implements planning, budgeting or cost prediction:
the simulator only adds the schedule replay and the cluster's communication.
See docs/simulate.md for the method, the assumptions and results.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sb_titan.balance.cost_model import (
    ANALYTIC_DEVICES,
    CostModel,
    DensityModel,
    analytic_stage_spec,
)
from sb_titan.balance.dst import ANCHORS, DSTConfig
from sb_titan.balance.sab import Planner, SABConfig, StepPlan
from sb_titan.balance.units import step_budgets
from sb_titan.data.longtail import longtail_v1
from sb_titan.models.qwen2_5 import FLAVORS, Qwen25Dims

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")
VARIANTS = ("baseline", "sab", "dst", "sab_dst")
BASELINE_POLICIES = ("sequential", "tokens")  # what the baseline and DST-only pack with
_DST_ON = {"baseline": False, "sab": False, "dst": True, "sab_dst": True}
JSON_FORMAT = "sb_titan.simulate"
JSON_VERSION = 1


# ----------------------------------------------------------------------------- assumptions


@dataclass(frozen=True, slots=True)
class Network:
    """Communication: activations between pipeline stages, gradients across DP ranks."""

    p2p_gbps: float = 100.0  # GB/s per stage boundary (NVLink within a node)
    p2p_latency_s: float = 20e-6
    allreduce_gbps: float = 50.0  # GB/s per GPU for the ring (400 Gb/s InfiniBand)
    allreduce_latency_s: float = 100e-6
    activation_bytes: int = 2  # bf16 activations and activation gradients
    grad_bytes: int = 4  # fp32 gradient reduction (TorchTitan's default reduce dtype)

    def send_seconds(self, tokens: np.ndarray, hidden: int) -> np.ndarray:
        """One micro-batch's activations (or their gradient) across a stage boundary."""
        return self.p2p_latency_s + tokens * hidden * self.activation_bytes / (self.p2p_gbps * 1e9)

    def allreduce_seconds(self, params: int, dp: int) -> float:
        """Ring all-reduce of one pipeline rank's gradients, not overlapped (worst case)."""
        if dp <= 1:
            return 0.0
        volume = 2 * (dp - 1) / dp * params * self.grad_bytes
        return self.allreduce_latency_s * 2 * (dp - 1) + volume / (self.allreduce_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class Cluster:
    dp: int
    pp: int
    microbatches: int
    schedule: str = "1F1B"
    virtual_stages: int = 1  # model chunks per pipeline rank (Interleaved1F1B: >= 2)
    rows: int = 1  # rows of seq_len tokens per micro-batch
    seq_len: int = 65536

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if min(self.dp, self.pp, self.microbatches, self.virtual_stages, self.rows) < 1:
            raise ValueError("dp, pp, microbatches, virtual_stages and rows must be >= 1")
        if self.schedule == "Interleaved1F1B" and self.virtual_stages < 2:
            raise ValueError("Interleaved1F1B needs virtual_stages >= 2")
        if self.schedule != "Interleaved1F1B" and self.virtual_stages != 1:
            raise ValueError(f"{self.schedule} runs one stage per rank (virtual_stages=1)")

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def gpus(self) -> int:
        return self.dp * self.pp


# ----------------------------------------------------------------------------- schedules


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # "F" | "B" (full backward)
    stage: int  # global stage index; it runs on pipeline rank stage % pp
    mb: int


def _single_stage_order(schedule: str, pp: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward. 1F1B as torch's Schedule1F1B runs it:
    min(m, pp - stage) warm-up forwards, then backward/forward pairs, then cool-down."""
    if schedule == "GPipe":
        return [Action(k, stage, i) for k in "FB" for i in range(m)]
    warmup = min(m, pp - stage)
    order = [Action("F", stage, i) for i in range(warmup)]
    for i in range(m):
        order.append(Action("B", stage, i))
        if warmup + i < m:
            order.append(Action("F", stage, warmup + i))
    return order


def schedule_orders(
    schedule: str, pp: int, microbatches: int, virtual: int = 1
) -> list[list[Action]]:
    """Per pipeline rank, its compute actions in the order the schedule runs them.

    1F1B and GPipe follow torch.distributed.pipelining's runtime loops (their IR
    generator `_get_pipeline_order` is off by one on the last stage in torch 2.13);
    Interleaved1F1B is torch's own `_calculate_single_rank_operations`, the order its
    runtime executes, built without stages or process groups. Without PP: gradient
    accumulation, forward then backward per micro-batch.
    """
    if pp == 1:
        return [[Action(k, 0, i) for i in range(microbatches) for k in "FB"]]
    if schedule in ("1F1B", "GPipe"):
        return [_single_stage_order(schedule, pp, microbatches, s) for s in range(pp)]
    from torch.distributed.pipelining import schedules as S

    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise ValueError(
            f"Interleaved1F1B needs microbatches ({microbatches}) to be a multiple of "
            f"max(1, microbatches // pp) = {rounds}"
        )
    sched = object.__new__(S.ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages = pp, virtual
    sched._n_microbatches, sched.number_of_rounds = microbatches, rounds
    sched.microbatches_per_round = microbatches // rounds
    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    orders = [
        [
            Action(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(r)
            if a is not None and a.computation_type in kinds
        ]
        for r in range(pp)
    ]
    expected = {(k, s, i) for k in "FB" for s in range(pp * virtual) for i in range(microbatches)}
    got = [(a.kind, a.stage, a.mb) for order in orders for a in order]
    if len(got) != len(expected) or set(got) != expected:
        raise RuntimeError(f"torch's Interleaved1F1B order (pp={pp}, m={microbatches}) is invalid")
    return orders


def closed_form_step_s(schedule: str, microbatches: int, pp: int, t: float, virtual: int = 1):
    """Balanced pipeline, t = fwd+bwd of one micro-batch on one rank, no send latency."""
    if schedule == "Interleaved1F1B":
        return (microbatches + (pp - 1) / virtual) * t
    return (microbatches + pp - 1) * t


# ----------------------------------------------------------------------------- replay


@dataclass
class Timeline:
    """One step's replay, vectorised over DP ranks (all run the same order)."""

    events: list[tuple[int, Action, np.ndarray, np.ndarray]]  # (pp rank, action, start, end)
    makespan: np.ndarray  # [dp] seconds until the last backward of each DP rank
    busy: np.ndarray  # [pp, dp] compute seconds of each (pipeline rank, DP rank)


def replay(
    orders: list[list[Action]], fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray
) -> Timeline:
    """Event-by-event replay of per-rank action orders.

    fwd, bwd: [n_stages, microbatches, dp] seconds; send: [microbatches, dp] seconds per
    stage boundary. F(s, i) needs F(s-1, i) plus a send; B(s, i) needs B(s+1, i) plus a
    send (the last stage: its own F); each rank runs its actions in order, one at a time.
    """
    n_stages, _, dp = fwd.shape
    pp = len(orders)
    done: dict[tuple[str, int, int], np.ndarray] = {}
    free = [np.zeros(dp) for _ in range(pp)]
    busy = np.zeros((pp, dp))
    ptr = [0] * pp
    events = []
    zero = np.zeros(dp)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                a = orders[r][ptr[r]]
                if a.kind == "F":
                    deps = [(("F", a.stage - 1, a.mb), send[a.mb])] if a.stage else []
                    dur = fwd[a.stage, a.mb]
                elif a.stage == n_stages - 1:
                    deps, dur = [(("F", a.stage, a.mb), zero)], bwd[a.stage, a.mb]
                else:
                    deps = [(("B", a.stage + 1, a.mb), send[a.mb]), (("F", a.stage, a.mb), zero)]
                    dur = bwd[a.stage, a.mb]
                if any(key not in done for key, _ in deps):
                    break
                start = free[r]
                for key, lag in deps:
                    start = np.maximum(start, done[key] + lag)
                end = start + dur
                done[(a.kind, a.stage, a.mb)] = end
                free[r] = end
                busy[r] += dur
                events.append((r, a, start, end))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [orders[r][ptr[r]] for r in range(pp) if ptr[r] < len(orders[r])]
            raise RuntimeError(f"schedule replay deadlocked at {stuck}")
    return Timeline(events, np.max([e[3] for e in events], axis=0), busy)


# ----------------------------------------------------------------------------- cost models


@dataclass(frozen=True, slots=True)
class StageSplit:
    """Layers per global stage as TorchTitan splits them, and where embedding/head live."""

    layers: tuple[int, ...]
    embedding: tuple[bool, ...]
    head: tuple[bool, ...]


def stage_split(
    n_layers: int, n_stages: int, first_less: int = 1, last_less: int = 1
) -> StageSplit:
    """TorchTitan's own split (`_generate_llm_fqn_per_model_part`): the first and last
    stages take `*_less` fewer layers for the embedding and the output head."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    parts = _generate_llm_fqn_per_model_part(n_stages, n_layers, first_less, last_less)
    return StageSplit(
        layers=tuple(sum(m.startswith("layers.") for m in p) for p in parts),
        embedding=tuple("tok_embeddings" in p for p in parts),
        head=tuple(s == n_stages - 1 for s in range(n_stages)),
    )


def stage_params(dims: Qwen25Dims, layers: int, embedding: bool, head: bool) -> int:
    """Parameters whose gradients a stage reduces (q/k/v/o, SwiGLU, embedding, head)."""
    proj = dims.dim * dims.head_dim * (2 * dims.n_heads + 2 * dims.n_kv_heads)
    params = layers * (proj + 3 * dims.dim * dims.hidden_dim)
    tied_whole_model = embedding and head and dims.tie_embeddings
    params += dims.vocab_size * dims.dim * (int(embedding) + int(head) - int(tied_whole_model))
    return params


@dataclass
class CostModels:
    """`planning`: the slowest pipeline rank's model, what SAB and DST see (DESIGN.md:
    DST's unit under PP is the micro-batch on the slowest stage). `stages`: one per
    global stage, for the replay; `scale` multiplies their predictions."""

    planning: CostModel
    stages: list[CostModel]
    scale: float
    params: list[int]  # per pipeline rank
    description: str


def build_cost_models(
    dims: Qwen25Dims,
    cluster: Cluster,
    *,
    device: str | None,
    profile: str | None,
    block_size: int,
    beta0: float,
    policy: str,
    density_exponent: float = 1.0,
    first_less: int = 1,
    last_less: int = 1,
) -> CostModels:
    """Per-stage analytic models, or one measured profile for every stage."""
    split = stage_split(dims.n_layers, cluster.n_stages, first_less, last_less)
    pp = cluster.pp
    rank_of = [s % pp for s in range(cluster.n_stages)]
    params = [0] * pp
    for s, r in enumerate(rank_of):
        params[r] += stage_params(dims, split.layers[s], split.embedding[s], split.head[s])
    density = DensityModel(prior_exponent=density_exponent)
    if profile is not None:
        cm = CostModel.from_file(profile, density_model=density)
        desc = f"profile {profile} (one stage; every rank, 1/{cluster.virtual_stages} per chunk)"
        return CostModels(cm, [cm] * cluster.n_stages, 1.0 / cluster.virtual_stages, params, desc)
    if device is None:
        raise ValueError("need an analytic device or a profile")
    cache: dict[tuple[int, bool], CostModel] = {}

    def model(layers: int, head: bool) -> CostModel:
        if (layers, head) not in cache:
            spec = analytic_stage_spec(dims, layers, head, device, block_size)
            cache[(layers, head)] = CostModel.analytic(spec, density_model=density)
        return cache[(layers, head)]

    stages = [model(split.layers[s], split.head[s]) for s in range(cluster.n_stages)]
    per_rank = [
        (
            sum(split.layers[s] for s in range(cluster.n_stages) if rank_of[s] == r),
            any(split.head[s] for s in range(cluster.n_stages) if rank_of[s] == r),
        )
        for r in range(pp)
    ]
    row = [cluster.seq_len]
    slowest = max(per_rank, key=lambda lh: model(*lh).predict_budget(row, beta0, policy))
    desc = (
        f"analytic {device}: layers per stage {list(split.layers)}, head on the last; "
        f"planning/DST on the slowest rank ({slowest[0]} layers{', head' if slowest[1] else ''})"
    )
    return CostModels(model(*slowest), stages, 1.0, params, desc)


# ----------------------------------------------------------------------------- planning


class _PieceCostCache:
    """cost_model.predict, memoised for single documents (the planner prices every
    piece alone). The simulator never refits, so that price is a pure function."""

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


def make_planner(
    lengths: np.ndarray,
    cluster: Cluster,
    sab: SABConfig,
    policy: str,
    cost_model: CostModel,
    dst: DSTConfig,
) -> Planner:
    """The trainer's planner: cost = cost_model.predict, density prior at beta0."""
    prior = functools.cache(lambda n: cost_model.density_for_budget(dst.beta0, n, dst.policy))
    return Planner(
        lengths,
        seq_len=cluster.seq_len,
        dp=cluster.dp,
        microbatches=cluster.microbatches,
        rows_per_microbatch=cluster.rows,
        config=dataclasses.replace(sab, policy=policy),
        cost_fn=_PieceCostCache(cost_model),
        density_prior=prior,
    )


# ----------------------------------------------------------------------------- one step


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
    recall_proxy: float  # DSTDecision.predicted_recall: token-mean recall lower bound
    clamped: int
    tokens: int  # trained this step (padding excluded)
    budgets_digest: str  # DSTDecision.digest(): what a trainer rank would log
    padding: float  # share of the step's row capacity left empty
    timeline: Timeline | None = None


@dataclass
class Simulator:
    """Everything fixed across steps: the cluster, the models, the schedule orders."""

    cluster: Cluster
    dims: Qwen25Dims
    models: CostModels
    dst: DSTConfig
    network: Network = field(default_factory=Network)
    bwd_over_fwd: float = 2.0

    def __post_init__(self) -> None:
        c = self.cluster
        self.orders = schedule_orders(c.schedule, c.pp, c.microbatches, c.virtual_stages)
        self.reduction_s = max(self.network.allreduce_seconds(p, c.dp) for p in self.models.params)

    def dst_config(self, variant: str) -> DSTConfig:
        """The run's [dst] config, switched off for the variants without DST."""
        return dataclasses.replace(self.dst, enabled=self.dst.enabled and _DST_ON[variant])

    def stage_seconds(self, plan: StepPlan, budgets: np.ndarray) -> np.ndarray:
        """[n_stages, microbatches, dp] fwd+bwd seconds from each stage's cost model."""
        c = self.cluster
        units = [[mb.doc_lens] for rank in plan.microbatches for mb in rank]
        beta = budgets.reshape(-1)
        by_model: dict[int, np.ndarray] = {}
        out = np.empty((c.n_stages, c.microbatches, c.dp))
        for s, cm in enumerate(self.models.stages):
            if id(cm) not in by_model:
                seconds = cm.predict_units(units, beta, self.dst.policy) * self.models.scale
                by_model[id(cm)] = seconds.reshape(c.dp, c.microbatches).T
            out[s] = by_model[id(cm)]
        return out

    def run_step(self, plan: StepPlan, variant: str, keep_timeline: bool = False) -> StepResult:
        """One variant of one step: budget it, time every stage, replay, reduce."""
        c = self.cluster
        budgets, decision = step_budgets(
            plan, self.models.planning, self.dst_config(variant), c.pp > 1
        )
        budgets = np.asarray(budgets)
        total = self.stage_seconds(plan, budgets)
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
        return StepResult(
            step_s=pipeline + self.reduction_s,
            pipeline_s=pipeline,
            reduction_s=self.reduction_s,
            ideal_s=float(ideal.makespan[0]) + self.reduction_s,
            bubble_share=1.0 - float(tl.busy.sum()) / (c.pp * c.dp * pipeline),
            rank_imbalance=float(rank_compute.max() / rank_compute.mean()),
            microbatch_imbalance=float(mb_work.max() / mb_work.mean()),
            mean_budget=float(budgets.mean()),
            recall_proxy=decision.predicted_recall,
            clamped=decision.n_clamped if self.dst_config(variant).enabled else 0,
            tokens=int(tokens.sum()),
            budgets_digest=decision.digest(),
            padding=1.0 - float(tokens.sum()) / capacity,
            timeline=tl if keep_timeline else None,
        )


# ----------------------------------------------------------------------------- a run


@dataclass
class Scenario:
    """What a run needs besides the cluster: model, data, planner and DST settings."""

    flavor: str = "3b"
    lengths: np.ndarray | None = None  # None: longtail-v1 at seq_len
    data_name: str = "longtail-v1"
    seed: int = 0
    steps: int = 10
    sab: SABConfig = field(default_factory=SABConfig)
    dst: DSTConfig = field(default_factory=DSTConfig)
    block_size: int = 64
    device: str | None = "h200"
    profile: str | None = None
    baseline_policy: str = "sequential"
    density_exponent: float = 1.0
    network: Network = field(default_factory=Network)
    bwd_over_fwd: float = 2.0
    first_less: int = 1
    last_less: int = 1


def draw_lengths(cluster: Cluster, steps: int, seed: int) -> np.ndarray:
    """Enough longtail-v1 documents for every step to see fresh ones (the planner
    would start a new epoch otherwise, which is harmless)."""
    pilot = longtail_v1(4096, cluster.seq_len, seed + 1).mean()
    tokens = steps * cluster.dp * cluster.microbatches * cluster.rows * cluster.seq_len
    return longtail_v1(int(1.2 * tokens / pilot) + 1024, cluster.seq_len, seed)


def build_simulator(cluster: Cluster, sc: Scenario) -> Simulator:
    dims = FLAVORS[sc.flavor]
    models = build_cost_models(
        dims,
        cluster,
        device=sc.device if sc.profile is None else None,
        profile=sc.profile,
        block_size=sc.block_size,
        beta0=sc.dst.beta0,
        policy=sc.dst.policy,
        density_exponent=sc.density_exponent,
        first_less=sc.first_less,
        last_less=sc.last_less,
    )
    return Simulator(cluster, dims, models, sc.dst, sc.network, sc.bwd_over_fwd)


def simulate(
    cluster: Cluster, sc: Scenario, progress: bool = False
) -> tuple[dict[str, Any], dict[str, StepResult]]:
    """Run every variant for sc.steps steps; (report, step-0 results with timelines)."""
    sim = build_simulator(cluster, sc)
    lengths = sc.lengths if sc.lengths is not None else draw_lengths(cluster, sc.steps, sc.seed)
    sab = dataclasses.replace(sc.sab, seed=sc.seed)
    planners = {
        policy: make_planner(lengths, cluster, sab, policy, sim.models.planning, sc.dst)
        for policy in (sc.baseline_policy, "sab")
    }
    results: dict[str, list[StepResult]] = {v: [] for v in VARIANTS}
    first: dict[str, StepResult] = {}
    t0 = time.perf_counter()
    for step in range(sc.steps):
        plans = {policy: p.next_step() for policy, p in planners.items()}
        for v in VARIANTS:
            policy = "sab" if v.startswith("sab") else sc.baseline_policy
            r = sim.run_step(plans[policy], v, keep_timeline=step == 0)
            if step == 0:
                first[v] = r
            results[v].append(r)
        if progress:
            line = "  ".join(f"{v} {results[v][-1].step_s:.2f}s" for v in VARIANTS)
            elapsed = time.perf_counter() - t0
            print(
                f"[sb-simulate] step {step + 1}/{sc.steps}  {line}  ({elapsed:.0f}s)",
                file=sys.stderr,
            )
    return report(cluster, sc, sim, results), first


def report(
    cluster: Cluster, sc: Scenario, sim: Simulator, results: dict[str, list[StepResult]]
) -> dict[str, Any]:
    """Means over steps per variant, and everything needed to reproduce them.

    Speedup is a throughput ratio (tokens per second): the sequential baseline pads
    rows where a document does not fit, so its steps hold fewer tokens than SAB's.
    """

    def throughput(rs: list[StepResult]) -> float:
        return sum(r.tokens for r in rs) / sum(r.step_s for r in rs)

    base = throughput(results["baseline"])
    base_step = float(np.mean([r.step_s for r in results["baseline"]]))
    variants = {}
    for v, rs in results.items():
        step = float(np.mean([r.step_s for r in rs]))
        ideal = float(np.mean([r.ideal_s for r in rs]))
        budget = float(np.mean([r.mean_budget for r in rs]))
        n_units = cluster.dp * cluster.microbatches if cluster.pp > 1 else cluster.dp
        variants[v] = {
            "step_time_s": step,
            "speedup_vs_baseline": throughput(rs) / base,
            "step_time_ratio_vs_baseline": base_step / step,
            "tokens_per_step": float(np.mean([r.tokens for r in rs])),
            "tokens_per_s": throughput(rs),
            "padding_share": float(np.mean([r.padding for r in rs])),
            "bubble_share": float(np.mean([r.bubble_share for r in rs])),
            "imbalance_max_over_mean": float(np.mean([r.rank_imbalance for r in rs])),
            "microbatch_imbalance_max_over_mean": float(
                np.mean([r.microbatch_imbalance for r in rs])
            ),
            "ideal_bound_s": ideal,
            "step_over_ideal": step / ideal,
            "reduction_s": float(np.mean([r.reduction_s for r in rs])),
            "mean_budget": budget,
            "mean_recall_proxy": float(np.mean([r.recall_proxy for r in rs])),
            "dst_clamped_share": float(np.mean([r.clamped for r in rs])) / n_units,
        }
    base_ideal = variants["baseline"]["ideal_bound_s"]
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "setup": {
            "flavor": sc.flavor,
            "gpus": cluster.gpus,
            **dataclasses.asdict(cluster),
            "data": sc.data_name,
            "seed": sc.seed,
            "steps": sc.steps,
            "baseline_policy": sc.baseline_policy,
            "block_size": sc.block_size,
            "policy": sc.dst.policy,
            "dst": {
                k: getattr(sc.dst, k) for k in ("anchor", "p", "beta0", "beta_min", "beta_max")
            },
            "density_prior_exponent": sc.density_exponent,
        },
        "assumptions": {
            "cost_model": sim.models.description,
            "device": None if sc.profile else {"name": sc.device, **ANALYTIC_DEVICES[sc.device]},
            "network": dataclasses.asdict(sc.network),
            "bwd_over_fwd": sc.bwd_over_fwd,
            "reduction": "ring all-reduce of each pipeline rank's gradients after the last "
            "backward of the slowest DP rank, not overlapped",
            "recall_proxy": "dst.DSTDecision.predicted_recall: tokens in a document's first "
            "two blocks keep all their estimated mass, later ones at least the budget "
            "(a lower bound on the token-mean recall)",
        },
        "balance_bound_speedup": base_step / base_ideal,
        "variants": variants,
    }


# ----------------------------------------------------------------------------- output


def format_table(rep: dict[str, Any]) -> str:
    head = (
        f"{'variant':<9}{'step s':>8}{'Mtok':>7}{'speedup':>9}{'bubble':>8}{'rank m/m':>9}"
        f"{'mb m/m':>8}{'ideal s':>9}{'budget':>8}{'recall':>8}"
    )
    lines = [head]
    for v, r in rep["variants"].items():
        lines.append(
            f"{v:<9}{r['step_time_s']:>8.3f}{r['tokens_per_step'] / 1e6:>7.2f}"
            f"{r['speedup_vs_baseline']:>8.3f}x{r['bubble_share']:>8.1%}"
            f"{r['imbalance_max_over_mean']:>9.3f}{r['microbatch_imbalance_max_over_mean']:>8.3f}"
            f"{r['ideal_bound_s']:>9.3f}{r['mean_budget']:>8.3f}{r['mean_recall_proxy']:>8.3f}"
        )
    lines.append(
        "speedup: tokens/s over the baseline's; ideal: every micro-batch at the step's mean "
        f"work. Balance bound (baseline step / its ideal): {rep['balance_bound_speedup']:.3f}x"
    )
    return "\n".join(lines)


def plot_timelines(first: dict[str, StepResult], cluster: Cluster, path: str, title: str) -> None:
    """Gantt of step 0 per variant: the slowest DP rank's pipeline (DP ranks if pp=1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(first), 1, figsize=(12, 1.2 + 0.9 * len(first) * max(cluster.pp, 2))
    )
    colors = plt.get_cmap("tab20").colors
    end = max(r.step_s for r in first.values())
    for ax, (v, r) in zip(np.atleast_1d(axes), first.items(), strict=True):
        tl = r.timeline
        if cluster.pp > 1:
            d = int(np.argmax(tl.makespan))
            rows = [(e[0], e[1], e[2][d], e[3][d]) for e in tl.events]
            labels = [f"stage {p}" for p in range(cluster.pp)]
        else:
            shown = min(cluster.dp, 16)
            rows = [(d, e[1], e[2][d], e[3][d]) for e in tl.events for d in range(shown)]
            labels = [f"dp {d}" for d in range(shown)]
        for y, a, s, e in rows:
            ax.barh(
                y,
                e - s,
                left=s,
                height=0.8,
                color=colors[a.mb % len(colors)],
                edgecolor="black",
                linewidth=0.3,
                alpha=0.55 if a.kind == "F" else 1.0,
                hatch="" if a.kind == "F" else "//",
            )
        ax.axvline(r.step_s, color="red", linewidth=1.2, label=f"step {r.step_s:.2f}s")
        ax.axvline(
            r.ideal_s, color="green", linestyle="--", linewidth=1.2, label=f"ideal {r.ideal_s:.2f}s"
        )
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.set_title(
            f"{v}: bubble {r.bubble_share:.1%}, mean budget {r.mean_budget:.3f}",
            fontsize=9,
            loc="left",
        )
        ax.legend(loc="lower right", fontsize=7)
    np.atleast_1d(axes)[-1].set_xlabel("seconds (F light, B hatched; colour = micro-batch)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sb-simulate",
        description="Simulate baseline / SAB / DST / SAB+DST step times for a cluster shape "
        "with the project's planner, DST and cost model and an event-level pipeline replay.",
    )
    p.add_argument("--config", help="TOML train config (model, sab, dst, sparse_attention, pp)")
    p.add_argument("--flavor", help="Qwen2.5 flavor without --config (default 3b)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--pp", type=int, help="pipeline stages (config, else 1)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step and DP rank")
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (config, else 1F1B)")
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (Interleaved)")
    p.add_argument("--rows", type=int, help="rows of seq_len per micro-batch (default 1)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="sb-profile JSON (one stage) instead of the analytic model")
    src.add_argument(
        "--device", choices=sorted(ANALYTIC_DEVICES), help="analytic device (default h200)"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, help="row length R (config, else 65536)")
    p.add_argument("--data", help="sb-prep dataset directory (lengths only); default longtail-v1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline-policy",
        choices=BASELINE_POLICIES,
        default="sequential",
        help="planner policy of the baseline and DST-only variants",
    )
    p.add_argument("--anchor", choices=ANCHORS, help="DST anchor (config, else mean)")
    p.add_argument(
        "--density-exponent",
        type=float,
        default=1.0,
        help="density-model prior rho = beta**k (1.0: the cost model's default)",
    )
    p.add_argument(
        "--bwd-over-fwd",
        type=float,
        default=2.0,
        help="backward / forward time (3.0 with full activation checkpointing)",
    )
    p.add_argument("--p2p-gbps", type=float, default=Network().p2p_gbps)
    p.add_argument("--allreduce-gbps", type=float, default=Network().allreduce_gbps)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a Gantt chart of step 0 per variant (PNG)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    return p


def _resolve(args: argparse.Namespace) -> tuple[Cluster, Scenario]:
    """CLI > config > defaults."""
    sc = Scenario(
        seed=args.seed,
        steps=args.steps,
        baseline_policy=args.baseline_policy,
        density_exponent=args.density_exponent,
        bwd_over_fwd=args.bwd_over_fwd,
        network=Network(p2p_gbps=args.p2p_gbps, allreduce_gbps=args.allreduce_gbps),
    )
    pp, schedule, seq_len, mbs, rows = 1, "1F1B", 65536, 8, 1
    if args.config:
        from sb_titan.balance.step_shape import step_shape
        from sb_titan.config.toml import load_config

        cfg = load_config(args.config)
        par = cfg.parallelism
        pp, schedule = par.pipeline_parallel_degree, par.pipeline_parallel_schedule
        non_dp = pp * par.tensor_parallel_degree * par.context_parallel_degree
        # The trainer's step (gradient accumulation included) for --dp ranks of data
        # parallelism; --pp below only overrides the stage count of the replay.
        step = step_shape(cfg, args.dp * non_dp)
        seq_len, mbs, rows = step.seq_len, step.microbatches, step.rows
        sc.flavor = cfg.model.flavor
        sc.sab = cfg.sab
        sc.dst = dataclasses.replace(cfg.dst, policy=cfg.sparse_attention.policy)
        sc.block_size = cfg.sparse_attention.block_size
        sc.first_less = par.pipeline_parallel_first_stage_less_layers
        sc.last_less = par.pipeline_parallel_last_stage_less_layers
        if cfg.cost_model.profile and not args.device:
            sc.profile = cfg.cost_model.profile
    if args.anchor:
        sc.dst = dataclasses.replace(sc.dst, anchor=args.anchor)
    sc.flavor = (args.flavor or sc.flavor).lower()
    if sc.flavor not in FLAVORS:
        raise SystemExit(f"sb-simulate: unknown flavor {sc.flavor!r}; one of {sorted(FLAVORS)}")
    if args.profile:
        sc.profile, sc.device = args.profile, None
    elif sc.profile is None:
        sc.device = args.device or "h200"
    else:
        sc.device = None
    pp = args.pp or pp
    schedule = args.schedule or schedule
    if schedule not in SCHEDULES:
        raise SystemExit(f"sb-simulate: schedule {schedule!r} is not one of {SCHEDULES}")
    cluster = Cluster(
        dp=args.dp,
        pp=pp,
        microbatches=args.microbatches or mbs,
        schedule=schedule,
        virtual_stages=args.virtual_stages if schedule == "Interleaved1F1B" else 1,
        rows=args.rows or rows,
        seq_len=args.seq_len or seq_len,
    )
    if args.data:
        from sb_titan.data.indexed import IndexedDataset

        ds = IndexedDataset(args.data)
        sc.lengths, sc.data_name = ds.lengths, ds.name
    else:
        sc.data_name = f"longtail-v1 (R={cluster.seq_len}, seed={args.seed})"
    return cluster, sc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster, sc = _resolve(args)
    except ValueError as e:
        print(f"sb-simulate: {e}", file=sys.stderr)
        return 2
    rep, first = simulate(cluster, sc, progress=not args.quiet)
    src = sc.profile or f"analytic {sc.device}"
    title = (
        f"Qwen2.5-{sc.flavor.upper()} DP={cluster.dp} x PP={cluster.pp} {cluster.schedule}, "
        f"{cluster.microbatches} micro-batches x {cluster.rows} x {cluster.seq_len} tokens, "
        f"{sc.data_name}, {src}"
    )
    print(title)
    print(format_table(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    if args.plot:
        plot_timelines(first, cluster, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
