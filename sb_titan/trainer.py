"""SBTrainer: TorchTitan's Trainer with the recipe's per-micro-batch attention metadata.

What it adds to the stock trainer, and nothing else:
  * recipe config sections ([model], [sparse_attention], [sab], [dst]);
  * wiring of the global step plan into the loader and per-micro-batch budgets into
    the attention (`attention_masks` = AttnMeta(doc_id, budget));
  * per-step measurements (realised density, recall, per-micro-batch time) logged
    to TensorBoard next to TorchTitan's own loss / step-time / tokens-per-second.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.trainer import Trainer

from sb_titan.attention.layout import AttnMeta, doc_ids_from_positions
from sb_titan.attention.module import SBAttention, SparseAttentionConfig
from sb_titan.dst import DSTConfig
from sb_titan.models.qwen2_5 import model_registry
from sb_titan.sab import SABConfig, StepPlan
from sb_titan.schedule import MicrobatchTimer, microbatch_context

_RECIPE_KEYS = ("plan", "microbatch")


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

        def rebuild_model_spec(self) -> None:
            """model_spec is hidden from the CLI; it is always derived from [model] and
            [sparse_attention], so TOML and CLI overrides of those take effect."""
            self.model_spec = model_registry(
                self.model.flavor,
                attention=self.sparse_attention,
                tie_embeddings=self.model.tie_embeddings,
            )

    def __init__(self, config: Config) -> None:
        self._configure_loader(config)
        self._step_plan: StepPlan | None = None
        self._budgets: list[list[float]] = []
        self._mb_timer = MicrobatchTimer()
        super().__init__(config)

    # -- set-up ------------------------------------------------------------------------
    @staticmethod
    def _configure_loader(config: Config) -> None:
        """The loader plans whole steps, so it must know the micro-batches per step."""
        p = config.parallelism
        world = int(os.environ.get("WORLD_SIZE", "1"))
        non_dp = p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree
        dp = world // non_dp
        local_bs = config.training.local_batch_size
        global_bs = config.training.global_batch_size
        grad_accum = 1 if global_bs < 0 else global_bs // (local_bs * dp)
        pp_mbs = (
            local_bs // p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else 1
        )
        loader = config.dataloader
        if hasattr(loader, "microbatches_per_step"):
            loader.microbatches_per_step = grad_accum * pp_mbs
            loader.sab = config.sab

    # -- per micro-batch metadata ------------------------------------------------------------
    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor):
        plan, mb_index = input_dict.pop("plan"), input_dict.pop("microbatch")
        if getattr(self.config.dataloader, "sample_log", False):
            self._log_samples(plan, mb_index)
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        positions = extra["positions"]
        budget = self._budget_of(plan, mb_index)
        extra["attention_masks"] = AttnMeta(
            doc_id=doc_ids_from_positions(positions),
            budget=torch.full((positions.shape[0],), budget, device=positions.device),
        )
        return inputs, labels, extra

    def _log_samples(self, plan: StepPlan, mb_index: int) -> None:
        rank = self._dp_rank()
        rows = plan.microbatches[rank][mb_index].rows
        record = {
            "step": self.step,
            "plan_step": plan.step,
            "microbatch": mb_index,
            "rows": [[[p.sample_id, p.start, p.length] for p in row] for row in rows],
        }
        os.makedirs(self.config.dump_folder, exist_ok=True)
        path = os.path.join(
            self.config.dump_folder, f"samples_rank{torch.distributed.get_rank()}.jsonl"
        )
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _budget_of(self, plan: StepPlan, mb_index: int) -> float:
        if self._step_plan is None or plan.step != self._step_plan.step:
            self._step_plan = plan
            self._budgets = self._step_budgets(plan)
        return self._budgets[self._dp_rank()][mb_index]

    def _step_budgets(self, plan: StepPlan) -> list[list[float]]:
        """Budget of every (DP rank, micro-batch) of the step, identical on all ranks."""
        beta0 = self.config.dst.beta0
        return [[beta0] * len(rank) for rank in plan.microbatches]

    def _dp_rank(self) -> int:
        if not self.parallel_dims.dp_enabled:
            return 0
        return self.parallel_dims.get_mesh("batch").get_local_rank()

    # -- measurement -----------------------------------------------------------------------
    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        mb = input_dict["microbatch"]
        with microbatch_context(0, mb, "forward_backward"):
            t0 = _now(self.device)
            loss = super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
            self._mb_timer.add(0, mb, "forward_backward", _now(self.device) - t0)
        return loss

    def train_step(self, data_iterator) -> None:
        self._mb_timer.reset()
        super().train_step(data_iterator)
        self._log_recipe_metrics()

    def _attention_modules(self) -> list[SBAttention]:
        return [
            m for part in self.model_parts for m in part.modules() if isinstance(m, SBAttention)
        ]

    def _log_recipe_metrics(self) -> None:
        sums = torch.zeros(3)
        for module in self._attention_modules():
            sums += module.pop_stats().cpu()
        if not self.metrics_processor.should_log(self.step):
            return
        if self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            sums = sums.to(self.device)
            torch.distributed.all_reduce(sums, group=mesh.get_group())
            sums = sums.cpu()
        density_sum, recall_sum, rows = sums.tolist()
        metrics = {}
        if rows > 0:
            metrics["sparsity/density"] = density_sum / rows
            metrics["sparsity/recall"] = recall_sum / rows
        if self._budgets:
            flat = [b for rank in self._budgets for b in rank]
            metrics["dst/budget_mean"] = sum(flat) / len(flat)
            metrics["dst/budget_min"] = min(flat)
            metrics["dst/budget_max"] = max(flat)
        if metrics:
            self.metrics_processor.logger.log(metrics, self.step)


def _now(device: torch.device) -> float:
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
