"""A model's dimensions and RoPE, whatever its family: what a flavor names and what a
Hugging Face config.json describes. Plain data, so that the `[model]` section, the
simulator and the cost model can hold it without importing model code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FamilyName = Literal["qwen2_5", "qwen3", "llama3"]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """config.json's `rope_scaling` (v4) / `rope_parameters` (v5) beyond plain RoPE, with
    transformers' defaults filled in: `llama3` (Llama 3.1 / 3.2) or `yarn` (Qwen past
    32K)."""

    rope_type: Literal["llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than original / low_freq_factor are scaled by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than original / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations at which the extrapolation ramp starts."""
    beta_slow: float = 1.0
    truncate: bool = True
    """yarn: floor / ceil the correction range, as transformers does by default."""
    attention_factor: float | None = None
    """yarn: the factor transformers multiplies cos and sin by; None: from `factor`
    (and `mscale` / `mscale_all_dim` when both are given)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def cos_sin_factor(self) -> float:
        """What transformers multiplies cos / sin by (1 for llama3): its YaRN mscale."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(
                self.factor, self.mscale_all_dim
            )
        return get_mscale(self.factor)


@dataclass(frozen=True, slots=True)
class ModelDims:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    tie_embeddings: bool
    max_seq_len: int = 131072
    """RoPE cache length; config.json's max_position_embeddings."""
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    family: FamilyName = "qwen2_5"
    """Which decoder (models/<family>/): QK-norm, q/k/v biases, RoPE layout."""
    rope_scaling: RopeScaling | None = None

    @property
    def score_scale(self) -> float:
        """The factor on the softmax scale 1/sqrt(head_dim): YaRN scales cos and sin by
        its mscale, so q . k by its square; TorchTitan's RoPE stays a pure rotation."""
        return self.rope_scaling.cos_sin_factor**2 if self.rope_scaling else 1.0
