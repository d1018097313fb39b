"""SBTrainer: TorchTitan's Trainer with per-micro-batch budgets, measured and balanced.

What it adds to the stock trainer, and nothing else:
  * recipe config sections ([model], [sparse_attention], [sab], [dst], [cost_model]);
  * the run's Balancer (balance/balancer.py): it decides the global step plan and the
    DST budget of every (DP rank, micro-batch) ahead, in the loader's planning thread,
    identically on every rank → `attention_masks = AttnMeta(doc_id, budget, microbatch,
    stats)`, which the pipeline schedule hands to every stage;
  * per-micro-batch measurements (time per stage, realised density, recall),
    all-gathered as one float64 tensor per rank and handed to `Balancer.observe` once
    per step, so every rank learns identically;
  * TensorBoard scalars next to TorchTitan's loss / step time / tokens per second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from sb_titan.attention.layout import AttnMeta, block_budgets, doc_ids_from_positions
from sb_titan.attention.selection import STATS_SIZE
from sb_titan.balance.balancer import Balancer, ScheduledStep
from sb_titan.balance.cost_model import (
    AnalyticSpec,
    CostModel,
    CostModelConfig,
    ProfileError,
    analytic_spec,
    build_cost_model,
)
from sb_titan.balance.doc_dst import DocDecision
from sb_titan.balance.dst import DSTConfig, DSTDecision
from sb_titan.balance.measurements import StepMeasurements
from sb_titan.balance.sab import SABConfig, StepPlan
from sb_titan.balance.step_shape import step_shape
from sb_titan.data.loader import SBDataLoader, build_source
from sb_titan.data.source import TokenSource, check_tokenizer, check_vocabulary, integrity_note
from sb_titan.models.attention import (
    SBAttention,
    SparseAttentionConfig,
)
from sb_titan.models.model_config import ModelConfig
from sb_titan.models.registry import derive_model_spec
from sb_titan.runtime import elastic
from sb_titan.runtime.checkpoint import IntegrityCheckpointManager
from sb_titan.runtime.console import SBMetricsProcessor
from sb_titan.runtime.context import RunContext
from sb_titan.runtime.cp_split import CPSplitter
from sb_titan.runtime.doc_credit import DocumentCredit
from sb_titan.runtime.measure import BlockClock, instrument_blocks
from sb_titan.runtime.measurements import (
    all_gather_flat,
    decode_measurements,
    encode_measurements,
)
from sb_titan.runtime.run_record import make_record, write_record
from sb_titan.runtime.schedule import with_microbatch_schedules
from sb_titan.runtime.tensorboard import add_run_tensorboard
from sb_titan.runtime.verify import assert_same_everywhere, plan_digest
from sb_titan.util.repeats import Repeats


class SBTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelConfig = field(default_factory=ModelConfig)
        sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
        sab: SABConfig = field(default_factory=SABConfig)
        dst: DSTConfig = field(default_factory=DSTConfig)
        cost_model: CostModelConfig = field(default_factory=CostModelConfig)
        checkpoint: IntegrityCheckpointManager.Config = field(
            default_factory=IntegrityCheckpointManager.Config
        )
        metrics: SBMetricsProcessor.Config = field(default_factory=SBMetricsProcessor.Config)

    def __init__(self, config: Config) -> None:
        self.model_spec = run_model_spec(config)  # derived once, here, whoever launched
        model = self.model_spec.model
        self._step_plan: StepPlan | None = None
        self._budgets: list[list[float]] = []
        self._decision: DSTDecision | None = None
        self._doc_decision: DocDecision | None = None
        self._snapshot = ""  # which cost-model snapshot planned the current step
        self._mb_stats: dict[int, torch.Tensor] = {}  # micro-batch -> AttnStats totals
        sparse = config.sparse_attention
        self._doc_credit = None  # documents credited with their own recall ([dst] doc_history)
        if config.dst.learns_doc_history and sparse.enabled and sparse.true_recall_rate > 0:
            self._doc_credit = DocumentCredit(sparse.block_size)
        self._cp_predicted: dict[int, float] = {}  # micro-batch -> predicted CP imbalance
        cp = config.parallelism.context_parallel_degree > 1
        self._cp_split = CPSplitter.from_config(config, model) if cp else None
        self._run = RunContext()
        self._repeats = Repeats()  # warnings that recur every step, rate-limited
        source = build_source(config.dataloader, config.training.seq_len)
        cost_model = build_run_cost_model(config, model)
        self.balancer = run_balancer(config, cost_model, source.lengths)
        self._microbatches = self.balancer.shape.microbatches  # sizes the measurement gather
        record = make_record(config, int(os.environ.get("WORLD_SIZE", "1")))  # as resolved
        with _as_torchtitan_builds(config, self.model_spec, self.balancer, source) as tensorboard:
            super().__init__(config)
        self.checkpointer.run_record = record  # into every step folder; checked on resume
        if dist.get_rank() == 0:
            write_record(config.dump_folder, record)
        self._first_step: int | None = None
        self._tensorboard = None
        if tensorboard:
            self._tensorboard = add_run_tensorboard(
                self.metrics_processor, config, self.parallel_dims
            )
        # checked before spawning too (config/preflight.py)
        check_vocabulary(source, model.vocab_size, config.model.flavor)
        if note := check_tokenizer(source, config.hf_assets_path):
            logger.info(note)
        if (note := integrity_note(source)) and dist.get_rank() == 0:  # once per run
            logger.warning(note)
        if self.parallel_dims.pp_enabled:
            self.pp_schedule.run_context = self._run
        self._clock = BlockClock(self.device)
        instrument_blocks(self.model_parts, self._clock, self._run)
        if config.sparse_attention.record:
            for module in self._attention_modules():
                module.recorder = self._record_attention

    # -- per micro-batch metadata -----------------------------------------------------------
    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor):
        scheduled, mb_index = input_dict.pop("scheduled"), input_dict.pop("microbatch")
        self._take_step(scheduled)
        plan = scheduled.plan
        budget = self._budgets[self._dp_rank()][mb_index]
        if self.config.dataloader.sample_log:
            self._log_samples(plan, mb_index, budget, scheduled.doc_budgets)
        if self.parallel_dims.cp_enabled:  # the recipe's own sharding, not TorchTitan's
            inputs = input_dict["input"]
            extra = {k: v for k, v in input_dict.items() if k != "input"}
        else:
            inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        positions = extra["positions"]
        doc_id = doc_ids_from_positions(positions)  # of the full row, before any sharding
        # row-wide (DST decides per micro-batch), or each document's own ([dst] per_document)
        doc_budgets = scheduled.row_budgets(self._dp_rank(), mb_index, doc_id.shape[0])
        bs = self.config.sparse_attention.block_size
        block_budget = block_budgets(doc_id, doc_budgets, bs)
        cp_blocks = None
        if self.parallel_dims.cp_enabled:
            split, self._cp_predicted[mb_index] = self._cp_split(
                self.balancer.cost_model, doc_id, doc_budgets
            )
            shard = split.token_index(self._cp_rank()).to(positions.device)
            inputs, labels, positions = (t.gather(1, shard) for t in (inputs, labels, positions))
            extra["positions"], cp_blocks = positions, split.blocks.to(positions.device)
            self.ntokens_seen += labels.numel()
        stats = self._mb_stats[mb_index] = positions.new_zeros(STATS_SIZE, dtype=torch.float32)
        mb = torch.tensor(mb_index)
        block_stats = None
        if self._doc_credit is not None:
            docs_per_row = [len(row) for row in plan.microbatches[self._dp_rank()][mb_index].rows]
            block_stats = self._doc_credit.buffer(mb_index, doc_id, docs_per_row)
        extra["attention_masks"] = AttnMeta(doc_id, block_budget, mb, stats, cp_blocks, block_stats)
        return inputs, labels, extra

    def _take_step(self, scheduled: ScheduledStep) -> None:
        """On a step's first micro-batch: adopt the plan and budgets the balancer decided."""
        if self._step_plan is not None and scheduled.plan.step == self._step_plan.step:
            return
        self._step_plan, self._budgets = scheduled.plan, scheduled.budgets
        self._decision, self._snapshot = scheduled.decision, scheduled.snapshot
        self._doc_decision = scheduled.doc_budgets
        if self.config.dst.verify_ranks:
            self._verify_budgets(scheduled)

    def _verify_budgets(self, scheduled: ScheduledStep) -> None:
        """Debug: the budgets decided ahead equal budgets decided here, in place, from the
        serialized snapshot of the same step, and every rank holds the same."""
        plan = scheduled.plan
        self.balancer.verify(scheduled)
        decided: Any = scheduled.budgets
        if scheduled.doc_budgets is not None:  # and each document's, where it has one
            decided = (scheduled.budgets, scheduled.doc_budgets.budgets)
        digest = hashlib.sha1(repr(decided).encode()).hexdigest()
        what = f"plan and budgets of step {plan.step}"
        assert_same_everywhere(f"{plan_digest(plan)}/{digest}", what)

    def _dp_rank(self) -> int:
        return self._mesh_rank("batch", self.parallel_dims.dp_enabled)

    def _cp_rank(self) -> int:
        return self._mesh_rank("cp", self.parallel_dims.cp_enabled)

    def _pp_rank(self) -> int:
        return self._mesh_rank("pp", self.parallel_dims.pp_enabled)

    def _mesh_rank(self, dim: str, enabled: bool) -> int:
        return self.parallel_dims.get_mesh(dim).get_local_rank() if enabled else 0

    # -- measurement ---------------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        with self._run.microbatch(0, input_dict["microbatch"], "forward_backward"):
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )

    def train_step(self, data_iterator) -> None:
        if self._first_step is None:
            self._start_logs(self.step)
        elastic.maybe_inject_fault(self.step)
        self._clock.reset()
        self._mb_stats, self._cp_predicted = {}, {}
        if self._doc_credit is not None:
            self._doc_credit.reset()
        t0 = _now(self.device)
        super().train_step(data_iterator)  # TorchTitan's step line waits for finish_step
        self.metrics_processor.finish_step(self.step, self._after_step(_now(self.device) - t0))

    def _local_measurements(self, step_seconds: float) -> dict[str, Any]:
        seconds = self._clock.seconds()
        # the sparse layers' sums in STATS_FIELDS order (one host copy)
        mbs = sorted(self._mb_stats)
        totals = torch.stack([self._mb_stats[mb] for mb in mbs]).tolist() if mbs else []
        stats = {mb: v for mb, v in zip(mbs, totals, strict=True) if v[1] > 0}
        return {
            "dp": self._dp_rank(),
            "pp": self._pp_rank(),
            "cp": self._cp_rank(),
            "seconds": seconds,
            "stats": stats,
            "step_seconds": step_seconds,
            "doc_sums": self._doc_credit.local() if self._doc_credit is not None else {},
        }

    def _after_step(self, step_seconds: float) -> dict[str, Any] | None:
        """Gather every rank's measurements; all ranks then do identical work with them.
        Returns the recipe's metrics of a step TorchTitan logs."""
        plan = self._step_plan
        counts = None  # documents per (DP rank, micro-batch): room for their own sums
        if self._doc_credit is not None and plan is not None:
            counts = DocumentCredit.counts(plan)
        local = self._local_measurements(step_seconds)
        local = encode_measurements(local, self._microbatches, counts)
        gathered = all_gather_flat(local.to(self.device))
        if plan is None:
            return None
        gathered = decode_measurements(gathered, self._microbatches, counts)
        per_doc = self._doc_decision.budgets if self._doc_decision is not None else None
        rate = self.config.sparse_attention.true_recall_rate
        m = StepMeasurements.from_gathered(gathered, plan, self._budgets, per_doc, rate)
        # Step 1 carries one-off work in its block times (torch.compile, Triton JIT,
        # allocator growth): never fit to it. A resumed process's first step is
        # fitted like any other (the refit is damped), so resume stays exact.
        predicted = self.balancer.observe(plan, m, fit_latency=self.step > 1)
        if not self.metrics_processor.should_log(self.step):
            return None
        return self._recipe_metrics(m, predicted)

    def _attention_modules(self) -> list[SBAttention]:
        return [
            m for part in self.model_parts for m in part.modules() if isinstance(m, SBAttention)
        ]

    def _recipe_metrics(self, m: StepMeasurements, predicted) -> dict[str, Any]:
        metrics = m.metrics()
        if self._cp_predicted:  # this DP rank's micro-batches, as the split priced them
            cp_predicted = np.mean(list(self._cp_predicted.values()))
            metrics["balance/cp_predicted_imbalance"] = float(cp_predicted)
        plan = self._step_plan
        real = sum(mb.num_tokens for rank in plan.microbatches for mb in rank)
        slots = sum(len(mb.rows) for rank in plan.microbatches for mb in rank)
        metrics["data/real_tokens"] = real  # padding excluded: compare policies per token
        metrics["data/padding_share"] = 1.0 - real / (slots * self.config.training.seq_len)
        if self._budgets and self.config.sparse_attention.enabled:  # dense: no budget applies
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
        if predicted is not None:
            keys = sorted(predicted)
            measured = np.asarray([m.seconds[k] for k in keys])
            guess = np.asarray([predicted[k] for k in keys])
            ape = np.abs(guess - measured) / np.maximum(measured, 1e-12)
            if len(ape):
                metrics["cost_model/ape_mean"] = float(ape.mean())
            drift = self.config.cost_model.drift_threshold
            warning = self.balancer.cost_model.drift_warning(drift)
            if warning:
                self._repeats.warning(logger, "cost_model_drift", warning)
        return metrics

    # -- debug logs ----------------------------------------------------------------------------
    def _start_logs(self, first_step: int) -> None:
        """At the first step this process trains (after any checkpoint load): steps from
        here on are (re)played, so earlier attempts' records of them are dropped."""
        self._first_step = first_step
        for stem in ("samples", "attention"):
            elastic.truncate_step_log(self._rank_file(stem), first_step)
        if self._tensorboard is not None:
            self._tensorboard.start(first_step)

    def _rank_file(self, stem: str) -> str:
        os.makedirs(self.config.dump_folder, exist_ok=True)
        return os.path.join(self.config.dump_folder, f"{stem}_rank{dist.get_rank()}.jsonl")

    def _log_samples(
        self, plan: StepPlan, mb_index: int, budget: float, per_doc: DocDecision | None
    ) -> None:
        mb = plan.microbatches[self._dp_rank()][mb_index]
        record = {
            "step": self.step,
            "plan_step": plan.step,
            "microbatch": mb_index,
            "budget": budget,
            "step_budgets": self._budgets,
            "cost_model_snapshot": self._snapshot,
            "plan_digest": plan_digest(plan),
            "rows": [[[p.sample_id, p.start, p.length] for p in row] for row in mb.rows],
        }
        if per_doc is not None:  # absent without it, so that earlier logs read the same
            record["doc_budgets"] = per_doc.budgets[self._dp_rank()][mb_index]
        if mb.recalls is not None:  # each document's last measured recall (None: never)
            record["doc_recalls"] = [None if math.isnan(r[0]) else r for r in mb.recalls]
        with open(self._rank_file("samples"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _record_attention(self, module: SBAttention, meta: AttnMeta, phase: str) -> None:
        if not self._run.measuring:  # the pipeline's shape inference
            return
        ctx = self._run.current()
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
        return {**super().state_dict(), **self.balancer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self.balancer.load_state_dict(state_dict, trained_step=self.step - 1):
            logger.warning("checkpoint has no cost-model snapshots; planning with its model")


def run_model_spec(config: SBTrainer.Config) -> ModelSpec:
    """The model spec the trainer builds, from its final config: `derive_model_spec` with
    micro-batch-aware pipeline schedules. A spec set on the config beforehand (TorchTitan's
    registries set one) is refused rather than silently replaced or obeyed."""
    if config.model_spec is not None:
        raise ValueError(
            "model_spec is derived from [model] and [sparse_attention] when the trainer is "
            "built; set those sections instead of config.model_spec"
        )
    return with_microbatch_schedules(derive_model_spec(config))


def build_run_cost_model(config: SBTrainer.Config, model: Qwen3Model.Config) -> CostModel | None:
    """The run's latency predictor, pricing `model` (the run's model spec's, derived from
    `config`); needed by DST and by the `sab` packing policy."""
    attn, ffn = model.layers[0].attention, model.layers[0].feed_forward
    layers = len(model.layers) // config.parallelism.pipeline_parallel_degree

    def spec_for(device: str) -> AnalyticSpec:
        return analytic_spec(
            device,
            hidden=model.dim,
            heads=attn.n_heads,
            kv_heads=attn.n_kv_heads,
            head_dim=attn.head_dim,
            intermediate=ffn.w1.out_features,
            layers=max(layers, 1),
            vocab_size=model.vocab_size,
            block_size=config.sparse_attention.block_size,
        )

    expected = {"block_size": config.sparse_attention.block_size}
    if config.cost_model.profile:
        from sb_titan.profiler import current_fingerprint

        expected = current_fingerprint(config, model)
    dst = config.dst
    model = build_cost_model(
        config.cost_model, spec_for, expected, dst.recall_measure, dst.recall_beta_knots
    )
    wants = (("dst.enabled", config.dst.enabled), ("sab.policy='sab'", config.sab.policy == "sab"))
    needs = [name for name, on in wants if on]
    if model is None and needs:  # a config problem: no restart will fix it (elastic.py)
        raise ProfileError(
            f"{' and '.join(needs)} need{'s' if len(needs) == 1 else ''} a latency profile: "
            "run `sb-profile --config <this config> --out profiles/NAME.json` and set "
            "cost_model.profile, or opt in to "
            "the analytic model with cost_model.analytic_device = 'h100' | 'h200' | 'cpu'"
        )
    return model


def run_balancer(
    config: SBTrainer.Config, cost_model: CostModel | None, lengths: np.ndarray
) -> Balancer:
    """The run's balance loop over the source's sample lengths: the step TorchTitan will
    cut, the packing policy, the DST rule and the cost model, planned plan_lag ahead."""
    return Balancer(
        lengths,
        step_shape(config, int(os.environ.get("WORLD_SIZE", "1"))),
        config.sab,
        cost_model,
        config.dst,
        selection=config.sparse_attention.policy,
        pipelined=config.parallelism.pipeline_parallel_degree > 1,
        plan_lag=config.cost_model.plan_lag,
        refit=config.cost_model.refit,
    )


@contextlib.contextmanager
def _as_torchtitan_builds(
    config: SBTrainer.Config, spec: ModelSpec, balancer: Balancer, source: TokenSource
) -> Iterator[bool]:
    """While TorchTitan's Trainer builds its parts: it reads the model spec from the
    config, so the derived one is set there for the build only; the loader's `build(...)`
    call also passes the run's balancer and the source it balances, and TensorBoard is
    left to the recipe (one run folder across restarts, runtime/tensorboard.py). Yields
    whether TensorBoard was on; the config is restored however the build ends."""
    loader, tensorboard = config.dataloader, config.metrics.enable_tensorboard
    if isinstance(loader, SBDataLoader.Config):
        config.dataloader = SimpleNamespace(
            build=functools.partial(loader.build, balancer=balancer, source=source)
        )
    config.metrics.enable_tensorboard = False
    config.model_spec = spec
    try:
        yield tensorboard
    finally:
        config.dataloader, config.metrics.enable_tensorboard = loader, tensorboard
        config.model_spec = None


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
