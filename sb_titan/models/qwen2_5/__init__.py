"""Qwen2.5 / Qwen2: Qwen3's decoder without QK-norm and with q/k/v biases (GQA,
rotate-half RoPE, SwiGLU, RMSNorm, optional tied embeddings). TorchTitan's Qwen3 model
and parallelization are reused unchanged; only the layer configs differ."""

from __future__ import annotations

from torchtitan.models.common import CosSinRoPE
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from sb_titan.models.family import Family, HFDefaults
from sb_titan.models.parallelize import pipeline_llm
from sb_titan.models.qwen2_5.flavors import FLAVORS as FLAVORS
from sb_titan.models.qwen3 import parallelize_qwen3
from sb_titan.models.state_dict_adapter import COMMON_LAYER_KEYS, TableStateDictAdapter


class Qwen25StateDictAdapter(TableStateDictAdapter):
    FAMILY = "Qwen2.5"
    LAYER_KEYS = COMMON_LAYER_KEYS | {
        "self_attn.q_proj.bias": "attention.qkv_linear.wq.bias",
        "self_attn.k_proj.bias": "attention.qkv_linear.wk.bias",
        "self_attn.v_proj.bias": "attention.qkv_linear.wv.bias",
    }


FAMILY = Family(
    name="qwen2_5",
    hf_model_type="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    model_cls=Qwen3Model,
    block_cls=Qwen3TransformerBlock,
    rope_cls=CosSinRoPE,
    qkv_bias=True,
    qk_norm=False,
    rope_types=("default", "yarn"),
    hf_defaults=HFDefaults(),
    adapter=Qwen25StateDictAdapter,
    parallelize_fn=parallelize_qwen3,
    pipelining_fn=pipeline_llm,
)
