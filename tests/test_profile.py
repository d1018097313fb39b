"""sb-profile: a tiny CPU grid of the debug model through the CLI, the fingerprint the
trainer checks against, clear errors, and the measuring helpers."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from conftest import DEBUG_TOML, REPO

from sb_titan import profiler as sbp
from sb_titan.balance.cost_model import CostModel, Profile, ProfileError
from sb_titan.balance.cost_model.fingerprint import SHAPE_KEYS, with_legacy_defaults
from sb_titan.config.toml import load_config
from sb_titan.models.attention import SBAttention
from sb_titan.models.registry import derive_model_spec
from sb_titan.tools.profile import main as profile_main

ROW = ["--training.seq_len", "256"]  # rows of 256 tokens keep every run sub-second
GRID = ["--lengths", "64", "256", "--densities", "0.5", "1.0", "--repeats", "1", "--warmup", "0"]


@pytest.fixture
def one_thread():
    """The profiler runs (and fingerprints) one CPU thread, like each training process."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One tiny profile, written through the CLI (shared by the tests below)."""
    before = torch.get_num_threads()
    path = tmp_path_factory.mktemp("profile") / "debug.json"
    rc = profile_main(["--config", str(DEBUG_TOML), "--out", str(path), "--quiet", *GRID, *ROW])
    torch.set_num_threads(before)
    assert rc == 0
    return path


def _config(*extra: str):
    return load_config(DEBUG_TOML, [*ROW, *extra])


def _model(config):
    return derive_model_spec(config).model


def test_cli_writes_a_loadable_profile_matching_current_fingerprint(profiled, one_thread):
    profile = Profile.load(profiled)
    assert profile.lengths == [64, 256] and profile.densities == [0.5, 1.0]
    assert profile.block_size == 64 and profile.overhead_seconds >= 0
    assert profile.linear_tokens == [128, 256, 384, 512]  # 2 rows x 1/4..4/4 of 256
    fp = profile.fingerprint
    assert fp["stage_modules"] == ["layers.0", "layers.1"] and fp["scope"] == "blocks"
    assert fp["stage_dense_layers"] == [0] and fp["row_len"] == 256 and fp["policy"] == "topk"
    config = _config()
    assert (
        CostModel(profile).check_fingerprint(sbp.current_fingerprint(config, _model(config))) == []
    )
    record = json.loads(profiled.read_text())["measurement"]
    assert record["settings"]["clock"] == "cpu" and len(record["linear_measured_seconds"]) == 4
    kinds = {(p["kind"], p["length"]): p for p in record["attention_points"]}
    assert kinds["dense", 64]["copies"] == 2 * 256 // 64 and kinds["sparse", 256]["layers"] == 1


def test_predictions_from_the_profile_are_monotone(profiled):
    model = CostModel(Profile.load(profiled))
    lengths = [16, 64, 100, 256, 1000, 4096]
    by_length = [model.predict([n], 0.5) for n in lengths]
    assert all(b >= a for a, b in zip(by_length, by_length[1:], strict=False))
    for n in (256, 200):
        by_budget = [model.predict_budget([n, 64], b, "topk") for b in np.linspace(0.05, 1, 20)]
        assert all(b >= a for a, b in zip(by_budget, by_budget[1:], strict=False))
    assert model.predict([256] * 2, 1.0) > model.predict([256], 1.0) > model.predict([], 1.0)


def test_fingerprint_mismatch_warns_through_the_trainer_loader(profiled, one_thread, caplog):
    same, other = _config(), _config("--sparse_attention.block_size", "128")
    with caplog.at_level(logging.WARNING, logger="sb_titan.balance.cost_model.fingerprint"):
        caplog.clear()
        sbp.load_cost_model(profiled, same, _model(same))
        assert not [
            r for r in caplog.records if r.name == "sb_titan.balance.cost_model.fingerprint"
        ]
        sbp.load_cost_model(profiled, other, _model(other))
    (warning,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "sb_titan.balance.cost_model.fingerprint"
    ]
    assert "block_size: profile=64 current=128" in warning and str(profiled) in warning
    longer = load_config(DEBUG_TOML, ["--training.seq_len", "512"])
    with pytest.raises(ProfileError, match="row_len: profile=256 current=512"):
        sbp.load_cost_model(profiled, longer, _model(longer), strict=True)


def test_a_profile_of_another_model_shape_is_refused_through_the_trainer_loader(profiled):
    deeper = _config("--model.flavor", "debug4")
    with pytest.raises(
        ProfileError, match=r"another model shape: profile \[family=qwen2_5 flavor=debug .*layers=2"
    ):
        sbp.load_cost_model(profiled, deeper, _model(deeper))
    allowed = _config("--model.flavor", "debug4", "--cost_model.allow_shape_mismatch")
    assert sbp.load_cost_model(profiled, allowed, _model(allowed)).profile.source == str(profiled)


def test_a_profile_of_another_family_is_refused_and_old_profiles_are_qwen2_5(profiled, tmp_path):
    """Qwen3's debug flavor has Qwen2.5 debug's shapes but QK-norm and no q/k/v biases:
    a profile names the family it timed. One written before fingerprints named it
    (the shipped ones) was timed on Qwen2.5."""
    qwen3 = _config("--model.family", "qwen3")
    assert _model(qwen3).dim == _model(_config()).dim  # same shapes, another decoder
    with pytest.raises(ProfileError, match=r"profile \[family=qwen2_5 flavor=debug .*"
                       r"this run \[family=qwen3 flavor=debug"):  # fmt: skip
        sbp.load_cost_model(profiled, qwen3, _model(qwen3))
    old = json.loads(profiled.read_text())
    del old["fingerprint"]["family"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    accepted = sbp.load_cost_model(tmp_path / "old.json", _config(), _model(_config()))
    assert accepted.profile.source == str(tmp_path / "old.json")
    with pytest.raises(ProfileError, match="family=qwen2_5"):
        sbp.load_cost_model(tmp_path / "old.json", qwen3, _model(qwen3))


def test_every_fingerprint_key_is_either_shape_or_environment(one_thread):
    """A key added to the fingerprint is placed on purpose: refused, or only warned."""
    config = _config()
    fp = sbp.current_fingerprint(config, _model(config), device="cpu")
    assert set(SHAPE_KEYS) <= set(fp)
    warned = {"device_type", "device_name", "torch", "triton", "dtype", "attention_backend"}
    assert set(fp) - set(SHAPE_KEYS) == warned | {"block_size", "row_len", "cpu_threads"}


def test_the_nvidia_driver_version_is_read_from_its_proc_file(tmp_path):
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 2023\n"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release\n"
    for text, version in ((proprietary, "535.104.05"), (open_module, "570.133.20")):
        (tmp_path / "version").write_text(text + "GCC version:  gcc version 12.3.0\n")
        assert sbp.nvidia_driver(tmp_path / "version") == version
    assert sbp.nvidia_driver(tmp_path / "absent") is None


def test_check_reports_match_mismatch_and_unusable_files(profiled, tmp_path, capsys, one_thread):
    args = ["--check", str(profiled), "--config", str(DEBUG_TOML)]
    assert profile_main([*args, *ROW]) == 0
    assert "fingerprint matches" in capsys.readouterr().out
    assert profile_main([*args, "--training.seq_len", "128"]) == 1
    assert "differs from this setup in: row_len\n" in capsys.readouterr().out
    assert profile_main([*args, *ROW, "--model.flavor", "debug4"]) == 1
    shape = "flavor, layers, stage_modules"
    assert f"in: {shape} (model shape: a run refuses it: {shape})" in capsys.readouterr().out
    text = profiled.read_text()
    for name, body in (("truncated.json", text[: len(text) // 2]), ("garbage.json", "{nope")):
        bad = tmp_path / name
        bad.write_text(body)
        assert profile_main(["--check", str(bad)]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and "corrupted or truncated" in err
        with pytest.raises(ProfileError, match=name):
            sbp.load_cost_model(bad)
    assert profile_main(["--check", str(tmp_path / "missing.json")]) == 2
    assert "no latency profile at" in capsys.readouterr().err


def test_bad_config_and_unsupported_flavor_are_clear_errors(tmp_path, capsys, one_thread):
    out = ["--out", str(tmp_path / "p.json"), "--quiet"]
    assert profile_main(["--config", str(tmp_path / "nope.toml"), *out]) == 2
    assert "config file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstepz = 3\n")
    assert profile_main(["--config", str(bad), *out]) == 2
    assert "unknown key 'training.stepz'" in capsys.readouterr().err
    assert profile_main(["--config", str(DEBUG_TOML), *out, "--model.flavor", "7b"]) == 2
    err = capsys.readouterr().err
    assert "too many to profile on CPU" in err and "smaller flavor" in err
    assert profile_main(["--config", str(DEBUG_TOML), *out, *ROW, "--lengths", "64", "100"]) == 2
    assert "must divide the row length" in capsys.readouterr().err
    assert profile_main(["--config", str(DEBUG_TOML), *out, "--stage", "1"]) == 2
    assert "no pipeline parallelism" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_pipeline_stages_follow_torchtitans_split():
    config = _config("--parallelism.pipeline_parallel_degree", "2")
    model = _model(config)
    assert sbp.stage_module_names(config.parallelism, model, 0) == ["tok_embeddings", "layers.0"]
    assert sbp.stage_module_names(config.parallelism, model, 1) == ["layers.1", "norm", "lm_head"]
    fp = sbp.current_fingerprint(config, model, stage=1, device="cpu", scope="stage")
    assert fp["stage_modules"] == ["layers.1", "norm", "lm_head"] and fp["pp_stage"] == 1
    assert fp["stage_dense_layers"] == [] and fp["pp_degree"] == 2
    blocks = sbp.current_fingerprint(config, model, stage=1, device="cpu")
    assert blocks["stage_modules"] == ["layers.1"]


def test_stage_scope_runs_embedding_head_and_loss(one_thread):
    config = _config()
    modules = ["tok_embeddings", "layers.1", "norm", "lm_head"]
    model = sbp.build_stage(config.training, _model(config), modules, torch.device("cpu"))
    assert len(model.layers) == 1 and model.lm_head is not None
    sbp.make_stage_step(model, config.training, [[64, 192]] * 2, 0.3, torch.device("cpu"))()
    assert model.lm_head.weight.grad is not None and model.tok_embeddings.weight.grad is not None
    with sbp.attention_swapped(model, sbp.TokenLinearAttention()):
        sbp.make_stage_step(model, config.training, [[256]], 1.0, torch.device("cpu"))()
    q = model.layers["1"].attention.qkv_linear.wq.weight
    assert q.grad is not None and q.grad.abs().sum() > 0  # stand-in keeps q's backward
    assert isinstance(model.layers["1"].attention.inner_attention, SBAttention)


def test_table_is_read_at_nominal_density_and_linear_fit():
    # topk realised 0.7 for budgets 0.1 and 0.5 (forced blocks), 1.0 at 1.0
    got = sbp.at_nominal([0.7, 0.7, 1.0], [2.0, 2.2, 3.0], [0.1, 0.5, 1.0])
    assert got == pytest.approx([2.1, 2.1, 3.0])
    got = sbp.at_nominal([0.2, 0.5, 1.0], [1.0, 2.0, 4.0], [0.1, 0.35, 1.0])
    assert got == pytest.approx([1.0, 1.5, 4.0])
    overhead, lin = sbp.fit_linear([100, 200, 300], [1.1, 2.1, 3.1])
    assert overhead == pytest.approx(0.1) and lin == pytest.approx([1.0, 2.0, 3.0])
    assert sbp.fit_linear([100, 200], [1.0, 3.0])[0] == 0.0  # negative intercept clamped
    assert sbp.default_lengths(2048, 64) == (16, 64, 128, 256, 512, 1024, 2048)
    assert sbp.default_lengths(3000, 128) == (15, 125, 250, 500, 1000, 1500, 3000)


# What a profile's fingerprint says about the machine, not about the config it describes.
_ENVIRONMENT_KEYS = {"device_type", "device_name", "torch", "triton", "cpu_threads"}


@pytest.mark.parametrize(
    "profile", sorted((REPO / "profiles").glob("*.json")), ids=lambda p: p.name
)
def test_every_shipped_profile_matches_the_config_it_is_named_for(profile):
    """profiles/NAME.json describes train_configs/NAME.toml: debug_cpu.json had been
    measured from e2e_cpu.toml (row length, dense layers) and mispredicted by 76%."""
    config_path = REPO / "train_configs" / f"{profile.stem}.toml"
    assert config_path.is_file(), f"{profile} has no train_configs/{profile.stem}.toml"
    config = load_config(config_path)
    expected = sbp.current_fingerprint(config, _model(config), device="cpu")
    # written before fingerprints named the family: read as Qwen2.5's, as the loader does
    have = with_legacy_defaults(json.loads(profile.read_text())["fingerprint"], expected)
    diffs = {
        k: (have.get(k), v)
        for k, v in expected.items()
        if k not in _ENVIRONMENT_KEYS and have.get(k) != v
    }
    assert not diffs, f"{profile}: (profile, config) differ: {diffs}"
