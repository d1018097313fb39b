"""TOML configs: precedence CLI > TOML > defaults, and clear errors for bad input."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DEBUG_TOML, REPO, forked_train_cli, prelaunch_refused

from sb_titan.config.toml import ConfigError, check_training_backend, load_config
from sb_titan.models.registry import derive_model_spec


def _write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 7\nseq_len = 256\n")
    config = load_config(path, ["--training.steps", "9"])
    assert config.training.steps == 9  # CLI wins
    assert config.training.seq_len == 256  # TOML wins over the default
    assert config.training.local_batch_size == 2  # default


@pytest.mark.parametrize("flag", ["--config", "--config_file", "--job.config_file"])
def test_sb_train_takes_config_like_the_other_tools(tmp_path, flag):
    """`sb-train --config X.toml` as sb-export / sb-plan / sb-profile take it; TorchTitan's
    `--config_file` (run_train.sh's) stays accepted, with a space or `=`."""
    from sb_titan.tools.train import parse

    path = _write(tmp_path, "[training]\nsteps = 7\n")
    for argv in ([flag, str(path)], [f"{flag}={path}"]):
        config = parse([*argv, "--training.seq_len", "256"])
        assert (config.training.steps, config.training.seq_len) == (7, 256), argv


def test_shipped_configs_load():
    shipped = sorted((REPO / "train_configs").glob("*.toml"))
    assert len(shipped) >= 6
    for path in shipped:
        config = load_config(path)
        assert config.model_spec is None, path  # derived where the model is built
        family = derive_model_spec(config).name
        # a config is named after the family it builds; the CPU ones build Qwen2.5
        prefix = {"qwen2_5": "", "qwen3": "qwen3_", "llama3": "llama3_"}[family]
        assert path.name.startswith(prefix), (path, family)
        assert family == "qwen2_5" or not path.name.startswith("qwen2.5_"), path


def test_recipe_sections_and_model_rebuild(tmp_path):
    path = _write(
        tmp_path,
        "[model]\nflavor = '0.5b'\n[sparse_attention]\npolicy = 'topk'\ndense_layers = [0, -1]\n",
    )
    spec = derive_model_spec(load_config(path))
    layers = spec.model.layers
    assert len(layers) == 24 and spec.model.enable_weight_tying
    sparse = [layer.attention.inner_attention.sparse for layer in layers]
    assert sparse[0] is False and sparse[-1] is False and all(sparse[1:-1])
    assert layers[1].attention.inner_attention.policy == "topk"


def test_param_groups_array_of_tables(tmp_path):
    path = _write(
        tmp_path,
        "[[optimizer.param_groups]]\npattern = '.*'\noptimizer_name = 'AdamW'\n"
        "optimizer_kwargs = { lr = 1e-3 }\n",
    )
    (group,) = load_config(path).optimizer.param_groups
    assert group.optimizer_kwargs == {"lr": 1e-3}


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("[training]\nstepz = 3\n", ["unknown key 'training.stepz'"]),
        ("[training]\nsteps = 'many'\n", ["'training.steps'", "expected int"]),
        ("[model]\nflavor = '13b'\n", ["model.flavor", "'13b'", "0.5b"]),
        ("[sparse_attention]\npolicy = 'random'\n", ["sparse_attention.policy", "'random'"]),
        ("[sab]\npolicy = 'magic'\n", ["'sab.policy' = 'magic', expected one of 'sab', 'tok"]),
        ("[dst]\nanchor = 'p99'\n", ["'dst.anchor' = 'p99', expected one of 'min', 'mean'"]),
        ("[cost_model]\nanalytic_device = 'a100'\n", ["one of 'h100', 'h200', 'cpu'"]),
        ("[training\nsteps = 3\n", ["invalid TOML"]),
    ],
)
def test_bad_input_names_file_and_key(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config(REPO / "nope.toml")


def test_cli_reports_one_clear_line_and_exit_code_2(tmp_path):
    """Through the real entry point (what run_train.sh calls before torchrun)."""
    path = _write(tmp_path, "[training]\nstepz = 3\n")
    proc = forked_train_cli(["--check-config", "--config_file", str(path)])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{path}: unknown key 'training.stepz'" in proc.stderr


def test_a_run_that_trains_nothing_is_refused_before_launch(tmp_path, capsys):
    """steps <= 0 spawned every rank, trained nothing and exited 0. The launcher's check
    refuses it (run_train.sh's refusal path: test_preflight.py's cluster-config launch)."""
    for steps in ("0", "-3"):
        line = prelaunch_refused(capsys, tmp_path, "--training.steps", steps)
        assert f"'training.steps' = {steps}, expected >= 1" in line
        assert not any(tmp_path.iterdir())


def test_flex_backend_loads_and_is_checked_for_training(tmp_path):
    """`backend = 'flex'` is a valid key; training with it needs CUDA (no CPU backward),
    forward-only uses of the config (eval) are left alone."""
    path = _write(tmp_path, "[sparse_attention]\nbackend = 'flex'\n")
    config = load_config(path)
    layers = derive_model_spec(config).model.layers
    assert layers[1].attention.inner_attention.backend == "flex"
    check_training_backend(config, path, "cuda")
    with pytest.raises(ConfigError) as err:
        check_training_backend(config, path, "cpu")
    message = str(err.value)
    assert str(path) in message and "'sparse_attention.backend' = 'flex'" in message
    assert "no cpu backward" in message
    config.sparse_attention.enabled = False  # every layer dense: Flex is never called
    check_training_backend(config, path, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only hosts")
def test_flex_training_on_cpu_is_refused_before_launch(tmp_path, capsys):
    """One line naming the key, exit 2, before torchrun spawns a rank."""
    line = prelaunch_refused(capsys, tmp_path, "--sparse_attention.backend", "flex")
    assert "'sparse_attention.backend' = 'flex' trains on CUDA only" in line
    assert not any(tmp_path.iterdir())


def test_help_all_prints_usage_and_every_override():
    """--help-all prints the usage and every override, with the real choices of the
    recipe's named values (not "one of POLICIES" typed STR), and exits 0. Given as
    run_train.sh passes it on, after its own help (its `--help` branch, which is this
    one, is test_cli.py's), with the config file."""
    wide = {"COLUMNS": "200"}  # wide enough that no choice list wraps
    proc = forked_train_cli(["--config_file", str(DEBUG_TOML), "--help-all"], **wide)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: sb-train --config X.toml" in proc.stdout
    assert "--training.steps" in proc.stdout
    assert "error" not in proc.stderr
    # tyro's panel wraps a long choice list: read it as one line
    flat = re.sub(r",\s+", ",", re.sub(r"[│\s]+", " ", proc.stdout))
    for choices in (
        "--model.family {None,qwen2_5,qwen3,llama3}",
        "--model.flavor {debug,debug4,0.5b,1.5b,3b,7b,0.6b,1.7b,4b,8b,14b,32b,1b,70b,hf}",
        "--sab.policy {sab,tokens,sequential}",
        "--sab.long-docs {split,truncate,drop}",
        "--dst.anchor {min,mean,median,max,recall}",
        "--sparse-attention.policy {mass,topk}",
        "--sparse-attention.backend {auto,torch,triton,flex}",
        "--cost-model.analytic-device {None,h100,h200,cpu}",
    ):
        assert choices in flat, choices
    for unresolved in ("FLAVORS", "POLICIES", "ANCHORS", "BACKENDS"):
        assert unresolved not in proc.stdout
