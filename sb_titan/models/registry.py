"""From a config to the model it builds, for every family: the `[model]` section (family,
flavor, overrides), an HF initial load's config.json, and `[sparse_attention]` -> dims
-> a TorchTitan ModelSpec. The one rule the trainer, the tools and eval share."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import torch
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.logging import logger

from sb_titan.models.attention import SparseAttentionConfig
from sb_titan.models.dims import ModelDims
from sb_titan.models.family import Family
from sb_titan.models.flavors import HF_FLAVOR, family_flavors
from sb_titan.models.hf_config import dims_from_hf_config, read_hf_config
from sb_titan.models.layers import decoder_config
from sb_titan.models.llama3 import FAMILY as LLAMA3
from sb_titan.models.model_config import ModelConfig
from sb_titan.models.qwen2_5 import FAMILY as QWEN2_5
from sb_titan.models.qwen3 import FAMILY as QWEN3
from sb_titan.models.sections import ModelSections

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2_5, QWEN3, LLAMA3)}
_BY_MODEL_TYPE = {f.hf_model_type: f for f in FAMILIES.values()}
TRITON_HEAD_DIMS = (64, 128)
"""The head sizes the Triton kernels are compiled for."""

# ModelDims field -> config.json key. Shapes must match a checkpoint exactly; the
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


def family_of(hf: dict, source: str = "config.json") -> Family:
    """The family whose model a config.json's `model_type` names (one line if none);
    without one, Qwen2 (what the recipe read before it had families)."""
    kind = hf.get("model_type", "qwen2")
    if kind not in _BY_MODEL_TYPE:
        raise ValueError(
            f"{source}: model_type = {kind!r}: expected one of {sorted(_BY_MODEL_TYPE)} "
            "(dense Qwen2 / Qwen2.5, Qwen3 and Llama 3; mixture-of-experts models are "
            "not supported)"
        )
    return _BY_MODEL_TYPE[kind]


def family_of_decoder(model: Decoder.Config) -> str:
    """The family whose decoder `model` is, told apart by what the families differ in
    (model and RoPE classes, q/k/v biases, QK-norm): a profile of one family does not
    price another's layers, whatever their shapes."""
    attn = model.layers[0].attention
    built = (type(model), type(attn.rope), attn.qkv_linear.wq.bias, attn.qk_norm is not None)
    for fam in FAMILIES.values():
        if built == (fam.model_cls.Config, fam.rope_cls.Config, fam.qkv_bias, fam.qk_norm):
            return fam.name
    raise ValueError(f"a {type(model).__qualname__} that is none of {sorted(FAMILIES)}")


def hf_dims(config_json: str | Path) -> ModelDims:
    """The model a Hugging Face config.json describes (ValueError in one line if the
    recipe cannot build it exactly)."""
    hf = read_hf_config(config_json)
    return dims_from_hf_config(hf, family_of(hf, str(config_json)), str(config_json))


def dims_from_model_config(model: ModelConfig, family: str | None = None) -> ModelDims:
    """The `[model]` section (flavor + optional overrides; None = the flavor's value) ->
    dims; `family` when [model] leaves it open (an HF initial load's), else qwen2_5."""
    name = model.family or family or "qwen2_5"
    flavors = family_flavors(name)
    if model.flavor not in flavors:
        why = "needs an HF initial load" if model.flavor == HF_FLAVOR else f"not a {name} flavor"
        raise ValueError(
            f"model.flavor: {model.flavor!r} ({why}); expected one of {sorted(flavors)}"
        )
    return dataclasses.replace(flavors[model.flavor], **_overrides(model))


def _overrides(model: ModelConfig) -> dict:
    """The dims fields [model] sets (None: left to the flavor or the checkpoint)."""
    names = ("tie_embeddings", *HF_VALUE_KEYS)
    return {n: v for n in names if (v := getattr(model, n)) is not None}


def adopt_hf_checkpoint(
    dims: ModelDims, config_json: str | Path, explicit: Collection[str] = ()
) -> ModelDims:
    """`dims` checked against the HF checkpoint the run starts from.

    The family and shapes must agree, and so must values set explicitly in [model]
    (`explicit`, field names), except a larger max_seq_len (training beyond the
    checkpoint's context); the other values (RoPE theta, scaling, norm eps, max
    positions) are the checkpoint's.
    """
    path = Path(config_json)
    ckpt = hf_dims(path)

    def refuse(field: str, key: str, why: str = "") -> None:
        raise ValueError(
            f"{path}: {key} = {getattr(ckpt, field)!r} in the checkpoint but the config "
            f"builds {getattr(dims, field)!r}{why}"
        )

    if ckpt.family != dims.family:
        raise ValueError(
            f"{path}: a {ckpt.family} checkpoint but the config builds {dims.family} (model.family)"
        )
    for field, key in HF_SHAPE_KEYS.items():
        if getattr(ckpt, field) != getattr(dims, field):
            refuse(field, key, " (model.flavor)")
    if dims.tie_embeddings and not ckpt.tie_embeddings:
        refuse("tie_embeddings", "tie_word_embeddings", " (set [model] tie_embeddings = false)")
    adopted = {}
    for field, key in {**HF_VALUE_KEYS, "rope_scaling": "rope_scaling"}.items():
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


def _initial_load_config(config: ModelSections) -> Path | None:
    """config.json of the HF checkpoint an initial load starts from
    (checkpoint.initial_load_in_hf, from initial_load_path, else hf_assets_path, as
    TorchTitan does), if there is one."""
    ckpt = config.checkpoint
    if not (ckpt.enable and ckpt.initial_load_in_hf):
        return None
    path = Path(ckpt.initial_load_path or config.hf_assets_path) / "config.json"
    return path if path.is_file() else None


def model_dims(config: ModelSections) -> ModelDims:
    """The dims a trainer config builds: [model], with the values of an HF initial
    load's config.json; `flavor = "hf"` builds that config.json's model as it is."""
    m = config.model
    config_json = _initial_load_config(config)
    explicit = [f for f in HF_VALUE_KEYS if getattr(m, f) is not None]
    if config_json is None:
        dims = dims_from_model_config(m)
    else:
        ckpt = hf_dims(config_json)
        if m.flavor == HF_FLAVOR:
            family = m.family or ckpt.family
            dims = dataclasses.replace(ckpt, family=family, **_overrides(m))
        else:
            dims = dims_from_model_config(m, ckpt.family)
        dims = adopt_hf_checkpoint(dims, config_json, explicit)
    seq_len = config.training.seq_len
    if seq_len > dims.max_seq_len:
        raise ValueError(
            f"training.seq_len = {seq_len} is beyond the model's {dims.max_seq_len} "
            "positions (set [model] max_seq_len)"
        )
    check_kernel_head_dim(dims, config.sparse_attention, str(config_json or "model.flavor"))
    return dims


def check_kernel_head_dim(dims: ModelDims, attention: SparseAttentionConfig, source: str) -> None:
    """One line before ranks spawn when the Triton kernels would run on a head size they
    do not ship (an explicit `triton` backend, or `auto` on a CUDA machine)."""
    triton = attention.backend == "triton" or (
        attention.backend == "auto" and torch.cuda.is_available()
    )
    if attention.enabled and triton and dims.head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"{source}: head_dim = {dims.head_dim}: the Triton kernels ship head_dim "
            f"{' and '.join(map(str, TRITON_HEAD_DIMS))} (sparse_attention.backend = "
            f"{attention.backend!r}; 'torch' or 'flex' run any head_dim)"
        )


def model_registry(
    flavor: str,
    attention: SparseAttentionConfig | None = None,
    tie_embeddings: bool | None = None,
    dims: ModelDims | None = None,
    family: str = "qwen2_5",
) -> ModelSpec:
    """The ModelSpec for `family`'s `flavor` (or explicit `dims`, e.g. from an HF
    config, whose family it is)."""
    if dims is None:
        flavors = family_flavors(family)
        if flavor not in flavors:
            raise ValueError(
                f"model.flavor: unknown {family} flavor {flavor!r}; expected one of "
                f"{sorted(flavors)}"
            )
        dims = flavors[flavor]
    if tie_embeddings is not None:
        dims = dataclasses.replace(dims, tie_embeddings=tie_embeddings)
    fam = FAMILIES[dims.family]
    return ModelSpec(
        name=fam.name,
        flavor=flavor,
        model=decoder_config(fam, dims, attention or SparseAttentionConfig()),
        parallelize_fn=fam.parallelize_fn,
        pipelining_fn=fam.pipelining_fn,
        post_optimizer_build_fn=None,
        state_dict_adapter=fam.adapter,
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
