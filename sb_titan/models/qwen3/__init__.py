"""Qwen3 dense: TorchTitan's Qwen3 model and parallelization with the recipe's inner
attention. QK-norm (RMSNorm over head_dim), no q/k/v biases, head_dim set explicitly
(128 in the released sizes, not hidden / heads), rotate-half RoPE, tied or untied
embeddings. Mixture-of-experts Qwen3 is out of scope."""

from __future__ import annotations

from torchtitan.models.common import CosSinRoPE
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from sb_titan.models.family import Family, HFDefaults
from sb_titan.models.parallelize import parallelize_with_recipe_attention, pipeline_llm
from sb_titan.models.qwen3.flavors import FLAVORS as FLAVORS
from sb_titan.models.state_dict_adapter import COMMON_LAYER_KEYS, TableStateDictAdapter


def parallelize_qwen3(model, **kwargs):
    """TorchTitan's Qwen3 recipe (imported here: it must load after compat.install)."""
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as parallelize

    return parallelize_with_recipe_attention(parallelize, model, **kwargs)


class Qwen3StateDictAdapter(TableStateDictAdapter):
    FAMILY = "Qwen3"
    LAYER_KEYS = COMMON_LAYER_KEYS | {
        "self_attn.q_norm.weight": "attention.q_norm.weight",
        "self_attn.k_norm.weight": "attention.k_norm.weight",
    }


FAMILY = Family(
    name="qwen3",
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    model_cls=Qwen3Model,
    block_cls=Qwen3TransformerBlock,
    rope_cls=CosSinRoPE,
    qkv_bias=False,
    qk_norm=True,
    rope_types=("default", "yarn"),
    hf_defaults=HFDefaults(head_dim=128),
    adapter=Qwen3StateDictAdapter,
    parallelize_fn=parallelize_qwen3,
    pipelining_fn=pipeline_llm,
)
