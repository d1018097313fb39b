"""One rule for how a config cuts a step, shared by the trainer, sb-plan and sb-simulate."""

from __future__ import annotations

import argparse

import pytest
from conftest import REPO

from sb_titan.balance.step_shape import StepShape, step_shape
from sb_titan.config.toml import load_config

E2E = REPO / "train_configs" / "e2e_cpu.toml"
DEBUG = REPO / "train_configs" / "debug_cpu.toml"


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        # TorchTitan: grad_accum = global // (local x dp); under PP, local // mb_size more.
        ([], 2, StepShape(seq_len=1024, dp=2, microbatches=1, rows=2)),
        (["--training.global_batch_size", "12"], 2, StepShape(1024, 2, 3, 2)),
        (
            ["--parallelism.pipeline_parallel_degree", "2"]
            + ["--parallelism.pipeline_parallel_microbatch_size", "1"],
            4,
            StepShape(1024, 2, 2, 1),
        ),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
            + ["--parallelism.pipeline_parallel_microbatch_size", "2"]
            + ["--training.global_batch_size", "16"],
            4,
            StepShape(1024, 2, 4, 2),
        ),
    ],
)
def test_step_shape_is_torchtitans_rule(overrides, world, expected):
    assert step_shape(load_config(DEBUG, overrides), world) == expected


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["--training.global_batch_size", "5"], 2, "training.global_batch_size (5)"),
        ([], 3, None),  # dp = 3 is fine without PP
        (["--parallelism.pipeline_parallel_degree", "2"], 3, "world size 3"),
    ],
)
def test_step_shape_refuses_what_does_not_divide(overrides, world, needle):
    config = load_config(DEBUG, overrides)
    if needle is None:
        assert step_shape(config, world).dp == 3
        return
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        step_shape(config, world)


def test_sb_plan_with_a_config_plans_the_trainers_step(capsys):
    """Crashed with AttributeError (`SBTrainer._configure_loader`) before."""
    from sb_titan.tools.plan import main

    argv = ["--data", "synthetic", "--docs", "2000", "--config", str(E2E)]
    assert main(argv + ["--world-size", "2", "--steps", "2", "--policy", "tokens"]) == 0
    out = capsys.readouterr().out
    assert "seq_len=4096 dp=2 microbatches=2 rows=1" in out
    assert main(argv + ["--world-size", "3"]) == 2
    assert "global_batch_size (4)" in capsys.readouterr().err


def test_sb_simulate_with_a_config_counts_gradient_accumulation():
    """e2e_cpu.toml at DP=2 runs 2 micro-batches per rank (global 4 = 2 ranks x 1 row
    x 2 accumulation steps); the simulator replayed 8."""
    from sb_titan.tools.simulate import _parser, _resolve

    args: argparse.Namespace = _parser().parse_args(["--config", str(E2E), "--dp", "2"])
    cluster, _ = _resolve(args)
    assert (cluster.dp, cluster.pp, cluster.microbatches, cluster.rows) == (2, 1, 2, 1)
    args = _parser().parse_args(["--config", str(E2E), "--dp", "1"])
    assert _resolve(args)[0].microbatches == 4


CP2 = ["--parallelism.context_parallel_degree", "2"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["--training.seq_len", "1000"],
            "training.seq_len (1000) must be a multiple of 2 x context_parallel_degree",
        ),
        (["--parallelism.context_parallel_load_balancer", "ptrr"], "'ptrr': under context"),
        (["--sparse_attention.backend", "flex"], "'flex' does not run under context"),
        (["--parallelism.tensor_parallel_degree", "2"], "with tensor parallelism"),
    ],
)
def test_context_parallel_refuses_what_it_cannot_run(overrides, needle):
    """One line naming the key, before any rank spawns (preflight calls step_shape)."""
    config = load_config(DEBUG, [*CP2, *overrides])
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        step_shape(config, 4)


def test_context_parallel_divides_the_world_like_torchtitan():
    assert step_shape(load_config(DEBUG, CP2), 4) == StepShape(1024, 2, 1, 2)
