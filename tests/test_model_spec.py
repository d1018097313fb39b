"""The model a config describes is the model built, whatever the launcher: the model
spec is derived from the final config where the trainer is built, never kept on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import DEBUG_TOML, REPO, cpu_env, losses

from sb_titan.config.toml import load_config
from sb_titan.models.registry import derive_model_spec
from sb_titan.runtime.trainer import run_model_spec

# debug4 as its flavor-table row says (models/qwen2_5/flavors.py), written out here.
DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 256, 4, 4, 2, 64, 512, 1024


def _qwen2_params(layers: int) -> int:
    """Parameters of an untied Qwen2 decoder: q/k/v with biases, o, SwiGLU, two norms a
    layer; embedding, final norm and head."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attention = (DIM * q + q) + 2 * (DIM * kv + kv) + q * DIM
    layer = attention + 3 * DIM * HIDDEN + 2 * DIM
    return layers * layer + 2 * VOCAB * DIM + DIM


@pytest.mark.torchrun
def test_torchtitan_launcher_builds_and_prices_the_overridden_model(tmp_path):
    """`torchtitan.train` with the recipe's registry and `--model.flavor debug4
    --sparse_attention.block_size 128`: the model built has debug4's 4 layers and
    128-token attention blocks, the cost model prices that model, and it trains. The
    shims are installed by the registry, whatever TorchTitan imported first."""
    out = tmp_path / "built.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += [str(REPO / "tests" / "native_launch_probe.py")]
    cmd += ["--module", "sb_titan.models.qwen2_5", "--config", "sb_titan_debug"]
    cmd += ["--model.flavor", "debug4", "--sparse_attention.block_size", "128"]
    cmd += ["--cost_model.analytic_device", "cpu", "--training.seq_len", "512"]
    cmd += ["--training.steps", "2", "--dump_folder", str(tmp_path / "dump")]
    env = cpu_env(PROBE_OUT=str(out), PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = json.loads(out.read_text())
    assert built["layers"] == LAYERS
    assert built["params"] == _qwen2_params(LAYERS)
    assert built["block_sizes"] == [128]
    assert built["priced"] == {
        "hidden": DIM,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate": HIDDEN,
        "layers": LAYERS,
        "block_size": 128,
    }
    assert built["priced_block_size"] == 128
    assert not built["spec_left_on_config"]  # derived state stays with the trainer
    # the build installed the CPU shim (compat/device.py) in TorchTitan's own launcher;
    # importing sb_titan alone leaves "cuda" (test_launch.py)
    assert built["device_type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert len(losses(tmp_path / "dump")) == 2


def test_a_spec_set_on_the_config_is_refused():
    """A registry that sets config.model_spec (TorchTitan's habit) would be overridden
    by [model] or would override it: neither silently."""
    config = load_config(DEBUG_TOML, ["--model.flavor", "debug4"])
    assert config.model_spec is None  # the TOML path stores no spec
    assert len(run_model_spec(config).model.layers) == LAYERS
    config.model_spec = derive_model_spec(load_config(DEBUG_TOML))
    with pytest.raises(ValueError, match=r"model_spec is derived from \[model\]"):
        run_model_spec(config)
