"""End-to-end training with real torchrun processes on CPU (gloo).

All runs start from one seed checkpoint, so runs with different parallel layouts
(1 process, FSDP, PP) start from the same weights and can be compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DEBUG_TOML, fixture_env, from_seed, losses, sample_log, scalars, torchrun

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def single(seed_ckpt, tmp_path_factory) -> list[float]:
    dump = tmp_path_factory.mktemp("single")
    torchrun(1, from_seed(seed_ckpt, 5), dump)
    return losses(dump)


def test_single_process_loss_decreases(single):
    assert len(single) == 5
    assert single[-1] < single[0] - 0.1, single


def test_fsdp_two_processes_loss_decreases(seed_ckpt, tmp_path):
    torchrun(2, from_seed(seed_ckpt, 5), tmp_path)
    loss = losses(tmp_path)
    assert len(loss) == 5 and loss[-1] < loss[0] - 0.1, loss


PP_1F1B = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
]


@pytest.fixture(scope="module")
def pp_plain(seed_ckpt, tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("pp_plain")
    torchrun(2, [*from_seed(seed_ckpt, 5), *PP_1F1B], dump)
    return dump


def test_pp_1f1b_matches_single_process_first_step(pp_plain, single):
    # Same rows as the single-process run (2 rows = 2 micro-batches of 1 row), same weights.
    loss = losses(pp_plain)
    assert len(loss) == 5 and loss[-1] < loss[0] - 0.1, loss
    assert abs(loss[0] - single[0]) < 1e-4, (loss[0], single[0])


def test_pp_1f1b_chunked_loss_matches_plain_loss(seed_ckpt, pp_plain, tmp_path):
    """ChunkedLossWrapper under 1F1B: the last stage returns hidden states, the schedule
    calls the wrapper (head + loss per chunk, head backward inside it) and runs backward
    through the stage. Losses and gradient norms of 5 steps equal the plain loss's, so
    the gradients that moved the weights were the same."""
    config = tmp_path / "chunked.toml"
    config.write_text(DEBUG_TOML.read_text() + "\n[loss]\nnum_chunks = 4\n")
    torchrun(2, [*from_seed(seed_ckpt, 5), *PP_1F1B], tmp_path, config=config)
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        plain, chunked = scalars(pp_plain, tag), scalars(tmp_path, tag)
        assert sorted(plain) == sorted(chunked) == [1, 2, 3, 4, 5]
        for step in plain:
            assert abs(chunked[step] - plain[step]) <= 1e-5 * abs(plain[step]), (tag, step)


@pytest.mark.parametrize(
    "recipe",
    [
        [],
        # SAB + DST with density observations feeding the planner and the density model,
        # and the cost-model refit on a deterministic clock (wall-clock times differ
        # between any two runs): what resume must restore includes the refit model and
        # the lagged snapshots that plan the steps after the checkpoint.
        [
            "--sab.policy",
            "sab",
            "--dst.enabled",
            "--cost_model.analytic_device",
            "cpu",
            "--sab.observe_lag",
            "4",
        ],
    ],
    ids=["baseline", "sab_dst_refit"],
)
def test_resume_gives_same_losses_and_samples(seed_ckpt, tmp_path, recipe):
    # LR constant after warm-up (min_lr_factor 1), so a 3-step run schedules like a 6-step one.
    common = [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.initial_load_path",
        str(seed_ckpt),
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.min_lr_factor",
        "1.0",
        "--dataloader.sample_log",
        *recipe,
    ]
    env = fixture_env("deterministic_clock")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun(1, [*common, "--training.steps", "6"], straight, env=env)
    torchrun(1, [*common, "--training.steps", "3"], resumed, env=env)
    torchrun(1, [*common, "--training.steps", "6"], resumed, env=env)
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, (a, b)
    assert sample_log(straight) == sample_log(resumed)
    if recipe:  # steps 4-6 were planned by refit snapshots, two of them from the checkpoint
        snapshots = [e["cost_model_snapshot"] for e in sample_log(straight)]
        assert [s.split(":")[0] for s in snapshots] == ["-1", "-1", "0", "1", "2", "3"]
        assert len(set(snapshots[3:])) == 3, snapshots
