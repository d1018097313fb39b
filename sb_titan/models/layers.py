"""A family's decoder config from its dims: TorchTitan's blocks and attention with the
recipe's inner attention (SBAttention) in every layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch.nn as nn
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.attention import GQAttention, QKVLinear
from torchtitan.models.common.config_utils import make_ffn_config
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.common.rope import RoPE

from sb_titan.models.attention import SBAttention, SparseAttentionConfig
from sb_titan.models.dims import ModelDims
from sb_titan.models.family import Family

_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}


class ScaledGQAttention(GQAttention):
    """TorchTitan's GQAttention with a factor on its softmax scale: YaRN's attention
    scaling (transformers multiplies cos and sin by it; TorchTitan's RoPE omits it). The
    scale reaches every inner attention as `scale=`, so SBAttention's kernels, its block
    estimator and the KV-cached decode all score with it."""

    @dataclass(kw_only=True, slots=True)
    class Config(GQAttention.Config):
        score_scale: float = 1.0

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.scaling = self.head_dim**-0.5 * config.score_scale


def dense_layer_set(dense_layers: list[int], n_layers: int) -> set[int]:
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


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT)


def _linear(n_in: int, n_out: int, bias: bool = False) -> Linear.Config:
    return Linear.Config(in_features=n_in, out_features=n_out, bias=bias, param_init=_LINEAR_INIT)


def rope_config(family: Family, d: ModelDims) -> RoPE.Config:
    """The family's RoPE class with `d`'s theta, length and scaling, in TorchTitan's terms."""
    kwargs: dict = {}
    s = d.rope_scaling
    if s is not None and s.rope_type == "llama3":
        kwargs = dict(
            scaling="llama",
            scaling_factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    elif s is not None:
        kwargs = dict(
            scaling="yarn",
            rope_factor=s.factor,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            original_seq_len=s.original_max_position_embeddings,
            truncate=s.truncate,
        )
    return family.rope_cls.Config(
        dim=d.head_dim, max_seq_len=d.max_seq_len, theta=d.rope_theta, **kwargs
    )


def _attention(family: Family, d: ModelDims, inner: SBAttention.Config) -> ScaledGQAttention.Config:
    qkv = QKVLinear.Config(
        head_dim=d.head_dim,
        wq=_linear(d.dim, d.n_heads * d.head_dim, family.qkv_bias),
        wkv=_linear(d.dim, d.n_kv_heads * d.head_dim, family.qkv_bias),
    )
    return ScaledGQAttention.Config(
        n_heads=d.n_heads,
        n_kv_heads=d.n_kv_heads,
        head_dim=d.head_dim,
        dim=d.dim,
        qkv_linear=qkv,
        wo=_linear(d.n_heads * d.head_dim, d.dim),
        qk_norm=_norm(d.head_dim, d.norm_eps) if family.qk_norm else None,
        inner_attention=inner,
        rope=rope_config(family, d),
        score_scale=d.score_scale,
    )


def decoder_config(
    family: Family, d: ModelDims, attention: SparseAttentionConfig
) -> Decoder.Config:
    """`family`'s TorchTitan model config of size `d`, sparse where `attention` says."""
    dense = dense_layer_set(attention.dense_layers, d.n_layers) if attention.enabled else set()
    layers = []
    for i in range(d.n_layers):
        inner = SBAttention.Config(
            sparse=attention.enabled and i not in dense,
            policy=attention.policy,
            block_size=attention.block_size,
            backend=attention.backend,
            scorer=attention.scorer,
            true_recall_rate=attention.true_recall_rate,
        )
        layers.append(
            family.block_cls.Config(
                attention_norm=_norm(d.dim, d.norm_eps),
                ffn_norm=_norm(d.dim, d.norm_eps),
                attention=_attention(family, d, inner),
                feed_forward=make_ffn_config(
                    dim=d.dim,
                    hidden_dim=d.hidden_dim,
                    w1_param_init=_LINEAR_INIT,
                    w2w3_param_init=_LINEAR_INIT,
                ),
            )
        )
    embed_init = {"weight": skip_param_init} if d.tie_embeddings else _LINEAR_INIT
    return family.model_cls.Config(
        vocab_size=d.vocab_size,
        dim=d.dim,
        norm=_norm(d.dim, d.norm_eps),
        enable_weight_tying=d.tie_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=d.vocab_size, embedding_dim=d.dim, param_init=embed_init
        ),
        lm_head=Linear.Config(
            in_features=d.dim, out_features=d.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )
