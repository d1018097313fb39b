"""sb-export: HF -> ours -> export round trip, and DCP checkpoint -> transformers logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sb_titan.eval.checkpoint import load_from_config, load_from_hf, resolve_checkpoint
from sb_titan.eval.generate import uniform_meta
from sb_titan.tools.export import export_model, hf_config
from sb_titan.tools.export import main as export_main

transformers = pytest.importorskip("transformers")
from conftest import DEBUG_TOML, tiny_hf_qwen2  # noqa: E402


def _hf_model(path, tied: bool):
    return tiny_hf_qwen2(path, tied)


def _ours_logits(model, tokens, budget: float = 1.0):
    B, L = tokens.shape
    with torch.no_grad():
        return model(
            tokens,
            positions=torch.arange(L).expand(B, L),
            attention_masks=uniform_meta(B, L, budget, tokens.device),
        )


@pytest.mark.parametrize("tied", [True, False])
def test_hf_round_trip(tmp_path, tied):
    hf = _hf_model(tmp_path / "hf", tied)
    loaded = load_from_hf(tmp_path / "hf")
    out = tmp_path / "export"
    export_model(loaded.model, loaded.dims, out)
    (out / "config.json").write_text(json.dumps(hf_config(loaded.dims, "float32", None, None)))
    original, exported = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert set(original) == set(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    again = load_from_hf(out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            loaded.model.state_dict().values(), again.model.state_dict().values(), strict=True
        )
    )
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.tie_word_embeddings == tied
    tokens = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, exp = hf(tokens).logits, reloaded(tokens).logits
    ours = _ours_logits(loaded.model, tokens)
    assert (exp - ref).abs().max().item() == 0.0
    assert (ours - exp).abs().max().item() <= 1e-4


def test_dcp_checkpoint_export_matches_transformers(tmp_path):
    import torch.distributed.checkpoint as dcp

    trained = load_from_config(None, DEBUG_TOML)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the init: the load must really happen
    step = tmp_path / "dump" / "checkpoint" / "step-3"
    dcp.save(trained.model.state_dict(), checkpoint_id=str(step))
    assert resolve_checkpoint(tmp_path / "dump") == step
    export_main(
        [
            "--checkpoint",
            str(tmp_path / "dump"),
            "--config",
            str(DEBUG_TOML),
            "--out",
            str(tmp_path / "hf"),
        ]
    )
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "hf" / name).is_file()
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 1024, (1, 130), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(tokens).logits
    dense = load_from_config(step, DEBUG_TOML, attention="dense")
    assert (_ours_logits(dense.model, tokens) - ref).abs().max().item() <= 1e-4
    sparse = _ours_logits(trained.model, tokens, budget=0.3)  # the config's sparse layers
    assert (sparse - ref).abs().max().item() > 1e-4


def test_export_keeps_rope_theta_norm_eps_and_max_positions(tmp_path):
    """HF (theta 12345, eps 1e-5, 777 positions) -> ours -> export: config.json says so
    (v4 and v5 forms) and transformers reproduces the original's logits."""
    hf = tiny_hf_qwen2(
        tmp_path / "hf", False, rope_theta=12345.0, rms_norm_eps=1e-5, max_position_embeddings=777
    )
    loaded = load_from_hf(tmp_path / "hf")
    out = tmp_path / "export"
    export_model(loaded.model, loaded.dims, out)
    (out / "config.json").write_text(json.dumps(hf_config(loaded.dims, "float32", None, None)))
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 12345.0
    assert written["rms_norm_eps"] == 1e-5 and written["max_position_embeddings"] == 777
    again = load_from_hf(out)
    assert again.dims == loaded.dims
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.rope_parameters["rope_theta"] == 12345.0
    tokens = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (reloaded(tokens).logits - hf(tokens).logits).abs().max().item() == 0.0


def test_export_of_a_toml_model_writes_its_model_section(tmp_path):
    """[model] rope_theta / norm_eps / max_seq_len reach sb-export's config.json."""
    toml = tmp_path / "run.toml"
    toml.write_text(
        DEBUG_TOML.read_text().replace(
            "[model]\n", "[model]\nrope_theta = 50000.0\nnorm_eps = 1e-5\nmax_seq_len = 2048\n"
        )
    )
    loaded = load_from_config(None, toml)
    assert (loaded.dims.rope_theta, loaded.dims.norm_eps, loaded.dims.max_seq_len) == (
        50000.0,
        1e-5,
        2048,
    )
    step = tmp_path / "dump" / "checkpoint" / "step-1"
    import torch.distributed.checkpoint as dcp

    dcp.save(loaded.model.state_dict(), checkpoint_id=str(step))
    out = tmp_path / "hf"
    export_main(["--checkpoint", str(step), "--config", str(toml), "--out", str(out)])
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 50000.0
    assert written["rms_norm_eps"] == 1e-5 and written["max_position_embeddings"] == 2048
