"""Hugging Face Qwen2.5 safetensors <-> TorchTitan state dict.

Qwen2.5 adds q/k/v biases to Qwen3's key set and drops QK-norm. Tied checkpoints
(0.5B, 1.5B, 3B) have no `lm_head.weight`: loading one into an untied model (needed
for pipeline parallelism) copies the embedding, which is exactly what tying meant.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.q_proj.bias": "attention.qkv_linear.wq.bias",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.k_proj.bias": "attention.qkv_linear.wk.bias",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.v_proj.bias": "attention.qkv_linear.wv.bias",
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


class Qwen25StateDictAdapter(StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        self.tied = bool(getattr(model_config, "enable_weight_tying", False))
        self._to_hf_layer = {v: k for k, v in _LAYER_KEYS.items()}
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
            if m and m.group(2) in _LAYER_KEYS:
                out[f"layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = value
                continue
            unknown.append(key)
        if unknown:
            raise KeyError(
                f"Qwen2.5 adapter: {len(unknown)} unexpected Hugging Face keys, e.g. {unknown[:3]}"
            )
        if "lm_head.weight" not in out and "tok_embeddings.weight" in out:
            out["lm_head.weight"] = out["tok_embeddings.weight"]  # tied checkpoint
        if self.tied:
            out["tok_embeddings.weight"] = out["lm_head.weight"]
        return out

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
            raise KeyError(f"Qwen2.5 adapter: no Hugging Face name for {key!r}")
        if self.tied:
            out.pop("lm_head.weight", None)
        return out
