"""Qwen2.5 as a TorchTitan model spec, with the recipe's sparse inner attention.

Qwen2.5 is Qwen3's decoder without QK-norm and with q/k/v biases: GQA, RoPE
(theta 1e6 in the released models), SwiGLU, RMSNorm (eps 1e-6), optional tied
embeddings. TorchTitan's Qwen3 model and parallelization are reused unchanged; only the
layer configs differ. theta, eps and the RoPE length are fields of Qwen25Dims so a
checkpoint's own values (e.g. theta 1e7 of the 1M-context variants) are kept.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

import torch.nn as nn
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import GQAttention, QKVLinear
from torchtitan.models.common.config_utils import make_ffn_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger

from sb_titan.models.qwen2_5.attention import SBAttention, SparseAttentionConfig
from sb_titan.models.qwen2_5.flavors import FLAVORS as FLAVORS
from sb_titan.models.qwen2_5.flavors import Qwen25Dims as Qwen25Dims
from sb_titan.models.qwen2_5.model_config import ModelConfig as ModelConfig
from sb_titan.models.qwen2_5.sections import ModelSections

_LINEAR_INIT: dict[str, Callable] = {
    "weight": partial(nn.init.normal_, std=0.02),
    "bias": nn.init.zeros_,
}
_NORM_INIT = {"weight": nn.init.ones_}


# Qwen25Dims field -> config.json key. Shapes must match a checkpoint exactly; the
# values may be adopted from it (see adopt_hf_checkpoint).
HF_SHAPE_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
}
HF_VALUE_KEYS = {
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
}
# transformers' Qwen2Config defaults, used when config.json omits the key.
_HF_DEFAULT_THETA = 10000.0
_HF_DEFAULT_EPS = 1e-6
_HF_DEFAULT_MAX_POSITIONS = 32768


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face config.json, checked to be a Qwen2 this model represents exactly."""
    path = Path(path)
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a JSON config: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object")
    check_hf_config(hf, str(path))
    return hf


def check_hf_config(hf: dict[str, Any], source: str = "config.json") -> None:
    """ValueError naming `source` and the key for anything the model would get silently
    wrong: RoPE scaling, sliding-window / dual-chunk attention, another activation or
    architecture, missing q/k/v biases."""

    def refuse(key: str, value: object, why: str) -> None:
        raise ValueError(f"{source}: {key} = {value!r}: {why}")

    if hf.get("model_type", "qwen2") != "qwen2":
        refuse("model_type", hf["model_type"], "expected 'qwen2'")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is supported")
    if hf.get("attention_bias", True) is not True:
        refuse("attention_bias", hf["attention_bias"], "Qwen2 has q/k/v biases")
    if hf.get("use_sliding_window"):
        refuse(
            "use_sliding_window",
            hf["use_sliding_window"],
            "sliding-window attention is not supported",
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        refuse("layer_types", layer_types, "only 'full_attention' layers are supported")
    if hf.get("dual_chunk_attention_config") is not None:
        refuse(
            "dual_chunk_attention_config",
            hf["dual_chunk_attention_config"],
            "dual-chunk attention is not supported",
        )
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            refuse(key, rope, "expected a JSON object or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            refuse(f"{key}.rope_type", kind, "only plain RoPE ('default') is supported")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(f"{key}.partial_rotary_factor", rope["partial_rotary_factor"], "expected 1.0")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", hf["partial_rotary_factor"], "expected 1.0")
    _hf_rope_theta(hf, source)  # both forms present and different


def _hf_rope_theta(hf: dict[str, Any], source: str) -> float:
    """theta from v4's top-level `rope_theta` or v5's `rope_parameters.rope_theta`."""
    params = hf.get("rope_parameters") or {}
    v4, v5 = hf.get("rope_theta"), params.get("rope_theta")
    if v4 is not None and v5 is not None and float(v4) != float(v5):
        raise ValueError(
            f"{source}: rope_theta = {v4!r} but rope_parameters.rope_theta = {v5!r}: "
            "expected one value"
        )
    theta = v5 if v5 is not None else v4
    return float(theta) if theta is not None else _HF_DEFAULT_THETA


def dims_from_hf_config(hf: dict[str, Any], source: str = "config.json") -> Qwen25Dims:
    """Dimensions, RoPE theta, norm eps and max positions of a Qwen2 config.json
    (ValueError naming `source` if the model cannot represent it exactly)."""
    check_hf_config(hf, source)
    n_heads = hf["num_attention_heads"]
    return Qwen25Dims(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        hidden_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings") or _HF_DEFAULT_MAX_POSITIONS,
        rope_theta=_hf_rope_theta(hf, source),
        norm_eps=float(hf.get("rms_norm_eps") or _HF_DEFAULT_EPS),
    )


def dims_from_model_config(model: ModelConfig) -> Qwen25Dims:
    """The `[model]` section (flavor + optional overrides; None = the flavor's value)
    → dims. The one rule the trainer, sb-eval and sb-export share."""
    if model.flavor not in FLAVORS:
        raise ValueError(
            f"model.flavor: unknown flavor {model.flavor!r}; expected one of {sorted(FLAVORS)}"
        )
    overrides = {
        name: value
        for name in ("tie_embeddings", *HF_VALUE_KEYS)
        if (value := getattr(model, name)) is not None
    }
    return dataclasses.replace(FLAVORS[model.flavor], **overrides)


def adopt_hf_checkpoint(
    dims: Qwen25Dims, config_json: str | Path, explicit: Collection[str] = ()
) -> Qwen25Dims:
    """`dims` checked against the HF checkpoint the run starts from.

    Shapes must agree, and so must values set explicitly in [model] (`explicit`, field
    names), except a larger max_seq_len (training beyond the checkpoint's context);
    the other values (RoPE theta, norm eps, max positions) are the checkpoint's.
    """
    path = Path(config_json)
    ckpt = dims_from_hf_config(read_hf_config(path), str(path))

    def refuse(field: str, key: str, why: str = "") -> None:
        raise ValueError(
            f"{path}: {key} = {getattr(ckpt, field)!r} in the checkpoint but the config "
            f"builds {getattr(dims, field)!r}{why}"
        )

    for field, key in HF_SHAPE_KEYS.items():
        if getattr(ckpt, field) != getattr(dims, field):
            refuse(field, key, " (model.flavor)")
    if dims.tie_embeddings and not ckpt.tie_embeddings:
        refuse("tie_embeddings", "tie_word_embeddings", " (set [model] tie_embeddings = false)")
    adopted = {}
    for field, key in HF_VALUE_KEYS.items():
        ours, theirs = getattr(dims, field), getattr(ckpt, field)
        if field not in explicit:
            if ours != theirs:
                adopted[field] = theirs
        elif ours != theirs and not (field == "max_seq_len" and ours > theirs):
            refuse(field, key, f" (model.{field})")
    if adopted:
        logger.info(
            f"model: from {path}: "
            + ", ".join(f"{f} = {v!r} (flavor: {getattr(dims, f)!r})" for f, v in adopted.items())
        )
    return dataclasses.replace(dims, **adopted)


def model_dims(config: ModelSections) -> Qwen25Dims:
    """The dims a trainer config builds: [model], plus the values of the HF checkpoint
    an initial load starts from (checkpoint.initial_load_in_hf, from initial_load_path,
    else hf_assets_path, as TorchTitan does) when it has a config.json."""
    dims = dims_from_model_config(config.model)
    ckpt = config.checkpoint
    if ckpt.enable and ckpt.initial_load_in_hf:
        config_json = Path(ckpt.initial_load_path or config.hf_assets_path) / "config.json"
        if config_json.is_file():
            explicit = [f for f in HF_VALUE_KEYS if getattr(config.model, f) is not None]
            dims = adopt_hf_checkpoint(dims, config_json, explicit)
    seq_len = config.training.seq_len
    if seq_len > dims.max_seq_len:
        raise ValueError(
            f"training.seq_len = {seq_len} is beyond the model's {dims.max_seq_len} "
            "positions (set [model] max_seq_len)"
        )
    return dims


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT)


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


def build_qwen2_5_config(d: Qwen25Dims, attention: SparseAttentionConfig) -> Qwen3Model.Config:
    dense = dense_layer_set(attention.dense_layers, d.n_layers) if attention.enabled else set()
    rope = CosSinRoPE.Config(dim=d.head_dim, max_seq_len=d.max_seq_len, theta=d.rope_theta)
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
                attention_norm=_norm(d.dim, d.norm_eps),
                ffn_norm=_norm(d.dim, d.norm_eps),
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


def derive_model_spec(config: ModelSections) -> ModelSpec:
    """The ModelSpec a trainer config builds: [model], with an HF initial load's values
    (`model_dims`), and [sparse_attention]. Derived from the final config by whatever
    builds from it (the trainer, once, whoever launched it; the tools that check, price
    or profile a run) and never stored on the config: a stored copy
    misses every override of those sections made after it (TorchTitan's launcher applies
    the command line to a registry's config)."""
    dims = model_dims(config)
    return model_registry(config.model.flavor, attention=config.sparse_attention, dims=dims)
