"""What a model family is: the differences between the decoders the recipe trains.

Each family is TorchTitan's own model code (its block and model classes, its RoPE
layout) with the recipe's inner attention; models/<family>/__init__.py fills one
`Family` and holds nothing else that the others share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.common.rope import RoPE
from torchtitan.protocols.state_dict_adapter import StateDictAdapter


@dataclass(frozen=True)
class HFDefaults:
    """transformers' config defaults for the keys a config.json may omit."""

    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    head_dim: int | None = None
    """None: hidden_size // num_attention_heads."""


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_type: str
    """config.json's `model_type`."""
    hf_architecture: str
    """config.json's `architectures[0]` on export."""
    model_cls: type[Decoder]
    block_cls: type[TransformerBlock]
    rope_cls: type[RoPE]
    """CosSinRoPE (rotate-half, HF's q/k layout) or ComplexRoPE (interleaved pairs: the
    adapter permutes q/k)."""
    qkv_bias: bool
    """Also what config.json's `attention_bias` must say (its default when absent)."""
    qk_norm: bool
    rope_types: tuple[str, ...]
    """The config.json rope types this family's RoPE class computes as transformers does."""
    hf_defaults: HFDefaults
    adapter: type[StateDictAdapter]
    parallelize_fn: Callable
    pipelining_fn: Callable
