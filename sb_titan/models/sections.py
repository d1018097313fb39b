"""The trainer-config sections the model is derived from, named as a Protocol: the
model layer reads these and no others, and never names the trainer's config class
(which lives above it)."""

from __future__ import annotations

from typing import Protocol

from torchtitan.config import TrainingConfig

from sb_titan.models.attention import SparseAttentionConfig
from sb_titan.models.model_config import ModelConfig


class InitialLoad(Protocol):
    """What `[checkpoint]` says about the checkpoint a run starts from."""

    @property
    def enable(self) -> bool: ...
    @property
    def initial_load_in_hf(self) -> bool: ...
    @property
    def initial_load_path(self) -> str | None: ...


class ModelSections(Protocol):
    """`[model]`, `[sparse_attention]`, `training.seq_len`, and the HF checkpoint an
    initial load starts from (whose config.json the dims adopt)."""

    model: ModelConfig
    sparse_attention: SparseAttentionConfig
    training: TrainingConfig
    hf_assets_path: str

    @property
    def checkpoint(self) -> InitialLoad: ...
