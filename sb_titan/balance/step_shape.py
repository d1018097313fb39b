"""How a training config cuts one step: the one rule the trainer, sb-plan and
sb-simulate share, so a tool never plans a different step than the trainer runs.

TorchTitan's trainer (0.3.0, `Trainer.__init__`) takes `grad_accum = global_batch_size //
(local_batch_size · dp)` loader batches per step (one when global_batch_size < 0), and
under pipeline parallelism splits each into `local_batch_size // microbatch_size`
micro-batches; the loader then yields one micro-batch per item.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sb_titan.context_parallel.split import check_divisible

if TYPE_CHECKING:  # names only: planning a step builds no model
    from torchtitan.config import ParallelismConfig, TrainingConfig

    from sb_titan.models.attention import SparseAttentionConfig


class StepSections(Protocol):
    """The trainer-config sections that cut a step: the degrees and micro-batch size,
    the batch sizes and sequence length, and (under context parallelism) the attention
    block and backend."""

    parallelism: ParallelismConfig
    training: TrainingConfig
    sparse_attention: SparseAttentionConfig


@dataclass(frozen=True, slots=True)
class StepShape:
    seq_len: int
    dp: int
    """Data-parallel ranks (world size over the pipeline, tensor and context degrees)."""
    microbatches: int
    """Micro-batches per DP rank and step: gradient accumulation x pipeline micro-batches."""
    rows: int
    """Rows of `seq_len` tokens per micro-batch."""


def step_shape(config: StepSections, world_size: int) -> StepShape:
    """The step the trainer runs for `config` on `world_size` ranks.

    Raises ValueError naming the keys when the sizes do not divide, as TorchTitan would
    (it asserts later, inside every rank)."""
    p, t = config.parallelism, config.training
    non_dp = p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree
    if world_size < 1 or world_size % non_dp:
        raise ValueError(
            f"world size {world_size} is not a multiple of pipeline x tensor x context "
            f"parallel degrees ({non_dp})"
        )
    dp = world_size // non_dp
    if p.context_parallel_degree > 1:
        check_context_parallel(config)
    per_step = t.local_batch_size * dp
    global_bs = per_step if t.global_batch_size < 0 else t.global_batch_size
    if global_bs < per_step or global_bs % per_step:
        raise ValueError(
            f"training.global_batch_size ({global_bs}) must be a positive multiple of "
            f"training.local_batch_size x data-parallel ranks ({t.local_batch_size} x {dp})"
        )
    grad_accum = global_bs // per_step
    if p.pipeline_parallel_degree > 1:
        rows = p.pipeline_parallel_microbatch_size
        if rows < 1 or t.local_batch_size % rows:
            raise ValueError(
                f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size ({rows})"
            )
        return StepShape(t.seq_len, dp, grad_accum * (t.local_batch_size // rows), rows)
    return StepShape(t.seq_len, dp, grad_accum, t.local_batch_size)


CP_SPLITS = ("sparse", "headtail")
"""parallelism.context_parallel_load_balancer under the recipe's CP: `sparse` splits
each row by predicted sparse cost, `headtail` is the dense zigzag split."""


def check_context_parallel(config: StepSections) -> None:
    """What the recipe's context parallelism needs of a config (ValueError naming keys)."""
    p, sa = config.parallelism, config.sparse_attention
    check_divisible(config.training.seq_len, p.context_parallel_degree, sa.block_size)
    if p.context_parallel_load_balancer not in CP_SPLITS:
        raise ValueError(
            f"parallelism.context_parallel_load_balancer = {p.context_parallel_load_balancer!r}"
            f": under context parallelism expected one of {CP_SPLITS}"
        )
    if sa.backend == "flex":
        raise ValueError(
            "sparse_attention.backend = 'flex' does not run under context parallelism "
            "(use auto, torch or triton)"
        )
    if p.tensor_parallel_degree > 1:
        raise ValueError("context parallelism with tensor parallelism is not supported yet")
