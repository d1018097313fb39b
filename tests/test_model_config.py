"""[model] rope_theta / norm_eps / max_seq_len, and an HF initial load's config.json:
its values are adopted where [model] leaves them open, disagreements are refused
before ranks spawn (`--check-config`)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess

import pytest
from conftest import DEBUG_HF_SHAPE, DEBUG_TOML, forked_train_cli, tiny_hf, tiny_hf_qwen2

from sb_titan.config.toml import ConfigError, checked_model_spec, load_config
from sb_titan.models.qwen2_5 import FLAVORS
from sb_titan.models.registry import adopt_hf_checkpoint, derive_model_spec

pytest.importorskip("transformers")

# The debug flavor's shapes, with the checkpoint's own theta / eps / positions.
DEBUG_SHAPED = {**DEBUG_HF_SHAPE, "rope_theta": 12345.0, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_debug")
    tiny_hf_qwen2(path, False, **DEBUG_SHAPED)
    return path


def _initial_load(path) -> list[str]:
    return [
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(path),
        "--checkpoint.initial_load_in_hf",
    ]


def _rope_and_eps(config) -> set[tuple[float, int, float]]:
    model = derive_model_spec(config).model
    out = {(model.norm.eps,)}
    for layer in model.layers:
        rope = layer.attention.rope
        out |= {(rope.theta, rope.max_seq_len, layer.attention_norm.eps, layer.ffn_norm.eps)}
    return out


def test_toml_model_section_reaches_rope_and_norms(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nrope_theta = 50000.0\nnorm_eps = 1e-5\nmax_seq_len = 2048\n")
    config = load_config(path)
    assert _rope_and_eps(config) == {(1e-5,), (50000.0, 2048, 1e-5, 1e-5)}
    model = derive_model_spec(config).model.build()
    assert model.norm.eps == 1e-5
    assert model.layers["0"].attention.rope.cache.shape[0] == 2048
    cli = load_config(path, ["--model.rope_theta", "20000"])
    assert _rope_and_eps(cli) == {(1e-5,), (20000.0, 2048, 1e-5, 1e-5)}
    # Unset: the flavor's values.
    assert _rope_and_eps(load_config(DEBUG_TOML)) == {(1e-6,), (1e6, 32768, 1e-6, 1e-6)}


def test_bad_model_values_are_config_errors(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nrope_theta = -1.0\n")
    with pytest.raises(ConfigError, match=r"c\.toml: \[model\] rope_theta = -1.0: expected a posi"):
        load_config(path)
    config = load_config(DEBUG_TOML, ["--model.max_seq_len", "2048", "--training.seq_len", "4096"])
    with pytest.raises(ConfigError, match=r"training.seq_len = 4096 is beyond the model's 2048"):
        checked_model_spec(config, DEBUG_TOML)


def test_adopt_takes_the_checkpoint_values_and_logs_once(hf_dir, caplog):
    caplog.set_level(logging.INFO)
    dims = adopt_hf_checkpoint(FLAVORS["debug"], hf_dir / "config.json")
    assert dims == dataclasses.replace(
        FLAVORS["debug"], rope_theta=12345.0, norm_eps=1e-5, max_seq_len=4096
    )
    lines = [r.getMessage() for r in caplog.records if "rope_theta" in r.getMessage()]
    assert len(lines) == 1 and str(hf_dir / "config.json") in lines[0], lines
    assert "rope_theta = 12345.0" in lines[0] and "norm_eps = 1e-05" in lines[0]


def test_adopt_refuses_explicit_values_and_shapes_that_disagree(hf_dir, tmp_path):
    path = hf_dir / "config.json"
    debug = FLAVORS["debug"]
    with pytest.raises(ValueError) as err:
        adopt_hf_checkpoint(debug, path, explicit=["rope_theta"])
    assert str(err.value) == (
        f"{path}: rope_theta = 12345.0 in the checkpoint but the config builds 1000000.0 "
        "(model.rope_theta)"
    )
    with pytest.raises(ValueError, match="rms_norm_eps = 1e-05 in the checkpoint but the config"):
        adopt_hf_checkpoint(debug, path, explicit=["norm_eps"])
    # Explicit values that agree are fine; a longer RoPE than the checkpoint's is training
    # beyond its context, a shorter one is refused.
    same = dataclasses.replace(debug, rope_theta=12345.0, max_seq_len=8192)
    assert adopt_hf_checkpoint(same, path, ["rope_theta", "max_seq_len"]).max_seq_len == 8192
    with pytest.raises(ValueError, match="max_position_embeddings = 4096 in the checkpoint"):
        adopt_hf_checkpoint(dataclasses.replace(debug, max_seq_len=1024), path, ["max_seq_len"])
    with pytest.raises(ValueError, match=f"{path}: hidden_size = 256 in the checkpoint but the "):
        adopt_hf_checkpoint(dataclasses.replace(debug, dim=128), path)
    with pytest.raises(ValueError, match="intermediate_size = 512 in the checkpoint"):
        adopt_hf_checkpoint(dataclasses.replace(debug, hidden_dim=1024), path)
    with pytest.raises(ValueError, match="tie_word_embeddings = False in the checkpoint"):
        adopt_hf_checkpoint(dataclasses.replace(debug, tie_embeddings=True), path)
    sliding = tmp_path / "config.json"
    sliding.write_text(
        path.read_text().replace('"use_sliding_window": false', '"use_sliding_window": true')
    )
    with pytest.raises(ValueError, match=f"{sliding}: use_sliding_window = True"):
        adopt_hf_checkpoint(debug, sliding)


def test_initial_load_in_hf_sets_the_run_model_and_eval_agrees(hf_dir):
    from sb_titan.eval.checkpoint import load_from_config

    config = load_config(DEBUG_TOML, _initial_load(hf_dir))
    assert _rope_and_eps(config) == {(1e-5,), (12345.0, 4096, 1e-5, 1e-5)}
    # TorchTitan's fallback: no initial_load_path -> hf_assets_path.
    fallback = ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--hf_assets_path"]
    config = load_config(DEBUG_TOML, [*fallback, str(hf_dir)])
    assert _rope_and_eps(config) == {(1e-5,), (12345.0, 4096, 1e-5, 1e-5)}
    # No initial load (checkpointing off): the flavor's values.
    off = load_config(DEBUG_TOML, _initial_load(hf_dir)[1:])
    assert _rope_and_eps(off) == {(1e-6,), (1e6, 32768, 1e-6, 1e-6)}
    loaded = load_from_config(None, DEBUG_TOML, cli_args=_initial_load(hf_dir))
    assert (loaded.dims.rope_theta, loaded.dims.norm_eps, loaded.dims.max_seq_len) == (
        12345.0,
        1e-5,
        4096,
    )
    too_long = [*_initial_load(hf_dir), "--training.seq_len", "8192"]
    with pytest.raises(ConfigError, match="training.seq_len = 8192 is beyond the model's 4096"):
        load_from_config(None, DEBUG_TOML, cli_args=too_long)


def _check_config(args: list[str]) -> subprocess.CompletedProcess:
    return forked_train_cli(["--check-config", "--config_file", *args])


def test_check_config_refuses_a_mismatching_hf_checkpoint_in_one_line(hf_dir):
    proc = _check_config([str(DEBUG_TOML), *_initial_load(hf_dir), "--model.norm_eps", "1e-6"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        f"sb_titan: config error: {DEBUG_TOML}: {hf_dir / 'config.json'}: rms_norm_eps = 1e-05 "
        "in the checkpoint but the config builds 1e-06 (model.norm_eps)"
    ], proc.stderr


def test_check_config_logs_the_adopted_values(hf_dir):
    proc = _check_config([str(DEBUG_TOML), *_initial_load(hf_dir)])
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "rope_theta = 12345.0" in line]
    assert len(lines) == 1 and str(hf_dir / "config.json") in lines[0], proc.stdout


def _families(config) -> tuple[str, str, int, int, bool]:
    spec = derive_model_spec(config)
    attn = spec.model.layers[0].attention
    return (spec.name, type(attn.rope).__qualname__, len(spec.model.layers), attn.head_dim,
            attn.qk_norm is not None)  # fmt: skip


def test_family_and_flavor_pick_the_model():
    assert _families(load_config(DEBUG_TOML)) == ("qwen2_5", "CosSinRoPE.Config", 2, 64, False)
    qwen3 = load_config(DEBUG_TOML, ["--model.family", "qwen3", "--model.flavor", "4b"])
    qwen3.training.seq_len = 4096
    assert _families(qwen3) == ("qwen3", "CosSinRoPE.Config", 36, 128, True)
    llama = load_config(DEBUG_TOML, ["--model.family", "llama3", "--model.flavor", "8b"])
    assert _families(llama) == ("llama3", "ComplexRoPE.Config", 32, 128, False)
    rope = derive_model_spec(llama).model.layers[0].attention.rope
    assert (rope.scaling, rope.scaling_factor, rope.original_max_position_embeddings) == (
        "llama", 8.0, 8192
    )  # fmt: skip
    wrong = load_config(DEBUG_TOML, ["--model.flavor", "4b"])
    with pytest.raises(ConfigError, match=r"model.flavor: '4b' \(not a qwen2_5 flavor\)"):
        checked_model_spec(wrong, DEBUG_TOML)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A Qwen3 of no named size: 3 layers, head_dim 32, tied, its own theta."""
    path = tmp_path_factory.mktemp("hf_qwen3")
    shape = dict(num_hidden_layers=3, head_dim=32, max_position_embeddings=4096, rope_theta=5e5)
    tiny_hf(path, "qwen3", True, **shape)
    return path


def test_flavor_hf_builds_what_config_json_describes(qwen3_dir):
    hf = [*_initial_load(qwen3_dir), "--model.flavor", "hf"]
    config = load_config(DEBUG_TOML, hf)
    assert _families(config) == ("qwen3", "CosSinRoPE.Config", 3, 32, True)
    model = derive_model_spec(config).model
    assert model.enable_weight_tying and model.layers[0].attention.rope.theta == 5e5
    # [model] still overrides what it may: an untied copy for pipeline parallelism.
    untied = load_config(DEBUG_TOML, [*hf, "--model.tie_embeddings", "False"])
    assert not derive_model_spec(untied).model.enable_weight_tying
    with pytest.raises(
        ConfigError, match=r"a qwen3 checkpoint but the config builds llama3 \(model.family\)"
    ):
        checked_model_spec(load_config(DEBUG_TOML, [*hf, "--model.family", "llama3"]), "c")
    with pytest.raises(ConfigError, match=r"model.flavor: 'hf' \(needs an HF initial load\)"):
        checked_model_spec(load_config(DEBUG_TOML, ["--model.flavor", "hf"]), "c")


def test_triton_backend_refuses_a_head_dim_it_does_not_ship(qwen3_dir):
    hf = [*_initial_load(qwen3_dir), "--model.flavor", "hf"]
    triton = load_config(DEBUG_TOML, [*hf, "--sparse_attention.backend", "triton"])
    with pytest.raises(ConfigError) as err:
        checked_model_spec(triton, DEBUG_TOML)
    assert str(err.value) == (
        f"{DEBUG_TOML}: {qwen3_dir / 'config.json'}: head_dim = 32: the Triton kernels ship "
        "head_dim 64 and 128 (sparse_attention.backend = 'triton'; 'torch' or 'flex' run "
        "any head_dim)"
    )
    torch_backend = load_config(DEBUG_TOML, [*hf, "--sparse_attention.backend", "torch"])
    assert derive_model_spec(torch_backend).model.layers[0].attention.head_dim == 32


def test_check_config_refuses_a_moe_checkpoint_before_ranks_spawn(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3_moe", "num_experts": 128, "hidden_size": 64}'
    )
    proc = _check_config([str(DEBUG_TOML), *_initial_load(tmp_path), "--model.flavor", "hf"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"sb_titan: config error: {DEBUG_TOML}: {tmp_path / 'config.json'}: model_type = "
        "'qwen3_moe': expected one of ['llama', 'qwen2', 'qwen3'] (dense Qwen2 / Qwen2.5, "
        "Qwen3 and Llama 3; mixture-of-experts models are not supported)"
    ], proc.stderr
