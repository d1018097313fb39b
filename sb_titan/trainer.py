"""SBTrainer: TorchTitan's Trainer with per-micro-batch budgets, measured and balanced.

What it adds to the stock trainer, and nothing else:
  * recipe config sections ([model], [sparse_attention], [sab], [dst], [cost_model]);
  * the global step plan from the loader → DST budgets for every (DP rank,
    micro-batch), identical on every rank → `attention_masks = AttnMeta(doc_id, budget,
    microbatch)`, which the pipeline schedule hands to every stage;
  * per-micro-batch measurements (time per stage, realised density, recall),
    all-gathered so every rank refits the cost model and feeds SAB identically;
  * TensorBoard scalars next to TorchTitan's loss / step time / tokens per second.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from sb_titan import elastic
from sb_titan.attention.layout import AttnMeta, doc_ids_from_positions
from sb_titan.attention.module import ATTENTION_OBSERVERS, SBAttention, SparseAttentionConfig
from sb_titan.config.toml import ConfigError
from sb_titan.cost_model import (
    AnalyticSpec,
    CostModel,
    CostModelConfig,
    LatencyObservation,
    analytic_stage_spec,
    build_cost_model,
)
from sb_titan.dst import DSTConfig, DSTDecision, sensitive_recall, tune_budgets
from sb_titan.measure import BlockClock, instrument_blocks
from sb_titan.models.qwen2_5 import FLAVORS, model_registry
from sb_titan.sab import SABConfig, StepPlan
from sb_titan.schedule import current_microbatch, microbatch_context


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The `[model]` section: which Qwen2.5 to build."""

    flavor: str = "debug"
    """One of sb_titan.models.qwen2_5.FLAVORS."""
    tie_embeddings: bool | None = None
    """Override the flavor's tying (pipeline parallelism needs untied)."""


class SBTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelConfig = field(default_factory=ModelConfig)
        sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
        sab: SABConfig = field(default_factory=SABConfig)
        dst: DSTConfig = field(default_factory=DSTConfig)
        cost_model: CostModelConfig = field(default_factory=CostModelConfig)

        def rebuild_model_spec(self) -> None:
            """model_spec is hidden from the CLI; it is always derived from [model] and
            [sparse_attention], so TOML and CLI overrides of those take effect."""
            self.model_spec = model_registry(
                self.model.flavor,
                attention=self.sparse_attention,
                tie_embeddings=self.model.tie_embeddings,
            )
            self.dst.policy = self.sparse_attention.policy

    def __init__(self, config: Config) -> None:
        self._step_plan: StepPlan | None = None
        self._budgets: list[list[float]] = []
        self._decision: DSTDecision | None = None
        self.cost_model = _cost_model(config)
        _configure_loader(config, copy.deepcopy(self.cost_model))
        tensorboard, config.metrics.enable_tensorboard = config.metrics.enable_tensorboard, False
        try:  # TensorBoard is built below: one run folder across restarts (sb_titan.elastic)
            super().__init__(config)
        finally:
            config.metrics.enable_tensorboard = tensorboard
        self._first_step: int | None = None
        if tensorboard:
            _add_run_tensorboard(self.metrics_processor, config, self.parallel_dims)
        self._clock = BlockClock(self.device)
        instrument_blocks(self.model_parts, self._clock)
        if config.sparse_attention.record:
            ATTENTION_OBSERVERS.append(self._record_attention)

    # -- per micro-batch metadata -----------------------------------------------------------
    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor):
        plan, mb_index = input_dict.pop("plan"), input_dict.pop("microbatch")
        budget = self._budget_of(plan, mb_index)
        if self.config.dataloader.sample_log:
            self._log_samples(plan, mb_index, budget)
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        positions = extra["positions"]
        extra["attention_masks"] = AttnMeta(
            doc_id=doc_ids_from_positions(positions),
            budget=torch.full((positions.shape[0],), budget, device=positions.device),
            microbatch=torch.tensor(mb_index),
        )
        return inputs, labels, extra

    def _budget_of(self, plan: StepPlan, mb_index: int) -> float:
        if self._step_plan is None or plan.step != self._step_plan.step:
            self._step_plan = plan
            self._budgets = self._step_budgets(plan)
        return self._budgets[self._dp_rank()][mb_index]

    def _step_budgets(self, plan: StepPlan) -> list[list[float]]:
        """Budget of every (DP rank, micro-batch) of the step: a pure function of the
        shared plan and the (identically refit) cost model, so every rank agrees."""
        cfg = self.config.dst
        shape = [len(rank) for rank in plan.microbatches]
        if self.cost_model is None:
            self._decision = None
            return [[cfg.beta0] * n for n in shape]
        if self.parallel_dims.pp_enabled:  # unit: a micro-batch (on the slowest stage)
            units = [[mb.doc_lens] for rank in plan.microbatches for mb in rank]
        else:  # unit: a DP rank's micro-batches (their summed time meets at the reduction)
            units = [[mb.doc_lens for mb in rank] for rank in plan.microbatches]
        self._decision = tune_budgets(units, self.cost_model, cfg)
        if cfg.verify_ranks:
            _assert_same_everywhere(self._decision.digest(), f"DST budgets of step {plan.step}")
        flat = iter(self._decision.budgets)
        if self.parallel_dims.pp_enabled:
            return [[next(flat) for _ in range(n)] for n in shape]
        return [[b] * n for b, n in zip(flat, shape, strict=True)]

    def _dp_rank(self) -> int:
        if not self.parallel_dims.dp_enabled:
            return 0
        return self.parallel_dims.get_mesh("batch").get_local_rank()

    def _pp_rank(self) -> int:
        if not self.parallel_dims.pp_enabled:
            return 0
        return self.parallel_dims.get_mesh("pp").get_local_rank()

    # -- measurement ---------------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        with microbatch_context(0, input_dict["microbatch"], "forward_backward"):
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )

    def train_step(self, data_iterator) -> None:
        if self._first_step is None:
            self._start_logs(self.step)
        elastic.maybe_inject_fault(self.step)
        self._clock.reset()
        t0 = _now(self.device)
        super().train_step(data_iterator)
        self._after_step(_now(self.device) - t0)

    def _local_measurements(self, step_seconds: float) -> dict[str, Any]:
        seconds = self._clock.seconds()
        stats: dict[int, list[float]] = {}
        for module in self._attention_modules():
            for mb, t in module.pop_stats().items():
                acc = stats.setdefault(mb, [0.0, 0.0, 0.0, 0.0])
                for i, v in enumerate(t.tolist()):
                    acc[i] += v
        return {
            "dp": self._dp_rank(),
            "pp": self._pp_rank(),
            "seconds": seconds,
            "stats": stats,
            "step_seconds": step_seconds,
        }

    def _after_step(self, step_seconds: float) -> None:
        """Gather every rank's measurements; all ranks then do identical work with them."""
        local = self._local_measurements(step_seconds)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        plan = self._step_plan
        if plan is None:
            return
        m = _StepMeasurements.from_gathered(gathered, plan, self._budgets)
        if self.cost_model is not None:
            policy = self.config.dst.policy
            predicted = {  # before this step's refit: an honest error
                key: self.cost_model.predict_budget(
                    plan.microbatches[key[0]][key[1]].doc_lens,
                    self._budgets[key[0]][key[1]],
                    policy,
                )
                for key in m.seconds
            }
            observations = m.observations(plan)
            if self.config.cost_model.refit and observations:
                self.cost_model.refit(observations)
            self.cost_model.density_model.update(m.density_observations(plan))
            self.cost_model.recall_model.update(
                m.recall_observations(plan, self.cost_model.block_size)
            )
        else:
            predicted = None
        planner = getattr(self.dataloader, "planner", None)
        if planner is not None and hasattr(planner, "observe"):
            ids, dens = m.sample_densities(plan)
            planner.observe(ids, dens, step=plan.step)
        if self.metrics_processor.should_log(self.step):
            self._log_recipe_metrics(m, predicted)

    def _attention_modules(self) -> list[SBAttention]:
        return [
            m for part in self.model_parts for m in part.modules() if isinstance(m, SBAttention)
        ]

    def _log_recipe_metrics(self, m: _StepMeasurements, predicted) -> None:
        metrics = m.metrics()
        plan = self._step_plan
        real = sum(mb.num_tokens for rank in plan.microbatches for mb in rank)
        slots = sum(len(mb.rows) for rank in plan.microbatches for mb in rank)
        metrics["data/real_tokens"] = real  # padding excluded: compare policies per token
        metrics["data/padding_share"] = 1.0 - real / (slots * self.config.training.seq_len)
        if self._budgets:
            flat = [b for rank in self._budgets for b in rank]
            metrics.update(
                {
                    "dst/budget_mean": float(np.mean(flat)),
                    "dst/budget_min": min(flat),
                    "dst/budget_max": max(flat),
                }
            )
        if self._decision is not None:
            d = self._decision
            metrics.update(
                {
                    "dst/anchor_s": d.anchor_s,
                    "dst/raised": d.n_raised,
                    "dst/lowered": d.n_lowered,
                    "dst/clamped": d.n_clamped,
                    "dst/predicted_imbalance_before": d.imbalance_before,
                    "dst/predicted_imbalance_after": d.imbalance_after,
                    "dst/predicted_recall": d.predicted_recall,
                    "dst/predicted_recall_static": d.predicted_recall_static,
                }
            )
        if predicted is not None and self.cost_model is not None:
            keys = sorted(predicted)
            measured = np.asarray([m.seconds[k] for k in keys])
            guess = np.asarray([predicted[k] for k in keys])
            ape = np.abs(guess - measured) / np.maximum(measured, 1e-12)
            if len(ape):
                metrics["cost_model/ape_mean"] = float(ape.mean())
            warning = self.cost_model.drift_warning(self.config.cost_model.drift_threshold)
            if warning:
                logger.warning(warning)
        self.metrics_processor.logger.log(metrics, self.step)

    # -- debug logs ----------------------------------------------------------------------------
    def _start_logs(self, first_step: int) -> None:
        """At the first step this process trains (after any checkpoint load): steps from
        here on are (re)played, so earlier attempts' records of them are dropped."""
        self._first_step = first_step
        for stem in ("samples", "attention"):
            elastic.truncate_step_log(self._rank_file(stem), first_step)
        for metric_logger in getattr(self.metrics_processor.logger, "_loggers", []):
            if isinstance(metric_logger, elastic.RunTensorBoardLogger):
                metric_logger.start(first_step)

    def _rank_file(self, stem: str) -> str:
        os.makedirs(self.config.dump_folder, exist_ok=True)
        return os.path.join(self.config.dump_folder, f"{stem}_rank{dist.get_rank()}.jsonl")

    def _log_samples(self, plan: StepPlan, mb_index: int, budget: float) -> None:
        rows = plan.microbatches[self._dp_rank()][mb_index].rows
        record = {
            "step": self.step,
            "plan_step": plan.step,
            "microbatch": mb_index,
            "budget": budget,
            "step_budgets": self._budgets,
            "plan_digest": _plan_digest(plan),
            "rows": [[[p.sample_id, p.start, p.length] for p in row] for row in rows],
        }
        with open(self._rank_file("samples"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _record_attention(self, module: SBAttention, meta: AttnMeta, phase: str) -> None:
        ctx = current_microbatch()
        doc_lens = [
            torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in meta.doc_id
        ]
        record = {
            "step": self.step,
            "phase": phase,
            "stage": None if ctx is None else ctx.stage,
            "schedule_microbatch": None if ctx is None else ctx.microbatch,
            "microbatch": int(meta.microbatch),
            "budget": meta.budget.tolist(),
            "doc_lens": doc_lens,
            "sparse": module.config.sparse,
        }
        with open(self._rank_file("attention"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        loader = getattr(self, "dataloader", None)  # absent if __init__ failed early
        if hasattr(loader, "close"):
            loader.close()
        super().close()

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.cost_model is not None:
            state["cost_model"] = json.dumps(self.cost_model.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.cost_model is not None and "cost_model" in state_dict:
            self.cost_model.load_state_dict(json.loads(state_dict["cost_model"]))


@dataclass
class _StepMeasurements:
    """One step's measurements from every rank, keyed by (DP rank, micro-batch)."""

    seconds: dict[tuple[int, int], float]  # slowest stage's fwd+bwd time
    rank_compute: dict[tuple[int, int], float]  # (dp, pp) -> summed compute seconds
    step_seconds: float
    density: dict[tuple[int, int], float]
    recall: dict[tuple[int, int], tuple[float, float]]  # (token-weighted sum, tokens)
    budgets: list[list[float]]
    pp_degree: int = 1

    @classmethod
    def from_gathered(cls, gathered: list[dict], plan: StepPlan, budgets) -> _StepMeasurements:
        seconds: dict[tuple[int, int], float] = {}
        rank_compute: dict[tuple[int, int], float] = {}
        sums: dict[tuple[int, int], list[float]] = {}
        for g in sorted(gathered, key=lambda g: (g["dp"], g["pp"])):
            rank_compute[(g["dp"], g["pp"])] = sum(g["seconds"].values())
            for mb, s in g["seconds"].items():
                key = (g["dp"], int(mb))
                seconds[key] = max(seconds.get(key, 0.0), s)
            for mb, values in g["stats"].items():  # [density_sum, rows, recall_sum, tokens]
                acc = sums.setdefault((g["dp"], int(mb)), [0.0, 0.0, 0.0, 0.0])
                for i, v in enumerate(values):
                    acc[i] += v
        density = {k: v[0] / v[1] for k, v in sums.items() if v[1] > 0}
        recall = {k: (v[2], v[3]) for k, v in sums.items() if v[1] > 0}
        step = max(g["step_seconds"] for g in gathered)
        pp = 1 + max(g["pp"] for g in gathered)
        return cls(seconds, rank_compute, step, density, recall, budgets, pp)

    def observations(self, plan: StepPlan) -> list[LatencyObservation]:
        out = []
        for (dp, mb), s in sorted(self.seconds.items()):
            lens = plan.microbatches[dp][mb].doc_lens
            rho = self.density.get((dp, mb), 1.0)
            out.append(LatencyObservation(lens, [rho] * len(lens), s))
        return out

    def density_observations(self, plan: StepPlan) -> list[tuple[float, int, float]]:
        """(budget, length, density) per micro-batch, the density attributed to its
        longest document (it holds most of the causal block pairs)."""
        out = []
        for (dp, mb), rho in sorted(self.density.items()):
            lens = plan.microbatches[dp][mb].doc_lens
            if lens:
                out.append((self.budgets[dp][mb], max(lens), rho))
        return out

    def recall_observations(
        self, plan: StepPlan, block_size: int
    ) -> list[tuple[float, int, float]]:
        """(budget, length, kept mass of budget-sensitive tokens) per micro-batch, for
        DST's recall model (dst.sensitive_recall inverts the measured recall)."""
        out = []
        for (dp, mb), (kept, tokens) in sorted(self.recall.items()):
            if tokens > 0:
                lens = plan.microbatches[dp][mb].doc_lens
                obs = sensitive_recall(lens, kept / tokens, block_size)
                if obs is not None:
                    out.append((self.budgets[dp][mb], *obs))
        return out

    def sample_densities(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        ids, dens = [], []
        for (dp, mb), rho in sorted(self.density.items()):
            for row in plan.microbatches[dp][mb].rows:
                for piece in row:
                    ids.append(piece.sample_id)
                    dens.append(rho)
        return ids, dens

    def unit_seconds_flat(self) -> list[float]:
        return [s for _, s in sorted(self.seconds.items())]

    def _excess_over_balanced(self) -> float:
        """Seconds the step lost to uneven work: the critical path minus the same
        path with every unit at the mean. Without PP the critical path is the slowest
        rank's compute; under 1F1B-like schedules it is ~ sum of the slowest stage's
        micro-batch times plus (p - 1) of the largest (warm-up and cool-down)."""
        per_dp: dict[int, list[float]] = {}
        for (dp, _), s in sorted(self.seconds.items()):
            per_dp.setdefault(dp, []).append(s)
        excess = []
        for times in per_dp.values():
            t = np.asarray(times)
            p = self.pp_degree
            excess.append((t.sum() + (p - 1) * t.max()) - (len(t) + p - 1) * t.mean())
        rank_sums = [sum(t) for t in per_dp.values()]
        dp_excess = max(rank_sums) - float(np.mean(rank_sums))
        return float(max(excess) + dp_excess)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        mb_times = np.asarray(self.unit_seconds_flat())
        if len(mb_times):
            out["balance/microbatch_imbalance"] = float(mb_times.max() / mb_times.mean())
        per_dp: dict[int, float] = {}
        for (dp, _), s in self.seconds.items():
            per_dp[dp] = per_dp.get(dp, 0.0) + s
        if per_dp:
            v = np.asarray(list(per_dp.values()))
            out["balance/rank_imbalance"] = float(v.max() / v.mean())
            out["balance/rank_compute_max_s"] = float(v.max())
            out["balance/rank_compute_mean_s"] = float(v.mean())
        if self.step_seconds > 0 and self.rank_compute:
            busy = np.asarray(list(self.rank_compute.values())) / self.step_seconds
            out["balance/bubble_share"] = float(np.clip(1.0 - busy, 0.0, 1.0).mean())
        if len(mb_times) and per_dp:
            out["balance/microbatch_max_s"] = float(mb_times.max())
            out["balance/microbatch_mean_s"] = float(mb_times.mean())
            out["balance/ideal_step_s"] = self.step_seconds - self._excess_over_balanced()
        if self.density:
            out["sparsity/density"] = float(np.mean(list(self.density.values())))
            # Over attending tokens of the whole step (padding excluded), so a padded
            # plan and a full one compare on the same footing.
            kept, tokens = np.sum(list(self.recall.values()), axis=0)
            out["sparsity/recall"] = float(kept / tokens) if tokens > 0 else 1.0
        return out


def _cost_model(config: SBTrainer.Config) -> CostModel | None:
    """The run's latency predictor; needed by DST and by the `sab` packing policy."""
    dims = FLAVORS[config.model.flavor]
    layers = len(config.model_spec.model.layers) // config.parallelism.pipeline_parallel_degree

    def spec_for(device: str) -> AnalyticSpec:
        return analytic_stage_spec(
            dims, layers, head=True, device=device, block_size=config.sparse_attention.block_size
        )

    expected = {"block_size": config.sparse_attention.block_size}
    if config.cost_model.profile:
        from sb_titan.profile import current_fingerprint

        expected = current_fingerprint(config)
    model = build_cost_model(config.cost_model, spec_for, expected)
    wants = (("dst.enabled", config.dst.enabled), ("sab.policy='sab'", config.sab.policy == "sab"))
    needs = [name for name, on in wants if on]
    if model is None and needs:  # a config problem: no restart will fix it (elastic.py)
        raise ConfigError(
            f"{' and '.join(needs)} need a latency profile: run `sb-profile --config <this "
            "config> --out profiles/NAME.json` and set cost_model.profile, or opt in to "
            "the analytic model with cost_model.analytic_device = 'h100' | 'h200' | 'cpu'"
        )
    return model


def _configure_loader(config: SBTrainer.Config, loader_cost_model: CostModel | None) -> None:
    """The loader plans whole steps, so it must know the micro-batches per step, the
    packing policy and predicted latency. It gets its own (never refit) cost model:
    it plans ahead in a prefetch thread, and plans must not depend on when a refit ran."""
    loader = config.dataloader
    if not hasattr(loader, "microbatches_per_step"):
        return
    p = config.parallelism
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (
        p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree
    )
    local_bs = config.training.local_batch_size
    global_bs = config.training.global_batch_size
    grad_accum = 1 if global_bs < 0 else global_bs // (local_bs * dp)
    pp_mbs = (
        local_bs // p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else 1
    )
    loader.microbatches_per_step = grad_accum * pp_mbs
    loader.sab = config.sab
    if loader_cost_model is not None:
        beta0, policy = config.dst.beta0, config.dst.policy
        loader.cost_fn = loader_cost_model.predict
        loader.density_prior = lambda n: loader_cost_model.density_for_budget(beta0, n, policy)


def _add_run_tensorboard(metrics, config: SBTrainer.Config, parallel_dims) -> None:
    """TorchTitan's TensorBoard logger (same ranks, same tb/<run>[/rank_<r>] layout),
    but restart-aware: see elastic.RunTensorBoardLogger."""
    from torchtitan.components.metrics import LoggerContainer, _get_metrics_rank

    cfg = config.metrics
    rank = dist.get_rank()
    if not cfg.save_for_all_ranks:
        schedule = config.parallelism.pipeline_parallel_schedule
        if rank != _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=schedule):
            return
    if not isinstance(metrics.logger, LoggerContainer):
        metrics.logger = LoggerContainer()
    sub = f"rank_{rank}" if cfg.save_for_all_ranks else None
    tb_root = os.path.join(config.dump_folder, cfg.save_tb_folder)
    metrics.logger.add_logger(elastic.RunTensorBoardLogger(tb_root, sub))


def _plan_digest(plan: StepPlan) -> str:
    """Hash of the whole global plan (every rank's pieces), to compare across ranks."""
    pieces = [
        (r, m, i, p.sample_id, p.start, p.length)
        for r, rank in enumerate(plan.microbatches)
        for m, mb in enumerate(rank)
        for i, row in enumerate(mb.rows)
        for p in row
    ]
    return hashlib.sha1(repr((plan.step, pieces)).encode()).hexdigest()


def _assert_same_everywhere(digest: str, what: str) -> None:
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on {what}: {digests}")


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
