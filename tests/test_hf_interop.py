"""The Qwen2.5 model spec against Hugging Face transformers' Qwen2 (independent reference).

A small random Qwen2Config model is built locally (no download), saved as safetensors,
loaded through the state-dict adapter, and must give the same logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import sb_titan  # noqa: F401
from sb_titan.attention.layout import AttnMeta, doc_ids_from_positions
from sb_titan.models.qwen2_5 import FLAVORS, dims_from_hf_config, model_registry
from sb_titan.models.qwen2_5.attention import SparseAttentionConfig
from sb_titan.models.qwen2_5.state_dict_adapter import Qwen25StateDictAdapter

transformers = pytest.importorskip("transformers")
from conftest import tiny_hf_qwen2  # noqa: E402


def _hf_model(path, tied: bool):
    return tiny_hf_qwen2(path, tied)


def _ours(tmp_path, tie_embeddings: bool | None = None):
    hf_config = json.loads((tmp_path / "config.json").read_text())
    spec = model_registry(
        "hf",
        attention=SparseAttentionConfig(enabled=False),
        dims=dims_from_hf_config(hf_config),
        tie_embeddings=tie_embeddings,
    )
    model = spec.model.build()
    model.init_weights()
    adapter = Qwen25StateDictAdapter(spec.model, str(tmp_path))
    state = adapter.from_hf(load_file(tmp_path / "model.safetensors"))
    model.load_state_dict(state, strict=True)
    return model.eval(), adapter


def _meta(positions: torch.Tensor) -> AttnMeta:
    return AttnMeta(doc_ids_from_positions(positions), torch.ones(positions.shape[0]))


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(tmp_path, tied):
    hf = _hf_model(tmp_path, tied)
    ours, _ = _ours(tmp_path)
    assert ours.enable_weight_tying == tied
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(96).expand(2, 96)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens, positions=positions, attention_masks=_meta(positions))
    assert (got - ref).abs().max().item() <= 1e-4


def test_tied_checkpoint_into_untied_model_for_pipeline_parallel(tmp_path):
    hf = _hf_model(tmp_path, tied=True)
    ours, _ = _ours(tmp_path, tie_embeddings=False)
    assert not ours.enable_weight_tying
    assert torch.equal(ours.lm_head.weight, ours.tok_embeddings.weight)
    assert ours.lm_head.weight.data_ptr() != ours.tok_embeddings.weight.data_ptr()
    tokens = torch.randint(0, 256, (1, 40))
    positions = torch.arange(40)[None]
    with torch.no_grad():
        diff = (
            ours(tokens, positions=positions, attention_masks=_meta(positions)) - hf(tokens).logits
        )
    assert diff.abs().max().item() <= 1e-4


def test_packed_documents_do_not_attend_across_boundaries(tmp_path):
    """A row packing two documents == transformers run on each document alone."""
    hf = _hf_model(tmp_path, tied=False)
    ours, _ = _ours(tmp_path)
    a, b = torch.randint(0, 256, (1, 37)), torch.randint(0, 256, (1, 59))
    tokens = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(37), torch.arange(59)])[None]
    with torch.no_grad():
        got = ours(tokens, positions=positions, attention_masks=_meta(positions))
        ref = torch.cat([hf(a).logits, hf(b).logits], dim=1)
    assert (got - ref).abs().max().item() <= 1e-4


def test_adapter_round_trip(tmp_path):
    _hf_model(tmp_path, tied=True)
    ours, adapter = _ours(tmp_path)
    hf_state = load_file(tmp_path / "model.safetensors")
    back = adapter.to_hf(ours.state_dict())
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_published_flavor_dimensions():
    # Hugging Face config.json values of the released Qwen2.5 checkpoints.
    expected = {
        "0.5b": (896, 24, 14, 2, 64, 4864, 151936, True),
        "1.5b": (1536, 28, 12, 2, 128, 8960, 151936, True),
        "3b": (2048, 36, 16, 2, 128, 11008, 151936, True),
        "7b": (3584, 28, 28, 4, 128, 18944, 152064, False),
    }
    for flavor, dims in expected.items():
        d = FLAVORS[flavor]
        got = (d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.head_dim, d.hidden_dim)
        assert got + (d.vocab_size, d.tie_embeddings) == dims
    spec = model_registry("0.5b")
    attn = spec.model.layers[0].attention
    assert attn.qkv_linear.wq.bias and attn.qk_norm is None
    assert attn.rope.theta == 1e6 and spec.model.norm.eps == 1e-6


def test_checkpoint_rope_theta_and_norm_eps_are_kept(tmp_path):
    """A Qwen2 with its own theta / eps loads with them (was: always 1e6 / 1e-6)."""
    from sb_titan.eval.checkpoint import load_from_hf

    hf = tiny_hf_qwen2(tmp_path, tied=False, rope_theta=12345.0, rms_norm_eps=1e-5)
    loaded = load_from_hf(tmp_path)
    d = loaded.dims
    assert (d.rope_theta, d.norm_eps, d.max_seq_len) == (12345.0, 1e-5, 512)
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(96).expand(2, 96)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = loaded.model(tokens, positions=positions, attention_masks=_meta(positions))
    assert (got - ref).abs().max().item() <= 1e-4


def test_v4_and_v5_rope_theta_forms(tmp_path):
    tiny_hf_qwen2(tmp_path, tied=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    assert dims_from_hf_config(v4).rope_theta == 5e5
    v5 = hf | {"rope_parameters": {"rope_type": "default", "rope_theta": 7e5}}
    assert dims_from_hf_config(v5).rope_theta == 7e5
    assert dims_from_hf_config(v5 | {"rope_theta": 7e5}).rope_theta == 7e5
    # Neither: transformers' Qwen2Config default.
    assert dims_from_hf_config({k: v for k, v in v4.items() if k != "rope_theta"}).rope_theta == 1e4
    with pytest.raises(ValueError, match=r"cfg\.json: rope_theta = 500000.0 but rope_parameters"):
        dims_from_hf_config(v5 | {"rope_theta": 5e5}, "cfg.json")


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type = 'yarn'"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type = 'linear'"),
        (
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
            "rope_parameters.rope_type = 'yarn'",
        ),
        ("use_sliding_window", True, "use_sliding_window = True"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types = "),
        ("dual_chunk_attention_config", {"chunk_size": 8192}, "dual_chunk_attention_config = "),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("model_type", "llama", "model_type = 'llama'"),
        ("attention_bias", False, "attention_bias = False"),
    ],
)
def test_unrepresentable_configs_are_refused(tmp_path, key, value, named):
    from sb_titan.eval.checkpoint import load_from_hf

    tiny_hf_qwen2(tmp_path, tied=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {key: value}))
    with pytest.raises(ValueError) as err:
        load_from_hf(tmp_path)
    assert str(err.value).startswith(f"{path}: {named}"), err.value
    assert "\n" not in str(err.value)


def test_plain_rope_and_disabled_sliding_window_are_accepted(tmp_path):
    tiny_hf_qwen2(tmp_path, tied=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    ok = hf | {
        "rope_scaling": {"rope_type": "default"},
        "use_sliding_window": False,
        "sliding_window": 4096,
        "dual_chunk_attention_config": None,
    }
    assert dims_from_hf_config(ok).rope_theta == 1e6
    assert dims_from_hf_config(hf | {"rope_scaling": None}).rope_theta == 1e6
