"""Llama 3 / 3.1 / 3.2: TorchTitan's Llama 3 model, parallelization and HF adapter with
the recipe's inner attention. No q/k/v biases or QK-norm; TorchTitan's complex
(interleaved-pair) RoPE, the one that computes Llama 3's RoPE scaling, so the adapter
permutes q/k rows from Hugging Face's rotate-half layout."""

from __future__ import annotations

from typing import Any

from torchtitan.models.common import ComplexRoPE
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter as TorchTitanLlama3Adapter,
)

from sb_titan.models.family import Family, HFDefaults
from sb_titan.models.llama3.flavors import FLAVORS as FLAVORS
from sb_titan.models.parallelize import parallelize_with_recipe_attention, pipeline_llm
from sb_titan.models.state_dict_adapter import tie_on_load


def parallelize_llama3(model, **kwargs):
    """TorchTitan's Llama 3 recipe (imported here: it must load after compat.install)."""
    from torchtitan.models.llama3.parallelize import parallelize_llama

    return parallelize_with_recipe_attention(parallelize_llama, model, **kwargs)


class Llama3StateDictAdapter(TorchTitanLlama3Adapter):
    """TorchTitan's adapter (names, q/k permutation), refusing keys it does not know and
    loading a tied checkpoint into an untied model (pipeline parallelism)."""

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in hf_state_dict if _abstract(k) not in self.from_hf_map]
        if unknown:
            raise KeyError(
                f"Llama 3 adapter: {len(unknown)} unexpected Hugging Face keys, e.g. {unknown[:3]}"
            )
        state = super().from_hf(dict(hf_state_dict))
        return tie_on_load(state, bool(self.model_config.enable_weight_tying))


def _abstract(key: str) -> str:
    """`model.layers.3.mlp...` -> `model.layers.{}.mlp...`, as TorchTitan's map names it."""
    head, sep, rest = key.partition("layers.")
    if not sep:
        return key
    _, _, tail = rest.partition(".")
    return f"{head}layers.{{}}.{tail}"


FAMILY = Family(
    name="llama3",
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    model_cls=Llama3Model,
    block_cls=Llama3TransformerBlock,
    rope_cls=ComplexRoPE,
    qkv_bias=False,
    qk_norm=False,
    rope_types=("default", "llama3"),
    hf_defaults=HFDefaults(max_position_embeddings=2048),
    adapter=Llama3StateDictAdapter,
    parallelize_fn=parallelize_llama3,
    pipelining_fn=pipeline_llm,
)
