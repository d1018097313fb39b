"""Qwen2.5 as a TorchTitan model spec, with the recipe's sparse inner attention.

Qwen2.5 is Qwen3's decoder without QK-norm and with q/k/v biases: GQA, RoPE
theta 1e6, SwiGLU, RMSNorm eps 1e-6, optional tied embeddings. TorchTitan's Qwen3
model and parallelization are reused unchanged; only the layer configs differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch.nn as nn
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import GQAttention, QKVLinear
from torchtitan.models.common.config_utils import make_ffn_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from sb_titan.attention.module import SBAttention, SparseAttentionConfig

_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}
_EPS = 1e-6
ROPE_THETA = 1_000_000.0


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


FLAVORS: dict[str, Qwen25Dims] = {
    # Tiny CPU model; head_dim 64 like 0.5B so the sparse kernels' shapes are real.
    # Untied so that pipeline parallelism works out of the box.
    "debug": Qwen25Dims(256, 2, 4, 2, 64, 512, 1024, False, 32768),
    # Published Qwen2.5 dimensions (Hugging Face config.json).
    "0.5b": Qwen25Dims(896, 24, 14, 2, 64, 4864, 151936, True),
    "1.5b": Qwen25Dims(1536, 28, 12, 2, 128, 8960, 151936, True),
    "3b": Qwen25Dims(2048, 36, 16, 2, 128, 11008, 151936, True),
    "7b": Qwen25Dims(3584, 28, 28, 4, 128, 18944, 152064, False),
}


def dims_from_hf_config(hf: dict) -> Qwen25Dims:
    """Dimensions of any Qwen2 checkpoint from its Hugging Face config.json."""
    n_heads = hf["num_attention_heads"]
    return Qwen25Dims(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        hidden_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings", 32768),
    )


def _norm(dim: int) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=_EPS, param_init=_NORM_INIT)


def _dense_layer_set(dense_layers: list[int], n_layers: int) -> set[int]:
    out = set()
    for i in dense_layers:
        j = i + n_layers if i < 0 else i
        if not 0 <= j < n_layers:
            raise ValueError(
                f"sparse_attention.dense_layers: layer {i} is out of range for a "
                f"{n_layers}-layer model"
            )
        out.add(j)
    return out


def build_qwen2_5_config(d: Qwen25Dims, attention: SparseAttentionConfig) -> Qwen3Model.Config:
    dense = _dense_layer_set(attention.dense_layers, d.n_layers) if attention.enabled else set()
    rope = CosSinRoPE.Config(dim=d.head_dim, max_seq_len=d.max_seq_len, theta=ROPE_THETA)
    layers = []
    for i in range(d.n_layers):
        inner = SBAttention.Config(
            sparse=attention.enabled and i not in dense,
            policy=attention.policy,
            block_size=attention.block_size,
            backend=attention.backend,
        )
        qkv = QKVLinear.Config(
            head_dim=d.head_dim,
            wq=Linear.Config(
                in_features=d.dim,
                out_features=d.n_heads * d.head_dim,
                bias=True,
                param_init=_LINEAR_INIT,
            ),
            wkv=Linear.Config(
                in_features=d.dim,
                out_features=d.n_kv_heads * d.head_dim,
                bias=True,
                param_init=_LINEAR_INIT,
            ),
        )
        attn = GQAttention.Config(
            n_heads=d.n_heads,
            n_kv_heads=d.n_kv_heads,
            head_dim=d.head_dim,
            dim=d.dim,
            qkv_linear=qkv,
            wo=Linear.Config(
                in_features=d.n_heads * d.head_dim, out_features=d.dim, param_init=_LINEAR_INIT
            ),
            qk_norm=None,
            inner_attention=inner,
            rope=dataclasses.replace(rope),
        )
        layers.append(
            Qwen3TransformerBlock.Config(
                attention_norm=_norm(d.dim),
                ffn_norm=_norm(d.dim),
                attention=attn,
                feed_forward=make_ffn_config(
                    dim=d.dim,
                    hidden_dim=d.hidden_dim,
                    w1_param_init=_LINEAR_INIT,
                    w2w3_param_init=_LINEAR_INIT,
                ),
            )
        )
    embed_init = {"weight": skip_param_init} if d.tie_embeddings else _LINEAR_INIT
    return Qwen3Model.Config(
        vocab_size=d.vocab_size,
        dim=d.dim,
        norm=_norm(d.dim),
        enable_weight_tying=d.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=d.vocab_size, embedding_dim=d.dim, param_init=embed_init
        ),
        lm_head=Linear.Config(
            in_features=d.dim, out_features=d.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )


def model_registry(
    flavor: str,
    attention: SparseAttentionConfig | None = None,
    tie_embeddings: bool | None = None,
    dims: Qwen25Dims | None = None,
) -> ModelSpec:
    """The Qwen2.5 ModelSpec for `flavor` (or explicit `dims`, e.g. from an HF config)."""
    from sb_titan.models.qwen2_5.parallelize import parallelize_qwen2_5, pipeline_qwen2_5
    from sb_titan.models.qwen2_5.state_dict_adapter import Qwen25StateDictAdapter

    if dims is None:
        if flavor not in FLAVORS:
            raise ValueError(
                f"model.flavor: unknown flavor {flavor!r}; expected one of {sorted(FLAVORS)}"
            )
        dims = FLAVORS[flavor]
    if tie_embeddings is not None:
        dims = dataclasses.replace(dims, tie_embeddings=tie_embeddings)
    config = build_qwen2_5_config(dims, attention or SparseAttentionConfig())
    return ModelSpec(
        name="qwen2_5",
        flavor=flavor,
        model=config,
        parallelize_fn=parallelize_qwen2_5,
        pipelining_fn=pipeline_qwen2_5,
        post_optimizer_build_fn=None,
        state_dict_adapter=Qwen25StateDictAdapter,
    )
