"""A Hugging Face config.json <-> ModelDims, for every family.

Reading refuses, in one line naming the key and value, anything the built model would
get silently wrong: mixture-of-experts, sliding-window or dual-chunk attention, a RoPE
type the family's RoPE does not compute as transformers does, another activation.
RoPE scaling is read as transformers reads it (v4 `rope_scaling` or v5
`rope_parameters`, its defaults filled in).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sb_titan.models.dims import ModelDims, RopeScaling
from sb_titan.models.family import Family

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict (ValueError naming the file if it is not one)."""
    path = Path(path)
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a JSON config: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return hf


def _refuse(source: str, key: str, value: object, why: str) -> None:
    raise ValueError(f"{source}: {key} = {value!r}: {why}")


def check_hf_config(hf: dict[str, Any], family: Family, source: str = "config.json") -> None:
    """ValueError naming `source` and the key for anything `family`'s model would get
    wrong, or that is out of the recipe's scope."""
    for key in _MOE_KEYS:
        if hf.get(key):
            _refuse(source, key, hf[key], "mixture-of-experts models are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(source, "hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is supported")
    bias = hf.get("attention_bias", family.qkv_bias)
    if bias is not family.qkv_bias:
        _refuse(
            source, "attention_bias", bias, f"{family.hf_architecture} expects {family.qkv_bias}"
        )
    if hf.get("mlp_bias"):
        _refuse(source, "mlp_bias", hf["mlp_bias"], "MLP biases are not supported")
    if hf.get("use_sliding_window"):
        _refuse(source, "use_sliding_window", True, "sliding-window attention is not supported")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        _refuse(source, "layer_types", layer_types, "only 'full_attention' layers are supported")
    if hf.get("dual_chunk_attention_config") is not None:
        dual = hf["dual_chunk_attention_config"]
        _refuse(
            source, "dual_chunk_attention_config", dual, "dual-chunk attention is not supported"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(source, "partial_rotary_factor", hf["partial_rotary_factor"], "expected 1.0")
    rope_scaling(hf, family, source)  # refuses an unknown type or a bad field
    _hf_rope_theta(hf, family, source)  # both forms present and different


def _hf_rope_theta(hf: dict[str, Any], family: Family, source: str) -> float:
    """theta from v4's top-level `rope_theta` or v5's `rope_parameters.rope_theta`."""
    params = hf.get("rope_parameters") or {}
    v4, v5 = hf.get("rope_theta"), params.get("rope_theta")
    if v4 is not None and v5 is not None and float(v4) != float(v5):
        raise ValueError(
            f"{source}: rope_theta = {v4!r} but rope_parameters.rope_theta = {v5!r}: "
            "expected one value"
        )
    theta = v5 if v5 is not None else v4
    return float(theta) if theta is not None else family.hf_defaults.rope_theta


def rope_scaling(hf: dict[str, Any], family: Family, source: str) -> RopeScaling | None:
    """The config's RoPE scaling as transformers computes it, or None for plain RoPE."""
    found = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            _refuse(source, key, rope, "expected a JSON object or null")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in family.rope_types:
            why = f"expected one of {family.rope_types} for {family.hf_architecture}"
            _refuse(source, f"{key}.rope_type", kind, why)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse(
                source,
                f"{key}.partial_rotary_factor",
                rope["partial_rotary_factor"],
                "expected 1.0",
            )
        if kind != "default" and found is None:
            found = (key, kind, rope)
    if found is None:
        return None
    key, kind, rope = found
    max_positions = hf.get("max_position_embeddings") or family.hf_defaults.max_position_embeddings
    original = int(
        rope.get("original_max_position_embeddings")
        or hf.get("original_max_position_embeddings")
        or max_positions
    )
    factor = rope.get("factor")
    if factor is None and kind == "yarn":
        factor = max_positions / original  # transformers' rule when only lengths are given
    if not isinstance(factor, (int, float)) or factor <= 0:
        _refuse(source, f"{key}.factor", factor, "expected a positive number")
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(factor),
            original,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        )
    return RopeScaling(
        "yarn",
        float(factor),
        original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=rope.get("attention_factor"),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
    )


def dims_from_hf_config(
    hf: dict[str, Any], family: Family, source: str = "config.json"
) -> ModelDims:
    """Dimensions, RoPE (theta, length, scaling), norm eps and tying of `family`'s
    config.json (ValueError naming `source` if the model cannot represent it exactly)."""
    check_hf_config(hf, family, source)
    n_heads = hf["num_attention_heads"]
    d = family.hf_defaults
    return ModelDims(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or d.head_dim or hf["hidden_size"] // n_heads,
        hidden_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings") or d.max_position_embeddings,
        rope_theta=_hf_rope_theta(hf, family, source),
        norm_eps=float(hf.get("rms_norm_eps") or d.rms_norm_eps),
        family=family.name,
        rope_scaling=rope_scaling(hf, family, source),
    )


def rope_parameters(dims: ModelDims) -> dict[str, Any]:
    """config.json's v5 `rope_parameters` for `dims` (also written as v4 fields)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": dims.rope_theta}
    s = dims.rope_scaling
    if s is None:
        return out
    out |= {
        "rope_type": s.rope_type,
        "factor": s.factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
    }
    if s.rope_type == "llama3":
        return out | {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor}
    extra = {
        "attention_factor": s.attention_factor,
        "mscale": s.mscale,
        "mscale_all_dim": s.mscale_all_dim,
    }
    out |= {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
    return out | {k: v for k, v in extra.items() if v is not None}


def hf_model_config(dims: ModelDims, family: Family) -> dict[str, Any]:
    """The model part of config.json for transformers' `family` class (v4 and v5 RoPE
    fields both set)."""
    rope = rope_parameters(dims)
    out = {
        "architectures": [family.hf_architecture],
        "model_type": family.hf_model_type,
        "hidden_size": dims.dim,
        "intermediate_size": dims.hidden_dim,
        "num_hidden_layers": dims.n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab_size,
        "max_position_embeddings": dims.max_seq_len,
        "rms_norm_eps": dims.norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
        if dims.rope_scaling
        else None,
        "hidden_act": "silu",
        "attention_bias": family.qkv_bias,
        "tie_word_embeddings": dims.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family.hf_model_type != "llama":
        out |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": dims.n_layers,
        }
    return out
