"""Hugging Face safetensors <-> TorchTitan state dict, by a family's key table.

Tied checkpoints have no `lm_head.weight`: loading one into an untied model (needed for
pipeline parallelism) copies the embedding, which is exactly what tying meant. A key
the table does not name is refused rather than dropped.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

# Every family's decoder layer: projections, SwiGLU, the two norms.
COMMON_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_IGNORED_HF = re.compile(r"rotary_emb\.inv_freq$")


def tie_on_load(state: dict[str, Any], tied: bool) -> dict[str, Any]:
    """A tied checkpoint's missing head is its embedding; a tied model shares one."""
    if "lm_head.weight" not in state and "tok_embeddings.weight" in state:
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    if tied:
        state["tok_embeddings.weight"] = state["lm_head.weight"]
    return state


class TableStateDictAdapter(StateDictAdapter):
    """Renames by `LAYER_KEYS` (HF suffix under model.layers.N -> ours under layers.N)."""

    LAYER_KEYS: ClassVar[dict[str, str]] = COMMON_LAYER_KEYS
    FAMILY: ClassVar[str] = ""

    def __init__(self, model_config, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        self.tied = bool(getattr(model_config, "enable_weight_tying", False))
        self._to_hf_layer = {v: k for k, v in self.LAYER_KEYS.items()}
        self._to_hf_global = {v: k for k, v in _GLOBAL_KEYS.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        unknown = []
        for key, value in hf_state_dict.items():
            if _IGNORED_HF.search(key):
                continue
            if key in _GLOBAL_KEYS:
                out[_GLOBAL_KEYS[key]] = value
                continue
            m = _HF_LAYER.match(key)
            if m and m.group(2) in self.LAYER_KEYS:
                out[f"layers.{m.group(1)}.{self.LAYER_KEYS[m.group(2)]}"] = value
                continue
            unknown.append(key)
        if unknown:
            raise KeyError(
                f"{self.FAMILY} adapter: {len(unknown)} unexpected Hugging Face keys, "
                f"e.g. {unknown[:3]}"
            )
        return tie_on_load(out, self.tied)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key in self._to_hf_global:
                out[self._to_hf_global[key]] = value
                continue
            m = _TT_LAYER.match(key)
            if m and m.group(2) in self._to_hf_layer:
                out[f"model.layers.{m.group(1)}.{self._to_hf_layer[m.group(2)]}"] = value
                continue
            raise KeyError(f"{self.FAMILY} adapter: no Hugging Face name for {key!r}")
        if self.tied:
            out.pop("lm_head.weight", None)
        return out
