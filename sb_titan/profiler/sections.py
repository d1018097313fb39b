"""The trainer-config sections a profile reads, named as Protocols: the profiler
takes these and no others, and never names the trainer's config class (which lives
above it)."""

from __future__ import annotations

from typing import Protocol

from torchtitan.config import ParallelismConfig, TrainingConfig

from sb_titan.balance.cost_model import CostModelConfig
from sb_titan.models.attention import SparseAttentionConfig
from sb_titan.models.model_config import ModelConfig


class ProfiledSections(Protocol):
    """What a profile is measured for: `[model]`'s flavor, the pipeline split, the
    compute dtype and row length, and the attention block and backend."""

    model: ModelConfig
    parallelism: ParallelismConfig
    training: TrainingConfig
    sparse_attention: SparseAttentionConfig


class CheckedSections(ProfiledSections, Protocol):
    """A run that checks a profile against itself: also how strict `[cost_model]` is."""

    cost_model: CostModelConfig
