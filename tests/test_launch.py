"""run_train.sh for real: the default CPU run, and a 2-node job on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, cpu_env, losses, scalars, torchrun

pytestmark = pytest.mark.torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_run(tmp_path):
    """`./run_train.sh` with its defaults (2 processes, debug_cpu.toml) but for the
    number of steps (6 of its 40: the later steps take the same code path): loss goes
    down and TensorBoard holds the loss and the recipe's sparsity scalars."""
    proc = subprocess.run(
        ["./run_train.sh", "--dump_folder", str(tmp_path), "--training.steps", "6"],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loss = losses(tmp_path)
    assert len(loss) == 6
    first, last = sum(loss[:3]) / 3, sum(loss[-3:]) / 3
    assert last < first - 0.3, loss  # 6.84 -> 6.43 when last measured
    density = scalars(tmp_path, "sparsity/density")
    assert density and all(0 < d <= 1 for d in density.values())
    # true recall of the sampled queries and top-key hits, logged beside estimated recall
    for tag in ("sparsity/true_recall", "sparsity/top_key_hit"):
        got = scalars(tmp_path, tag)
        assert got.keys() == density.keys() and all(0 < v <= 1 for v in got.values()), tag
    # The console: every step line carries the recipe's signals and, on CPU, neither
    # memory (CUDA allocator statistics) nor MFU; TorchTitan's harmless messages are gone.
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "step: " in line and "loss: " in line]
    assert len(lines) == len(loss), lines[:3]
    fields = ("imbalance: ", "bubble: ", "budget: ", "density: ", "true recall: ", "top-key hit: ")
    for field in fields:
        assert all(field in line for line in lines), field
    if not torch.cuda.is_available():
        assert not [line for line in lines if "memory" in line or "mfu" in line]
        assert "Peak flops undefined" not in out and "CPU memory usage" not in out
    assert "initial_load_model_only=True has no effect" not in out
    assert scalars(tmp_path, "balance/rank_imbalance")  # the same values in TensorBoard


def test_two_nodes_on_loopback(tmp_path):
    """Two run_train.sh invocations (NNODES=2, NODE_RANK=0/1, one process each) form one
    2-rank job (FSDP across the 'nodes') that trains exactly as one node's 2 ranks do.
    Node 0 forks its rank from the launcher's preloaded server (the CPU default), node 1
    starts a fresh interpreter (SB_FORK_RANKS=0, what a GPU node does): torchrun's agent
    logs which entry point it started."""
    port = str(_free_port())
    env = dict(NNODES="2", NGPU="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOGLEVEL="INFO")
    steps = ["--training.steps", "4"]
    args = ["./run_train.sh", "--dump_folder", str(tmp_path / "nodes"), *TINY, *steps]
    nodes = [
        subprocess.Popen(
            args,
            cwd=REPO,
            env=cpu_env(NODE_RANK=str(rank), SB_FORK_RANKS=str(1 - rank), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=400)[0] for node in nodes]
    for node, out in zip(nodes, outs, strict=True):
        assert node.returncode == 0, out[-4000:]
    assert "dp_shard=2" in outs[0]  # one job, data parallel over both nodes
    assert "starting workers for entrypoint: run_script_path" in outs[0]  # forked
    assert "starting workers for entrypoint: python" in outs[1]  # a fresh interpreter
    loss = losses(tmp_path / "nodes")
    assert len(loss) == 4 and loss[-1] < loss[0], loss
    torchrun(2, steps, tmp_path / "one_node")
    assert loss == losses(tmp_path / "one_node")


def test_importing_sb_titan_has_no_side_effects():
    code = (
        "import sb_titan, sb_titan.models.qwen2_5, sb_titan.data.loader, sb_titan.runtime.trainer;"
        "import torchtitan.tools.utils as u;"
        "print(u.device_type)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda"]  # TorchTitan's own default on a CPU host, untouched
