"""Qwen2.5's dimensions: the named flavors (`[model] flavor`) and the released models'
RoPE and RMSNorm defaults. Its own module so that the `[model]` section can name the
flavors without importing the model code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ROPE_THETA = 1_000_000.0
"""The released Qwen2.5 models' RoPE base (the flavors' default)."""
NORM_EPS = 1e-6
"""The released Qwen2.5 models' RMSNorm epsilon (the flavors' default)."""


@dataclass(frozen=True, slots=True)
class Qwen25Dims:
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
    rope_theta: float = ROPE_THETA
    norm_eps: float = NORM_EPS


FLAVORS: dict[str, Qwen25Dims] = {
    # Tiny CPU model; head_dim 64 like 0.5B so the sparse kernels' shapes are real.
    # Untied so that pipeline parallelism works out of the box.
    "debug": Qwen25Dims(256, 2, 4, 2, 64, 512, 1024, False, 32768),
    # The same with 4 layers: multi-token key -> value recall needs composed offset heads
    # that 2 layers of 4 heads did not learn in CPU time (bench/accuracy.py's base).
    "debug4": Qwen25Dims(256, 4, 4, 2, 64, 512, 1024, False, 32768),
    # Published Qwen2.5 dimensions (Hugging Face config.json).
    "0.5b": Qwen25Dims(896, 24, 14, 2, 64, 4864, 151936, True),
    "1.5b": Qwen25Dims(1536, 28, 12, 2, 128, 8960, 151936, True),
    "3b": Qwen25Dims(2048, 36, 16, 2, 128, 11008, 151936, True),
    "7b": Qwen25Dims(3584, 28, 28, 4, 128, 18944, 152064, False),
}
Flavor = Literal[tuple(FLAVORS)]  # `[model] flavor`: the CLI help and TOML errors list them
