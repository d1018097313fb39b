"""Every family's model spec against Hugging Face transformers (independent reference).

A small random transformers model (Qwen2, Qwen2 with YaRN, Qwen3, Llama 3 with llama3
RoPE scaling) is built locally (no download), saved as safetensors, loaded through the
recipe's HF path, and must give the same logits; its export must give back the same
weights and a config.json transformers builds the same model from.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import sb_titan  # noqa: F401
from sb_titan.attention.layout import AttnMeta, doc_ids_from_positions
from sb_titan.models.attention import SparseAttentionConfig
from sb_titan.models.hf_config import dims_from_hf_config
from sb_titan.models.qwen2_5 import FAMILY as QWEN2_5
from sb_titan.models.qwen2_5 import FLAVORS
from sb_titan.models.registry import hf_dims, model_registry

transformers = pytest.importorskip("transformers")
from conftest import tiny_hf, tiny_hf_qwen2  # noqa: E402

# A tiny random model of each family: (config.json model_type, config overrides).
FAMILIES = {
    "qwen2_5": ("qwen2", {}),
    # YaRN stretching 32 positions 4x: transformers scales cos / sin by 1 + 0.1 ln 4.
    "qwen2_5_yarn": (
        "qwen2",
        {
            "max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # head_dim set explicitly, not hidden / heads (as in the released Qwen3 sizes).
    "qwen3": ("qwen3", {"head_dim": 32}),
    # llama3 scaling from 64 positions, so that the tiny head's frequencies are scaled.
    "llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 1e4,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


def _hf_model(path, tied: bool, family: str = "qwen2_5"):
    model_type, overrides = FAMILIES[family]
    return tiny_hf(path, model_type, tied, **overrides)


def _ours(tmp_path, tie_embeddings: bool | None = None, attention=None):
    spec = model_registry(
        "hf",
        attention=attention or SparseAttentionConfig(enabled=False),
        dims=hf_dims(tmp_path / "config.json"),
        tie_embeddings=tie_embeddings,
    )
    model = spec.model.build()
    model.init_weights()
    adapter = spec.state_dict_adapter(spec.model, str(tmp_path))
    state = adapter.from_hf(load_file(tmp_path / "model.safetensors"))
    model.load_state_dict(state, strict=True)
    return model.eval(), adapter


def _meta(positions: torch.Tensor) -> AttnMeta:
    return AttnMeta(doc_ids_from_positions(positions), torch.ones(positions.shape[0]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(tmp_path, family, tied):
    hf = _hf_model(tmp_path, tied, family)
    ours, _ = _ours(tmp_path)
    assert ours.enable_weight_tying == tied
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(96).expand(2, 96)
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens, positions=positions, attention_masks=_meta(positions))
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_path_at_full_budget_matches_transformers(tmp_path, family):
    """Every layer sparse (`topk`, beta = 1 keeps every block): the selection, the block
    kernels and their softmax scale (YaRN's included) give transformers' logits."""
    hf = _hf_model(tmp_path, False, family)
    sparse = SparseAttentionConfig(policy="topk", dense_layers=[], block_size=64)
    ours, _ = _ours(tmp_path, attention=sparse)
    tokens = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(128)[None]
    with torch.no_grad():
        got = ours(tokens, positions=positions, attention_masks=_meta(positions))
        ref = hf(tokens).logits
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
def test_export_round_trip(tmp_path, family, tied):
    """Weights back to HF names are the checkpoint's, bit for bit; the exported
    config.json reads back to the same dims, and transformers builds from it a model
    that gives our logits."""
    from sb_titan.tools.export import export_model, hf_config

    src, out = tmp_path / "src", tmp_path / "out"
    _hf_model(src, tied, family)
    ours, adapter = _ours(src)
    hf_state = load_file(src / "model.safetensors")
    back = adapter.to_hf(ours.state_dict())
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    dims = hf_dims(src / "config.json")
    export_model(ours, dims, out)
    (out / "config.json").write_text(json.dumps(hf_config(dims, "float32", None, None)))
    assert hf_dims(out / "config.json") == dims
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(hf_state)
    assert all(torch.equal(exported[k], hf_state[k]) for k in hf_state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(80)[None]
    with torch.no_grad():
        got = ours(tokens, positions=positions, attention_masks=_meta(positions))
        ref = reloaded(tokens).logits
    assert (got - ref).abs().max().item() <= 1e-4


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


def _dims(hf: dict, source: str = "config.json"):
    return dims_from_hf_config(hf, QWEN2_5, source)


def test_v4_and_v5_rope_theta_forms(tmp_path):
    tiny_hf_qwen2(tmp_path, tied=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"} | {"rope_theta": 5e5}
    assert _dims(v4).rope_theta == 5e5
    v5 = hf | {"rope_parameters": {"rope_type": "default", "rope_theta": 7e5}}
    assert _dims(v5).rope_theta == 7e5
    assert _dims(v5 | {"rope_theta": 7e5}).rope_theta == 7e5
    # Neither: transformers' Qwen2Config default.
    assert _dims({k: v for k, v in v4.items() if k != "rope_theta"}).rope_theta == 1e4
    with pytest.raises(ValueError, match=r"cfg\.json: rope_theta = 500000.0 but rope_parameters"):
        _dims(v5 | {"rope_theta": 5e5}, "cfg.json")


@pytest.mark.parametrize(
    "key, value, named",
    [
        # Qwen's rotate-half RoPE computes plain and YaRN RoPE only.
        (
            "rope_scaling",
            {"rope_type": "llama3", "factor": 8.0},
            "rope_scaling.rope_type = 'llama3'",
        ),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type = 'linear'"),
        (
            "rope_parameters",
            {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
            "rope_parameters.rope_type = 'dynamic'",
        ),
        ("num_experts", 8, "num_experts = 8: mixture-of-experts"),
        ("use_sliding_window", True, "use_sliding_window = True"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types = "),
        ("dual_chunk_attention_config", {"chunk_size": 8192}, "dual_chunk_attention_config = "),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("model_type", "qwen2_moe", "model_type = 'qwen2_moe'"),
        ("model_type", "mistral", "model_type = 'mistral'"),
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


@pytest.mark.parametrize(
    "model_type, key, value, named",
    [
        ("qwen3", "layer_types", ["sliding_attention", "full_attention"], "layer_types = "),
        ("qwen3", "use_sliding_window", True, "use_sliding_window = True"),
        ("qwen3", "attention_bias", True, "attention_bias = True"),
        ("qwen3", "model_type", "qwen3_moe", "model_type = 'qwen3_moe'"),
        ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope_parameters.rope"),
        ("llama", "mlp_bias", True, "mlp_bias = True"),
    ],
)
def test_other_families_refuse_in_one_line(tmp_path, model_type, key, value, named):
    hf = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf | {key: value}))
    with pytest.raises(ValueError) as err:
        hf_dims(path)
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
    assert _dims(ok).rope_theta == 1e6
    assert _dims(hf | {"rope_scaling": None}).rope_theta == 1e6
